// sparge_merge_states on the CUDA backend: random partial states (every dtype,
// several layouts, -inf rows with NaN-poisoned outputs) against a float64
// reference and against the CPU backend on the same bytes; in-place use on the
// device; host memory refused by name.
#include "catch_compat.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_util.hpp"

using namespace sgt;

namespace {

const float kInf = std::numeric_limits<float>::infinity();

size_t esize(sparge_dtype_t dt) { return dt == SPARGE_DTYPE_FLOAT32 ? 4 : 2; }

// A strided host tensor (bytes) with a device twin of the same layout.
struct Twin {
  sparge_dtype_t dt = SPARGE_DTYPE_FLOAT32;
  int ndim = 4;
  int64_t shape[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};
  std::vector<unsigned char> host;
  DeviceBuffer dev;
  size_t bytes = 0;

  Twin(sparge_dtype_t dtype, int nd, const int64_t* shp, const int64_t* str) : dt(dtype), ndim(nd) {
    int64_t last = 0;
    for (int d = 0; d < nd; ++d) {
      shape[d] = shp[d];
      stride[d] = str[d];
      last += (shp[d] - 1) * str[d];
    }
    bytes = size_t(last + 1) * esize(dt);
    host.assign(bytes, 0xff);  // NaN poison in every dtype
    dev.alloc(bytes);
    dev.fill(0xff);
  }
  int64_t off(int64_t b, int64_t h, int64_t l, int64_t d) const {
    return b * stride[0] + h * stride[1] + l * stride[2] + (ndim == 4 ? d * stride[3] : 0);
  }
  float get(int64_t b, int64_t h, int64_t l, int64_t d = 0) const {
    const int64_t o = off(b, h, l, d);
    if (dt == SPARGE_DTYPE_FLOAT32) {
      float f;
      std::memcpy(&f, host.data() + o * 4, 4);
      return f;
    }
    uint16_t u;
    std::memcpy(&u, host.data() + o * 2, 2);
    return from16(u, dt);
  }
  void set(int64_t b, int64_t h, int64_t l, int64_t d, float v) {
    const int64_t o = off(b, h, l, d);
    if (dt == SPARGE_DTYPE_FLOAT32) {
      std::memcpy(host.data() + o * 4, &v, 4);
    } else {
      const uint16_t u = to16(v, dt);
      std::memcpy(host.data() + o * 2, &u, 2);
    }
  }
  void upload() { dev.upload(host.data(), bytes); }
  void download() { dev.download(host.data(), bytes); }
  sparge_tensor_t desc(bool on_device) const {
    sparge_tensor_t t{};
    t.data = on_device ? dev.get() : const_cast<unsigned char*>(host.data());
    t.device_type = on_device ? SPARGE_DEVICE_CUDA : SPARGE_DEVICE_CPU;
    t.device_id = 0;
    t.dtype = dt;
    t.ndim = ndim;
    for (int d = 0; d < ndim; ++d) {
      t.shape[d] = shape[d];
      t.strides[d] = stride[d];
    }
    return t;
  }
};

Twin make_out(sparge_dtype_t dt, int64_t B, int64_t H, int64_t L, int64_t D, int kind) {
  const int64_t shp[4] = {B, H, L, D};
  int64_t st[4];
  switch (kind % 3) {
    case 0: st[3] = 1, st[2] = D, st[1] = L * D, st[0] = H * L * D; break;          // HND
    case 1: st[3] = 1, st[1] = D, st[2] = H * D, st[0] = L * H * D; break;          // NHD
    default: st[3] = 2, st[2] = 2 * D + 3, st[1] = L * (2 * D + 3), st[0] = H * L * (2 * D + 3); break;
  }
  return Twin(dt, 4, shp, st);
}
Twin make_lse(int64_t B, int64_t H, int64_t L) {
  const int64_t shp[3] = {B, H, L}, st[3] = {H * L, L, 1};
  return Twin(SPARGE_DTYPE_FLOAT32, 3, shp, st);
}

}  // namespace

TEST_CASE("CUDA merge_states matches float64 and the CPU backend", "[gpu][merge][sanitize]") {
  std::mt19937_64 rng(case_seed("merge"));
  const sparge_dtype_t dts[3] = {SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT32};
  Stream stream;
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t B = 1 + int64_t(rng() % 2), H = 1 + int64_t(rng() % 4), L = 1 + int64_t(rng() % 150),
                  D = trial % 3 == 0 ? 128 : 1 + int64_t(rng() % 90);
    const int count = trial == 11 ? SPARGE_MERGE_MAX_STATES : 1 + int(rng() % 6);
    INFO("trial " << trial << " B=" << B << " H=" << H << " L=" << L << " D=" << D << " count=" << count);
    std::vector<Twin> outs, lses;
    std::normal_distribution<float> nd(0.2f, 1.3f);
    std::uniform_real_distribution<float> ul(-10.0f, 10.0f);
    for (int i = 0; i < count; ++i) {
      outs.push_back(make_out(dts[rng() % 3], B, H, L, D, int(rng() % 3)));
      lses.push_back(make_lse(B, H, L));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t l = 0; l < L; ++l) {
            // rows l % 7 == 3 are empty in every state; others in about a quarter of the states
            const bool empty = l % 7 == 3 || rng() % 4 == 0;
            lses.back().set(b, h, l, 0, empty ? -kInf : ul(rng));
            for (int64_t d = 0; d < D; ++d)
              if (!empty) outs.back().set(b, h, l, d, nd(rng));  // empty rows stay NaN
          }
      outs.back().upload();
      lses.back().upload();
    }
    const sparge_dtype_t odt = dts[trial % 3];
    Twin out = make_out(odt, B, H, L, D, trial), lse = make_lse(B, H, L);
    Twin cpu_out = make_out(odt, B, H, L, D, trial), cpu_lse = make_lse(B, H, L);
    std::vector<sparge_tensor_t> dv_o, dv_l, h_o, h_l;
    for (int i = 0; i < count; ++i) {
      dv_o.push_back(outs[size_t(i)].desc(true));
      dv_l.push_back(lses[size_t(i)].desc(true));
      h_o.push_back(outs[size_t(i)].desc(false));
      h_l.push_back(lses[size_t(i)].desc(false));
    }
    const sparge_tensor_t d_out = out.desc(true), d_lse = lse.desc(true);
    REQUIRE(sparge_merge_states(count, dv_o.data(), dv_l.data(), &d_out, &d_lse, stream.get()) == SPARGE_OK);
    stream.sync();
    out.download();
    lse.download();
    const sparge_tensor_t c_out = cpu_out.desc(false), c_lse = cpu_lse.desc(false);
    REQUIRE(sparge_merge_states(count, h_o.data(), h_l.data(), &c_out, &c_lse, nullptr) == SPARGE_OK);

    const double ulp = odt == SPARGE_DTYPE_FLOAT32 ? 0x1p-23 : odt == SPARGE_DTYPE_FLOAT16 ? 0x1p-10 : 0x1p-7;
    int64_t bad = 0, bad_cpu = 0, bad_lse = 0;
    double worst = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t l = 0; l < L; ++l) {
          double m = -INFINITY;
          for (int i = 0; i < count; ++i) m = std::max(m, double(lses[size_t(i)].get(b, h, l)));
          double tot = 0;
          std::vector<double> ref(size_t(D), 0.0);
          if (m != -INFINITY) {
            for (int i = 0; i < count; ++i) {
              const double x = lses[size_t(i)].get(b, h, l);
              if (x == -INFINITY) continue;
              const double w = std::exp(x - m);
              tot += w;
              for (int64_t d = 0; d < D; ++d) ref[size_t(d)] += w * double(outs[size_t(i)].get(b, h, l, d));
            }
            for (auto& r : ref) r /= tot;
          }
          const double ref_lse = m == -INFINITY ? -INFINITY : m + std::log(tot);
          const double gl = lse.get(b, h, l);
          if (ref_lse == -INFINITY ? gl != -kInf : !(std::fabs(gl - ref_lse) <= 2e-6 * (1 + std::fabs(ref_lse))))
            ++bad_lse;
          for (int64_t d = 0; d < D; ++d) {
            const double g = out.get(b, h, l, d), c = cpu_out.get(b, h, l, d), r = ref[size_t(d)];
            // float32 arithmetic: a few float32 ulps of the inputs' scale, plus the output's rounding
            const double tol = 1e-5 * 3.0 + std::fabs(r) * ulp;
            const double err = std::fabs(g - r);
            worst = std::max(worst, std::isnan(err) ? INFINITY : err);
            if (!(err <= tol)) ++bad;
            if (!(std::fabs(g - c) <= std::fabs(c) * ulp + 1e-5 * 3.0)) ++bad_cpu;
          }
        }
    INFO("worst |gpu - f64| " << worst);
    CHECK(bad == 0);
    CHECK(bad_cpu == 0);
    CHECK(bad_lse == 0);
  }
}

TEST_CASE("CUDA merge_states in place, and host memory refused by name", "[gpu][merge][sanitize]") {
  std::mt19937_64 rng(case_seed("merge-inplace"));
  const int64_t B = 1, H = 8, L = 333, D = 64;
  std::vector<Twin> outs, lses;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < 3; ++i) {
    outs.push_back(make_out(SPARGE_DTYPE_BFLOAT16, B, H, L, D, i));
    lses.push_back(make_lse(B, H, L));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        lses.back().set(0, h, l, 0, 3.0f * nd(rng));
        for (int64_t d = 0; d < D; ++d) outs.back().set(0, h, l, d, nd(rng));
      }
    outs.back().upload();
    lses.back().upload();
  }
  // Expected: the CPU backend on the host copies.
  Twin want = make_out(SPARGE_DTYPE_BFLOAT16, B, H, L, D, 1), want_lse = make_lse(B, H, L);
  std::vector<sparge_tensor_t> h_o, h_l, d_o, d_l;
  for (int i = 0; i < 3; ++i) {
    h_o.push_back(outs[size_t(i)].desc(false));
    h_l.push_back(lses[size_t(i)].desc(false));
    d_o.push_back(outs[size_t(i)].desc(true));
    d_l.push_back(lses[size_t(i)].desc(true));
  }
  const sparge_tensor_t wo = want.desc(false), wl = want_lse.desc(false);
  REQUIRE(sparge_merge_states(3, h_o.data(), h_l.data(), &wo, &wl, nullptr) == SPARGE_OK);

  // A host pointer among device tensors is refused, naming it; nothing is written.
  {
    std::vector<sparge_tensor_t> mixed = d_o;
    mixed[2].data = outs[2].host.data();
    const sparge_tensor_t o = outs[1].desc(true), l = lses[1].desc(true);
    const sparge_status_t st = sparge_merge_states(3, mixed.data(), d_l.data(), &o, &l, nullptr);
    INFO("message: " << sparge_last_error());
    CHECK(st == SPARGE_ERR_INVALID_ARGUMENT);
    CHECK(std::string(sparge_last_error()).find("outs[2]") != std::string::npos);
  }
  // In place: out is outs[1], lse_out is lses[1].
  const sparge_tensor_t o = outs[1].desc(true), l = lses[1].desc(true);
  Stream stream;
  REQUIRE(sparge_merge_states(3, d_o.data(), d_l.data(), &o, &l, stream.get()) == SPARGE_OK);
  stream.sync();
  outs[1].download();
  lses[1].download();
  int64_t bad = 0, bad_lse = 0;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t l2 = 0; l2 < L; ++l2) {
      const float a = lses[1].get(0, h, l2), c = want_lse.get(0, h, l2);
      if (!(std::fabs(a - c) <= 2e-6f * (1 + std::fabs(c)))) ++bad_lse;
      for (int64_t d = 0; d < D; ++d) {
        const float g = outs[1].get(0, h, l2, d), w = want.get(0, h, l2, d);
        if (!(std::fabs(g - w) <= std::fabs(w) * 0x1p-7 + 3e-5f)) ++bad;
      }
    }
  CHECK(bad == 0);
  CHECK(bad_lse == 0);
}
