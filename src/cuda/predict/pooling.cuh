// Pooled block statistics of the mask prediction (docs/PREDICTION.md), as
// device helpers that the preparation's fused passes over Q and K call while
// they quantize the same rows (one read of each input for both stages).
#pragma once
#include "cuda/common/device.cuh"

namespace sparge {
namespace cuda {

// Per-thread float column partials of a block (8 columns per thread): sums
// (ps) and sums of the rows divided by their norms (us) -> pooled mean and
// self-similarity, written by the block. `red` is shared scratch
// [2][NW][D] floats plus 32 floats. sim_out null: the mean only (us is not
// read).
template <int D, int TPR, int kThreads>
__device__ __forceinline__ void block_pool_finish(float (&ps)[8], float (&us)[8], int n, float* red,
                                                  float* pooled_out, float* sim_out) {
  constexpr int NW = kThreads / 32;
  const bool sim = sim_out != nullptr;  // uniform
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, cg = tid % TPR;
#pragma unroll
  for (int o = TPR; o < 32; o <<= 1) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      ps[c] += __shfl_xor_sync(0xffffffffu, ps[c], o);
      if (sim) us[c] += __shfl_xor_sync(0xffffffffu, us[c], o);
    }
  }
  float* rp = red;               // [NW][D]
  float* ru = red + NW * D;      // [NW][D]
  float* rs = red + 2 * NW * D;  // [32]
  if (lane < TPR) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      rp[warp * D + cg * 8 + c] = ps[c];
      if (sim) ru[warp * D + cg * 8 + c] = us[c];
    }
  }
  __syncthreads();
  if (tid < D) {
    float Pc = 0.f, Uc = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      Pc += rp[w * D + tid];
      if (sim) Uc += ru[w * D + tid];
    }
    pooled_out[tid] = Pc / float(n);
    if (!sim) return;
    const float u2 = warp_sum(Uc * Uc);
    if (lane == 0) rs[warp] = u2;
  }
  if (!sim) return;
  __syncthreads();
  if (tid == 0) {
    float u2 = 0.f;
#pragma unroll
    for (int w = 0; w < D / 32; ++w) u2 += rs[w];
    *sim_out = u2 / (float(n) * float(n));
  }
}

// Accumulates one row (8 columns per thread, TPR threads per row) into the
// pooled partials: column sums and (sim) the row divided by its norm.
template <int TPR>
__device__ __forceinline__ void pool_row(const float (&x)[8], float (&ps)[8], float (&us)[8], bool sim) {
  if (!sim) {  // uniform
#pragma unroll
    for (int c = 0; c < 8; ++c) ps[c] += x[c];
    return;
  }
  float n2 = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) n2 = fmaf(x[c], x[c], n2);
  n2 = group_sum<TPR>(n2);
  const float inv = n2 > 0.f ? rsqrtf(n2) : 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    ps[c] += x[c];
    us[c] = fmaf(x[c], inv, us[c]);
  }
}

}  // namespace cuda
}  // namespace sparge
