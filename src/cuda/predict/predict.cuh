// Internal entry points of the CUDA prediction stage beyond the launch_*
// contract of cuda/common/internal.cuh (see docs/PREDICTION.md).
#pragma once
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {

// Largest number of key blocks a selection row can hold (the row is sorted in
// shared memory): Lkv <= 16384 * 64 = 1M keys. check_device() rejects larger
// problems at plan time with SPARGE_ERR_UNSUPPORTED.
constexpr int64_t kMaxKeyBlocks = 16384;

// Plan-time feasibility of the CUDA preparation/selection kernels for `p`
// (head dim, dtype, block sizes, key-block count). SPARGE_OK or UNSUPPORTED.
sparge_status_t predict_supported(const Problem& p);

// Estimator KEYS_LSE: block scores from the pooled queries (already in the workspace) and every
// key of k, into the workspace's score region; launch_select then skips its pooled-score kernel.
// kept (optional): counters the kernel also resets; *kept_zeroed says whether it did.
sparge_status_t launch_key_scores(const Plan& plan, const Tensor4& k, void* ws, cudaStream_t stream,
                                  const KeptRef* kept = nullptr, bool* kept_zeroed = nullptr);

}  // namespace cuda
}  // namespace sparge
