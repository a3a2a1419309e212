// Block scores of the estimator KEYS_LSE on the tensor cores (mma.sync, sm_80 and newer; on a
// device that runs the sm90 family, sm90/key_scores_sm90.cu's wgmma kernel takes Dk 64 and 128):
//   scores[bh, qb, kb] = log sum_j exp(float32(scale * q'[bh, qb] . k_j))
// over the keys j of block kb that the last row of qb sees, q' the pooled query row rounded once
// to K's 16-bit type (docs/SEMANTICS.md, "Mask prediction").
//
// Work: per kv head, the g = Hq/Hkv heads' pooled query rows (g*nQB rows of Dk float32) times
// K^T (Dk x Lkv, the caller's 16-bit keys), then one log-sum-exp per (row, 64-key block).
//
// Precision. The float32 pooled row q goes into the MMA as a single term q' = rn16(q): bf16 rounds
// to nearest even; fp16 first multiplies the row by a power of two 2^s (exact) that puts its
// largest finite |q_c| in [2^14, 2^15), so that no entry overflows and only entries more than 2^28
// times smaller than the largest fall into the fp16 subnormals (s = 15 - e for 2^(e-1) <= max < 2^e,
// clamped to [-64, 64], 0 for a zero or non-finite maximum, NaN entries ignored). K is exact in its
// 16-bit type, every product q'_c k_c is exact in float32, the m16n8k16 MMA accumulates in float32,
// and the per-row factor scale * 2^-s (exact) undoes the scaling. This is the CPU reference's
// function (src/cpu/predict.cpp) up to the float32 accumulation: the rounding of q itself, a
// relative error of at most 2^-8 (bf16) or 2^-11 (fp16) per entry, is part of the definition, not
// an error against it. The factor is folded into the exponentials, f = scale * 2^-s * log2(e):
// first ln(sum 2^(acc * f)) (ex2.approx, relative error ~2^-22), kept where every row sum of the
// warp is in [2^-100, 2^100]; otherwise the row's max m over its raw accumulators (scale > 0),
// 2^(acc * f - m * f) and m * scale * 2^-s + ln(sum) (ks::tile_row_scores).
//
// Non-finite values (docs/SEMANTICS.md, "Non-finite values"): a NaN key score (a NaN in k or in
// the pooled row, or 0 * inf) makes the block score NaN, and a +Inf one makes it NaN too
// (inf - inf), so the selection keeps every visible block of the row. A -Inf key score (an
// infinite k element against a pooled entry of the other sign) has weight exp(-inf) = 0 in its
// block; a block whose visible scores are all -Inf gets -Inf, which is non-finite too. An infinite
// k element meets q as one product q'_c k_c, as in the CPU reference (NaN exactly where q'_c is
// 0), so both backends agree on these cases. Keys past Lkv and keys the row does not see are
// excluded (zero-filled by the loads, masked before the reduction).
//
// CTA: 128 pooled rows (row r of a kv head's g*nQB rows is query block r / g of head hk*g + r % g,
// so the query heads sharing K go through one CTA and rows of one CTA have nearly the same causal
// extent), 32 tiles of 64 keys streamed through a cp.async ring (16-byte copies, zero-fill past
// Lkv and past the head dim; scalar loads when K is not 16-byte aligned). A warp owns kMt
// consecutive 16-row MMA tiles (Dk <= 128: 2, so 4 warps; Dk = 256: 1, 8 warps): their A
// fragments stay in registers for the whole key range, and every B fragment of K (ldmatrix from an
// XOR-swizzled tile) feeds kMt MMAs. Per tile a warp computes the whole 16 kMt x 64 score tile in
// registers (Dk/16 k-steps x 8 n-tiles per row tile), sums each row's exponentials (as a tree) and
// merges the sums over the 4 lanes of its quad (the max-shifted pass where a sum is out of range):
// no running state across tiles.
// Tiles that every row of the warp sees whole skip the masking. With causality a warp skips the
// tiles past its rows' extent, and the tiles past the extent of its first row tile multiply the
// second one only (the CTA loads them for its other warps). CTAs are ordered row chunk fastest, so
// the CTAs reading the same keys run together and share them through L2.
#include "core/error.hpp"
#include "cuda/common/launch.cuh"
#include "cuda/predict/key_scores.cuh"
#include "cuda/predict/predict.cuh"
#include "cuda/registry/registry.hpp"

namespace sparge {
namespace cuda {
namespace {

using ks::kKeys;
using ks::kRows;
using ks::kTiles;

template <int DK>
struct KsTraits {
  static_assert(DK % 64 == 0, "kernel head dim: a multiple of 64");
  static constexpr int kSteps = DK / 16;                 // k16 steps of the MMA
  static constexpr int kRowBytes = DK * 2;
  static constexpr int kStageBytes = kKeys * kRowBytes;
  static constexpr int kStages = DK <= 128 ? 3 : 2;
  static constexpr int kSmem = kStages * kStageBytes;    // 24 KB at DK = 64, 48 KB at 128, 64 KB at 256
  // 16-row MMA tiles per warp: A fragments 4 * kSteps registers per tile, accumulators 32 per tile.
  // (DK == 64 ? 2 : 1, i.e. 8 warps of 16 rows at DK = 128, also builds without spills: the variant
  // to compare against, docs/PERF-NOTES.md v35.)
  static constexpr int kMt = DK <= 128 ? 2 : 1;
  static constexpr int kWarps = kRows / (16 * kMt);
  static constexpr int kThreads = 32 * kWarps;
  // CTAs per SM the registers are budgeted for (65536 / (kThreads * kMinBlocks) per thread)
  static constexpr int kMinBlocks = DK == 64 ? 3 : DK == 128 ? 2 : 1;
};
template <int DK, class T>
using Loader = ks::TileLoader<DK, T, KsTraits<DK>::kThreads, KsTraits<DK>::kRowBytes, 128>;

using portable::cp_async_commit;
using portable::cp_async_wait;
using portable::ldsm_x4;
using portable::Mma;
using portable::smem_u32;

// A warp's rows: kMt tiles of 16, the thread's rows gq and gq + 8 of each.
template <int DK, class T>
struct WarpRows {
  using Tr = KsTraits<DK>;
  static constexpr int KS = Tr::kSteps, MT = Tr::kMt;
  uint32_t a[MT][KS][4];  // A fragments of q': (ks, {rows gq / gq+8 x columns c, c+1; the same x c+8, c+9})
  float fac[MT][2];       // scale * 2^-s
  float f2[MT][2];        // fac * log2(e)
  int32_t last[MT][2];    // last visible key of the row (-1: none, or a padding row)
  float* out[MT][2];      // score row (ks::CtaWork::Row::out)

  // The score tile of key tile `tile` (keys j0..j0+63, in shared memory at sbase + this lane's
  // ldmatrix row) for row tiles M0..MT-1, and its block scores. MASK: some row does not see every
  // key of the tile (causal extent, or keys past Lkv).
  template <int M0, bool MASK>
  __device__ __forceinline__ void tile_scores(uint32_t sbase, int lsel, int lxor, int tq, int32_t j0,
                                              int64_t tile) const {
    // acc[mt][n][2r + e]: row gq + 8r of tile mt, key 8n + 2tq + e
    float acc[MT][8][4];
#pragma unroll
    for (int mt = M0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][n][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint32_t coff = uint32_t(((2 * ks + lsel) ^ lxor) << 4);
      uint32_t bf[4][4];  // keys 16 np .. 16 np + 15
#pragma unroll
      for (int np = 0; np < 4; ++np) ldsm_x4(sbase + uint32_t(np * 16 * Tr::kRowBytes) + coff, bf[np]);
#pragma unroll
      for (int np = 0; np < 4; ++np)
#pragma unroll
        for (int mt = M0; mt < MT; ++mt) {
          Mma<T>::run(acc[mt][2 * np], a[mt][ks], bf[np][0], bf[np][1]);
          Mma<T>::run(acc[mt][2 * np + 1], a[mt][ks], bf[np][2], bf[np][3]);
        }
    }
#pragma unroll
    for (int mt = M0; mt < MT; ++mt)
      ks::tile_row_scores<MASK, false>([&](int n, int i) { return acc[mt][n][i]; }, tq, last[mt], j0, fac[mt],
                                       f2[mt], out[mt], tile);
  }
};

template <int DK, class T, bool VEC>
__global__ void __launch_bounds__(KsTraits<DK>::kThreads, KsTraits<DK>::kMinBlocks)
    key_scores_mma_kernel(const ks::Args a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  ks::reset_kept(a);
  using Tr = KsTraits<DK>;
  constexpr int MT = Tr::kMt;
  extern __shared__ __align__(128) unsigned char ks_smem[];
  const Problem& p = a.prob;
  const ks::CtaWork cw(a, kRows);
  if (cw.ntiles == 0) return;  // uniform
  const uint32_t b = cw.b, hk = cw.hk;
  const int64_t row0 = cw.row0, t_begin = cw.t_begin;
  const int ntiles = cw.ntiles;

  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  // Per row tile of the warp: its extent (tiles past it are loaded for the other warps but not
  // multiplied; a tile of padding rows only takes the extent of the tile before it, so that the
  // extents do not decrease in mt), and the last visible key of the warp's first row, the smallest
  // of its rows (a key tile up to it needs no mask).
  int64_t mvis[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mvis[mt] = cw.extent(a, row0 + 16 * (MT * warp + mt), 16);
    if (mt > 0) mvis[mt] = max(mvis[mt], mvis[mt - 1]);
  }
  const int64_t wfirst = row0 + 16 * MT * warp;
  const int32_t kmin = wfirst < cw.nrows ? ks::row_last_key(p, cw.qblock(a, wfirst)) : -1;

  const uint32_t smem0 = smem_u32(ks_smem);
  const Loader<DK, T> ld(a, b, hk);
  // prologue: the first stages of K in flight while the A fragments are built
#pragma unroll
  for (int s = 0; s < Tr::kStages - 1; ++s) {
    if (s < ntiles)
      ld.template load<VEC>(int32_t(t_begin + s) * kKeys, smem0 + s * Tr::kStageBytes,
                            ks_smem + s * Tr::kStageBytes);
    cp_async_commit();
  }

  const int gq = lane >> 2, tq = lane & 3;  // group (row) and thread-in-group of the MMA fragments
  const int D = int(p.D);

  WarpRows<DK, T> wr;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const ks::CtaWork::Row rr = cw.row<DK>(a, row0 + 16 * (MT * warp + mt) + gq + 8 * r);
      wr.out[mt][r] = rr.out;
      wr.last[mt][r] = rr.last;
      const float fac = ks::row_fragments<DK, T>(rr.pq, D, tq, p.scale, r, wr.a[mt]);
      wr.fac[mt][r] = fac;
      wr.f2[mt][r] = fac * 1.4426950408889634f;
    }

  // ldmatrix.x4 rows of this lane: keys 16 np + 8 (lane >> 4) + (lane & 7), chunk 2 ks + ((lane >> 3) & 1)
  const uint32_t lrow = uint32_t((8 * (lane >> 4) + (lane & 7)) * Tr::kRowBytes);
  const int lsel = (lane >> 3) & 1, lxor = lane & 7;

  int stage = 0;
  for (int i = 0; i < ntiles; ++i) {
    cp_async_wait<Tr::kStages - 2>();
    __syncthreads();  // tile i landed for every thread; the stage of tile i-1 is free
    {
      const int nx = i + Tr::kStages - 1;
      int ns = stage + Tr::kStages - 1;
      if (ns >= Tr::kStages) ns -= Tr::kStages;
      if (nx < ntiles)
        ld.template load<VEC>(int32_t(t_begin + nx) * kKeys, smem0 + ns * Tr::kStageBytes,
                              ks_smem + ns * Tr::kStageBytes);
      cp_async_commit();
    }
    const uint32_t sbase = smem0 + uint32_t(stage * Tr::kStageBytes) + lrow;
    if (++stage == Tr::kStages) stage = 0;
    const int64_t tile = t_begin + i;
    if (tile >= mvis[MT - 1]) continue;  // warp-uniform; the next iteration's barrier is still reached
    const int32_t j0 = int32_t(tile * kKeys);
    if constexpr (MT == 2) {
      if (tile >= mvis[0]) {  // past the first row tile's extent (causal): the second tile only
        wr.template tile_scores<1, true>(sbase, lsel, lxor, tq, j0, tile);
        continue;
      }
    }
    if (j0 + kKeys - 1 <= kmin)
      wr.template tile_scores<0, false>(sbase, lsel, lxor, tq, j0, tile);
    else
      wr.template tile_scores<0, true>(sbase, lsel, lxor, tq, j0, tile);
  }
}

}  // namespace

sparge_status_t launch_key_scores(const Plan& plan, const Tensor4& k, void* ws, cudaStream_t stream,
                                  const KeptRef* kept, bool* kept_zeroed, sparge_estimator_t est) {
  if (kept_zeroed) *kept_zeroed = false;
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  if (p.BK != kKeys)
    return fail(SPARGE_ERR_UNSUPPORTED, "estimator KEYS_LSE on CUDA needs block_k = %d, got %lld", kKeys,
                (long long)p.BK);
  char* base = static_cast<char*>(ws);
  ks::Args ka;
  ka.prob = p;
  ka.k = k;
  const bool split2 = grouped_estimator(est);
  ka.sub = split2 ? 2 : 1;
  ka.pooled_q = ws_ptr<float>(base, split2 ? L.split_q : L.pooled_q);
  ka.scores = ws_ptr<float>(base, L.scores);
  ka.scores2 = split2 ? ws_ptr<float>(base, L.idx) : nullptr;  // int32 lists later: the same size
  ka.rows = p.group() * p.nQB * ka.sub;
  ka.kept = kept ? *kept : KeptRef{nullptr, 0, 0};
  if (est == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE) {  // the grid is sized for every row; CTAs past a list exit
    ka.list = ws_ptr<int32_t>(base, L.split_rows);
    ka.list_n = ws_ptr<int32_t>(base, L.split_cnt);
  }
  // The grid for the smallest CTA (64 rows) is checked once for both kernels.
  const int64_t key_ctas = ceil_div(p.nKB, kTiles);
  if (p.B * p.Hkv * key_ctas <= 0 || ka.rows <= 0) return SPARGE_OK;
  if (p.B * p.Hkv * ceil_div(ka.rows, 64) * key_ctas > int64_t(0x7fffffff))
    return fail(SPARGE_ERR_UNSUPPORTED, "key score grid too large");
  ka.key_ctas = uint32_t(key_ctas);
  ka.tiles = kTiles;
  const int64_t row_ctas = ceil_div(ka.rows, kRows);
  const int64_t n = p.B * p.Hkv * row_ctas * key_ctas;
  ka.row_ctas = uint32_t(row_ctas);
  // 16-byte copies need a 16-byte aligned base and row/head/batch strides of multiples of 8 elements
  bool vec = reinterpret_cast<uintptr_t>(k.data) % 16 == 0;
  for (int d = 0; d < 3; ++d)
    if (k.shape[d] > 1 && k.stride[d] % 8 != 0) vec = false;
  cudaError_t err = cudaSuccess;
  sparge_status_t st = SPARGE_OK;
  // The wgmma kernel where the plan runs the sm90 family (SPARGE_KERNEL_FAMILY=portable: this one).
#if defined(SPARGE_WITH_SM90)
  Family fam;
  if (family_for_device(plan.sm_version, &fam) && fam == Family::kSm90) {
    bool ran = false;
    SPARGE_TRY(ks::launch_key_scores_sm90(ka, vec, plan.sm_count, stream, &ran));
    if (ran) {
      if (kept_zeroed) *kept_zeroed = kept != nullptr;
      return SPARGE_OK;
    }
  }
#endif
  const bool built = dispatch_dim_type(p.Dk, p.dtype, [&](auto dc, auto tt) {
    constexpr int DK = decltype(dc)::value;
    using T = typename decltype(tt)::type;
    auto kern = vec ? key_scores_mma_kernel<DK, T, true> : key_scores_mma_kernel<DK, T, false>;
    constexpr int smem = KsTraits<DK>::kSmem;
    st = ensure_smem_attr(reinterpret_cast<const void*>(kern), smem, p.device_id);
    if (st == SPARGE_OK) err = launch_pdl(kern, dim3(unsigned(n)), dim3(KsTraits<DK>::kThreads), size_t(smem), stream, ka);
  });
  if (!built)
    return fail(SPARGE_ERR_UNSUPPORTED, "estimator KEYS_LSE on CUDA: kernel head dim %lld not built",
                (long long)p.Dk);
  SPARGE_TRY(st);
  SPARGE_PDL_CHECK(err, "sparge per-key scores kernel");
  if (kept_zeroed) *kept_zeroed = kept != nullptr;
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
