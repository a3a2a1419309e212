// Mask prediction properties: top-k counts, CDF minimality (brute force),
// forced non-compressible blocks, attention sink, causality, per-head values,
// block sizes, kept counts and visible-block counts.
#include "catch_compat.hpp"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cmath>
#include <numeric>
#include <random>

#include "test_util.hpp"
#include "core/problem.hpp"

using namespace sparge_test;

namespace {

// Rows of each block = block centre + noise: pooled scores are well separated.
void fill_blocks(HostTensor& t, int64_t block, std::mt19937_64& rng, float centre, float noise) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const auto& s = t.t.shape;
  std::vector<float> c(static_cast<size_t>(s[3]));
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t r0 = 0; r0 < s[2]; r0 += block) {
        for (auto& x : c) x = nd(rng) * centre;
        for (int64_t r = r0; r < std::min(s[2], r0 + block); ++r)
          for (int64_t d = 0; d < s[3]; ++d) t.set(b, h, r, d, c[size_t(d)] + noise * nd(rng));
      }
}

struct Pred {
  sparge_problem_t prob;
  int64_t BQ, BK, nQB, nKB;
  HostTensor q, k, mask, kept;
};

Pred make_pred(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, int64_t D, int BQ, int BK, bool causal,
               std::mt19937_64& rng) {
  Pred p;
  p.prob = cpu_problem(B, Hq, Hkv, Lq, Lkv, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT, causal);
  p.prob.block_q = BQ;
  p.prob.block_k = BK;
  p.BQ = BQ;
  p.BK = BK;
  p.nQB = ceil_div(Lq, BQ);
  p.nKB = ceil_div(Lkv, BK);
  p.q = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hq, Lq, D, Layout::HND);
  p.k = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hkv, Lkv, D, Layout::NHD);
  fill_blocks(p.q, BQ, rng, 1.0f, 0.3f);
  fill_blocks(p.k, BK, rng, 1.0f, 0.3f);
  p.mask = make_dense(SPARGE_DTYPE_UINT8, {B, Hq, p.nQB, p.nKB});
  p.kept = make_dense(SPARGE_DTYPE_INT32, {B, Hq});
  return p;
}

int64_t visible(const Pred& p, int64_t qb) {
  if (!p.prob.causal) return p.nKB;
  const int64_t last_row = std::min(p.prob.len_q - 1, qb * p.BQ + p.BQ - 1);
  const int64_t last_key = last_row + (p.prob.len_kv - p.prob.len_q);
  if (last_key < 0) return 0;
  return std::min(last_key, p.prob.len_kv - 1) / p.BK + 1;
}

// Test-side block probabilities (float64) of the estimator MEAN: softmax over visible blocks of
// the pooled scores (K smoothed by its mean).
std::vector<double> block_probs(const Pred& p, int64_t b, int64_t h, int64_t qb, bool smooth) {
  const int64_t D = p.prob.head_dim, hk = h / (p.prob.heads_q / p.prob.heads_kv);
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> mu(size_t(D), 0.0), pq(size_t(D), 0.0);
  if (smooth)
    for (int64_t j = 0; j < p.prob.len_kv; ++j)
      for (int64_t d = 0; d < D; ++d) mu[size_t(d)] += p.k.get(b, hk, j, d) / double(p.prob.len_kv);
  const int64_t r1 = std::min(p.prob.len_q, qb * p.BQ + p.BQ);
  for (int64_t r = qb * p.BQ; r < r1; ++r)
    for (int64_t d = 0; d < D; ++d) pq[size_t(d)] += p.q.get(b, h, r, d) / double(r1 - qb * p.BQ);
  const int64_t vis = visible(p, qb);
  std::vector<double> s(static_cast<size_t>(vis));
  for (int64_t kb = 0; kb < vis; ++kb) {
    const int64_t j1 = std::min(p.prob.len_kv, kb * p.BK + p.BK), n = j1 - kb * p.BK;
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) {
      double pk = 0;
      for (int64_t j = kb * p.BK; j < j1; ++j) pk += p.k.get(b, hk, j, d) - mu[size_t(d)];
      dot += pq[size_t(d)] * pk / double(n);
    }
    s[size_t(kb)] = scale * dot;
  }
  const double mx = vis ? *std::max_element(s.begin(), s.end()) : 0.0;
  double tot = 0;
  for (auto& x : s) tot += (x = std::exp(x - mx));
  for (auto& x : s) x /= tot;
  return s;
}

std::vector<int64_t> kept_blocks(const Pred& p, int64_t b, int64_t h, int64_t qb) {
  std::vector<int64_t> r;
  for (int64_t kb = 0; kb < p.nKB; ++kb)
    if (p.mask.get(b, h, qb, kb) != 0.0f) r.push_back(kb);
  return r;
}

// Test-side forced blocks of the budget: the sink (key block 0), the local window (the key
// blocks holding the diagonal keys i + Lkv - Lq of the block's rows, and w - 1 more on each side)
// and, causal, the first diagonal block. sink / window -1: the documented defaults of the mode.
std::vector<bool> budget_forced_blocks(const Pred& p, int64_t qb, int sink, int window) {
  const bool causal = p.prob.causal != 0;
  if (sink < 0) sink = 1;
  if (window < 0) window = causal ? 2 : 1;
  const int64_t vis = visible(p, qb), Lq = p.prob.len_q, Lkv = p.prob.len_kv;
  std::vector<bool> f(static_cast<size_t>(vis), false);
  if (vis == 0) return f;
  if (sink) f[0] = true;
  int64_t first = INT64_MAX, last = -1;
  for (int64_t i = qb * p.BQ; i < std::min(Lq, qb * p.BQ + p.BQ); ++i) {
    const int64_t j = std::min(std::max<int64_t>(i + Lkv - Lq, 0), Lkv - 1);
    first = std::min(first, j / p.BK);
    last = std::max(last, j / p.BK);
  }
  if (window > 0) {
    for (int64_t kb = first - (window - 1); kb <= last + (window - 1); ++kb)
      if (kb >= 0 && kb < vis) f[size_t(kb)] = true;
  } else if (causal && first < vis) {
    f[size_t(first)] = true;
  }
  return f;
}

int64_t topk_n(float topk, int64_t vis) {
  if (vis == 0) return 0;
  return std::min(vis, std::max<int64_t>(1, int64_t(double(topk) * double(vis) + 1e-4)));
}

// Top-k parameters without sink and window (only the causal diagonal block is forced).
sparge_predict_params_t bare_topk(float topk, sparge_estimator_t est) {
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.estimator = est;
  params.topk = topk;
  params.attention_sink = 0;
  params.local_window = 0;
  return params;
}

// Row qb of head h in p.mask (no sink, no window) against reference scores sc[0..vis): it keeps the
// forced blocks and the top-k count, and the other kept blocks are among the highest scores.
// Returns false (nothing checked beyond the count) where the boundary is a near-tie (1e-5).
bool kept_are_top_scores(const Pred& p, int64_t h, int64_t qb, const std::vector<double>& sc, float topk) {
  const int64_t vis = visible(p, qb);
  const int64_t n = topk_n(topk, vis);
  const auto F = budget_forced_blocks(p, qb, 0, 0);  // causal: the first diagonal block
  const int64_t nf = std::count(F.begin(), F.end(), true);
  std::vector<double> others;
  for (int64_t kb = 0; kb < vis; ++kb)
    if (!F[size_t(kb)]) others.push_back(sc[size_t(kb)]);
  std::sort(others.rbegin(), others.rend());
  const int64_t m = std::max<int64_t>(0, n - nf);
  const auto kept = kept_blocks(p, 0, h, qb);
  REQUIRE(int64_t(kept.size()) == std::max(n, nf));
  if (m == 0 || (m < int64_t(others.size()) && others[size_t(m - 1)] - others[size_t(m)] < 1e-5)) return false;
  for (int64_t kb : kept)
    if (!F[size_t(kb)]) CHECK(sc[size_t(kb)] >= others[size_t(m - 1)] - 1e-9);
  return true;
}

void check_masks_binary_and_kept(const Pred& p) {
  for (int64_t b = 0; b < p.prob.batch; ++b)
    for (int64_t h = 0; h < p.prob.heads_q; ++h) {
      int64_t n = 0;
      for (int64_t qb = 0; qb < p.nQB; ++qb)
        for (int64_t kb = 0; kb < p.nKB; ++kb) {
          const float m = p.mask.get(b, h, qb, kb);
          REQUIRE((m == 0.0f || m == 1.0f));
          n += m != 0.0f;
          if (kb >= visible(p, qb)) REQUIRE(m == 0.0f);  // causally invisible: never kept
        }
      CHECK(int64_t(p.kept.get(b, h)) == n);
    }
}

}  // namespace

TEST_CASE("top-k keeps max(1, floor(topk * visible)) blocks: the budget's forced ones, then the highest",
          "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const int sw[][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 2}, {-1, -1}};
  for (bool causal : {false, true})
    for (float topk : {0.05f, 0.3f, 0.5f, 1.0f})
      for (const auto& sinkwin : sw) {
        INFO("causal " << causal << " topk " << topk << " sink " << sinkwin[0] << " window " << sinkwin[1]);
        Pred p = make_pred(2, 4, 2, 600, 640, 32, 64, 64, causal, rng);
        Plan plan(p.prob);
        sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
        params.estimator = SPARGE_ESTIMATOR_MEAN;  // the rule of block_probs
        params.topk = topk;
        params.attention_sink = sinkwin[0];
        params.local_window = sinkwin[1];
        REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
        check_masks_binary_and_kept(p);
        int64_t checked_sets = 0;
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t h = 0; h < 4; ++h)
            for (int64_t qb = 0; qb < p.nQB; ++qb) {
              const int64_t vis = visible(p, qb);
              const auto F = budget_forced_blocks(p, qb, sinkwin[0], sinkwin[1]);
              const int64_t nf = std::count(F.begin(), F.end(), true);
              const int64_t n = std::max(topk_n(topk, vis), nf);
              const auto kept = kept_blocks(p, b, h, qb);
              REQUIRE(int64_t(kept.size()) == n);
              std::vector<bool> in(size_t(p.nKB), false);
              for (int64_t kb : kept) in[size_t(kb)] = true;
              for (int64_t kb = 0; kb < vis; ++kb)
                if (F[size_t(kb)]) REQUIRE(in[size_t(kb)]);
              // the rest is the n - nf most probable of the others (skip rows with a near tie at the cut)
              const auto P = block_probs(p, b, h, qb, true);
              std::vector<double> others;
              for (int64_t kb = 0; kb < vis; ++kb)
                if (!F[size_t(kb)]) others.push_back(P[size_t(kb)]);
              std::sort(others.rbegin(), others.rend());
              const int64_t m = n - nf, no = int64_t(others.size());
              if (m == 0) continue;
              if (m < no && others[size_t(m - 1)] - others[size_t(m)] < 1e-5 * others[0]) continue;
              for (int64_t kb : kept)
                if (!F[size_t(kb)]) CHECK(P[size_t(kb)] >= others[size_t(m - 1)]);
              ++checked_sets;
            }
        if (topk >= 0.5f) CHECK(checked_sets > 0);
      }
}

// Top-k ranks the block scores themselves, not their float32 probabilities: key block kb holds
// copies of c_kb w (w a unit vector, c_kb a permutation of 0, step, 2 step, ...) and every query row
// is 2 w plus noise, so the block scores of both estimators are (scale 2 c_kb + a constant) up to
// small terms, 20 apart. Over a row they span hundreds, so the probabilities of most blocks are 0 in
// float32 (the softmax of a score 104 below the row's maximum underflows), and a ranking by
// probability would take those blocks by index. The kept sets must be the forced blocks and then
// the largest c_kb.
TEST_CASE("top-k ranks the block scores, also where their probabilities underflow to 0", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int sw[][2] = {{0, 0}, {1, 0}, {1, 2}};
  for (bool causal : {false, true})
    for (int est = 0; est < 2; ++est) {
      const int64_t Lq = causal ? 1024 : 512, Lkv = 1024, D = 32;
      Pred p = make_pred(1, 2, 1, Lq, Lkv, D, 128, 64, causal, rng);
      std::vector<float> w(static_cast<size_t>(D));
      double n2 = 0.0;
      for (float& x : w) n2 += double(x = nd(rng)) * x;
      for (float& x : w) x = float(x / std::sqrt(n2));
      const double scale = 1.0 / std::sqrt(double(D)), step = 10.0 / scale;  // scores 20 apart
      std::vector<int64_t> perm(static_cast<size_t>(p.nKB));
      std::iota(perm.begin(), perm.end(), int64_t(0));
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t j = 0; j < Lkv; ++j)
        for (int64_t d = 0; d < D; ++d)
          p.k.set(0, 0, j, d, float(step * double(perm[size_t(j / 64)])) * w[size_t(d)] + 0.01f * nd(rng));
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < Lq; ++i)
          for (int64_t d = 0; d < D; ++d) p.q.set(0, h, i, d, 2.0f * w[size_t(d)] + 0.3f * nd(rng));
      Plan plan(p.prob);
      int64_t underflow_rows = 0;
      for (float topk : {0.25f, 0.5f, 0.75f})
        for (const auto& sinkwin : sw) {
          INFO("causal " << causal << " estimator " << (est ? "keys_lse" : "mean") << " topk " << topk << " sink "
                         << sinkwin[0] << " window " << sinkwin[1]);
          sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
          params.estimator = est ? SPARGE_ESTIMATOR_KEYS_LSE : SPARGE_ESTIMATOR_MEAN;
          params.topk = topk;
          params.attention_sink = sinkwin[0];
          params.local_window = sinkwin[1];
          REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
          check_masks_binary_and_kept(p);
          for (int64_t h = 0; h < 2; ++h)
            for (int64_t qb = 0; qb < p.nQB; ++qb) {
              const int64_t vis = visible(p, qb);
              const auto F = budget_forced_blocks(p, qb, sinkwin[0], sinkwin[1]);
              std::vector<int64_t> others;
              int64_t nf = 0, cmax = -1;
              for (int64_t kb = 0; kb < vis; ++kb) {
                cmax = std::max(cmax, perm[size_t(kb)]);
                if (F[size_t(kb)])
                  ++nf;
                else
                  others.push_back(kb);
              }
              std::sort(others.begin(), others.end(),
                        [&](int64_t a, int64_t c) { return perm[size_t(a)] > perm[size_t(c)]; });
              const int64_t m = std::max(topk_n(topk, vis), nf) - nf;
              for (int64_t kb = 0; kb < vis; ++kb)
                if (F[size_t(kb)]) REQUIRE(p.mask.get(0, h, qb, kb) == 1.0f);
              for (int64_t t = 0; t < int64_t(others.size()); ++t)
                REQUIRE(p.mask.get(0, h, qb, others[size_t(t)]) == (t < m ? 1.0f : 0.0f));
              // the cut lies where float32 probabilities are 0 (so the test tells the two rankings apart)
              if (m > 1 && m < int64_t(others.size()) &&
                  2.0 * scale * step * double(cmax - perm[size_t(others[size_t(m - 1)])]) > 110.0)
                ++underflow_rows;
            }
        }
      CHECK(underflow_rows > 0);
    }
}

TEST_CASE("CDF mode keeps the smallest set holding the forced blocks and reaching the threshold (brute force)",
          "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const int sw[][2] = {{0, 0}, {1, 0}, {0, 2}, {-1, -1}};
  for (bool causal : {false, true})
    for (float thr : {0.3f, 0.7f, 0.95f, 1.0f})
      for (const auto& sinkwin : sw) {
        INFO("causal " << causal << " cdf " << thr << " sink " << sinkwin[0] << " window " << sinkwin[1]);
        Pred p = make_pred(1, 3, 3, 320, 320, 16, 32, 32, causal, rng);  // nKB = 10
        Plan plan(p.prob);
        sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
        params.estimator = SPARGE_ESTIMATOR_MEAN;  // the rule of block_probs
        params.mode = SPARGE_SELECT_CDF;
        params.cdf_threshold = thr;
        params.topk = 0.0f;  // not used in CDF mode
        params.attention_sink = sinkwin[0];
        params.local_window = sinkwin[1];
        REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
        check_masks_binary_and_kept(p);
        for (int64_t h = 0; h < 3; ++h)
          for (int64_t qb = 0; qb < p.nQB; ++qb) {
            const auto P = block_probs(p, 0, h, qb, true);
            const int64_t vis = int64_t(P.size());
            const auto F = budget_forced_blocks(p, qb, sinkwin[0], sinkwin[1]);
            uint32_t fmask = 0;
            for (int64_t i = 0; i < vis; ++i) fmask |= F[size_t(i)] ? (1u << i) : 0u;
            // brute force: the smallest superset of the forced blocks whose probability reaches thr,
            // and whether a near-threshold subset makes the answer ambiguous
            int64_t best = vis;
            bool ambiguous = false;
            for (uint32_t s = 1; s < (1u << vis); ++s) {
              if ((s & fmask) != fmask) continue;
              double sum = 0;
              for (int64_t i = 0; i < vis; ++i)
                if (s >> i & 1) sum += P[size_t(i)];
              const int64_t n = __builtin_popcount(s);
              if (std::fabs(sum - thr) < 1e-5) ambiguous = true;
              if (sum >= thr) best = std::min(best, n);
            }
            const auto kept = kept_blocks(p, 0, h, qb);
            if (ambiguous) continue;
            INFO("h " << h << " qb " << qb);
            CHECK(int64_t(kept.size()) == std::max<int64_t>(1, best));
            double sum = 0;
            for (int64_t kb : kept) sum += P[size_t(kb)];
            CHECK(sum >= thr - 1e-6);
            for (int64_t kb = 0; kb < vis; ++kb)
              if (F[size_t(kb)]) CHECK(p.mask.get(0, h, qb, kb) != 0.0f);
          }
      }
}

TEST_CASE("non-compressible Q and K blocks are kept whole; sink keeps key block 0", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Pred p = make_pred(1, 2, 1, 512, 512, 32, 64, 64, false, rng);
  // q block 3 and k block 5: pure noise (self-similarity ~ 1/n); the rest ~ 1
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t r = 3 * 64; r < 4 * 64; ++r)
      for (int64_t d = 0; d < 32; ++d) p.q.set(0, h, r, d, nd(rng));
  for (int64_t r = 5 * 64; r < 6 * 64; ++r)
    for (int64_t d = 0; d < 32; ++d) p.k.set(0, 0, r, d, nd(rng));
  Plan plan(p.prob);
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.topk = 0.1f;  // one block per row
  params.sim_threshold = 0.5f;
  params.attention_sink = 0;
  params.local_window = 0;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  check_masks_binary_and_kept(p);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t qb = 0; qb < 8; ++qb) {
      const auto kept = kept_blocks(p, 0, h, qb);
      INFO("h " << h << " qb " << qb);
      if (qb == 3) {
        CHECK(kept.size() == 8);  // whole row
      } else {
        CHECK(std::count(kept.begin(), kept.end(), 5) == 1);  // forced K block
        CHECK(kept.size() <= 2);                              // 1 selected + forced
      }
    }
  // Disabled forcing: exactly one per row.
  params.sim_threshold = -0.1f;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  bool some_row_without_block0 = false;
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t qb = 0; qb < 8; ++qb) {
      const auto kept = kept_blocks(p, 0, h, qb);
      CHECK(kept.size() == 1);
      if (kept[0] != 0) some_row_without_block0 = true;
    }
  // Sink: block 0 in every row, counted in the budget (one block per row: the sink only).
  params.attention_sink = 1;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t qb = 0; qb < 8; ++qb) {
      const auto kept = kept_blocks(p, 0, h, qb);
      REQUIRE(kept.size() == 1);
      CHECK(kept[0] == 0);
    }
  CHECK(some_row_without_block0);
}

TEST_CASE("causally invisible blocks are never kept, even when forced", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct L {
    int64_t lq, lkv;
  };
  for (L l : {L{300, 300}, L{200, 450}, L{450, 200}}) {
    INFO("Lq " << l.lq << " Lkv " << l.lkv);
    Pred p = make_pred(1, 2, 2, l.lq, l.lkv, 16, 32, 48, true, rng);
    Plan plan(p.prob);
    int64_t vis_total = 0;
    REQUIRE(sparge_plan_visible_blocks(plan.p, &vis_total) == SPARGE_OK);
    int64_t expect = 0;
    for (int64_t qb = 0; qb < p.nQB; ++qb) expect += visible(p, qb);
    CHECK(vis_total == expect);
    // brute force over tokens: a block pair is visible iff some (i, j) pair is
    int64_t brute = 0;
    for (int64_t qb = 0; qb < p.nQB; ++qb)
      for (int64_t kb = 0; kb < p.nKB; ++kb) {
        bool any = false;
        for (int64_t i = qb * 32; i < std::min(l.lq, qb * 32 + 32) && !any; ++i)
          for (int64_t j = kb * 48; j < std::min(l.lkv, kb * 48 + 48) && !any; ++j) any = j <= i + (l.lkv - l.lq);
        brute += any;
      }
    CHECK(vis_total == brute);

    sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
    params.sim_threshold = 2.0f;  // every block non-compressible: all visible kept
    params.attention_sink = 1;
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    check_masks_binary_and_kept(p);
    for (int64_t h = 0; h < 2; ++h) {
      CHECK(int64_t(p.kept.get(0, h)) == vis_total);
      for (int64_t qb = 0; qb < p.nQB; ++qb) CHECK(int64_t(kept_blocks(p, 0, h, qb).size()) == visible(p, qb));
    }
    params.sim_threshold = -0.1f;
    params.topk = 0.5f;
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    check_masks_binary_and_kept(p);
    for (int64_t qb = 0; qb < p.nQB; ++qb)
      if (visible(p, qb) == 0) CHECK(kept_blocks(p, 0, 0, qb).empty());
  }
}

TEST_CASE("per-head parameters are honoured", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  Pred p = make_pred(2, 4, 2, 256, 640, 16, 64, 64, false, rng);  // nKB = 10
  Plan plan(p.prob);
  const float topk[4] = {0.1f, 0.25f, 0.5f, 1.0f};
  const float sim[4] = {-0.1f, -0.1f, -0.1f, 2.0f};
  // the default sink and window count in the budget: a row keeps at least its forced blocks
  auto kept_at_least = [&](int64_t n) {
    int64_t total = 0;
    for (int64_t qb = 0; qb < p.nQB; ++qb) {
      const auto F = budget_forced_blocks(p, qb, -1, -1);
      total += std::max<int64_t>(n, std::count(F.begin(), F.end(), true));
    }
    return total;
  };
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.topk = 0.9f;  // overridden
  params.topk_per_head = topk;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h) CHECK(int64_t(p.kept.get(b, h)) == kept_at_least(topk_n(topk[h], 10)));
  params.topk_per_head = nullptr;
  params.topk = 0.1f;
  params.sim_threshold_per_head = sim;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h) CHECK(int64_t(p.kept.get(b, h)) == (h == 3 ? p.nQB * 10 : kept_at_least(1)));
  const float cdf[4] = {1.0f, 1e-6f, 1.0f, 1e-6f};
  params.sim_threshold_per_head = nullptr;
  params.mode = SPARGE_SELECT_CDF;
  params.cdf_threshold_per_head = cdf;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h) CHECK(int64_t(p.kept.get(b, h)) == (h % 2 == 0 ? p.nQB * 10 : kept_at_least(1)));
  // without sink and window, the counts alone
  params.mode = SPARGE_SELECT_TOPK;
  params.cdf_threshold_per_head = nullptr;
  params.topk_per_head = topk;
  params.attention_sink = 0;
  params.local_window = 0;
  REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 4; ++h) CHECK(int64_t(p.kept.get(b, h)) == p.nQB * topk_n(topk[h], 10));
}

TEST_CASE("other block sizes and the default 128 x 64", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct Bs {
    int bq, bk;
  };
  for (Bs bs : {Bs{128, 64}, Bs{1, 1}, Bs{17, 5}, Bs{64, 128}, Bs{1024, 1024}}) {
    INFO("BQ " << bs.bq << " BK " << bs.bk);
    for (bool causal : {false, true}) {
      Pred p = make_pred(1, 2, 1, 150, 130, 8, bs.bq, bs.bk, causal, rng);
      Plan plan(p.prob);
      sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
      params.topk = 0.4f;
      REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
      check_masks_binary_and_kept(p);
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        const auto F = budget_forced_blocks(p, qb, -1, -1);
        const int64_t nf = std::count(F.begin(), F.end(), true);
        CHECK(int64_t(kept_blocks(p, 0, 1, qb).size()) == std::max(nf, topk_n(0.4f, visible(p, qb))));
      }
      sparge_problem_t got = SPARGE_PROBLEM_INIT;
      REQUIRE(sparge_plan_get_problem(plan.p, &got) == SPARGE_OK);
      CHECK(got.block_q == bs.bq);
      CHECK(got.block_k == bs.bk);
    }
  }
}

TEST_CASE("defaults: NULL params, kept_out optional, scale and blocks resolved", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  Pred p = make_pred(1, 1, 1, 300, 700, 64, 128, 64, false, rng);
  p.prob.block_q = 0;
  p.prob.block_k = 0;
  Plan plan(p.prob);
  REQUIRE(run_predict(plan, p.q, p.k, nullptr, p.mask, nullptr) == SPARGE_OK);
  int64_t n = 0;
  for (int64_t qb = 0; qb < 3; ++qb) n += int64_t(kept_blocks(p, 0, 0, qb).size());
  CHECK(n == 3 * topk_n(0.5f, 11));
  // A caller compiled against the 0.1 layout (struct_size without local_window and estimator):
  // those fields are not read, the defaults apply (the mode's window and estimator).
  const auto mask_default = p.mask.snapshot();
  sparge_predict_params_t old = SPARGE_PREDICT_PARAMS_INIT;
  old.struct_size = offsetof(sparge_predict_params_t, local_window);
  old.local_window = -7;
  old.estimator = sparge_estimator_t(99);
  REQUIRE(run_predict(plan, p.q, p.k, &old, p.mask, nullptr) == SPARGE_OK);
  CHECK(p.mask.snapshot() == mask_default);
  sparge_problem_t got = SPARGE_PROBLEM_INIT;
  REQUIRE(sparge_plan_get_problem(plan.p, &got) == SPARGE_OK);
  CHECK(got.block_q == 128);
  CHECK(got.block_k == 64);
  CHECK(got.scale == Approx(0.125f));
  CHECK(got.len_kv == 700);
  CHECK(got.struct_size == sizeof(sparge_problem_t));
}

// The default estimator scores the keys' log-sum-exp, not MEAN: SPARGE_PREDICT_PARAMS_INIT (AUTO), NULL
// params and a caller of the 0.1 layout (no estimator field) all predict KEYS_LSE's mask here. One query
// block (every row 4 e0, scale 1/2: AUTO's KEYS_LSE_ADAPTIVE keeps it one group, whose mean row is the
// pooled row) against eight key blocks: block 1 holds one key 5 e0 and 63 keys -e0 (per-key log-sum-exp
// ~10, mean score -1.8), block 2 64 keys e0 (log-sum-exp 6.2, mean score 2), the others zeros; the
// default sink keeps block 0, the default non-causal window 1 the diagonal blocks 6 and 7 (rows aligned
// to the last keys), and top-k 0.5 one more: block 1 for KEYS_LSE, block 2 for MEAN. (Without the window,
// top-k would keep two more.)
TEST_CASE("the default estimator is not MEAN (INIT, NULL params, the 0.1 layout)", "[cpu][predict][keys_lse]") {
  const sparge_predict_params_t init = SPARGE_PREDICT_PARAMS_INIT;
  CHECK(init.estimator == SPARGE_ESTIMATOR_AUTO);
  const int64_t Lq = 128, Lkv = 512, D = 4;
  sparge_problem_t prob = cpu_problem(1, 1, 1, Lq, Lkv, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT, false);
  Plan plan(prob);
  HostTensor q = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 1, Lq, D, Layout::HND);
  HostTensor k = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 1, Lkv, D, Layout::HND);
  HostTensor mask = make_dense(SPARGE_DTYPE_UINT8, {1, 1, 1, 8});
  for (int64_t i = 0; i < Lq; ++i)
    for (int64_t d = 0; d < D; ++d) q.set(0, 0, i, d, d == 0 ? 4.0f : 0.0f);
  for (int64_t j = 0; j < Lkv; ++j) {
    const float k0 = j == 64 ? 5.0f : j < 128 && j > 64 ? -1.0f : j >= 128 && j < 192 ? 1.0f : 0.0f;
    for (int64_t d = 0; d < D; ++d) k.set(0, 0, j, d, d == 0 ? k0 : 0.0f);
  }
  auto predicted = [&](const sparge_predict_params_t* prm) {
    REQUIRE(run_predict(plan, q, k, prm, mask, nullptr) == SPARGE_OK);
    std::vector<int> m;
    for (int64_t kb = 0; kb < 8; ++kb) m.push_back(mask.get(0, 0, 0, kb) != 0.0f ? 1 : 0);
    return m;
  };
  sparge_predict_params_t lse = SPARGE_PREDICT_PARAMS_INIT, mean = SPARGE_PREDICT_PARAMS_INIT;
  lse.estimator = SPARGE_ESTIMATOR_KEYS_LSE;
  mean.estimator = SPARGE_ESTIMATOR_MEAN;
  const std::vector<int> want_lse = {1, 1, 0, 0, 0, 0, 1, 1}, want_mean = {1, 0, 1, 0, 0, 0, 1, 1};
  CHECK(predicted(&lse) == want_lse);
  CHECK(predicted(&mean) == want_mean);
  CHECK(predicted(&init) == want_lse);
  CHECK(predicted(nullptr) == want_lse);
  sparge_predict_params_t old = mean;  // a 0.1 caller: the estimator field is past its struct_size
  old.struct_size = offsetof(sparge_predict_params_t, local_window);
  CHECK(predicted(&old) == want_lse);
}

// SPARGE_ESTIMATOR_AUTO, the default, is KEYS_LSE_ADAPTIVE when not causal and KEYS_LSE when causal: the
// same masks bit for bit, whether named, taken from SPARGE_PREDICT_PARAMS_INIT or NULL params, or implied by
// the 0.1 layout. Every query block's rows form two clusters 120 degrees apart (the mean row about half the
// rows' length, inside [0.25, 0.75): KEYS_LSE_ADAPTIVE splits every block), so the two estimators' masks
// differ in both modes and the comparison can tell them apart.
TEST_CASE("SPARGE_ESTIMATOR_AUTO: KEYS_LSE_ADAPTIVE when not causal, KEYS_LSE when causal",
          "[cpu][predict][keys_lse]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t Lq = 128 * 8, Lkv = 2000, D = 64, H = 4;
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    Pred p = make_pred(1, H, 1, Lq, Lkv, D, 128, 64, causal, rng);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        std::vector<float> c1(static_cast<size_t>(D)), c2(static_cast<size_t>(D));
        for (int64_t d = 0; d < D; ++d) {
          const float a = 0.4f * nd(rng), b = 0.4f * nd(rng);
          c1[size_t(d)] = a;
          c2[size_t(d)] = -0.5f * a + 0.866f * b;
        }
        for (int64_t i = qb * 128; i < qb * 128 + 128; ++i) {
          const std::vector<float>& c = (i % 2) ? c2 : c1;  // equal halves, interleaved
          for (int64_t d = 0; d < D; ++d) p.q.set(0, h, i, d, c[size_t(d)] + 0.05f * nd(rng));
        }
      }
    Plan plan(p.prob);
    auto predicted = [&](const sparge_predict_params_t* prm) {
      REQUIRE(run_predict(plan, p.q, p.k, prm, p.mask, &p.kept) == SPARGE_OK);
      check_masks_binary_and_kept(p);
      return p.mask.snapshot();
    };
    sparge_predict_params_t lse = SPARGE_PREDICT_PARAMS_INIT, adaptive = lse, autom = lse, old = lse;
    lse.estimator = SPARGE_ESTIMATOR_KEYS_LSE;
    adaptive.estimator = SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
    autom.estimator = SPARGE_ESTIMATOR_AUTO;
    old.estimator = SPARGE_ESTIMATOR_MEAN;  // past a 0.1 caller's struct_size: not read
    old.struct_size = offsetof(sparge_predict_params_t, local_window);
    const auto m_lse = predicted(&lse), m_adaptive = predicted(&adaptive);
    int64_t rows_differ = 0;
    for (int64_t r = 0; r < H * p.nQB; ++r)
      rows_differ += !std::equal(m_lse.begin() + r * p.nKB, m_lse.begin() + (r + 1) * p.nKB,
                                 m_adaptive.begin() + r * p.nKB);
    INFO("query-block rows where KEYS_LSE and KEYS_LSE_ADAPTIVE differ: " << rows_differ);
    REQUIRE(rows_differ > 0);
    const auto& want = causal ? m_lse : m_adaptive;
    CHECK(predicted(&autom) == want);
    const sparge_predict_params_t init = SPARGE_PREDICT_PARAMS_INIT;
    CHECK(predicted(&init) == want);
    CHECK(predicted(nullptr) == want);
    CHECK(predicted(&old) == want);
  }
}

TEST_CASE("top-k with a decimal fraction keeps the expected count (0.7 of 10 blocks is 7)", "[cpu][predict]") {
  CHECK(sparge::topk_count(0.7f, 10) == 7);
  CHECK(sparge::topk_count(0.9f, 10) == 9);
  CHECK(sparge::topk_count(0.3f, 10) == 3);
  CHECK(sparge::topk_count(0.5f, 3) == 1);
  CHECK(sparge::topk_count(0.01f, 10) == 1);
  CHECK(sparge::topk_count(1.0f, 10) == 10);
  CHECK(sparge::topk_count(0.5f, 0) == 0);
}

// Every query row that sees a key keeps a visible key: mask level over block sizes and length
// mismatches (any sink / window / mode), and output level (no exact-zero row, finite LSE) at
// L = 256 and 4096 with the defaults (params NULL).
TEST_CASE("causal prediction leaves no query row without a kept visible key", "[cpu][predict][causal]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct Sh {
    int64_t lq, lkv;
    int bq, bk;
  };
  for (Sh sh : {Sh{256, 256, 128, 64}, Sh{1000, 1000, 128, 64}, Sh{300, 700, 128, 64}, Sh{700, 300, 128, 64},
                Sh{513, 513, 64, 128}, Sh{200, 200, 17, 5}}) {
    for (int mode = 0; mode < 3; ++mode) {
      INFO("Lq " << sh.lq << " Lkv " << sh.lkv << " BQ " << sh.bq << " BK " << sh.bk << " setting " << mode);
      Pred p = make_pred(1, 2, 1, sh.lq, sh.lkv, 16, sh.bq, sh.bk, true, rng);
      fill_random(p.q, rng);  // unstructured: the pooled ranking is arbitrary
      fill_random(p.k, rng);
      Plan plan(p.prob);
      sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
      params.topk = 1e-6f;  // one block per row
      if (mode == 1) params.attention_sink = 0, params.local_window = 0;
      if (mode == 2) params.mode = SPARGE_SELECT_CDF, params.cdf_threshold = 1e-6f, params.attention_sink = 0;
      REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < sh.lq; ++i) {
          const int64_t last = i + sh.lkv - sh.lq;
          if (last < 0) continue;  // sees no key at all
          const int64_t qb = i / sh.bq;
          bool ok = false;
          for (int64_t kb = 0; kb < p.nKB && !ok; ++kb) ok = p.mask.get(0, h, qb, kb) != 0.0f && kb * sh.bk <= last;
          INFO("h " << h << " row " << i);
          REQUIRE(ok);
        }
    }
  }
  for (int64_t L : {256, 4096}) {
    INFO("L " << L);
    const int64_t H = L > 1000 ? 1 : 4, D = 32;
    auto prob = cpu_problem(1, H, H, L, L, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT, true);
    Plan plan(prob);
    HostTensor q = make_bhld(SPARGE_DTYPE_FLOAT32, 1, H, L, D, Layout::HND);
    HostTensor k = make_bhld(SPARGE_DTYPE_FLOAT32, 1, H, L, D, Layout::HND);
    HostTensor v = make_bhld(SPARGE_DTYPE_FLOAT32, 1, H, L, D, Layout::HND);
    HostTensor out = make_bhld(SPARGE_DTYPE_FLOAT32, 1, H, L, D, Layout::HND);
    HostTensor lse = make_dense(SPARGE_DTYPE_FLOAT32, {1, H, L});
    fill_random(q, rng);
    fill_random(k, rng);
    fill_random(v, rng, 1.0f, 0.5f);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t d = 0; d < D; ++d) out.set(0, h, i, d, 0.0f);  // a missed row would stay exactly 0
    REQUIRE(run_attention(plan, q, k, v, nullptr, nullptr, out, &lse) == SPARGE_OK);
    int64_t zero_rows = 0;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        bool nz = false;
        for (int64_t d = 0; d < D; ++d) nz = nz || out.get(0, h, i, d) != 0.0f;
        zero_rows += nz && std::isfinite(lse.get(0, h, i)) ? 0 : 1;
      }
    CHECK(zero_rows == 0);
  }
}

// Estimator KEYS_LSE: scores log sum_{j in kb, visible to the block's last row} exp(scale pq . k_j) with the
// raw keys; the top-k set (no forced blocks) is the highest of a float64 recomputation, and K smoothing,
// a shift of every row's scores, changes nothing.
TEST_CASE("estimator KEYS_LSE keeps the blocks of largest per-key log-sum-exp", "[cpu][predict]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    Pred p = make_pred(1, 4, 2, 700, 900, 32, 64, 64, causal, rng);
    Plan plan(p.prob);
    sparge_predict_params_t params = bare_topk(0.3f, SPARGE_ESTIMATOR_KEYS_LSE);
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    check_masks_binary_and_kept(p);
    const auto first = p.mask.snapshot();
    params.smooth_k = 0;
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    int64_t same_rows = 0, rows = 0, checked = 0;
    const double scale = 1.0 / std::sqrt(32.0);
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        const int64_t vis = visible(p, qb);
        if (vis == 0) continue;
        const int64_t r1 = std::min<int64_t>(700, qb * 64 + 64), last_key = causal ? r1 - 1 + 200 : 899;
        std::vector<double> pq(32, 0.0), sc(static_cast<size_t>(vis));
        for (int64_t i = qb * 64; i < r1; ++i)
          for (int64_t d = 0; d < 32; ++d) pq[size_t(d)] += p.q.get(0, h, i, d) / double(r1 - qb * 64);
        for (int64_t kb = 0; kb < vis; ++kb) {
          double m = -INFINITY, sum = 0.0;
          std::vector<double> v;
          for (int64_t j = kb * 64; j < std::min<int64_t>({900, kb * 64 + 64, last_key + 1}); ++j) {
            double dot = 0.0;
            for (int64_t d = 0; d < 32; ++d) dot += pq[size_t(d)] * p.k.get(0, h / 2, j, d);
            v.push_back(scale * dot);
            m = std::max(m, v.back());
          }
          for (double x : v) sum += std::exp(x - m);
          sc[size_t(kb)] = m + std::log(sum);
        }
        ++rows;
        bool same = true;
        for (int64_t kb = 0; kb < p.nKB; ++kb) same = same && first[size_t(((h * p.nQB) + qb) * p.nKB + kb)] == p.mask.get(0, h, qb, kb);
        same_rows += same;
        checked += kept_are_top_scores(p, h, qb, sc, 0.3f);
      }
    CHECK(checked > rows / 2);
    CHECK(same_rows >= rows - 2);  // smoothing moves a row's scores alike: only float rounding can differ
  }
}

// KEYS_LSE_SPLIT2 (docs/SEMANTICS.md, "Mask prediction"): query blocks whose rows come from two
// clusters, recomputed here in float64 from the definition (seeds, strict nearer-seed grouping,
// each group's per-key log-sum-exp normalized over the visible blocks, averaged by group size).
TEST_CASE("estimator KEYS_LSE_SPLIT2 keeps the blocks of largest group-averaged mass", "[cpu][predict][keys_lse]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t Lq = 700, Lkv = 900, D = 32, BQ = 64, BK = 64;
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    Pred p = make_pred(1, 4, 2, Lq, Lkv, D, int(BQ), int(BK), causal, rng);
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        std::vector<float> c[2] = {std::vector<float>(size_t(D)), std::vector<float>(size_t(D))};
        for (auto& v : c)
          for (float& x : v) x = 1.5f * nd(rng);
        for (int64_t i = qb * BQ; i < std::min(Lq, qb * BQ + BQ); ++i) {
          const int g = int(rng() & 1);
          for (int64_t d = 0; d < D; ++d) p.q.set(0, h, i, d, c[g][size_t(d)] + 0.3f * nd(rng));
        }
      }
    Plan plan(p.prob);
    sparge_predict_params_t params = bare_topk(0.3f, SPARGE_ESTIMATOR_KEYS_LSE);
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    const auto lse_mask = p.mask.snapshot();
    params.estimator = SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2;
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    check_masks_binary_and_kept(p);
    const auto split_mask = p.mask.snapshot();
    int64_t rows = 0, checked = 0, differ = 0;
    const double scale = 1.0 / std::sqrt(double(D));
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        const int64_t vis = visible(p, qb);
        if (vis == 0) continue;
        const int64_t r0 = qb * BQ, r1 = std::min(Lq, r0 + BQ), n = r1 - r0;
        const int64_t last_key = causal ? r1 - 1 + (Lkv - Lq) : Lkv - 1;
        auto row = [&](int64_t i, int64_t d) { return double(p.q.get(0, h, i, d)); };
        std::vector<double> mu(size_t(D), 0.0);
        for (int64_t i = r0; i < r1; ++i)
          for (int64_t d = 0; d < D; ++d) mu[size_t(d)] += row(i, d) / double(n);
        auto dist = [&](int64_t i, auto&& ref) {
          double s = 0.0;
          for (int64_t d = 0; d < D; ++d) s += (row(i, d) - ref(d)) * (row(i, d) - ref(d));
          return s;
        };
        auto farthest = [&](auto&& ref) {
          int64_t best = r0;
          for (int64_t i = r0 + 1; i < r1; ++i)
            if (dist(i, ref) > dist(best, ref)) best = i;
          return best;
        };
        const int64_t a = farthest([&](int64_t d) { return mu[size_t(d)]; });
        const int64_t b = farthest([&](int64_t d) { return row(a, d); });
        std::vector<double> gm[2] = {std::vector<double>(size_t(D), 0.0), std::vector<double>(size_t(D), 0.0)};
        double ng[2] = {0.0, 0.0};
        for (int64_t i = r0; i < r1; ++i) {
          const int g = dist(i, [&](int64_t d) { return row(b, d); }) < dist(i, [&](int64_t d) { return row(a, d); });
          for (int64_t d = 0; d < D; ++d) gm[g][size_t(d)] += row(i, d);
          ng[g] += 1.0;
        }
        std::vector<double> mass(static_cast<size_t>(vis), 0.0);
        for (int g = 0; g < 2; ++g) {
          if (ng[g] == 0.0) continue;
          std::vector<double> bs(static_cast<size_t>(vis));
          double tot = 0.0;
          for (int64_t kb = 0; kb < vis; ++kb) {
            double sum = 0.0;
            for (int64_t j = kb * BK; j < std::min({Lkv, kb * BK + BK, last_key + 1}); ++j) {
              double dot = 0.0;
              for (int64_t d = 0; d < D; ++d) dot += gm[g][size_t(d)] / ng[g] * p.k.get(0, h / 2, j, d);
              sum += std::exp(scale * dot);
            }
            bs[size_t(kb)] = sum;
            tot += sum;
          }
          for (int64_t kb = 0; kb < vis; ++kb) mass[size_t(kb)] += ng[g] / double(n) * bs[size_t(kb)] / tot;
        }
        std::vector<double> sc(static_cast<size_t>(vis));
        for (int64_t kb = 0; kb < vis; ++kb) sc[size_t(kb)] = std::log(mass[size_t(kb)]);
        const size_t mrow = size_t((h * p.nQB + qb) * p.nKB);
        differ += !std::equal(split_mask.begin() + mrow, split_mask.begin() + mrow + p.nKB, lse_mask.begin() + mrow);
        ++rows;
        checked += kept_are_top_scores(p, h, qb, sc, 0.3f);
      }
    CHECK(checked > rows / 2);
    CHECK(differ > 0);  // two clusters per block: not the single pooled row's ranking everywhere
  }
}

// One cluster (every row of a block equal): the second group is empty, and the ranking is KEYS_LSE's.
TEST_CASE("estimator KEYS_LSE_SPLIT2 on blocks of equal rows ranks as KEYS_LSE", "[cpu][predict][keys_lse]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    Pred p = make_pred(1, 2, 1, 512, 1024, 32, 64, 64, causal, rng);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        std::vector<float> c(32);
        for (float& x : c) x = nd(rng);
        for (int64_t i = qb * 64; i < qb * 64 + 64; ++i)
          for (int64_t d = 0; d < 32; ++d) p.q.set(0, h, i, d, c[size_t(d)]);
      }
    Plan plan(p.prob);
    sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
    params.topk = 0.25f;
    params.estimator = SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2;
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    const auto a = p.mask.snapshot();
    params.estimator = SPARGE_ESTIMATOR_KEYS_LSE;
    REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
    const auto b = p.mask.snapshot();
    int64_t rows_diff = 0;
    for (int64_t r = 0; r < 2 * p.nQB; ++r)
      rows_diff += !std::equal(a.begin() + r * p.nKB, a.begin() + (r + 1) * p.nKB, b.begin() + r * p.nKB);
    // the normalized score rounds to float32 on its own scale: only near-ties can move
    CHECK(rows_diff <= 2);
  }
}

// KEYS_LSE_ADAPTIVE (docs/SEMANTICS.md, "Mask prediction"): a query block is split as by
// KEYS_LSE_SPLIT2 only where its mean row is short but not near zero (0.25 to 0.75 of the rows'
// mean length); elsewhere it ranks as KEYS_LSE. Three kinds of blocks, each far from both
// thresholds: rows near one direction (mean ~ as long as the rows: one group), two clusters 120
// degrees apart (mean about half as long: split), independent normal rows (mean ~ 1/8 of the
// rows' length: one group).
TEST_CASE("estimator KEYS_LSE_ADAPTIVE splits only the blocks of short, non-zero mean", "[cpu][predict][keys_lse]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Nine heads: 36 split blocks per causality. With causality a split block keeps 1 to 4 of 5 to 16 visible
  // blocks, and its mask equals the single pooled row's in about 6 of 10 draws, so that three heads' 12 left
  // "no split block ranks differently" at about 1 in 400 seeds.
  const int64_t Lq = 64 * 12, Lkv = 1000, D = 64, H = 9;
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    Pred p = make_pred(1, H, 1, Lq, Lkv, D, 64, 64, causal, rng);
    std::vector<int> kind(size_t(H * p.nQB));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t qb = 0; qb < p.nQB; ++qb) {
        const int k = int((h + qb) % 3);
        kind[size_t(h * p.nQB + qb)] = k;
        std::vector<float> c1(static_cast<size_t>(D)), cp(static_cast<size_t>(D));
        for (int64_t d = 0; d < D; ++d) c1[size_t(d)] = 0.4f * nd(rng), cp[size_t(d)] = 0.4f * nd(rng);
        for (int64_t i = qb * 64; i < qb * 64 + 64; ++i) {
          const bool second = (i - qb * 64) % 2 == 1;  // equal halves, interleaved
          for (int64_t d = 0; d < D; ++d) {
            const float c2 = -0.5f * c1[size_t(d)] + 0.866f * cp[size_t(d)];
            const float x = k == 0   ? c1[size_t(d)] + 0.05f * nd(rng)
                            : k == 1 ? (second ? c2 : c1[size_t(d)]) + 0.05f * nd(rng)
                                     : nd(rng);
            p.q.set(0, h, i, d, x);
          }
        }
      }
    Plan plan(p.prob);
    std::vector<uint8_t> m[3];
    const sparge_estimator_t est[3] = {SPARGE_ESTIMATOR_KEYS_LSE, SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2,
                                       SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE};
    for (int e = 0; e < 3; ++e) {
      sparge_predict_params_t params = bare_topk(0.3f, est[e]);
      REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
      check_masks_binary_and_kept(p);
      m[e] = p.mask.snapshot();
    }
    auto same = [&](int e, int64_t row) {
      return std::equal(m[e].begin() + row * p.nKB, m[e].begin() + (row + 1) * p.nKB, m[2].begin() + row * p.nKB);
    };
    int64_t off_lse = 0, off_split = 0, split_differs = 0;
    for (int64_t row = 0; row < H * p.nQB; ++row) {
      if (visible(p, row % p.nQB) == 0) continue;
      if (kind[size_t(row)] == 1) {
        off_split += !same(1, row);
        split_differs += !same(0, row);
      } else {
        off_lse += !same(0, row);  // one group: KEYS_LSE's scores of the sum4 mean row (KEYS_LSE pools in
                                   // float64): only a near-tie can differ
      }
    }
    CHECK(off_split == 0);  // the same groups and the same arithmetic as KEYS_LSE_SPLIT2
    CHECK(off_lse <= 1);
    CHECK(split_differs > 0);  // the split blocks are not ranked by the single pooled row
  }
}

// A non-finite query element under the grouping estimators: the block's scores are NaN (KEYS_LSE_SPLIT2:
// the group holding the row has a non-finite mean; KEYS_LSE_ADAPTIVE: the lengths are non-finite, so the
// block keeps one group, whose mean is), so its row keeps every visible block; every other row is as
// without it.
TEST_CASE("grouping estimators: a non-finite query element keeps its row's visible blocks",
          "[cpu][predict][keys_lse]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (sparge_estimator_t est : {SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2, SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE})
    for (float bad : {NAN, INFINITY}) {
      INFO("estimator " << int(est) << " value " << bad);
      Pred p = make_pred(1, 2, 1, 640, 700, 32, 64, 64, true, rng);
      Plan plan(p.prob);
      const sparge_predict_params_t params = bare_topk(0.2f, est);
      REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
      const auto before = p.mask.snapshot();
      const int64_t h = 1, qb = 6;
      p.q.set(0, h, qb * 64 + 13, 5, bad);
      REQUIRE(run_predict(plan, p.q, p.k, &params, p.mask, &p.kept) == SPARGE_OK);
      check_masks_binary_and_kept(p);
      const auto after = p.mask.snapshot();
      for (int64_t r = 0; r < 2 * p.nQB; ++r) {
        const bool hit = r == h * p.nQB + qb;
        for (int64_t kb = 0; kb < p.nKB; ++kb) {
          const size_t i = size_t(r * p.nKB + kb);
          if (hit)
            CHECK(after[i] == (kb < visible(p, qb) ? 1 : 0));
          else
            CHECK(after[i] == before[i]);
        }
      }
    }
}

// ---------------------------------------------------------------- KEYS_LSE on 16-bit keys
// The pooled query row enters the per-key scores rounded once to the keys' 16-bit type (fp16 rows
// scaled by a power of two first), the single term the CUDA kernel multiplies on the tensor cores
// (docs/SEMANTICS.md, "Mask prediction", step 3).
namespace {

// Test-side copy of the rule: the float32 pooled row q rounded to `dt` (fp16: times 2^s, s = 15 - e
// for 2^(e-1) <= max |q_c| < 2^e, clamped to [-64, 64], NaN ignored, 0 for a zero or infinite max);
// returns 2^-s.
double round_pooled_row(const std::vector<double>& pq, sparge_dtype_t dt, std::vector<double>& out) {
  out.assign(pq.size(), 0.0);
  int s = 0;
  if (dt == SPARGE_DTYPE_FLOAT16) {
    double mx = 0.0;
    for (double x : pq)
      if (!std::isnan(x)) mx = std::max(mx, std::fabs(double(float(x))));
    if (mx > 0.0 && std::isfinite(mx)) {
      int e = 0;
      std::frexp(mx, &e);
      s = std::min(std::max(15 - e, -64), 64);
    }
  }
  for (size_t c = 0; c < pq.size(); ++c) out[c] = round_dtype(dt, std::ldexp(float(pq[c]), s));
  return std::ldexp(1.0, -s);
}

struct Pred16 {
  sparge_problem_t prob;
  HostTensor q, k, mask, kept;
  int64_t nQB, nKB;
};

Pred16 make_pred16(sparge_dtype_t dt, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, int64_t D, bool causal) {
  Pred16 p;
  p.prob = cpu_problem(1, Hq, Hkv, Lq, Lkv, D, dt, SPARGE_PRECISION_EXACT, causal);
  p.prob.block_q = 64;
  p.prob.block_k = 64;
  p.nQB = ceil_div(Lq, 64);
  p.nKB = ceil_div(Lkv, 64);
  p.q = make_bhld(dt, 1, Hq, Lq, D, Layout::HND);
  p.k = make_bhld(dt, 1, Hkv, Lkv, D, Layout::NHD);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < Lq; ++i)
      for (int64_t d = 0; d < D; ++d) p.q.set(0, h, i, d, 0.0f);
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t j = 0; j < Lkv; ++j)
      for (int64_t d = 0; d < D; ++d) p.k.set(0, h, j, d, 0.0f);
  p.mask = make_dense(SPARGE_DTYPE_UINT8, {1, Hq, p.nQB, p.nKB});
  p.kept = make_dense(SPARGE_DTYPE_INT32, {1, Hq});
  return p;
}

sparge_predict_params_t lse_params(float topk) { return bare_topk(topk, SPARGE_ESTIMATOR_KEYS_LSE); }

}  // namespace

TEST_CASE("estimator KEYS_LSE rounds the pooled row once to the keys' 16-bit type", "[cpu][predict][keys_lse]") {
  // Query channel 0 alternates 1 and 1 + ulp(1): its pooled mean 1 + ulp/2 is a tie that rounds (to
  // even) to 1. Block A's keys are (2, 0, 0), block B's (0, 2, 1) against the constant channels
  // q_1 = 1, q_2 = ulp/2: unrounded A = 2 + ulp > B = 2 + ulp/2, rounded A = 2 < B. With one of the
  // two blocks kept, 16-bit keys keep B; float32 keys (nothing rounded) keep A.
  for (sparge_dtype_t dt : {SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_FLOAT32}) {
    INFO("dtype " << int(dt));
    const float ulp = dt == SPARGE_DTYPE_FLOAT16 ? 0x1p-10f : 0x1p-7f;  // spacing of [1, 2); float32: as bf16
    Pred16 p = make_pred16(dt, 1, 1, 64, 128, 16, false);
    for (int64_t i = 0; i < 64; ++i) {
      p.q.set(0, 0, i, 0, i % 2 ? 1.0f + ulp : 1.0f);
      p.q.set(0, 0, i, 1, 1.0f);
      p.q.set(0, 0, i, 2, ulp / 2);
    }
    for (int64_t j = 0; j < 64; ++j) {
      p.k.set(0, 0, j, 0, 2.0f);
      p.k.set(0, 0, 64 + j, 1, 2.0f);
      p.k.set(0, 0, 64 + j, 2, 1.0f);
    }
    Plan plan(p.prob);
    const sparge_predict_params_t prm = lse_params(0.5f);
    REQUIRE(run_predict(plan, p.q, p.k, &prm, p.mask, &p.kept) == SPARGE_OK);
    const bool rounded = dt != SPARGE_DTYPE_FLOAT32;
    CHECK(p.mask.get(0, 0, 0, 0) == (rounded ? 0.0f : 1.0f));
    CHECK(p.mask.get(0, 0, 0, 1) == (rounded ? 1.0f : 0.0f));
  }
}

TEST_CASE("estimator KEYS_LSE: fp16 pooled rows are scaled by a power of two before the rounding",
          "[cpu][predict][keys_lse]") {
  // Pooled entries in the fp16 subnormal range: channel 0 = 2^-20 + 2^-26 (the mean of 48 rows of
  // 2^-20 and 16 of 2^-20 + 2^-24), channel 1 = 2^-20. Scaled by 2^34 both are exact in fp16; rounded
  // unscaled (quantum 2^-24) channel 0 would lose its 2^-26. Block A's keys are (2^15, 0), block B's
  // (0, 2^15 + 2^5): A = 2^-5 (1 + 2^-6) > B = 2^-5 (1 + 2^-10), but without the scaling A = 2^-5 < B.
  Pred16 p = make_pred16(SPARGE_DTYPE_FLOAT16, 1, 1, 64, 128, 16, false);
  for (int64_t i = 0; i < 64; ++i) {
    p.q.set(0, 0, i, 0, i < 16 ? 0x1p-20f + 0x1p-24f : 0x1p-20f);
    p.q.set(0, 0, i, 1, 0x1p-20f);
  }
  for (int64_t j = 0; j < 64; ++j) {
    p.k.set(0, 0, j, 0, 32768.0f);
    p.k.set(0, 0, 64 + j, 1, 32800.0f);
  }
  REQUIRE(p.q.get(0, 0, 0, 0) == 0x1p-20f + 0x1p-24f);  // representable (fp16 subnormals)
  Plan plan(p.prob);
  const sparge_predict_params_t prm = lse_params(0.5f);
  REQUIRE(run_predict(plan, p.q, p.k, &prm, p.mask, &p.kept) == SPARGE_OK);
  CHECK(p.mask.get(0, 0, 0, 0) == 1.0f);
  CHECK(p.mask.get(0, 0, 0, 1) == 0.0f);
}

TEST_CASE("estimator KEYS_LSE on 16-bit keys keeps the top-k of the rounded-row scores", "[cpu][predict][keys_lse]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (sparge_dtype_t dt : {SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT16})
    for (bool causal : {false, true}) {
      INFO("dtype " << int(dt) << " causal " << causal);
      const int64_t Hq = 4, Hkv = 2, Lq = 640, Lkv = 900, D = 32, g = Hq / Hkv;
      Pred16 p = make_pred16(dt, Hq, Hkv, Lq, Lkv, D, causal);
      // fp16: small query rows (pooled entries near 2^-12, scaled by 2^26 before the rounding) against
      // keys of 2^10, so that the scores are of order 1 for both types
      const float qs = dt == SPARGE_DTYPE_FLOAT16 ? 0x1p-10f : 1.0f, ks = dt == SPARGE_DTYPE_FLOAT16 ? 0x1p10f : 1.0f;
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < Lq; ++i)
          for (int64_t d = 0; d < D; ++d) p.q.set(0, h, i, d, qs * (nd(rng) + 0.3f * float(d % 3)));
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t j = 0; j < Lkv; ++j)
          for (int64_t d = 0; d < D; ++d) p.k.set(0, h, j, d, ks * nd(rng));
      Plan plan(p.prob);
      const sparge_predict_params_t prm = lse_params(0.3f);
      REQUIRE(run_predict(plan, p.q, p.k, &prm, p.mask, &p.kept) == SPARGE_OK);
      const double scale = 1.0 / std::sqrt(double(D));
      int64_t rows = 0, checked = 0;
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t qb = 0; qb < p.nQB; ++qb) {
          const int64_t r0 = qb * 64, r1 = std::min(Lq, r0 + 64);
          const int64_t last_key = causal ? std::min(Lkv - 1, r1 - 1 + Lkv - Lq) : Lkv - 1;
          const int64_t vis = last_key / 64 + 1;
          std::vector<double> pq(size_t(D), 0.0), qr;
          for (int64_t i = r0; i < r1; ++i)
            for (int64_t d = 0; d < D; ++d) pq[size_t(d)] += p.q.get(0, h, i, d);
          for (double& x : pq) x = double(float(x / double(r1 - r0)));  // the library keeps it in float32
          const double fac = scale * round_pooled_row(pq, dt, qr);
          // block scores of the rounded row
          std::vector<double> sc(static_cast<size_t>(vis));
          for (int64_t kb = 0; kb < vis; ++kb) {
            double m = -INFINITY;
            std::vector<double> v;
            for (int64_t j = kb * 64; j < std::min(last_key + 1, kb * 64 + 64); ++j) {
              double dot = 0.0;
              for (int64_t d = 0; d < D; ++d) dot += qr[size_t(d)] * p.k.get(0, h / g, j, d);
              v.push_back(fac * dot);
              m = std::max(m, v.back());
            }
            double sum = 0.0;
            for (double x : v) sum += std::exp(x - m);
            sc[size_t(kb)] = m + std::log(sum);
          }
          const int64_t n = topk_n(0.3f, vis);
          // causal: the first diagonal block is forced into the budget
          int64_t forced = -1;
          if (causal) forced = std::min(Lkv - 1, std::max<int64_t>(0, r0 + Lkv - Lq)) / 64;
          std::vector<int64_t> order;
          for (int64_t kb = 0; kb < vis; ++kb)
            if (kb != forced) order.push_back(kb);
          auto top = [&](const std::vector<double>& s) {
            std::vector<int64_t> o(order);
            std::stable_sort(o.begin(), o.end(), [&](int64_t a, int64_t b) { return s[size_t(a)] > s[size_t(b)]; });
            return o;
          };
          const int64_t m = n - (forced >= 0 ? 1 : 0);
          const std::vector<int64_t> want = top(sc);
          ++rows;
          if (m <= 0 || m >= int64_t(want.size())) continue;
          if (sc[size_t(want[size_t(m - 1)])] - sc[size_t(want[size_t(m)])] < 1e-5) continue;  // near tie
          for (int64_t t = 0; t < int64_t(want.size()); ++t)
            CHECK(p.mask.get(0, h, qb, want[size_t(t)]) == (t < m ? 1.0f : 0.0f));
          ++checked;
        }
      CHECK(checked > rows / 2);
    }
}

TEST_CASE("estimator KEYS_LSE: an infinite key element, against the rounded pooled row", "[cpu][predict][keys_lse]") {
  // Query channel 0 is 1 in every row (q'_0 = 1), channel 1 is 0 (q'_1 = 0), the rest random. One key
  // of block 5 with k_0 = +inf scores +inf: its block is NaN and every row keeps all its visible
  // blocks. k_0 = -inf scores -inf: weight 0, the masks are those with that key's k_0 = -60000 (a
  // finite score whose exponential is 0 in float64 too). A block whose keys all score -inf gets -inf
  // (non-finite): every row that sees it keeps all its visible blocks. k_1 = inf meets q'_1 = 0:
  // 0 * inf = NaN, every row keeps all.
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (sparge_dtype_t dt : {SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT16}) {
    INFO("dtype " << int(dt));
    const int64_t L = 1024, D = 16;
    Pred16 base = make_pred16(dt, 1, 1, L, L, D, false);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) base.q.set(0, 0, i, d, d == 0 ? 1.0f : d == 1 ? 0.0f : nd(rng));
    for (int64_t j = 0; j < L; ++j)
      for (int64_t d = 0; d < D; ++d) base.k.set(0, 0, j, d, nd(rng));
    Plan plan(base.prob);
    const sparge_predict_params_t prm = lse_params(0.25f);
    const int64_t nKB = base.nKB, nQB = base.nQB;
    auto run = [&](const std::function<void(HostTensor&)>& edit) {
      HostTensor k = make_bhld(dt, 1, 1, L, D, Layout::NHD);
      copy_logical(base.k, k);
      edit(k);
      REQUIRE(run_predict(plan, base.q, k, &prm, base.mask, &base.kept) == SPARGE_OK);
      std::vector<float> m;
      for (int64_t qb = 0; qb < nQB; ++qb)
        for (int64_t kb = 0; kb < nKB; ++kb) m.push_back(base.mask.get(0, 0, qb, kb));
      return m;
    };
    auto all_kept = [&](const std::vector<float>& m) {
      return std::all_of(m.begin(), m.end(), [](float x) { return x == 1.0f; });
    };
    const int64_t j = 5 * 64 + 17;
    const auto plain = run([](HostTensor&) {});
    CHECK(!all_kept(plain));
    CHECK(all_kept(run([&](HostTensor& k) { k.set(0, 0, j, 0, INFINITY); })));
    const auto minus = run([&](HostTensor& k) { k.set(0, 0, j, 0, -INFINITY); });
    CHECK(!all_kept(minus));
    CHECK(minus == run([&](HostTensor& k) { k.set(0, 0, j, 0, -60000.0f); }));
    CHECK(all_kept(run([&](HostTensor& k) {
      for (int64_t t = 5 * 64; t < 6 * 64; ++t) k.set(0, 0, t, 0, -INFINITY);
    })));
    CHECK(all_kept(run([&](HostTensor& k) { k.set(0, 0, j, 1, INFINITY); })));
  }
}
