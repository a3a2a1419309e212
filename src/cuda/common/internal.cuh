// Contracts between the CUDA backend's parts: the preparation kernels
// (statistics, quantization, prediction, mask -> index lists) and the
// attention kernel families. Layouts are those of core/problem.hpp's
// WorkspaceLayout; semantics are docs/SEMANTICS.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/backend.hpp"
#include "core/error.hpp"

namespace sparge {
namespace cuda {

// Returns SPARGE_ERR_CUDA with the call site and CUDA's message when `e` fails.
sparge_status_t cuda_status(cudaError_t e, const char* what);
#define SPARGE_CUDA_TRY(call) SPARGE_TRY(::sparge::cuda::cuda_status((call), #call))
// Kernel launches go through launch_pdl and report with SPARGE_PDL_CHECK
// (cuda/common/launch.cuh).

// Everything an attention kernel reads, resolved to pointers.
struct AttnArgs {
  Problem prob;
  // INT8_FP8 operands (workspace)
  const int8_t* q_i8 = nullptr;    // [B*Hq, nQB*128, D]
  const float* q_scale = nullptr;  // [B*Hq, nQB*128]
  const float* q_mu = nullptr;     // [B*Hq, nQB*128]  scale * q.mu (0 without smoothing)
  const int8_t* k_i8 = nullptr;    // [B*Hkv, nKB*64, D]
  const float* k_scale = nullptr;  // [B*Hkv, nKB]
  const uint8_t* v_f8 = nullptr;   // [B*Hkv, D, nKB*64] e4m3, token-permuted in groups of 32
  const uint8_t* v_f8_lo = nullptr;  // like v_f8: e4m3(v*448/amax - hi), INT8_FP8_SPLIT_V only
  const float* v_amax = nullptr;   // [B*Hkv, D] per-channel max |v| (dequant: amax/448)
  // FP16 operands (the inputs themselves)
  Tensor4 q, k, v;
  // sparsity (workspace)
  const int32_t* idx = nullptr;    // [B*Hq, nQB, nKB] kept key blocks, ascending
  const int32_t* cnt = nullptr;    // [B*Hq, nQB]
  const int32_t* order = nullptr;  // [B*Hq*nQB] (bh*nQB + qb), K/V group by group, heaviest rows first within one
  // outputs
  Tensor4 out;
  LseView lse;                     // lse.data == nullptr: not wanted
  int sm_count = 0;                // the device's multiprocessors (grids of persistent CTAs)
};

// The scheduling stage's read-ahead contract with the attention kernels: the
// first kListReadAhead entries of every row's list hold a defined value (a
// listed block, or -1 past the count), so a kernel may read the blocks of its
// first step together with the count instead of after it.
constexpr int kListReadAhead = 3;

// Token permutation used by v_f8 within each group of 32 keys: column kk of the
// stored V^T holds key perm32(kk). It matches the register layout of the fp8
// wgmma A operand to that of the int8 wgmma accumulator, so P needs no shuffles.
__host__ __device__ __forceinline__ int perm32(int kk) {
  const int hi = kk & 16, r = kk & 15, quad = r >> 2, i = r & 3;
  return hi + ((i < 2) ? (2 * quad + i) : (8 + 2 * quad + (i - 2)));
}

// --- preparation, prediction, scheduling (src/cuda/prepare/, predict/, schedule/) -------------------------------------
// prepare_impl (cuda/prepare/prepare.cuh): K column mean, V column max|.|,
// Q/K int8 quantization with pooled means and self-similarities, q_mu, the
// fp8 V^T. Fills the corresponding workspace regions.
// The kept counters [B, Hq] a selection adds to: the caller's (kept, when given with data) or
// the workspace's.
struct KeptRef {
  int32_t* data;
  int64_t s0, s1;
};
inline KeptRef kept_ref(const Plan& plan, const KeptView* kept, void* ws) {
  if (kept && kept->data) return KeptRef{kept->data, kept->stride[0], kept->stride[1]};
  return KeptRef{ws_ptr<int32_t>(static_cast<char*>(ws), plan.ws.kept), plan.prob.Hq, 1};
}
// Pooled scores, softmax, selection, forced blocks -> uint8 mask (any strides) and kept counts.
// lists_too: the mask must be the workspace's; the selection then also writes
// the rows' index lists (idx, cnt), and only the work order remains to launch.
// kept_zeroed: the preparation's block-score kernel has reset the counters (prepare_impl).
sparge_status_t launch_select(const Plan& plan, const PredictConfig& cfg, const MaskView& mask,
                              const KeptView* kept, void* ws, cudaStream_t stream, bool lists_too = false,
                              bool kept_zeroed = false);
// The work order of index lists already in the workspace (cuda/schedule/work_lists.cu).
sparge_status_t launch_work_order(const Plan& plan, void* ws, cudaStream_t stream);
// Mask (any strides) -> idx/cnt/order in the workspace (causally invisible blocks dropped).
sparge_status_t launch_mask_to_lists(const Plan& plan, const MaskView& mask, void* ws, cudaStream_t stream);

// --- attention kernel families (src/cuda/attention/, through src/cuda/registry/)
// Layout checks on the caller's tensors shared by the families' setups
// (UNSUPPORTED naming the tensor and the mode):
// rows moved in 16-byte pieces (16-byte aligned pointer, B/H/L strides
// multiples of 8 elements);
sparge_status_t check_rows16(const Tensor4& t, const char* name, const char* mode);
// the same rule as the message of a tensor a TMA map could not express;
sparge_status_t check_tma_rows16(const Tensor4& t, const char* name, const char* mode);
// an output written in pairs of 16-bit elements (4-byte aligned pointer, even
// B/H/L strides).
sparge_status_t check_out_pairs(const Tensor4& out);

}  // namespace cuda
}  // namespace sparge
