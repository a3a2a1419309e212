// Backend-neutral arguments of sparge_merge_states after validation.
#pragma once
#include <cstdint>

#include "sparge/sparge.h"

namespace sparge {

// One partial state: an output [B, H, L, D] and its float32 LSE [B, H, L].
struct MergeInput {
  const void* data = nullptr;
  sparge_dtype_t dtype = SPARGE_DTYPE_FLOAT32;
  int64_t stride[4] = {0, 0, 0, 0};
  const float* lse = nullptr;
  int64_t lse_stride[3] = {0, 0, 0};
};

struct MergeArgs {
  int32_t count = 0;
  int64_t shape[4] = {0, 0, 0, 0};  // B, H, L, D (shared by every tensor)
  MergeInput in[SPARGE_MERGE_MAX_STATES];
  void* out = nullptr;
  sparge_dtype_t out_dtype = SPARGE_DTYPE_FLOAT32;
  int64_t out_stride[4] = {0, 0, 0, 0};
  float* lse_out = nullptr;  // nullptr: not wanted
  int64_t lse_out_stride[3] = {0, 0, 0};
};

}  // namespace sparge
