// Layout checks on the caller's tensors shared by the attention families
// (cuda/common/internal.cuh).
#include <cstdint>

#include "core/error.hpp"
#include "cuda/common/internal.cuh"

namespace sparge {
namespace cuda {

namespace {
bool rows16_ok(const Tensor4& t) {
  return (reinterpret_cast<uintptr_t>(t.data) % 16 == 0) && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 &&
         t.stride[2] % 8 == 0 && t.stride[3] == 1;
}
}  // namespace

sparge_status_t check_rows16(const Tensor4& t, const char* name, const char* mode) {
  if (rows16_ok(t)) return SPARGE_OK;
  return fail(SPARGE_ERR_UNSUPPORTED,
              "%s: the %s attention kernels need a 16-byte aligned data pointer and B/H/L strides that are "
              "multiples of 8 elements (got strides %lld, %lld, %lld, %lld)",
              name, mode, static_cast<long long>(t.stride[0]), static_cast<long long>(t.stride[1]),
              static_cast<long long>(t.stride[2]), static_cast<long long>(t.stride[3]));
}

sparge_status_t check_tma_rows16(const Tensor4& t, const char* name, const char* mode) {
  if (!rows16_ok(t)) return check_rows16(t, name, mode);
  return fail(SPARGE_ERR_UNSUPPORTED,
              "%s: the %s CUDA kernel reads %s through a TMA tensor map, which cannot express its strides "
              "(%lld, %lld, %lld; e.g. rows that overlap)",
              name, mode, name, static_cast<long long>(t.stride[0]), static_cast<long long>(t.stride[1]),
              static_cast<long long>(t.stride[2]));
}

sparge_status_t check_out_pairs(const Tensor4& o) {
  bool even = reinterpret_cast<uintptr_t>(o.data) % 4 == 0;
  for (int d = 0; d < 3; ++d) even = even && (o.shape[d] <= 1 || o.stride[d] % 2 == 0);
  if (even) return SPARGE_OK;
  return fail(SPARGE_ERR_UNSUPPORTED,
              "out: the int8 CUDA kernels write pairs of elements and need a 4-byte aligned data pointer "
              "and even batch/head/row strides (got strides %lld, %lld, %lld)",
              static_cast<long long>(o.stride[0]), static_cast<long long>(o.stride[1]),
              static_cast<long long>(o.stride[2]));
}

}  // namespace cuda
}  // namespace sparge
