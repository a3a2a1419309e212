// Device helpers for sparge_bench: random inputs generated on the GPU (so that
// setting up a 32K-token workload takes milliseconds) and a check that an
// output holds no NaN (the output is poisoned with NaN before timing).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "bench_kernels.hpp"

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float normal_of(uint64_t r) {
  const float u1 = (static_cast<float>(r >> 40) + 0.5f) * (1.0f / 16777216.0f);
  const float u2 = static_cast<float>((r >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__device__ __forceinline__ uint16_t bits16(float z, int is_fp16) {
  if (is_fp16) {
    const __half h = __float2half_rn(z);
    return *reinterpret_cast<const uint16_t*>(&h);
  }
  const __nv_bfloat16 h = __float2bfloat16_rn(z);
  return *reinterpret_cast<const uint16_t*>(&h);
}

__global__ void fill_normal_kernel(uint16_t* p, size_t n, uint64_t seed, float stddev, int is_fp16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = bits16(normal_of(mix64(seed ^ mix64(i))) * stddev, is_fp16);
}

// Query rows with block structure: per 128-row block of a head, rows around one centre c1, or
// (a `share` of the blocks, chosen by hash) alternately around c1 and c2 = -c1/2 + 0.866 cp (120
// degrees apart), each element plus 0.3 N(0, 1); centres N(0, 1) per element.
__global__ void fill_blocks_kernel(uint16_t* p, size_t n, int64_t L, int64_t D, float share, uint64_t seed,
                                   int is_fp16) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t d = i % uint64_t(D), row = i / uint64_t(D), bh = row / uint64_t(L), r = row % uint64_t(L);
    const uint64_t blk = mix64(seed ^ mix64(bh * 1000003ull + r / 128));
    const bool split = static_cast<float>(blk >> 40) * (1.0f / 16777216.0f) < share;
    const float c1 = normal_of(mix64(blk ^ (2 * d + 1))), cp = normal_of(mix64(blk ^ (2 * d + 2)));
    const float c = split && (r & 1) ? -0.5f * c1 + 0.866f * cp : c1;
    p[i] = bits16(c + 0.3f * normal_of(mix64(seed ^ 0x5bd1e995ull ^ mix64(i))), is_fp16);
  }
}

__global__ void count_nan_kernel(const uint16_t* p, size_t n, int is_fp16, unsigned long long* count) {
  unsigned long long local = 0;
  const uint16_t lim = is_fp16 ? 0x7c00u : 0x7f80u;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    local += (p[i] & 0x7fffu) > lim;
  if (local) atomicAdd(count, local);
}

}  // namespace

cudaError_t bench_fill_normal(uint16_t* p, size_t n, uint64_t seed, float stddev, bool fp16, cudaStream_t s) {
  fill_normal_kernel<<<1024, 256, 0, s>>>(p, n, seed, stddev, fp16 ? 1 : 0);
  return cudaGetLastError();
}

cudaError_t bench_fill_blocks(uint16_t* p, size_t n, int64_t L, int64_t D, float share, uint64_t seed, bool fp16,
                              cudaStream_t s) {
  fill_blocks_kernel<<<1024, 256, 0, s>>>(p, n, L, D, share, seed, fp16 ? 1 : 0);
  return cudaGetLastError();
}

cudaError_t bench_count_nan(const uint16_t* p, size_t n, bool fp16, unsigned long long* d_count, cudaStream_t s) {
  cudaError_t e = cudaMemsetAsync(d_count, 0, sizeof(unsigned long long), s);
  if (e != cudaSuccess) return e;
  count_nan_kernel<<<1024, 256, 0, s>>>(p, n, fp16 ? 1 : 0, d_count);
  return cudaGetLastError();
}
