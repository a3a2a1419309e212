// CUDA attention vs a float64 reference (all rows, or a sample of rows for
// long sequences) and vs the CPU backend: the quantization twin for the int8
// modes (int8_fp8, int8_fp8_split_v, int8_fp16), EXACT (float64) for fp16 mode. Random block masks at densities
// 1, 0.5, 0.1 and 0; causal with Lq = Lkv and Lq != Lkv; GQA; NHD/HND. At density 1 the dense call
// (no mask, top-k 1) must give the all-ones mask's bits, except FP16 at D = 64, whose dense calls run
// another tiling on sm_90a (192-row tiles, 128-key steps): there it is held to the float64 bars.
#include "catch_compat.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "gpu_util.hpp"

using namespace sgt;

namespace {

struct AttnCase {
  const char* name;
  Shape s;
  Layout layout;
  sparge_dtype_t dtype;
  bool outliers;
  bool twin;         // compare with the CPU backend (full tensors)
  int64_t ref_rows;  // 0: float64 reference on every row; else a sample of this many rows
};

bool fp8_capable() {
  cudaDeviceProp p;
  SGT_CUDA(cudaGetDeviceProperties(&p, 0));
  return p.major * 10 + p.minor >= 89;
}

std::string fmt_label(const AttnCase& c, sparge_precision_t prec, double density) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s %s d=%g", c.name, precision_name(prec), density);
  return buf;
}

// Test bars against the float64 reference. The int8_fp8 semantics themselves
// (the CPU twin, measured on the same input generator) give cosine ~0.9994-0.9995
// and rel. L1 ~0.032-0.036 on random normal inputs, where the nearly uniform
// softmax leaves the e4m3 rounding of V and P un-averaged; the design target
// (cos >= 0.9995, rel. L1 <= 0.03) is therefore recorded separately, as a
// target, and the test bar is set just outside what the semantics give.
struct Bars {
  double cos, rel_l1, lse_atol, lse_mag;
};
// Split V halves the V rounding error (emulated: cos ~0.9996, rel. L1 ~0.028);
// int8_fp16 leaves the int8 Q.K^T error alone (emulated: ~0.9999, ~0.011).
Bars ref_bars(const AttnCase& c, sparge_precision_t prec) {
  if (prec == SPARGE_PRECISION_FP16) return {0.9999, 0.005, 1e-3, 1e-5};
  // Outlier inputs (three channels x 20 in Q and K): the scores are huge and the
  // softmax nearly one-hot, so the int8 Q.K^T rounding can swap the winning key
  // of a row. With 64 used keys (L128-outl, d=0.5) the int8 modes' cosine
  // ranges 0.9874..0.9999 over 375 seeds of this generator in the CPU twin
  // (median 0.9987, 0.5 % of seeds below 0.99; one GPU run hit 0.9864), the
  // same for all three int8 modes: the bar is set below that spread.
  if (c.outliers) return {0.98, 0.08, 0.05, 1.0 / 32};
  if (prec == SPARGE_PRECISION_INT8_FP8_SPLIT_V) return {0.999, 0.04, 0.02, 1.0 / 64};
  if (prec == SPARGE_PRECISION_INT8_FP16) return {0.9995, 0.02, 0.02, 1.0 / 64};
  return {0.998, 0.05, 0.02, 1.0 / 64};
}
// The int8 modes: compared with the CPU quantization twin.
bool quantized(sparge_precision_t p) {
  return p == SPARGE_PRECISION_INT8_FP8 || p == SPARGE_PRECISION_INT8_FP8_SPLIT_V || p == SPARGE_PRECISION_INT8_FP16;
}
// The modes with fp8 tensor-core products.
bool needs_fp8(sparge_precision_t p) { return p == SPARGE_PRECISION_INT8_FP8 || p == SPARGE_PRECISION_INT8_FP8_SPLIT_V; }
const std::vector<sparge_precision_t> kGpuPrecisions = {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP8_SPLIT_V,
                                                        SPARGE_PRECISION_INT8_FP16, SPARGE_PRECISION_FP16};
// Whether a dense call may step through the keys differently from a masked call of the same plan
// (the sm_90a FP16 kernels at D = 64: three consumer warpgroups, 128-key steps, for dense calls),
// so that the two agree to rounding rather than bit for bit.
bool dense_retiled(sparge_precision_t p, const Shape& s) { return p == SPARGE_PRECISION_FP16 && s.D == 64; }

void run_case(const AttnCase& c, const std::vector<double>& densities) {
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t seed = case_seed(c.name);
  std::printf("case %-14s %s %s %s%s seed 0x%016llx\n", c.name, c.s.str().c_str(), layout_name(c.layout),
              dtype_name(c.dtype), c.outliers ? " outliers" : "", static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  const Inputs in = make_inputs(c.s, c.layout, c.dtype, c.outliers, seed);
  const DeviceInputs din(in);
  Stream stream;
  const std::vector<RowId> rows = c.ref_rows ? sample_rows(c.s, c.ref_rows, seed) : all_rows(c.s);
  const bool fp8 = fp8_capable();

  for (sparge_precision_t prec : kGpuPrecisions) {
    if (needs_fp8(prec) && c.s.D == 256) {
      // No INT8_FP8 kernel at D = 256: the plan is refused (test_errors.cpp).
      const AttnResult g = gpu_attention(in, din, prec, nullptr, nullptr, true, stream.get());
      CHECK(g.status == SPARGE_ERR_UNSUPPORTED);
      continue;
    }
    if (prec == SPARGE_PRECISION_FP16 && fp16_plans_portable() && c.s.D == 256) {
      // The portable FP16-mode kernel has head dims 64, 96 and 128: the plan is refused.
      const AttnResult g = gpu_attention(in, din, prec, nullptr, nullptr, true, stream.get());
      CHECK(g.status == SPARGE_ERR_UNSUPPORTED);
      continue;
    }
    if (needs_fp8(prec) && !fp8) {
      WARN(precision_name(prec) << " skipped: device has no fp8 tensor cores");
      continue;
    }
    for (double d : densities) {
      const std::string label = fmt_label(c, prec, d);
      INFO(label << " [" << c.s.str() << " " << layout_name(c.layout) << " " << dtype_name(c.dtype) << "]");
      try {
        const std::vector<uint8_t> mask = random_mask(c.s, d, mix64(seed ^ static_cast<uint64_t>(d * 1000 + 7)));
        const AttnResult g = gpu_attention(in, din, prec, &mask, nullptr, true, stream.get());
        if (g.status != SPARGE_OK) {
          FAIL_CHECK(g.error);
          continue;
        }
        CHECK(g.unwritten == 0);
        CHECK(g.clobbered == 0);
        // Same inputs, same bits: a difference here is a race.
        const AttnResult g2 = gpu_attention(in, din, prec, &mask, nullptr, true, stream.get());
        REQUIRE(g2.status == SPARGE_OK);
        CHECK(g2.bits == g.bits);
        CHECK(std::memcmp(g2.lse.data(), g.lse.data(), g.lse.size() * 4) == 0);
        AttnResult gd;  // the dense call, where it is checked against float64 below
        if (d == 1.0) {
          // A dense call (no mask, top-k 1): the kernels enumerate the visible blocks themselves
          // (no prediction, no index lists, another row order) and give the all-ones mask's bits.
          sparge_predict_params_t every = SPARGE_PREDICT_PARAMS_INIT;
          every.topk = 1.0f;
          AttnResult d1 = gpu_attention(in, din, prec, nullptr, &every, true, stream.get());
          REQUIRE(d1.status == SPARGE_OK);
          CHECK(d1.unwritten == 0);
          CHECK(d1.clobbered == 0);
          if (dense_retiled(prec, c.s)) {
            const AttnResult d2 = gpu_attention(in, din, prec, nullptr, &every, true, stream.get());
            REQUIRE(d2.status == SPARGE_OK);
            CHECK(d2.bits == d1.bits);  // same inputs, same bits
            CHECK(std::memcmp(d2.lse.data(), d1.lse.data(), d1.lse.size() * 4) == 0);
            gd = std::move(d1);
          } else {
            CHECK(d1.bits == g.bits);
            CHECK(std::memcmp(d1.lse.data(), g.lse.data(), g.lse.size() * 4) == 0);
          }
        }

        if (d == 0.0) {  // nothing kept: zeros and -inf everywhere
          int64_t bad = 0;
          for (float x : g.out) bad += x != 0.0f;
          for (float x : g.lse) bad += !(std::isinf(x) && x < 0);
          CHECK(bad == 0);
          record("attention", label, "nonzero/non-inf", static_cast<double>(bad), 0, false);
          continue;
        }

        const RefRows ref = ref_attention(in, mask.data(), rows);
        const ErrStats e = compare_rows(g.out, c.s, rows, ref.out);
        const Bars bar = ref_bars(c, prec);
        record("attention", label, "cos vs f64", e.cosine, bar.cos, true);
        record("attention", label, "relL1 vs f64", e.rel_l1, bar.rel_l1, false);
        if (quantized(prec) && d == 1.0 && c.s.Lkv >= 1000) {
          // The design accuracy bar: enforced for split V and int8_fp16 on normal
          // inputs (the reason those modes exist); recorded as a target otherwise.
          const bool enforce =
              (prec == SPARGE_PRECISION_INT8_FP8_SPLIT_V || prec == SPARGE_PRECISION_INT8_FP16) && !c.outliers;
          record("attention", label, "cos (design target)", e.cosine, 0.9995, true, enforce);
          record("attention", label, "relL1 (design target)", e.rel_l1, 0.03, false, enforce);
          if (enforce) {
            CHECK(e.cosine >= 0.9995);
            CHECK(e.rel_l1 <= 0.03);
          }
        }
        CHECK(e.nonfinite == 0);
        CHECK(e.cosine >= bar.cos);
        CHECK(e.rel_l1 <= bar.rel_l1);
        const LseStats le = compare_lse_rows(g.lse, c.s, ref, bar.lse_atol, bar.lse_mag);
        record("attention", label, "LSE maxabs vs f64", le.max_abs, HUGE_VAL, false);  // information only
        record("attention", label, "LSE excess over tolerance vs f64", le.max_excess, 0, false);
        CHECK(le.nonfinite == 0);
        CHECK(le.inf_mismatch == 0);
        CHECK(le.max_excess <= 0.0);
        if (!gd.out.empty()) {
          const std::string dl = label + " dense";
          const ErrStats ed = compare_rows(gd.out, c.s, rows, ref.out);
          record("attention", dl, "cos vs f64", ed.cosine, bar.cos, true);
          record("attention", dl, "relL1 vs f64", ed.rel_l1, bar.rel_l1, false);
          CHECK(ed.nonfinite == 0);
          CHECK(ed.cosine >= bar.cos);
          CHECK(ed.rel_l1 <= bar.rel_l1);
          const LseStats ld = compare_lse_rows(gd.lse, c.s, ref, bar.lse_atol, bar.lse_mag);
          record("attention", dl, "LSE excess over tolerance vs f64", ld.max_excess, 0, false);
          CHECK(ld.nonfinite == 0);
          CHECK(ld.inf_mismatch == 0);
          CHECK(ld.max_excess <= 0.0);
        }

        if (!c.twin) continue;
        const sparge_precision_t cprec = quantized(prec) ? prec : SPARGE_PRECISION_EXACT;
        const AttnResult t = cpu_attention(in, cprec, &mask, nullptr, true);
        if (t.status != SPARGE_OK) {
          FAIL_CHECK("CPU backend: " << t.error);
          continue;
        }
        CHECK(t.unwritten == 0);
        const ErrStats et = compare_full(g.out, t.out);
        if (quantized(prec)) {
          // The twin rounds the same way; what remains is exp2 ulps moving a p
          // across an e4m3 (or 16-bit) boundary, summation order, and the final
          // 16-bit rounding.
          record("attention", label, "relL1 vs CPU twin", et.rel_l1, 2e-3, false);
          record("attention", label, "maxrel vs CPU twin", et.rel_max, 0.1, false);
          CHECK(et.rel_l1 <= 2e-3);
          CHECK(et.rel_max <= 0.1);
          const LseStats lt = compare_lse_full(g.lse, t.lse, 1e-3, 1e-5);
          record("attention", label, "LSE maxabs vs twin", lt.max_abs, HUGE_VAL, false);  // information only
          record("attention", label, "LSE excess over tolerance vs twin", lt.max_excess, 0, false);
          CHECK(lt.inf_mismatch == 0);
          CHECK(lt.max_excess <= 0.0);
        } else {
          record("attention", label, "relL1 vs CPU exact", et.rel_l1, 0.005, false);
          CHECK(et.rel_l1 <= 0.005);
          const LseStats lt = compare_lse_full(g.lse, t.lse, 1e-3, 1e-5);
          CHECK(lt.inf_mismatch == 0);
          CHECK(lt.max_excess <= 0.0);
        }
      } catch (const std::exception& ex) {
        FAIL_CHECK(label << ": " << ex.what());
      }
    }
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("case %-14s done in %.1f s\n", c.name, sec);
  std::fflush(stdout);
}

Shape shp(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, int64_t D, bool causal) {
  Shape s;
  s.B = B, s.Hq = Hq, s.Hkv = Hkv, s.Lq = Lq, s.Lkv = Lkv, s.D = D, s.causal = causal;
  return s;
}

const std::vector<double> kDensities = {1.0, 0.5, 0.1, 0.0};

// A causal CUDA plan for shape s, and its workspace size (for tests that call
// the C API directly).
sparge_plan_t causal_cuda_plan(const Shape& s, sparge_dtype_t dtype, sparge_precision_t prec, size_t* wsb) {
  sparge_problem_t pr = SPARGE_PROBLEM_INIT;
  pr.batch = s.B, pr.heads_q = s.Hq, pr.heads_kv = s.Hkv, pr.len_q = s.Lq, pr.len_kv = s.Lkv, pr.head_dim = s.D;
  pr.dtype = dtype, pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = prec, pr.causal = 1;
  sparge_plan_t plan = nullptr;
  REQUIRE(sparge_create_plan(&pr, &plan) == SPARGE_OK);
  REQUIRE(sparge_plan_workspace_size(plan, wsb) == SPARGE_OK);
  return plan;
}

}  // namespace

TEST_CASE("attention, small shapes: vs float64 and the CPU backend", "[gpu][attention][sanitize]") {
  const AttnCase cases[] = {
      {"L1", shp(1, 2, 2, 1, 1, 64, false), Layout::HND, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"L1-causal", shp(1, 2, 2, 1, 1, 128, true), Layout::NHD, SPARGE_DTYPE_FLOAT16, false, true, 0},
      {"L100-gqa4", shp(2, 4, 1, 100, 100, 128, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"L128-outl", shp(1, 2, 2, 128, 128, 64, false), Layout::HND, SPARGE_DTYPE_FLOAT16, true, true, 0},
      {"Lq200-Lkv333", shp(1, 2, 1, 200, 333, 64, true), Layout::HND, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"Lq333-Lkv130", shp(1, 2, 2, 333, 130, 128, true), Layout::NHD, SPARGE_DTYPE_FLOAT16, false, true, 0},
      {"L200-d96", shp(1, 2, 1, 200, 300, 96, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"L130-d256", shp(1, 2, 2, 130, 200, 256, false), Layout::HND, SPARGE_DTYPE_FLOAT16, false, true, 0},
      // Non-causal D = 128 under the sanitizers (Lkv: 8 key blocks, the last one partial).
      {"L300-Lkv500", shp(1, 2, 1, 300, 500, 128, false), Layout::HND, SPARGE_DTYPE_BFLOAT16, false, true, 0},
  };
  for (const AttnCase& c : cases) run_case(c, kDensities);
}

TEST_CASE("attention, medium shapes: vs float64 and the CPU backend", "[gpu][attention]") {
  const AttnCase cases[] = {
      {"L1000-causal", shp(1, 4, 4, 1000, 1000, 128, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"L1000-outl", shp(1, 4, 4, 1000, 1000, 64, false), Layout::HND, SPARGE_DTYPE_FLOAT16, true, true, 0},
      {"Lq300-Lkv1000", shp(1, 2, 1, 300, 1000, 64, true), Layout::HND, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"Lq1000-Lkv300", shp(1, 2, 2, 1000, 300, 128, true), Layout::NHD, SPARGE_DTYPE_FLOAT16, false, true, 0},
      {"L256-gqa32", shp(1, 32, 1, 256, 256, 64, true), Layout::HND, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"gqa32-pad", shp(1, 64, 2, 130, 333, 128, false), Layout::HND_PAD, SPARGE_DTYPE_FLOAT16, true, true, 0},
      {"L4097-causal", shp(1, 1, 1, 4097, 4097, 64, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"L1000-d96", shp(1, 4, 2, 1000, 1000, 96, false), Layout::HND, SPARGE_DTYPE_FLOAT16, false, true, 0},
      {"L1000-d96-outl", shp(1, 2, 2, 1000, 1000, 96, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, true, true, 0},
      {"L1000-d256", shp(1, 4, 4, 1000, 1000, 256, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"gqa8-d256-pad", shp(1, 8, 1, 300, 700, 256, false), Layout::HND_PAD, SPARGE_DTYPE_FLOAT16, false, true, 0},
      // Many short rows (>= 2 per SM up to 200 SMs): FP16 dense calls on persistent CTAs (sm_90a),
      // several rows per CTA; causal with an odd query-block count (a pair without its short row).
      {"many-rows", shp(4, 26, 13, 500, 500, 64, false), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"many-rows-d64-causal", shp(3, 48, 12, 700, 700, 64, true), Layout::HND, SPARGE_DTYPE_FLOAT16, false, true, 0},
      {"Lq1000-Lkv300-d64", shp(1, 2, 2, 1000, 300, 64, true), Layout::HND, SPARGE_DTYPE_BFLOAT16, false, true, 0},
      {"many-rows-causal", shp(2, 40, 8, 600, 600, 128, true), Layout::HND, SPARGE_DTYPE_FLOAT16, false, true, 0},
      // Non-causal D = 128 with long rows (65 key blocks, the last one partial) and few queries.
      {"Lq300-Lkv4150", shp(1, 2, 2, 300, 4150, 128, false), Layout::NHD, SPARGE_DTYPE_FLOAT16, false, true, 0},
  };
  for (const AttnCase& c : cases) run_case(c, kDensities);
}

TEST_CASE("attention, long sequences: sampled rows vs float64", "[gpu][attention][large]") {
  const AttnCase cases[] = {
      {"L4097-outl", shp(1, 2, 1, 4097, 4097, 128, false), Layout::HND, SPARGE_DTYPE_FLOAT16, true, false, 192},
      {"L32768-causal", shp(1, 4, 1, 32768, 32768, 128, true), Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, false, 96},
  };
  for (const AttnCase& c : cases) run_case(c, kDensities);
}

TEST_CASE("attention: no LSE requested, and the run is capturable in a CUDA graph", "[gpu][graph][sanitize]") {
  const Shape s = shp(1, 4, 2, 300, 300, 128, true);
  const Inputs in = make_inputs(s, Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, case_seed("graph"));
  const DeviceInputs din(in);
  Stream stream;
  const bool fp8 = fp8_capable();
  for (sparge_precision_t prec : kGpuPrecisions) {
    if (needs_fp8(prec) && !fp8) continue;
    INFO(precision_name(prec));
    const std::vector<uint8_t> mask = random_mask(s, 0.5, case_seed("graph-mask"));
    const AttnResult with_lse = gpu_attention(in, din, prec, &mask, nullptr, true, stream.get());
    REQUIRE(with_lse.status == SPARGE_OK);
    const AttnResult no_lse = gpu_attention(in, din, prec, &mask, nullptr, false, stream.get());
    REQUIRE(no_lse.status == SPARGE_OK);
    CHECK(no_lse.unwritten == 0);
    CHECK(no_lse.clobbered == 0);
    CHECK(no_lse.bits == with_lse.bits);

    // Capture predict-inside attention (mask NULL) in global capture mode: any
    // allocation or host synchronization inside the call makes capture fail.
    size_t wsb = 0;
    sparge_plan_t plan = causal_cuda_plan(s, in.q.dtype, prec, &wsb);
    DeviceBuffer ws(wsb), out_eager(in.q.storage * 2), out_graph(in.q.storage * 2);
    out_eager.fill(0xFF);
    out_graph.fill(0xFF);
    const sparge_tensor_t qd = desc4(in.q, din.q.get(), SPARGE_DEVICE_CUDA);
    const sparge_tensor_t kd = desc4(in.k, din.k.get(), SPARGE_DEVICE_CUDA);
    const sparge_tensor_t vd = desc4(in.v, din.v.get(), SPARGE_DEVICE_CUDA);
    const sparge_tensor_t oe = desc4(in.q, out_eager.get(), SPARGE_DEVICE_CUDA);
    const sparge_tensor_t og = desc4(in.q, out_graph.get(), SPARGE_DEVICE_CUDA);
    sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
    prm.topk = 0.5f;
    CHECK(sparge_attention_run(plan, &qd, &kd, &vd, nullptr, &prm, &oe, nullptr, ws.get(), wsb, stream.get()) ==
          SPARGE_OK);
    stream.sync();

    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    SGT_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    const sparge_status_t st =
        sparge_attention_run(plan, &qd, &kd, &vd, nullptr, &prm, &og, nullptr, ws.get(), wsb, stream.get());
    const cudaError_t ce = cudaStreamEndCapture(stream.get(), &graph);
    INFO("capture: " << sparge_status_string(st) << " " << sparge_last_error() << " / " << cudaGetErrorString(ce));
    CHECK(st == SPARGE_OK);
    CHECK(ce == cudaSuccess);
    if (st == SPARGE_OK && ce == cudaSuccess) {
      SGT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int r = 0; r < 3; ++r) SGT_CUDA(cudaGraphLaunch(exec, stream.get()));
      stream.sync();
      std::vector<uint16_t> a(in.q.storage), b(in.q.storage);
      out_eager.download(a.data(), a.size() * 2);
      out_graph.download(b.data(), b.size() * 2);
      CHECK(a == b);
      int64_t poisoned = 0;
      for (uint16_t x : a) poisoned += x == 0xFFFF;
      CHECK(poisoned == 0);
      SGT_CUDA(cudaGraphExecDestroy(exec));
    }
    if (graph) SGT_CUDA(cudaGraphDestroy(graph));
    cudaGetLastError();  // a failed capture leaves no sticky error; clear the non-sticky one
    sparge_destroy_plan(plan);
  }
}

// The sm_90a kernels store the output through shared memory and the TMA unit
// when its strides fit a tensor map, else with 4-byte stores from registers.
// An output with a row pitch of D + 2 elements (rows 4-byte but not 16-byte
// aligned) takes the second path: it must hold the same bits as a contiguous
// output, and the two padding elements of every row must stay untouched. The
// same for a given mask with rows that list no block (written by the kernels'
// empty-row path: 16-byte stores on the contiguous output, 4-byte ones on the
// padded one).
TEST_CASE("attention: an output no tensor map can describe gets the same bits by direct stores",
          "[gpu][attention][sanitize]") {
  if (!fp8_capable()) return;
  Stream stream;
  for (int64_t D : {int64_t(64), int64_t(128)}) {
    const Shape s = shp(2, 4, 2, 300, 300, D, true);
    const Inputs in = make_inputs(s, Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, case_seed("direct-out"));
    const DeviceInputs din(in);
    for (sparge_precision_t prec :
         {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP8_SPLIT_V, SPARGE_PRECISION_INT8_FP16}) {
      INFO(precision_name(prec) << " D=" << D);
      size_t wsb = 0;
      sparge_plan_t plan = causal_cuda_plan(s, in.q.dtype, prec, &wsb);
      const int64_t rows = s.B * s.Hq * s.Lq, pitch = D + 2;
      DeviceBuffer ws(wsb), dense(static_cast<size_t>(rows * D) * 2), padded(static_cast<size_t>(rows * pitch) * 2);
      const int64_t osh[4] = {s.B, s.Hq, s.Lq, D};
      const int64_t dst[4] = {s.Hq * s.Lq * D, s.Lq * D, D, 1}, pst[4] = {s.Hq * s.Lq * pitch, s.Lq * pitch, pitch, 1};
      const sparge_tensor_t od = make_desc(dense.get(), SPARGE_DEVICE_CUDA, in.q.dtype, 4, osh, dst);
      const sparge_tensor_t op = make_desc(padded.get(), SPARGE_DEVICE_CUDA, in.q.dtype, 4, osh, pst);
      const sparge_tensor_t qd = desc4(in.q, din.q.get(), SPARGE_DEVICE_CUDA);
      const sparge_tensor_t kd = desc4(in.k, din.k.get(), SPARGE_DEVICE_CUDA);
      const sparge_tensor_t vd = desc4(in.v, din.v.get(), SPARGE_DEVICE_CUDA);
      sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
      prm.topk = 0.5f;
      // About one mask row in six lists no block (nKB = 5, density 0.3).
      const std::vector<uint8_t> mask = random_mask(s, 0.3, case_seed("direct-out-mask") ^ uint64_t(D));
      DeviceBuffer dmask(mask.size());
      dmask.upload(mask.data(), mask.size());
      const int64_t msh[4] = {s.B, s.Hq, s.nQB(), s.nKB()};
      const int64_t mst[4] = {s.Hq * s.nQB() * s.nKB(), s.nQB() * s.nKB(), s.nKB(), 1};
      const sparge_tensor_t md = make_desc(dmask.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_UINT8, 4, msh, mst);
      for (const bool given : {false, true}) {
        INFO((given ? "given mask" : "predicted mask"));
        const sparge_tensor_t* mp = given ? &md : nullptr;
        const sparge_predict_params_t* pp = given ? nullptr : &prm;
        dense.fill(0xFF);
        padded.fill(0xFF);
        CHECK(sparge_attention_run(plan, &qd, &kd, &vd, mp, pp, &od, nullptr, ws.get(), wsb, stream.get()) ==
              SPARGE_OK);
        CHECK(sparge_attention_run(plan, &qd, &kd, &vd, mp, pp, &op, nullptr, ws.get(), wsb, stream.get()) ==
              SPARGE_OK);
        stream.sync();
        std::vector<uint16_t> a(static_cast<size_t>(rows * D)), b(static_cast<size_t>(rows * pitch));
        dense.download(a.data(), a.size() * 2);
        padded.download(b.data(), b.size() * 2);
        int64_t differ = 0, poisoned = 0, pad_written = 0, empty_rows = 0, empty_nonzero = 0;
        for (int64_t r = 0; r < rows; ++r) {
          // r = (bb * Hq + hh) * Lq + i: its mask row lists no block.
          const int64_t bh = r / s.Lq, qb = (r % s.Lq) / 128;
          bool none = given;
          for (int64_t kb = 0; none && kb < s.nKB(); ++kb)
            none = mask[static_cast<size_t>((bh * s.nQB() + qb) * s.nKB() + kb)] == 0;
          empty_rows += none;
          for (int64_t c = 0; c < D; ++c) {
            const uint16_t x = a[static_cast<size_t>(r * D + c)];
            differ += x != b[static_cast<size_t>(r * pitch + c)];
            poisoned += x == 0xFFFF;
            empty_nonzero += none && x != 0;
          }
          for (int64_t c = D; c < pitch; ++c) pad_written += b[static_cast<size_t>(r * pitch + c)] != 0xFFFF;
        }
        if (given) CHECK(empty_rows > 0);
        CHECK(differ == 0);
        CHECK(poisoned == 0);
        CHECK(pad_written == 0);
        CHECK(empty_nonzero == 0);
      }
      sparge_destroy_plan(plan);
    }
  }
}

// The PV skip (docs/SEMANTICS.md, "PV skip") is the CPU backend's in this release: a CUDA plan refuses a
// positive pv_threshold with a status and a message naming it, and writes nothing.
TEST_CASE("attention: a CUDA plan refuses the PV skip", "[gpu][attention][pv]") {
  Stream stream;
  const Shape s = shp(1, 2, 1, 300, 300, 128, true);
  const Inputs in = make_inputs(s, Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, case_seed("pv-refused"));
  const DeviceInputs din(in);
  for (sparge_precision_t prec : kGpuPrecisions) {
    if (needs_fp8(prec) && !fp8_capable()) continue;
    INFO(precision_name(prec));
    const std::vector<uint8_t> mask = random_mask(s, 0.5, case_seed("pv-refused-mask"));
    sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
    prm.pv_threshold = 4.0f;
    const AttnResult g = gpu_attention(in, din, prec, &mask, &prm, true, stream.get());
    CHECK(g.status == SPARGE_ERR_UNSUPPORTED);
    CHECK(g.error.find("params->pv_threshold") != std::string::npos);
    prm.pv_threshold = 0.0f;
    const AttnResult ok = gpu_attention(in, din, prec, &mask, &prm, true, stream.get());
    CHECK(ok.status == SPARGE_OK);
  }
}
