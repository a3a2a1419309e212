// The 8-bit modes of the portable kernel family (sm_80 and newer, mma.sync):
//   S = Q K^T   int8 m16n8k32 with int32 accumulators, Q and K the
//               preparation's int8 codes (per-token / per-64-key-block scales);
//   P           the shared online softmax (../common/softmax.cuh), whose score
//               layout is that of consecutive m16n8 accumulators, in steps of
//               blocks_per_step listed 64-key blocks like the sm_90a kernels
//               and the CPU twin (core/kernel_traits.hpp);
//   O += P V    INT8_FP8 (and split V): e4m3 m16n8k32 (sm_89+) from the
//               preparation's permuted V^T (perm32 makes the score layout the
//               A-operand layout), into a fresh accumulator per step and 8
//               output columns, then O = O * alpha + O_step in fp32 (the
//               two-level accumulation: the fp8 tensor-core accumulator is not
//               full fp32); INT8_FP16: 16-bit m16n8k16 from the caller's V
//               (ldmatrix.trans), O rescaled by alpha first.
// One CTA of 8 warps computes one 128-row query block; warp w owns rows
// 16w..16w+15 and keeps its Q fragments in registers (loaded once from
// global memory). K/V tiles of a step (kHalves blocks) stream through a
// cp.async ring of kStages steps in at most 96 KiB of shared memory, so one
// CTA fits every sm_80+ SM (99 KiB on sm_86/89/120). See docs/KERNELS-PORTABLE.md.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "core/kernel_traits.hpp"
#include "cuda/attention/common/softmax.cuh"
#include "cuda/attention/common/work.cuh"
#include "cuda/attention/portable/primitives.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/registry/registry.hpp"

namespace sparge {
namespace cuda {
namespace portable {

// The shared parameter block plus what the portable family reads from
// pointers (the sm_90a family reads them through tensor maps).
struct Int8Params {
  attn::Params a;
  const int8_t* q_i8;     // [BHq, nQB*128, Dk]
  const int8_t* k_i8;     // [BHkv, nKB*64, Dk]
  const uint8_t* v_f8;    // [BHkv, Dk, nKB*64] e4m3, token-permuted (perm32)
  const uint8_t* v_f8_lo; // split V's second term, or null
  const void* v;          // INT8_FP16: the caller's 16-bit V
  int64_t v_sb, v_sh, v_sl;
  int D;                  // the problem's head dim (output columns, V columns read)
};

// P.V policies: e4m3 with kVTerms V terms, or the 16-bit type T.
template <int kVTerms>
struct PvFp8 {
  static constexpr bool kFp8 = true;
  static constexpr int kTerms = kVTerms;
  using Pack = attn::PackE4M3;
  using T = void;
  static constexpr sparge_precision_t kPrecision =
      kVTerms == 2 ? SPARGE_PRECISION_INT8_FP8_SPLIT_V : SPARGE_PRECISION_INT8_FP8;
};
template <class T_>
struct Pv16 {
  static constexpr bool kFp8 = false;
  static constexpr int kTerms = 1;
  using Pack = attn::Pack16<T_>;
  using T = T_;
  static constexpr sparge_precision_t kPrecision = SPARGE_PRECISION_INT8_FP16;
};

// Byte offset of 16-byte chunk `ch` of row `r` in a tile of `pitch`-byte
// rows: chunks are XOR-swizzled so that the 8 rows one ldmatrix matrix reads
// (8 consecutive rows, one logical chunk) hit 8 different 16-byte bank groups.
template <int kPitch>
__host__ __device__ constexpr int swz_key(int r) {
  static_assert(kPitch == 64 || kPitch % 128 == 0, "row pitch");
  return kPitch == 64 ? ((r >> 1) & 3) : (r & 7);  // 64-byte rows: two per 128-byte line
}
template <int kPitch>
__device__ __forceinline__ int swz_off(int r, int ch) {
  return r * kPitch + ((ch ^ swz_key<kPitch>(r)) << 4);
}

template <class PV, int Dk>
struct Int8Traits {
  static_assert(Dk == 64 || Dk == 128 || (Dk == 256 && !PV::kFp8), "kernel head dim");
  static constexpr int kHalves = blocks_per_step(PV::kPrecision, Dk);
  static constexpr int kThreads = 256;
  static constexpr int kKTile = 64 * Dk;                          // int8 K rows
  static constexpr int kVPitch = PV::kFp8 ? 64 : 2 * Dk;          // V^T rows of 64 keys, or V rows
  static constexpr int kVTile = PV::kFp8 ? Dk * 64 : 64 * 2 * Dk;
  static constexpr int kStageK = kHalves * kKTile;
  static constexpr int kStageBytes = kStageK + PV::kTerms * kHalves * kVTile;
  static constexpr int kBudget = 96 * 1024;
  static constexpr int kStages = (kBudget / kStageBytes) < 4 ? (kBudget / kStageBytes) : 4;
  static_assert(kStages >= 2, "two pipeline stages fit the shared-memory budget");
  static constexpr int kSmem = kStages * kStageBytes;
};

template <class PV, int Dk, bool kCausal>
struct Int8Cta {
  using Tr = Int8Traits<PV, Dk>;
  static constexpr int kHalves = Tr::kHalves, kStages = Tr::kStages;
  using SM = attn::OnlineSoftmax<kHalves, kCausal, true, typename PV::Pack, true, 0>;
  using Consumer = attn::ConsumerBase<SM, true>;
  static constexpr int KS = SM::KS;

  // Step u's blocks into ring slot `slot`: K tiles (contiguous 64 x Dk int8
  // rows), V^T tiles (Dk rows of 64 e4m3 keys at pitch nKB*64) or 16-bit V
  // tiles (64 key rows of the caller's V, zeros past Lkv and past D). A
  // missing block (past an odd count) is zero-filled, so P = 0 meets finite
  // values.
  static __device__ __forceinline__ void load_step(const Int8Params& P, const attn::RowWork& w, uint8_t* smem,
                                                   int u, int slot, int tid) {
    const attn::Params& p = P.a;
    uint8_t* sk = smem + slot * Tr::kStageBytes;
    uint8_t* sv = sk + Tr::kStageK;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      const int kb = w.block<kHalves>(u, hh);
      const bool have = kb >= 0;
      const int kbc = have ? kb : 0;
      const int8_t* gk = P.k_i8 + (int64_t(w.bhkv) * p.nKB + kbc) * 64 * Dk;
      constexpr int kKChunks = 64 * Dk / 16;
#pragma unroll
      for (int i = tid; i < kKChunks; i += Tr::kThreads) {
        const int r = i / (Dk / 16), ch = i % (Dk / 16);
        cp_async16(smem_u32(sk + hh * Tr::kKTile + swz_off<Dk>(r, ch)), gk + i * 16, have);
      }
      if constexpr (PV::kFp8) {
        const int64_t ldv = int64_t(p.nKB) * 64;
#pragma unroll
        for (int tt = 0; tt < PV::kTerms; ++tt) {
          const uint8_t* gv = (tt ? P.v_f8_lo : P.v_f8) + int64_t(w.bhkv) * Dk * ldv + int64_t(kbc) * 64;
          uint8_t* dst = sv + (tt * kHalves + hh) * Tr::kVTile;
#pragma unroll
          for (int i = tid; i < Dk * 4; i += Tr::kThreads) {
            const int r = i / 4, ch = i % 4;
            cp_async16(smem_u32(dst + swz_off<64>(r, ch)), gv + r * ldv + ch * 16, have);
          }
        }
      } else {
        using T = typename PV::T;
        const T* gv = static_cast<const T*>(P.v) + int64_t(w.b) * P.v_sb + int64_t(w.hkv) * P.v_sh;
        uint8_t* dst = sv + hh * Tr::kVTile;
        constexpr int kCh = Dk / 8;  // 16-byte chunks per row
#pragma unroll
        for (int i = tid; i < 64 * kCh; i += Tr::kThreads) {
          const int r = i / kCh, ch = i % kCh;
          const int key = kbc * 64 + r;
          const bool ok = have && key < p.Lkv && ch * 8 < P.D;
          const T* src = ok ? gv + int64_t(key) * P.v_sl + ch * 8 : gv;
          cp_async16(smem_u32(dst + swz_off<2 * Dk>(r, ch)), src, ok);
        }
      }
    }
  }

  static __device__ __forceinline__ void run(const Int8Params& P, uint8_t* smem) {
    const attn::Params& p = P.a;
    const int tid = threadIdx.x, lane = tid & 31, t4 = lane & 3;
    const attn::RowWork w(p);
    const int n_steps = w.steps<kHalves>();
    if (n_steps == 0) {  // nothing to compute: zeros and LSE -inf, written directly
      attn::write_empty_row(p, w, P.D, tid, 256);
      return;
    }
    Consumer c(p, 0, tid, w);  // warp w: rows 16w.. of the block (cw = 0, tid < 256)

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_steps) load_step(P, w, smem, s, s, tid);
      cp_async_commit();
    }

    // Q fragments (rows row0, row1 = row0 + 8 of this thread), k-chunks of 32.
    uint32_t qa[Dk / 32][4];
    {
      const int8_t* q0 = P.q_i8 + c.qrow * Dk + 4 * t4;
#pragma unroll
      for (int kc = 0; kc < Dk / 32; ++kc) {
        qa[kc][0] = __ldg(reinterpret_cast<const unsigned*>(q0 + kc * 32));
        qa[kc][1] = __ldg(reinterpret_cast<const unsigned*>(q0 + 8 * Dk + kc * 32));
        qa[kc][2] = __ldg(reinterpret_cast<const unsigned*>(q0 + kc * 32 + 16));
        qa[kc][3] = __ldg(reinterpret_cast<const unsigned*>(q0 + 8 * Dk + kc * 32 + 16));
      }
    }

    // ldmatrix lane addressing: lanes 8i..8i+7 give the rows of matrix i.
    //   K (B of Q K^T, rows = keys): matrix i = keys +8*(i>>1), chunk +(i&1)
    //     -> r0, r1 = b0, b1 of n-tile 2np; r2, r3 of n-tile 2np + 1.
    //   V^T (B of P V, rows = channels): the same with channels for keys.
    //   V 16-bit (.trans, rows = keys): matrix i = keys +8*(i&1), chunk
    //     +(i>>1) -> r0, r1 = b0, b1 of d-tile 2dp; r2, r3 of 2dp + 1.
    const int mi = lane >> 3, r7 = lane & 7;
    const int rk = (mi >> 1) * 8 + r7;  // K / V^T row of this lane within 16
    const int xk = mi & 1;              // chunk parity of this lane's matrix
    const int rv = (mi & 1) * 8 + r7;   // 16-bit V row within 16
    const int xv = mi >> 1;

    float o[Dk / 8][4];
#pragma unroll
    for (int j = 0; j < Dk / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    for (int u = 0; u < n_steps; ++u) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // step u landed for every thread; slot (u - 1) % kStages is free
      if (u + kStages - 1 < n_steps) load_step(P, w, smem, u + kStages - 1, (u + kStages - 1) % kStages, tid);
      cp_async_commit();

      int kb[kHalves];
      float ksc[kHalves];
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) kb[hh] = w.block<kHalves>(u, hh);
      c.template load_kscale<kHalves>(kb, ksc);
      const uint8_t* sk = smem + (u % kStages) * Tr::kStageBytes;
      const uint8_t* sv = sk + Tr::kStageK;

      // ---- S = Q K^T
      int32_t s[SM::NS];
#pragma unroll
      for (int j = 0; j < SM::NS; ++j) s[j] = 0;
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh)
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          const uint32_t row = smem_u32(sk + hh * Tr::kKTile) + (16 * np + rk) * Dk;
#pragma unroll
          for (int kc = 0; kc < Dk / 32; ++kc) {
            uint32_t b[4];
            ldsm_x4(row + (((2 * kc + xk) ^ swz_key<Dk>(rk)) << 4), b);
            mma_s8(&s[hh * 32 + 8 * np], qa[kc], b[0], b[1]);
            mma_s8(&s[hh * 32 + 8 * np + 4], qa[kc], b[2], b[3]);
          }
        }

      // ---- softmax: masks, row max, P fragments
      float al0, al1;
      const typename SM::StepScale st = c.sm.row_max(s, kb, ksc, al0, al1);
      uint32_t pa[KS][4];
      c.sm.exponentiate(s, st, al0, al1, pa, [] {});

      // ---- O = O * alpha + P V
      if constexpr (PV::kFp8) {
        // k-step ks: keys 32ks..32ks+31 of the step = tile ks/2, chunks
        // 2(ks%2), +1 of its V^T rows.
#pragma unroll
        for (int dp = 0; dp < Dk / 16; ++dp) {
          float t0[4] = {0.f, 0.f, 0.f, 0.f}, t1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int tt = 0; tt < PV::kTerms; ++tt)
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
              const uint32_t row =
                  smem_u32(sv + (tt * kHalves + ks / 2) * Tr::kVTile) + (16 * dp + rk) * 64;
              uint32_t b[4];
              ldsm_x4(row + (((2 * (ks % 2) + xk) ^ swz_key<64>(rk)) << 4), b);
              mma_e4m3(t0, pa[ks], b[0], b[1]);
              mma_e4m3(t1, pa[ks], b[2], b[3]);
            }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o[2 * dp][e] = fmaf(o[2 * dp][e], (e & 2) ? al1 : al0, t0[e]);
            o[2 * dp + 1][e] = fmaf(o[2 * dp + 1][e], (e & 2) ? al1 : al0, t1[e]);
          }
        }
      } else {
        // Rescale only where some row of the warp changed its max (alpha is
        // then exactly 1 everywhere else).
        if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {
#pragma unroll
          for (int j = 0; j < Dk / 8; ++j) {
            o[j][0] *= al0;
            o[j][1] *= al0;
            o[j][2] *= al1;
            o[j][3] *= al1;
          }
        }
        // k-step ks: keys 16ks..16ks+15 of the step = tile ks/4, rows
        // 16(ks%4).. of its V tile.
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const uint32_t row = smem_u32(sv + (ks / 4) * Tr::kVTile) + (16 * (ks % 4) + rv) * (2 * Dk);
#pragma unroll
          for (int dp = 0; dp < Dk / 16; ++dp) {
            uint32_t b[4];
            ldsm_x4_t(row + (((2 * dp + xv) ^ swz_key<2 * Dk>(rv)) << 4), b);
            Mma<typename PV::T>::run(o[2 * dp], pa[ks], b[0], b[1]);
            Mma<typename PV::T>::run(o[2 * dp + 1], pa[ks], b[2], b[3]);
          }
        }
      }
    }
    cp_async_wait<0>();

    // ---- epilogue: O / l (INT8_FP8: then times the channel's V scale
    // amax / 448; l carries P's 448), 16-bit pairs straight to the output;
    // the LSE adds back the smoothing shift.
    float inv0, inv1;
    c.sm.finish(inv0, inv1);
    const float* vamax = PV::kFp8 ? p.v_amax + int64_t(w.bhkv) * Dk : nullptr;
    const bool bf16 = PV::kFp8 ? p.out_bf16 != 0 : std::is_same<typename PV::T, __nv_bfloat16>::value;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = half ? c.sm.row1 : c.sm.row0;
      if (row >= p.Lq) continue;
      const float inv = half ? inv1 : inv0;
      char* orow = static_cast<char*>(p.out) + 2 * (int64_t(w.b) * p.out_stride[0] +
                                                   int64_t(w.h) * p.out_stride[1] + int64_t(row) * p.out_stride[2]);
#pragma unroll
      for (int j = 0; j < Dk / 8; ++j) {
        const int col = 8 * j + 2 * t4;
        if (col >= P.D) break;
        float x0 = o[j][2 * half] * inv, x1 = o[j][2 * half + 1] * inv;
        if constexpr (PV::kFp8) {
          constexpr float kDequantPV = 1.f / kFp8Max;
          x0 *= __ldg(vamax + col) * kDequantPV;
          x1 *= __ldg(vamax + col + 1) * kDequantPV;
        }
        *reinterpret_cast<uint32_t*>(orow + 2 * col) =
            bf16 ? attn::pack16<__nv_bfloat16>(x0, x1) : attn::pack16<__half>(x0, x1);
      }
      if (p.lse != nullptr && t4 == 0)
        p.lse[int64_t(w.b) * p.lse_stride[0] + int64_t(w.h) * p.lse_stride[1] + int64_t(row) * p.lse_stride[2]] =
            c.sm.lse(half, c.lse_shift(half));
    }
  }
};

template <class PV, int Dk, bool kCausal>
__global__ void __launch_bounds__(256, 1) attn_int8_kernel(const Int8Params P) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  extern __shared__ __align__(128) uint8_t smem[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  // fp8 P.V needs sm_89: the registry refuses these kernels below it (the
  // image's architecture is checked at plan creation), so this never runs.
  if constexpr (PV::kFp8) {
    __trap();
  } else {
    Int8Cta<PV, Dk, kCausal>::run(P, smem);
  }
#else
  Int8Cta<PV, Dk, kCausal>::run(P, smem);
#endif
}

// Host side.
template <class PV, int Dk, bool kCausal>
sparge_status_t launch_int8(const Int8Params& p, int64_t grid, cudaStream_t stream) {
  auto* kern = attn_int8_kernel<PV, Dk, kCausal>;
  constexpr int smem = Int8Traits<PV, Dk>::kSmem;
  SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(kern), smem));
  SPARGE_PDL_CHECK(launch_pdl(kern, dim3(static_cast<unsigned>(grid)), dim3(256), smem, stream, p),
                   "attn_int8_kernel");
  return SPARGE_OK;
}

// The architecture of the image the kernel runs as on the current device
// (registry.hpp, image_arch_of).
template <class PV, int Dk, bool kCausal>
int int8_image_arch() {
  return image_arch_of(reinterpret_cast<const void*>(attn_int8_kernel<PV, Dk, kCausal>));
}

// Instances, one file per P.V kind and kernel head dim (attn_int8_*.cu, see
// tools/gen/gen_instances.py).
#define SPARGE_PORTABLE_INT8_INSTANCE(EXTERN, PV, DK)                                                   \
  EXTERN template sparge_status_t launch_int8<PV, DK, false>(const Int8Params&, int64_t, cudaStream_t); \
  EXTERN template sparge_status_t launch_int8<PV, DK, true>(const Int8Params&, int64_t, cudaStream_t);  \
  EXTERN template int int8_image_arch<PV, DK, false>();                                                 \
  EXTERN template int int8_image_arch<PV, DK, true>();

}  // namespace portable
}  // namespace cuda
}  // namespace sparge
