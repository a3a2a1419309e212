// Dispatch for the FP16-mode attention kernels: checks what they need (head
// dim, 16-byte aligned rows), then runs the sm_90a wgmma kernel where it
// applies, else fills the portable kernel's parameters and picks its instance.
#include "cuda/attention/portable/attn_fp16.cuh"

namespace sparge {
namespace cuda {

namespace {

// The kernel moves rows in 16-byte pieces: base pointer 16-byte aligned and
// every non-unit stride a multiple of 8 elements.
sparge_status_t check_rows16(const Tensor4& t, const char* name) {
  const bool ok = (reinterpret_cast<uintptr_t>(t.data) % 16 == 0) && t.stride[0] % 8 == 0 &&
                  t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0 && t.stride[3] == 1;
  if (!ok)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "%s: the fp16 attention kernel needs a 16-byte aligned data pointer and B/H/L strides that are "
                "multiples of 8 elements (got strides %lld, %lld, %lld, %lld)",
                name, static_cast<long long>(t.stride[0]), static_cast<long long>(t.stride[1]),
                static_cast<long long>(t.stride[2]), static_cast<long long>(t.stride[3]));
  return SPARGE_OK;
}

template <class T>
sparge_status_t dispatch_dim(const fp16attn::Params& p, int64_t grid, int64_t D, bool causal, cudaStream_t s) {
  if (D == 64) return causal ? fp16attn::launch<T, 64, true>(p, grid, s) : fp16attn::launch<T, 64, false>(p, grid, s);
  if (D == 128)
    return causal ? fp16attn::launch<T, 128, true>(p, grid, s) : fp16attn::launch<T, 128, false>(p, grid, s);
  return fail(SPARGE_ERR_UNSUPPORTED, "fp16 attention: head dim %lld is not supported (64 or 128)",
              static_cast<long long>(D));
}

}  // namespace

sparge_status_t launch_attention_fp16(const AttnArgs& a, cudaStream_t stream) {
  const Problem& pr = a.prob;
  if (pr.D != 64 && pr.D != 128)
    return fail(SPARGE_ERR_UNSUPPORTED, "fp16 attention: head dim %lld is not supported (64 or 128)",
                static_cast<long long>(pr.D));
  if (pr.BQ != fp16attn::kBQ || pr.BK != fp16attn::kBK)
    return fail(SPARGE_ERR_UNSUPPORTED, "fp16 attention: mask blocks %dx%d are not supported (128x64)", pr.BQ,
                pr.BK);
  if (pr.dtype != SPARGE_DTYPE_FLOAT16 && pr.dtype != SPARGE_DTYPE_BFLOAT16)
    return fail(SPARGE_ERR_UNSUPPORTED, "fp16 attention: dtype must be float16 or bfloat16");
  SPARGE_TRY(check_rows16(a.q, "q"));
  SPARGE_TRY(check_rows16(a.k, "k"));
  SPARGE_TRY(check_rows16(a.v, "v"));
  SPARGE_TRY(check_rows16(a.out, "out"));
  const int64_t grid = pr.B * pr.Hq * pr.nQB;
  if (grid == 0) return SPARGE_OK;
  bool launched = false;
  SPARGE_TRY(launch_attention_sm90_fp16(a, stream, &launched));
  if (launched) return SPARGE_OK;
  if (grid > 0x7fffffffLL || pr.Lq > 0x3fffffffLL || pr.Lkv > 0x3fffffffLL)
    return fail(SPARGE_ERR_UNSUPPORTED, "fp16 attention: problem too large for one launch");

  fp16attn::Params p{};
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
  p.Hq = static_cast<int>(pr.Hq);
  p.group = static_cast<int>(pr.Hq / pr.Hkv);
  p.Lq = static_cast<int>(pr.Lq);
  p.Lkv = static_cast<int>(pr.Lkv);
  p.nQB = static_cast<int>(pr.nQB);
  p.nKB = static_cast<int>(pr.nKB);
  p.scale_log2 = pr.scale * kLog2e;

  if (pr.dtype == SPARGE_DTYPE_FLOAT16) return dispatch_dim<__half>(p, grid, pr.D, pr.causal, stream);
  return dispatch_dim<__nv_bfloat16>(p, grid, pr.D, pr.causal, stream);
}

}  // namespace cuda
}  // namespace sparge
