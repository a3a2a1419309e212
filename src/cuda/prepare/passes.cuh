// Shared by the preparation's translation units (prepare.cu: the Q, K and V
// passes; column_stats.cu: the K mean and V max|.|): the block size, the NaN
// policy's maxima, the load-width check and the one head-dim x dtype x load
// dispatch of every pass kernel.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {
namespace prep {

constexpr int kThreads = 256;

// First row of block `blk` of `rows` rows, in 64 bits: the block index is a
// uint32 taken from blockIdx.x, and blk * rows in 32 bits wraps for
// Lq >= 2^32 (query blocks of 128 rows), which the launch grids allow.
__host__ __device__ constexpr int64_t block_row0(uint32_t blk, int rows) { return int64_t(blk) * rows; }
static_assert(block_row0(0xFFFFFFFFu, kGpuBlockQ) == int64_t(0xFFFFFFFF) * 128, "block rows must not wrap");
static_assert(block_row0(uint32_t(1) << 25, kGpuBlockQ) == int64_t(1) << 32, "block rows must not wrap");

// NaN policy (docs/SEMANTICS.md, "Non-finite values"): the max |x| behind a
// quantization scale propagates NaN (fmaxf would drop it), and a maximum that
// is not finite (NaN, or +inf from an infinite element) gives the scale NaN,
// so every score or value dequantized with it is NaN. max.NaN returns the
// canonical NaN when either operand is NaN.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
struct OpMaxNaN {
  __device__ __forceinline__ float operator()(float a, float b) const { return max_nan(a, b); }
};
template <int W>
__device__ __forceinline__ float group_max_nan(float v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// A max |x| that is not finite becomes NaN (isfinite is false for NaN and inf).
__device__ __forceinline__ float finite_or_nan(float a) { return isfinite(a) ? a : __int_as_float(0x7fffffff); }

// 16-byte loads need a 16-byte aligned base and strides (of the dimensions
// that are actually indexed) that are multiples of 8 elements.
inline bool vec_ok(const Tensor4& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.shape[d] > 1 && t.stride[d] % 8 != 0) return false;
  return true;
}

// Calls f(IntC<D>, TypeTag<T>, integral_constant<bool, VEC>) for the problem's
// head dimension and dtype and the load width `vec` (16-byte loads or scalar):
// the one dispatch of every preparation pass kernel.
template <class F>
void dispatch_pass(const Problem& p, bool vec, F&& f) {
  dispatch_dim_type(p.Dk, p.dtype, [&](auto dc, auto tt) {
    if (vec)
      f(dc, tt, std::true_type{});
    else
      f(dc, tt, std::false_type{});
  });
}

}  // namespace prep
}  // namespace cuda
}  // namespace sparge
