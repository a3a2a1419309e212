// Instances of the FP16-mode attention kernel for __half inputs (head dims 64,
// 96 on the 128-wide kernel, and 128; causal and not). One file per dtype keeps builds parallel.
#include "cuda/attention/portable/attn_fp16.cuh"

namespace sparge {
namespace cuda {
namespace fp16attn {

SPARGE_FP16_ATTN_INSTANCES(, __half)

}  // namespace fp16attn
}  // namespace cuda
}  // namespace sparge
