// The INT8_FP8 quantization twin: hand-checked rounding cases, and a
// bit-for-bit comparison with a second, test-side transcription of the steps
// in docs/SEMANTICS.md.
#include "catch_compat.hpp"

#include <cmath>
#include <cstring>

#include "core/kernel_traits.hpp"
#include "test_util.hpp"

using namespace sparge_test;

namespace {

sparge_predict_params_t no_smoothing() {
  sparge_predict_params_t p = SPARGE_PREDICT_PARAMS_INIT;
  p.smooth_k = 0;
  return p;
}

// Runs INT8_FP8 attention on fp32 inputs given as dense [Lq, D] / [Lkv, D]
// arrays with every block kept.
struct Tiny {
  HostTensor out, lse;
};
// A float32 [1, 1, L, D] tensor holding one head's rows.
HostTensor one_head(const std::vector<float>& x, int64_t L, int64_t D) {
  HostTensor t = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 1, L, D, Layout::HND);
  std::memcpy(t.mem.get(), x.data(), x.size() * 4);
  return t;
}

Tiny run_tiny(int64_t Lq, int64_t Lkv, int64_t D, const std::vector<float>& q, const std::vector<float>& k,
              const std::vector<float>& v, float scale, bool smooth, const std::vector<uint8_t>& keys = {}) {
  auto prob = cpu_problem(1, 1, 1, Lq, Lkv, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_INT8_FP8);
  prob.scale = scale;
  if (!keys.empty()) prob.block_k = 1;  // per-key mask
  Plan plan(prob);
  HostTensor tq = one_head(q, Lq, D), tk = one_head(k, Lkv, D), tv = one_head(v, Lkv, D);
  Tiny t{make_bhld(SPARGE_DTYPE_FLOAT32, 1, 1, Lq, D, Layout::HND), make_dense(SPARGE_DTYPE_FLOAT32, {1, 1, Lq})};
  HostTensor mask = full_mask(1, 1, ceil_div(Lq, 128), keys.empty() ? ceil_div(Lkv, 64) : Lkv);
  for (size_t j = 0; j < keys.size(); ++j)
    for (int64_t i = 0; i < ceil_div(Lq, 128); ++i) mask.set(0, 0, i, int64_t(j), keys[j]);
  sparge_predict_params_t params = no_smoothing();
  params.smooth_k = smooth ? 1 : 0;
  REQUIRE(run_attention(plan, tq, tk, tv, &mask, &params, t.out, &t.lse) == SPARGE_OK);
  return t;
}

}  // namespace

TEST_CASE("twin: Q codes use round-half-even and a per-token scale", "[cpu][twin]") {
  // q = [127, x]: amax 127 so q8 = [127, rint(x)]; k = [0, 127]: k8 = [0, 127], sk = 1.
  // scale = 1/127: t = rint(x) * 127 * (1 * (scale * log2 e)) * 1, LSE = t ln 2 ~= rint(x).
  const float xs[] = {0.5f, 1.5f, 2.5f, -2.5f, 3.5f, -0.5f, 126.5f};
  const float expect[] = {0, 2, 2, -2, 4, 0, 126};
  std::vector<float> q;
  for (float x : xs) {
    q.push_back(127.0f);
    q.push_back(x);
  }
  const int64_t n = int64_t(sizeof(xs) / sizeof(xs[0]));
  Tiny t = run_tiny(n, 1, 2, q, {0.0f, 127.0f}, {1.0f, -2.0f}, 1.0f / 127.0f, false);
  for (int64_t i = 0; i < n; ++i) {
    INFO("x = " << xs[i]);
    CHECK(t.lse.get(0, 0, i) == Approx(expect[i]).margin(1e-4));
    // one key: the output is that key's V up to the V and P rounding (448 and v8 exact here)
    CHECK(t.out.get(0, 0, i, 0) == Approx(1.0f).epsilon(1e-6));
    CHECK(t.out.get(0, 0, i, 1) == Approx(-2.0f).epsilon(1e-6));
  }
  // a second token with a small amax gets its own scale: [0.01, 0.005] -> codes [127, 64] (63.5 -> 64)
  Tiny u = run_tiny(1, 1, 2, {0.01f, 0.005f}, {0.0f, 127.0f}, {1.0f, 1.0f}, 1.0f / 127.0f, false);
  // t = 64 * 127 * ((0.01/127) * log2e / 127) * 1 -> LSE = 64 * 0.01 / 127
  CHECK(u.lse.get(0, 0, 0) == Approx(64.0 * 0.01 / 127.0).epsilon(1e-5));
}

TEST_CASE("twin: V uses per-channel scales and e4m3 with ties to even", "[cpu][twin]") {
  // Two identical keys: p = 1 for both, l = 2, o = (e4m3(448) * (v8_0 + v8_1) / 2) * (sv/448).
  // v = [448, x] per channel: sv = 1, v8 = [448, e4m3(x)].
  struct Case {
    float x, rounded;
  };
  const float sub = std::ldexp(1.0f, -9);
  const Case cases[] = {{1.0625f, 1.0f}, {1.1875f, 1.25f}, {1.5f * sub, 2 * sub}, {0.5f * sub, 0.0f},
                        {232.0f, 224.0f}, {-232.0f, -224.0f}};
  for (const Case& c : cases) {
    INFO("x = " << c.x);
    Tiny t = run_tiny(1, 2, 1, {1.0f}, {1.0f, 1.0f}, {448.0f, c.x}, 0.125f, false);
    const double expect = (448.0 + double(c.rounded)) / 2.0;
    CHECK(t.out.get(0, 0, 0, 0) == Approx(expect).margin(2e-5));
    CHECK(std::fabs(t.out.get(0, 0, 0, 0) - (448.0 + double(c.x)) / 2.0) ==
          Approx(std::fabs(double(c.rounded) - double(c.x)) / 2.0).margin(2e-5));
  }
  // Channels are scaled independently: channel 1 is tiny but keeps its precision.
  Tiny t = run_tiny(1, 2, 2, {1.0f, 0.0f}, {1.0f, 0.0f, 1.0f, 0.0f}, {448.0f, 1e-3f, 448.0f, 0.5e-3f}, 0.125f, false);
  CHECK(t.out.get(0, 0, 0, 1) == Approx(0.75e-3).epsilon(1e-6));
}

TEST_CASE("twin: K codes per 64-key block on smoothed K", "[cpu][twin]") {
  // Key 0 = [0, 127] is in quantization block 0 (amax 127), key 64 = [0, 0.3]
  // alone in block 1: with its own scale it keeps its value (code 127); with one
  // scale for all keys it would quantize to 0. Only keys 0 and 64 are used.
  const int64_t Lkv = 65;
  std::vector<float> k(size_t(Lkv * 2), 0.0f), v(size_t(Lkv * 2), 1.0f);
  k[1] = 127.0f;
  k[64 * 2 + 1] = 0.3f;
  std::vector<uint8_t> keys(size_t(Lkv), 0);
  keys[0] = keys[64] = 1;
  const float scale = 1.0f / (127.0f * 127.0f);
  const double s0 = 1.0, s64 = 0.3 / 127.0;
  const double lse = std::log(std::exp(s0) + std::exp(s64));  // 1.31389 (1.31327 if key 64 were 0)
  Tiny t = run_tiny(1, Lkv, 2, {0.0f, 127.0f}, k, v, scale, false, keys);
  CHECK(t.lse.get(0, 0, 0) == Approx(lse).epsilon(2e-6));
  // With smoothing (mu = mean over all 65 keys) the codes change but the LSE is
  // that of the real scores: the shift scale * q.mu is added back.
  Tiny s = run_tiny(1, Lkv, 2, {0.0f, 127.0f}, k, v, scale, true, keys);
  CHECK(s.lse.get(0, 0, 0) == Approx(lse).epsilon(2e-4));
}

namespace {

// A second transcription of SEMANTICS.md's int8 steps (one head, float
// inputs given as dense arrays, used[i, j] = key j used by query i, kept(qb, kb)
// the block mask, bq x bk blocks). vmode: 0 INT8_FP8 (e4m3 P and V), 1
// INT8_FP8_SPLIT_V (V as two e4m3 terms), 2 INT8_FP16 (V as given, P rounded
// to pdt: FLOAT32 leaves it unrounded). Steps of per_step listed tiles. pv:
// the PV skip's threshold (natural log; 0 off): a step whose max is below
// m - pv * log2(e) leaves the row as it is.
template <class Kept>
void twin_reference(int64_t Lq, int64_t Lkv, int64_t D, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<uint8_t>& used /* [Lq, Lkv] */, Kept kept,
                    int64_t bq, int64_t bk, bool causal, float scale, bool smooth, int vmode,
                    std::vector<float>& out, std::vector<float>& lse, int per_step = 2,
                    sparge_dtype_t pdt = SPARGE_DTYPE_FLOAT32, float pv = 0.0f) {
  std::vector<float> mu(size_t(D), 0.0f);
  if (smooth)
    for (int64_t c = 0; c < D; ++c) {
      double s = 0;
      for (int64_t j = 0; j < Lkv; ++j) s += k[size_t(j * D + c)];
      mu[size_t(c)] = float(s / double(Lkv));
    }
  auto q8of = [](float x, float inv) { return std::min(127.0f, std::max(-127.0f, std::nearbyint(x * inv))); };
  const int64_t nT = (Lkv + 63) / 64;
  std::vector<float> k8(size_t(Lkv * D), 0.0f), sk(size_t(nT), 0.0f);
  for (int64_t tb = 0; tb < nT; ++tb) {
    float a = 0;
    for (int64_t j = tb * 64; j < std::min(Lkv, tb * 64 + 64); ++j)
      for (int64_t c = 0; c < D; ++c) a = std::max(a, std::fabs(k[size_t(j * D + c)] - mu[size_t(c)]));
    if (a == 0) continue;
    sk[size_t(tb)] = a / 127.0f;
    for (int64_t j = tb * 64; j < std::min(Lkv, tb * 64 + 64); ++j)
      for (int64_t c = 0; c < D; ++c) k8[size_t(j * D + c)] = q8of(k[size_t(j * D + c)] - mu[size_t(c)], 127.0f / a);
  }
  std::vector<float> v8(size_t(Lkv * D), 0.0f), sv(size_t(D), 0.0f);
  for (int64_t c = 0; c < D && vmode != 2; ++c) {
    float a = 0;
    for (int64_t j = 0; j < Lkv; ++j) a = std::max(a, std::fabs(v[size_t(j * D + c)]));
    if (a == 0) continue;
    sv[size_t(c)] = a / 448.0f;
    for (int64_t j = 0; j < Lkv; ++j) {
      const float y = v[size_t(j * D + c)] * (448.0f / a), hi = e4m3_reference(y);
      v8[size_t(j * D + c)] = vmode == 1 ? hi + e4m3_reference(y - hi) : hi;
    }
  }
  out.assign(size_t(Lq * D), 0.0f);
  lse.assign(size_t(Lq), -INFINITY);
  for (int64_t i = 0; i < Lq; ++i) {
    float a = 0;
    for (int64_t c = 0; c < D; ++c) a = std::max(a, std::fabs(q[size_t(i * D + c)]));
    std::vector<float> q8(size_t(D), 0.0f);
    const float sq = a == 0 ? 0.0f : a / 127.0f;
    if (a != 0)
      for (int64_t c = 0; c < D; ++c) q8[size_t(c)] = q8of(q[size_t(i * D + c)], 127.0f / a);
    // Listed tiles of this row's query block: 64-key tiles holding a key of a
    // kept block that some query of the block can see; steps are pairs of them.
    const int64_t qb = i / bq, last_row = std::min(qb * bq + bq - 1, Lq - 1);
    std::vector<int64_t> listed;
    for (int64_t tb = 0; tb < nT; ++tb) {
      bool any_key = false;
      for (int64_t j = tb * 64; j < std::min(Lkv, tb * 64 + 64); ++j) {
        const int64_t kb = j / bk;
        any_key |= kept(qb, kb) && (!causal || kb * bk <= last_row + (Lkv - Lq));
      }
      if (any_key) listed.push_back(tb);
    }
    float m = -INFINITY, l = 0;
    std::vector<float> acc(size_t(D), 0.0f);
    for (size_t s0 = 0; s0 < listed.size(); s0 += size_t(per_step)) {
      const size_t s1 = std::min(listed.size(), s0 + size_t(per_step));
      std::vector<float> t(size_t(64 * per_step), -INFINITY);
      bool any = false;
      float tmax = -INFINITY;
      for (size_t u = s0; u < s1; ++u) {
        const int64_t tb = listed[u], j0 = tb * 64, j1 = std::min(Lkv, j0 + 64);
        for (int64_t j = j0; j < j1; ++j) {
          if (!used[size_t(i * Lkv + j)]) continue;
          any = true;
          int32_t dot = 0;
          for (int64_t c = 0; c < D; ++c) dot += int32_t(q8[size_t(c)]) * int32_t(k8[size_t(j * D + c)]);
          const float tj = float(dot) * ((sq * (scale * 1.4426950408889634f)) * sk[size_t(tb)]);
          t[size_t(int64_t(u - s0) * 64 + (j - j0))] = tj;
          tmax = std::max(tmax, tj);
        }
      }
      if (!any) continue;
      if (pv > 0.0f && m != -INFINITY && tmax < m - pv * 1.4426950408889634f) continue;
      const float mn = std::max(m, tmax);
      const float alpha = m == -INFINITY ? 0.0f : std::exp2(m - mn);
      float ps = 0;
      for (int64_t c = 0; c < D; ++c) acc[size_t(c)] *= alpha;
      for (size_t u = s0; u < s1; ++u) {
        const int64_t tb = listed[u], j0 = tb * 64, j1 = std::min(Lkv, j0 + 64);
        for (int64_t j = j0; j < j1; ++j) {
          const float tj = t[size_t(int64_t(u - s0) * 64 + (j - j0))];
          if (tj == -INFINITY) continue;
          const float p = std::exp2(tj - mn);
          ps += p;
          if (vmode == 2) {
            const float pr = round_dtype(pdt, p);
            for (int64_t c = 0; c < D; ++c) acc[size_t(c)] += pr * v[size_t(j * D + c)];
            continue;
          }
          const float p8 = e4m3_reference(p * 448.0f);
          for (int64_t c = 0; c < D; ++c) acc[size_t(c)] += p8 * v8[size_t(j * D + c)];
        }
      }
      l = l * alpha + ps;
      m = mn;
    }
    if (l == 0) continue;
    double qmu = 0;
    for (int64_t c = 0; c < D; ++c) qmu += double(q[size_t(i * D + c)]) * double(mu[size_t(c)]);
    for (int64_t c = 0; c < D; ++c)
      out[size_t(i * D + c)] = vmode == 2 ? acc[size_t(c)] / l : (acc[size_t(c)] / l) * (sv[size_t(c)] / 448.0f);
    lse[size_t(i)] = m * 0.693147180559945309f + std::log(l) + float(double(scale) * qmu);
  }
}

// Runs the library on the mask (dt: the tensors' dtype, also the rounding of P
// for vmode 2) and the transcription on the same values, and counts the
// output elements (the transcription's rounded to dt) and LSE values that
// differ.
int64_t twin_mismatches(const Plan& plan, const HostTensor& tq, const HostTensor& tk, const HostTensor& tv,
                        const HostTensor& mask, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, int64_t Lq, int64_t Lkv, int64_t D, int64_t bq, int64_t bk,
                        bool causal, bool smooth, int vmode, int per_step, sparge_dtype_t dt, float pv = 0.0f) {
  std::vector<uint8_t> used(size_t(Lq * Lkv));
  for (int64_t i = 0; i < Lq; ++i)
    for (int64_t j = 0; j < Lkv; ++j)
      used[size_t(i * Lkv + j)] = (mask.get(0, 0, i / bq, j / bk) != 0) && (!causal || j <= i + (Lkv - Lq));
  HostTensor out = make_bhld(dt, 1, 1, Lq, D, Layout::HND);
  HostTensor lse = make_dense(SPARGE_DTYPE_FLOAT32, {1, 1, Lq});
  sparge_predict_params_t params = no_smoothing();
  params.smooth_k = smooth;
  params.pv_threshold = pv;
  REQUIRE(run_attention(plan, tq, tk, tv, &mask, &params, out, &lse) == SPARGE_OK);
  std::vector<float> ro, rl;
  auto kept = [&](int64_t qb, int64_t kb) { return mask.get(0, 0, qb, kb) != 0; };
  twin_reference(Lq, Lkv, D, q, k, v, used, kept, bq, bk, causal, 0.2f, smooth, vmode, ro, rl, per_step, dt, pv);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < Lq; ++i) {
    if (!(lse.get(0, 0, i) == rl[size_t(i)])) ++mismatches;
    for (int64_t c = 0; c < D; ++c)
      if (!(out.get(0, 0, i, c) == round_dtype(dt, ro[size_t(i * D + c)]))) ++mismatches;
  }
  return mismatches;
}

}  // namespace

TEST_CASE("twin: bit-identical to a second transcription of the steps", "[cpu][twin]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Layout 0: 32x16 blocks, 3 of 4 kept at random (64-key tiles rarely unlisted).
  // Layout 1: 32x64 blocks with a deterministic pattern of gaps, so the listed
  // tiles are not consecutive (e.g. 0, 2, 3, 5, 6) and pairing listed tiles
  // differs from pairing fixed 128-key windows; 450 keys end in a ragged tile.
  for (int layout : {0, 1})
  for (int vmode : {0, 1, 2})
  for (bool causal : {false, true})
    for (bool smooth : {false, true}) {
      INFO("layout " << layout << " vmode " << vmode << " causal " << causal << " smooth " << smooth);
      const sparge_precision_t prec = vmode == 0   ? SPARGE_PRECISION_INT8_FP8
                                      : vmode == 1 ? SPARGE_PRECISION_INT8_FP8_SPLIT_V
                                                   : SPARGE_PRECISION_INT8_FP16;
      const int64_t Lq = 150, Lkv = layout == 0 ? 200 : 450, D = 40;
      const int bq = 32, bk = layout == 0 ? 16 : 64;
      auto prob = cpu_problem(1, 1, 1, Lq, Lkv, D, SPARGE_DTYPE_FLOAT32, prec, causal);
      prob.block_q = bq;
      prob.block_k = bk;
      prob.scale = 0.2f;
      Plan plan(prob);
      std::vector<float> q(size_t(Lq * D)), k(size_t(Lkv * D)), v(size_t(Lkv * D));
      for (auto& x : q) x = nd(rng);
      for (auto& x : k) x = nd(rng) + 0.7f;
      for (auto& x : v) x = nd(rng) * 3.0f;
      for (int64_t c = 0; c < D; ++c) v[size_t(5 * D + c)] = 0.0f;  // a zero row of V
      for (int64_t c = 0; c < D; ++c) q[size_t(7 * D + c)] = 0.0f;  // a zero row of Q
      HostTensor tq = one_head(q, Lq, D), tk = one_head(k, Lkv, D), tv = one_head(v, Lkv, D);
      const int64_t nQB = ceil_div(Lq, bq), nKB = ceil_div(Lkv, bk);
      HostTensor mask = make_dense(SPARGE_DTYPE_UINT8, {1, 1, nQB, nKB});
      for (int64_t i = 0; i < nQB; ++i)
        for (int64_t j = 0; j < nKB; ++j) {
          const bool on = layout == 0 ? (rng() % 4) != 0 : ((i + j) % 3) != 1;
          mask.set(0, 0, i, j, on ? 1.0f : 0.0f);
        }
      REQUIRE(sparge::blocks_per_step(prec, D) == 2);
      CHECK(twin_mismatches(plan, tq, tk, tv, mask, q, k, v, Lq, Lkv, D, bq, bk, causal, smooth, vmode, 2,
                            SPARGE_DTYPE_FLOAT32) == 0);
    }
}

// INT8_FP16 as the sm_90a kernels run it: 16-bit inputs (P rounded to their
// type before P.V) and the kernels' steps (core/kernel_traits.hpp): three
// listed tiles at D = 64, two up to 128 (D = 96 runs the 128-wide kernel), one
// at D = 256.
TEST_CASE("twin: INT8_FP16 on 16-bit inputs, bit-identical to the transcription", "[cpu][twin]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto dt : {SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT16})
    for (int64_t D : {int64_t(64), int64_t(40), int64_t(96), int64_t(256)})
      for (bool causal : {false, true}) {
        INFO("dtype " << int(dt) << " D " << D << " causal " << causal);
        const int per_step = D == 64 ? 3 : D == 256 ? 1 : 2;
        REQUIRE(sparge::blocks_per_step(SPARGE_PRECISION_INT8_FP16, D) == per_step);
        // 450 keys: eight tiles, a ragged last one; 64-key mask blocks with a
        // pattern of gaps, so the listed tiles are not consecutive.
        const int64_t Lq = 150, Lkv = 450;
        const int bq = 32, bk = 64;
        auto prob = cpu_problem(1, 1, 1, Lq, Lkv, D, dt, SPARGE_PRECISION_INT8_FP16, causal);
        prob.block_q = bq;
        prob.block_k = bk;
        prob.scale = 0.2f;
        Plan plan(prob);
        HostTensor tq = make_bhld(dt, 1, 1, Lq, D, Layout::HND), tk = make_bhld(dt, 1, 1, Lkv, D, Layout::HND),
                   tv = make_bhld(dt, 1, 1, Lkv, D, Layout::HND);
        std::vector<float> q(size_t(Lq * D)), k(size_t(Lkv * D)), v(size_t(Lkv * D));
        auto fill = [&](HostTensor& t, std::vector<float>& x, int64_t L, float off, float mul) {
          for (int64_t i = 0; i < L; ++i)
            for (int64_t c = 0; c < D; ++c) {
              t.set(0, 0, i, c, nd(rng) * mul + off);
              x[size_t(i * D + c)] = t.get(0, 0, i, c);  // the rounded value the library reads
            }
        };
        fill(tq, q, Lq, 0.0f, 1.0f);
        fill(tk, k, Lkv, 0.7f, 1.0f);
        fill(tv, v, Lkv, 0.0f, 3.0f);
        const int64_t nQB = ceil_div(Lq, bq), nKB = ceil_div(Lkv, bk);
        HostTensor mask = make_dense(SPARGE_DTYPE_UINT8, {1, 1, nQB, nKB});
        for (int64_t i = 0; i < nQB; ++i)
          for (int64_t j = 0; j < nKB; ++j) mask.set(0, 0, i, j, ((i + j) % 3) != 1 ? 1.0f : 0.0f);
        CHECK(twin_mismatches(plan, tq, tk, tv, mask, q, k, v, Lq, Lkv, D, bq, bk, causal, true, 2, per_step, dt) ==
              0);
      }
}

// The PV skip (docs/SEMANTICS.md, "PV skip") on inputs where it acts: every
// query shares a direction with the 64 keys of tile 0 (a "sink" several
// nats above the other keys), so after the first step most rows find later
// steps far below their running max. Each int8 mode with tau = 1 nat is bit
// for bit the transcription's skip; tau = 1 changes most rows and keeps the
// zero rows (all scores equal); tau = 60 (no step is that far below) equals the skip off; FP16 on
// the same inputs likewise (its own steps of one tile).
TEST_CASE("twin: the PV skip, bit-identical to the transcription, acting where a step is far below m",
          "[cpu][twin][pv]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t Lq = 150, Lkv = 450, D = 40;
  const int bq = 32, bk = 64;
  std::vector<float> u(static_cast<size_t>(D));
  double un = 0;
  for (auto& x : u) x = nd(rng), un += double(x) * x;
  for (auto& x : u) x = float(x / std::sqrt(un));
  std::vector<float> q(size_t(Lq * D)), k(size_t(Lkv * D)), v(size_t(Lkv * D));
  // Rows 40..47 are zero: every score 0, no step below m, nothing skipped.
  for (int64_t i = 0; i < Lq; ++i)
    for (int64_t c = 0; c < D; ++c) q[size_t(i * D + c)] = (i >= 40 && i < 48) ? 0.0f : 6.0f * u[size_t(c)] + nd(rng);
  for (int64_t j = 0; j < Lkv; ++j)
    for (int64_t c = 0; c < D; ++c) k[size_t(j * D + c)] = (j < 64 ? 6.0f * u[size_t(c)] : 0.0f) + nd(rng);
  for (auto& x : v) x = nd(rng) * 3.0f;
  HostTensor tq = one_head(q, Lq, D), tk = one_head(k, Lkv, D), tv = one_head(v, Lkv, D);
  const int64_t nQB = ceil_div(Lq, bq), nKB = ceil_div(Lkv, bk);
  HostTensor mask = make_dense(SPARGE_DTYPE_UINT8, {1, 1, nQB, nKB});
  for (int64_t i = 0; i < nQB; ++i)
    for (int64_t j = 0; j < nKB; ++j) mask.set(0, 0, i, j, (j == 0 || ((i + j) % 3) != 1) ? 1.0f : 0.0f);
  // Outputs with the skip at tau against the skip off: rows changed, rows equal.
  auto compare = [&](Plan& plan, float tau, int64_t& changed, int64_t& same) {
    HostTensor o0 = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 1, Lq, D, Layout::HND),
               o1 = make_bhld(SPARGE_DTYPE_FLOAT32, 1, 1, Lq, D, Layout::HND);
    sparge_predict_params_t params = no_smoothing();
    REQUIRE(run_attention(plan, tq, tk, tv, &mask, &params, o0, nullptr) == SPARGE_OK);
    params.pv_threshold = tau;
    REQUIRE(run_attention(plan, tq, tk, tv, &mask, &params, o1, nullptr) == SPARGE_OK);
    changed = same = 0;
    for (int64_t i = 0; i < Lq; ++i) {
      bool eq = true;
      for (int64_t c = 0; c < D; ++c) eq = eq && o0.get(0, 0, i, c) == o1.get(0, 0, i, c);
      (eq ? same : changed) += 1;
    }
  };
  for (int vmode : {0, 1, 2, 3})
    for (bool causal : {false, true}) {
      INFO("vmode " << vmode << " causal " << causal);
      const sparge_precision_t prec = vmode == 0   ? SPARGE_PRECISION_INT8_FP8
                                      : vmode == 1 ? SPARGE_PRECISION_INT8_FP8_SPLIT_V
                                      : vmode == 2 ? SPARGE_PRECISION_INT8_FP16
                                                   : SPARGE_PRECISION_FP16;
      auto prob = cpu_problem(1, 1, 1, Lq, Lkv, D, SPARGE_DTYPE_FLOAT32, prec, causal);
      prob.block_q = bq;
      prob.block_k = bk;
      prob.scale = 0.2f;
      Plan plan(prob);
      if (vmode < 3)
        CHECK(twin_mismatches(plan, tq, tk, tv, mask, q, k, v, Lq, Lkv, D, bq, bk, causal, false, vmode, 2,
                              SPARGE_DTYPE_FLOAT32, 1.0f) == 0);
      int64_t changed = 0, same = 0;
      compare(plan, 1.0f, changed, same);
      CHECK(changed > Lq / 2);
      CHECK(same >= 8);
      compare(plan, 60.0f, changed, same);
      CHECK(changed == 0);
    }
}
