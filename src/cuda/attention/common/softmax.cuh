// The online softmax shared by every mainloop of both attention kernel
// families: score masking (ragged end, causal diagonal, missing blocks), the
// row max, the exponentials packed into P fragments, the row sums, and the
// final normalisation and LSE. A warp owns 16 query rows; a thread holds rows
// row0 and row1 = row0 + 8. Register j of the score accumulator holds row
// (j & 2 ? row1 : row0) and column 8*(j/4) + 2*quad + (j & 1): the layout of
// an sm_90a m64nN wgmma accumulator (per warp) and of N/8 consecutive
// m16n8 mma.sync accumulators alike. On sm_90a a consumer warpgroup (cw) owns
// 64 rows; the portable family's 8 warps own 16 rows each (cw = 0, tid up to
// 255).
//
// Scores come as int32 (kI8: int8 Q.K^T, dequantized per row by q_scale and
// per 64-key block by k_scale) or as fp32 (16-bit Q.K^T). P is packed by a
// Pack policy: e4m3 in k-steps of 32 keys (scaled by 448) or the 16-bit input
// type in k-steps of 16 keys. Numerics: docs/SEMANTICS.md.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/attention/common/math.cuh"
#include "cuda/attention/common/work.cuh"

namespace sparge {
namespace cuda {
namespace attn {

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

// P as the A operand of an fp8 P.V k-step (32 keys): a thread's 16 scores of
// the k-step (accumulator chunks 4ks .. 4ks+3) into four registers of four
// e4m3 each. V^T's token order (perm32) makes the columns land where the
// A fragment wants k = 4*quad + (0..3) and 16 + 4*quad + (0..3).
struct PackE4M3 {
  static constexpr int kKeys = 32;
  static constexpr int kPer = 16;
  static constexpr float kLog2Scale = 8.807354922057604f;  // log2(448): P is stored as p * 448
  static constexpr float kLnScale = 6.1047932324149f;      // ln(448)
  __device__ __forceinline__ static void pack(const float (&x)[kPer], uint32_t (&r)[4]) {
    r[0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
    r[1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
    r[2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
    r[3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
  }
};

// P as the A operand of a 16-bit P.V k-step (16 keys): the accumulator layout
// of two adjacent 8-column groups is the A-operand layout.
template <class T>
struct Pack16 {
  static constexpr int kKeys = 16;
  static constexpr int kPer = 8;
  static constexpr float kLog2Scale = 0.f;
  static constexpr float kLnScale = 0.f;
  __device__ __forceinline__ static void pack(const float (&x)[kPer], uint32_t (&r)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = pack16<T>(x[2 * i], x[2 * i + 1]);
  }
};

// kHalves: listed 64-key blocks per step. kI2fp: the exact int->float of the
// int8 scores by I2FP (else the two-op trick; both exact, a speed choice per
// instance). kPoly: every kPoly-th exponential by poly_exp2 on the FMA pipe
// (0: none).
template <int kHalves, bool kCausal, bool kI8, class Pack, bool kI2fp, int kPoly>
struct OnlineSoftmax {
  using Acc = std::conditional_t<kI8, int32_t, float>;
  static constexpr int kKeys = kHalves * 64;
  static constexpr int NS = kKeys / 2;              // S accumulator registers per thread
  static constexpr int KS = kKeys / Pack::kKeys;    // P.V k-steps per step
  // A masked score: the smallest integer (below any int8 product sum) or -inf.
  static constexpr Acc kMasked = kI8 ? Acc(INT32_MIN) : Acc(-INFINITY);

  // Lkv and scale * log2(e) are read from the kernel's parameter block (a
  // constant-bank operand, which keeps the per-step block checks on the
  // uniform datapath) rather than copied into registers.
  const Params& p;
  int quad, row0, row1, wg_row_min, diag;
  float qs0 = 0.f, qs1 = 0.f;  // kI8: q_scale * scale * log2(e) of row0, row1
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  // What the row-max phase hands to the exponentials: per 64-key block the
  // dequantization factor of each row (kI8), the shift (P's log2 scale minus
  // the new max, which is 0 for a row that has seen no key) of each row, and
  // whether any score of the step is masked (uniform over the warpgroup: it
  // depends on the key blocks and the warpgroup's first row only).
  // q0: the CTA tile's first query row (RowWork::q0).
  __device__ __forceinline__ OnlineSoftmax(const Params& p_, int q0, int cw, int tid)
      : p(p_),
        quad(tid & 3),
        row0(q0 + cw * 64 + (tid / 32) * 16 + ((tid & 31) >> 2)),
        row1(q0 + cw * 64 + (tid / 32) * 16 + ((tid & 31) >> 2) + 8),
        wg_row_min(q0 + cw * 64),
        diag(p_.Lkv - p_.Lq) {}
  // A fresh state for the tile at query row q0 (persistent CTAs: the next row).
  __device__ __forceinline__ void reset(int q0, int cw, int tid) {
    row0 = q0 + cw * 64 + (tid / 32) * 16 + ((tid & 31) >> 2);
    row1 = row0 + 8;
    wg_row_min = q0 + cw * 64;
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.f;
  }

  struct StepScale {
    float f0[kHalves], f1[kHalves];
    float c0, c1;
    bool masked_any;
  };

  // The masked scores of listed block kb (slot hh of the step, first key
  // key0) set to kMasked: a missing block, keys past Lkv, (causal) keys past
  // a row's diagonal. (key0 comes from the caller, which has it: recomputing
  // it here, or the need-mask test in a helper, changes the code ptxas emits
  // for the measured kernels, the portable int8 ones among them.)
  __device__ __forceinline__ void mask_block(Acc (&s)[NS], int hh, int kb, int key0) const {
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
      const int key = key0 + 8 * (jj / 4) + 2 * quad + (jj & 1);
      const int row = (jj & 2) ? row1 : row0;
      bool ok = (kb >= 0) && key < p.Lkv;
      if (kCausal) ok = ok && (key <= row + diag);
      if (!ok) s[hh * 32 + jj] = kMasked;
    }
  }

  // Phase 1 (reads the scores only, so it can run while the previous P.V is
  // in flight): masks, takes the row max, updates m and returns the step's
  // scale and the rescale factors of the previous state. kI8: per 64-key
  // block the max of the integers times q_scale * k_scale * scale * log2(e)
  // (f > 0, so this is the max of the dequantized scores exactly). Else the
  // max of the fp32 scores times scale * log2(e).
  __device__ __forceinline__ StepScale row_max(Acc (&s)[NS], const int (&kb)[kHalves], const float (&ksc)[kHalves],
                                               float& alpha0, float& alpha1) {
    StepScale st;
    st.masked_any = false;
    // The masked scores of a step: kMasked where a listed block is missing,
    // past the ragged end or (causal) past a row's diagonal. The two arms
    // differ only in the FP16 mode's non-finite rule; each keeps the code its
    // kernels were measured with (PERF-NOTES v67).
    if constexpr (kI8) {
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) {
        const int key0 = kb[hh] * 64;
        const bool need_mask = (kb[hh] < 0) || (key0 + 64 > p.Lkv) || (kCausal && key0 + 63 > wg_row_min + diag);
        st.masked_any |= need_mask;
        if (need_mask) mask_block(s, hh, kb[hh], key0);
      }
    } else {
      bool need_mask[kHalves];
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) {
        const int key0 = kb[hh] * 64;
        need_mask[hh] = (kb[hh] < 0) || (key0 + 64 > p.Lkv) || (kCausal && key0 + 63 > wg_row_min + diag);
        st.masked_any |= need_mask[hh];
      }
      // A score of exactly -inf (an infinite k element) must make its rows
      // NaN (docs/SEMANTICS.md, "Non-finite values"), not look masked: 0 * s +
      // s is NaN for an infinite s and s for every finite one. A step with a
      // masked score applies it here, before the masks write -inf; the others
      // in the exponent's argument (exponentiate), off the row max's path:
      // -inf and NaN never set a max, and a +inf max makes the row NaN too.
      if (st.masked_any) {
#pragma unroll
        for (int j = 0; j < NS; ++j) s[j] = __fmaf_rn(0.f, s[j], s[j]);
      }
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) {
        const int key0 = kb[hh] * 64;
        if (need_mask[hh]) mask_block(s, hh, kb[hh], key0);
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
      // Each row's NS / 2 scores by a tree (depth log2 instead of a chain).
      float r0[NS / 2], r1[NS / 2];
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        if (j & 2) r1[(j >> 2) * 2 + (j & 1)] = s[j];
        else r0[(j >> 2) * 2 + (j & 1)] = s[j];
      }
      auto mx = [](float a, float b) { return fmaxf(a, b); };
      float mx0 = tree_reduce(r0, mx), mx1 = tree_reduce(r1, mx);
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
    // exponent = float(x)*f - mu + P's log2 scale: one FFMA after the exact
    // int->float (folding the conversion's magic constant into the FFMA too
    // would round a constant of size 1.26e7*f, an error that grows with the
    // score scale).
    st.c0 = Pack::kLog2Scale - mu0;
    st.c1 = Pack::kLog2Scale - mu1;
    return st;
  }

  // Phase 2: p = 2^(s f + c) (masked scores: p = 0) packed into the P
  // fragments `pa`, row sums of the unrounded p into l. `alongside()` runs
  // first in the same basic block (the previous P.V's wait and fold), so that
  // ptxas interleaves it with the exponentials' latency while the row max
  // above stays under the previous P.V.
  //
  // Two copies, chosen by the warpgroup-uniform masked_any: steps without a
  // masked score (all but the causal diagonal and the ragged end) skip the
  // compare-and-select per score. Each k-step's scores are exponentiated and
  // packed before the next ones, which keeps few of them live.
  template <typename Alongside>
  __device__ __forceinline__ void exponentiate(const Acc (&s)[NS], const StepScale& st, float alpha0, float alpha1,
                                               uint32_t (&pa)[KS][4], Alongside alongside) {
    float rs0 = 0.f, rs1 = 0.f;
    auto exps = [&](auto masked) {
      alongside();
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        float x[Pack::kPer];
#pragma unroll
        for (int jj = 0; jj < Pack::kPer; ++jj) {
          const int j = Pack::kPer * ks + jj;
          float arg;
          if constexpr (kI8) {
            const float sj = kI2fp ? __int2float_rn(s[j]) : small_int_to_float(s[j]);
            arg = fmaf(sj, (j & 2) ? st.f1[j / 32] : st.f0[j / 32], (j & 2) ? st.c1 : st.c0);
          } else {
            // Unmasked steps: 0 * s + s here (row_max applied it to masked ones).
            const float sj = decltype(masked)::value ? s[j] : __fmaf_rn(0.f, s[j], s[j]);
            arg = fmaf(sj, p.scale_log2, (j & 2) ? st.c1 : st.c0);
          }
          // (jj is a constant after unrolling: this selects code, not data.)
          constexpr int kEvery = kPoly > 0 ? kPoly : 1;
          float pj = (kPoly > 0 && jj % kEvery == kEvery - 1) ? poly_exp2(arg) : fast_exp2(arg);
          if constexpr (decltype(masked)::value) {
            if (s[j] == kMasked) pj = 0.f;
          }
          x[jj] = pj;
          if (j & 2) rs1 += pj;
          else rs0 += pj;
        }
        Pack::pack(x, pa[ks]);
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

  // The row sums over the quad, and 1/l (0 for a row that saw no key; NaN
  // for a NaN sum: a non-finite input stays visible, docs/SEMANTICS.md).
  __device__ __forceinline__ void finish(float& inv0, float& inv1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    inv0 = (l0 > 0.f || l0 != l0) ? 1.f / l0 : 0.f;
    inv1 = (l1 > 0.f || l1 != l1) ? 1.f / l1 : 0.f;
  }

  // Natural-log LSE of row `half` (after finish): m ln 2 + ln l, minus ln of
  // P's scale, plus `shift` (the smoothing shift q.mu of the int8 modes); NaN
  // for a NaN sum; -inf for a row that saw no key, whatever the shift (a NaN
  // shift comes from a non-finite k, which such a row does not use).
  __device__ __forceinline__ float lse(int half, float shift = 0.f) const {
    const float l = half ? l1 : l0;
    const float m = half ? m1 : m0;
    return (l > 0.f || l != l) ? (m * 0.69314718055994531f + (logf(l) - Pack::kLnScale)) + shift : -INFINITY;
  }
};

// What every mainloop's consumer holds: the CTA row's coordinates, the index
// of its first row in the per-token arrays, and the online softmax; with
// int8 Q.K^T (kI8) the per-row Q scales, the per-block K scales of a step and
// the LSE's smoothing shift.
template <class SM, bool kI8>
struct ConsumerBase {
  const Params& p;
  const int cw;
  int b, h, bhkv;
  int64_t qrow;  // index of row0 in the per-token arrays (q_scale, q_mu)
  SM sm;

  __device__ __forceinline__ ConsumerBase(const Params& p_, int cw_, int tid, const RowWork& w)
      : p(p_),
        cw(cw_),
        b(w.b),
        h(w.h),
        bhkv(w.bhkv),
        qrow(int64_t(w.bh) * p_.nQB * 128 + w.q0 + cw_ * 64 + (tid / 32) * 16 + ((tid & 31) >> 2)),
        sm(p_, w.q0, cw_, tid) {
    load_qscale();
  }
  // The next row of a persistent CTA: its indices and a fresh softmax state.
  __device__ __forceinline__ void retarget(const RowWork& w, int tid) {
    b = w.b;
    h = w.h;
    bhkv = w.bhkv;
    qrow = int64_t(w.bh) * p.nQB * 128 + w.q0 + cw * 64 + (tid / 32) * 16 + ((tid & 31) >> 2);
    sm.reset(w.q0, cw, tid);
    load_qscale();
  }
  __device__ __forceinline__ void load_qscale() {
    if constexpr (kI8) {
      sm.qs0 = p.q_scale[qrow] * p.scale_log2;
      sm.qs1 = p.q_scale[qrow + 8] * p.scale_log2;
    }
  }
  // The step's K block scales, loaded before its waits (their latency off the
  // softmax's critical path). Nothing without int8 Q.K^T.
  template <int kHalves>
  __device__ __forceinline__ void load_kscale(const int (&kb)[kHalves], float (&ksc)[kHalves]) const {
    if constexpr (kI8) {
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh)
        ksc[hh] = (kb[hh] >= 0) ? p.k_scale[int64_t(bhkv) * p.nKB + kb[hh]] : 0.f;
    }
  }
  // Added to the LSE of row `half`: the smoothing shift scale * q . mu.
  __device__ __forceinline__ float lse_shift(int half) const {
    if constexpr (kI8) return p.q_mu[qrow + 8 * half];
    return 0.f;
  }
};

}  // namespace attn
}  // namespace cuda
}  // namespace sparge
