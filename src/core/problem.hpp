// Backend-neutral description of one attention problem, its tensors after
// validation, the resolved prediction parameters, and the workspace layout.
// Kernels and the CPU reference see only these types, never the C API structs.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "sparge/sparge.h"

#if defined(__CUDACC__)
#define SPARGE_HD __host__ __device__ __forceinline__
#else
#define SPARGE_HD inline
#endif

namespace sparge {

// Block sizes the CUDA kernels are built for (mask granularity == kernel tiles).
constexpr int kGpuBlockQ = 128;
constexpr int kGpuBlockK = 64;
// fp8 e4m3 largest finite value; P is stored as p * kP8Scale, V per channel as v / (amax / kP8Scale).
constexpr float kFp8Max = 448.0f;
constexpr float kLog2e = 1.4426950408889634f;
// CUDA column statistics (K mean, V max|.|) are reduced in two levels: per-chunk
// partials of this many keys, then one finalize pass (deterministic order).
constexpr int kGpuColChunk = 512;

struct Problem {
  int64_t B = 0, Hq = 0, Hkv = 0, Lq = 0, Lkv = 0, D = 0;
  // Width of Q/K/V rows inside the backend: D on the CPU; on CUDA the
  // kernels' head dim (core/kernel_traits.hpp: D padded to a multiple of 64).
  int64_t Dk = 0;
  sparge_dtype_t dtype = SPARGE_DTYPE_BFLOAT16;
  sparge_device_type_t device = SPARGE_DEVICE_CPU;
  int device_id = 0;
  sparge_precision_t precision = SPARGE_PRECISION_INT8_FP8;
  // The caller asked for SPARGE_PRECISION_AUTO: `precision` holds the choice
  // of auto_precision (the device's family may still turn it to FP16).
  bool precision_is_auto = false;
  bool causal = false;
  float scale = 0.f;      // resolved (never 0)
  int BQ = 128, BK = 64;  // resolved mask block sizes
  int64_t nQB = 0, nKB = 0;
  int64_t group() const { return Hq / Hkv; }
  // INT8_FP8, INT8_FP8_SPLIT_V or INT8_FP16: int8 Q.K^T (Q and K quantized
  // in the preparation).
  SPARGE_HD bool quantized() const { return fp8_pv() || precision == SPARGE_PRECISION_INT8_FP16; }
  // INT8_FP8 or INT8_FP8_SPLIT_V: fp8 P.V (V quantized in the preparation).
  SPARGE_HD bool fp8_pv() const {
    return precision == SPARGE_PRECISION_INT8_FP8 || precision == SPARGE_PRECISION_INT8_FP8_SPLIT_V;
  }
  SPARGE_HD bool split_v() const { return precision == SPARGE_PRECISION_INT8_FP8_SPLIT_V; }
};

// SPARGE_PRECISION_AUTO (docs/SEMANTICS.md, "Precision AUTO"). The int8
// path pays preparation passes over Q (Lq rows) and over K and V (2 Lkv rows)
// against a faster main loop over Lq x Lkv: its gain grows with
// Lq Lkv / (Lq + 2 Lkv), which times 3 is N when Lq == Lkv == N. The
// threshold is the crossover measured on the H200 at D = 128
// (docs/BENCHMARKS.md): below it FP16 is faster, dense and predicted, and
// more accurate. At D <= 64 FP16 is as fast or faster at every length (the
// 8-bit main loop's exponentials outweigh its products there; dense calls run
// the three-consumer FP16 kernel): FP16 always.
// `int8_family`: the device runs the sm_90a int8 kernels (CPU plans: true).
constexpr double kAutoInt8Length = 16384;  // the effective length from which INT8_FP8 is chosen
inline sparge_precision_t auto_precision(int64_t Lq, int64_t Lkv, int64_t head_dim, bool int8_family) {
  if (!int8_family || head_dim > 128 || head_dim <= 64) return SPARGE_PRECISION_FP16;
  const double n_eff = 3.0 * double(Lq) * double(Lkv) / (double(Lq) + 2.0 * double(Lkv));
  return n_eff >= kAutoInt8Length ? SPARGE_PRECISION_INT8_FP8 : SPARGE_PRECISION_FP16;
}

// A validated 4-D view [B, H, L, D] (strides in elements, stride[3] == 1).
struct Tensor4 {
  void* data = nullptr;
  sparge_dtype_t dtype = SPARGE_DTYPE_BFLOAT16;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 1};
  SPARGE_HD int64_t offset(int64_t b, int64_t h, int64_t l, int64_t d) const {
    return b * stride[0] + h * stride[1] + l * stride[2] + d * stride[3];
  }
};

// uint8 block mask [B, Hq, nQB, nKB], any strides.
struct MaskView {
  uint8_t* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  SPARGE_HD int64_t offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * stride[0] + h * stride[1] + i * stride[2] + j * stride[3];
  }
};

// int32 [B, Hq] kept-block counts.
struct KeptView {
  int32_t* data = nullptr;
  int64_t stride[2] = {0, 0};
};

// float32 [B, Hq, Lq] log-sum-exp.
struct LseView {
  float* data = nullptr;
  int64_t stride[3] = {0, 0, 0};
};

// Prediction parameters after validation (pointers in the plan's memory space).
struct PredictConfig {
  sparge_select_mode_t mode = SPARGE_SELECT_TOPK;
  float topk = 0.5f;
  float cdf_threshold = 0.9f;
  float sim_threshold = -0.1f;
  bool smooth_k = true;
  bool attention_sink = false;  // resolved (the mode's default applied)
  int32_t local_window = 0;     // resolved, >= 0
  sparge_estimator_t estimator = SPARGE_ESTIMATOR_KEYS_LSE;  // resolved (never AUTO): 0..3
  const float* topk_per_head = nullptr;
  const float* cdf_per_head = nullptr;
  const float* sim_per_head = nullptr;
  float pv_threshold = 0.0f;  // PV skip (docs/SEMANTICS.md, "PV skip"): 0 off, else finite > 0 (natural log)
};

// The PV skip's threshold in the base-2 units of the online softmax: pv_threshold * float(log2 e),
// rounded to float32 (docs/SEMANTICS.md, "PV skip"); +inf when the skip is off, so that
// `m - tau2` is -inf and no step compares below it.
inline float pv_tau2(float pv_threshold) { return pv_threshold > 0.0f ? pv_threshold * kLog2e : INFINITY; }

// A prediction that keeps every visible block whatever the scores: TOPK with topk = 1 and no
// per-head values (the per-head array lies in device memory for CUDA plans). The attention of
// such a call is dense; the CUDA backend runs it without the prediction, the mask and the index
// lists (docs/API.md, sparge_attention_run, "Dense attention").
inline bool keeps_every_block(int32_t mode, float topk, const void* topk_per_head) {
  return mode == SPARGE_SELECT_TOPK && topk >= 1.0f && topk_per_head == nullptr;
}

// ---------------------------------------------------------------- semantics
// Causal rule (bottom-right aligned): query i sees key j iff j <= i + (Lkv - Lq).
// Last key index visible to query row i (may be < 0: the row sees nothing).
SPARGE_HD int64_t causal_last_key(int64_t i, int64_t Lq, int64_t Lkv) { return i + (Lkv - Lq); }

// Number of key blocks causally visible to query block qb (0 when the whole
// block sees nothing). Without causality every key block is visible.
SPARGE_HD int64_t visible_key_blocks(const Problem& p, int64_t qb) {
  if (!p.causal) return p.nKB;
  int64_t last_row = qb * p.BQ + p.BQ - 1;
  if (last_row > p.Lq - 1) last_row = p.Lq - 1;
  int64_t last_key = causal_last_key(last_row, p.Lq, p.Lkv);
  if (last_key < 0) return 0;
  if (last_key > p.Lkv - 1) last_key = p.Lkv - 1;
  return last_key / p.BK + 1;
}

// Dense work (docs/API.md, sparge_attention_run, "Dense attention"): the CUDA kernels of a dense call enumerate their
// rows and blocks themselves, with the GPU's 128 x 64 blocks. dense_row: the mask row
// ((b * Hq + h) * nQB + qb) of CTA i, in the order the work-order kernel gives rows of equal or
// causally growing counts: K/V group by group (b, kv head), within a group the query blocks from
// the most visible blocks down (causal: the last first), the group's query heads side by side (they
// read the same K/V blocks at the same time). i < B * Hq * nQB < 2^31.
SPARGE_HD int32_t dense_row(int32_t i, int32_t Hq, int32_t group, int32_t nQB, int causal) {
  const int32_t per_group = group * nQB;
  const int32_t g = i / per_group, j = i - g * per_group;
  const int32_t qr = j / group, hh = j - qr * group;
  const int32_t Hkv = Hq / group;
  const int32_t b = g / Hkv, hkv = g - b * Hkv;
  const int32_t qb = causal ? nQB - 1 - qr : qr;
  return (b * Hq + hkv * group + hh) * nQB + qb;
}
// The work units of a dense call on persistent CTAs (cuda/attention/common/work.cuh,
// persistent_row): its rows, or with causality pairs of one head's query blocks nQB-1-r and r.
SPARGE_HD int64_t persistent_units(int64_t rows, int64_t nQB, int causal) {
  return causal ? rows / nQB * ((nQB + 1) / 2) : rows;
}
// visible_key_blocks for 128-row query blocks and 64-key blocks, in 32-bit arithmetic
// (Lq, Lkv < 2^30).
SPARGE_HD int32_t dense_blocks(int32_t qb, int causal, int32_t Lq, int32_t Lkv, int32_t nKB, int32_t rows = 128) {
  if (!causal) return nKB;
  const int32_t row_end = qb * rows + rows - 1, last_row = row_end < Lq - 1 ? row_end : Lq - 1;
  const int32_t key = last_row + (Lkv - Lq), last_key = key < Lkv - 1 ? key : Lkv - 1;
  return last_key < 0 ? 0 : last_key / 64 + 1;
}

// Blocks kept before any ranking, counted in the row's budget (docs/SEMANTICS.md, "Mask
// prediction", step 4): the attention sink (key block 0), the local window around the diagonal
// and, with causality, the first diagonal block, which every row of the query block that sees any
// key also sees (so no such row is left without a kept key).
// The defaults of attention_sink / local_window = -1, per mode (chosen on captured activations:
// docs/ACCURACY.md, "Predicted masks").
inline bool default_sink(bool /*causal*/) { return true; }
inline int32_t default_local_window(bool causal) { return causal ? 2 : 1; }
// The estimator of SPARGE_ESTIMATOR_AUTO (docs/ACCURACY.md, "Estimators"). Not causal,
// KEYS_LSE_ADAPTIVE is closer to the oracle mask: DINOv2 ViT layer 10 at top-k 0.2 1.06x the
// oracle's relative L1 (KEYS_LSE 1.107x), every ViT layer <= 1.06x at top-k 0.2 and 0.5, grid3d
// 1.14x / 1.11x (KEYS_LSE 1.17x / 1.13x). Causal (the language model) it splits 0-22 % of the
// blocks and equals KEYS_LSE's accuracy at a higher cost: KEYS_LSE.
inline sparge_estimator_t default_estimator(bool causal) {
  return causal ? SPARGE_ESTIMATOR_KEYS_LSE : SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
}

struct BudgetForced {
  int64_t lo = 1, hi = 0;  // key block range [lo, hi] (empty when lo > hi)
  bool sink = false;
  SPARGE_HD bool has(int64_t kb) const { return (sink && kb == 0) || (kb >= lo && kb <= hi); }
};

SPARGE_HD BudgetForced budget_forced(const Problem& p, const PredictConfig& c, int64_t qb) {
  BudgetForced f;
  f.sink = c.attention_sink;
  // diagonal: the key blocks holding key i + (Lkv - Lq) for the rows i of qb, clamped to the keys
  const int64_t r0 = qb * p.BQ;
  int64_t r1 = r0 + p.BQ - 1;
  if (r1 > p.Lq - 1) r1 = p.Lq - 1;
  int64_t k0 = r0 + (p.Lkv - p.Lq), k1 = r1 + (p.Lkv - p.Lq);
  k0 = k0 < 0 ? 0 : (k0 > p.Lkv - 1 ? p.Lkv - 1 : k0);
  k1 = k1 < 0 ? 0 : (k1 > p.Lkv - 1 ? p.Lkv - 1 : k1);
  const int64_t first = k0 / p.BK, last = k1 / p.BK;
  if (c.local_window > 0) {
    f.lo = first - (c.local_window - 1);
    f.hi = last + (c.local_window - 1);
    if (f.lo < 0) f.lo = 0;
  } else if (p.causal) {
    f.lo = f.hi = first;
  }
  return f;
}

// Blocks kept by top-k among `visible` candidates.
SPARGE_HD int64_t topk_count(float topk, int64_t visible) {
  if (visible <= 0) return 0;
  // topk arrives as a float (0.7f is 0.69999999): without the small tolerance
  // floor(0.7f * 10) would keep 6 blocks where every user expects 7.
  int64_t n = static_cast<int64_t>(static_cast<double>(topk) * static_cast<double>(visible) + 1e-4);
  if (n < 1) n = 1;
  if (n > visible) n = visible;
  return n;
}

// ---------------------------------------------------------------- workspace
// One function computes both the size and the offsets, so the size query and
// the real use cannot drift. All offsets are 256-byte aligned; 0 bytes = unused.
struct WorkspaceLayout {
  size_t total = 0;
  bool overflow = false;  // a byte count exceeded 63 bits: the problem is rejected at plan creation
  // shared by both backends
  size_t k_mean = 0;    // float [B*Hkv, D]
  size_t pooled_q = 0;  // float [B*Hq, nQB, D]
  size_t sim_q = 0;     // float [B*Hq, nQB]
  size_t pooled_k = 0;  // float [B*Hkv, nKB, D]
  size_t sim_k = 0;     // float [B*Hkv, nKB]
  size_t scores = 0;    // float [B*Hq, nQB, nKB]
  size_t mask = 0;      // uint8 [B*Hq, nQB, nKB] (mask predicted inside attention_run)
  size_t kept = 0;      // int32 [B*Hq]
  // CUDA backend only
  size_t v_amax = 0;    // float [B*Hkv, D]
  size_t q_i8 = 0;      // int8  [B*Hq, nQB*128, D]   (pad rows zero)
  size_t q_scale = 0;   // float [B*Hq, nQB*128]     per-token dequant scale
  size_t q_mu = 0;      // float [B*Hq, nQB*128]     scale * q . mean_k  (LSE shift)
  size_t k_i8 = 0;      // int8  [B*Hkv, nKB*64, D]   (smoothed, pad rows zero)
  size_t k_scale = 0;   // float [B*Hkv, nKB]        per-64-key-block dequant scale
  size_t v_f8 = 0;      // fp8   [B*Hkv, D, nKB*64]   transposed, token-permuted
  size_t v_f8_lo = 0;   // fp8   like v_f8: the second term of split V (INT8_FP8_SPLIT_V)
  size_t idx = 0;       // int32 [B*Hq, nQB, nKB]    kept key blocks, ascending
  size_t cnt = 0;       // int32 [B*Hq, nQB]
  size_t order = 0;     // int32 [B*Hq*nQB]          work order: group-major, heaviest first in a group
  size_t col_part = 0;  // double [B*Hkv, nChunk, D] K column sums, then float [B*Hkv, nChunk, D]
                        // V column max|.|; nChunk = ceil(Lkv / kGpuColChunk)
  size_t col_tick = 0;  // uint64 [B*Hkv]           tickets of the column statistics (no initialization needed)
  size_t split_q = 0;   // float [B*Hq, nQB, 2, D]   KEYS_LSE_SPLIT2: the two groups' mean rows
  size_t split_n = 0;   // float [B*Hq, nQB, 2]      KEYS_LSE_SPLIT2: the groups' sizes
  size_t split_rows = 0;  // int32 [B*Hkv, group*nQB*2] KEYS_LSE_ADAPTIVE: the pooled rows to score, in order
  size_t split_cnt = 0;   // int32 [B*Hkv]             KEYS_LSE_ADAPTIVE: their number
                        // (and idx holds the second group's block scores until the selection)
};

WorkspaceLayout plan_workspace(const Problem& p);

template <class T>
inline T* ws_ptr(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

}  // namespace sparge
