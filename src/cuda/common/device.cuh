// Small device helpers shared by the CUDA backend's preparation kernels:
// 16-bit input loads (vectorized or scalar), warp/block reductions, and the
// compile-time dispatch over head dimension and input type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "sparge/sparge.h"

namespace sparge {
namespace cuda {

// ---------------------------------------------------------------- loads
// Eight consecutive 16-bit elements -> float. VEC: one 16-byte load (the
// caller checked the alignment); otherwise eight 2-byte loads.
template <bool VEC>
__device__ __forceinline__ uint4 load8_raw(const void* p) {
  if constexpr (VEC) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    uint4 r;
    r.x = uint32_t(__ldg(s + 0)) | (uint32_t(__ldg(s + 1)) << 16);
    r.y = uint32_t(__ldg(s + 2)) | (uint32_t(__ldg(s + 3)) << 16);
    r.z = uint32_t(__ldg(s + 4)) | (uint32_t(__ldg(s + 5)) << 16);
    r.w = uint32_t(__ldg(s + 6)) | (uint32_t(__ldg(s + 7)) << 16);
    return r;
  }
}

// Two 16-bit values packed in a word (low half first) -> float2.
template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                     __half2float(__ushort_as_half((unsigned short)(w >> 16))));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));  // exact
}

template <class T>
__device__ __forceinline__ void unpack8(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = unpack2<T>(w[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// ---------------------------------------------------------------- exact-ish float sums
// Error-free transformation (TwoSum): s + e tracks the running sum with about
// 48 significant bits at the cost of six float adds (cheaper than a float64
// conversion plus add on sm_90).
__device__ __forceinline__ void two_sum_acc(float& s, float& e, float x) {
  const float t = __fadd_rn(s, x);
  const float bp = __fsub_rn(t, s);
  const float err = __fadd_rn(__fsub_rn(s, __fsub_rn(t, bp)), __fsub_rn(x, bp));
  s = t;
  e = __fadd_rn(e, err);
}

// int8 code of x with inverse scale inv = 127 / a, |x| <= a, in the SEMANTICS
// order clamp(rint(x * inv), -127, 127): the product is rounded on its own (no
// contraction), then rounded to an integer with round-to-nearest-even by
// adding 1.5 * 2^23; the low byte of the sum's bits is the two's-complement
// code. No clamp is needed: |x * inv| <= 127 * (1 + 2^-24) rounds to at most
// 127 + 2^-17, whose rint is 127.
__device__ __forceinline__ uint32_t q8_word(float x, float inv) {
  return __float_as_uint(__fadd_rn(__fmul_rn(x, inv), 12582912.0f));
}
// Low bytes of four words -> one word (a in the lowest byte).
__device__ __forceinline__ uint32_t pack_low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// ---------------------------------------------------------------- reductions
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Reduction over the W consecutive lanes of a group (W a power of two <= 32).
template <int W, class T>
__device__ __forceinline__ T group_sum(T v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <int W>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions with a fixed order (deterministic). `red` is shared
// scratch of at least 32 elements; every thread gets the result.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T* red, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // protect `red` from a previous use
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
  for (int w = 1; w < nw; ++w) r = op(r, red[w]);
  return r;
}
struct OpSum {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct OpMax {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
};

// ---------------------------------------------------------------- dispatch
template <int N>
using IntC = std::integral_constant<int, N>;
template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(IntC<D>, TypeTag<T>) for the kernels' head dimensions (64, 128, 256)
// and 16-bit input types; returns false when the combination is not built.
template <class F>
inline bool dispatch_dim_type(int64_t D, sparge_dtype_t dt, F&& f) {
  const bool h = dt == SPARGE_DTYPE_FLOAT16, bf = dt == SPARGE_DTYPE_BFLOAT16;
  if (D == 64 && h) return f(IntC<64>{}, TypeTag<__half>{}), true;
  if (D == 64 && bf) return f(IntC<64>{}, TypeTag<__nv_bfloat16>{}), true;
  if (D == 128 && h) return f(IntC<128>{}, TypeTag<__half>{}), true;
  if (D == 128 && bf) return f(IntC<128>{}, TypeTag<__nv_bfloat16>{}), true;
  if (D == 256 && h) return f(IntC<256>{}, TypeTag<__half>{}), true;
  if (D == 256 && bf) return f(IntC<256>{}, TypeTag<__nv_bfloat16>{}), true;
  return false;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace cuda
}  // namespace sparge
