// The CTA-level pieces of the sm_90a kernel skeleton (kernel.cuh): the
// tensor maps, the mbarrier ring and the producer loop, the consumers' turn-taking around their wgmma batches, and
// the TMA-store epilogue.
#pragma once
#include <cstdint>

#include <cuda.h>

#include "cuda/attention/common/work.cuh"
#include "cuda/attention/sm90/primitives.cuh"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {

using attn::Params;
using attn::RowWork;

constexpr int kTurnBar0 = 1;  // named barriers 1-3: consumer turn-taking (0 is __syncthreads; 3 only with
                              // three consumers, which the INT8_FP8 mainloop's barrier 3 never has)
constexpr int kEpiBar0 = 4;   // named barriers 4-6: a consumer warpgroup's staged output tile is complete

// The tensor maps a kernel reads (q, k, v, v2: the second V term of split V)
// and writes (o), passed as __grid_constant__ kernel parameters.
struct Maps {
  CUtensorMap q, k, v, v2, o;
};

// Epilogue through shared memory and a TMA store: a consumer warpgroup's
// 64 x D output tile. pair(c, half) gives the thread's two 16-bit values of
// columns 8c + 2 quad, +1 in row `half ? row1 : row0` (the accumulator
// layout). The tile is staged as D/64 blocks of 64 rows x 128 bytes, 128B
// swizzled (the layout of the output map's 64 x 64 box), block k at
// stage + k * block_stride (1024-byte aligned); the warpgroup's first thread
// stores the blocks and waits until they have been read (the CTA's shared
// memory must outlive the store). Conflict-free: the 8 rows of a warp's store
// land in 8 different 16-byte chunks. Rows past the tensor's end are clipped
// by the TMA unit.
template <int D, class Pair>
__device__ __forceinline__ void store_tile_tma(uint8_t* stage, int block_stride, const CUtensorMap* map, int cw,
                                               int tid, int row_base, int h, int b, Pair pair) {
  const int lane = tid & 31, quad = lane & 3;
  const int r0 = (tid / 32) * 16 + lane / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + 8 * half;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const int off = (c / 8) * block_stride + r * 128 + (((c % 8) ^ (r & 7)) * 16) + quad * 4;
      *reinterpret_cast<uint32_t*>(stage + off) = pair(c, half);
    }
  }
  fence_proxy_async_smem();
  named_bar_sync(kEpiBar0 + cw, 128);
  if (tid == 0) {
#pragma unroll
    for (int k = 0; k < D / 64; ++k) tma_store_4d(map, stage + k * block_stride, 64 * k, row_base, h, b);
    bulk_commit();
    bulk_wait_read_all();
  }
}

// One of four 32-bit values by a runtime index (selects, not local memory).
__device__ __forceinline__ uint32_t pick4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, int i) {
  const uint32_t lo = (i & 1) ? a1 : a0, hi = (i & 1) ? a3 : a2;
  return (i & 2) ? hi : lo;
}

// Direct 16-byte stores of a warpgroup's rows. A quad of threads holds rows
// row0 and row1, columns 8c .. 8c+7 as 2-column pairs (thread `quad`: columns
// 8c + 2 quad, +1); for every 16 columns (c, c + 1) the quad transposes its
// 4 x 4 values (V[k], k = 2 j + half: column group c + j) with three xor
// shuffles, so that thread q holds the 8 columns of group c + (q >> 1) in row
// (q & 1 ? row1 : row0) and writes them with one store: whole 32-byte sectors
// and a quarter of the 4-byte stores' instructions. Every thread of the warp
// takes part (ok0 / ok1 only guard the stores: rows past Lq).
template <int Dout, class Pair>
__device__ __forceinline__ void store_rows16(char* orow0, char* orow1, bool ok0, bool ok1, int quad, Pair pair) {
  static_assert(Dout % 16 == 0, "16-byte direct stores: head dims that are multiples of 16");
  const int mine = quad & 1;
  char* dst = mine ? orow1 : orow0;
  const bool ok = mine ? ok1 : ok0;
#pragma unroll
  for (int c = 0; c < Dout / 8; c += 2) {
    const uint32_t v0 = pair(c, 0), v1 = pair(c, 1), v2 = pair(c + 1, 0), v3 = pair(c + 1, 1);
    // Round r: this thread receives V_{quad^r}[quad] and sends V[quad^r].
    uint32_t g[4];
    g[0] = pick4(v0, v1, v2, v3, quad);
#pragma unroll
    for (int r = 1; r < 4; ++r) g[r] = __shfl_xor_sync(0xffffffffu, pick4(v0, v1, v2, v3, quad ^ r), r);
    // Column pair s of the group came from thread s, in round s ^ quad.
    const uint4 o = make_uint4(pick4(g[0], g[1], g[2], g[3], quad), pick4(g[0], g[1], g[2], g[3], 1 ^ quad),
                               pick4(g[0], g[1], g[2], g[3], 2 ^ quad), pick4(g[0], g[1], g[2], g[3], 3 ^ quad));
    if (ok) *reinterpret_cast<uint4*>(dst + 16 * (c + (quad >> 1))) = o;
  }
}

// A consumer warpgroup's output rows and their LSE: the tile through the
// TMA store (`tma`: staged at `stage`, see store_tile_tma) or by direct
// stores of the first Dout columns (16-byte ones, store_rows16, where the
// output's base and strides are multiples of 16 bytes; else 4-byte ones); Dk
// is the accumulator's width (columns past Dout are padding, clipped by the
// output map). pair(c, half)
// as for store_tile_tma; shift(half) is added to the row's LSE (the
// smoothing shift q.mu of the int8 modes).
template <int Dk, int Dout, class SM, class Pair, class Shift>
__device__ __forceinline__ void write_output(const Params& p, const SM& sm, int b, int h, int cw, int tid, bool tma,
                                             uint8_t* stage, int stage_stride, const CUtensorMap* map, Pair pair,
                                             Shift shift) {
  if (tma) store_tile_tma<Dk>(stage, stage_stride, map, cw, tid, sm.wg_row_min, h, b, pair);
  auto out_row = [&](int row) {
    return static_cast<char*>(p.out) +
           2 * (int64_t(b) * p.out_stride[0] + int64_t(h) * p.out_stride[1] + int64_t(row) * p.out_stride[2]);
  };
  bool rows16 = false;
  if constexpr (Dout % 16 == 0) {
    rows16 = !tma && ((reinterpret_cast<uintptr_t>(p.out) | uintptr_t(p.out_stride[0] * 2) |
                       uintptr_t(p.out_stride[1] * 2) | uintptr_t(p.out_stride[2] * 2)) & 15) == 0;
    if (rows16) store_rows16<Dout>(out_row(sm.row0), out_row(sm.row1), sm.row0 < p.Lq, sm.row1 < p.Lq, sm.quad, pair);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = half ? sm.row1 : sm.row0;
    if (row >= p.Lq) continue;
    if (!tma && !rows16) {
      char* orow = out_row(row);
#pragma unroll
      for (int c = 0; c < Dout / 8; ++c)
        *reinterpret_cast<uint32_t*>(orow + 2 * (8 * c + 2 * sm.quad)) = pair(c, half);
    }
    if (p.lse != nullptr && sm.quad == 0)
      p.lse[int64_t(b) * p.lse_stride[0] + int64_t(h) * p.lse_stride[1] + int64_t(row) * p.lse_stride[2]] =
          sm.lse(half, shift(half));
  }
}

// The dynamic shared memory, its base aligned to 1024 bytes (the 128B
// swizzle pattern of TMA and wgmma repeats every 1024 bytes; the allocation
// carries 1 KiB of slack), and the ring's barriers at byte offset `bar`:
// full[kStages], empty[kStages], with kSplit fullv[kStages], emptyv[kStages],
// then the Q barrier (persistent CTAs: qfull[2], qempty[2]).
// One pair per stage guards its K and V together: the consumers release the
// stage once P.V has read V. kSplit: K and V have pairs of their own (full /
// empty guard K), so K's slot is free once Q.K^T has read it, a step before V's,
// and two stages cover the loads (persistent CTAs at D = 128, PersistLayout).
// Steps are counted by g across the ring (stage g % kStages, phase
// (g / kStages) & 1).
template <int kStages, bool kSplit = false>
struct SmemRing {
  static constexpr int kStagesC = kStages;
  static constexpr int kBarriers = (kSplit ? 4 : 2) * kStages;
  uint8_t* base;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* fullv;   // kSplit only (else full)
  uint64_t* emptyv;  // kSplit only (else empty)
  uint64_t* qbar;
  __device__ __forceinline__ SmemRing(uint8_t* raw, int bar) {
    base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    full = reinterpret_cast<uint64_t*>(base + bar);
    empty = full + kStages;
    fullv = kSplit ? empty + kStages : full;
    emptyv = kSplit ? fullv + kStages : empty;
    qbar = full + kBarriers;
  }
  // Thread 0: the ring's barriers (full: one arrival plus the bytes; empty:
  // the `consumers` threads).
  __device__ __forceinline__ void init(int consumers) const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumers);
      if constexpr (kSplit) {
        mbar_init(&fullv[s], 1);
        mbar_init(&emptyv[s], consumers);
      }
    }
  }
  // The consumers' side, by step: step g's K (and, unsplit, V) loaded; its V
  // loaded (split); K read by Q.K^T (split); V read by P.V (frees the stage
  // unsplit).
  __device__ __forceinline__ void wait_k(int g) const { mbar_wait(&full[g % kStages], (g / kStages) & 1); }
  __device__ __forceinline__ void wait_v(int g) const {
    if constexpr (kSplit) mbar_wait(&fullv[g % kStages], (g / kStages) & 1);
  }
  __device__ __forceinline__ void release_k(int g) const {
    if constexpr (kSplit) mbar_arrive(&empty[g % kStages]);
  }
  __device__ __forceinline__ void release_v(int g) const { mbar_arrive(&emptyv[g % kStages]); }
};

// Thread 0, before the CTA-wide barrier: initialises the ring (SmemRing::init)
// and the Q barrier, then issues Q (`load_q`) and stage 0 (`load_stage(0,
// blocks)`).
// The row's first list entries are read alongside its count (they are inside
// the row's nKB entries whatever the count), so the first stage waits for one
// global load after `order`, not two; the values past the count are dropped.
template <int kHalves, class Ring, class LoadQ, class LoadStage>
__device__ __forceinline__ void start_ring(const RowWork& w, int nKB, int consumers, const Ring& ring,
                                           LoadQ load_q, LoadStage load_stage) {
  int first[kHalves];
#pragma unroll
  for (int hh = 0; hh < kHalves; ++hh) first[hh] = (hh < nKB) ? w.listed(hh) : -1;
  ring.init(consumers);
  mbar_init(ring.qbar, 1);
  mbar_fence_init();
  // Q first (it needs the row only), then stage 0 (n_steps > 0: an empty row
  // never gets here, row_cta).
  load_q();
#pragma unroll
  for (int hh = 0; hh < kHalves; ++hh) first[hh] = (hh < w.n_tiles) ? first[hh] : -1;
  load_stage(0, first);
}

// The producer thread after the barrier: stages 1.. of the row, each into the
// ring slot freed by the consumers.
template <int kStages, int kHalves, class LoadStage>
__device__ __forceinline__ void produce(const RowWork& w, int n_steps, uint64_t* empty, LoadStage load_stage) {
  for (int u = 1; u < n_steps; ++u) {
    const int s = u % kStages;
    if (u >= kStages) mbar_wait(&empty[s], ((u / kStages) - 1) & 1);
    int kbh[kHalves];
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) kbh[hh] = w.block<kHalves>(u, hh);
    load_stage(s, kbh);
  }
}

// A consumer warpgroup's turn: wait for it and fence the registers its
// wgmmas read; `turn_end` hands the turn to the other warpgroup once this
// one's batch is issued.
__device__ __forceinline__ void turn_begin(int me) {
  named_bar_sync(kTurnBar0 + me, 256);
  wgmma_fence();
}
__device__ __forceinline__ void turn_end(int other) { named_bar_arrive(kTurnBar0 + other, 256); }

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
