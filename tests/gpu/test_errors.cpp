// Bad inputs specific to CUDA plans: host memory passed where device memory is
// required, descriptors that claim the wrong device, workspaces that are too
// small, and problems the CUDA backend does not support. Each must fail with a
// status and a message naming the argument, and leave the library usable.
#include "catch_compat.hpp"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_util.hpp"

using namespace sgt;

namespace {

struct Fixture {
  Shape s;
  Inputs in;
  DeviceInputs din;
  sparge_plan_t plan = nullptr;
  size_t wsb = 0;
  DeviceBuffer ws, out, lse, mask;
  std::vector<uint16_t> host_buf;  // host memory big enough for any tensor here
  sparge_tensor_t q, k, v, o, l, m;

  static Shape shape() {
    Shape s;
    s.B = 1, s.Hq = 2, s.Hkv = 1, s.Lq = 200, s.Lkv = 200, s.D = 64, s.causal = true;
    return s;
  }
  explicit Fixture(sparge_precision_t prec)
      : s(shape()), in(make_inputs(s, Layout::HND, SPARGE_DTYPE_BFLOAT16, false, case_seed("errors"))), din(in) {
    sparge_problem_t pr = SPARGE_PROBLEM_INIT;
    pr.batch = s.B, pr.heads_q = s.Hq, pr.heads_kv = s.Hkv, pr.len_q = s.Lq, pr.len_kv = s.Lkv, pr.head_dim = s.D;
    pr.dtype = SPARGE_DTYPE_BFLOAT16, pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = prec, pr.causal = 1;
    const sparge_status_t st = sparge_create_plan(&pr, &plan);
    if (st != SPARGE_OK) throw std::runtime_error(std::string("create_plan: ") + sparge_last_error());
    if (sparge_plan_workspace_size(plan, &wsb) != SPARGE_OK) throw std::runtime_error("workspace_size");
    ws.alloc(wsb + 256);
    out.alloc(in.q.storage * 2);
    lse.alloc(static_cast<size_t>(s.B * s.Hq * s.Lq) * 4);
    mask.alloc(static_cast<size_t>(s.B * s.Hq * s.nQB() * s.nKB()));
    mask.fill(1);
    host_buf.assign(in.q.storage + 4096, 0);
    q = desc4(in.q, din.q.get(), SPARGE_DEVICE_CUDA);
    k = desc4(in.k, din.k.get(), SPARGE_DEVICE_CUDA);
    v = desc4(in.v, din.v.get(), SPARGE_DEVICE_CUDA);
    o = desc4(in.q, out.get(), SPARGE_DEVICE_CUDA);
    const int64_t lsh[3] = {s.B, s.Hq, s.Lq}, lst[3] = {s.Hq * s.Lq, s.Lq, 1};
    l = make_desc(lse.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_FLOAT32, 3, lsh, lst);
    const int64_t msh[4] = {s.B, s.Hq, s.nQB(), s.nKB()},
                  mst[4] = {s.Hq * s.nQB() * s.nKB(), s.nQB() * s.nKB(), s.nKB(), 1};
    m = make_desc(mask.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_UINT8, 4, msh, mst);
  }
  ~Fixture() { sparge_destroy_plan(plan); }

  sparge_status_t run(const sparge_tensor_t& q_, const sparge_tensor_t& k_, const sparge_tensor_t& v_,
                      const sparge_tensor_t* m_, const sparge_tensor_t& o_, const sparge_tensor_t* l_, void* w,
                      size_t wb) {
    const sparge_status_t st = sparge_attention_run(plan, &q_, &k_, &v_, m_, nullptr, &o_, l_, w, wb, nullptr);
    SGT_CUDA(cudaDeviceSynchronize());
    return st;
  }
  sparge_status_t run_ok() { return run(q, k, v, &m, o, &l, ws.get(), wsb); }
};

// Bytes of the fixture's workspace that no longer hold `poison` once the
// device is idle: 0 proves a refused call queued nothing.
size_t workspace_bytes_changed(const Fixture& f, int poison) {
  SGT_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> wsh(f.wsb);
  f.ws.download(wsh.data(), f.wsb);
  size_t changed = 0;
  for (unsigned char b : wsh) changed += b != static_cast<unsigned char>(poison);
  return changed;
}

}  // namespace

// Tagged [hostptr]: if a check were missing, a kernel would fault on host memory
// and leave a sticky CUDA error behind, so tools/gpu_check.sh runs these in a
// process of their own.
TEST_CASE("CUDA plan: host pointers are rejected, naming the tensor", "[gpu][errors][hostptr][sanitize]") {
  Fixture f(SPARGE_PRECISION_FP16);
  REQUIRE(f.run_ok() == SPARGE_OK);
  void* host = f.host_buf.data();
  struct Probe {
    const char* name;
    int which;
  };
  const Probe probes[] = {{"q", 0}, {"k", 1}, {"v", 2}, {"out", 3}, {"mask", 4}, {"lse", 5}};
  for (const Probe& p : probes) {
    INFO("tensor " << p.name);
    sparge_tensor_t t[6] = {f.q, f.k, f.v, f.o, f.m, f.l};
    t[p.which].data = host;  // descriptor still says CUDA
    const sparge_status_t st = f.run(t[0], t[1], t[2], &t[4], t[3], &t[5], f.ws.get(), f.wsb);
    const std::string msg = sparge_last_error();
    INFO("status " << sparge_status_string(st) << ", message: " << msg);
    CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
    CHECK(names_word(msg, p.name));
  }
  // A descriptor that says CPU on a CUDA plan.
  for (const Probe& p : probes) {
    INFO("tensor " << p.name << " with device_type CPU");
    sparge_tensor_t t[6] = {f.q, f.k, f.v, f.o, f.m, f.l};
    t[p.which].device_type = SPARGE_DEVICE_CPU;
    const sparge_status_t st = f.run(t[0], t[1], t[2], &t[4], t[3], &t[5], f.ws.get(), f.wsb);
    const std::string msg = sparge_last_error();
    INFO("status " << sparge_status_string(st) << ", message: " << msg);
    CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
    CHECK(names_word(msg, p.name));
  }
  // Host memory for predict_mask's q and mask_out, also after the plan has
  // predicted with the valid arguments (twice: the second call is a known
  // argument set, checked without driver queries); a changed pointer is a new
  // argument set and is checked in full.
  {
    for (int rep = 0; rep < 2; ++rep) {
      INFO("valid prediction " << rep);
      CHECK(sparge_predict_mask(f.plan, &f.q, &f.k, nullptr, &f.m, nullptr, f.ws.get(), f.wsb, nullptr) == SPARGE_OK);
    }
    SGT_CUDA(cudaDeviceSynchronize());
    sparge_tensor_t qh = f.q, mh = f.m;
    qh.data = host;
    sparge_status_t st = sparge_predict_mask(f.plan, &qh, &f.k, nullptr, &f.m, nullptr, f.ws.get(), f.wsb, nullptr);
    CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
    CHECK(names_word(sparge_last_error(), "q"));
    mh.data = host;
    st = sparge_predict_mask(f.plan, &f.q, &f.k, nullptr, &mh, nullptr, f.ws.get(), f.wsb, nullptr);
    INFO("message: " << sparge_last_error());
    CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
    SGT_CUDA(cudaDeviceSynchronize());
  }
  // The library is still usable and no CUDA error is pending.
  CHECK(f.run_ok() == SPARGE_OK);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("CUDA plan: workspace checks", "[gpu][errors][sanitize]") {
  Fixture f(SPARGE_PRECISION_INT8_FP8);
  REQUIRE(f.wsb > 0);
  sparge_status_t st = f.run(f.q, f.k, f.v, &f.m, f.o, &f.l, f.ws.get(), f.wsb - 1);
  INFO("message: " << sparge_last_error());
  CHECK(st == SPARGE_ERR_WORKSPACE_TOO_SMALL);
  st = f.run(f.q, f.k, f.v, nullptr, f.o, &f.l, f.ws.get(), f.wsb / 2);  // predict inside
  CHECK(st == SPARGE_ERR_WORKSPACE_TOO_SMALL);
  st = sparge_predict_mask(f.plan, &f.q, &f.k, nullptr, &f.m, nullptr, f.ws.get(), 0, nullptr);
  CHECK(st == SPARGE_ERR_WORKSPACE_TOO_SMALL);
  st = f.run(f.q, f.k, f.v, &f.m, f.o, &f.l, nullptr, f.wsb);
  CHECK(st != SPARGE_OK);
  // A larger workspace than needed is fine.
  CHECK(f.run(f.q, f.k, f.v, &f.m, f.o, &f.l, f.ws.get(), f.wsb + 256) == SPARGE_OK);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("CUDA plan: host memory as workspace is rejected", "[gpu][errors][hostptr][sanitize]") {
  Fixture f(SPARGE_PRECISION_INT8_FP8);
  REQUIRE(f.wsb > 0);
  // 256-byte aligned on purpose: the alignment check must not be what rejects it.
  std::vector<unsigned char> hws(f.wsb + 512);
  void* hp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(hws.data()) + 255) & ~uintptr_t(255));
  const sparge_status_t st = f.run(f.q, f.k, f.v, &f.m, f.o, &f.l, hp, f.wsb);
  INFO("host workspace: " << sparge_status_string(st) << " " << sparge_last_error());
  CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
  CHECK(names_word(sparge_last_error(), "workspace"));
  CHECK(f.run_ok() == SPARGE_OK);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("CUDA plan: unsupported problems fail at plan creation", "[gpu][errors][sanitize]") {
  auto base = [] {
    sparge_problem_t pr = SPARGE_PROBLEM_INIT;
    pr.batch = 1, pr.heads_q = 2, pr.heads_kv = 2, pr.len_q = 256, pr.len_kv = 256, pr.head_dim = 64;
    pr.device_type = SPARGE_DEVICE_CUDA;
    return pr;
  };
  auto expect_fail = [](const sparge_problem_t& pr, const char* what) {
    INFO(what);
    sparge_plan_t plan = reinterpret_cast<sparge_plan_t>(static_cast<uintptr_t>(1));
    const sparge_status_t st = sparge_create_plan(&pr, &plan);
    INFO(sparge_status_string(st) << ": " << sparge_last_error());
    CHECK(st != SPARGE_OK);
    CHECK(plan == nullptr);
    CHECK(std::string(sparge_last_error()).size() > 0);
    if (st == SPARGE_OK) sparge_destroy_plan(plan);
    return st;
  };
  sparge_problem_t pr = base();
  pr.precision = SPARGE_PRECISION_EXACT;
  const sparge_status_t st_exact = expect_fail(pr, "EXACT precision on a CUDA plan");
  CHECK((st_exact == SPARGE_ERR_UNSUPPORTED || st_exact == SPARGE_ERR_INVALID_ARGUMENT));
  pr = base();
  pr.dtype = SPARGE_DTYPE_FLOAT32;
  expect_fail(pr, "float32 inputs on a CUDA plan");
  pr = base();
  pr.head_dim = 80;
  const sparge_status_t st_d = expect_fail(pr, "D = 80 on a CUDA plan");
  CHECK(st_d == SPARGE_ERR_UNSUPPORTED);
  CHECK(names_word(sparge_last_error(), "head_dim"));
  // No INT8_FP8 kernel at D = 256 (its two fp32 output accumulators do not
  // fit the registers): refused at plan creation, naming head_dim and the mode
  // that has the same int8 Q.K^T.
  for (sparge_precision_t prec : {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP8_SPLIT_V}) {
    pr = base();
    pr.head_dim = 256;
    pr.precision = prec;
    CHECK(expect_fail(pr, "INT8_FP8 at D = 256") == SPARGE_ERR_UNSUPPORTED);
    CHECK(names_word(sparge_last_error(), "head_dim"));
    CHECK(std::string(sparge_last_error()).find("INT8_FP16") != std::string::npos);
  }
  pr = base();
  int n = 0;
  SGT_CUDA(cudaGetDeviceCount(&n));
  pr.device_id = n;  // one past the last device
  const sparge_status_t st_dev = expect_fail(pr, "device id out of range");
  CHECK((st_dev == SPARGE_ERR_NO_DEVICE || st_dev == SPARGE_ERR_INVALID_ARGUMENT));
  pr = base();
  CHECK(sparge_create_plan(&pr, nullptr) == SPARGE_ERR_INVALID_ARGUMENT);  // NULL out pointer
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("CUDA: outputs whose rows the kernels cannot store are refused, naming out", "[gpu][errors][sanitize]") {
  for (sparge_precision_t prec : {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP16, SPARGE_PRECISION_FP16}) {
    Fixture f(prec);
    INFO(precision_name(prec));
    const Shape& s = f.s;
    // Row pitch D + 1 elements: rows start on odd 2-byte boundaries.
    const int64_t pitch = s.D + 1;
    DeviceBuffer odd(static_cast<size_t>(s.B * s.Hq * s.Lq * pitch) * 2 + 64);
    const int64_t osh[4] = {s.B, s.Hq, s.Lq, s.D}, ost[4] = {s.Hq * s.Lq * pitch, s.Lq * pitch, pitch, 1};
    const sparge_tensor_t o_odd = make_desc(odd.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_BFLOAT16, 4, osh, ost);
    // Refused before anything is queued: the workspace (where the
    // preparation would write first) keeps its poison.
    f.ws.fill(0x5a);
    sparge_status_t st = f.run(f.q, f.k, f.v, &f.m, o_odd, &f.l, f.ws.get(), f.wsb);
    INFO("odd pitch: " << sparge_status_string(st) << " " << sparge_last_error());
    CHECK(st == SPARGE_ERR_UNSUPPORTED);
    CHECK(names_word(sparge_last_error(), "out"));
    CHECK(workspace_bytes_changed(f, 0x5a) == 0);
    // A data pointer one element past an aligned one, even pitch.
    const int64_t est[4] = {s.Hq * s.Lq * s.D, s.Lq * s.D, s.D, 1};
    const sparge_tensor_t o_mis = make_desc(static_cast<char*>(odd.get()) + 2, SPARGE_DEVICE_CUDA,
                                            SPARGE_DTYPE_BFLOAT16, 4, osh, est);
    st = f.run(f.q, f.k, f.v, &f.m, o_mis, &f.l, f.ws.get(), f.wsb);
    INFO("misaligned pointer: " << sparge_status_string(st) << " " << sparge_last_error());
    CHECK(st == SPARGE_ERR_UNSUPPORTED);
    CHECK(names_word(sparge_last_error(), "out"));
    CHECK(f.run_ok() == SPARGE_OK);
    CHECK(cudaGetLastError() == cudaSuccess);
  }
}

// INT8_FP16 reads V through a TMA tensor map and has no other path: a V whose
// rows start on odd 2-byte boundaries is refused before anything runs.
TEST_CASE("CUDA: INT8_FP16 refuses a V no tensor map can describe, naming v", "[gpu][errors][sanitize]") {
  Fixture f(SPARGE_PRECISION_INT8_FP16);
  const Shape& s = f.s;
  const int64_t pitch = s.D + 1;
  DeviceBuffer odd(static_cast<size_t>(s.B * s.Hkv * s.Lkv * pitch) * 2 + 64);
  odd.fill(0x3c);  // finite bf16 values, in case anything read them
  const int64_t vsh[4] = {s.B, s.Hkv, s.Lkv, s.D}, vst[4] = {s.Hkv * s.Lkv * pitch, s.Lkv * pitch, pitch, 1};
  const sparge_tensor_t v_odd = make_desc(odd.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_BFLOAT16, 4, vsh, vst);
  f.out.fill(0xFF);
  f.ws.fill(0x5a);
  const sparge_status_t st = f.run(f.q, f.k, v_odd, &f.m, f.o, &f.l, f.ws.get(), f.wsb);
  INFO(sparge_status_string(st) << " " << sparge_last_error());
  CHECK(st == SPARGE_ERR_UNSUPPORTED);
  CHECK(names_word(sparge_last_error(), "v"));
  // Refused before the preparation ran: the workspace keeps its poison.
  CHECK(workspace_bytes_changed(f, 0x5a) == 0);
  CHECK(f.run_ok() == SPARGE_OK);
  CHECK(cudaGetLastError() == cudaSuccess);
}

// The plan reports the kernel the registry chose: family, instance and the
// tile facts of the traits (the online-softmax step is the one the CPU twin
// follows).
TEST_CASE("CUDA plan: the chosen kernel is reported", "[gpu][errors][registry][sanitize]") {
  struct Want {
    sparge_precision_t prec;
    int64_t D;
    int32_t head_dim, keys_per_step;
    const char* name_part;
  };
  const Want wants[] = {
      {SPARGE_PRECISION_INT8_FP8, 64, 64, 128, "int8_fp8_d64"},
      {SPARGE_PRECISION_INT8_FP8, 96, 128, 128, "int8_fp8_d96"},
      {SPARGE_PRECISION_INT8_FP8, 128, 128, 128, "int8_fp8_d128"},
      {SPARGE_PRECISION_INT8_FP8_SPLIT_V, 128, 128, 128, "int8_fp8_split_v_d128"},
      {SPARGE_PRECISION_INT8_FP16, 64, 64, 192, "int8_fp16_d64"},
      {SPARGE_PRECISION_INT8_FP16, 96, 128, 128, "int8_fp16_d96"},
      {SPARGE_PRECISION_INT8_FP16, 256, 256, 64, "int8_fp16_d256"},
      {SPARGE_PRECISION_FP16, 128, 128, 128, "fp16_d128"},
      {SPARGE_PRECISION_FP16, 256, 256, 64, "fp16_d256"},
  };
  const char* forced = std::getenv("SPARGE_FP16_KERNEL");
  const char* family_env = std::getenv("SPARGE_KERNEL_FAMILY");
  // SPARGE_KERNEL_FAMILY=portable: every plan takes the portable family.
  const bool portable_all = family_env != nullptr && std::string(family_env) == "portable";
  const bool portable_fp16 =
      portable_all || (forced != nullptr && std::string(forced) == "portable") || fp16_plans_portable();
  for (const Want& w : wants) {
    for (int causal : {0, 1}) {
      INFO(precision_name(w.prec) << " D " << w.D << " causal " << causal);
      sparge_problem_t pr = SPARGE_PROBLEM_INIT;
      pr.batch = 1, pr.heads_q = 2, pr.heads_kv = 1, pr.len_q = 300, pr.len_kv = 300, pr.head_dim = w.D;
      pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = w.prec, pr.causal = causal;
      sparge_plan_t plan = nullptr;
      const sparge_status_t st = sparge_create_plan(&pr, &plan);
      if (portable_fp16 && w.prec == SPARGE_PRECISION_FP16 && w.D == 256) {
        CHECK(st == SPARGE_ERR_UNSUPPORTED);  // the portable kernel has head dims 64, 96 and 128
        continue;
      }
      REQUIRE(st == SPARGE_OK);
      sparge_kernel_info_t ki;
      std::memset(&ki, 0x7f, sizeof ki);
      ki.struct_size = sizeof ki;
      REQUIRE(sparge_plan_kernel_info(plan, &ki) == SPARGE_OK);
      const std::string name(ki.name), family(ki.family);
      INFO("kernel " << family << " " << name);
      if (portable_fp16 && w.prec == SPARGE_PRECISION_FP16) {
        CHECK(family == "portable");
        CHECK(ki.keys_per_step == 64);
      } else if (portable_all || family == "portable") {
        // (A build without the sm90 family reports the portable one too.)
        // The portable 8-bit kernels: the same names, steps (the CPU twin's)
        // and kernel head dims; 8 warps; shared memory that fits every sm_80+ SM.
        CHECK(family == "portable");
        CHECK(name.find(std::string("portable_") + w.name_part) != std::string::npos);
        CHECK((name.find("_causal") != std::string::npos) == (causal != 0));
        CHECK(name.find("bf16") != std::string::npos);
        CHECK(ki.head_dim == w.head_dim);
        CHECK(ki.keys_per_step == w.keys_per_step);
        CHECK(ki.threads == 256);
        CHECK(ki.block_q == 128);
        CHECK(ki.stages >= 2);
        CHECK(ki.smem_bytes > 0);
        CHECK(ki.smem_bytes <= 96 * 1024);
      } else {
        CHECK(family == "sm90");
        CHECK(name.find(w.name_part) != std::string::npos);
        CHECK((name.find("_causal") != std::string::npos) == (causal != 0));
        CHECK(name.find("bf16") != std::string::npos);
        CHECK(ki.head_dim == w.head_dim);
        CHECK(ki.keys_per_step == w.keys_per_step);
        CHECK(ki.threads == 384);
        CHECK(ki.block_q == 128);
        CHECK(ki.stages >= 2);
        CHECK(ki.smem_bytes > 0);
        CHECK(ki.smem_bytes <= 227 * 1024);
      }
      CHECK(ki.sm_version >= 80);
      sparge_kernel_info_t small = ki;
      small.struct_size = sizeof ki - 1;
      CHECK(sparge_plan_kernel_info(plan, &small) == SPARGE_ERR_INVALID_ARGUMENT);
      CHECK(names_word(sparge_last_error(), "info"));
      sparge_destroy_plan(plan);
    }
  }
}

// SPARGE_PRECISION_AUTO: INT8_FP8 where the device runs the sm_90a int8
// kernels and the effective length reaches the threshold of the head dim;
// FP16 everywhere else (the portable family included). The AUTO plan is the
// explicit plan of its choice: same kernel, same workspace.
TEST_CASE("CUDA plan: precision AUTO resolves for the device's kernel family", "[gpu][errors][registry][sanitize]") {
  auto problem = [](int64_t L, int64_t D, sparge_precision_t prec) {
    sparge_problem_t pr = SPARGE_PROBLEM_INIT;
    pr.batch = 1, pr.heads_q = 2, pr.heads_kv = 1, pr.len_q = L, pr.len_kv = L, pr.head_dim = D;
    pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = prec;
    return pr;
  };
  auto facts = [](const sparge_problem_t& pr, sparge_problem_t* got, sparge_kernel_info_t* ki, size_t* wsb) {
    sparge_plan_t plan = nullptr;
    REQUIRE(sparge_create_plan(&pr, &plan) == SPARGE_OK);
    *got = SPARGE_PROBLEM_INIT;
    REQUIRE(sparge_plan_get_problem(plan, got) == SPARGE_OK);
    std::memset(ki, 0, sizeof *ki);
    ki->struct_size = sizeof *ki;
    REQUIRE(sparge_plan_kernel_info(plan, ki) == SPARGE_OK);
    REQUIRE(sparge_plan_workspace_size(plan, wsb) == SPARGE_OK);
    sparge_destroy_plan(plan);
  };
  // Which family runs INT8_FP8 here (sm90, or portable when forced or built so).
  sparge_problem_t got;
  sparge_kernel_info_t ki;
  size_t wsb = 0;
  facts(problem(300, 128, SPARGE_PRECISION_INT8_FP8), &got, &ki, &wsb);
  const bool int8_family = std::string(ki.family) == "sm90";
  INFO("int8 family: " << ki.family);
  const struct {
    int64_t L, D;
    bool int8_if_sm90;
  } cases[] = {{300, 128, false},  {8192, 128, false}, {16384, 128, true}, {16384, 96, true},
               {16384, 64, false}, {32768, 64, false}, {65536, 64, false}};
  for (const auto& c : cases) {
    for (int causal : {0, 1}) {
      INFO("L " << c.L << " D " << c.D << " causal " << causal);
      sparge_problem_t pr = problem(c.L, c.D, SPARGE_PRECISION_AUTO);
      pr.causal = causal;
      const sparge_precision_t want =
          c.int8_if_sm90 && int8_family ? SPARGE_PRECISION_INT8_FP8 : SPARGE_PRECISION_FP16;
      sparge_problem_t got_auto, got_twin;
      sparge_kernel_info_t ki_auto, ki_twin;
      size_t ws_auto = 0, ws_twin = 0;
      facts(pr, &got_auto, &ki_auto, &ws_auto);
      CHECK(got_auto.precision == want);
      pr.precision = want;
      facts(pr, &got_twin, &ki_twin, &ws_twin);
      CHECK(std::string(ki_auto.name) == ki_twin.name);
      CHECK(std::string(ki_auto.family) == ki_twin.family);
      CHECK(ws_auto == ws_twin);
    }
  }
}
