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
#include <atomic>
#include <cstring>
#include <random>
#include <type_traits>

#include "core/error.hpp"
#include "core/kernel_traits.hpp"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/pooling.cuh"
#include "cuda/predict/predict.cuh"
#include "cuda/prepare/column_stats.cuh"
#include "cuda/prepare/passes.cuh"
#include "cuda/prepare/prepare.cuh"
#include "cuda/schedule/lists.cuh"

namespace sparge {
namespace cuda {
namespace {

using namespace prep;

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
  bool pool;            // pooled mean (for the mask prediction)
  bool lse_shift;       // q_mu (only the LSE output reads it)
  const float* k_mean;  // [B*Hkv, D]
  float* pooled_q;      // [B*Hq, nQB, D]
  float* sim_q;         // [B*Hq, nQB], with pool; null: not computed (read only by a threshold > 0)
  int8_t* q_i8;         // [B*Hq, nQB*128, D]
  float* q_scale;       // [B*Hq, nQB*128]
  float* q_mu;          // [B*Hq, nQB*128]
};

// Shared memory of the Q and K passes (floats): the pooling reduction, and
// the K pass's block max.
template <int D>
struct PassSmem {
  float red[2 * (kThreads / 32) * D + 32];
  float fred[32];
};

// CTA `cta` of one per (b, h, 128-row query block). POOL_ONLY: the pooled means alone (no
// quantization, no self-similarity), compiled without the quantization's registers (pool_q_kernel).
template <int D, class T, bool VEC, bool POOL_ONLY = false>
__device__ __forceinline__ void q_pass(const QArgs& a, uint32_t cta, PassSmem<D>& sm) {
  constexpr int TPR = D / 8, RPI = kThreads / TPR, ITER = kGpuBlockQ / RPI;
  float* red = sm.red;
  const uint32_t qb = cta % uint32_t(a.nQB), bh = cta / uint32_t(a.nQB);
  const uint32_t b = bh / uint32_t(a.Hq), h = bh % uint32_t(a.Hq), bhk = b * uint32_t(a.Hkv) + h / uint32_t(a.group);
  const int tid = threadIdx.x, lr = tid / TPR, cg = tid % TPR;
  const int64_t row0 = block_row0(qb, kGpuBlockQ);

  uint4 raw[ITER];
  load_rows8<ITER, RPI, T, VEC>(a.q, b, h, row0, lr, cg, a.Lq, a.d_in, raw);
  float mu[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) mu[c] = 0.f;
  const bool quant = !POOL_ONLY && a.quant, pool = POOL_ONLY || a.pool;
  const bool sim = !POOL_ONLY && a.sim_q != nullptr;
  const bool shift = quant && a.lse_shift;
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
    if (pool) pool_row<TPR>(x, ps, us, sim);
    if (quant) {
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
  if (!pool) return;
  const int n = int(min(int64_t(kGpuBlockQ), a.Lq - row0));
  const int64_t blk = bh * a.nQB + qb;
  block_pool_finish<D, TPR, kThreads>(ps, us, n, red, a.pooled_q + blk * D, sim ? a.sim_q + blk : nullptr);
}

// ---------------------------------------------------------------- K pass
struct KArgs {
  Tensor4 k;
  int d_in;  // the tensor's head dim (see ColArgs)
  int64_t Hkv, Lkv, nKB;
  bool smooth, quant;
  bool pool;            // pooled mean (for the mask prediction)
  const float* k_mean;  // [B*Hkv, D]
  float* pooled_k;      // [B*Hkv, nKB, D]
  float* sim_k;         // [B*Hkv, nKB], with pool; null: not computed (read only by a threshold > 0)
  int8_t* k_i8;         // [B*Hkv, nKB*64, D]
  float* k_scale;       // [B*Hkv, nKB]
};

// CTA `cta` of one per (b, hkv, 64-key block).
template <int D, class T, bool VEC>
__device__ __forceinline__ void k_pass(const KArgs& a, uint32_t cta, PassSmem<D>& sm) {
  constexpr int TPR = D / 8, RPI = kThreads / TPR, ITER = kGpuBlockK / RPI;
  float* red = sm.red;
  float* fred = sm.fred;
  const uint32_t kb = cta % uint32_t(a.nKB), bhk = cta / uint32_t(a.nKB);
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
    if (a.pool) pool_row<TPR>(x[it], ps, us, a.sim_k != nullptr);
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
  block_pool_finish<D, TPR, kThreads>(ps, us, n, red, a.pooled_k + blk * D, a.sim_k ? a.sim_k + blk : nullptr);
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

// CTA `cta` of one per (b, hkv, tile of 128 token slots), 8 warps. Warp w owns
// the channel groups w, w + 8, ... of 8 channels each; lane l owns the four
// consecutive slots 4l..4l+3 of the tile, i.e. the keys perm32(kk) of their
// group of 32. Per channel group each lane reads its four keys (16 bytes each)
// and writes one 32-bit word per channel: every channel row of the tile is a
// contiguous 128-byte store of the warp.
template <int D, class T, bool VEC>
__device__ __forceinline__ void v_pass(const VArgs& a, uint32_t cta) {
  const uint32_t tile = cta % uint32_t(a.ntile), bhk = cta / uint32_t(a.ntile);
  const uint32_t b = bhk / uint32_t(a.Hkv), hk = bhk % uint32_t(a.Hkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t s0 = block_row0(tile, 128) + lane * 4;  // first slot of this lane
  if (s0 >= a.lk_pad) return;
  const int64_t g = s0 & ~int64_t(31);
  const int kk0 = int(s0 & 31);
  const T* vp = static_cast<const T*>(a.v.data);
#pragma unroll 1
  for (int c0 = warp * 8; c0 < D; c0 += kThreads / 4) {
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
}

bool grid_ok(int64_t blocks) { return blocks > 0 && blocks <= int64_t(0x7fffffff); }

// ---------------------------------------------------------------- the two launches
// The preparation runs as two launches of 256-thread CTAs whose grid is the
// concatenation of independent parts (no CTA waits for another):
//   stage A: column statistics (their last CTA per head reduces the chunks),
//            the Q pass (unless it needs the K mean), the mask-to-lists rows
//            of a caller's mask;
//   stage B: the work order of those lists, the K pass, the V pass, the Q
//            pass that needs the K mean (LSE shift), the pooled-K smoothing
//            of a prediction-only call.
// Stage B reads what stage A wrote (stream order, PDL wait). Parts are laid
// out in that order, so the CTAs that gate stage B's start are dispatched
// first.
struct StageA {
  ColArgs col;
  QArgs q;
  lists::ListArgs lists;
  uint32_t n_col, n_q, n_lists;
};

struct StageB {
  lists::OrderArgs ord;
  KArgs k;
  VArgs v;
  QArgs q;
  SubMeanArgs sub;
  uint32_t n_ord, n_k, n_v, n_q, n_sub;
};

template <int D>
union StageSmem {
  ColSmem<D> col;
  PassSmem<D> pass;
};

template <int D, class T, bool VEC>
__global__ void __launch_bounds__(kThreads, 3) stage_a_kernel(const __grid_constant__ StageA a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  __shared__ __align__(16) unsigned char raw[sizeof(StageSmem<D>)];
  StageSmem<D>& sm = *reinterpret_cast<StageSmem<D>*>(raw);
  uint32_t cta = blockIdx.x;
  if (cta < a.n_col) return col_partial<D, T, VEC>(a.col, cta, sm.col);
  cta -= a.n_col;
  if (cta < a.n_q) return q_pass<D, T, VEC>(a.q, cta, sm.pass);
  cta -= a.n_q;
  lists::mask_to_lists(a.lists, cta);
}

// Stage A when it is the Q pass's pooled means alone (prediction only with KEYS_LSE and no forcing: no
// quantization, no self-similarity, no column statistics, no lists): more CTAs per SM keep more of
// Q in flight (the pass is a read of Q at DRAM bandwidth).
template <int D>
constexpr int pool_min_blocks() {
  return D <= 128 ? 4 : 2;
}

template <int D, class T, bool VEC>
__global__ void __launch_bounds__(kThreads, pool_min_blocks<D>()) pool_q_kernel(const __grid_constant__ StageA a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  __shared__ __align__(16) unsigned char raw[sizeof(PassSmem<D>)];
  q_pass<D, T, VEC, true>(a.q, blockIdx.x, *reinterpret_cast<PassSmem<D>*>(raw));
}

template <int D, class T, bool VEC>
__global__ void __launch_bounds__(kThreads, 3) stage_b_kernel(const __grid_constant__ StageB a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  __shared__ __align__(16) unsigned char raw[sizeof(PassSmem<D>)];
  extern __shared__ int hist[];  // the work order's counters (nKB + 1), when it is a part
  PassSmem<D>& sm = *reinterpret_cast<PassSmem<D>*>(raw);
  uint32_t cta = blockIdx.x;
  if (cta < a.n_ord) return lists::order_rows<kThreads>(a.ord, cta, hist);
  cta -= a.n_ord;
  if (cta < a.n_k) return k_pass<D, T, VEC>(a.k, cta, sm);
  cta -= a.n_k;
  if (cta < a.n_v) return v_pass<D, T, VEC>(a.v, cta);
  cta -= a.n_v;
  if (cta < a.n_q) return q_pass<D, T, VEC>(a.q, cta, sm);
  cta -= a.n_q;
  pooled_sub_mean(a.sub, cta, a.n_sub);
}

// The work order joins stage B only while its counters are small: they are
// dynamic shared memory of every CTA of the launch.
constexpr int kOrderInStageMaxBins = 2048;

// A new ticket epoch per call (column_stats.cuh): never 0, kTicketEpochBits wide.
uint64_t next_epoch() {
  static std::atomic<uint64_t> counter{[] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ uint64_t(rd());
  }()};
  constexpr uint64_t kMask = (uint64_t(1) << kTicketEpochBits) - 1;
  uint64_t e = 0;
  while (e == 0) e = counter.fetch_add(1, std::memory_order_relaxed) & kMask;
  return e;
}

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

sparge_status_t prepare_impl(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4* v,
                             const PredictConfig& cfg, void* ws, cudaStream_t stream, bool quantize, bool pool,
                             bool lse_shift, const MaskView* lists_mask, bool zero_tickets,
                             const KeptView* kept, bool* kept_zeroed) {
  if (kept_zeroed) *kept_zeroed = false;
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  if (L.col_part == 0 || L.pooled_q == 0 || L.pooled_k == 0 || L.col_tick == 0)
    return fail(SPARGE_ERR_INTERNAL, "CUDA preparation: workspace layout lacks the CUDA regions");
  char* base = static_cast<char*>(ws);
  const bool quant = quantize && L.q_i8 != 0 && L.k_i8 != 0;
  const bool do_v = quant && v != nullptr && L.v_f8 != 0;
  const bool do_k = cfg.smooth_k;
  if (!pool && !quant) return SPARGE_OK;  // nothing asked for
  const int64_t bhq = p.B * p.Hq, bhk = p.B * p.Hkv;
  const int64_t lk_pad = p.nKB * kGpuBlockK;
  const int64_t nchunk = ceil_div(p.Lkv, kGpuColChunk);
  float* k_mean = ws_ptr<float>(base, L.k_mean);
  float* v_amax = ws_ptr<float>(base, L.v_amax);

  // Prediction only, smoothing on, no self-similarity forcing possible
  // (similarities are >= 0, so a threshold <= 0 never forces): the pooled K
  // means come out of the column statistics' read (raw, then minus the mean in
  // stage B) and the K pass, a second read of K, is skipped.
  const bool no_sim_forcing = cfg.sim_per_head == nullptr && !(cfg.sim_threshold > 0.f);
  // Prediction only with KEYS_LSE and no forcing: the scores read the raw keys
  // and the pooled queries, nothing else (a K mean shifts every score of a row
  // by the same q . mean, which no selection sees): no column statistics, no
  // pooled K, no K pass.
  const bool split2 = grouped_estimator(cfg.estimator);
  const bool q_only = !quant && keys_estimator(cfg.estimator) && no_sim_forcing;
  // ... and with KEYS_LSE_SPLIT2 not even the pooled queries: its grouping kernel reads Q itself.
  const bool no_q_pass = q_only && split2;
  const bool fused_kpool = !quant && !q_only && do_k && no_sim_forcing;
  const bool q_late = quant && lse_shift && do_k;  // q . k_mean needs the K mean

  StageA A;
  StageB B;
  std::memset(&A, 0, sizeof A);
  std::memset(&B, 0, sizeof B);

  if ((do_k || do_v) && !q_only) {  // column statistics
    ColArgs& ca = A.col;
    ca.k = k;
    ca.d_in = int(p.D);
    ca.v = do_v ? *v : k;
    ca.Hkv = p.Hkv, ca.Lkv = p.Lkv, ca.nchunk = nchunk, ca.nKB = p.nKB;
    ca.do_k = do_k, ca.do_v = do_v;
    ca.ksum = ws_ptr<double>(base, L.col_part);
    ca.vmax = reinterpret_cast<float*>(ca.ksum + bhk * nchunk * p.Dk);
    ca.kpool = fused_kpool ? ws_ptr<float>(base, L.pooled_k) : nullptr;
    ca.ksim = fused_kpool ? ws_ptr<float>(base, L.sim_k) : nullptr;
    ca.k_mean = k_mean;
    ca.v_amax = do_v ? v_amax : nullptr;
    ca.ticks = ws_ptr<uint64_t>(base, L.col_tick);
    ca.epoch = next_epoch();
    A.n_col = uint32_t(bhk * nchunk);
  }
  if (!no_q_pass) {  // Q pass
    QArgs qa{};
    qa.q = q;
    qa.d_in = int(p.D);
    qa.Hq = p.Hq, qa.Hkv = p.Hkv, qa.group = p.group(), qa.Lq = p.Lq, qa.nQB = p.nQB;
    qa.scale = p.scale;
    qa.smooth = do_k, qa.quant = quant, qa.pool = pool, qa.lse_shift = lse_shift;
    qa.k_mean = k_mean;
    qa.pooled_q = ws_ptr<float>(base, L.pooled_q);
    qa.sim_q = no_sim_forcing ? nullptr : ws_ptr<float>(base, L.sim_q);  // read only by a threshold > 0 (select.cu)
    qa.q_i8 = quant ? ws_ptr<int8_t>(base, L.q_i8) : nullptr;
    qa.q_scale = quant ? ws_ptr<float>(base, L.q_scale) : nullptr;
    qa.q_mu = quant ? ws_ptr<float>(base, L.q_mu) : nullptr;
    if (q_late) {
      B.q = qa;
      B.n_q = uint32_t(bhq * p.nQB);
    } else {
      A.q = qa;
      A.n_q = uint32_t(bhq * p.nQB);
    }
  }
  int64_t order_groups = 0;  // the work order after stage B, on its own
  if (lists_mask != nullptr) {
    int64_t ctas = 0, groups = 0;
    SPARGE_TRY(lists::list_args(plan, *lists_mask, ws, &A.lists, &B.ord, &ctas, &groups));
    A.n_lists = uint32_t(ctas);
    if (B.ord.nbins <= kOrderInStageMaxBins)
      B.n_ord = uint32_t(groups);
    else
      order_groups = groups;
  }
  if (!fused_kpool && !q_only) {  // K pass
    KArgs& ka = B.k;
    ka.k = k;
    ka.d_in = int(p.D);
    ka.Hkv = p.Hkv, ka.Lkv = p.Lkv, ka.nKB = p.nKB;
    ka.smooth = do_k, ka.quant = quant, ka.pool = pool;
    ka.k_mean = k_mean;
    ka.pooled_k = ws_ptr<float>(base, L.pooled_k);
    ka.sim_k = no_sim_forcing ? nullptr : ws_ptr<float>(base, L.sim_k);
    ka.k_i8 = quant ? ws_ptr<int8_t>(base, L.k_i8) : nullptr;
    ka.k_scale = quant ? ws_ptr<float>(base, L.k_scale) : nullptr;
    B.n_k = uint32_t(bhk * p.nKB);
  }
  if (do_v) {  // V pass
    VArgs& va = B.v;
    va.v = *v;
    va.d_in = int(p.D);
    va.Hkv = p.Hkv, va.Lkv = p.Lkv, va.lk_pad = lk_pad, va.ntile = ceil_div(lk_pad, 128);
    va.v_amax = v_amax;
    va.v_f8 = ws_ptr<uint8_t>(base, L.v_f8);
    va.v_f8_lo = p.split_v() ? ws_ptr<uint8_t>(base, L.v_f8_lo) : nullptr;
    B.n_v = uint32_t(bhk * va.ntile);
  }
  if (fused_kpool) {  // pooled K minus the mean
    SubMeanArgs& sa = B.sub;
    sa.pooled = ws_ptr<float4>(base, L.pooled_k);
    sa.mean = reinterpret_cast<const float4*>(k_mean);
    sa.nKB = p.nKB;
    sa.D4 = int(p.Dk / 4);
    sa.total4 = bhk * p.nKB * p.Dk / 4;
    B.n_sub = uint32_t(std::min<int64_t>(ceil_div(sa.total4, kThreads), 132 * 8));
  }

  const int64_t na = int64_t(A.n_col) + A.n_q + A.n_lists;
  const int64_t nb = int64_t(B.n_ord) + B.n_k + B.n_v + B.n_q + B.n_sub;
  // Every part's count is checked by predict_supported and list_args; their sums here.
  if (na > int64_t(0x7fffffff) || nb > int64_t(0x7fffffff))
    return fail(SPARGE_ERR_UNSUPPORTED, "problem too large for the CUDA preparation's launch grids");
  const bool vec = vec_ok(q) && vec_ok(k) && (!do_v || vec_ok(*v));
  if (A.n_col > 0 && zero_tickets)
    SPARGE_CUDA_TRY(cudaMemsetAsync(A.col.ticks, 0, size_t(bhk) * sizeof(uint64_t), stream));
  if (na > 0) {
    const bool pool_only = na == A.n_q && !quant && A.q.sim_q == nullptr;
    cudaError_t err = cudaSuccess;
    dispatch_pass(p, vec, [&](auto dc, auto tt, auto vc) {
      constexpr int D = decltype(dc)::value;
      using T = typename decltype(tt)::type;
      constexpr bool VEC = decltype(vc)::value;
      err = launch_pdl(pool_only ? pool_q_kernel<D, T, VEC> : stage_a_kernel<D, T, VEC>, dim3(unsigned(na)),
                       dim3(kThreads), 0, stream, A);
    });
    SPARGE_PDL_CHECK(err, pool_only ? "sparge pooled-query kernel" : "sparge preparation kernel (stage A)");
  }
  if (nb > 0) {
    const size_t smem = B.n_ord > 0 ? size_t(B.ord.nbins) * sizeof(int) : 0;
    cudaError_t err = cudaSuccess;
    sparge_status_t st = SPARGE_OK;
    dispatch_pass(p, vec, [&](auto dc, auto tt, auto vc) {
      auto kern = stage_b_kernel<decltype(dc)::value, typename decltype(tt)::type, decltype(vc)::value>;
      st = ensure_smem_attr(reinterpret_cast<const void*>(kern), int(smem), p.device_id);
      if (st == SPARGE_OK) err = launch_pdl(kern, dim3(unsigned(nb)), dim3(kThreads), smem, stream, B);
    });
    SPARGE_TRY(st);
    SPARGE_PDL_CHECK(err, "sparge preparation kernel (stage B)");
  }
  if (order_groups > 0) SPARGE_TRY(lists::launch_order(plan, B.ord, order_groups, stream));

  // Block scores from every key (estimator KEYS_LSE: the pooled Q of stage A or B is ready;
  // KEYS_LSE_SPLIT2: the groups' mean rows first; the selection combines their scores).
  if (pool && keys_estimator(cfg.estimator)) {
    if (split2)
      SPARGE_TRY(launch_split2_group(plan, q, ws, stream, cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE));
    const KeptRef kr = kept_ref(plan, kept, ws);
    SPARGE_TRY(launch_key_scores(plan, k, ws, stream, kept_zeroed ? &kr : nullptr, kept_zeroed, cfg.estimator));
  }
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
