// sparge_merge_states: validation and dispatch (the math is in the backends).
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "api/validate.hpp"
#include "core/backend.hpp"
#include "core/error.hpp"

using namespace sparge;

namespace {

constexpr sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT;

bool is_output_dtype(int32_t dt) {
  return dt == SPARGE_DTYPE_FLOAT16 || dt == SPARGE_DTYPE_BFLOAT16 || dt == SPARGE_DTYPE_FLOAT32;
}

// Checks one tensor descriptor of the merge: device, dtype, rank, shape (against
// `shape` when `expect` is set, else it defines it), strides and extent.
// `name` is the argument as the caller wrote it ("outs[2]", "lse_out").
sparge_status_t check_merge_tensor(const sparge_tensor_t* t, const char* name, int ndim, bool is_lse,
                                   sparge_device_type_t device, int32_t device_id, const int64_t* shape) {
  if (!t->data) return fail(INV, "%s->data is NULL, expected a pointer to %s memory", name, api::device_name(device));
  const int32_t t_device = api::raw_enum(t->device_type), t_dtype = api::raw_enum(t->dtype);
  if (t_device != device)
    return fail(INV, "%s->device_type is %s (%d), expected %s (the device of out)", name, api::device_name(t_device),
                int(t_device), api::device_name(device));
  if (t->device_id != device_id)
    return fail(INV, "%s->device_id is %d, expected %d (the device_id of out)", name, int(t->device_id),
                int(device_id));
  if (is_lse) {
    if (t_dtype != SPARGE_DTYPE_FLOAT32)
      return fail(INV, "%s->dtype is %s (%d), expected FLOAT32", name, api::dtype_name(t_dtype), int(t_dtype));
  } else if (!is_output_dtype(t_dtype)) {
    return fail(INV, "%s->dtype is %s (%d), expected FLOAT16, BFLOAT16 or FLOAT32", name, api::dtype_name(t_dtype),
                int(t_dtype));
  }
  if (t->ndim != ndim) return fail(INV, "%s->ndim is %d, expected %d", name, int(t->ndim), ndim);
  static const char* const dims[4] = {"B", "H", "L", "D"};
  for (int d = 0; d < ndim; ++d)
    if (t->shape[d] != shape[d])
      return fail(INV, "%s->shape[%d] is %" PRId64 ", expected %" PRId64 " (%s of out)", name, d, t->shape[d],
                  shape[d], dims[d]);
  uint64_t last = 0;
  for (int d = 0; d < ndim; ++d) {
    const int64_t st = t->strides[d];
    if (st < 0)
      return fail(INV, "%s->strides[%d] is %" PRId64 ", expected >= 0 (negative strides are not supported)", name, d,
                  st);
    uint64_t term = 0;
    if (__builtin_mul_overflow(uint64_t(t->shape[d] - 1), uint64_t(st), &term) ||
        __builtin_add_overflow(last, term, &last) || last > uint64_t(INT64_MAX) / 4)
      return fail(INV, "%s: the extent given by its shape and strides overflows 64 bits", name);
  }
  if (device == SPARGE_DEVICE_CUDA) SPARGE_TRY(cuda::pointer_on_device(t->data, device_id, name));
  return SPARGE_OK;
}

// Written outputs must not repeat an element: no zero stride on a dimension of extent > 1.
sparge_status_t check_no_repeats(const sparge_tensor_t* t, const char* name, int ndim) {
  for (int d = 0; d < ndim; ++d)
    if (t->strides[d] == 0 && t->shape[d] > 1)
      return fail(INV, "%s->strides[%d] is 0, expected >= 1 (an output must not repeat elements; extent %" PRId64 ")",
                  name, d, t->shape[d]);
  return SPARGE_OK;
}

sparge_status_t merge_impl(int32_t count, const sparge_tensor_t* outs, const sparge_tensor_t* lses,
                           const sparge_tensor_t* out, const sparge_tensor_t* lse_out, void* stream) {
  if (count < 1 || count > SPARGE_MERGE_MAX_STATES)
    return fail(INV, "count is %d, expected 1..%d (SPARGE_MERGE_MAX_STATES)", int(count), SPARGE_MERGE_MAX_STATES);
  if (!outs) return fail(INV, "outs is NULL, expected an array of %d tensor descriptors", int(count));
  if (!lses) return fail(INV, "lses is NULL, expected an array of %d tensor descriptors", int(count));
  if (!out) return fail(INV, "out is NULL, expected a tensor descriptor");

  // out defines the device and the shape.
  const int32_t device = api::raw_enum(out->device_type);
  if (device != SPARGE_DEVICE_CPU && device != SPARGE_DEVICE_CUDA)
    return fail(INV, "out->device_type is %d, expected SPARGE_DEVICE_CPU (0) or SPARGE_DEVICE_CUDA (1)", int(device));
  const sparge_device_type_t dev = sparge_device_type_t(device);
  if (out->device_id < 0) return fail(INV, "out->device_id is %d, expected >= 0", int(out->device_id));
  if (dev == SPARGE_DEVICE_CPU && out->device_id != 0)
    return fail(INV, "out->device_id is %d, expected 0 for host memory", int(out->device_id));
  if (dev == SPARGE_DEVICE_CUDA && !cuda::built())
    return fail(SPARGE_ERR_NO_DEVICE,
                "out->device_type is CUDA but libsparge was built without CUDA (sparge_has_cuda() == 0)");
  if (out->ndim != 4) return fail(INV, "out->ndim is %d, expected 4 ([B, H, L, D])", int(out->ndim));
  int64_t shape[4];
  static const char* const dims[4] = {"B", "H", "L", "D"};
  for (int d = 0; d < 4; ++d) {
    if (out->shape[d] < 1)
      return fail(INV, "out->shape[%d] is %" PRId64 ", expected >= 1 (%s)", d, out->shape[d], dims[d]);
    shape[d] = out->shape[d];
  }
  uint64_t rows = 0;
  if (__builtin_mul_overflow(uint64_t(shape[0]), uint64_t(shape[1]), &rows) ||
      __builtin_mul_overflow(rows, uint64_t(shape[2]), &rows) || rows > uint64_t(INT64_MAX) / 4)
    return fail(INV, "out: B*H*L overflows 64 bits");
  const int32_t id = out->device_id;
  SPARGE_TRY(check_merge_tensor(out, "out", 4, false, dev, id, shape));
  SPARGE_TRY(check_no_repeats(out, "out", 4));
  if (lse_out) {
    SPARGE_TRY(check_merge_tensor(lse_out, "lse_out", 3, true, dev, id, shape));
    SPARGE_TRY(check_no_repeats(lse_out, "lse_out", 3));
  }
  char name[32];
  for (int32_t i = 0; i < count; ++i) {
    std::snprintf(name, sizeof name, "outs[%d]", int(i));
    SPARGE_TRY(check_merge_tensor(&outs[i], name, 4, false, dev, id, shape));
    std::snprintf(name, sizeof name, "lses[%d]", int(i));
    SPARGE_TRY(check_merge_tensor(&lses[i], name, 3, true, dev, id, shape));
  }

  MergeArgs a;
  a.count = count;
  for (int d = 0; d < 4; ++d) a.shape[d] = shape[d];
  for (int32_t i = 0; i < count; ++i) {
    MergeInput& in = a.in[i];
    in.data = outs[i].data;
    in.dtype = outs[i].dtype;
    for (int d = 0; d < 4; ++d) in.stride[d] = outs[i].strides[d];
    in.lse = static_cast<const float*>(lses[i].data);
    for (int d = 0; d < 3; ++d) in.lse_stride[d] = lses[i].strides[d];
  }
  a.out = out->data;
  a.out_dtype = out->dtype;
  for (int d = 0; d < 4; ++d) a.out_stride[d] = out->strides[d];
  if (lse_out) {
    a.lse_out = static_cast<float*>(lse_out->data);
    for (int d = 0; d < 3; ++d) a.lse_out_stride[d] = lse_out->strides[d];
  }
  if (dev == SPARGE_DEVICE_CUDA) return cuda::merge_states(a, id, stream);
  return cpu::merge_states(a);
}

}  // namespace

extern "C" SPARGE_API sparge_status_t sparge_merge_states(int32_t count, const sparge_tensor_t* outs,
                                                          const sparge_tensor_t* lses, const sparge_tensor_t* out,
                                                          const sparge_tensor_t* lse_out, void* stream) {
  try {
    const sparge_status_t st = merge_impl(count, outs, lses, out, lse_out, stream);
    if (st == SPARGE_OK) clear_error();
    return st;
  } catch (const std::bad_alloc&) {
    return fail(SPARGE_ERR_OUT_OF_MEMORY, "sparge_merge_states: out of host memory");
  } catch (const std::exception& e) {
    return fail(SPARGE_ERR_INTERNAL, "sparge_merge_states: internal error: %s", e.what());
  } catch (...) {
    return fail(SPARGE_ERR_INTERNAL, "sparge_merge_states: internal error (unknown exception)");
  }
}
