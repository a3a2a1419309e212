// Block scores of the estimator KEYS_LSE on the tensor cores (mma.sync, sm_80 and newer):
//   scores[bh, qb, kb] = log sum_j exp(float32(scale * pooled_q[bh, qb] . k_j))
// over the keys j of block kb that the last row of qb sees (docs/SEMANTICS.md, "Mask prediction").
//
// Work: per kv head, the g = Hq/Hkv heads' pooled query rows (g*nQB rows of Dk float32) times
// K^T (Dk x Lkv, the caller's 16-bit keys), then one log-sum-exp per (row, 64-key block).
//
// Precision. K is exact in its 16-bit type. A pooled row q (float32) is split into
// hi = rn16(q) and lo = rn16(q - hi) (q - hi is exact in float32), and both halves go through
// an m16n8k16 MMA with float32 accumulation: q.k = hi.k + lo.k + e, |e| <= u^2 sum_c |q_c k_c|
// with u the unit roundoff of the 16-bit type (fp16 2^-11: 2^-22; bf16 2^-8: 2^-16), plus the
// float32 accumulation error. For fp16, whose exponent range is narrow, each row is first
// multiplied by a power of two 2^s (exact) that puts its largest |q_c| in [2^14, 2^15), so that
// neither half overflows nor falls into the fp16 subnormals; the products are undone by the
// per-row factor scale * 2^-s (exact) applied to the float32 dot product. bf16 needs no scaling
// (float32's exponent range). The scores are float32(scale * dot) as in the CPU reference, up to
// that error; the exponentials use ex2.approx (relative error ~2^-22, far below it).
//
// Non-finite values (docs/SEMANTICS.md, "Non-finite values"): a NaN key score (a NaN in k or in
// the pooled row) makes the block score NaN, and a +Inf one makes it NaN too (inf - inf in the
// log-sum-exp), so the selection keeps every visible block of the row; a block whose visible
// scores are all -inf or NaN gets -inf or NaN. Keys past Lkv and keys the row does not see are
// excluded (zero-filled by the loads, set to -inf before the reduction). One difference from the
// CPU reference: an infinite k element meets q as two products, hi*k + lo*k, which is NaN when lo
// is 0 or of the other sign than hi, where the CPU's single product is +-Inf; a -Inf key score
// drops out of the CPU's log-sum-exp (exp(-inf) = 0), while here the row keeps every visible block.
//
// CTA: 8 warps, 128 pooled rows (row r of a kv head's g*nQB rows is query block r / g of head
// hk*g + r % g, so the query heads sharing K go through one CTA and rows of one CTA have
// nearly the same causal extent), 32 tiles of 64 keys streamed through a cp.async ring (16-byte
// copies, zero-fill past Lkv and past the head dim; scalar loads when K is not 16-byte aligned).
// Warp w owns rows 16w..16w+15: their hi/lo A fragments stay in registers for the whole key
// range; per tile it computes the 16 x 64 score tile (Dk/16 k-steps x 8 n-tiles x 2 MMAs, B
// fragments by ldmatrix from an XOR-swizzled tile) in two halves of 32 keys, masks, keeps a running
// max and sum of exponentials per row and thread, and merges them over the 4 lanes of a quad that
// hold a row. With causality a warp skips the tiles past its own rows' extent (the CTA loads
// them for its other warps). CTAs are ordered row chunk fastest, so the CTAs reading the same
// keys run together and share them through L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.hpp"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/predict.cuh"

namespace sparge {
namespace cuda {
namespace {

constexpr int kKsWarps = 8;
constexpr int kKsThreads = 32 * kKsWarps;
constexpr int kKsRows = 16 * kKsWarps;  // pooled rows per CTA
constexpr int kKsKeys = 64;             // keys per tile (one key block)
constexpr int kKsTiles = 32;            // key tiles per CTA (2048 keys)

template <int DK>
struct KsTraits {
  static_assert(DK % 64 == 0, "kernel head dim: a multiple of 64");
  static constexpr int kSteps = DK / 16;                 // k16 steps of the MMA
  static constexpr int kChunks = DK / 8;                 // 16-byte chunks per key row
  static constexpr int kRowBytes = DK * 2;
  static constexpr int kStageBytes = kKsKeys * kRowBytes;
  static constexpr int kStages = DK <= 128 ? 3 : 2;
  static constexpr int kSmem = kStages * kStageBytes;    // 48 KB at DK = 128, 64 KB at 256
  static constexpr int kLoads = kKsKeys * kChunks / kKsThreads;  // 16-byte chunks per thread and tile
  static constexpr int kMinBlocks = DK <= 128 ? 2 : 1;  // register budget: A fragments are 8*kSteps registers
};

struct KsArgs {
  Problem prob;
  Tensor4 k;
  const float* pooled_q;  // [B*Hq, nQB, Dk]
  float* scores;          // [B*Hq, nQB, nKB]
  int64_t rows;           // pooled rows per kv head: group * nQB
  uint32_t row_ctas, key_ctas;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), float32 accumulation.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x0, x1) -> packed hi = rn16(x) and lo = rn16(x - hi), low half first.
template <class T>
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo);
template <>
__device__ __forceinline__ void split2<__half>(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(__fsub_rn(x0, hf.x), __fsub_rn(x1, hf.y));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}
template <>
__device__ __forceinline__ void split2<__nv_bfloat16>(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(__fsub_rn(x0, hf.x), __fsub_rn(x1, hf.y));
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2f(int e) { return __int_as_float((127 + e) << 23); }

// A thread's share of the K tile loads: the 16-byte column chunk c = tid % kChunks of key rows
// r0 + i * kRowStep, i < kLoads (the same chunk every tile).
template <int DK, class T>
struct TileLoader {
  using Tr = KsTraits<DK>;
  static constexpr int kRowStep = kKsThreads / Tr::kChunks;
  static_assert(kKsThreads % Tr::kChunks == 0 && kRowStep * Tr::kLoads == kKsKeys && kRowStep % 8 == 0,
                "tile load split (every row of a thread has the same r & 7)");
  const T* col;        // k[b, hk, 0, 8c]
  int64_t rs;          // key row stride (elements)
  int32_t lkv;         // <= kMaxKeyBlocks * 64 (predict_supported)
  uint32_t soff;       // shared offset of row r0, chunk c ^ (r0 & 7)
  int r0, c;
  bool cok;            // chunk inside the head dim
  __device__ __forceinline__ TileLoader(const KsArgs& a, uint32_t b, uint32_t hk) {
    const int tid = int(threadIdx.x);
    c = tid % Tr::kChunks;
    r0 = tid / Tr::kChunks;
    cok = c * 8 < int(a.prob.D);
    col = static_cast<const T*>(a.k.data) + (cok ? a.k.offset(b, hk, 0, c * 8) : 0);
    rs = a.k.stride[2];
    lkv = int32_t(a.prob.Lkv);
    soff = uint32_t(r0 * Tr::kRowBytes + ((c ^ (r0 & 7)) << 4));
  }
  // One 64-key tile (keys j0..j0+63) into a stage: key row r, chunk c stored at chunk c ^ (r & 7)
  // of the row (the 8 rows an ldmatrix reads fall into 8 different bank groups). Keys past Lkv and
  // columns past the head dim are zeros.
  template <bool VEC>
  __device__ __forceinline__ void load(int32_t j0, uint32_t stage, unsigned char* stage_ptr) const {
#pragma unroll
    for (int i = 0; i < Tr::kLoads; ++i) {
      const int32_t j = j0 + r0 + i * kRowStep;
      const bool ok = cok && j < lkv;
      const uint32_t off = soff + uint32_t(i * kRowStep * Tr::kRowBytes);
      const T* src = col + (ok ? int64_t(j) * rs : int64_t(0));
      if constexpr (VEC) {
        cp_async16(stage + off, src, ok ? 16u : 0u);
      } else {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (ok) v = load8_raw<false>(src);
        *reinterpret_cast<uint4*>(stage_ptr + off) = v;
      }
    }
  }
};

template <int DK, class T, bool VEC>
__global__ void __launch_bounds__(kKsThreads, KsTraits<DK>::kMinBlocks) key_scores_mma_kernel(const KsArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  using Tr = KsTraits<DK>;
  constexpr int KS = Tr::kSteps;
  extern __shared__ __align__(128) unsigned char ks_smem[];
  const Problem& p = a.prob;

  const uint32_t rc = blockIdx.x % a.row_ctas, t2 = blockIdx.x / a.row_ctas;
  const uint32_t kc = t2 % a.key_ctas, bhk = t2 / a.key_ctas;
  const uint32_t Hkv = uint32_t(p.Hkv), g = uint32_t(p.Hq / p.Hkv);
  const uint32_t b = bhk / Hkv, hk = bhk % Hkv;
  const int64_t row0 = int64_t(rc) * kKsRows;
  const int64_t row_last = min(a.rows, row0 + kKsRows) - 1;
  // rows are query-block major: the CTA's last row has its largest query block, hence its causal extent
  const int64_t vis = visible_key_blocks(p, row_last / g);
  const int64_t t_begin = int64_t(kc) * kKsTiles;
  const int64_t t_end = min(vis, t_begin + kKsTiles);
  if (t_begin >= t_end) return;  // uniform
  const int ntiles = int(t_end - t_begin);

  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  // the warp's own extent: tiles past it are loaded for the other warps but not multiplied (causal)
  const int64_t wrow_last = min(a.rows, row0 + 16 * warp + 16) - 1;
  const int64_t wvis = wrow_last < row0 + 16 * warp ? 0 : visible_key_blocks(p, wrow_last / g);

  const uint32_t smem0 = smem_u32(ks_smem);
  const TileLoader<DK, T> ld(a, b, hk);
  // prologue: the first stages of K in flight while the A fragments are built
#pragma unroll
  for (int s = 0; s < Tr::kStages - 1; ++s) {
    if (s < ntiles)
      ld.template load<VEC>(int32_t(t_begin + s) * kKsKeys, smem0 + s * Tr::kStageBytes, ks_smem + s * Tr::kStageBytes);
    cp_async_commit();
  }

  const int gq = lane >> 2, tq = lane & 3;  // group (row) and thread-in-group of the MMA fragments
  const int D = int(p.D);

  // the thread's two rows: gq and gq + 8 of the warp's 16
  int64_t srow[2];     // score row offset (bh * nQB + qb) * nKB, or -1 for a padding row
  int32_t last[2];     // last visible key of the row (-1: none)
  float fac[2];        // scale * 2^-s
  float xv[2][KS][4];  // the row's float32 values at the fragment positions: (ks, {c, c+1, c+8, c+9})
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + 16 * warp + gq + 8 * r;
    srow[r] = -1;
    last[r] = -1;
    const float* pq = nullptr;
    if (row < a.rows) {
      const int64_t qb = row / g, h = int64_t(hk) * g + row % g, bh = int64_t(b) * p.Hq + h;
      pq = a.pooled_q + (bh * p.nQB + qb) * DK;
      srow[r] = (bh * p.nQB + qb) * p.nKB;
      int64_t lk = p.Lkv - 1;
      if (p.causal) lk = min(lk, causal_last_key(min(p.Lq, (qb + 1) * p.BQ) - 1, p.Lq, p.Lkv));
      last[r] = int32_t(max(lk, int64_t(-1)));
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int c = ks * 16 + 8 * hh + 2 * tq;
        float2 v = make_float2(0.f, 0.f);
        if (pq != nullptr && c < D) v = *reinterpret_cast<const float2*>(pq + c);
        xv[r][ks][2 * hh] = v.x;
        xv[r][ks][2 * hh + 1] = v.y;
      }
  }
  // per-row power-of-two scaling (fp16) and the hi/lo split
  uint32_t ah[KS][4], al[KS][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    fac[r] = p.scale;
    if constexpr (std::is_same<T, __half>::value) {
      float mx = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx = fmaxf(mx, fabsf(xv[r][ks][e]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      int s = 0;
      if (mx > 0.f && isfinite(mx)) {  // (fmaxf drops NaN; an infinite row stays unscaled and non-finite)
        int ex;
        frexpf(mx, &ex);  // mx in [2^(ex-1), 2^ex)
        s = min(max(15 - ex, -64), 64);
      }
      if (s != 0) {
        const float up = pow2f(s);
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
#pragma unroll
          for (int e = 0; e < 4; ++e) xv[r][ks][e] *= up;
        fac[r] = p.scale * pow2f(-s);
      }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      // a0/a1: rows gq / gq+8, columns c, c+1; a2/a3: the same rows, columns c+8, c+9
      split2<T>(xv[r][ks][0], xv[r][ks][1], ah[ks][r], al[ks][r]);
      split2<T>(xv[r][ks][2], xv[r][ks][3], ah[ks][2 + r], al[ks][2 + r]);
    }
  }

  // ldmatrix.x4 rows of this lane: keys 16 np + 8 (lane >> 4) + (lane & 7), chunk 2 ks + ((lane >> 3) & 1)
  const uint32_t lrow = uint32_t((8 * (lane >> 4) + (lane & 7)) * Tr::kRowBytes);
  const int lsel = (lane >> 3) & 1, lxor = lane & 7;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  int stage = 0;
  for (int i = 0; i < ntiles; ++i) {
    cp_async_wait<Tr::kStages - 2>();
    __syncthreads();  // tile i landed for every thread; the stage of tile i-1 is free
    {
      const int nx = i + Tr::kStages - 1;
      int ns = stage + Tr::kStages - 1;
      if (ns >= Tr::kStages) ns -= Tr::kStages;
      if (nx < ntiles)
        ld.template load<VEC>(int32_t(t_begin + nx) * kKsKeys, smem0 + ns * Tr::kStageBytes, ks_smem + ns * Tr::kStageBytes);
      cp_async_commit();
    }
    const uint32_t sbase = smem0 + uint32_t(stage * Tr::kStageBytes) + lrow;
    if (++stage == Tr::kStages) stage = 0;
    const int64_t tile = t_begin + i;
    if (tile >= wvis) continue;  // warp-uniform; the next iteration's barrier is still reached
    const int32_t j0 = int32_t(tile * kKsKeys);
    // The tile in two halves of 32 keys (half the accumulator registers live at a time). Each
    // thread keeps, per row, a running max mrun and sum of exponentials srun relative to it over the
    // keys it holds that the row sees: acc[n][2r + e] is key 32 half + 8n + 2tq + e of row r.
    float mrun[2] = {-INFINITY, -INFINITY}, srun[2] = {0.f, 0.f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float acc[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t coff = uint32_t(((2 * ks + lsel) ^ lxor) << 4);
        uint32_t bf[2][4];
#pragma unroll
        for (int np = 0; np < 2; ++np)
          ldmatrix_x4(sbase + uint32_t((2 * half + np) * 16 * Tr::kRowBytes) + coff, bf[np]);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          mma16816<T>(acc[2 * np], ah[ks], bf[np][0], bf[np][1]);
          mma16816<T>(acc[2 * np + 1], ah[ks], bf[np][2], bf[np][3]);
        }
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          mma16816<T>(acc[2 * np], al[ks], bf[np][0], bf[np][1]);
          mma16816<T>(acc[2 * np + 1], al[ks], bf[np][2], bf[np][3]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int32_t lim = last[r] - j0 - 32 * half;  // keys 0..lim of the half are visible
        float sv[8];
        float m = mrun[r];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = 8 * n + 2 * tq + e <= lim ? fac[r] * acc[n][2 * r + e] : -INFINITY;
            sv[2 * n + e] = x;
            m = fmaxf(m, x);  // ignores NaN; a NaN reaches the sum below
          }
        // m == -inf: every term so far is -inf (exp 0) or NaN (stays NaN); no inf - inf
        const float mb = (m == -INFINITY ? 0.f : m) * kLog2e;
        float sum = srun[r] * ex2_approx(fmaf(mrun[r], kLog2e, -mb));
#pragma unroll
        for (int t = 0; t < 8; ++t) sum += ex2_approx(fmaf(sv[t], kLog2e, -mb));
        mrun[r] = m;
        srun[r] = sum;
      }
    }
    // merge the 4 lanes of a quad (they hold the row's 64 keys) and write the block score
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t lim = last[r] - j0;  // lim < 0: the row sees no key of the block (not written)
      float m = fmaxf(mrun[r], __shfl_xor_sync(0xffffffffu, mrun[r], 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float mb = (m == -INFINITY ? 0.f : m) * kLog2e;
      float sum = srun[r] * ex2_approx(fmaf(mrun[r], kLog2e, -mb));
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (tq == 0 && lim >= 0) a.scores[srow[r] + tile] = m + __log2f(sum) * kLn2;
    }
  }
}

}  // namespace

sparge_status_t launch_key_scores(const Plan& plan, const Tensor4& k, void* ws, cudaStream_t stream) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  if (p.BK != kKsKeys)
    return fail(SPARGE_ERR_UNSUPPORTED, "estimator KEYS_LSE on CUDA needs block_k = %d, got %lld", kKsKeys,
                (long long)p.BK);
  char* base = static_cast<char*>(ws);
  KsArgs ka;
  ka.prob = p;
  ka.k = k;
  ka.pooled_q = ws_ptr<float>(base, L.pooled_q);
  ka.scores = ws_ptr<float>(base, L.scores);
  ka.rows = p.group() * p.nQB;
  const int64_t row_ctas = ceil_div(ka.rows, kKsRows), key_ctas = ceil_div(p.nKB, kKsTiles);
  const int64_t n = p.B * p.Hkv * row_ctas * key_ctas;
  if (n <= 0) return SPARGE_OK;
  if (n > int64_t(0x7fffffff) || row_ctas > int64_t(0xffffffff))
    return fail(SPARGE_ERR_UNSUPPORTED, "key score grid too large");
  ka.row_ctas = uint32_t(row_ctas), ka.key_ctas = uint32_t(key_ctas);
  // 16-byte copies need a 16-byte aligned base and row/head/batch strides of multiples of 8 elements
  bool vec = reinterpret_cast<uintptr_t>(k.data) % 16 == 0;
  for (int d = 0; d < 3; ++d)
    if (k.shape[d] > 1 && k.stride[d] % 8 != 0) vec = false;
  cudaError_t err = cudaErrorInvalidValue;
  const bool built = dispatch_dim_type(p.Dk, p.dtype, [&](auto dc, auto tt) {
    constexpr int DK = decltype(dc)::value;
    using T = typename decltype(tt)::type;
    auto kern = vec ? key_scores_mma_kernel<DK, T, true> : key_scores_mma_kernel<DK, T, false>;
    constexpr int smem = KsTraits<DK>::kSmem;
    err = cudaSuccess;
    if (smem > 48 * 1024) err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err == cudaSuccess) err = launch_pdl(kern, dim3(unsigned(n)), dim3(kKsThreads), size_t(smem), stream, ka);
  });
  if (!built)
    return fail(SPARGE_ERR_UNSUPPORTED, "estimator KEYS_LSE on CUDA: kernel head dim %lld not built",
                (long long)p.Dk);
  SPARGE_PDL_CHECK(err, "sparge per-key scores kernel");
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
