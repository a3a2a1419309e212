// The plan's cache of call setups (tensor maps, launch parameters, pointer
// checks; src/cuda/backend.cu) never serves the state of other arguments,
// tagged [cache]. Each case runs one plan over changing arguments and compares
// every result, bit for bit, with a fresh plan's on the same buffers:
//  - other tensors (other pointers), then the first ones again;
//  - the same pointers with other strides (HND, NHD, padded rows), with and
//    without LSE, with a caller's mask and a predicted one;
//  - tensors freed and new ones allocated (often at the same addresses);
//  - two host threads alternating their own tensors on one plan;
//  - a host pointer among otherwise cached arguments is still refused.
// Inputs are random normal, outputs poisoned with NaN before every call.
#include "catch_compat.hpp"

#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.hpp"

using namespace sgt;

namespace {

bool fp8_ok() {
  cudaDeviceProp p;
  SGT_CUDA(cudaGetDeviceProperties(&p, 0));
  return p.major * 10 + p.minor >= 89;
}

std::vector<sparge_precision_t> precisions() {
  std::vector<sparge_precision_t> r;
  if (fp8_ok()) r.push_back(SPARGE_PRECISION_INT8_FP8);
  r.push_back(SPARGE_PRECISION_FP16);
  return r;
}

Shape shape() {
  Shape s;
  s.B = 2, s.Hq = 4, s.Hkv = 2, s.Lq = 300, s.Lkv = 400, s.D = 64, s.causal = false;
  return s;
}

sparge_plan_t make_plan(const Shape& s, sparge_precision_t prec, size_t* wsb) {
  sparge_problem_t pr = SPARGE_PROBLEM_INIT;
  pr.batch = s.B, pr.heads_q = s.Hq, pr.heads_kv = s.Hkv, pr.len_q = s.Lq, pr.len_kv = s.Lkv, pr.head_dim = s.D;
  pr.dtype = SPARGE_DTYPE_BFLOAT16, pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = prec;
  pr.causal = s.causal ? 1 : 0;
  sparge_plan_t plan = nullptr;
  const sparge_status_t st = sparge_create_plan(&pr, &plan);
  INFO("create_plan: " << sparge_last_error());
  REQUIRE(st == SPARGE_OK);
  REQUIRE(sparge_plan_workspace_size(plan, wsb) == SPARGE_OK);
  return plan;
}

// One call's device buffers, sized for any layout, and its descriptors.
struct Args {
  Shape s;
  Inputs in;
  DeviceBuffer q, k, v, out, lse, mask, ws;
  sparge_tensor_t qd{}, kd{}, vd{}, od{}, ld{}, md{};
  size_t wsb = 0;
  bool use_lse = true, use_mask = false;
  float topk = 0.5f;
  int32_t sink = -1, window = -1;  // the prediction's structure (-1: the mode's defaults)

  Args(const Shape& s_, size_t wsb_, uint64_t seed) : s(s_), wsb(wsb_) {
    // The padded layout is the largest of the three.
    const Inputs big = make_inputs(s, Layout::HND_PAD, SPARGE_DTYPE_BFLOAT16, false, seed);
    q.alloc(big.q.storage * 2), k.alloc(big.k.storage * 2), v.alloc(big.v.storage * 2);
    out.alloc(big.q.storage * 2), lse.alloc(size_t(s.B * s.Hq * s.Lq) * 4), ws.alloc(wsb + 256);
    mask.alloc(size_t(s.B * s.Hq * s.nQB() * s.nKB()));
    const std::vector<uint8_t> m = random_mask(s, 0.5, seed ^ 0x5a5a);
    mask.upload(m.data(), m.size());
    const int64_t msh[4] = {s.B, s.Hq, s.nQB(), s.nKB()};
    const int64_t mst[4] = {s.Hq * s.nQB() * s.nKB(), s.nQB() * s.nKB(), s.nKB(), 1};
    md = make_desc(mask.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_UINT8, 4, msh, mst);
    const int64_t lsh[3] = {s.B, s.Hq, s.Lq}, lst[3] = {s.Hq * s.Lq, s.Lq, 1};
    ld = make_desc(lse.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_FLOAT32, 3, lsh, lst);
    set_inputs(Layout::HND, seed);
  }
  // New random values in layout `l` (same buffers: the pointers stay, the strides change).
  void set_inputs(Layout l, uint64_t seed) {
    in = make_inputs(s, l, SPARGE_DTYPE_BFLOAT16, false, seed);
    q.upload(in.q.bits.data(), in.q.storage * 2);
    k.upload(in.k.bits.data(), in.k.storage * 2);
    v.upload(in.v.bits.data(), in.v.storage * 2);
    qd = desc4(in.q, q.get(), SPARGE_DEVICE_CUDA), kd = desc4(in.k, k.get(), SPARGE_DEVICE_CUDA);
    vd = desc4(in.v, v.get(), SPARGE_DEVICE_CUDA), od = desc4(in.q, out.get(), SPARGE_DEVICE_CUDA);
  }
  sparge_status_t launch(sparge_plan_t plan, cudaStream_t st) {
    out.fill(0xFF), lse.fill(0xFF);  // NaN in bf16 and float32
    SGT_CUDA(cudaDeviceSynchronize());
    return call(plan, st);
  }
  // The call alone (nothing poisoned, no synchronization: capturable).
  sparge_status_t call(sparge_plan_t plan, cudaStream_t st) {
    sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
    prm.topk = topk;
    prm.attention_sink = sink, prm.local_window = window;
    return sparge_attention_run(plan, &qd, &kd, &vd, use_mask ? &md : nullptr, &prm, &od, use_lse ? &ld : nullptr,
                                ws.get(), wsb, st);
  }
  // The output's logical bits (then LSE bits); every element checked for having been written.
  std::vector<uint16_t> result(cudaStream_t st) const {
    SGT_CUDA(cudaStreamSynchronize(st));
    std::vector<uint16_t> raw(out.bytes() / 2);
    out.download(raw.data(), out.bytes());
    std::vector<uint16_t> r;
    r.reserve(size_t(s.B * s.Hq * s.Lq * s.D) + size_t(s.B * s.Hq * s.Lq) * 2);
    int64_t nan = 0;
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t i = 0; i < s.Lq; ++i)
          for (int64_t c = 0; c < s.D; ++c) {
            const uint16_t x = raw[size_t(in.q.off(b, h, i, c))];
            nan += is_nan16(x, SPARGE_DTYPE_BFLOAT16) ? 1 : 0;
            r.push_back(x);
          }
    CHECK(nan == 0);
    if (use_lse) {
      std::vector<uint16_t> l(lse.bytes() / 2);
      lse.download(l.data(), lse.bytes());
      r.insert(r.end(), l.begin(), l.end());
    }
    return r;
  }
  std::vector<uint16_t> run(sparge_plan_t plan, cudaStream_t st = nullptr) {
    const sparge_status_t status = launch(plan, st);
    INFO("sparge_attention_run: " << sparge_status_string(status) << " " << sparge_last_error());
    REQUIRE(status == SPARGE_OK);
    return result(st);
  }
  // The same call on a new plan (nothing cached).
  std::vector<uint16_t> fresh(sparge_precision_t prec) {
    size_t w = 0;
    sparge_plan_t p = make_plan(s, prec, &w);
    REQUIRE(w == wsb);
    std::vector<uint16_t> r = run(p);
    sparge_destroy_plan(p);
    return r;
  }
};

}  // namespace

TEST_CASE("cache: other tensors on one plan give a fresh plan's results", "[gpu][cache]") {
  const Shape s = shape();
  for (sparge_precision_t prec : precisions()) {
    INFO(precision_name(prec));
    size_t wsb = 0;
    sparge_plan_t plan = make_plan(s, prec, &wsb);
    Args x(s, wsb, case_seed("cache-x")), y(s, wsb, case_seed("cache-y"));
    const std::vector<uint16_t> rx = x.run(plan);
    CHECK(rx == x.fresh(prec));
    const std::vector<uint16_t> ry = y.run(plan);
    CHECK(ry == y.fresh(prec));
    CHECK(ry != rx);
    CHECK(x.run(plan) == rx);  // X again (its setup cached)
    CHECK(y.run(plan) == ry);
    // Y's inputs at X's workspace: a key that differs in the workspace alone.
    std::swap(x.ws, y.ws);
    CHECK(y.run(plan) == ry);
    CHECK(x.run(plan) == rx);
    sparge_destroy_plan(plan);
  }
}

// From a key's second call on, the call replays a CUDA graph of its launches
// (src/cuda/backend.cu): it must still read the inputs' current values, the
// current parameters, and run on the stream it is given, also inside the
// caller's own capture.
TEST_CASE("cache: repeated calls (graph replay) read the current inputs, parameters and stream",
          "[gpu][cache][graph]") {
  const Shape s = shape();
  for (sparge_precision_t prec : precisions()) {
    for (int use_mask = 0; use_mask < 2; ++use_mask) {
      INFO(precision_name(prec) << " mask " << use_mask);
      size_t wsb = 0;
      sparge_plan_t plan = make_plan(s, prec, &wsb);
      Args a(s, wsb, case_seed("graph-a"));
      a.use_mask = use_mask != 0;
      const std::vector<uint16_t> r1 = a.run(plan);  // launches one by one
      CHECK(r1 == a.run(plan));                      // captured, then replayed
      CHECK(r1 == a.run(plan));                      // replayed
      CHECK(r1 == a.fresh(prec));
      a.set_inputs(Layout::HND, case_seed("graph-b"));  // same pointers and strides, new values
      const std::vector<uint16_t> r2 = a.run(plan);
      CHECK(r2 != r1);
      CHECK(r2 == a.fresh(prec));
      if (!a.use_mask) {  // the prediction's parameters are not part of the pointer key
        // (at this shape the default sink and local window fill the top-k 0.25 and 0.5 budgets
        // alike: both off, so that the masks differ)
        a.topk = 0.25f, a.sink = 0, a.window = 0;
        const std::vector<uint16_t> r3 = a.run(plan);
        CHECK(r3 != r2);
        CHECK(r3 == a.fresh(prec));
        CHECK(r3 == a.run(plan));
        a.topk = 0.5f, a.sink = -1, a.window = -1;
        CHECK(r2 == a.run(plan));
        // top-k 1 on the same pointers: a dense call (a key of its own: no prediction, no lists)
        a.topk = 1.0f;
        const std::vector<uint16_t> r4 = a.run(plan);
        CHECK(r4 != r2);
        CHECK(r4 == a.fresh(prec));
        CHECK(r4 == a.run(plan));
        CHECK(r4 == a.run(plan));
        a.topk = 0.5f;
        CHECK(r2 == a.run(plan));
        a.topk = 1.0f;
        CHECK(r4 == a.run(plan));
        a.topk = 0.5f;
      }
      cudaStream_t st = nullptr;
      SGT_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      CHECK(r2 == a.run(plan, st));
      // The caller captures a call whose key already has a graph.
      a.out.fill(0xFF), a.lse.fill(0xFF);
      SGT_CUDA(cudaDeviceSynchronize());
      SGT_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      const sparge_status_t cs = a.call(plan, st);
      cudaGraph_t g = nullptr;
      SGT_CUDA(cudaStreamEndCapture(st, &g));
      INFO("captured call: " << sparge_last_error());
      REQUIRE(cs == SPARGE_OK);
      cudaGraphExec_t ge = nullptr;
      SGT_CUDA(cudaGraphInstantiate(&ge, g, 0));
      SGT_CUDA(cudaGraphLaunch(ge, st));
      CHECK(r2 == a.result(st));
      SGT_CUDA(cudaGraphExecDestroy(ge));
      SGT_CUDA(cudaGraphDestroy(g));
      SGT_CUDA(cudaStreamDestroy(st));
      sparge_destroy_plan(plan);
    }
  }
}

TEST_CASE("cache: the same pointers with other strides, LSE and mask give a fresh plan's results",
          "[gpu][cache]") {
  const Shape s = shape();
  for (sparge_precision_t prec : precisions()) {
    INFO(precision_name(prec));
    size_t wsb = 0;
    sparge_plan_t plan = make_plan(s, prec, &wsb);
    Args a(s, wsb, case_seed("cache-strides"));
    int step = 0;
    for (Layout l : {Layout::HND, Layout::NHD, Layout::HND_PAD, Layout::HND}) {
      a.set_inputs(l, case_seed("cache-strides" + std::to_string(step++)));
      for (int variant = 0; variant < 4; ++variant) {
        a.use_lse = (variant & 1) == 0;
        a.use_mask = (variant & 2) != 0;
        INFO(layout_name(l) << " lse " << a.use_lse << " mask " << a.use_mask);
        const std::vector<uint16_t> r = a.run(plan);
        CHECK(r == a.fresh(prec));
        CHECK(a.run(plan) == r);  // a hit gives the same
      }
    }
    sparge_destroy_plan(plan);
  }
}

TEST_CASE("cache: tensors freed and reallocated (same or other addresses) give a fresh plan's results",
          "[gpu][cache]") {
  const Shape s = shape();
  for (sparge_precision_t prec : precisions()) {
    INFO(precision_name(prec));
    size_t wsb = 0;
    sparge_plan_t plan = make_plan(s, prec, &wsb);
    int same_address = 0;
    for (int round = 0; round < 4; ++round) {
      auto a = std::make_unique<Args>(s, wsb, case_seed("cache-realloc" + std::to_string(round)));
      const void* old_q = a->q.get();
      const std::vector<uint16_t> r0 = a->run(plan);
      CHECK(r0 == a->fresh(prec));
      a.reset();  // cudaFree of every buffer
      auto b = std::make_unique<Args>(s, wsb, case_seed("cache-realloc-new" + std::to_string(round)));
      same_address += b->q.get() == old_q ? 1 : 0;
      if (round % 2 == 1) b->set_inputs(Layout::NHD, case_seed("cache-realloc-nhd" + std::to_string(round)));
      const std::vector<uint16_t> r1 = b->run(plan);
      CHECK(r1 == b->fresh(prec));
      CHECK(r1 != r0);
    }
    INFO("rounds whose new q landed at the freed address: " << same_address);
    SUCCEED();
    sparge_destroy_plan(plan);
  }
}

TEST_CASE("cache: two threads alternating their own tensors on one plan", "[gpu][cache][streams]") {
  const Shape s = shape();
  for (sparge_precision_t prec : precisions()) {
    INFO(precision_name(prec));
    size_t wsb = 0;
    sparge_plan_t plan = make_plan(s, prec, &wsb);
    // Thread t alternates between args[2t] and args[2t+1], each with its own workspace.
    std::vector<std::unique_ptr<Args>> args;
    std::vector<std::vector<uint16_t>> want;
    for (int i = 0; i < 4; ++i) {
      args.push_back(std::make_unique<Args>(s, wsb, case_seed("cache-thread" + std::to_string(i))));
      if (i >= 2) args.back()->set_inputs(Layout::NHD, case_seed("cache-thread-nhd" + std::to_string(i)));
      args.back()->use_lse = (i % 2) == 0;
      want.push_back(args.back()->fresh(prec));
    }
    std::atomic<int> bad{0}, failed{0};
    auto worker = [&](int t) {
      cudaStream_t st = nullptr;
      if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
        failed++;
        return;
      }
      for (int it = 0; it < 24; ++it) {
        Args& a = *args[size_t(2 * t + (it % 2))];
        // Poisoned and called in stream order on this thread's stream; nothing here
        // may use the test framework's macros (not thread-safe): failures are counted.
        if (cudaMemsetAsync(a.out.get(), 0xFF, a.out.bytes(), st) != cudaSuccess ||
            cudaMemsetAsync(a.lse.get(), 0xFF, a.lse.bytes(), st) != cudaSuccess || a.call(plan, st) != SPARGE_OK) {
          failed++;
          continue;
        }
        cudaStreamSynchronize(st);
        std::vector<uint16_t> raw(a.out.bytes() / 2);
        if (cudaMemcpy(raw.data(), a.out.get(), a.out.bytes(), cudaMemcpyDeviceToHost) != cudaSuccess) {
          failed++;
          continue;
        }
        const std::vector<uint16_t>& w = want[size_t(2 * t + (it % 2))];
        size_t j = 0;
        for (int64_t b = 0; b < s.B; ++b)
          for (int64_t h = 0; h < s.Hq; ++h)
            for (int64_t i = 0; i < s.Lq; ++i)
              for (int64_t c = 0; c < s.D; ++c, ++j)
                if (raw[size_t(a.in.q.off(b, h, i, c))] != w[j]) {
                  bad++;
                  goto next;
                }
      next:;
      }
      cudaStreamDestroy(st);
    };
    std::thread t0(worker, 0), t1(worker, 1);
    t0.join(), t1.join();
    CHECK(failed.load() == 0);
    CHECK(bad.load() == 0);
    sparge_destroy_plan(plan);
  }
}

TEST_CASE("cache: a host pointer among cached arguments is still refused", "[gpu][cache][errors]") {
  const Shape s = shape();
  const sparge_precision_t prec = precisions().front();
  size_t wsb = 0;
  sparge_plan_t plan = make_plan(s, prec, &wsb);
  Args a(s, wsb, case_seed("cache-host"));
  a.run(plan);  // cached
  std::vector<uint16_t> host(a.in.q.storage);
  const sparge_tensor_t dev_q = a.qd;
  a.qd.data = host.data();  // 256-byte alignment is not required of q: only the memory kind refuses it
  const sparge_status_t st = a.launch(plan, nullptr);
  CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
  CHECK(names_word(sparge_last_error(), "q"));
  a.qd = dev_q;
  CHECK(a.run(plan) == a.fresh(prec));
  sparge_destroy_plan(plan);
}
