// The work description shared by the attention kernel families: the common
// parameter block and which mask row (batch, query head, 128-row query block)
// a CTA computes, with its list of kept 64-key blocks.
#pragma once
#include <cmath>
#include <cstdint>

#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {
namespace attn {

// The parameter block every attention kernel family shares: the work lists,
// the output and LSE with their strides, the problem's sizes, and the
// preparation's scales (those a mainloop does not read stay null). A family
// with operands outside tensor maps (portable) adds their pointers around it.
// idx, cnt and order null: dense work (every visible block of every row: RowWork).
struct Params {
  const int32_t* idx;
  const int32_t* cnt;
  const int32_t* order;
  int causal;  // the problem's causality (dense work counts the visible blocks)
  void* out;
  int64_t out_stride[4];
  float* lse;
  int64_t lse_stride[3];
  int Hq, group, Lq, Lkv, nQB, nKB;
  int n_rows;            // B * Hq * nQB: the mask rows of the call
  int q_rows;            // query rows per CTA tile: 128 (a mask row), or the wide dense tiles'
                         // 192 (then nQB and n_rows count those tiles: sm90 Mainloop16::Wide)
  float scale_log2;      // scale * log2(e)
  int tma_store;         // the output goes out through shared memory and the tm_o tensor map
  int out_bf16;          // the output's 16-bit type (mainloops not templated on it)
  const float* q_scale;  // [BHq, nQB*128]  int8 Q.K^T
  const float* q_mu;     // [BHq, nQB*128]  int8 Q.K^T, written when an LSE is asked for
  const float* k_scale;  // [BHkv, nKB]     int8 Q.K^T
  const float* v_amax;   // [BHkv, Dk]      fp8 P.V
#ifdef SPARGE_SM90_TRACE
  unsigned long long* trace;  // sm90/trace.cuh (trace builds only)
#endif
};

// Host side: the parameter block of a call (tma_store left 0: a family sets
// it where it applies).
inline Params make_params(const AttnArgs& a) {
  const Problem& pb = a.prob;
  Params p{};
  p.idx = a.idx;
  p.cnt = a.cnt;
  p.order = a.order;
  p.causal = pb.causal ? 1 : 0;
  p.out = a.out.data;
  for (int i = 0; i < 4; ++i) p.out_stride[i] = a.out.stride[i];
  p.lse = a.lse.data;
  for (int i = 0; i < 3; ++i) p.lse_stride[i] = a.lse.stride[i];
  p.Hq = static_cast<int>(pb.Hq);
  p.group = static_cast<int>(pb.Hq / pb.Hkv);
  p.Lq = static_cast<int>(pb.Lq);
  p.Lkv = static_cast<int>(pb.Lkv);
  p.nQB = static_cast<int>(pb.nQB);
  p.nKB = static_cast<int>(pb.nKB);
  p.n_rows = static_cast<int>(pb.B * pb.Hq * pb.nQB);
  p.q_rows = kGpuBlockQ;
  p.scale_log2 = pb.scale * kLog2e;
  p.out_bf16 = pb.dtype == SPARGE_DTYPE_BFLOAT16 ? 1 : 0;
  p.q_scale = a.q_scale;
  p.q_mu = a.q_mu;
  p.k_scale = a.k_scale;
  p.v_amax = a.v_amax;
  return p;
}

// The mask row of this CTA (blockIdx.x indexes the work order): its batch,
// query head and 128-row query block, its K/V head, and its list of kept
// 64-key blocks (null for dense work, core/problem.hpp's dense_row and dense_blocks:
// blocks 0 .. n_tiles - 1). P holds order,
// cnt, idx, causal, Lq, Lkv, nQB, nKB, Hq and group.
struct RowWork {
  int row_id, bh, qb, b, h, hkv, bhkv, n_tiles;
  int q0;  // the tile's first query row: qb * p.q_rows
  const int32_t* tiles;

  template <class P>
  __device__ __forceinline__ explicit RowWork(const P& p) {
    const bool dense = p.idx == nullptr;
    set_row(p, dense ? dense_row(int(blockIdx.x), p.Hq, p.group, p.nQB, p.causal) : p.order[blockIdx.x]);
    n_tiles = dense ? dense_blocks(qb, p.causal, p.Lq, p.Lkv, p.nKB, p.q_rows) : p.cnt[row_id];
    tiles = dense ? nullptr : p.idx + int64_t(row_id) * p.nKB;
  }
  // Dense work: mask row `row` (persistent CTAs, persistent_row).
  template <class P>
  __device__ __forceinline__ RowWork(const P& p, int row) {
    set_row(p, row);
    n_tiles = dense_blocks(qb, p.causal, p.Lq, p.Lkv, p.nKB, p.q_rows);
    tiles = nullptr;
  }
  // The row's indices.
  template <class P>
  __device__ __forceinline__ void set_row(const P& p, int row) {
    row_id = row;
    bh = row_id / p.nQB;
    qb = row_id - bh * p.nQB;
    q0 = qb * p.q_rows;
    b = bh / p.Hq;
    h = bh - b * p.Hq;
    hkv = h / p.group;
    bhkv = b * (p.Hq / p.group) + hkv;
  }
  // Steps of kHalves listed blocks.
  template <int kHalves>
  __device__ __forceinline__ int steps() const {
    return (n_tiles + kHalves - 1) / kHalves;
  }
  // Key block of list entry t (t < n_tiles).
  __device__ __forceinline__ int listed(int t) const { return tiles != nullptr ? tiles[t] : t; }
  // Key block of half hh of step u; -1 past the end (an odd count, wide steps).
  template <int kHalves>
  __device__ __forceinline__ int block(int u, int hh) const {
    return (u * kHalves + hh < n_tiles) ? listed(u * kHalves + hh) : -1;
  }
};

// A mask row with no block to compute (a sparse row that lists none; a dense
// causal row that sees no key): its query rows use no key, so their output is
// zeros and their LSE -inf (docs/SEMANTICS.md). The CTA's nthreads threads
// write them and the CTA ends: no Q load, no shared memory, no barrier. out:
// the 16-bit output of the row's (batch, head), row stride sl elements; lse
// likewise (null: not asked for); rows q0 .. q0 + rows - 1 below Lq, d
// columns. 16-byte stores where the rows allow them, else 4-byte ones (CUDA
// plans require 4-byte aligned output rows and even head dims).
__device__ __forceinline__ void write_empty_row(void* out, int64_t sl, float* lse, int64_t lse_sl, int q0, int rows,
                                                int Lq, int d, int tid, int nthreads) {
  const int n = Lq - q0 < rows ? Lq - q0 : rows;
  if (n <= 0) return;
  char* o = static_cast<char*>(out) + 2 * int64_t(q0) * sl;
  const uintptr_t a = reinterpret_cast<uintptr_t>(o) | uintptr_t(sl * 2) | uintptr_t(d * 2);
  const bool wide = (a & 15) == 0;
  const int per_row = wide ? d / 8 : d / 2;
  for (int i = tid; i < n * per_row; i += nthreads) {
    const int r = i / per_row, c = i - r * per_row;
    char* dst = o + 2 * int64_t(r) * sl;
    if (wide)
      reinterpret_cast<uint4*>(dst)[c] = make_uint4(0u, 0u, 0u, 0u);
    else
      reinterpret_cast<uint32_t*>(dst)[c] = 0u;
  }
  if (lse != nullptr)
    for (int r = tid; r < n; r += nthreads) lse[int64_t(q0 + r) * lse_sl] = -INFINITY;
}

// The same for the row of w, with the output and LSE of the parameter block.
__device__ __forceinline__ void write_empty_row(const Params& p, const RowWork& w, int d, int tid, int nthreads) {
  const int64_t bh = int64_t(w.b) * p.out_stride[0] + int64_t(w.h) * p.out_stride[1];
  float* lse = p.lse != nullptr ? p.lse + int64_t(w.b) * p.lse_stride[0] + int64_t(w.h) * p.lse_stride[1] : nullptr;
  write_empty_row(static_cast<char*>(p.out) + 2 * bh, p.out_stride[2], lse, p.lse_stride[2], w.q0, p.q_rows, p.Lq, d,
                  tid, nthreads);
}

// Dense work on persistent CTAs (one per SM, each taking its rows in turn):
// the mask row of the k-th slot of CTA `cta` of `ctas`, -1 past the last, -2
// for a slot without a row. Non-causal: rows cta, cta + ctas, ... of
// dense_row's order (all rows equally long). Causal: units of two rows, query
// blocks nQB-1-r (long, first) and r (short) of one head, about nQB + 1
// blocks' work each, so that a static stride gives every CTA nearly the same
// work; unit cta + (k/2) * ctas, units group by group as dense_row orders rows
// (the short row of the middle unit of an odd nQB is the -2 slot).
__device__ __forceinline__ int persistent_row(const Params& p, int cta, int ctas, int k) {
  if (!p.causal) {
    const int64_t t = int64_t(cta) + int64_t(k) * ctas;
    return t < p.n_rows ? dense_row(int32_t(t), p.Hq, p.group, p.nQB, 0) : -1;
  }
  const int pairs = (p.nQB + 1) / 2;
  const int64_t unit = int64_t(cta) + int64_t(k / 2) * ctas;
  const int64_t per_group = int64_t(p.group) * pairs;
  if (unit >= int64_t(p.n_rows / p.nQB) * pairs) return -1;
  const int g = int(unit / per_group);
  const int j = int(unit - g * per_group);
  const int r = j / p.group, hh = j - r * p.group;
  const int Hkv = p.Hq / p.group;
  const int b = g / Hkv, hkv = g - b * Hkv;
  const bool second = (k & 1) != 0;
  if (second && r == p.nQB - 1 - r) return -2;
  return (b * p.Hq + hkv * p.group + hh) * p.nQB + (second ? r : p.nQB - 1 - r);
}

}  // namespace attn
}  // namespace cuda
}  // namespace sparge
