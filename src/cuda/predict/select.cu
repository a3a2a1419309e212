// Block selection: pooled scores (float64 dot products of the float32 pooled
// vectors, rounded to float32 as the CPU reference does), per-row softmax
// (float64), top-k / CDF selection with the exact tie rule (probability
// descending, lower block index first), forced blocks, the uint8 mask and the
// kept counts. Pipeline and costs: docs/PREDICTION.md.
#include "core/error.hpp"
#include "cuda/common.cuh"
#include "cuda/internal.cuh"
#include "cuda/predict/predict.cuh"

namespace sparge {
namespace cuda {
namespace {

// ---------------------------------------------------------------- pooled scores
// scores[bh, qb, kb] = float(double(scale) * sum_c double(pq[c]) * double(pk[c]))
// (the products are exact in float64 and summed in ascending c with fma, the
// CPU reference's order). One CTA of 128 threads per (bh, 64 query blocks,
// 64 key blocks) tile; the head dimension goes through shared memory in
// chunks of 32, stored transposed ([c][block]) so that the key-block reads of
// a warp are consecutive. Each thread computes 8 query blocks x 4 key blocks.
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

__global__ void __launch_bounds__(kSThreads) scores_kernel(const ScoreArgs a) {
  __shared__ double sq[kSDC][kST];
  __shared__ double sk[kSDC][kST];
  const Problem& p = a.prob;
  int64_t t = blockIdx.x;
  const int64_t tk = t % a.ntk;
  t /= a.ntk;
  const int64_t tq = t % a.ntq, bh = t / a.ntq;
  const int64_t b = bh / p.Hq, h = bh % p.Hq, bhk = b * p.Hkv + h / (p.Hq / p.Hkv);
  const int tid = threadIdx.x;
  if (tq == 0 && tk == 0 && tid == 0) a.kept[b * a.kept_s0 + h * a.kept_s1] = 0;

  const int64_t qb0 = tq * kST, kb0 = tk * kST;
  const int64_t qb_last = min(p.nQB, qb0 + kST) - 1;
  if (kb0 >= visible_key_blocks(p, qb_last)) return;  // nothing visible in this tile (uniform)

  const int D = int(p.D);
  const float* pq = a.pooled_q + (bh * p.nQB) * D;
  const float* pk = a.pooled_k + (bhk * p.nKB) * D;
  const int tx = tid % 16, ty = tid / 16;  // key blocks tx + 16j (j < 4), query blocks ty + 8i (i < 8)
  double acc[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0;

  for (int d0 = 0; d0 < D; d0 += kSDC) {
    __syncthreads();
    // 64 rows x 32 floats per operand: 8 consecutive threads read one row's 32 floats as float4
    for (int e = tid; e < kST * (kSDC / 4); e += kSThreads) {
      const int r = e / (kSDC / 4), c4 = (e % (kSDC / 4)) * 4;
      const int64_t qb = qb0 + r, kb = kb0 + r;
      float4 qv = make_float4(0.f, 0.f, 0.f, 0.f), kv = qv;
      if (qb < p.nQB) qv = *reinterpret_cast<const float4*>(pq + qb * D + d0 + c4);
      if (kb < p.nKB) kv = *reinterpret_cast<const float4*>(pk + kb * D + d0 + c4);
      sq[c4 + 0][r] = qv.x, sq[c4 + 1][r] = qv.y, sq[c4 + 2][r] = qv.z, sq[c4 + 3][r] = qv.w;
      sk[c4 + 0][r] = kv.x, sk[c4 + 1][r] = kv.y, sk[c4 + 2][r] = kv.z, sk[c4 + 3][r] = kv.w;
    }
    __syncthreads();
#pragma unroll 2
    for (int c = 0; c < kSDC; ++c) {
      double qv[8], kv[4];
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[i] = sq[c][ty + 8 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[j] = sk[c][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fma(qv[i], kv[j], acc[i][j]);
    }
  }
  const double scale = double(p.scale);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t qb = qb0 + ty + 8 * i;
    if (qb >= p.nQB) continue;
    float* row = a.scores + (bh * p.nQB + qb) * p.nKB;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t kb = kb0 + tx + 16 * j;
      if (kb < p.nKB) row[kb] = float(scale * acc[i][j]);
    }
  }
}

// ---------------------------------------------------------------- selection
// Per row: probabilities P (float32, from a float64 softmax), then the
// selection threshold by a bitwise search over the bit patterns of P
// (non-negative floats order like their bit patterns):
//  - top-k: weight 1 per block, target n = max(1, floor(topk * visible));
//  - CDF: weight P in 2^-62 fixed point (exact and associative), target
//    cdf_threshold in the same fixed point.
// With W(t) = total weight of the blocks whose P bits are >= t, the search
// builds t* = max { t : W(t) >= target } bit by bit from the most significant
// one (W is monotone), one block-wide reduction per bit (deterministic, no
// atomics, no contention on ties). t* is the P of the last selected block in
// the ordering (P descending, lower index first). Blocks with P > t* are kept
// and, of the blocks with P == t*, the lowest-index ones, as many as needed to
// reach the target.
constexpr int kSelThreads = 128;
constexpr int kSelCache = 8;  // register-cached blocks per thread (V <= 1024 fully cached)

struct SelectArgs {
  Problem prob;
  PredictConfig cfg;
  const float* scores;  // [B*Hq, nQB, nKB]
  const float* sim_q;   // [B*Hq, nQB]
  const float* sim_k;   // [B*Hkv, nKB]
  MaskView mask;
  int32_t* kept;
  int64_t kept_s0, kept_s1;
};

// P in units of 2^-62 (exact for P >= 2^-38; smaller P are truncated).
__device__ __forceinline__ unsigned long long fixed62(uint32_t pbits) {
  return __float2ull_rz(__uint_as_float(pbits) * 4611686018427387904.0f);
}

// Block-wide sum of one u64 per thread; every thread gets the total. `red`
// holds 2 x 32 slots (alternating buffers: one barrier per call).
__device__ __forceinline__ unsigned long long block_sum_u64(unsigned long long v, unsigned long long* red,
                                                            int& parity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  unsigned long long* r = red + 32 * parity;
  parity ^= 1;
  if (lane == 0) r[warp] = v;
  __syncthreads();
  unsigned long long s = 0;
  for (int w = 0; w < nw; ++w) s += r[w];
  return s;
}

// Block-wide exclusive scan of one int per thread (fixed order).
__device__ __forceinline__ int block_exclusive_scan_int(int v, int* red /* >= 32 */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) red[warp] = x;
  __syncthreads();
  int base = 0;
  for (int w = 0; w < warp; ++w) base += red[w];
  return base + x - v;
}

// One CTA per (bh, qb) row. Dynamic shared memory: nKB probability bit
// patterns (u32) + nKB flags.
__global__ void __launch_bounds__(kSelThreads) select_kernel(const SelectArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ unsigned long long u64red[64];
  __shared__ double dred[32];
  __shared__ float fred[32];
  __shared__ int ired[32];
  const Problem& p = a.prob;
  const PredictConfig& cfg = a.cfg;
  const int64_t nKB = p.nKB;
  uint32_t* pb = reinterpret_cast<uint32_t*>(smem);
  uint8_t* sel = smem + nKB * sizeof(uint32_t);

  const int64_t qb = blockIdx.x % p.nQB, bh = blockIdx.x / p.nQB;
  const int64_t b = bh / p.Hq, h = bh % p.Hq, bhk = b * p.Hkv + h / (p.Hq / p.Hkv);
  const int tid = threadIdx.x, nt = blockDim.x;
  const int V = int(visible_key_blocks(p, qb));
  const float sim_thr = cfg.sim_per_head ? cfg.sim_per_head[h] : cfg.sim_threshold;

  for (int64_t kb = tid; kb < nKB; kb += nt) sel[kb] = 0;
  __syncthreads();

  if (V > 0) {
    const bool force_row = a.sim_q[bh * p.nQB + qb] < sim_thr;
    if (force_row) {
      for (int kb = tid; kb < V; kb += nt) sel[kb] = 1;
    } else {
      const float* srow = a.scores + (bh * p.nQB + qb) * nKB;
      // softmax over the visible entries (float64, as the CPU reference)
      float mx = -INFINITY;
      for (int kb = tid; kb < V; kb += nt) mx = fmaxf(mx, srow[kb]);
      mx = block_reduce(mx, fred, OpMax{});
      double tot = 0.0;
      for (int kb = tid; kb < V; kb += nt) tot += exp(double(srow[kb]) - double(mx));
      tot = block_reduce(tot, dred, OpSum{});
      for (int kb = tid; kb < V; kb += nt)
        pb[kb] = __float_as_uint(float(exp(double(srow[kb]) - double(mx)) / tot));

      const bool cdf_mode = cfg.mode != SPARGE_SELECT_TOPK;
      unsigned long long target;
      if (cdf_mode) {
        const float cdf = cfg.cdf_per_head ? cfg.cdf_per_head[h] : cfg.cdf_threshold;
        target = fixed62(__float_as_uint(cdf));
      } else {
        const float topk = cfg.topk_per_head ? cfg.topk_per_head[h] : cfg.topk;
        target = (unsigned long long)topk_count(topk, V);
      }
      __syncthreads();  // pb complete
      // Blocks tid + i*nt: bit patterns and weights cached in registers for the
      // search (the first kSelCache per thread; the rest, if any, from shared memory).
      const int nloc = (V + nt - 1) / nt;
      uint32_t uc[kSelCache];
      unsigned long long wc[kSelCache];
#pragma unroll
      for (int i = 0; i < kSelCache; ++i) {
        const int kb = tid + i * nt;
        const bool valid = i < nloc && kb < V;
        uc[i] = valid ? pb[kb] : 0u;
        wc[i] = valid ? (cdf_mode ? fixed62(uc[i]) : 1ull) : 0ull;
      }
      int parity = 0;
      auto weight_ge = [&](uint32_t t) {
        unsigned long long w = 0;
#pragma unroll
        for (int i = 0; i < kSelCache; ++i)
          if (i < nloc && uc[i] >= t) w += wc[i];
        for (int kb = tid + kSelCache * nt; kb < V; kb += nt) {
          const uint32_t u = pb[kb];
          if (u >= t) w += cdf_mode ? fixed62(u) : 1ull;
        }
        return block_sum_u64(w, u64red, parity);
      };
      if (target == 0 || weight_ge(0) < target) {  // CDF never reached (rounding): keep all visible
        for (int kb = tid; kb < V; kb += nt) sel[kb] = 1;
      } else {
        uint32_t tstar = 0;
        for (int bit = 30; bit >= 0; --bit) {  // P <= 1: bits 31 and 30 of t* are 0 (bit 30 tested anyway)
          const uint32_t cand = tstar | (1u << bit);
          if (weight_ge(cand) >= target) tstar = cand;
        }
        const unsigned long long above = weight_ge(tstar + 1);
        const unsigned long long rem = target - above;
        unsigned long long need = rem;  // ties (P == t*) to take, in index order
        if (cdf_mode) {
          const unsigned long long w = fixed62(tstar);
          need = w ? (rem + w - 1) / w : 1;
        }
        // ties ranked in index order: thread t owns the contiguous blocks [s0, s1)
        const int seg = (V + nt - 1) / nt;
        const int s0 = min(V, tid * seg), s1 = min(V, s0 + seg);
        int ties = 0;
        for (int kb = s0; kb < s1; ++kb) ties += pb[kb] == tstar;
        int rank = block_exclusive_scan_int(ties, ired);
        for (int kb = s0; kb < s1; ++kb) {
          const uint32_t u = pb[kb];
          if (u > tstar) {
            sel[kb] = 1;
          } else if (u == tstar) {
            if ((unsigned long long)rank < need) sel[kb] = 1;
            ++rank;
          }
        }
      }
    }
    __syncthreads();
    // forced blocks: non-compressible key blocks, attention sink
    const float* sk = a.sim_k + bhk * nKB;
    for (int kb = tid; kb < V; kb += nt)
      if (sk[kb] < sim_thr) sel[kb] = 1;
    if (cfg.attention_sink && tid == 0) sel[0] = 1;
    __syncthreads();
  }

  // write the whole row (invisible blocks are 0) and count
  int cnt = 0;
  uint8_t* mrow = a.mask.data + a.mask.offset(b, h, qb, 0);
  const int64_t ms = a.mask.stride[3];
  for (int64_t kb = tid; kb < nKB; kb += nt) {
    const uint8_t v = sel[kb];
    mrow[kb * ms] = v;
    cnt += v;
  }
  cnt = block_reduce(cnt, ired, OpSum{});
  if (tid == 0 && cnt > 0) atomicAdd(a.kept + b * a.kept_s0 + h * a.kept_s1, cnt);
}

}  // namespace

sparge_status_t launch_select(const Plan& plan, const PredictConfig& cfg, const MaskView& mask,
                              const KeptView* kept, void* ws, cudaStream_t stream) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  char* base = static_cast<char*>(ws);
  const int64_t bhq = p.B * p.Hq;

  int32_t* kept_ptr = ws_ptr<int32_t>(base, L.kept);
  int64_t ks0 = p.Hq, ks1 = 1;
  if (kept && kept->data) {
    kept_ptr = kept->data;
    ks0 = kept->stride[0], ks1 = kept->stride[1];
  }

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
  scores_kernel<<<unsigned(nsb), kSThreads, 0, stream>>>(sa);
  SPARGE_LAUNCH_CHECK("sparge pooled scores kernel");

  SelectArgs se;
  se.prob = p;
  se.cfg = cfg;
  se.scores = sa.scores;
  se.sim_q = ws_ptr<float>(base, L.sim_q);
  se.sim_k = ws_ptr<float>(base, L.sim_k);
  se.mask = mask;
  se.kept = kept_ptr, se.kept_s0 = ks0, se.kept_s1 = ks1;
  const size_t smem = size_t(p.nKB) * (sizeof(uint32_t) + 1);
  if (smem > 48 * 1024)
    SPARGE_CUDA_TRY(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  select_kernel<<<unsigned(bhq * p.nQB), kSelThreads, smem, stream>>>(se);
  SPARGE_LAUNCH_CHECK("sparge block selection kernel");
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
