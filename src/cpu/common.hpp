// Helpers shared by the CPU reference backend's parts.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/backend.hpp"
#include "cpu/numeric.hpp"

namespace sparge {
namespace cpu {

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads (at most
// 16), the calling thread included; tasks are handed out one at a time from a
// shared counter, so every task runs exactly once however many workers run.
// When the system refuses a worker thread (std::thread throws: a pids/nproc
// limit, no memory for its stack), no further workers are started and the
// tasks run on the threads already running, at the least the caller's, so the
// result is the same. The first exception thrown by any task is rethrown on
// the calling thread after every worker has been joined.
inline void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  unsigned hw = std::thread::hardware_concurrency();
  int64_t nt = std::min<int64_t>(n, std::max(1u, std::min(hw, 16u)));
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::exception_ptr err;
  std::mutex mu;
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  auto worker = [&]() {
    try {
      for (;;) {
        if (stop.load(std::memory_order_relaxed)) return;
        const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= n) return;
        fn(i);
      }
    } catch (...) {
      stop.store(true, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(size_t(nt - 1));
  } catch (...) {
    // no room for the handles: run on the calling thread alone
  }
  for (int64_t t = 1; t < nt && threads.size() < threads.capacity(); ++t) {
    try {
      threads.emplace_back(worker);
    } catch (...) {  // std::system_error (EAGAIN) or std::bad_alloc: run with the workers started
      break;
    }
  }
  worker();
  for (auto& th : threads) th.join();
  if (err) std::rethrow_exception(err);
}

// Copies rows [0, L) of head (b, h) of a validated tensor into a dense float
// buffer [L, D] (values are exactly those of the input type).
inline void load_head(const Tensor4& t, int64_t b, int64_t h, std::vector<float>& dst) {
  const int64_t L = t.shape[2], D = t.shape[3];
  dst.resize(size_t(L * D));
  for (int64_t l = 0; l < L; ++l) {
    const int64_t base = t.offset(b, h, l, 0);
    for (int64_t d = 0; d < D; ++d) dst[size_t(l * D + d)] = load_elem(t.data, t.dtype, base + d);
  }
}

// Whether key j is used by query row i (causality and mask).
struct RowMask {
  const Problem* p;
  const uint8_t* row;   // mask entries of query block i / BQ
  int64_t stride_kb;    // stride between key blocks
  int64_t last_key;     // last causally visible key (inclusive)
  bool used(int64_t j) const { return j <= last_key && row[(j / p->BK) * stride_kb] != 0; }
};

inline RowMask row_mask(const Problem& p, const MaskView& m, int64_t b, int64_t h, int64_t i) {
  RowMask r;
  r.p = &p;
  r.row = m.data + m.offset(b, h, i / p.BQ, 0);
  r.stride_kb = m.stride[3];
  r.last_key = p.causal ? std::min(causal_last_key(i, p.Lq, p.Lkv), p.Lkv - 1) : p.Lkv - 1;
  return r;
}

// Per-(b, kv head) K column means (zeros without smoothing), stored in the
// workspace region ws.k_mean (float [B*Hkv, D]).
void compute_k_mean(const Plan& plan, const Tensor4& k, bool smooth, float* k_mean);

}  // namespace cpu
}  // namespace sparge
