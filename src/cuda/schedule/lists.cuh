// Mask -> per-row index lists for the attention kernels (device code of
// work_lists.cu and of the preparation's launches, prepare.cu): idx (kept and
// causally visible key blocks, ascending), cnt, and a work order: K/V group by
// group, the heaviest rows (largest cnt) first within a group.
#pragma once
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {
namespace lists {

constexpr int kListWarps = 8;

struct ListArgs {
  Problem prob;
  MaskView mask;
  int32_t* idx;  // [B*Hq, nQB, nKB]
  int32_t* cnt;  // [B*Hq, nQB]
};

// One warp: the index list of one row, out[0..cnt) = the key blocks kb < V
// with flag(kb) != 0, ascending (ballot compaction); *cnt_out = cnt.
template <class Flag>
__device__ __forceinline__ void emit_list(Flag&& flag, int64_t V, int64_t nKB, int32_t* out, int32_t* cnt_out) {
  const int lane = threadIdx.x & 31;
  const uint32_t lt = (1u << lane) - 1u;
  int base = 0;
  for (int64_t kb0 = 0; kb0 < V; kb0 += 128) {
    uint8_t m[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t kb = kb0 + 32 * u + lane;
      m[u] = kb < V ? flag(kb) : uint8_t(0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool on = m[u] != 0;
      const uint32_t bal = __ballot_sync(0xffffffffu, on);
      if (on) out[base + __popc(bal & lt)] = int32_t(kb0 + 32 * u + lane);
      base += __popc(bal);
    }
  }
  if (lane == 0) *cnt_out = base;
  // The read-ahead contract (kListReadAhead, cuda/common/internal.cuh): the
  // attention kernels read the first entries of every row (one per listed
  // block of their first step) before they know the count; give unused ones
  // a defined value.
  if (lane < kListReadAhead && lane >= base && lane < nKB) out[lane] = -1;
}

// One warp per (bh, qb) row: the list of the nonzero mask entries among the
// visible key blocks.
__device__ __forceinline__ void mask_to_lists(const ListArgs& a, uint32_t cta) {
  const Problem& p = a.prob;
  const int64_t row = int64_t(cta) * kListWarps + (threadIdx.x >> 5);
  if (row >= p.B * p.Hq * p.nQB) return;
  const int64_t qb = row % p.nQB, bh = row / p.nQB;
  const int64_t b = bh / p.Hq, h = bh % p.Hq;
  const uint8_t* mrow = a.mask.data + a.mask.offset(b, h, qb, 0);
  const int64_t ms = a.mask.stride[3];
  emit_list([&](int64_t kb) { return mrow[kb * ms]; }, visible_key_blocks(p, qb), p.nKB, a.idx + row * p.nKB,
            a.cnt + row);
}

// Work order: group-major (one group = the query heads that share a K/V
// head, rows contiguous), heaviest rows first within a group. Rows that read
// the same K and V run at the same time and find their key tiles in L2, while
// within a group the long rows start first and short ones fill in behind.
// (Sorting all rows by cnt scattered the rows of a random or predicted mask
// over every head: at N = 8K, density 0.1, the attention kernel read 390 MB
// from DRAM for about 160 MB of operands and output.)
//
// One CTA of NT threads per group: a counting sort of its rows by cnt,
// descending; rows of equal cnt keep no particular order among themselves.
// hist: nbins = nKB + 1 counters of shared memory.
struct OrderArgs {
  const int32_t* cnt;
  int64_t group_rows;
  int nbins;
  int32_t* order;
};

template <int NT>
__device__ __forceinline__ void order_rows(const OrderArgs& a, uint32_t group, int* hist) {
  constexpr int kOrderThreads = NT;
  __shared__ int wsum[kOrderThreads / 32];
  const int32_t* __restrict__ cnt = a.cnt;
  int32_t* __restrict__ order = a.order;
  const int64_t group_rows = a.group_rows;
  const int nbins = a.nbins;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r0 = int64_t(group) * group_rows;
  cnt += r0;
  order += r0;
  for (int i = tid; i < nbins; i += kOrderThreads) hist[i] = 0;
  __syncthreads();
  for (int64_t r = tid; r < group_rows; r += kOrderThreads) atomicAdd(&hist[cnt[r]], 1);
  __syncthreads();
  // exclusive scan in descending cnt order: start[k] = sum of hist[k'] for k' > k.
  // Thread t owns the reversed bins u in [t*seg, (t+1)*seg), bin k = nbins-1-u.
  const int seg = (nbins + kOrderThreads - 1) / kOrderThreads;
  const int u0 = min(nbins, tid * seg), u1 = min(nbins, u0 + seg);
  int local = 0;
  for (int u = u0; u < u1; ++u) local += hist[nbins - 1 - u];
  int x = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int w = 0; w < kOrderThreads / 32; ++w) {
      const int s = wsum[w];
      wsum[w] = run;
      run += s;
    }
  }
  __syncthreads();
  int run = wsum[warp] + x - local;
  for (int u = u0; u < u1; ++u) {
    const int k = nbins - 1 - u;
    const int c = hist[k];
    hist[k] = run;
    run += c;
  }
  __syncthreads();
  for (int64_t r = tid; r < group_rows; r += kOrderThreads) {
    const int pos = atomicAdd(&hist[cnt[r]], 1);
    order[pos] = int32_t(r0 + r);
  }
}

// Host side (work_lists.cu): the arguments of both kernels for `mask`, the
// CTA count of mask_to_lists (8 rows each) and of order_rows (one per group);
// and the order kernel launched on its own (after the lists are complete).
sparge_status_t list_args(const Plan& plan, const MaskView& mask, void* ws, ListArgs* la, OrderArgs* oa,
                          int64_t* list_ctas, int64_t* groups);
sparge_status_t launch_order(const Plan& plan, const OrderArgs& oa, int64_t groups, cudaStream_t stream);

}  // namespace lists
}  // namespace cuda
}  // namespace sparge
