// The portable family's registry table: the FP16-mode mma.sync kernel
// (attn_fp16.cuh; instances in attn_fp16_<dtype>.cu) for head dims 64, 96 (on the
// 128-wide kernel) and 128.
// It is the kernel of FP16 plans on devices without an sm_90a family, under
// SPARGE_FP16_KERNEL=portable, and the fallback of the sm_90a FP16 kernel when
// TMA cannot express a call's strides.
#include <new>
#include <type_traits>

#include "cuda/attention/portable/attn_fp16.cuh"
#include "cuda/registry/registry.hpp"

namespace sparge {
namespace cuda {

namespace {

struct PortableLaunch {
  fp16attn::Params p;
  int64_t grid;
};
static_assert(sizeof(PortableLaunch) <= sizeof(LaunchBlob), "the launch blob holds the portable launch");
static_assert(std::is_trivially_copyable<PortableLaunch>::value, "the launch blob is plain data");

sparge_status_t portable_supports(const Problem& pr) {
  if (pr.B * pr.Hq * pr.nQB > 0x7fffffffLL || pr.Lq > 0x3fffffffLL || pr.Lkv > 0x3fffffffLL)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "problem (batch, heads, len_q, len_kv): too large for one launch of the portable fp16 kernel");
  return SPARGE_OK;
}

sparge_status_t portable_setup(const AttnArgs& a, LaunchBlob* blob, bool* applies) {
  *applies = true;
  SPARGE_TRY(check_rows16(a.q, "q", "fp16"));
  SPARGE_TRY(check_rows16(a.k, "k", "fp16"));
  SPARGE_TRY(check_rows16(a.v, "v", "fp16"));
  SPARGE_TRY(check_rows16(a.out, "out", "fp16"));
  PortableLaunch* s = reinterpret_cast<PortableLaunch*>(blob->bytes);  // plain data in an aligned blob
  *s = PortableLaunch{};
  const Problem& pr = a.prob;
  fp16attn::Params& p = s->p;
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.o = a.out.data;
  p.q_sb = a.q.stride[0], p.q_sh = a.q.stride[1], p.q_sl = a.q.stride[2];
  p.k_sb = a.k.stride[0], p.k_sh = a.k.stride[1], p.k_sl = a.k.stride[2];
  p.v_sb = a.v.stride[0], p.v_sh = a.v.stride[1], p.v_sl = a.v.stride[2];
  p.o_sb = a.out.stride[0], p.o_sh = a.out.stride[1], p.o_sl = a.out.stride[2];
  p.lse = a.lse.data;
  p.lse_sb = a.lse.stride[0], p.lse_sh = a.lse.stride[1], p.lse_sl = a.lse.stride[2];
  p.idx = a.idx;
  p.cnt = a.cnt;
  p.order = a.order;
  p.causal = pr.causal ? 1 : 0;
  p.Hq = static_cast<int>(pr.Hq);
  p.group = static_cast<int>(pr.Hq / pr.Hkv);
  p.Lq = static_cast<int>(pr.Lq);
  p.Lkv = static_cast<int>(pr.Lkv);
  p.nQB = static_cast<int>(pr.nQB);
  p.q_rows = kGpuBlockQ;
  p.nKB = static_cast<int>(pr.nKB);
  p.D = static_cast<int>(pr.D);
  p.scale_log2 = pr.scale * kLog2e;
  s->grid = pr.B * pr.Hq * pr.nQB;
  return SPARGE_OK;
}

template <class T, int D, bool kCausal>
sparge_status_t portable_run(const LaunchBlob& blob, cudaStream_t stream) {
  const PortableLaunch& s = *reinterpret_cast<const PortableLaunch*>(blob.bytes);
  if (s.grid == 0) return SPARGE_OK;
  return fp16attn::launch<T, D, kCausal>(s.p, s.grid, stream);
}

// Kernel head dim D for problems of head dim `head_dim` (96 runs the 128-wide
// kernel on zero-filled columns).
template <class T, int D, bool kCausal>
constexpr KernelEntry portable_entry(int head_dim, sparge_dtype_t dtype, const char* name) {
  return KernelEntry{{Family::kPortable, SPARGE_PRECISION_FP16, head_dim, dtype, kCausal},
                     name,
                     D,
                     fp16attn::kBQ,
                     fp16attn::kBK,
                     fp16attn::stages<D>(),
                     fp16attn::kThreads,
                     fp16attn::smem_bytes<D>(),
                     &portable_supports,
                     &portable_setup,
                     &portable_run<T, D, kCausal>,
                     80,
                     &fp16attn::image_arch<T, D, kCausal>};
}

}  // namespace

extern const KernelEntry kPortableKernels[] = {
    portable_entry<__half, 64, false>(64, SPARGE_DTYPE_FLOAT16, "portable_fp16_d64_f16"),
    portable_entry<__nv_bfloat16, 64, false>(64, SPARGE_DTYPE_BFLOAT16, "portable_fp16_d64_bf16"),
    portable_entry<__half, 64, true>(64, SPARGE_DTYPE_FLOAT16, "portable_fp16_d64_f16_causal"),
    portable_entry<__nv_bfloat16, 64, true>(64, SPARGE_DTYPE_BFLOAT16, "portable_fp16_d64_bf16_causal"),
    portable_entry<__half, 128, false>(128, SPARGE_DTYPE_FLOAT16, "portable_fp16_d128_f16"),
    portable_entry<__nv_bfloat16, 128, false>(128, SPARGE_DTYPE_BFLOAT16, "portable_fp16_d128_bf16"),
    portable_entry<__half, 128, true>(128, SPARGE_DTYPE_FLOAT16, "portable_fp16_d128_f16_causal"),
    portable_entry<__nv_bfloat16, 128, true>(128, SPARGE_DTYPE_BFLOAT16, "portable_fp16_d128_bf16_causal"),
    portable_entry<__half, 128, false>(96, SPARGE_DTYPE_FLOAT16, "portable_fp16_d96_f16"),
    portable_entry<__nv_bfloat16, 128, false>(96, SPARGE_DTYPE_BFLOAT16, "portable_fp16_d96_bf16"),
    portable_entry<__half, 128, true>(96, SPARGE_DTYPE_FLOAT16, "portable_fp16_d96_f16_causal"),
    portable_entry<__nv_bfloat16, 128, true>(96, SPARGE_DTYPE_BFLOAT16, "portable_fp16_d96_bf16_causal"),
};
extern const int kPortableKernelCount = int(sizeof(kPortableKernels) / sizeof(kPortableKernels[0]));

}  // namespace cuda
}  // namespace sparge
