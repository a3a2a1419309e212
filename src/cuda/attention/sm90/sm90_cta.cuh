// The CTA skeleton shared by the sm_90a attention kernels (INT8_FP8, and the
// 16-bit P.V kernel of FP16 and INT8_FP16): which mask row a CTA computes, the
// start of the mbarrier ring, the producer loop, and the consumers'
// turn-taking around their wgmma batches.
#pragma once
#include <cstdint>

#include "cuda/attention/sm90/sm90_primitives.cuh"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {

constexpr int kTurnBar0 = 1;  // named barriers 1, 2: consumer turn-taking (0 is __syncthreads)
constexpr int kEpiBar0 = 4;   // named barriers 4, 5: a consumer warpgroup's staged output tile is complete

// Kernel parameters every sm_90a attention kernel takes: the work lists, the
// output and LSE with their strides, and the problem's sizes.
struct RowParams {
  const int32_t* idx;
  const int32_t* cnt;
  const int32_t* order;
  void* out;
  int64_t out_stride[4];
  float* lse;
  int64_t lse_stride[3];
  int Hq, group, Lq, Lkv, nQB, nKB;
  float scale_log2;  // scale * log2(e)
  int tma_store;     // the output goes out through shared memory and the tm_o tensor map
};

// Host side: RowParams from the attention arguments.
inline void fill_row_params(const AttnArgs& a, RowParams* r) {
  const Problem& pb = a.prob;
  r->idx = a.idx;
  r->cnt = a.cnt;
  r->order = a.order;
  r->out = a.out.data;
  for (int i = 0; i < 4; ++i) r->out_stride[i] = a.out.stride[i];
  r->lse = a.lse.data;
  for (int i = 0; i < 3; ++i) r->lse_stride[i] = a.lse.stride[i];
  r->Hq = static_cast<int>(pb.Hq);
  r->group = static_cast<int>(pb.Hq / pb.Hkv);
  r->Lq = static_cast<int>(pb.Lq);
  r->Lkv = static_cast<int>(pb.Lkv);
  r->nQB = static_cast<int>(pb.nQB);
  r->nKB = static_cast<int>(pb.nKB);
  r->scale_log2 = pb.scale * kLog2e;
  r->tma_store = 0;  // set by the launcher once the output's tensor map is encoded
}

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

// The dynamic shared memory, its base aligned to 1024 bytes (the 128B
// swizzle pattern of TMA and wgmma repeats every 1024 bytes; the allocation
// carries 1 KiB of slack), and the barriers at byte offset `bar`: full[kStages],
// empty[kStages], then the Q barrier.
template <int kStages>
struct SmemRing {
  uint8_t* base;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* qbar;
  __device__ __forceinline__ SmemRing(uint8_t* raw, int bar) {
    base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    full = reinterpret_cast<uint64_t*>(base + bar);
    empty = full + kStages;
    qbar = empty + kStages;
  }
};

// The mask row of this CTA (blockIdx.x indexes the work order): its batch,
// query head and 128-row query block, its K/V head, and its list of kept
// 64-key blocks. P holds order, cnt, idx, nQB, nKB, Hq and group.
struct RowWork {
  int row_id, bh, qb, b, h, hkv, bhkv, n_tiles;
  const int32_t* tiles;

  template <class P>
  __device__ __forceinline__ explicit RowWork(const P& p) {
    row_id = p.order[blockIdx.x];
    bh = row_id / p.nQB;
    qb = row_id - bh * p.nQB;
    b = bh / p.Hq;
    h = bh - b * p.Hq;
    hkv = h / p.group;
    bhkv = b * (p.Hq / p.group) + hkv;
    n_tiles = p.cnt[row_id];
    tiles = p.idx + int64_t(row_id) * p.nKB;
  }
  // Steps of kHalves listed blocks.
  template <int kHalves>
  __device__ __forceinline__ int steps() const {
    return (n_tiles + kHalves - 1) / kHalves;
  }
  // Key block of half hh of step u; -1 past the end (an odd count, wide steps).
  template <int kHalves>
  __device__ __forceinline__ int block(int u, int hh) const {
    return (u * kHalves + hh < n_tiles) ? tiles[u * kHalves + hh] : -1;
  }
};

// Thread 0, before the CTA-wide barrier: initialises the ring (`full`: one
// arrival plus the stage's bytes; `empty`: the 256 consumer threads) and the
// Q barrier, then issues Q (`load_q`) and stage 0 (`load_stage(0, blocks)`).
// The row's first list entries are read alongside its count (they are inside
// the row's nKB entries whatever the count), so the first stage waits for one
// global load after `order`, not two; the values past the count are dropped.
template <int kStages, int kHalves, class LoadQ, class LoadStage>
__device__ __forceinline__ void start_ring(const RowWork& w, int nKB, int n_steps, uint64_t* full, uint64_t* empty,
                                           uint64_t* qbar, LoadQ load_q, LoadStage load_stage) {
  int first[kHalves];
#pragma unroll
  for (int hh = 0; hh < kHalves; ++hh) first[hh] = (hh < nKB) ? w.tiles[hh] : -1;
  for (int s = 0; s < kStages; ++s) {
    mbar_init(&full[s], 1);
    mbar_init(&empty[s], 256);
  }
  mbar_init(qbar, 1);
  mbar_fence_init();
  // Q first (it needs the row only), then stage 0; the consumers wait for Q
  // even on an empty row.
  load_q();
  if (n_steps > 0) {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) first[hh] = (hh < w.n_tiles) ? first[hh] : -1;
    load_stage(0, first);
  }
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
