// Internal entry points of the CUDA preparation pipeline beyond the
// launch_* contract of cuda/internal.cuh (see docs/PREDICTION.md).
#pragma once
#include "cuda/internal.cuh"

namespace sparge {
namespace cuda {

// Largest number of key blocks a selection row can hold (the row is sorted in
// shared memory): Lkv <= 16384 * 64 = 1M keys. check_device() rejects larger
// problems at plan time with SPARGE_ERR_UNSUPPORTED.
constexpr int64_t kMaxKeyBlocks = 16384;

// The preparation: K column mean (cfg.smooth_k), V column max|.| (v given and
// quantize), Q/K pooled means and self-similarities (pool), int8 Q/K and fp8
// V^T (quantize), q_mu (quantize and lse_shift). quantize = false computes only
// what the mask prediction needs and skips the int8/fp8 operands even when the
// plan has room for them (predict_mask); pool = false skips the pooled means
// and self-similarities (an attention run with the caller's mask predicts
// nothing); lse_shift = false skips q_mu = scale * q . k_mean, which only the
// LSE output reads (it is left unwritten).
sparge_status_t prepare_impl(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4* v,
                             const PredictConfig& cfg, void* ws, cudaStream_t stream, bool quantize, bool pool,
                             bool lse_shift);

// Plan-time feasibility of the CUDA preparation/selection kernels for `p`
// (head dim, dtype, block sizes, key-block count). SPARGE_OK or UNSUPPORTED.
sparge_status_t predict_supported(const Problem& p);

}  // namespace cuda
}  // namespace sparge
