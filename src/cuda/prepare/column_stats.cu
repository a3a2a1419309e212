// The preparation's column statistics: per (b, hkv) the K column mean (the
// smoothing shift) and the V column max |.| (the fp8 V scales), reduced in two
// levels in a fixed order (per-chunk partials, then one finalize pass), and for
// a prediction-only call the raw pooled K means of the same read.
#include <algorithm>

#include "core/error.hpp"
#include "cuda/common/launch.cuh"
#include "cuda/prepare/passes.cuh"
#include "cuda/prepare/prepare.cuh"

namespace sparge {
namespace cuda {
namespace prep {
namespace {

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

}  // namespace

sparge_status_t launch_column_stats(const Plan& plan, const Tensor4& k, const Tensor4* v, bool do_k, bool do_v,
                                    bool fused_kpool, void* ws, cudaStream_t stream) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  char* base = static_cast<char*>(ws);
  const int64_t bhk = p.B * p.Hkv;
  const int64_t nchunk = ceil_div(p.Lkv, kGpuColChunk);
  double* ksum = ws_ptr<double>(base, L.col_part);
  float* vmax = reinterpret_cast<float*>(ksum + bhk * nchunk * p.Dk);
  float* k_mean = ws_ptr<float>(base, L.k_mean);
  float* v_amax = ws_ptr<float>(base, L.v_amax);
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

  return SPARGE_OK;
}

}  // namespace prep
}  // namespace cuda
}  // namespace sparge
