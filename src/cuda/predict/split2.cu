// Estimators KEYS_LSE_SPLIT2 and KEYS_LSE_ADAPTIVE on CUDA (docs/SEMANTICS.md, "Mask prediction",
// step 3; pipeline and costs: docs/PREDICTION.md). Two launches after the preparation's passes
// (three with KEYS_LSE_ADAPTIVE) and the combination inside the selection:
//   1. split2_group_kernel: per 128-row query block, the two groups of similar rows and their float32
//      mean rows and sizes, in float32 with the CPU reference's operations in its order (every sum a
//      sum4, below; no fused multiply-adds), so that groups and means equal the CPU backend's bit for
//      bit; KEYS_LSE_ADAPTIVE keeps one group (every row, the
//      block's mean row) unless the rows' mean is short but not near 0 (0.25 to 0.75 of their mean
//      length), decided in float32 as on the CPU; then split2_list_kernel lists the rows to score
//      per kv head;
//   2. the KEYS_LSE block-score kernels on both mean rows of every query block (ks::Args::sub = 2;
//      KEYS_LSE_ADAPTIVE: on the listed rows only, ks::Args::list),
//      the first group's scores into the score region, the second group's into the index-list region
//      (free until the selection writes the lists, after step 3 has read it);
//   3. (in the selection kernel, select.cu: combine_groups) per row, each group's scores normalized
//      over the visible blocks and their size-weighted mean, log(sum_g (n_g / n) exp(s_g - lse s_g)),
//      in float32, ranked as KEYS_LSE scores (KEYS_LSE_ADAPTIVE: rows of one group keep the
//      KEYS_LSE scores of step 2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/attention/portable/primitives.cuh"
#include "cuda/common/device.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/predict.cuh"
#include "cuda/prepare/passes.cuh"

namespace sparge {
namespace cuda {
namespace {

constexpr int kGThreads = 128;  // one thread per row of a query block (kGpuBlockQ rows)
static_assert(kGThreads == kGpuBlockQ, "one grouping thread per query row");

struct GroupArgs {
  Tensor4 q;
  int d_in;  // the tensor's head dim (<= Dk)
  int64_t Hq, Lq, nQB;
  float* rows;   // [B*Hq, nQB, 2, Dk]: the groups' mean rows (zeros past d_in, and for an empty group)
  float* count;  // [B*Hq, nQB, 2]: the groups' sizes
  bool adaptive;  // KEYS_LSE_ADAPTIVE: one group unless the rows' mean is 0.25 to 0.75 of their length
};

// Shared memory of the grouping kernel: the block's rows as 16-bit values, then float32 vectors.
template <int DK>
struct GroupSmem {
  // 16-bit elements per row: thread r reads row r 8 bytes at a time (rows 8-byte aligned), a warp in
  // 2 phases of 16 lanes on banks (2r + c/2, 2r + c/2 + 1) mod 32: DK + 4 is 2 words past a
  // multiple of 32 words (DK a multiple of 64)
  static constexpr int kPitch = DK + 4;
  static constexpr int kMu = kGThreads * kPitch * 2;  // float [DK]: the mean row
  static constexpr int kGm = kMu + DK * 4;             // float [2][DK]: the groups' means
  static constexpr int kLen = kGm + 2 * DK * 4;        // float [128]: the rows' lengths (adaptive)
  static constexpr int kRedD = kLen + kGThreads * 4;   // float [4]: reductions
  static constexpr int kRedR = kRedD + 16;             // int [4]
  static constexpr int kList = kRedR + 16;             // int [2][128]: each group's rows (byte offsets), ascending
  static constexpr int kBytes = kList + 2 * kGThreads * 4;
};

// Every float32 operation below is rounded on its own (no fused multiply-add), in the CPU
// reference's order (src/cpu/predict.cpp, split2_rows), so that both backends form the same groups.
// A sum over i = 0 .. n-1 is four partial sums over i = k (mod 4), each in ascending i, added as
// (p0 + p1) + (p2 + p3) (four independent chains: a quarter of the latency of one).
struct Sum4 {
  float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  __device__ __forceinline__ void add(int k, float v) { p[k] = __fadd_rn(p[k], v); }
  __device__ __forceinline__ float total() const { return __fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3])); }
};

// sum4 of f(i), i < n (U: the unroll count of the loop over groups of four; a count above n / 4
// with n a constant unrolls it fully).
template <int U = 2, class F>
__device__ __forceinline__ float sum4(int n, F&& f) {
  Sum4 s;
  int i = 0;
#pragma unroll U
  for (; i + 3 < n; i += 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s.add(k, f(i + k));
  }
#pragma unroll
  for (int k = 0; k < 3; ++k)
    if (i + k < n) s.add(k, f(i + k));
  return s.total();
}

// sum4 of f(i), i < n, by a whole warp: lane k < 4 forms partial k, the total goes to every lane.
template <class F>
__device__ __forceinline__ float warp_sum4(int n, F&& f) {
  const int lane = threadIdx.x & 31;
  float p = 0.0f;
  if (lane < 4) {
#pragma unroll 8
    for (int i = lane; i < n; i += 4) p = __fadd_rn(p, f(i));
  }
  const float p1 = __shfl_sync(0xffffffffu, p, 1), p2 = __shfl_sync(0xffffffffu, p, 2),
              p3 = __shfl_sync(0xffffffffu, p, 3), p0 = __shfl_sync(0xffffffffu, p, 0);
  return __fadd_rn(__fadd_rn(p0, p1), __fadd_rn(p2, p3));
}

// A vector's length: the square root of the sum4 of its squares (a whole warp).
__device__ __forceinline__ float warp_length(const float* v, int n) {
  return __fsqrt_rn(warp_sum4(n, [&](int c) { return __fmul_rn(v[c], v[c]); }));
}

// An 8-byte asynchronous copy global -> shared (zeros, nothing read, where !ok).
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 8 : 0) : "memory");
}

template <class T>
__device__ __forceinline__ float elem(const unsigned short* x) {
  if constexpr (std::is_same<T, __half>::value)
    return __half2float(__ushort_as_half(*x));
  else
    return __uint_as_float(uint32_t(*x) << 16);
}

// Elements c .. c + 3 of a row (c a multiple of 4: one 64-bit shared load).
template <class T>
__device__ __forceinline__ float4 elem4(const unsigned short* x) {
  const uint2 w = *reinterpret_cast<const uint2*>(x);
  if constexpr (std::is_same<T, __half>::value) {
    __half2 h0, h1;
    *reinterpret_cast<uint32_t*>(&h0) = w.x;
    *reinterpret_cast<uint32_t*>(&h1) = w.y;
    const float2 a = __half22float2(h0), b = __half22float2(h1);
    return make_float4(a.x, a.y, b.x, b.y);
  } else {
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u), __uint_as_float(w.y << 16),
                       __uint_as_float(w.y & 0xffff0000u));
  }
}

// Squared Euclidean distance of a row to a reference: the sum4 over the columns of (x_c - r_c)^2.
// ref(c) gives r_c .. r_{c+3} (c a multiple of 4) as a float4, ref1(c) one value.
// SUB false: the reference is zero and the subtraction is skipped (x - 0 is x, bit for bit).
template <class T, bool SUB = true, int U = 2, class Ref4, class Ref1>
__device__ __forceinline__ float dist2_to(const unsigned short* row, int d_in, Ref4&& ref, Ref1&& ref1) {
  Sum4 s;
  auto term = [&](int k, float x, float m) {
    const float t = SUB ? __fsub_rn(x, m) : x;
    s.add(k, __fmul_rn(t, t));
  };
  int c = 0;
#pragma unroll U
  for (; c + 3 < d_in; c += 4) {
    const float4 x = elem4<T>(row + c), m = ref(c);
    term(0, x.x, m.x);
    term(1, x.y, m.y);
    term(2, x.z, m.z);
    term(3, x.w, m.w);
  }
#pragma unroll
  for (int k = 0; k < 3; ++k)
    if (c + k < d_in) term(k, elem<T>(row + c + k), ref1(c + k));
  return s.total();
}

// ... to a float32 row (16-byte aligned), and to zero (the squared length; x - 0 is x).
template <class T, int U>
__device__ __forceinline__ float dist2(const unsigned short* row, const float* ref, int d_in) {
  return dist2_to<T, true, U>(row, d_in, [&](int c) { return *reinterpret_cast<const float4*>(ref + c); },
                              [&](int c) { return ref[c]; });
}
template <class T, int U>
__device__ __forceinline__ float norm2(const unsigned short* row, int d_in) {
  return dist2_to<T, false, U>(row, d_in, [](int) { return make_float4(0.f, 0.f, 0.f, 0.f); },
                               [](int) { return 0.f; });
}

// The farthest row: the largest distance, the lowest row on equal distances; NaN distances (and
// padding rows, d < 0) never win over a number; with no number at all, row 0 (the CPU's scan from
// the first row with `d > best`, best starting below every distance).
__device__ __forceinline__ int farthest(float d, int r, float* red_d, int* red_r) {
  bool ok = d >= 0.0f;  // false for NaN and padding
  auto better = [](bool oa, float da, int ra, bool ob, float db, int rb) {
    if (oa != ob) return oa;
    if (oa && da != db) return da > db;
    return ra < rb;
  };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float d2 = __shfl_xor_sync(0xffffffffu, d, o);
    const int r2 = __shfl_xor_sync(0xffffffffu, r, o);
    const bool o2 = __shfl_xor_sync(0xffffffffu, int(ok), o) != 0;
    if (better(o2, d2, r2, ok, d, r)) d = d2, r = r2, ok = o2;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // the previous use of red_* is over
  if (lane == 0) red_d[warp] = ok ? d : -1.0f, red_r[warp] = r;
  __syncthreads();
  float bd = red_d[0];
  int br = red_r[0];
#pragma unroll
  for (int w = 1; w < kGThreads / 32; ++w)
    if (better(red_d[w] >= 0.0f, red_d[w], red_r[w], bd >= 0.0f, bd, br)) bd = red_d[w], br = red_r[w];
  return br;
}

// The grouping of a block whose rows are in xs (every thread of the CTA; n_rows rows, d_cols
// columns): thread r owns row r in the distance passes and column c (c = tid, tid + 128) in the
// column sums. FULL: n_rows = 128 and d_cols = Dk (the loops then have constant trip counts and are
// unrolled fully; a block at the end of the sequence or a head dim below Dk takes FULL = false).
template <int DK, class T, bool FULL>
__device__ __forceinline__ void group_rows(const GroupArgs& a, unsigned char* g_smem, int n_rows, int d_cols,
                                           float* out, float* cnt) {
  using Sm = GroupSmem<DK>;
  constexpr int U = FULL ? 64 : 2;  // unroll counts of the sum4 loops
  const unsigned short* xs = reinterpret_cast<const unsigned short*>(g_smem);  // [128][kPitch]
  float* mu = reinterpret_cast<float*>(g_smem + Sm::kMu);
  float* gm = reinterpret_cast<float*>(g_smem + Sm::kGm);
  float* len = reinterpret_cast<float*>(g_smem + Sm::kLen);
  float* red_d = reinterpret_cast<float*>(g_smem + Sm::kRedD);
  int* red_r = reinterpret_cast<int*>(g_smem + Sm::kRedR);
  int* list = reinterpret_cast<int*>(g_smem + Sm::kList);
  const int n = FULL ? kGThreads : n_rows;
  const int d_in = FULL ? DK : d_cols;
  const int tid = threadIdx.x;
  // the mean row (column sums in row order, then / n)
  for (int c = tid; c < d_in; c += kGThreads) {
    mu[c] = __fdiv_rn(sum4<U>(n, [&](int r) { return elem<T>(xs + r * Sm::kPitch + c); }), float(n));
  }
  const unsigned short* mine = xs + tid * Sm::kPitch;
  const bool real = tid < n;
  auto one_group = [&] {  // group a: every row, its mean the block's
    for (int c = tid; c < DK; c += kGThreads) out[c] = c < d_in ? mu[c] : 0.0f, out[DK + c] = 0.0f;
    if (tid == 0) cnt[0] = float(n), cnt[1] = 0.0f;
  };
  if (a.adaptive) {
    // l, the rows' mean length (the sum4 of the lengths in row order, / n); one group unless
    // 0.25 l <= |mean| < 0.75 l (decided by warp 0)
    len[tid] = real ? __fsqrt_rn(norm2<T, U>(mine, d_in)) : 0.0f;
    __syncthreads();  // the lengths and the mean row
    float* lm = red_d;  // l (warp 0) and |mean| (warp 1), side by side
    if (tid < 32) {
      const float l = __fdiv_rn(warp_sum4(n, [&](int r) { return len[r]; }), float(n));
      if (tid == 0) lm[0] = l;
    } else if (tid < 64) {
      const float m = warp_length(mu, d_in);
      if (tid == 32) lm[1] = m;
    }
    __syncthreads();
    const float l = lm[0], m = lm[1];
    if (!(m < __fmul_rn(0.75f, l) && m >= __fmul_rn(0.25f, l))) return one_group();  // uniform
  } else {
    __syncthreads();  // the mean row
  }
  // seed a: farthest from the mean; seed b: farthest from a. A seed row is copied to float32 (in gm,
  // free until the groups' means; exact) so that the distance passes read it 16 bytes at a time.
  auto seed_row = [&](int r, float* dst) {
    for (int c = tid; c < d_in; c += kGThreads) dst[c] = elem<T>(xs + r * Sm::kPitch + c);
    __syncthreads();
  };
  const int ra = farthest(real ? dist2<T, U>(mine, mu, d_in) : -1.0f, tid, red_d, red_r);
  seed_row(ra, gm);
  const float da = real ? dist2<T, U>(mine, gm, d_in) : -1.0f;
  const int rb = farthest(da, tid, red_d, red_r);
  seed_row(rb, gm + DK);
  // a row joins b when strictly nearer to b than to a (NaN: stays with a)
  const bool to_b = real && dist2<T, U>(mine, gm + DK, d_in) < da;
  // each group's rows in ascending order (list: group a's, then from kGThreads group b's), as byte
  // offsets into xs: a row's place is the number of its group's rows before it
  {
    const int lane = tid & 31, warp = tid >> 5;
    const uint32_t bal = __ballot_sync(0xffffffffu, to_b);
    if (lane == 0) red_r[warp] = __popc(bal);
    __syncthreads();  // (farthest's reads of red_r are before seed_row's barrier)
    int nb_before = __popc(bal & ((1u << lane) - 1u));
#pragma unroll
    for (int w = 0; w < kGThreads / 32; ++w) nb_before += w < warp ? red_r[w] : 0;
    if (real) list[to_b ? kGThreads + nb_before : tid - nb_before] = tid * Sm::kPitch * 2;
  }
  const int nb = __syncthreads_count(to_b);
  const int na = n - nb;
  // the groups' means: each group's sum4 over its own rows (its j-th row adds to partial j mod 4),
  // over the group's size (0 for an empty group)
  auto group_sum = [&](const int* rows, int m, int c) {
    const unsigned char* col = reinterpret_cast<const unsigned char*>(xs + c);
    auto at = [&](int o) { return elem<T>(reinterpret_cast<const unsigned short*>(col + o)); };
    Sum4 s;
    int j = 0;
#pragma unroll 2
    for (; j + 3 < m; j += 4) {
      const int4 o = *reinterpret_cast<const int4*>(rows + j);
      s.add(0, at(o.x));
      s.add(1, at(o.y));
      s.add(2, at(o.z));
      s.add(3, at(o.w));
    }
#pragma unroll
    for (int k = 0; k < 3; ++k)
      if (j + k < m) s.add(k, at(rows[j + k]));
    return s.total();
  };
  for (int c = tid; c < d_in; c += kGThreads) {  // (the seed rows in gm are read: barriers above)
    gm[c] = na ? __fdiv_rn(group_sum(list, na, c), float(na)) : 0.0f;
    gm[DK + c] = nb ? __fdiv_rn(group_sum(list + kGThreads, nb, c), float(nb)) : 0.0f;
  }
  // the groups' mean rows (zeros past d_in), and their sizes
  for (int c = tid; c < DK; c += kGThreads) {
    out[c] = c < d_in ? gm[c] : 0.0f;
    out[DK + c] = c < d_in ? gm[DK + c] : 0.0f;
  }
  if (tid == 0) cnt[0] = float(na), cnt[1] = float(nb);
}

// CTA: one per (b, h, query block). The block's rows sit in shared memory as the input's 16-bit
// values.
template <int DK, class T, bool VEC>
__global__ void __launch_bounds__(kGThreads) split2_group_kernel(const GroupArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  using Sm = GroupSmem<DK>;
  extern __shared__ __align__(16) unsigned char g_smem[];
  unsigned short* xs = reinterpret_cast<unsigned short*>(g_smem);  // [128][kPitch]

  const int64_t cta = blockIdx.x;
  const int64_t qb = cta % a.nQB, bh = cta / a.nQB;
  const uint32_t b = uint32_t(bh / a.Hq), h = uint32_t(bh % a.Hq);
  const int64_t r0 = qb * kGThreads;
  const int n = int(min(a.Lq - r0, int64_t(kGThreads)));
  const int d_in = a.d_in;
  const int tid = threadIdx.x;

  // the block's rows (zeros past n and past d_in); thread (lr, cg) copies 16-byte column chunk cg of
  // rows lr, lr + RPI, ... . VEC: every copy of the thread in flight at once (cp.async, two 8-byte
  // halves per chunk: the rows are 8-byte aligned), so that a CTA waits for one memory round trip
  // instead of one per batch of loads.
  {
    constexpr int TPR = DK / 8, RPI = kGThreads / TPR;
    const int lr = tid / TPR, cg = tid % TPR;
    const T* base = static_cast<const T*>(a.q.data);
    const bool col_ok = cg * 8 < d_in;
    const T* src = base + a.q.offset(b, h, r0 + lr, col_ok ? cg * 8 : 0);  // row lr, then + step per copy
    const int64_t step = int64_t(RPI) * a.q.stride[2];
    if constexpr (VEC) {
      const T* any = base + a.q.offset(b, h, r0, 0);  // a readable address for the zero fills
#pragma unroll
      for (int i = 0; i < kGThreads / RPI; ++i, src += step) {
        const int r = lr + i * RPI;
        const bool ok = r < n && col_ok;
        const T* s = ok ? src : any;
        const uint32_t dst = portable::smem_u32(xs + r * Sm::kPitch + cg * 8);
        cp_async8(dst, s, ok);
        cp_async8(dst + 8u, s + 4, ok);
      }
      portable::cp_async_commit();
      portable::cp_async_wait<0>();
    } else {
      for (int r = lr; r < kGThreads; r += RPI, src += step) {
        const uint4 v = (r < n && col_ok) ? load8_raw<false>(src) : make_uint4(0, 0, 0, 0);
        uint2* dst = reinterpret_cast<uint2*>(xs + r * Sm::kPitch + cg * 8);  // (rows are 8-byte aligned)
        dst[0] = make_uint2(v.x, v.y), dst[1] = make_uint2(v.z, v.w);
      }
    }
  }
  __syncthreads();
  float* out = a.rows + (bh * a.nQB + qb) * 2 * DK;
  float* cnt = a.count + (bh * a.nQB + qb) * 2;
  if (n == kGThreads && d_in == DK)
    group_rows<DK, T, true>(a, g_smem, n, d_in, out, cnt);
  else
    group_rows<DK, T, false>(a, g_smem, n, d_in, out, cnt);
}

// KEYS_LSE_ADAPTIVE: per kv head (a CTA each), the pooled rows to score in the key-score kernels'
// order (ks::row_qblock: query block, then group, then the query head within the kv head's group):
// group a of every query block, group b where it has rows.
struct ListArgs {
  int64_t Hq, Hkv, nQB;
  const float* count;  // [B*Hq, nQB, 2]
  int32_t* list;       // [B*Hkv][group * nQB * 2]
  int32_t* list_n;     // [B*Hkv]
};

constexpr int kLThreads = 256;

__global__ void __launch_bounds__(kLThreads) split2_list_kernel(const ListArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  __shared__ int wsum[kLThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t bhk = blockIdx.x;
  const int64_t g = a.Hq / a.Hkv, b = bhk / a.Hkv, hk = bhk % a.Hkv;
  const int64_t total = g * a.nQB * 2;
  int32_t* list = a.list + bhk * total;
  int32_t n = 0;
  for (int64_t e0 = 0; e0 < total; e0 += kLThreads) {
    const int64_t e = e0 + tid;
    bool take = false;
    if (e < total) {
      const int64_t qs = e / g, qb = qs / 2, bh = b * a.Hq + hk * g + e % g;
      take = qs % 2 == 0 || a.count[(bh * a.nQB + qb) * 2 + 1] > 0.f;
    }
    const uint32_t m = __ballot_sync(0xffffffffu, take);
    if (lane == 0) wsum[warp] = __popc(m);
    __syncthreads();
    int before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < kLThreads / 32; ++w) {
      before += w < warp ? wsum[w] : 0;
      all += wsum[w];
    }
    if (take) list[n + before + __popc(m & ((1u << lane) - 1u))] = int32_t(e);
    n += all;
    __syncthreads();  // wsum is read
  }
  if (tid == 0) a.list_n[bhk] = n;
}

}  // namespace

sparge_status_t launch_split2_group(const Plan& plan, const Tensor4& q, void* ws, cudaStream_t stream,
                                    bool adaptive) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  if (p.BQ != kGpuBlockQ)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "estimators KEYS_LSE_SPLIT2 / KEYS_LSE_ADAPTIVE on CUDA need block_q = %d, got %lld",
                kGpuBlockQ, (long long)p.BQ);
  if (L.split_q == 0 || L.split_n == 0 || L.split_rows == 0 || L.split_cnt == 0)
    return fail(SPARGE_ERR_INTERNAL, "CUDA KEYS_LSE_SPLIT2 / KEYS_LSE_ADAPTIVE: workspace layout lacks their regions");
  const int64_t n = p.B * p.Hq * p.nQB;
  if (n <= 0) return SPARGE_OK;
  if (n > int64_t(0x7fffffff)) return fail(SPARGE_ERR_UNSUPPORTED, "KEYS_LSE_SPLIT2 grouping grid too large");
  if (adaptive && p.group() * p.nQB * 2 > int64_t(0x7fffffff))  // the row lists are int32
    return fail(SPARGE_ERR_UNSUPPORTED, "KEYS_LSE_ADAPTIVE: %lld pooled rows per kv head exceed the int32 row list",
                (long long)(p.group() * p.nQB * 2));
  char* base = static_cast<char*>(ws);
  GroupArgs ga;
  ga.q = q;
  ga.d_in = int(p.D);
  ga.Hq = p.Hq, ga.Lq = p.Lq, ga.nQB = p.nQB;
  ga.rows = ws_ptr<float>(base, L.split_q);
  ga.count = ws_ptr<float>(base, L.split_n);
  ga.adaptive = adaptive;
  const bool vec = prep::vec_ok(q);
  sparge_status_t st = SPARGE_OK;
  cudaError_t err = cudaSuccess;
  const bool built = dispatch_dim_type(p.Dk, p.dtype, [&](auto dc, auto tt) {
    constexpr int DK = decltype(dc)::value;
    using T = typename decltype(tt)::type;
    auto kern = vec ? split2_group_kernel<DK, T, true> : split2_group_kernel<DK, T, false>;
    constexpr int smem = GroupSmem<DK>::kBytes;
    st = ensure_smem_attr(reinterpret_cast<const void*>(kern), smem, p.device_id);
    if (st == SPARGE_OK) err = launch_pdl(kern, dim3(unsigned(n)), dim3(kGThreads), size_t(smem), stream, ga);
  });
  if (!built)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "estimators KEYS_LSE_SPLIT2 / KEYS_LSE_ADAPTIVE on CUDA: kernel head dim %lld not built",
                (long long)p.Dk);
  SPARGE_TRY(st);
  SPARGE_PDL_CHECK(err, "sparge KEYS_LSE_SPLIT2 grouping kernel");
  if (!adaptive) return SPARGE_OK;
  ListArgs la;
  la.Hq = p.Hq, la.Hkv = p.Hkv, la.nQB = p.nQB;
  la.count = ga.count;
  la.list = ws_ptr<int32_t>(base, L.split_rows);
  la.list_n = ws_ptr<int32_t>(base, L.split_cnt);
  SPARGE_PDL_CHECK(launch_pdl(split2_list_kernel, dim3(unsigned(p.B * p.Hkv)), dim3(kLThreads), 0, stream, la),
                   "sparge KEYS_LSE_ADAPTIVE row list kernel");
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
