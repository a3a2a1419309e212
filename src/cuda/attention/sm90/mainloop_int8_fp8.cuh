// The INT8_FP8 mainloop of the sm_90a kernel skeleton (kernel.cuh):
//   S = Q K^T    int8 wgmma m64n128k32 (IGMMA), s32 accumulators, Q and K
//                from the preparation's int8 rows (K-major, TMA 2-D maps);
//   P -> e4m3 in registers (the accumulator layout is reused as the A operand;
//                V^T's token order is permuted to match, see perm32);
//   O_tile = P V fp8 wgmma m64nDk32 (QGMMA) into a fresh accumulator, then
//   O = O * alpha + O_tile in fp32 (two-level accumulation: the fp8
//                tensor-core accumulator is not full fp32).
// Split V (kVTerms = 2) adds P V_lo into the same O_tile. The producer's
// second warp stages the per-channel V scales for the epilogue.
#pragma once
#include <cuda.h>

#include "core/kernel_traits.hpp"
#include "cuda/attention/common/softmax.cuh"
#include "cuda/attention/sm90/cta.cuh"
#include "cuda/attention/sm90/primitives.cuh"
#include "cuda/attention/sm90/wgmma_ops.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {

using attn::ConsumerBase;
using attn::OnlineSoftmax;
using attn::pack16;
using attn::PackE4M3;

constexpr int kVScaleBar = 3;  // named barrier 3: the V scales in shared memory are ready

template <int D, bool kCausal, int kVTerms>
struct MainloopInt8Fp8 {
  static constexpr int Dk = int(gpu_kernel_head_dim(D));
  static_assert(Dk == 64 || Dk == 128, "INT8_FP8 on sm_90a: kernel head dim 64 or 128");
  static constexpr int kHalves = blocks_per_step(kVTerms == 2 ? SPARGE_PRECISION_INT8_FP8_SPLIT_V
                                                              : SPARGE_PRECISION_INT8_FP8, D);
  static constexpr int kKeys = kHalves * 64;
  static constexpr int kConsumers = 2, kRows = 128, kThreads = 384;  // kernel.cuh
  using Wide = void;   // no dense-call variant
  using Short = void;  // no short-row variant
  static constexpr int kOcc = 1;  // CTAs per SM
  static constexpr bool kSerialSteps = false;
  static constexpr int kHeadDim = D;
  static constexpr bool kI8C = true, kFp8PV = true;
  static constexpr bool kCausalC = kCausal;
  static constexpr int kVTermsC = kVTerms;
  // Every 4th exponential by poly_exp2 at Dk = 64, where the exponentials
  // outweigh the matrix products (H200 A/B: -2.5..-3.1 % dense); none at 128
  // (every 8th / 4th / 2nd cost +5 / +5 / +14 %). I2FP at Dk = 64 (-2.4 %),
  // the two-op int->float at 128 (I2FP +1 %).
  static constexpr int kPoly = Dk == 64 ? 4 : 0;
  static constexpr bool kI2fp = Dk == 64;
  // The row max of step u under P.V(u-1): yes, except causal Dk = 128, where
  // the longer live ranges make ptxas spill (H200 A/B: +9 % there).
  static constexpr bool kMaxUnderPV = !(kCausal && Dk == 128);
  static constexpr bool kPersistOK = false;  // one CTA per row (kernel.cuh)

  // A stage holds kHalves K tiles (64 x Dk int8, stacked: one kKeys-row
  // operand) and as many V^T tiles (Dk x 64 fp8, one after the other), times
  // kVTerms (split V: the hi tiles, then the lo tiles).
  struct Layout {
    static constexpr int kStages = 4;
    static constexpr int kQBytes = 128 * Dk;
    static constexpr int kKTile = 64 * Dk;
    static constexpr int kVTile = Dk * 64;
    static constexpr int kKBytes = kKeys * Dk;
    static constexpr int kVBytes = Dk * kKeys;  // one term
    static constexpr int kKStage = kKBytes;
    static constexpr int kVStage = kVTerms * kVBytes;
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kQBytes;
    static constexpr int kV = kK + kStages * kKStage;
    // The output staging of the TMA-store epilogue where the shared memory
    // has room (all but split V at Dk = 128, which keeps direct stores).
    static constexpr int kOut = (kV + kStages * kVStage + 1023) / 1024 * 1024;
    static constexpr int kOutWanted = 2 * 64 * Dk * 2;
    static constexpr bool kOutFits = kOut + kOutWanted + Dk * 4 + (2 * kStages + 1) * 8 + 1024 <= 227 * 1024;
    static constexpr int kOutBytes = kOutFits ? kOutWanted : 0;
    static constexpr int kVScale = kOut + kOutBytes;  // Dk floats: v_amax / 448
    static constexpr int kBar = kVScale + Dk * 4;
    static constexpr int kBytes = kBar + (2 * kStages + 1) * 8;
    static constexpr int kAlloc = kBytes + 1024;  // room to align the base to 1024
  };
  static constexpr bool kTmaStore = Layout::kOutBytes > 0;
  using SM = OnlineSoftmax<kHalves, kCausal, true, PackE4M3, kI2fp, kPoly>;
  static constexpr int KS = SM::KS;

  __device__ __forceinline__ static void load_q(const Maps& m, const Params&, const RowWork& w, uint8_t* base,
                                                uint64_t* bar) {
    mbar_arrive_expect_tx(bar, Layout::kQBytes);
    tma_load_2d(base + Layout::kQ, &m.q, bar, 0, w.row_id * 128);
  }
  // Listed block kb into slot hh of a stage (sk, sv): its K tile and V^T
  // tile (and the lo term's for split V).
  __device__ __forceinline__ static void load_block(const Maps& m, const Params& p, const RowWork& w, uint8_t* sk,
                                                    uint8_t* sv, uint64_t* full, int hh, int kb) {
    tma_load_2d(sk + hh * Layout::kKTile, &m.k, full, 0, (w.bhkv * p.nKB + kb) * 64);
    tma_load_2d(sv + hh * Layout::kVTile, &m.v, full, kb * 64, w.bhkv * Dk);
    if (kVTerms == 2) tma_load_2d(sv + Layout::kVBytes + hh * Layout::kVTile, &m.v2, full, kb * 64, w.bhkv * Dk);
  }
  // The producer's second warp: the epilogue's V scales into shared memory
  // (their latency off the tail of the CTA).
  __device__ __forceinline__ static void producer_side(const Params& p, const RowWork& w, uint8_t* base, int lane) {
    float* vs = reinterpret_cast<float*>(base + Layout::kVScale);
    const float* vamax = p.v_amax + int64_t(w.bhkv) * Dk;
    constexpr float kDequantPV = 1.f / kFp8Max;  // l carries the other 1/448
    for (int i = lane; i < Dk; i += 32) vs[i] = vamax[i] * kDequantPV;
    named_bar_arrive(kVScaleBar, 256 + 32);
  }

  struct Consumer : ConsumerBase<SM, true> {
    using Base = ConsumerBase<SM, true>;
    using Base::p, Base::cw, Base::b, Base::h, Base::sm;
    static constexpr int NO = Dk / 2;  // O accumulator registers per thread
    static constexpr uint32_t kSwz = (Dk == 128) ? kSwizzle128B : kSwizzle64B;
    static constexpr uint32_t kSboQK = 8 * Dk;  // 8 rows of Dk int8 bytes
    static constexpr uint32_t kSboV = 8 * 64;   // 8 channels of 64 fp8 bytes

    const uint8_t* sk;
    const uint8_t* sv;
    uint64_t desc_q;
    int32_t s[SM::NS];
    float o[NO];
    float o_tile[NO];

    __device__ Consumer(const Params& p_, int cw_, int tid, const RowWork& w, uint8_t* base)
        : Base(p_, cw_, tid, w), sk(base + Layout::kK), sv(base + Layout::kV) {
      desc_q = make_smem_desc(base + Layout::kQ + cw * 64 * Dk, kSwz, kSboQK);
#pragma unroll
      for (int j = 0; j < NO; ++j) o[j] = 0.f;
#pragma unroll
      for (int j = 0; j < NO; ++j) o_tile[j] = 0.f;
    }

    // Descriptors of stage st, computed before the first wgmma of a batch (an
    // ordinary instruction defining a wgmma input between the wgmmas of one
    // batch makes ptxas serialize them).
    __device__ __forceinline__ uint64_t desc_k(int st) const {
      return make_smem_desc(sk + st * Layout::kKBytes, kSwz, kSboQK);
    }
    __device__ __forceinline__ uint64_t desc_v(int st) const {
      return make_smem_desc(sv + st * Layout::kVStage, kSwizzle64B, kSboV);
    }
    // S = Q K^T (int8, s32). Caller fences before and commits after.
    __device__ __forceinline__ void issue_qk(uint64_t dk) {
#pragma unroll
      for (int kk = 0; kk < Dk / 32; ++kk)
        wgmma_s8_ss<kKeys>(s, desc_q + uint64_t((kk * 32) >> 4), dk + uint64_t((kk * 32) >> 4), kk > 0);
    }
    // O_tile = P V (fresh accumulator; split V: P V_hi + P V_lo). k-step ks
    // of term tt reads V^T tile ks/2 of that term at byte offset 32*(ks%2).
    __device__ __forceinline__ void issue_pv(uint64_t dv, const uint32_t (&pa)[KS][4]) {
#pragma unroll
      for (int tt = 0; tt < kVTerms; ++tt) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const uint64_t d =
              dv + uint64_t((tt * Layout::kVBytes + (ks / 2) * Layout::kVTile + (ks % 2) * 32) >> 4);
          wgmma_e4m3_rs<Dk>(o_tile, pa[ks], d, tt > 0 || ks > 0);
        }
      }
    }
    __device__ __forceinline__ void fence_pv() { fence_regs(o_tile); }
    // After P.V(u-1): O = O * alpha(u-1) + O_tile.
    __device__ __forceinline__ void after_pv(float ap0, float ap1, float, float) { accumulate(ap0, ap1); }
    __device__ __forceinline__ void after_last_pv(float ap0, float ap1) { accumulate(ap0, ap1); }
    __device__ __forceinline__ void accumulate(float alpha0, float alpha1) {
#pragma unroll
      for (int j = 0; j < NO; ++j) o[j] = fmaf(o[j], (j & 2) ? alpha1 : alpha0, o_tile[j]);
    }

    // (O / l) * (v_amax / 448) as 16-bit pairs; the LSE adds back q.mu and
    // removes P's 448.
    __device__ __forceinline__ void epilogue(const Maps& m, uint8_t* base, int tid) {
      float inv0, inv1;
      sm.finish(inv0, inv1);
      named_bar_sync(kVScaleBar, 256 + 32);
      const float* vscale = reinterpret_cast<const float*>(base + Layout::kVScale);
      const bool bf16 = p.out_bf16 != 0;
      auto pair = [&](int c, int half) -> uint32_t {
        const int col = 8 * c + 2 * sm.quad;
        const float inv = half ? inv1 : inv0;
        // Normalised before the V scale is applied (docs/SEMANTICS.md): O
        // holds code sums that O * scale could take past the float range.
        const float x0 = (o[c * 4 + 2 * half + 0] * inv) * vscale[col];
        const float x1 = (o[c * 4 + 2 * half + 1] * inv) * vscale[col + 1];
        return bf16 ? pack16<__nv_bfloat16>(x0, x1) : pack16<__half>(x0, x1);
      };
      const bool tma = Layout::kOutBytes > 0 && p.tma_store;  // the host sets tma_store only where there is room
      write_output<Dk, D>(p, sm, b, h, cw, tid, tma, base + Layout::kOut + cw * (Dk / 64) * 8192, 8192, &m.o, pair,
                          [&](int half) { return this->lse_shift(half); });
    }
  };
};

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
