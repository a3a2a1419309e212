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
// LSE output reads (it is left unwritten). lists_mask (optional): the caller's
// mask, whose index lists and work order (cuda/schedule/lists.cuh) then run in
// the preparation's two launches instead of two of their own. Two launches
// (prepare.cu), and the KEYS_LSE scores when that estimator predicts.
// zero_tickets: clear the column statistics' ticket words first (a memset
// node). Correctness does not need it (column_stats.cuh, tickets); it keeps the
// first use of a workspace free of reads of uninitialized memory, so callers
// clear them on a workspace's first call with a key, not on its repeats.
// kept_zeroed (optional): the KEYS_LSE block-score kernel also resets the selection's kept counters
// (kept_ref(plan, kept, ws)), and *kept_zeroed says whether it ran (launch_select's kept_zeroed).
sparge_status_t prepare_impl(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4* v,
                             const PredictConfig& cfg, void* ws, cudaStream_t stream, bool quantize, bool pool,
                             bool lse_shift, const MaskView* lists_mask = nullptr, bool zero_tickets = true,
                             const KeptView* kept = nullptr, bool* kept_zeroed = nullptr);

}  // namespace cuda
}  // namespace sparge
