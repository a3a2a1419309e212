// The C entry points of sparge.h: validation, handles, dispatch. No math.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>

#include "api/validate.hpp"
#include "core/backend.hpp"
#include "core/error.hpp"
#include "core/kernel_traits.hpp"

using namespace sparge;

namespace {

// Runs `body` so that no C++ exception crosses the C ABI; success clears the
// thread-local message.
template <class F>
sparge_status_t guarded(const char* fn, F&& body) {
  try {
    const sparge_status_t st = body();
    if (st == SPARGE_OK) clear_error();
    return st;
  } catch (const std::bad_alloc&) {
    return fail(SPARGE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  } catch (const std::exception& e) {
    return fail(SPARGE_ERR_INTERNAL, "%s: internal error: %s", fn, e.what());
  } catch (...) {
    return fail(SPARGE_ERR_INTERNAL, "%s: internal error (unknown exception)", fn);
  }
}

using u128 = unsigned __int128;

// sum_{i=0}^{n-1} floor((a*i + b) / m) for a, b >= 0, m >= 1, in O(log) steps.
// Every term added is part of the (non-negative) result, and a, m <= 1024, so no
// intermediate exceeds 128 bits when the result fits in 64.
u128 floor_sum(u128 n, u128 m, u128 a, u128 b) {
  u128 ans = 0;
  for (;;) {
    if (a >= m) {
      ans += n * (n - 1) / 2 * (a / m);
      a %= m;
    }
    if (b >= m) {
      ans += n * (b / m);
      b %= m;
    }
    const u128 y_max = a * n + b;
    if (y_max < m) break;
    n = y_max / m;
    b = y_max % m;
    const u128 t = m;
    m = a;
    a = t;
  }
  return ans;
}

// sum over query blocks of visible_key_blocks(p, qb), without a loop over nQB
// (which may be ~2^60 for a valid plan). Query block qb < nQB - 1 sees keys up to
// qb*BQ + c, c = BQ - 1 + Lkv - Lq, never beyond Lkv - 2; only the last block can
// be clipped at Lq - 1, so it is counted apart.
int64_t total_visible_blocks(const Problem& p) {
  if (!p.causal) return p.nQB * p.nKB;  // fits: checked in sparge_create_plan
  const int64_t c = int64_t(p.BQ) - 1 + (p.Lkv - p.Lq);
  const int64_t qb0 = c >= 0 ? 0 : (-c + p.BQ - 1) / p.BQ;  // first block that sees a key
  u128 total = u128(visible_key_blocks(p, p.nQB - 1));
  if (qb0 < p.nQB - 1) {
    const int64_t n = p.nQB - 1 - qb0;
    total += floor_sum(u128(n), u128(p.BK), u128(p.BQ), u128(qb0 * p.BQ + c)) + u128(n);
  }
  return int64_t(total);  // <= nQB * nKB, which fits
}

sparge_status_t check_plan(sparge_plan_t plan) {
  if (!plan) return fail(SPARGE_ERR_INVALID_ARGUMENT, "plan is NULL, expected a plan from sparge_create_plan");
  return SPARGE_OK;
}

}  // namespace

extern "C" {

SPARGE_API sparge_status_t sparge_create_plan(const sparge_problem_t* problem, sparge_plan_t* out) {
  return guarded("sparge_create_plan", [&]() -> sparge_status_t {
    if (!out) return fail(SPARGE_ERR_INVALID_ARGUMENT, "out is NULL, expected a pointer to receive the plan");
    *out = nullptr;
    if (!problem) return fail(SPARGE_ERR_INVALID_ARGUMENT, "problem is NULL, expected a sparge_problem_t");
    Problem p;
    SPARGE_TRY(api::resolve_problem(*problem, &p));
    int sm = 0, sms = 0;
    const void* kernel = nullptr;
    if (p.device == SPARGE_DEVICE_CUDA) {
      if (!cuda::built())
        return fail(SPARGE_ERR_NO_DEVICE,
                    "problem->device_type is CUDA but libsparge was built without CUDA (sparge_has_cuda() == 0)");
      const sparge_status_t st = cuda::check_device(p, &sm, &sms, &kernel);
      if (st != SPARGE_OK) {  // name the argument the device comes from
        char why[1024];  // copied: fail() rewrites the message it is formatted from
        std::snprintf(why, sizeof(why), "%s", last_error_text());
        return fail(st, "problem->device_type is CUDA, problem->device_id %d: %s", p.device_id, why);
      }
    }
    std::unique_ptr<sparge_plan> plan(new sparge_plan);
    plan->prob = p;
    plan->ws = plan_workspace(p);
    plan->sm_version = sm;
    plan->sm_count = sms;
    plan->kernel = kernel;
    if (p.device == SPARGE_DEVICE_CUDA) plan->call_cache = cuda::create_call_cache();
    *out = plan.release();
    return SPARGE_OK;
  });
}

SPARGE_API sparge_status_t sparge_plan_workspace_size(sparge_plan_t plan, size_t* bytes) {
  return guarded("sparge_plan_workspace_size", [&]() -> sparge_status_t {
    SPARGE_TRY(check_plan(plan));
    if (!bytes) return fail(SPARGE_ERR_INVALID_ARGUMENT, "bytes is NULL, expected a pointer to a size_t");
    *bytes = plan->ws.total;
    return SPARGE_OK;
  });
}

SPARGE_API sparge_status_t sparge_plan_kernel_info(sparge_plan_t plan, sparge_kernel_info_t* info) {
  return guarded("sparge_plan_kernel_info", [&]() -> sparge_status_t {
    SPARGE_TRY(check_plan(plan));
    if (!info) return fail(SPARGE_ERR_INVALID_ARGUMENT, "info is NULL, expected a sparge_kernel_info_t to fill");
    if (info->struct_size < sizeof(sparge_kernel_info_t))
      return fail(SPARGE_ERR_INVALID_ARGUMENT,
                  "info->struct_size is %zu, expected >= %zu (sizeof(sparge_kernel_info_t))", info->struct_size,
                  sizeof(sparge_kernel_info_t));
    const Problem& p = plan->prob;
    if (p.device == SPARGE_DEVICE_CUDA) return cuda::kernel_info(*plan, info);
    sparge_kernel_info_t r;
    std::memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    std::snprintf(r.family, sizeof r.family, "cpu");
    std::snprintf(r.name, sizeof r.name, "cpu_reference");
    r.head_dim = static_cast<int32_t>(p.D);
    r.block_q = p.BQ;
    // The online-softmax step of the CPU backend (src/cpu/attention.cpp): the
    // int8 twins step as the GPU kernels (core/kernel_traits.hpp), FP16 over
    // 64-key tiles whatever block_k is; EXACT has no online softmax (two
    // float64 passes over the row): 0.
    r.keys_per_step = p.quantized()                            ? blocks_per_step(p.precision, p.D) * 64
                      : p.precision == SPARGE_PRECISION_FP16 ? 64
                                                               : 0;
    *info = r;
    return SPARGE_OK;
  });
}

SPARGE_API sparge_status_t sparge_plan_get_problem(sparge_plan_t plan, sparge_problem_t* problem) {
  return guarded("sparge_plan_get_problem", [&]() -> sparge_status_t {
    SPARGE_TRY(check_plan(plan));
    if (!problem) return fail(SPARGE_ERR_INVALID_ARGUMENT, "problem is NULL, expected a sparge_problem_t to fill");
    if (problem->struct_size < sizeof(sparge_problem_t))
      return fail(SPARGE_ERR_INVALID_ARGUMENT,
                  "problem->struct_size is %zu, expected >= %zu (sizeof(sparge_problem_t); use SPARGE_PROBLEM_INIT)",
                  problem->struct_size, sizeof(sparge_problem_t));
    const Problem& p = plan->prob;
    sparge_problem_t r = SPARGE_PROBLEM_INIT;
    r.batch = p.B;
    r.heads_q = p.Hq;
    r.heads_kv = p.Hkv;
    r.len_q = p.Lq;
    r.len_kv = p.Lkv;
    r.head_dim = p.D;
    r.dtype = p.dtype;
    r.device_type = p.device;
    r.device_id = p.device_id;
    r.precision = p.precision;
    r.causal = p.causal ? 1 : 0;
    r.scale = p.scale;
    r.block_q = p.BQ;
    r.block_k = p.BK;
    *problem = r;
    return SPARGE_OK;
  });
}

SPARGE_API sparge_status_t sparge_plan_visible_blocks(sparge_plan_t plan, int64_t* visible_per_head) {
  return guarded("sparge_plan_visible_blocks", [&]() -> sparge_status_t {
    SPARGE_TRY(check_plan(plan));
    if (!visible_per_head)
      return fail(SPARGE_ERR_INVALID_ARGUMENT, "visible_per_head is NULL, expected a pointer to an int64_t");
    *visible_per_head = total_visible_blocks(plan->prob);
    return SPARGE_OK;
  });
}

// CUDA plans: an argument set this plan has seen before (whose pointers were
// then checked) skips the driver queries of where the pointers live; every
// other check runs (docs/API.md, "Validation cost"). Returns whether to query;
// fills `key` on CUDA plans.
static bool query_pointers(const Plan& pl, const sparge_tensor_t* q, const sparge_tensor_t* k,
                           const sparge_tensor_t* v, const sparge_tensor_t* mask, const sparge_predict_params_t* params,
                           const sparge_tensor_t* out, const sparge_tensor_t* lse, const void* workspace,
                           AttnCallKey* key) {
  if (pl.prob.device != SPARGE_DEVICE_CUDA) return true;
  api::attention_call_key(q, k, v, mask, params, out, lse, workspace, key);
  return !cuda::call_known(pl, *key);
}

SPARGE_API sparge_status_t sparge_predict_mask(sparge_plan_t plan, const sparge_tensor_t* q,
                                               const sparge_tensor_t* k, const sparge_predict_params_t* params,
                                               const sparge_tensor_t* mask_out, const sparge_tensor_t* kept_out,
                                               void* workspace, size_t workspace_bytes, void* stream) {
  return guarded("sparge_predict_mask", [&]() -> sparge_status_t {
    SPARGE_TRY(check_plan(plan));
    const Plan& pl = *plan;
    const bool gpu = pl.prob.device == SPARGE_DEVICE_CUDA;
    AttnCallKey key;  // a prediction's: no v, no out (never an attention call's)
    const bool query = query_pointers(pl, q, k, nullptr, mask_out, params, nullptr, kept_out, workspace, &key);
    SPARGE_TRY(api::check_tensor(pl, q, api::spec_q(pl, "q"), query));
    SPARGE_TRY(api::check_tensor(pl, k, api::spec_kv(pl, "k"), query));
    SPARGE_TRY(api::check_tensor(pl, mask_out, api::spec_mask(pl, "mask_out"), query));
    PredictConfig cfg;
    SPARGE_TRY(api::read_params(pl, params, &cfg, query));
    if (kept_out) SPARGE_TRY(api::check_tensor(pl, kept_out, api::spec_kept(pl, "kept_out"), query));
    SPARGE_TRY(api::check_workspace(pl, workspace, workspace_bytes, query));
    {
      const api::NamedTensor ins[] = {{"q", q}, {"k", k}};
      const api::NamedTensor outs[] = {{"mask_out", mask_out}, {"kept_out", kept_out}};
      SPARGE_TRY(api::check_overlap(pl, ins, 2, outs, kept_out ? 2 : 1, workspace));
    }

    const Tensor4 tq = api::to_tensor4(*q), tk = api::to_tensor4(*k);
    const MaskView m = api::to_mask(*mask_out);
    KeptView kv;
    if (kept_out) kv = api::to_kept(*kept_out);
    const KeptView* kp = kept_out ? &kv : nullptr;
    if (gpu) {
      SPARGE_TRY(cuda::predict(pl, tq, tk, cfg, m, kp, workspace, stream));
      if (query) cuda::remember_call(pl, key);
      return SPARGE_OK;
    }
    return cpu::predict(pl, tq, tk, cfg, m, kp, workspace);
  });
}

SPARGE_API sparge_status_t sparge_attention_run(sparge_plan_t plan, const sparge_tensor_t* q,
                                                const sparge_tensor_t* k, const sparge_tensor_t* v,
                                                const sparge_tensor_t* mask, const sparge_predict_params_t* params,
                                                const sparge_tensor_t* out, const sparge_tensor_t* lse,
                                                void* workspace, size_t workspace_bytes, void* stream) {
  return guarded("sparge_attention_run", [&]() -> sparge_status_t {
    SPARGE_TRY(check_plan(plan));
    const Plan& pl = *plan;
    const bool gpu = pl.prob.device == SPARGE_DEVICE_CUDA;
    AttnCallKey key;
    const bool query = query_pointers(pl, q, k, v, mask, params, out, lse, workspace, &key);
    SPARGE_TRY(api::check_tensor(pl, q, api::spec_q(pl, "q"), query));
    SPARGE_TRY(api::check_tensor(pl, k, api::spec_kv(pl, "k"), query));
    SPARGE_TRY(api::check_tensor(pl, v, api::spec_kv(pl, "v"), query));
    if (mask) SPARGE_TRY(api::check_tensor(pl, mask, api::spec_mask(pl, "mask"), query));
    PredictConfig cfg;
    SPARGE_TRY(api::read_params(pl, params, &cfg, query));
    SPARGE_TRY(api::check_tensor(pl, out, api::spec_q(pl, "out"), query));
    if (lse) SPARGE_TRY(api::check_tensor(pl, lse, api::spec_lse(pl, "lse"), query));
    SPARGE_TRY(api::check_workspace(pl, workspace, workspace_bytes, query));
    {
      api::NamedTensor ins[4] = {{"q", q}, {"k", k}, {"v", v}, {"mask", mask}};
      const api::NamedTensor outs[] = {{"out", out}, {"lse", lse}};
      SPARGE_TRY(api::check_overlap(pl, ins, mask ? 4 : 3, outs, lse ? 2 : 1, workspace));
    }

    const Tensor4 tq = api::to_tensor4(*q), tk = api::to_tensor4(*k), tv = api::to_tensor4(*v),
                  to = api::to_tensor4(*out);
    MaskView m;
    if (mask) m = api::to_mask(*mask);
    const MaskView* mp = mask ? &m : nullptr;
    LseView lv;
    if (lse) lv = api::to_lse(*lse);
    const LseView* lp = lse ? &lv : nullptr;
    if (gpu) return cuda::attention(pl, tq, tk, tv, mp, cfg, to, lp, workspace, stream, &key);
    return cpu::attention(pl, tq, tk, tv, mp, cfg, to, lp, workspace);
  });
}

SPARGE_API void sparge_destroy_plan(sparge_plan_t plan) { delete plan; }

SPARGE_API const char* sparge_last_error(void) {
  try {
    return last_error_text();
  } catch (...) {
    return "";
  }
}

SPARGE_API const char* sparge_status_string(sparge_status_t status) {
  switch (api::raw_enum(status)) {  // any int may arrive from C: compare integers
    case SPARGE_OK: return "SPARGE_OK";
    case SPARGE_ERR_INVALID_ARGUMENT: return "SPARGE_ERR_INVALID_ARGUMENT";
    case SPARGE_ERR_UNSUPPORTED: return "SPARGE_ERR_UNSUPPORTED";
    case SPARGE_ERR_WORKSPACE_TOO_SMALL: return "SPARGE_ERR_WORKSPACE_TOO_SMALL";
    case SPARGE_ERR_NO_DEVICE: return "SPARGE_ERR_NO_DEVICE";
    case SPARGE_ERR_CUDA: return "SPARGE_ERR_CUDA";
    case SPARGE_ERR_OUT_OF_MEMORY: return "SPARGE_ERR_OUT_OF_MEMORY";
    case SPARGE_ERR_INTERNAL: return "SPARGE_ERR_INTERNAL";
  }
  return "SPARGE_ERR_UNKNOWN (unrecognized status value)";
}

SPARGE_API void sparge_version(int* major, int* minor, int* patch) {
  if (major) *major = SPARGE_VERSION_MAJOR;
  if (minor) *minor = SPARGE_VERSION_MINOR;
  if (patch) *patch = SPARGE_VERSION_PATCH;
}

SPARGE_API int sparge_has_cuda(void) { return cuda::built() ? 1 : 0; }

}  // extern "C"
