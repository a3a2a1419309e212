// Block-sparse flash-attention forward, FP16 precision mode (fp16 / bf16 inputs,
// fp32 scores and accumulation), for sm_80+ tensor cores through mma.sync.
//
// One CTA computes one 128-row query block (the mask's BQ) of one (batch, head):
// 8 warps x 16 query rows. It walks the row's kept 64-key blocks (the mask's BK,
// one kernel tile each) in ascending order with a 3-stage cp.async pipeline of
// K/V tiles, and keeps O in registers. See docs/KERNELS-FP16.md.
//
// Fragment layouts used below (PTX ISA, mma.m16n8k16, 16-bit A/B, fp32 C/D);
// lane = 32*warp + 4*g + t, i.e. g = lane/4 ("group"), t = lane%4:
//   A (16x16, row major), 4 x b32 regs, each a pair of consecutive columns:
//     a0 = A[g  ][2t..2t+1]   a1 = A[g+8][2t..2t+1]
//     a2 = A[g  ][2t+8..+9]   a3 = A[g+8][2t+8..+9]
//   B (16x8, "col" = stored as B^T row major, i.e. [n][k]), 2 x b32 regs:
//     b0 = B[2t..2t+1][g]     b1 = B[2t+8..2t+9][g]
//   C/D (16x8 fp32), 4 regs:
//     c0,c1 = C[g][2t], C[g][2t+1]    c2,c3 = C[g+8][2t], C[g+8][2t+1]
// ldmatrix.x4: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of
// matrix i; register ri of lane (4g+t) receives M_i[g][2t..2t+1]. With .trans it
// receives M_i[2t][g], M_i[2t+1][g] (the pair of rows 2t, 2t+1 in column g).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/internal.cuh"

namespace sparge {
namespace cuda {
namespace fp16attn {

constexpr int kBQ = 128;     // query rows per CTA (== mask BQ)
constexpr int kBK = 64;      // keys per tile (== mask BK)
constexpr int kWarps = 8;    // 16 query rows each
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;   // K/V tiles in flight

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_sb, q_sh, q_sl;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  int64_t o_sb, o_sh, o_sl;
  float* lse;  // nullptr: not wanted
  int64_t lse_sb, lse_sh, lse_sl;
  const int32_t* idx;    // [B*Hq, nQB, nKB]
  const int32_t* cnt;    // [B*Hq, nQB]
  const int32_t* order;  // [B*Hq*nQB]
  int Hq, group, Lq, Lkv, nQB, nKB;
  float scale_log2;  // scale * log2(e)
};

template <int D>
constexpr int smem_bytes() {
  return (kBQ * D + kStages * 2 * kBK * D) * 2;
}

// ------------------------------------------------------------ primitives
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; ok == false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <class T>
struct Mma;
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Two fp32 -> one b32 holding (lo, hi) as 16-bit values, round to nearest even.
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory tiles are [rows][D] 16-bit values, row pitch D*2 bytes (128 or
// 256 B), split in 16-byte chunks. Chunk c of row r is stored at chunk
// c ^ (r & 7): the 8 rows an ldmatrix matrix reads (8 consecutive rows, one
// logical chunk) land in 8 distinct chunks of one 128-byte line, so the 32
// banks are each hit once (no conflicts); cp.async writes stay 16-byte aligned.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);  // in elements
}

// ------------------------------------------------------------ kernel
template <class T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) attn_fp16_kernel(const Params p) {
  static_assert(D == 64 || D == 128, "head dim");
  constexpr int kChunks = D / 8;   // 16-byte chunks per row
  constexpr int kKSteps = D / 16;  // k-steps of Q.K^T, also 16-wide d-tile pairs of P.V
  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [kBQ][D], later the O staging tile
  T* sKV = sQ + kBQ * D;                   // [kStages][K, V][kBK][D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  const int work = p.order[blockIdx.x];
  const int bh = work / p.nQB, qb = work - bh * p.nQB;
  const int b = bh / p.Hq, h = bh - b * p.Hq, hk = h / p.group;
  const int q0 = qb * kBQ;

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const int32_t* list = p.idx + static_cast<int64_t>(work) * p.nKB;
  const int n = p.cnt[work];

  // ---- Q tile (rows >= Lq are zero-filled), own commit group
#pragma unroll
  for (int i = 0; i < kBQ * kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads, r = c / kChunks, ch = c % kChunks;
    const bool ok = q0 + r < p.Lq;
    const T* src = gQ + (ok ? static_cast<int64_t>(q0 + r) * p.q_sl : 0) + ch * 8;
    cp_async16(smem_u32(sQ + swz<D>(r, ch)), src, ok);
  }
  cp_async_commit();

  // K and V rows of kept block list[t] into stage s (keys >= Lkv zero-filled:
  // V must hold finite values where P is 0).
  auto load_tile = [&](int t, int s) {
    const int k0 = list[t] * kBK;
    T* sK = sKV + s * 2 * kBK * D;
    T* sV = sK + kBK * D;
#pragma unroll
    for (int i = 0; i < kBK * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads, r = c / kChunks, ch = c % kChunks;
      const bool ok = k0 + r < p.Lkv;
      const int64_t row = ok ? k0 + r : 0;
      cp_async16(smem_u32(sK + swz<D>(r, ch)), gK + row * p.k_sl + ch * 8, ok);
      cp_async16(smem_u32(sV + swz<D>(r, ch)), gV + row * p.v_sl + ch * 8, ok);
    }
  };
  if (n > 0) load_tile(0, 0);
  cp_async_commit();
  if (n > 1) load_tile(1, 1);
  cp_async_commit();

  // ---- Q fragments of this warp's 16 rows, kept in registers (A operand).
  // ldmatrix.x4 for k-step kk: matrix i = rows 8*(i&1).., columns 16kk + 8*(i>>1)..,
  // so r0..r3 are a0..a3 of the A layout above.
  cp_async_wait<2>();
  __syncthreads();
  uint32_t qf[kKSteps][4];
  {
    const int mi = lane >> 3;
    const int r = warp * 16 + (lane & 7) + (mi & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
      ldsm_x4(smem_u32(sQ + swz<D>(r, kk * 2 + (mi >> 1))), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  }

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // Row statistics of rows g (index 0) and g+8 (index 1) of the warp; m is in
  // log2 units (scores already multiplied by scale*log2e); l is this thread's
  // partial sum over its own columns (reduced across the quad at the end).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const int row_lo = q0 + warp * 16;    // warp's first query row
  const int diag = p.Lkv - p.Lq;        // causal: row i sees keys <= i + diag
  // Per-lane ldmatrix addressing. Every row a lane addresses below is
  // (multiple of 8) + (lane & 7), so its swizzle key is r7 = lane & 7; a logical
  // chunk 2c + x (x = 0/1 from the matrix index, c = k-step or d-pair) is stored
  // at ((2c) ^ (x ^ r7)): for 2c >= 8 the high bit passes through (+128 bytes).
  const int mi = lane >> 3, r7 = lane & 7;
  const uint32_t kv_base = smem_u32(sKV);
  const uint32_t k_lane = ((mi >> 1) * 8 + r7) * D * 2;  // K: matrix i -> keys +8*(i>>1), chunk +(i&1)
  const uint32_t v_lane = ((mi & 1) * 8 + r7) * D * 2;   // V: matrix i -> keys +8*(i&1), chunk +(i>>1)
  uint32_t kx[4], vx[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    kx[c] = ((2 * c) ^ ((mi & 1) ^ r7)) << 4;
    vx[c] = ((2 * c) ^ ((mi >> 1) ^ r7)) << 4;
  }

  for (int t = 0; t < n; ++t) {
    cp_async_wait<1>();  // tile t (and all before it) has landed
    __syncthreads();     // ... for every thread; and stage (t+2)%3 is no longer read
    if (t + 2 < n) load_tile(t + 2, (t + 2) % kStages);
    cp_async_commit();

    const int k0 = list[t] * kBK;
    bool need_mask = k0 + kBK > p.Lkv;
    bool skip = false;
    if (kCausal) {
      skip = k0 > row_lo + 15 + diag;           // no row of the warp sees any key of the tile
      need_mask |= k0 + kBK - 1 > row_lo + diag;  // some row does not see every key
    }
    if (skip) continue;  // warp-uniform; the barrier above is the only one per tile

    // Lane addresses (bytes) of this stage's K and V tiles; see kx / vx above.
    const uint32_t aK = kv_base + (t % kStages) * (2 * kBK * D * 2) + k_lane;
    const uint32_t aV = kv_base + (t % kStages) * (2 * kBK * D * 2) + kBK * D * 2 + v_lane;

    // ---- S = Q K^T (16 x 64 per warp): 8 n-tiles of 8 keys.
    // B operand for keys n0..n0+7 is K[n0+g][k..] rows = plain (non-trans)
    // ldmatrix of K rows. One x4 covers n-tiles 2jp, 2jp+1 of k-step kk:
    // matrix i = keys 16jp + 8*(i>>1) + 0..7, columns 16kk + 8*(i&1) + 0..7,
    // giving (b0, b1) of n-tile 2jp and (b0, b1) of n-tile 2jp+1.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(aK + jp * 16 * D * 2 + (kk >> 2) * 128 + kx[kk & 3], b0, b1, b2, b3);
        Mma<T>::run(s[2 * jp], qf[kk], b0, b1);
        Mma<T>::run(s[2 * jp + 1], qf[kk], b2, b3);
      }
    }

    // ---- scale to log2 units, mask, row max. s[j][e]: row g + 8*(e>>1),
    // key k0 + 8j + 2t + (e&1).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * j + 2 * t4 + (e & 1);
          const int row = row_lo + g + 8 * (e >> 1);
          bool ok = key < p.Lkv;
          if (kCausal) ok = ok && key <= row + diag;
          if (!ok) s[j][e] = -INFINITY;
        }
    }
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    // ---- online softmax: alpha = 2^(m - m'), p = 2^(s - m'). A row that has
    // seen no key yet keeps m' = -inf; it uses 0 as the reference so that all
    // its p and alpha are exactly 0 (no NaN).
    float ref[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      ref[r] = (mx[r] == -INFINITY) ? 0.f : mx[r];
      alpha[r] = ex2(m[r] - ref[r]);
      m[r] = mx[r];
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j][0] = ex2(s[j][0] - ref[0]);
      s[j][1] = ex2(s[j][1] - ref[0]);
      s[j][2] = ex2(s[j][2] - ref[1]);
      s[j][3] = ex2(s[j][3] - ref[1]);
      l[0] += s[j][0] + s[j][1];
      l[1] += s[j][2] + s[j][3];
    }

    // ---- O += P V. P (rounded to T) is the A operand straight from the S
    // accumulators: for key step kk (keys 16kk..16kk+15)
    //   a0 = P[g][16kk+2t..]   = n-tile 2kk   (c0,c1)
    //   a1 = P[g+8][16kk+2t..] = n-tile 2kk   (c2,c3)
    //   a2 = P[g][16kk+8+2t..] = n-tile 2kk+1 (c0,c1)
    //   a3 = P[g+8][...]       = n-tile 2kk+1 (c2,c3)
    // B operand: B[k][n] = V[key k][d n], V stored [key][d], so b0 = V[2t..2t+1][g]
    // is the .trans ldmatrix of the 8x8 block (keys 16kk.., dims 8j..). One x4:
    // matrix i = keys 16kk + 8*(i&1) + 0..7, dims 16dp + 8*(i>>1) + 0..7, giving
    // (b0, b1) of d-tile 2dp and (b0, b1) of d-tile 2dp+1.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t a[4];
      a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(aV + kk * 16 * D * 2 + (dp >> 2) * 128 + vx[dp & 3], b0, b1, b2, b3);
        Mma<T>::run(o[2 * dp], a, b0, b1);
        Mma<T>::run(o[2 * dp + 1], a, b2, b3);
      }
    }
  }

  // ---- epilogue
  cp_async_wait<0>();
  __syncthreads();  // Q tile landed everywhere (matters when n == 0) before it is overwritten
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const float inv0 = l[0] > 0.f ? 1.f / l[0] : 0.f;
  const float inv1 = l[1] > 0.f ? 1.f / l[1] : 0.f;
  // O (C layout: o[j] = rows g, g+8 x dims 8j+2t..) -> T, staged in this warp's
  // own 16 rows of sQ (same swizzle; chunk j holds dims 8j..8j+7), then written
  // out as 16-byte row segments.
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int r = warp * 16 + g;
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r, j) + 2 * t4) = Mma<T>::pack(o[j][0] * inv0, o[j][1] * inv0);
    *reinterpret_cast<uint32_t*>(sQ + swz<D>(r + 8, j) + 2 * t4) = Mma<T>::pack(o[j][2] * inv1, o[j][3] * inv1);
  }
  __syncwarp();
  T* gO = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int c = lane + i * 32, r = c / kChunks, ch = c % kChunks;
    const int row = q0 + warp * 16 + r;
    if (row < p.Lq)
      *reinterpret_cast<uint4*>(gO + static_cast<int64_t>(row) * p.o_sl + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + swz<D>(warp * 16 + r, ch));
  }
  if (p.lse != nullptr && t4 == 0) {
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + g + 8 * r;
      if (row < p.Lq)
        p.lse[b * p.lse_sb + h * p.lse_sh + static_cast<int64_t>(row) * p.lse_sl] =
            l[r] > 0.f ? m[r] * kLn2 + logf(l[r]) : -INFINITY;
    }
  }
}

// Host side: launches the <T, D, causal> kernel (defined in the per-dtype .cu files).
template <class T, int D, bool kCausal>
sparge_status_t launch(const Params& p, int64_t grid, cudaStream_t stream);

template <class T, int D, bool kCausal>
sparge_status_t launch_impl(const Params& p, int64_t grid, cudaStream_t stream) {
  auto* kern = attn_fp16_kernel<T, D, kCausal>;
  constexpr int smem = smem_bytes<D>();
  SPARGE_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kern<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(p);
  SPARGE_LAUNCH_CHECK("attn_fp16_kernel");
  return SPARGE_OK;
}

}  // namespace fp16attn
}  // namespace cuda
}  // namespace sparge
