#include "core/problem.hpp"

namespace sparge {
namespace {
// Bump allocator: the same code measures and lays out.
struct Bump {
  size_t top = 0;
  size_t take(size_t bytes) {
    if (bytes == 0) return 0;
    top = (top + 255) & ~size_t(255);
    size_t off = top;
    top += bytes;
    return off;
  }
};
}  // namespace

WorkspaceLayout plan_workspace(const Problem& p) {
  WorkspaceLayout w;
  Bump a;
  a.take(1);  // offset 0 means "unused": keep every real region above it
  const size_t f = sizeof(float);
  const size_t bhq = size_t(p.B * p.Hq), bhk = size_t(p.B * p.Hkv);
  const size_t D = size_t(p.D), nQB = size_t(p.nQB), nKB = size_t(p.nKB);
  w.k_mean = a.take(bhk * D * f);
  w.pooled_q = a.take(bhq * nQB * D * f);
  w.sim_q = a.take(bhq * nQB * f);
  w.pooled_k = a.take(bhk * nKB * D * f);
  w.sim_k = a.take(bhk * nKB * f);
  w.scores = a.take(bhq * nQB * nKB * f);
  w.mask = a.take(bhq * nQB * nKB);
  w.kept = a.take(bhq * sizeof(int32_t));
  if (p.device == SPARGE_DEVICE_CUDA) {
    const size_t lq = nQB * kGpuBlockQ, lk = nKB * kGpuBlockK;
    w.v_amax = a.take(bhk * D * f);
    w.q_scale = a.take(bhq * lq * f);
    w.q_mu = a.take(bhq * lq * f);
    w.k_scale = a.take(bhk * nKB * f);
    w.idx = a.take(bhq * nQB * nKB * sizeof(int32_t));
    w.cnt = a.take(bhq * nQB * sizeof(int32_t));
    w.order = a.take(bhq * nQB * sizeof(int32_t));
    const size_t nchunk = (size_t(p.Lkv) + kGpuColChunk - 1) / kGpuColChunk;
    w.col_part = a.take(bhk * nchunk * D * (sizeof(double) + sizeof(float)));
    if (p.precision == SPARGE_PRECISION_INT8_FP8) {
      w.q_i8 = a.take(bhq * lq * D);
      w.k_i8 = a.take(bhk * lk * D);
      w.v_f8 = a.take(bhk * D * lk);
    }
  }
  w.total = (a.top + 255) & ~size_t(255);
  return w;
}

}  // namespace sparge
