// The cuda:: backend entry points of a build without the CUDA backend.
// (This directory is globbed into every build; the guard keeps this file empty
// when the real backend in src/cuda/ is compiled.)
#if !defined(SPARGE_WITH_CUDA)

#include "core/backend.hpp"
#include "core/error.hpp"

namespace sparge {
namespace cuda {
namespace {
sparge_status_t absent() {
  return fail(SPARGE_ERR_NO_DEVICE, "libsparge was built without CUDA: no CUDA backend in this build");
}
}  // namespace

bool built() { return false; }
sparge_status_t check_device(Problem&, int* sm_version, int* sm_count, const void** kernel) {
  if (sm_version) *sm_version = 0;
  if (sm_count) *sm_count = 0;
  if (kernel) *kernel = nullptr;
  return absent();
}
sparge_status_t kernel_info(const Plan&, sparge_kernel_info_t*) { return absent(); }
sparge_status_t pointer_on_device(const void*, int, const char*) { return absent(); }
sparge_status_t predict(const Plan&, const Tensor4&, const Tensor4&, const PredictConfig&, const MaskView&,
                        const KeptView*, void*, void*) {
  return absent();
}
sparge_status_t attention(const Plan&, const Tensor4&, const Tensor4&, const Tensor4&, const MaskView*,
                          const PredictConfig&, const Tensor4&, const LseView*, void*, void*, const AttnCallKey*) {
  return absent();
}
bool call_known(const Plan&, const AttnCallKey&) { return false; }
void remember_call(const Plan&, const AttnCallKey&) {}
CallCache* create_call_cache() { return nullptr; }
void destroy_call_cache(CallCache*) {}  // never created without the backend
sparge_status_t merge_states(const MergeArgs&, int, void*) { return absent(); }

}  // namespace cuda
}  // namespace sparge

#endif  // !SPARGE_WITH_CUDA
