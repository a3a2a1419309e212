// sparge_merge_states on the CPU backend: random partial states in every dtype
// and layout against a float64 reference, the -inf / NaN / +inf rules, in-place
// use, attention split over key chunks merged back into the whole, and every
// rejected argument.
#include "catch_compat.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.hpp"

using namespace sparge_test;

namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

sparge_dtype_t pick_dtype(std::mt19937_64& rng) {
  const sparge_dtype_t all[3] = {SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT32};
  return all[rng() % 3];
}

// [B, H, L, D] in one of four layouts: HND, NHD, a padded row pitch, or a D stride of 3.
HostTensor make_state(sparge_dtype_t dt, int64_t B, int64_t H, int64_t L, int64_t D, int kind) {
  switch (kind % 4) {
    case 0: return make_bhld(dt, B, H, L, D, Layout::HND);
    case 1: return make_bhld(dt, B, H, L, D, Layout::NHD);
    case 2: return make_strided(dt, {B, H, L, D}, {H * L * (D + 5), L * (D + 5), D + 5, 1});
    default: return make_strided(dt, {B, H, L, D}, {H * L * D * 3, L * D * 3, D * 3, 3});
  }
}

HostTensor make_lse(int64_t B, int64_t H, int64_t L, int kind) {
  if (kind % 2 == 0) return make_dense(SPARGE_DTYPE_FLOAT32, {B, H, L});
  return make_strided(SPARGE_DTYPE_FLOAT32, {B, H, L}, {1, B, B * H});  // transposed
}

// Random LSEs (fill_random covers 4-D tensors only).
void fill_lse(HostTensor& t, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> nd(0.0f, stddev);
  for (int64_t b = 0; b < t.t.shape[0]; ++b)
    for (int64_t h = 0; h < t.t.shape[1]; ++h)
      for (int64_t l = 0; l < t.t.shape[2]; ++l) t.set(b, h, l, 0, nd(rng));
}

struct States {
  std::vector<HostTensor> outs, lses;
  std::vector<sparge_tensor_t> touts, tlses;
  void finish() {
    touts.clear();
    tlses.clear();
    for (auto& o : outs) touts.push_back(o.t);
    for (auto& l : lses) tlses.push_back(l.t);
  }
};

// float64 reference of the merge from the stored (rounded) inputs.
void reference(const States& s, int64_t B, int64_t H, int64_t L, int64_t D, std::vector<double>& out,
               std::vector<double>& lse) {
  out.assign(size_t(B * H * L * D), 0.0);
  lse.assign(size_t(B * H * L), -INFINITY);
  const size_t n = s.outs.size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        double m = -INFINITY;
        for (size_t i = 0; i < n; ++i) m = std::max(m, double(s.lses[i].get(b, h, l)));
        const size_t r = size_t((b * H + h) * L + l);
        if (m == -INFINITY) continue;
        double tot = 0.0;
        for (size_t i = 0; i < n; ++i) {
          const double x = s.lses[i].get(b, h, l);
          if (x == -INFINITY) continue;
          const double w = std::exp(x - m);
          tot += w;
          for (int64_t d = 0; d < D; ++d) out[r * size_t(D) + size_t(d)] += w * double(s.outs[i].get(b, h, l, d));
        }
        for (int64_t d = 0; d < D; ++d) out[r * size_t(D) + size_t(d)] /= tot;
        lse[r] = m + std::log(tot);
      }
}

// Largest error of `out` against the reference in units of the output dtype's
// rounding (0.5 ulp is the best any implementation can do).
void check_against(const HostTensor& out, const HostTensor* lse_out, const std::vector<double>& ref,
                   const std::vector<double>& ref_lse, int64_t B, int64_t H, int64_t L, int64_t D) {
  const sparge_dtype_t dt = out.dtype();
  const double eps = dt == SPARGE_DTYPE_FLOAT32 ? 0x1p-24 : dt == SPARGE_DTYPE_FLOAT16 ? 0x1p-11 : 0x1p-8;
  int64_t bad = 0, bad_lse = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        const size_t r = size_t((b * H + h) * L + l);
        for (int64_t d = 0; d < D; ++d) {
          const double want = ref[r * size_t(D) + size_t(d)], got = out.get(b, h, l, d);
          // 16-bit outputs: half an ulp of the value plus float32 slack; fp16 subnormals: absolute.
          const double tol = std::fabs(want) * eps * 1.01 + 1e-6 * std::fabs(want) + 1e-7 +
                             (dt == SPARGE_DTYPE_FLOAT16 ? 0x1p-25 : 0.0);
          if (!(std::fabs(got - want) <= tol)) ++bad;
        }
        if (lse_out) {
          const double want = ref_lse[r], got = lse_out->get(b, h, l);
          if (want == -INFINITY ? got != -kInf : !(std::fabs(got - want) <= 1e-6 * (1.0 + std::fabs(want)))) ++bad_lse;
        }
      }
  CHECK(bad == 0);
  CHECK(bad_lse == 0);
}

sparge_status_t merge(States& s, const HostTensor& out, const HostTensor* lse_out) {
  s.finish();
  return sparge_merge_states(int32_t(s.outs.size()), s.touts.data(), s.tlses.data(), out.desc(),
                             lse_out ? lse_out->desc() : nullptr, nullptr);
}

}  // namespace

TEST_CASE("merge_states: random states in every dtype and layout match float64", "[merge]") {
  std::mt19937_64 rng(fresh_seed());
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t B = 1 + int64_t(rng() % 2), H = 1 + int64_t(rng() % 3), L = 1 + int64_t(rng() % 37),
                  D = 1 + int64_t(rng() % 70);
    const int count = 1 + int(rng() % 6);
    INFO("trial " << trial << " B=" << B << " H=" << H << " L=" << L << " D=" << D << " count=" << count);
    States s;
    std::uniform_real_distribution<float> ul(-8.0f, 8.0f);
    for (int i = 0; i < count; ++i) {
      s.outs.push_back(make_state(pick_dtype(rng), B, H, L, D, int(rng() % 4)));
      fill_random(s.outs.back(), rng, 1.5f, 0.25f);
      s.lses.push_back(make_lse(B, H, L, int(rng() % 2)));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t l = 0; l < L; ++l) {
            // about a fifth of the rows of each state are empty (-inf); their outputs are NaN
            // poison, which must not leak into the result
            const bool empty = rng() % 5 == 0;
            s.lses.back().set(b, h, l, 0, empty ? -kInf : ul(rng) + float(i));
            if (empty)
              for (int64_t d = 0; d < D; ++d) s.outs.back().set(b, h, l, d, kNaN);
          }
    }
    HostTensor out = make_state(pick_dtype(rng), B, H, L, D, int(rng() % 4));
    HostTensor lse_out = make_lse(B, H, L, int(rng() % 2));
    REQUIRE(merge(s, out, &lse_out) == SPARGE_OK);
    CHECK(std::string(sparge_last_error()).empty());
    std::vector<double> ref, ref_lse;
    reference(s, B, H, L, D, ref, ref_lse);
    check_against(out, &lse_out, ref, ref_lse, B, H, L, D);
    // Without lse_out the output is the same.
    HostTensor out2 = make_state(out.dtype(), B, H, L, D, 0);
    REQUIRE(merge(s, out2, nullptr) == SPARGE_OK);
    check_against(out2, nullptr, ref, ref_lse, B, H, L, D);
  }
}

TEST_CASE("merge_states: -inf rows, NaN and +inf LSEs", "[merge]") {
  std::mt19937_64 rng(fresh_seed());
  const int64_t B = 1, H = 1, L = 4, D = 9;
  States s;
  for (int i = 0; i < 3; ++i) {
    s.outs.push_back(make_bhld(SPARGE_DTYPE_FLOAT32, B, H, L, D, Layout::HND));
    fill_random(s.outs.back(), rng);
    s.lses.push_back(make_dense(SPARGE_DTYPE_FLOAT32, {B, H, L}));
  }
  // row 0: every state empty; row 1: one NaN; row 2: one +inf among finite; row 3: two +inf.
  const float lse[3][4] = {{-kInf, 0.5f, 1.0f, kInf}, {-kInf, kNaN, kInf, 2.0f}, {-kInf, 0.0f, 3.0f, kInf}};
  for (int i = 0; i < 3; ++i)
    for (int64_t l = 0; l < L; ++l) s.lses[size_t(i)].set(0, 0, l, 0, lse[i][l]);
  HostTensor out = make_bhld(SPARGE_DTYPE_FLOAT32, B, H, L, D, Layout::HND);
  HostTensor lse_out = make_dense(SPARGE_DTYPE_FLOAT32, {B, H, L});
  REQUIRE(merge(s, out, &lse_out) == SPARGE_OK);
  for (int64_t d = 0; d < D; ++d) {
    CHECK(out.get(0, 0, 0, d) == 0.0f);
    CHECK(std::isnan(out.get(0, 0, 1, d)));
    CHECK(out.get(0, 0, 2, d) == s.outs[1].get(0, 0, 2, d));  // the +inf state alone
    const double avg = 0.5 * (double(s.outs[0].get(0, 0, 3, d)) + double(s.outs[2].get(0, 0, 3, d)));
    CHECK(out.get(0, 0, 3, d) == Approx(avg).epsilon(1e-6));
  }
  CHECK(lse_out.get(0, 0, 0) == -kInf);
  CHECK(std::isnan(lse_out.get(0, 0, 1)));
  CHECK(lse_out.get(0, 0, 2) == kInf);
  CHECK(lse_out.get(0, 0, 3) == kInf);
}

TEST_CASE("merge_states: in place, out and lse_out being one of the inputs", "[merge]") {
  std::mt19937_64 rng(fresh_seed());
  const int64_t B = 2, H = 3, L = 17, D = 40;
  for (const sparge_dtype_t dt : {SPARGE_DTYPE_FLOAT32, SPARGE_DTYPE_BFLOAT16}) {
    States s;
    for (int i = 0; i < 4; ++i) {
      s.outs.push_back(make_bhld(dt, B, H, L, D, i % 2 ? Layout::NHD : Layout::HND));
      fill_random(s.outs.back(), rng);
      s.lses.push_back(make_dense(SPARGE_DTYPE_FLOAT32, {B, H, L}));
      fill_lse(s.lses.back(), rng, 3.0f);
    }
    std::vector<double> ref, ref_lse;
    reference(s, B, H, L, D, ref, ref_lse);
    HostTensor out = s.outs[2], lse_out = s.lses[2];  // shares the memory
    REQUIRE(merge(s, out, &lse_out) == SPARGE_OK);
    check_against(out, &lse_out, ref, ref_lse, B, H, L, D);
  }
}

TEST_CASE("merge_states: attention over key chunks merges into attention over all keys", "[merge]") {
  std::mt19937_64 rng(fresh_seed());
  const int64_t B = 1, Hq = 4, Hkv = 2, Lq = 96, D = 32;
  const int64_t chunks[] = {64, 37, 128, 20};  // Lkv = 249, split in four uneven chunks
  int64_t Lkv = 0;
  for (int64_t c : chunks) Lkv += c;
  HostTensor q = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hq, Lq, D, Layout::HND);
  HostTensor k = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hkv, Lkv, D, Layout::HND);
  HostTensor v = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hkv, Lkv, D, Layout::HND);
  fill_random(q, rng);
  fill_random(k, rng);
  fill_random(v, rng);
  // Whole problem (EXACT, every block kept).
  Plan whole(cpu_problem(B, Hq, Hkv, Lq, Lkv, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT));
  HostTensor out_all = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hq, Lq, D, Layout::HND);
  HostTensor lse_all = make_dense(SPARGE_DTYPE_FLOAT32, {B, Hq, Lq});
  HostTensor mask_all = full_mask(B, Hq, ceil_div(Lq, 128), ceil_div(Lkv, 64));
  REQUIRE(run_attention(whole, q, k, v, &mask_all, nullptr, out_all, &lse_all) == SPARGE_OK);
  // Each chunk on its own, then merged.
  States s;
  int64_t start = 0;
  for (int64_t c : chunks) {
    HostTensor kc = k, vc = v;  // views into the chunk: same strides, offset pointer
    kc.t.shape[2] = c;
    vc.t.shape[2] = c;
    kc.t.data = static_cast<float*>(k.t.data) + start * k.t.strides[2];
    vc.t.data = static_cast<float*>(v.t.data) + start * v.t.strides[2];
    Plan part(cpu_problem(B, Hq, Hkv, Lq, c, D, SPARGE_DTYPE_FLOAT32, SPARGE_PRECISION_EXACT));
    s.outs.push_back(make_bhld(SPARGE_DTYPE_FLOAT32, B, Hq, Lq, D, Layout::NHD));
    s.lses.push_back(make_dense(SPARGE_DTYPE_FLOAT32, {B, Hq, Lq}));
    HostTensor m = full_mask(B, Hq, ceil_div(Lq, 128), ceil_div(c, 64));
    REQUIRE(run_attention(part, q, kc, vc, &m, nullptr, s.outs.back(), &s.lses.back()) == SPARGE_OK);
    start += c;
  }
  HostTensor out = make_bhld(SPARGE_DTYPE_FLOAT32, B, Hq, Lq, D, Layout::HND);
  HostTensor lse = make_dense(SPARGE_DTYPE_FLOAT32, {B, Hq, Lq});
  REQUIRE(merge(s, out, &lse) == SPARGE_OK);
  double max_err = 0, max_lse_err = 0;
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t i = 0; i < Lq; ++i) {
      for (int64_t d = 0; d < D; ++d)
        max_err = std::max(max_err, std::fabs(double(out.get(0, h, i, d)) - double(out_all.get(0, h, i, d))));
      max_lse_err = std::max(max_lse_err, std::fabs(double(lse.get(0, h, i)) - double(lse_all.get(0, h, i))));
    }
  INFO("max |out - whole| = " << max_err << ", max |lse - whole| = " << max_lse_err);
  CHECK(max_err < 2e-6);
  CHECK(max_lse_err < 2e-6);
}

TEST_CASE("merge_states: rejected arguments name the argument", "[merge][validation]") {
  std::mt19937_64 rng(fresh_seed());
  const int64_t B = 1, H = 2, L = 5, D = 8;
  States s;
  for (int i = 0; i < 2; ++i) {
    s.outs.push_back(make_bhld(SPARGE_DTYPE_BFLOAT16, B, H, L, D, Layout::HND));
    fill_random(s.outs.back(), rng);
    s.lses.push_back(make_dense(SPARGE_DTYPE_FLOAT32, {B, H, L}));
    fill_lse(s.lses.back(), rng, 2.0f);
  }
  s.finish();
  HostTensor out = make_bhld(SPARGE_DTYPE_FLOAT32, B, H, L, D, Layout::HND);
  HostTensor lse_out = make_dense(SPARGE_DTYPE_FLOAT32, {B, H, L});
  const auto poisoned = out.snapshot();
  const auto lse_poisoned = lse_out.snapshot();
  auto expect = [&](sparge_status_t st, sparge_status_t want, const char* needle) {
    INFO("message: " << sparge_last_error());
    CHECK(std::string(sparge_status_string(st)) == sparge_status_string(want));
    CHECK(std::string(sparge_last_error()).find(needle) != std::string::npos);
    CHECK(out.snapshot() == poisoned);  // nothing written
    CHECK(lse_out.snapshot() == lse_poisoned);
  };
  const sparge_status_t INV = SPARGE_ERR_INVALID_ARGUMENT;
  sparge_tensor_t* o = s.touts.data();
  sparge_tensor_t* l = s.tlses.data();
  expect(sparge_merge_states(0, o, l, out.desc(), lse_out.desc(), nullptr), INV, "count is 0");
  expect(sparge_merge_states(SPARGE_MERGE_MAX_STATES + 1, o, l, out.desc(), nullptr, nullptr), INV,
         "SPARGE_MERGE_MAX_STATES");
  expect(sparge_merge_states(2, nullptr, l, out.desc(), nullptr, nullptr), INV, "outs is NULL");
  expect(sparge_merge_states(2, o, nullptr, out.desc(), nullptr, nullptr), INV, "lses is NULL");
  expect(sparge_merge_states(2, o, l, nullptr, nullptr, nullptr), INV, "out is NULL");

  auto with = [&](auto edit, const char* needle, sparge_status_t want = SPARGE_ERR_INVALID_ARGUMENT) {
    States t = s;
    sparge_tensor_t to = out.t, tl = lse_out.t;
    t.finish();
    edit(t.touts, t.tlses, to, tl);
    expect(sparge_merge_states(2, t.touts.data(), t.tlses.data(), &to, &tl, nullptr), want, needle);
  };
  using V = std::vector<sparge_tensor_t>;
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.ndim = 3; }, "out->ndim is 3");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.shape[2] = 0; }, "out->shape[2] is 0");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.dtype = SPARGE_DTYPE_UINT8; }, "out->dtype is UINT8");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.device_type = sparge_device_type_t(7); },
       "out->device_type is 7");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.device_id = 3; }, "out->device_id is 3");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.data = nullptr; }, "out->data is NULL");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.strides[1] = -1; }, "out->strides[1] is -1");
  with([](V&, V&, sparge_tensor_t& to, sparge_tensor_t&) { to.strides[2] = 0; }, "out->strides[2] is 0");
  with([](V&, V&, sparge_tensor_t&, sparge_tensor_t& tl) { tl.dtype = SPARGE_DTYPE_FLOAT16; },
       "lse_out->dtype is FLOAT16");
  with([](V&, V&, sparge_tensor_t&, sparge_tensor_t& tl) { tl.shape[1] = 3; }, "lse_out->shape[1] is 3");
  with([](V&, V&, sparge_tensor_t&, sparge_tensor_t& tl) { tl.strides[0] = 0; tl.shape[0] = 1; tl.strides[2] = 0; },
       "lse_out->strides[2] is 0");
  with([](V& vo, V&, sparge_tensor_t&, sparge_tensor_t&) { vo[1].shape[3] = 9; }, "outs[1]->shape[3] is 9");
  with([](V& vo, V&, sparge_tensor_t&, sparge_tensor_t&) { vo[1].dtype = SPARGE_DTYPE_INT32; },
       "outs[1]->dtype is INT32");
  with([](V& vo, V&, sparge_tensor_t&, sparge_tensor_t&) { vo[0].data = nullptr; }, "outs[0]->data is NULL");
  with([](V& vo, V&, sparge_tensor_t&, sparge_tensor_t&) { vo[1].device_type = SPARGE_DEVICE_CUDA; },
       "outs[1]->device_type is CUDA");
  with([](V&, V& vl, sparge_tensor_t&, sparge_tensor_t&) { vl[1].ndim = 4; }, "lses[1]->ndim is 4");
  with([](V&, V& vl, sparge_tensor_t&, sparge_tensor_t&) { vl[0].dtype = SPARGE_DTYPE_BFLOAT16; },
       "lses[0]->dtype is BFLOAT16");
  with([](V&, V& vl, sparge_tensor_t&, sparge_tensor_t&) { vl[1].strides[2] = INT64_MAX / 2; },
       "lses[1]: the extent");
  // Inputs may repeat elements (a broadcast LSE, say): a zero stride on an input is fine.
  {
    States t = s;
    t.finish();
    t.tlses[1].strides[1] = 0;
    HostTensor o2 = make_bhld(SPARGE_DTYPE_FLOAT32, B, H, L, D, Layout::HND);
    CHECK(sparge_merge_states(2, t.touts.data(), t.tlses.data(), o2.desc(), nullptr, nullptr) == SPARGE_OK);
  }
  // A CUDA out: without the CUDA backend NO_DEVICE; with it, host memory is refused by name.
  {
    sparge_tensor_t to = out.t;
    to.device_type = SPARGE_DEVICE_CUDA;
    const sparge_status_t st = sparge_merge_states(2, o, l, &to, nullptr, nullptr);
    INFO("message: " << sparge_last_error());
    CHECK(st != SPARGE_OK);
    if (!sparge_has_cuda()) CHECK(st == SPARGE_ERR_NO_DEVICE);
    CHECK(std::string(sparge_last_error()).find("out") != std::string::npos);
    CHECK(out.snapshot() == poisoned);
  }
}
