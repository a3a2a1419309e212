// Block selection: pooled scores (float32 dot products of the float32 pooled
// vectors), top-k by score / CDF by the probabilities of a per-row float64 softmax, with the
// exact tie rule (score or probability descending, lower block index first), forced blocks,
// the uint8 mask and the kept counts. Pipeline and costs: docs/PREDICTION.md.
#include <algorithm>
#include <cstdint>

#include "core/error.hpp"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/predict.cuh"
#include "cuda/schedule/lists.cuh"

namespace sparge {
namespace cuda {
namespace {

// ---------------------------------------------------------------- pooled scores
// scores[bh, qb, kb] = scale * (pq . pk) in float32 (the pooled vectors are
// float32 means; their dot product's rounding is of the same order as theirs).
// One CTA of 128 threads per (bh, 64 query blocks, 64 key blocks) tile; the
// head dimension goes through shared memory in chunks of 32, stored transposed
// ([c][block]). Thread (tx, ty) computes query blocks 8ty..8ty+7 x key blocks
// 4tx..4tx+3: three 16-byte shared loads per 32 FMAs.
constexpr int kST = 64;   // tile edge (query blocks and key blocks)
constexpr int kSDC = 32;  // head-dim chunk
constexpr int kSThreads = 128;

struct ScoreArgs {
  Problem prob;
  const float* pooled_q;  // [B*Hq, nQB, D]
  const float* pooled_k;  // [B*Hkv, nKB, D]
  float* scores;          // [B*Hq, nQB, nKB]
  int64_t ntq, ntk;       // tiles along qb and kb
  int32_t* kept;          // zeroed here (selection adds to it)
  int64_t kept_s0, kept_s1;
};

// acc[i][j] += the sum over one head-dim chunk of sq[c][8ty + i] * sk[c][4tx + j]:
// a thread's 8 x 4 block of the pooled score tile.
__device__ __forceinline__ void fma_tile(const float (&sq)[kSDC][kST], const float (&sk)[kSDC][kST], int ty, int tx,
                                         float (&acc)[8][4]) {
#pragma unroll 4
  for (int c = 0; c < kSDC; ++c) {
    const float4 q0 = *reinterpret_cast<const float4*>(&sq[c][8 * ty]);
    const float4 q1 = *reinterpret_cast<const float4*>(&sq[c][8 * ty + 4]);
    const float4 k4 = *reinterpret_cast<const float4*>(&sk[c][4 * tx]);
    const float qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    const float kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(qv[i], kv[j], acc[i][j]);
  }
}

__global__ void __launch_bounds__(kSThreads) scores_kernel(const ScoreArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  __shared__ __align__(16) float sq[kSDC][kST];
  __shared__ __align__(16) float sk[kSDC][kST];
  const Problem& p = a.prob;
  const uint32_t ntk = uint32_t(a.ntk), ntq = uint32_t(a.ntq);
  const uint32_t tk = blockIdx.x % ntk, t2 = blockIdx.x / ntk;
  const uint32_t tq = t2 % ntq, bh = t2 / ntq;
  const uint32_t Hq = uint32_t(p.Hq), Hkv = uint32_t(p.Hkv);
  const uint32_t b = bh / Hq, h = bh % Hq, bhk = b * Hkv + h / (Hq / Hkv);
  const int tid = threadIdx.x;
  if (tq == 0 && tk == 0 && tid == 0) a.kept[b * a.kept_s0 + h * a.kept_s1] = 0;

  const int64_t qb0 = int64_t(tq) * kST, kb0 = int64_t(tk) * kST;
  const int64_t qb_last = min(p.nQB, qb0 + kST) - 1;
  if (kb0 >= visible_key_blocks(p, qb_last)) return;  // nothing visible in this tile (uniform)

  const int D = int(p.Dk);  // pooled rows are stored at the kernels' width (zero padding)
  const float* pq = a.pooled_q + (int64_t(bh) * p.nQB) * D;
  const float* pk = a.pooled_k + (int64_t(bhk) * p.nKB) * D;
  const int tx = tid % 16, ty = tid / 16;
  float acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  for (int d0 = 0; d0 < D; d0 += kSDC) {
    __syncthreads();
    // consecutive threads take consecutive rows (conflict-free transposed stores)
#pragma unroll
    for (int it = 0; it < (kST * kSDC / 4) / kSThreads; ++it) {
      const int e = tid + it * kSThreads;
      const int r = e % kST, c4 = (e / kST) * 4;
      const int64_t qb = qb0 + r, kb = kb0 + r;
      float4 qv = make_float4(0.f, 0.f, 0.f, 0.f), kv = qv;
      if (qb < p.nQB) qv = *reinterpret_cast<const float4*>(pq + qb * D + d0 + c4);
      if (kb < p.nKB) kv = *reinterpret_cast<const float4*>(pk + kb * D + d0 + c4);
      sq[c4 + 0][r] = qv.x, sq[c4 + 1][r] = qv.y, sq[c4 + 2][r] = qv.z, sq[c4 + 3][r] = qv.w;
      sk[c4 + 0][r] = kv.x, sk[c4 + 1][r] = kv.y, sk[c4 + 2][r] = kv.z, sk[c4 + 3][r] = kv.w;
    }
    __syncthreads();
    fma_tile(sq, sk, ty, tx, acc);
  }
  const float scale = p.scale;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t qb = qb0 + 8 * ty + i;
    if (qb >= p.nQB) continue;
    float* row = a.scores + (int64_t(bh) * p.nQB + qb) * p.nKB;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t kb = kb0 + 4 * tx + j;
      if (kb < p.nKB) row[kb] = scale * acc[i][j];
    }
  }
}

// Zeroes the kept counters when neither the pooled-score kernel nor the KEYS_LSE block-score
// kernel (prepare_impl's kept_zeroed) does.
__global__ void zero_kept_kernel(int32_t* kept, int64_t B, int64_t Hq, int64_t s0, int64_t s1) {
  pdl_grid_sync();
  for (int64_t i = threadIdx.x; i < B * Hq; i += blockDim.x) kept[(i / Hq) * s0 + (i % Hq) * s1] = 0;
}

// ---------------------------------------------------------------- selection
// One warp per (b, h, qb) row (up to kSelRows rows per CTA). Row keys order the
// candidates: top-k ranks the float32 scores themselves (score_key: no softmax),
// CDF the float32 probabilities P of a float64 softmax (non-negative floats order
// like their bit patterns). Then the selection threshold by a bitwise search over
// the keys:
//  - top-k: weight 1 per block, target n = max(1, floor(topk * visible));
//  - CDF: weight P in 2^-62 fixed point (exact and associative), target
//    cdf_threshold in the same fixed point.
// With W(t) = total weight of the blocks whose keys are >= t, the search
// builds t* = max { t : W(t) >= target } bit by bit from the most significant
// one (W is monotone): one warp reduction per bit, deterministic, no sort, no
// atomics, no contention on ties. t* lies between the row's smallest and
// largest candidate keys, so the search starts below the leading bits those
// two share; a top-k search stops at the first candidate t with W(t) ==
// target (the keys >= t are then exactly the selection, as the remaining bits
// would find). t* is the key of the last selected block in the ordering (key
// descending, lower index first). Blocks with keys > t* are kept
// and, of the blocks with key == t*, the lowest-index ones, as many as needed to
// reach the target.
constexpr int kSelCache = 16;  // register-cached blocks per lane at most (V <= 512 fully cached)

struct SelectArgs {
  Problem prob;
  PredictConfig cfg;
  const float* scores;  // [B*Hq, nQB, nKB]
  const float* sim_q;   // [B*Hq, nQB]
  const float* sim_k;   // [B*Hkv, nKB]
  MaskView mask;
  int32_t* kept;
  int64_t kept_s0, kept_s1;
  int32_t* idx;  // [B*Hq, nQB, nKB] or null: the rows' index lists too (cuda/schedule/lists.cuh)
  int32_t* cnt;  // [B*Hq, nQB]
  // Estimators KEYS_LSE_SPLIT2 / KEYS_LSE_ADAPTIVE (grouped != 0): `scores` holds group a's block
  // scores, scores2 group b's (the index-list region: a row's lists are written after its scores2
  // are read, by the same warp), count the groups' sizes [B*Hq, nQB, 2]. The row's scores are
  // their combination (combine_groups): every row for 1 (KEYS_LSE_SPLIT2), the rows of two groups
  // for 2 (KEYS_LSE_ADAPTIVE; a row of one group keeps its KEYS_LSE scores).
  const float* scores2;
  const float* count;
  int32_t grouped;
};

// The combination of a row's two groups' block scores (KEYS_LSE_SPLIT2, KEYS_LSE_ADAPTIVE; the
// row's warp, its V visible blocks), into out (lane-strided: block kb by lane kb % 32, which also
// reads it afterwards). In float32 (the CPU reference: float64; the two differ by float32
// roundings, within the block scores' own tolerance). Per group g of n_g > 0 rows: m_g = the
// largest visible score (NaN ignored), norm_g = m_g + log sum exp(s_g - m_g) (NaN when m_g is
// infinite: the CPU's arithmetic), u_g = s_g + (log(n_g / n) - norm_g); the block's score is
// m + log(1 + exp(o - m)), m and o the larger and the smaller u_g (u_0 alone with one group), or
// NaN where some u_g is not finite.
__device__ __forceinline__ void combine_groups(const float* s0, const float* s1, float n0, float n1, int V,
                                               float* out) {
  const int lane = threadIdx.x & 31;
  const float n = n0 + n1;        // (integers <= 128: exact)
  float shift[2] = {0.0f, 0.0f};  // log(n_g / n) - norm_g
  const bool has[2] = {n0 > 0.f, n1 > 0.f};
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    if (!has[g]) continue;  // warp-uniform
    const float* s = g ? s1 : s0;
    float m = -INFINITY;
    for (int kb = lane; kb < V; kb += 32) m = fmaxf(m, s[kb]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int kb = lane; kb < V; kb += 32) sum += expf(s[kb] - m);
    sum = warp_sum(sum);
    shift[g] = logf((g ? n1 : n0) / n) - (m + logf(sum));
  }
  for (int kb = lane; kb < V; kb += 32) {
    const float u0 = has[0] ? s0[kb] + shift[0] : 0.0f, u1 = has[1] ? s1[kb] + shift[1] : 0.0f;
    float r;
    if ((has[0] && !isfinite(u0)) || (has[1] && !isfinite(u1)))
      r = NAN;
    else if (has[0] && has[1])
      r = fmaxf(u0, u1) + log1pf(expf(fminf(u0, u1) - fmaxf(u0, u1)));
    else
      r = has[0] ? u0 : u1;
    out[kb] = r;
  }
}

// Row keys: for a candidate block the score's order key (top-k) or the P bit pattern (CDF),
// plus 1; 0 for a block that is not a candidate (kept beforehand as a forced block of the
// budget). Searches run over keys >= 1 only, so non-candidates never weigh nor get selected.
// P in units of 2^-62 (exact for P >= 2^-38; smaller P are truncated).
__device__ __forceinline__ unsigned long long fixed62(uint32_t pbits) {
  return __float2ull_rz(__uint_as_float(pbits) * 4611686018427387904.0f);
}
// Top-k row key of a finite score: its float32 order as an unsigned order (negative scores
// below positive ones, -0 as +0), plus 1 (0 marks a non-candidate). At most 0xff800000 for
// finite scores (a non-finite row keeps every block and never reads its keys).
__device__ __forceinline__ uint32_t score_key(float s) {
  const uint32_t u = __float_as_uint(s == 0.f ? 0.f : s);
  return ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) + 1u;
}
__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Weight of this lane's blocks with keys >= t. NC: register-cached blocks per lane (4, 8 or
// kSelCache: select_row_any picks the smallest that holds the row, so that a short causal row
// does not pay a long row's compares in each of its search steps).
template <bool CDF, int NC>
struct RowSearch {
  uint32_t uc[NC];            // keys of blocks lane + 32 i
  unsigned long long wc[NC];  // their weights (CDF only; 0 beyond V)
  int V;
  const uint32_t* pb;      // shared: all V keys (the tail beyond the cache)

  // (uc and wc are 0 past the cache's entries in use and past V, and t >= 1: those never count.)
  __device__ __forceinline__ unsigned long long local(uint32_t t) const {
    const int lane = threadIdx.x & 31;
    if (CDF) {
      unsigned long long w = 0;
#pragma unroll
      for (int i = 0; i < NC; ++i)
        if (uc[i] >= t) w += wc[i];
      for (int kb = lane + 32 * NC; kb < V; kb += 32) {
        const uint32_t u = pb[kb];
        if (u >= t) w += fixed62(u - 1u);
      }
      return w;
    }
    uint32_t w = 0;  // top-k: counts, in 32 bits (V <= kMaxKeyBlocks)
#pragma unroll
    for (int i = 0; i < NC; ++i) w += uint32_t(uc[i] >= t);
    for (int kb = lane + 32 * NC; kb < V; kb += 32) w += uint32_t(pb[kb] >= t);
    return w;
  }
  // The smallest and largest candidate key (>= 1) of the row, warp-wide.
  __device__ __forceinline__ void key_range(uint32_t& kmin, uint32_t& kmax) const {
    const int lane = threadIdx.x & 31;
    kmin = 0xffffffffu, kmax = 0u;
    auto take = [&](uint32_t u) {
      kmax = max(kmax, u);
      kmin = min(kmin, u ? u : 0xffffffffu);
    };
#pragma unroll
    for (int i = 0; i < NC; ++i) take(uc[i]);
    for (int kb = lane + 32 * NC; kb < V; kb += 32) take(pb[kb]);
    kmin = __reduce_min_sync(0xffffffffu, kmin);
    kmax = __reduce_max_sync(0xffffffffu, kmax);
  }
  __device__ __forceinline__ unsigned long long total_ge(uint32_t t) const {
    if (CDF) return warp_sum_u64(local(t));
    return (unsigned long long)__reduce_add_sync(0xffffffffu, uint32_t(local(t)));
  }
};

// Marks the selected blocks of the row in `sel` (shared).
template <bool CDF, int NC>
__device__ __forceinline__ void select_row(const uint32_t* pb, int V, unsigned long long target, uint8_t* sel) {
  const int lane = threadIdx.x & 31;
  RowSearch<CDF, NC> rs;
  rs.V = V;
  rs.pb = pb;
#pragma unroll
  for (int i = 0; i < NC; ++i) {
    const int kb = lane + 32 * i;
    rs.uc[i] = kb < V ? pb[kb] : 0u;
    if (CDF) rs.wc[i] = (kb < V && rs.uc[i] != 0u) ? fixed62(rs.uc[i] - 1u) : 0ull;
  }
  if (rs.total_ge(1) < target) {  // CDF never reached (rounding): keep every visible block
    for (int kb = lane; kb < V; kb += 32) sel[kb] = 1;
    return;
  }
  // t* lies in [kmin, kmax], so it has the bits those two share above their
  // highest differing bit: the search starts below them.
  uint32_t kmin, kmax;
  rs.key_range(kmin, kmax);
  const uint32_t diff = kmin ^ kmax;  // kmin <= kmax: total_ge(1) >= target >= 1 above
  const int top = diff ? 31 - __clz(diff) : -1;
  // (one key value, top < 0: t* = kmax, and the ties below take the first `target`)
  uint32_t tstar = top >= 0 ? kmax & ~((2u << top) - 1u) : kmax;
  bool exact = false;
  for (int bit = top; bit >= 0; --bit) {
    const uint32_t cand = tstar | (1u << bit);
    const unsigned long long w = rs.total_ge(cand);
    if (w >= target) tstar = cand;
    // Top-k: exactly `target` keys >= cand are the selection (the keys >= the
    // smallest of them, t*, ties included): the remaining bits change nothing.
    if (!CDF && w == target) {
      exact = true;
      break;
    }
  }
  unsigned long long need;  // ties (key == t*) to take, in index order
  if (exact) {
    // keys >= tstar are the selection: as "keys > tstar - 1", no ties (tstar >= 1)
    tstar -= 1u;
    need = 0;
  } else {
    const unsigned long long rem = target - rs.total_ge(tstar + 1);
    need = rem;
    if (CDF) {
      const unsigned long long w = fixed62(tstar - 1u);
      need = w ? (rem + w - 1) / w : 1;
    }
  }
  // ties in index order: chunks of 32 consecutive blocks (chunk i is uc[i], then the shared
  // tail), ballot + prefix count; keys past V are 0 < t* + 1 and never tie (t* >= 1 or exact)
  unsigned long long taken = 0;
  const uint32_t lt = (1u << lane) - 1u;
  auto mark = [&](int kb, uint32_t u) {
    const bool tie = u == tstar && !exact;
    const uint32_t bal = __ballot_sync(0xffffffffu, tie);
    if (u > tstar || (tie && taken + __popc(bal & lt) < need)) sel[kb] = 1;
    taken += __popc(bal);
  };
#pragma unroll
  for (int i = 0; i < NC; ++i)
    if (32 * i < V) mark(lane + 32 * i, rs.uc[i]);
  for (int kb0 = 32 * NC; kb0 < V; kb0 += 32) {
    const int kb = kb0 + lane;
    mark(kb, kb < V ? pb[kb] : 0u);
  }
}

// select_row with the smallest register cache that holds the row's V blocks (warp-uniform).
template <bool CDF>
__device__ __forceinline__ void select_row_any(const uint32_t* pb, int V, unsigned long long target,
                                               uint8_t* sel) {
  if (V <= 32 * 4)
    select_row<CDF, 4>(pb, V, target, sel);
  else if (V <= 32 * 8)
    select_row<CDF, 8>(pb, V, target, sel);
  else
    select_row<CDF, kSelCache>(pb, V, target, sel);
}

// Up to kSelRows warps per CTA (blockDim.x / 32), one row each (a head's consecutive query blocks).
// Dynamic shared memory per warp: nKB row keys (u32) + nKB flags, rounded up to 16
// bytes; at most kSelSmem per CTA (fewer rows per CTA for long rows).
constexpr int kSelRows = 4;
constexpr size_t kSelSmem = 96 * 1024;
__host__ __device__ inline size_t select_warp_smem(int64_t nKB) {
  return (size_t(nKB) * (sizeof(uint32_t) + 1) + 15) / 16 * 16;
}

// TOPK: the mode (cfg.mode) as a template argument, so that the top-k kernel carries none of the
// softmax's registers (the float64 exponentials kept for the division) and runs more warps per SM.
template <bool TOPK>
__global__ void __launch_bounds__(32 * kSelRows) select_kernel(const SelectArgs a, uint32_t nrows) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  extern __shared__ __align__(16) unsigned char smem[];
  const Problem& p = a.prob;
  const PredictConfig& cfg = a.cfg;
  const int nKB = int(p.nKB);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t row = blockIdx.x * (blockDim.x >> 5) + uint32_t(warp);
  if (row >= nrows) return;  // warp-uniform; no CTA-wide barrier below
  unsigned char* wsm = smem + size_t(warp) * select_warp_smem(nKB);
  uint32_t* pb = reinterpret_cast<uint32_t*>(wsm);
  uint8_t* sel = wsm + size_t(nKB) * sizeof(uint32_t);

  const uint32_t nQB = uint32_t(p.nQB), Hq = uint32_t(p.Hq);
  const uint32_t qb = row % nQB, bh = row / nQB;
  const uint32_t b = bh / Hq, h = bh % Hq, bhk = b * uint32_t(p.Hkv) + h / (Hq / uint32_t(p.Hkv));
  const int V = int(visible_key_blocks(p, qb));
  const float sim_thr = cfg.sim_per_head ? cfg.sim_per_head[h] : cfg.sim_threshold;
  // the groups' sizes (grouped estimators), read before the row's set-up below hides their latency
  float n0 = 0.f, n1 = 0.f;
  if (a.grouped != 0) {
    const float2 nn = reinterpret_cast<const float2*>(a.count)[size_t(bh) * nQB + qb];
    n0 = nn.x, n1 = nn.y;
  }

  // 16-byte flag and mask accesses where the row allows them (warp-uniform): nKB a multiple of 16
  // (sel, after nKB u32 keys in a 16-byte-aligned region, is then 16-byte aligned) and a
  // contiguous, 16-byte-aligned mask row
  uint8_t* mrow = a.mask.data + a.mask.offset(b, h, qb, 0);
  const int64_t ms = a.mask.stride[3];
  const bool vec16 = (nKB & 15) == 0;
  const bool mvec = vec16 && ms == 1 && (reinterpret_cast<uintptr_t>(mrow) & 15) == 0;
  if (vec16) {
    for (int kb = 16 * lane; kb < nKB; kb += 512) *reinterpret_cast<uint4*>(sel + kb) = make_uint4(0, 0, 0, 0);
  } else {
    for (int kb = lane; kb < nKB; kb += 32) sel[kb] = 0;
  }
  __syncwarp();

  if (V > 0) {
    // (self-similarities are >= 0 or NaN: a threshold <= 0 forces no row, and
    // sim_q is then neither read nor computed: prepare.cu)
    const bool force_row = sim_thr > 0.f && a.sim_q[size_t(bh) * nQB + qb] < sim_thr;
    const float* srow = a.scores + (size_t(bh) * nQB + qb) * size_t(nKB);
    // the combined scores (warp-uniform), staged in pb and read below in place (the other rows read
    // srow through global loads)
    const bool staged = a.grouped != 0 && !force_row && (a.grouped == 1 || n1 > 0.f);
    if (staged)
      combine_groups(srow, a.scores2 + (size_t(bh) * nQB + qb) * size_t(nKB), n0, n1, V, reinterpret_cast<float*>(pb));
    // forced blocks of the budget (sink, local window, causal diagonal): kept first, their count
    // (top-k) or probability (CDF) taken off the target, no longer candidates
    const BudgetForced fb = budget_forced(p, cfg, qb);
    float mx = -INFINITY;
    bool nonfinite = false;
    uint32_t fcount = 0;
    if (!force_row) {
      for (int kb = lane; kb < V; kb += 32) {
        const float sv = staged ? __uint_as_float(pb[kb]) : __ldg(srow + kb);
        nonfinite |= !isfinite(sv);
        if constexpr (!TOPK) {
          pb[kb] = __float_as_uint(sv);  // stage the scores (CDF: probabilities below)
          mx = fmaxf(mx, sv);
        } else if (fb.has(kb)) {  // top-k ranks the scores themselves: their keys directly
          sel[kb] = 1;
          ++fcount;
          pb[kb] = 0u;
        } else {
          pb[kb] = score_key(sv);
        }
      }
      // NaN policy (docs/SEMANTICS.md): a row with a NaN or infinite score keeps
      // every visible block, so the selection never drops a non-finite value.
      nonfinite = __any_sync(0xffffffffu, nonfinite);
      __syncwarp();
    }
    if (force_row || nonfinite) {
      for (int kb = lane; kb < V; kb += 32) sel[kb] = 1;
    } else if constexpr (TOPK) {
      fcount = __reduce_add_sync(0xffffffffu, fcount);
      const float tk = cfg.topk_per_head ? cfg.topk_per_head[h] : cfg.topk;
      const unsigned long long n = (unsigned long long)topk_count(tk, V);
      if (n > fcount) select_row_any<false>(pb, V, n - fcount, sel);
    } else {
      mx = warp_max(mx);
      // softmax over the visible entries (float64, as the CPU reference); the exponentials of
      // the first 32 kSelCache blocks are kept in registers for the division
      double tot = 0.0, ex[kSelCache];
#pragma unroll
      for (int i = 0; i < kSelCache; ++i) {
        const int kb = lane + 32 * i;
        ex[i] = kb < V ? exp(double(__uint_as_float(pb[kb])) - double(mx)) : 0.0;
        tot += ex[i];
      }
      for (int kb = lane + 32 * kSelCache; kb < V; kb += 32) tot += exp(double(__uint_as_float(pb[kb])) - double(mx));
      tot = warp_sum_f64(tot);
#pragma unroll
      for (int i = 0; i < kSelCache; ++i) {
        const int kb = lane + 32 * i;
        if (kb < V) pb[kb] = __float_as_uint(float(ex[i] / tot));
      }
      for (int kb = lane + 32 * kSelCache; kb < V; kb += 32)
        pb[kb] = __float_as_uint(float(exp(double(__uint_as_float(pb[kb])) - double(mx)) / tot));
      __syncwarp();
      unsigned long long fmass = 0;
      for (int kb = lane; kb < V; kb += 32) {
        const uint32_t u = pb[kb];
        if (fb.has(kb)) {
          sel[kb] = 1;
          ++fcount;
          fmass += fixed62(u);
          pb[kb] = 0u;
        } else {
          pb[kb] = u + 1u;
        }
      }
      fcount = __reduce_add_sync(0xffffffffu, fcount);
      fmass = warp_sum_u64(fmass);
      __syncwarp();
      const float cdf = cfg.cdf_per_head ? cfg.cdf_per_head[h] : cfg.cdf_threshold;
      const unsigned long long t = fixed62(__float_as_uint(cdf));
      unsigned long long target = t > fmass ? t - fmass : 0ull;
      if (fcount == 0 && target == 0) target = 1;  // at least one block
      if (target > 0) select_row_any<true>(pb, V, target, sel);
    }
    __syncwarp();
    // forced blocks outside the budget: non-compressible key blocks (self-
    // similarities are >= 0 or NaN: a threshold <= 0 forces none, and sim_k is
    // then not read — a KEYS_LSE prediction does not compute it)
    if (sim_thr > 0.f) {
      const float* sk = a.sim_k + size_t(bhk) * nKB;
      for (int kb = lane; kb < V; kb += 32)
        if (sk[kb] < sim_thr) sel[kb] = 1;
    }
    __syncwarp();
  }

  // write the whole row (invisible blocks are 0) and count
  int cnt = 0;
  if (mvec) {  // flags are 0 or 1: a word's population count is its number of kept blocks
    for (int kb = 16 * lane; kb < nKB; kb += 512) {
      const uint4 v = *reinterpret_cast<const uint4*>(sel + kb);
      *reinterpret_cast<uint4*>(mrow + kb) = v;
      cnt += __popc(v.x) + __popc(v.y) + __popc(v.z) + __popc(v.w);
    }
  } else {
    for (int kb = lane; kb < nKB; kb += 32) {
      const uint8_t v = sel[kb];
      mrow[kb * ms] = v;
      cnt += v;
    }
  }
  cnt = int(__reduce_add_sync(0xffffffffu, uint32_t(cnt)));
  if (lane == 0 && cnt > 0) atomicAdd(a.kept + b * a.kept_s0 + h * a.kept_s1, cnt);
  if (a.idx != nullptr) {  // the attention's index list of this row, from the same flags
    __syncwarp();
    const int64_t row = int64_t(bh) * nQB + qb;
    lists::emit_list([&](int64_t kb) { return sel[kb]; }, V, nKB, a.idx + row * nKB, a.cnt + row);
  }
}

}  // namespace

sparge_status_t launch_select(const Plan& plan, const PredictConfig& cfg, const MaskView& mask,
                              const KeptView* kept, void* ws, cudaStream_t stream, bool lists_too,
                              bool kept_zeroed) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  char* base = static_cast<char*>(ws);
  const int64_t bhq = p.B * p.Hq;

  const KeptRef kr = kept_ref(plan, kept, ws);
  int32_t* kept_ptr = kr.data;
  const int64_t ks0 = kr.s0, ks1 = kr.s1;

  ScoreArgs sa;
  sa.prob = p;
  sa.pooled_q = ws_ptr<float>(base, L.pooled_q);
  sa.pooled_k = ws_ptr<float>(base, L.pooled_k);
  sa.scores = ws_ptr<float>(base, L.scores);
  sa.ntq = ceil_div(p.nQB, kST);
  sa.ntk = ceil_div(p.nKB, kST);
  sa.kept = kept_ptr, sa.kept_s0 = ks0, sa.kept_s1 = ks1;
  const int64_t nsb = bhq * sa.ntq * sa.ntk;
  if (nsb > int64_t(0x7fffffff)) return fail(SPARGE_ERR_UNSUPPORTED, "score grid too large");
  if (keys_estimator(cfg.estimator)) {  // scores written by launch_key_scores (preparation)
    if (!kept_zeroed)
      SPARGE_PDL_CHECK(launch_pdl(zero_kept_kernel, dim3(1), dim3(256), 0, stream, kept_ptr, p.B, p.Hq, ks0, ks1),
                       "sparge kept-count zeroing kernel");
  } else {
    SPARGE_PDL_CHECK(launch_pdl(scores_kernel, dim3(unsigned(nsb)), dim3(kSThreads), 0, stream, sa),
                     "sparge pooled scores kernel");
  }

  SelectArgs se;
  se.prob = p;
  se.cfg = cfg;
  se.scores = sa.scores;
  se.sim_q = ws_ptr<float>(base, L.sim_q);
  se.sim_k = ws_ptr<float>(base, L.sim_k);
  se.mask = mask;
  se.kept = kept_ptr, se.kept_s0 = ks0, se.kept_s1 = ks1;
  se.idx = lists_too ? ws_ptr<int32_t>(base, L.idx) : nullptr;
  se.cnt = lists_too ? ws_ptr<int32_t>(base, L.cnt) : nullptr;
  se.grouped = cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2     ? 1
               : cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE ? 2
                                                                     : 0;
  se.scores2 = se.grouped ? ws_ptr<float>(base, L.idx) : nullptr;
  se.count = se.grouped ? ws_ptr<float>(base, L.split_n) : nullptr;
  if (se.grouped && (L.idx == 0 || L.split_n == 0))
    return fail(SPARGE_ERR_INTERNAL, "CUDA selection: workspace layout lacks the grouped estimators' regions");
  if (lists_too && (L.idx == 0 || L.cnt == 0))
    return fail(SPARGE_ERR_INTERNAL, "CUDA selection: workspace layout lacks idx/cnt");
  const int64_t nrows = bhq * p.nQB;
  if (nrows > int64_t(0x7fffffff)) return fail(SPARGE_ERR_UNSUPPORTED, "selection grid too large");
  const size_t wsm = select_warp_smem(p.nKB);
  const int rpc = int(std::max<size_t>(1, std::min<size_t>(kSelRows, kSelSmem / wsm)));
  const size_t smem = size_t(rpc) * wsm;
  auto kern = cfg.mode == SPARGE_SELECT_TOPK ? select_kernel<true> : select_kernel<false>;
  SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(kern), int(smem), p.device_id));
  SPARGE_PDL_CHECK(launch_pdl(kern, dim3(unsigned(ceil_div(nrows, rpc))), dim3(32 * rpc), smem, stream, se,
                              uint32_t(nrows)),
                   "sparge block selection kernel");
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
