// sparge_bench: times libsparge through its C API with CUDA events.
//
// Workloads: B x H heads, D in {128, 64}, N in {8K, 16K, 32K} (64K with --n64k),
// causal and not. Modes per workload:
//   dense      int8_fp8 attention on an all-ones block mask
//   d0.5 ...   int8_fp8 attention on random block masks of that density
//              (over causally visible blocks)
//   predict    mask prediction alone (topk)
//   pred+attn  attention with the mask predicted inside (mask = NULL, topk)
//   fp16       fp16-mode attention on an all-ones mask
//   fp16sparse fp16-mode attention on random block masks of density 0.5, 0.2,
//              0.1 (ratio and target against fp16-mode dense)
//   splitv     int8_fp8_split_v attention on an all-ones mask
//   full       int8_fp8 dense attention as a call without a mask and with top-k 1
//              (no prediction, no index lists); ratio against `dense`
//   fp16full   the same in fp16 mode, against fp16-mode `dense` (runs `fp16`)
//   i8f16      int8_fp16 attention on an all-ones mask
//   i8f16sparse int8_fp16 attention on random block masks of density 0.5, 0.2,
//              0.1 (ratio and target against int8_fp16 dense)
// Each measurement: warm-up, then the median of many iterations (each timed by
// its own pair of events), rotating among several input sets when one set is
// small against the L2 cache. Prints a markdown table; --csv writes CSV.
//
// TOPS columns: dense-equivalent work is 4*B*H*Lq*Lkv*D, halved for causal;
// "work" multiplies that by the block density actually computed.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_kernels.hpp"
#include "sparge/sparge.h"

namespace {

struct Options {
  std::vector<int64_t> ns = {8192, 16384, 32768};
  std::vector<int64_t> ds = {128, 64};
  std::vector<int> causal = {0, 1};
  std::vector<std::string> modes = {"dense",     "d0.5", "d0.2",       "d0.1",
                                    "predict",   "pred+attn", "fp16", "fp16sparse", "splitv",
                                    "i8f16",     "i8f16sparse", "full", "fp16full"};
  int64_t batch = 1, heads = 32, kv_heads = 0;  // kv_heads 0: = heads
  sparge_dtype_t dtype = SPARGE_DTYPE_BFLOAT16;
  float topk = 0.5f;
  float q_split = -1.0f;  // < 0: independent normal Q rows
  sparge_estimator_t estimator = SPARGE_ESTIMATOR_KEYS_LSE;
  int warmup = 3, min_iters = 10, max_iters = 100;
  double target_ms = 250;
  std::string csv, tag;
  bool lse = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    const size_t q = s.find(',', p);
    const std::string t = s.substr(p, q == std::string::npos ? std::string::npos : q - p);
    if (!t.empty()) out.push_back(t);
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return out;
}

int64_t parse_n(const std::string& t) {
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (end && (*end == 'k' || *end == 'K')) v *= 1024;
  return static_cast<int64_t>(v);
}

void usage() {
  std::printf(
      "usage: sparge_bench [options]\n"
      "  --n LIST          sequence lengths, e.g. 8k,16k,32k (default)\n"
      "  --n64k            add N = 64K\n"
      "  --d LIST          head dims (default 128,64)\n"
      "  --causal LIST     0,1 (default both)\n"
      "  --modes LIST      dense,d0.5,d0.2,d0.1,predict,pred+attn,fp16,fp16sparse,splitv,\n"
      "                    i8f16,i8f16sparse,full,fp16full (default all)\n"
      "  --heads H         (32)   --batch B (1)   --dtype bf16|fp16 (bf16)\n"
      "  --kv-heads H      K/V heads (default: --heads; GQA when fewer, a divisor of --heads)\n"
      "  --topk T          prediction top-k fraction (0.5)\n"
      "  --estimator E     keys_lse (default), keys_lse_split2, keys_lse_adaptive, mean or auto (the library's\n"
      "                    default: keys_lse_adaptive when not causal, keys_lse when causal)\n"
      "  --q-split S       Q with 128-row block structure: one cluster per block, two in a share S\n"
      "                    of the blocks (0..1; default: independent normal rows)\n"
      "  --lse             also write the LSE output\n"
      "  --warmup N (3)  --min-iters N (10)  --max-iters N (100)  --target-ms T (250)\n"
      "  --quick           N=8K, D=128, non-causal, warmup 1, 3..5 iterations\n"
      "  --csv FILE        write the results as CSV\n"
      "  --tag TEXT        free text (e.g. the commit) for the CSV and the header\n");
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--n") {
      o.ns.clear();
      for (auto& t : split(next())) o.ns.push_back(parse_n(t));
    } else if (a == "--n64k") {
      o.ns.push_back(65536);
    } else if (a == "--d") {
      o.ds.clear();
      for (auto& t : split(next())) o.ds.push_back(std::atoll(t.c_str()));
    } else if (a == "--causal") {
      o.causal.clear();
      for (auto& t : split(next())) o.causal.push_back(std::atoi(t.c_str()));
    } else if (a == "--modes") {
      o.modes = split(next());
    } else if (a == "--heads") {
      o.heads = std::atoll(next().c_str());
    } else if (a == "--kv-heads") {
      o.kv_heads = std::atoll(next().c_str());
    } else if (a == "--batch") {
      o.batch = std::atoll(next().c_str());
    } else if (a == "--dtype") {
      const std::string t = next();
      o.dtype = t == "fp16" ? SPARGE_DTYPE_FLOAT16 : SPARGE_DTYPE_BFLOAT16;
    } else if (a == "--q-split") {
      o.q_split = static_cast<float>(std::atof(next().c_str()));
    } else if (a == "--topk") {
      o.topk = static_cast<float>(std::atof(next().c_str()));
    } else if (a == "--estimator") {
      const std::string e = next();
      if (e == "keys_lse") {
        o.estimator = SPARGE_ESTIMATOR_KEYS_LSE;
      } else if (e == "keys_lse_split2") {
        o.estimator = SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2;
      } else if (e == "keys_lse_adaptive") {
        o.estimator = SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
      } else if (e == "mean") {
        o.estimator = SPARGE_ESTIMATOR_MEAN;
      } else if (e == "auto") {
        o.estimator = SPARGE_ESTIMATOR_AUTO;
      } else {
        std::fprintf(stderr, "--estimator: keys_lse, keys_lse_split2, keys_lse_adaptive, mean or auto, got %s\n",
                     e.c_str());
        return false;
      }
    } else if (a == "--lse") {
      o.lse = true;
    } else if (a == "--warmup") {
      o.warmup = std::atoi(next().c_str());
    } else if (a == "--min-iters") {
      o.min_iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--max-iters") {
      o.max_iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--target-ms") {
      o.target_ms = std::atof(next().c_str());
    } else if (a == "--quick") {
      o.ns = {8192}, o.ds = {128}, o.causal = {0};
      o.warmup = 1, o.min_iters = 3, o.max_iters = 5;
    } else if (a == "--csv") {
      o.csv = next();
    } else if (a == "--tag") {
      o.tag = next();
    } else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      usage();
      return false;
    }
  }
  if (o.max_iters < o.min_iters) o.max_iters = o.min_iters;
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  if (o.heads < 1 || o.kv_heads < 1 || o.heads % o.kv_heads != 0) {
    std::fprintf(stderr, "--kv-heads %lld must divide --heads %lld\n", static_cast<long long>(o.kv_heads),
                 static_cast<long long>(o.heads));
    return false;
  }
  return true;
}

// A CUDA failure in the harness itself is fatal (the numbers would mean nothing).
#define CK(call)                                                                                            \
  do {                                                                                                      \
    cudaError_t e_ = (call);                                                                                \
    if (e_ != cudaSuccess) {                                                                                \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));   \
      std::exit(1);                                                                                         \
    }                                                                                                       \
  } while (0)

struct Buf {
  void* p = nullptr;
  size_t n = 0;
  Buf() = default;
  explicit Buf(size_t bytes) : n(bytes) { CK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  ~Buf() {
    if (p) cudaFree(p);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
};

struct Row {
  int64_t N, D;
  int causal;
  std::string mode, precision;
  double density = 1, ms = NAN, tops_work = NAN, tops_dense = NAN, ratio = NAN;
  double host_us = NAN;  // median CPU time of the API call itself (enqueue only)
  int iters = 0, sets = 0;
  std::string target, note;
};

sparge_tensor_t desc(void* data, sparge_dtype_t t, int ndim, const int64_t* shape, const int64_t* strides) {
  sparge_tensor_t d;
  std::memset(&d, 0, sizeof d);
  d.data = data, d.device_type = SPARGE_DEVICE_CUDA, d.device_id = 0, d.dtype = t, d.ndim = ndim;
  for (int i = 0; i < ndim; ++i) d.shape[i] = shape[i], d.strides[i] = strides[i];
  return d;
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Times fn(set) with per-iteration events; returns the median in ms, or NaN when fn fails.
double time_median(const Options& o, int nsets, const std::function<bool(int)>& fn, cudaStream_t s, int* iters_out) {
  for (int w = 0; w < o.warmup; ++w)
    if (!fn(w % nsets)) return NAN;
  // One timed call estimates the iteration count that fills target_ms.
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, s));
  if (!fn(0)) return NAN;
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float est = 0;
  CK(cudaEventElapsedTime(&est, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  int iters = est > 0 ? static_cast<int>(o.target_ms / est) : o.max_iters;
  iters = std::min(std::max(iters, o.min_iters), o.max_iters);
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) CK(cudaEventCreate(&e));
  bool ok = true;
  for (int i = 0; i < iters && ok; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    ok = fn(i % nsets);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<float> t;
  for (int i = 0; ok && i < iters; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    t.push_back(ms);
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  if (!ok || t.empty()) return NAN;
  std::sort(t.begin(), t.end());
  *iters_out = iters;
  const size_t m = t.size() / 2;
  return t.size() % 2 ? t[m] : 0.5 * (t[m - 1] + t[m]);
}

int64_t visible_blocks(int64_t N, int64_t qb, int64_t nKB, bool causal) {
  if (!causal) return nKB;
  const int64_t last_row = std::min(qb * 128 + 127, N - 1);
  return std::min(last_row, N - 1) / 64 + 1;  // Lq == Lkv
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) return 2;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "sparge_bench: no CUDA device\n");
    return 77;
  }
  if (!sparge_has_cuda()) {
    std::fprintf(stderr, "sparge_bench: libsparge was built without CUDA\n");
    return 77;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int maj, min, pat;
  sparge_version(&maj, &min, &pat);
  std::printf("# sparge_bench: libsparge %d.%d.%d on %s (sm_%d%d, %d SMs, L2 %d MB)%s%s\n", maj, min, pat, prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20, o.tag.empty() ? "" : ", ",
              o.tag.c_str());
  std::printf("# B=%lld H=%lld Hkv=%lld dtype=%s topk=%.2f estimator=%s; median of per-iteration CUDA event times\n\n",
              static_cast<long long>(o.batch), static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads),
              o.dtype == SPARGE_DTYPE_FLOAT16 ? "fp16" : "bf16", o.topk,
              o.estimator == SPARGE_ESTIMATOR_KEYS_LSE          ? "keys_lse"
              : o.estimator == SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2   ? "keys_lse_split2"
              : o.estimator == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE ? "keys_lse_adaptive"
              : o.estimator == SPARGE_ESTIMATOR_AUTO              ? "auto"
                                                                  : "mean");
  if (o.q_split >= 0.f) std::printf("# Q: 128-row blocks of one cluster, two in a share %.2f of them\n\n", o.q_split);
  std::fflush(stdout);

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Buf nan_count(sizeof(unsigned long long));
  std::vector<Row> rows;
  int failures = 0;
  const bool fp16 = o.dtype == SPARGE_DTYPE_FLOAT16;
  auto has = [&](const std::string& m) { return std::find(o.modes.begin(), o.modes.end(), m) != o.modes.end(); };

  for (int64_t D : o.ds)
    for (int64_t N : o.ns)
      for (int causal : o.causal) {
        const int64_t B = o.batch, H = o.heads, HK = o.kv_heads, nQB = (N + 127) / 128, nKB = (N + 63) / 64;
        const size_t elems = static_cast<size_t>(B * H * N * D), elems_kv = static_cast<size_t>(B * HK * N * D);
        const size_t set_bytes = (elems + 2 * elems_kv) * 2;
        const size_t l2 = static_cast<size_t>(std::max(prop.l2CacheSize, 1));
        int nsets = 1;
        if (set_bytes < (size_t(2) << 30))
          nsets = static_cast<int>(std::max<size_t>(2, std::min<size_t>(4, (8 * l2 + set_bytes - 1) / set_bytes)));
        std::vector<Buf> qs, ks, vs;
        for (int i = 0; i < nsets; ++i) {
          qs.emplace_back(elems * 2), ks.emplace_back(elems_kv * 2), vs.emplace_back(elems_kv * 2);
          const uint64_t seed = mix64(static_cast<uint64_t>(N * 1000 + D * 10 + causal) ^ (i * 0x1234567ull));
          if (o.q_split >= 0.f)
            CK(bench_fill_blocks(static_cast<uint16_t*>(qs.back().p), elems, N, D, o.q_split, seed ^ 1, fp16, stream));
          else
            CK(bench_fill_normal(static_cast<uint16_t*>(qs.back().p), elems, seed ^ 1, 1.0f, fp16, stream));
          CK(bench_fill_normal(static_cast<uint16_t*>(ks.back().p), elems_kv, seed ^ 2, 1.0f, fp16, stream));
          CK(bench_fill_normal(static_cast<uint16_t*>(vs.back().p), elems_kv, seed ^ 3, 1.0f, fp16, stream));
        }
        Buf out(elems * 2), lse(static_cast<size_t>(B * H * N) * 4);
        const int64_t shape[4] = {B, H, N, D}, str[4] = {H * N * D, N * D, D, 1};
        const int64_t kshape[4] = {B, HK, N, D}, kstr[4] = {HK * N * D, N * D, D, 1};
        const int64_t lsh[3] = {B, H, N}, lst[3] = {H * N, N, 1};
        const int64_t msh[4] = {B, H, nQB, nKB}, mst[4] = {H * nQB * nKB, nQB * nKB, nKB, 1};
        const int64_t ksh[2] = {B, H}, kst[2] = {H, 1};
        std::vector<sparge_tensor_t> qd, kd, vd;
        for (int i = 0; i < nsets; ++i) {
          qd.push_back(desc(qs[i].p, o.dtype, 4, shape, str));
          kd.push_back(desc(ks[i].p, o.dtype, 4, kshape, kstr));
          vd.push_back(desc(vs[i].p, o.dtype, 4, kshape, kstr));
        }
        const sparge_tensor_t od = desc(out.p, o.dtype, 4, shape, str);
        const sparge_tensor_t ld = desc(lse.p, SPARGE_DTYPE_FLOAT32, 3, lsh, lst);

        sparge_problem_t pr = SPARGE_PROBLEM_INIT;
        pr.batch = B, pr.heads_q = H, pr.heads_kv = HK, pr.len_q = N, pr.len_kv = N, pr.head_dim = D;
        pr.dtype = o.dtype, pr.device_type = SPARGE_DEVICE_CUDA, pr.causal = causal;
        sparge_plan_t plan8 = nullptr, plan16 = nullptr, plan_sv = nullptr, plan_if = nullptr;
        pr.precision = SPARGE_PRECISION_INT8_FP8;
        const sparge_status_t s8 = sparge_create_plan(&pr, &plan8);
        const std::string e8 = s8 == SPARGE_OK ? "" : sparge_last_error();
        pr.precision = SPARGE_PRECISION_FP16;
        const sparge_status_t s16 = sparge_create_plan(&pr, &plan16);
        const std::string e16 = s16 == SPARGE_OK ? "" : sparge_last_error();
        pr.precision = SPARGE_PRECISION_INT8_FP8_SPLIT_V;
        const sparge_status_t ssv = sparge_create_plan(&pr, &plan_sv);
        const std::string esv = ssv == SPARGE_OK ? "" : sparge_last_error();
        pr.precision = SPARGE_PRECISION_INT8_FP16;
        const sparge_status_t sif = sparge_create_plan(&pr, &plan_if);
        const std::string eif = sif == SPARGE_OK ? "" : sparge_last_error();
        size_t w8 = 0, w16 = 0, wsv = 0, wif = 0;
        if (plan8) sparge_plan_workspace_size(plan8, &w8);
        if (plan16) sparge_plan_workspace_size(plan16, &w16);
        if (plan_sv) sparge_plan_workspace_size(plan_sv, &wsv);
        if (plan_if) sparge_plan_workspace_size(plan_if, &wif);
        Buf ws(std::max(std::max(w8, w16), std::max(wsv, wif)));

        // Block masks: all ones; random at each density over visible blocks.
        std::vector<int64_t> visible_rows(static_cast<size_t>(nQB));
        int64_t visible = 0;
        for (int64_t qb = 0; qb < nQB; ++qb) visible += visible_rows[qb] = visible_blocks(N, qb, nKB, causal);
        auto make_mask = [&](double d, double* got) {
          std::vector<uint8_t> m(static_cast<size_t>(B * H * nQB * nKB), 0);
          int64_t kept = 0;
          for (int64_t bh = 0; bh < B * H; ++bh)
            for (int64_t qb = 0; qb < nQB; ++qb)
              for (int64_t kb = 0; kb < visible_rows[qb]; ++kb) {
                const uint64_t r = mix64(static_cast<uint64_t>((bh * nQB + qb) * nKB + kb) ^ 0xabcdef);
                const bool on = d >= 1.0 || static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0) < d;
                m[static_cast<size_t>((bh * nQB + qb) * nKB + kb)] = on;
                kept += on;
              }
          *got = static_cast<double>(kept) / static_cast<double>(B * H * visible);
          Buf dm(m.size());
          CK(cudaMemcpy(dm.p, m.data(), m.size(), cudaMemcpyHostToDevice));
          return dm;
        };
        const double dense_flop = 4.0 * B * H * static_cast<double>(N) * N * D * (causal ? 0.5 : 1.0);
        sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
        prm.topk = o.topk;
        prm.estimator = o.estimator;
        double dense_ms = NAN, pred_density = NAN;

        auto emit = [&](Row r) {
          r.N = N, r.D = D, r.causal = causal;
          if (std::isfinite(r.ms)) {
            r.tops_dense = dense_flop / (r.ms * 1e-3) / 1e12;
            r.tops_work = r.tops_dense * r.density;
            if (std::isfinite(dense_ms) && r.mode != "dense" && !std::isfinite(r.ratio)) r.ratio = r.ms / dense_ms;
          }
          std::printf("  N=%-6lld D=%-4lld causal=%d %-10s %-9s density %.3f  %9.3f ms  %7.1f TOPS  host %6.1f us  %s\n",
                      static_cast<long long>(N), static_cast<long long>(D), causal, r.mode.c_str(),
                      r.precision.c_str(), r.density, r.ms, r.tops_work, r.host_us, r.note.c_str());
          std::fflush(stdout);
          rows.push_back(r);
        };
        // Poisons the output, then after the timing checks that it holds no NaN.
        auto poison = [&]() { CK(cudaMemsetAsync(out.p, 0xFF, elems * 2, stream)); };
        auto nan_check = [&](Row& r) {
          CK(cudaStreamSynchronize(stream));
          CK(bench_count_nan(static_cast<const uint16_t*>(out.p), elems, fp16, static_cast<unsigned long long*>(nan_count.p),
                             stream));
          unsigned long long n = 0;
          CK(cudaMemcpyAsync(&n, nan_count.p, sizeof n, cudaMemcpyDeviceToHost, stream));
          CK(cudaStreamSynchronize(stream));
          if (n) {
            r.note += " OUTPUT HAS " + std::to_string(n) + " NaN";
            ++failures;
          }
        };
        auto api_fail = [&](Row& r, sparge_status_t st) {
          r.note = std::string(sparge_status_string(st)) + ": " + sparge_last_error();
          ++failures;
        };

        auto run_attn = [&](sparge_plan_t plan, const sparge_tensor_t* mask, Row& r, size_t wsb) {
          sparge_status_t last = SPARGE_OK;
          poison();
          std::vector<double> host;
          r.ms = time_median(
              o, nsets,
              [&](int i) {
                const auto h0 = std::chrono::steady_clock::now();
                last = sparge_attention_run(plan, &qd[i], &kd[i], &vd[i], mask, &prm, &od, o.lse ? &ld : nullptr,
                                            ws.p, wsb, stream);
                host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count());
                return last == SPARGE_OK;
              },
              stream, &r.iters);
          if (!host.empty()) {
            std::nth_element(host.begin(), host.begin() + host.size() / 2, host.end());
            r.host_us = host[host.size() / 2];
          }
          r.sets = nsets;
          if (last != SPARGE_OK) return api_fail(r, last);
          CK(cudaGetLastError());
          nan_check(r);
        };

        // One random-mask row of density d: its ratio and its (d + 0.05) target
        // against `dense_ref` ms (the same precision's dense time).
        auto sparse_row = [&](sparge_plan_t plan, size_t wsb, const char* precision, double d, double dense_ref) {
          Row r;
          char name[16];
          std::snprintf(name, sizeof name, "d%g", d);
          r.mode = name, r.precision = precision;
          Buf m = make_mask(d, &r.density);
          const sparge_tensor_t mdd = desc(m.p, SPARGE_DTYPE_UINT8, 4, msh, mst);
          run_attn(plan, &mdd, r, wsb);
          if (std::isfinite(r.ms) && std::isfinite(dense_ref)) {
            r.ratio = r.ms / dense_ref;
            char t[64];
            std::snprintf(t, sizeof t, "<=%.2f %s", r.density + 0.05, r.ratio <= r.density + 0.05 ? "ok" : "MISS");
            r.target = t;
          }
          emit(r);
        };

        // Dense attention as a call without a mask and with top-k 1: the kernels enumerate the
        // visible blocks (no prediction, no lists); ratio against `dense_ref`, the same precision's
        // all-ones mask.
        auto full_row = [&](sparge_plan_t plan, size_t wsb, const char* precision, double dense_ref) {
          Row r;
          r.mode = "full", r.precision = precision, r.density = 1;
          const float keep = prm.topk;
          prm.topk = 1.0f;
          run_attn(plan, nullptr, r, wsb);
          prm.topk = keep;
          if (std::isfinite(r.ms) && std::isfinite(dense_ref)) r.ratio = r.ms / dense_ref;
          emit(r);
        };

        // int8_fp8 dense first: the reference of the ratio column.
        if (plan8) {
          double got = 1;
          Buf ones = make_mask(1.0, &got);
          const sparge_tensor_t md = desc(ones.p, SPARGE_DTYPE_UINT8, 4, msh, mst);
          if (has("dense")) {
            Row r;
            r.mode = "dense", r.precision = "int8_fp8", r.density = 1;
            run_attn(plan8, &md, r, w8);
            dense_ms = r.ms;
            emit(r);
          }
          if (has("full")) full_row(plan8, w8, "int8_fp8", dense_ms);
          for (double d : {0.5, 0.2, 0.1}) {
            char name[16];
            std::snprintf(name, sizeof name, "d%g", d);
            if (has(name)) sparse_row(plan8, w8, "int8_fp8", d, dense_ms);
          }
          if (has("predict") || has("pred+attn")) {
            Buf pm(static_cast<size_t>(B * H * nQB * nKB)), kept(static_cast<size_t>(B * H) * 4);
            const sparge_tensor_t pmd = desc(pm.p, SPARGE_DTYPE_UINT8, 4, msh, mst);
            const sparge_tensor_t kd2 = desc(kept.p, SPARGE_DTYPE_INT32, 2, ksh, kst);
            Row r;
            r.mode = "predict", r.precision = "int8_fp8";
            sparge_status_t last = SPARGE_OK;
            r.ms = time_median(
                o, nsets,
                [&](int i) {
                  last = sparge_predict_mask(plan8, &qd[i], &kd[i], &prm, &pmd, &kd2, ws.p, w8, stream);
                  return last == SPARGE_OK;
                },
                stream, &r.iters);
            r.sets = nsets;
            if (last != SPARGE_OK) {
              api_fail(r, last);
            } else {
              CK(cudaStreamSynchronize(stream));
              std::vector<int32_t> kh(static_cast<size_t>(B * H));
              CK(cudaMemcpy(kh.data(), kept.p, kh.size() * 4, cudaMemcpyDeviceToHost));
              double tot = 0;
              for (int32_t x : kh) tot += x;
              pred_density = tot / static_cast<double>(B * H * visible);
            }
            r.density = pred_density;
            if (has("predict")) {
              Row e = r;
              e.density = 0;  // no attention work
              if (std::isfinite(r.ms) && std::isfinite(dense_ms)) {
                const double frac = r.ms / dense_ms;
                const double bound = N >= 32768 ? 0.02 : (N <= 8192 ? 0.05 : NAN);
                char t[64];
                if (std::isfinite(bound))
                  std::snprintf(t, sizeof t, "<=%.2f %s", bound, frac <= bound ? "ok" : "MISS");
                else
                  std::snprintf(t, sizeof t, "-");
                e.target = t;
              }
              char nb[64];
              std::snprintf(nb, sizeof nb, "predicted density %.3f", pred_density);
              e.note += nb;
              emit(e);
            }
            if (has("pred+attn")) {
              Row a;
              a.mode = "pred+attn", a.precision = "int8_fp8", a.density = pred_density;
              run_attn(plan8, nullptr, a, w8);
              emit(a);
            }
          }
        } else {
          Row r;
          r.mode = "dense", r.precision = "int8_fp8";
          r.note = "plan: " + e8;
          ++failures;
          emit(r);
        }
        // Dense attention in another precision: one row, or the plan's error.
        auto dense_other = [&](sparge_plan_t plan, size_t wsb, const std::string& err, const char* precision) {
          Row r;
          r.mode = "dense", r.precision = precision, r.density = 1;
          if (plan) {
            double got = 1;
            Buf ones = make_mask(1.0, &got);
            const sparge_tensor_t md = desc(ones.p, SPARGE_DTYPE_UINT8, 4, msh, mst);
            run_attn(plan, &md, r, wsb);
          } else {
            r.note = "plan: " + err;
            ++failures;
          }
          emit(r);
        };
        if (has("fp16") || has("fp16sparse") || has("fp16full")) dense_other(plan16, w16, e16, "fp16");
        if ((has("fp16sparse") || has("fp16full")) && plan16) {
          const double dense16 = rows.back().ms;
          if (has("fp16full")) full_row(plan16, w16, "fp16", dense16);
          if (has("fp16sparse"))
            for (double d : {0.5, 0.2, 0.1}) sparse_row(plan16, w16, "fp16", d, dense16);
        }
        if (has("splitv")) dense_other(plan_sv, wsv, esv, "int8_fp8_split_v");
        if (has("i8f16") || has("i8f16sparse")) dense_other(plan_if, wif, eif, "int8_fp16");
        if (has("i8f16sparse") && plan_if) {
          const double dense_if = rows.back().ms;
          for (double d : {0.5, 0.2, 0.1}) sparse_row(plan_if, wif, "int8_fp16", d, dense_if);
        }
        sparge_destroy_plan(plan_if);
        sparge_destroy_plan(plan8);
        sparge_destroy_plan(plan16);
        sparge_destroy_plan(plan_sv);
      }

  // ---------------------------------------------------------------- report
  std::printf("\n| N | D | causal | mode | precision | density | ms | TOPS (work) | TOPS (dense-eq.) | x own dense | target |\n");
  std::printf("|---:|---:|:---:|---|---|---:|---:|---:|---:|---:|---|\n");
  for (const Row& r : rows) {
    char ratio[32] = "";
    if (std::isfinite(r.ratio)) std::snprintf(ratio, sizeof ratio, "%.3f", r.ratio);
    std::printf("| %lld | %lld | %s | %s | %s | %.3f | %.3f | %.1f | %.1f | %s | %s |\n", static_cast<long long>(r.N),
                static_cast<long long>(r.D), r.causal ? "yes" : "no", r.mode.c_str(), r.precision.c_str(), r.density,
                r.ms, r.tops_work, r.tops_dense, ratio, r.note.empty() ? r.target.c_str() : (r.target + " " + r.note).c_str());
  }
  if (!o.csv.empty()) {
    FILE* f = std::fopen(o.csv.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", o.csv.c_str());
      return 1;
    }
    std::fprintf(f, "gpu,tag,batch,heads,kv_heads,N,D,causal,mode,precision,density,ms,tops_work,tops_dense_eq,ratio_own_dense,"
                    "iters,input_sets,target,note,host_us\n");
    for (const Row& r : rows)
      std::fprintf(f, "\"%s\",\"%s\",%lld,%lld,%lld,%lld,%lld,%d,%s,%s,%.4f,%.4f,%.2f,%.2f,%.4f,%d,%d,\"%s\",\"%s\",%.1f\n",
                   prop.name, o.tag.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.heads),
                   static_cast<long long>(o.kv_heads), static_cast<long long>(r.N), static_cast<long long>(r.D), r.causal, r.mode.c_str(),
                   r.precision.c_str(), r.density, r.ms, r.tops_work, r.tops_dense, r.ratio, r.iters, r.sets,
                   r.target.c_str(), r.note.c_str(), r.host_us);
    std::fclose(f);
    std::printf("\nwrote %s\n", o.csv.c_str());
  }
  CK(cudaStreamDestroy(stream));
  if (failures) std::printf("\n%d measurement(s) failed\n", failures);
  return failures ? 1 : 0;
}
