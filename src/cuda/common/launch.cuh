// Kernel launches with programmatic dependent launch (PDL, sm_90): every
// kernel of the CUDA backend is launched with the programmatic-stream-
// serialization attribute and starts with pdl_grid_sync(), which lets the next
// grid on the stream be scheduled (`griddepcontrol.launch_dependents`) and
// then waits until the previous grid has completed and its memory is visible
// (`griddepcontrol.wait`). A call's chain of short kernels (preparation, lists,
// attention) then overlaps each kernel's launch and ramp-up with the tail of
// the one before instead of draining the GPU between them. Nothing of a
// kernel's global-memory work precedes the wait, so ordering is that of plain
// stream order, also against the caller's own kernels before and after.
// SPARGE_PDL=0 (read once) launches without the attribute (A/B runs); the
// wait is then a no-op.
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace sparge {
namespace cuda {

// First statement of every kernel launched through launch_pdl.
__device__ __forceinline__ void pdl_grid_sync() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether launches carry the PDL attribute (SPARGE_PDL, read once; default on).
bool pdl_enabled();

template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace cuda
}  // namespace sparge

// The result of a launch_pdl call (`err`) as a status naming the kernel. The
// launch is evaluated first; only when it failed is the runtime's last error
// cleared (the error this launch left), so an error that the caller left
// pending before the call stays pending for the caller's own
// cudaGetLastError/cudaPeekAtLastError. Never synchronizes.
#define SPARGE_PDL_CHECK(err, name)                                       \
  do {                                                                    \
    const cudaError_t sparge_pdl_err_ = (err);                            \
    if (sparge_pdl_err_ != cudaSuccess) {                                 \
      (void)cudaGetLastError();                                           \
      return ::sparge::cuda::cuda_status(sparge_pdl_err_, (name));        \
    }                                                                     \
  } while (0)
