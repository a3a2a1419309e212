// CUDA backend of sparge_merge_states (core/backend.hpp): LSE-weighted
// combination of partial attention states, float32 arithmetic. One warp per
// output row: lane i holds the LSE of state i (count <= 32), the row maximum
// and the weight sum are warp reductions, and the lanes then stride over D.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"

namespace sparge {
namespace cuda {
namespace {

static_assert(SPARGE_MERGE_MAX_STATES <= 32, "one lane per merged state");
constexpr int kRowsPerBlock = 8;

__device__ __forceinline__ float load_any(const void* p, sparge_dtype_t dt, int64_t off) {
  if (dt == SPARGE_DTYPE_FLOAT16) return __half2float(static_cast<const __half*>(p)[off]);
  if (dt == SPARGE_DTYPE_BFLOAT16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[off]);
  return static_cast<const float*>(p)[off];
}

__device__ __forceinline__ void store_any(void* p, sparge_dtype_t dt, int64_t off, float v) {
  if (dt == SPARGE_DTYPE_FLOAT16) static_cast<__half*>(p)[off] = __float2half_rn(v);
  else if (dt == SPARGE_DTYPE_BFLOAT16) static_cast<__nv_bfloat16*>(p)[off] = __float2bfloat16_rn(v);
  else static_cast<float*>(p)[off] = v;
}

__global__ void __launch_bounds__(32 * kRowsPerBlock) merge_kernel(const MergeArgs a, int64_t rows) {
  pdl_grid_sync();
  __shared__ float weights[kRowsPerBlock][32];
  const int lane = threadIdx.x;
  const int64_t H = a.shape[1], L = a.shape[2], D = a.shape[3];
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.y; r < rows;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t l = r % L, bh = r / L, h = bh % H, b = bh / H;
    float x = -INFINITY;
    if (lane < a.count) {
      const MergeInput& in = a.in[lane];
      x = in.lse[b * in.lse_stride[0] + h * in.lse_stride[1] + l * in.lse_stride[2]];
    }
    const bool nan = __any_sync(0xffffffffu, isnan(x));
    float m = isnan(x) ? -INFINITY : x;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    // exp(x - m) with the limits: -inf weighs 0 (its output row is not read), x == m weighs 1
    // (also when both are +inf).
    float w = (x == -INFINITY || isnan(x)) ? 0.0f : (x == m ? 1.0f : expf(x - m));
    float tot = w;
    for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
    weights[threadIdx.y][lane] = w;
    __syncwarp();
    const int64_t ob = b * a.out_stride[0] + h * a.out_stride[1] + l * a.out_stride[2];
    if (nan || m == -INFINITY) {
      const float fill = nan ? NAN : 0.0f;
      for (int64_t d = lane; d < D; d += 32) store_any(a.out, a.out_dtype, ob + d * a.out_stride[3], fill);
    } else {
      const float inv = 1.0f / tot;
      for (int64_t d = lane; d < D; d += 32) {
        float acc = 0.0f;
        for (int i = 0; i < a.count; ++i) {
          const float wi = weights[threadIdx.y][i];  // uniform across the warp
          if (wi == 0.0f) continue;
          const MergeInput& in = a.in[i];
          acc += wi * load_any(in.data, in.dtype, b * in.stride[0] + h * in.stride[1] + l * in.stride[2] +
                                                      d * in.stride[3]);
        }
        store_any(a.out, a.out_dtype, ob + d * a.out_stride[3], acc * inv);
      }
    }
    // Every lane has read its LSE (lse_out may be one of the inputs) and the weights of this row.
    __syncwarp();
    if (a.lse_out && lane == 0) {
      const float lse = nan ? NAN : (m == -INFINITY ? -INFINITY : m + logf(tot));
      a.lse_out[b * a.lse_out_stride[0] + h * a.lse_out_stride[1] + l * a.lse_out_stride[2]] = lse;
    }
  }
}

}  // namespace

sparge_status_t merge_states(const MergeArgs& a, int device_id, void* stream) {
  int prev = 0;
  SPARGE_CUDA_TRY(cudaGetDevice(&prev));
  if (prev != device_id) SPARGE_CUDA_TRY(cudaSetDevice(device_id));
  const int64_t rows = a.shape[0] * a.shape[1] * a.shape[2];
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const unsigned grid = unsigned(blocks < (int64_t(1) << 24) ? blocks : (int64_t(1) << 24));
  const cudaError_t e = launch_pdl(merge_kernel, dim3(grid), dim3(32, kRowsPerBlock), 0,
                                   static_cast<cudaStream_t>(stream), a, rows);
  sparge_status_t st = SPARGE_OK;
  {
    (void)cudaGetLastError();
    st = cuda_status(e, "merge_kernel launch");
  }
  if (prev != device_id) cudaSetDevice(prev);
  return st;
}

}  // namespace cuda
}  // namespace sparge
