// Fault injection: the library under refused thread creation and failed host
// allocations. This executable interposes three functions for the whole
// process, libsparge included (the dynamic linker resolves them to the
// executable's definitions first):
//  - pthread_create (what std::thread calls): fails with EAGAIN after a given
//    number of successes, as under a pids/nproc limit;
//  - get_nprocs (what std::thread::hardware_concurrency reads): reports 16
//    CPUs, so that the CPU backend starts 15 workers on any machine;
//  - operator new / delete: operator new throws std::bad_alloc after a given
//    number of successes.
// Every call must return a status (OK, or OUT_OF_MEMORY for allocations),
// never abort and never let an exception out; a call that returns OK must give
// the same bytes as a call without faults.
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <string>

#include "catch_compat.hpp"
#include "test_util.hpp"

namespace {
std::atomic<long> g_threads_left{-1};  // successful pthread_create calls still allowed; -1 = no limit
std::atomic<long> g_allocs_left{-1};   // successful operator new calls still allowed; -1 = no limit
std::atomic<long> g_threads_refused{0}, g_allocs_refused{0};

bool take(std::atomic<long>& left) {  // false: inject the failure
  long v = left.load();
  for (;;) {
    if (v < 0) return true;
    if (v == 0) return false;
    if (left.compare_exchange_weak(v, v - 1)) return true;
  }
}
}  // namespace

extern "C" __attribute__((visibility("default"))) int pthread_create(pthread_t* th, const pthread_attr_t* attr, void* (*fn)(void*), void* arg) {
  using real_t = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static real_t real = reinterpret_cast<real_t>(dlsym(RTLD_NEXT, "pthread_create"));
  if (!take(g_threads_left)) {
    g_threads_refused.fetch_add(1);
    return EAGAIN;
  }
  return real(th, attr, fn, arg);
}

extern "C" __attribute__((visibility("default"))) int get_nprocs(void) { return 16; }

__attribute__((visibility("default"))) void* operator new(size_t n) {
  if (!take(g_allocs_left)) {
    g_allocs_refused.fetch_add(1);
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((visibility("default"))) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((visibility("default"))) void operator delete(void* p, size_t) noexcept { std::free(p); }

using namespace sparge_test;

namespace {

struct Case {
  sparge_problem_t prob;
  HostTensor q, k, v, out, lse, mask, kept;
};

// 2 x 8 heads: 16 tasks for the CPU backend's workers.
Case make_case(sparge_precision_t prec, std::mt19937_64& rng) {
  Case c;
  c.prob = cpu_problem(2, 8, 4, 96, 130, 32, SPARGE_DTYPE_FLOAT32, prec, /*causal=*/true);
  c.prob.block_q = 32;
  c.prob.block_k = 32;
  c.q = make_bhld(SPARGE_DTYPE_FLOAT32, 2, 8, 96, 32, Layout::HND);
  c.k = make_bhld(SPARGE_DTYPE_FLOAT32, 2, 4, 130, 32, Layout::HND);
  c.v = make_bhld(SPARGE_DTYPE_FLOAT32, 2, 4, 130, 32, Layout::HND);
  fill_random(c.q, rng);
  fill_random(c.k, rng);
  fill_random(c.v, rng);
  c.out = make_bhld(SPARGE_DTYPE_FLOAT32, 2, 8, 96, 32, Layout::HND);
  c.lse = make_dense(SPARGE_DTYPE_FLOAT32, {2, 8, 96});
  c.mask = make_dense(SPARGE_DTYPE_UINT8, {2, 8, 3, 5});
  c.kept = make_dense(SPARGE_DTYPE_INT32, {2, 8});
  return c;
}

struct Outcome {
  sparge_status_t attn = SPARGE_OK, pred = SPARGE_OK;
  bool threw = false;
  std::string msg;
  std::vector<unsigned char> out, lse, mask;
};

// Plan creation, workspace query, prediction and attention with the faults
// armed (the test's own allocations happen before and after).
Outcome run_all(Case& c, long threads_ok, long allocs_ok) {
  Outcome r;
  c.out.fill_nan();
  c.lse.fill_nan();
  std::vector<unsigned char> ws(1 << 22);
  void* wsp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) & ~uintptr_t(255));
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.topk = 0.6f;
  char msg[1024] = "";  // no allocation while the faults are armed
  g_threads_left = threads_ok;
  g_allocs_left = allocs_ok;
  try {
    sparge_plan_t plan = nullptr;
    sparge_status_t st = sparge_create_plan(&c.prob, &plan);
    size_t need = 0;
    if (st == SPARGE_OK) st = sparge_plan_workspace_size(plan, &need);
    if (st == SPARGE_OK && need > ws.size() - 256) st = SPARGE_ERR_INTERNAL;  // the test's buffer is too small
    if (st == SPARGE_OK) {
      r.pred = sparge_predict_mask(plan, c.q.desc(), c.k.desc(), &params, c.mask.desc(), c.kept.desc(), wsp, need,
                                   nullptr);
      r.attn = sparge_attention_run(plan, c.q.desc(), c.k.desc(), c.v.desc(), nullptr, &params, c.out.desc(),
                                    c.lse.desc(), wsp, need, nullptr);
    } else {
      r.pred = r.attn = st;
    }
    if (r.attn != SPARGE_OK || r.pred != SPARGE_OK) std::snprintf(msg, sizeof(msg), "%s", sparge_last_error());
    sparge_destroy_plan(plan);
  } catch (...) {
    r.threw = true;
  }
  g_threads_left = -1;
  g_allocs_left = -1;
  r.msg = msg;
  r.out = c.out.snapshot();
  r.lse = c.lse.snapshot();
  r.mask = c.mask.snapshot();
  return r;
}

}  // namespace

TEST_CASE("refused worker threads: a status and the same result, never std::terminate", "[fault]") {
  std::mt19937_64 rng(fresh_seed());
  for (sparge_precision_t prec : {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_FP16, SPARGE_PRECISION_EXACT}) {
    Case c = make_case(prec, rng);
    const Outcome ref = run_all(c, -1, -1);
    REQUIRE(ref.attn == SPARGE_OK);
    REQUIRE(ref.pred == SPARGE_OK);
    for (long ok : {0L, 1L, 3L, 7L, 14L, 20L, 40L}) {
      INFO("precision " << int(prec) << ", pthread_create succeeds " << ok << " times, then fails");
      g_threads_refused = 0;
      const Outcome r = run_all(c, ok, -1);
      REQUIRE_FALSE(r.threw);
      CHECK(r.pred == SPARGE_OK);
      CHECK(r.attn == SPARGE_OK);
      CHECK(r.out == ref.out);
      CHECK(r.lse == ref.lse);
      CHECK(r.mask == ref.mask);
      if (ok < 14) CHECK(g_threads_refused.load() > 0);  // the fault was hit
    }
  }
}

TEST_CASE("failed host allocations: OUT_OF_MEMORY with a message, never an abort", "[fault]") {
  std::mt19937_64 rng(fresh_seed());
  for (sparge_precision_t prec : {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_FP16}) {
    Case c = make_case(prec, rng);
    const Outcome ref = run_all(c, -1, -1);
    REQUIRE(ref.attn == SPARGE_OK);
    int oom = 0, ok = 0;
    // Fail the n-th allocation for every n until a run needs no more than n.
    for (long n = 0; n < 100000; n = n < 64 ? n + 1 : n + n / 8) {
      INFO("precision " << int(prec) << ", operator new succeeds " << n << " times, then throws");
      g_allocs_refused = 0;
      const Outcome r = run_all(c, -1, n);
      REQUIRE_FALSE(r.threw);
      if (n == 0 && g_allocs_refused.load() == 0) {
        // Not one allocation of the library reached this executable's operator new: the library
        // does not import it (a toolchain that links libstdc++ into it statically, where the
        // version script keeps its copy local). Nothing can be injected: said, not passed.
        WARN("fault injection of host allocations not possible: libsparge does not call this executable's operator "
             "new (libstdc++ linked into the library?)");
        return;
      }
      for (sparge_status_t st : {r.pred, r.attn}) CHECK((st == SPARGE_OK || st == SPARGE_ERR_OUT_OF_MEMORY));
      if (r.attn == SPARGE_ERR_OUT_OF_MEMORY) {
        ++oom;
        CHECK(r.msg.find("out of host memory") != std::string::npos);
      } else if (r.attn == SPARGE_OK) {
        CHECK(r.out == ref.out);
        CHECK(r.lse == ref.lse);
      }
      if (g_allocs_refused.load() == 0) {  // this many allocations were enough: done
        ++ok;
        CHECK(r.attn == SPARGE_OK);
        break;
      }
    }
    CHECK(oom > 0);
    CHECK(ok == 1);
  }
}

TEST_CASE("both faults at once", "[fault]") {
  std::mt19937_64 rng(fresh_seed());
  Case c = make_case(SPARGE_PRECISION_INT8_FP8, rng);
  const Outcome ref = run_all(c, -1, -1);
  REQUIRE(ref.attn == SPARGE_OK);
  for (long t : {2L, 5L})
    for (long a : {10L, 40L, 160L}) {
      const Outcome r = run_all(c, t, a);
      REQUIRE_FALSE(r.threw);
      CHECK((r.attn == SPARGE_OK || r.attn == SPARGE_ERR_OUT_OF_MEMORY));
      if (r.attn == SPARGE_OK) CHECK(r.out == ref.out);
    }
}
