// The NaN/Inf policy (docs/SEMANTICS.md, "Non-finite values") on the CPU
// backend, every precision: one NaN or Inf placed in q, k or v; the elements
// the policy names must be NaN (or non-finite where it says so), and every
// other element of out and LSE must be bit-identical to the call without it.
#include "catch_compat.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include "test_util.hpp"

using namespace sparge_test;

namespace {

constexpr int64_t B = 1, Hq = 2, Hkv = 1, Lq = 200, Lkv = 260, D = 32, BQ = 128, BK = 64;
constexpr int64_t nQB = (Lq + BQ - 1) / BQ, nKB = (Lkv + BK - 1) / BK;

const sparge_precision_t kAll[] = {SPARGE_PRECISION_EXACT, SPARGE_PRECISION_FP16, SPARGE_PRECISION_INT8_FP8,
                                   SPARGE_PRECISION_INT8_FP8_SPLIT_V, SPARGE_PRECISION_INT8_FP16};

bool fp8_v(sparge_precision_t p) {
  return p == SPARGE_PRECISION_INT8_FP8 || p == SPARGE_PRECISION_INT8_FP8_SPLIT_V;
}
bool int8(sparge_precision_t p) { return fp8_v(p) || p == SPARGE_PRECISION_INT8_FP16; }

struct Run {
  HostTensor out, lse;
};

struct World {
  sparge_problem_t prob;
  bool causal;
  HostTensor q, k, v, mask;
  int64_t last_key(int64_t i) const { return causal ? std::min(i + (Lkv - Lq), Lkv - 1) : Lkv - 1; }
  bool kept(int64_t h, int64_t qb, int64_t kb) const {
    const int64_t last = causal ? std::min(qb * BQ + BQ - 1, Lq - 1) + (Lkv - Lq) : Lkv - 1;
    return kb * BK <= last && mask.get(0, h, qb, kb) != 0.0f;
  }
  bool used(int64_t h, int64_t i, int64_t j) const { return j <= last_key(i) && kept(h, i / BQ, j / BK); }
  bool uses_any(int64_t h, int64_t i) const {
    for (int64_t j = 0; j < Lkv; ++j)
      if (used(h, i, j)) return true;
    return false;
  }
};

World make_world(sparge_precision_t prec, sparge_dtype_t dt, bool causal, std::mt19937_64& rng) {
  World w;
  w.causal = causal;
  w.prob = cpu_problem(B, Hq, Hkv, Lq, Lkv, D, dt, prec, causal);
  w.prob.block_q = BQ;
  w.prob.block_k = BK;
  w.q = make_bhld(dt, B, Hq, Lq, D, Layout::HND);
  w.k = make_bhld(dt, B, Hkv, Lkv, D, Layout::HND);
  w.v = make_bhld(dt, B, Hkv, Lkv, D, Layout::HND);
  fill_random(w.q, rng);
  fill_random(w.k, rng);
  fill_random(w.v, rng);
  w.mask = make_dense(SPARGE_DTYPE_UINT8, {B, Hq, nQB, nKB});
  std::bernoulli_distribution keep(0.6);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t qb = 0; qb < nQB; ++qb)
      for (int64_t kb = 0; kb < nKB; ++kb) w.mask.set(0, h, qb, kb, keep(rng) ? 1.0f : 0.0f);
  w.mask.set(0, 0, 0, 1, 1.0f);  // key block 1 is used somewhere
  w.mask.set(0, 1, 1, 0, 1.0f);
  w.mask.set(0, 1, 1, 1, 0.0f);  // head 1: query block 1 skips key block 1
  return w;
}

Run run(const World& w, const HostTensor& q, const HostTensor& k, const HostTensor& v, int smooth_k) {
  Plan plan(w.prob);
  Run r{make_bhld(w.prob.dtype, B, Hq, Lq, D, Layout::HND), make_dense(SPARGE_DTYPE_FLOAT32, {B, Hq, Lq})};
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.smooth_k = smooth_k;
  REQUIRE(run_attention(plan, q, k, v, &w.mask, &params, r.out, &r.lse) == SPARGE_OK);
  return r;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// expect(h, i, c): 0 = unchanged (bit-identical), 1 = NaN, 2 = non-finite
// (NaN or +-inf); c == -1 is the LSE. Counts the elements that must change so
// that a case cannot pass vacuously.
template <class Expect>
void check(const Run& clean, const Run& dirty, Expect expect, int64_t* n_poisoned) {
  int64_t bad = 0, poisoned = 0;
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < Lq; ++i)
      for (int64_t c = -1; c < D; ++c) {
        const float x0 = c < 0 ? clean.lse.get(0, h, i) : clean.out.get(0, h, i, c);
        const float x1 = c < 0 ? dirty.lse.get(0, h, i) : dirty.out.get(0, h, i, c);
        const int e = expect(h, i, c);
        bool ok;
        if (e == 0) ok = same_bits(x0, x1);
        else if (e == 1) ok = std::isnan(x1);
        else ok = !std::isfinite(x1);
        poisoned += e != 0;
        if (!ok && bad++ < 5) {
          UNSCOPED_INFO("head " << h << " row " << i << (c < 0 ? " LSE" : " channel ") << (c < 0 ? "" : std::to_string(c))
                                << ": clean " << x0 << ", with the non-finite value " << x1 << ", expected "
                                << (e == 0 ? "unchanged" : e == 1 ? "NaN" : "non-finite"));
        }
      }
  CHECK(bad == 0);
  *n_poisoned = poisoned;
}

}  // namespace

TEST_CASE("non-finite q: the row and its LSE are NaN, nothing else changes", "[cpu][nonfinite]") {
  std::mt19937_64 rng(fresh_seed());
  for (sparge_precision_t prec : kAll)
    for (sparge_dtype_t dt : {SPARGE_DTYPE_FLOAT32, SPARGE_DTYPE_BFLOAT16})
      for (bool causal : {false, true})
        for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
          INFO("precision " << int(prec) << " dtype " << int(dt) << " causal " << causal << " value " << bad);
          const World w = make_world(prec, dt, causal, rng);
          const Run clean = run(w, w.q, w.k, w.v, 1);
          const int64_t h = 1, i = 150, c = 7;  // query block 1
          HostTensor q = make_bhld(dt, B, Hq, Lq, D, Layout::HND);
          copy_logical(w.q, q);
          q.set(0, h, i, c, bad);
          const Run dirty = run(w, q, w.k, w.v, 1);
          const bool any = w.uses_any(h, i);
          int64_t n = 0;
          check(clean, dirty, [&](int64_t hh, int64_t ii, int64_t) { return (hh == h && ii == i && any) ? 1 : 0; }, &n);
          CHECK(n == D + 1);
        }
}

TEST_CASE("non-finite k: the rows that use the key (the K block or, smoothed, the head) are NaN", "[cpu][nonfinite]") {
  std::mt19937_64 rng(fresh_seed());
  for (sparge_precision_t prec : kAll)
    for (int smooth : {0, 1})
      for (bool causal : {false, true})
        for (float bad : {std::nanf(""), INFINITY}) {
          INFO("precision " << int(prec) << " smooth_k " << smooth << " causal " << causal << " value " << bad);
          const World w = make_world(prec, SPARGE_DTYPE_FLOAT32, causal, rng);
          const Run clean = run(w, w.q, w.k, w.v, smooth);
          const int64_t j = 70, c = 3;  // key block 1
          HostTensor k = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hkv, Lkv, D, Layout::HND);
          copy_logical(w.k, k);
          k.set(0, 0, j, c, bad);
          const Run dirty = run(w, w.q, k, w.v, smooth);
          auto row_nan = [&](int64_t h, int64_t i) {
            if (!int8(prec)) return w.used(h, i, j);  // the score s_ij
            if (smooth) return w.uses_any(h, i);      // the K mean of channel c: every block scale
            for (int64_t jj = (j / 64) * 64; jj < std::min(Lkv, (j / 64) * 64 + 64); ++jj)
              if (w.used(h, i, jj)) return true;      // the scale of j's 64-key block
            return false;
          };
          int64_t n = 0;
          check(clean, dirty, [&](int64_t h, int64_t i, int64_t) { return row_nan(h, i) ? 1 : 0; }, &n);
          CHECK(n > 0);
        }
}

TEST_CASE("non-finite v: the channel in the rows whose listed tiles hold the key (fp8 V: the whole channel)",
          "[cpu][nonfinite]") {
  std::mt19937_64 rng(fresh_seed());
  for (sparge_precision_t prec : kAll)
    for (bool causal : {false, true})
      for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
        INFO("precision " << int(prec) << " causal " << causal << " value " << bad);
        const World w = make_world(prec, SPARGE_DTYPE_FLOAT32, causal, rng);
        const Run clean = run(w, w.q, w.k, w.v, 1);
        const int64_t j = 100, c = 5;  // key block 1 (head 1's query block 1 does not keep it)
        HostTensor v = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hkv, Lkv, D, Layout::HND);
        copy_logical(w.v, v);
        v.set(0, 0, j, c, bad);
        const Run dirty = run(w, w.q, w.k, v, 1);
        int64_t n = 0;
        check(clean, dirty,
              [&](int64_t h, int64_t i, int64_t cc) {
                if (cc != c) return 0;
                if (fp8_v(prec)) return 1;  // the channel's V scale is NaN
                // 16-bit P.V: key j's tile is multiplied (weight 0 if masked) when the block keeps it
                if (!w.kept(h, i / BQ, j / BK)) return 0;
                return std::isnan(bad) || !w.used(h, i, j) ? 1 : 2;
              },
              &n);
        CHECK(n > 0);
      }
}

TEST_CASE("non-finite inputs: a predicted row keeps every visible block", "[cpu][nonfinite][predict]") {
  std::mt19937_64 rng(fresh_seed());
  const World w = make_world(SPARGE_PRECISION_FP16, SPARGE_DTYPE_FLOAT32, true, rng);
  Plan plan(w.prob);
  sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
  params.topk = 0.25f;
  HostTensor m0 = make_dense(SPARGE_DTYPE_UINT8, {B, Hq, nQB, nKB});
  HostTensor m1 = make_dense(SPARGE_DTYPE_UINT8, {B, Hq, nQB, nKB});
  REQUIRE(run_predict(plan, w.q, w.k, &params, m0, nullptr) == SPARGE_OK);
  HostTensor q = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hq, Lq, D, Layout::HND);
  copy_logical(w.q, q);
  q.set(0, 0, 140, 0, std::nanf(""));  // head 0, query block 1
  REQUIRE(run_predict(plan, q, w.k, &params, m1, nullptr) == SPARGE_OK);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t qb = 0; qb < nQB; ++qb) {
      const int64_t last = std::min(qb * BQ + BQ - 1, Lq - 1) + (Lkv - Lq);
      for (int64_t kb = 0; kb < nKB; ++kb) {
        const bool vis = kb * BK <= last;
        if (h == 0 && qb == 1) CHECK(m1.get(0, h, qb, kb) == (vis ? 1.0f : 0.0f));
        else CHECK(m1.get(0, h, qb, kb) == m0.get(0, h, qb, kb));
      }
    }
  // A NaN in k (smoothed): every row of every head keeps all its visible blocks.
  HostTensor k = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hkv, Lkv, D, Layout::HND);
  copy_logical(w.k, k);
  k.set(0, 0, 3, 9, INFINITY);
  REQUIRE(run_predict(plan, w.q, k, &params, m1, nullptr) == SPARGE_OK);
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t qb = 0; qb < nQB; ++qb) {
      const int64_t last = std::min(qb * BQ + BQ - 1, Lq - 1) + (Lkv - Lq);
      for (int64_t kb = 0; kb < nKB; ++kb) CHECK(m1.get(0, h, qb, kb) == (kb * BK <= last ? 1.0f : 0.0f));
    }
}

TEST_CASE("int8_fp8: values near the bf16 maximum stay finite (dequantization after the division by l)",
          "[cpu][nonfinite]") {
  std::mt19937_64 rng(fresh_seed());
  const float kMax = 3.3895314e38f;  // largest finite bf16
  for (sparge_precision_t prec : {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP8_SPLIT_V}) {
    INFO("precision " << int(prec));
    World w = make_world(prec, SPARGE_DTYPE_BFLOAT16, false, rng);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int64_t j = 0; j < Lkv; ++j)
      for (int64_t c = 0; c < D; ++c) {
        const float x = nd(rng) * (kMax / 4.0f);
        w.v.set(0, 0, j, c, std::max(-kMax, std::min(kMax, x)));
      }
    const HostTensor full = full_mask(B, Hq, nQB, nKB);
    Plan plan(w.prob);
    HostTensor out = make_bhld(SPARGE_DTYPE_BFLOAT16, B, Hq, Lq, D, Layout::HND);
    REQUIRE(run_attention(plan, w.q, w.k, w.v, &full, nullptr, out, nullptr) == SPARGE_OK);
    const RefResult ref = ref_attention(w.q, w.k, w.v, 1.0 / std::sqrt(double(D)), false,
                                        [](int64_t, int64_t, int64_t, int64_t) { return true; });
    const Compare cmp = compare(out, ref.out);
    INFO(describe(cmp));
    CHECK(cmp.nonfinite == 0);
    CHECK(cmp.rel_l1 < 0.06);
  }
}
