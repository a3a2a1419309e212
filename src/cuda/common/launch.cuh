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

#include <atomic>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "sparge/sparge.h"

namespace sparge {
namespace cuda {

sparge_status_t cuda_status(cudaError_t e, const char* what);  // cuda/backend.cu
// True when `s` is being captured into a graph (by the caller): a call then
// launches its kernels into that capture one by one. An error of the query
// (e.g. the legacy stream while another thread captures) also answers true;
// the launches then report it. cuda/backend.cu.
bool stream_capturing(cudaStream_t s);

// First statement of every kernel launched through launch_pdl.
__device__ __forceinline__ void pdl_grid_sync() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether launches carry the PDL attribute (SPARGE_PDL, read once; default on).
bool pdl_enabled();

// A CUDA graph built from launch_pdl calls instead of launching them (the
// call cache's graphs, cuda/backend.cu): while a thread has a recorder set,
// its launch_pdl calls append kernel nodes in order, each depending on the one
// before through a programmatic edge (as stream capture makes of PDL launches;
// a full edge with SPARGE_PDL=0). Built by hand rather than by stream capture:
// a capture in progress makes other threads' cudaDeviceSynchronize and
// similar device-wide calls fail.
struct LaunchRecorder {
  cudaGraph_t graph = nullptr;
  cudaGraphNode_t last = nullptr;
};
inline LaunchRecorder*& launch_recorder() {
  static thread_local LaunchRecorder* r = nullptr;
  return r;
}
// Sets the calling thread's recorder for its lifetime.
class RecordLaunches {
 public:
  explicit RecordLaunches(LaunchRecorder* r) : prev_(launch_recorder()) { launch_recorder() = r; }
  ~RecordLaunches() { launch_recorder() = prev_; }
  RecordLaunches(const RecordLaunches&) = delete;
  RecordLaunches& operator=(const RecordLaunches&) = delete;

 private:
  LaunchRecorder* prev_;
};

template <typename... KArgs, typename... Args>
cudaError_t record_launch(LaunchRecorder* r, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                          Args&&... args) {
  std::tuple<std::decay_t<KArgs>...> values(std::forward<Args>(args)...);
  void* ptrs[sizeof...(KArgs) > 0 ? sizeof...(KArgs) : 1];
  std::apply([&](auto&... v) {
    int i = 0;
    ((ptrs[i++] = static_cast<void*>(&v)), ...);
  }, values);
  cudaKernelNodeParams kp = {};
  kp.func = reinterpret_cast<void*>(kernel);
  kp.gridDim = grid;
  kp.blockDim = block;
  kp.sharedMemBytes = static_cast<unsigned>(smem);
  kp.kernelParams = ptrs;
  cudaGraphNode_t node = nullptr;
  cudaError_t e = cudaGraphAddKernelNode(&node, r->graph, nullptr, 0, &kp);
  if (e != cudaSuccess) return e;
  if (r->last != nullptr) {
    cudaGraphEdgeData edge = {};
    if (pdl_enabled()) {
      edge.from_port = cudaGraphKernelNodePortProgrammatic;
      edge.type = cudaGraphDependencyTypeProgrammatic;
    }
    e = cudaGraphAddDependencies(r->graph, &r->last, &node, &edge, 1);
    if (e != cudaSuccess) return e;
  }
  r->last = node;
  return cudaSuccess;
}

template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  if (LaunchRecorder* r = launch_recorder()) return record_launch(r, kernel, grid, block, smem, std::forward<Args>(args)...);
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

// ---------------------------------------------------------------- dynamic shared memory
// cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) once per
// kernel and device instead of before every launch: a process-wide table
// records the largest size set for each (kernel, device); a launch that needs
// no more than that costs two atomic loads. Sizes up to 48 KB need no
// attribute. The attribute only grows (a kernel launched with several sizes
// keeps the largest). Thread-safe: a size is recorded only after the driver
// accepted it, and setting happens under one lock. The attribute belongs to
// the device's primary context: a process that calls cudaDeviceReset must not
// launch through this helper afterwards (nor use plans made before it).
// A kernel that runs several CTAs per SM (`max_carveout`; above 48 KB) also asks for the
// largest shared-memory carveout, with the same once-per-kernel-and-device
// record (a kernel is always asked with the same flag).
namespace smem_attr_detail {
constexpr int kSlots = 128;   // kernels (power of two); beyond: set on every launch
constexpr int kDevices = 32;  // device ordinals recorded; beyond: set on every launch
struct Slot {
  std::atomic<const void*> kernel;
  std::atomic<int> bytes[kDevices];  // largest size set on each device (0: none)
};
inline Slot* slots() {
  static Slot table[kSlots];  // zero-initialized (static storage, trivial atomics)
  return table;
}
inline std::mutex& lock() {
  static std::mutex m;
  return m;
}
inline unsigned home(const void* kernel) {
  return unsigned((uint64_t(reinterpret_cast<uintptr_t>(kernel)) * 0x9E3779B97F4A7C15ull) >> 57) & (kSlots - 1);
}
inline sparge_status_t set(const void* kernel, int bytes, bool max_carveout) {
  const sparge_status_t st =
      cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                  "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (st != SPARGE_OK || !max_carveout) return st;
  return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          int(cudaSharedmemCarveoutMaxShared)),
                     "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
}
inline sparge_status_t slow(const void* kernel, int bytes, int device, bool max_carveout) {
  std::lock_guard<std::mutex> guard(lock());
  Slot* t = slots();
  Slot* slot = nullptr;
  for (unsigned i = 0, h = home(kernel); i < unsigned(kSlots) && slot == nullptr; ++i) {
    Slot& s = t[(h + i) & (kSlots - 1)];
    const void* k = s.kernel.load(std::memory_order_relaxed);
    if (k == kernel) slot = &s;
    if (k == nullptr) {
      s.kernel.store(kernel, std::memory_order_release);
      slot = &s;
    }
  }
  if (slot == nullptr) return set(kernel, bytes, max_carveout);  // table full
  if (slot->bytes[device].load(std::memory_order_relaxed) >= bytes) return SPARGE_OK;
  const sparge_status_t st = set(kernel, bytes, max_carveout);
  if (st == SPARGE_OK) slot->bytes[device].store(bytes, std::memory_order_release);
  return st;
}
}  // namespace smem_attr_detail

// `device` must be the current device.
inline sparge_status_t ensure_smem_attr(const void* kernel, int bytes, int device, bool max_carveout = false) {
  namespace d = smem_attr_detail;
  if (bytes <= 48 * 1024) return SPARGE_OK;
  if (device < 0 || device >= d::kDevices) return d::set(kernel, bytes, max_carveout);
  const d::Slot* t = d::slots();
  for (unsigned i = 0, h = d::home(kernel); i < unsigned(d::kSlots); ++i) {
    const d::Slot& s = t[(h + i) & (d::kSlots - 1)];
    const void* k = s.kernel.load(std::memory_order_acquire);
    if (k == kernel) {
      if (s.bytes[device].load(std::memory_order_acquire) >= bytes) return SPARGE_OK;
      break;
    }
    if (k == nullptr) break;
  }
  return d::slow(kernel, bytes, device, max_carveout);
}

// On the current device (one cudaGetDevice: a read of the runtime's
// thread-local state, no driver call).
inline sparge_status_t ensure_smem_attr(const void* kernel, int bytes) {
  if (bytes <= 48 * 1024) return SPARGE_OK;
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_status(e, "cudaGetDevice");
  return ensure_smem_attr(kernel, bytes, device);
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
