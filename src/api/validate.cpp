#include "api/validate.hpp"

#include "core/kernel_traits.hpp"

#include <cinttypes>
#include <cstddef>
#include <cmath>
#include <initializer_list>
#include <utility>

namespace sparge {
namespace api {
namespace {

constexpr uint64_t kMaxBytes = uint64_t(INT64_MAX);

// Product of non-negative factors; false when it exceeds INT64_MAX.
bool checked_product(std::initializer_list<uint64_t> factors, uint64_t* out) {
  uint64_t r = 1;
  for (uint64_t f : factors) {
    if (__builtin_mul_overflow(r, f, &r)) return false;
  }
  if (r > kMaxBytes) return false;
  *out = r;
  return true;
}

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

bool is_attention_dtype(int dt) {
  return dt == SPARGE_DTYPE_FLOAT16 || dt == SPARGE_DTYPE_BFLOAT16 || dt == SPARGE_DTYPE_FLOAT32;
}

}  // namespace

const char* dtype_name(int dtype) {
  switch (dtype) {
    case SPARGE_DTYPE_FLOAT16: return "FLOAT16";
    case SPARGE_DTYPE_BFLOAT16: return "BFLOAT16";
    case SPARGE_DTYPE_FLOAT32: return "FLOAT32";
    case SPARGE_DTYPE_UINT8: return "UINT8";
    case SPARGE_DTYPE_INT32: return "INT32";
    default: return "unknown dtype";
  }
}

const char* device_name(int device) {
  switch (device) {
    case SPARGE_DEVICE_CPU: return "CPU";
    case SPARGE_DEVICE_CUDA: return "CUDA";
    default: return "unknown device";
  }
}

size_t dtype_size(sparge_dtype_t dtype) {
  switch (dtype) {
    case SPARGE_DTYPE_FLOAT16:
    case SPARGE_DTYPE_BFLOAT16: return 2;
    case SPARGE_DTYPE_UINT8: return 1;
    default: return 4;
  }
}

sparge_status_t resolve_problem(const sparge_problem_t& in, Problem* out) {
  const sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT, UNS = SPARGE_ERR_UNSUPPORTED;
  if (in.struct_size < sizeof(sparge_problem_t))
    return fail(INV, "problem->struct_size is %zu, expected >= %zu (sizeof(sparge_problem_t); use SPARGE_PROBLEM_INIT)",
                in.struct_size, sizeof(sparge_problem_t));
  const struct {
    const char* name;
    int64_t v;
  } sizes[] = {{"batch", in.batch},     {"heads_q", in.heads_q}, {"heads_kv", in.heads_kv},
               {"len_q", in.len_q},     {"len_kv", in.len_kv},   {"head_dim", in.head_dim}};
  for (const auto& s : sizes)
    if (s.v < 1) return fail(INV, "problem->%s is %" PRId64 ", expected >= 1", s.name, s.v);
  if (in.heads_q % in.heads_kv != 0)
    return fail(INV, "problem->heads_q (%" PRId64 ") must be a multiple of problem->heads_kv (%" PRId64 ")",
                in.heads_q, in.heads_kv);
  const int32_t device_type = raw_enum(in.device_type), dtype = raw_enum(in.dtype),
                precision = raw_enum(in.precision);
  if (device_type != SPARGE_DEVICE_CPU && device_type != SPARGE_DEVICE_CUDA)
    return fail(INV, "problem->device_type is %d, expected SPARGE_DEVICE_CPU (0) or SPARGE_DEVICE_CUDA (1)",
                int(device_type));
  const bool gpu = device_type == SPARGE_DEVICE_CUDA;
  if (in.device_id < 0) return fail(INV, "problem->device_id is %d, expected >= 0", int(in.device_id));
  if (!gpu && in.device_id != 0)
    return fail(INV, "problem->device_id is %d, expected 0 for a CPU plan (host memory has the one device id 0)",
                int(in.device_id));
  if (!is_attention_dtype(dtype))
    return fail(INV, "problem->dtype is %s (%d), expected FLOAT16, BFLOAT16 or FLOAT32", dtype_name(dtype),
                int(dtype));
  if (gpu && dtype == SPARGE_DTYPE_FLOAT32)
    return fail(UNS, "problem->dtype is FLOAT32: CUDA plans support FLOAT16 or BFLOAT16");
  if (precision != SPARGE_PRECISION_INT8_FP8 && precision != SPARGE_PRECISION_FP16 &&
      precision != SPARGE_PRECISION_EXACT && precision != SPARGE_PRECISION_INT8_FP8_SPLIT_V &&
      precision != SPARGE_PRECISION_INT8_FP16 && precision != SPARGE_PRECISION_AUTO)
    return fail(INV,
                "problem->precision is %d, expected INT8_FP8 (0), FP16 (1), EXACT (2), INT8_FP8_SPLIT_V (3), "
                "INT8_FP16 (4) or AUTO (5)",
                int(precision));
  if (gpu && precision == SPARGE_PRECISION_EXACT)
    return fail(UNS,
                "problem->precision is EXACT: CUDA plans support INT8_FP8, INT8_FP8_SPLIT_V, INT8_FP16 or FP16 (EXACT "
                "is CPU only)");
  if (gpu && !gpu_head_dim_supported(in.head_dim))
    return fail(UNS, "problem->head_dim is %" PRId64 ": CUDA plans support 64, 96, 128 or 256", in.head_dim);
  if (!gpu && in.head_dim > 256)
    return fail(UNS, "problem->head_dim is %" PRId64 ": CPU plans support 1..256", in.head_dim);
  if (!std::isfinite(in.scale) || in.scale < 0.0f)
    return fail(INV, "problem->scale is %g, expected a finite value >= 0 (0 means 1/sqrt(head_dim))",
                double(in.scale));
  const struct {
    const char* name;
    int32_t v;
    int32_t dflt;
  } blocks[] = {{"block_q", in.block_q, kGpuBlockQ}, {"block_k", in.block_k, kGpuBlockK}};
  // Both signs first, then both ranges: the order of the bad-input catalogue.
  for (const auto& bl : blocks)
    if (bl.v < 0) return fail(INV, "problem->%s is %d, expected 0 (default %d) or a positive size", bl.name, bl.v, bl.dflt);
  for (const auto& bl : blocks) {
    const int32_t r = bl.v == 0 ? bl.dflt : bl.v;
    if (gpu && r != bl.dflt)
      return fail(UNS, "problem->%s is %d: CUDA plans support only %d (or 0 for the default)", bl.name, bl.v, bl.dflt);
    if (!gpu && r > 1024) return fail(UNS, "problem->%s is %d: CPU plans support 1..1024", bl.name, bl.v);
  }

  Problem p;
  p.B = in.batch;
  p.Hq = in.heads_q;
  p.Hkv = in.heads_kv;
  p.Lq = in.len_q;
  p.Lkv = in.len_kv;
  p.D = in.head_dim;
  p.Dk = gpu ? gpu_kernel_head_dim(in.head_dim) : in.head_dim;
  p.dtype = sparge_dtype_t(dtype);
  p.device = sparge_device_type_t(device_type);
  p.device_id = in.device_id;
  p.precision_is_auto = precision == SPARGE_PRECISION_AUTO;
  // AUTO resolves here with the int8 family's rule; cuda::check_device turns
  // it to FP16 on a device without the sm_90a kernels.
  p.precision = p.precision_is_auto ? auto_precision(p.Lq, p.Lkv, p.D, true) : sparge_precision_t(precision);
  p.causal = in.causal != 0;
  p.scale = in.scale == 0.0f ? float(1.0 / std::sqrt(double(in.head_dim))) : in.scale;
  p.BQ = in.block_q == 0 ? kGpuBlockQ : in.block_q;
  p.BK = in.block_k == 0 ? kGpuBlockK : in.block_k;
  p.nQB = ceil_div(p.Lq, p.BQ);
  p.nKB = ceil_div(p.Lkv, p.BK);

  // Every byte count derived from the problem must fit in 64 bits.
  const uint64_t B = uint64_t(p.B), Hq = uint64_t(p.Hq), Hkv = uint64_t(p.Hkv), Lq = uint64_t(p.Lq),
                 Lkv = uint64_t(p.Lkv), D = uint64_t(p.D), nQB = uint64_t(p.nQB), nKB = uint64_t(p.nKB);
  const uint64_t es = dtype_size(p.dtype);
  uint64_t tmp = 0;
  bool ok = checked_product({B, Hq, Lq, D, es}, &tmp) && checked_product({B, Hkv, Lkv, D, es}, &tmp) &&
            checked_product({B, Hq, nQB, nKB}, &tmp) && checked_product({B, Hq, Lq, 4}, &tmp) &&
            checked_product({nQB, uint64_t(p.BQ)}, &tmp) && checked_product({nKB, uint64_t(p.BK)}, &tmp);
  if (gpu) ok = ok && checked_product({nQB, uint64_t(kGpuBlockQ)}, &tmp) && checked_product({nKB, uint64_t(kGpuBlockK)}, &tmp);
  // The workspace layout checks its own byte counts (the same function plans use).
  const bool ws_overflow = ok && plan_workspace(p).overflow;
  if (!ok || ws_overflow)
    return fail(INV,
                "problem sizes overflow 64-bit byte counts (batch=%" PRId64 ", heads_q=%" PRId64 ", heads_kv=%" PRId64
                ", len_q=%" PRId64 ", len_kv=%" PRId64 ", head_dim=%" PRId64 ")",
                p.B, p.Hq, p.Hkv, p.Lq, p.Lkv, p.D);
  *out = p;
  return SPARGE_OK;
}

// ---------------------------------------------------------------- tensors
TensorSpec spec_q(const Plan& plan, const char* name) {
  const Problem& p = plan.prob;
  return TensorSpec{name, p.dtype, 4, {p.B, p.Hq, p.Lq, p.D}, {"B", "Hq", "Lq", "D"}, true};
}
TensorSpec spec_kv(const Plan& plan, const char* name) {
  const Problem& p = plan.prob;
  return TensorSpec{name, p.dtype, 4, {p.B, p.Hkv, p.Lkv, p.D}, {"B", "Hkv", "Lkv", "D"}, true};
}
TensorSpec spec_mask(const Plan& plan, const char* name) {
  const Problem& p = plan.prob;
  return TensorSpec{name, SPARGE_DTYPE_UINT8, 4, {p.B, p.Hq, p.nQB, p.nKB}, {"B", "Hq", "nQB", "nKB"}, false};
}
TensorSpec spec_lse(const Plan& plan, const char* name) {
  const Problem& p = plan.prob;
  return TensorSpec{name, SPARGE_DTYPE_FLOAT32, 3, {p.B, p.Hq, p.Lq, 0}, {"B", "Hq", "Lq", ""}, false};
}
TensorSpec spec_kept(const Plan& plan, const char* name) {
  const Problem& p = plan.prob;
  return TensorSpec{name, SPARGE_DTYPE_INT32, 2, {p.B, p.Hq, 0, 0}, {"B", "Hq", "", ""}, false};
}

sparge_status_t check_tensor(const Plan& plan, const sparge_tensor_t* t, const TensorSpec& s, bool query_pointer) {
  const sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT;
  const Problem& p = plan.prob;
  if (!t) return fail(INV, "%s is NULL, expected a tensor descriptor", s.name);
  if (!t->data) return fail(INV, "%s->data is NULL, expected a pointer to %s memory", s.name, device_name(p.device));
  const int32_t t_device = raw_enum(t->device_type), t_dtype = raw_enum(t->dtype);
  if (t_device != p.device)
    return fail(INV, "%s->device_type is %s (%d), expected %s (the plan's device)", s.name, device_name(t_device),
                int(t_device),
                device_name(p.device));
  if (t->device_id != p.device_id)
    return fail(INV, "%s->device_id is %d, expected %d (the plan's device_id)", s.name, int(t->device_id), p.device_id);
  if (t_dtype != s.dtype)
    return fail(INV, "%s->dtype is %s (%d), expected %s", s.name, dtype_name(t_dtype), int(t_dtype),
                dtype_name(s.dtype));
  if (t->ndim != s.ndim) return fail(INV, "%s->ndim is %d, expected %d", s.name, int(t->ndim), s.ndim);
  for (int d = 0; d < s.ndim; ++d)
    if (t->shape[d] != s.shape[d])
      return fail(INV, "%s->shape[%d] is %" PRId64 ", expected %" PRId64 " (%s of the plan)", s.name, d, t->shape[d],
                  s.shape[d], s.dim_names[d]);
  uint64_t last = 0;  // largest element offset
  for (int d = 0; d < s.ndim; ++d) {
    const int64_t st = t->strides[d];
    if (st < 0) return fail(INV, "%s->strides[%d] is %" PRId64 ", expected >= 1 (negative strides are not supported)",
                            s.name, d, st);
    if (s.unit_last && d == s.ndim - 1 && st != 1)
      return fail(INV, "%s->strides[%d] is %" PRId64 ", expected 1 (the head dimension must be contiguous)", s.name, d,
                  st);
    if (st == 0 && t->shape[d] > 1)
      return fail(INV, "%s->strides[%d] is 0, expected >= 1 (dimension %d has extent %" PRId64 ")", s.name, d, d,
                  t->shape[d]);
    uint64_t term = 0;
    if (__builtin_mul_overflow(uint64_t(t->shape[d] - 1), uint64_t(st), &term) ||
        __builtin_add_overflow(last, term, &last) || last > kMaxBytes)
      return fail(INV, "%s: the extent given by its shape and strides overflows 64 bits", s.name);
  }
  uint64_t bytes = 0;
  if (!checked_product({last + 1, uint64_t(dtype_size(s.dtype))}, &bytes))
    return fail(INV, "%s: the extent given by its shape and strides overflows 64 bits", s.name);
  if (p.device == SPARGE_DEVICE_CUDA && query_pointer)
    SPARGE_TRY(cuda::pointer_on_device(t->data, p.device_id, s.name));
  return SPARGE_OK;
}

Tensor4 to_tensor4(const sparge_tensor_t& t) {
  Tensor4 r;
  r.data = t.data;
  r.dtype = t.dtype;
  for (int d = 0; d < 4; ++d) {
    r.shape[d] = t.shape[d];
    r.stride[d] = t.strides[d];
  }
  return r;
}

MaskView to_mask(const sparge_tensor_t& t) {
  MaskView m;
  m.data = static_cast<uint8_t*>(t.data);
  for (int d = 0; d < 4; ++d) m.stride[d] = t.strides[d];
  return m;
}

LseView to_lse(const sparge_tensor_t& t) {
  LseView l;
  l.data = static_cast<float*>(t.data);
  for (int d = 0; d < 3; ++d) l.stride[d] = t.strides[d];
  return l;
}

KeptView to_kept(const sparge_tensor_t& t) {
  KeptView k;
  k.data = static_cast<int32_t*>(t.data);
  k.stride[0] = t.strides[0];
  k.stride[1] = t.strides[1];
  return k;
}

// ---------------------------------------------------------------- params
namespace {
bool in_unit_interval(float x) { return x > 0.0f && x <= 1.0f; }  // false for NaN

sparge_status_t check_per_head(const Plan& plan, const float* arr, const char* name, bool unit_interval,
                               bool query_pointer) {
  if (!arr) return SPARGE_OK;
  const Problem& p = plan.prob;
  if (p.device == SPARGE_DEVICE_CUDA)
    return query_pointer ? cuda::pointer_on_device(arr, p.device_id, name) : SPARGE_OK;
  for (int64_t h = 0; h < p.Hq; ++h) {
    const float x = arr[h];
    if (unit_interval ? !in_unit_interval(x) : std::isnan(x))
      return fail(SPARGE_ERR_INVALID_ARGUMENT, "params->%s[%" PRId64 "] is %g, expected %s", name, h, double(x),
                  unit_interval ? "a value in (0, 1]" : "a number (not NaN)");
  }
  return SPARGE_OK;
}
}  // namespace

sparge_status_t read_params(const Plan& plan, const sparge_predict_params_t* params, PredictConfig* cfg,
                            bool query_pointers) {
  const sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT;
  const sparge_predict_params_t defaults = SPARGE_PREDICT_PARAMS_INIT;
  const sparge_predict_params_t& in = params ? *params : defaults;
  // 0.1 layout: up to pv_threshold; 0.2 adds local_window and estimator.
  const size_t v1_size = offsetof(sparge_predict_params_t, local_window);
  const bool has_v2 = in.struct_size >= sizeof(sparge_predict_params_t);
  if (in.struct_size < v1_size)
    return fail(INV,
                "params->struct_size is %zu, expected >= %zu (sizeof(sparge_predict_params_t); use "
                "SPARGE_PREDICT_PARAMS_INIT)",
                in.struct_size, sizeof(sparge_predict_params_t));
  const int32_t window = has_v2 ? in.local_window : -1;
  const int32_t estimator = has_v2 ? raw_enum(in.estimator) : int32_t(defaults.estimator);
  if (window < -1 || window > 1024)
    return fail(INV, "params->local_window is %d, expected -1 (default of the mode), 0 (off) or 1..1024",
                int(window));
  if (estimator != SPARGE_ESTIMATOR_MEAN && estimator != SPARGE_ESTIMATOR_KEYS_LSE &&
      estimator != SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2 && estimator != SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE &&
      estimator != SPARGE_ESTIMATOR_AUTO)
    return fail(INV,
                "params->estimator is %d, expected SPARGE_ESTIMATOR_MEAN (0), SPARGE_ESTIMATOR_KEYS_LSE (1), "
                "SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2 (2), SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE (3) or "
                "SPARGE_ESTIMATOR_AUTO (4, the default of the mode)",
                int(estimator));
  const int32_t mode = raw_enum(in.mode);
  if (mode != SPARGE_SELECT_TOPK && mode != SPARGE_SELECT_CDF)
    return fail(INV, "params->mode is %d, expected SPARGE_SELECT_TOPK (0) or SPARGE_SELECT_CDF (1)", int(mode));
  if (mode == SPARGE_SELECT_TOPK && !in_unit_interval(in.topk))
    return fail(INV, "params->topk is %g, expected a value in (0, 1]", double(in.topk));
  if (mode == SPARGE_SELECT_CDF && !in_unit_interval(in.cdf_threshold))
    return fail(INV, "params->cdf_threshold is %g, expected a value in (0, 1]", double(in.cdf_threshold));
  if (std::isnan(in.sim_threshold)) return fail(INV, "params->sim_threshold is NaN, expected a number");
  if (!std::isfinite(in.pv_threshold) || in.pv_threshold < 0.0f)
    return fail(INV, "params->pv_threshold is %g, expected 0 (off) or a finite positive value (natural-log units)",
                double(in.pv_threshold));
  if (in.pv_threshold > 0.0f && plan.prob.precision == SPARGE_PRECISION_EXACT)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "params->pv_threshold is %g: the PV skip has no EXACT form (the float64 reference computes every "
                "kept key), expected 0 with SPARGE_PRECISION_EXACT",
                double(in.pv_threshold));
  if (in.pv_threshold > 0.0f && plan.prob.device == SPARGE_DEVICE_CUDA)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "params->pv_threshold is %g: the CUDA kernels have no PV skip in this release (the CPU backend has "
                "it; docs/SEMANTICS.md, \"PV skip\"), expected 0 on a CUDA plan",
                double(in.pv_threshold));
  if (mode == SPARGE_SELECT_TOPK)
    SPARGE_TRY(check_per_head(plan, in.topk_per_head, "topk_per_head", true, query_pointers));
  if (mode == SPARGE_SELECT_CDF)
    SPARGE_TRY(check_per_head(plan, in.cdf_threshold_per_head, "cdf_threshold_per_head", true, query_pointers));
  SPARGE_TRY(check_per_head(plan, in.sim_threshold_per_head, "sim_threshold_per_head", false, query_pointers));

  PredictConfig c;
  c.mode = sparge_select_mode_t(mode);
  c.topk = in.topk;
  c.cdf_threshold = in.cdf_threshold;
  c.sim_threshold = in.sim_threshold;
  c.smooth_k = in.smooth_k != 0;
  const bool causal = plan.prob.causal;
  c.attention_sink = in.attention_sink == -1 ? default_sink(causal) : in.attention_sink != 0;
  c.local_window = window == -1 ? default_local_window(causal) : window;
  c.estimator = estimator == SPARGE_ESTIMATOR_AUTO ? default_estimator(causal) : sparge_estimator_t(estimator);
  c.topk_per_head = mode == SPARGE_SELECT_TOPK ? in.topk_per_head : nullptr;
  c.cdf_per_head = mode == SPARGE_SELECT_CDF ? in.cdf_threshold_per_head : nullptr;
  c.sim_per_head = in.sim_threshold_per_head;
  c.pv_threshold = in.pv_threshold > 0.0f ? in.pv_threshold : 0.0f;  // -0 is off
  *cfg = c;
  return SPARGE_OK;
}

sparge_status_t check_workspace(const Plan& plan, const void* workspace, size_t workspace_bytes,
                                bool query_pointer) {
  const size_t need = plan.ws.total;
  if (!workspace && workspace_bytes > 0)
    return fail(SPARGE_ERR_INVALID_ARGUMENT, "workspace is NULL but workspace_bytes is %zu, expected a pointer",
                workspace_bytes);
  if (workspace_bytes < need)
    return fail(SPARGE_ERR_WORKSPACE_TOO_SMALL,
                "workspace_bytes is %zu, expected >= %zu (sparge_plan_workspace_size): needed %zu bytes, given %zu",
                workspace_bytes, need, need, workspace_bytes);
  const size_t align = plan.prob.device == SPARGE_DEVICE_CUDA ? 256 : 16;
  if (need > 0 && (reinterpret_cast<uintptr_t>(workspace) % align) != 0)
    return fail(SPARGE_ERR_INVALID_ARGUMENT, "workspace is not %zu-byte aligned, expected a %zu-byte aligned pointer",
                align, align);
  // Host memory that happens to be 256-byte aligned must not reach a kernel.
  if (need > 0 && plan.prob.device == SPARGE_DEVICE_CUDA && query_pointer)
    SPARGE_TRY(cuda::pointer_on_device(workspace, plan.prob.device_id, "workspace"));
  return SPARGE_OK;
}

namespace {
void key_tensor(const sparge_tensor_t* t, AttnCallKey::Tensor* o) {
  std::memset(o, 0, sizeof *o);
  if (!t) return;
  o->data = t->data;
  o->device_type = raw_enum(t->device_type);
  o->device_id = t->device_id;
  o->dtype = raw_enum(t->dtype);
  o->ndim = t->ndim;
  const int n = t->ndim < 0 ? 0 : (t->ndim > SPARGE_MAX_DIMS ? SPARGE_MAX_DIMS : t->ndim);
  for (int d = 0; d < n; ++d) {
    o->shape[d] = t->shape[d];
    o->strides[d] = t->strides[d];
  }
}
}  // namespace

void attention_call_key(const sparge_tensor_t* q, const sparge_tensor_t* k, const sparge_tensor_t* v,
                        const sparge_tensor_t* mask, const sparge_predict_params_t* params,
                        const sparge_tensor_t* out, const sparge_tensor_t* lse, const void* workspace,
                        AttnCallKey* key) {
  static_assert(sizeof(AttnCallKey::Tensor) == 88 && sizeof(AttnCallKey) == 6 * 88 + 6 * 8,
                "the call key is plain bytes without padding");
  key_tensor(q, &key->q);
  key_tensor(k, &key->k);
  key_tensor(v, &key->v);
  key_tensor(out, &key->out);
  key_tensor(mask, &key->mask);
  key_tensor(lse, &key->lse);
  key->workspace = workspace;
  // The per-head arrays lie in the 0.1 layout; a shorter struct fails read_params.
  const bool heads = params && params->struct_size >= offsetof(sparge_predict_params_t, local_window);
  key->per_head[0] = heads ? params->topk_per_head : nullptr;
  key->per_head[1] = heads ? params->cdf_threshold_per_head : nullptr;
  key->per_head[2] = heads ? params->sim_threshold_per_head : nullptr;
  // (as the backend decides from the validated params; a call whose params fail validation
  // never reaches it)
  key->dense = mask == nullptr && heads &&
               keeps_every_block(int32_t(params->mode), params->topk, params->topk_per_head);
  // FNV-1a over the 64-bit words before `hash`.
  uint64_t h = 1469598103934665603ull, w = 0;
  const unsigned char* b = reinterpret_cast<const unsigned char*>(key);
  for (size_t i = 0; i < offsetof(AttnCallKey, hash); i += 8) {
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  key->hash = h;
}

}  // namespace api
}  // namespace sparge

namespace sparge {
namespace api {

namespace {

// Bytes [lo, hi) that a validated tensor spans (first to last byte addressed).
struct Span {
  const char* name;
  uintptr_t lo, hi;
};

Span span_of(const char* name, const sparge_tensor_t& t) {
  uint64_t last = 0;
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] > 1) last += uint64_t(t.shape[d] - 1) * uint64_t(t.strides[d]);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data);
  return {name, lo, lo + uintptr_t((last + 1) * dtype_size(t.dtype))};
}

bool intersect(const Span& a, const Span& b) { return a.lo < b.hi && b.lo < a.hi; }

// Whether distinct indices of a validated tensor always address distinct
// elements, by the sufficient rule: ordered by stride, each dimension's stride
// exceeds the largest offset that the smaller-strided dimensions reach. Every
// permutation of a dense layout, with or without padding, passes.
bool self_disjoint(const sparge_tensor_t& t) {
  int dims[4];
  int n = 0;
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] > 1) dims[n++] = d;
  for (int i = 1; i < n; ++i)  // insertion sort by stride (n <= 4)
    for (int j = i; j > 0 && t.strides[dims[j]] < t.strides[dims[j - 1]]; --j) std::swap(dims[j], dims[j - 1]);
  uint64_t reach = 0;  // largest offset of the dimensions so far
  for (int i = 0; i < n; ++i) {
    const int d = dims[i];
    if (uint64_t(t.strides[d]) <= reach) return false;
    reach += uint64_t(t.shape[d] - 1) * uint64_t(t.strides[d]);
  }
  return true;
}

}  // namespace

sparge_status_t check_overlap(const Plan& plan, const NamedTensor* inputs, int n_inputs, const NamedTensor* outputs,
                              int n_outputs, const void* workspace) {
  Span in[8], out[4];
  for (int i = 0; i < n_inputs; ++i) in[i] = span_of(inputs[i].name, *inputs[i].t);
  for (int o = 0; o < n_outputs; ++o) {
    const sparge_tensor_t& t = *outputs[o].t;
    if (!self_disjoint(t))
      return fail(SPARGE_ERR_INVALID_ARGUMENT,
                  "%s: its strides make distinct elements share memory; an output must not overlap itself",
                  outputs[o].name);
    out[o] = span_of(outputs[o].name, t);
    for (int i = 0; i < n_inputs; ++i)
      if (intersect(out[o], in[i]))
        return fail(SPARGE_ERR_INVALID_ARGUMENT,
                    "%s overlaps %s in memory (bytes %p..%p and %p..%p); outputs must not share memory with any other "
                    "argument",
                    out[o].name, in[i].name, reinterpret_cast<void*>(out[o].lo), reinterpret_cast<void*>(out[o].hi),
                    reinterpret_cast<void*>(in[i].lo), reinterpret_cast<void*>(in[i].hi));
    for (int p = 0; p < o; ++p)
      if (intersect(out[o], out[p]))
        return fail(SPARGE_ERR_INVALID_ARGUMENT, "%s overlaps %s in memory; outputs must not share memory",
                    out[o].name, out[p].name);
  }
  if (workspace != nullptr && plan.ws.total > 0) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(workspace);
    const Span ws{"workspace", lo, lo + uintptr_t(plan.ws.total)};
    for (int i = 0; i < n_inputs + n_outputs; ++i) {
      const Span& s = i < n_inputs ? in[i] : out[i - n_inputs];
      if (intersect(ws, s))
        return fail(SPARGE_ERR_INVALID_ARGUMENT,
                    "workspace overlaps %s in memory (its first %zu bytes, sparge_plan_workspace_size, must not share "
                    "memory with any tensor argument)",
                    s.name, size_t(plan.ws.total));
    }
  }
  return SPARGE_OK;
}

}  // namespace api
}  // namespace sparge
