// Block-sparse flash-attention forward, FP16 precision mode (fp16 / bf16 inputs,
// fp32 scores and accumulation), for sm_80+ tensor cores through mma.sync.
//
// One CTA computes one 128-row query block (the mask's BQ) of one (batch, head)
// with 4 warps x 32 query rows (two 16-row m-tiles per warp, so each K/V
// fragment read from shared memory feeds two MMAs). It walks the row's kept
// 64-key blocks (the mask's BK, one kernel tile each) in ascending order through
// a multi-stage cp.async pipeline of K/V tiles and keeps O in registers; two
// CTAs share an SM. See docs/KERNELS-FP16.md.
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

#include "cuda/attention/common/work.cuh"
#include "cuda/attention/portable/primitives.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/registry/registry.hpp"

namespace sparge {
namespace cuda {
namespace fp16attn {

using portable::cp_async16;
using portable::cp_async_commit;
using portable::cp_async_wait;
using portable::ex2;
using portable::ldsm_x4;
using portable::ldsm_x4_t;
using portable::Mma;
using portable::smem_u32;

constexpr int kBQ = 128;    // query rows per CTA (== mask BQ)
constexpr int kBK = 64;     // keys per tile (== mask BK)
constexpr int kWarps = 4;   // 32 query rows each
constexpr int kThreads = kWarps * 32;
constexpr int kMT = 2;      // 16-row m-tiles per warp

// K/V tiles in flight: 2 CTAs/SM must fit in 227 KB of shared memory.
template <int D>
__host__ __device__ constexpr int stages() {
  return D == 64 ? 3 : 2;
}
template <int D>
__host__ __device__ constexpr int smem_bytes() {
  return (kBQ * D + stages<D>() * 2 * kBK * D) * 2;
}

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
  const int32_t* idx;    // [B*Hq, nQB, nKB], or null: dense work (attn::RowWork; cnt, order null)
  const int32_t* cnt;    // [B*Hq, nQB]
  const int32_t* order;  // [B*Hq*nQB]
  int causal;            // the problem's causality (= kCausal)
  int Hq, group, Lq, Lkv, nQB, nKB;
  int q_rows;        // query rows per CTA (128: attn::RowWork)
  int D;             // the problem's head dim (<= the kernel's; D = 96 runs the 128-wide kernel)
  float scale_log2;  // scale * log2(e), > 0
};

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
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 2) attn_fp16_kernel(const Params p) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  static_assert(D == 64 || D == 128, "head dim");
  constexpr int kStages = stages<D>();
  constexpr int kChunks = D / 8;   // 16-byte chunks per row
  constexpr int kKSteps = D / 16;  // k-steps of Q.K^T, also 16-wide d-tile pairs of P.V
  extern __shared__ __align__(128) uint8_t smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [kBQ][D], finally the O staging tile
  T* sKV = sQ + kBQ * D;                   // [kStages][K, V][kBK][D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  const attn::RowWork w(p);
  const int qb = w.qb;
  const int b = w.b, h = w.h, hk = w.hkv;
  const int q0 = qb * kBQ;

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  const int n = w.n_tiles;
  if (n == 0) {  // nothing to compute: zeros and LSE -inf, written directly
    attn::write_empty_row(static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh, p.o_sl,
                          p.lse != nullptr ? p.lse + b * p.lse_sb + h * p.lse_sh : nullptr, p.lse_sl, q0, kBQ, p.Lq,
                          p.D, tid, kThreads);
    return;
  }

  // ---- Q tile (rows >= Lq are zero-filled), own commit group
#pragma unroll
  for (int i = 0; i < kBQ * kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads, r = c / kChunks, ch = c % kChunks;
    const bool ok = q0 + r < p.Lq && ch * 8 < p.D;  // columns past D arrive as zeros
    const T* src = gQ + (ok ? static_cast<int64_t>(q0 + r) * p.q_sl : 0) + ch * 8;
    cp_async16(smem_u32(sQ + swz<D>(r, ch)), src, ok);
  }
  cp_async_commit();

  // K and V rows of kept block w.listed(t) into stage s (keys >= Lkv zero-filled:
  // V must hold finite values where P is 0). Thread tid copies chunk
  // tid % kChunks of rows tid / kChunks + kRowsPerIter * i; kRowsPerIter is a
  // multiple of 8, so the swizzled destination is a fixed offset per i.
  constexpr int kRowsPerIter = kThreads / kChunks;
  const int ld_r = tid / kChunks, ld_ch = tid % kChunks;
  const bool ld_col = ld_ch * 8 < p.D;  // columns past D arrive as zeros
  const uint32_t ld_dst = smem_u32(sKV) + swz<D>(ld_r, ld_ch) * 2;
  const int64_t k_step = kRowsPerIter * p.k_sl, v_step = kRowsPerIter * p.v_sl;
  auto load_tile = [&](int t, int s) {
    const int k0 = w.listed(t) * kBK + ld_r;
    const T* srcK = gK + static_cast<int64_t>(k0) * p.k_sl + ld_ch * 8;
    const T* srcV = gV + static_cast<int64_t>(k0) * p.v_sl + ld_ch * 8;
    const uint32_t dst = ld_dst + s * (2 * kBK * D * 2);
#pragma unroll
    for (int i = 0; i < kBK / kRowsPerIter; ++i) {
      const bool ok = ld_col && k0 + i * kRowsPerIter < p.Lkv;
      cp_async16(dst + i * kRowsPerIter * D * 2, ok ? srcK : gK, ok);
      cp_async16(dst + kBK * D * 2 + i * kRowsPerIter * D * 2, ok ? srcV : gV, ok);
      srcK += k_step;
      srcV += v_step;
    }
  };
  // Groups: Q, tile 0 .. tile kStages-2 (empty groups past the list's end).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) load_tile(s, s);
    cp_async_commit();
  }

  float o[kMT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < D / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
  // Row statistics of rows g (index 0) and g+8 (index 1) of each m-tile; m is
  // in log2 units (score * scale * log2e); l is this thread's partial sum over
  // its own columns (reduced across the quad at the end).
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.f;

  const int row_lo = q0 + warp * 32;  // warp's first query row
  const int diag = p.Lkv - p.Lq;      // causal: row i sees keys <= i + diag
  const float sl2 = p.scale_log2;

  // Per-lane ldmatrix addressing (lanes 8i..8i+7 address matrix i). Every row a
  // lane addresses is (multiple of 8) + (lane & 7), so its swizzle key is
  // r7 = lane & 7; logical chunk 2c + x (x = 0/1 chosen by the matrix index,
  // c = k-step or d-pair, 2c + x == 2c ^ x) is stored at chunk (2c) ^ (x ^ r7);
  // for c >= 4 (D = 128) bit 3 of the chunk passes through the XOR.
  //   Q (A operand, non-trans): matrix i = rows +8*(i&1), chunk +(i>>1)
  //     -> r0..r3 = a0..a3 (rows g / g+8, columns 2t / 2t+8).
  //   K (B operand of S = Q K^T, non-trans; B[k][n] = K[n][k], so the rows the
  //     ldmatrix reads are keys): matrix i = keys +8*(i>>1), chunk +(i&1)
  //     -> r0, r1 = b0, b1 of n-tile 2jp; r2, r3 = b0, b1 of n-tile 2jp+1.
  //   V (B operand of O = P V, .trans; B[k][n] = V[key k][dim n], rows read are
  //     keys, the transpose hands lane (g, t) V[2t..2t+1][g]): matrix i = keys
  //     +8*(i&1), chunk +(i>>1) -> r0, r1 = b0, b1 of d-tile 2dp; r2, r3 of 2dp+1.
  const int mi = lane >> 3, r7 = lane & 7;
  const uint32_t q_addr = smem_u32(sQ) + (warp * 32 + (mi & 1) * 8 + r7) * D * 2;
  const uint32_t kv_base = smem_u32(sKV);
  const uint32_t k_lane = ((mi >> 1) * 8 + r7) * D * 2;
  const uint32_t v_lane = ((mi & 1) * 8 + r7) * D * 2;
  // Byte offset of logical chunk pair c within a row: ((2c) ^ key) << 4 ==
  // (32c) ^ (key << 4), and for c >= 4 bit 7 is untouched by the XOR.
  const uint32_t kx = ((mi & 1) ^ r7) << 4;
  const uint32_t vx = ((mi >> 1) ^ r7) << 4;  // also Q (same matrix order)

  for (int t = 0; t < n; ++t) {
    cp_async_wait<kStages - 2>();  // tile t (and Q) landed for this thread's copies
    __syncthreads();               // ... for all threads; stage (t-1) % kStages is free
    if (t + kStages - 1 < n) load_tile(t + kStages - 1, (t + kStages - 1) % kStages);
    cp_async_commit();

    const int k0 = w.listed(t) * kBK;
    bool need_mask = k0 + kBK > p.Lkv;
    // Causal: a warp none of whose rows sees a key of the tile still
    // multiplies it (all weights 0), so that a non-finite V value reaches the
    // same rows on every backend (docs/SEMANTICS.md, "Non-finite values").
    if (kCausal) need_mask |= k0 + kBK - 1 > row_lo + diag;  // some row does not see every key
    const uint32_t aK = kv_base + (t % kStages) * (2 * kBK * D * 2) + k_lane;
    const uint32_t aV = kv_base + (t % kStages) * (2 * kBK * D * 2) + kBK * D * 2 + v_lane;

    // ---- S = Q K^T: per m-tile 16 x 64 = 8 n-tiles of 8 keys; s[mt][j][e] is
    // row g + 8*(e>>1) of m-tile mt, key k0 + 8j + 2t + (e&1) (C layout).
    float s[kMT][8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t qa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) ldsm_x4(q_addr + mt * 16 * D * 2 + ((kk * 32) ^ vx), qa[mt]);
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t kb[4];
        ldsm_x4(aK + jp * 16 * D * 2 + ((kk * 32) ^ kx), kb);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>::run(s[mt][2 * jp], qa[mt], kb[0], kb[1]);
          Mma<T>::run(s[mt][2 * jp + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      // ---- a score of exactly -inf (an infinite k element) becomes NaN, so
      // that it is not taken for a masked one (docs/SEMANTICS.md); then the
      // mask (only on tiles that need it), row max over raw scores
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = __fmaf_rn(0.f, s[mt][j][e], s[mt][j][e]);
      if (need_mask) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + 8 * j + 2 * t4 + (e & 1);
            const int row = row_lo + mt * 16 + g + 8 * (e >> 1);
            bool ok = key < p.Lkv;
            if (kCausal) ok = ok && key <= row + diag;
            if (!ok) s[mt][j][e] = -INFINITY;
          }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(s[mt][j][0], s[mt][j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[mt][j][2], s[mt][j][3]));
      }
      // ---- online softmax in base 2 (scale > 0, so max(s)*c == max(s*c)):
      // m' = max(m, mx*c), alpha = 2^(m - m'), p = 2^(s*c - m'). A row that has
      // seen no key yet keeps m' = -inf and uses 0 as the reference, so its p
      // and alpha are exactly 0 (no NaN).
      float ref[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mnew = fmaxf(m[mt][r], mx[r] * sl2);
        ref[r] = (mnew == -INFINITY) ? 0.f : mnew;
        alpha[r] = ex2(m[mt][r] - ref[r]);
        m[mt][r] = mnew;
        l[mt][r] *= alpha[r];
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[mt][j][0] *= alpha[0];
        o[mt][j][1] *= alpha[0];
        o[mt][j][2] *= alpha[1];
        o[mt][j][3] *= alpha[1];
      }
      const float nref0 = -ref[0], nref1 = -ref[1];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[mt][j][0] = ex2(fmaf(s[mt][j][0], sl2, nref0));
        s[mt][j][1] = ex2(fmaf(s[mt][j][1], sl2, nref0));
        s[mt][j][2] = ex2(fmaf(s[mt][j][2], sl2, nref1));
        s[mt][j][3] = ex2(fmaf(s[mt][j][3], sl2, nref1));
        l[mt][0] += s[mt][j][0] + s[mt][j][1];
        l[mt][1] += s[mt][j][2] + s[mt][j][3];
      }
    }

    // ---- O += P V. P (rounded to T) is the A operand straight from the S
    // accumulators: for key step kk (keys 16kk..16kk+15)
    //   a0 = P[g][16kk+2t..]   = n-tile 2kk   (c0,c1)
    //   a1 = P[g+8][16kk+2t..] = n-tile 2kk   (c2,c3)
    //   a2 = P[g][16kk+8+2t..] = n-tile 2kk+1 (c0,c1)
    //   a3 = P[g+8][...]       = n-tile 2kk+1 (c2,c3)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        ldsm_x4_t(aV + kk * 16 * D * 2 + ((dp * 32) ^ vx), vb);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<T>::run(o[mt][2 * dp], a[mt], vb[0], vb[1]);
          Mma<T>::run(o[mt][2 * dp + 1], a[mt], vb[2], vb[3]);
        }
      }
    }
  }

  // ---- epilogue
  cp_async_wait<0>();
  __syncthreads();  // Q tile landed everywhere (matters when n == 0) before it is overwritten
  // O (C layout: o[mt][j] = rows g, g+8 of m-tile mt x dims 8j+2t..) -> T,
  // staged in this warp's own 32 rows of sQ (same swizzle; chunk j holds dims
  // 8j..8j+7), then written out as 16-byte row segments.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 2);
      // A NaN row sum (a non-finite input, docs/SEMANTICS.md) stays NaN.
      inv[r] = (l[mt][r] > 0.f || l[mt][r] != l[mt][r]) ? 1.f / l[mt][r] : 0.f;
    }
    const int r = warp * 32 + mt * 16 + g;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(sQ + swz<D>(r, j) + 2 * t4) =
          Mma<T>::pack(o[mt][j][0] * inv[0], o[mt][j][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(sQ + swz<D>(r + 8, j) + 2 * t4) =
          Mma<T>::pack(o[mt][j][2] * inv[1], o[mt][j][3] * inv[1]);
    }
  }
  __syncwarp();
  T* gO = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int i = 0; i < 32 * kChunks / 32; ++i) {
    const int c = lane + i * 32, r = c / kChunks, ch = c % kChunks;
    const int row = row_lo + r;
    if (row < p.Lq && ch * 8 < p.D)
      *reinterpret_cast<uint4*>(gO + static_cast<int64_t>(row) * p.o_sl + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + swz<D>(warp * 32 + r, ch));
  }
  if (p.lse != nullptr && t4 == 0) {
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_lo + mt * 16 + g + 8 * r;
        if (row < p.Lq)
          p.lse[b * p.lse_sb + h * p.lse_sh + static_cast<int64_t>(row) * p.lse_sl] =
              (l[mt][r] > 0.f || l[mt][r] != l[mt][r]) ? m[mt][r] * kLn2 + logf(l[mt][r]) : -INFINITY;
      }
  }
}

// Host side: launches the <T, D, causal> kernel.
template <class T, int D, bool kCausal>
sparge_status_t launch(const Params& p, int64_t grid, cudaStream_t stream) {
  auto* kern = attn_fp16_kernel<T, D, kCausal>;
  constexpr int smem = smem_bytes<D>();
  SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(kern), smem));
  SPARGE_PDL_CHECK(launch_pdl(kern, dim3(static_cast<unsigned>(grid)), dim3(kThreads), smem, stream, p),
                   "attn_fp16_kernel");
  return SPARGE_OK;
}

// The architecture of the image the <T, D, causal> kernel runs as on the
// current device (registry.hpp, image_arch_of).
template <class T, int D, bool kCausal>
int image_arch() {
  return image_arch_of(reinterpret_cast<const void*>(attn_fp16_kernel<T, D, kCausal>));
}

// The instances for one dtype (head dims 64 and 128, causal and not). They are
// declared extern here and defined in attn_fp16_<dtype>.cu, one file per dtype,
// so the kernels compile in parallel and only once.
#define SPARGE_FP16_ATTN_INSTANCES(EXTERN, T)                                                \
  EXTERN template sparge_status_t launch<T, 64, false>(const Params&, int64_t, cudaStream_t);  \
  EXTERN template sparge_status_t launch<T, 64, true>(const Params&, int64_t, cudaStream_t);   \
  EXTERN template sparge_status_t launch<T, 128, false>(const Params&, int64_t, cudaStream_t); \
  EXTERN template sparge_status_t launch<T, 128, true>(const Params&, int64_t, cudaStream_t);  \
  EXTERN template int image_arch<T, 64, false>();                                              \
  EXTERN template int image_arch<T, 64, true>();                                               \
  EXTERN template int image_arch<T, 128, false>();                                             \
  EXTERN template int image_arch<T, 128, true>();
SPARGE_FP16_ATTN_INSTANCES(extern, __half)
SPARGE_FP16_ATTN_INSTANCES(extern, __nv_bfloat16)

}  // namespace fp16attn
}  // namespace cuda
}  // namespace sparge
