// Preparation kernels: column statistics (K mean, V max|.|), the Q pass
// (pooled mean, self-similarity, per-token int8 quantization, LSE shift), the
// K pass (smoothing, pooled mean, self-similarity, per-64-key-block int8
// quantization) and the V pass (per-channel fp8 e4m3, transposed and
// token-permuted). Semantics: docs/SEMANTICS.md; pipeline: docs/PREDICTION.md.
//
// Statistics that feed the prediction (pooled means, self-similarities, the K
// mean) accumulate in float64 and are rounded to float32 once, as the CPU
// reference does, so both backends see the same pooled vectors. The int8/fp8
// quantization follows SEMANTICS.md's float32 operation order exactly.
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "core/error.hpp"
#include "core/kernel_traits.hpp"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/pooling.cuh"
#include "cuda/predict/predict.cuh"
#include "cuda/prepare/prepare.cuh"

namespace sparge {
namespace cuda {
namespace {

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

// ---------------------------------------------------------------- column statistics
struct ColArgs {
  Tensor4 k, v;
  int d_in;  // the tensors' head dim (columns at or past it read as zeros: the padding to the kernels' width D)
  int64_t Hkv, Lkv, nchunk, nKB;
  bool do_k, do_v;
  double* ksum;  // [B*Hkv, nchunk, D]
  float* vmax;   // [B*Hkv, nchunk, D]
  // Optional (predict without self-similarity forcing): raw pooled K means per
  // 64-key block [B*Hkv, nKB, D] (smoothed later by subtracting the mean) and
  // sim_k set to 0 (never below a threshold <= 0).
  float* kpool;
  float* ksim;
};

// One CTA per (b, hkv, chunk of kGpuColChunk keys): partial column sums of K
// and column max|V|, reduced in a fixed order. Each iteration of the main loop
// covers one 64-key block (chunks start at block boundaries).
template <int D, class T, bool VEC>
__global__ void __launch_bounds__(kThreads, 3) col_partial_kernel(const ColArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  constexpr int TPR = D / 8, RPI = kThreads / TPR, U = kGpuBlockK / RPI, NW = kThreads / 32;
  static_assert(kGpuColChunk % kGpuBlockK == 0, "chunks must start at key-block boundaries");
  __shared__ float spool[NW][D];
  const uint32_t chunk = blockIdx.x % uint32_t(a.nchunk), bhk = blockIdx.x / uint32_t(a.nchunk);
  const uint32_t b = bhk / uint32_t(a.Hkv), hk = bhk % uint32_t(a.Hkv);
  const int tid = threadIdx.x, lr = tid / TPR, cg = tid % TPR, lane = tid & 31, warp = tid >> 5;
  const int64_t r0 = int64_t(chunk) * kGpuColChunk;
  const int64_t r1 = min(a.Lkv, r0 + int64_t(kGpuColChunk));
  const T* kp = static_cast<const T*>(a.k.data);
  const T* vp = static_cast<const T*>(a.v.data);

  float ks[8], ke[8], vm[8];  // K column sums as TwoSum pairs, V column max|.|
#pragma unroll
  for (int c = 0; c < 8; ++c) ks[c] = 0.f, ke[c] = 0.f, vm[c] = 0.f;

  for (int64_t base = r0; base < r1; base += kGpuBlockK) {  // uniform trip count
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t rr = base + lr + int64_t(u) * RPI;
      kr[u] = make_uint4(0, 0, 0, 0);
      vr[u] = make_uint4(0, 0, 0, 0);
      if (rr < r1) {
        if (a.do_k && cg * 8 < a.d_in) kr[u] = load8_raw<VEC>(kp + a.k.offset(b, hk, rr, cg * 8));
        if (a.do_v && cg * 8 < a.d_in) vr[u] = load8_raw<VEC>(vp + a.v.offset(b, hk, rr, cg * 8));
      }
    }
    float bs[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) bs[c] = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float f[8];
      if (a.do_k) {  // rows past r1 loaded as zeros: they add nothing
        unpack8<T>(kr[u], f);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          two_sum_acc(ks[c], ke[c], f[c]);
          bs[c] += f[c];
        }
      }
      if (a.do_v) {
        unpack8<T>(vr[u], f);
#pragma unroll
        for (int c = 0; c < 8; ++c) vm[c] = max_nan(vm[c], fabsf(f[c]));
      }
    }
    if (a.kpool) {  // raw pooled mean of this key block (uniform branch)
#pragma unroll
      for (int o = TPR; o < 32; o <<= 1)
#pragma unroll
        for (int c = 0; c < 8; ++c) bs[c] += __shfl_xor_sync(0xffffffffu, bs[c], o);
      if (lane < TPR) {
#pragma unroll
        for (int c = 0; c < 8; ++c) spool[warp][cg * 8 + c] = bs[c];
      }
      __syncthreads();
      const int64_t kb = base / kGpuBlockK;
      if (tid < D) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) sum += spool[w][tid];
        const int n = int(min(int64_t(kGpuBlockK), a.Lkv - base));
        a.kpool[(int64_t(bhk) * a.nKB + kb) * D + tid] = sum / float(n);
      }
      if (tid == 0) a.ksim[int64_t(bhk) * a.nKB + kb] = 0.f;
      __syncthreads();
    }
  }
  // lanes with the same column group: xor over the row bits of the lane id
  double kd[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) kd[c] = double(ks[c]) + double(ke[c]);
#pragma unroll
  for (int o = TPR; o < 32; o <<= 1) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      kd[c] += __shfl_xor_sync(0xffffffffu, kd[c], o);
      vm[c] = max_nan(vm[c], __shfl_xor_sync(0xffffffffu, vm[c], o));
    }
  }
  __shared__ double sk[NW][D];
  __shared__ float sv[NW][D];
  if (lane < TPR) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      sk[warp][cg * 8 + c] = kd[c];
      sv[warp][cg * 8 + c] = vm[c];
    }
  }
  __syncthreads();
  if (tid < D) {
    double s = 0.0;
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      s += sk[w][tid];
      m = max_nan(m, sv[w][tid]);
    }
    const int64_t o = (bhk * a.nchunk + chunk) * D + tid;
    if (a.do_k) a.ksum[o] = s;
    if (a.do_v) a.vmax[o] = m;
  }
}

// One CTA of 256 threads per (b, hkv): k_mean = float(sum / Lkv) (zeros
// without smoothing), v_amax = max over the chunks. Thread t sums column
// t % D over the chunks of its group t / D (loads batched), the groups are
// then combined in a fixed order.
constexpr int kFinThreads = 256;
__global__ void __launch_bounds__(kFinThreads) col_finalize_kernel(const double* __restrict__ ksum,
                                                                   const float* __restrict__ vmax, int64_t nchunk,
                                                                   int64_t Lkv, int D, bool do_k, bool do_v,
                                                                   float* __restrict__ k_mean,
                                                                   float* __restrict__ v_amax) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  __shared__ double ssum[kFinThreads];
  __shared__ float smax[kFinThreads];
  const int64_t bhk = blockIdx.x;
  const int tid = threadIdx.x, c = tid % D, grp = tid / D, ngrp = kFinThreads / D;
  const int64_t per = (nchunk + ngrp - 1) / ngrp;
  const int64_t ch0 = min(nchunk, grp * per), ch1 = min(nchunk, ch0 + per);
  const int64_t base = bhk * nchunk * D + c;
  double s = 0.0;
  float m = 0.f;
  for (int64_t ch = ch0; ch < ch1; ch += 8) {
    double kv[8];
    float vv[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const bool in = ch + u < ch1;
      kv[u] = (do_k && in) ? ksum[base + (ch + u) * D] : 0.0;
      vv[u] = (do_v && in) ? vmax[base + (ch + u) * D] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      s += kv[u];
      m = max_nan(m, vv[u]);
    }
  }
  ssum[tid] = s;
  smax[tid] = m;
  __syncthreads();
  if (tid < D) {
    for (int g = 1; g < ngrp; ++g) {
      s += ssum[g * D + tid];
      m = max_nan(m, smax[g * D + tid]);
    }
    k_mean[bhk * D + tid] = do_k ? float(s / double(Lkv)) : 0.f;
    if (do_v) v_amax[bhk * D + tid] = finite_or_nan(m);  // NaN: the channel dequantizes to NaN
  }
}

// pooled_k[bhk, kb, :] -= k_mean[bhk, :] (raw pooled means -> smoothed ones).
__global__ void pooled_sub_mean_kernel(float4* __restrict__ pooled, const float4* __restrict__ mean, int64_t nKB,
                                       int D4, int64_t total4) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total4; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c4 = i % D4, bhk = i / (D4 * nKB);
    float4 v = pooled[i];
    const float4 m = mean[bhk * D4 + c4];
    v.x -= m.x, v.y -= m.y, v.z -= m.z, v.w -= m.w;
    pooled[i] = v;
  }
}

// int8 codes of 8 values with the block/token max |x| = a (a == 0, or a NaN
// scale: zeros).
__device__ __forceinline__ uint2 quant8(const float (&x)[8], float a) {
  uint2 o = make_uint2(0, 0);
  if (a > 0.f) {  // false for NaN
    const float inv = 127.f / a;
    o.x = pack_low_bytes(q8_word(x[0], inv), q8_word(x[1], inv), q8_word(x[2], inv), q8_word(x[3], inv));
    o.y = pack_low_bytes(q8_word(x[4], inv), q8_word(x[5], inv), q8_word(x[6], inv), q8_word(x[7], inv));
  }
  return o;
}

// Eight consecutive floats (two 16-byte loads; p 16-byte aligned).
__device__ __forceinline__ void load_f8(const float* p, float (&x)[8]) {
  const float4* p4 = reinterpret_cast<const float4*>(p);
  const float4 a = p4[0], b = p4[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
  x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// A thread's share of a block of rows of one (b, h): rows row0 + it*RPI + lr,
// elements cg*8 .. cg*8+7; rows at or past `rows` and columns at or past
// `d_in` (the padding of a head dim to the kernels' width) read as zeros.
template <int ITER, int RPI, class T, bool VEC>
__device__ __forceinline__ void load_rows8(const Tensor4& t, uint32_t b, uint32_t h, int64_t row0, int lr, int cg,
                                           int64_t rows, int d_in, uint4 (&raw)[ITER]) {
  const T* base = static_cast<const T*>(t.data);
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    const int64_t row = row0 + it * RPI + lr;
    raw[it] = (row < rows && cg * 8 < d_in) ? load8_raw<VEC>(base + t.offset(b, h, row, cg * 8)) : make_uint4(0, 0, 0, 0);
  }
}

// ---------------------------------------------------------------- Q pass
struct QArgs {
  Tensor4 q;
  int d_in;  // the tensor's head dim (see ColArgs)
  int64_t Hq, Hkv, group, Lq, nQB;
  float scale;
  bool smooth, quant;
  bool pool;            // pooled mean and self-similarity (for the mask prediction)
  bool lse_shift;       // q_mu (only the LSE output reads it)
  const float* k_mean;  // [B*Hkv, D]
  float* pooled_q;      // [B*Hq, nQB, D]
  float* sim_q;         // [B*Hq, nQB]
  int8_t* q_i8;         // [B*Hq, nQB*128, D]
  float* q_scale;       // [B*Hq, nQB*128]
  float* q_mu;          // [B*Hq, nQB*128]
};

// One CTA per (b, h, 128-row query block).
template <int D, class T, bool VEC>
__global__ void __launch_bounds__(kThreads, 3) q_pass_kernel(const QArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  constexpr int TPR = D / 8, RPI = kThreads / TPR, ITER = kGpuBlockQ / RPI, NW = kThreads / 32;
  __shared__ float red[2 * NW * D + 32];
  const uint32_t qb = blockIdx.x % uint32_t(a.nQB), bh = blockIdx.x / uint32_t(a.nQB);
  const uint32_t b = bh / uint32_t(a.Hq), h = bh % uint32_t(a.Hq), bhk = b * uint32_t(a.Hkv) + h / uint32_t(a.group);
  const int tid = threadIdx.x, lr = tid / TPR, cg = tid % TPR;
  const int64_t row0 = block_row0(qb, kGpuBlockQ);

  uint4 raw[ITER];
  load_rows8<ITER, RPI, T, VEC>(a.q, b, h, row0, lr, cg, a.Lq, a.d_in, raw);
  float mu[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) mu[c] = 0.f;
  const bool shift = a.quant && a.lse_shift;
  if (shift && a.smooth) load_f8(a.k_mean + bhk * D + cg * 8, mu);

  float ps[8], us[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) ps[c] = 0.f, us[c] = 0.f;
  const int64_t lq_pad = a.nQB * kGpuBlockQ;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    const int64_t row = row0 + it * RPI + lr;
    float x[8];
    unpack8<T>(raw[it], x);  // rows past Lq are zeros
    if (a.pool) pool_row<TPR>(x, ps, us);
    if (a.quant) {
      float am = 0.f;
#pragma unroll
      for (int c = 0; c < 8; ++c) am = max_nan(am, fabsf(x[c]));
      am = finite_or_nan(group_max_nan<TPR>(am));
      const int64_t prow = bh * lq_pad + row;
      *reinterpret_cast<uint2*>(a.q_i8 + prow * D + cg * 8) = quant8(x, am);
      if (cg == 0) a.q_scale[prow] = am / 127.f;
      if (shift) {
        double dm = 0.0;  // q . mu in float64 (the LSE shift), as the CPU reference
#pragma unroll
        for (int c = 0; c < 8; ++c) dm += double(x[c]) * double(mu[c]);
        dm = group_sum<TPR>(dm);
        if (cg == 0) a.q_mu[prow] = row < a.Lq ? float(double(a.scale) * dm) : 0.f;
      }
    }
  }
  if (!a.pool) return;
  const int n = int(min(int64_t(kGpuBlockQ), a.Lq - row0));
  const int64_t blk = bh * a.nQB + qb;
  block_pool_finish<D, TPR, kThreads>(ps, us, n, red, a.pooled_q + blk * D, a.sim_q + blk);
}

// ---------------------------------------------------------------- K pass
struct KArgs {
  Tensor4 k;
  int d_in;  // the tensor's head dim (see ColArgs)
  int64_t Hkv, Lkv, nKB;
  bool smooth, quant;
  bool pool;            // pooled mean and self-similarity (for the mask prediction)
  const float* k_mean;  // [B*Hkv, D]
  float* pooled_k;      // [B*Hkv, nKB, D]
  float* sim_k;         // [B*Hkv, nKB]
  int8_t* k_i8;         // [B*Hkv, nKB*64, D]
  float* k_scale;       // [B*Hkv, nKB]
};

// One CTA per (b, hkv, 64-key block).
template <int D, class T, bool VEC>
__global__ void __launch_bounds__(kThreads, 4) k_pass_kernel(const KArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  constexpr int TPR = D / 8, RPI = kThreads / TPR, ITER = kGpuBlockK / RPI, NW = kThreads / 32;
  __shared__ float red[2 * NW * D + 32];
  __shared__ float fred[32];
  const uint32_t kb = blockIdx.x % uint32_t(a.nKB), bhk = blockIdx.x / uint32_t(a.nKB);
  const uint32_t b = bhk / uint32_t(a.Hkv), hk = bhk % uint32_t(a.Hkv);
  const int tid = threadIdx.x, lr = tid / TPR, cg = tid % TPR;
  const int64_t row0 = block_row0(kb, kGpuBlockK);

  uint4 raw[ITER];
  load_rows8<ITER, RPI, T, VEC>(a.k, b, hk, row0, lr, cg, a.Lkv, a.d_in, raw);
  float mu[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) mu[c] = 0.f;
  if (a.smooth) load_f8(a.k_mean + bhk * D + cg * 8, mu);

  float x[ITER][8];
  float ps[8], pe[8], us[8];
  float am = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) ps[c] = 0.f, pe[c] = 0.f, us[c] = 0.f;
#pragma unroll
  for (int it = 0; it < ITER; ++it) {
    const int64_t row = row0 + it * RPI + lr;
    unpack8<T>(raw[it], x[it]);
    const bool valid = row < a.Lkv;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      x[it][c] = valid ? x[it][c] - mu[c] : 0.f;  // k' = k - mu (float32); pad rows stay zero
      am = max_nan(am, fabsf(x[it][c]));
    }
    if (a.pool) pool_row<TPR>(x[it], ps, us);
  }
  if (a.quant) {
    am = finite_or_nan(block_reduce(am, fred, OpMaxNaN{}));
    const int64_t lk_pad = a.nKB * kGpuBlockK;
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
      const int64_t prow = bhk * lk_pad + row0 + it * RPI + lr;
      *reinterpret_cast<uint2*>(a.k_i8 + prow * D + cg * 8) = quant8(x[it], am);
    }
    if (tid == 0) a.k_scale[bhk * a.nKB + kb] = am / 127.f;
  }
  if (!a.pool) return;
  const int n = int(min(int64_t(kGpuBlockK), a.Lkv - row0));
  const int64_t blk = bhk * a.nKB + kb;
  block_pool_finish<D, TPR, kThreads>(ps, us, n, red, a.pooled_k + blk * D, a.sim_k + blk);
}

// ---------------------------------------------------------------- V pass
struct VArgs {
  Tensor4 v;
  int d_in;  // the tensor's head dim (see ColArgs)
  int64_t Hkv, Lkv, lk_pad, ntile;
  const float* v_amax;  // [B*Hkv, D]
  uint8_t* v_f8;        // [B*Hkv, D, lk_pad]
  uint8_t* v_f8_lo;     // [B*Hkv, D, lk_pad] or null: split V's second term
};

__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// An e4m3 code as float (exact: every e4m3 value is an fp16 value).
__device__ __forceinline__ float e4m3_to_float(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), __NV_E4M3);
  return __half2float(__half(h));
}

// One CTA of D/8 warps per (b, hkv, tile of 128 token slots). Warp w owns
// channels 8w..8w+7; lane l owns the four consecutive slots 4l..4l+3 of the
// tile, i.e. the keys perm32(kk) of their group of 32. Each lane reads its four
// keys (16 bytes each) and writes one 32-bit word per channel: every channel
// row of the tile is a contiguous 128-byte store of the warp.
template <int D, class T, bool VEC>
__global__ void __launch_bounds__(D * 4) v_pass_kernel(const VArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  const uint32_t tile = blockIdx.x % uint32_t(a.ntile), bhk = blockIdx.x / uint32_t(a.ntile);
  const uint32_t b = bhk / uint32_t(a.Hkv), hk = bhk % uint32_t(a.Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = warp * 8;
  const int64_t s0 = block_row0(tile, 128) + lane * 4;  // first slot of this lane
  if (s0 >= a.lk_pad) return;
  const int64_t g = s0 & ~int64_t(31);
  const int kk0 = int(s0 & 31);
  const T* vp = static_cast<const T*>(a.v.data);

  uint4 raw[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t j = g + perm32(kk0 + i);
    raw[i] = (j < a.Lkv && c0 < a.d_in) ? load8_raw<VEC>(vp + a.v.offset(b, hk, j, c0)) : make_uint4(0, 0, 0, 0);
  }
  float inv[8];
  bool nz[8];
  {
    float am[8];
    load_f8(a.v_amax + bhk * D + c0, am);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      nz[c] = am[c] > 0.f;
      inv[c] = nz[c] ? kFp8Max / am[c] : 0.f;
    }
  }
  float x[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i) unpack8<T>(raw[i], x[i]);
  const int64_t off = (bhk * D + c0) * a.lk_pad + s0;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    uint32_t w = 0, wl = 0;
    if (nz[c]) {
      float y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) y[i] = __fmul_rn(x[i][c], inv[c]);  // rounded on its own, never fused
      w = e4m3x2(y[0], y[1]) | (e4m3x2(y[2], y[3]) << 16);
      if (a.v_f8_lo != nullptr) {
        // Split V: lo = e4m3(y - hi); y - hi is exact in float32.
        float r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) r[i] = __fsub_rn(y[i], e4m3_to_float(uint8_t(w >> (8 * i))));
        wl = e4m3x2(r[0], r[1]) | (e4m3x2(r[2], r[3]) << 16);
      }
    }
    *reinterpret_cast<uint32_t*>(a.v_f8 + off + int64_t(c) * a.lk_pad) = w;
    if (a.v_f8_lo != nullptr) *reinterpret_cast<uint32_t*>(a.v_f8_lo + off + int64_t(c) * a.lk_pad) = wl;
  }
}

// ---------------------------------------------------------------- host side
// 16-byte loads need a 16-byte aligned base and strides (of the dimensions
// that are actually indexed) that are multiples of 8 elements.
bool vec_ok(const Tensor4& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.shape[d] > 1 && t.stride[d] % 8 != 0) return false;
  return true;
}

bool grid_ok(int64_t blocks) { return blocks > 0 && blocks <= int64_t(0x7fffffff); }

}  // namespace

sparge_status_t predict_supported(const Problem& p) {
  if (!gpu_head_dim_supported(p.D))
    return fail(SPARGE_ERR_UNSUPPORTED, "head_dim %lld: the CUDA backend supports 64, 96, 128 and 256",
                (long long)p.D);
  if (p.dtype != SPARGE_DTYPE_FLOAT16 && p.dtype != SPARGE_DTYPE_BFLOAT16)
    return fail(SPARGE_ERR_UNSUPPORTED, "dtype %d: the CUDA backend takes float16 or bfloat16 inputs",
                int(p.dtype));
  if (p.BQ != kGpuBlockQ || p.BK != kGpuBlockK)
    return fail(SPARGE_ERR_UNSUPPORTED, "block sizes %dx%d: the CUDA backend uses %dx%d", p.BQ, p.BK,
                kGpuBlockQ, kGpuBlockK);
  if (p.nKB > kMaxKeyBlocks)
    return fail(SPARGE_ERR_UNSUPPORTED, "len_kv %lld: the CUDA backend supports at most %lld keys",
                (long long)p.Lkv, (long long)(kMaxKeyBlocks * kGpuBlockK));
  const int64_t nchunk = ceil_div(p.Lkv, kGpuColChunk);
  if (!grid_ok(p.B * p.Hq * p.nQB) || !grid_ok(p.B * p.Hkv * p.nKB) || !grid_ok(p.B * p.Hkv * nchunk))
    return fail(SPARGE_ERR_UNSUPPORTED, "problem too large for the CUDA backend's launch grids");
  // (The attention kernels' own limits are their registry entries' `supports`,
  // checked at plan creation too.)
  if (p.Lq > 0x3fffffffLL)
    return fail(SPARGE_ERR_UNSUPPORTED, "len_q %lld: the CUDA attention kernels support at most 2^30 - 1 queries",
                (long long)p.Lq);
  return SPARGE_OK;
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

sparge_status_t prepare_impl(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4* v,
                             const PredictConfig& cfg, void* ws, cudaStream_t stream, bool quantize, bool pool,
                             bool lse_shift) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  if (L.col_part == 0 || L.pooled_q == 0 || L.pooled_k == 0)
    return fail(SPARGE_ERR_INTERNAL, "CUDA preparation: workspace layout lacks the CUDA regions");
  char* base = static_cast<char*>(ws);
  const bool quant = quantize && L.q_i8 != 0 && L.k_i8 != 0;
  const bool do_v = quant && v != nullptr && L.v_f8 != 0;
  const bool do_k = cfg.smooth_k;
  if (!pool && !quant) return SPARGE_OK;  // nothing asked for
  const int64_t bhq = p.B * p.Hq, bhk = p.B * p.Hkv;
  const int64_t nchunk = ceil_div(p.Lkv, kGpuColChunk);
  const int64_t lk_pad = p.nKB * kGpuBlockK;

  double* ksum = ws_ptr<double>(base, L.col_part);
  float* vmax = reinterpret_cast<float*>(ksum + bhk * nchunk * p.Dk);
  float* k_mean = ws_ptr<float>(base, L.k_mean);
  float* v_amax = ws_ptr<float>(base, L.v_amax);

  // 1. column statistics
  // Prediction only, smoothing on, no self-similarity forcing possible
  // (similarities are >= 0, so a threshold <= 0 never forces): the pooled K
  // means come out of the column pass (raw, then minus the mean) and the K pass,
  // a second read of K, is skipped.
  const bool fused_kpool = !quant && do_k && cfg.sim_per_head == nullptr && !(cfg.sim_threshold > 0.f);
  if (do_k || do_v) {
    ColArgs ca;
    ca.k = k;
    ca.d_in = int(p.D);
    ca.v = do_v ? *v : k;
    ca.Hkv = p.Hkv, ca.Lkv = p.Lkv, ca.nchunk = nchunk, ca.nKB = p.nKB;
    ca.do_k = do_k, ca.do_v = do_v;
    ca.ksum = ksum, ca.vmax = vmax;
    ca.kpool = fused_kpool ? ws_ptr<float>(base, L.pooled_k) : nullptr;
    ca.ksim = fused_kpool ? ws_ptr<float>(base, L.sim_k) : nullptr;
    const bool vec = vec_ok(k) && (!do_v || vec_ok(*v));
    cudaError_t err = cudaSuccess;
    dispatch_pass(p, vec, [&](auto dc, auto tt, auto vc) {
      err = launch_pdl(col_partial_kernel<decltype(dc)::value, typename decltype(tt)::type, decltype(vc)::value>,
                       dim3(unsigned(bhk * nchunk)), dim3(kThreads), 0, stream, ca);
    });
    SPARGE_PDL_CHECK(err, "sparge column statistics kernel");
  }
  SPARGE_PDL_CHECK(launch_pdl(col_finalize_kernel, dim3(unsigned(bhk)), dim3(kFinThreads), 0, stream,
                              static_cast<const double*>(ksum), static_cast<const float*>(vmax), nchunk, p.Lkv,
                              int(p.Dk), do_k, do_v, k_mean, do_v ? v_amax : nullptr),
                   "sparge column statistics finalize kernel");
  if (fused_kpool) {
    const int64_t total4 = bhk * p.nKB * p.Dk / 4;
    const int64_t blocks = std::min<int64_t>(ceil_div(total4, 256), 132 * 16);
    SPARGE_PDL_CHECK(launch_pdl(pooled_sub_mean_kernel, dim3(unsigned(blocks)), dim3(256), 0, stream,
                                ws_ptr<float4>(base, L.pooled_k), reinterpret_cast<const float4*>(k_mean), p.nKB,
                                int(p.Dk / 4), total4),
                     "sparge pooled-K smoothing kernel");
  }

  // 2. Q pass
  {
    QArgs qa;
    qa.q = q;
    qa.d_in = int(p.D);
    qa.Hq = p.Hq, qa.Hkv = p.Hkv, qa.group = p.group(), qa.Lq = p.Lq, qa.nQB = p.nQB;
    qa.scale = p.scale;
    qa.smooth = do_k, qa.quant = quant, qa.pool = pool, qa.lse_shift = lse_shift;
    qa.k_mean = k_mean;
    qa.pooled_q = ws_ptr<float>(base, L.pooled_q);
    qa.sim_q = ws_ptr<float>(base, L.sim_q);
    qa.q_i8 = quant ? ws_ptr<int8_t>(base, L.q_i8) : nullptr;
    qa.q_scale = quant ? ws_ptr<float>(base, L.q_scale) : nullptr;
    qa.q_mu = quant ? ws_ptr<float>(base, L.q_mu) : nullptr;
    const bool vec = vec_ok(q);
    cudaError_t err = cudaSuccess;
    dispatch_pass(p, vec, [&](auto dc, auto tt, auto vc) {
      err = launch_pdl(q_pass_kernel<decltype(dc)::value, typename decltype(tt)::type, decltype(vc)::value>,
                       dim3(unsigned(bhq * p.nQB)), dim3(kThreads), 0, stream, qa);
    });
    SPARGE_PDL_CHECK(err, "sparge Q pass kernel");
  }

  // 3. K pass
  if (!fused_kpool) {
    KArgs ka;
    ka.k = k;
    ka.d_in = int(p.D);
    ka.Hkv = p.Hkv, ka.Lkv = p.Lkv, ka.nKB = p.nKB;
    ka.smooth = do_k, ka.quant = quant, ka.pool = pool;
    ka.k_mean = k_mean;
    ka.pooled_k = ws_ptr<float>(base, L.pooled_k);
    ka.sim_k = ws_ptr<float>(base, L.sim_k);
    ka.k_i8 = quant ? ws_ptr<int8_t>(base, L.k_i8) : nullptr;
    ka.k_scale = quant ? ws_ptr<float>(base, L.k_scale) : nullptr;
    const bool vec = vec_ok(k);
    cudaError_t err = cudaSuccess;
    dispatch_pass(p, vec, [&](auto dc, auto tt, auto vc) {
      err = launch_pdl(k_pass_kernel<decltype(dc)::value, typename decltype(tt)::type, decltype(vc)::value>,
                       dim3(unsigned(bhk * p.nKB)), dim3(kThreads), 0, stream, ka);
    });
    SPARGE_PDL_CHECK(err, "sparge K pass kernel");
  }

  // 4. V pass
  if (do_v) {
    VArgs va;
    va.v = *v;
    va.d_in = int(p.D);
    va.Hkv = p.Hkv, va.Lkv = p.Lkv, va.lk_pad = lk_pad, va.ntile = ceil_div(lk_pad, 128);
    va.v_amax = v_amax;
    va.v_f8 = ws_ptr<uint8_t>(base, L.v_f8);
    va.v_f8_lo = p.split_v() ? ws_ptr<uint8_t>(base, L.v_f8_lo) : nullptr;
    const bool vec = vec_ok(*v);
    if (!grid_ok(bhk * va.ntile)) return fail(SPARGE_ERR_UNSUPPORTED, "V pass grid too large");
    cudaError_t err = cudaSuccess;
    dispatch_pass(p, vec, [&](auto dc, auto tt, auto vc) {
      err = launch_pdl(v_pass_kernel<decltype(dc)::value, typename decltype(tt)::type, decltype(vc)::value>,
                       dim3(unsigned(bhk * va.ntile)), dim3(decltype(dc)::value * 4), 0, stream, va);
    });
    SPARGE_PDL_CHECK(err, "sparge V pass kernel");
  }

  // 5. block scores from every key (estimator KEYS_LSE; the pooled Q of step 2 is ready)
  if (pool && cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE) SPARGE_TRY(launch_key_scores(plan, k, ws, stream));
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
