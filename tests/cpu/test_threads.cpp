// Concurrency: many caller threads creating, sharing and destroying plans,
// each with its own workspace, interleaving failing calls (per-thread
// messages). Run by CI under ThreadSanitizer (scripts/sanitize.sh).
#include "catch_compat.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "test_util.hpp"

using namespace sparge_test;

TEST_CASE("many threads create, share and destroy plans", "[cpu][threads]") {
  std::mt19937_64 rng(fresh_seed());
  const sparge_precision_t precs[] = {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_FP16, SPARGE_PRECISION_EXACT,
                                      SPARGE_PRECISION_INT8_FP16};
  constexpr int kPrec = 4;
  std::vector<sparge_problem_t> probs;
  for (sparge_precision_t p : precs) probs.push_back(cpu_problem(1, 4, 2, 72, 90, 16, SPARGE_DTYPE_FLOAT32, p, true));
  HostTensor q = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 4, 72, 16, Layout::HND);
  HostTensor k = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 2, 90, 16, Layout::HND);
  HostTensor v = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 2, 90, 16, Layout::HND);
  fill_random(q, rng);
  fill_random(k, rng);
  fill_random(v, rng);
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.topk = 0.5f;

  // References, one thread; the shared plans stay alive for the whole test.
  std::vector<std::unique_ptr<Plan>> shared;
  std::vector<std::vector<unsigned char>> want;
  for (const auto& pr : probs) {
    shared.emplace_back(new Plan(pr));
    HostTensor out = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 4, 72, 16, Layout::HND);
    REQUIRE(run_attention(*shared.back(), q, k, v, nullptr, &params, out, nullptr) == SPARGE_OK);
    want.push_back(out.snapshot());
  }

  // Buffers are made here: the worker threads call only the C API (Catch2's
  // assertions are not thread-safe).
  constexpr int kThreads = 8, kIters = 24;
  size_t ws_max = 0;
  for (const auto& pl : shared) ws_max = std::max(ws_max, pl->workspace_size());
  std::vector<HostTensor> outs;
  std::vector<std::shared_ptr<unsigned char>> wss;
  for (int t = 0; t < kThreads; ++t) {
    outs.push_back(make_bhld(SPARGE_DTYPE_FLOAT32, 1, 4, 72, 16, Layout::HND));
    wss.push_back(alloc_workspace(ws_max));
  }
  std::atomic<int> mismatches{0}, failures{0}, bad_messages{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      HostTensor& out = outs[size_t(t)];
      void* ws = wss[size_t(t)].get();
      for (int it = 0; it < kIters; ++it) {
        const int pi = (t + it) % kPrec;
        // Half the calls use a plan of their own (created and destroyed here), half a shared one.
        sparge_plan_t own = nullptr, plan = shared[size_t(pi)]->p;
        if ((t + it) % 2 == 0) {
          if (sparge_create_plan(&probs[size_t(pi)], &own) != SPARGE_OK) {
            ++failures;
            continue;
          }
          plan = own;
        }
        size_t need = 0;
        if (sparge_plan_workspace_size(plan, &need) != SPARGE_OK || need > ws_max) ++failures;
        out.fill_nan();
        const sparge_status_t st = sparge_attention_run(plan, q.desc(), k.desc(), v.desc(), nullptr, &params,
                                                        out.desc(), nullptr, ws, need, nullptr);
        if (st != SPARGE_OK) ++failures;
        else if (out.snapshot() != want[size_t(pi)]) ++mismatches;
        sparge_destroy_plan(own);
        // A failing call: this thread's message names its own value.
        sparge_problem_t badp = probs[size_t(pi)];
        badp.len_q = -(t + 1);
        sparge_plan_t none = nullptr;
        if (sparge_create_plan(&badp, &none) != SPARGE_ERR_INVALID_ARGUMENT) ++failures;
        const std::string msg = sparge_last_error();
        if (msg.find("len_q is " + std::to_string(-(t + 1))) == std::string::npos) ++bad_messages;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
  CHECK(mismatches.load() == 0);
  CHECK(bad_messages.load() == 0);
}
