/*
 * sparge — run one block-sparse attention workload through the libsparge C ABI
 * and report speed, block density and accuracy.
 *
 * Default workload: the GPU (B=1, H=32, L=8192, D=128, bf16, topk 0.5) when the
 * library has the CUDA backend and a device is present, else a small CPU
 * problem (B=1, H=4, L=1024, D=64, fp32) that finishes in seconds.
 *
 * For each run it creates a plan, sizes and allocates the workspace, predicts
 * the block mask, runs sparse attention (mask predicted inside, mask=NULL) and
 * dense attention (all-ones mask), and compares a sample of output rows with a
 * float64 reference computed on the host from the same (rounded) inputs.
 *
 * Output: a report for people (default), or --json (one object) / --csv (one
 * row per call) for scripts, on stdout; progress of long runs and notes on
 * stderr (a refreshed line on a terminal, plain lines when piped). stdout is
 * line buffered and flushed before anything goes to stderr, so the two stay in
 * order when both go to one pipe.
 * `sparge tune ...` runs the Python tuning command instead (python3 -m sparge tune ...; $SPARGE_PYTHON
 * chooses the interpreter), which needs the sparge Python package on its path.
 *
 * Exit status: 0 success, 1 a library or runtime call failed, 2 bad usage,
 * 3 an accuracy gate (--min-cos) was missed.
 */
#define _POSIX_C_SOURCE 200809L

#include <sparge/sparge.h>

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef SPARGE_TOOL_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>
#endif

/* ------------------------------------------------------------------ errors */

enum { FMT_TEXT, FMT_JSON, FMT_CSV };
static int g_format = FMT_TEXT;
static int g_progress = 1;
static int g_progress_open = 0; /* a terminal progress line is on screen */

static void progress_clear(void);

/* The report for people: only in the text format. */
static void say(const char* fmt, ...) {
  va_list ap;
  if (g_format != FMT_TEXT) return;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
}

/* A note: stdout in the text format, stderr otherwise (stdout is for the data). */
static void note(const char* fmt, ...) {
  va_list ap;
  FILE* f = g_format == FMT_TEXT ? stdout : stderr;
  fflush(stdout);
  progress_clear();
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fflush(f);
}

static void die(int code, const char* fmt, ...) {
  va_list ap;
  fflush(stdout);
  progress_clear();
  fprintf(stderr, "sparge: ");
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  exit(code);
}

/* Every library failure: the call, the status string and the library's message. */
static void check(sparge_status_t st, const char* what) {
  if (st != SPARGE_OK) {
    const char* msg = sparge_last_error();
    fflush(stdout);
    progress_clear();
    fprintf(stderr, "sparge: %s failed: %s (status %d)%s%s\n", what, sparge_status_string(st), (int)st,
            msg[0] ? ": " : "", msg);
    exit(1);
  }
}

#ifdef SPARGE_TOOL_CUDA
static void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fflush(stdout);
    progress_clear();
    fprintf(stderr, "sparge: CUDA runtime: %s failed: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
    exit(1);
  }
}
#endif

static void* xmalloc(size_t n) {
  void* p = malloc(n ? n : 1);
  if (!p) die(1, "out of host memory (%zu bytes)", n);
  return p;
}

/* ------------------------------------------------------------------ number formats */

static uint16_t f32_to_f16(float f) {
  uint32_t x, sign, ax, h, m, rem;
  memcpy(&x, &f, 4);
  sign = (x >> 16) & 0x8000u;
  ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
  if (ax >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); /* >= 65536: inf */
  if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal */
    float a;
    memcpy(&a, &ax, 4);
    return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
  }
  m = ax & 0x7fffffu;
  h = (((ax >> 23) - 112u) << 10) | (m >> 13);
  rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* may carry into inf: correct */
  return (uint16_t)(sign | h);
}

static float f16_to_f32(uint16_t h) {
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  float v;
  if (e == 0)
    v = ldexpf((float)m, -24);
  else if (e == 31)
    v = m ? NAN : INFINITY;
  else
    v = ldexpf((float)(m | 0x400u), (int)e - 25);
  return (h & 0x8000u) ? -v : v;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

static float bf16_to_f32(uint16_t b) {
  uint32_t x = (uint32_t)b << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static size_t dtype_bytes(sparge_dtype_t t) { return t == SPARGE_DTYPE_FLOAT32 ? 4 : 2; }

static void store_elem(void* base, size_t i, sparge_dtype_t t, float v) {
  if (t == SPARGE_DTYPE_FLOAT32)
    ((float*)base)[i] = v;
  else if (t == SPARGE_DTYPE_FLOAT16)
    ((uint16_t*)base)[i] = f32_to_f16(v);
  else
    ((uint16_t*)base)[i] = f32_to_bf16(v);
}

static float load_elem(const void* base, size_t i, sparge_dtype_t t) {
  if (t == SPARGE_DTYPE_FLOAT32) return ((const float*)base)[i];
  if (t == SPARGE_DTYPE_FLOAT16) return f16_to_f32(((const uint16_t*)base)[i]);
  return bf16_to_f32(((const uint16_t*)base)[i]);
}

static float round_to(float v, sparge_dtype_t t) {
  if (t == SPARGE_DTYPE_FLOAT16) return f16_to_f32(f32_to_f16(v));
  if (t == SPARGE_DTYPE_BFLOAT16) return bf16_to_f32(f32_to_bf16(v));
  return v;
}

static const char* dtype_name(sparge_dtype_t t) {
  switch (t) {
    case SPARGE_DTYPE_FLOAT16: return "fp16";
    case SPARGE_DTYPE_BFLOAT16: return "bf16";
    case SPARGE_DTYPE_FLOAT32: return "fp32";
    default: return "?";
  }
}

static const struct {
  const char* name;
  sparge_precision_t value;
} kPrecisions[] = {{"auto", SPARGE_PRECISION_AUTO},
                   {"int8_fp8", SPARGE_PRECISION_INT8_FP8},
                   {"int8_fp8_split_v", SPARGE_PRECISION_INT8_FP8_SPLIT_V},
                   {"int8_fp16", SPARGE_PRECISION_INT8_FP16},
                   {"fp16", SPARGE_PRECISION_FP16},
                   {"exact", SPARGE_PRECISION_EXACT}};

static const char* precision_name(sparge_precision_t p) {
  for (size_t i = 0; i < sizeof kPrecisions / sizeof kPrecisions[0]; ++i)
    if (kPrecisions[i].value == p) return kPrecisions[i].name;
  return "?";
}

static const char* estimator_name(int e) {
  return e == SPARGE_ESTIMATOR_MEAN               ? "mean"
         : e == SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2   ? "keys_lse_split2"
         : e == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE ? "keys_lse_adaptive"
         : e == SPARGE_ESTIMATOR_AUTO              ? "auto"
                                                   : "keys_lse";
}

/* The estimator the library runs: SPARGE_ESTIMATOR_AUTO is KEYS_LSE_ADAPTIVE when not causal,
 * KEYS_LSE when causal (sparge.h). */
static int resolved_estimator(int e, int causal) {
  if (e != SPARGE_ESTIMATOR_AUTO) return e;
  return causal ? SPARGE_ESTIMATOR_KEYS_LSE : SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
}

/* ------------------------------------------------------------------ random numbers */

typedef struct {
  uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t* r) { /* splitmix64 */
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static double rng_uniform(rng_t* r) { return ((double)(rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static float rng_normal(rng_t* r) {
  double u1 = rng_uniform(r), u2 = rng_uniform(r);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static uint64_t hash64(uint64_t x) {
  rng_t r;
  r.s = x;
  return rng_next(&r);
}

/* ------------------------------------------------------------------ options */

typedef struct {
  int device; /* -1 auto, SPARGE_DEVICE_CPU, SPARGE_DEVICE_CUDA */
  int device_id;
  int64_t B, H, Hkv, L, Lkv, D; /* -1: default for the device */
  int dtype;                    /* -1: default for the device */
  int precision;
  int causal;
  int use_cdf;
  float topk, cdf, sim_threshold;
  int sink, smooth_k;
  int window; /* -1: the default of the mode */
  int estimator; /* SPARGE_ESTIMATOR_* */
  int iters, warmup; /* -1: default for the device */
  uint64_t seed;
  int nhd;
  int rows;
  int data_random;
  double min_cos; /* < 0: no gate */
} options_t;

/* ------------------------------------------------------------------ progress */

static double now_seconds(void);
static double g_t0, g_last_progress;

/* Progress of long runs on stderr: a line refreshed in place on a terminal (after the
 * first second), plain lines when stderr is not a terminal (after 2 s, then at most one
 * every 10 s and one per phase). Off with --no-progress. */
static void progress(const char* what, int i, int n) {
  static const char* last_what = NULL;
  double t = now_seconds(), el = t - g_t0;
  int new_phase = what != last_what;
  if (!g_progress) return;
  if (isatty(fileno(stderr))) {
    if (el < 1.0 || (t - g_last_progress < 0.2 && !new_phase)) return;
    fflush(stdout);
    fprintf(stderr, "\r\033[Ksparge: %s %d/%d (%.0f s)", what, i, n, el);
    fflush(stderr);
    g_progress_open = 1;
  } else {
    if (el < 2.0 || (!new_phase && t - g_last_progress < 10.0)) return;
    fflush(stdout);
    fprintf(stderr, "sparge: progress: %s %d/%d (%.1f s)\n", what, i, n, el);
    fflush(stderr);
  }
  last_what = what;
  g_last_progress = t;
}

static void progress_clear(void) {
  if (g_progress_open) {
    fprintf(stderr, "\r\033[K");
    fflush(stderr);
    g_progress_open = 0;
  }
}

static void usage(FILE* f) {
  fprintf(f,
          "usage: sparge [options]\n"
          "\n"
          "Runs block-sparse attention (mask predicted from Q and K) and dense attention (all\n"
          "blocks kept) through libsparge and prints time per call, effective TOPS, block\n"
          "density and accuracy against a float64 reference on a sample of rows.\n"
          "\n"
          "  --device cpu|cuda[:N]  backend (default: cuda if the library has it and a GPU is\n"
          "                         present, else cpu)\n"
          "  -b, --batch N          batch size B (default 1)\n"
          "  -H, --heads N          query heads Hq (default: cuda 32, cpu 4)\n"
          "  --hkv N                key/value heads (default Hq; Hq %% Hkv == 0 for GQA/MQA)\n"
          "  -L, --len N            query length Lq (default: cuda 8192, cpu 1024)\n"
          "  --lkv N                key/value length (default Lq)\n"
          "  -D, --head-dim N       head dimension (default: cuda 128, cpu 64)\n"
          "  --dtype fp16|bf16|fp32 input/output type (default: cuda bf16, cpu fp32)\n"
          "  --causal               bottom-right aligned causal mask\n"
          "  --topk X               keep fraction of blocks per row, (0, 1] (default 0.5)\n"
          "  --cdf X                select by cumulative probability X instead of top-k\n"
          "  --sim-threshold X      self-similarity threshold (default -0.1: off)\n"
          "  --sink | --no-sink     keep the first key block (counted in the budget; default: on)\n"
          "  --window W             keep the diagonal key blocks and W-1 more per side (default: 2 when\n"
          "                         causal, 1 otherwise; 0: off)\n"
          "  --no-smooth-k          do not subtract the mean of K before prediction\n"
          "  --estimator auto|keys_lse|keys_lse_adaptive|keys_lse_split2|mean\n"
          "                         block importance (default auto: keys_lse_adaptive when not\n"
          "                         causal, keys_lse when causal; keys_lse: pooled q against every\n"
          "                         key; keys_lse_split2: two groups of rows per query block;\n"
          "                         keys_lse_adaptive: split2 where a block's rows spread;\n"
          "                         mean: pooled q against pooled k, the SpargeAttn rule)\n"
          "  --precision auto|int8_fp8|int8_fp8_split_v|int8_fp16|fp16|exact\n"
          "                         (default auto: int8_fp8 on sm_90 at long sequences, else\n"
          "                         fp16, reported in the output; int8_fp8_split_v: V as two e4m3 terms,\n"
          "                         smaller P.V error, one more fp8 P.V product; int8_fp16:\n"
          "                         int8 Q.K, P in 16 bits, V as given; exact: CPU only)\n"
          "  --iters N              timed calls per measurement (default: cuda 20, cpu 3)\n"
          "  --warmup N             untimed calls first (default: cuda 3, cpu 1)\n"
          "  --seed N               random seed (default 0)\n"
          "  --layout hnd|nhd       memory layout of q, k, v, out (default hnd)\n"
          "  --data clustered|random  inputs: tokens in runs sharing a random direction\n"
          "                         (default), or i.i.d. normal\n"
          "  --rows N               rows sampled for the accuracy check (default 128)\n"
          "  --min-cos X            exit 3 unless dense and sparse-on-its-own-mask cosine >= X\n"
          "  --json                 print the results as one JSON object (stdout) instead of the report\n"
          "  --csv                  print the results as CSV, a header and one row per call\n"
          "  --no-progress          no progress lines on stderr during long runs\n"
          "  --version              print the tool's and the loaded library's versions and exit\n"
          "  -h, --help             this text\n"
          "\n"
          "Short options take their value attached or separate (-L256 or -L 256); long ones\n"
          "with '=' or separate (--len=256 or --len 256).\n");
}

static int parse_i64(const char* flag, const char* v, int64_t lo, int64_t* out) {
  char* end = NULL;
  long long x;
  if (!v) die(2, "%s needs a value", flag);
  x = strtoll(v, &end, 10);
  if (!end || *end || x < lo) die(2, "%s: expected an integer >= %lld, got '%s'", flag, (long long)lo, v);
  *out = (int64_t)x;
  return 0;
}

static float parse_f(const char* flag, const char* v) {
  char* end = NULL;
  double x;
  if (!v) die(2, "%s needs a value", flag);
  x = strtod(v, &end);
  if (!end || *end || x != x) die(2, "%s: expected a number, got '%s'", flag, v);
  return (float)x;
}

static void parse_args(int argc, char** argv, options_t* o) {
  int i;
  memset(o, 0, sizeof(*o));
  o->device = -1;
  o->B = 1;
  o->H = o->Hkv = o->L = o->Lkv = o->D = -1;
  o->dtype = -1;
  o->precision = SPARGE_PRECISION_AUTO;
  o->topk = 0.5f;
  o->cdf = 0.9f;
  o->sim_threshold = -0.1f;
  o->smooth_k = 1;
  o->sink = -1;
  o->window = -1;
  {
    const sparge_predict_params_t def = SPARGE_PREDICT_PARAMS_INIT;
    o->estimator = def.estimator; /* the library's default */
  }
  o->iters = o->warmup = -1;
  o->rows = 128;
  o->min_cos = -1.0;
  for (i = 1; i < argc; ++i) {
    char flag[64];
    const char* a = argv[i];
    const char* val = NULL;
    const char* eq = strchr(a, '=');
    int64_t n;
    if (a[0] == '-' && a[1] == '-' && eq && (size_t)(eq - a) < sizeof(flag)) {
      memcpy(flag, a, (size_t)(eq - a));
      flag[eq - a] = 0;
      val = eq + 1;
    } else if (a[0] == '-' && a[1] && a[1] != '-' && a[2] && strchr("bHLD", a[1])) {
      /* GNU style: a short option with its value attached (-L256) */
      flag[0] = '-';
      flag[1] = a[1];
      flag[2] = 0;
      val = a + 2;
    } else {
      snprintf(flag, sizeof(flag), "%s", a);
    }
#define VALUE() (val ? val : (i + 1 < argc ? argv[++i] : NULL))
    if (!strcmp(flag, "-h") || !strcmp(flag, "--help")) {
      usage(stdout);
      exit(0);
    } else if (!strcmp(flag, "--version")) {
      int ma, mi, pa;
      sparge_version(&ma, &mi, &pa);
      printf("sparge %d.%d.%d (libsparge %d.%d.%d loaded, CUDA backend: %s)\n", SPARGE_VERSION_MAJOR,
             SPARGE_VERSION_MINOR, SPARGE_VERSION_PATCH, ma, mi, pa, sparge_has_cuda() ? "yes" : "no");
      exit(0);
    } else if (!strcmp(flag, "--json")) {
      g_format = FMT_JSON;
    } else if (!strcmp(flag, "--csv")) {
      g_format = FMT_CSV;
    } else if (!strcmp(flag, "--no-progress")) {
      g_progress = 0;
    } else if (!strcmp(flag, "--device")) {
      const char* v = VALUE();
      if (!v) die(2, "--device needs a value");
      if (!strcmp(v, "cpu")) {
        o->device = SPARGE_DEVICE_CPU;
      } else if (!strncmp(v, "cuda", 4) && (v[4] == 0 || v[4] == ':')) {
        o->device = SPARGE_DEVICE_CUDA;
        if (v[4] == ':') {
          parse_i64("--device cuda:N", v + 5, 0, &n);
          o->device_id = (int)n;
        }
      } else {
        die(2, "--device: expected cpu or cuda[:N], got '%s'", v);
      }
    } else if (!strcmp(flag, "-b") || !strcmp(flag, "--batch")) {
      parse_i64(flag, VALUE(), 1, &o->B);
    } else if (!strcmp(flag, "-H") || !strcmp(flag, "--heads")) {
      parse_i64(flag, VALUE(), 1, &o->H);
    } else if (!strcmp(flag, "--hkv")) {
      parse_i64(flag, VALUE(), 1, &o->Hkv);
    } else if (!strcmp(flag, "-L") || !strcmp(flag, "--len")) {
      parse_i64(flag, VALUE(), 1, &o->L);
    } else if (!strcmp(flag, "--lkv")) {
      parse_i64(flag, VALUE(), 1, &o->Lkv);
    } else if (!strcmp(flag, "-D") || !strcmp(flag, "--head-dim")) {
      parse_i64(flag, VALUE(), 1, &o->D);
    } else if (!strcmp(flag, "--dtype")) {
      const char* v = VALUE();
      if (v && (!strcmp(v, "fp16") || !strcmp(v, "float16")))
        o->dtype = SPARGE_DTYPE_FLOAT16;
      else if (v && (!strcmp(v, "bf16") || !strcmp(v, "bfloat16")))
        o->dtype = SPARGE_DTYPE_BFLOAT16;
      else if (v && (!strcmp(v, "fp32") || !strcmp(v, "float32")))
        o->dtype = SPARGE_DTYPE_FLOAT32;
      else
        die(2, "--dtype: expected fp16, bf16 or fp32, got '%s'", v ? v : "");
    } else if (!strcmp(flag, "--causal")) {
      o->causal = 1;
    } else if (!strcmp(flag, "--topk")) {
      o->topk = parse_f(flag, VALUE());
      o->use_cdf = 0;
    } else if (!strcmp(flag, "--cdf")) {
      o->cdf = parse_f(flag, VALUE());
      o->use_cdf = 1;
    } else if (!strcmp(flag, "--sim-threshold")) {
      o->sim_threshold = parse_f(flag, VALUE());
    } else if (!strcmp(flag, "--sink")) {
      o->sink = 1;
    } else if (!strcmp(flag, "--no-sink")) {
      o->sink = 0;
    } else if (!strcmp(flag, "--window")) {
      int64_t w;
      parse_i64(flag, VALUE(), 0, &w);
      if (w > 1024) die(2, "--window: expected an integer in [0, 1024], got %lld", (long long)w);
      o->window = (int)w;
    } else if (!strcmp(flag, "--no-smooth-k")) {
      o->smooth_k = 0;
    } else if (!strcmp(flag, "--estimator")) {
      const char* v = VALUE();
      if (v && !strcmp(v, "auto"))
        o->estimator = SPARGE_ESTIMATOR_AUTO;
      else if (v && !strcmp(v, "keys_lse"))
        o->estimator = SPARGE_ESTIMATOR_KEYS_LSE;
      else if (v && !strcmp(v, "keys_lse_split2"))
        o->estimator = SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2;
      else if (v && !strcmp(v, "keys_lse_adaptive"))
        o->estimator = SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
      else if (v && !strcmp(v, "mean"))
        o->estimator = SPARGE_ESTIMATOR_MEAN;
      else
        die(2, "--estimator: expected auto, keys_lse, keys_lse_adaptive, keys_lse_split2 or mean, got '%s'",
            v ? v : "");
    } else if (!strcmp(flag, "--precision")) {
      const char* v = VALUE();
      size_t i = 0;
      while (i < sizeof kPrecisions / sizeof kPrecisions[0] && !(v && !strcmp(v, kPrecisions[i].name))) ++i;
      if (i == sizeof kPrecisions / sizeof kPrecisions[0])
        die(2, "--precision: expected auto, int8_fp8, int8_fp8_split_v, int8_fp16, fp16 or exact, got '%s'",
            v ? v : "");
      o->precision = kPrecisions[i].value;
    } else if (!strcmp(flag, "--iters")) {
      parse_i64(flag, VALUE(), 1, &n);
      o->iters = (int)n;
    } else if (!strcmp(flag, "--warmup")) {
      parse_i64(flag, VALUE(), 0, &n);
      o->warmup = (int)n;
    } else if (!strcmp(flag, "--seed")) {
      parse_i64(flag, VALUE(), 0, &n);
      o->seed = (uint64_t)n;
    } else if (!strcmp(flag, "--layout")) {
      const char* v = VALUE();
      if (v && !strcmp(v, "hnd"))
        o->nhd = 0;
      else if (v && !strcmp(v, "nhd"))
        o->nhd = 1;
      else
        die(2, "--layout: expected hnd or nhd, got '%s'", v ? v : "");
    } else if (!strcmp(flag, "--data")) {
      const char* v = VALUE();
      if (v && !strcmp(v, "random"))
        o->data_random = 1;
      else if (v && !strcmp(v, "clustered"))
        o->data_random = 0;
      else
        die(2, "--data: expected clustered or random, got '%s'", v ? v : "");
    } else if (!strcmp(flag, "--rows")) {
      parse_i64(flag, VALUE(), 0, &n);
      o->rows = (int)n;
    } else if (!strcmp(flag, "--min-cos")) {
      o->min_cos = parse_f(flag, VALUE());
    } else {
      fflush(stdout);
      fprintf(stderr, "sparge: unknown option '%s'\n\n", a);
      usage(stderr);
      exit(2);
    }
#undef VALUE
  }
}

/* ------------------------------------------------------------------ device choice */

#ifdef SPARGE_TOOL_CUDA
static cudaError_t g_cuda_count_err = cudaSuccess;
#endif

/* Number of CUDA devices usable by this process (only when built with the runtime). */
static int cuda_device_count(void) {
#ifdef SPARGE_TOOL_CUDA
  int n = 0;
  g_cuda_count_err = cudaGetDeviceCount(&n);
  if (g_cuda_count_err != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

#ifdef SPARGE_TOOL_CUDA
/* Why cuda_device_count() found nothing, in words. The runtime reports a machine with
 * no NVIDIA driver at all as cudaErrorInsufficientDriver; tell that apart from an old
 * driver by whether the driver library loads. */
static const char* no_gpu_reason(void) {
  static char buf[256];
  if (g_cuda_count_err == cudaErrorInsufficientDriver) {
    void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!h) return "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)";
    dlclose(h);
    return "the NVIDIA driver is older than the CUDA runtime this tool was built with "
           "(cudaErrorInsufficientDriver)";
  }
  if (g_cuda_count_err == cudaErrorNoDevice || g_cuda_count_err == cudaSuccess)
    return "no CUDA device is visible to this process";
  snprintf(buf, sizeof(buf), "CUDA device query failed: %s (%s)", cudaGetErrorString(g_cuda_count_err),
           cudaGetErrorName(g_cuda_count_err));
  return buf;
}
#endif

static void resolve_defaults(options_t* o) {
  if (o->device < 0) {
    int have_gpu = sparge_has_cuda() && cuda_device_count() > 0;
    o->device = have_gpu ? SPARGE_DEVICE_CUDA : SPARGE_DEVICE_CPU;
#ifdef SPARGE_TOOL_CUDA
    if (!have_gpu && sparge_has_cuda()) note("note      : %s; running the CPU workload\n", no_gpu_reason());
#endif
    if (o->device == SPARGE_DEVICE_CUDA) {
      /* A GPU is present; make sure the library can use it (e.g. its compute
       * capability), else fall back to the CPU workload and say why. */
      sparge_problem_t probe = SPARGE_PROBLEM_INIT;
      sparge_plan_t plan = NULL;
      sparge_status_t st;
      probe.len_q = probe.len_kv = 128;
      probe.head_dim = 128;
      probe.device_type = SPARGE_DEVICE_CUDA;
      probe.device_id = o->device_id;
      st = sparge_create_plan(&probe, &plan);
      sparge_destroy_plan(plan);
      if (st != SPARGE_OK) {
        note("note      : CUDA device not usable (%s: %s); running the CPU workload\n", sparge_status_string(st),
             sparge_last_error());
        o->device = SPARGE_DEVICE_CPU;
      }
    }
  }
  if (o->device == SPARGE_DEVICE_CUDA) {
#ifndef SPARGE_TOOL_CUDA
    die(1, "--device cuda: this build of the sparge tool has no CUDA support (it was built without the CUDA "
           "runtime; reconfigure with nvcc on PATH, or use --device cpu)");
#endif
    if (!sparge_has_cuda())
      die(1, "--device cuda: the loaded libsparge was built without the CUDA backend (sparge_has_cuda() == 0)");
  }
  if (o->device == SPARGE_DEVICE_CUDA) {
    if (o->H < 0) o->H = 32;
    if (o->L < 0) o->L = 8192;
    if (o->D < 0) o->D = 128;
    if (o->dtype < 0) o->dtype = SPARGE_DTYPE_BFLOAT16;
    if (o->iters < 0) o->iters = 20;
    if (o->warmup < 0) o->warmup = 3;
  } else {
    if (o->H < 0) o->H = 4;
    if (o->L < 0) o->L = 1024;
    if (o->D < 0) o->D = 64;
    if (o->dtype < 0) o->dtype = SPARGE_DTYPE_FLOAT32;
    if (o->iters < 0) o->iters = 3;
    if (o->warmup < 0) o->warmup = 1;
  }
  if (o->Hkv < 0) o->Hkv = o->H;
  if (o->Lkv < 0) o->Lkv = o->L;
}

/* ------------------------------------------------------------------ buffers */

/* Memory in the plan's space: host for CPU plans, device for CUDA plans. */
typedef struct {
  int cuda;
  void* ptr;
  size_t bytes;
} buf_t;

static buf_t buf_alloc(int cuda, size_t bytes) {
  buf_t b;
  b.cuda = cuda;
  b.bytes = bytes;
  b.ptr = NULL;
  if (bytes == 0) return b;
  if (cuda) {
#ifdef SPARGE_TOOL_CUDA
    cuda_check(cudaMalloc(&b.ptr, bytes), "cudaMalloc");
#endif
  } else {
    if (posix_memalign(&b.ptr, 256, (bytes + 255) & ~(size_t)255) != 0) die(1, "out of host memory (%zu bytes)", bytes);
  }
  return b;
}

static void buf_free(buf_t* b) {
  if (!b->ptr) return;
#ifdef SPARGE_TOOL_CUDA
  if (b->cuda) {
    cudaFree(b->ptr);
    b->ptr = NULL;
    return;
  }
#endif
  free(b->ptr);
  b->ptr = NULL;
}

static void buf_upload(buf_t* b, const void* host, size_t bytes) {
  if (b->cuda) {
#ifdef SPARGE_TOOL_CUDA
    cuda_check(cudaMemcpy(b->ptr, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (to device)");
#endif
  } else {
    memcpy(b->ptr, host, bytes);
  }
}

static void buf_download(const buf_t* b, void* host, size_t bytes) {
  if (b->cuda) {
#ifdef SPARGE_TOOL_CUDA
    cuda_check(cudaMemcpy(host, b->ptr, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (to host)");
#endif
  } else {
    memcpy(host, b->ptr, bytes);
  }
}

static void buf_fill(buf_t* b, int byte) {
  if (!b->ptr) return;
  if (b->cuda) {
#ifdef SPARGE_TOOL_CUDA
    cuda_check(cudaMemset(b->ptr, byte, b->bytes), "cudaMemset");
#endif
  } else {
    memset(b->ptr, byte, b->bytes);
  }
}

/* ------------------------------------------------------------------ tensors */

/* Strides (elements) of a logical [B, H, L, D] tensor stored as HND or NHD. */
static void layout_strides(int nhd, int64_t H, int64_t L, int64_t D, int64_t st[4]) {
  if (nhd) {
    st[0] = L * H * D;
    st[1] = D;
    st[2] = H * D;
  } else {
    st[0] = H * L * D;
    st[1] = L * D;
    st[2] = D;
  }
  st[3] = 1;
}

static sparge_tensor_t make_tensor(void* data, sparge_device_type_t dev, int id, sparge_dtype_t dt, int ndim,
                                   const int64_t* shape, const int64_t* strides) {
  sparge_tensor_t t;
  int i;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device_type = dev;
  t.device_id = id;
  t.dtype = dt;
  t.ndim = ndim;
  for (i = 0; i < ndim; ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

/* ------------------------------------------------------------------ inputs */

/* Host copies in logical [B, H, L, D] order, already rounded to the dtype. */
typedef struct {
  float *q, *k, *v;
} host_inputs_t;

enum { kClusters = 8, kRun = 256 };

/* The random directions (and K offset) of one (batch, kv head): a stream of its
 * own, so that q and k generation can both recreate them. */
static void head_directions(const options_t* o, int64_t b, int64_t hk, float* centers, float* kbias) {
  const float cstd = (float)sqrt(5.0 / sqrt((double)o->D));
  rng_t r;
  int64_t i;
  r.s = hash64(o->seed * 0x9e3779b97f4a7c15ull ^ ((uint64_t)(b * o->Hkv + hk) << 24) ^ 0x5bd1e995ull);
  for (i = 0; i < kClusters * o->D; ++i) centers[i] = cstd * rng_normal(&r);
  for (i = 0; i < o->D; ++i) kbias[i] = rng_normal(&r);
}

/* Which direction token `i` of a sequence of `len` follows (runs of kRun tokens,
 * placed by relative position so that q and k of different lengths line up). */
static int64_t token_cluster(const options_t* o, int64_t b, int64_t hk, int64_t i) {
  return (int64_t)(hash64(o->seed + 0x1234567ull * (uint64_t)(b * o->Hkv + hk + 1) + (uint64_t)(i / kRun)) %
                   (uint64_t)kClusters);
}

/* Clustered inputs (default): tokens come in runs of 256 that share one of 8
 * random directions per (batch, kv head), so q and k of the same direction
 * attend to each other strongly -- the block structure attention shows in real
 * models. K also carries a per-head offset (removed by K smoothing; softmax is
 * invariant to it). V is i.i.d. normal. --data random: all i.i.d. normal. */
static void generate(const options_t* o, host_inputs_t* in) {
  const int64_t B = o->B, H = o->H, Hkv = o->Hkv, L = o->L, Lkv = o->Lkv, D = o->D;
  const int64_t group = H / Hkv;
  const sparge_dtype_t dt = (sparge_dtype_t)o->dtype;
  float* centers = (float*)xmalloc(sizeof(float) * (size_t)(kClusters * D));
  float* kbias = (float*)xmalloc(sizeof(float) * (size_t)D);
  rng_t r;
  int64_t b, h, i, d;
  r.s = o->seed;
  in->q = (float*)xmalloc(sizeof(float) * (size_t)(B * H * L * D));
  in->k = (float*)xmalloc(sizeof(float) * (size_t)(B * Hkv * Lkv * D));
  in->v = (float*)xmalloc(sizeof(float) * (size_t)(B * Hkv * Lkv * D));
  for (b = 0; b < B; ++b) {
    for (h = 0; h < Hkv; ++h) {
      head_directions(o, b, h, centers, kbias);
      for (i = 0; i < Lkv; ++i) {
        float* kr = in->k + ((b * Hkv + h) * Lkv + i) * D;
        float* vr = in->v + ((b * Hkv + h) * Lkv + i) * D;
        const float* c = centers + token_cluster(o, b, h, i) * D;
        for (d = 0; d < D; ++d) {
          float x = rng_normal(&r);
          if (!o->data_random) x += c[d] + kbias[d];
          kr[d] = round_to(x, dt);
          vr[d] = round_to(rng_normal(&r), dt);
        }
      }
    }
    for (h = 0; h < H; ++h) {
      const int64_t hk = h / group;
      head_directions(o, b, hk, centers, kbias);
      for (i = 0; i < L; ++i) {
        float* qr = in->q + ((b * H + h) * L + i) * D;
        /* align query i with key i + (Lkv - Lq), as the causal rule does */
        int64_t j = i + (Lkv - L);
        const float* c = centers + token_cluster(o, b, hk, j < 0 ? 0 : j) * D;
        for (d = 0; d < D; ++d) {
          float x = rng_normal(&r);
          if (!o->data_random) x += c[d];
          qr[d] = round_to(x, dt);
        }
      }
    }
  }
  free(centers);
  free(kbias);
}

/* Packs logical [B, H, L, D] floats into dtype bytes with the given strides. */
static void* pack(const float* x, int64_t B, int64_t H, int64_t L, int64_t D, const int64_t st[4],
                  sparge_dtype_t dt) {
  void* p = xmalloc((size_t)(B * H * L * D) * dtype_bytes(dt));
  int64_t b, h, i, d;
  for (b = 0; b < B; ++b)
    for (h = 0; h < H; ++h)
      for (i = 0; i < L; ++i)
        for (d = 0; d < D; ++d)
          store_elem(p, (size_t)(b * st[0] + h * st[1] + i * st[2] + d), dt, x[((b * H + h) * L + i) * D + d]);
  return p;
}

/* ------------------------------------------------------------------ reference */

typedef struct {
  double dot, oo, rr, l1_diff, l1_ref;
} acc_t;

static void acc_add(acc_t* a, const float* o, const double* r, int64_t D) {
  int64_t d;
  for (d = 0; d < D; ++d) {
    a->dot += (double)o[d] * r[d];
    a->oo += (double)o[d] * o[d];
    a->rr += r[d] * r[d];
    a->l1_diff += fabs((double)o[d] - r[d]);
    a->l1_ref += fabs(r[d]);
  }
}

static double acc_cos(const acc_t* a) {
  if (a->oo == 0.0 && a->rr == 0.0) return 1.0;
  if (a->oo == 0.0 || a->rr == 0.0) return 0.0;
  return a->dot / (sqrt(a->oo) * sqrt(a->rr));
}

static double acc_rel_l1(const acc_t* a) { return a->l1_ref > 0 ? a->l1_diff / a->l1_ref : a->l1_diff; }

/* float64 softmax attention of one query row over the keys `use` selects
 * (use == NULL: all causally visible keys). */
static void reference_row(const options_t* o, const host_inputs_t* in, double scale, int64_t b, int64_t h,
                          int64_t i, const uint8_t* use, double* logits, double* out) {
  const int64_t D = o->D, Lkv = o->Lkv, hk = h / (o->H / o->Hkv);
  const float* q = in->q + ((b * o->H + h) * o->L + i) * D;
  int64_t last = o->causal ? i + (Lkv - o->L) : Lkv - 1;
  int64_t j, d;
  double m = -INFINITY, l = 0.0;
  if (last > Lkv - 1) last = Lkv - 1;
  for (d = 0; d < D; ++d) out[d] = 0.0;
  for (j = 0; j <= last; ++j) {
    const float* k = in->k + ((b * o->Hkv + hk) * Lkv + j) * D;
    double s = 0.0;
    if (use && !use[j]) continue;
    for (d = 0; d < D; ++d) s += (double)q[d] * k[d];
    logits[j] = s * scale;
    if (logits[j] > m) m = logits[j];
  }
  if (m == -INFINITY) return; /* no key: zeros */
  for (j = 0; j <= last; ++j) {
    const float* v = in->v + ((b * o->Hkv + hk) * Lkv + j) * D;
    double p;
    if (use && !use[j]) continue;
    p = exp(logits[j] - m);
    l += p;
    for (d = 0; d < D; ++d) out[d] += p * v[d];
  }
  for (d = 0; d < D; ++d) out[d] /= l;
}

/* ------------------------------------------------------------------ timing */

typedef struct {
  int cuda;
#ifdef SPARGE_TOOL_CUDA
  cudaStream_t stream;
  cudaEvent_t ev0, ev1;
#endif
  void* stream_ptr;
} timer_ctx_t;

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
  sparge_plan_t plan;
  sparge_tensor_t q, k, v, out_sparse, out_dense, mask_pred, mask_ones, kept;
  sparge_predict_params_t params;
  void* ws;
  size_t ws_bytes;
  void* stream;
} run_ctx_t;

enum { kPredict, kSparse, kSparseGivenMask, kDense, kNumCalls };
static const char* const kCallNames[kNumCalls] = {"predict_mask", "sparse (predict + attention)",
                                                  "sparse (attention, given mask)", "dense (all-ones mask)"};

static void one_call(const run_ctx_t* c, int which) {
  switch (which) {
    case kPredict:
      check(sparge_predict_mask(c->plan, &c->q, &c->k, &c->params, &c->mask_pred, &c->kept, c->ws, c->ws_bytes,
                                c->stream),
            "sparge_predict_mask");
      break;
    case kSparse:
      check(sparge_attention_run(c->plan, &c->q, &c->k, &c->v, NULL, &c->params, &c->out_sparse, NULL, c->ws,
                                 c->ws_bytes, c->stream),
            "sparge_attention_run (mask predicted inside)");
      break;
    case kSparseGivenMask:
      check(sparge_attention_run(c->plan, &c->q, &c->k, &c->v, &c->mask_pred, &c->params, &c->out_sparse, NULL,
                                 c->ws, c->ws_bytes, c->stream),
            "sparge_attention_run (predicted mask)");
      break;
    default:
      check(sparge_attention_run(c->plan, &c->q, &c->k, &c->v, &c->mask_ones, &c->params, &c->out_dense, NULL,
                                 c->ws, c->ws_bytes, c->stream),
            "sparge_attention_run (all-ones mask)");
      break;
  }
}

/* Seconds per call: `warmup` untimed calls, then `iters` timed ones (CUDA
 * events on the stream for GPU plans, the monotonic clock for CPU plans). */
static double time_call(const run_ctx_t* c, timer_ctx_t* t, int which, int warmup, int iters) {
  int i;
  double sec = 0.0;
  for (i = 0; i < warmup; ++i) {
    if (!t->cuda) progress(kCallNames[which], i + 1, warmup + iters);
    one_call(c, which);
  }
  if (t->cuda) {
#ifdef SPARGE_TOOL_CUDA
    float ms = 0.f;
    cuda_check(cudaEventRecord(t->ev0, t->stream), "cudaEventRecord");
    for (i = 0; i < iters; ++i) one_call(c, which);
    cuda_check(cudaEventRecord(t->ev1, t->stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(t->ev1), "cudaEventSynchronize (a kernel failed?)");
    cuda_check(cudaEventElapsedTime(&ms, t->ev0, t->ev1), "cudaEventElapsedTime");
    sec = (double)ms * 1e-3;
#endif
  } else {
    double t0 = now_seconds();
    for (i = 0; i < iters; ++i) {
      progress(kCallNames[which], warmup + i + 1, warmup + iters);
      one_call(c, which);
    }
    sec = now_seconds() - t0;
  }
  return sec / iters;
}

/* ------------------------------------------------------------------ main */

static void print_time(double sec) {
  if (sec < 1e-3)
    say("%10.1f us", sec * 1e6);
  else if (sec < 1.0)
    say("%10.3f ms", sec * 1e3);
  else
    say("%10.3f s ", sec);
}

/* `sparge tune ARGS`: python3 -m sparge tune ARGS (the tuner is Python: numpy, the yardstick). */
static int run_tune(int argc, char** argv) {
  const char* py = getenv("SPARGE_PYTHON");
  char** args = (char**)calloc((size_t)argc + 4, sizeof(char*));
  int i;
  if (!py || !*py) py = "python3";
  if (!args) die(1, "out of memory");
  args[0] = (char*)py;
  args[1] = (char*)"-m";
  args[2] = (char*)"sparge";
  for (i = 1; i < argc; ++i) args[2 + i] = argv[i];
  execvp(py, args);
  fprintf(stderr, "sparge tune: cannot run %s -m sparge tune (set SPARGE_PYTHON, install the sparge Python package)\n",
          py);
  return 1;
}

int main(int argc, char** argv) {
  options_t o;
  sparge_problem_t prob = SPARGE_PROBLEM_INIT;
  sparge_problem_t resolved = SPARGE_PROBLEM_INIT;
  run_ctx_t c;
  timer_ctx_t tm;
  host_inputs_t in;
  int64_t qst[4], kst[4], shape_q[4], shape_kv[4], mshape[4], mstride[4], kshape[2], kstride[2];
  int64_t nQB, nKB, visible = 0, b, h, i, pairs = 0;
  sparge_device_type_t dev;
  sparge_dtype_t dt;
  int cuda, major, minor, patch, which;
  size_t qn, kvn, esz, mask_bytes;
  buf_t dq, dk, dv, dos, dod, dmask, dones, dkept, dws;
  void *hq, *hk, *hv, *hos, *hod;
  if (argc >= 2 && !strcmp(argv[1], "tune")) return run_tune(argc, argv);
  uint8_t* hmask;
  int32_t* hkept;
  double sec[kNumCalls], flops, density, kmin = 1e300, kmax = -1e300;
  long long kept_total = 0;
  acc_t acc_sparse, acc_dense, acc_own;
  int min_cos_failed = 0;
  char devname[320] = "cpu (reference backend)";

  setvbuf(stdout, NULL, _IOLBF, 0); /* ordered with stderr when both go to one pipe */
  g_t0 = now_seconds();
  parse_args(argc, argv, &o);
  sparge_version(&major, &minor, &patch);
  say("sparge %d.%d.%d (CUDA backend: %s)\n", major, minor, patch, sparge_has_cuda() ? "yes" : "no");
  resolve_defaults(&o);
  dev = (sparge_device_type_t)o.device;
  dt = (sparge_dtype_t)o.dtype;
  cuda = dev == SPARGE_DEVICE_CUDA;
  memset(&c, 0, sizeof(c));
  memset(&tm, 0, sizeof(tm));
  tm.cuda = cuda;


#ifdef SPARGE_TOOL_CUDA
  if (cuda) {
    struct cudaDeviceProp prop;
    int n = cuda_device_count();
    if (n <= 0) {
      die(1, "--device cuda: %s", no_gpu_reason());
    } else {
      if (o.device_id >= n) die(1, "--device cuda:%d: only %d CUDA device(s) present", o.device_id, n);
      cuda_check(cudaSetDevice(o.device_id), "cudaSetDevice");
      cuda_check(cudaGetDeviceProperties(&prop, o.device_id), "cudaGetDeviceProperties");
      snprintf(devname, sizeof(devname), "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor,
               prop.multiProcessorCount);
      say("device    : cuda:%d %s (sm_%d%d, %d SMs)\n", o.device_id, prop.name, prop.major, prop.minor,
             prop.multiProcessorCount);
    }
  }
#endif
  if (!cuda) say("device    : cpu (reference backend)\n");

  /* ---- plan */
  prob.batch = o.B;
  prob.heads_q = o.H;
  prob.heads_kv = o.Hkv;
  prob.len_q = o.L;
  prob.len_kv = o.Lkv;
  prob.head_dim = o.D;
  prob.dtype = dt;
  prob.device_type = dev;
  prob.device_id = o.device_id;
  prob.precision = (sparge_precision_t)o.precision;
  prob.causal = o.causal;
  check(sparge_create_plan(&prob, &c.plan), "sparge_create_plan");
  check(sparge_plan_get_problem(c.plan, &resolved), "sparge_plan_get_problem");
  check(sparge_plan_workspace_size(c.plan, &c.ws_bytes), "sparge_plan_workspace_size");
  check(sparge_plan_visible_blocks(c.plan, &visible), "sparge_plan_visible_blocks");
  nQB = (o.L + resolved.block_q - 1) / resolved.block_q;
  nKB = (o.Lkv + resolved.block_k - 1) / resolved.block_k;

  c.params.struct_size = sizeof(c.params);
  {
    sparge_predict_params_t def = SPARGE_PREDICT_PARAMS_INIT;
    c.params = def;
  }
  c.params.mode = o.use_cdf ? SPARGE_SELECT_CDF : SPARGE_SELECT_TOPK;
  c.params.topk = o.topk;
  c.params.cdf_threshold = o.cdf;
  c.params.sim_threshold = o.sim_threshold;
  c.params.smooth_k = o.smooth_k;
  c.params.attention_sink = o.sink;
  c.params.local_window = o.window;
  c.params.estimator = (sparge_estimator_t)o.estimator;

  say("problem   : B=%lld Hq=%lld Hkv=%lld Lq=%lld Lkv=%lld D=%lld %s, layout %s, %s, scale %.6g\n",
         (long long)o.B, (long long)o.H, (long long)o.Hkv, (long long)o.L, (long long)o.Lkv, (long long)o.D,
         dtype_name(dt), o.nhd ? "nhd" : "hnd", o.causal ? "causal" : "non-causal", (double)resolved.scale);
  if (o.use_cdf)
    say("sparsity  : precision %s, select cdf %.3g", precision_name(resolved.precision), (double)o.cdf);
  else
    say("sparsity  : precision %s, select topk %.3g", precision_name(resolved.precision), (double)o.topk);
  say(", sim_threshold %.3g, smooth_k %d, sink %d, window %d, estimator %s%s\n", (double)o.sim_threshold, o.smooth_k,
      o.sink >= 0 ? o.sink : 1, o.window >= 0 ? o.window : (o.causal ? 2 : 1),
      estimator_name(resolved_estimator(o.estimator, o.causal)), o.estimator == SPARGE_ESTIMATOR_AUTO ? " (auto)" : "");
  say("inputs    : %s, seed %llu\n", o.data_random ? "i.i.d. normal" : "clustered (runs of 256 tokens, 8 directions)",
         (unsigned long long)o.seed);
  say("workspace : %.2f MiB\n", (double)c.ws_bytes / (1024.0 * 1024.0));
  {
    sparge_kernel_info_t ki;
    memset(&ki, 0, sizeof ki);
    ki.struct_size = sizeof ki;
    check(sparge_plan_kernel_info(c.plan, &ki), "sparge_plan_kernel_info");
    if (strcmp(ki.family, "cpu") == 0)
      say("kernel    : cpu reference\n");
    else
      say("kernel    : %s family, %s (compute capability %d.%d): %d query rows x %d keys per step, %d stages, "
          "%d threads, %d B shared memory\n",
          ki.family, ki.name, ki.sm_version / 10, ki.sm_version % 10, ki.block_q, ki.keys_per_step, ki.stages,
          ki.threads, ki.smem_bytes);
  }

  /* ---- inputs */
  generate(&o, &in);
  layout_strides(o.nhd, o.H, o.L, o.D, qst);
  layout_strides(o.nhd, o.Hkv, o.Lkv, o.D, kst);
  shape_q[0] = o.B; shape_q[1] = o.H; shape_q[2] = o.L; shape_q[3] = o.D;
  shape_kv[0] = o.B; shape_kv[1] = o.Hkv; shape_kv[2] = o.Lkv; shape_kv[3] = o.D;
  esz = dtype_bytes(dt);
  qn = (size_t)(o.B * o.H * o.L * o.D);
  kvn = (size_t)(o.B * o.Hkv * o.Lkv * o.D);
  hq = pack(in.q, o.B, o.H, o.L, o.D, qst, dt);
  hk = pack(in.k, o.B, o.Hkv, o.Lkv, o.D, kst, dt);
  hv = pack(in.v, o.B, o.Hkv, o.Lkv, o.D, kst, dt);

  dq = buf_alloc(cuda, qn * esz);
  dk = buf_alloc(cuda, kvn * esz);
  dv = buf_alloc(cuda, kvn * esz);
  dos = buf_alloc(cuda, qn * esz);
  dod = buf_alloc(cuda, qn * esz);
  mask_bytes = (size_t)(o.B * o.H * nQB * nKB);
  dmask = buf_alloc(cuda, mask_bytes);
  dones = buf_alloc(cuda, mask_bytes);
  dkept = buf_alloc(cuda, (size_t)(o.B * o.H) * sizeof(int32_t));
  dws = buf_alloc(cuda, c.ws_bytes);
  buf_upload(&dq, hq, qn * esz);
  buf_upload(&dk, hk, kvn * esz);
  buf_upload(&dv, hv, kvn * esz);
  buf_fill(&dos, 0);
  buf_fill(&dod, 0);
  buf_fill(&dmask, 0);
  buf_fill(&dones, 1);
  c.ws = dws.ptr;

  c.q = make_tensor(dq.ptr, dev, o.device_id, dt, 4, shape_q, qst);
  c.k = make_tensor(dk.ptr, dev, o.device_id, dt, 4, shape_kv, kst);
  c.v = make_tensor(dv.ptr, dev, o.device_id, dt, 4, shape_kv, kst);
  c.out_sparse = make_tensor(dos.ptr, dev, o.device_id, dt, 4, shape_q, qst);
  c.out_dense = make_tensor(dod.ptr, dev, o.device_id, dt, 4, shape_q, qst);
  mshape[0] = o.B; mshape[1] = o.H; mshape[2] = nQB; mshape[3] = nKB;
  mstride[0] = o.H * nQB * nKB; mstride[1] = nQB * nKB; mstride[2] = nKB; mstride[3] = 1;
  c.mask_pred = make_tensor(dmask.ptr, dev, o.device_id, SPARGE_DTYPE_UINT8, 4, mshape, mstride);
  c.mask_ones = make_tensor(dones.ptr, dev, o.device_id, SPARGE_DTYPE_UINT8, 4, mshape, mstride);
  kshape[0] = o.B; kshape[1] = o.H; kstride[0] = o.H; kstride[1] = 1;
  c.kept = make_tensor(dkept.ptr, dev, o.device_id, SPARGE_DTYPE_INT32, 2, kshape, kstride);

#ifdef SPARGE_TOOL_CUDA
  if (cuda) {
    cuda_check(cudaStreamCreateWithFlags(&tm.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaEventCreate(&tm.ev0), "cudaEventCreate");
    cuda_check(cudaEventCreate(&tm.ev1), "cudaEventCreate");
    c.stream = (void*)tm.stream;
  }
#endif

  /* ---- runs (predict first: the given-mask run reads its mask) */
  for (which = 0; which < kNumCalls; ++which) sec[which] = time_call(&c, &tm, which, o.warmup, o.iters);
#ifdef SPARGE_TOOL_CUDA
  if (cuda) cuda_check(cudaStreamSynchronize(tm.stream), "cudaStreamSynchronize");
#endif
  /* The timed given-mask run overwrote out_sparse; recompute it the way the
   * main path does (mask predicted inside) so the accuracy is that of mask=NULL. */
  one_call(&c, kSparse);
#ifdef SPARGE_TOOL_CUDA
  if (cuda) cuda_check(cudaStreamSynchronize(tm.stream), "cudaStreamSynchronize");
#endif

  /* ---- results back to the host */
  hos = xmalloc(qn * esz);
  hod = xmalloc(qn * esz);
  hmask = (uint8_t*)xmalloc(mask_bytes);
  hkept = (int32_t*)xmalloc((size_t)(o.B * o.H) * sizeof(int32_t));
  buf_download(&dos, hos, qn * esz);
  buf_download(&dod, hod, qn * esz);
  buf_download(&dmask, hmask, mask_bytes);
  buf_download(&dkept, hkept, (size_t)(o.B * o.H) * sizeof(int32_t));

  for (i = 0; i < o.B * o.H; ++i) {
    double dens = visible > 0 ? (double)hkept[i] / (double)visible : 0.0;
    kept_total += hkept[i];
    if (dens < kmin) kmin = dens;
    if (dens > kmax) kmax = dens;
  }
  density = visible > 0 ? (double)kept_total / ((double)visible * (double)(o.B * o.H)) : 0.0;
  say("blocks    : %dx%d, %lldx%lld per head, %lld visible; density %.4f "
         "(per head %.4f .. %.4f)\n",
         resolved.block_q, resolved.block_k, (long long)nQB, (long long)nKB, (long long)visible, density, kmin,
         kmax);

  /* ---- accuracy on sampled rows */
  memset(&acc_sparse, 0, sizeof(acc_sparse));
  memset(&acc_dense, 0, sizeof(acc_dense));
  memset(&acc_own, 0, sizeof(acc_own));
  {
    double* logits = (double*)xmalloc(sizeof(double) * (size_t)o.Lkv);
    double* ref = (double*)xmalloc(sizeof(double) * (size_t)o.D);
    double* ref_mask = (double*)xmalloc(sizeof(double) * (size_t)o.D);
    uint8_t* use = (uint8_t*)xmalloc((size_t)o.Lkv);
    float* row = (float*)xmalloc(sizeof(float) * (size_t)o.D);
    rng_t r;
    int s, nrows = o.rows;
    int64_t total = o.B * o.H * o.L, j, d;
    r.s = o.seed ^ 0xa5a5a5a5deadbeefull;
    if ((int64_t)nrows > total) nrows = (int)total;
    for (s = 0; s < nrows; ++s) {
      int64_t flat = (nrows == total) ? s : (int64_t)(rng_next(&r) % (uint64_t)total);
      size_t base;
      progress("float64 reference rows", s + 1, nrows);
      b = flat / (o.H * o.L);
      h = (flat / o.L) % o.H;
      i = flat % o.L;
      base = (size_t)(b * qst[0] + h * qst[1] + i * qst[2]);
      reference_row(&o, &in, (double)resolved.scale, b, h, i, NULL, logits, ref);
      for (j = 0; j < o.Lkv; ++j)
        use[j] = hmask[((b * o.H + h) * nQB + i / resolved.block_q) * nKB + j / resolved.block_k];
      reference_row(&o, &in, (double)resolved.scale, b, h, i, use, logits, ref_mask);
      for (d = 0; d < o.D; ++d) row[d] = load_elem(hod, base + (size_t)d, dt);
      acc_add(&acc_dense, row, ref, o.D);
      for (d = 0; d < o.D; ++d) row[d] = load_elem(hos, base + (size_t)d, dt);
      acc_add(&acc_sparse, row, ref, o.D);
      acc_add(&acc_own, row, ref_mask, o.D);
    }
    say("accuracy  : %d sampled rows vs a float64 reference of the same (rounded) inputs\n", nrows);
    free(logits);
    free(ref);
    free(ref_mask);
    free(use);
    free(row);
  }

  /* ---- report */
  progress_clear();
  for (i = 0; i < o.L; ++i) {
    int64_t last = o.causal ? i + (o.Lkv - o.L) : o.Lkv - 1;
    if (last > o.Lkv - 1) last = o.Lkv - 1;
    if (last >= 0) pairs += last + 1;
  }
  flops = 4.0 * (double)o.B * (double)o.H * (double)o.D * (double)pairs;
  say("\n%-32s %13s %11s %11s %9s\n", "call", "time/call", "eff. TOPS", "cos (f64)", "rel L1");
  for (which = 0; which < kNumCalls; ++which) {
    say("%-32s ", kCallNames[which]);
    print_time(sec[which]);
    if (which == kPredict) {
      say("\n");
      continue;
    }
    {
      double tops = sec[which] > 0 ? flops / sec[which] * 1e-12 : 0.0;
      say(tops < 10.0 ? " %11.4f" : " %11.1f", tops);
    }
    if (which == kSparse)
      say(" %11.6f %9.5f", acc_cos(&acc_sparse), acc_rel_l1(&acc_sparse));
    else if (which == kDense)
      say(" %11.6f %9.5f", acc_cos(&acc_dense), acc_rel_l1(&acc_dense));
    say("\n");
  }
  say("\nspeedup   : dense / sparse %.2fx end to end, %.2fx attention only; prediction is %.1f%% of dense\n",
         sec[kDense] / sec[kSparse], sec[kDense] / sec[kSparseGivenMask], 100.0 * sec[kPredict] / sec[kDense]);
  say("kernel    : sparse vs exact attention on its own predicted mask: cos %.6f, rel L1 %.5f\n",
         acc_cos(&acc_own), acc_rel_l1(&acc_own));
  say("timing    : %d warmup + %d timed call(s) each, %s; eff. TOPS = dense FLOPs (4*B*Hq*D*visible "
         "token pairs) / time\n",
         o.warmup, o.iters, cuda ? "CUDA events on a non-blocking stream" : "monotonic clock");

  if (g_format != FMT_TEXT) {
    char devstr[32];
    double cos_v[kNumCalls], l1_v[kNumCalls], tops_v[kNumCalls];
    for (which = 0; which < kNumCalls; ++which) {
      cos_v[which] = l1_v[which] = NAN;
      tops_v[which] = which == kPredict || sec[which] <= 0 ? NAN : flops / sec[which] * 1e-12;
    }
    snprintf(devstr, sizeof(devstr), cuda ? "cuda:%d" : "cpu", o.device_id);
    cos_v[kSparse] = acc_cos(&acc_sparse);
    l1_v[kSparse] = acc_rel_l1(&acc_sparse);
    cos_v[kDense] = acc_cos(&acc_dense);
    l1_v[kDense] = acc_rel_l1(&acc_dense);
    if (g_format == FMT_CSV) {
      printf("call,seconds,eff_tops,cos_f64,rel_l1,density,device,B,Hq,Hkv,Lq,Lkv,D,dtype,layout,causal,precision,"
             "select,topk,cdf,version\n");
      for (which = 0; which < kNumCalls; ++which) {
        printf("%s,%.9g,", kCallNames[which], sec[which]);
        if (tops_v[which] == tops_v[which]) printf("%.6g", tops_v[which]);
        printf(",");
        if (cos_v[which] == cos_v[which]) printf("%.9f,%.9f", cos_v[which], l1_v[which]);
        else printf(",");
        printf(",%.6f,%s,%lld,%lld,%lld,%lld,%lld,%lld,%s,%s,%d,%s,%s,%.6g,%.6g,%d.%d.%d\n", density, devstr,
               (long long)o.B, (long long)o.H,
               (long long)o.Hkv, (long long)o.L, (long long)o.Lkv, (long long)o.D, dtype_name(dt),
               o.nhd ? "nhd" : "hnd", o.causal, precision_name(resolved.precision), o.use_cdf ? "cdf" : "topk",
               (double)o.topk, (double)o.cdf, major, minor, patch);
      }
    } else {
      const char* p;
      printf("{\"version\": \"%d.%d.%d\", \"cuda_backend\": %s, \"device\": \"", major, minor, patch,
             sparge_has_cuda() ? "true" : "false");
      printf("%s\", \"device_name\": \"", devstr);
      for (p = devname; *p; ++p) {
        if (*p == '"' || *p == '\\') putchar('\\');
        if ((unsigned char)*p >= 0x20) putchar(*p);
      }
      printf("\",\n \"problem\": {\"B\": %lld, \"Hq\": %lld, \"Hkv\": %lld, \"Lq\": %lld, \"Lkv\": %lld, "
             "\"D\": %lld, \"dtype\": \"%s\", \"layout\": \"%s\", \"causal\": %s, \"scale\": %.9g},\n",
             (long long)o.B, (long long)o.H, (long long)o.Hkv, (long long)o.L, (long long)o.Lkv, (long long)o.D,
             dtype_name(dt), o.nhd ? "nhd" : "hnd", o.causal ? "true" : "false", (double)resolved.scale);
      printf(" \"sparsity\": {\"precision\": \"%s\", \"select\": \"%s\", \"topk\": %.9g, \"cdf\": %.9g, "
             "\"sim_threshold\": %.9g, \"smooth_k\": %s, \"sink\": %s, \"estimator\": \"%s\"},\n",
             precision_name(resolved.precision), o.use_cdf ? "cdf" : "topk", (double)o.topk, (double)o.cdf,
             (double)o.sim_threshold, o.smooth_k ? "true" : "false", o.sink ? "true" : "false",
             estimator_name(resolved_estimator(o.estimator, o.causal)));
      printf(" \"inputs\": {\"data\": \"%s\", \"seed\": %llu}, \"workspace_bytes\": %zu,\n",
             o.data_random ? "random" : "clustered", (unsigned long long)o.seed, c.ws_bytes);
      printf(" \"blocks\": {\"block_q\": %d, \"block_k\": %d, \"q_blocks\": %lld, \"k_blocks\": %lld, "
             "\"visible_per_head\": %lld, \"density\": %.9g, \"density_min\": %.9g, \"density_max\": %.9g},\n",
             resolved.block_q, resolved.block_k, (long long)nQB, (long long)nKB, (long long)visible, density, kmin,
             kmax);
      printf(" \"calls\": [");
      for (which = 0; which < kNumCalls; ++which) {
        printf("%s\n  {\"name\": \"%s\", \"seconds\": %.9g", which ? "," : "", kCallNames[which], sec[which]);
        if (tops_v[which] == tops_v[which]) printf(", \"eff_tops\": %.6g", tops_v[which]);
        if (cos_v[which] == cos_v[which]) printf(", \"cos_f64\": %.9f, \"rel_l1\": %.9f", cos_v[which], l1_v[which]);
        printf("}");
      }
      printf("],\n \"speedup_end_to_end\": %.6g, \"speedup_attention\": %.6g, \"prediction_share\": %.6g,\n",
             sec[kDense] / sec[kSparse], sec[kDense] / sec[kSparseGivenMask], sec[kPredict] / sec[kDense]);
      printf(" \"kernel_on_own_mask\": {\"cos_f64\": %.9f, \"rel_l1\": %.9f}, \"accuracy_rows\": %d,\n",
             acc_cos(&acc_own), acc_rel_l1(&acc_own), o.rows < o.B * o.H * o.L ? o.rows : (int)(o.B * o.H * o.L));
      printf(" \"timing\": {\"warmup\": %d, \"iters\": %d, \"clock\": \"%s\"}}\n", o.warmup, o.iters,
             cuda ? "cuda_events" : "monotonic");
    }
    fflush(stdout);
  }

  if (o.min_cos >= 0.0) {
    if (acc_cos(&acc_dense) < o.min_cos || acc_cos(&acc_own) < o.min_cos) {
      fflush(stdout);
      fprintf(stderr, "sparge: accuracy gate missed: dense cos %.6f, sparse-on-own-mask cos %.6f, need >= %.6f\n",
              acc_cos(&acc_dense), acc_cos(&acc_own), o.min_cos);
      min_cos_failed = 1;
    }
  }

  /* ---- cleanup */
#ifdef SPARGE_TOOL_CUDA
  if (cuda) {
    cudaEventDestroy(tm.ev0);
    cudaEventDestroy(tm.ev1);
    cudaStreamDestroy(tm.stream);
  }
#endif
  buf_free(&dq);
  buf_free(&dk);
  buf_free(&dv);
  buf_free(&dos);
  buf_free(&dod);
  buf_free(&dmask);
  buf_free(&dones);
  buf_free(&dkept);
  buf_free(&dws);
  sparge_destroy_plan(c.plan);
  free(hq);
  free(hk);
  free(hv);
  free(hos);
  free(hod);
  free(hmask);
  free(hkept);
  free(in.q);
  free(in.k);
  free(in.v);
  return min_cos_failed ? 3 : 0;
}
