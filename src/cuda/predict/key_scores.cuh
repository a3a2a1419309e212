// Shared by the two KEYS_LSE block-score kernels (key_scores.cu: mma.sync, sm_80 and newer;
// sm90/key_scores_sm90.cu: wgmma, sm_90a): the CTA's work split, the argument block, the K tile
// loader, the rounding of the pooled row and the per-row log-sum-exp of a 64-key score tile held
// in the m16n8 accumulator layout (which wgmma's m64nN accumulators share, per warp).
// The function and its precision: key_scores.cu's header comment and docs/PREDICTION.md.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/attention/common/math.cuh"
#include "cuda/attention/portable/primitives.cuh"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {
namespace ks {

constexpr int kRows = 128;  // pooled rows per CTA
constexpr int kKeys = 64;   // keys per tile (one key block)
constexpr int kTiles = 32;  // key tiles per CTA (2048 keys; the wgmma kernel may take fewer: Args::tiles)

struct Args {
  Problem prob;
  Tensor4 k;
  const float* pooled_q;  // [B*Hq, nQB, sub, Dk]
  float* scores;          // [B*Hq, nQB, nKB]: the scores of pooled row 0 of each query block
  float* scores2;         // [B*Hq, nQB, nKB]: those of pooled row 1 (sub = 2; KEYS_LSE_SPLIT2's second group)
  int64_t rows;           // pooled rows per kv head: group * nQB * sub
  int32_t sub;            // pooled rows per query block: 1 (KEYS_LSE) or 2 (KEYS_LSE_SPLIT2)
  uint32_t row_ctas, key_ctas;
  uint32_t tiles;         // key tiles per CTA (key_ctas = ceil(nKB / tiles))
  KeptRef kept;           // data != null: the kept counters [B, Hq], reset by CTA 0 (the selection adds to them)
  // KEYS_LSE_ADAPTIVE: the pooled rows each kv head scores, ascending ([B*Hkv][rows], list_n[bhk] of
  // them; rows past it exit); nullptr: every row 0 .. rows - 1.
  const int32_t* list = nullptr;
  const int32_t* list_n = nullptr;
};

// CTA 0 resets the kept counters (after pdl_grid_sync: every earlier kernel of the stream is done
// with them), so that the selection needs no launch of its own for it.
__device__ __forceinline__ void reset_kept(const Args& a) {
  if (blockIdx.x != 0 || a.kept.data == nullptr) return;
  const int64_t n = a.prob.B * a.prob.Hq;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    a.kept.data[(i / a.prob.Hq) * a.kept.s0 + (i % a.prob.Hq) * a.kept.s1] = 0;
}

// Query block of pooled row r of a kv head (rows are query-block major: r = (qb sub + s) g + h % g).
SPARGE_HD int64_t row_qblock(const Args& a, int64_t r, int64_t g) { return r / g / a.sub; }

// Last visible key of query block qb's last row (-1: none).
__device__ __forceinline__ int32_t row_last_key(const Problem& p, int64_t qb) {
  int64_t lk = p.Lkv - 1;
  if (p.causal) lk = min(lk, causal_last_key(min(p.Lq, (qb + 1) * p.BQ) - 1, p.Lq, p.Lkv));
  return int32_t(max(lk, int64_t(-1)));
}

// The CTA's place in the grid (row chunk fastest: the CTAs reading the same keys run together and
// share them through L2) and its key tiles [t_begin, t_begin + ntiles): the tiles up to the causal
// extent of its last row, which has its largest query block (rows are query-block major).
struct CtaWork {
  uint32_t b, hk, g;
  int64_t row0, t_begin;
  int64_t nrows;        // the kv head's rows (Args::rows, or its list's length)
  const int32_t* list;  // the kv head's row list (nullptr: row r is row r)
  int ntiles;  // 0: nothing to do (uniform)
  // rows_per_cta: kRows (mma.sync kernel) or 64 per warpgroup (wgmma kernel).
  __device__ __forceinline__ CtaWork(const Args& a, int rows_per_cta) {
    const Problem& p = a.prob;
    const uint32_t rc = blockIdx.x % a.row_ctas, t2 = blockIdx.x / a.row_ctas;
    const uint32_t kc = t2 % a.key_ctas, bhk = t2 / a.key_ctas;
    const uint32_t Hkv = uint32_t(p.Hkv);
    g = uint32_t(p.Hq / p.Hkv);
    b = bhk / Hkv, hk = bhk % Hkv;
    list = a.list ? a.list + int64_t(bhk) * a.rows : nullptr;
    nrows = a.list ? int64_t(a.list_n[bhk]) : a.rows;
    row0 = int64_t(rc) * rows_per_cta;
    const int64_t row_last = min(nrows, row0 + rows_per_cta) - 1;
    t_begin = int64_t(kc) * a.tiles;
    ntiles = 0;
    if (row_last < row0) return;  // past the list
    const int64_t vis = visible_key_blocks(p, qblock(a, row_last));
    const int64_t t_end = min(vis, t_begin + int64_t(a.tiles));
    ntiles = t_begin < t_end ? int(t_end - t_begin) : 0;
  }
  // The kv head's pooled row index of the CTA's row r (< nrows) and its query block.
  __device__ __forceinline__ int64_t orig(int64_t r) const { return list ? int64_t(list[r]) : r; }
  __device__ __forceinline__ int64_t qblock(const Args& a, int64_t r) const { return row_qblock(a, orig(r), g); }
  // Key blocks visible to the last of rows [first, first + n) that exist (0 if none does).
  __device__ __forceinline__ int64_t extent(const Args& a, int64_t first, int n) const {
    const int64_t lastr = min(nrows, first + n) - 1;
    return lastr < first ? 0 : visible_key_blocks(a.prob, qblock(a, lastr));
  }
  // Pooled row `row` of the CTA's kv head (pooled row s = (row / g) % sub of query block
  // row / g / sub of query head hk g + row % g): its float32 values (nullptr past the rows: a
  // padding row), its score row (scores, or scores2 for s = 1, + (bh nQB + qb) nKB; nullptr for a
  // padding row) and the last key it sees (-1 for a padding row).
  struct Row {
    const float* pq;
    float* out;
    int32_t last;
  };
  template <int DK>
  __device__ __forceinline__ Row row(const Args& a, int64_t r) const {
    Row o{nullptr, nullptr, -1};
    if (r < nrows) {
      const Problem& p = a.prob;
      r = orig(r);
      const int64_t qs = r / g, qb = qs / a.sub, h = int64_t(hk) * g + r % g, bh = int64_t(b) * p.Hq + h;
      o.pq = a.pooled_q + ((bh * p.nQB + qb) * a.sub + qs % a.sub) * DK;
      o.out = (qs % a.sub == 0 ? a.scores : a.scores2) + (bh * p.nQB + qb) * p.nKB;
      o.last = row_last_key(p, qb);
    }
    return o;
  }
};

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((127 + e) << 23); }

// fp16: the power of two 2^s that puts the row's largest finite |q_c| (mx, NaN ignored by the
// caller's fmaxf) in [2^14, 2^15), s clamped to [-64, 64]; 0 for a zero or non-finite maximum (an
// infinite row stays unscaled and non-finite). bf16 rows are not scaled.
template <class T>
__device__ __forceinline__ int row_shift(float mx) {
  if constexpr (std::is_same<T, __half>::value) {
    if (mx > 0.f && isfinite(mx)) {
      int ex;
      frexpf(mx, &ex);  // mx in [2^(ex-1), 2^ex)
      return min(max(15 - ex, -64), 64);
    }
  }
  return 0;
}

// The MMA A fragments of one pooled row, q' (the float32 row pq rounded once to T; fp16 rows
// first scaled by their power of two 2^s): the thread's pair of rows gq (r = 0) and gq + 8 (r = 1)
// of a 16-row tile in the m16n8k16 layout, which wgmma's register A operand shares per warp:
// a[ks][r] = columns 16ks + 2tq, +1 and a[ks][2 + r] = columns 16ks + 8 + 2tq, +1. pq == nullptr
// (a padding row) and columns past D give zeros. Every lane of the quad must call it (the fp16
// row maximum is taken over the quad). Returns the score factor scale * 2^-s.
template <int DK, class T>
__device__ __forceinline__ float row_fragments(const float* pq, int D, int tq, float scale, int r,
                                               uint32_t (&a)[DK / 16][4]) {
  constexpr int KS = DK / 16;
  float xv[KS][4];  // the row's values at the fragment positions: (ks, {c, c+1, c+8, c+9})
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int c = ks * 16 + 8 * hh + 2 * tq;
      float2 v = make_float2(0.f, 0.f);
      if (pq != nullptr && c < D) v = *reinterpret_cast<const float2*>(pq + c);
      xv[ks][2 * hh] = v.x;
      xv[ks][2 * hh + 1] = v.y;
    }
  float fac = scale;
  if constexpr (std::is_same<T, __half>::value) {
    float mx = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx = fmaxf(mx, fabsf(xv[ks][e]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const int s = row_shift<T>(mx);
    if (s != 0) {
      const float up = pow2f(s);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) xv[ks][e] *= up;
      fac = scale * pow2f(-s);
    }
  }
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    a[ks][r] = portable::Mma<T>::pack(xv[ks][0], xv[ks][1]);
    a[ks][2 + r] = portable::Mma<T>::pack(xv[ks][2], xv[ks][3]);
  }
  return fac;
}

// A thread's share of the K tile loads: the 16-byte column chunk c = tid % (DK / 8) of key rows
// r0 + i * kRowStep, i < kLoads (the same chunk every tile). Shared layout: key row r, chunk c at
// r * kPitch + (c / 8) * kColBytes + ((c % 8) ^ (r % 8)) * 16, i.e. the 8 chunks of a 128-byte
// span XOR-swizzled by the row (mma.sync kernel: whole rows, kPitch = 2 DK, kColBytes = 128; wgmma
// kernel: the 128-byte-swizzle layout of 64-column blocks, kPitch = 128, kColBytes = 64 * 128).
template <int DK, class T, int kThreads, int kPitch, int kColBytes>
struct TileLoader {
  static constexpr int kChunks = DK / 8;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kLoads = kKeys * kChunks / kThreads;
  static_assert(kThreads % kChunks == 0 && kRowStep * kLoads == kKeys && kRowStep % 8 == 0,
                "tile load split (every row of a thread has the same r & 7)");
  const unsigned char* col;  // k[b, hk, 0, 8c] (k[b, hk, 0, 0] for a chunk past the head dim): always readable
  const unsigned char* src;  // col + r0 rows
  int64_t rsb;               // key row stride in bytes
  int32_t lkv;               // <= kMaxKeyBlocks * 64 (predict_supported)
  int32_t r0;
  uint32_t soff;             // shared offset of row r0, chunk c
  uint32_t bytes;            // 16, or 0 for a chunk past the head dim (zero-filled, nothing read)
  __device__ __forceinline__ TileLoader(const Args& a, uint32_t b, uint32_t hk) {
    const int tid = int(threadIdx.x);
    const int c = tid % kChunks;
    r0 = tid / kChunks;
    const bool cok = c * 8 < int(a.prob.D);
    col = reinterpret_cast<const unsigned char*>(static_cast<const T*>(a.k.data) +
                                                 a.k.offset(b, hk, 0, cok ? c * 8 : 0));
    rsb = a.k.stride[2] * int64_t(sizeof(T));
    src = col + int64_t(r0) * rsb;
    lkv = int32_t(a.prob.Lkv);
    soff = uint32_t(r0 * kPitch + (c >> 3) * kColBytes + (((c & 7) ^ (r0 & 7)) << 4));
    bytes = cok ? 16u : 0u;
  }
  template <bool VEC>
  __device__ __forceinline__ void copy(const unsigned char* p, uint32_t n, uint32_t stage, unsigned char* stage_ptr,
                                       uint32_t off) const {
    if constexpr (VEC) {
      portable::cp_async16(stage + off, p, n != 0);
    } else {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (n != 0) v = load8_raw<false>(p);
      *reinterpret_cast<uint4*>(stage_ptr + off) = v;
    }
  }
  // One 64-key tile (keys j0..j0+63) into a stage (shared address `stage`, generic `stage_ptr`).
  // Keys past Lkv and columns past the head dim are zeros.
  template <bool VEC>
  __device__ __forceinline__ void load(int32_t j0, uint32_t stage, unsigned char* stage_ptr) const {
    const unsigned char* p = src + int64_t(j0) * rsb;
    const int64_t step = int64_t(kRowStep) * rsb;
    if (j0 + kKeys <= lkv) {  // warp-uniform: every key of the tile exists
#pragma unroll
      for (int i = 0; i < kLoads; ++i, p += step)
        copy<VEC>(p, bytes, stage, stage_ptr, soff + uint32_t(i * kRowStep * kPitch));
    } else {
#pragma unroll
      for (int i = 0; i < kLoads; ++i, p += step) {
        const bool ok = j0 + r0 + i * kRowStep < lkv;
        copy<VEC>(ok ? p : col, ok ? bytes : 0u, stage, stage_ptr, soff + uint32_t(i * kRowStep * kPitch));
      }
    }
  }
};

// The block scores of NR of the thread's rows (r0 .. r0 + NR - 1 of its two, gq + 8r) of a 64-key
// score tile in the m16n8 accumulator layout: acc(n, 2r + e) is this thread's raw dot product of row
// gq + 8r with key 8n + 2tq + e (n < 8), the quad (4 lanes, tq = lane & 3) holding the row. lim[r]:
// row r sees keys 0..lim[r] of the tile (< 0: none, nothing is written). fac = scale * 2^-s,
// f2 = fac * log2(e). MASK: some row may see part of the tile only. The NR rows go through each step
// together (independent dependency chains; NR = 2 needs 16 more live registers). First without a
// maximum: sum = sum_j 2^(acc_j f2) (ex2.approx), block score ln(sum), taken where the sum of every
// row of the warp that sees a key lies in [2^-100, 2^100] (block scores within about +-69); the
// rounding of acc_j f2 is then at most 2^-24 |acc_j f2|, an error that scales with the score itself,
// and the terms that ex2.approx.ftz flushes (below 2^-126) weigh less than 2^-20 of the sum.
// Otherwise (a larger score, NaN or infinite scores, a block of -inf) the warp takes the rows again
// with their maxima m over the raw accumulators (scale > 0: the order of the scores; a NaN is ignored
// there and reaches the sum): 2^(acc f2 - m f2) and m fac + ln(sum). The logarithms flush
// subnormal sums, which neither case passes (the first takes sums >= 2^-100, the second's are >= 1,
// 0 or NaN). A row that sees no key of the tile is neither masked nor written.
template <bool MASK, int NR, class Acc>
__device__ __forceinline__ void tile_rows_score(const Acc& acc, int r0, int tq, const int32_t (&lim)[2],
                                                const float (&fac)[2], const float (&f2)[2], float* const (&out)[2]) {
  constexpr float kLn2 = 0.6931471805599453f;
  float v[NR][16];  // row r0 + r's 16 scores of this thread, keys past lim at -inf (weight 0)
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = acc(n, 2 * (r0 + r) + e);
        v[r][2 * n + e] = MASK && 8 * n + 2 * tq + e > lim[r0 + r] ? -INFINITY : x;
      }
  // each row's sum of 2^(v f2 - mb) over the quad, as a tree (4 dependent steps instead of 16)
  auto row_sums = [&](const float (&mb)[NR], float (&sum)[NR]) {
    float st[NR][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        st[r][i] = attn::fast_exp2(fmaf(v[r][i], f2[r0 + r], -mb[r])) +
                   attn::fast_exp2(fmaf(v[r][i + 8], f2[r0 + r], -mb[r]));
#pragma unroll
    for (int w = 4; w > 0; w >>= 1)
#pragma unroll
      for (int i = 0; i < w; ++i)
#pragma unroll
        for (int r = 0; r < NR; ++r) st[r][i] += st[r][i + w];
#pragma unroll
    for (int r = 0; r < NR; ++r) sum[r] = st[r][0];
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1)
#pragma unroll
      for (int r = 0; r < NR; ++r) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], o);
  };
  float sum[NR], mb[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) mb[r] = 0.f;
  row_sums(mb, sum);
  bool in_range = true;
#pragma unroll
  for (int r = 0; r < NR; ++r)
    in_range = in_range && (lim[r0 + r] < 0 || (sum[r] >= 0x1p-100f && sum[r] <= 0x1p100f));  // false for NaN
  if (__all_sync(0xffffffffu, in_range)) {
    if (tq == 0) {
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (lim[r0 + r] >= 0) *out[r0 + r] = attn::fast_log2(sum[r]) * kLn2;
    }
    return;
  }
  float m[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    float mt[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) mt[i] = fmaxf(v[r][i], v[r][i + 8]);
#pragma unroll
    for (int w = 4; w > 0; w >>= 1)
#pragma unroll
      for (int i = 0; i < w; ++i) mt[i] = fmaxf(mt[i], mt[i + w]);
    m[r] = mt[0];
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
    // m == -inf: every visible term is -inf (weight 0) or NaN (stays NaN); no inf - inf
    mb[r] = m[r] == -INFINITY ? 0.f : m[r] * f2[r0 + r];
  }
  row_sums(mb, sum);
  if (tq == 0) {
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (lim[r0 + r] >= 0) *out[r0 + r] = fmaf(m[r], fac[r0 + r], attn::fast_log2(sum[r]) * kLn2);
  }
}

// Both rows of the thread (PAIR: together; else one after the other) for key tile `tile` (keys
// j0 ..): last[r] is row r's last visible key, out[r] its score row. The tile is taken without masks
// unless a row of the warp sees part of it only (0 <= lim < 63; a row that sees all of it or none
// needs no mask; checked where PAIR), or MASK is false (the caller knows every row sees all of it).
template <bool MASK, bool PAIR, class Acc>
__device__ __forceinline__ void tile_row_scores(const Acc& acc, int tq, const int32_t (&last)[2], int32_t j0,
                                                const float (&fac)[2], const float (&f2)[2], float* const (&outrow)[2],
                                                int64_t tile) {
  const int32_t lim[2] = {last[0] - j0, last[1] - j0};
  float* const out[2] = {outrow[0] + tile, outrow[1] + tile};
  auto run = [&](auto maskc) {
    constexpr bool M = decltype(maskc)::value;
    if constexpr (PAIR) {
      tile_rows_score<M, 2>(acc, 0, tq, lim, fac, f2, out);
    } else {
      tile_rows_score<M, 1>(acc, 0, tq, lim, fac, f2, out);
      tile_rows_score<M, 1>(acc, 1, tq, lim, fac, f2, out);
    }
  };
  if constexpr (MASK && PAIR) {  // (the unpaired kernels keep the registers the vote would take)
    const bool part = (lim[0] >= 0 && lim[0] < kKeys - 1) || (lim[1] >= 0 && lim[1] < kKeys - 1);
    if (__any_sync(0xffffffffu, part))
      run(std::true_type{});
    else
      run(std::false_type{});
  } else {
    run(std::integral_constant<bool, MASK>{});
  }
}

// The wgmma kernel (sm_90a, Dk 64 and 128; built with the sm90 family): *ran = false when the
// head dim has none (the caller then runs the mma.sync kernel). `a` without its grid (row_ctas,
// key_ctas and tiles are set here, the tiles from the device's sm_count); vec: 16-byte K loads.
sparge_status_t launch_key_scores_sm90(Args a, bool vec, int sm_count, cudaStream_t stream, bool* ran);

}  // namespace ks
}  // namespace cuda
}  // namespace sparge
