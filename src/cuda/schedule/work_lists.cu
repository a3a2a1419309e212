// Mask -> per-row index lists for the attention kernels: idx (kept and
// causally visible key blocks, ascending), cnt, and a work order: K/V group
// by group, the heaviest rows (largest cnt) first within a group.
#include "core/error.hpp"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/predict.cuh"

namespace sparge {
namespace cuda {
namespace {

constexpr int kListWarps = 8;

struct ListArgs {
  Problem prob;
  MaskView mask;
  int32_t* idx;  // [B*Hq, nQB, nKB]
  int32_t* cnt;  // [B*Hq, nQB]
};

// One warp per (bh, qb) row: ballot-compaction of the nonzero mask entries
// among the visible key blocks.
__global__ void __launch_bounds__(kListWarps * 32) mask_to_lists_kernel(const ListArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  const Problem& p = a.prob;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kListWarps + (threadIdx.x >> 5);
  if (row >= p.B * p.Hq * p.nQB) return;
  const int64_t qb = row % p.nQB, bh = row / p.nQB;
  const int64_t b = bh / p.Hq, h = bh % p.Hq;
  const int64_t V = visible_key_blocks(p, qb);
  const uint8_t* mrow = a.mask.data + a.mask.offset(b, h, qb, 0);
  const int64_t ms = a.mask.stride[3];
  int32_t* out = a.idx + row * p.nKB;
  const uint32_t lt = (1u << lane) - 1u;
  int base = 0;
  for (int64_t kb0 = 0; kb0 < V; kb0 += 128) {
    uint8_t m[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t kb = kb0 + 32 * u + lane;
      m[u] = kb < V ? mrow[kb * ms] : uint8_t(0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool on = m[u] != 0;
      const uint32_t bal = __ballot_sync(0xffffffffu, on);
      if (on) out[base + __popc(bal & lt)] = int32_t(kb0 + 32 * u + lane);
      base += __popc(bal);
    }
  }
  if (lane == 0) a.cnt[row] = base;
  // The read-ahead contract (kListReadAhead, cuda/common/internal.cuh): the
  // attention kernels read the first entries of every row (one per listed
  // block of their first step) before they know the count; give unused ones
  // a defined value.
  if (lane < kListReadAhead && lane >= base && lane < p.nKB) out[lane] = -1;
}

// Work order: group-major (one group = the query heads that share a K/V
// head, rows contiguous), heaviest rows first within a group. Rows that read
// the same K and V run at the same time and find their key tiles in L2, while
// within a group the long rows start first and short ones fill in behind.
// (Sorting all rows by cnt scattered the rows of a random or predicted mask
// over every head: at N = 8K, density 0.1, the attention kernel read 390 MB
// from DRAM for about 160 MB of operands and output.)
//
// One CTA per group: a counting sort of its rows by cnt, descending; rows of
// equal cnt keep no particular order among themselves.
constexpr int kOrderThreads = 512;

__global__ void __launch_bounds__(kOrderThreads) order_kernel(const int32_t* __restrict__ cnt, int64_t group_rows,
                                                              int nbins, int32_t* __restrict__ order) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  extern __shared__ int hist[];  // nbins = nKB + 1 counters
  __shared__ int wsum[kOrderThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t r0 = int64_t(blockIdx.x) * group_rows;
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

}  // namespace

sparge_status_t launch_mask_to_lists(const Plan& plan, const MaskView& mask, void* ws, cudaStream_t stream) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  if (L.idx == 0 || L.cnt == 0 || L.order == 0)
    return fail(SPARGE_ERR_INTERNAL, "CUDA index lists: workspace layout lacks idx/cnt/order");
  char* base = static_cast<char*>(ws);
  const int64_t rows = p.B * p.Hq * p.nQB;
  if (rows <= 0) return SPARGE_OK;
  if (rows > int64_t(0x7fffffff)) return fail(SPARGE_ERR_UNSUPPORTED, "too many query blocks");

  ListArgs la;
  la.prob = p;
  la.mask = mask;
  la.idx = ws_ptr<int32_t>(base, L.idx);
  la.cnt = ws_ptr<int32_t>(base, L.cnt);
  SPARGE_PDL_CHECK(launch_pdl(mask_to_lists_kernel, dim3(unsigned(ceil_div(rows, kListWarps))),
                              dim3(kListWarps * 32), 0, stream, la),
                   "sparge mask-to-lists kernel");

  const int nbins = int(p.nKB + 1);
  const size_t smem = size_t(nbins) * sizeof(int);
  // Once per kernel, size and device (cuda/common/launch.cuh; nothing up to 48 KB); the
  // backend made the plan's device current.
  SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(&order_kernel), int(smem), p.device_id));
  const int64_t groups = p.B * p.Hkv, group_rows = p.group() * p.nQB;
  SPARGE_PDL_CHECK(launch_pdl(order_kernel, dim3(unsigned(groups)), dim3(kOrderThreads), smem, stream,
                              static_cast<const int32_t*>(la.cnt), group_rows, nbins, ws_ptr<int32_t>(base, L.order)),
                   "sparge work-order kernel");
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
