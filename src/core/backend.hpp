// The interface between the API layer (validation, handles) and the backends.
// Everything handed to a backend has been validated: shapes match the plan,
// pointers are non-NULL where required, dtypes are the plan's.
#pragma once
#include <cstdint>

#include "core/merge.hpp"
#include "core/problem.hpp"

namespace sparge {

// Everything of one sparge_attention_run call that the CUDA backend's setup
// (launch parameters, tensor maps, kernel choice) and the pointer checks of
// the validation depend on, copied from the caller's descriptors before they
// are validated: the tensors' data pointers, device, dtype, rank, shapes and
// strides (entries past ndim zeroed), the workspace and the per-head arrays.
// Plain bytes with no padding, compared with memcmp.
struct AttnCallKey {
  struct Tensor {
    const void* data;
    int32_t device_type, device_id, dtype, ndim;
    int64_t shape[4], strides[4];
  };
  Tensor q, k, v, out, mask, lse;  // mask, lse: all zero when absent
  const void* workspace;
  const void* per_head[3];  // topk, cdf_threshold, sim_threshold per head (params), NULL when absent
  int64_t dense;            // 1: no mask and params that keep every block (keeps_every_block)
  uint64_t hash;            // of the fields above (a cheap first comparison)
};

namespace cuda {
// The per-plan cache of call setups (cuda/backend.cu): created with a CUDA
// plan (its fixed number of entries allocated then, so that the calls
// allocate nothing), freed with the plan.
struct CallCache;
CallCache* create_call_cache();
void destroy_call_cache(CallCache* c);
}  // namespace cuda

}  // namespace sparge

struct sparge_plan {
  sparge::Problem prob;
  sparge::WorkspaceLayout ws;
  int sm_version = 0;            // CUDA plans: major*10+minor of the device
  int sm_count = 0;              // CUDA plans: the device's multiprocessor count
  const void* kernel = nullptr;  // CUDA plans: the attention kernel's registry entry (cuda/registry)
  // CUDA plans: the setup of recent calls (keyed by AttnCallKey, under the
  // cache's own lock; NULL for CPU plans). Not part of what the plan means: a
  // hit returns exactly what the setup computes for those arguments.
  sparge::cuda::CallCache* call_cache = nullptr;

  sparge_plan() = default;
  sparge_plan(const sparge_plan&) = delete;
  sparge_plan& operator=(const sparge_plan&) = delete;
  ~sparge_plan() {
    if (call_cache) sparge::cuda::destroy_call_cache(call_cache);
  }
};

namespace sparge {

using Plan = sparge_plan;

namespace cpu {
// mask_out is written in full; kept (optional) gets per-(b,h) kept counts.
sparge_status_t predict(const Plan& plan, const Tensor4& q, const Tensor4& k, const PredictConfig& cfg,
                        const MaskView& mask_out, const KeptView* kept, void* workspace);
// mask == nullptr: predict into the workspace first with cfg. lse optional.
sparge_status_t attention(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                          const MaskView* mask, const PredictConfig& cfg, const Tensor4& out,
                          const LseView* lse, void* workspace);
// sparge_merge_states on host memory (float64 arithmetic).
sparge_status_t merge_states(const MergeArgs& a);
}  // namespace cpu

namespace cuda {
// True when the library was built with the CUDA backend.
bool built();
// Checks that device `id` exists and is usable for `p`; fills sm_version and sm_count.
// Called once by sparge_create_plan (host-side driver queries are allowed there).
// The device, the preparation's limits and the attention kernel of `p`
// (from the kernel registry); every reason to refuse the plan. Resolves
// SPARGE_PRECISION_AUTO for the device's kernel family (`p.precision`).
sparge_status_t check_device(Problem& p, int* sm_version, int* sm_count, const void** kernel);
// The chosen kernel's facts for sparge_plan_kernel_info.
sparge_status_t kernel_info(const Plan& plan, sparge_kernel_info_t* info);
// True when `ptr` is device (or managed) memory of device `id`.
sparge_status_t pointer_on_device(const void* ptr, int device_id, const char* name);
// Whether this plan already set up a call with exactly `key`'s arguments (whose
// pointers the validation then checked with the driver): the validation of a
// call with that key may skip the pointer queries. Never true when
// SPARGE_CHECK_POINTERS=1 (read once).
bool call_known(const Plan& plan, const AttnCallKey& key);
// Records `key` as a call whose pointers were checked (sparge_predict_mask,
// which keeps no setup: its key has neither v nor out, so it never matches an
// attention call's).
void remember_call(const Plan& plan, const AttnCallKey& key);
sparge_status_t predict(const Plan& plan, const Tensor4& q, const Tensor4& k, const PredictConfig& cfg,
                        const MaskView& mask_out, const KeptView* kept, void* workspace, void* stream);
// `key` (optional): the call's arguments; the setup is then looked up in and
// stored into the plan's cache.
sparge_status_t attention(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                          const MaskView* mask, const PredictConfig& cfg, const Tensor4& out,
                          const LseView* lse, void* workspace, void* stream, const AttnCallKey* key = nullptr);
// sparge_merge_states on device `device_id` (src/cuda/merge/), queued on `stream`.
sparge_status_t merge_states(const MergeArgs& a, int device_id, void* stream);
}  // namespace cuda

}  // namespace sparge
