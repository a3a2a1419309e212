// The preparation's column statistics (device code of the first preparation
// launch, prepare.cu): per (b, hkv) the K column mean (the smoothing shift) and
// the V column max |.| (the fp8 V scales), reduced in two levels in a fixed
// order (per-chunk partials; then, by whichever CTA of the head finishes last,
// the reduction over the chunks), and for a prediction-only call the raw pooled
// K means of the same read.
#pragma once
#include "cuda/predict/predict.cuh"
#include "cuda/prepare/passes.cuh"

namespace sparge {
namespace cuda {
namespace prep {

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
  // The reduction over the chunks: k_mean = float(sum / Lkv) (zeros without
  // smoothing), v_amax = max over the chunks, written by the CTA that finds
  // itself the last of its head in ticks[bhk] (see finish_ticket).
  float* k_mean;   // [B*Hkv, D]
  float* v_amax;   // [B*Hkv, D] or null
  uint64_t* ticks;  // [B*Hkv]
  uint64_t epoch;   // this call's ticket epoch (kTicketEpochBits bits, never 0)
};

// Tickets: one 64-bit word per head, the call's epoch in the high bits and the
// count of the head's finished chunks in the low kTicketCountBits. A CTA that
// finds another epoch there starts the count afresh, so the word needs no
// initialization: every completed launch leaves {its epoch, 0} (the last CTA
// resets the count), and the host draws a new epoch for every call (a replayed
// graph repeats its epoch and finds the count it left, 0). Uninitialized memory
// fails this only if it holds exactly this epoch with a nonzero count
// (probability 2^-48 per head on the first use of a workspace).
constexpr int kTicketCountBits = 16;
constexpr int kTicketEpochBits = 64 - kTicketCountBits;
static_assert((int64_t(kMaxKeyBlocks) * kGpuBlockK + kGpuColChunk - 1) / kGpuColChunk < (int64_t(1) << kTicketCountBits),
              "the chunk count of a head must fit the ticket's count bits");

// Called by thread 0 after the CTA's partials are written: true for the CTA
// that completes its head's count (the count is then reset).
__device__ __forceinline__ bool finish_ticket(uint64_t* word, uint64_t epoch, uint64_t total) {
  __threadfence();  // this CTA's partials before its ticket
  const uint64_t mine = epoch << kTicketCountBits;
  unsigned long long old = *reinterpret_cast<volatile unsigned long long*>(word);
  unsigned long long now;
  for (;;) {
    const uint64_t count = (old >> kTicketCountBits) == epoch ? (old & ((uint64_t(1) << kTicketCountBits) - 1)) : 0;
    now = mine | (count + 1);
    const unsigned long long seen = atomicCAS(reinterpret_cast<unsigned long long*>(word), old, now);
    if (seen == old) break;
    old = seen;
  }
  const bool last = (now & ((uint64_t(1) << kTicketCountBits) - 1)) == total;
  if (last) {
    atomicExch(reinterpret_cast<unsigned long long*>(word), (unsigned long long)mine);
    __threadfence();  // the other CTAs' partials, read after this
  }
  return last;
}

// Shared memory of col_partial (bytes).
template <int D>
struct ColSmem {
  static constexpr int NW = kThreads / 32;
  double sk[NW][D];
  float sv[NW][D];
  float spool[NW][D];
  int last;
};


// One CTA per (b, hkv, chunk of kGpuColChunk keys): partial column sums of K
// and column max|V|, reduced in a fixed order. Each iteration of the main loop
// covers one 64-key block (chunks start at block boundaries).
template <int D, class T, bool VEC>
__device__ __forceinline__ void col_partial(const ColArgs& a, uint32_t cta, ColSmem<D>& sm) {
  constexpr int TPR = D / 8, RPI = kThreads / TPR, U = kGpuBlockK / RPI, NW = kThreads / 32;
  static_assert(kGpuColChunk % kGpuBlockK == 0, "chunks must start at key-block boundaries");
  auto& spool = sm.spool;
  const uint32_t chunk = cta % uint32_t(a.nchunk), bhk = cta / uint32_t(a.nchunk);
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
  auto& sk = sm.sk;
  auto& sv = sm.sv;
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
  __syncthreads();
  if (tid == 0) sm.last = finish_ticket(a.ticks + bhk, a.epoch, uint64_t(a.nchunk));
  __syncthreads();
  if (!sm.last) return;
  // The last CTA of the head: the reduction over its chunks in a fixed order
  // (the result does not depend on which CTA does it). Thread t sums column
  // t % D over the chunks of its group t / D (loads batched, from L2: other
  // SMs wrote them), the groups are then combined in order.
  constexpr int NG = kThreads / D;
  const int c = tid % D, grp = tid / D;
  const int64_t per = (a.nchunk + NG - 1) / NG;
  const int64_t ch0 = min(a.nchunk, grp * per), ch1 = min(a.nchunk, ch0 + per);
  const int64_t base = int64_t(bhk) * a.nchunk * D + c;
  double s = 0.0;
  float m = 0.f;
  for (int64_t ch = ch0; ch < ch1; ch += 8) {
    double kv[8];
    float vv[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const bool in = ch + u < ch1;
      kv[u] = (a.do_k && in) ? __ldcg(a.ksum + base + (ch + u) * D) : 0.0;
      vv[u] = (a.do_v && in) ? __ldcg(a.vmax + base + (ch + u) * D) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      s += kv[u];
      m = max_nan(m, vv[u]);
    }
  }
  double* ssum = &sk[0][0];  // NW * D >= kThreads entries, free again
  float* smax = &sv[0][0];
  __syncthreads();
  ssum[tid] = s;
  smax[tid] = m;
  __syncthreads();
  if (tid < D) {
    for (int g = 1; g < NG; ++g) {
      s += ssum[g * D + tid];
      m = max_nan(m, smax[g * D + tid]);
    }
    a.k_mean[int64_t(bhk) * D + tid] = a.do_k ? float(s / double(a.Lkv)) : 0.f;
    if (a.do_v) a.v_amax[int64_t(bhk) * D + tid] = finite_or_nan(m);  // NaN: the channel dequantizes to NaN
  }
}

// pooled_k[bhk, kb, :] -= k_mean[bhk, :] (raw pooled means -> smoothed ones),
// CTA `cta` of `ctas`.
struct SubMeanArgs {
  float4* pooled;
  const float4* mean;
  int64_t nKB, total4;
  int D4;
};

__device__ __forceinline__ void pooled_sub_mean(const SubMeanArgs& a, uint32_t cta, uint32_t ctas) {
  for (int64_t i = cta * int64_t(kThreads) + threadIdx.x; i < a.total4; i += int64_t(ctas) * kThreads) {
    const int64_t c4 = i % a.D4, bhk = i / (a.D4 * a.nKB);
    float4 v = a.pooled[i];
    const float4 m = a.mean[bhk * a.D4 + c4];
    v.x -= m.x, v.y -= m.y, v.z -= m.z, v.w -= m.w;
    a.pooled[i] = v;
  }
}

}  // namespace prep
}  // namespace cuda
}  // namespace sparge
