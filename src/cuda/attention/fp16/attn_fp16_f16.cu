// Instantiations of the FP16-mode attention kernel for __half inputs
// (head dims 64 and 128, causal and not). One file per dtype keeps builds parallel.
#include "cuda/attention/fp16/attn_fp16.cuh"

namespace sparge {
namespace cuda {
namespace fp16attn {

template <>
sparge_status_t launch<__half, 64, false>(const Params& p, int64_t grid, cudaStream_t s) {
  return launch_impl<__half, 64, false>(p, grid, s);
}
template <>
sparge_status_t launch<__half, 64, true>(const Params& p, int64_t grid, cudaStream_t s) {
  return launch_impl<__half, 64, true>(p, grid, s);
}
template <>
sparge_status_t launch<__half, 128, false>(const Params& p, int64_t grid, cudaStream_t s) {
  return launch_impl<__half, 128, false>(p, grid, s);
}
template <>
sparge_status_t launch<__half, 128, true>(const Params& p, int64_t grid, cudaStream_t s) {
  return launch_impl<__half, 128, true>(p, grid, s);
}

}  // namespace fp16attn
}  // namespace cuda
}  // namespace sparge
