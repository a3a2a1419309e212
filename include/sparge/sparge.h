/*
 * libsparge — training-free block-sparse attention with a stable C ABI.
 *
 * This is the only public header. It is C99 and includes nothing beyond
 * <stddef.h> and <stdint.h>. See docs/API.md for the full reference.
 *
 * ABI rules
 *  - Enumerator values never change; new ones are appended.
 *  - Every struct passed by pointer starts with `size_t struct_size`, set by the
 *    caller to sizeof(the struct it was compiled against) (use the *_INIT macros).
 *    Structs only grow at the end; a newer library reads only the fields an older
 *    caller's struct_size covers. A struct_size smaller than the first published
 *    layout (this one) is rejected with SPARGE_ERR_INVALID_ARGUMENT.
 *  - Nothing crosses the ABI as an exception, abort or exit: every failure is a
 *    status plus a thread-local message (sparge_last_error()).
 *  - On CUDA plans sparge_predict_mask and sparge_attention_run allocate no
 *    buffers (scratch is the caller's workspace; a repeated call's instantiated
 *    CUDA graph aside), never synchronize the host and run on the caller's
 *    stream (CUDA graph capturable). CPU plans allocate host scratch.
 */
#ifndef SPARGE_SPARGE_H_
#define SPARGE_SPARGE_H_

#include <stddef.h>
#include <stdint.h>

#define SPARGE_VERSION_MAJOR 0
#define SPARGE_VERSION_MINOR 1
#define SPARGE_VERSION_PATCH 0
#define SPARGE_VERSION_NUMBER \
  (SPARGE_VERSION_MAJOR * 10000 + SPARGE_VERSION_MINOR * 100 + SPARGE_VERSION_PATCH)

#if defined(_WIN32)
#  if defined(SPARGE_BUILDING_LIBRARY)
#    define SPARGE_API __declspec(dllexport)
#  else
#    define SPARGE_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) || defined(__clang__)
#  define SPARGE_API __attribute__((visibility("default")))
#else
#  define SPARGE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ status */
typedef enum sparge_status {
  SPARGE_OK = 0,
  SPARGE_ERR_INVALID_ARGUMENT = 1,   /* NULL, bad shape/stride/dtype/value      */
  SPARGE_ERR_UNSUPPORTED = 2,        /* valid request this build/GPU cannot do  */
  SPARGE_ERR_WORKSPACE_TOO_SMALL = 3,
  SPARGE_ERR_NO_DEVICE = 4,          /* CUDA plan but no usable GPU/CUDA backend */
  SPARGE_ERR_CUDA = 5,               /* a CUDA runtime/driver call failed        */
  SPARGE_ERR_OUT_OF_MEMORY = 6,      /* host allocation in plan creation failed  */
  SPARGE_ERR_INTERNAL = 7
} sparge_status_t;

/* ------------------------------------------------------------------ enums */
typedef enum sparge_dtype {
  SPARGE_DTYPE_FLOAT16 = 0,
  SPARGE_DTYPE_BFLOAT16 = 1,
  SPARGE_DTYPE_FLOAT32 = 2,
  SPARGE_DTYPE_UINT8 = 3,   /* block masks                          */
  SPARGE_DTYPE_INT32 = 4    /* kept-block counts                    */
} sparge_dtype_t;

typedef enum sparge_device_type {
  SPARGE_DEVICE_CPU = 0,
  SPARGE_DEVICE_CUDA = 1
} sparge_device_type_t;

typedef enum sparge_precision {
  /* Q, K int8 (per-token Q scale, per-64-key-block K scale, K smoothed);
   * P and V fp8 e4m3 (per-channel V scale); fp32 accumulation.
   * The fastest on sm_90 at long sequences (AUTO's choice there). The CPU backend emulates it bit-for-bit in its
   * rounding steps (the "quantization twin"). */
  SPARGE_PRECISION_INT8_FP8 = 0,
  /* Q, K, P, V in the input's 16-bit type, fp32 accumulation. */
  SPARGE_PRECISION_FP16 = 1,
  /* No rounding at all: float64 accumulation. CPU backend only. */
  SPARGE_PRECISION_EXACT = 2,
  /* INT8_FP8 with V carried as two e4m3 terms (v ~ hi + lo, both on the same
   * per-channel scale): V's own rounding error nearly vanishes, so the output
   * error falls to that of P and Q.K^T (relative L1 ~0.028 instead of ~0.038
   * on random normal inputs, docs/ACCURACY.md); one more fp8 P.V product per
   * key tile and a second fp8 V region in the CUDA workspace. */
  SPARGE_PRECISION_INT8_FP8_SPLIT_V = 3,
  /* Q, K int8 exactly as INT8_FP8 (per-token Q scale, per-64-key-block K
   * scale, K smoothed); P rounded to the input's 16-bit type, V used as
   * given; fp32 accumulation. The error is that of the int8 Q.K^T alone
   * (relative L1 ~0.011 on random normal inputs, docs/ACCURACY.md); no V
   * preparation pass and no fp8 V region in the CUDA workspace. */
  SPARGE_PRECISION_INT8_FP16 = 4,
  /* The plan picks INT8_FP8 or FP16 from the problem and the device
   * (docs/SEMANTICS.md, "Precision AUTO"): INT8_FP8 on compute capability 9.0
   * for head_dim 65..128 once the problem is long enough for the int8 path's
   * preparation passes to pay off (an effective length
   * 3 Lq Lkv / (Lq + 2 Lkv) of at least 16384 keys); FP16 everywhere else
   * (head_dim <= 64 at every length). CPU plans apply the
   * compute capability 9.0 rule. sparge_plan_get_problem reports the choice.
   * The SPARGE_PROBLEM_INIT default. */
  SPARGE_PRECISION_AUTO = 5
} sparge_precision_t;

typedef enum sparge_select_mode {
  SPARGE_SELECT_TOPK = 0,  /* keep max(1, floor(topk * visible)) blocks per row  */
  SPARGE_SELECT_CDF = 1    /* keep the smallest set with probability >= cdf_threshold */
} sparge_select_mode_t;

/* Block-importance estimator of the prediction (docs/SEMANTICS.md, "Mask prediction"). */
typedef enum sparge_estimator {
  SPARGE_ESTIMATOR_MEAN = 0,       /* softmax of scale * mean(q block) . mean(k' block) (SpargeAttn) */
  SPARGE_ESTIMATOR_KEYS_LSE = 1,   /* softmax of log sum_{j in block} exp(scale * mean(q block) . k_j) */
  SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2 = 2, /* KEYS_LSE for two groups of similar rows per query block, their
                                          block distributions averaged by group size (about twice the
                                          prediction cost of KEYS_LSE) */
  SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE = 3, /* KEYS_LSE_SPLIT2 on the query blocks whose mean row is 0.25
                                             to 0.75 of their rows' length (rows that share a direction
                                             but spread), KEYS_LSE of the block's mean row on the
                                             others (the cost follows the share of split blocks) */
  SPARGE_ESTIMATOR_AUTO = 4        /* the default of the mode: KEYS_LSE_ADAPTIVE when not causal,
                                      KEYS_LSE when causal (docs/ACCURACY.md, "Estimators") */
} sparge_estimator_t;

/* ------------------------------------------------------------------ tensors */
/* A borrowed, strided view of a tensor (compatible in spirit with DLPack's
 * DLTensor: pointer, device, dtype, shape and strides in ELEMENTS).
 * Attention tensors are 4-D in logical order [B, H, L, D]; any strides are
 * accepted as long as the last (D) stride is 1 (HND, NHD, packed QKV ...).
 * LSE is 3-D [B, Hq, Lq]; a block mask is 4-D [B, Hq, ceil(Lq/BQ), ceil(Lkv/BK)];
 * kept-block counts are 2-D [B, Hq]. Unused trailing shape/stride entries are ignored. */
#define SPARGE_MAX_DIMS 4
typedef struct sparge_tensor {
  void* data;
  sparge_device_type_t device_type;
  int32_t device_id;
  sparge_dtype_t dtype;
  int32_t ndim;
  int64_t shape[SPARGE_MAX_DIMS];
  int64_t strides[SPARGE_MAX_DIMS];
} sparge_tensor_t;

/* ------------------------------------------------------------------ problem */
typedef struct sparge_problem {
  size_t struct_size;        /* = sizeof(sparge_problem_t)                      */
  int64_t batch;             /* B                                               */
  int64_t heads_q;           /* Hq                                              */
  int64_t heads_kv;          /* Hkv, Hq % Hkv == 0 (GQA / MQA)                  */
  int64_t len_q;             /* Lq                                              */
  int64_t len_kv;            /* Lkv                                             */
  int64_t head_dim;          /* D: CPU 1..256; GPU 64, 96, 128, 256 (INT8_FP8 and
                                INT8_FP8_SPLIT_V: 64, 96, 128)                   */
  sparge_dtype_t dtype;      /* q, k, v and out dtype                           */
  sparge_device_type_t device_type;
  int32_t device_id;
  sparge_precision_t precision;
  int32_t causal;            /* bottom-right aligned: q i sees k j iff j <= i + Lkv - Lq */
  float scale;               /* softmax scale; 0 means 1/sqrt(D)                */
  int32_t block_q;           /* mask block rows; 0 means 128                    */
  int32_t block_k;           /* mask block cols; 0 means 64                     */
} sparge_problem_t;

#define SPARGE_PROBLEM_INIT                                                       \
  { sizeof(sparge_problem_t), 1, 1, 1, 0, 0, 128, SPARGE_DTYPE_BFLOAT16,           \
    SPARGE_DEVICE_CPU, 0, SPARGE_PRECISION_AUTO, 0, 0.0f, 0, 0 }

/* ------------------------------------------------------------------ prediction */
typedef struct sparge_predict_params {
  size_t struct_size;             /* = sizeof(sparge_predict_params_t)          */
  sparge_select_mode_t mode;
  float topk;                     /* (0, 1], TOPK mode                          */
  float cdf_threshold;            /* (0, 1], CDF mode                           */
  float sim_threshold;            /* blocks with self-similarity < this are kept
                                     whole (non-compressible); <= 0 disables     */
  int32_t smooth_k;               /* subtract the per-head mean of K            */
  int32_t attention_sink;         /* -1: the default of the mode; 0: off; other:
                                     keep key block 0 (counted in the budget)      */
  /* Optional per-head overrides, length Hq, in the plan's memory space (host
   * memory for CPU plans, device memory for CUDA plans); NULL = use the scalar. */
  const float* topk_per_head;
  const float* cdf_threshold_per_head;
  const float* sim_threshold_per_head;
  float pv_threshold;             /* PV skip; 0 (default) = off. tau > 0: a query
                                     row skips a softmax step whose scores are all
                                     more than tau nats below its running max
                                     (CPU backend; not with SPARGE_PRECISION_EXACT;
                                     CUDA plans: SPARGE_ERR_UNSUPPORTED for now) */
  /* --- since 0.2 (read only when struct_size covers them; older callers get
   *     the defaults of the mode: local_window -1, SPARGE_ESTIMATOR_AUTO) */
  int32_t local_window;           /* w >= 1: keep the key blocks on the diagonal and
                                     w - 1 more on each side (counted in the budget);
                                     0: off; -1: the default of the mode           */
  sparge_estimator_t estimator;   /* SPARGE_ESTIMATOR_AUTO (default, also for
                                     callers of the 0.1 layout: KEYS_LSE_ADAPTIVE
                                     when not causal, KEYS_LSE when causal), or
                                     one by name: _KEYS_LSE, _KEYS_LSE_ADAPTIVE,
                                     _KEYS_LSE_SPLIT2, _MEAN (SpargeAttn; also what
                                     a zero-filled struct holds: start from
                                     SPARGE_PREDICT_PARAMS_INIT)                   */
} sparge_predict_params_t;

#define SPARGE_PREDICT_PARAMS_INIT                                                  \
  { sizeof(sparge_predict_params_t), SPARGE_SELECT_TOPK, 0.5f, 0.9f, -0.1f, 1, -1,   \
    NULL, NULL, NULL, 0.0f, -1, SPARGE_ESTIMATOR_AUTO }

/* ------------------------------------------------------------------ API */
typedef struct sparge_plan* sparge_plan_t;

/* Validates the problem, resolves defaults, computes the workspace layout.
 * CUDA plans check the device here (the only place the library may synchronize
 * or query the driver). On failure *out is set to NULL. */
SPARGE_API sparge_status_t sparge_create_plan(const sparge_problem_t* problem, sparge_plan_t* out);

/* Bytes of scratch memory (in the plan's memory space; 256-byte aligned device
 * memory for CUDA plans, 16-byte aligned host memory for CPU plans) that
 * predict_mask and attention_run need. Zero-sized workspaces may pass NULL. */
SPARGE_API sparge_status_t sparge_plan_workspace_size(sparge_plan_t plan, size_t* bytes);

/* The resolved problem (defaults filled in: scale, block sizes, the precision
 * SPARGE_PRECISION_AUTO chose). */
SPARGE_API sparge_status_t sparge_plan_get_problem(sparge_plan_t plan, sparge_problem_t* problem);

/* Number of causally visible (query-block, key-block) pairs per (batch, head):
 * the denominator of the block density. Host-only arithmetic. */
SPARGE_API sparge_status_t sparge_plan_visible_blocks(sparge_plan_t plan, int64_t* visible_per_head);

/* Predicts the block mask from Q and K. mask_out: uint8 [B, Hq, nQB, nKB].
 * kept_out (optional, may be NULL): int32 [B, Hq], number of kept blocks.
 * params NULL = defaults (SPARGE_PREDICT_PARAMS_INIT). */
SPARGE_API sparge_status_t sparge_predict_mask(sparge_plan_t plan, const sparge_tensor_t* q,
                                               const sparge_tensor_t* k,
                                               const sparge_predict_params_t* params,
                                               const sparge_tensor_t* mask_out,
                                               const sparge_tensor_t* kept_out, void* workspace,
                                               size_t workspace_bytes, void* stream);

/* Block-sparse attention. mask: uint8 [B, Hq, nQB, nKB] (1 = compute), or NULL
 * to predict it inside with `params` (NULL = defaults). lse: optional float32
 * [B, Hq, Lq] (natural log; -inf for rows with no visible key).
 * out has q's logical shape and the problem dtype; any strides with unit D stride. */
SPARGE_API sparge_status_t sparge_attention_run(sparge_plan_t plan, const sparge_tensor_t* q,
                                                const sparge_tensor_t* k, const sparge_tensor_t* v,
                                                const sparge_tensor_t* mask,
                                                const sparge_predict_params_t* params,
                                                const sparge_tensor_t* out,
                                                const sparge_tensor_t* lse, void* workspace,
                                                size_t workspace_bytes, void* stream);

/* What a plan runs: the attention kernel chosen from the kernel registry at
 * plan creation (CUDA), or the CPU reference. */
typedef struct sparge_kernel_info {
  size_t struct_size;     /* = sizeof(sparge_kernel_info_t), set by the caller    */
  char family[16];        /* "sm90" or "portable" (CUDA plans), "cpu"              */
  char name[64];          /* the instance, e.g. "sm90_int8_fp8_d128_bf16_causal"   */
  int32_t sm_version;     /* CUDA: major*10 + minor of the device; CPU: 0          */
  int32_t head_dim;       /* row width the kernel multiplies (96 runs as 128)      */
  int32_t block_q;        /* query rows per CTA (CPU: the mask block rows)         */
  int32_t keys_per_step;  /* keys per online-softmax step (P is rounded per step); 0: EXACT */
  int32_t stages;         /* K/V pipeline stages (CPU: 0)                          */
  int32_t threads;        /* threads per CTA (CPU: 0)                              */
  int32_t smem_bytes;     /* dynamic shared memory per CTA (CPU: 0)                */
} sparge_kernel_info_t;

/* Fills *info (info->struct_size >= sizeof(sparge_kernel_info_t)). An FP16 call
 * whose strides the sm90 kernel's tensor maps cannot express runs the portable
 * kernel of the same key instead. Host-only. */
SPARGE_API sparge_status_t sparge_plan_kernel_info(sparge_plan_t plan, sparge_kernel_info_t* info);

/* Accepts NULL. */
SPARGE_API void sparge_destroy_plan(sparge_plan_t plan);

/* Thread-local text of the last failure on this thread; "" after success. Never NULL. */
SPARGE_API const char* sparge_last_error(void);
SPARGE_API const char* sparge_status_string(sparge_status_t status);
SPARGE_API void sparge_version(int* major, int* minor, int* patch);
/* 1 if this build has the CUDA backend, else 0. */
SPARGE_API int sparge_has_cuda(void);

/* ------------------------------------------------------------------ merging partial results */
/* Most partial states one sparge_merge_states call combines. */
#define SPARGE_MERGE_MAX_STATES 32

/* Combines `count` partial attention results of the same queries over disjoint
 * key sets (the key chunks of ring attention, say) exactly by their LSE; per
 * row r, over the states i whose lses[i][r] is not -inf:
 *   M = max lses[i][r];  w_i = exp(lses[i][r] - M);
 *   out[r] = sum w_i outs[i][r] / sum w_i;  lse_out[r] = M + log(sum w_i).
 * A state whose LSE is -inf contributes nothing (its output row is not read);
 * a row where every LSE is -inf gets zeros and -inf. A NaN LSE gives a NaN row
 * (output and LSE). An LSE of +inf weighs 1 and every finite one 0 (the limit).
 * outs[0..count-1] and out: [B, H, L, D], each FLOAT16, BFLOAT16 or FLOAT32;
 * lses[0..count-1] and lse_out (optional, may be NULL): FLOAT32 [B, H, L];
 * any non-negative strides (also on D). count: 1..SPARGE_MERGE_MAX_STATES.
 * Every tensor is on one device: host memory (CPU, float64 arithmetic) or CUDA
 * device memory of one device_id (float32 arithmetic, asynchronous on `stream`,
 * no allocation, graph capturable). out may be the very tensor outs[i] (same
 * data and strides) and lse_out the very tensor lses[i]; other overlaps between
 * outputs and inputs are not allowed. */
SPARGE_API sparge_status_t sparge_merge_states(int32_t count, const sparge_tensor_t* outs,
                                               const sparge_tensor_t* lses, const sparge_tensor_t* out,
                                               const sparge_tensor_t* lse_out, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* SPARGE_SPARGE_H_ */
