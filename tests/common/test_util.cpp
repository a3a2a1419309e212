#include "test_util.hpp"

#include "catch_compat.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace sparge_test {

// ---------------------------------------------------------------- seeds
namespace {
uint64_t base_seed() {
  static const uint64_t seed = [] {
    uint64_t s;
    if (const char* env = std::getenv("SPARGE_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 0);
    } else {
      std::random_device rd;
      s = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    std::fprintf(stderr, "sparge tests: base seed %llu (set SPARGE_TEST_SEED to reproduce)\n",
                 static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}
std::atomic<uint64_t> g_counter{0};
}  // namespace

uint64_t fresh_seed() {
  uint64_t x = base_seed() + 0x9e3779b97f4a7c15ull * (g_counter.fetch_add(1) + 1);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

// ---------------------------------------------------------------- 16-bit types
// Arithmetic (frexp/ldexp) conversions, deliberately unlike the library's bit tricks.
uint16_t f32_to_f16(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | uint16_t(std::nearbyint(std::ldexp(a, 24)));
  int e;
  std::frexp(a, &e);
  int E = e - 1;
  double mant = std::nearbyint(std::ldexp(a, 10 - E));
  if (mant == 2048.0) {
    mant = 1024.0;
    ++E;
  }
  return uint16_t(sign | ((E + 15) << 10) | (int(mant) - 1024));
}

float f16_to_f32(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = std::ldexp(double(m), -24);
  else if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else v = std::ldexp(double(1024 + m), e - 25);
  return float((h & 0x8000) ? -v : v);
}

uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (std::isinf(f)) return sign | 0x7f80;
  if (a < std::ldexp(1.0, -126)) return sign | uint16_t(std::nearbyint(std::ldexp(a, 133)));
  int e;
  std::frexp(a, &e);
  int E = e - 1;
  double mant = std::nearbyint(std::ldexp(a, 7 - E));
  if (mant == 256.0) {
    mant = 128.0;
    ++E;
  }
  if (E > 127) return sign | 0x7f80;
  return uint16_t(sign | ((E + 127) << 7) | (int(mant) - 128));
}

float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

size_t dtype_bytes(sparge_dtype_t dt) {
  switch (dt) {
    case SPARGE_DTYPE_FLOAT16:
    case SPARGE_DTYPE_BFLOAT16: return 2;
    case SPARGE_DTYPE_UINT8: return 1;
    default: return 4;
  }
}

float round_dtype(sparge_dtype_t dt, float f) {
  if (dt == SPARGE_DTYPE_FLOAT16) return f16_to_f32(f32_to_f16(f));
  if (dt == SPARGE_DTYPE_BFLOAT16) return bf16_to_f32(f32_to_bf16(f));
  return f;
}

// ---------------------------------------------------------------- tensors
int64_t HostTensor::offset(const int64_t* idx) const {
  int64_t o = 0;
  for (int d = 0; d < t.ndim; ++d) o += idx[d] * t.strides[d];
  return o;
}

float HostTensor::get(int64_t a, int64_t b, int64_t c, int64_t d) const {
  const int64_t idx[4] = {a, b, c, d};
  const int64_t o = offset(idx);
  const unsigned char* base = mem.get();
  switch (t.dtype) {
    case SPARGE_DTYPE_FLOAT16: {
      uint16_t h;
      std::memcpy(&h, base + o * 2, 2);
      return f16_to_f32(h);
    }
    case SPARGE_DTYPE_BFLOAT16: {
      uint16_t h;
      std::memcpy(&h, base + o * 2, 2);
      return bf16_to_f32(h);
    }
    case SPARGE_DTYPE_UINT8: return float(base[o]);
    case SPARGE_DTYPE_INT32: {
      int32_t i;
      std::memcpy(&i, base + o * 4, 4);
      return float(i);
    }
    default: {
      float f;
      std::memcpy(&f, base + o * 4, 4);
      return f;
    }
  }
}

void HostTensor::set(int64_t a, int64_t b, int64_t c, int64_t d, float v) {
  const int64_t idx[4] = {a, b, c, d};
  const int64_t o = offset(idx);
  unsigned char* base = mem.get();
  switch (t.dtype) {
    case SPARGE_DTYPE_FLOAT16: {
      uint16_t h = f32_to_f16(v);
      std::memcpy(base + o * 2, &h, 2);
      break;
    }
    case SPARGE_DTYPE_BFLOAT16: {
      uint16_t h = f32_to_bf16(v);
      std::memcpy(base + o * 2, &h, 2);
      break;
    }
    case SPARGE_DTYPE_UINT8: base[o] = uint8_t(v); break;
    case SPARGE_DTYPE_INT32: {
      int32_t i = int32_t(v);
      std::memcpy(base + o * 4, &i, 4);
      break;
    }
    default: std::memcpy(base + o * 4, &v, 4); break;
  }
}

void HostTensor::fill_nan() {
  unsigned char* base = mem.get();
  switch (t.dtype) {
    case SPARGE_DTYPE_FLOAT16:
    case SPARGE_DTYPE_BFLOAT16: {
      const uint16_t nan = t.dtype == SPARGE_DTYPE_FLOAT16 ? 0x7e00 : 0x7fc0;
      for (size_t i = 0; i + 2 <= bytes; i += 2) std::memcpy(base + i, &nan, 2);
      break;
    }
    case SPARGE_DTYPE_FLOAT32: {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (size_t i = 0; i + 4 <= bytes; i += 4) std::memcpy(base + i, &nan, 4);
      break;
    }
    default: std::memset(base, 0xAB, bytes); break;
  }
}

std::vector<unsigned char> HostTensor::snapshot() const {
  return std::vector<unsigned char>(mem.get(), mem.get() + bytes);
}

std::shared_ptr<unsigned char> alloc_workspace(size_t bytes) {
  size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, n);
  REQUIRE(p != nullptr);
  return std::shared_ptr<unsigned char>(static_cast<unsigned char*>(p), [](unsigned char* x) { std::free(x); });
}

HostTensor make_strided(sparge_dtype_t dt, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  HostTensor h;
  h.t.dtype = dt;
  h.t.device_type = SPARGE_DEVICE_CPU;
  h.t.device_id = 0;
  h.t.ndim = int32_t(shape.size());
  int64_t last = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    h.t.shape[d] = shape[d];
    h.t.strides[d] = strides[d];
    last += (shape[d] - 1) * strides[d];
  }
  // round the allocation up to whole elements of 4 bytes so fill_nan covers it
  h.bytes = size_t(last + 1) * dtype_bytes(dt);
  h.bytes = (h.bytes + 3) / 4 * 4;
  h.mem = alloc_workspace(h.bytes);
  h.t.data = h.mem.get();
  h.fill_nan();
  return h;
}

HostTensor make_dense(sparge_dtype_t dt, const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    st[d] = s;
    s *= shape[d];
  }
  return make_strided(dt, shape, st);
}

HostTensor make_bhld(sparge_dtype_t dt, int64_t B, int64_t H, int64_t L, int64_t D, Layout layout) {
  if (layout == Layout::HND) return make_dense(dt, {B, H, L, D});
  return make_strided(dt, {B, H, L, D}, {L * H * D, D, H * D, 1});
}

void fill_random(HostTensor& t, std::mt19937_64& rng, float stddev, float mean) {
  std::normal_distribution<float> nd(mean, stddev);
  const auto& s = t.t.shape;
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t b = 0; b < s[1]; ++b)
      for (int64_t c = 0; c < s[2]; ++c)
        for (int64_t d = 0; d < s[3]; ++d) t.set(a, b, c, d, nd(rng));
}

// ---------------------------------------------------------------- reference
RefResult ref_attention(const HostTensor& q, const HostTensor& k, const HostTensor& v, double scale, bool causal,
                        const KeyMask& used) {
  const int64_t B = q.t.shape[0], Hq = q.t.shape[1], Lq = q.t.shape[2], D = q.t.shape[3];
  const int64_t Hkv = k.t.shape[1], Lkv = k.t.shape[2], G = Hq / Hkv;
  RefResult r;
  r.out.assign(size_t(B * Hq * Lq * D), 0.0);
  r.lse.assign(size_t(B * Hq * Lq), -std::numeric_limits<double>::infinity());
  std::vector<double> s(static_cast<size_t>(Lkv));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Lq; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Lkv; ++j) {
          const bool vis = !causal || j <= i + (Lkv - Lq);
          if (!vis || !used(b, h, i, j)) {
            s[size_t(j)] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double d = 0;
          for (int64_t c = 0; c < D; ++c) d += double(q.get(b, h, i, c)) * double(k.get(b, hk, j, c));
          s[size_t(j)] = scale * d;
          mx = std::max(mx, s[size_t(j)]);
        }
        if (std::isinf(mx)) continue;
        double sum = 0;
        double* o = &r.out[size_t(((b * Hq + h) * Lq + i) * D)];
        for (int64_t j = 0; j < Lkv; ++j) {
          if (std::isinf(s[size_t(j)])) continue;
          const double e = std::exp(s[size_t(j)] - mx);
          sum += e;
          for (int64_t c = 0; c < D; ++c) o[c] += e * double(v.get(b, hk, j, c));
        }
        for (int64_t c = 0; c < D; ++c) o[c] /= sum;
        r.lse[size_t((b * Hq + h) * Lq + i)] = mx + std::log(sum);
      }
    }
  return r;
}

KeyMask block_key_mask(const HostTensor& mask, int64_t BQ, int64_t BK) {
  return [mask, BQ, BK](int64_t b, int64_t h, int64_t i, int64_t j) {
    return mask.get(b, h, i / BQ, j / BK) != 0.0f;
  };
}

// ---------------------------------------------------------------- metrics
Compare compare(const HostTensor& out, const std::vector<double>& ref) {
  const auto& s = out.t.shape;
  Compare c;
  double dot = 0, n1 = 0, n2 = 0, l1 = 0, l1ref = 0;
  size_t idx = 0;
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t b = 0; b < s[1]; ++b)
      for (int64_t l = 0; l < s[2]; ++l)
        for (int64_t d = 0; d < s[3]; ++d, ++idx) {
          const double x = out.get(a, b, l, d), y = ref[idx];
          if (!std::isfinite(x)) {
            ++c.nonfinite;
            continue;
          }
          dot += x * y;
          n1 += x * x;
          n2 += y * y;
          l1 += std::fabs(x - y);
          l1ref += std::fabs(y);
          c.max_abs = std::max(c.max_abs, std::fabs(x - y));
        }
  c.cosine = (n1 > 0 && n2 > 0) ? dot / std::sqrt(n1 * n2) : (n1 == n2 ? 1.0 : 0.0);
  c.rel_l1 = l1ref > 0 ? l1 / l1ref : l1;
  return c;
}

std::string describe(const Compare& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "cosine=%.8f rel_l1=%.3e max_abs=%.3e nonfinite=%lld", c.cosine, c.rel_l1,
                c.max_abs, static_cast<long long>(c.nonfinite));
  return buf;
}

// ---------------------------------------------------------------- plans
Plan::Plan(const sparge_problem_t& prob) {
  const sparge_status_t st = sparge_create_plan(&prob, &p);
  INFO(sparge_last_error());
  REQUIRE(st == SPARGE_OK);
}

size_t Plan::workspace_size() const {
  size_t n = 0;
  REQUIRE(sparge_plan_workspace_size(p, &n) == SPARGE_OK);
  return n;
}

sparge_problem_t cpu_problem(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, int64_t D,
                             sparge_dtype_t dt, sparge_precision_t prec, bool causal) {
  sparge_problem_t p = SPARGE_PROBLEM_INIT;
  p.batch = B;
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.len_q = Lq;
  p.len_kv = Lkv;
  p.head_dim = D;
  p.dtype = dt;
  p.device_type = SPARGE_DEVICE_CPU;
  p.precision = prec;
  p.causal = causal ? 1 : 0;
  return p;
}

}  // namespace sparge_test

namespace sparge_test {

sparge_status_t run_attention(const Plan& plan, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                              const HostTensor* mask, const sparge_predict_params_t* params, const HostTensor& out,
                              const HostTensor* lse) {
  const size_t n = plan.workspace_size();
  auto ws = alloc_workspace(n);
  return sparge_attention_run(plan.p, q.desc(), k.desc(), v.desc(), mask ? mask->desc() : nullptr, params,
                              out.desc(), lse ? lse->desc() : nullptr, ws.get(), n, nullptr);
}

sparge_status_t run_predict(const Plan& plan, const HostTensor& q, const HostTensor& k,
                            const sparge_predict_params_t* params, const HostTensor& mask, const HostTensor* kept) {
  const size_t n = plan.workspace_size();
  auto ws = alloc_workspace(n);
  return sparge_predict_mask(plan.p, q.desc(), k.desc(), params, mask.desc(), kept ? kept->desc() : nullptr,
                             ws.get(), n, nullptr);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

HostTensor full_mask(int64_t B, int64_t Hq, int64_t nQB, int64_t nKB) {
  HostTensor m = make_dense(SPARGE_DTYPE_UINT8, {B, Hq, nQB, nKB});
  std::memset(m.mem.get(), 1, m.bytes);
  return m;
}

void copy_logical(const HostTensor& src, HostTensor& dst) {
  const auto& s = src.t.shape;
  const size_t es = dtype_bytes(src.t.dtype);
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t b = 0; b < s[1]; ++b)
      for (int64_t c = 0; c < s[2]; ++c)
        for (int64_t d = 0; d < s[3]; ++d) {
          const int64_t idx[4] = {a, b, c, d};
          std::memcpy(dst.mem.get() + dst.offset(idx) * es, src.mem.get() + src.offset(idx) * es, es);
        }
}

float e4m3_reference(float x) {
  if (std::isnan(x)) return x;
  // Enumerate the non-negative finite e4m3 values and pick the nearest (ties: even code).
  static const std::vector<double> grid = [] {
    std::vector<double> g;
    for (int code = 0; code <= 0x7e; ++code) {
      const int e = code >> 3, m = code & 7;
      g.push_back(e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7));
    }
    return g;
  }();
  const double a = std::fabs(double(x));
  if (a >= 448.0) return std::signbit(x) ? -448.0f : 448.0f;
  size_t best = 0;
  for (size_t c = 1; c < grid.size(); ++c) {
    const double dc = std::fabs(grid[c] - a), db = std::fabs(grid[best] - a);
    if (dc < db || (dc == db && (c % 2 == 0) && (best % 2 == 1))) best = c;
  }
  const float r = float(grid[best]);
  return std::signbit(x) ? -r : r;
}

}  // namespace sparge_test
