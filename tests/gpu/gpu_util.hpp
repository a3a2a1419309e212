// Helpers for the GPU test suite: checked CUDA calls, device buffers, 16-bit
// float conversion, strided host tensors with their exact float values, random
// inputs, a float64 reference for attention and for mask prediction, runners
// for the CPU and CUDA backends through the public C API, and error metrics.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "sparge/sparge.h"

namespace sgt {

// ------------------------------------------------------------------ CUDA checks
[[noreturn]] void cuda_fail(cudaError_t e, const char* what, const char* file, int line);
inline void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) cuda_fail(e, what, file, line);
}
#define SGT_CUDA(call) ::sgt::cuda_check((call), #call, __FILE__, __LINE__)

// Owns a cudaMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { alloc(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) { release(); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  void alloc(size_t bytes);
  void release();
  void* get() const { return p_; }
  size_t bytes() const { return n_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  void upload(const void* src, size_t bytes);
  void download(void* dst, size_t bytes) const;
  void fill(int byte);

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Owns a non-blocking stream.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  void sync() const;

 private:
  cudaStream_t s_ = nullptr;
};

// ------------------------------------------------------------------ 16-bit floats
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
inline uint16_t to16(float f, sparge_dtype_t t) { return t == SPARGE_DTYPE_FLOAT16 ? f32_to_f16(f) : f32_to_bf16(f); }
inline float from16(uint16_t h, sparge_dtype_t t) { return t == SPARGE_DTYPE_FLOAT16 ? f16_to_f32(h) : bf16_to_f32(h); }
inline bool is_nan16(uint16_t h, sparge_dtype_t t) {
  return t == SPARGE_DTYPE_FLOAT16 ? (h & 0x7fff) > 0x7c00 : (h & 0x7fff) > 0x7f80;
}
const char* dtype_name(sparge_dtype_t t);
const char* precision_name(sparge_precision_t p);

// ------------------------------------------------------------------ seeds, threads
// The run's base seed: SPARGE_TEST_SEED if set, else fresh from std::random_device.
uint64_t base_seed();
// A per-case seed derived from the base seed and a label.
uint64_t case_seed(const std::string& label);
uint64_t mix64(uint64_t x);
// Runs fn(i) for i in [0, n) on all hardware threads.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

// ------------------------------------------------------------------ host tensors
enum class Layout { HND, NHD, HND_PAD };  // HND_PAD: HND with a row pitch of D + 8 elements
const char* layout_name(Layout l);

// A 4-D attention tensor [B, H, L, D]: storage bits in its layout, and the exact
// stored values in logical order (for references).
struct HostTensor {
  int64_t B = 0, H = 0, L = 0, D = 0;
  Layout layout = Layout::HND;
  sparge_dtype_t dtype = SPARGE_DTYPE_BFLOAT16;
  int64_t strides[4] = {0, 0, 0, 1};
  size_t storage = 0;              // elements of storage (including padding)
  std::vector<uint16_t> bits;      // storage, 16-bit
  std::vector<float> val;          // logical [B, H, L, D]

  void init(int64_t B_, int64_t H_, int64_t L_, int64_t D_, Layout l, sparge_dtype_t t);
  int64_t off(int64_t b, int64_t h, int64_t i, int64_t c) const {
    return b * strides[0] + h * strides[1] + i * strides[2] + c;
  }
  size_t lidx(int64_t b, int64_t h, int64_t i, int64_t c) const {
    return static_cast<size_t>(((b * H + h) * L + i) * D + c);
  }
  // Sets val from a generator of logical values, rounding to dtype; fills bits.
  void set_values(const std::vector<float>& logical);
};

sparge_tensor_t make_desc(void* data, sparge_device_type_t dev, sparge_dtype_t t, int ndim,
                          const int64_t* shape, const int64_t* strides);
sparge_tensor_t desc4(const HostTensor& t, void* data, sparge_device_type_t dev);

// Random logical values [B, H, L, D]: normal(0, 1); with `outliers`, a smooth
// per-channel offset and three channels (the same in every head) scaled by 20.
std::vector<float> random_values(int64_t B, int64_t H, int64_t L, int64_t D, uint64_t seed, bool outliers,
                                 float offset_scale);

// ------------------------------------------------------------------ problems
struct Shape {
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lkv = 1, D = 64;
  bool causal = false;
  int64_t nQB() const { return (Lq + 127) / 128; }
  int64_t nKB() const { return (Lkv + 63) / 64; }
  int64_t group() const { return Hq / Hkv; }
  double scale() const;
  std::string str() const;
};

struct Inputs {
  Shape s;
  HostTensor q, k, v;
  uint64_t seed = 0;
};
Inputs make_inputs(const Shape& s, Layout layout, sparge_dtype_t dtype, bool outliers, uint64_t seed);

// Causally visible key blocks of query block qb (docs/SEMANTICS.md).
int64_t visible_blocks(const Shape& s, int64_t qb);
// uint8 [B, Hq, nQB, nKB] contiguous; each entry 1 with probability `density`
// (1 and 0 give all-ones and all-zeros masks).
std::vector<uint8_t> random_mask(const Shape& s, double density, uint64_t seed);

// ------------------------------------------------------------------ references
struct RowId {
  int64_t b, h, i;
};
std::vector<RowId> all_rows(const Shape& s);
// `n` distinct rows spread over (b, h, i), always including the first and last query of some heads.
std::vector<RowId> sample_rows(const Shape& s, int64_t n, uint64_t seed);

// float64 masked attention on the given rows. out: rows.size() * D; lse: rows.size()
// (-inf where no key is used); mag: scale * max_j sum_c |q_c k_jc| per row (error scale).
struct RefRows {
  std::vector<RowId> rows;
  std::vector<double> out, lse, mag;
};
RefRows ref_attention(const Inputs& in, const uint8_t* mask /* nullable: all ones */, const std::vector<RowId>& rows);

// float64 mask prediction diagnostics for one (b, h, qb) row: the selection and
// the values that decide it (logits sorted, probabilities, similarities).
struct PredictRef {
  // [B, Hq, nQB, nKB] logits (scale * pooled_q . pooled_k'), NaN where invisible
  std::vector<double> logits;
  std::vector<double> sim_q;  // [B, Hq, nQB]
  std::vector<double> sim_k;  // [B, Hkv, nKB]
  std::vector<double> mag;    // [B, Hq, nQB] scale * max_kb sum_c |pq_c pk_c|
};
PredictRef ref_predict(const Inputs& in, bool smooth_k);

// ------------------------------------------------------------------ API runners
struct AttnResult {
  sparge_status_t status = SPARGE_OK;
  std::string error;
  std::vector<float> out;        // logical [B, Hq, Lq, D]
  std::vector<uint16_t> bits;    // logical order, raw 16-bit (GPU) for bitwise comparisons
  std::vector<float> lse;        // [B, Hq, Lq] (empty when not requested)
  int64_t unwritten = 0;         // output elements still NaN-poisoned
  int64_t clobbered = 0;         // bytes outside the output/LSE views or past the workspace that changed
};

// Device copies of a case's inputs (uploaded once).
struct DeviceInputs {
  DeviceBuffer q, k, v;
  explicit DeviceInputs(const Inputs& in);
};

// Runs sparge_attention_run on a CUDA plan. mask: host uint8 [B,Hq,nQB,nKB] contiguous,
// or nullptr to predict inside with `params`. The output (q's layout), LSE and the
// workspace are poisoned first; every element is checked for having been written.
AttnResult gpu_attention(const Inputs& in, const DeviceInputs& din, sparge_precision_t prec,
                         const std::vector<uint8_t>* mask, const sparge_predict_params_t* params, bool want_lse,
                         cudaStream_t stream);

// Runs the CPU backend (through the public API), split into independent
// (batch, kv-head) slices on all hardware threads. prec EXACT runs a float32
// plan on the exact stored values (float64 arithmetic).
AttnResult cpu_attention(const Inputs& in, sparge_precision_t prec, const std::vector<uint8_t>* mask,
                         const sparge_predict_params_t* params, bool want_lse);

struct PredictResult {
  sparge_status_t status = SPARGE_OK;
  std::string error;
  std::vector<uint8_t> mask;   // [B, Hq, nQB, nKB] contiguous
  std::vector<int32_t> kept;   // [B, Hq]
  int64_t clobbered = 0;       // mask padding bytes that changed (GPU, padded mask)
};
// per_head_topk: optional host array of length Hq (copied to the device for CUDA plans).
PredictResult gpu_predict(const Inputs& in, const DeviceInputs& din, sparge_precision_t prec,
                          const sparge_predict_params_t& params, const std::vector<float>* per_head_topk,
                          bool padded_mask, cudaStream_t stream);
PredictResult cpu_predict(const Inputs& in, sparge_precision_t prec, const sparge_predict_params_t& params,
                          const std::vector<float>* per_head_topk);

// ------------------------------------------------------------------ metrics
struct ErrStats {
  double cosine = 1, rel_l1 = 0, max_abs = 0, ref_max = 0, rel_max = 0;
  int64_t nonfinite = 0, n = 0;
};
// a: result (logical, full array) read at `rows`; b: reference values per row (rows.size()*D).
ErrStats compare_rows(const std::vector<float>& a, const Shape& s, const std::vector<RowId>& rows,
                      const std::vector<double>& ref);
ErrStats compare_full(const std::vector<float>& a, const std::vector<float>& b);

struct LseStats {
  double max_abs = 0;      // over rows finite in both
  double max_excess = 0;   // max(|d| - tol) over rows (<= 0: all within tolerance)
  int64_t inf_mismatch = 0;
  int64_t nonfinite = 0;   // NaN, or +inf
};
// tol(row) = atol + mag_coef * mag[row]
LseStats compare_lse_rows(const std::vector<float>& lse, const Shape& s, const RefRows& ref, double atol,
                          double mag_coef);
// tol = atol + rtol * |b|
LseStats compare_lse_full(const std::vector<float>& a, const std::vector<float>& b, double atol, double rtol);

// ------------------------------------------------------------------ measured values
// Every accuracy figure is recorded and printed as a table at the end of the run.
struct Record {
  std::string test, label, metric;
  double value, bar;
  bool higher_is_better;
  bool pass;
  bool hard;  // false: a design target reported for information, not a test failure
};
void record(const std::string& test, const std::string& label, const std::string& metric, double value, double bar,
            bool higher_is_better, bool hard = true);
void print_records();

// True when `msg` contains `name` as a whole word (not inside a longer identifier).
bool names_word(const std::string& msg, const std::string& name);

// Whether FP16-mode plans of this build run the portable family on device 0
// (SPARGE_KERNEL_FAMILY / SPARGE_FP16_KERNEL=portable, or a build without the
// sm90 family): its FP16 kernel has head dims 64, 96 and 128 only.
bool fp16_plans_portable();

}  // namespace sgt
