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
// est KEYS_LSE_SPLIT2: the two group rows of every query block (launch_split2_group's) instead of
// the pooled row, the second group's scores into the index-list region; KEYS_LSE_ADAPTIVE: the same
// rows, but only those of launch_split2_group's row lists (the second row of a block that keeps one
// group is not scored).
sparge_status_t launch_key_scores(const Plan& plan, const Tensor4& k, void* ws, cudaStream_t stream,
                                  const KeptRef* kept = nullptr, bool* kept_zeroed = nullptr,
                                  sparge_estimator_t est = SPARGE_ESTIMATOR_KEYS_LSE);

// Estimators KEYS_LSE_SPLIT2 and KEYS_LSE_ADAPTIVE (split2.cu): the grouping of every query block of
// q into two groups (adaptive: one where its mean row is not 0.25 to 0.75 of its rows' length) and their mean
// rows and sizes, and for adaptive the list of rows to score per kv head (before
// launch_key_scores). launch_select combines the two groups' block scores of a row (adaptive: the
// rows of two groups only; the others keep the KEYS_LSE scores of their mean row).
sparge_status_t launch_split2_group(const Plan& plan, const Tensor4& q, void* ws, cudaStream_t stream,
                                    bool adaptive);

// Estimators with two group rows per query block (split2.cu).
inline bool grouped_estimator(sparge_estimator_t e) {
  return e == SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2 || e == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
}

// Estimators whose block scores the preparation writes (launch_key_scores): KEYS_LSE and the
// grouped ones.
inline bool keys_estimator(sparge_estimator_t e) { return e == SPARGE_ESTIMATOR_KEYS_LSE || grouped_estimator(e); }

}  // namespace cuda
}  // namespace sparge
