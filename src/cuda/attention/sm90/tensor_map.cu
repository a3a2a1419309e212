// Tensor-map helpers shared by the sm_90a kernels (host code).
#include "cuda/attention/sm90/tensor_map.hpp"
#include "cuda/common/switches.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>

#include "core/error.hpp"
#include "core/kernel_traits.hpp"

namespace sparge {
namespace cuda {
namespace sm90 {

sparge_status_t get_encode_fn(EncodeTiledFn* fn) {
  static EncodeTiledFn cached = nullptr;
  static cudaError_t err = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
    if (err == cudaSuccess && q == cudaDriverEntryPointSuccess) cached = reinterpret_cast<EncodeTiledFn>(ptr);
  });
  if (cached == nullptr) {
    return fail(SPARGE_ERR_CUDA, "cuTensorMapEncodeTiled is not available from the CUDA driver (%s)",
                cudaGetErrorString(err));
  }
  *fn = cached;
  return SPARGE_OK;
}

sparge_status_t make_map(EncodeTiledFn enc, CUtensorMap* map, const void* base, uint64_t row_bytes, uint64_t rows,
                         uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swz, const char* what) {
  const cuuint64_t dims[2] = {row_bytes, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t estr[2] = {1, 1};
  CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, estr,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, swz, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return fail(SPARGE_ERR_CUDA, "cuTensorMapEncodeTiled(%s) failed with CUresult %d", what, int(r));
  return SPARGE_OK;
}

CUresult make_map_bhld16(EncodeTiledFn enc, CUtensorMap* map, const void* base, bool bf16, const int64_t (&shape)[4],
                         const int64_t (&stride)[4], uint32_t box_rows) {
  // TMA dimensions innermost first: D, L, H, B. The stride of an extent-1
  // dimension is never used; the packed value (the span of the dimensions
  // inside it) stands in for it, which satisfies every rule the encoder has
  // for strides.
  const int order[3] = {2, 1, 0};
  cuuint64_t dims[4] = {cuuint64_t(shape[3]), 0, 0, 0};
  cuuint64_t strides[3];
  cuuint64_t span = cuuint64_t(shape[3]) * 2;  // bytes covered by the dimensions inside
  for (int i = 0; i < 3; ++i) {
    const int d = order[i];
    dims[i + 1] = cuuint64_t(shape[d]);
    strides[i] = (shape[d] == 1) ? span : cuuint64_t(stride[d]) * 2;
    span = std::max(span, strides[i] * dims[i + 1]);
  }
  // The encoder's rules, checked here first so that the expected refusals
  // (callers fall back) are not failed driver calls: a 16-byte aligned base,
  // strides that are multiples of 16 bytes below 2^40, extents up to 2^32.
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 3; ++i)
    if (strides[i] % 16 != 0 || strides[i] >= (cuuint64_t(1) << 40)) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 4; ++i)
    if (dims[i] == 0 || dims[i] > (cuuint64_t(1) << 32)) return CUDA_ERROR_INVALID_VALUE;
  const cuuint32_t box[4] = {64, box_rows, 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return enc(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
             const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

bool tma_store_from_env() { return dev_switches().tma_store; }

int persistent_grid_cap(int sm_count) {
  const int cap = dev_switches().persist_grid;
  return cap > 0 && cap < sm_count ? cap : sm_count;
}

namespace {
// Causal units of persistent CTAs (pairs of a head's tiles) that fill the
// SMs' last wave to >= 90 %.
bool causal_units_fill(int64_t rows, int64_t tiles, int64_t sms) {
  const int64_t units = persistent_units(rows, tiles, 1), waves = (units + sms - 1) / sms;
  return 10 * units >= 9 * waves * sms;
}
}  // namespace

bool use_wide() {
  const int sw = dev_switches().wide;
  if (sw >= 0) return sw == 1;
  // Measured (PERF-NOTES v54, H100): -10 ... -16 % on non-causal rows from 2K
  // keys; causal -3 ... -32 % (with persistent CTAs on the rows below) or
  // within 1 us (1x12x1K, 8x12x1K) once a warpgroup skips the steps its rows
  // cannot see.
  return true;
}

bool use_short(const Problem& pb, int sm_count, bool masked) {
  const int sw = dev_switches().shrt;
  if (sw >= 0) return sw == 1;
  // Measured (PERF-NOTES v71, H100): with at least four 128-row tiles per SM
  // the short-row kernel took 64x12x1Kx64 causal 0.400 -> 0.329 ms, 8x12x1K
  // causal 0.062 -> 0.054, non-causal 0.079 -> 0.071, the causal 2K shapes
  // -2 ... -4 %, and masked calls at 8K -3 ... -28 % at densities 0.1-0.2
  // (level at 0.5); it lost on dense rows of 2K non-causal and of 4K-8K
  // (+1 ... +36 %) and wherever tiles were few (1x12: +5 ... +57 %).
  if (sm_count <= 0 || gpu_kernel_head_dim(pb.D) != 64) return false;
  if (pb.B * pb.Hq * pb.nQB < 4 * int64_t(sm_count)) return false;
  if (masked) return pb.nKB <= 128;
  return pb.nKB <= (pb.causal ? 32 : 16);
}

bool use_persistent(const Problem& pb, int sm_count, int consumers) {
  const int sw = dev_switches().persist;
  if (sw >= 0) return sw == 1;
  // Measured (PERF-NOTES v50, v55): causal calls gain from the balanced pairs
  // of rows when the units fill the SMs' last wave to >= 90 % (1x32x1K-4K
  // x128: -11 ... -25 %), at D = 128 only while the rows are short or the
  // units few (8x32x4K-8K: level or +1 %); non-causal calls at D = 64 with
  // many rows of <= 4K keys, where the consumers pipeline across rows (-4 ...
  // -8 %); not at D = 128, where that pipeline runs on a two-stage ring
  // (+2 ... +5 % from 2K keys, level at 1K).
  // Kernel head dims 64 and 128 only, the measured ones (D = 96 runs the
  // 128-wide kernel and takes its rule; D = 256 was not measured).
  const int64_t tile = 64 * consumers, nQT = (pb.Lq + tile - 1) / tile;
  const int64_t rows = pb.B * pb.Hq * nQT, sms = sm_count, dk = gpu_kernel_head_dim(pb.D);
  if (dk != 64 && dk != 128) return false;
  const bool d64 = dk == 64;
  if (consumers == 3) {
    // The wide D = 64 kernel (PERF-NOTES v54): causal with > 2K keys when the
    // units fill the last wave (1x12x4K -32 %, 1x12x8K -14 %; with <= 2K keys
    // +9 ... +27 %); non-causal only with <= 1K keys (8x12x1K, 64x12x1K:
    // -2 ... -4 %), since its pipeline across rows spills (2K keys: +1 %,
    // 4K-8K: +5 ... +9 %).
    if (pb.causal) return pb.nKB > 32 && causal_units_fill(rows, nQT, sms);
    return pb.nKB <= 16 && rows >= 2 * sms;
  }
  if (pb.causal) {
    const int64_t units = persistent_units(rows, nQT, 1);
    return causal_units_fill(rows, nQT, sms) && (d64 || pb.nKB <= 32 || units <= 4 * sms);
  }
  return d64 && pb.nKB <= 64 && rows >= 2 * sms;
}

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
