// Device helpers for sparge_bench (bench_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// Fills n 16-bit values (bf16, or fp16 when `fp16`) with N(0, stddev^2) numbers.
cudaError_t bench_fill_normal(uint16_t* p, size_t n, uint64_t seed, float stddev, bool fp16, cudaStream_t s);
// Query rows of [B*H][L][D] with 128-row block structure: one cluster per block, or two clusters
// 120 degrees apart in a `share` of the blocks (the inputs KEYS_LSE_ADAPTIVE splits).
cudaError_t bench_fill_blocks(uint16_t* p, size_t n, int64_t L, int64_t D, float share, uint64_t seed, bool fp16,
                              cudaStream_t s);
// Counts NaN values among n 16-bit values into *d_count (device memory).
cudaError_t bench_count_nan(const uint16_t* p, size_t n, bool fp16, unsigned long long* d_count, cudaStream_t s);
