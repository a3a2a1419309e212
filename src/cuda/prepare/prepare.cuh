// The operand preparation stage of the CUDA pipeline (src/cuda/prepare/):
// column statistics and the quantized operands of the attention kernels,
// fused with the pooled statistics of the prediction stage where both read the
// same rows (src/cuda/predict/pooling.cuh).
#pragma once
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {

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

namespace prep {
// Step 1 of prepare_impl (column_stats.cu): the K column mean (do_k), the V
// column max |.| (do_v), and with fused_kpool the smoothed pooled K means and
// zero self-similarities of a prediction-only call.
sparge_status_t launch_column_stats(const Plan& plan, const Tensor4& k, const Tensor4* v, bool do_k, bool do_v,
                                    bool fused_kpool, void* ws, cudaStream_t stream);
}  // namespace prep

}  // namespace cuda
}  // namespace sparge
