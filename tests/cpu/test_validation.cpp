// Every rejected input: the status, a message naming the argument, and
// outputs left untouched (they are NaN-poisoned before the call).
#include "catch_compat.hpp"

#include <climits>
#include <cstddef>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "test_util.hpp"

using namespace sparge_test;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

std::string last_error() { return sparge_last_error(); }

// Checks a failed call: status and that the message contains `needle`.
#define CHECK_FAILS(call, want, needle)                                 \
  do {                                                                  \
    const sparge_status_t st_ = (call);                                 \
    INFO("message: " << last_error());                                  \
    CHECK(sparge_status_string(st_) == std::string(sparge_status_string(want))); \
    CHECK(last_error().find(needle) != std::string::npos);              \
  } while (0)

struct Fixture {
  sparge_problem_t prob;
  std::unique_ptr<Plan> plan;
  HostTensor q, k, v, out, lse, mask, mask_out, kept;
  sparge_tensor_t tq, tk, tv, tout, tlse, tmask, tmask_out, tkept;
  std::shared_ptr<unsigned char> ws;
  size_t ws_bytes = 0;
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  std::vector<unsigned char> out0, lse0, mask_out0, kept0;

  Fixture() {
    std::mt19937_64 rng(fresh_seed());
    prob = cpu_problem(2, 4, 2, 100, 130, 16, SPARGE_DTYPE_FLOAT16, SPARGE_PRECISION_INT8_FP8, true);
    plan.reset(new Plan(prob));
    q = make_bhld(prob.dtype, 2, 4, 100, 16, Layout::HND);
    k = make_bhld(prob.dtype, 2, 2, 130, 16, Layout::NHD);
    v = make_bhld(prob.dtype, 2, 2, 130, 16, Layout::HND);
    fill_random(q, rng);
    fill_random(k, rng);
    fill_random(v, rng);
    out = make_bhld(prob.dtype, 2, 4, 100, 16, Layout::HND);
    lse = make_dense(SPARGE_DTYPE_FLOAT32, {2, 4, 100});
    mask = full_mask(2, 4, 1, 3);
    mask_out = make_dense(SPARGE_DTYPE_UINT8, {2, 4, 1, 3});
    kept = make_dense(SPARGE_DTYPE_INT32, {2, 4});
    tq = q.t, tk = k.t, tv = v.t, tout = out.t, tlse = lse.t, tmask = mask.t, tmask_out = mask_out.t, tkept = kept.t;
    ws_bytes = plan->workspace_size();
    ws = alloc_workspace(ws_bytes);
    out0 = out.snapshot(), lse0 = lse.snapshot(), mask_out0 = mask_out.snapshot(), kept0 = kept.snapshot();
  }
  sparge_plan_t p() const { return plan->p; }
  sparge_status_t attn() {
    return sparge_attention_run(p(), &tq, &tk, &tv, &tmask, &params, &tout, &tlse, ws.get(), ws_bytes, nullptr);
  }
  sparge_status_t pred() {
    return sparge_predict_mask(p(), &tq, &tk, &params, &tmask_out, &tkept, ws.get(), ws_bytes, nullptr);
  }
  void untouched() const {
    CHECK(out.snapshot() == out0);
    CHECK(lse.snapshot() == lse0);
    CHECK(mask_out.snapshot() == mask_out0);
    CHECK(kept.snapshot() == kept0);
  }
};

sparge_problem_t good_problem() {
  return cpu_problem(1, 4, 2, 100, 200, 64, SPARGE_DTYPE_BFLOAT16, SPARGE_PRECISION_INT8_FP8);
}

void check_create_fails(const sparge_problem_t& prob, sparge_status_t want, const char* needle) {
  sparge_plan_t plan = reinterpret_cast<sparge_plan_t>(uintptr_t(0x10));  // poison
  CHECK_FAILS(sparge_create_plan(&prob, &plan), want, needle);
  CHECK(plan == nullptr);
}

}  // namespace

TEST_CASE("create_plan rejects bad problems", "[cpu][validation]") {
  sparge_plan_t plan = nullptr;
  CHECK_FAILS(sparge_create_plan(nullptr, &plan), SPARGE_ERR_INVALID_ARGUMENT, "problem");
  const sparge_problem_t good = good_problem();
  CHECK_FAILS(sparge_create_plan(&good, nullptr), SPARGE_ERR_INVALID_ARGUMENT, "out");
  {
    sparge_problem_t p = good;
    p.struct_size = sizeof(sparge_problem_t) - 1;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "struct_size");
  }
  SECTION("sizes") {
    int64_t sparge_problem_t::*fields[] = {&sparge_problem_t::batch,  &sparge_problem_t::heads_q,
                                           &sparge_problem_t::heads_kv, &sparge_problem_t::len_q,
                                           &sparge_problem_t::len_kv, &sparge_problem_t::head_dim};
    const char* names[] = {"batch", "heads_q", "heads_kv", "len_q", "len_kv", "head_dim"};
    for (int f = 0; f < 6; ++f)
      for (int64_t bad : {int64_t(0), int64_t(-3), std::numeric_limits<int64_t>::min()}) {
        INFO(names[f] << " = " << bad);
        sparge_problem_t p = good;
        p.*fields[f] = bad;
        check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, names[f]);
      }
  }
  SECTION("GQA divisibility") {
    sparge_problem_t p = good;
    p.heads_q = 6;
    p.heads_kv = 4;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "heads_kv");
  }
  SECTION("enums") {
    for (int dt : {int(SPARGE_DTYPE_UINT8), int(SPARGE_DTYPE_INT32), 77, -1}) {
      sparge_problem_t p = good;
      p.dtype = sparge_dtype_t(dt);
      check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "dtype");
    }
    sparge_problem_t p = good;
    p.device_type = sparge_device_type_t(9);
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "device_type");
    p = good;
    p.device_id = -1;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "device_id");
    for (int id : {1, 5}) {  // a CPU plan has the one device id 0 (its tensors carry 0)
      p.device_id = id;
      check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "device_id");
    }
    for (int bad : {9, 6, -1}) {  // 5 is AUTO, the last valid value
      p = good;
      p.precision = sparge_precision_t(bad);
      check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "precision");
      CHECK(last_error().find("AUTO (5)") != std::string::npos);
    }
  }
  SECTION("head_dim range on CPU") {
    sparge_problem_t p = good;
    p.head_dim = 257;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "head_dim");
    p.head_dim = 256;
    Plan ok(p);
    p.head_dim = 1;
    Plan ok1(p);
  }
  SECTION("scale") {
    for (float s : {-1.0f, -0.0001f, kNaN, kInf, -kInf}) {
      INFO("scale " << s);
      sparge_problem_t p = good;
      p.scale = s;
      check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "scale");
    }
  }
  SECTION("block sizes on CPU") {
    sparge_problem_t p = good;
    p.block_q = -1;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "block_q");
    p = good;
    p.block_k = -64;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "block_k");
    p = good;
    p.block_k = 1025;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "block_k");
    p = good;
    p.block_q = 4096;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "block_q");
    p = good;
    p.block_q = 1024;
    p.block_k = 1;
    Plan ok(p);
  }
  SECTION("64-bit overflow of derived sizes") {
    sparge_problem_t p = good;
    p.len_q = p.len_kv = int64_t(1) << 40;
    p.heads_q = p.heads_kv = int64_t(1) << 12;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "overflow");
    p = good;  // the block mask alone overflows: 2^33 x 2^33 blocks
    p.len_q = p.len_kv = int64_t(1) << 33;
    p.head_dim = 1;
    p.block_q = p.block_k = 1;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "overflow");
    p = good;
    p.batch = std::numeric_limits<int64_t>::max();
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "overflow");
    p = good;
    p.len_q = std::numeric_limits<int64_t>::max();
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "overflow");
  }
  SECTION("CUDA-only restrictions are checked before the device") {
    sparge_problem_t c = good;
    c.device_type = SPARGE_DEVICE_CUDA;
    sparge_problem_t p = c;
    for (int64_t d : {32, 80, 160, 192})  // the GPU kernels' head dims are 64, 96, 128 and 256
      p.head_dim = d, check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "head_dim");
    p = c;
    p.precision = SPARGE_PRECISION_EXACT;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "precision");
    p = c;
    p.dtype = SPARGE_DTYPE_FLOAT32;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "dtype");
    p = c;
    p.block_q = 64;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "block_q");
    p = c;
    p.block_k = 128;
    check_create_fails(p, SPARGE_ERR_UNSUPPORTED, "block_k");
    if (!sparge_has_cuda()) check_create_fails(c, SPARGE_ERR_NO_DEVICE, "CUDA");
  }
  SECTION("success clears the message and sets the handle") {
    sparge_problem_t p = good;
    p.len_q = 0;
    check_create_fails(p, SPARGE_ERR_INVALID_ARGUMENT, "len_q");
    CHECK(sparge_create_plan(&good, &plan) == SPARGE_OK);
    CHECK(plan != nullptr);
    CHECK(last_error().empty());
    sparge_destroy_plan(plan);
  }
}

TEST_CASE("plan queries reject NULL arguments", "[cpu][validation]") {
  Plan plan(good_problem());
  size_t bytes = 7;
  CHECK_FAILS(sparge_plan_workspace_size(nullptr, &bytes), SPARGE_ERR_INVALID_ARGUMENT, "plan");
  CHECK(bytes == 7);
  CHECK_FAILS(sparge_plan_workspace_size(plan.p, nullptr), SPARGE_ERR_INVALID_ARGUMENT, "bytes");
  int64_t vis = 7;
  CHECK_FAILS(sparge_plan_visible_blocks(nullptr, &vis), SPARGE_ERR_INVALID_ARGUMENT, "plan");
  CHECK_FAILS(sparge_plan_visible_blocks(plan.p, nullptr), SPARGE_ERR_INVALID_ARGUMENT, "visible_per_head");
  CHECK(vis == 7);
  CHECK(sparge_plan_visible_blocks(plan.p, &vis) == SPARGE_OK);
  CHECK(vis == 1 * 4);
  sparge_problem_t got = SPARGE_PROBLEM_INIT;
  CHECK_FAILS(sparge_plan_get_problem(nullptr, &got), SPARGE_ERR_INVALID_ARGUMENT, "plan");
  CHECK_FAILS(sparge_plan_get_problem(plan.p, nullptr), SPARGE_ERR_INVALID_ARGUMENT, "problem");
  got.struct_size = 8;
  got.batch = 99;
  CHECK_FAILS(sparge_plan_get_problem(plan.p, &got), SPARGE_ERR_INVALID_ARGUMENT, "struct_size");
  CHECK(got.batch == 99);
}

TEST_CASE("attention_run and predict_mask reject bad tensors", "[cpu][validation]") {
  Fixture f;
  // the fixture is valid
  REQUIRE(f.attn() == SPARGE_OK);
  REQUIRE(f.pred() == SPARGE_OK);
  Fixture g;  // fresh, poisoned outputs for the failures
  const sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT;

  SECTION("NULL plan and tensors") {
    CHECK_FAILS(sparge_attention_run(nullptr, &g.tq, &g.tk, &g.tv, nullptr, nullptr, &g.tout, nullptr, g.ws.get(),
                                     g.ws_bytes, nullptr),
                INV, "plan");
    CHECK_FAILS(sparge_attention_run(g.p(), nullptr, &g.tk, &g.tv, nullptr, nullptr, &g.tout, nullptr, g.ws.get(),
                                     g.ws_bytes, nullptr),
                INV, "q is NULL");
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, nullptr, &g.tv, nullptr, nullptr, &g.tout, nullptr, g.ws.get(),
                                     g.ws_bytes, nullptr),
                INV, "k is NULL");
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, &g.tk, nullptr, nullptr, nullptr, &g.tout, nullptr, g.ws.get(),
                                     g.ws_bytes, nullptr),
                INV, "v is NULL");
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, &g.tk, &g.tv, nullptr, nullptr, nullptr, &g.tlse, g.ws.get(),
                                     g.ws_bytes, nullptr),
                INV, "out is NULL");
    CHECK_FAILS(sparge_predict_mask(nullptr, &g.tq, &g.tk, nullptr, &g.tmask_out, nullptr, g.ws.get(), g.ws_bytes,
                                    nullptr),
                INV, "plan");
    CHECK_FAILS(sparge_predict_mask(g.p(), &g.tq, &g.tk, nullptr, nullptr, &g.tkept, g.ws.get(), g.ws_bytes, nullptr),
                INV, "mask_out is NULL");
    CHECK_FAILS(sparge_predict_mask(g.p(), nullptr, &g.tk, nullptr, &g.tmask_out, &g.tkept, g.ws.get(), g.ws_bytes,
                                    nullptr),
                INV, "q is NULL");
  }
  SECTION("NULL data pointers") {
    g.tq.data = nullptr;
    CHECK_FAILS(g.attn(), INV, "q->data");
    g.tq = g.q.t;
    g.tv.data = nullptr;
    CHECK_FAILS(g.attn(), INV, "v->data");
    g.tv = g.v.t;
    g.tlse.data = nullptr;
    CHECK_FAILS(g.attn(), INV, "lse->data");
    g.tlse = g.lse.t;
    g.tmask.data = nullptr;
    CHECK_FAILS(g.attn(), INV, "mask->data");
    g.tmask = g.mask.t;
    g.tkept.data = nullptr;
    CHECK_FAILS(g.pred(), INV, "kept_out->data");
  }
  SECTION("shape and ndim mismatches with the plan") {
    g.tq.shape[2] = 101;  // a plan used with tensors of another shape
    CHECK_FAILS(g.attn(), INV, "q->shape[2]");
    g.tq = g.q.t;
    g.tq.ndim = 3;
    CHECK_FAILS(g.attn(), INV, "q->ndim");
    g.tq = g.q.t;
    g.tk.shape[1] = 4;
    CHECK_FAILS(g.attn(), INV, "k->shape[1]");
    g.tk = g.k.t;
    g.tv.shape[3] = 32;
    CHECK_FAILS(g.attn(), INV, "v->shape[3]");
    g.tv = g.v.t;
    g.tv.shape[2] = 129;
    CHECK_FAILS(g.attn(), INV, "v->shape[2]");
    g.tv = g.v.t;
    g.tout.shape[0] = 1;
    CHECK_FAILS(g.attn(), INV, "out->shape[0]");
    g.tout = g.out.t;
    g.tmask.shape[3] = 4;
    CHECK_FAILS(g.attn(), INV, "mask->shape[3]");
    g.tmask = g.mask.t;
    g.tmask.ndim = 2;
    CHECK_FAILS(g.attn(), INV, "mask->ndim");
    g.tmask = g.mask.t;
    g.tlse.shape[2] = 99;
    CHECK_FAILS(g.attn(), INV, "lse->shape[2]");
    g.tlse = g.lse.t;
    g.tlse.ndim = 4;
    CHECK_FAILS(g.attn(), INV, "lse->ndim");
    g.tlse = g.lse.t;
    g.tmask_out.shape[2] = 2;
    CHECK_FAILS(g.pred(), INV, "mask_out->shape[2]");
    g.tmask_out = g.mask_out.t;
    g.tkept.shape[1] = 2;
    CHECK_FAILS(g.pred(), INV, "kept_out->shape[1]");
    g.tkept = g.kept.t;
    g.tkept.ndim = 1;
    CHECK_FAILS(g.pred(), INV, "kept_out->ndim");
  }
  SECTION("dtypes") {
    g.tq.dtype = SPARGE_DTYPE_BFLOAT16;
    CHECK_FAILS(g.attn(), INV, "q->dtype");
    g.tq = g.q.t;
    g.tout.dtype = SPARGE_DTYPE_FLOAT32;
    CHECK_FAILS(g.attn(), INV, "out->dtype");
    g.tout = g.out.t;
    g.tmask.dtype = SPARGE_DTYPE_INT32;
    CHECK_FAILS(g.attn(), INV, "mask->dtype");
    g.tmask = g.mask.t;
    g.tlse.dtype = SPARGE_DTYPE_FLOAT16;
    CHECK_FAILS(g.attn(), INV, "lse->dtype");
    g.tlse = g.lse.t;
    g.tkept.dtype = SPARGE_DTYPE_FLOAT32;
    CHECK_FAILS(g.pred(), INV, "kept_out->dtype");
    g.tkept = g.kept.t;
    g.tmask_out.dtype = SPARGE_DTYPE_FLOAT16;
    CHECK_FAILS(g.pred(), INV, "mask_out->dtype");
  }
  SECTION("strides") {
    g.tq.strides[3] = 2;
    CHECK_FAILS(g.attn(), INV, "q->strides[3]");
    g.tq = g.q.t;
    g.tk.strides[2] = 0;
    CHECK_FAILS(g.attn(), INV, "k->strides[2]");
    g.tk = g.k.t;
    g.tv.strides[1] = -g.tv.strides[1];
    CHECK_FAILS(g.attn(), INV, "v->strides[1]");
    g.tv = g.v.t;
    g.tout.strides[3] = 0;
    CHECK_FAILS(g.attn(), INV, "out->strides[3]");
    g.tout = g.out.t;
    g.tmask.strides[0] = -1;
    CHECK_FAILS(g.attn(), INV, "mask->strides[0]");
    g.tmask = g.mask.t;
    g.tmask_out.strides[3] = 0;
    CHECK_FAILS(g.pred(), INV, "mask_out->strides[3]");
    g.tmask_out = g.mask_out.t;
    g.tlse.strides[2] = -1;
    CHECK_FAILS(g.attn(), INV, "lse->strides[2]");
    g.tlse = g.lse.t;
    g.tkept.strides[1] = 0;
    CHECK_FAILS(g.pred(), INV, "kept_out->strides[1]");
    g.tkept = g.kept.t;
    g.tq.strides[0] = int64_t(1) << 62;  // extent overflows 64-bit byte counts
    CHECK_FAILS(g.attn(), INV, "q: the extent");
    g.tq = g.q.t;
  }
  SECTION("overlapping memory") {
    // out aliasing itself: rows of 16 elements 8 apart
    g.tout.strides[2] = 8;
    CHECK_FAILS(g.attn(), INV, "out: its strides make distinct elements share memory");
    g.tout = g.out.t;
    // out written over q (in place), over v's last element, lse over k
    g.tout.data = g.tq.data;
    CHECK_FAILS(g.attn(), INV, "out overlaps q");
    g.tout = g.out.t;
    g.tlse.data = g.tk.data;
    CHECK_FAILS(g.attn(), INV, "lse overlaps k");
    g.tlse = g.lse.t;
    g.tlse.data = static_cast<unsigned char*>(g.tout.data) + 64;
    CHECK_FAILS(g.attn(), INV, "lse overlaps out");
    g.tlse = g.lse.t;
    g.tmask.data = static_cast<unsigned char*>(g.tout.data) + 2 * (g.out.bytes / 2 - 1);  // out's last element
    CHECK_FAILS(g.attn(), INV, "out overlaps mask");
    g.tmask = g.mask.t;
    // the workspace over an input or an output
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, &g.tk, &g.tv, &g.tmask, &g.params, &g.tout, &g.tlse, g.tv.data,
                                     g.ws_bytes, nullptr),
                INV, "workspace overlaps v");
    {
      // kept_out at the start of a buffer of its own that also serves as the
      // workspace: it overlaps kept_out and nothing else, whatever the heap
      // layout (under a sanitizer's allocator too).
      std::unique_ptr<int32_t[]> scratch(new int32_t[g.ws_bytes / 4 + 64]);
      sparge_tensor_t kept_in_ws = g.tkept;
      kept_in_ws.data = scratch.get();
      CHECK_FAILS(sparge_predict_mask(g.p(), &g.tq, &g.tk, &g.params, &g.tmask_out, &kept_in_ws, scratch.get(),
                                      g.ws_bytes, nullptr),
                  INV, "workspace overlaps kept_out");
    }
    g.tmask_out.data = g.tk.data;
    CHECK_FAILS(g.pred(), INV, "mask_out overlaps k");
    g.tmask_out = g.mask_out.t;
    g.tkept.data = g.tmask_out.data;
    CHECK_FAILS(g.pred(), INV, "kept_out overlaps mask_out");
    g.tkept = g.kept.t;
  }
  SECTION("devices") {
    g.tq.device_type = SPARGE_DEVICE_CUDA;
    CHECK_FAILS(g.attn(), INV, "q->device_type");
    g.tq = g.q.t;
    g.tk.device_id = 1;
    CHECK_FAILS(g.attn(), INV, "k->device_id");
    g.tk = g.k.t;
    g.tlse.device_type = SPARGE_DEVICE_CUDA;
    CHECK_FAILS(g.attn(), INV, "lse->device_type");
    g.tlse = g.lse.t;
    g.tmask_out.device_id = 3;
    CHECK_FAILS(g.pred(), INV, "mask_out->device_id");
  }
  g.untouched();
}

TEST_CASE("workspace checks", "[cpu][validation]") {
  Fixture g;
  SECTION("too small: needed and given bytes in the message") {
    const size_t need = g.ws_bytes;
    CHECK(need > 0);
    g.ws_bytes = need - 1;
    CHECK_FAILS(g.attn(), SPARGE_ERR_WORKSPACE_TOO_SMALL, std::to_string(need));
    CHECK(last_error().find(std::to_string(need - 1)) != std::string::npos);
    CHECK(last_error().find("workspace") != std::string::npos);
    CHECK_FAILS(g.pred(), SPARGE_ERR_WORKSPACE_TOO_SMALL, "workspace");
    g.untouched();
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, &g.tk, &g.tv, nullptr, nullptr, &g.tout, nullptr, nullptr, 0,
                                     nullptr),
                SPARGE_ERR_WORKSPACE_TOO_SMALL, "workspace");
    g.untouched();
    // exactly the queried size works (and nothing past it is touched)
    auto big = alloc_workspace(need + 256);
    std::memset(big.get(), 0x5A, need + 256);
    CHECK(sparge_attention_run(g.p(), &g.tq, &g.tk, &g.tv, nullptr, nullptr, &g.tout, &g.tlse, big.get(), need,
                               nullptr) == SPARGE_OK);
    for (size_t i = need; i < need + 256; ++i) REQUIRE(big.get()[i] == 0x5A);
    CHECK(last_error().empty());
  }
  SECTION("NULL with a size, misaligned") {
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, &g.tk, &g.tv, nullptr, nullptr, &g.tout, nullptr, nullptr,
                                     g.ws_bytes, nullptr),
                SPARGE_ERR_INVALID_ARGUMENT, "workspace is NULL");
    auto big = alloc_workspace(g.ws_bytes + 256);
    CHECK_FAILS(sparge_attention_run(g.p(), &g.tq, &g.tk, &g.tv, nullptr, nullptr, &g.tout, nullptr, big.get() + 1,
                                     g.ws_bytes, nullptr),
                SPARGE_ERR_INVALID_ARGUMENT, "workspace");
    g.untouched();
  }
}

TEST_CASE("prediction parameters", "[cpu][validation]") {
  Fixture g;
  const sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT;
  auto both = [&](const char* needle, sparge_status_t want) {
    CHECK_FAILS(g.attn(), want, needle);
    CHECK_FAILS(g.pred(), want, needle);
    g.params = SPARGE_PREDICT_PARAMS_INIT;
  };
  g.params.struct_size = offsetof(sparge_predict_params_t, local_window) - 4;  // below the 0.1 layout
  both("params->struct_size", INV);
  for (int32_t w : {-2, 1025, INT32_MIN}) {
    INFO("local_window " << w);
    g.params.local_window = w;
    both("params->local_window", INV);
  }
  for (int32_t e : {99, 5, -1}) {  // 0..3 and SPARGE_ESTIMATOR_AUTO (4) only
    INFO("estimator " << e);
    g.params.estimator = sparge_estimator_t(e);
    CHECK_FAILS(g.pred(), INV, "SPARGE_ESTIMATOR_AUTO (4");
    both("params->estimator", INV);
  }
  {
    Fixture ok;  // writes its outputs
    for (int32_t e = 0; e <= 4; ++e) {
      INFO("estimator " << e);
      ok.params.estimator = sparge_estimator_t(e);
      CHECK(ok.pred() == SPARGE_OK);
      CHECK(ok.attn() == SPARGE_OK);
    }
  }

  g.params.mode = sparge_select_mode_t(5);
  both("params->mode", INV);
  for (float t : {0.0f, -0.5f, 1.0001f, kNaN, kInf}) {
    INFO("topk " << t);
    g.params.topk = t;
    both("params->topk", INV);
  }
  for (float t : {0.0f, 1.5f, kNaN, -kInf}) {
    INFO("cdf " << t);
    g.params.mode = SPARGE_SELECT_CDF;
    g.params.cdf_threshold = t;
    both("params->cdf_threshold", INV);
  }
  g.params.sim_threshold = kNaN;
  both("params->sim_threshold", INV);
  for (float t : {-1.0f, kNaN, kInf, -kInf}) {
    INFO("pv_threshold " << t);
    g.params.pv_threshold = t;
    both("params->pv_threshold", INV);
  }
  const float topk_bad[4] = {0.5f, 0.0f, 0.5f, 0.5f};
  g.params.topk_per_head = topk_bad;
  both("params->topk_per_head[1]", INV);
  const float cdf_bad[4] = {0.5f, 0.5f, 0.5f, kNaN};
  g.params.mode = SPARGE_SELECT_CDF;
  g.params.cdf_threshold_per_head = cdf_bad;
  both("params->cdf_threshold_per_head[3]", INV);
  const float sim_bad[4] = {kNaN, 0.5f, 0.5f, 0.5f};
  g.params.sim_threshold_per_head = sim_bad;
  both("params->sim_threshold_per_head[0]", INV);
  g.untouched();
  // values of the mode not in use are not checked
  g.params.mode = SPARGE_SELECT_CDF;
  g.params.topk = 0.0f;
  CHECK(g.pred() == SPARGE_OK);
}

TEST_CASE("masks, LSE and kept counts accept any positive strides", "[cpu][validation]") {
  Fixture f, g;
  copy_logical(f.q, g.q);
  copy_logical(f.k, g.k);
  copy_logical(f.v, g.v);
  REQUIRE(f.pred() == SPARGE_OK);
  REQUIRE(f.attn() == SPARGE_OK);
  // transposed mask / lse / kept layouts
  HostTensor mask_t = make_strided(SPARGE_DTYPE_UINT8, {2, 4, 1, 3}, {1, 2, 100, 8 * 5});
  HostTensor lse_t = make_strided(SPARGE_DTYPE_FLOAT32, {2, 4, 100}, {1, 2 * 100, 2});
  HostTensor kept_t = make_strided(SPARGE_DTYPE_INT32, {2, 4}, {5, 11});
  g.tmask_out = mask_t.t;
  g.tkept = kept_t.t;
  REQUIRE(g.pred() == SPARGE_OK);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h) {
      CHECK(kept_t.get(b, h) == f.kept.get(b, h));
      for (int64_t j = 0; j < 3; ++j) CHECK(mask_t.get(b, h, 0, j) == f.mask_out.get(b, h, 0, j));
    }
  g.tmask = mask_t.t;
  g.tlse = lse_t.t;
  copy_logical(f.mask_out, f.mask);  // the same predicted mask, dense in f and transposed in g
  REQUIRE(f.attn() == SPARGE_OK);
  REQUIRE(g.attn() == SPARGE_OK);
  CHECK(g.out.snapshot() == f.out.snapshot());
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 100; ++i) {
        const float x = lse_t.get(b, h, i), y = f.lse.get(b, h, i);
        CHECK(((std::isinf(x) && std::isinf(y)) || x == y));
      }
}

TEST_CASE("status strings, version, thread-local messages", "[cpu][validation]") {
  std::set<std::string> names;
  for (int s = 0; s <= 7; ++s) {
    const char* n = sparge_status_string(sparge_status_t(s));
    REQUIRE(n != nullptr);
    CHECK(std::string(n).rfind("SPARGE_", 0) == 0);
    names.insert(n);
  }
  CHECK(names.size() == 8);
  CHECK(std::string(sparge_status_string(SPARGE_ERR_WORKSPACE_TOO_SMALL)) == "SPARGE_ERR_WORKSPACE_TOO_SMALL");
  REQUIRE(sparge_status_string(sparge_status_t(1234)) != nullptr);
  CHECK(names.count(sparge_status_string(sparge_status_t(1234))) == 0);
  int major = -1, minor = -1, patch = -1;
  sparge_version(&major, nullptr, nullptr);
  sparge_version(nullptr, &minor, &patch);
  sparge_version(nullptr, nullptr, nullptr);
  CHECK(major == SPARGE_VERSION_MAJOR);
  CHECK(minor == SPARGE_VERSION_MINOR);
  CHECK(patch == SPARGE_VERSION_PATCH);
  CHECK((sparge_has_cuda() == 0 || sparge_has_cuda() == 1));
  // the message is per thread
  sparge_plan_t plan = nullptr;
  sparge_problem_t bad = good_problem();
  bad.len_kv = -1;
  REQUIRE(sparge_create_plan(&bad, &plan) == SPARGE_ERR_INVALID_ARGUMENT);
  std::string other = "unset";
  std::thread([&] { other = sparge_last_error(); }).join();
  CHECK(other.empty());
  CHECK(last_error().find("len_kv") != std::string::npos);
  sparge_destroy_plan(nullptr);
}

TEST_CASE("sparge_plan_kernel_info: what a CPU plan runs, and its argument checks", "[cpu][api]") {
  sparge_problem_t p = SPARGE_PROBLEM_INIT;
  p.batch = 1, p.heads_q = 2, p.heads_kv = 1, p.len_q = 100, p.len_kv = 100, p.head_dim = 64;
  // The info of a fresh plan of `prob` (its fields poisoned first).
  auto info_of = [](const sparge_problem_t& prob) {
    sparge_plan_t pl = nullptr;
    REQUIRE(sparge_create_plan(&prob, &pl) == SPARGE_OK);
    sparge_kernel_info_t i;
    std::memset(&i, 0x7f, sizeof i);
    i.struct_size = sizeof i;
    REQUIRE(sparge_plan_kernel_info(pl, &i) == SPARGE_OK);
    sparge_destroy_plan(pl);
    return i;
  };
  p.precision = SPARGE_PRECISION_INT8_FP16;
  sparge_kernel_info_t ki = info_of(p);
  CHECK(std::string(ki.family) == "cpu");
  CHECK(ki.head_dim == 64);
  CHECK(ki.block_q == 128);
  CHECK(ki.keys_per_step == 192);  // the int8 twin steps as the GPU kernel at D = 64
  CHECK(ki.sm_version == 0);
  CHECK(ki.threads == 0);
  {
    // FP16 steps over 64-key tiles whatever the mask block; EXACT has no online softmax.
    sparge_problem_t q = p;
    q.block_k = 128;
    q.precision = SPARGE_PRECISION_FP16;
    CHECK(info_of(q).keys_per_step == 64);
    q.precision = SPARGE_PRECISION_EXACT;
    CHECK(info_of(q).keys_per_step == 0);
  }
  sparge_plan_t plan = nullptr;
  REQUIRE(sparge_create_plan(&p, &plan) == SPARGE_OK);
  ki.struct_size = sizeof ki - 4;
  CHECK(sparge_plan_kernel_info(plan, &ki) == SPARGE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(sparge_last_error()).rfind("info->struct_size", 0) == 0);
  CHECK(sparge_plan_kernel_info(plan, nullptr) == SPARGE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(sparge_last_error()).rfind("info", 0) == 0);
  CHECK(sparge_plan_kernel_info(nullptr, &ki) == SPARGE_ERR_INVALID_ARGUMENT);
  sparge_destroy_plan(plan);
}

TEST_CASE("precision AUTO: the default, resolved at plan creation by the effective length", "[cpu][api]") {
  {
    const sparge_problem_t init = SPARGE_PROBLEM_INIT;
    CHECK(init.precision == SPARGE_PRECISION_AUTO);
  }
  // CPU plans follow the compute capability 9.0 rule: INT8_FP8 for
  // 64 < head_dim <= 128 once 3 Lq Lkv / (Lq + 2 Lkv) reaches 16384; FP16
  // otherwise (at head_dim <= 64 at every length).
  const struct {
    int64_t Lq, Lkv, D;
    sparge_precision_t want;
  } cases[] = {
      {1024, 1024, 128, SPARGE_PRECISION_FP16},        {8192, 8192, 128, SPARGE_PRECISION_FP16},
      {16383, 16383, 128, SPARGE_PRECISION_FP16},      {16384, 16384, 128, SPARGE_PRECISION_INT8_FP8},
      {16384, 16384, 96, SPARGE_PRECISION_INT8_FP8},   {16384, 16384, 64, SPARGE_PRECISION_FP16},
      {32768, 32768, 64, SPARGE_PRECISION_FP16},       {65536, 65536, 256, SPARGE_PRECISION_FP16},
      {131072, 131072, 64, SPARGE_PRECISION_FP16},
      {32768, 16384, 128, SPARGE_PRECISION_INT8_FP8},  // 3 Lq Lkv / (Lq + 2 Lkv) = 24576
      {32768, 16384, 64, SPARGE_PRECISION_FP16},       // head_dim <= 64
      {16384, 32768, 128, SPARGE_PRECISION_INT8_FP8},  // 19661
      {1, 1 << 20, 128, SPARGE_PRECISION_FP16},        // one query row: 1.5
      {1 << 20, 64, 128, SPARGE_PRECISION_FP16},       // 192
  };
  for (const auto& c : cases) {
    for (int causal : {0, 1}) {
      INFO("Lq " << c.Lq << " Lkv " << c.Lkv << " D " << c.D << " causal " << causal);
      sparge_problem_t p = cpu_problem(1, 2, 1, c.Lq, c.Lkv, c.D, SPARGE_DTYPE_BFLOAT16, SPARGE_PRECISION_AUTO,
                                       causal != 0);
      Plan plan(p);
      sparge_problem_t got = SPARGE_PROBLEM_INIT;
      REQUIRE(sparge_plan_get_problem(plan.p, &got) == SPARGE_OK);
      CHECK(got.precision == c.want);
      // The plan is the explicit plan of its choice: same workspace, same step.
      p.precision = c.want;
      Plan twin(p);
      CHECK(plan.workspace_size() == twin.workspace_size());
      sparge_kernel_info_t a, b;
      a.struct_size = b.struct_size = sizeof a;
      REQUIRE(sparge_plan_kernel_info(plan.p, &a) == SPARGE_OK);
      REQUIRE(sparge_plan_kernel_info(twin.p, &b) == SPARGE_OK);
      CHECK(a.keys_per_step == b.keys_per_step);
    }
  }
  // Outputs: an AUTO plan computes exactly what its resolved precision does.
  std::mt19937_64 rng(fresh_seed());
  const sparge_problem_t pa = cpu_problem(1, 2, 1, 200, 300, 64, SPARGE_DTYPE_BFLOAT16, SPARGE_PRECISION_AUTO, true);
  sparge_problem_t pf = pa;
  pf.precision = SPARGE_PRECISION_FP16;
  Plan auto_plan(pa), fp16_plan(pf);
  HostTensor q = make_bhld(pa.dtype, 1, 2, 200, 64, Layout::HND), k = make_bhld(pa.dtype, 1, 1, 300, 64, Layout::HND),
             v = make_bhld(pa.dtype, 1, 1, 300, 64, Layout::HND);
  fill_random(q, rng);
  fill_random(k, rng);
  fill_random(v, rng);
  HostTensor o1 = make_bhld(pa.dtype, 1, 2, 200, 64, Layout::HND), o2 = make_bhld(pa.dtype, 1, 2, 200, 64, Layout::HND);
  o1.fill_nan();
  o2.fill_nan();
  REQUIRE(run_attention(auto_plan, q, k, v, nullptr, nullptr, o1, nullptr) == SPARGE_OK);
  REQUIRE(run_attention(fp16_plan, q, k, v, nullptr, nullptr, o2, nullptr) == SPARGE_OK);
  CHECK(o1.snapshot() == o2.snapshot());
}

TEST_CASE("inputs may share memory with each other", "[cpu][validation]") {
  Fixture g;
  g.tv = g.tk;  // v is k
  CHECK(g.attn() == SPARGE_OK);
  CHECK(g.out.snapshot() != g.out0);
}
