// Hardening checks of the CUDA backend, tagged [hardening]:
//  - a whole call captured in a CUDA graph and replayed with new inputs
//    equals direct calls, bit for bit;
//  - two streams (and two host threads) at once give the results of
//    sequential calls;
//  - the NaN/Inf policy (docs/SEMANTICS.md, "Non-finite values") on every
//    GPU precision: the non-finite pattern of the output and LSE equals the
//    CPU backend's, everything else equals the run without the value;
//  - a pending CUDA error of the caller survives a successful call;
//  - overlapping outputs are refused;
//  - [large]: L = 256K with B*H*L*D beyond 2^31 elements, sampled rows vs
//    float64.
#include "catch_compat.hpp"

#include <cmath>
#include <cstring>
#include <thread>

#include "gpu_util.hpp"

using namespace sgt;

namespace {

bool fp8_ok() {
  cudaDeviceProp p;
  SGT_CUDA(cudaGetDeviceProperties(&p, 0));
  return p.major * 10 + p.minor >= 89;
}
const sparge_precision_t kPrecs[] = {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP8_SPLIT_V,
                                     SPARGE_PRECISION_INT8_FP16, SPARGE_PRECISION_FP16};
bool fp8_mode(sparge_precision_t p) {
  return p == SPARGE_PRECISION_INT8_FP8 || p == SPARGE_PRECISION_INT8_FP8_SPLIT_V;
}

Shape shp(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, int64_t D, bool causal) {
  Shape s;
  s.B = B, s.Hq = Hq, s.Hkv = Hkv, s.Lq = Lq, s.Lkv = Lkv, s.D = D, s.causal = causal;
  return s;
}

sparge_plan_t cuda_plan(const Shape& s, sparge_dtype_t dt, sparge_precision_t prec, size_t* wsb) {
  sparge_problem_t pr = SPARGE_PROBLEM_INIT;
  pr.batch = s.B, pr.heads_q = s.Hq, pr.heads_kv = s.Hkv, pr.len_q = s.Lq, pr.len_kv = s.Lkv, pr.head_dim = s.D;
  pr.dtype = dt, pr.device_type = SPARGE_DEVICE_CUDA, pr.precision = prec, pr.causal = s.causal ? 1 : 0;
  sparge_plan_t plan = nullptr;
  const sparge_status_t st = sparge_create_plan(&pr, &plan);
  INFO("create_plan: " << sparge_last_error());
  REQUIRE(st == SPARGE_OK);
  REQUIRE(sparge_plan_workspace_size(plan, wsb) == SPARGE_OK);
  return plan;
}

// Device buffers of one call: inputs, out, LSE, workspace.
struct Call {
  Shape s;
  sparge_dtype_t dt;
  HostTensor qh, kh, vh;  // layouts (their bits are uploaded)
  DeviceBuffer q, k, v, out, lse, ws;
  size_t wsb = 0;
  sparge_tensor_t qd{}, kd{}, vd{}, od{}, ld{};
  Call(const Inputs& in, size_t wsb_) : s(in.s), dt(in.q.dtype), qh(in.q), kh(in.k), vh(in.v), wsb(wsb_) {
    q.alloc(qh.storage * 2), k.alloc(kh.storage * 2), v.alloc(vh.storage * 2);
    out.alloc(qh.storage * 2), lse.alloc(size_t(s.B * s.Hq * s.Lq) * 4), ws.alloc(wsb + 256);
    qd = desc4(qh, q.get(), SPARGE_DEVICE_CUDA), kd = desc4(kh, k.get(), SPARGE_DEVICE_CUDA);
    vd = desc4(vh, v.get(), SPARGE_DEVICE_CUDA), od = desc4(qh, out.get(), SPARGE_DEVICE_CUDA);
    const int64_t lsh[3] = {s.B, s.Hq, s.Lq}, lst[3] = {s.Hq * s.Lq, s.Lq, 1};
    ld = make_desc(lse.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_FLOAT32, 3, lsh, lst);
  }
  void upload_async(const Inputs& in, cudaStream_t st) {
    SGT_CUDA(cudaMemcpyAsync(q.get(), in.q.bits.data(), qh.storage * 2, cudaMemcpyHostToDevice, st));
    SGT_CUDA(cudaMemcpyAsync(k.get(), in.k.bits.data(), kh.storage * 2, cudaMemcpyHostToDevice, st));
    SGT_CUDA(cudaMemcpyAsync(v.get(), in.v.bits.data(), vh.storage * 2, cudaMemcpyHostToDevice, st));
  }
  sparge_status_t run(sparge_plan_t plan, const sparge_predict_params_t* prm, cudaStream_t st) {
    return sparge_attention_run(plan, &qd, &kd, &vd, nullptr, prm, &od, &ld, ws.get(), wsb, st);
  }
  std::vector<unsigned char> result() const {  // out bits then LSE bits
    std::vector<unsigned char> r(out.bytes() + lse.bytes());
    out.download(r.data(), out.bytes());
    lse.download(r.data() + out.bytes(), lse.bytes());
    return r;
  }
};

}  // namespace

TEST_CASE("hardening: a captured call replayed with new inputs equals direct calls",
          "[gpu][hardening][graph][sanitize]") {
  const Shape s = shp(2, 4, 2, 777, 900, 128, true);
  const bool fp8 = fp8_ok();
  for (sparge_precision_t prec : kPrecs) {
    if (fp8_mode(prec) && !fp8) continue;
    INFO(precision_name(prec));
    size_t wsb = 0;
    sparge_plan_t plan = cuda_plan(s, SPARGE_DTYPE_BFLOAT16, prec, &wsb);
    Inputs in0 = make_inputs(s, Layout::NHD, SPARGE_DTYPE_BFLOAT16, false, case_seed("hgraph0"));
    Call g(in0, wsb), d(in0, wsb);
    Stream stream;
    sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
    prm.topk = 0.4f;
    g.upload_async(in0, stream.get());
    stream.sync();
    // The graph: the call alone, mask predicted inside (mask NULL), with LSE.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    SGT_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
    const sparge_status_t st = g.run(plan, &prm, stream.get());
    SGT_CUDA(cudaStreamEndCapture(stream.get(), &graph));
    INFO("captured call: " << sparge_status_string(st) << " " << sparge_last_error());
    REQUIRE(st == SPARGE_OK);
    SGT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      INFO("replay " << r);
      const Inputs in = make_inputs(s, Layout::NHD, SPARGE_DTYPE_BFLOAT16, r == 1, case_seed("hgraph" + std::to_string(r + 1)));
      g.out.fill(0xFF), g.lse.fill(0xFF), d.out.fill(0xEE), d.lse.fill(0xEE);
      g.upload_async(in, stream.get());
      SGT_CUDA(cudaGraphLaunch(exec, stream.get()));
      d.upload_async(in, stream.get());
      REQUIRE(d.run(plan, &prm, stream.get()) == SPARGE_OK);
      stream.sync();
      CHECK(g.result() == d.result());
    }
    SGT_CUDA(cudaGraphExecDestroy(exec));
    SGT_CUDA(cudaGraphDestroy(graph));
    sparge_destroy_plan(plan);
  }
}

TEST_CASE("hardening: two streams and two host threads at once equal sequential calls",
          "[gpu][hardening][streams][sanitize]") {
  const Shape s = shp(1, 8, 2, 1500, 1500, 64, true);
  const bool fp8 = fp8_ok();
  std::vector<sparge_precision_t> precs;
  for (sparge_precision_t p : kPrecs)
    if (!fp8_mode(p) || fp8) precs.push_back(p);
  const sparge_precision_t pa = precs.front(), pb = precs.back();
  size_t wa = 0, wb = 0;
  sparge_plan_t plan_a = cuda_plan(s, SPARGE_DTYPE_FLOAT16, pa, &wa);
  sparge_plan_t plan_b = cuda_plan(s, SPARGE_DTYPE_FLOAT16, pb, &wb);
  const Inputs ia = make_inputs(s, Layout::HND, SPARGE_DTYPE_FLOAT16, false, case_seed("hstream-a"));
  const Inputs ib = make_inputs(s, Layout::HND, SPARGE_DTYPE_FLOAT16, false, case_seed("hstream-b"));
  sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
  prm.topk = 0.3f;
  // Sequential references on one stream.
  Stream s0;
  Call ra(ia, wa), rb(ib, wb), rs(ia, wa);  // rs: plan_a's second workspace (same plan shared below)
  ra.upload_async(ia, s0.get());
  rb.upload_async(ib, s0.get());
  rs.upload_async(ia, s0.get());
  // Poisoned outputs also for the references (and defined bytes for
  // compute-sanitizer initcheck, which does not count the sm_90a kernels' TMA
  // stores as initializing memory).
  ra.out.fill(0xFF), rb.out.fill(0xFF), rs.out.fill(0xFF);
  REQUIRE(ra.run(plan_a, &prm, s0.get()) == SPARGE_OK);
  s0.sync();
  REQUIRE(rb.run(plan_b, &prm, s0.get()) == SPARGE_OK);
  s0.sync();
  const std::vector<unsigned char> want_a = ra.result(), want_b = rb.result();
  SECTION("two streams, one host thread, interleaved without synchronizing") {
    Stream s1, s2;
    for (int r = 0; r < 4; ++r) {
      ra.out.fill(0xFF), rb.out.fill(0xFF), rs.out.fill(0xFF);
      REQUIRE(ra.run(plan_a, &prm, s1.get()) == SPARGE_OK);
      REQUIRE(rb.run(plan_b, &prm, s2.get()) == SPARGE_OK);
      REQUIRE(rs.run(plan_a, &prm, s2.get()) == SPARGE_OK);  // the same plan on both streams, own workspace
      s1.sync();
      s2.sync();
      CHECK(ra.result() == want_a);
      CHECK(rb.result() == want_b);
      CHECK(rs.result() == want_a);
    }
  }
  SECTION("two host threads, a stream each, the same plan") {
    bool ok[2] = {true, true};
    auto work = [&](int t) {
      Stream st;
      Call* c = t == 0 ? &ra : &rs;
      for (int r = 0; r < 6 && ok[t]; ++r) {
        if (c->run(plan_a, &prm, st.get()) != SPARGE_OK) ok[t] = false;
        st.sync();
        if (c->result() != want_a) ok[t] = false;
      }
    };
    std::thread t0(work, 0), t1(work, 1);
    t0.join();
    t1.join();
    CHECK(ok[0]);
    CHECK(ok[1]);
  }
  sparge_destroy_plan(plan_a);
  sparge_destroy_plan(plan_b);
}

namespace {

// One non-finite value into a host tensor (bits and logical value).
void poke(HostTensor& t, int64_t b, int64_t h, int64_t i, int64_t c, float x) {
  t.bits[size_t(t.off(b, h, i, c))] = to16(x, t.dtype);
  t.val[t.lidx(b, h, i, c)] = from16(to16(x, t.dtype), t.dtype);
}

struct Pattern {
  int64_t out_mismatch = 0, lse_mismatch = 0, changed = 0, poisoned = 0;
};

// GPU result with the non-finite value vs the CPU backend's with it (the
// non-finite pattern must agree element by element) and vs the GPU result
// without it (every finite element of the CPU pattern must be bit-identical).
Pattern compare_policy(const AttnResult& gpu, const AttnResult& gpu_clean, const AttnResult& cpu,
                       bool finiteness_only = false) {
  Pattern p;
  for (size_t e = 0; e < gpu.out.size(); ++e) {
    const bool cf = std::isfinite(cpu.out[e]), gf = std::isfinite(gpu.out[e]);
    const bool cn = std::isnan(cpu.out[e]), gn = std::isnan(gpu.out[e]);
    if (cf != gf || (!finiteness_only && cn != gn)) ++p.out_mismatch;
    if (cf && gpu.bits[e] != gpu_clean.bits[e]) ++p.changed;
    p.poisoned += !cf;
  }
  for (size_t r = 0; r < gpu.lse.size(); ++r) {
    const float c = cpu.lse[r], g = gpu.lse[r];
    const bool same_class = (std::isnan(c) == std::isnan(g)) && (std::isinf(c) == std::isinf(g));
    if (!same_class) ++p.lse_mismatch;
    if (std::isfinite(c) && std::memcmp(&g, &gpu_clean.lse[r], 4) != 0) ++p.changed;
  }
  return p;
}

}  // namespace

// The LSE checks need the attention kernels to give LSE = NaN for a row whose
// sum l is NaN (their epilogues take `l > 0 ? m ln 2 + ln l : -inf`, which
// gives -inf): not in the [sanitize] subset until then.
TEST_CASE("hardening: the NaN/Inf policy on every GPU precision matches the CPU backend", "[gpu][hardening][nan]") {
  const bool fp8 = fp8_ok();
  for (int64_t D : {64, 128})
    for (sparge_precision_t prec : kPrecs) {
      if (fp8_mode(prec) && !fp8) continue;
      const Shape s = shp(1, 2, 1, 300, 330, D, true);
      const Inputs clean = make_inputs(s, Layout::HND, SPARGE_DTYPE_BFLOAT16, false, case_seed("hnan"));
      std::vector<uint8_t> mask = random_mask(s, 0.6, case_seed("hnan-mask"));
      // Key block 0 (visible to every row) in every row of blocks: every row
      // uses a key, so a poked q row always has an output to poison.
      for (int64_t r = 0; r < s.Hq * s.nQB(); ++r) mask[size_t(r * s.nKB())] = 1;
      struct Poke {
        const char* what;
        char tensor;
        int64_t h, i, c;
        float x;
      };
      const Poke pokes[] = {{"NaN in q", 'q', 1, 150, 7, NAN},      {"+Inf in q", 'q', 0, 20, 3, INFINITY},
                            {"NaN in k", 'k', 0, 70, 3, NAN},       {"-Inf in k", 'k', 0, 200, 9, -INFINITY},
                            {"NaN in v", 'v', 0, 100, 5, NAN},      {"+Inf in v", 'v', 0, 64, 11, INFINITY}};
      // A poked key's block kept by every query block of its head (the random mask could drop it
      // from all the rows that see it, and then nothing is there to poison).
      for (const Poke& pk : pokes)
        if (pk.tensor != 'q')
          for (int64_t qb = 0; qb < s.nQB(); ++qb) mask[size_t((pk.h * s.nQB() + qb) * s.nKB() + pk.i / 64)] = 1;
      const DeviceInputs dclean(clean);
      Stream stream;
      const AttnResult g0 = gpu_attention(clean, dclean, prec, &mask, nullptr, true, stream.get());
      REQUIRE(g0.status == SPARGE_OK);
      for (const Poke& pk : pokes) {
        INFO(precision_name(prec) << " D=" << D << ": " << pk.what);
        Inputs in = clean;
        HostTensor& t = pk.tensor == 'q' ? in.q : pk.tensor == 'k' ? in.k : in.v;
        poke(t, 0, pk.h, pk.i, pk.c, pk.x);
        const DeviceInputs din(in);
        const AttnResult g = gpu_attention(in, din, prec, &mask, nullptr, true, stream.get());
        const AttnResult c = cpu_attention(in, prec, &mask, nullptr, true);
        REQUIRE(g.status == SPARGE_OK);
        REQUIRE(c.status == SPARGE_OK);
        // An infinite v gives NaN or +-Inf (docs/SEMANTICS.md): which one
        // depends on whether a weight underflowed to 0, so only finiteness
        // must agree there.
        const Pattern p = compare_policy(g, g0, c, pk.tensor == 'v' && std::isinf(pk.x));
        CHECK(p.poisoned > 0);
        CHECK(p.out_mismatch == 0);
        CHECK(p.changed == 0);
        CHECK(p.lse_mismatch == 0);
      }
    }
}

TEST_CASE("hardening: the predicted mask keeps every visible block of a row with a non-finite score",
          "[gpu][hardening][nan][sanitize]") {
  const Shape s = shp(1, 2, 1, 500, 600, 128, true);
  Inputs in = make_inputs(s, Layout::HND, SPARGE_DTYPE_BFLOAT16, false, case_seed("hnan-pred"));
  poke(in.q, 0, 1, 300, 2, NAN);
  const DeviceInputs din(in);
  Stream stream;
  sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
  prm.topk = 0.2f;
  prm.estimator = SPARGE_ESTIMATOR_MEAN;  // masks compared bit for bit (KEYS_LSE may differ at near-ties)
  const PredictResult g = gpu_predict(in, din, SPARGE_PRECISION_INT8_FP8, prm, nullptr, false, stream.get());
  const PredictResult c = cpu_predict(in, SPARGE_PRECISION_INT8_FP8, prm, nullptr);
  REQUIRE(g.status == SPARGE_OK);
  REQUIRE(c.status == SPARGE_OK);
  CHECK(g.mask == c.mask);
  CHECK(g.kept == c.kept);
  const int64_t qb = 300 / 128, row = (1 * s.nQB() + qb) * s.nKB();
  for (int64_t kb = 0; kb < s.nKB(); ++kb) CHECK(int(g.mask[size_t(row + kb)]) == (kb < visible_blocks(s, qb) ? 1 : 0));
}

TEST_CASE("hardening: a caller's pending CUDA error survives a successful call", "[gpu][hardening][errors]") {
  const Shape s = shp(1, 2, 1, 256, 256, 64, false);
  const Inputs in = make_inputs(s, Layout::HND, SPARGE_DTYPE_BFLOAT16, false, case_seed("hpending"));
  size_t wsb = 0;
  sparge_plan_t plan = cuda_plan(s, SPARGE_DTYPE_BFLOAT16, SPARGE_PRECISION_FP16, &wsb);
  Call c(in, wsb);
  Stream stream;
  c.upload_async(in, stream.get());
  stream.sync();
  SGT_CUDA(cudaGetLastError());
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, size_t(1) << 62) == cudaErrorMemoryAllocation);  // the caller's own, non-sticky
  REQUIRE(cudaPeekAtLastError() == cudaErrorMemoryAllocation);
  CHECK(c.run(plan, nullptr, stream.get()) == SPARGE_OK);
  stream.sync();
  CHECK(cudaPeekAtLastError() == cudaErrorMemoryAllocation);  // still pending: the library did not clear it
  CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
  CHECK(cudaGetLastError() == cudaSuccess);
  sparge_destroy_plan(plan);
}

TEST_CASE("hardening: outputs overlapping inputs are refused on CUDA plans", "[gpu][hardening][errors][sanitize]") {
  const Shape s = shp(1, 2, 1, 256, 256, 64, false);
  const Inputs in = make_inputs(s, Layout::HND, SPARGE_DTYPE_BFLOAT16, false, case_seed("hoverlap"));
  size_t wsb = 0;
  sparge_plan_t plan = cuda_plan(s, SPARGE_DTYPE_BFLOAT16, SPARGE_PRECISION_FP16, &wsb);
  Call c(in, wsb);
  sparge_tensor_t o = c.od;
  o.data = c.q.get();  // in place
  CHECK(sparge_attention_run(plan, &c.qd, &c.kd, &c.vd, nullptr, nullptr, &o, &c.ld, c.ws.get(), wsb, nullptr) ==
        SPARGE_ERR_INVALID_ARGUMENT);
  CHECK(names_word(sparge_last_error(), "out"));
  CHECK(sparge_attention_run(plan, &c.qd, &c.kd, &c.vd, nullptr, nullptr, &c.od, &c.ld, c.v.get(), wsb, nullptr) ==
        SPARGE_ERR_INVALID_ARGUMENT);
  CHECK(names_word(sparge_last_error(), "workspace"));
  SGT_CUDA(cudaDeviceSynchronize());
  sparge_destroy_plan(plan);
}

namespace {

// Large inputs generated from a hash of the element index (distinct values
// everywhere, so a wrong 64-bit offset reads other values), written as bf16.
inline float hashed_value(uint64_t salt, uint64_t idx) {
  const uint64_t h = mix64(idx * 0x9E3779B97F4A7C15ull ^ salt);
  return float(double(h >> 40) * (1.0 / 16777216.0) * 3.4 - 1.7);
}
inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
// `bytes` bytes at byte offset `off` of a device buffer.
void download_bytes(void* dst, const DeviceBuffer& src, size_t off, size_t bytes) {
  SGT_CUDA(cudaMemcpy(dst, src.as<const char>() + off, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace

TEST_CASE("hardening: L = 256K with B*H*L*D beyond 2^31 elements, sampled rows vs float64",
          "[gpu][hardening][large]") {
  // Hq * L * D = 66 * 262144 * 128 = 2.21e9 > 2^31 elements in q and out; the
  // last two heads start beyond element 2^31.
  const int64_t Hq = 66, Hkv = 6, L = 262144, D = 128, nQB = L / 128, nKB = L / 64;
  const Shape s = shp(1, Hq, Hkv, L, L, D, true);
  const uint64_t nq = uint64_t(Hq) * L * D, nk = uint64_t(Hkv) * L * D;
  REQUIRE(nq > (uint64_t(1) << 31));
  const uint64_t sq = mix64(case_seed("hlarge") ^ 1), sk = mix64(sq ^ 2), sv = mix64(sq ^ 3);
  auto fill = [&](uint64_t n, uint64_t salt, DeviceBuffer& dst) {
    std::vector<uint16_t> host(n);
    parallel_for(64, [&](int64_t part) {
      const uint64_t a = n * uint64_t(part) / 64, b = n * uint64_t(part + 1) / 64;
      for (uint64_t e = a; e < b; ++e) host[e] = f32_to_bf16(hashed_value(salt, e));
    });
    dst.alloc(n * 2);
    dst.upload(host.data(), n * 2);
  };
  DeviceBuffer q, k, v, out, lse, mask;
  fill(nq, sq, q);
  fill(nk, sk, k);
  fill(nk, sv, v);
  out.alloc(nq * 2);
  lse.alloc(size_t(Hq) * L * 4);
  mask.alloc(size_t(Hq) * nQB * nKB);
  const int64_t qsh[4] = {1, Hq, L, D}, qst[4] = {Hq * L * D, L * D, D, 1};
  const int64_t ksh[4] = {1, Hkv, L, D}, kst[4] = {Hkv * L * D, L * D, D, 1};
  const int64_t lsh[3] = {1, Hq, L}, lst[3] = {Hq * L, L, 1};
  const int64_t msh[4] = {1, Hq, nQB, nKB}, mst[4] = {Hq * nQB * nKB, nQB * nKB, nKB, 1};
  const sparge_tensor_t qd = make_desc(q.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_BFLOAT16, 4, qsh, qst);
  const sparge_tensor_t kd = make_desc(k.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_BFLOAT16, 4, ksh, kst);
  const sparge_tensor_t vd = make_desc(v.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_BFLOAT16, 4, ksh, kst);
  const sparge_tensor_t od = make_desc(out.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_BFLOAT16, 4, qsh, qst);
  const sparge_tensor_t ld = make_desc(lse.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_FLOAT32, 3, lsh, lst);
  const sparge_tensor_t md = make_desc(mask.get(), SPARGE_DEVICE_CUDA, SPARGE_DTYPE_UINT8, 4, msh, mst);
  // Sampled rows: first/last rows of the first and last heads, and spread rows.
  std::vector<RowId> rows = {{0, 0, 0}, {0, 0, L - 1}, {0, Hq - 1, 0}, {0, Hq - 1, L - 1}, {0, Hq - 2, 123457}};
  for (int r = 0; r < 19; ++r) rows.push_back({0, int64_t(mix64(sq + r) % Hq), int64_t(mix64(sk + r) % L)});
  Stream stream;
  sparge_predict_params_t prm = SPARGE_PREDICT_PARAMS_INIT;
  prm.topk = 0.02f;
  const bool fp8 = fp8_ok();
  for (sparge_precision_t prec : {SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_INT8_FP16, SPARGE_PRECISION_FP16}) {
    if (fp8_mode(prec) && !fp8) continue;
    INFO(precision_name(prec));
    size_t wsb = 0;
    sparge_plan_t plan = cuda_plan(s, SPARGE_DTYPE_BFLOAT16, prec, &wsb);
    DeviceBuffer ws(wsb);
    REQUIRE(sparge_predict_mask(plan, &qd, &kd, &prm, &md, nullptr, ws.get(), wsb, stream.get()) == SPARGE_OK);
    out.fill(0xFF);
    lse.fill(0xFF);
    const sparge_status_t st =
        sparge_attention_run(plan, &qd, &kd, &vd, &md, nullptr, &od, &ld, ws.get(), wsb, stream.get());
    INFO(sparge_last_error());
    REQUIRE(st == SPARGE_OK);
    stream.sync();
    SGT_CUDA(cudaGetLastError());
    // float64 reference of the sampled rows on their mask rows.
    std::vector<double> err_num(rows.size()), err_den(rows.size()), lse_err(rows.size());
    std::vector<uint8_t> mrows(rows.size() * size_t(nKB));
    std::vector<uint16_t> orows(rows.size() * size_t(D));
    std::vector<float> lrows(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      const RowId& id = rows[r];
      download_bytes(mrows.data() + r * nKB, mask, (size_t(id.h) * nQB + size_t(id.i / 128)) * nKB, size_t(nKB));
      download_bytes(orows.data() + r * D, out, (size_t(id.h) * L + size_t(id.i)) * D * 2, size_t(D) * 2);
      download_bytes(&lrows[r], lse, (size_t(id.h) * L + size_t(id.i)) * 4, 4);
    }
    const double scale = 1.0 / std::sqrt(double(D));
    parallel_for(int64_t(rows.size()), [&](int64_t r) {
      const RowId& id = rows[size_t(r)];
      const int64_t hk = id.h / (Hq / Hkv);
      std::vector<double> qi(static_cast<size_t>(D)), o(static_cast<size_t>(D), 0.0);
      for (int64_t c = 0; c < D; ++c) qi[size_t(c)] = bf16_round(hashed_value(sq, uint64_t((id.h * L + id.i) * D + c)));
      double mx = -INFINITY;
      std::vector<double> sc;
      std::vector<int64_t> js;
      for (int64_t j = 0; j <= id.i; ++j) {
        if (!mrows[size_t(r) * nKB + size_t(j / 64)]) continue;
        double d = 0;
        for (int64_t c = 0; c < D; ++c) d += qi[size_t(c)] * bf16_round(hashed_value(sk, uint64_t((hk * L + j) * D + c)));
        sc.push_back(scale * d);
        js.push_back(j);
        mx = std::max(mx, scale * d);
      }
      double sum = 0;
      for (size_t u = 0; u < js.size(); ++u) {
        const double e = std::exp(sc[u] - mx);
        sum += e;
        for (int64_t c = 0; c < D; ++c) o[size_t(c)] += e * bf16_round(hashed_value(sv, uint64_t((hk * L + js[u]) * D + c)));
      }
      double num = 0, den = 0;
      for (int64_t c = 0; c < D; ++c) {
        const double ref = js.empty() ? 0.0 : o[size_t(c)] / sum;
        num += std::fabs(double(bf16_to_f32(orows[size_t(r) * D + c])) - ref);
        den += std::fabs(ref);
      }
      err_num[size_t(r)] = num, err_den[size_t(r)] = den;
      lse_err[size_t(r)] = js.empty() ? (std::isinf(lrows[size_t(r)]) ? 0.0 : 1.0) : std::fabs(lrows[size_t(r)] - (mx + std::log(sum)));
    });
    double num = 0, den = 0, lmax = 0;
    for (size_t r = 0; r < rows.size(); ++r) num += err_num[r], den += err_den[r], lmax = std::max(lmax, lse_err[r]);
    const double rel = num / den;
    record("hardening", std::string("L256K H66 ") + precision_name(prec), "relL1 sampled rows", rel,
           prec == SPARGE_PRECISION_FP16 ? 0.01 : 0.06, false);
    record("hardening", std::string("L256K H66 ") + precision_name(prec), "LSE maxabs sampled rows", lmax, 0.05, false);
    CHECK(rel < (prec == SPARGE_PRECISION_FP16 ? 0.01 : 0.06));
    CHECK(lmax < 0.05);
    sparge_destroy_plan(plan);
  }
}
