// CPU reference: block-sparse attention in the five precision modes
// (docs/SEMANTICS.md, "Attention on a mask" and "Precision modes").
#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/kernel_traits.hpp"
#include "cpu/common.hpp"

namespace sparge {
namespace cpu {
namespace {

constexpr int64_t kTile = 64;  // online-softmax key tile (FP16 and the int8 modes)
constexpr float kLn2 = 0.693147180559945309f;

// 2^(t - mx) for t <= mx. Equal to std::exp2(t - mx) whenever the difference is
// defined, and 1 when t == mx == +inf (scores that overflowed float32 for a huge
// scale): the softmax limit, instead of the NaN of inf - inf.
inline float stable_exp2(float t, float mx) { return t == mx ? 1.0f : std::exp2(t - mx); }

// ---------------------------------------------------------------- NaN policy
// (docs/SEMANTICS.md, "Non-finite values".) The max |x| behind an int8/fp8
// scale propagates NaN (std::max would drop it), and a maximum that is not
// finite gives the scale NaN; codes under a NaN scale are 0, as on the GPU.
inline float max_nan(float a, float b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }
inline float finite_or_nan(float a) { return std::isfinite(a) ? a : NAN; }

// Non-finite flags of the rows of a dense [L, D] buffer.
std::vector<uint8_t> nonfinite_rows(const std::vector<float>& x, int64_t L, int64_t D) {
  std::vector<uint8_t> bad(size_t(L), 0);
  for (int64_t r = 0; r < L; ++r)
    for (int64_t c = 0; c < D; ++c)
      if (!std::isfinite(x[size_t(r * D + c)])) {
        bad[size_t(r)] = 1;
        break;
      }
  return bad;
}
bool any_set(const std::vector<uint8_t>& f) { return std::find(f.begin(), f.end(), uint8_t(1)) != f.end(); }

struct HeadIO {
  const Problem& p;
  const Tensor4& out;
  const LseView* lse;
  int64_t b, h;
  void write_row(int64_t i, const float* o, float lse_val) const {
    const int64_t base = out.offset(b, h, i, 0);
    for (int64_t c = 0; c < p.D; ++c) store_elem(out.data, out.dtype, base + c, o[c]);
    if (lse) lse->data[b * lse->stride[0] + h * lse->stride[1] + i * lse->stride[2]] = lse_val;
  }
};

// Base-2 online softmax of one query row (docs/SEMANTICS.md, FP16 and
// INT8_FP8). The keys are visited in steps: step s covers the 64-key tiles
// tiles[s*per_step .. s*per_step + per_step) (aligned to multiples of 64,
// ascending). Per step m' = max(m, max_j t_j), alpha = 2^(m - m'),
// p_j = 2^(t_j - m'), l = l*alpha + sum p_j (unrounded),
// acc = acc*alpha + sum round_p(p_j) * v_j; a step without a used key is
// skipped. score(j, tile) gives t_j for a used key j; v_row(j) its D values of
// V. Leaves l == 0 when the row uses no key.
//
// NaN policy: a NaN score of a used key makes the whole row NaN (m, l and acc
// are NaN on return). With v_nonfinite (V holds a NaN or Inf somewhere), every
// key of a listed tile that the row does not use still adds 0 * v_j to acc, as
// the GPU kernels' tile products do (weight 0 for masked keys; 0 * NaN and
// 0 * inf are NaN), also in steps where the row uses no key.
//
// PV skip (tau2 = pv_tau2(pv_threshold), +inf when off): a step whose scores
// are all numbers and whose max is below m - tau2 leaves m, l and acc as they
// are (its keys get weight 0). With v_nonfinite its used keys still add
// 0 * v_j, as a tile product that runs for the other rows of a kernel's row
// group does.
template <class Score, class RoundP, class VRow>
void online_softmax_row(const Problem& p, const RowMask& rm, const std::vector<int64_t>& tiles, int per_step,
                        float tau2, Score score, RoundP round_p, VRow v_row, bool v_nonfinite,
                        std::vector<float>& t, std::vector<float>& acc, float& m, float& l) {
  const int64_t D = p.D;
  m = -INFINITY;
  l = 0.0f;
  std::fill(acc.begin(), acc.end(), 0.0f);
  t.resize(size_t(per_step * kTile));
  // A key of a listed tile that gets weight 0 still meets V in the tile product (0 * NaN = NaN).
  auto add_zero_v = [&](int64_t j) {
    const float* vj = v_row(j);
    for (int64_t c = 0; c < D; ++c) acc[size_t(c)] += 0.0f * vj[c];
  };
  const size_t n_tiles = tiles.size();
  for (size_t s0 = 0; s0 < n_tiles; s0 += size_t(per_step)) {
    const size_t s1 = std::min(n_tiles, s0 + size_t(per_step));
    float tmax = -INFINITY;
    bool any = false, nan = false;
    for (size_t u = s0; u < s1; ++u) {
      const int64_t tb = tiles[u], j0 = tb * kTile, j1 = std::min(p.Lkv, j0 + kTile);
      for (int64_t j = j0; j < j1; ++j) {
        float& tj = t[size_t(int64_t(u - s0) * kTile + (j - j0))];
        if (!rm.used(j)) {
          tj = -INFINITY;
          if (v_nonfinite) add_zero_v(j);
          continue;
        }
        any = true;
        tj = score(j, tb);
        nan |= std::isnan(tj);
        tmax = std::max(tmax, tj);
      }
    }
    if (nan) {
      m = l = NAN;
      std::fill(acc.begin(), acc.end(), NAN);
      return;
    }
    if (!any) continue;
    if (m != -INFINITY && tmax < m - tau2) {  // PV skip
      if (v_nonfinite)
        for (size_t u = s0; u < s1; ++u)
          for (int64_t j = tiles[u] * kTile, j1 = std::min(p.Lkv, j + kTile); j < j1; ++j)
            if (rm.used(j)) add_zero_v(j);
      continue;
    }
    const float mn = std::max(m, tmax);
    if (mn == -INFINITY) continue;
    const float alpha = (m == -INFINITY) ? 0.0f : stable_exp2(m, mn);
    float psum = 0.0f;
    for (int64_t c = 0; c < D; ++c) acc[size_t(c)] *= alpha;
    for (size_t u = s0; u < s1; ++u) {
      const int64_t tb = tiles[u], j0 = tb * kTile, j1 = std::min(p.Lkv, j0 + kTile);
      for (int64_t j = j0; j < j1; ++j) {
        const float tj = t[size_t(int64_t(u - s0) * kTile + (j - j0))];
        if (tj == -INFINITY) continue;
        const float pj = stable_exp2(tj, mn);
        psum += pj;
        const float pr = round_p(pj);
        const float* vj = v_row(j);
        for (int64_t c = 0; c < D; ++c) acc[size_t(c)] += pr * vj[c];
      }
    }
    l = l * alpha + psum;
    m = mn;
  }
}

// The listed tiles of query block qb (every mode; FP16 steps over each alone):
// 64-key tiles holding a key of
// a kept, causally visible block of the row, ascending. With 64-key mask
// blocks these are the kept visible blocks themselves, i.e. the GPU's per-row
// index list; consecutive pairs of it form the 128-key steps.
void listed_tiles(const Problem& p, const MaskView& m, int64_t b, int64_t h, int64_t qb,
                  std::vector<int64_t>& tiles) {
  tiles.clear();
  const int64_t vis = visible_key_blocks(p, qb);
  const uint8_t* row = m.data + m.offset(b, h, qb, 0);
  for (int64_t tb = 0; tb * kTile < p.Lkv; ++tb) {
    const int64_t j0 = tb * kTile, j1 = std::min(p.Lkv, j0 + kTile) - 1;
    bool listed = false;
    for (int64_t kb = j0 / p.BK; kb <= j1 / p.BK && kb < vis; ++kb) listed |= row[kb * m.stride[3]] != 0;
    if (listed) tiles.push_back(tb);
  }
}

// The unused keys of the listed tiles (row rm, tiles of its query block) add
// 0 * v_j to the row, as in the 16-bit modes' tile products: a channel with a
// non-finite v among them becomes NaN (unless it is already non-finite).
void nan_v_channels(const Problem& p, const RowMask& rm, const std::vector<int64_t>& tiles,
                    const std::vector<float>& vh, float* o) {
  const int64_t D = p.D;
  for (const int64_t tb : tiles)
    for (int64_t j = tb * kTile, j1 = std::min(p.Lkv, tb * kTile + kTile); j < j1; ++j) {
      if (rm.used(j)) continue;
      for (int64_t c = 0; c < D; ++c)
        if (!std::isfinite(vh[size_t(j * D + c)]) && std::isfinite(o[c])) o[c] = NAN;
    }
}

// ---------------------------------------------------------------- EXACT
// float64 throughout, two passes (max, then exp-sum and weighted sum).
// NaN policy: a non-finite q row or k row makes the score NaN, and a NaN score
// of a used key makes the row NaN; a non-finite v element reaches channel c of
// every row whose listed tiles hold its key (nan_v_channels).
void head_exact(const Problem& p, const std::vector<float>& qh, const std::vector<float>& kh,
                const std::vector<float>& vh, const MaskView& mask, const HeadIO& io) {
  const int64_t D = p.D;
  std::vector<double> s(static_cast<size_t>(p.Lkv)), o(static_cast<size_t>(D));
  std::vector<float> of(static_cast<size_t>(D));
  const std::vector<uint8_t> qbad = nonfinite_rows(qh, p.Lq, D), kbad = nonfinite_rows(kh, p.Lkv, D);
  const bool v_nonfinite = any_set(nonfinite_rows(vh, p.Lkv, D));
  std::vector<int64_t> tiles;
  for (int64_t i = 0; i < p.Lq; ++i) {
    if (v_nonfinite && i % p.BQ == 0) listed_tiles(p, mask, io.b, io.h, i / p.BQ, tiles);
    const RowMask rm = row_mask(p, mask, io.b, io.h, i);
    const float* qi = qh.data() + i * D;
    double mx = -INFINITY;
    bool nan = false;
    for (int64_t j = 0; j < p.Lkv; ++j) {
      if (!rm.used(j)) {
        s[size_t(j)] = -INFINITY;
        continue;
      }
      if (qbad[size_t(i)] || kbad[size_t(j)]) {
        nan = true;
        break;
      }
      double d = 0.0;
      const float* kj = kh.data() + j * D;
      for (int64_t c = 0; c < D; ++c) d += double(qi[c]) * double(kj[c]);
      s[size_t(j)] = double(p.scale) * d;
      mx = std::max(mx, s[size_t(j)]);
    }
    if (nan) {
      std::fill(of.begin(), of.end(), NAN);
      io.write_row(i, of.data(), NAN);
      continue;
    }
    if (mx == -INFINITY) {  // no used key
      std::fill(of.begin(), of.end(), 0.0f);
      if (v_nonfinite) nan_v_channels(p, rm, tiles, vh, of.data());
      io.write_row(i, of.data(), -INFINITY);
      continue;
    }
    std::fill(o.begin(), o.end(), 0.0);
    double sum = 0.0;
    for (int64_t j = 0; j < p.Lkv; ++j) {
      if (s[size_t(j)] == -INFINITY) continue;
      const double e = std::exp(s[size_t(j)] - mx);
      sum += e;
      const float* vj = vh.data() + j * D;
      for (int64_t c = 0; c < D; ++c) o[size_t(c)] += e * double(vj[c]);
    }
    for (int64_t c = 0; c < D; ++c) of[size_t(c)] = float(o[size_t(c)] / sum);
    if (v_nonfinite) nan_v_channels(p, rm, tiles, vh, of.data());
    io.write_row(i, of.data(), float(mx + std::log(sum)));
  }
}

// ---------------------------------------------------------------- FP16
// Inputs as given, fp32 scores, base-2 online softmax over 64-key tiles, P
// rounded to the input's 16-bit type (fp32 inputs: not rounded), fp32 accumulation.
void head_fp16(const Problem& p, const std::vector<float>& qh, const std::vector<float>& kh,
               const std::vector<float>& vh, const MaskView& mask, float tau2, const HeadIO& io) {
  const int64_t D = p.D;
  const float cexp = p.scale * kLog2e;
  std::vector<float> t, acc(static_cast<size_t>(D));
  const std::vector<uint8_t> qbad = nonfinite_rows(qh, p.Lq, D), kbad = nonfinite_rows(kh, p.Lkv, D);
  const bool v_nonfinite = any_set(nonfinite_rows(vh, p.Lkv, D));
  std::vector<int64_t> tiles;
  for (int64_t i = 0; i < p.Lq; ++i) {
    if (i % p.BQ == 0) listed_tiles(p, mask, io.b, io.h, i / p.BQ, tiles);
    const RowMask rm = row_mask(p, mask, io.b, io.h, i);
    const float* qi = qh.data() + i * D;
    float m, l;
    online_softmax_row(
        p, rm, tiles, 1, tau2,
        [&](int64_t j, int64_t) {
          if (qbad[size_t(i)] || kbad[size_t(j)]) return NAN;  // NaN policy: a non-finite q or k row
          float d = 0.0f;
          const float* kj = kh.data() + j * D;
          for (int64_t c = 0; c < D; ++c) d += qi[c] * kj[c];
          return d == 0.0f ? 0.0f : d * cexp;  // cexp may be +inf for a huge scale: 0 * inf is no score
        },
        [&](float pj) { return round_to(p.dtype, pj); }, [&](int64_t j) { return vh.data() + j * D; },
        v_nonfinite, t, acc, m, l);
    if (l == 0.0f) {  // no used key: zeros (NaN in a channel that a listed tile's non-finite v reaches)
      for (int64_t c = 0; c < D; ++c) acc[size_t(c)] = std::isnan(acc[size_t(c)]) ? NAN : 0.0f;
      io.write_row(i, acc.data(), -INFINITY);
      continue;
    }
    for (int64_t c = 0; c < D; ++c) acc[size_t(c)] = acc[size_t(c)] / l;
    io.write_row(i, acc.data(), m * kLn2 + std::log(l));
  }
}

// ---------------------------------------------------------------- int8 twins
// The rounding steps of the int8 GPU modes (INT8_FP8, INT8_FP8_SPLIT_V and
// INT8_FP16), exactly as listed in SEMANTICS.md.
struct QuantKV {
  std::vector<int8_t> k8;   // [Lkv, D] smoothed, per-64-key-block scale
  std::vector<float> sk;    // [nTiles]
  std::vector<float> v8;    // [Lkv, D] float(e4m3(y)), y = v * 448 / amax_c; split V: + float(e4m3(y - hi))
  std::vector<float> sv;    // [D] amax_c / 448
  // (v8 and sv stay empty for INT8_FP16, whose P.V uses V as given.)
};

inline int8_t quant_i8(float x, float inv) {
  float r = std::nearbyint(x * inv);
  r = std::min(127.0f, std::max(-127.0f, r));
  return int8_t(r);
}

// Scale factor a / div of a max |x| (NaN policy: a non-finite maximum gives
// NaN); whether codes are computed (a > 0: false for 0 and NaN).
inline float amax_scale(float a, float div) { return a == 0.0f ? 0.0f : a / div; }

void quantize_kv(const Problem& p, const std::vector<float>& kh, const std::vector<float>& vh,
                 const float* mu, QuantKV& qkv) {
  const int64_t D = p.D, nT = (p.Lkv + kTile - 1) / kTile;
  qkv.k8.assign(size_t(p.Lkv * D), 0);
  qkv.sk.assign(size_t(nT), 0.0f);
  std::vector<float> ks(size_t(kTile * D));
  for (int64_t tb = 0; tb < nT; ++tb) {
    const int64_t j0 = tb * kTile, j1 = std::min(p.Lkv, j0 + kTile);
    float a = 0.0f;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t c = 0; c < D; ++c) {
        const float x = kh[size_t(j * D + c)] - mu[c];
        ks[size_t((j - j0) * D + c)] = x;
        a = max_nan(a, std::fabs(x));
      }
    a = finite_or_nan(a);
    qkv.sk[size_t(tb)] = amax_scale(a, 127.0f);
    if (!(a > 0.0f)) continue;  // scale 0 or NaN, codes 0
    const float inv = 127.0f / a;
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t c = 0; c < D; ++c) qkv.k8[size_t(j * D + c)] = quant_i8(ks[size_t((j - j0) * D + c)], inv);
  }
  if (!p.fp8_pv()) return;
  qkv.sv.assign(size_t(D), 0.0f);
  qkv.v8.assign(size_t(p.Lkv * D), 0.0f);
  for (int64_t c = 0; c < D; ++c) {
    float a = 0.0f;
    for (int64_t j = 0; j < p.Lkv; ++j) a = max_nan(a, std::fabs(vh[size_t(j * D + c)]));
    a = finite_or_nan(a);
    qkv.sv[size_t(c)] = amax_scale(a, kFp8Max);
    if (!(a > 0.0f)) continue;  // scale 0 or NaN (the whole channel dequantizes to NaN), codes 0
    const float inv = kFp8Max / a;
    for (int64_t j = 0; j < p.Lkv; ++j) {
      const float y = vh[size_t(j * D + c)] * inv, hi = e4m3_round(y);
      // Split V: hi + lo is exact in float32 (lo is below half an e4m3 ulp of hi).
      qkv.v8[size_t(j * D + c)] = p.split_v() ? hi + e4m3_round(y - hi) : hi;
    }
  }
}

// INT8_FP8 and INT8_FP8_SPLIT_V: P as e4m3(p * 448) times the e4m3 V codes,
// dequantized by amax_c / 448 / 448 at the end. INT8_FP16: P rounded to the
// input's 16-bit type (as the FP16 mode) times V as given (vh).
void head_int8(const Problem& p, const std::vector<float>& qh, const std::vector<float>& vh, const QuantKV& kv,
               const float* mu, const MaskView& mask, float tau2, const HeadIO& io) {
  const bool fp8 = p.fp8_pv();
  // The GPU kernels' step (core/kernel_traits.hpp): P is rounded against its max.
  const int per_step = blocks_per_step(p.precision, p.D);
  const int64_t D = p.D;
  const float cexp = p.scale * kLog2e;
  std::vector<int8_t> q8(static_cast<size_t>(D));
  std::vector<float> t, acc(static_cast<size_t>(D));
  std::vector<int64_t> tiles;
  // INT8_FP16 multiplies V as given (the fp8 codes are always finite).
  const bool v_nonfinite = !fp8 && any_set(nonfinite_rows(vh, p.Lkv, D));
  for (int64_t i = 0; i < p.Lq; ++i) {
    if (i % p.BQ == 0) listed_tiles(p, mask, io.b, io.h, i / p.BQ, tiles);
    const RowMask rm = row_mask(p, mask, io.b, io.h, i);
    const float* qi = qh.data() + i * D;
    // per-token Q quantization
    float a = 0.0f;
    for (int64_t c = 0; c < D; ++c) a = max_nan(a, std::fabs(qi[c]));
    a = finite_or_nan(a);
    const float sq = amax_scale(a, 127.0f);
    if (!(a > 0.0f)) {  // scale 0 or NaN: codes 0
      std::fill(q8.begin(), q8.end(), int8_t(0));
    } else {
      const float inv = 127.0f / a;
      for (int64_t c = 0; c < D; ++c) q8[size_t(c)] = quant_i8(qi[c], inv);
    }
    const float qs = sq * cexp;
    float m, l;
    online_softmax_row(
        p, rm, tiles, per_step, tau2,
        [&](int64_t j, int64_t tb) {
          const float f = qs * kv.sk[size_t(tb)];
          int32_t d = 0;
          const int8_t* kj = kv.k8.data() + j * D;
          for (int64_t c = 0; c < D; ++c) d += int32_t(q8[size_t(c)]) * int32_t(kj[c]);
          // NaN policy: a NaN Q or K scale gives a NaN score. Otherwise f may overflow to +inf or
          // be 0 * inf = NaN (a huge scale): a zero dot product is no score.
          if (std::isnan(sq) || std::isnan(kv.sk[size_t(tb)])) return NAN;
          return d == 0 ? 0.0f : float(d) * f;
        },
        [&](float pj) { return fp8 ? e4m3_round(pj * kFp8Max) : round_to(p.dtype, pj); },
        [&](int64_t j) { return (fp8 ? kv.v8.data() : vh.data()) + j * D; }, v_nonfinite, t, acc, m, l);
    if (l == 0.0f) {  // no used key: zeros; NaN in a channel with a NaN V scale (fp8) or one that a
                      // listed tile's non-finite v reaches (INT8_FP16)
      for (int64_t c = 0; c < D; ++c)
        acc[size_t(c)] = (std::isnan(acc[size_t(c)]) || (fp8 && std::isnan(kv.sv[size_t(c)]))) ? NAN : 0.0f;
      io.write_row(i, acc.data(), -INFINITY);
      continue;
    }
    if (fp8) {
      // (acc / l) first: acc * (sv / 448) is the unnormalized sum of p·v, which overflows
      // float32 for |v| near the bf16 maximum; acc / l is at most 448 * 448.
      for (int64_t c = 0; c < D; ++c) acc[size_t(c)] = (acc[size_t(c)] / l) * (kv.sv[size_t(c)] / kFp8Max);
    } else {
      for (int64_t c = 0; c < D; ++c) acc[size_t(c)] = acc[size_t(c)] / l;
    }
    double qmu = 0.0;
    for (int64_t c = 0; c < D; ++c) qmu += double(qi[c]) * double(mu[c]);
    const float shift = float(double(p.scale) * qmu);
    io.write_row(i, acc.data(), m * kLn2 + std::log(l) + shift);
  }
}

}  // namespace

sparge_status_t attention(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                          const MaskView* mask, const PredictConfig& cfg, const Tensor4& out,
                          const LseView* lse, void* workspace) {
  const Problem& p = plan.prob;
  MaskView m;
  if (mask) {
    m = *mask;
  } else {
    m.data = ws_ptr<uint8_t>(workspace, plan.ws.mask);
    m.stride[3] = 1;
    m.stride[2] = p.nKB;
    m.stride[1] = p.nQB * p.nKB;
    m.stride[0] = p.Hq * p.nQB * p.nKB;
    SPARGE_TRY(predict(plan, q, k, cfg, m, nullptr, workspace));
  }
  float* k_mean = ws_ptr<float>(workspace, plan.ws.k_mean);
  if (p.quantized() && mask) compute_k_mean(plan, k, cfg.smooth_k, k_mean);

  const float tau2 = pv_tau2(cfg.pv_threshold);
  parallel_for(p.B * p.Hq, [&](int64_t bh) {
    const int64_t b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group();
    std::vector<float> qh, kh, vh;
    load_head(q, b, h, qh);
    load_head(k, b, hk, kh);
    load_head(v, b, hk, vh);
    const HeadIO io{p, out, lse, b, h};
    switch (p.precision) {
      case SPARGE_PRECISION_EXACT: head_exact(p, qh, kh, vh, m, io); break;
      case SPARGE_PRECISION_FP16: head_fp16(p, qh, kh, vh, m, tau2, io); break;
      default: {
        const float* mu = k_mean + (b * p.Hkv + hk) * p.D;
        QuantKV kv;
        quantize_kv(p, kh, vh, mu, kv);
        head_int8(p, qh, vh, kv, mu, m, tau2, io);
        break;
      }
    }
  });
  return SPARGE_OK;
}

}  // namespace cpu
}  // namespace sparge
