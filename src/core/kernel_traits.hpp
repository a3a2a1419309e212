// The kernel facts that are part of the semantics, shared by the CUDA kernel
// traits (src/cuda/attention/) and the CPU twin (src/cpu/attention.cpp), so
// that the twin follows the kernels by construction:
//   - the online-softmax step: how many listed 64-key blocks one step of the
//     running max covers (P is rounded against the step's max);
//   - the kernel head dim: the width the CUDA pipeline stores and multiplies
//     (head dims that are not a multiple of 64 are zero-padded to one).
// docs/SEMANTICS.md states the rule; docs/KERNELS-SM90.md why each value.
#pragma once
#include <cstdint>

#include "core/problem.hpp"

#if defined(__CUDACC__)
#define SPARGE_CHD __host__ __device__ constexpr
#else
#define SPARGE_CHD constexpr
#endif

namespace sparge {

// Head dims the GPU kernel families are generated for (tools/gen/gen_instances.py).
SPARGE_CHD bool gpu_head_dim_supported(int64_t D) { return D == 64 || D == 96 || D == 128 || D == 256; }

// The width of Q, K and V rows inside the CUDA pipeline: D rounded up to a
// multiple of 64 (D = 96 runs the D = 128 kernels on zero-padded columns:
// zeros add nothing to a dot product, a norm, a maximum or a sum, so the
// results are those of D = 96).
SPARGE_CHD int64_t gpu_kernel_head_dim(int64_t D) { return (D + 63) / 64 * 64; }

// Listed 64-key blocks per online-softmax step for a precision and (kernel)
// head dim:
//   INT8_FP8 (and split V): 2 (128 keys; the two-level fp8 accumulation keeps
//     a second D-wide accumulator, which leaves room for no wider step);
//   INT8_FP16 and FP16: 3 at D = 64 (192 keys: the step's fixed costs weigh
//     more against the small products), 2 up to kernel head dim 128 (D = 96,
//     128; and the CPU's other head dims up to 128), 1 above (D = 256: the fp32
//     output accumulator alone takes 128 registers per thread).
// The CPU twin steps INT8_FP8 and INT8_FP16 the same way (the FP16 mode is not
// twinned: its P rounding is checked against float64 within tolerance).
SPARGE_CHD int blocks_per_step(sparge_precision_t precision, int64_t D) {
  const int64_t dk = gpu_kernel_head_dim(D);
  if (precision == SPARGE_PRECISION_INT8_FP8 || precision == SPARGE_PRECISION_INT8_FP8_SPLIT_V) return 2;
  if (D == 64) return 3;
  return dk <= 128 ? 2 : 1;
}

}  // namespace sparge
