// CPU attention against the float64 dense reference: masks, causality, GQA,
// layouts, odd lengths, empty rows, LSE, and the three precision modes.
#include "catch_compat.hpp"

#include <cmath>
#include <cstring>
#include <utility>

#include "test_util.hpp"

using namespace sparge_test;

namespace {

struct Setup {
  sparge_problem_t prob;
  int64_t BQ, BK, nQB, nKB;
  HostTensor q, k, v, out, lse;
};

Setup make_setup(const sparge_problem_t& prob, Layout layout, std::mt19937_64& rng) {
  Setup s{prob, 0, 0, 0, 0, {}, {}, {}, {}, {}};
  s.BQ = prob.block_q ? prob.block_q : 128;
  s.BK = prob.block_k ? prob.block_k : 64;
  s.nQB = ceil_div(prob.len_q, s.BQ);
  s.nKB = ceil_div(prob.len_kv, s.BK);
  s.q = make_bhld(prob.dtype, prob.batch, prob.heads_q, prob.len_q, prob.head_dim, layout);
  s.k = make_bhld(prob.dtype, prob.batch, prob.heads_kv, prob.len_kv, prob.head_dim, layout);
  s.v = make_bhld(prob.dtype, prob.batch, prob.heads_kv, prob.len_kv, prob.head_dim, layout);
  s.out = make_bhld(prob.dtype, prob.batch, prob.heads_q, prob.len_q, prob.head_dim, layout);
  s.lse = make_dense(SPARGE_DTYPE_FLOAT32, {prob.batch, prob.heads_q, prob.len_q});
  fill_random(s.q, rng);
  fill_random(s.k, rng);
  fill_random(s.v, rng);
  return s;  // out and lse are NaN-poisoned by construction
}

double scale_of(const sparge_problem_t& p) { return p.scale ? p.scale : 1.0 / std::sqrt(double(p.head_dim)); }

// Checks LSE against the reference: finite entries within tol, -inf where expected.
void check_lse(const HostTensor& lse, const std::vector<double>& ref, double tol) {
  const auto& s = lse.t.shape;
  size_t idx = 0;
  double worst = 0;
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t i = 0; i < s[2]; ++i, ++idx) {
        const double x = lse.get(b, h, i), y = ref[idx];
        if (std::isinf(y)) {
          INFO("row " << i << " expected -inf, got " << x);
          REQUIRE((std::isinf(x) && x < 0));
        } else {
          INFO("row " << i);
          REQUIRE(std::isfinite(x));
          worst = std::max(worst, std::fabs(x - y));
        }
      }
  INFO("max |lse - ref| = " << worst);
  CHECK(worst <= tol);
}

// EXACT mode must match the float64 reference up to the output rounding.
void check_exact(const Setup& s, const RefResult& ref) {
  const Compare c = compare(s.out, ref.out);
  INFO(describe(c));
  REQUIRE(c.nonfinite == 0);
  const double tol = s.prob.dtype == SPARGE_DTYPE_FLOAT32 ? 2e-6 : (s.prob.dtype == SPARGE_DTYPE_FLOAT16 ? 2e-3 : 1.6e-2);
  CHECK(c.max_abs <= tol);
  check_lse(s.lse, ref.lse, 1e-5);
}

}  // namespace

TEST_CASE("EXACT with every block kept equals float64 dense attention", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (sparge_dtype_t dt : {SPARGE_DTYPE_FLOAT32, SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_BFLOAT16}) {
    INFO("dtype " << int(dt));
    auto prob = cpu_problem(2, 4, 2, 100, 150, 32, dt, SPARGE_PRECISION_EXACT);
    Plan plan(prob);
    Setup s = make_setup(prob, Layout::HND, rng);
    HostTensor mask = full_mask(2, 4, s.nQB, s.nKB);
    REQUIRE(run_attention(plan, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
    check_exact(s, ref_attention(s.q, s.k, s.v, scale_of(prob), false, [](int64_t, int64_t, int64_t, int64_t) {
                  return true;
                }));
  }
}

TEST_CASE("EXACT on a random block mask equals dense attention with -inf outside", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (bool causal : {false, true}) {
    auto prob = cpu_problem(1, 3, 3, 90, 120, 16, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT, causal);
    prob.block_q = 16;
    prob.block_k = 8;
    prob.scale = 0.3f;
    Plan plan(prob);
    Setup s = make_setup(prob, Layout::HND, rng);
    HostTensor mask = make_dense(SPARGE_DTYPE_UINT8, {1, 3, s.nQB, s.nKB});
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t i = 0; i < s.nQB; ++i)
        for (int64_t j = 0; j < s.nKB; ++j) mask.set(0, h, i, j, (rng() % 3) ? 1.0f : 0.0f);
    mask.set(0, 1, 2, 0, 0);  // make sure some rows see nothing
    for (int64_t j = 0; j < s.nKB; ++j) mask.set(0, 1, 2, j, 0.0f);
    REQUIRE(run_attention(plan, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
    RefResult ref = ref_attention(s.q, s.k, s.v, 0.3, causal, block_key_mask(mask, 16, 8));
    check_exact(s, ref);
    // rows of the empty mask row: zeros and -inf
    for (int64_t i = 32; i < 48; ++i) {
      CHECK(std::isinf(s.lse.get(0, 1, i)));
      for (int64_t d = 0; d < 16; ++d) CHECK(s.out.get(0, 1, i, d) == 0.0f);
    }
  }
}

TEST_CASE("causal with Lq != Lkv (both ways), GQA 4:1 and MQA", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  struct Shape {
    int64_t Hq, Hkv, Lq, Lkv;
  };
  for (Shape sh : {Shape{8, 2, 70, 200}, Shape{4, 1, 200, 70}, Shape{4, 4, 129, 129}, Shape{2, 1, 1, 300}}) {
    INFO("Hq " << sh.Hq << " Hkv " << sh.Hkv << " Lq " << sh.Lq << " Lkv " << sh.Lkv);
    auto prob = cpu_problem(1, sh.Hq, sh.Hkv, sh.Lq, sh.Lkv, 24, SPARGE_DTYPE_FLOAT16, SPARGE_PRECISION_EXACT, true);
    Plan plan(prob);
    Setup s = make_setup(prob, Layout::NHD, rng);
    HostTensor mask = full_mask(1, sh.Hq, s.nQB, s.nKB);
    REQUIRE(run_attention(plan, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
    RefResult ref = ref_attention(s.q, s.k, s.v, scale_of(prob), true, block_key_mask(mask, 128, 64));
    check_exact(s, ref);
    if (sh.Lq > sh.Lkv) {  // rows i < Lq - Lkv see nothing
      for (int64_t i = 0; i < sh.Lq - sh.Lkv; ++i) {
        CHECK(std::isinf(s.lse.get(0, 0, i)));
        CHECK(s.out.get(0, 0, i, 0) == 0.0f);
      }
      CHECK(std::isfinite(s.lse.get(0, 0, sh.Lq - sh.Lkv)));
    }
  }
}

TEST_CASE("odd lengths: L not a multiple of the block, L < 128, L = 1", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (auto prec : {SPARGE_PRECISION_EXACT, SPARGE_PRECISION_FP16, SPARGE_PRECISION_INT8_FP8,
                    SPARGE_PRECISION_INT8_FP16}) {
    for (auto L : {std::pair<int64_t, int64_t>{1, 1}, {1, 77}, {77, 1}, {130, 65}, {257, 191}}) {
      INFO("precision " << int(prec) << " Lq " << L.first << " Lkv " << L.second);
      for (bool causal : {false, true}) {
        auto prob = cpu_problem(1, 2, 1, L.first, L.second, 64, SPARGE_DTYPE_BFLOAT16, prec, causal);
        Plan plan(prob);
        Setup s = make_setup(prob, Layout::HND, rng);
        HostTensor mask = full_mask(1, 2, s.nQB, s.nKB);
        REQUIRE(run_attention(plan, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
        RefResult ref = ref_attention(s.q, s.k, s.v, scale_of(prob), causal, block_key_mask(mask, 128, 64));
        const Compare c = compare(s.out, ref.out);
        INFO(describe(c));
        CHECK(c.nonfinite == 0);
        const bool int8 = prec == SPARGE_PRECISION_INT8_FP8 || prec == SPARGE_PRECISION_INT8_FP16;
        CHECK(c.cosine >= (prec == SPARGE_PRECISION_INT8_FP8 ? 0.995 : int8 ? 0.999 : 0.99999));  // few rows: noisy
        check_lse(s.lse, ref.lse, int8 ? 0.1 : 1e-3);
      }
    }
  }
}

TEST_CASE("NHD and HND layouts give bit-identical results", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (auto prec : {SPARGE_PRECISION_EXACT, SPARGE_PRECISION_FP16, SPARGE_PRECISION_INT8_FP8,
                    SPARGE_PRECISION_INT8_FP8_SPLIT_V, SPARGE_PRECISION_INT8_FP16}) {
    INFO("precision " << int(prec));
    auto prob = cpu_problem(2, 4, 2, 150, 140, 32, SPARGE_DTYPE_FLOAT16, prec, true);
    Plan plan(prob);
    Setup a = make_setup(prob, Layout::HND, rng);
    Setup b = make_setup(prob, Layout::NHD, rng);
    copy_logical(a.q, b.q);
    copy_logical(a.k, b.k);
    copy_logical(a.v, b.v);
    // predicted masks inside, default parameters
    REQUIRE(run_attention(plan, a.q, a.k, a.v, nullptr, nullptr, a.out, &a.lse) == SPARGE_OK);
    REQUIRE(run_attention(plan, b.q, b.k, b.v, nullptr, nullptr, b.out, &b.lse) == SPARGE_OK);
    HostTensor bo = make_bhld(prob.dtype, 2, 4, 150, 32, Layout::HND);
    copy_logical(b.out, bo);
    CHECK(a.out.snapshot() == bo.snapshot());
    CHECK(a.lse.snapshot() == b.lse.snapshot());
  }
}

TEST_CASE("FP16 and INT8_FP8 modes are close to float64", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (auto dt : {SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_BFLOAT16}) {
    for (bool causal : {false, true}) {
      INFO("dtype " << int(dt) << " causal " << causal);
      auto prob = cpu_problem(1, 4, 2, 256, 320, 64, dt, SPARGE_PRECISION_FP16, causal);
      Plan plan16(prob);
      prob.precision = SPARGE_PRECISION_INT8_FP8;
      Plan plan8(prob);
      Setup s = make_setup(prob, Layout::HND, rng);
      // a K offset shared by all keys (what smoothing removes) and larger scores
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t j = 0; j < 320; ++j)
          for (int64_t d = 0; d < 64; ++d) s.k.set(0, h, j, d, s.k.get(0, h, j, d) * 2.0f + (d % 3 == 0 ? 1.5f : 0.f));
      HostTensor mask = full_mask(1, 4, s.nQB, s.nKB);
      RefResult ref = ref_attention(s.q, s.k, s.v, scale_of(prob), causal, block_key_mask(mask, 128, 64));

      REQUIRE(run_attention(plan16, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
      Compare c16 = compare(s.out, ref.out);
      INFO("fp16 mode: " << describe(c16));
      CHECK(c16.nonfinite == 0);
      CHECK(c16.rel_l1 <= (dt == SPARGE_DTYPE_FLOAT16 ? 2e-3 : 1.2e-2));
      check_lse(s.lse, ref.lse, 1e-4);

      s.out.fill_nan();
      s.lse.fill_nan();
      REQUIRE(run_attention(plan8, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
      Compare c8 = compare(s.out, ref.out);
      INFO("int8_fp8 mode: " << describe(c8));
      CHECK(c8.nonfinite == 0);
      CHECK(c8.cosine >= 0.999);
      CHECK(c8.rel_l1 <= 0.05);
      check_lse(s.lse, ref.lse, 0.1);
    }
  }
}

TEST_CASE("a predicted mask inside attention_run equals predict_mask then attention_run", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (auto prec : {SPARGE_PRECISION_EXACT, SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP16}) {
    auto prob = cpu_problem(1, 2, 2, 300, 400, 32, SPARGE_DTYPE_BFLOAT16, prec, false);
    Plan plan(prob);
    Setup s = make_setup(prob, Layout::HND, rng);
    sparge_predict_params_t params = SPARGE_PREDICT_PARAMS_INIT;
    params.topk = 0.3f;
    HostTensor mask = make_dense(SPARGE_DTYPE_UINT8, {1, 2, s.nQB, s.nKB});
    REQUIRE(run_predict(plan, s.q, s.k, &params, mask, nullptr) == SPARGE_OK);
    REQUIRE(run_attention(plan, s.q, s.k, s.v, &mask, &params, s.out, &s.lse) == SPARGE_OK);
    HostTensor out2 = make_bhld(prob.dtype, 1, 2, 300, 32, Layout::HND);
    HostTensor lse2 = make_dense(SPARGE_DTYPE_FLOAT32, {1, 2, 300});
    REQUIRE(run_attention(plan, s.q, s.k, s.v, nullptr, &params, out2, &lse2) == SPARGE_OK);
    CHECK(s.out.snapshot() == out2.snapshot());
    CHECK(s.lse.snapshot() == lse2.snapshot());
    if (prec == SPARGE_PRECISION_EXACT) {
      RefResult ref = ref_attention(s.q, s.k, s.v, scale_of(prob), false, block_key_mask(mask, 128, 64));
      const Compare c = compare(s.out, ref.out);
      INFO(describe(c));
      CHECK(c.max_abs <= 1.6e-2);
      check_lse(s.lse, ref.lse, 1e-5);
    }
  }
}

TEST_CASE("strided views: packed QKV and a padded output", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t B = 2, H = 2, L = 70, D = 16;
  // packed [B, L, 3, H, D]: q, k, v share one buffer
  HostTensor qkv = make_dense(SPARGE_DTYPE_FLOAT32, {B, L, 3 * H * D});
  auto view = [&](int which) {
    HostTensor t = qkv;
    t.t.ndim = 4;
    t.t.shape[0] = B;
    t.t.shape[1] = H;
    t.t.shape[2] = L;
    t.t.shape[3] = D;
    t.t.strides[0] = L * 3 * H * D;
    t.t.strides[1] = D;
    t.t.strides[2] = 3 * H * D;
    t.t.strides[3] = 1;
    t.t.data = static_cast<float*>(qkv.t.data) + which * H * D;
    // HostTensor::get uses mem + offset: rebase via a shared_ptr alias
    t.mem = std::shared_ptr<unsigned char>(qkv.mem, static_cast<unsigned char*>(t.t.data));
    return t;
  };
  HostTensor q = view(0), k = view(1), v = view(2);
  fill_random(q, rng);
  fill_random(k, rng);
  fill_random(v, rng);
  HostTensor out = make_strided(SPARGE_DTYPE_FLOAT32, {B, H, L, D}, {H * L * 40, L * 40, 40, 1});
  auto prob = cpu_problem(B, H, H, L, L, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT, true);
  Plan plan(prob);
  HostTensor mask = full_mask(B, H, 1, 2);
  REQUIRE(run_attention(plan, q, k, v, &mask, nullptr, out, nullptr) == SPARGE_OK);
  RefResult ref = ref_attention(q, k, v, 0.25, true, block_key_mask(mask, 128, 64));
  const Compare c = compare(out, ref.out);
  INFO(describe(c));
  CHECK(c.nonfinite == 0);
  CHECK(c.max_abs <= 2e-6);
  // the padding between rows is untouched
  CHECK(std::isnan(out.get(0, 0, 0, D)));
}

namespace {

// INT8_FP8 and `other` on the same random normal inputs, all blocks kept, long
// rows (the design's accuracy workload: 2048 keys, where the roundings of P and
// V are not averaged away), each against float64; the LSE of `other` is
// checked with tolerance lse_tol.
std::pair<Compare, Compare> vs_int8_fp8(sparge_precision_t other, sparge_dtype_t dt, int64_t D, bool causal,
                                        std::mt19937_64& rng, double lse_tol) {
  auto prob = cpu_problem(1, 2, 1, 256, 2048, D, dt, SPARGE_PRECISION_INT8_FP8, causal);
  Plan plan8(prob);
  prob.precision = other;
  Plan plan_other(prob);
  Setup s = make_setup(prob, Layout::HND, rng);
  HostTensor mask = full_mask(1, 2, s.nQB, s.nKB);
  RefResult ref = ref_attention(s.q, s.k, s.v, scale_of(prob), causal, block_key_mask(mask, 128, 64));
  REQUIRE(run_attention(plan8, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
  const Compare c8 = compare(s.out, ref.out);
  s.out.fill_nan();
  s.lse.fill_nan();
  REQUIRE(run_attention(plan_other, s.q, s.k, s.v, &mask, nullptr, s.out, &s.lse) == SPARGE_OK);
  const Compare c = compare(s.out, ref.out);
  check_lse(s.lse, ref.lse, lse_tol);
  return {c8, c};
}

}  // namespace

TEST_CASE("INT8_FP8_SPLIT_V: a smaller error than INT8_FP8 on random normal inputs", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    // float32 inputs: V reaches the quantization unrounded.
    const auto [c8, cs] = vs_int8_fp8(SPARGE_PRECISION_INT8_FP8_SPLIT_V, SPARGE_DTYPE_FLOAT32, 64, causal, rng, 0.1);
    INFO("int8_fp8: " << describe(c8) << "; split V: " << describe(cs));
    CHECK(cs.nonfinite == 0);
    // Emulation (docs/ACCURACY.md): 0.038 -> 0.028 relative L1.
    CHECK(cs.rel_l1 <= 0.85 * c8.rel_l1);
    CHECK(cs.rel_l1 <= 0.032);
    CHECK(cs.cosine >= 0.9995);
  }
}

TEST_CASE("INT8_FP16: the error of the int8 Q.K^T alone, on 16-bit inputs", "[cpu][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (auto dt : {SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_BFLOAT16}) {
    for (bool causal : {false, true}) {
      for (int64_t D : {64, 128}) {
        INFO("dtype " << int(dt) << " causal " << causal << " D " << D);
        const auto [c8, c] = vs_int8_fp8(SPARGE_PRECISION_INT8_FP16, dt, D, causal, rng, 0.05);
        INFO("int8_fp8: " << describe(c8) << "; int8_fp16: " << describe(c));
        CHECK(c.nonfinite == 0);
        // Emulation (docs/ACCURACY.md): int8 Q.K^T alone 0.011 relative L1,
        // against 0.038 for INT8_FP8; the 16-bit P adds little (bf16: 2^-9).
        CHECK(c.rel_l1 <= 0.5 * c8.rel_l1);
        CHECK(c.rel_l1 <= 0.02);
        CHECK(c.cosine >= 0.9998);
      }
    }
  }
}
