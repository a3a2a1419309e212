// Host side of the sm_90a kernels' TMA: the driver's tensor-map encoder
// (looked up once through the runtime, so the library needs no -lcuda) and
// the two map shapes the kernels use.
#pragma once
#include <cuda.h>

#include <cstdint>

#include "core/problem.hpp"
#include "sparge/sparge.h"

namespace sparge {
namespace cuda {
namespace sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled; SPARGE_ERR_CUDA when the driver lacks it.
sparge_status_t get_encode_fn(EncodeTiledFn* fn);

// A 2-D uint8 tensor map: `rows` rows of `row_bytes` bytes, box = box_cols x box_rows.
sparge_status_t make_map(EncodeTiledFn enc, CUtensorMap* map, const void* base, uint64_t row_bytes, uint64_t rows,
                         uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swz, const char* what);

// A 4-D map over a 16-bit [B, H, L, D] tensor with element strides
// `stride` (unit stride on D), box = 64 elements of D x box_rows rows of L,
// 128B swizzle, zero fill outside the tensor. Returns the driver's result, or
// CUDA_ERROR_INVALID_VALUE without calling it when the base or strides break
// the encoder's alignment rules (no error message): callers fall back to
// another path when the tensor is not expressible (e.g. rows that overlap).
CUresult make_map_bhld16(EncodeTiledFn enc, CUtensorMap* map, const void* base, bool bf16, const int64_t (&shape)[4],
                         const int64_t (&stride)[4], uint32_t box_rows);

// The kernels' output path: false when SPARGE_SM90_EPILOGUE=direct (4-byte
// stores from registers, a developer switch for A/B runs, read once); else
// the TMA store through shared memory where a kernel has room for it.
bool tma_store_from_env();

// Whether the dense work of a 16-bit sm_90a kernel with `consumers` consumer
// warpgroups (tiles of 64 * consumers query rows) runs on persistent CTAs
// (kernel.cuh): SPARGE_SM90_PERSIST=0 / 1 decides where set; else rows many
// and short (docs/PERF-NOTES.md v50).
bool use_persistent(const Problem& pb, int sm_count, int consumers);
// Whether a dense call takes a mainloop's wide (three-consumer, 192-row)
// variant: SPARGE_SM90_WIDE=0 / 1 decides where set; else yes (measured on
// every shape of the grid: docs/PERF-NOTES.md v54).
bool use_wide();
// Whether an FP16 call at D = 64 (dense or masked) takes the short-row
// variant (two CTAs per SM, 64-key steps): SPARGE_SM90_SHORT=0 / 1 decides
// where set; else calls with at least four 128-row tiles per SM whose rows
// are short: dense rows of <= 2K keys (causal) or 1K (not), masked rows of
// <= 8K (docs/PERF-NOTES.md v48, v71).
bool use_short(const Problem& pb, int sm_count, bool masked);
// The most persistent CTAs: sm_count, or fewer where SPARGE_SM90_PERSIST_GRID says.
int persistent_grid_cap(int sm_count);

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
