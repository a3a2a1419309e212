// Bad-input harness for the C API (CPU plans).
//
// Each iteration builds a random problem (sizes including 0, negative and
// huge values; unknown enum values; NaN/inf/out-of-range scale and block
// sizes), predicts the status of sparge_create_plan from the bad-input
// catalogue of docs/API.md, then calls the plan queries, sparge_predict_mask
// and sparge_attention_run with random tensor descriptors, parameters and
// workspaces, most of them with one deliberate defect per argument.
//
// Checked on every call:
//  - the status is the one the catalogue predicts for the first defective
//    argument (OK when there is none);
//  - a failure leaves a message that starts with the argument's name;
//  - a failure writes nothing (outputs and workspace keep their poison bytes);
//  - a success writes only addressed elements, no NaN in out/LSE, a 0/1 mask
//    with zero invisible blocks and kept counts that match it.
// Buffers are allocated with their exact extent (so AddressSanitizer sees any
// access past them), and never for a request above a few MB: such problems
// are called only with a defect the library must reject by shape, with a
// small placeholder buffer behind every pointer.
//
// Build modes: the default is a deterministic randomized driver
// (SPARGE_FUZZ_ITERS, SPARGE_FUZZ_SEED); with SPARGE_FUZZ_LIBFUZZER defined it
// is a libFuzzer target whose input bytes drive the same choices.
#include <sparge/sparge.h>

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int INV = SPARGE_ERR_INVALID_ARGUMENT;
constexpr int UNS = SPARGE_ERR_UNSUPPORTED;
constexpr int WTS = SPARGE_ERR_WORKSPACE_TOO_SMALL;
constexpr int NODEV = SPARGE_ERR_NO_DEVICE;
constexpr int64_t I64MAX = std::numeric_limits<int64_t>::max();
constexpr int64_t I64MIN = std::numeric_limits<int64_t>::min();
constexpr uint8_t kPoison = 0xA5;
constexpr size_t kMaxTensorBytes = size_t(2) << 20;     // larger requests are never allocated
constexpr size_t kMaxWorkspaceBytes = size_t(8) << 20;
constexpr double kMaxFlops = 3e5;                       // larger problems only get defective calls

// ---------------------------------------------------------------- choices
struct Source {
  const uint8_t* bytes = nullptr;  // libFuzzer input, or NULL for the generator
  size_t size = 0, pos = 0;
  uint64_t state = 0;
  uint64_t next() {
    // libFuzzer input while it lasts; then the generator (a constant stream
    // would never leave the harness's "pick another value" loops).
    if (bytes && pos < size) {
      uint64_t v = 0;
      for (int i = 0; i < 4; ++i) v = (v << 8) | (pos < size ? bytes[pos++] : 0);
      return v * 0x9E3779B97F4A7C15ull ^ (v >> 7);
    }
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  int64_t range(int64_t lo, int64_t hi) { return lo + int64_t(below(uint64_t(hi - lo) + 1)); }
  bool chance(int percent) { return int(below(100)) < percent; }
  float uniform(float lo, float hi) { return lo + (hi - lo) * float(double(next() >> 11) * 0x1.0p-53); }
  template <class T, size_t N>
  T pick(const T (&a)[N]) { return a[below(N)]; }
};

// ---------------------------------------------------------------- failures
int g_failures = 0;
long g_counts[3][9];  // [create_plan, predict_mask, attention_run][status]
std::string g_context;

void failure(const char* fmt, ...) {
  ++g_failures;
  if (g_failures <= 25) {
    std::fprintf(stderr, "FAIL [%s]: ", g_context.c_str());
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "\n");
  }
#if defined(SPARGE_FUZZ_LIBFUZZER)
  std::abort();
#endif
}

// An enum field may hold any int: store one without an out-of-range enum value in C++.
template <class E>
void set_enum(E& e, int32_t v) {
  static_assert(sizeof(E) == sizeof(int32_t), "32-bit enums");
  std::memcpy(&e, &v, sizeof(v));
}
template <class E>
int32_t get_enum(const E& e) {
  int32_t v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

// What a call must return: any status of `allowed`, and on failure a message
// starting with `name` (empty name: only non-empty is required).
struct Expect {
  std::vector<int> allowed;
  std::string name;
  bool ok() const { return allowed.size() == 1 && allowed[0] == SPARGE_OK; }
};
Expect expect_ok() { return Expect{{SPARGE_OK}, ""}; }
Expect expect_fail(int st, const std::string& name) { return Expect{{st}, name}; }

bool check_status(const char* call, int st, const Expect& e) {
  bool allowed = false;
  for (int a : e.allowed) allowed = allowed || a == st;
  const std::string msg = sparge_last_error();
  if (!allowed) {
    std::string want;
    for (int a : e.allowed) want += std::string(sparge_status_string(sparge_status_t(a))) + " ";
    failure("%s returned %s, expected %s(argument '%s'); message: \"%s\"", call,
            sparge_status_string(sparge_status_t(st)), want.c_str(), e.name.c_str(), msg.c_str());
    return false;
  }
  if (st == SPARGE_OK) {
    if (!msg.empty()) failure("%s returned OK but sparge_last_error() is \"%s\"", call, msg.c_str());
    return true;
  }
  if (msg.empty()) {
    failure("%s returned %s with an empty message", call, sparge_status_string(sparge_status_t(st)));
    return false;
  }
  if (!e.name.empty()) {
    // The name must be followed by something that cannot continue it ("q->..", "q is NULL", "q:").
    const auto ident = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
    const bool named = msg.compare(0, e.name.size(), e.name) == 0 &&
                       (msg.size() == e.name.size() || !ident(e.name.back()) || !ident(msg[e.name.size()]));
    if (!named)
      failure("%s: message \"%s\" does not start with the argument name '%s'", call, msg.c_str(), e.name.c_str());
  }
  return true;
}

// ---------------------------------------------------------------- problem oracle
using i128 = __int128;
constexpr i128 kCap = i128(1) << 100;
i128 mul_sat(std::initializer_list<i128> f) {
  i128 r = 1;
  for (i128 x : f) {
    if (x <= 0) return 0;
    if (r > kCap / x) return kCap;
    r *= x;
  }
  return r;
}
int64_t cdiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

struct Resolved {
  int64_t B, Hq, Hkv, Lq, Lkv, D, nQB, nKB;
  int BQ, BK, es;
  bool causal;
  bool exact = false;  // SPARGE_PRECISION_EXACT (no PV skip)
  bool gpu = false;    // a CUDA plan (no PV skip in this release)
};

// Exact CPU workspace bytes of a resolved problem (the regions of core/workspace.cpp,
// each 256-aligned) computed without wrap-around; `raw` is the sum of region sizes.
i128 cpu_workspace(const Resolved& r, i128* raw) {
  const i128 B = r.B, Hq = r.Hq, Hkv = r.Hkv, D = r.D, nQB = r.nQB, nKB = r.nKB;
  const i128 regions[] = {1,
                          mul_sat({B, Hkv, D, 4}),
                          mul_sat({B, Hq, nQB, D, 4}),
                          mul_sat({B, Hq, nQB, 4}),
                          mul_sat({B, Hkv, nKB, D, 4}),
                          mul_sat({B, Hkv, nKB, 4}),
                          mul_sat({B, Hq, nQB, nKB, 4}),
                          mul_sat({B, Hq, nQB, nKB}),
                          mul_sat({B, Hq, 4})};
  i128 top = 0, sum = 0;
  for (i128 b : regions) {
    top = (top + 255) / 256 * 256 + b;
    sum += b;
  }
  *raw = sum;
  return (top + 255) / 256 * 256;
}

Expect expect_plan(const sparge_problem_t& p, Resolved* res) {
  auto F = [](int st, const char* field) { return expect_fail(st, std::string("problem->") + field); };
  if (p.struct_size < sizeof(sparge_problem_t)) return F(INV, "struct_size");
  const struct {
    const char* n;
    int64_t v;
  } sizes[] = {{"batch", p.batch},   {"heads_q", p.heads_q}, {"heads_kv", p.heads_kv},
               {"len_q", p.len_q},   {"len_kv", p.len_kv},   {"head_dim", p.head_dim}};
  for (const auto& s : sizes)
    if (s.v < 1) return F(INV, s.n);
  if (p.heads_q % p.heads_kv != 0) return F(INV, "heads_q");
  const int32_t dev = get_enum(p.device_type), dt = get_enum(p.dtype), prec = get_enum(p.precision);
  if (dev != 0 && dev != 1) return F(INV, "device_type");
  const bool gpu = dev == 1;
  if (p.device_id < 0) return F(INV, "device_id");
  if (!gpu && p.device_id != 0) return F(INV, "device_id");
  if (dt < 0 || dt > 2) return F(INV, "dtype");
  if (gpu && dt == SPARGE_DTYPE_FLOAT32) return F(UNS, "dtype");
  if (prec < 0 || prec > 5) return F(INV, "precision");
  if (gpu && prec == SPARGE_PRECISION_EXACT) return F(UNS, "precision");
  const bool gpu_dim = p.head_dim == 64 || p.head_dim == 96 || p.head_dim == 128 || p.head_dim == 256;
  if (gpu ? !gpu_dim : p.head_dim > 256) return F(UNS, "head_dim");
  if (!std::isfinite(p.scale) || p.scale < 0) return F(INV, "scale");
  if (p.block_q < 0) return F(INV, "block_q");
  if (p.block_k < 0) return F(INV, "block_k");
  const int BQ = p.block_q ? p.block_q : 128, BK = p.block_k ? p.block_k : 64;
  if (gpu ? BQ != 128 : BQ > 1024) return F(UNS, "block_q");
  if (gpu ? BK != 64 : BK > 1024) return F(UNS, "block_k");
  Resolved r{p.batch, p.heads_q, p.heads_kv, p.len_q, p.len_kv, p.head_dim, cdiv(p.len_q, BQ), cdiv(p.len_kv, BK),
             BQ, BK, dt == SPARGE_DTYPE_FLOAT32 ? 4 : 2, p.causal != 0, prec == SPARGE_PRECISION_EXACT, gpu};
  const i128 lim = I64MAX;
  i128 raw = 0;
  const bool overflow = mul_sat({r.B, r.Hq, r.Lq, r.D, r.es}) > lim || mul_sat({r.B, r.Hkv, r.Lkv, r.D, r.es}) > lim ||
                        mul_sat({r.B, r.Hq, r.nQB, r.nKB}) > lim || mul_sat({r.B, r.Hq, r.Lq, 4}) > lim ||
                        mul_sat({r.nQB, r.BQ}) > lim || mul_sat({r.nKB, r.BK}) > lim ||
                        cpu_workspace(r, &raw) + 9 * 256 > lim;
  *res = r;
  if (gpu) {
    // The CUDA workspace has more regions: a problem without CPU overflow may
    // still overflow there; in a build with CUDA the device decides the rest.
    if (overflow) return Expect{{INV}, "problem"};
    if (!sparge_has_cuda()) return Expect{{INV, NODEV}, "problem"};
    return Expect{{INV, NODEV, UNS, SPARGE_OK}, "problem"};
  }
  if (overflow) return Expect{{INV}, "problem sizes overflow"};
  return expect_ok();
}

// sparge_status_string called with a plain int, as a C caller may (through a
// pointer of the C-compatible type; clang's -fsanitize=function check of the
// call's C++ type is what this deliberately steps around).
#if defined(__clang__)
__attribute__((no_sanitize("function")))
#endif
const char* status_string_of_int(int32_t v) {
  const auto fn = reinterpret_cast<const char* (*)(int32_t)>(&sparge_status_string);
  return fn(v);
}

// ---------------------------------------------------------------- problem generator
sparge_problem_t gen_problem(Source& s) {
  sparge_problem_t p = SPARGE_PROBLEM_INIT;
  const bool bigger = s.chance(10);
  p.batch = s.range(1, 2);
  p.heads_kv = s.range(1, 2);
  p.heads_q = p.heads_kv * s.range(1, 3);
  p.len_q = s.range(1, bigger ? 150 : 40);
  p.len_kv = s.range(1, bigger ? 200 : 40);
  p.head_dim = s.chance(70) ? s.range(1, 12) : s.pick({16, 32, 64, 96, 128, 256});
  set_enum(p.dtype, int32_t(s.below(3)));
  set_enum(p.precision, int32_t(s.below(6)));
  p.causal = s.chance(50) ? int32_t(s.range(1, 3)) : 0;
  p.scale = s.chance(60) ? 0.0f : s.pick({-0.0f, 1e-30f, 0.05f, 0.5f, 1.0f, 3.0f});
  p.block_q = s.chance(40) ? 0 : int32_t(s.pick({1, 2, 3, 7, 16, 33, 64, 128, 1024}));
  p.block_k = s.chance(40) ? 0 : int32_t(s.pick({1, 2, 5, 16, 31, 64, 100, 1024}));

  // Defects and extreme-but-valid values.
  const int n = s.chance(55) ? int(s.range(1, 2)) : 0;
  for (int i = 0; i < n; ++i) {
    switch (s.below(13)) {
      case 0: p.struct_size = s.pick({size_t(0), sizeof(sparge_problem_t) - 1, sizeof(sparge_problem_t) - 8}); break;
      case 1: {
        int64_t* f[] = {&p.batch, &p.heads_q, &p.heads_kv, &p.len_q, &p.len_kv, &p.head_dim};
        *f[s.below(6)] = s.pick({int64_t(0), int64_t(-1), int64_t(-4096), I64MIN});
        break;
      }
      case 2: p.heads_kv = p.heads_q > I64MAX - 3 ? p.heads_q - 1 : p.heads_q + s.range(1, 3); break;
      case 3: set_enum(p.device_type, s.pick({1, 2, 77, -1})); break;
      case 4: p.device_id = s.pick({-1, -100, 1, 7}); break;  // a CPU plan refuses any id but 0
      case 5: set_enum(p.dtype, s.pick({3, 4, 5, 77, -1})); break;
      case 6: set_enum(p.precision, s.pick({6, -1, 99})); break;
      case 7: p.head_dim = s.pick({int64_t(257), int64_t(1) << 20, I64MAX}); break;
      case 8:
        p.scale = s.pick({std::nanf(""), INFINITY, -INFINITY, -1.0f, -1e-30f, 3.0e38f, 1e20f});
        break;
      case 9:
        (s.chance(50) ? p.block_q : p.block_k) = s.pick({-1, -64, std::numeric_limits<int32_t>::min()});
        break;
      case 10:
        (s.chance(50) ? p.block_q : p.block_k) = s.pick({1025, 4096, std::numeric_limits<int32_t>::max()});
        break;
      default: {  // huge sizes: overflow, or a valid plan far too large to allocate
        const int64_t big[] = {int64_t(1) << 31, int64_t(1) << 40, int64_t(3037000500), I64MAX / 2, I64MAX,
                               int64_t(1) << 20, int64_t(1) << 62};
        switch (s.below(5)) {
          case 0: p.batch = s.pick(big); break;
          case 1: p.heads_q = s.pick(big); p.heads_kv = s.chance(50) ? 1 : p.heads_q; break;
          case 2: p.len_q = s.pick(big); break;
          case 3: p.len_kv = s.pick(big); break;
          default: p.len_q = s.pick(big); p.len_kv = s.pick(big); break;
        }
        if (s.chance(30)) p.head_dim = 1;
        if (s.chance(30)) p.block_q = 1;
        if (s.chance(30)) p.block_k = 1;
        break;
      }
    }
  }
  return p;
}

// ---------------------------------------------------------------- buffers
// A heap buffer of exactly `bytes` bytes (ASan-visible bounds), poisoned.
struct Buffer {
  std::vector<uint8_t> mem;
  explicit Buffer(size_t bytes = 0) : mem(bytes, kPoison) {}
  void* data() { return mem.empty() ? nullptr : mem.data(); }
};

alignas(256) uint8_t g_placeholder[4096];  // behind every pointer of a call that must fail

struct Arg {
  std::string name;
  int ndim = 4;
  sparge_dtype_t dtype = SPARGE_DTYPE_FLOAT32;
  int64_t shape[4] = {1, 1, 1, 1};
  bool unit_last = false;
  bool output = false;
  bool optional = false;
  bool present = true;       // optional arguments may be passed as NULL
  sparge_tensor_t t{};
  int64_t st[4] = {0, 0, 0, 0};  // the valid strides the buffer was laid out with
  Buffer buf;
  bool real = false;         // buf backs t.data
  std::vector<uint8_t> before;
  Expect defect = expect_ok();
  size_t es() const { return dtype == SPARGE_DTYPE_FLOAT16 || dtype == SPARGE_DTYPE_BFLOAT16 ? 2 : dtype == SPARGE_DTYPE_UINT8 ? 1 : 4; }
  int64_t offset(const int64_t* idx) const {
    int64_t o = 0;
    for (int d = 0; d < ndim; ++d) o += idx[d] * st[d];
    return o;
  }
};

int64_t elements(const Arg& a) {
  int64_t n = 1;
  for (int d = 0; d < a.ndim; ++d) n *= a.shape[d];
  return n;
}

// Valid strides: dims in a random order (the unit dim innermost), random
// padding; `dense` gives plain row-major. Returns the extent in elements, or -1
// when it would exceed `limit`.
int64_t layout(Source& s, Arg& a, bool dense, int64_t limit) {
  int order[4] = {0, 1, 2, 3};
  const int nd = a.ndim;
  if (!dense) {
    const int nperm = a.unit_last ? nd - 1 : nd;
    for (int i = nperm - 1; i > 0; --i) {
      const int j = int(s.below(uint64_t(i) + 1));
      std::swap(order[i], order[j]);
    }
  }
  // order[nd-1] is innermost. A valid plan keeps dense extents within int64.
  i128 stride = 1, extent = 1;
  for (int i = nd - 1; i >= 0; --i) {
    const int d = order[i];
    if (!dense && !(a.unit_last && d == nd - 1) && s.chance(30)) stride += s.range(1, 5);
    if (stride > I64MAX) return -1;
    a.t.strides[d] = int64_t(stride);
    extent += (a.shape[d] - 1) * stride;
    stride *= a.shape[d];
  }
  // Extent-1 dims: any stride is valid (it never multiplies a nonzero index).
  for (int d = 0; d < nd; ++d)
    if (!dense && a.shape[d] == 1 && !(a.unit_last && d == nd - 1) && s.chance(20))
      a.t.strides[d] = s.pick({int64_t(0), int64_t(12345), I64MAX});
  // Entries past ndim are ignored.
  for (int d = nd; d < 4; ++d)
    if (s.chance(50)) {
      a.t.shape[d] = s.pick({int64_t(-7), int64_t(0), I64MAX});
      a.t.strides[d] = s.pick({int64_t(-7), int64_t(0), I64MAX});
    }
  return extent > limit ? -1 : int64_t(extent);
}

void init_desc(Arg& a, int32_t device_id) {
  a.t = sparge_tensor_t{};
  a.t.data = g_placeholder;
  set_enum(a.t.device_type, SPARGE_DEVICE_CPU);
  a.t.device_id = device_id;
  a.t.dtype = a.dtype;
  a.t.ndim = a.ndim;
  for (int d = 0; d < 4; ++d) a.t.shape[d] = d < a.ndim ? a.shape[d] : 0;
}

// One random defect (the library must reject it before touching memory).
// Returns false when the chosen defect does not apply to this argument.
bool apply_defect(Source& s, Arg& a) {
  const std::string& n = a.name;
  switch (s.below(10)) {
    case 0:
      if (a.optional) return false;
      a.present = false;
      a.defect = expect_fail(INV, n + " is NULL");
      return true;
    case 1: a.t.data = nullptr; a.defect = expect_fail(INV, n + "->data"); return true;
    case 2: set_enum(a.t.device_type, s.pick({1, 2, 77, -1})); a.defect = expect_fail(INV, n + "->device_type"); return true;
    case 3: a.t.device_id += s.pick({1, -1, 3}); a.defect = expect_fail(INV, n + "->device_id"); return true;
    case 4: {
      int32_t dt;
      do dt = s.pick({0, 1, 2, 3, 4, 5, 77, -1}); while (dt == int32_t(a.dtype));
      set_enum(a.t.dtype, dt);
      a.defect = expect_fail(INV, n + "->dtype");
      return true;
    }
    case 5: {
      int32_t nd;
      do nd = s.pick({0, 1, 2, 3, 4, 5, -1, 100}); while (nd == a.ndim);
      a.t.ndim = nd;
      a.defect = expect_fail(INV, n + "->ndim");
      return true;
    }
    case 6: {
      const int d = int(s.below(uint64_t(a.ndim)));
      int64_t v;
      const int64_t x = a.shape[d];
      do v = s.pick({x == I64MAX ? 1 : x + 1, x - 1, int64_t(0), int64_t(-5), I64MAX, I64MIN, x > I64MAX / 2 ? 3 : x * 2});
      while (v == a.shape[d]);
      a.t.shape[d] = v;
      a.defect = expect_fail(INV, n + "->shape[" + std::to_string(d) + "]");
      return true;
    }
    case 7: {
      const int d = int(s.below(uint64_t(a.ndim)));
      a.t.strides[d] = s.pick({int64_t(-1), int64_t(-1000), I64MIN});
      a.defect = expect_fail(INV, n + "->strides[" + std::to_string(d) + "]");
      return true;
    }
    case 8: {
      if (a.unit_last) {  // head dimension not contiguous
        a.t.strides[a.ndim - 1] = s.pick({int64_t(0), int64_t(2), a.shape[a.ndim - 1] + 1, I64MAX});
        a.defect = expect_fail(INV, n + "->strides[" + std::to_string(a.ndim - 1) + "]");
        return true;
      }
      for (int d = 0; d < a.ndim; ++d)
        if (a.shape[d] > 1) {
          a.t.strides[d] = 0;
          a.defect = expect_fail(INV, n + "->strides[" + std::to_string(d) + "]");
          return true;
        }
      return false;
    }
    default: {  // extent overflows 64 bits (element or byte count)
      const int nlast = a.unit_last ? a.ndim - 1 : a.ndim;
      for (int d = 0; d < nlast; ++d)
        if (a.shape[d] > 1) {
          a.t.strides[d] = s.chance(50) || a.shape[d] == 2 ? I64MAX : I64MAX / (a.shape[d] - 1) + 1;
          a.defect = expect_fail(INV, n + ":");
          return true;
        }
      return false;
    }
  }
}

// ---------------------------------------------------------------- values
uint16_t to_half(float f) {
  // Inputs are small normal numbers: truncation is fine here.
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax < 0x38800000u) return uint16_t(sign);
  return uint16_t(sign | (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu));
}
float from_half(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t x;
  if (e == 0) return (h & 0x8000u) ? -std::ldexp(float(m), -24) : std::ldexp(float(m), -24);
  if (e == 31) x = sign | 0x7f800000u | (m << 13);
  else x = sign | ((e + 112u) << 23) | (m << 13);
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
float load(const Arg& a, int64_t off) {
  const uint8_t* p = a.buf.mem.data() + size_t(off) * a.es();
  if (a.dtype == SPARGE_DTYPE_FLOAT16) { uint16_t h; std::memcpy(&h, p, 2); return from_half(h); }
  if (a.dtype == SPARGE_DTYPE_BFLOAT16) { uint16_t h; std::memcpy(&h, p, 2); uint32_t x = uint32_t(h) << 16; float f; std::memcpy(&f, &x, 4); return f; }
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
void store(Arg& a, int64_t off, float v) {
  uint8_t* p = a.buf.mem.data() + size_t(off) * a.es();
  if (a.dtype == SPARGE_DTYPE_FLOAT16) { const uint16_t h = to_half(v); std::memcpy(p, &h, 2); return; }
  if (a.dtype == SPARGE_DTYPE_BFLOAT16) { uint32_t x; std::memcpy(&x, &v, 4); const uint16_t h = uint16_t(x >> 16); std::memcpy(p, &h, 2); return; }
  std::memcpy(p, &v, 4);
}

template <class F>
void for_each_index(const Arg& a, F&& f) {
  int64_t idx[4] = {0, 0, 0, 0};
  const int64_t n = elements(a);
  for (int64_t e = 0; e < n; ++e) {
    int64_t r = e;
    for (int d = a.ndim - 1; d >= 0; --d) {
      idx[d] = r % a.shape[d];
      r /= a.shape[d];
    }
    f(idx);
  }
}

// ---------------------------------------------------------------- one iteration
struct Ctx {
  Source& s;
  sparge_plan_t plan;
  Resolved r;
  size_t ws_need;
  bool small;  // real buffers can back every argument
};

int64_t visible_blocks_brute(const Resolved& r, int64_t qb) {
  if (!r.causal) return r.nKB;
  int64_t last_row = std::min(qb * r.BQ + r.BQ - 1, r.Lq - 1);
  int64_t last_key = last_row + (r.Lkv - r.Lq);
  if (last_key < 0) return 0;
  last_key = std::min(last_key, r.Lkv - 1);
  return last_key / r.BK + 1;
}

// Random parameters: valid or with one defect. `holder` keeps per-head arrays alive.
struct Params {
  sparge_predict_params_t p = SPARGE_PREDICT_PARAMS_INIT;
  bool null = false;
  std::vector<float> topk_h, cdf_h, sim_h;
  Expect defect = expect_ok();
};

void gen_params(Source& s, int64_t Hq, bool allow_arrays, Params& pr) {
  if (s.chance(20)) {
    pr.null = true;
    return;
  }
  sparge_predict_params_t& p = pr.p;
  set_enum(p.mode, int32_t(s.below(2)));
  p.topk = s.pick({0.5f, 1.0f, 1e-30f, 0.25f, 0.7f, 0.999f});
  p.cdf_threshold = s.pick({0.9f, 1.0f, 1e-30f, 0.5f});
  p.sim_threshold = s.pick({-0.1f, 0.0f, 0.5f, 0.9f, 1.5f, INFINITY, -INFINITY});
  p.smooth_k = s.chance(70) ? 1 : 0;
  p.attention_sink = s.chance(30) ? int32_t(s.range(1, 5)) : (s.chance(50) ? -1 : 0);
  p.local_window = s.chance(30) ? int32_t(s.range(1, 4)) : (s.chance(50) ? -1 : 0);
  if (s.chance(10)) p.struct_size = offsetof(sparge_predict_params_t, local_window);  // a 0.1 caller
  p.pv_threshold = s.chance(80) ? 0.0f : s.pick({-0.0f, 0.5f, 1e-30f, 20.0f});
  const bool topk_mode = get_enum(p.mode) == SPARGE_SELECT_TOPK;
  // A value the mode does not use is ignored, whatever it is.
  if (s.chance(20)) (topk_mode ? p.cdf_threshold : p.topk) = s.pick({std::nanf(""), -1.0f, 7.0f, 0.0f});
  if (allow_arrays && Hq <= 64) {
    if (s.chance(20)) {
      pr.topk_h.resize(size_t(Hq));
      for (auto& x : pr.topk_h) x = s.pick({0.1f, 0.5f, 1.0f});
      p.topk_per_head = pr.topk_h.data();
    }
    if (s.chance(20)) {
      pr.cdf_h.resize(size_t(Hq));
      for (auto& x : pr.cdf_h) x = s.pick({0.3f, 0.9f, 1.0f});
      p.cdf_threshold_per_head = pr.cdf_h.data();
    }
    if (s.chance(20)) {
      pr.sim_h.resize(size_t(Hq));
      for (auto& x : pr.sim_h) x = s.pick({-0.1f, 0.5f, 2.0f, -INFINITY});
      p.sim_threshold_per_head = pr.sim_h.data();
    }
  }
}

bool params_defect(Source& s, Params& pr) {
  if (pr.null) return false;
  sparge_predict_params_t& p = pr.p;
  const bool topk_mode = get_enum(p.mode) == SPARGE_SELECT_TOPK;
  const float bad_unit[] = {std::nanf(""), 0.0f, -0.5f, 1.0001f, INFINITY, -INFINITY, 2.0f};
  const size_t v1 = offsetof(sparge_predict_params_t, local_window);
  switch (s.below(9)) {
    case 0:
      p.struct_size = s.pick({size_t(0), v1 - 4, v1 - 8});
      pr.defect = expect_fail(INV, "params->struct_size");
      return true;
    case 7:
      p.struct_size = sizeof(p);
      p.local_window = s.pick({-2, 1025, INT32_MIN, INT32_MAX});
      pr.defect = expect_fail(INV, "params->local_window");
      return true;
    case 8:
      p.struct_size = sizeof(p);
      set_enum(p.estimator, s.pick({1000, -1, 5, 77}));
      pr.defect = expect_fail(INV, "params->estimator");
      return true;
    case 1: set_enum(p.mode, s.pick({2, -1, 77})); pr.defect = expect_fail(INV, "params->mode"); return true;
    case 2:
      if (topk_mode) {
        p.topk = s.pick(bad_unit);
        pr.defect = expect_fail(INV, "params->topk");
      } else {
        p.cdf_threshold = s.pick(bad_unit);
        pr.defect = expect_fail(INV, "params->cdf_threshold");
      }
      return true;
    case 3: p.sim_threshold = std::nanf(""); pr.defect = expect_fail(INV, "params->sim_threshold"); return true;
    case 4:
      p.pv_threshold = s.pick({std::nanf(""), -1.0f, -INFINITY, -1e-30f, INFINITY});
      pr.defect = expect_fail(INV, "params->pv_threshold");
      return true;
    case 5: {
      std::vector<float>& arr = topk_mode ? pr.topk_h : pr.cdf_h;
      if (arr.empty()) return false;
      arr[s.below(arr.size())] = s.pick(bad_unit);
      pr.defect = expect_fail(INV, topk_mode ? "params->topk_per_head" : "params->cdf_threshold_per_head");
      return true;
    }
    default:
      if (pr.sim_h.empty()) return false;
      pr.sim_h[s.below(pr.sim_h.size())] = std::nanf("");
      pr.defect = expect_fail(INV, "params->sim_threshold_per_head");
      return true;
  }
}

struct Workspace {
  Buffer buf;
  void* ptr = nullptr;
  size_t bytes = 0;
  Expect defect = expect_ok();
};

void gen_workspace(Source& s, size_t need, bool real, Workspace& w) {
  if (real) {
    const size_t extra = s.chance(20) ? size_t(s.range(1, 300)) : 0;
    w.buf = Buffer(need + extra + 512);
    uintptr_t base = reinterpret_cast<uintptr_t>(w.buf.mem.data());
    // 16-byte aligned is enough for a CPU plan; sometimes exactly 16 mod 256.
    uintptr_t aligned = (base + 255) & ~uintptr_t(255);
    if (s.chance(30)) aligned += 16;
    w.ptr = reinterpret_cast<void*>(aligned);
    w.bytes = need + extra;
    if (aligned + w.bytes > base + w.buf.mem.size()) w.bytes = need;
  } else {
    w.ptr = g_placeholder;
    w.bytes = need;  // a lie: only ever passed with a defect that the library must catch first
  }
}

bool workspace_defect(Source& s, size_t need, Workspace& w) {
  switch (s.below(3)) {
    case 0:
      w.ptr = nullptr;
      w.bytes = s.chance(50) ? need : size_t(1);
      w.defect = expect_fail(INV, "workspace");
      return true;
    case 1:
      w.bytes = need ? size_t(s.below(need)) : 0;
      if (s.chance(20)) w.ptr = nullptr, w.bytes = 0;
      w.defect = expect_fail(WTS, "workspace_bytes");
      return true;
    default:
      w.ptr = static_cast<uint8_t*>(w.ptr) + s.range(1, 15);
      w.defect = expect_fail(INV, "workspace");
      return true;
  }
}

// Builds the arguments of one call. Returns false when no argument could be made
// defective for a plan that must not reach the backend.
struct Call {
  std::vector<Arg> args;  // in validation order, params and workspace handled apart
  Params params;
  Workspace ws;
  Expect expect = expect_ok();
};

Arg make_arg(const char* name, int ndim, sparge_dtype_t dt, std::initializer_list<int64_t> shape, bool unit_last,
             bool output, bool optional) {
  Arg a;
  a.name = name;
  a.ndim = ndim;
  a.dtype = dt;
  int d = 0;
  for (int64_t x : shape) a.shape[d++] = x;
  a.unit_last = unit_last;
  a.output = output;
  a.optional = optional;
  return a;
}

void snapshot(Arg& a) {
  if (a.real && a.output) a.before = a.buf.mem;
}

// Checks that every byte of `buf` outside the addressed elements still holds the poison.
void check_unaddressed(const Arg& a) {
  std::vector<uint8_t> addressed(a.buf.mem.size(), 0);
  for_each_index(a, [&](const int64_t* idx) {
    const int64_t o = a.offset(idx);
    for (size_t b = 0; b < a.es(); ++b) addressed[size_t(o) * a.es() + b] = 1;
  });
  for (size_t i = 0; i < addressed.size(); ++i)
    if (!addressed[i] && a.buf.mem[i] != kPoison) {
      failure("%s: byte %zu outside the addressed elements was written", a.name.c_str(), i);
      return;
    }
}

// The four entry points that take tensors.
enum class Fn { Predict, Attention };

void run_call(Ctx& c, Fn fn) {
  Source& s = c.s;
  const Resolved& r = c.r;
  sparge_problem_t rp = SPARGE_PROBLEM_INIT;
  if (sparge_plan_get_problem(c.plan, &rp) != SPARGE_OK) {
    failure("sparge_plan_get_problem failed on a valid plan: %s", sparge_last_error());
    return;
  }
  const sparge_dtype_t pdt = rp.dtype;
  Call call;
  std::vector<Arg>& A = call.args;
  const bool user_mask = fn == Fn::Attention && s.chance(50);
  A.push_back(make_arg("q", 4, pdt, {r.B, r.Hq, r.Lq, r.D}, true, false, false));
  A.push_back(make_arg("k", 4, pdt, {r.B, r.Hkv, r.Lkv, r.D}, true, false, false));
  if (fn == Fn::Attention) {
    A.push_back(make_arg("v", 4, pdt, {r.B, r.Hkv, r.Lkv, r.D}, true, false, false));
    A.push_back(make_arg("mask", 4, SPARGE_DTYPE_UINT8, {r.B, r.Hq, r.nQB, r.nKB}, false, false, true));
    A.back().present = user_mask;
  } else {
    A.push_back(make_arg("mask_out", 4, SPARGE_DTYPE_UINT8, {r.B, r.Hq, r.nQB, r.nKB}, false, true, false));
  }
  const size_t params_pos = A.size();  // params are validated here
  if (fn == Fn::Attention) {
    A.push_back(make_arg("out", 4, pdt, {r.B, r.Hq, r.Lq, r.D}, true, true, false));
    A.push_back(make_arg("lse", 3, SPARGE_DTYPE_FLOAT32, {r.B, r.Hq, r.Lq}, false, true, true));
    A.back().present = s.chance(60);
  } else {
    A.push_back(make_arg("kept_out", 2, SPARGE_DTYPE_INT32, {r.B, r.Hq}, false, true, true));
    A.back().present = s.chance(60);
  }

  // Layouts and buffers.
  bool real = c.small;
  for (Arg& a : A) {
    init_desc(a, rp.device_id);
    const int64_t limit = c.small ? int64_t(kMaxTensorBytes / a.es()) : I64MAX;
    const int64_t ext = layout(s, a, !c.small, limit);
    if (c.small && ext < 0) {
      // A random padding pushed it over the limit: dense it is.
      init_desc(a, rp.device_id);
      layout(s, a, true, limit);
    }
    std::memcpy(a.st, a.t.strides, sizeof(a.st));
    if (c.small) {
      int64_t e = 1;
      for (int d = 0; d < a.ndim; ++d) e += (a.shape[d] - 1) * a.t.strides[d];
      a.buf = Buffer(size_t(e) * a.es());
      a.t.data = a.buf.data();
      a.real = true;
    }
  }
  gen_params(s, r.Hq, true, call.params);
  // A valid PV skip that the plan's precision or device cannot do (read_params checks it last).
  if (!call.params.null && (r.exact || r.gpu) && call.params.p.pv_threshold > 0.0f)
    call.params.defect = expect_fail(UNS, "params->pv_threshold");
  gen_workspace(s, c.ws_need, real, call.ws);

  // Defects: every argument independently; a plan too large to run must get one.
  int defects = 0;
  const int rate = c.small ? (s.chance(35) ? 0 : 25) : 35;
  for (int attempt = 0; attempt < 4 && (defects == 0 || attempt == 0); ++attempt) {
    for (Arg& a : A)
      if (a.present && a.defect.ok() && s.chance(rate)) defects += apply_defect(s, a);
    if (call.params.defect.ok() && s.chance(rate)) defects += params_defect(s, call.params);
    if (call.ws.defect.ok() && s.chance(rate)) defects += workspace_defect(s, c.ws_need, call.ws);
    if (c.small) break;
  }
  if (!c.small && defects == 0) {
    // Guarantee one: a shape defect on q always applies.
    A[0].t.shape[2] = r.Lq == I64MAX ? 1 : r.Lq + 1;
    A[0].defect = expect_fail(INV, "q->shape[2]");
  }

  // Expected result: the first defective argument in validation order.
  Expect expect = expect_ok();
  for (size_t i = 0; i < A.size() && expect.ok(); ++i) {
    if (i == params_pos && !call.params.defect.ok()) expect = call.params.defect;
    if (expect.ok() && !A[i].defect.ok()) expect = A[i].defect;
  }
  if (expect.ok() && !call.params.defect.ok()) expect = call.params.defect;
  if (expect.ok() && !call.ws.defect.ok()) expect = call.ws.defect;
  if (!c.small && expect.ok()) {
    failure("internal: a large plan would run");
    return;
  }

  // Inputs: random values; outputs: poison.
  for (Arg& a : A) {
    if (!a.real || a.output) continue;
    if (a.dtype == SPARGE_DTYPE_UINT8) {
      for_each_index(a, [&](const int64_t* idx) { a.buf.mem[size_t(a.offset(idx))] = uint8_t(s.chance(60)); });
    } else {
      const float amp = s.pick({1.0f, 2.0f, 0.01f, 8.0f});
      const bool zero = s.chance(5);
      for_each_index(a, [&](const int64_t* idx) { store(a, a.offset(idx), zero ? 0.0f : s.uniform(-amp, amp)); });
    }
  }
  for (Arg& a : A) snapshot(a);
  const std::vector<uint8_t> ws_before = call.ws.buf.mem;

  auto desc = [&](const char* name) -> const sparge_tensor_t* {
    for (Arg& a : A)
      if (a.name == name) return a.present ? &a.t : nullptr;
    return nullptr;
  };
  const sparge_predict_params_t* pp = call.params.null ? nullptr : &call.params.p;
  sparge_status_t st;
  const char* fname;
  if (fn == Fn::Predict) {
    fname = "sparge_predict_mask";
    st = sparge_predict_mask(c.plan, desc("q"), desc("k"), pp, desc("mask_out"), desc("kept_out"), call.ws.ptr,
                             call.ws.bytes, nullptr);
  } else {
    fname = "sparge_attention_run";
    st = sparge_attention_run(c.plan, desc("q"), desc("k"), desc("v"), desc("mask"), pp, desc("out"), desc("lse"),
                              call.ws.ptr, call.ws.bytes, nullptr);
  }
  ++g_counts[fn == Fn::Predict ? 1 : 2][unsigned(st) < 9 ? unsigned(st) : 8];
  if (!check_status(fname, st, expect)) return;

  if (st != SPARGE_OK) {
    for (Arg& a : A)
      if (a.real && a.output && a.buf.mem != a.before)
        failure("%s failed (%s) but wrote to %s", fname, sparge_last_error(), a.name.c_str());
    if (call.ws.buf.mem != ws_before) failure("%s failed (%s) but wrote to the workspace", fname, sparge_last_error());
    return;
  }

  // Success: outputs are complete, finite where they must be, and nothing else was written.
  for (Arg& a : A)
    if (a.real && a.output && a.present) check_unaddressed(a);
  if (fn == Fn::Predict) {
    Arg& m = A[2];
    std::vector<int64_t> kept(size_t(r.B * r.Hq), 0);
    for_each_index(m, [&](const int64_t* idx) {
      const uint8_t v = m.buf.mem[size_t(m.offset(idx))];
      if (v > 1) failure("mask_out entry %u is not 0/1", unsigned(v));
      if (v && idx[3] >= visible_blocks_brute(r, idx[2])) failure("mask_out keeps an invisible block");
      kept[size_t(idx[0] * r.Hq + idx[1])] += v;
    });
    Arg& k = A[3];
    if (k.present)
      for_each_index(k, [&](const int64_t* idx) {
        int32_t v;
        std::memcpy(&v, k.buf.mem.data() + size_t(k.offset(idx)) * 4, 4);
        if (v != kept[size_t(idx[0] * r.Hq + idx[1])]) failure("kept_out %d differs from the mask's count", v);
      });
  } else {
    Arg& o = A[4];
    Arg& l = A[5];
    for_each_index(o, [&](const int64_t* idx) {
      const float v = load(o, o.offset(idx));
      if (std::isnan(v)) failure("out[%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 "] is NaN", idx[0], idx[1], idx[2], idx[3]);
    });
    // Inputs are within +-8: scores fit in float32 unless the scale is enormous. When
    // they overflow, the LSE of the int8 modes (max score + smoothing shift) can be inf - inf.
    const bool scores_fit = double(rp.scale) * 64.0 * double(r.D) * 2.0 < 3.0e38;
    if (l.present && scores_fit)
      for_each_index(l, [&](const int64_t* idx) {
        float v;
        std::memcpy(&v, l.buf.mem.data() + size_t(l.offset(idx)) * 4, 4);
        if (std::isnan(v)) failure("lse[%" PRId64 ",%" PRId64 ",%" PRId64 "] is %g", idx[0], idx[1], idx[2], double(v));
      });
  }
}

void iteration(Source& s) {
  // Plain NULL checks of the handle-level calls.
  if (s.chance(3)) {
    sparge_plan_t pl = reinterpret_cast<sparge_plan_t>(&g_placeholder);
    check_status("sparge_create_plan(NULL, &plan)", sparge_create_plan(nullptr, &pl), expect_fail(INV, "problem"));
    if (pl != nullptr) failure("sparge_create_plan(NULL, &plan) left *out non-NULL");
    sparge_problem_t p = SPARGE_PROBLEM_INIT;
    check_status("sparge_create_plan(&p, NULL)", sparge_create_plan(&p, nullptr), expect_fail(INV, "out"));
    size_t b;
    int64_t v;
    check_status("sparge_plan_workspace_size(NULL)", sparge_plan_workspace_size(nullptr, &b), expect_fail(INV, "plan"));
    check_status("sparge_plan_get_problem(NULL)", sparge_plan_get_problem(nullptr, &p), expect_fail(INV, "plan"));
    check_status("sparge_plan_visible_blocks(NULL)", sparge_plan_visible_blocks(nullptr, &v), expect_fail(INV, "plan"));
    check_status("sparge_predict_mask(NULL plan)",
                 sparge_predict_mask(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr),
                 expect_fail(INV, "plan"));
    check_status("sparge_attention_run(NULL plan)",
                 sparge_attention_run(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      0, nullptr),
                 expect_fail(INV, "plan"));
    const int32_t bogus = int32_t(s.pick({-1, 8, 77, 1 << 30}));
    // As a C caller passes it: an int that is no enumerator (an enum-typed value
    // outside the enumeration's range would be undefined in this C++ file).
    const char* name = status_string_of_int(bogus);
    if (!name || std::strstr(name, "UNKNOWN") == nullptr) failure("sparge_status_string(%d) is not UNKNOWN", bogus);
  }

  const sparge_problem_t prob = gen_problem(s);
  char ctx[512];
  std::snprintf(ctx, sizeof(ctx),
                "problem{size=%zu B=%" PRId64 " Hq=%" PRId64 " Hkv=%" PRId64 " Lq=%" PRId64 " Lkv=%" PRId64
                " D=%" PRId64 " dtype=%d dev=%d id=%d prec=%d causal=%d scale=%g bq=%d bk=%d}",
                prob.struct_size, prob.batch, prob.heads_q, prob.heads_kv, prob.len_q, prob.len_kv, prob.head_dim,
                get_enum(prob.dtype), get_enum(prob.device_type), prob.device_id, get_enum(prob.precision),
                prob.causal, double(prob.scale), prob.block_q, prob.block_k);
  g_context = ctx;
  Resolved r{};
  const Expect pe = expect_plan(prob, &r);
  sparge_plan_t plan = reinterpret_cast<sparge_plan_t>(&g_placeholder);
  const sparge_status_t st = sparge_create_plan(&prob, &plan);
  ++g_counts[0][unsigned(st) < 9 ? unsigned(st) : 8];
  if (!check_status("sparge_create_plan", st, pe)) {
    if (st == SPARGE_OK) sparge_destroy_plan(plan);
    return;
  }
  if (st != SPARGE_OK) {
    if (plan != nullptr) failure("sparge_create_plan failed but *out is not NULL");
    return;
  }
  if (get_enum(prob.device_type) != SPARGE_DEVICE_CPU) {  // a real GPU: not exercised here
    sparge_destroy_plan(plan);
    return;
  }

  // Plan queries.
  size_t ws = 0;
  check_status("sparge_plan_workspace_size", sparge_plan_workspace_size(plan, &ws), expect_ok());
  i128 raw = 0;
  const i128 exact = cpu_workspace(r, &raw);
  if (i128(ws) < raw || i128(ws) > exact + 9 * 256 || ws % 256 != 0)
    failure("workspace size %zu is not consistent with the regions (%.0f bytes in all)", ws, double(raw));
  check_status("sparge_plan_workspace_size(plan, NULL)", sparge_plan_workspace_size(plan, nullptr),
               expect_fail(INV, "bytes"));
  sparge_problem_t got = SPARGE_PROBLEM_INIT;
  if (s.chance(10)) {
    got.struct_size = sizeof(got) - 1;
    check_status("sparge_plan_get_problem(small)", sparge_plan_get_problem(plan, &got),
                 expect_fail(INV, "problem->struct_size"));
    got.struct_size = sizeof(got);
  }
  check_status("sparge_plan_get_problem", sparge_plan_get_problem(plan, &got), expect_ok());
  if (got.block_q != r.BQ || got.block_k != r.BK || !(got.scale > 0) || got.len_q != r.Lq)
    failure("sparge_plan_get_problem: resolved values differ");
  int64_t vis = -1;
  check_status("sparge_plan_visible_blocks", sparge_plan_visible_blocks(plan, &vis), expect_ok());
  if (r.nQB <= 200000) {
    int64_t want = 0;
    for (int64_t qb = 0; qb < r.nQB; ++qb) want += visible_blocks_brute(r, qb);
    if (vis != want) failure("sparge_plan_visible_blocks is %" PRId64 ", expected %" PRId64, vis, want);
  } else if (vis < 0 || i128(vis) > i128(r.nQB) * r.nKB) {
    failure("sparge_plan_visible_blocks is %" PRId64 ", outside [0, nQB*nKB]", vis);
  }

  // Calls with tensors.
  const double flops = double(r.B) * double(r.Hq) * double(r.Lq) * double(r.Lkv) * double(r.D);
  const i128 esz = r.es;
  const bool small = ws <= kMaxWorkspaceBytes && flops <= kMaxFlops &&
                     mul_sat({r.B, r.Hq, r.Lq, r.D, esz}) * 2 <= i128(kMaxTensorBytes) &&
                     mul_sat({r.B, r.Hkv, r.Lkv, r.D, esz}) * 2 <= i128(kMaxTensorBytes) &&
                     mul_sat({r.B, r.Hq, r.nQB, r.nKB}) * 2 <= i128(kMaxTensorBytes);
  Ctx c{s, plan, r, ws, small};
  const int calls = int(s.range(1, 3));
  for (int i = 0; i < calls; ++i) run_call(c, s.chance(50) ? Fn::Predict : Fn::Attention);
  sparge_destroy_plan(plan);
}

}  // namespace

#if defined(SPARGE_FUZZ_LIBFUZZER)
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Source s;
  s.bytes = data;
  s.state = uint64_t(size) * 0xD1B54A32D192ED03ull;  // after the input runs out
  s.size = size;
  iteration(s);
  return 0;
}
#else
int main(int argc, char** argv) {
  long iters = 20000;
  uint64_t seed = 0x5EED5EEDull;
  if (const char* e = std::getenv("SPARGE_FUZZ_ITERS")) iters = std::strtol(e, nullptr, 10);
  if (const char* e = std::getenv("SPARGE_FUZZ_SEED")) seed = std::strtoull(e, nullptr, 0);
  if (argc > 1) iters = std::strtol(argv[1], nullptr, 10);
  if (argc > 2) seed = std::strtoull(argv[2], nullptr, 0);
  long first = 0;  // to rerun one failing iteration: SPARGE_FUZZ_FIRST=<it> SPARGE_FUZZ_ITERS=1
  if (const char* e = std::getenv("SPARGE_FUZZ_FIRST")) first = std::strtol(e, nullptr, 10);
  std::printf("fuzz_api: %ld iterations, seed 0x%" PRIx64 "\n", iters, seed);
  for (long it = first; it < first + iters && g_failures < 25; ++it) {
    Source s;
    s.state = seed ^ (uint64_t(it) * 0xD1B54A32D192ED03ull);
    iteration(s);
    if (g_failures) {
      std::fprintf(stderr, "  (rerun: SPARGE_FUZZ_SEED=0x%" PRIx64 " SPARGE_FUZZ_FIRST=%ld SPARGE_FUZZ_ITERS=1)\n",
                   seed, it);
      break;
    }
  }
  if (g_failures) {
    std::fprintf(stderr, "fuzz_api: %d failure(s)\n", g_failures);
    return 1;
  }
  const char* fns[] = {"sparge_create_plan", "sparge_predict_mask", "sparge_attention_run"};
  for (int f = 0; f < 3; ++f) {
    std::printf("  %-21s", fns[f]);
    for (int st = 0; st < 8; ++st)
      if (g_counts[f][st]) std::printf(" %s=%ld", sparge_status_string(sparge_status_t(st)) + 7, g_counts[f][st]);
    std::printf("\n");
  }
  std::printf("fuzz_api: all checks passed\n");
  return 0;
}
#endif
