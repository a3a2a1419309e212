#include <cstdint>
#include <initializer_list>

#include "core/problem.hpp"

namespace sparge {
namespace {
// Bump allocator: the same code measures, lays out and checks for overflow,
// so the size query, the real layout and the validation cannot drift.
struct Bump {
  uint64_t top = 0;
  bool overflow = false;
  // Reserves the product of `factors` bytes (256-byte aligned); 0 bytes = unused region (offset 0).
  size_t take(std::initializer_list<uint64_t> factors) {
    uint64_t bytes = 1;
    for (uint64_t f : factors)
      if (__builtin_mul_overflow(bytes, f, &bytes)) overflow = true;
    if (overflow || bytes == 0) return 0;
    uint64_t off = 0;
    if (__builtin_add_overflow(top, uint64_t(255), &off)) overflow = true;
    off &= ~uint64_t(255);
    if (overflow || __builtin_add_overflow(off, bytes, &top) || top > uint64_t(INT64_MAX)) {
      overflow = true;
      return 0;
    }
    return size_t(off);
  }
};
}  // namespace

WorkspaceLayout plan_workspace(const Problem& p) {
  WorkspaceLayout w;
  Bump a;
  a.take({1});  // offset 0 means "unused": keep every real region above it
  const uint64_t f = sizeof(float), i32 = sizeof(int32_t);
  const uint64_t B = uint64_t(p.B), Hq = uint64_t(p.Hq), Hkv = uint64_t(p.Hkv);
  const uint64_t D = uint64_t(p.Dk > 0 ? p.Dk : p.D), nQB = uint64_t(p.nQB), nKB = uint64_t(p.nKB);
  w.k_mean = a.take({B, Hkv, D, f});
  w.pooled_q = a.take({B, Hq, nQB, D, f});
  w.sim_q = a.take({B, Hq, nQB, f});
  w.pooled_k = a.take({B, Hkv, nKB, D, f});
  w.sim_k = a.take({B, Hkv, nKB, f});
  w.scores = a.take({B, Hq, nQB, nKB, f});
  w.mask = a.take({B, Hq, nQB, nKB});
  w.kept = a.take({B, Hq, i32});
  if (p.device == SPARGE_DEVICE_CUDA) {
    const uint64_t nchunk = (uint64_t(p.Lkv) + kGpuColChunk - 1) / kGpuColChunk;
    w.v_amax = a.take({B, Hkv, D, f});
    w.q_scale = a.take({B, Hq, nQB, kGpuBlockQ, f});
    w.q_mu = a.take({B, Hq, nQB, kGpuBlockQ, f});
    w.k_scale = a.take({B, Hkv, nKB, f});
    w.idx = a.take({B, Hq, nQB, nKB, i32});
    w.cnt = a.take({B, Hq, nQB, i32});
    w.order = a.take({B, Hq, nQB, i32});
    w.col_part = a.take({B, Hkv, nchunk, D, sizeof(double) + sizeof(float)});
    w.col_tick = a.take({B, Hkv, sizeof(uint64_t)});
    w.split_q = a.take({B, Hq, nQB, 2, D, f});
    w.split_n = a.take({B, Hq, nQB, 2, f});
    w.split_rows = a.take({B, Hq, nQB, 2, i32});
    w.split_cnt = a.take({B, Hkv, i32});
    if (p.quantized()) {
      w.q_i8 = a.take({B, Hq, nQB, kGpuBlockQ, D});
      w.k_i8 = a.take({B, Hkv, nKB, kGpuBlockK, D});
      if (p.fp8_pv()) w.v_f8 = a.take({B, Hkv, D, nKB, kGpuBlockK});
      if (p.split_v()) w.v_f8_lo = a.take({B, Hkv, D, nKB, kGpuBlockK});
    }
  }
  uint64_t total = 0;
  if (a.overflow || __builtin_add_overflow(a.top, uint64_t(255), &total)) {
    w.overflow = true;
    return w;
  }
  w.total = size_t(total & ~uint64_t(255));
  return w;
}

}  // namespace sparge
