// Hopper (sm_90a) block-sparse attention, INT8_FP8 precision.
//
// One CTA computes one 128-row query block of one (batch, head) over the key
// blocks listed for it (idx/cnt). Three warpgroups:
//   WG0  producer: one thread issues TMA loads of Q (once) and, per step, of
//        the listed K tiles (64 x D int8) and V^T tiles (D x 64 fp8; split V:
//        also the lo term's) into a ring of kStages shared-memory stages
//        guarded by full/empty mbarriers (Q and stage 0 before the CTA-wide
//        barrier); its second warp stages the V scales in shared memory for
//        the epilogue;
//   WG1, WG2  consumers, 64 query rows each, steps of two listed 64-key
//        blocks (128 keys; the 64-key pingpong schedule is an A/B switch):
//        S = Q K^T   int8 wgmma m64n128k32 (IGMMA), s32 accumulators
//        online softmax in base 2 on the dequantized scores (row max while
//             the previous step's P.V runs, then the exponentials)
//        P -> e4m3 in registers (the accumulator layout is reused as the A
//             operand; V^T's token order is permuted to match, see perm32)
//        O_tile = P V  fp8 wgmma m64nDk32 (QGMMA) into a fresh accumulator,
//        O = O * alpha + O_tile in fp32 (two-level accumulation: the fp8
//             tensor-core accumulator is not full fp32).
// The two consumer warpgroups run out of phase, so one's softmax overlaps the
// other's matrix products. Numerics follow docs/SEMANTICS.md (INT8_FP8).
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

constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kBQ = 128;  // query rows per CTA (= mask block rows)
constexpr int kBK = 64;   // keys per tile (= mask block cols)
// setmaxnreg budgets: 128*24 + 256*240 <= 64K registers of the SM.
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kConsumerRegs = 240;
constexpr int kVScaleBar = 3;  // named barrier 3: the V scales in shared memory are ready
// Every poly_exp2_every<D>()-th exponential of the softmax is computed by
// poly_exp2 on the FMA pipe instead of MUFU.EX2 (0: none). H200 A/B
// (docs/PERF-NOTES.md v24): every 4th at D = 64, -2.5..-3.1 % dense (causal
// -1 %); at D = 128 every 8th / 4th / 2nd cost +5 / +5 / +14 %, so none.
// -DSPARGE_SM90_POLY_EXP2_EVERY=n overrides both at build time (A/B runs).
template <int D>
constexpr int poly_exp2_every() {
#ifdef SPARGE_SM90_POLY_EXP2_EVERY
  return SPARGE_SM90_POLY_EXP2_EVERY;
#else
  return D == 64 ? 4 : 0;
#endif
}

// Consumer schedules (see docs/KERNELS-SM90.md):
//   kWide       (default, the specified rounding) 128 keys per step: two
//               listed 64-key blocks side by side, the warpgroups taking turns
//               to issue Q.K^T(u) and P.V(u-1) back to back; the row max of
//               step u runs while P.V(u-1) is in flight (not for causal
//               D = 128, see kMaxUnderPV), the exponentials after it (one P
//               buffer keeps the wider accumulators within the register
//               budget);
//   kPingPong   64 keys per step, softmax of tile t while P.V of tile t-1 runs
//               plus turn-taking between the warpgroups. Kept for A/B
//               measurements only: its P rounding follows a 64-key running
//               max, which is not the specified one.
enum Schedule : int { kPingPong = 2, kWide = 3 };
template <int kSchedule>
struct KeysPerStep {
  static constexpr int value = kSchedule == kWide ? 128 : 64;
};

// A stage holds kKeys/64 K tiles (64 x D int8, stacked: one 128-row operand
// when kKeys = 128) and as many V^T tiles (D x 64 fp8, one after the other),
// times kVTerms (split V: the hi tiles, then the lo tiles).
template <int D, int kKeys, int kVTerms>
struct SmemLayout {
  static constexpr int kQBytes = kBQ * D;
  static constexpr int kKTile = kBK * D;
  static constexpr int kVTile = D * kBK;
  static constexpr int kKBytes = kKeys * D;
  static constexpr int kVBytes = D * kKeys;       // one term
  static constexpr int kVStage = kVTerms * kVBytes;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + kStages * kKBytes;
  // The output staging of the TMA-store epilogue: per consumer warpgroup D/64
  // blocks of 64 rows x 128 bytes, where the shared memory has room (all but
  // split V at D = 128, whose stages take 208 KiB; it keeps direct stores).
  static constexpr int kOut = (kV + kStages * kVStage + 1023) / 1024 * 1024;
  static constexpr int kOutWanted = 2 * 64 * D * 2;
  static constexpr bool kOutFits = kOut + kOutWanted + D * 4 + (2 * kStages + 1) * 8 + 1024 <= 227 * 1024;
  static constexpr int kOutBytes = kOutFits ? kOutWanted : 0;
  static constexpr int kVScale = kOut + kOutBytes;  // D floats: v_amax / 448
  static constexpr int kBar = kVScale + D * 4;
  static constexpr int kBytes = kBar + (2 * kStages + 1) * 8;
  static constexpr int kAlloc = kBytes + 1024;  // room to align the base to 1024
};

struct Params : RowParams {
  const float* q_scale;  // [BHq, nQB*128]
  const float* q_mu;     // [BHq, nQB*128]
  const float* k_scale;  // [BHkv, nKB]
  const float* v_amax;   // [BHkv, D]
  int out_bf16;
};

// Per-thread state of one consumer warpgroup (64 query rows). Register j of
// an m64nN accumulator holds row (j & 2 ? row1 : row0) and column
// 8*(j/4) + 2*quad + (j & 1), where row0 = 16*warp + lane/4 and row1 = row0 + 8.
template <int D, bool kCausal, int kKeys, int kVTerms>
struct Consumer {
  using L = SmemLayout<D, kKeys, kVTerms>;
  static constexpr int kHalves = kKeys / 64;  // 64-key blocks per step
  static constexpr int NS = kKeys / 2;        // S accumulator registers per thread
  static constexpr int KS = kKeys / 32;       // k-steps of P.V
  static constexpr uint32_t kSwz = (D == 128) ? kSwizzle128B : kSwizzle64B;
  static constexpr uint32_t kSboQK = 8 * D;   // 8 rows of D int8 bytes
  static constexpr uint32_t kSboV = 8 * kBK;  // 8 channels of 64 fp8 bytes
  static constexpr int NO = D / 2;            // O accumulator registers per thread
  static constexpr int kPolyExp2Every = poly_exp2_every<D>();

  const Params& p;
  const int cw, quad, bh, b, h, bhkv, row0, row1, wg_row_min, diag;
  const int64_t lq_pad;
  const uint8_t* sk;
  const uint8_t* sv;
  uint64_t desc_q;
  float qs0, qs1;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  int32_t acc[NS];
  float o[NO];
  float o_tile[NO];

  __device__ Consumer(const Params& p_, int cw_, int tid, int bh_, int qb, int bhkv_, const uint8_t* sq,
                      const uint8_t* sk_, const uint8_t* sv_)
      : p(p_),
        cw(cw_),
        quad(tid & 3),
        bh(bh_),
        b(bh_ / p_.Hq),
        h(bh_ - (bh_ / p_.Hq) * p_.Hq),
        bhkv(bhkv_),
        row0(qb * kBQ + cw_ * 64 + (tid / 32) * 16 + ((tid & 31) >> 2)),
        row1(qb * kBQ + cw_ * 64 + (tid / 32) * 16 + ((tid & 31) >> 2) + 8),
        wg_row_min(qb * kBQ + cw_ * 64),
        diag(p_.Lkv - p_.Lq),
        lq_pad(int64_t(p_.nQB) * kBQ),
        sk(sk_),
        sv(sv_) {
    desc_q = make_smem_desc(sq + cw * 64 * D, kSwz, kSboQK);
    qs0 = p.q_scale[int64_t(bh) * lq_pad + row0] * p.scale_log2;
    qs1 = p.q_scale[int64_t(bh) * lq_pad + row1] * p.scale_log2;
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j] = 0.f;
#pragma unroll
    for (int j = 0; j < NO; ++j) o_tile[j] = 0.f;
  }

  // Shared-memory descriptors of stage s. They are computed before the first
  // wgmma of a batch: an ordinary instruction defining a wgmma input between
  // wgmmas of one batch makes ptxas serialize them.
  __device__ __forceinline__ uint64_t desc_k(int s) const {
    return make_smem_desc(sk + s * L::kKBytes, kSwz, kSboQK);
  }
  __device__ __forceinline__ uint64_t desc_v(int s) const {
    return make_smem_desc(sv + s * L::kVStage, kSwizzle64B, kSboV);
  }

  // S = Q K^T (int8, s32 accumulate). Caller fences before and commits after.
  __device__ __forceinline__ void issue_qk(uint64_t dk) {
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      if constexpr (kKeys == 128) {
        wgmma_m64n128k32_s8s8(acc, desc_q + uint64_t((kk * 32) >> 4), dk + uint64_t((kk * 32) >> 4), kk > 0);
      } else {
        wgmma_m64n64k32_s8s8(acc, desc_q + uint64_t((kk * 32) >> 4), dk + uint64_t((kk * 32) >> 4), kk > 0);
      }
    }
  }

  // O_tile = P V (fp8, fresh accumulator; split V: P V_hi + P V_lo into the
  // same accumulator). Caller fences before and commits after. k-step ks of
  // term tt reads V^T tile ks/2 of that term at byte offset 32*(ks%2).
  __device__ __forceinline__ void issue_pv(uint64_t dv, const uint32_t (&pa)[KS][4]) {
#pragma unroll
    for (int tt = 0; tt < kVTerms; ++tt) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint64_t d = dv + uint64_t((tt * L::kVBytes + (ks / 2) * L::kVTile + (ks % 2) * 32) >> 4);
        if constexpr (D == 128) {
          wgmma_m64n128k32_e4m3_rs(o_tile, pa[ks], d, tt > 0 || ks > 0);
        } else {
          wgmma_m64n64k32_e4m3_rs(o_tile, pa[ks], d, tt > 0 || ks > 0);
        }
      }
    }
  }

  // The K block scales of a step, loaded before the step's waits so that their
  // latency is off the softmax's critical path.
  __device__ __forceinline__ void load_kscale(const int (&kb)[kHalves], float (&ks)[kHalves]) const {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) ks[hh] = (kb[hh] >= 0) ? p.k_scale[int64_t(bhkv) * p.nKB + kb[hh]] : 0.f;
  }

  // What the row-max phase hands to the exponentials: per 64-key half the
  // dequantization factor of each row, the shift (log2(448) - new max) of
  // each row, and whether any score of the step is masked.
  struct StepScale {
    float f0[kHalves], f1[kHalves];
    float c0, c1;
    bool masked_any;
  };

  // Online softmax of the scores in `acc`, phase 1: key block kb[hh] fills
  // columns [64*hh, 64*hh + 64) (kb[hh] < 0: no block, all masked); ks[hh] its
  // K scale. Masks, takes the row max, updates m and returns the rescale
  // factors of the previous accumulator. Reads `acc` only, so it can run while
  // a P.V that reads the P registers is still in flight.
  //
  // Instructions per score: an exact int->float (IADD + FADD at D = 128, I2FP
  // at D = 64), a three-input IMNMX per two scores (row max on the integers),
  // one FFMA (scale, shift and the x448 fp8 scale in one), MUFU.EX2, FADD
  // (row sum) and half an F2FP. Since f > 0, max_j float(x_j)*f ==
  // float(max_j x_j)*f exactly, so the running max equals the reference's bit
  // for bit.
  __device__ __forceinline__ StepScale row_max(const int (&kb)[kHalves], const float (&ks)[kHalves], float& alpha0,
                                               float& alpha1) {
    constexpr int32_t kMasked = INT32_MIN;
    StepScale st;
    st.masked_any = false;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      st.f0[hh] = qs0 * ks[hh];
      st.f1[hh] = qs1 * ks[hh];
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
          if (!ok) acc[j] = kMasked;
        }
      }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      int32_t im0, im1;
      quad_row_max_s32(acc, hh * 32, im0, im1);
      if (im0 != kMasked) mx0 = fmaxf(mx0, small_int_to_float(im0) * st.f0[hh]);
      if (im1 != kMasked) mx1 = fmaxf(mx1, small_int_to_float(im1) * st.f1[hh]);
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = (mn0 == -INFINITY) ? 0.f : mn0;
    const float mu1 = (mn1 == -INFINITY) ? 0.f : mn1;
    alpha0 = fast_exp2(m0 - mu0);
    alpha1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    // exponent = float(x)*f - mu + log2(448), one FFMA after the exact
    // int->float. (Folding the conversion's magic constant into the FFMA too
    // would round a constant of size 1.26e7*f, an error that grows with the
    // score scale: measurable on inputs with outlier channels.)
    constexpr float kLog2Fp8Max = 8.807354922057604f;  // log2(448)
    st.c0 = kLog2Fp8Max - mu0;
    st.c1 = kLog2Fp8Max - mu1;
    return st;
  }

  // Phase 2: P = exp2(...) as e4m3 A fragments into `pa`, row sums into l.
  // `alongside()` runs first in the same basic block (the wide schedule folds
  // the previous P.V into O there, so ptxas can interleave those FFMAs with
  // the exponentials' latency).
  //
  // Two copies of the exponentials: steps without a masked score (all but
  // the causal diagonal and the ragged end) skip the compare-and-select per
  // score. masked_any is uniform over the warpgroup (it depends on the key
  // blocks and the warpgroup's first row only), so the branch never diverges.
  // Each P.V k-step's 16 scores are exponentiated and packed to e4m3 before
  // the next ones, which keeps few of them live (register pressure limits how
  // many independent exponentials ptxas can keep in flight).
  //
  // k-step ks of P.V covers step columns [32ks, 32ks+32): accumulator chunks
  // c = 4ks .. 4ks+3, i.e. acc[16ks .. 16ks+15]. The A fragment wants, per
  // thread, k = 4*quad + (0..3) and 16 + 4*quad + (0..3); V^T's token order
  // (perm32) makes the columns this thread holds land exactly there.
  template <typename Alongside>
  __device__ __forceinline__ void exponentiate(const StepScale& st, float alpha0, float alpha1,
                                               uint32_t (&pa)[KS][4], Alongside alongside) {
    constexpr int32_t kMasked = INT32_MIN;
    float rs0 = 0.f, rs1 = 0.f;
    auto exps = [&](auto masked) {
      alongside();
#pragma unroll
      for (int ksp = 0; ksp < KS; ++ksp) {
        float x[16];
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          const int j = 16 * ksp + jj;
          const int hh = j / 32;
          // int -> float: one I2FP at D = 64, the two-op trick at D = 128 (where
          // the quarter-rate pipe I2FP shares with MUFU is the busier; H200 A/B:
          // I2FP -2.4 % time at D = 64, +1 % at D = 128). Both are exact.
          const float sj = (D == 64) ? __int2float_rn(acc[j]) : small_int_to_float(acc[j]);
          const float xj = fmaf(sj, (j & 2) ? st.f1[hh] : st.f0[hh], (j & 2) ? st.c1 : st.c0);
          // One exponential in kPolyExp2Every on the FMA pipe (poly_exp2).
          // (jj is a constant after unrolling, so this selects code, not data.)
          constexpr int kEvery = kPolyExp2Every > 0 ? kPolyExp2Every : 1;
          const bool poly = kPolyExp2Every > 0 && jj % kEvery == kEvery - 1;
          float pj = poly ? poly_exp2(xj) : fast_exp2(xj);
          if constexpr (decltype(masked)::value) {
            if (acc[j] == kMasked) pj = 0.f;
          }
          x[jj] = pj;  // p * 448
          if (j & 2) rs1 += pj;
          else rs0 += pj;
        }
        pa[ksp][0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
        pa[ksp][1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
        pa[ksp][2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
        pa[ksp][3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
      }
    };
    if (st.masked_any) {
      exps(std::true_type{});
    } else {
      exps(std::false_type{});
    }
    // Row sums are kept in units of 448 (undone in the epilogue).
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
  }

  // Both phases back to back.
  __device__ __forceinline__ void softmax(const int (&kb)[kHalves], const float (&ks)[kHalves],
                                          uint32_t (&pa)[KS][4], float& alpha0, float& alpha1) {
    const StepScale st = row_max(kb, ks, alpha0, alpha1);
    exponentiate(st, alpha0, alpha1, pa, [] {});
  }

  // O = O * alpha + O_tile (two-level accumulation in fp32).
  __device__ __forceinline__ void accumulate(float alpha0, float alpha1) {
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j] = fmaf(o[j], (j & 2) ? alpha1 : alpha0, o_tile[j]);
  }

  // vscale: shared-memory copy of v_amax * (1/448), written by the producer
  // warpgroup's second warp at the start (its latency off the tail of the CTA).
  // With p.tma_store the tile goes out through `stage` and tm_o (whole 64-row
  // tile; the TMA unit clips rows past Lq), else by direct 4-byte stores.
  __device__ __forceinline__ void epilogue(const float* vscale, uint8_t* stage, const CUtensorMap* tm_o, int tid) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = (l0 > 0.f) ? 1.f / l0 : 0.f;
    const float inv1 = (l1 > 0.f) ? 1.f / l1 : 0.f;
    named_bar_sync(kVScaleBar, 256 + 32);
    // Columns 8c + 2 quad, +1 of row `half` as a 16-bit pair.
    auto pair = [&](int c, int half) -> uint32_t {
      const int col = 8 * c + 2 * quad;
      const float inv = half ? inv1 : inv0;
      const float x0 = o[c * 4 + 2 * half + 0] * vscale[col] * inv;
      const float x1 = o[c * 4 + 2 * half + 1] * vscale[col + 1] * inv;
      if (p.out_bf16) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
        return *reinterpret_cast<const uint32_t*>(&v);
      }
      const __half2 v = __floats2half2_rn(x0, x1);
      return *reinterpret_cast<const uint32_t*>(&v);
    };
    const bool tma = L::kOutBytes > 0 && p.tma_store;  // the host sets tma_store only where there is room
    if (tma) store_tile_tma<D>(stage, 8192, tm_o, cw, tid, wg_row_min, h, b, pair);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = half ? row1 : row0;
      if (row >= p.Lq) continue;
      if (!tma) {
        char* orow = static_cast<char*>(p.out) + 2 * (int64_t(b) * p.out_stride[0] + int64_t(h) * p.out_stride[1] +
                                                      int64_t(row) * p.out_stride[2]);
#pragma unroll
        for (int c = 0; c < D / 8; ++c) *reinterpret_cast<uint32_t*>(orow + 2 * (8 * c + 2 * quad)) = pair(c, half);
      }
      if (p.lse != nullptr && quad == 0) {
        const float l = half ? l1 : l0;
        const float m = half ? m1 : m0;
        const float mu = p.q_mu[int64_t(bh) * lq_pad + row];
        const float v = (l > 0.f) ? (m * 0.69314718055994531f + (logf(l) - 6.1047932324149f) + mu) : -INFINITY;  // ln 448
        p.lse[int64_t(b) * p.lse_stride[0] + int64_t(h) * p.lse_stride[1] + int64_t(row) * p.lse_stride[2]] = v;
      }
    }
  }
};

template <int D, bool kCausal, int kSchedule, int kVTerms>
__global__ void __launch_bounds__(kThreads, 1)
    attn_int8fp8_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                        const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_vlo,
                        const __grid_constant__ CUtensorMap tm_o, const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  constexpr int kKeys = KeysPerStep<kSchedule>::value;
  constexpr int kHalves = kKeys / 64;
  using L = SmemLayout<D, kKeys, kVTerms>;
  using C = Consumer<D, kCausal, kKeys, kVTerms>;
  extern __shared__ uint8_t smem_raw[];
  const SmemRing<kStages> ring(smem_raw, L::kBar);
  uint8_t* sq = ring.base + L::kQ;
  uint8_t* sk = ring.base + L::kK;
  uint8_t* sv = ring.base + L::kV;

  const RowWork w(p);
  const int row_id = w.row_id, bh = w.bh, qb = w.qb, bhkv = w.bhkv;
  const int n_steps = w.steps<kHalves>();
  auto block_of = [&](int u, int hh) { return w.block<kHalves>(u, hh); };
  // Stage s <- step u: K tiles and V^T tiles (hi, and lo for split V).
  auto load_stage = [&](int s, const int (&kbh)[kHalves]) {
    mbar_arrive_expect_tx(&ring.full[s], L::kKBytes + L::kVStage);
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      // A missing second block loads the first again (finite data; its
      // scores are masked), so every stage completes the same byte count.
      const int kb = kbh[hh] >= 0 ? kbh[hh] : kbh[0];
      tma_load_2d(sk + s * L::kKBytes + hh * L::kKTile, &tm_k, &ring.full[s], 0, (bhkv * p.nKB + kb) * kBK);
      tma_load_2d(sv + s * L::kVStage + hh * L::kVTile, &tm_v, &ring.full[s], kb * kBK, bhkv * D);
      if (kVTerms == 2)
        tma_load_2d(sv + s * L::kVStage + L::kVBytes + hh * L::kVTile, &tm_vlo, &ring.full[s], kb * kBK, bhkv * D);
    }
  };

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    start_ring<kStages, kHalves>(
        w, p.nKB, n_steps, ring.full, ring.empty, ring.qbar,
        [&] {
          mbar_arrive_expect_tx(ring.qbar, L::kQBytes);
          tma_load_2d(sq, &tm_q, ring.qbar, 0, row_id * kBQ);
        },
        load_stage);
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    regs_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce<kStages, kHalves>(w, n_steps, ring.empty, load_stage);
    } else if (threadIdx.x >= 32 && threadIdx.x < 64) {
      // Second warp: the epilogue's V scales into shared memory.
      float* vs = reinterpret_cast<float*>(ring.base + L::kVScale);
      const float* vamax = p.v_amax + int64_t(bhkv) * D;
      constexpr float kDequantPV = 1.f / kFp8Max;  // l carries the other 1/448
      for (int i = threadIdx.x - 32; i < D; i += 32) vs[i] = vamax[i] * kDequantPV;
      named_bar_arrive(kVScaleBar, 256 + 32);
    }
    return;
  }

  // -------------------------------------------------------------- consumers
  regs_alloc<kConsumerRegs>();
  C c(p, wg - 1, threadIdx.x - 128 * wg, bh, qb, bhkv, sq, sk, sv);
  auto blocks = [&](int u, int (&kb)[kHalves]) {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) kb[hh] = block_of(u, hh);
  };
  mbar_wait(ring.qbar, 0);
  if (n_steps > 0) {
    const int me = c.cw, other = c.cw ^ 1;
    // The first turn, common to both schedules: Q.K^T(0) alone, waited for.
    // `before_turn` runs between the stage wait and the turn (global loads).
    auto first_qk = [&](auto before_turn) {
      mbar_wait(&ring.full[0], 0);
      const uint64_t dk = c.desc_k(0);
      before_turn();
      turn_begin(me);
      c.issue_qk(dk);
      wgmma_commit();
      turn_end(other);
      wgmma_wait<0>();
      fence_regs(c.acc);
    };
    // The last turn: P.V of the last step, folded into O.
    auto last_pv = [&](const uint32_t(&pin)[C::KS][4], float ain0, float ain1) {
      const int sp = (n_steps - 1) % kStages;
      const uint64_t dv = c.desc_v(sp);
      turn_begin(me);
      c.issue_pv(dv, pin);
      wgmma_commit();
      if (me == 0) turn_end(other);  // balances the initial arrive
      wgmma_wait<0>();
      fence_regs(c.o_tile);
      mbar_arrive(&ring.empty[sp]);
      c.accumulate(ain0, ain1);
    };
    if constexpr (kSchedule == kWide) {
      // Turn-taking: in its turn a warpgroup issues Q.K^T(u) then P.V(u-1);
      // it takes the row max of step u while P.V(u-1) runs, then folds
      // P.V(u-1) into O alongside the exponentials of step u, which overwrite
      // the P registers P.V(u-1) read. The other warpgroup has its turn
      // meanwhile.
      // Whether the row max of step u really runs under P.V(u-1): yes, except
      // for causal D = 128, where the longer live ranges make ptxas spill
      // inside the loop (H200 A/B, docs/PERF-NOTES.md v13: +9 % time there,
      // -1..-4 % everywhere else).
      constexpr bool kMaxUnderPV = !(kCausal && D == 128);
      if (me == 1) turn_end(0);  // warpgroup 0 goes first
      uint32_t pa[C::KS][4];
      float al0, al1;
      int kb[kHalves];
      float ksc[kHalves];
      first_qk([&] {
        blocks(0, kb);
        c.load_kscale(kb, ksc);
      });
      c.softmax(kb, ksc, pa, al0, al1);
      for (int u = 1; u < n_steps; ++u) {
        const int s = u % kStages, sp = (u - 1) % kStages;
        mbar_wait(&ring.full[s], (u / kStages) & 1);
        const uint64_t dk = c.desc_k(s), dv = c.desc_v(sp);
        blocks(u, kb);
        c.load_kscale(kb, ksc);
        turn_begin(me);
        c.issue_qk(dk);
        wgmma_commit();
        c.issue_pv(dv, pa);
        wgmma_commit();
        turn_end(other);
        wgmma_wait<1>();  // Q.K^T(u) done
        fence_regs(c.acc);
        float nal0, nal1;
        const typename C::StepScale st = c.row_max(kb, ksc, nal0, nal1);
        if constexpr (kMaxUnderPV) {
          // The wait sits inside the exponentials' branch arms: ptxas
          // schedules within a basic block and would otherwise sink the row
          // max below the wait.
          c.exponentiate(st, nal0, nal1, pa, [&] {
            wgmma_wait<0>();  // P.V(u-1) done
            fence_regs(c.o_tile);
            fence_regs(pa);
            mbar_arrive(&ring.empty[sp]);
            c.accumulate(al0, al1);
          });
        } else {
          wgmma_wait<0>();  // P.V(u-1) done
          fence_regs(c.o_tile);
          fence_regs(pa);
          mbar_arrive(&ring.empty[sp]);
          c.exponentiate(st, nal0, nal1, pa, [&] { c.accumulate(al0, al1); });
        }
        al0 = nal0;
        al1 = nal1;
      }
      last_pv(pa, al0, al1);
    } else {
      // Intra-warpgroup overlap (softmax of tile t while P.V of tile t-1 runs)
      // and turn-taking between the two consumer warpgroups.
      if (me == 1) turn_end(0);  // warpgroup 0 goes first
      first_qk([] {});
      // Two P buffers used alternately (the loop is unrolled by two), so the
      // registers an in-flight P.V reads are never the ones the next softmax
      // writes; a copy between them would let ptxas merge the two and
      // serialize the wgmmas.
      uint32_t pa_a[C::KS][4], pa_b[C::KS][4];
      float al_a0, al_a1, al_b0, al_b1;
      int kb[kHalves];
      float ksc[kHalves];
      blocks(0, kb);
      c.load_kscale(kb, ksc);
      c.softmax(kb, ksc, pa_a, al_a0, al_a1);
      auto step = [&](int t, const uint32_t(&pin)[C::KS][4], float ain0, float ain1, uint32_t(&pout)[C::KS][4],
                      float& aout0, float& aout1) {
        const int s = t % kStages, sp = (t - 1) % kStages;
        mbar_wait(&ring.full[s], (t / kStages) & 1);
        const uint64_t dk = c.desc_k(s), dv = c.desc_v(sp);
        turn_begin(me);
        c.issue_qk(dk);
        wgmma_commit();
        c.issue_pv(dv, pin);
        wgmma_commit();
        turn_end(other);
        wgmma_wait<1>();
        fence_regs(c.acc);
        int kbt[kHalves];
        float kst[kHalves];
        blocks(t, kbt);
        c.load_kscale(kbt, kst);
        c.softmax(kbt, kst, pout, aout0, aout1);
        wgmma_wait<0>();
        fence_regs(c.o_tile);
        mbar_arrive(&ring.empty[sp]);
        c.accumulate(ain0, ain1);
      };
      int t = 1;
      for (; t + 1 < n_steps; t += 2) {
        step(t, pa_a, al_a0, al_a1, pa_b, al_b0, al_b1);
        step(t + 1, pa_b, al_b0, al_b1, pa_a, al_a0, al_a1);
      }
      if (t < n_steps) {
        step(t, pa_a, al_a0, al_a1, pa_b, al_b0, al_b1);
        last_pv(pa_b, al_b0, al_b1);
      } else {
        last_pv(pa_a, al_a0, al_a1);
      }
    }
  }
  c.epilogue(reinterpret_cast<const float*>(ring.base + L::kVScale), ring.base + L::kOut + c.cw * (D / 64) * 8192,
             &tm_o, threadIdx.x - 128 * wg);
#else
  __trap();  // built for another architecture: the dispatcher must not launch this
#endif
}

// ------------------------------------------------------------------ host side
template <int D, bool kCausal, int kSchedule, int kVTerms>
sparge_status_t launch(const AttnArgs& a, const Params& prm, cudaStream_t stream) {
  using L = SmemLayout<D, KeysPerStep<kSchedule>::value, kVTerms>;
  static_assert(L::kAlloc <= 227 * 1024, "shared memory budget of sm_90");
  EncodeTiledFn enc = nullptr;
  SPARGE_TRY(get_encode_fn(&enc));
  const Problem& pb = a.prob;
  const uint64_t bhq = uint64_t(pb.B * pb.Hq), bhk = uint64_t(pb.B * pb.Hkv);
  const CUtensorMapSwizzle swz = (D == 128) ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  CUtensorMap tq, tk, tv, tvlo;
  SPARGE_TRY(make_map(enc, &tq, a.q_i8, D, bhq * pb.nQB * kBQ, D, kBQ, swz, "q"));
  SPARGE_TRY(make_map(enc, &tk, a.k_i8, D, bhk * pb.nKB * kBK, D, kBK, swz, "k"));
  SPARGE_TRY(make_map(enc, &tv, a.v_f8, uint64_t(pb.nKB) * kBK, bhk * D, kBK, D, CU_TENSOR_MAP_SWIZZLE_64B, "v"));
  if (kVTerms == 2) {
    SPARGE_TRY(make_map(enc, &tvlo, a.v_f8_lo, uint64_t(pb.nKB) * kBK, bhk * D, kBK, D, CU_TENSOR_MAP_SWIZZLE_64B,
                        "v_lo"));
  } else {
    tvlo = tv;  // unused
  }
  // The TMA-store epilogue where the stages leave room and the output's strides
  // are expressible (else direct stores).
  CUtensorMap to = tq;
  Params prm_run = prm;
  prm_run.tma_store = 0;
  if (L::kOutBytes > 0 && tma_store_from_env() &&
      make_map_bhld16(enc, &to, a.out.data, pb.dtype == SPARGE_DTYPE_BFLOAT16, a.out.shape, a.out.stride, 64) ==
          CUDA_SUCCESS)
    prm_run.tma_store = 1;
  auto kernel = attn_int8fp8_kernel<D, kCausal, kSchedule, kVTerms>;
  SPARGE_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kAlloc));
  const unsigned grid = static_cast<unsigned>(bhq * pb.nQB);
  SPARGE_PDL_CHECK(launch_pdl(kernel, dim3(grid), dim3(kThreads), L::kAlloc, stream, tq, tk, tv, tvlo, to, prm_run),
                   "attn_int8fp8_kernel");
  return SPARGE_OK;
}

// Consumer schedule: SPARGE_SM90_SCHEDULE = wide (default) or pingpong. A
// developer switch for A/B measurements, read once.
int schedule_from_env() {
  static const int schedule = [] {
    const char* e = std::getenv("SPARGE_SM90_SCHEDULE");
    if (e != nullptr && std::strcmp(e, "pingpong") == 0) return int(kPingPong);
    return int(kWide);
  }();
  return schedule;
}

// Split V runs the wide schedule only (the pingpong A/B switch is ignored).
template <int D, bool kCausal>
sparge_status_t launch_variant(const AttnArgs& a, const Params& prm, cudaStream_t stream) {
  if (a.prob.split_v()) return launch<D, kCausal, kWide, 2>(a, prm, stream);
  if (schedule_from_env() == kPingPong) return launch<D, kCausal, kPingPong, 1>(a, prm, stream);
  return launch<D, kCausal, kWide, 1>(a, prm, stream);
}

}  // namespace
}  // namespace sm90

sparge_status_t check_int8fp8_out(const Tensor4& o) {
  // The epilogue writes pairs of 16-bit elements (4-byte stores) when it does
  // not go through the TMA unit: rows must start on 4-byte boundaries.
  bool even = reinterpret_cast<uintptr_t>(o.data) % 4 == 0;
  for (int d = 0; d < 3; ++d) even = even && (o.shape[d] <= 1 || o.stride[d] % 2 == 0);
  if (even) return SPARGE_OK;
  return fail(SPARGE_ERR_UNSUPPORTED,
              "out: the int8 CUDA kernels write pairs of elements and need a 4-byte aligned data pointer "
              "and even batch/head/row strides (got strides %lld, %lld, %lld)",
              static_cast<long long>(o.stride[0]), static_cast<long long>(o.stride[1]),
              static_cast<long long>(o.stride[2]));
}

sparge_status_t check_sm90_int8_problem(const Problem& pb, const char* mode) {
  if (pb.D != 64 && pb.D != 128)
    return fail(SPARGE_ERR_UNSUPPORTED, "head_dim: the sm_90 %s kernel supports 64 and 128, got %lld", mode,
                static_cast<long long>(pb.D));
  if (pb.BQ != kGpuBlockQ || pb.BK != kGpuBlockK)
    return fail(SPARGE_ERR_UNSUPPORTED, "problem->block_q/block_k: the CUDA kernels use 128x64 mask blocks, got %dx%d",
                pb.BQ, pb.BK);
  if (pb.dtype != SPARGE_DTYPE_FLOAT16 && pb.dtype != SPARGE_DTYPE_BFLOAT16)
    return fail(SPARGE_ERR_UNSUPPORTED, "dtype: the sm_90 %s kernel takes float16 or bfloat16 tensors", mode);
  // Tile coordinates are 32-bit: rows of the int8 Q and K (and of V^T), and
  // key and row indices (key0 + 64 must not overflow).
  if (pb.B * pb.Hq * pb.nQB * kGpuBlockQ >= (int64_t(1) << 31) ||
      pb.B * pb.Hkv * pb.nKB * kGpuBlockK >= (int64_t(1) << 31) || pb.B * pb.Hkv * pb.D >= (int64_t(1) << 31) ||
      pb.Lq > 0x3fffffffLL || pb.Lkv > 0x3fffffffLL)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "problem (batch, heads, len_q, len_kv): too large for 32-bit tile coordinates (B*H*L >= 2^31 or "
                "L >= 2^30)");
  return SPARGE_OK;
}

sparge_status_t launch_attention_sm90_int8fp8(const AttnArgs& a, cudaStream_t stream) {
  const Problem& pb = a.prob;
  SPARGE_TRY(check_sm90_int8_problem(pb, "INT8_FP8"));
  if (pb.B * pb.Hq * pb.nQB == 0) return SPARGE_OK;
  sm90::Params prm{};
  prm.q_scale = a.q_scale;
  prm.q_mu = a.q_mu;
  prm.k_scale = a.k_scale;
  prm.v_amax = a.v_amax;
  sm90::fill_row_params(a, &prm);
  prm.out_bf16 = (pb.dtype == SPARGE_DTYPE_BFLOAT16) ? 1 : 0;
  if (pb.D == 128) {
    if (pb.causal) return sm90::launch_variant<128, true>(a, prm, stream);
    return sm90::launch_variant<128, false>(a, prm, stream);
  }
  if (pb.causal) return sm90::launch_variant<64, true>(a, prm, stream);
  return sm90::launch_variant<64, false>(a, prm, stream);
}

}  // namespace cuda
}  // namespace sparge
