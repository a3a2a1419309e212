// Test helpers: random host tensors in fp16/bf16/fp32 with HND or NHD layout,
// 16-bit conversions (written independently of the library's), a float64
// dense attention reference with an explicit key mask and the causal rule,
// and comparison metrics.
#pragma once
#include <sparge/sparge.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace sparge_test {

// ---------------------------------------------------------------- seeds
// A fresh seed for every call; the base seed is random per run (or
// SPARGE_TEST_SEED) and printed once so that failures can be reproduced.
uint64_t fresh_seed();

// ---------------------------------------------------------------- 16-bit types
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t b);
size_t dtype_bytes(sparge_dtype_t dt);
float round_dtype(sparge_dtype_t dt, float f);

// ---------------------------------------------------------------- tensors
enum class Layout { HND, NHD };  // [B, H, L, D] or [B, L, H, D] in memory

// Owning host buffer with a sparge_tensor_t view. Memory is 256-byte aligned.
struct HostTensor {
  std::shared_ptr<unsigned char> mem;
  size_t bytes = 0;
  sparge_tensor_t t{};
  sparge_dtype_t dtype() const { return t.dtype; }
  int64_t offset(const int64_t* idx) const;
  float get(int64_t a, int64_t b = 0, int64_t c = 0, int64_t d = 0) const;
  void set(int64_t a, int64_t b, int64_t c, int64_t d, float v);  // rounds to dtype
  void fill_nan();      // poison (NaN for floats, 0xAB bytes for integer types)
  std::vector<unsigned char> snapshot() const;  // raw bytes
  const sparge_tensor_t* desc() const { return &t; }
};

// Allocates a tensor with the given logical shape (ndim = shape.size()) and
// explicit strides (elements); storage covers the largest offset.
HostTensor make_strided(sparge_dtype_t dt, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides);
// Dense row-major tensor.
HostTensor make_dense(sparge_dtype_t dt, const std::vector<int64_t>& shape);
// [B, H, L, D] attention tensor in the given memory layout.
HostTensor make_bhld(sparge_dtype_t dt, int64_t B, int64_t H, int64_t L, int64_t D, Layout layout);
// Fills with N(mean, std) values, rounded to the dtype.
void fill_random(HostTensor& t, std::mt19937_64& rng, float stddev = 1.0f, float mean = 0.0f);

// ---------------------------------------------------------------- reference
struct RefResult {
  std::vector<double> out;  // [B, Hq, Lq, D]
  std::vector<double> lse;  // [B, Hq, Lq]
};
// used(b, h, i, j) decides the keys (the causal rule is applied on top when causal).
using KeyMask = std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)>;
RefResult ref_attention(const HostTensor& q, const HostTensor& k, const HostTensor& v, double scale, bool causal,
                        const KeyMask& used);
// Key mask from a uint8 block mask tensor [B, Hq, nQB, nKB].
KeyMask block_key_mask(const HostTensor& mask, int64_t BQ, int64_t BK);

// ---------------------------------------------------------------- metrics
struct Compare {
  double cosine = 0, rel_l1 = 0, max_abs = 0;
  int64_t nonfinite = 0;
};
Compare compare(const HostTensor& out, const std::vector<double>& ref);
std::string describe(const Compare& c);

// ---------------------------------------------------------------- plans
struct Plan {
  sparge_plan_t p = nullptr;
  Plan() = default;
  explicit Plan(const sparge_problem_t& prob);  // REQUIREs success
  ~Plan() { sparge_destroy_plan(p); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  size_t workspace_size() const;
};
// 256-byte aligned workspace of `bytes` bytes (at least 1 allocated).
std::shared_ptr<unsigned char> alloc_workspace(size_t bytes);

sparge_problem_t cpu_problem(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, int64_t D,
                             sparge_dtype_t dt, sparge_precision_t prec, bool causal = false);

}  // namespace sparge_test

namespace sparge_test {
// Runs sparge_attention_run / sparge_predict_mask with a workspace of exactly
// the queried size (NULL tensors pass NULL).
sparge_status_t run_attention(const Plan& plan, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                              const HostTensor* mask, const sparge_predict_params_t* params, const HostTensor& out,
                              const HostTensor* lse);
sparge_status_t run_predict(const Plan& plan, const HostTensor& q, const HostTensor& k,
                            const sparge_predict_params_t* params, const HostTensor& mask, const HostTensor* kept);
// Block mask [B, Hq, nQB, nKB] with every entry 1.
HostTensor full_mask(int64_t B, int64_t Hq, int64_t nQB, int64_t nKB);
int64_t ceil_div(int64_t a, int64_t b);
// Byte-wise copy of `src`'s logical contents into `dst` (same shape/dtype, any strides).
void copy_logical(const HostTensor& src, HostTensor& dst);
// fp8 e4m3 (satfinite, RNE) written from the format's definition, for cross-checks.
float e4m3_reference(float x);
}  // namespace sparge_test
