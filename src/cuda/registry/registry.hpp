// The kernel registry: every attention kernel the build carries, keyed by
// family (architecture) x precision x head dim x dtype x causal, with its
// tile facts and its two host entry points. Plans look their kernel up at
// creation (so a plan knows and reports what it will run, and refuses what no
// kernel can do); a call runs the kernel's setup (every check, the tensor
// maps: nothing queued) before the first kernel of the call is queued, and its
// run afterwards. Entries come from the generated instance files
// (tools/gen/gen_instances.py) and the portable family's table.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/problem.hpp"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {

enum class Family : int { kSm90 = 0, kPortable = 1 };
const char* family_name(Family f);

struct KernelKey {
  Family family;
  sparge_precision_t precision;
  int head_dim;  // the problem's head dim
  sparge_dtype_t dtype;
  bool causal;
};

// A launch prepared by setup: the family's parameters and tensor maps.
struct alignas(64) LaunchBlob {
  unsigned char bytes[1536];
};

struct KernelEntry {
  KernelKey key;
  const char* name;
  int kernel_head_dim;  // width of the rows the kernel multiplies (padded head dims)
  int block_q;          // query rows per CTA
  int keys_per_step;    // keys per online-softmax step
  int stages;           // K/V pipeline stages
  int threads;          // threads per CTA
  int smem_bytes;       // dynamic shared memory per CTA
  // Plan time: problem-level limits (sizes, 32-bit coordinates). SPARGE_OK or
  // UNSUPPORTED naming the argument.
  sparge_status_t (*supports)(const Problem& p);
  // Call time, before anything is queued: every check on the tensors and the
  // tensor maps into `blob`. *applies = false (status OK) when this kernel
  // cannot take these tensors and the caller may run the fallback instead.
  sparge_status_t (*setup)(const AttnArgs& a, LaunchBlob* blob, bool* applies);
  // Queues the kernel prepared in `blob` on `stream`.
  sparge_status_t (*run)(const LaunchBlob& blob, cudaStream_t stream);
  // The lowest compute capability (major*10 + minor) the kernel's instructions
  // need (fp8 mma.sync: 89); 0: the family's own rule.
  int min_sm = 0;
  // The architecture of the image the kernel runs as on the current device
  // (the PTX's when the driver compiles it, else the SASS's; 0: none), or
  // null when the family's rule settles it.
  int (*image_arch)() = nullptr;
};

// The architecture of the image `kernel` runs as on the current device
// (cudaFuncAttributes::ptxVersion: the PTX's when the driver compiles it, else
// the SASS's), 0 when the build has none for it: the body of the entries'
// image_arch.
int image_arch_of(const void* kernel);

// The entry for `key`, or nullptr.
const KernelEntry* find_kernel(const KernelKey& key);
// All entries (for listings and tests).
int kernel_count();
const KernelEntry* kernel_at(int i);

// The family a device of compute capability `sm_version` runs, or false when
// this build has none for it: sm90 on 9.0 when built, else portable on 8.0
// and newer. SPARGE_KERNEL_FAMILY=portable sends every plan to the portable
// family (SPARGE_FP16_KERNEL=portable the FP16-mode plans only).
bool family_for_device(int sm_version, Family* out);

// Plan time: the kernel of problem `p` on a device of `sm_version` (the
// current device: kernel images and attributes are queried there), with a
// status naming what is missing when there is none (block sizes and dtype are
// checked before, by predict_supported).
sparge_status_t choose_kernel(const Problem& p, int sm_version, const KernelEntry** out);

// The portable family's tables (attention/portable/: the FP16 kernel's, the
// generated 8-bit one), and the generated sm_90a tables
// (attention/sm90/instances/).
extern const KernelEntry kPortableKernels[];
extern const int kPortableKernelCount;
namespace portable {
extern const KernelEntry kPortableInt8Kernels[];
extern const int kPortableInt8KernelCount;
}  // namespace portable

}  // namespace cuda
}  // namespace sparge
