// Register-level math shared by the attention kernel families (sm_90a and
// portable) and the block scores: exponentials and logarithms, exact small int -> float, quad row maxima of int32
// accumulators, e4m3 packing. Nothing here depends on the architecture's
// matrix instructions; pack_e4m3x4 needs sm_89 or newer.
#pragma once
#include <cstdint>

namespace sparge {
namespace cuda {
namespace attn {

// ---------------------------------------------------------------- math
// 2^x on the special-function unit (flushes denormal results; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) on the special-function unit alone (flushes denormal inputs to 0, log2(0) = -inf;
// __log2f rescales them first).
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe (no MUFU): x = j + r with j = rint(x) by the 1.5*2^23
// trick and r in [-0.5, 0.5]; 2^r by a degree-3 polynomial (relative error
// <= 1.02e-4, fitted for relative error with the constant term fixed at 1);
// 2^j added to the exponent bits. x is clamped at -125 so the exponent field
// stays normal (results below 2^-125 are far below what e4m3 keeps). Eight
// full-rate instructions instead of one quarter-rate MUFU.EX2: the 8-bit
// kernel at D = 64, where the exponentials outweigh the matrix products,
// computes every 4th exponential this way so that the two consumer
// warpgroups queue less on the MUFU pipe of each sub-partition.
__device__ __forceinline__ float poly_exp2(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  x = fmaxf(x, -125.0f);
  const float f = __fadd_rn(x, kRound);
  const float r = __fsub_rn(x, __fsub_rn(f, kRound));
  float p = fmaf(0.05500897789403876f, r, 0.24221101953617863f);
  p = fmaf(p, r, 0.6932829207097604f);
  p = fmaf(p, r, 1.0f);
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(f) << 23));
}

// Exact int32 -> float for |x| < 2^22 with two full-rate ALU ops instead of a
// quarter-rate I2F: x + 1.5*2^23 (as integer bits) is the float 1.5*2^23 + x.
// An int8 dot product over D <= 256 is at most 127*127*256 < 2^22.
constexpr int32_t kIntToFloatMagicBits = 0x4B400000;
constexpr float kIntToFloatMagic = 12582912.0f;
// v[0] = op over v[0 .. N) by a balanced tree (depth ceil(log2 N) instead of
// a chain of N - 1 dependent operations; N and every index are constants after
// unrolling). For max (exactly associative and commutative on the values it
// keeps) the result is the chain's.
template <int N, int n = N, class T, class Op>
__device__ __forceinline__ T tree_reduce(T (&v)[N], Op op) {
  if constexpr (n == 1) {
    return v[0];
  } else {
    constexpr int h = (n + 1) / 2;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) v[i] = op(v[i], v[i + h]);
    return tree_reduce<N, h>(v, op);
  }
}

// Row maxima of one 64-key block of an s32 wgmma accumulator over the four
// threads of a quad: registers acc[off .. off + 32) of this thread, those with
// (j & 2) set in its second row. INT32_MIN (below any product sum) where every
// score of the block is masked. `off` is a constant after unrolling.
// (A chain here, not tree_reduce: the int8 kernels built with the tree ran
// 1-3 % slower at D = 128, PERF-NOTES v67.)
template <int NS>
__device__ __forceinline__ void quad_row_max_s32(const int32_t (&acc)[NS], int off, int32_t& im0, int32_t& im1) {
  im0 = INT32_MIN;
  im1 = INT32_MIN;
#pragma unroll
  for (int jj = 0; jj < 32; ++jj) {
    if (jj & 2) im1 = max(im1, acc[off + jj]);
    else im0 = max(im0, acc[off + jj]);
  }
  im0 = max(im0, __shfl_xor_sync(0xffffffffu, im0, 1));
  im0 = max(im0, __shfl_xor_sync(0xffffffffu, im0, 2));
  im1 = max(im1, __shfl_xor_sync(0xffffffffu, im1, 1));
  im1 = max(im1, __shfl_xor_sync(0xffffffffu, im1, 2));
}

__device__ __forceinline__ float small_int_to_float(int32_t x) {
  return __int_as_float(x + kIntToFloatMagicBits) - kIntToFloatMagic;
}

// ---------------------------------------------------------------- fp8
// Four floats -> four e4m3 bytes (RNE, saturating), x0 in the lowest byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

}  // namespace attn
}  // namespace cuda
}  // namespace sparge
