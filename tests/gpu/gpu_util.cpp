#include "gpu_util.hpp"

#include <algorithm>
#include <cctype>
#include <tuple>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

namespace sgt {

// ------------------------------------------------------------------ CUDA
void cuda_fail(cudaError_t e, const char* what, const char* file, int line) {
  std::ostringstream os;
  os << file << ":" << line << ": " << what << " failed: " << cudaGetErrorName(e) << " (" << cudaGetErrorString(e)
     << ")";
  throw std::runtime_error(os.str());
}

void DeviceBuffer::alloc(size_t bytes) {
  release();
  if (bytes == 0) return;
  SGT_CUDA(cudaMalloc(&p_, bytes));
  n_ = bytes;
}
void DeviceBuffer::release() {
  if (p_) cudaFree(p_);  // no throw from destructors
  p_ = nullptr;
  n_ = 0;
}
void DeviceBuffer::upload(const void* src, size_t bytes) {
  if (bytes > n_) throw std::runtime_error("DeviceBuffer::upload: too many bytes");
  if (bytes) SGT_CUDA(cudaMemcpy(p_, src, bytes, cudaMemcpyHostToDevice));
}
void DeviceBuffer::download(void* dst, size_t bytes) const {
  if (bytes > n_) throw std::runtime_error("DeviceBuffer::download: too many bytes");
  if (bytes) SGT_CUDA(cudaMemcpy(dst, p_, bytes, cudaMemcpyDeviceToHost));
}
void DeviceBuffer::fill(int byte) {
  if (n_) SGT_CUDA(cudaMemset(p_, byte, n_));
}

Stream::Stream() { SGT_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
Stream::~Stream() {
  if (s_) cudaStreamDestroy(s_);
}
void Stream::sync() const { SGT_CUDA(cudaStreamSynchronize(s_)); }

// ------------------------------------------------------------------ 16-bit floats
static uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t u = fbits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_to_f32(uint16_t h) { return bitsf(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_f16(float f) {
  const uint32_t x = fbits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (ax < 0x38800000u) {                         // below 2^-14: subnormal (exact scaling, RNE)
    const float r = std::nearbyint(bitsf(ax) * 16777216.0f);
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}
float f16_to_f32(uint16_t h) {
  const uint32_t s = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return s ? -v : v;
  }
  if (e == 31) return bitsf(s | 0x7f800000u | (m << 13));
  return bitsf(s | ((e - 15u + 127u) << 23) | (m << 13));
}

const char* dtype_name(sparge_dtype_t t) {
  switch (t) {
    case SPARGE_DTYPE_FLOAT16: return "fp16";
    case SPARGE_DTYPE_BFLOAT16: return "bf16";
    case SPARGE_DTYPE_FLOAT32: return "fp32";
    default: return "?";
  }
}
const char* precision_name(sparge_precision_t p) {
  switch (p) {
    case SPARGE_PRECISION_INT8_FP8: return "int8_fp8";
    case SPARGE_PRECISION_FP16: return "fp16";
    case SPARGE_PRECISION_EXACT: return "exact";
    case SPARGE_PRECISION_INT8_FP8_SPLIT_V: return "int8_fp8_split_v";
    case SPARGE_PRECISION_INT8_FP16: return "int8_fp16";
    default: return "?";
  }
}

// ------------------------------------------------------------------ seeds, threads
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t base_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("SPARGE_TEST_SEED");
    if (env && *env) return static_cast<uint64_t>(std::strtoull(env, nullptr, 0));
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}

uint64_t case_seed(const std::string& label) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : label) h = (h ^ ch) * 1099511628211ull;
  return mix64(base_seed() ^ h);
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int64_t nt = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  nt = std::min(nt, n);
  if (nt == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr err;
  std::mutex mu;
  std::vector<std::thread> th;
  for (int64_t t = 0; t < nt; ++t)
    th.emplace_back([&] {
      for (;;) {
        const int64_t i = next.fetch_add(1);
        if (i >= n) return;
        try {
          fn(i);
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu);
          if (!err) err = std::current_exception();
          next.store(n);
          return;
        }
      }
    });
  for (auto& t : th) t.join();
  if (err) std::rethrow_exception(err);
}

// ------------------------------------------------------------------ tensors
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::HND: return "HND";
    case Layout::NHD: return "NHD";
    case Layout::HND_PAD: return "HND+pad";
  }
  return "?";
}

void HostTensor::init(int64_t B_, int64_t H_, int64_t L_, int64_t D_, Layout l, sparge_dtype_t t) {
  B = B_, H = H_, L = L_, D = D_, layout = l, dtype = t;
  switch (l) {
    case Layout::HND:
      strides[0] = H * L * D, strides[1] = L * D, strides[2] = D, strides[3] = 1;
      storage = static_cast<size_t>(B * H * L * D);
      break;
    case Layout::NHD:
      strides[0] = L * H * D, strides[1] = D, strides[2] = H * D, strides[3] = 1;
      storage = static_cast<size_t>(B * H * L * D);
      break;
    case Layout::HND_PAD: {
      const int64_t pitch = D + 8;
      strides[0] = H * L * pitch, strides[1] = L * pitch, strides[2] = pitch, strides[3] = 1;
      storage = static_cast<size_t>(B * H * L * pitch);
      break;
    }
  }
  bits.assign(storage, 0);
  val.assign(static_cast<size_t>(B * H * L * D), 0.f);
}

void HostTensor::set_values(const std::vector<float>& logical) {
  parallel_for(B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t i = 0; i < L; ++i)
      for (int64_t c = 0; c < D; ++c) {
        const size_t li = lidx(b, h, i, c);
        const uint16_t x = to16(logical[li], dtype);
        bits[static_cast<size_t>(off(b, h, i, c))] = x;
        val[li] = from16(x, dtype);
      }
  });
}

sparge_tensor_t make_desc(void* data, sparge_device_type_t dev, sparge_dtype_t t, int ndim, const int64_t* shape,
                          const int64_t* strides) {
  sparge_tensor_t d;
  std::memset(&d, 0, sizeof d);
  d.data = data;
  d.device_type = dev;
  d.device_id = 0;
  d.dtype = t;
  d.ndim = ndim;
  for (int i = 0; i < ndim; ++i) d.shape[i] = shape[i], d.strides[i] = strides[i];
  return d;
}

sparge_tensor_t desc4(const HostTensor& t, void* data, sparge_device_type_t dev) {
  const int64_t shape[4] = {t.B, t.H, t.L, t.D};
  return make_desc(data, dev, t.dtype, 4, shape, t.strides);
}

static double unit(uint64_t x) { return (static_cast<double>(x >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

std::vector<float> random_values(int64_t B, int64_t H, int64_t L, int64_t D, uint64_t seed, bool outliers,
                                 float offset_scale) {
  std::vector<float> out(static_cast<size_t>(B * H * L * D));
  parallel_for(B * H, [&](int64_t bh) {
    const int64_t h = bh % H;
    std::vector<float> chan_off(static_cast<size_t>(D), 0.f), chan_mul(static_cast<size_t>(D), 1.f);
    if (outliers) {
      for (int64_t c = 0; c < D; ++c)
        chan_off[static_cast<size_t>(c)] = offset_scale * static_cast<float>(std::sin(0.37 * c + 1.3 * h));
      // The same channels in every head of Q and K (as in real models, where
      // Q and K outliers share channels); the offset pattern varies by head.
      const int64_t picks[3] = {3 % D, 40 % D, 77 % D};
      for (int64_t c : picks) chan_mul[static_cast<size_t>(c)] = 20.f;
    }
    const size_t base = static_cast<size_t>(bh * L * D);
    for (int64_t e = 0; e < L * D; e += 2) {
      const uint64_t r = mix64(seed ^ mix64(base + static_cast<uint64_t>(e)));
      const double u1 = unit(r), u2 = unit(mix64(r));
      const double rad = std::sqrt(-2.0 * std::log(u1));
      const double z[2] = {rad * std::cos(6.283185307179586 * u2), rad * std::sin(6.283185307179586 * u2)};
      for (int t = 0; t < 2 && e + t < L * D; ++t) {
        const int64_t c = (e + t) % D;
        out[base + static_cast<size_t>(e + t)] =
            static_cast<float>(z[t]) * chan_mul[static_cast<size_t>(c)] + chan_off[static_cast<size_t>(c)];
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------ problems
double Shape::scale() const { return 1.0 / std::sqrt(static_cast<double>(D)); }
std::string Shape::str() const {
  std::ostringstream os;
  os << "B" << B << " Hq" << Hq << " Hkv" << Hkv << " Lq" << Lq << " Lkv" << Lkv << " D" << D
     << (causal ? " causal" : "");
  return os.str();
}

Inputs make_inputs(const Shape& s, Layout layout, sparge_dtype_t dtype, bool outliers, uint64_t seed) {
  Inputs in;
  in.s = s;
  in.seed = seed;
  in.q.init(s.B, s.Hq, s.Lq, s.D, layout, dtype);
  in.k.init(s.B, s.Hkv, s.Lkv, s.D, layout, dtype);
  in.v.init(s.B, s.Hkv, s.Lkv, s.D, layout, dtype);
  in.q.set_values(random_values(s.B, s.Hq, s.Lq, s.D, mix64(seed ^ 0x51), outliers, 0.5f));
  in.k.set_values(random_values(s.B, s.Hkv, s.Lkv, s.D, mix64(seed ^ 0x4b), outliers, 2.0f));
  in.v.set_values(random_values(s.B, s.Hkv, s.Lkv, s.D, mix64(seed ^ 0x56), outliers, 0.5f));
  return in;
}

int64_t visible_blocks(const Shape& s, int64_t qb) {
  if (!s.causal) return s.nKB();
  const int64_t last_row = std::min(qb * 128 + 127, s.Lq - 1);
  int64_t last_key = last_row + (s.Lkv - s.Lq);
  if (last_key < 0) return 0;
  last_key = std::min(last_key, s.Lkv - 1);
  return last_key / 64 + 1;
}

std::vector<uint8_t> random_mask(const Shape& s, double density, uint64_t seed) {
  const size_t n = static_cast<size_t>(s.B * s.Hq * s.nQB() * s.nKB());
  std::vector<uint8_t> m(n, 0);
  if (density >= 1.0) {
    std::fill(m.begin(), m.end(), 1);
  } else if (density > 0.0) {
    for (size_t i = 0; i < n; ++i) m[i] = unit(mix64(seed ^ mix64(i))) < density ? 1 : 0;
  }
  return m;
}

// ------------------------------------------------------------------ references
std::vector<RowId> all_rows(const Shape& s) {
  std::vector<RowId> r;
  r.reserve(static_cast<size_t>(s.B * s.Hq * s.Lq));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i = 0; i < s.Lq; ++i) r.push_back({b, h, i});
  return r;
}

std::vector<RowId> sample_rows(const Shape& s, int64_t n, uint64_t seed) {
  std::set<std::tuple<int64_t, int64_t, int64_t>> pick;
  pick.insert({0, 0, 0});
  pick.insert({0, 0, s.Lq - 1});
  pick.insert({s.B - 1, s.Hq - 1, s.Lq - 1});
  pick.insert({s.B - 1, s.Hq - 1, std::min<int64_t>(127, s.Lq - 1)});
  const int64_t total = s.B * s.Hq * s.Lq;
  uint64_t x = seed;
  while (static_cast<int64_t>(pick.size()) < std::min(n, total)) {
    x = mix64(x);
    const int64_t r = static_cast<int64_t>(x % static_cast<uint64_t>(total));
    pick.insert({r / (s.Hq * s.Lq), (r / s.Lq) % s.Hq, r % s.Lq});
  }
  std::vector<RowId> out;
  for (auto& t : pick) out.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t)});
  return out;
}

RefRows ref_attention(const Inputs& in, const uint8_t* mask, const std::vector<RowId>& rows) {
  const Shape& s = in.s;
  RefRows R;
  R.rows = rows;
  R.out.assign(rows.size() * static_cast<size_t>(s.D), 0.0);
  R.lse.assign(rows.size(), -std::numeric_limits<double>::infinity());
  R.mag.assign(rows.size(), 0.0);
  const double scale = s.scale();
  const int64_t g = s.group(), nQB = s.nQB(), nKB = s.nKB(), D = s.D;
  parallel_for(static_cast<int64_t>(rows.size()), [&](int64_t r) {
    const RowId id = rows[static_cast<size_t>(r)];
    const int64_t hk = id.h / g;
    int64_t last = s.causal ? id.i + (s.Lkv - s.Lq) : s.Lkv - 1;
    last = std::min(last, s.Lkv - 1);
    const float* q = &in.q.val[in.q.lidx(id.b, id.h, id.i, 0)];
    const uint8_t* mrow = mask ? mask + ((id.b * s.Hq + id.h) * nQB + id.i / 128) * nKB : nullptr;
    std::vector<double> sc(static_cast<size_t>(std::max<int64_t>(last + 1, 0)));
    double m = -std::numeric_limits<double>::infinity(), mag = 0;
    for (int64_t j = 0; j <= last; ++j) {
      if (mrow && !mrow[j / 64]) {
        sc[static_cast<size_t>(j)] = -std::numeric_limits<double>::infinity();
        continue;
      }
      const float* k = &in.k.val[in.k.lidx(id.b, hk, j, 0)];
      double dot = 0, a = 0;
      for (int64_t c = 0; c < D; ++c) {
        dot += static_cast<double>(q[c]) * k[c];
        a += std::fabs(static_cast<double>(q[c]) * k[c]);
      }
      sc[static_cast<size_t>(j)] = dot * scale;
      m = std::max(m, dot * scale);
      mag = std::max(mag, a * scale);
    }
    R.mag[static_cast<size_t>(r)] = mag;
    if (m == -std::numeric_limits<double>::infinity()) return;  // zeros, -inf
    double l = 0;
    double* o = &R.out[static_cast<size_t>(r * D)];
    for (int64_t j = 0; j <= last; ++j) {
      const double x = sc[static_cast<size_t>(j)];
      if (x == -std::numeric_limits<double>::infinity()) continue;
      const double p = std::exp(x - m);
      l += p;
      const float* v = &in.v.val[in.v.lidx(id.b, hk, j, 0)];
      for (int64_t c = 0; c < D; ++c) o[c] += p * v[c];
    }
    for (int64_t c = 0; c < D; ++c) o[c] /= l;
    R.lse[static_cast<size_t>(r)] = m + std::log(l);
  });
  return R;
}

// Pooled mean and self-similarity of rows [r0, r1) of a logical [.., L, D] slice.
static void pool_block(const float* base, int64_t r0, int64_t r1, int64_t D, const double* shift, double* pooled,
                       double* sim) {
  std::vector<double> sum_hat(static_cast<size_t>(D), 0.0);
  for (int64_t c = 0; c < D; ++c) pooled[c] = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = base + r * D;
    double nrm = 0;
    for (int64_t c = 0; c < D; ++c) {
      const double y = x[c] - (shift ? shift[c] : 0.0);
      pooled[c] += y;
      nrm += y * y;
    }
    nrm = std::sqrt(nrm);
    if (nrm > 0)
      for (int64_t c = 0; c < D; ++c) sum_hat[static_cast<size_t>(c)] += (x[c] - (shift ? shift[c] : 0.0)) / nrm;
  }
  const double n = static_cast<double>(r1 - r0);
  double s2 = 0;
  for (int64_t c = 0; c < D; ++c) {
    pooled[c] /= n;
    s2 += sum_hat[static_cast<size_t>(c)] * sum_hat[static_cast<size_t>(c)];
  }
  *sim = s2 / (n * n);
}

PredictRef ref_predict(const Inputs& in, bool smooth_k) {
  const Shape& s = in.s;
  const int64_t D = s.D, nQB = s.nQB(), nKB = s.nKB(), g = s.group();
  PredictRef P;
  P.logits.assign(static_cast<size_t>(s.B * s.Hq * nQB * nKB), std::numeric_limits<double>::quiet_NaN());
  P.sim_q.assign(static_cast<size_t>(s.B * s.Hq * nQB), 0.0);
  P.sim_k.assign(static_cast<size_t>(s.B * s.Hkv * nKB), 0.0);
  P.mag.assign(static_cast<size_t>(s.B * s.Hq * nQB), 0.0);
  std::vector<double> pk(static_cast<size_t>(s.B * s.Hkv * nKB * D));
  parallel_for(s.B * s.Hkv, [&](int64_t bh) {
    const int64_t b = bh / s.Hkv, h = bh % s.Hkv;
    const float* base = &in.k.val[in.k.lidx(b, h, 0, 0)];
    std::vector<double> mu(static_cast<size_t>(D), 0.0);
    if (smooth_k) {
      for (int64_t j = 0; j < s.Lkv; ++j)
        for (int64_t c = 0; c < D; ++c) mu[static_cast<size_t>(c)] += base[j * D + c];
      for (auto& x : mu) x /= static_cast<double>(s.Lkv);
    }
    for (int64_t kb = 0; kb < nKB; ++kb)
      pool_block(base, kb * 64, std::min((kb + 1) * 64, s.Lkv), D, mu.data(), &pk[static_cast<size_t>((bh * nKB + kb) * D)],
                 &P.sim_k[static_cast<size_t>(bh * nKB + kb)]);
  });
  const double scale = s.scale();
  parallel_for(s.B * s.Hq, [&](int64_t bh) {
    const int64_t b = bh / s.Hq, h = bh % s.Hq, hk = h / g;
    const float* base = &in.q.val[in.q.lidx(b, h, 0, 0)];
    std::vector<double> pq(static_cast<size_t>(D));
    for (int64_t qb = 0; qb < nQB; ++qb) {
      pool_block(base, qb * 128, std::min((qb + 1) * 128, s.Lq), D, nullptr, pq.data(),
                 &P.sim_q[static_cast<size_t>(bh * nQB + qb)]);
      const int64_t vis = visible_blocks(s, qb);
      double mag = 0;
      for (int64_t kb = 0; kb < vis; ++kb) {
        const double* k = &pk[static_cast<size_t>(((b * s.Hkv + hk) * nKB + kb) * D)];
        double dot = 0, a = 0;
        for (int64_t c = 0; c < D; ++c) {
          dot += pq[static_cast<size_t>(c)] * k[c];
          a += std::fabs(pq[static_cast<size_t>(c)] * k[c]);
        }
        P.logits[static_cast<size_t>((bh * nQB + qb) * nKB + kb)] = dot * scale;
        mag = std::max(mag, a * scale);
      }
      P.mag[static_cast<size_t>(bh * nQB + qb)] = mag;
    }
  });
  return P;
}

// ------------------------------------------------------------------ API runners
namespace {
struct PlanHolder {
  sparge_plan_t p = nullptr;
  ~PlanHolder() { sparge_destroy_plan(p); }
};

constexpr size_t kGuard = 4096;

std::string api_error(const char* what, sparge_status_t st) {
  std::ostringstream os;
  os << what << " -> " << sparge_status_string(st) << ": " << sparge_last_error();
  return os.str();
}

// Creates the plan and queries its workspace size; on failure fills R.status / R.error.
template <class Result>
bool open_plan(const sparge_problem_t& pr, PlanHolder& plan, size_t* ws_bytes, Result& R) {
  sparge_status_t st = sparge_create_plan(&pr, &plan.p);
  const char* what = "sparge_create_plan";
  if (st == SPARGE_OK) {
    st = sparge_plan_workspace_size(plan.p, ws_bytes);
    what = "sparge_plan_workspace_size";
  }
  if (st == SPARGE_OK) return true;
  R.status = st;
  R.error = api_error(what, st);
  return false;
}

sparge_problem_t problem_of(const Shape& s, sparge_dtype_t dtype, sparge_device_type_t dev, sparge_precision_t prec) {
  sparge_problem_t p = SPARGE_PROBLEM_INIT;
  p.batch = s.B;
  p.heads_q = s.Hq;
  p.heads_kv = s.Hkv;
  p.len_q = s.Lq;
  p.len_kv = s.Lkv;
  p.head_dim = s.D;
  p.dtype = dtype;
  p.device_type = dev;
  p.device_id = 0;
  p.precision = prec;
  p.causal = s.causal ? 1 : 0;
  return p;
}

int64_t count_changed(const std::vector<unsigned char>& buf, size_t from, unsigned char pattern) {
  int64_t n = 0;
  for (size_t i = from; i < buf.size(); ++i) n += buf[i] != pattern;
  return n;
}
}  // namespace

DeviceInputs::DeviceInputs(const Inputs& in) {
  q.alloc(in.q.storage * 2);
  k.alloc(in.k.storage * 2);
  v.alloc(in.v.storage * 2);
  q.upload(in.q.bits.data(), in.q.storage * 2);
  k.upload(in.k.bits.data(), in.k.storage * 2);
  v.upload(in.v.bits.data(), in.v.storage * 2);
}

AttnResult gpu_attention(const Inputs& in, const DeviceInputs& din, sparge_precision_t prec,
                         const std::vector<uint8_t>* mask, const sparge_predict_params_t* params, bool want_lse,
                         cudaStream_t stream) {
  const Shape& s = in.s;
  AttnResult R;
  sparge_problem_t pr = problem_of(s, in.q.dtype, SPARGE_DEVICE_CUDA, prec);
  PlanHolder plan;
  size_t ws_bytes = 0;
  if (!open_plan(pr, plan, &ws_bytes, R)) return R;
  sparge_status_t st = SPARGE_OK;
  // Workspace content is garbage on entry (0xA5), with a guard after it.
  DeviceBuffer ws(ws_bytes + kGuard);
  ws.fill(0xA5);
  const size_t out_bytes = in.q.storage * 2;
  DeviceBuffer out(out_bytes + kGuard);
  out.fill(0xFF);  // NaN in fp16 and bf16
  const size_t lse_bytes = static_cast<size_t>(s.B * s.Hq * s.Lq) * 4;
  DeviceBuffer lse(lse_bytes + kGuard);
  lse.fill(0xFF);  // NaN
  DeviceBuffer dmask;
  if (mask) {
    dmask.alloc(mask->size());
    dmask.upload(mask->data(), mask->size());
  }
  const sparge_tensor_t qd = desc4(in.q, din.q.get(), SPARGE_DEVICE_CUDA);
  const sparge_tensor_t kd = desc4(in.k, din.k.get(), SPARGE_DEVICE_CUDA);
  const sparge_tensor_t vd = desc4(in.v, din.v.get(), SPARGE_DEVICE_CUDA);
  const sparge_tensor_t od = desc4(in.q, out.get(), SPARGE_DEVICE_CUDA);
  const int64_t mshape[4] = {s.B, s.Hq, s.nQB(), s.nKB()};
  const int64_t mstr[4] = {s.Hq * s.nQB() * s.nKB(), s.nQB() * s.nKB(), s.nKB(), 1};
  const sparge_tensor_t md = make_desc(dmask.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_UINT8, 4, mshape, mstr);
  const int64_t lshape[3] = {s.B, s.Hq, s.Lq};
  const int64_t lstr[3] = {s.Hq * s.Lq, s.Lq, 1};
  const sparge_tensor_t ld = make_desc(lse.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_FLOAT32, 3, lshape, lstr);
  st = sparge_attention_run(plan.p, &qd, &kd, &vd, mask ? &md : nullptr, params, &od, want_lse ? &ld : nullptr,
                            ws.get(), ws_bytes, stream);
  if (st != SPARGE_OK) {
    R.status = st;
    R.error = api_error("sparge_attention_run", st);
    SGT_CUDA(cudaStreamSynchronize(stream));
    return R;
  }
  SGT_CUDA(cudaStreamSynchronize(stream));
  SGT_CUDA(cudaGetLastError());

  // Output: every view element written, padding and guard untouched.
  std::vector<unsigned char> raw(out_bytes + kGuard);
  out.download(raw.data(), raw.size());
  R.clobbered += count_changed(raw, out_bytes, 0xFF);
  std::vector<uint16_t> ob(in.q.storage);
  std::memcpy(ob.data(), raw.data(), out_bytes);
  std::vector<char> touched(in.q.storage, 0);
  const size_t n = in.q.val.size();
  R.out.resize(n);
  R.bits.resize(n);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i = 0; i < s.Lq; ++i)
        for (int64_t c = 0; c < s.D; ++c) {
          const size_t so = static_cast<size_t>(in.q.off(b, h, i, c)), li = in.q.lidx(b, h, i, c);
          touched[so] = 1;
          R.bits[li] = ob[so];
          R.unwritten += ob[so] == 0xFFFF;
          R.out[li] = from16(ob[so], in.q.dtype);
        }
  for (size_t i = 0; i < ob.size(); ++i)
    if (!touched[i] && ob[i] != 0xFFFF) ++R.clobbered;

  std::vector<unsigned char> lraw(lse_bytes + kGuard);
  lse.download(lraw.data(), lraw.size());
  R.clobbered += count_changed(lraw, want_lse ? lse_bytes : 0, 0xFF);
  if (want_lse) {
    R.lse.resize(lse_bytes / 4);
    std::memcpy(R.lse.data(), lraw.data(), lse_bytes);
    for (size_t i = 0; i < R.lse.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &R.lse[i], 4);
      R.unwritten += u == 0xFFFFFFFFu;
    }
  }
  std::vector<unsigned char> wg(kGuard);
  SGT_CUDA(cudaMemcpy(wg.data(), ws.as<unsigned char>() + ws_bytes, kGuard, cudaMemcpyDeviceToHost));
  R.clobbered += count_changed(wg, 0, 0xA5);
  return R;
}

// Runs body(b, hk, plan, workspace, workspace_bytes, &what) for every (batch,
// kv head) of `s` on all hardware threads, each on a CPU plan of that slice
// alone (B = 1, Hq = group, Hkv = 1) with its own 256-byte aligned workspace.
// body returns a status and names the failing call in `what`; the first
// failure of any slice lands in status / error.
template <class Body>
void for_each_cpu_group(const Shape& s, sparge_dtype_t dtype, sparge_precision_t prec, sparge_status_t& status,
                        std::string& error, Body&& body) {
  std::mutex mu;
  parallel_for(s.B * s.Hkv, [&](int64_t bk) {
    const int64_t b = bk / s.Hkv, hk = bk % s.Hkv;
    Shape sub = s;
    sub.B = 1, sub.Hq = s.group(), sub.Hkv = 1;
    sparge_problem_t pr = problem_of(sub, dtype, SPARGE_DEVICE_CPU, prec);
    PlanHolder plan;
    auto failed = [&](const char* what, sparge_status_t st) {
      std::lock_guard<std::mutex> lk(mu);
      if (status == SPARGE_OK) status = st, error = api_error(what, st);
    };
    sparge_status_t st = sparge_create_plan(&pr, &plan.p);
    if (st != SPARGE_OK) return failed("sparge_create_plan(cpu)", st);
    size_t wsb = 0;
    st = sparge_plan_workspace_size(plan.p, &wsb);
    if (st != SPARGE_OK) return failed("sparge_plan_workspace_size(cpu)", st);
    std::vector<unsigned char> wsv(wsb + 256);
    void* wsp = wsv.data() + (256 - reinterpret_cast<uintptr_t>(wsv.data()) % 256) % 256;
    const char* what = "";
    st = body(b, hk, plan.p, wsp, wsb, &what);
    if (st != SPARGE_OK) failed(what, st);
  });
}

AttnResult cpu_attention(const Inputs& in, sparge_precision_t prec, const std::vector<uint8_t>* mask,
                         const sparge_predict_params_t* params, bool want_lse) {
  const Shape& s = in.s;
  const int64_t g = s.group(), nQB = s.nQB(), nKB = s.nKB(), D = s.D;
  const bool f32 = prec == SPARGE_PRECISION_EXACT;
  const sparge_dtype_t dt = f32 ? SPARGE_DTYPE_FLOAT32 : in.q.dtype;
  const size_t es = f32 ? 4 : 2;
  // Inputs: the stored 16-bit tensors as they are, or float32 HND copies of their values.
  const void* qb = in.q.bits.data();
  const void* kb = in.k.bits.data();
  const void* vb = in.v.bits.data();
  int64_t qs[4], ks[4], vs[4];
  std::copy(in.q.strides, in.q.strides + 4, qs);
  std::copy(in.k.strides, in.k.strides + 4, ks);
  std::copy(in.v.strides, in.v.strides + 4, vs);
  if (f32) {
    qb = in.q.val.data(), kb = in.k.val.data(), vb = in.v.val.data();
    const int64_t a[4] = {s.Hq * s.Lq * D, s.Lq * D, D, 1}, c[4] = {s.Hkv * s.Lkv * D, s.Lkv * D, D, 1};
    std::copy(a, a + 4, qs);
    std::copy(c, c + 4, ks);
    std::copy(c, c + 4, vs);
  }
  const int64_t os[4] = {s.Hq * s.Lq * D, s.Lq * D, D, 1};
  std::vector<unsigned char> out(static_cast<size_t>(s.B * s.Hq * s.Lq * D) * es, 0xFF);
  std::vector<float> lse(static_cast<size_t>(s.B * s.Hq * s.Lq), std::numeric_limits<float>::quiet_NaN());
  AttnResult R;
  for_each_cpu_group(s, dt, prec, R.status, R.error, [&](int64_t b, int64_t hk, sparge_plan_t plan, void* wsp,
                                                           size_t wsb, const char** what) {
    auto at = [&](const void* base, const int64_t* str, int64_t h) {
      return const_cast<unsigned char*>(static_cast<const unsigned char*>(base)) +
             static_cast<size_t>(b * str[0] + h * str[1]) * es;
    };
    const int64_t qsh[4] = {1, g, s.Lq, D}, ksh[4] = {1, 1, s.Lkv, D};
    const sparge_tensor_t qd = make_desc(at(qb, qs, hk * g), SPARGE_DEVICE_CPU, dt, 4, qsh, qs);
    const sparge_tensor_t kd = make_desc(at(kb, ks, hk), SPARGE_DEVICE_CPU, dt, 4, ksh, ks);
    const sparge_tensor_t vd = make_desc(at(vb, vs, hk), SPARGE_DEVICE_CPU, dt, 4, ksh, vs);
    const sparge_tensor_t od = make_desc(at(out.data(), os, hk * g), SPARGE_DEVICE_CPU, dt, 4, qsh, os);
    const int64_t msh[4] = {1, g, nQB, nKB}, mst[4] = {s.Hq * nQB * nKB, nQB * nKB, nKB, 1};
    sparge_tensor_t md{};
    if (mask)
      md = make_desc(const_cast<uint8_t*>(mask->data()) + (b * s.Hq + hk * g) * nQB * nKB, SPARGE_DEVICE_CPU,
                     SPARGE_DTYPE_UINT8, 4, msh, mst);
    const int64_t lsh[3] = {1, g, s.Lq}, lst[3] = {s.Hq * s.Lq, s.Lq, 1};
    const sparge_tensor_t ld =
        make_desc(lse.data() + (b * s.Hq + hk * g) * s.Lq, SPARGE_DEVICE_CPU, SPARGE_DTYPE_FLOAT32, 3, lsh, lst);
    *what = "sparge_attention_run(cpu)";
    return sparge_attention_run(plan, &qd, &kd, &vd, mask ? &md : nullptr, params, &od, want_lse ? &ld : nullptr, wsp,
                                wsb, nullptr);
  });
  if (R.status != SPARGE_OK) return R;
  const size_t n = out.size() / es;
  R.out.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (f32) {
      std::memcpy(&R.out[i], &out[i * 4], 4);
      uint32_t u;
      std::memcpy(&u, &out[i * 4], 4);
      R.unwritten += u == 0xFFFFFFFFu;
    } else {
      uint16_t h;
      std::memcpy(&h, &out[i * 2], 2);
      R.unwritten += h == 0xFFFF;
      R.out[i] = from16(h, dt);
    }
  }
  if (want_lse) {
    R.lse = lse;
    for (float x : lse) R.unwritten += std::isnan(x);
  }
  return R;
}

PredictResult gpu_predict(const Inputs& in, const DeviceInputs& din, sparge_precision_t prec,
                          const sparge_predict_params_t& params, const std::vector<float>* per_head_topk,
                          bool padded_mask, cudaStream_t stream) {
  const Shape& s = in.s;
  const int64_t nQB = s.nQB(), nKB = s.nKB();
  PredictResult R;
  sparge_problem_t pr = problem_of(s, in.q.dtype, SPARGE_DEVICE_CUDA, prec);
  PlanHolder plan;
  size_t ws_bytes = 0;
  if (!open_plan(pr, plan, &ws_bytes, R)) return R;
  sparge_status_t st = SPARGE_OK;
  DeviceBuffer ws(ws_bytes + kGuard);
  ws.fill(0xA5);
  const int64_t pitch = padded_mask ? nKB + 3 : nKB;
  const size_t mbytes = static_cast<size_t>(s.B * s.Hq * nQB * pitch);
  DeviceBuffer dmask(mbytes + kGuard);
  dmask.fill(0xCD);
  DeviceBuffer dkept(static_cast<size_t>(s.B * s.Hq) * 4 + kGuard);
  dkept.fill(0xFF);
  DeviceBuffer dtopk;
  sparge_predict_params_t prm = params;
  if (per_head_topk) {
    dtopk.alloc(per_head_topk->size() * 4);
    dtopk.upload(per_head_topk->data(), per_head_topk->size() * 4);
    prm.topk_per_head = dtopk.as<float>();
  }
  const sparge_tensor_t qd = desc4(in.q, din.q.get(), SPARGE_DEVICE_CUDA);
  const sparge_tensor_t kd = desc4(in.k, din.k.get(), SPARGE_DEVICE_CUDA);
  const int64_t msh[4] = {s.B, s.Hq, nQB, nKB}, mst[4] = {s.Hq * nQB * pitch, nQB * pitch, pitch, 1};
  const sparge_tensor_t md = make_desc(dmask.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_UINT8, 4, msh, mst);
  const int64_t ksh[2] = {s.B, s.Hq}, kst[2] = {s.Hq, 1};
  const sparge_tensor_t kpd = make_desc(dkept.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_INT32, 2, ksh, kst);
  st = sparge_predict_mask(plan.p, &qd, &kd, &prm, &md, &kpd, ws.get(), ws_bytes, stream);
  SGT_CUDA(cudaStreamSynchronize(stream));
  if (st != SPARGE_OK) {
    R.status = st;
    R.error = api_error("sparge_predict_mask", st);
    return R;
  }
  SGT_CUDA(cudaGetLastError());
  std::vector<unsigned char> raw(mbytes + kGuard);
  dmask.download(raw.data(), raw.size());
  R.clobbered += count_changed(raw, mbytes, 0xCD);
  R.mask.resize(static_cast<size_t>(s.B * s.Hq * nQB * nKB));
  for (int64_t r = 0; r < s.B * s.Hq * nQB; ++r)
    for (int64_t j = 0; j < pitch; ++j) {
      const unsigned char x = raw[static_cast<size_t>(r * pitch + j)];
      if (j < nKB)
        R.mask[static_cast<size_t>(r * nKB + j)] = x;
      else
        R.clobbered += x != 0xCD;
    }
  std::vector<unsigned char> kraw(static_cast<size_t>(s.B * s.Hq) * 4 + kGuard);
  dkept.download(kraw.data(), kraw.size());
  R.clobbered += count_changed(kraw, static_cast<size_t>(s.B * s.Hq) * 4, 0xFF);
  R.kept.resize(static_cast<size_t>(s.B * s.Hq));
  std::memcpy(R.kept.data(), kraw.data(), R.kept.size() * 4);
  std::vector<unsigned char> wg(kGuard);
  SGT_CUDA(cudaMemcpy(wg.data(), ws.as<unsigned char>() + ws_bytes, kGuard, cudaMemcpyDeviceToHost));
  R.clobbered += count_changed(wg, 0, 0xA5);
  return R;
}

PredictResult cpu_predict(const Inputs& in, sparge_precision_t prec, const sparge_predict_params_t& params,
                          const std::vector<float>* per_head_topk) {
  const Shape& s = in.s;
  const int64_t g = s.group(), nQB = s.nQB(), nKB = s.nKB(), D = s.D;
  PredictResult R;
  R.mask.assign(static_cast<size_t>(s.B * s.Hq * nQB * nKB), 0xCD);
  R.kept.assign(static_cast<size_t>(s.B * s.Hq), -1);
  for_each_cpu_group(s, in.q.dtype, prec, R.status, R.error, [&](int64_t b, int64_t hk, sparge_plan_t plan,
                                                                  void* wsp, size_t wsb, const char** what) {
    const int64_t qsh[4] = {1, g, s.Lq, D}, ksh[4] = {1, 1, s.Lkv, D};
    const sparge_tensor_t qd = make_desc(const_cast<uint16_t*>(in.q.bits.data()) + b * in.q.strides[0] +
                                             hk * g * in.q.strides[1],
                                         SPARGE_DEVICE_CPU, in.q.dtype, 4, qsh, in.q.strides);
    const sparge_tensor_t kd =
        make_desc(const_cast<uint16_t*>(in.k.bits.data()) + b * in.k.strides[0] + hk * in.k.strides[1],
                  SPARGE_DEVICE_CPU, in.k.dtype, 4, ksh, in.k.strides);
    const int64_t msh[4] = {1, g, nQB, nKB}, mst[4] = {s.Hq * nQB * nKB, nQB * nKB, nKB, 1};
    const sparge_tensor_t md = make_desc(R.mask.data() + (b * s.Hq + hk * g) * nQB * nKB, SPARGE_DEVICE_CPU,
                                         SPARGE_DTYPE_UINT8, 4, msh, mst);
    const int64_t kpsh[2] = {1, g}, kpst[2] = {s.Hq, 1};
    const sparge_tensor_t kpd =
        make_desc(R.kept.data() + b * s.Hq + hk * g, SPARGE_DEVICE_CPU, SPARGE_DTYPE_INT32, 2, kpsh, kpst);
    sparge_predict_params_t prm = params;
    if (per_head_topk) prm.topk_per_head = per_head_topk->data() + hk * g;
    *what = "sparge_predict_mask(cpu)";
    return sparge_predict_mask(plan, &qd, &kd, &prm, &md, &kpd, wsp, wsb, nullptr);
  });
  return R;
}

// ------------------------------------------------------------------ metrics
namespace {
struct Acc {
  double dot = 0, na = 0, nb = 0, l1d = 0, l1b = 0, maxd = 0, maxb = 0;
  int64_t nonfinite = 0, n = 0;
  void add(double x, double y) {
    ++n;
    if (!std::isfinite(x)) {
      ++nonfinite;
      return;
    }
    dot += x * y, na += x * x, nb += y * y;
    const double d = std::fabs(x - y);
    l1d += d, l1b += std::fabs(y);
    maxd = std::max(maxd, d), maxb = std::max(maxb, std::fabs(y));
  }
  ErrStats stats() const {
    ErrStats e;
    e.n = n, e.nonfinite = nonfinite;
    e.cosine = (na == 0 && nb == 0) ? 1.0 : (na == 0 || nb == 0) ? 0.0 : dot / std::sqrt(na * nb);
    e.rel_l1 = l1b > 0 ? l1d / l1b : (l1d > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    e.max_abs = maxd, e.ref_max = maxb;
    e.rel_max = maxb > 0 ? maxd / maxb : (maxd > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    if (nonfinite) e.cosine = 0, e.rel_l1 = e.rel_max = std::numeric_limits<double>::infinity();
    return e;
  }
};
}  // namespace

ErrStats compare_rows(const std::vector<float>& a, const Shape& s, const std::vector<RowId>& rows,
                      const std::vector<double>& ref) {
  Acc acc;
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowId id = rows[r];
    const size_t base = static_cast<size_t>(((id.b * s.Hq + id.h) * s.Lq + id.i) * s.D);
    for (int64_t c = 0; c < s.D; ++c) acc.add(a[base + static_cast<size_t>(c)], ref[r * static_cast<size_t>(s.D) + static_cast<size_t>(c)]);
  }
  return acc.stats();
}

ErrStats compare_full(const std::vector<float>& a, const std::vector<float>& b) {
  Acc acc;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) acc.add(a[i], b[i]);
  return acc.stats();
}

namespace {
// One LSE comparison: x (tested) against y (reference) with tolerance tol.
// A NaN or +inf x is non-finite; an infinite value on either side must match
// exactly; otherwise |x - y| - tol is the excess over the bar.
void add_lse(LseStats& L, double x, double y, double tol) {
  if (std::isnan(x) || x == std::numeric_limits<double>::infinity()) {
    ++L.nonfinite;
    return;
  }
  if (std::isinf(y) || std::isinf(x)) {
    L.inf_mismatch += (x != y);
    return;
  }
  const double d = std::fabs(x - y);
  L.max_abs = std::max(L.max_abs, d);
  L.max_excess = std::max(L.max_excess, d - tol);
}
}  // namespace

LseStats compare_lse_rows(const std::vector<float>& lse, const Shape& s, const RefRows& ref, double atol,
                          double mag_coef) {
  LseStats L;
  L.max_excess = -std::numeric_limits<double>::infinity();
  for (size_t r = 0; r < ref.rows.size(); ++r) {
    const RowId id = ref.rows[r];
    add_lse(L, lse[static_cast<size_t>((id.b * s.Hq + id.h) * s.Lq + id.i)], ref.lse[r], atol + mag_coef * ref.mag[r]);
  }
  return L;
}

LseStats compare_lse_full(const std::vector<float>& a, const std::vector<float>& b, double atol, double rtol) {
  LseStats L;
  L.max_excess = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) add_lse(L, a[i], b[i], atol + rtol * std::fabs(double(b[i])));
  return L;
}

// ------------------------------------------------------------------ records
static std::mutex g_rec_mu;
static std::vector<Record> g_records;

void record(const std::string& test, const std::string& label, const std::string& metric, double value, double bar,
            bool higher_is_better, bool hard) {
  const bool pass = higher_is_better ? value >= bar : value <= bar;
  std::lock_guard<std::mutex> lk(g_rec_mu);
  g_records.push_back({test, label, metric, value, bar, higher_is_better, pass, hard});
  std::printf("ACC %-10s %-34s %-22s %12.6g  (%s %-8.3g) %s\n", test.c_str(), label.c_str(), metric.c_str(), value,
              higher_is_better ? ">=" : "<=", bar, pass ? "ok" : (hard ? "FAIL" : "miss"));
  std::fflush(stdout);
}

void print_records() {
  std::lock_guard<std::mutex> lk(g_rec_mu);
  if (g_records.empty()) return;
  std::printf("\n## Measured accuracy (%zu values, base seed 0x%016llx)\n\n", g_records.size(),
              static_cast<unsigned long long>(base_seed()));
  std::printf("| test | case | metric | value | bar | ok |\n|---|---|---|---:|---:|---|\n");
  int fails = 0, misses = 0;
  for (const Record& r : g_records) {
    std::printf("| %s | %s | %s | %.6g | %s %.3g | %s |\n", r.test.c_str(), r.label.c_str(), r.metric.c_str(), r.value,
                r.higher_is_better ? ">=" : "<=", r.bar, r.pass ? "ok" : (r.hard ? "**FAIL**" : "miss (target)"));
    fails += !r.pass && r.hard;
    misses += !r.pass && !r.hard;
  }
  std::printf("\n%d of %zu measured values outside their test bars; %d design-target values missed (not failures)\n",
              fails, g_records.size(), misses);
  if (const char* csv = std::getenv("SPARGE_GPU_TEST_CSV")) {
    if (FILE* f = std::fopen(csv, "w")) {
      std::fprintf(f, "test,case,metric,value,bar,higher_is_better,hard,pass\n");
      for (const Record& r : g_records)
        std::fprintf(f, "%s,\"%s\",%s,%.9g,%.9g,%d,%d,%d\n", r.test.c_str(), r.label.c_str(), r.metric.c_str(), r.value,
                     r.bar, r.higher_is_better ? 1 : 0, r.hard ? 1 : 0, r.pass ? 1 : 0);
      std::fclose(f);
    }
  }
  std::fflush(stdout);
}

bool names_word(const std::string& msg, const std::string& name) {
  auto ident = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t pos = msg.find(name); pos != std::string::npos; pos = msg.find(name, pos + 1)) {
    const bool left = pos == 0 || !ident(msg[pos - 1]);
    const bool right = pos + name.size() >= msg.size() || !ident(msg[pos + name.size()]);
    if (left && right) return true;
  }
  return false;
}

bool fp16_plans_portable() {
  static const bool portable = [] {
    sparge_problem_t pr = SPARGE_PROBLEM_INIT;
    pr.len_q = pr.len_kv = 256;
    pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = SPARGE_PRECISION_FP16;
    sparge_plan_t plan = nullptr;
    if (sparge_create_plan(&pr, &plan) != SPARGE_OK) return false;
    sparge_kernel_info_t ki;
    std::memset(&ki, 0, sizeof ki);
    ki.struct_size = sizeof ki;
    const bool ok = sparge_plan_kernel_info(plan, &ki) == SPARGE_OK && std::strcmp(ki.family, "portable") == 0;
    sparge_destroy_plan(plan);
    return ok;
  }();
  return portable;
}

}  // namespace sgt
