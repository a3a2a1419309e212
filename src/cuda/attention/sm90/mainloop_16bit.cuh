// The 16-bit P.V mainloops of the sm_90a kernel skeleton (kernel.cuh): the
// FP16 precision mode (fp16 or bf16 q, k, v used as given; fp32 scores and
// accumulation) and INT8_FP16 (kI8: Q and K as the preparation's int8 codes
// with their per-token / per-64-key-block scales on the int8 tensor cores; P
// and V as in the FP16 mode).
//   S = Q K^T   FP16: wgmma m64n{kKeys}k16 (HGMMA), both operands in shared
//               memory, K-major, loaded by 4-D TMA maps straight from the
//               caller's [B, H, L, D] tensors (rows past the end, and the
//               columns of a head dim padded to Dk, arrive as zeros);
//               INT8_FP16: int8 wgmma m64n{kKeys}k32 from the workspace's
//               int8 rows (2-D maps);
//   P -> the 16-bit type in registers: the accumulator layout of two
//               adjacent 8-column groups is the A-operand layout of one
//               16-key k-step;
//   O += P V    wgmma m64n{Dk}k16 with A from registers and V as the
//               transposed (MN-major) B operand straight from the tile TMA
//               wrote; O is rescaled by alpha before the next P.V is issued
//               (fp32 accumulation needs no second level).
#pragma once
#include <cuda.h>

#include <type_traits>

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
using attn::Pack16;

//
// kCW: consumer warpgroups (64 query rows each). 2: the CTA tile is one
// 128-row mask row (every call). 3: dense FP16 calls at D = 64 only (Wide
// below): 192-row tiles, 128-key steps, so that two warpgroups' softmax
// overlaps the third's products (at D = 64 a step's products are too short
// to cover one warpgroup's softmax).
// kOcc: CTAs per SM. 2: the short-row variant of FP16 at D = 64 (Short
// below): 64-key steps, four stages of 16 KiB, 104-register consumers, so
// that one CTA's start (Q's latency, the first stage) and end (epilogue, CTA
// turnover) overlap the other's steps where many short rows make those
// fixed costs a large share (docs/PERF-NOTES.md v48, v71).
template <class T, int D, bool kCausal, bool kI8, int kCW = 2, int kOccupancy = 1>
struct Mainloop16 {
  static constexpr int Dk = int(gpu_kernel_head_dim(D));
  static_assert(Dk == 64 || Dk == 128 || Dk == 256, "16-bit P.V on sm_90a: kernel head dim 64, 128 or 256");
  static_assert(kCW == 2 || (kCW == 3 && !kI8 && D == 64), "three consumer warpgroups: dense FP16 at D = 64");
  static_assert(kOccupancy == 1 || (kOccupancy == 2 && kCW == 2 && !kI8 && D == 64),
                "two CTAs per SM: FP16 at D = 64 on two consumer warpgroups");
  static constexpr int kOcc = kOccupancy;
  static constexpr int kConsumers = kCW;
  static constexpr int kRows = 64 * kCW;  // query rows of a CTA tile
  static constexpr int kThreads = 128 * (kCW + 1);
  static constexpr int kHalves =
      kOcc == 2 ? 1
                : (kCW == 3 ? 2 : blocks_per_step(kI8 ? SPARGE_PRECISION_INT8_FP16 : SPARGE_PRECISION_FP16, D));
  static constexpr int kKeys = kHalves * 64;
  static constexpr bool kBase = kCW == 2 && kOcc == 1 && !kI8 && D == 64;
  // The dense-call variant of this mainloop (launch_sm90.cuh), or void.
  using Wide = std::conditional_t<kBase, Mainloop16<T, D, kCausal, false, 3>, void>;
  // The short-row variant (launch_sm90.cuh, use_short), or void.
  using Short = std::conditional_t<kBase, Mainloop16<T, D, kCausal, false, 2, 2>, void>;
  static constexpr int kHeadDim = D;
  static constexpr bool kI8C = kI8, kFp8PV = false, kTmaStore = true;
  static constexpr bool kCausalC = kCausal;
  static constexpr int kVTermsC = 1;
  // INT8_FP16 at Dk = 64: I2FP for the non-causal kernels, the two-op
  // int->float for causal (H200 A/B: -2.0..-2.9 % causal, I2FP otherwise);
  // no poly_exp2 (every 4th measured -1.6..+1.2 %, +6 % with the trick).
  static constexpr bool kI2fp = kI8 && Dk == 64 && !kCausal;
  static constexpr int kPoly = 0;
  static constexpr bool kMaxUnderPV = true;
  // The short-row kernel's steps without turns (kernel.cuh, consume_serial).
  static constexpr bool kSerialSteps = kOcc == 2;
  // Dense work may run on persistent CTAs (kernel.cuh: persistent_cta).
  static constexpr bool kPersistOK = !kI8 && kOcc == 1;

  // Shared memory. Every 16-bit operand tile is stored as column blocks of 64
  // elements (128 bytes per row, 128B swizzle, as TMA writes it):
  //   Q      [Dk/64][kRows][64]          K-major A operand
  //   K (s)  [Dk/64][kKeys][64]          K-major B operand of Q K^T; block hh of
  //                                      the step fills keys 64hh..64hh+63
  //   V (s)  [Dk/64][kKeys][64]          MN-major B operand of P V (N = Dk)
  // int8 Q and K (kI8) are column blocks of W = min(Dk, 128) bytes (swizzle
  // W): Q [Dk/W][128][W], K (s) [Dk/W][kKeys][W]; and the output tile is staged
  // in its own region (per consumer warpgroup Dk/64 blocks of 64 rows x 128
  // bytes); FP16 stages it in the warpgroup's rows of the Q tile.
  struct Layout {
    static constexpr int kStages = (Dk == 64) ? 4 : (Dk == 128) ? 3 : 2;
    static constexpr int kCols = Dk / 64;           // 64-element column blocks
    static constexpr int kW8 = Dk < 128 ? Dk : 128;  // int8 column block width (bytes)
    static constexpr int kCols8 = Dk / kW8;
    static constexpr int kQCol = kRows * 128;       // bytes of one 16-bit Q column block
    static constexpr int kKVCol = kKeys * 128;      // bytes of one 16-bit K or V column block (a step)
    static constexpr int kBlockRows = 64 * 128;     // bytes of one listed block inside a column block
    static constexpr int kQCol8 = 128 * kW8;        // bytes of one int8 Q column block
    static constexpr int kKCol8 = kKeys * kW8;      // bytes of one int8 K column block (a step)
    static constexpr int kQBytes = kI8 ? 128 * Dk : kCols * kQCol;
    static constexpr int kQBoxRows = kCW == 2 ? 128 : 64;  // rows of the Q map's box (the host's map)
    static constexpr int kKBytes = kI8 ? kKeys * Dk : kCols * kKVCol;  // K of one stage
    static constexpr int kVBytes = kCols * kKVCol;                    // V of one stage
    static constexpr int kKStage = kKBytes, kVStage = kVBytes;
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kQBytes;
    static constexpr int kV = kK + kStages * kKStage;
    static constexpr int kOut = (kV + kStages * kVStage + 1023) / 1024 * 1024;
    static constexpr int kOutBytes = kI8 ? 2 * 64 * Dk * 2 : 0;
    static constexpr int kBar = kI8 ? kOut + kOutBytes : kV + kStages * kVStage;
    static constexpr int kBytes = kBar + (2 * kStages + 1) * 8;
    static constexpr int kAlloc = kBytes + 1024;  // room to align the base to 1024
  };
  using SM = OnlineSoftmax<kHalves, kCausal, kI8, Pack16<T>, kI2fp, kPoly>;
  static constexpr int KS = SM::KS;

  __device__ __forceinline__ static void load_q(const Maps& m, const Params& p, const RowWork& w, uint8_t* base,
                                                uint64_t* bar) {
    load_q_to(m, p, w, base + Layout::kQ, bar);
  }
  // The row's Q tile into the Q buffer at sq (persistent CTAs alternate two).
  __device__ __forceinline__ static void load_q_to(const Maps& m, const Params&, const RowWork& w, uint8_t* sq,
                                                   uint64_t* bar) {
    mbar_arrive_expect_tx(bar, Layout::kQBytes);
    if constexpr (kI8) {
#pragma unroll
      for (int cb = 0; cb < Layout::kCols8; ++cb)
        tma_load_2d(sq + cb * Layout::kQCol8, &m.q, bar, cb * Layout::kW8, w.row_id * 128);
    } else {
#pragma unroll
      for (int cb = 0; cb < Layout::kCols; ++cb)
#pragma unroll
        for (int r = 0; r < kRows; r += Layout::kQBoxRows)
          tma_load_4d(sq + cb * Layout::kQCol + r * 128, &m.q, bar, cb * 64, w.q0 + r, w.h, w.b);
    }
  }
  // Listed block kb into slot hh of a stage (sk, sv): its K rows (INT8_FP16:
  // rows (bhkv * nKB + kb) * 64.. of the workspace's int8 K) and V rows.
  __device__ __forceinline__ static void load_block(const Maps& m, const Params& p, const RowWork& w, uint8_t* sk,
                                                    uint8_t* sv, uint64_t* full, int hh, int kb) {
    if constexpr (kI8) {
#pragma unroll
      for (int cb = 0; cb < Layout::kCols8; ++cb)
        tma_load_2d(sk + cb * Layout::kKCol8 + hh * 64 * Layout::kW8, &m.k, full, cb * Layout::kW8,
                    (w.bhkv * p.nKB + kb) * 64);
    } else {
      load_part<false>(m, w, sk, full, hh, kb);
    }
    load_part<true>(m, w, sv, full, hh, kb);
  }
  // The 16-bit K (kV false; FP16 only) or V rows of block kb into slot hh of
  // a stage's K or V tile at dst (a split ring loads them apart).
  template <bool kV>
  __device__ __forceinline__ static void load_part(const Maps& m, const RowWork& w, uint8_t* dst, uint64_t* bar,
                                                   int hh, int kb) {
    static_assert(kV || !kI8, "int8 K rows load through load_block");
#pragma unroll
    for (int cb = 0; cb < Layout::kCols; ++cb)
      tma_load_4d(dst + cb * Layout::kKVCol + hh * Layout::kBlockRows, kV ? &m.v : &m.k, bar, cb * 64, kb * 64,
                  w.hkv, w.b);
  }
  __device__ __forceinline__ static void producer_side(const Params&, const RowWork&, uint8_t*, int) {}

  struct Consumer : ConsumerBase<SM, kI8> {
    using Base = ConsumerBase<SM, kI8>;
    using Base::p, Base::cw, Base::b, Base::h, Base::sm;
    using Mma = Wgmma16<T>;
    using Acc = typename SM::Acc;
    static constexpr int NO = Dk / 2;  // O accumulator registers per thread
    // Q and K descriptors: 16-bit: 128B swizzle, 1024 bytes per 8 rows of a
    // 64-element column block; int8: swizzle of the column block width, 8 W
    // bytes per 8 rows.
    static constexpr uint32_t kSwzQK = (kI8 && Layout::kW8 == 64) ? kSwizzle64B : kSwizzle128B;
    static constexpr uint32_t kSboQK = kI8 ? 8 * Layout::kW8 : 1024;

    uint8_t* sq;
    const uint8_t* sk;
    const uint8_t* sv;
    uint64_t desc_q;
    Acc s[SM::NS];
    float o[NO];

    __device__ Consumer(const Params& p_, int cw_, int tid, const RowWork& w, uint8_t* base)
        : Consumer(p_, cw_, tid, w, base, base + Layout::kQ) {}
    // Q read from (and, FP16, the output staged in) the Q buffer at sq_.
    __device__ Consumer(const Params& p_, int cw_, int tid, const RowWork& w, uint8_t* base, uint8_t* sq_)
        : Base(p_, cw_, tid, w), sq(sq_), sk(base + Layout::kK), sv(base + Layout::kV) {
      desc_q = q_desc_at(sq);
#pragma unroll
      for (int j = 0; j < NO; ++j) o[j] = 0.f;
    }
    // This warpgroup's 64 rows of the Q buffer at q (first column block).
    __device__ __forceinline__ uint64_t q_desc_at(const uint8_t* q) const {
      return make_smem_desc(q + cw * 64 * (kI8 ? Layout::kW8 : 128), kSwzQK, kSboQK);
    }
    // The next row of a persistent CTA, its Q in the buffer at sq_ (after
    // the epilogue of the row before: O starts again from 0).
    __device__ __forceinline__ void retarget(const RowWork& w, int tid, uint8_t* sq_) {
      Base::retarget(w, tid);
      sq = sq_;
      desc_q = q_desc_at(sq_);
#pragma unroll
      for (int j = 0; j < NO; ++j) o[j] = 0.f;
    }

    __device__ __forceinline__ uint64_t desc_k(int st) const {
      return make_smem_desc(sk + st * Layout::kKBytes, kSwzQK, kSboQK);
    }
    __device__ __forceinline__ uint64_t desc_v(int st) const {
      return make_smem_desc_mn(sv + st * Layout::kVBytes, Layout::kKVCol, 1024);
    }
    // S = Q K^T over Dk: 16-bit k-steps of 16 (32 bytes inside a 128-byte
    // column block); int8 k-steps of 32 (32 bytes inside a W-byte column
    // block). Caller fences before and commits after.
    __device__ __forceinline__ void issue_qk(uint64_t dk) { issue_qk(dk, desc_q); }
    __device__ __forceinline__ void issue_qk(uint64_t dk, uint64_t dq) {
      if constexpr (kI8) {
        constexpr int kPerCol = Layout::kW8 / 32;
#pragma unroll
        for (int kk = 0; kk < Dk / 32; ++kk) {
          const uint32_t qoff = (kk / kPerCol) * Layout::kQCol8 + (kk % kPerCol) * 32;
          const uint32_t koff = (kk / kPerCol) * Layout::kKCol8 + (kk % kPerCol) * 32;
          wgmma_s8_ss<kKeys>(s, dq + uint64_t(qoff >> 4), dk + uint64_t(koff >> 4), kk > 0);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < Dk / 16; ++kk) {
          const uint32_t qoff = (kk / 4) * Layout::kQCol + (kk % 4) * 32;
          const uint32_t koff = (kk / 4) * Layout::kKVCol + (kk % 4) * 32;
          Mma::template ss_m64nNk16<kKeys>(s, dq + uint64_t(qoff >> 4), dk + uint64_t(koff >> 4), kk > 0);
        }
      }
    }
    // O += P V: k-step ks reads keys 16ks..16ks+15, i.e. two 8-row groups of
    // every column block (2048 bytes further per k-step).
    __device__ __forceinline__ void issue_pv(uint64_t dv, const uint32_t (&pa)[KS][4]) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) Mma::template rs_tb_m64nNk16<Dk>(o, pa[ks], dv + uint64_t((ks * 2048) >> 4), 1);
    }
    __device__ __forceinline__ void fence_pv() { fence_regs(o); }
    // After P.V(u-1), before P.V(u) is issued: O *= alpha(u), skipped when no
    // row of the warp changed its max (alpha is then exactly 1): after the
    // first few steps of a row most steps leave the max unchanged.
    __device__ __forceinline__ void after_pv(float, float, float ac0, float ac1) {
      if (!__any_sync(0xffffffffu, ac0 != 1.f || ac1 != 1.f)) return;
#pragma unroll
      for (int j = 0; j < NO; ++j) o[j] *= (j & 2) ? ac1 : ac0;
    }
    __device__ __forceinline__ void after_last_pv(float, float) {}

    // O / l as 16-bit pairs; INT8_FP16's LSE adds back the smoothing shift.
    __device__ __forceinline__ void epilogue(const Maps& m, uint8_t* base, int tid) {
      float inv0, inv1;
      sm.finish(inv0, inv1);
      auto pair = [&](int c, int half) -> uint32_t {
        const float inv = half ? inv1 : inv0;
        return pack16<T>(o[c * 4 + 2 * half] * inv, o[c * 4 + 2 * half + 1] * inv);
      };
      uint8_t* stage = kI8 ? base + Layout::kOut + cw * (Dk / 64) * 8192 : sq + cw * 64 * 128;
      const int stride = kI8 ? 8192 : Layout::kQCol;
      write_output<Dk, D>(p, sm, b, h, cw, tid, p.tma_store != 0, stage, stride, &m.o, pair,
                          [&](int half) { return this->lse_shift(half); });
    }
  };
};

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
