// CPU backend of sparge_merge_states: LSE-weighted combination of partial
// attention states, float64 arithmetic, one output row at a time.
#include <cmath>
#include <vector>

#include "cpu/common.hpp"

namespace sparge {
namespace cpu {

sparge_status_t merge_states(const MergeArgs& a) {
  const int64_t B = a.shape[0], H = a.shape[1], L = a.shape[2], D = a.shape[3];
  parallel_for(B * H, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    std::vector<double> w(static_cast<size_t>(a.count)), acc(static_cast<size_t>(D));
    for (int64_t l = 0; l < L; ++l) {
      // Row maximum over the LSEs that are not -inf; NaN poisons the row.
      bool nan = false, any = false;
      double m = -INFINITY;
      for (int32_t i = 0; i < a.count; ++i) {
        const MergeInput& in = a.in[i];
        const double x = in.lse[b * in.lse_stride[0] + h * in.lse_stride[1] + l * in.lse_stride[2]];
        w[size_t(i)] = x;
        if (std::isnan(x)) nan = true;
        else if (x != -INFINITY) {
          any = true;
          if (x > m) m = x;
        }
      }
      double lse = -INFINITY;
      std::fill(acc.begin(), acc.end(), 0.0);
      if (nan) {
        std::fill(acc.begin(), acc.end(), double(NAN));
        lse = NAN;
      } else if (any) {
        double tot = 0.0;
        for (int32_t i = 0; i < a.count; ++i) {
          const double x = w[size_t(i)];
          // exp(x - m), with the limits: -inf weighs 0 (and its row is not read); x == m weighs 1,
          // also when both are +inf.
          const double wi = x == -INFINITY ? 0.0 : (x == m ? 1.0 : std::exp(x - m));
          w[size_t(i)] = wi;
          tot += wi;
        }
        for (int32_t i = 0; i < a.count; ++i) {
          const double wi = w[size_t(i)];
          if (wi == 0.0) continue;
          const MergeInput& in = a.in[i];
          const int64_t base = b * in.stride[0] + h * in.stride[1] + l * in.stride[2];
          for (int64_t d = 0; d < D; ++d)
            acc[size_t(d)] += wi * double(load_elem(in.data, in.dtype, base + d * in.stride[3]));
        }
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] /= tot;
        lse = m + std::log(tot);
      }
      // All reads of this row are done: out (and lse_out) may be one of the inputs.
      const int64_t ob = b * a.out_stride[0] + h * a.out_stride[1] + l * a.out_stride[2];
      for (int64_t d = 0; d < D; ++d) store_elem(a.out, a.out_dtype, ob + d * a.out_stride[3], float(acc[size_t(d)]));
      if (a.lse_out)
        a.lse_out[b * a.lse_out_stride[0] + h * a.lse_out_stride[1] + l * a.lse_out_stride[2]] = float(lse);
    }
  });
  return SPARGE_OK;
}

}  // namespace cpu
}  // namespace sparge
