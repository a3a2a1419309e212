// Hopper (sm_90a) block-sparse attention with 16-bit P.V: the FP16 precision
// mode (fp16 or bf16 q, k, v used as given; fp32 scores and accumulation) and
// the INT8_FP16 mode (kI8: Q and K as the preparation's int8 codes with their
// per-token / per-64-key-block scales, Q.K^T on the int8 tensor cores; P and V
// as in the FP16 mode).
//
// One CTA computes one 128-row query block of one (batch, head) over the key
// blocks listed for it (idx/cnt). Three warpgroups:
//   WG0  producer: one thread issues TMA loads straight from the caller's
//        tensors (4-D maps over [B, H, L, D] with their strides; rows past the
//        end arrive as zeros): Q once, and per step the listed 64-key
//        blocks of K and of V (two at D=128, three at D=64) into a ring of shared-memory stages guarded by
//        full/empty mbarriers (Q and stage 0 before the CTA-wide barrier);
//   WG1, WG2  consumers, 64 query rows each, steps of two (D=128) or three
//        (D=64) listed blocks, taking turns to issue their matrix products:
//        S = Q K^T     wgmma m64n128k16 / m64n192k16 (HGMMA), both operands in shared
//                      memory, K-major;
//        online softmax in base 2 on the fp32 scores (row max while the
//             previous step's P.V runs, then the exponentials);
//        P -> fp16/bf16 in registers: the accumulator layout of two adjacent
//             8-column groups is the A-operand layout of one 16-key k-step;
//        O += P V      wgmma m64nDk16 with A from registers and V as the
//                      transposed (MN-major) B operand, straight from the
//                      tile TMA wrote; O is rescaled by alpha before the next
//                      P.V is issued (fp32 accumulation needs no second
//                      level, unlike the fp8 products).
// INT8_FP16 differs in the producer's Q and K loads (2-D maps over the
// workspace's int8 rows), in S = Q K^T (int8 wgmma m64n128k32 / m64n192k32,
// s32 accumulators: the row max is taken on the integers of each 64-key block
// and scaled by q_scale * k_scale, as in the INT8_FP8 kernel) and in the
// epilogue (a dedicated staging region; the Q tile is too small to hold the
// output tile).
// Numerics: docs/SEMANTICS.md (FP16, INT8_FP16), with steps of two or three
// listed tiles (the portable FP16 kernel steps one tile at a time; everything
// is checked against float64 in the GPU tests, INT8_FP16 also against its CPU
// twin).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/attention/sm90/sm90_cta.cuh"
#include "cuda/attention/sm90/sm90_primitives.cuh"
#include "cuda/attention/sm90/tensor_map.hpp"
#include "cuda/attention/sm90/wgmma_ops.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {
namespace {

constexpr int kThreads = 384;
constexpr int kBQ = 128;    // query rows per CTA (= mask block rows)
constexpr int kBK = 64;     // keys per listed block (= mask block cols)
static_assert(kBQ == kGpuBlockQ && kBK == kGpuBlockK, "the tensor-map boxes and the expected bytes must agree");
// Listed blocks per step: two at D=128 (the register budget: S 64 + O 64 + P 32
// per thread), three at D=64 (S 96 + O 32 + P 48), where the step's fixed costs
// weigh more against the smaller matrix products.
template <int D>
struct StepBlocks {
  static constexpr int value = (D == 64) ? 3 : 2;
};
// INT8_FP16 build switches for A/B runs (docs/PERF-NOTES.md v26): the exact
// int -> float of the scores at D = 64 by I2FP (0), by the two-op trick (1),
// or as measured best per instantiation (-1, default: the trick for causal,
// -2.0..-2.9 %; I2FP otherwise, where the trick cost +0.5..+1.5 %); every
// SPARGE_I8F16_POLY_EVERY-th exponential at D = 64 by poly_exp2 on the FMA
// pipe (0, default: none; every 4th measured -1.6..+1.2 %, and +6 % together
// with the trick).
#ifndef SPARGE_I8F16_D64_CVT
#define SPARGE_I8F16_D64_CVT -1
#endif
#ifndef SPARGE_I8F16_POLY_EVERY
#define SPARGE_I8F16_POLY_EVERY 0
#endif
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kConsumerRegs = 240;

// Shared memory. Every 16-bit operand tile is stored as column blocks of 64
// elements (128 bytes per row, 128B swizzle, as TMA writes it):
//   Q      [D/64][128 rows][64]         K-major A operand
//   K (s)  [D/64][kKeys][64]            K-major B operand of Q K^T; block hh of
//                                       the step fills keys 64hh..64hh+63
//   V (s)  [D/64][kKeys][64]            MN-major B operand of P V (N = D)
// With kI8 (INT8_FP16) Q and K are int8 rows of D bytes (128B swizzle at
// D = 128, 64B at D = 64, as in the INT8_FP8 kernel): Q [128][D], K (s)
// [kKeys][D] with block hh at row 64hh; and the output tile is staged in its
// own region (per consumer warpgroup D/64 blocks of 64 rows x 128 bytes).
template <int D, bool kI8>
struct Layout16 {
  static constexpr int kHalves = StepBlocks<D>::value;
  static constexpr int kKeys = kHalves * kBK;      // keys per step
  static constexpr int kStages = (D == 128) ? 3 : 4;
  static constexpr int kCols = D / 64;             // 64-element column blocks
  static constexpr int kQCol = kBQ * 128;          // bytes of one Q column block (16-bit Q)
  static constexpr int kKVCol = kKeys * 128;       // bytes of one K or V column block (a step)
  static constexpr int kBlockRows = kBK * 128;     // bytes of one listed block inside a column block
  static constexpr int kQBytes = kI8 ? kBQ * D : kCols * kQCol;
  static constexpr int kKBytes = kI8 ? kKeys * D : kCols * kKVCol;  // K of one stage
  static constexpr int kVBytes = kCols * kKVCol;                    // V of one stage
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + kStages * kKBytes;
  static constexpr int kOut = (kV + kStages * kVBytes + 1023) / 1024 * 1024;
  static constexpr int kOutBytes = kI8 ? 2 * 64 * D * 2 : 0;
  static constexpr int kBar = kI8 ? kOut + kOutBytes : kV + kStages * kVBytes;
  static constexpr int kBytes = kBar + (2 * kStages + 1) * 8;
  static constexpr int kAlloc = kBytes + 1024;  // room to align the base to 1024
};

// Kernel parameters: the row parameters, and for INT8_FP16 the preparation's
// scales (unused by the FP16 mode).
struct Params16 : RowParams {
  const float* q_scale;  // [BHq, nQB*128]
  const float* q_mu;     // [BHq, nQB*128], written when an LSE is asked for
  const float* k_scale;  // [BHkv, nKB]
};

// S = Q K^T on the int8 tensor cores, N = 128 or 192 keys.
template <int N>
__device__ __forceinline__ void wgmma_qk_s8(int32_t (&d)[N / 2], uint64_t a, uint64_t b, int scale_d) {
  if constexpr (N == 192) wgmma_m64n192k32_s8s8(d, a, b, scale_d);
  else wgmma_m64n128k32_s8s8(d, a, b, scale_d);
}


// Two floats -> a 16-bit pair (lo in the low half), round to nearest even.
template <class T>
__device__ __forceinline__ uint32_t pack16(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack16<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack16<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Per-thread state of one consumer warpgroup (64 query rows). Register j of
// an m64nN accumulator holds row (j & 2 ? row1 : row0) and column
// 8*(j/4) + 2*quad + (j & 1), where row0 = 16*warp + lane/4 and row1 = row0 + 8.
template <class T, int D, bool kCausal, bool kI8>
struct Consumer16 {
  using L = Layout16<D, kI8>;
  using Mma = Wgmma16<T>;
  using Acc = std::conditional_t<kI8, int32_t, float>;  // S accumulator element
  static constexpr int kHalves = L::kHalves;
  static constexpr int kKeys = L::kKeys;
  static constexpr int NS = kKeys / 2;  // S accumulator registers per thread
  static constexpr int KS = kKeys / 16;  // k-steps of P.V
  static constexpr int NO = D / 2;       // O accumulator registers per thread
  // Q and K shared-memory descriptors: 128B swizzle, 1024 bytes per 8 rows of
  // a 64-element column block (16-bit); int8 rows of D bytes: 128B swizzle at
  // D = 128, 64B at D = 64, 8 D bytes per 8 rows.
  static constexpr uint32_t kSwzQK = (kI8 && D == 64) ? kSwizzle64B : kSwizzle128B;
  static constexpr uint32_t kSboQK = kI8 ? 8 * D : 1024;
  // A masked score: -inf, or the smallest integer (below any int8 product sum).
  static constexpr Acc kMaskedS = kI8 ? Acc(INT32_MIN) : Acc(-INFINITY);

  const Params16& p;
  const int cw, quad, b, h, bhkv, row0, row1, wg_row_min, diag;
  const int64_t qrow;  // index of row0 in the per-token arrays (q_scale, q_mu)
  const uint8_t* sk;
  const uint8_t* sv;
  uint64_t desc_q;
  float qs0 = 0.f, qs1 = 0.f;  // INT8_FP16: q_scale * scale * log2(e) of row0, row1
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  Acc s[NS];
  float o[NO];

  __device__ Consumer16(const Params16& p_, int cw_, int tid, const RowWork& w, const uint8_t* sq, const uint8_t* sk_,
                        const uint8_t* sv_)
      : p(p_),
        cw(cw_),
        quad(tid & 3),
        b(w.b),
        h(w.h),
        bhkv(w.bhkv),
        row0(w.qb * kBQ + cw_ * 64 + (tid / 32) * 16 + ((tid & 31) >> 2)),
        row1(w.qb * kBQ + cw_ * 64 + (tid / 32) * 16 + ((tid & 31) >> 2) + 8),
        wg_row_min(w.qb * kBQ + cw_ * 64),
        diag(p_.Lkv - p_.Lq),
        qrow(int64_t(w.bh) * p_.nQB * kBQ + w.qb * kBQ + cw_ * 64 + (tid / 32) * 16 + ((tid & 31) >> 2)),
        sk(sk_),
        sv(sv_) {
    // This warpgroup's 64 rows of Q: 64 rows x 128 bytes (16-bit, first
    // column block) or 64 rows x D bytes (int8).
    desc_q = make_smem_desc(sq + cw * 64 * (kI8 ? D : 128), kSwzQK, kSboQK);
    if constexpr (kI8) {
      qs0 = p.q_scale[qrow] * p.scale_log2;
      qs1 = p.q_scale[qrow + 8] * p.scale_log2;
    }
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j] = 0.f;
  }

  __device__ __forceinline__ uint64_t desc_k(int st) const {
    return make_smem_desc(sk + st * L::kKBytes, kSwzQK, kSboQK);
  }
  __device__ __forceinline__ uint64_t desc_v(int st) const {
    return make_smem_desc_mn(sv + st * L::kVBytes, L::kKVCol, 1024);
  }

  // S = Q K^T over D in k-steps of 16 (32 bytes inside a 128-byte column
  // block); INT8_FP16: k-steps of 32 int8 (32 bytes of a row). Caller fences
  // before and commits after.
  __device__ __forceinline__ void issue_qk(uint64_t dk) {
    if constexpr (kI8) {
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk)
        wgmma_qk_s8<kKeys>(s, desc_q + uint64_t((kk * 32) >> 4), dk + uint64_t((kk * 32) >> 4), kk > 0);
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t qoff = (kk / 4) * L::kQCol + (kk % 4) * 32;
        const uint32_t koff = (kk / 4) * L::kKVCol + (kk % 4) * 32;
        Mma::template ss_m64nNk16<kKeys>(s, desc_q + uint64_t(qoff >> 4), dk + uint64_t(koff >> 4), kk > 0);
      }
    }
  }

  // O += P V: k-step ks reads keys 16ks..16ks+15, i.e. two 8-row groups of
  // every column block (2048 bytes further per k-step).
  __device__ __forceinline__ void issue_pv(uint64_t dv, const uint32_t (&pa)[KS][4]) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) Mma::template rs_tb_m64nNk16<D>(o, pa[ks], dv + uint64_t((ks * 2048) >> 4), 1);
  }

  // INT8_FP16: the K block scales of a step, loaded before the step's turn
  // (their latency under the stage wait's tail and the wgmma waits, off the
  // softmax's path). Nothing for the FP16 mode.
  __device__ __forceinline__ void load_kscale(const int (&kb)[kHalves], float (&ksc)[kHalves]) const {
    if constexpr (kI8) {
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh)
        ksc[hh] = (kb[hh] >= 0) ? p.k_scale[int64_t(bhkv) * p.nKB + kb[hh]] : 0.f;
    }
  }

  // What the row-max phase hands to the exponentials: the shift (-new max, 0
  // for a row that has seen no key) of each row, INT8_FP16's dequantization
  // factor of each row and 64-key block, and whether any score of the step is
  // masked (uniform over the warpgroup: it depends on the key blocks and the
  // first row only).
  struct StepScale {
    float c0, c1;
    float f0[kHalves], f1[kHalves];
    bool masked_any;
  };

  // Phase 1 (reads S only, so it can run while the previous P.V is in
  // flight): masks, takes the row max, updates m and returns the step's
  // scale and the rescale factors of the previous state. FP16: the max of the
  // fp32 scores times scale * log2(e). INT8_FP16: per 64-key block the max of
  // the integers times q_scale * k_scale * scale * log2(e) (f > 0, so this is
  // the max of the dequantized scores exactly).
  __device__ __forceinline__ StepScale row_max(const int (&kb)[kHalves], const float (&ksc)[kHalves], float& alpha0,
                                               float& alpha1) {
    StepScale st;
    st.masked_any = false;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      const int key0 = kb[hh] * kBK;
      const bool need_mask =
          (kb[hh] < 0) || (key0 + kBK > p.Lkv) || (kCausal && key0 + kBK - 1 > wg_row_min + diag);
      st.masked_any |= need_mask;
      if (need_mask) {
#pragma unroll
        for (int jj = 0; jj < 32; ++jj) {
          const int j = hh * 32 + jj;
          const int key = key0 + 8 * (jj / 4) + 2 * quad + (jj & 1);
          const int row = (jj & 2) ? row1 : row0;
          bool ok = (kb[hh] >= 0) && key < p.Lkv;
          if (kCausal) ok = ok && (key <= row + diag);
          if (!ok) s[j] = kMaskedS;
        }
      }
    }
    float mn0, mn1;
    if constexpr (kI8) {
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) {
        st.f0[hh] = qs0 * ksc[hh];
        st.f1[hh] = qs1 * ksc[hh];
        int32_t im0, im1;
        quad_row_max_s32(s, hh * 32, im0, im1);
        if (im0 != INT32_MIN) mx0 = fmaxf(mx0, small_int_to_float(im0) * st.f0[hh]);
        if (im1 != INT32_MIN) mx1 = fmaxf(mx1, small_int_to_float(im1) * st.f1[hh]);
      }
      mn0 = fmaxf(m0, mx0);
      mn1 = fmaxf(m1, mx1);
    } else {
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        if (j & 2) mx1 = fmaxf(mx1, s[j]);
        else mx0 = fmaxf(mx0, s[j]);
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      mn0 = fmaxf(m0, mx0 * p.scale_log2);
      mn1 = fmaxf(m1, mx1 * p.scale_log2);
    }
    const float mu0 = (mn0 == -INFINITY) ? 0.f : mn0;
    const float mu1 = (mn1 == -INFINITY) ? 0.f : mn1;
    alpha0 = fast_exp2(m0 - mu0);
    alpha1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    st.c0 = -mu0;
    st.c1 = -mu1;
    return st;
  }

  // Phase 2: p = 2^(s c - m') (masked scores: p = 0), packed to the 16-bit
  // type as A fragments; row sums of the unrounded p into l.
  // `alongside()` runs first (the previous P.V's wait and the rescale of O).
  //
  // Two copies, chosen by the warpgroup-uniform `masked_any`: ptxas schedules
  // within a basic block, and with the wait in the same block as the row max
  // it places the wait first, so the max would no longer run under the
  // previous P.V. The masked copy also zeroes p where s is masked explicitly
  // (for FP16 2^-inf is already 0), which keeps the two copies distinct.
  template <typename Alongside>
  __device__ __forceinline__ void exponentiate(const StepScale& st, float alpha0, float alpha1,
                                               uint32_t (&pa)[KS][4], Alongside alongside) {
    const float sc = p.scale_log2;
    float rs0 = 0.f, rs1 = 0.f;
    auto exps = [&](auto masked_c) {
      alongside();
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        float x[8];
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = 8 * ks + jj;
          float arg;
          if constexpr (kI8) {
            // Exact int -> float: the two-op trick, or I2FP at D = 64 where it
            // measured faster (non-causal; see SPARGE_I8F16_D64_CVT).
            constexpr bool kI2fp =
                D == 64 && (SPARGE_I8F16_D64_CVT == 0 || (SPARGE_I8F16_D64_CVT < 0 && !kCausal));
            const float sj = kI2fp ? __int2float_rn(s[j]) : small_int_to_float(s[j]);
            arg = fmaf(sj, (j & 2) ? st.f1[j / 32] : st.f0[j / 32], (j & 2) ? st.c1 : st.c0);
          } else {
            arg = fmaf(s[j], sc, (j & 2) ? st.c1 : st.c0);
          }
          constexpr int kPoly = (kI8 && D == 64) ? SPARGE_I8F16_POLY_EVERY : 0;
          x[jj] = (kPoly > 0 && jj % (kPoly > 0 ? kPoly : 1) == kPoly - 1) ? poly_exp2(arg) : fast_exp2(arg);
          if constexpr (decltype(masked_c)::value) {
            if (s[j] == kMaskedS) x[jj] = 0.f;
          }
          if (j & 2) rs1 += x[jj];
          else rs0 += x[jj];
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[ks][r] = pack16<T>(x[2 * r], x[2 * r + 1]);
      }
    };
    if (st.masked_any) {
      exps(std::true_type{});
    } else {
      exps(std::false_type{});
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
  }

  // O *= alpha, skipped when no row of the warp changed its max (alpha is
  // then exactly 1 and the product would be O itself): after the first few
  // steps of a row most steps leave the max unchanged.
  __device__ __forceinline__ void rescale(float alpha0, float alpha1) {
    if (!__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) return;
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j] *= (j & 2) ? alpha1 : alpha0;
  }

  // With p.tma_store the tile goes out by TMA through `stage` (D/64 blocks of
  // 64 rows x 128 bytes, `stage_stride` bytes apart, the output box's
  // swizzled layout): FP16 uses this warpgroup's rows of the Q tile, free once
  // its last Q.K^T has completed; INT8_FP16 its own region. Else direct
  // 4-byte stores. The INT8_FP16 LSE adds back the smoothing shift q.mu.
  __device__ __forceinline__ void epilogue(uint8_t* stage, int stage_stride, const CUtensorMap* tm_o, int tid) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = (l0 > 0.f) ? 1.f / l0 : 0.f;
    const float inv1 = (l1 > 0.f) ? 1.f / l1 : 0.f;
    auto pair = [&](int c, int half) -> uint32_t {
      const float inv = half ? inv1 : inv0;
      return pack16<T>(o[c * 4 + 2 * half] * inv, o[c * 4 + 2 * half + 1] * inv);
    };
    if (p.tma_store) store_tile_tma<D>(stage, stage_stride, tm_o, cw, tid, wg_row_min, h, b, pair);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = half ? row1 : row0;
      if (row >= p.Lq) continue;
      if (!p.tma_store) {
        T* orow = static_cast<T*>(p.out) + int64_t(b) * p.out_stride[0] + int64_t(h) * p.out_stride[1] +
                  int64_t(row) * p.out_stride[2];
#pragma unroll
        for (int c = 0; c < D / 8; ++c) *reinterpret_cast<uint32_t*>(orow + 8 * c + 2 * quad) = pair(c, half);
      }
      if (p.lse != nullptr && quad == 0) {
        const float l = half ? l1 : l0;
        const float m = half ? m1 : m0;
        float v = (l > 0.f) ? (m * 0.69314718055994531f + logf(l)) : -INFINITY;
        if constexpr (kI8) v += p.q_mu[qrow + 8 * half];
        p.lse[int64_t(b) * p.lse_stride[0] + int64_t(h) * p.lse_stride[1] + int64_t(row) * p.lse_stride[2]] = v;
      }
    }
  }
};

template <class T, int D, bool kCausal, bool kI8>
__global__ void __launch_bounds__(kThreads, 1)
    attn_fp16_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                          const Params16 p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  using L = Layout16<D, kI8>;
  using C = Consumer16<T, D, kCausal, kI8>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  const SmemRing<kStages> ring(smem_raw, L::kBar);
  uint8_t* sq = ring.base + L::kQ;
  uint8_t* sk = ring.base + L::kK;
  uint8_t* sv = ring.base + L::kV;

  const RowWork w(p);
  const int qb = w.qb, b = w.b, h = w.h, hkv = w.hkv;
  constexpr int kHalves = L::kHalves;
  const int n_steps = w.steps<kHalves>();
  // Stage st <- the K and V rows of the step's blocks (a missing block loads
  // the first again: finite data, masked scores, same byte count). INT8_FP16:
  // K block kb is rows (bhkv * nKB + kb) * 64.. of the workspace's int8 K.
  auto load_stage = [&](int st, const int (&kbh)[kHalves]) {
    mbar_arrive_expect_tx(&ring.full[st], L::kKBytes + L::kVBytes);
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      const int kb = kbh[hh] >= 0 ? kbh[hh] : kbh[0];
      if constexpr (kI8)
        tma_load_2d(sk + st * L::kKBytes + hh * kBK * D, &tm_k, &ring.full[st], 0, (w.bhkv * p.nKB + kb) * kBK);
#pragma unroll
      for (int cb = 0; cb < L::kCols; ++cb) {
        const int off = st * L::kVBytes + cb * L::kKVCol + hh * L::kBlockRows;
        if constexpr (!kI8) tma_load_4d(sk + off, &tm_k, &ring.full[st], cb * 64, kb * kBK, hkv, b);
        tma_load_4d(sv + off, &tm_v, &ring.full[st], cb * 64, kb * kBK, hkv, b);
      }
    }
  };

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    start_ring<kStages, kHalves>(
        w, p.nKB, n_steps, ring.full, ring.empty, ring.qbar,
        [&] {
          mbar_arrive_expect_tx(ring.qbar, L::kQBytes);
          if constexpr (kI8) {
            tma_load_2d(sq, &tm_q, ring.qbar, 0, w.row_id * kBQ);
          } else {
#pragma unroll
            for (int cb = 0; cb < L::kCols; ++cb)
              tma_load_4d(sq + cb * L::kQCol, &tm_q, ring.qbar, cb * 64, qb * kBQ, h, b);
          }
        },
        load_stage);
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    regs_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) produce<kStages, kHalves>(w, n_steps, ring.empty, load_stage);
    return;
  }

  // -------------------------------------------------------------- consumers
  regs_alloc<kConsumerRegs>();
  C c(p, wg - 1, threadIdx.x - 128 * wg, w, sq, sk, sv);
  mbar_wait(ring.qbar, 0);
  if (n_steps > 0) {
    const int me = c.cw, other = c.cw ^ 1;
    // Turn-taking as in the INT8_FP8 kernel: in its turn a warpgroup issues
    // Q.K^T(u) then P.V(u-1); it takes the row max of step u while P.V(u-1)
    // runs, then waits for it, rescales O for step u and exponentiates step u
    // (overwriting the P registers P.V(u-1) read) during the other's turn.
    if (me == 1) turn_end(0);  // warpgroup 0 goes first
    uint32_t pa[C::KS][4];
    float al0, al1;
    int kb[kHalves];
    float ksc[kHalves];  // INT8_FP16: the step's K block scales
    auto blocks = [&](int u) {
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) kb[hh] = w.block<kHalves>(u, hh);
      c.load_kscale(kb, ksc);
    };
    blocks(0);
    mbar_wait(&ring.full[0], 0);
    {
      const uint64_t dk = c.desc_k(0);
      turn_begin(me);
      c.issue_qk(dk);
      wgmma_commit();
      turn_end(other);
      wgmma_wait<0>();
      fence_regs(c.s);
    }
    const typename C::StepScale st0 = c.row_max(kb, ksc, al0, al1);
    c.exponentiate(st0, al0, al1, pa, [] {});
    for (int u = 1; u < n_steps; ++u) {
      const int st = u % kStages, sp = (u - 1) % kStages;
      mbar_wait(&ring.full[st], (u / kStages) & 1);
      const uint64_t dk = c.desc_k(st), dv = c.desc_v(sp);
      blocks(u);
      turn_begin(me);
      c.issue_qk(dk);
      wgmma_commit();
      c.issue_pv(dv, pa);
      wgmma_commit();
      turn_end(other);
      wgmma_wait<1>();  // Q.K^T(u) done
      fence_regs(c.s);
      const typename C::StepScale stu = c.row_max(kb, ksc, al0, al1);
      c.exponentiate(stu, al0, al1, pa, [&] {
        wgmma_wait<0>();  // P.V(u-1) done
        fence_regs(c.o);
        fence_regs(pa);
        mbar_arrive(&ring.empty[sp]);
        c.rescale(al0, al1);
      });
    }
    // The last turn: P.V of the last step.
    const int sp = (n_steps - 1) % kStages;
    const uint64_t dv = c.desc_v(sp);
    turn_begin(me);
    c.issue_pv(dv, pa);
    wgmma_commit();
    if (me == 0) turn_end(other);  // balances the initial arrive
    wgmma_wait<0>();
    fence_regs(c.o);
    mbar_arrive(&ring.empty[sp]);
  }
  if constexpr (kI8) {
    c.epilogue(ring.base + L::kOut + c.cw * (D / 64) * 8192, 8192, &tm_o, threadIdx.x - 128 * wg);
  } else {
    c.epilogue(sq + c.cw * 64 * 128, L::kQCol, &tm_o, threadIdx.x - 128 * wg);
  }
#else
  __trap();  // built for another architecture: the dispatcher must not launch this
#endif
}

template <class T, int D, bool kCausal, bool kI8>
sparge_status_t launch16(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const CUtensorMap& to,
                         const Params16& prm, unsigned grid, cudaStream_t stream) {
  using L = Layout16<D, kI8>;
  static_assert(L::kAlloc <= 227 * 1024, "shared memory budget of sm_90");
  auto kernel = attn_fp16_sm90_kernel<T, D, kCausal, kI8>;
  SPARGE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kAlloc));
  SPARGE_PDL_CHECK(launch_pdl(kernel, dim3(grid), dim3(kThreads), L::kAlloc, stream, tq, tk, tv, to, prm),
                   "attn_fp16_sm90_kernel");
  return SPARGE_OK;
}

template <class T, bool kI8>
sparge_status_t dispatch16(int64_t D, bool causal, const CUtensorMap& tq, const CUtensorMap& tk,
                           const CUtensorMap& tv, const CUtensorMap& to, const Params16& prm, unsigned grid,
                           cudaStream_t stream) {
  if (D == 128)
    return causal ? launch16<T, 128, true, kI8>(tq, tk, tv, to, prm, grid, stream)
                  : launch16<T, 128, false, kI8>(tq, tk, tv, to, prm, grid, stream);
  return causal ? launch16<T, 64, true, kI8>(tq, tk, tv, to, prm, grid, stream)
                : launch16<T, 64, false, kI8>(tq, tk, tv, to, prm, grid, stream);
}

// The rest of a launch, common to both modes: the output through shared
// memory and a TMA store where its strides are expressible (else direct
// stores), then the kernel for the dtype, head dim and causality.
template <bool kI8>
sparge_status_t launch_rest(const AttnArgs& a, EncodeTiledFn enc, const CUtensorMap& tq, const CUtensorMap& tk,
                            const CUtensorMap& tv, Params16& prm, cudaStream_t stream) {
  const Problem& pb = a.prob;
  const bool bf16 = pb.dtype == SPARGE_DTYPE_BFLOAT16;
  CUtensorMap to = tq;
  if (tma_store_from_env() &&
      make_map_bhld16(enc, &to, a.out.data, bf16, a.out.shape, a.out.stride, 64) == CUDA_SUCCESS)
    prm.tma_store = 1;
  const unsigned grid = static_cast<unsigned>(pb.B * pb.Hq * pb.nQB);
  if (bf16) return dispatch16<__nv_bfloat16, kI8>(pb.D, pb.causal, tq, tk, tv, to, prm, grid, stream);
  return dispatch16<__half, kI8>(pb.D, pb.causal, tq, tk, tv, to, prm, grid, stream);
}

// SPARGE_FP16_KERNEL (developer switch, read once): `portable` selects the
// mma.sync kernel on sm_90 too (A/B measurements); `sm90` makes a call that the
// sm_90a kernel cannot take an error instead of a silent fallback (the GPU
// test script sets it, so the tests prove which kernel they ran).
enum class Fp16Choice { kAuto, kPortable, kSm90Only };
Fp16Choice fp16_choice() {
  static const Fp16Choice c = [] {
    const char* e = std::getenv("SPARGE_FP16_KERNEL");
    if (e != nullptr && std::strcmp(e, "portable") == 0) return Fp16Choice::kPortable;
    if (e != nullptr && std::strcmp(e, "sm90") == 0) return Fp16Choice::kSm90Only;
    return Fp16Choice::kAuto;
  }();
  return c;
}

// The sm_90a kernel does not take the call: fall back to the portable kernel,
// or fail when SPARGE_FP16_KERNEL=sm90 asks for the sm_90a kernel only.
sparge_status_t decline(const char* why) {
  if (fp16_choice() == Fp16Choice::kSm90Only)
    return fail(SPARGE_ERR_UNSUPPORTED, "fp16 attention: the sm_90a kernel does not apply (%s) and "
                "SPARGE_FP16_KERNEL=sm90 forbids the portable fallback", why);
  return SPARGE_OK;
}

}  // namespace
}  // namespace sm90

sparge_status_t launch_attention_sm90_fp16(const AttnArgs& a, cudaStream_t stream, bool* launched) {
  *launched = false;
  const Problem& pb = a.prob;
  if (sm90::fp16_choice() == sm90::Fp16Choice::kPortable) return SPARGE_OK;
  if ((pb.D != 64 && pb.D != 128) || pb.BQ != kGpuBlockQ || pb.BK != kGpuBlockK) return sm90::decline("shape");
  if (pb.dtype != SPARGE_DTYPE_FLOAT16 && pb.dtype != SPARGE_DTYPE_BFLOAT16) return sm90::decline("dtype");
  // Key and row indices are 32-bit in the kernel (key0 + 64 must not overflow);
  // the portable kernel has the same limit and reports it.
  const int64_t rows = pb.B * pb.Hq * pb.nQB;
  if (rows >= (int64_t(1) << 31) || pb.Lq > 0x3fffffffLL || pb.Lkv > 0x3fffffffLL) return sm90::decline("size");
  if (rows == 0) {
    *launched = true;
    return SPARGE_OK;
  }
  sm90::EncodeTiledFn enc = nullptr;
  if (sm90::get_encode_fn(&enc) != SPARGE_OK) return sm90::decline("no cuTensorMapEncodeTiled in the driver");
  const bool bf16 = pb.dtype == SPARGE_DTYPE_BFLOAT16;
  CUtensorMap tq, tk, tv;
  // Strides TMA cannot express (e.g. L rows that overlap) leave the call to the
  // portable kernel.
  if (sm90::make_map_bhld16(enc, &tq, a.q.data, bf16, a.q.shape, a.q.stride, kGpuBlockQ) != CUDA_SUCCESS ||
      sm90::make_map_bhld16(enc, &tk, a.k.data, bf16, a.k.shape, a.k.stride, kGpuBlockK) != CUDA_SUCCESS ||
      sm90::make_map_bhld16(enc, &tv, a.v.data, bf16, a.v.shape, a.v.stride, kGpuBlockK) != CUDA_SUCCESS)
    return sm90::decline("a tensor map for these strides");
  sm90::Params16 prm{};
  sm90::fill_row_params(a, &prm);
  *launched = true;
  return sm90::launch_rest<false>(a, enc, tq, tk, tv, prm, stream);
}

sparge_status_t check_int8fp16_v(const Tensor4& v) {
  sm90::EncodeTiledFn enc = nullptr;
  SPARGE_TRY(sm90::get_encode_fn(&enc));
  CUtensorMap map;
  if (sm90::make_map_bhld16(enc, &map, v.data, v.dtype == SPARGE_DTYPE_BFLOAT16, v.shape, v.stride, kGpuBlockK) ==
      CUDA_SUCCESS)
    return SPARGE_OK;
  return fail(SPARGE_ERR_UNSUPPORTED,
              "v: the INT8_FP16 CUDA kernel reads V through a TMA tensor map, which needs a 16-byte aligned data "
              "pointer and batch/head/row strides that are multiples of 8 elements (got strides %lld, %lld, %lld)",
              static_cast<long long>(v.stride[0]), static_cast<long long>(v.stride[1]),
              static_cast<long long>(v.stride[2]));
}

sparge_status_t launch_attention_sm90_int8fp16(const AttnArgs& a, cudaStream_t stream) {
  const Problem& pb = a.prob;
  SPARGE_TRY(check_sm90_int8_problem(pb, "INT8_FP16"));
  if (pb.B * pb.Hq * pb.nQB == 0) return SPARGE_OK;
  sm90::EncodeTiledFn enc = nullptr;
  SPARGE_TRY(sm90::get_encode_fn(&enc));
  const bool bf16 = pb.dtype == SPARGE_DTYPE_BFLOAT16;
  const uint64_t bhq = uint64_t(pb.B * pb.Hq), bhk = uint64_t(pb.B * pb.Hkv);
  const CUtensorMapSwizzle swz = (pb.D == 128) ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const uint32_t d = static_cast<uint32_t>(pb.D);
  CUtensorMap tq, tk, tv;
  SPARGE_TRY(sm90::make_map(enc, &tq, a.q_i8, d, bhq * pb.nQB * kGpuBlockQ, d, kGpuBlockQ, swz, "q"));
  SPARGE_TRY(sm90::make_map(enc, &tk, a.k_i8, d, bhk * pb.nKB * kGpuBlockK, d, kGpuBlockK, swz, "k"));
  // V is read from the caller's tensor by TMA; there is no other path (the
  // backend checked it before the preparation: check_int8fp16_v).
  if (sm90::make_map_bhld16(enc, &tv, a.v.data, bf16, a.v.shape, a.v.stride, kGpuBlockK) != CUDA_SUCCESS) {
    const sparge_status_t st = check_int8fp16_v(a.v);
    return st != SPARGE_OK ? st : fail(SPARGE_ERR_INTERNAL, "v: the INT8_FP16 kernel's tensor map failed to encode");
  }
  sm90::Params16 prm{};
  sm90::fill_row_params(a, &prm);
  prm.q_scale = a.q_scale;
  prm.q_mu = a.q_mu;
  prm.k_scale = a.k_scale;
  return sm90::launch_rest<true>(a, enc, tq, tk, tv, prm, stream);
}

}  // namespace cuda
}  // namespace sparge
