// Argument validation of the C entry points: problem -> Problem, tensors ->
// views, params -> PredictConfig, workspace. Every failure sets the thread-local
// message naming the argument and the expected value, and nothing is written
// to the caller's outputs.
#pragma once
#include <cstdint>
#include <cstring>

#include "core/backend.hpp"
#include "core/error.hpp"

namespace sparge {
namespace api {

// The integer a C caller stored in an enum-typed field. A C program may store any
// int there, and in C++ loading an enum object whose value lies outside the
// enumeration's range is undefined; reading the bytes as an integer is not.
template <class E>
inline int32_t raw_enum(const E& e) {
  static_assert(sizeof(E) == sizeof(int32_t), "C enums of the ABI are 32-bit");
  int32_t v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

const char* dtype_name(int dtype);
const char* device_name(int device);
size_t dtype_size(sparge_dtype_t dtype);

// Validates `in` (already known non-NULL), resolves defaults, checks that every
// size derived from it fits in 64 bits. Does not touch the device.
sparge_status_t resolve_problem(const sparge_problem_t& in, Problem* out);

// What a tensor argument must look like.
struct TensorSpec {
  const char* name;       // argument name used in messages ("q", "mask_out", ...)
  sparge_dtype_t dtype;
  int ndim;
  int64_t shape[4];
  const char* dim_names[4];  // e.g. {"B", "Hq", "Lq", "D"}
  bool unit_last;            // the last dimension must have stride 1
};

// Validates one tensor against the plan and `spec`. query_pointer = false
// skips the driver query of where t->data lives (CUDA plans; see
// cuda::call_known): every other check runs.
sparge_status_t check_tensor(const Plan& plan, const sparge_tensor_t* t, const TensorSpec& spec,
                             bool query_pointer = true);

TensorSpec spec_q(const Plan& plan, const char* name);    // [B, Hq, Lq, D], plan dtype
TensorSpec spec_kv(const Plan& plan, const char* name);   // [B, Hkv, Lkv, D], plan dtype
TensorSpec spec_mask(const Plan& plan, const char* name); // uint8 [B, Hq, nQB, nKB]
TensorSpec spec_lse(const Plan& plan, const char* name);  // float32 [B, Hq, Lq]
TensorSpec spec_kept(const Plan& plan, const char* name); // int32 [B, Hq]

Tensor4 to_tensor4(const sparge_tensor_t& t);
MaskView to_mask(const sparge_tensor_t& t);
LseView to_lse(const sparge_tensor_t& t);
KeptView to_kept(const sparge_tensor_t& t);

// params == NULL gives the defaults of SPARGE_PREDICT_PARAMS_INIT.
// query_pointers as in check_tensor (the per-head arrays).
sparge_status_t read_params(const Plan& plan, const sparge_predict_params_t* params, PredictConfig* cfg,
                            bool query_pointers = true);

sparge_status_t check_workspace(const Plan& plan, const void* workspace, size_t workspace_bytes,
                                bool query_pointer = true);

// The key of a sparge_attention_run call on a CUDA plan (core/backend.hpp),
// from the caller's descriptors as given (any of them may be NULL or invalid:
// the key only has to be equal for equal arguments).
void attention_call_key(const sparge_tensor_t* q, const sparge_tensor_t* k, const sparge_tensor_t* v,
                        const sparge_tensor_t* mask, const sparge_predict_params_t* params,
                        const sparge_tensor_t* out, const sparge_tensor_t* lse, const void* workspace,
                        AttnCallKey* key);

// Memory overlap, after every argument has been validated: an output whose
// strides alias its own elements, an output whose byte range [first, last]
// intersects any other tensor argument's, or a workspace (its first
// sparge_plan_workspace_size bytes) intersecting any tensor argument are
// INVALID_ARGUMENT. Inputs may overlap each other. At most 8 inputs, 4 outputs.
struct NamedTensor {
  const char* name;
  const sparge_tensor_t* t;
};
sparge_status_t check_overlap(const Plan& plan, const NamedTensor* inputs, int n_inputs, const NamedTensor* outputs,
                              int n_outputs, const void* workspace);

}  // namespace api
}  // namespace sparge
