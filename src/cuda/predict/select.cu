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
// One CTA of 256 threads per (bh, 64 query blocks, 64 key blocks) tile; the
// head dimension goes through shared memory in chunks of 32 (float64). Each
// thread computes 4 query blocks x 4 key blocks.
constexpr int kST = 64;   // tile edge (query blocks and key blocks)
constexpr int kSDC = 32;  // head-dim chunk
constexpr int kSThreads = 256;

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
  __shared__ double sq[kST][kSDC + 1];
  __shared__ double sk[kST][kSDC + 1];
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
  const int tx = tid % 16, ty = tid / 16;  // key blocks tx + 16j, query blocks 4ty + i
  double acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0;

  for (int d0 = 0; d0 < D; d0 += kSDC) {
    __syncthreads();
    for (int e = tid; e < kST * kSDC; e += kSThreads) {
      const int r = e / kSDC, c = e % kSDC;
      const int64_t qb = qb0 + r, kb = kb0 + r;
      sq[r][c] = qb < p.nQB ? double(pq[qb * D + d0 + c]) : 0.0;
      sk[r][c] = kb < p.nKB ? double(pk[kb * D + d0 + c]) : 0.0;
    }
    __syncthreads();
#pragma unroll 4
    for (int c = 0; c < kSDC; ++c) {
      double qv[4], kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = sq[4 * ty + i][c];
#pragma unroll
      for (int j = 0; j < 4; ++j) kv[j] = sk[tx + 16 * j][c];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fma(qv[i], kv[j], acc[i][j]);
    }
  }
  const double scale = double(p.scale);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t qb = qb0 + 4 * ty + i;
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
constexpr int kSelThreads = 256;

struct SelectArgs {
  Problem prob;
  PredictConfig cfg;
  const float* scores;  // [B*Hq, nQB, nKB]
  const float* sim_q;   // [B*Hq, nQB]
  const float* sim_k;   // [B*Hkv, nKB]
  MaskView mask;
  int32_t* kept;
  int64_t kept_s0, kept_s1;
  int64_t n2max;        // power of two >= nKB: sort capacity
};

__device__ __forceinline__ uint64_t sort_key(float prob, int64_t kb) {
  // ascending order of the key = probability descending, then block index ascending
  return (uint64_t(~__float_as_uint(prob)) << 32) | uint64_t(uint32_t(kb));
}
__device__ __forceinline__ float key_prob(uint64_t key) { return __uint_as_float(~uint32_t(key >> 32)); }

// Bitonic sort (ascending) of n (power of two) keys in shared memory.
__device__ void bitonic_sort(uint64_t* keys, int n) {
  const int half = n >> 1;
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int pidx = threadIdx.x; pidx < half; pidx += blockDim.x) {
        const int i = 2 * pidx - (pidx & (j - 1));  // lower element of the pair, bit j clear
        const int l = i + j;
        const uint64_t x = keys[i], y = keys[l];
        const bool up = (i & k) == 0;
        if ((x > y) == up) {
          keys[i] = y;
          keys[l] = x;
        }
      }
      __syncthreads();
    }
  }
}

// Block-wide exclusive scan of one double per thread (fixed order).
__device__ double block_exclusive_scan(double v, double* red /* >= 33 */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  double x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) red[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    double run = 0.0;
    for (int w = 0; w < nw; ++w) {
      const double s = red[w];
      red[w] = run;
      run += s;
    }
  }
  __syncthreads();
  return red[warp] + x - v;
}

// One CTA per (bh, qb) row. Dynamic shared memory: n2max keys (u64) + nKB flags.
__global__ void __launch_bounds__(kSelThreads) select_kernel(const SelectArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double dred[40];
  __shared__ float fred[32];
  __shared__ int ired[32];
  const Problem& p = a.prob;
  const PredictConfig& cfg = a.cfg;
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  uint8_t* sel = smem + a.n2max * sizeof(uint64_t);

  const int64_t qb = blockIdx.x % p.nQB, bh = blockIdx.x / p.nQB;
  const int64_t b = bh / p.Hq, h = bh % p.Hq, bhk = b * p.Hkv + h / (p.Hq / p.Hkv);
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t nKB = p.nKB;
  const int V = int(visible_key_blocks(p, qb));
  const float sim_thr = cfg.sim_per_head ? cfg.sim_per_head[h] : cfg.sim_threshold;

  for (int64_t kb = tid; kb < nKB; kb += nt) sel[kb] = 0;
  __syncthreads();

  if (V > 0) {
    const bool force_row = a.sim_q[bh * p.nQB + qb] < sim_thr;
    int64_t nsel = 0;  // selected prefix length of the sorted order (uniform)
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
      int n2 = 1;
      while (n2 < V) n2 <<= 1;
      for (int i = tid; i < n2; i += nt) {
        uint64_t key = ~uint64_t(0);  // padding sorts last
        if (i < V) key = sort_key(float(exp(double(srow[i]) - double(mx)) / tot), i);
        keys[i] = key;
      }
      __syncthreads();
      bitonic_sort(keys, n2);

      if (cfg.mode == SPARGE_SELECT_TOPK) {
        const float topk = cfg.topk_per_head ? cfg.topk_per_head[h] : cfg.topk;
        nsel = topk_count(topk, V);
      } else {
        const float cdf = cfg.cdf_per_head ? cfg.cdf_per_head[h] : cfg.cdf_threshold;
        // first sorted position whose inclusive prefix sum reaches cdf
        const int seg = (V + nt - 1) / nt;
        const int s0 = min(V, tid * seg), s1 = min(V, s0 + seg);
        double local = 0.0;
        for (int i = s0; i < s1; ++i) local += double(key_prob(keys[i]));
        double run = block_exclusive_scan(local, dred);
        int first = V;  // none reached: keep all
        for (int i = s0; i < s1; ++i) {
          run += double(key_prob(keys[i]));
          if (run >= double(cdf)) {
            first = i;
            break;
          }
        }
        // min over threads
        int m = first;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = min(m, __shfl_xor_sync(0xffffffffu, m, o));
        __syncthreads();
        if ((tid & 31) == 0) ired[tid >> 5] = m;
        __syncthreads();
        m = ired[0];
        for (int w = 1; w < (nt >> 5); ++w) m = min(m, ired[w]);
        nsel = m >= V ? V : m + 1;
      }
      for (int64_t i = tid; i < nsel; i += nt) sel[uint32_t(keys[i])] = 1;
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
  int64_t n2 = 1;
  while (n2 < p.nKB) n2 <<= 1;
  se.n2max = n2;
  const size_t smem = size_t(n2) * sizeof(uint64_t) + size_t((p.nKB + 15) / 16 * 16);
  if (smem > 48 * 1024)
    SPARGE_CUDA_TRY(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  select_kernel<<<unsigned(bhq * p.nQB), kSelThreads, smem, stream>>>(se);
  SPARGE_LAUNCH_CHECK("sparge block selection kernel");
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
