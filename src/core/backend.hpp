// The interface between the API layer (validation, handles) and the backends.
// Everything handed to a backend has been validated: shapes match the plan,
// pointers are non-NULL where required, dtypes are the plan's.
#pragma once
#include "core/merge.hpp"
#include "core/problem.hpp"

struct sparge_plan {
  sparge::Problem prob;
  sparge::WorkspaceLayout ws;
  int sm_version = 0;            // CUDA plans: major*10+minor of the device
  const void* kernel = nullptr;  // CUDA plans: the attention kernel's registry entry (cuda/registry)
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
// Checks that device `id` exists and is usable for `p`; fills sm_version.
// Called once by sparge_create_plan (host-side driver queries are allowed there).
// The device, the preparation's limits and the attention kernel of `p`
// (from the kernel registry); every reason to refuse the plan.
sparge_status_t check_device(const Problem& p, int* sm_version, const void** kernel);
// The chosen kernel's facts for sparge_plan_kernel_info.
sparge_status_t kernel_info(const Plan& plan, sparge_kernel_info_t* info);
// True when `ptr` is device (or managed) memory of device `id`.
sparge_status_t pointer_on_device(const void* ptr, int device_id, const char* name);
sparge_status_t predict(const Plan& plan, const Tensor4& q, const Tensor4& k, const PredictConfig& cfg,
                        const MaskView& mask_out, const KeptView* kept, void* workspace, void* stream);
sparge_status_t attention(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                          const MaskView* mask, const PredictConfig& cfg, const Tensor4& out,
                          const LseView* lse, void* workspace, void* stream);
// sparge_merge_states on device `device_id` (src/cuda/merge/), queued on `stream`.
sparge_status_t merge_states(const MergeArgs& a, int device_id, void* stream);
}  // namespace cuda

}  // namespace sparge
