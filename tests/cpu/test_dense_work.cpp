// Dense calls (docs/API.md, "Dense attention"): the CUDA kernels enumerate their rows and blocks
// with core/problem.hpp's dense_row and dense_blocks instead of reading the work order and the
// index lists. Checked here on the host, where both are plain functions: every row exactly once,
// the order the work-order kernel gives such rows, and the counts of visible_key_blocks.
#include "catch_compat.hpp"

#include <cstdint>
#include <vector>

#include "core/problem.hpp"

namespace {

sparge::Problem dense_problem(int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t Lkv, bool causal) {
  sparge::Problem p;
  p.B = B, p.Hq = Hq, p.Hkv = Hkv, p.Lq = Lq, p.Lkv = Lkv, p.causal = causal;
  p.BQ = sparge::kGpuBlockQ, p.BK = sparge::kGpuBlockK;
  p.nQB = (Lq + p.BQ - 1) / p.BQ;
  p.nKB = (Lkv + p.BK - 1) / p.BK;
  return p;
}

}  // namespace

TEST_CASE("dense work: every row once, K/V group by group, heaviest first, visible blocks", "[dense]") {
  const int64_t heads[][2] = {{1, 1}, {4, 1}, {4, 2}, {6, 3}, {32, 1}, {12, 12}};
  const int64_t lens[][2] = {{1, 1},     {127, 127}, {128, 128},  {129, 129},  {200, 333}, {333, 130},
                             {1000, 300}, {300, 1000}, {4097, 4097}, {64, 4096}, {4096, 64}, {2048, 2048}};
  int64_t checked = 0;
  for (int64_t B : {1, 3})
    for (const auto& hh : heads)
      for (const auto& ll : lens)
        for (bool causal : {false, true}) {
          const sparge::Problem p = dense_problem(B, hh[0], hh[1], ll[0], ll[1], causal);
          INFO("B " << B << " Hq " << p.Hq << " Hkv " << p.Hkv << " Lq " << p.Lq << " Lkv " << p.Lkv << " causal "
                    << causal);
          const int64_t g = p.group(), rows = p.B * p.Hq * p.nQB, per_group = g * p.nQB;
          std::vector<int> seen(static_cast<size_t>(rows), 0);
          int64_t bad_range = 0, bad_group = 0, bad_order = 0, bad_count = 0;
          for (int64_t i = 0; i < rows; ++i) {
            const int32_t r = sparge::dense_row(int32_t(i), int32_t(p.Hq), int32_t(g), int32_t(p.nQB), causal);
            if (r < 0 || r >= rows) {
              ++bad_range;
              continue;
            }
            ++seen[size_t(r)];
            const int64_t bh = r / p.nQB, qb = r % p.nQB, b = bh / p.Hq, h = bh % p.Hq;
            // CTA i belongs to K/V group i / (g nQB), which is (b, h / g)
            bad_group += (b * p.Hkv + h / g) != i / per_group;
            const int64_t vis = sparge::visible_key_blocks(p, qb);
            bad_count += sparge::dense_blocks(int32_t(qb), causal, int32_t(p.Lq), int32_t(p.Lkv), int32_t(p.nKB)) != vis;
            // within a group, counts never grow (the longest rows start first)
            if (i % per_group != 0) {
              const int32_t rp =
                  sparge::dense_row(int32_t(i - 1), int32_t(p.Hq), int32_t(g), int32_t(p.nQB), causal);
              bad_order += vis > sparge::visible_key_blocks(p, rp % p.nQB);
            }
            ++checked;
          }
          int64_t not_once = 0;
          for (int s : seen) not_once += s != 1;
          CHECK(bad_range == 0);
          CHECK(not_once == 0);
          CHECK(bad_group == 0);
          CHECK(bad_order == 0);
          CHECK(bad_count == 0);
        }
  CHECK(checked > 40000);
}
