// CPU reference: block-mask prediction (docs/SEMANTICS.md, "Mask prediction").
//
// Accumulations are float64; the intermediates kept in the workspace (K mean,
// pooled vectors, self-similarities, block probabilities) are float32, the
// precision the CUDA backend keeps them in.
#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>

#include "core/error.hpp"
#include "cpu/common.hpp"

namespace sparge {
namespace cpu {

void compute_k_mean(const Plan& plan, const Tensor4& k, bool smooth, float* k_mean) {
  const Problem& p = plan.prob;
  const int64_t D = p.D;
  parallel_for(p.B * p.Hkv, [&](int64_t bh) {
    const int64_t b = bh / p.Hkv, h = bh % p.Hkv;
    float* mu = k_mean + bh * D;
    if (!smooth) {
      std::fill(mu, mu + D, 0.0f);
      return;
    }
    std::vector<double> acc(size_t(D), 0.0);
    for (int64_t j = 0; j < p.Lkv; ++j) {
      const int64_t base = k.offset(b, h, j, 0);
      for (int64_t c = 0; c < D; ++c) acc[size_t(c)] += load_elem(k.data, k.dtype, base + c);
    }
    for (int64_t c = 0; c < D; ++c) mu[c] = float(acc[size_t(c)] / double(p.Lkv));
  });
}

namespace {

// Pooled mean and self-similarity of rows [r0, r1) of a dense [L, D] buffer.
void pool_block(const float* x, int64_t D, int64_t r0, int64_t r1, float* pooled, float* sim) {
  const int64_t n = r1 - r0;
  std::vector<double> sum(size_t(D), 0.0), unit(size_t(D), 0.0);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * D;
    double nrm2 = 0.0;
    for (int64_t c = 0; c < D; ++c) {
      sum[size_t(c)] += row[c];
      nrm2 += double(row[c]) * double(row[c]);
    }
    if (nrm2 > 0.0) {
      const double inv = 1.0 / std::sqrt(nrm2);
      for (int64_t c = 0; c < D; ++c) unit[size_t(c)] += double(row[c]) * inv;
    }
  }
  double u2 = 0.0;
  for (int64_t c = 0; c < D; ++c) {
    pooled[c] = float(sum[size_t(c)] / double(n));
    u2 += unit[size_t(c)] * unit[size_t(c)];
  }
  *sim = float(u2 / (double(n) * double(n)));
}

// The pooled query row as the KEYS_LSE scores use it (docs/SEMANTICS.md, "Mask prediction", step 3):
// rounded once to the keys' 16-bit type, the single term the CUDA kernel feeds to the tensor cores.
// fp16 rows are first multiplied by 2^s, s = 15 - e for 2^(e-1) <= max_c |q_c| < 2^e (NaN entries
// ignored; s = 0 when the maximum is 0 or infinite), clamped to [-64, 64]: the largest entry lands
// in [2^14, 2^15), nothing overflows, and only entries 2^28 times smaller than the largest become
// fp16 subnormals. Writes rn16(q_c 2^s) to out (exact in double) and returns 2^-s, the factor that
// undoes the scaling after the dot product. float32 keys: the row as it is.
double keys_lse_row(const float* q, int64_t D, sparge_dtype_t dt, double* out) {
  if (dt == SPARGE_DTYPE_FLOAT16) {
    float mx = 0.0f;
    for (int64_t c = 0; c < D; ++c)
      if (!std::isnan(q[c])) mx = std::max(mx, std::fabs(q[c]));
    int s = 0;
    if (mx > 0.0f && std::isfinite(mx)) {
      int ex = 0;
      std::frexp(mx, &ex);  // mx in [2^(ex-1), 2^ex)
      s = std::min(std::max(15 - ex, -64), 64);
    }
    // (the scaling is exact, or its result is far below the fp16 range either way)
    for (int64_t c = 0; c < D; ++c) out[c] = double(round_to(dt, std::ldexp(q[c], s)));
    return std::ldexp(1.0, -s);
  }
  for (int64_t c = 0; c < D; ++c) out[c] = double(round_to(dt, q[c]));  // bf16: RNE; float32: unchanged
  return 1.0;
}

// The float32 sum of f(i), i = 0 .. n-1, as KEYS_LSE_SPLIT2's grouping forms it (docs/SEMANTICS.md,
// "Mask prediction", step 3): four partial sums over i = k (mod 4), each in ascending i, added as
// (p0 + p1) + (p2 + p3).
template <class F>
float sum4(int64_t n, F&& f) {
  float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t i = 0; i < n; ++i) p[i & 3] += f(i);
  return (p[0] + p[1]) + (p[2] + p[3]);
}

// KEYS_LSE_SPLIT2's grouping of rows [r0, r1) of a dense [L, D] buffer (docs/SEMANTICS.md, "Mask
// prediction", step 3), in float32 with every operation rounded on its own and every sum a sum4
// (the CUDA kernel's operations): seed a is the row farthest from the rows' mean, seed b the row
// farthest from a (the lowest index on equal distances); a row joins b when it is strictly nearer
// to b than to a. Writes each group's mean (zeros for an empty group) and its number of rows.
// adaptive (KEYS_LSE_ADAPTIVE): the rows stay one group (a) unless their mean is short but not
// near zero, 0.25 l <= |mean| < 0.75 l (l: the rows' mean length; rows with no common direction,
// such as independent noise, gain nothing from a split).
void split2_rows(const float* x, int64_t D, int64_t r0, int64_t r1, bool adaptive, float* mean_a, float* mean_b,
                 int64_t* na, int64_t* nb) {
  const int64_t n = r1 - r0;
  std::vector<float> mu(static_cast<size_t>(D)), sa(static_cast<size_t>(D)), sb(static_cast<size_t>(D));
  for (int64_t c = 0; c < D; ++c)
    mu[size_t(c)] = sum4(n, [&](int64_t i) { return x[(r0 + i) * D + c]; }) / float(n);
  // squared distance of row r to ref: the sum4 of (x_c - ref_c)^2 over the columns
  auto d2 = [&](int64_t r, auto&& ref) {
    return sum4(D, [&](int64_t c) {
      const float t = x[r * D + c] - ref(c);
      return t * t;
    });
  };
  auto farthest = [&](auto&& ref) {
    int64_t best = r0;
    float bd = -1.0f;
    for (int64_t r = r0; r < r1; ++r) {
      const float d = d2(r, ref);
      if (d > bd) bd = d, best = r;
    }
    return best;
  };
  // a vector's length: the square root of the sum4 of its squares
  auto length = [&](const std::vector<float>& u) {
    return std::sqrt(sum4(D, [&](int64_t c) { return u[size_t(c)] * u[size_t(c)]; }));
  };
  auto one_group = [&] {
    for (int64_t c = 0; c < D; ++c) mean_a[c] = mu[size_t(c)], mean_b[c] = 0.0f;
    *na = n, *nb = 0;
  };
  if (adaptive) {
    auto row_length = [&](int64_t i) { return std::sqrt(d2(r0 + i, [](int64_t) { return 0.0f; })); };
    const float ell = sum4(n, row_length) / float(n);
    const float m = length(mu);
    if (!(m < 0.75f * ell && m >= 0.25f * ell)) return one_group();
  }
  const int64_t a = farthest([&](int64_t c) { return mu[size_t(c)]; });
  auto row_a = [&](int64_t c) { return x[a * D + c]; };
  const int64_t b = farthest(row_a);
  auto row_b = [&](int64_t c) { return x[b * D + c]; };
  std::vector<int64_t> rows_a, rows_b;  // each group's rows, ascending
  for (int64_t i = 0; i < n; ++i) (d2(r0 + i, row_b) < d2(r0 + i, row_a) ? rows_b : rows_a).push_back(r0 + i);
  const int64_t ca = int64_t(rows_a.size()), cb = int64_t(rows_b.size());
  for (int64_t c = 0; c < D; ++c) {  // the groups' means: each group's sum4 over its own rows
    const float ta = sum4(ca, [&](int64_t j) { return x[rows_a[size_t(j)] * D + c]; });
    const float tb = sum4(cb, [&](int64_t j) { return x[rows_b[size_t(j)] * D + c]; });
    sa[size_t(c)] = ca ? ta / float(ca) : 0.0f;
    sb[size_t(c)] = cb ? tb / float(cb) : 0.0f;
  }
  for (int64_t c = 0; c < D; ++c) mean_a[c] = sa[size_t(c)], mean_b[c] = sb[size_t(c)];
  *na = ca, *nb = cb;
}

float head_value(const float* per_head, int64_t h, float scalar) {
  return per_head ? per_head[h] : scalar;
}

}  // namespace

sparge_status_t predict(const Plan& plan, const Tensor4& q, const Tensor4& k, const PredictConfig& cfg,
                        const MaskView& mask_out, const KeptView* kept, void* workspace) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& ws = plan.ws;
  const int64_t D = p.D, nQB = p.nQB, nKB = p.nKB;
  float* k_mean = ws_ptr<float>(workspace, ws.k_mean);
  float* pooled_q = ws_ptr<float>(workspace, ws.pooled_q);
  float* sim_q = ws_ptr<float>(workspace, ws.sim_q);
  float* pooled_k = ws_ptr<float>(workspace, ws.pooled_k);
  float* sim_k = ws_ptr<float>(workspace, ws.sim_k);
  float* probs = ws_ptr<float>(workspace, ws.scores);
  int32_t* kept_ws = ws_ptr<int32_t>(workspace, ws.kept);

  // 1-2. K smoothing, pooled smoothed K and its self-similarity, per kv head.
  compute_k_mean(plan, k, cfg.smooth_k, k_mean);
  parallel_for(p.B * p.Hkv, [&](int64_t bh) {
    std::vector<float> kh;
    load_head(k, bh / p.Hkv, bh % p.Hkv, kh);
    const float* mu = k_mean + bh * D;
    for (int64_t j = 0; j < p.Lkv; ++j)
      for (int64_t c = 0; c < D; ++c) kh[size_t(j * D + c)] -= mu[c];
    for (int64_t kb = 0; kb < nKB; ++kb) {
      const int64_t r0 = kb * p.BK, r1 = std::min(p.Lkv, r0 + p.BK);
      pool_block(kh.data(), D, r0, r1, pooled_k + (bh * nKB + kb) * D, sim_k + bh * nKB + kb);
    }
  });

  // 2-6. Per query head: pooled Q, scores, softmax, selection, forced blocks.
  parallel_for(p.B * p.Hq, [&](int64_t bh) {
    const int64_t b = bh / p.Hq, h = bh % p.Hq;
    const int64_t bhk = b * p.Hkv + h / p.group();
    std::vector<float> qh, kraw;
    load_head(q, b, h, qh);
    const bool adaptive = cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE;
    const bool split2 = cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2 || adaptive;
    const bool keys_lse = cfg.estimator == SPARGE_ESTIMATOR_KEYS_LSE;
    // raw keys (a shift of K moves a row's scores alike)
    if (keys_lse || split2) load_head(k, b, h / p.group(), kraw);
    for (int64_t qb = 0; qb < nQB; ++qb) {
      const int64_t r0 = qb * p.BQ, r1 = std::min(p.Lq, r0 + p.BQ);
      pool_block(qh.data(), D, r0, r1, pooled_q + (bh * nQB + qb) * D, sim_q + bh * nQB + qb);
    }
    const float topk = head_value(cfg.topk_per_head, h, cfg.topk);
    const float cdf = head_value(cfg.cdf_per_head, h, cfg.cdf_threshold);
    const float sim_thr = head_value(cfg.sim_per_head, h, cfg.sim_threshold);
    const float* pk = pooled_k + bhk * nKB * D;
    const float* sk = sim_k + bhk * nKB;

    int64_t kept_count = 0;
    std::vector<double> e(static_cast<size_t>(nKB));
    std::vector<int64_t> order(static_cast<size_t>(nKB));
    std::vector<uint8_t> keep(static_cast<size_t>(nKB));
    std::vector<double> sc(static_cast<size_t>(p.BK)), qr(static_cast<size_t>(D));
    std::vector<float> grow[2] = {std::vector<float>(size_t(D)), std::vector<float>(size_t(D))};  // SPLIT2 rows
    std::vector<double> gs[2] = {std::vector<double>(size_t(split2 ? nKB : 0)),
                                 std::vector<double>(size_t(split2 ? nKB : 0))};
    for (int64_t qb = 0; qb < nQB; ++qb) {
      const int64_t vis = visible_key_blocks(p, qb);
      const float* pq = pooled_q + (bh * nQB + qb) * D;
      float* P = probs + (bh * nQB + qb) * nKB;
      std::fill(keep.begin(), keep.end(), uint8_t(0));
      std::fill(P, P + nKB, 0.0f);
      if (vis > 0) {
        // 3. scores and softmax over the visible entries
        double mx = -INFINITY;
        // keys visible to the block's last row (KEYS_LSE)
        const int64_t last_key = p.causal ? causal_last_key(std::min(p.Lq, (qb + 1) * p.BQ) - 1, p.Lq, p.Lkv)
                                          : p.Lkv - 1;
        bool nonfinite = false;
        // KEYS_LSE: log sum_j exp(scale * q' . k_j) over block kb's keys that the block's last row
        // sees, q' the pooled row pr rounded to the keys' 16-bit type (qr; kfac: the score factor),
        // each score rounded to float32 (the products of two 16-bit values are exact; an infinite k
        // element gives +-Inf, or NaN where q'_c is 0). A -Inf score has weight 0; a block whose
        // scores are all -Inf gets -Inf (a zero sum), one with a NaN or +Inf score NaN.
        auto lse_block = [&](double kfac, int64_t kb) {
          const int64_t j0 = kb * p.BK, j1 = std::min({p.Lkv, j0 + p.BK, last_key + 1});
          double m = -INFINITY;
          for (int64_t j = j0; j < j1; ++j) {
            double d = 0.0;
            for (int64_t c = 0; c < D; ++c) d += qr[size_t(c)] * double(kraw[size_t(j * D + c)]);
            sc[size_t(j - j0)] = double(float(kfac * d));
            m = std::max(m, sc[size_t(j - j0)]);  // ignores NaN, which reaches the sum
          }
          const double mb = m == -INFINITY ? 0.0 : m;
          double sum = 0.0;
          for (int64_t j = j0; j < j1; ++j) sum += std::exp(sc[size_t(j - j0)] - mb);
          return j1 > j0 ? float(m + std::log(sum)) : -INFINITY;
        };
        // The row KEYS_LSE scores: the pooled row, or the mean row of a KEYS_LSE_ADAPTIVE block
        // that keeps one group; null for MEAN and for blocks of two combined groups.
        const float* lse_row = keys_lse ? pq : nullptr;
        bool combined = false;
        if (split2) {
          // KEYS_LSE_SPLIT2: each group's KEYS_LSE scores s_g, normalized over the visible blocks
          // (u_g = s_g - log sum exp s_g), combined as log sum_g (n_g / n) exp(u_g) in float64 and
          // rounded to float32: the log of the size-weighted mean of the groups' block
          // distributions. A non-finite s_g or normalizer makes the block's score NaN (the row
          // then keeps every visible block, as for KEYS_LSE).
          const int64_t r0 = qb * p.BQ, r1 = std::min(p.Lq, r0 + p.BQ);
          int64_t ng[2];
          split2_rows(qh.data(), D, r0, r1, adaptive, grow[0].data(), grow[1].data(), &ng[0], &ng[1]);
          if (adaptive && ng[1] == 0) {
            lse_row = grow[0].data();  // KEYS_LSE_ADAPTIVE, one group: KEYS_LSE's scores of its mean row
          } else {
            combined = true;
            for (int g = 0; g < 2; ++g) {
              if (ng[g] == 0) continue;
              const double kfac = double(p.scale) * keys_lse_row(grow[g].data(), D, k.dtype, qr.data());
              double m = -INFINITY;
              for (int64_t kb = 0; kb < vis; ++kb) {
                gs[g][size_t(kb)] = double(lse_block(kfac, kb));
                m = std::max(m, gs[g][size_t(kb)]);
              }
              double sum = 0.0;
              for (int64_t kb = 0; kb < vis; ++kb) sum += std::exp(gs[g][size_t(kb)] - m);
              const double norm = m + std::log(sum);
              const double lw = std::log(double(ng[g]) / double(r1 - r0));
              for (int64_t kb = 0; kb < vis; ++kb) gs[g][size_t(kb)] += lw - norm;
            }
            for (int64_t kb = 0; kb < vis; ++kb) {
              double m = -INFINITY, sum = 0.0;
              bool bad = false;
              for (int g = 0; g < 2; ++g)
                if (ng[g]) bad |= !std::isfinite(gs[g][size_t(kb)]), m = std::max(m, gs[g][size_t(kb)]);
              for (int g = 0; g < 2; ++g)
                if (ng[g]) sum += std::exp(gs[g][size_t(kb)] - m);
              const float sf = bad ? NAN : float(m + std::log(sum));
              e[size_t(kb)] = sf;
              mx = std::max(mx, double(sf));
              nonfinite |= !std::isfinite(sf);
            }
          }
        }
        const double kfac = lse_row ? double(p.scale) * keys_lse_row(lse_row, D, k.dtype, qr.data()) : 0.0;
        for (int64_t kb = 0; kb < (combined ? 0 : vis); ++kb) {
          float sf;
          if (lse_row) {
            sf = lse_block(kfac, kb);
          } else {
            double s = 0.0;
            for (int64_t c = 0; c < D; ++c) s += double(pq[c]) * double(pk[kb * D + c]);
            sf = float(double(p.scale) * s);
          }
          e[size_t(kb)] = sf;
          mx = std::max(mx, double(sf));
          nonfinite |= !std::isfinite(sf);
        }
        if (nonfinite) {
          // NaN policy: a row with a NaN or infinite score (a non-finite input, or a
          // scale so large that float32 scores overflow) keeps every visible block, so
          // the selection never drops a non-finite value.
          for (int64_t kb = 0; kb < vis; ++kb) keep[size_t(kb)] = 1;
        } else {
          // 4. selection: the budget's forced blocks first (sink, local window, causal
          // diagonal), then the others by key descending, ties by lower block index. The key
          // is the float32 score for top-k (no softmax: the ranking of the scores themselves,
          // also where their probabilities would round to equal float32 values or to 0) and
          // the float32 probability (softmax of the row in float64) for CDF.
          const bool topk_mode = cfg.mode == SPARGE_SELECT_TOPK;
          if (!topk_mode) {  // (e holds the float32 scores, which top-k ranks as they are)
            double tot = 0.0;
            for (int64_t kb = 0; kb < vis; ++kb) {
              e[size_t(kb)] = std::exp(e[size_t(kb)] - mx);
              tot += e[size_t(kb)];
            }
            for (int64_t kb = 0; kb < vis; ++kb) P[kb] = float(e[size_t(kb)] / tot);
          }
          const BudgetForced fb = budget_forced(p, cfg, qb);
          int64_t nforced = 0;
          for (int64_t kb = 0; kb < vis; ++kb) nforced += fb.has(kb) ? 1 : 0;
          std::iota(order.begin(), order.begin() + vis, int64_t(0));
          std::stable_sort(order.begin(), order.begin() + vis, [&](int64_t a, int64_t c) {
            const bool fa = fb.has(a), fc = fb.has(c);
            if (fa != fc) return fa;
            return !fa && (topk_mode ? e[size_t(a)] > e[size_t(c)] : P[a] > P[c]);
          });
          int64_t n = 0;
          if (topk_mode) {
            n = std::max(topk_count(topk, vis), nforced);
          } else {
            double acc = 0.0;
            while (n < vis) {
              acc += double(P[order[size_t(n)]]);
              ++n;
              if (n >= nforced && acc >= double(cdf)) break;
            }
          }
          for (int64_t t = 0; t < n; ++t) keep[size_t(order[size_t(t)])] = 1;
        }
        // 5. forced blocks
        if (sim_q[bh * nQB + qb] < sim_thr)
          for (int64_t kb = 0; kb < vis; ++kb) keep[size_t(kb)] = 1;
        for (int64_t kb = 0; kb < vis; ++kb)
          if (sk[kb] < sim_thr) keep[size_t(kb)] = 1;
      }
      // 6. write the whole row (invisible blocks are 0)
      for (int64_t kb = 0; kb < nKB; ++kb) {
        mask_out.data[mask_out.offset(b, h, qb, kb)] = keep[size_t(kb)];
        kept_count += keep[size_t(kb)];
      }
    }
    kept_ws[bh] = int32_t(std::min<int64_t>(kept_count, INT32_MAX));  // saturates (int32 output)
  });

  if (kept) {
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t h = 0; h < p.Hq; ++h)
        kept->data[b * kept->stride[0] + h * kept->stride[1]] = kept_ws[b * p.Hq + h];
  }
  return SPARGE_OK;
}

}  // namespace cpu
}  // namespace sparge
