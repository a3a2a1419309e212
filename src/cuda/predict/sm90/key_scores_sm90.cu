// KEYS_LSE block scores on sm_90a: the function of key_scores.cu (docs/PREDICTION.md), with the
// score tiles from asynchronous wgmma so that the tensor cores work on the next key tile while the
// warps take the log-sum-exp of the current one.
//
// CTA: one or two warpgroups of 64 pooled rows (WG) x 32 key tiles of 64 (the rows, row order and
// key split of the mma.sync kernel). The pooled rows stay in registers as q' (rounded to K's 16-bit
// type, fp16 rows scaled by their power of two), the register A operand of the wgmmas, so that only
// K is read from shared memory (an m64n64k16 with both operands there needs 128 bytes per clock,
// all of the SM's shared-memory bandwidth); K tiles stream through a cp.async ring of kStages
// stages in the 128-byte-swizzle layout of 64-column blocks.
// Per key tile i a warpgroup issues the m64n64k16 wgmmas of tile i + 1 into its second accumulator
// set, waits for those of tile i and reduces tile i's accumulators (64 x 64 scores, per warp the
// m16n8 layout of ks::tile_row_scores): one tile of MMAs always in flight behind the exponentials.
// The ring: the barrier of step i makes tile i + 1 visible to every warpgroup and frees the stage
// of tile i - 1 (its wgmmas completed in step i - 1), which then receives tile i + kStages - 1.
// Causal: the CTA's tiles end at the extent of its last row; rows mask the keys past their own.
#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "cuda/attention/sm90/primitives.cuh"
#include "cuda/attention/sm90/wgmma_ops.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/key_scores.cuh"

namespace sparge {
namespace cuda {
namespace {

using ks::kKeys;

constexpr int kKCol = kKeys * 128;  // bytes per 64-column block of a K tile

// DEEP (one warpgroup, Dk = 128): 3 CTAs per SM of 4 stages instead of 4 of 3; the register cap
// rises from 128 to 168, so that nothing spills (at 4 CTAs, 196 KB of shared memory leave the spill
// loads too little L1: they miss and go to L2), and two tiles load during a step.
template <int DK, int WG, bool DEEP = false>
struct Ks90 {
  static_assert(DK == 64 || DK == 128, "wgmma block scores: Dk 64 or 128");
  static_assert(WG == 1 || WG == 2, "one or two warpgroups per CTA");
  static_assert(!DEEP || (WG == 1 && DK == 128), "DEEP: one warpgroup, Dk = 128");
  static constexpr int kThreads = 128 * WG;
  static constexpr int kRowsCta = 64 * WG;
  static constexpr int kStageBytes = (DK / 64) * kKCol;  // 8 KB / 16 KB
  // kStages - 2 tiles loading during a step; 2 CTAs per SM of two warpgroups, 4 of one (3 DEEP)
  static constexpr int kStages = (WG == 2 || DK == 64 || DEEP) ? 4 : 3;
  static constexpr int kMinBlocks = WG == 2 ? 2 : DEEP ? 3 : 4;
  // a thread's two rows reduced together where the registers allow it (ptxas, sm_90a: DEEP spills
  // nothing, Dk = 64 4 bytes for bf16 and 24 for fp16; the other Dk = 128 kernels would spill 88-120)
  static constexpr bool kPair = DEEP || DK == 64;
  // 1024-byte aligned stages (the swizzle pattern repeats every 8 rows of 128 bytes)
  static constexpr int kSmem = 1024 + kStages * kStageBytes;
};
template <int DK, class T, int WG>
using Loader90 = ks::TileLoader<DK, T, Ks90<DK, WG>::kThreads, 128, kKCol>;

template <int DK, class T>
__device__ __forceinline__ void issue_tile(float (&d)[32], const uint32_t (&qa)[DK / 16][4], uint64_t dk) {
#pragma unroll
  for (int kk = 0; kk < DK / 16; ++kk) {
    const uint32_t koff = (kk / 4) * kKCol + (kk % 4) * 32;
    sm90::Wgmma16<T>::template rs_m64nNk16<64>(d, qa[kk], dk + uint64_t(koff >> 4), kk > 0);
  }
}

// Per-thread state of the reduction: the thread's two rows (gq, gq + 8 of its warp's 16).
struct Rows90 {
  float fac[2], f2[2];
  int32_t last[2];   // last visible key (-1: none, or a padding row)
  float* out[2];     // score row (CtaWork::Row::out)
};

template <bool MASK, bool PAIR>
__device__ __forceinline__ void reduce_tile(const float (&d)[32], const Rows90& rw, int tq, int32_t j0, int64_t tile) {
  ks::tile_row_scores<MASK, PAIR>([&](int n, int i) { return d[4 * n + i]; }, tq, rw.last, j0, rw.fac, rw.f2, rw.out,
                                  tile);
}

template <int DK, class T, int WG, bool VEC, bool DEEP>
__global__ void __launch_bounds__(Ks90<DK, WG, DEEP>::kThreads, Ks90<DK, WG, DEEP>::kMinBlocks)
    key_scores_wgmma_kernel(const ks::Args a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  ks::reset_kept(a);
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tr = Ks90<DK, WG, DEEP>;
  constexpr int S = Tr::kStages;
  extern __shared__ __align__(128) unsigned char ks_smem[];
  const Problem& p = a.prob;
  const ks::CtaWork cw(a, Tr::kRowsCta);
  if (cw.ntiles == 0) return;  // uniform
  const int ntiles = cw.ntiles;
  const int64_t t_begin = cw.t_begin;

  unsigned char* sk = ks_smem + ((1024 - (sm90::smem_u32(ks_smem) & 1023)) & 1023);
  const uint32_t sk_u = sm90::smem_u32(sk);

  const Loader90<DK, T, WG> ld(a, cw.b, cw.hk);
  auto load_tile = [&](int i) {  // tile i of the CTA into stage i % S
    const int st = i % S;
    ld.template load<VEC>(int32_t(t_begin + i) * kKeys, sk_u + uint32_t(st * Tr::kStageBytes),
                          sk + st * Tr::kStageBytes);
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < ntiles) load_tile(s);
    portable::cp_async_commit();
  }

  // The thread's rows gq and gq + 8 of its warp's 16 (warp w: the CTA's rows 16 w ..; warpgroup
  // w / 4 multiplies rows 64 (w / 4) ..), their q' as the wgmma's register A fragments.
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  uint32_t qa[DK / 16][4];
  Rows90 rw;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const ks::CtaWork::Row rr = cw.row<DK>(a, cw.row0 + 16 * warp + gq + 8 * r);
    rw.out[r] = rr.out;
    rw.last[r] = rr.last;
    rw.fac[r] = ks::row_fragments<DK, T>(rr.pq, int(p.D), tq, p.scale, r, qa);
    rw.f2[r] = rw.fac[r] * 1.4426950408889634f;
  }

  portable::cp_async_wait<S - 2>();  // tile 0
  sm90::fence_proxy_async_smem();    // the generic-proxy cp.async writes before wgmma reads them
  __syncthreads();
  auto dk = [&](int i) { return sm90::make_smem_desc(sk + (i % S) * Tr::kStageBytes, sm90::kSwizzle128B, 1024); };

  // Every condition below around a wgmma or a read of its accumulators depends on the CTA alone
  // (a thread-dependent one makes ptxas serialize the wgmmas): every warpgroup multiplies every tile
  // of the CTA (with causality, a warpgroup's tiles past its own rows' extent are computed and not
  // written), and a tile is reduced without masks when the CTA's first row sees all of it.
  const int32_t kmin = ks::row_last_key(p, cw.qblock(a, cw.row0));
  float acc0[32], acc1[32];
  sm90::wgmma_fence();
  issue_tile<DK, T>(acc0, qa, dk(0));
  sm90::wgmma_commit();
  // Step i: tile i + 1 landed, the stage of tile i - 1 refilled, tile i + 1 into `nxt` (if it
  // exists), tile i's scores from `cur`. The loop is written so that the same accumulator set is in
  // flight at every merge of control paths (acc0 at the loop head), else ptxas serializes the wgmmas.
  auto ring = [&](int i) {
    portable::cp_async_wait<S - 3>();  // tile i + 1 landed (this thread's copies)
    sm90::fence_proxy_async_smem();
    __syncthreads();                   // ... everyone's; the wgmmas of tile i - 1 are complete
    if (i + S - 1 < ntiles) load_tile(i + S - 1);
    portable::cp_async_commit();
  };
  auto reduce = [&](int i, const float (&cur)[32]) {
    const int64_t tile = t_begin + i;
    const int32_t j0 = int32_t(tile * kKeys);
    if (j0 + kKeys - 1 <= kmin)
      reduce_tile<false, Tr::kPair>(cur, rw, tq, j0, tile);
    else
      reduce_tile<true, Tr::kPair>(cur, rw, tq, j0, tile);
  };
  auto step = [&](int i, float (&cur)[32], float (&nxt)[32]) {
    ring(i);
    sm90::wgmma_fence();
    issue_tile<DK, T>(nxt, qa, dk(i + 1));
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();
    sm90::fence_regs(cur);
    reduce(i, cur);
  };
  auto last = [&](int i, float (&cur)[32]) {
    sm90::wgmma_wait<0>();
    sm90::fence_regs(cur);
    reduce(i, cur);
  };
  for (int i = 0;; i += 2) {  // acc0 holds tile i, in flight
    if (i + 1 >= ntiles) {
      last(i, acc0);
      return;
    }
    step(i, acc0, acc1);
    if (i + 2 >= ntiles) {
      last(i + 1, acc1);
      return;
    }
    step(i + 1, acc1, acc0);
  }
#endif
}

}  // namespace

namespace ks {

// CTAs of rows_per_cta rows and `tiles` key tiles that have a visible tile (the others exit at once).
static int64_t active_ctas(const Args& a, int rows_per_cta, int tiles) {
  const Problem& p = a.prob;
  const int64_t row_ctas = ceil_div(a.rows, rows_per_cta);
  const int64_t g = p.Hq / p.Hkv;
  int64_t active = 0;
  for (int64_t rc = 0; rc < row_ctas; ++rc) {
    const int64_t last = std::min(a.rows, (rc + 1) * rows_per_cta) - 1;
    active += ceil_div(visible_key_blocks(p, row_qblock(a, last, g)), int64_t(tiles));
  }
  return active * p.B * p.Hkv;
}

// Key tiles per CTA: the most (up to kTiles, at least 4) that still fill the GPU's CTA slots in
// whole waves (active CTAs / slots at >= 90 % of the next whole number, or >= 2 waves), so that
// short or causal problems, whose CTAs would otherwise leave SMs idle in their only wave, run on
// more, shorter CTAs. From two waves on, longer CTAs (fewer prologues) beat a fuller last wave
// (32K causal, 2.4-3.2 waves of 32 tiles: -2 to -3 % against 16; docs/PERF-NOTES.md v49). A CTA
// with no visible tile exits at once and is not counted.
static int choose_tiles(const Args& a, int rows_per_cta, int slots) {
  int tiles = kTiles;
  for (; tiles > 4; tiles /= 2) {
    const double waves = double(active_ctas(a, rows_per_cta, tiles)) / double(std::max(slots, 1));
    if (waves >= 2.0 || waves >= 0.9 * std::ceil(waves)) break;
  }
  return tiles;
}

sparge_status_t launch_key_scores_sm90(Args a, bool vec, int sms, cudaStream_t stream, bool* ran) {
  const Problem& p = a.prob;
  *ran = false;
  sparge_status_t st = SPARGE_OK;
  cudaError_t err = cudaSuccess;
  // One warpgroup per CTA (64 rows, 4 CTAs per SM, or 3 DEEP) where it measured faster: Dk = 64,
  // causal (a CTA's tiles end at its own rows' extent, so fewer tiles past a row's extent are
  // multiplied), Dk = 128 problems that fill two waves of DEEP CTAs, and problems of at most 64
  // rows per kv head (a second warpgroup would multiply padding rows); two (128 rows: K read from
  // L2 half as often) for the other non-causal Dk = 128 problems (docs/PERF-NOTES.md v38, v42, v49).
  dispatch_dim_type(p.Dk, p.dtype, [&](auto dc, auto tt) {
    constexpr int DK = decltype(dc)::value;
    using T = typename decltype(tt)::type;
    if constexpr (DK == 64 || DK == 128) {
      auto run = [&](auto wgc, auto deepc) {
        constexpr int WG = decltype(wgc)::value;
        constexpr bool DEEP = decltype(deepc)::value;
        using Tr = Ks90<DK, WG, DEEP>;
        auto kern = vec ? key_scores_wgmma_kernel<DK, T, WG, true, DEEP> : key_scores_wgmma_kernel<DK, T, WG, false, DEEP>;
        const int64_t row_ctas = ceil_div(a.rows, Tr::kRowsCta);
        const int tiles = choose_tiles(a, Tr::kRowsCta, sms * Tr::kMinBlocks);
        const int64_t key_ctas = ceil_div(p.nKB, int64_t(tiles));
        const int64_t n = p.B * p.Hkv * row_ctas * key_ctas;
        if (n > int64_t(0x7fffffff)) {  // the caller checked the grid of kTiles per CTA
          st = fail(SPARGE_ERR_UNSUPPORTED, "key score grid too large");
          return;
        }
        a.row_ctas = uint32_t(row_ctas);
        a.key_ctas = uint32_t(key_ctas);
        a.tiles = uint32_t(tiles);
        st = ensure_smem_attr(reinterpret_cast<const void*>(kern), Tr::kSmem, p.device_id);
        if (st == SPARGE_OK) err = launch_pdl(kern, dim3(unsigned(n)), dim3(Tr::kThreads), size_t(Tr::kSmem), stream, a);
      };
      *ran = true;
      using I1 = std::integral_constant<int, 1>;
      using I2 = std::integral_constant<int, 2>;
      if constexpr (DK == 128) {
        using Deep = Ks90<DK, 1, true>;
        if (a.rows > 64 && active_ctas(a, Deep::kRowsCta, kTiles) >= 2 * int64_t(sms) * Deep::kMinBlocks) {
          // DEEP where the problem fills at least two whole waves of its 3 CTAs per SM with
          // kTiles-tile CTAs (32K causal: 1280 CTAs on 396 slots, 165 -> 154 us; non-causal
          // KEYS_LSE 212 -> 207 us and KEYS_LSE_SPLIT2 -8 %, though each K tile is read by twice
          // as many CTAs as with two warpgroups: docs/PERF-NOTES.md v49); shorter problems keep
          // 4 CTAs per SM, whose extra slots they need (8K causal: 28 us, 39 DEEP)
          run(I1{}, std::true_type{});
        } else if (p.causal || a.rows <= 64) {
          run(I1{}, std::false_type{});
        } else {
          run(I2{}, std::false_type{});
        }
      } else {
        run(I1{}, std::false_type{});
      }
    }
  });
  SPARGE_TRY(st);
  SPARGE_PDL_CHECK(err, "sparge per-key scores kernel (sm_90a)");
  return SPARGE_OK;
}

}  // namespace ks
}  // namespace cuda
}  // namespace sparge
