// The sm_90a attention kernel skeleton: one warp-specialized kernel for every
// mainloop (mainloop_int8_fp8.cuh: INT8_FP8 and split V;
// mainloop_16bit.cuh: FP16 and INT8_FP16).
//
// A CTA computes 128-row query blocks of one (batch, head) over the key
// blocks listed for them (the scheduling stage's work lists), rows of the
// work order one after the other (persistent: the grid is at most one CTA per
// SM, so that a row's Q and first stages load while the previous row's
// epilogue runs; with a grid of one CTA per row each CTA takes one). Three
// warpgroups:
//   WG0  producer: one thread issues the mainloop's TMA loads of each row's Q
//        (once the consumers are done with the previous row's, the qfree
//        barrier) and, per step, of the step's listed K and V blocks into a
//        ring of shared-memory stages guarded by full/empty mbarriers, whose
//        slots and phases run on across the rows (the first row's Q and stage
//        0 before the CTA-wide barrier), and draws the CTA's next row;
//   WG1, WG2  consumers, 64 query rows each, steps of the mainloop's
//        kHalves listed blocks. In its turn a warpgroup issues Q.K^T(u) then
//        P.V(u-1); it takes the row max of step u while P.V(u-1) runs, then
//        folds P.V(u-1) (after_pv) alongside the exponentials of step u,
//        which overwrite the P registers P.V(u-1) read. The other warpgroup
//        has its turn meanwhile, so one's softmax overlaps the other's matrix
//        products.
// The online softmax (../common/softmax.cuh) and the epilogue writer (cta.cuh) are
// shared; a mainloop supplies its layout, loads, matrix products, fold and
// output scaling. Host side: launch_sm90.cuh.
#pragma once
#include <cuda.h>

#include "cuda/attention/sm90/cta.cuh"
#include "cuda/attention/sm90/primitives.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {

constexpr int kThreads = 384;
// setmaxnreg budgets: 128*24 + 256*240 <= 64K registers of the SM.
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kConsumerRegs = 240;

// The consumers' steps 0 .. n_steps-1 of one row (see the file comment).
// g0: the CTA's steps before this row (the ring position of its step 0).
template <class ML, class C, class Ring>
__device__ __forceinline__ void consume(C& c, const RowWork& w, const Ring& ring, int n_steps, int g0) {
  constexpr int kHalves = ML::kHalves;
  constexpr int kStages = ML::Layout::kStages;
  const int me = c.cw, other = c.cw ^ 1;
  if (me == 1) turn_end(0);  // warpgroup 0 goes first
  uint32_t pa[ML::KS][4];
  float ap0, ap1, ac0, ac1;  // rescale factors of the previous and the current step
  int kb[kHalves];
  float ksc[kHalves];  // int8 Q.K^T: the step's K block scales
  auto blocks = [&](int u) {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) kb[hh] = w.block<kHalves>(u, hh);
    c.load_kscale(kb, ksc);
  };
  // Step 0: Q.K^T alone, waited for.
  blocks(0);
  const RingPos<kStages> r0(g0, 0);
  mbar_wait(&ring.full[r0.slot], r0.phase);
  {
    const uint64_t dk = c.desc_k(r0.slot);
    turn_begin(me);
    c.issue_qk(dk);
    wgmma_commit();
    turn_end(other);
    wgmma_wait<0>();
    fence_regs(c.s);
  }
  {
    const auto st = c.sm.row_max(c.s, kb, ksc, ap0, ap1);
    c.sm.exponentiate(c.s, st, ap0, ap1, pa, [] {});
  }
  for (int u = 1; u < n_steps; ++u) {
    const RingPos<kStages> r(g0, u);
    const int s = r.slot, sp = s == 0 ? kStages - 1 : s - 1;
    mbar_wait(&ring.full[s], r.phase);
    const uint64_t dk = c.desc_k(s), dv = c.desc_v(sp);
    blocks(u);
    turn_begin(me);
    c.issue_qk(dk);
    wgmma_commit();
    c.issue_pv(dv, pa);
    wgmma_commit();
    turn_end(other);
    wgmma_wait<1>();  // Q.K^T(u) done
    fence_regs(c.s);
    const auto st = c.sm.row_max(c.s, kb, ksc, ac0, ac1);
    if constexpr (ML::kMaxUnderPV) {
      // The wait sits inside the exponentials' branch arms: ptxas schedules
      // within a basic block and would otherwise sink the row max below it.
      c.sm.exponentiate(c.s, st, ac0, ac1, pa, [&] {
        wgmma_wait<0>();  // P.V(u-1) done
        c.fence_pv();
        fence_regs(pa);
        mbar_arrive(&ring.empty[sp]);
        c.after_pv(ap0, ap1, ac0, ac1);
      });
    } else {
      wgmma_wait<0>();  // P.V(u-1) done
      c.fence_pv();
      fence_regs(pa);
      mbar_arrive(&ring.empty[sp]);
      c.sm.exponentiate(c.s, st, ac0, ac1, pa, [&] { c.after_pv(ap0, ap1, ac0, ac1); });
    }
    ap0 = ac0;
    ap1 = ac1;
  }
  // The last turn: P.V of the last step.
  const int sp = RingPos<kStages>(g0, n_steps - 1).slot;
  const uint64_t dv = c.desc_v(sp);
  turn_begin(me);
  c.issue_pv(dv, pa);
  wgmma_commit();
  if (me == 0) turn_end(other);  // balances the initial arrive
  wgmma_wait<0>();
  c.fence_pv();
  mbar_arrive(&ring.empty[sp]);
  c.after_last_pv(ap0, ap1);
}

template <class ML>
__global__ void __launch_bounds__(kThreads, 1) attn_sm90_kernel(const __grid_constant__ Maps maps, const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  using L = typename ML::Layout;
  constexpr int kStages = L::kStages, kHalves = ML::kHalves;
  static_assert(kHalves <= kListReadAhead, "the first step reads more list entries than the scheduler defines");
  extern __shared__ uint8_t smem_raw[];
  const SmemRing<kStages> ring(smem_raw, L::kBar);
  RowWork w(p);
  int n_steps = w.steps<kHalves>();
  // Stage s <- the step's listed blocks. A missing block (an odd count at
  // the end of a row) loads the first again: finite data whose scores are
  // masked, so every stage completes the same byte count.
  auto load_stage = [&](int s, const int (&kbh)[kHalves]) {
    mbar_arrive_expect_tx(&ring.full[s], L::kKStage + L::kVStage);
    uint8_t* sk = ring.base + L::kK + s * L::kKStage;
    uint8_t* sv = ring.base + L::kV + s * L::kVStage;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh)
      ML::load_block(maps, p, w, sk, sv, &ring.full[s], hh, kbh[hh] >= 0 ? kbh[hh] : kbh[0]);
  };
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0)
    start_ring<kStages, kHalves>(w, p.nKB, n_steps, ring, [&] { ML::load_q(maps, p, w, ring.base, ring.qbar); },
                                 load_stage);
  __syncthreads();

  // The CTA's rows: its first is entry blockIdx.x of the work order, the
  // next ones entries gridDim.x + (the row counter after the order, which the
  // order's builder zeroed, drawn by atomicAdd): a CTA takes a row when it
  // starts the one before, so the long rows at the head of each group spread
  // over the SMs as with one CTA per row. The producer hands each next row to
  // the consumers through ring.rows[parity] before its Q barrier. g0 counts
  // the ring steps of the rows before.
  int g0 = 0;
  if (wg == 0) {
    regs_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) {
      int* counter = const_cast<int*>(p.order) + p.n_rows;
      for (int t = 0;; ++t) {
        // The next row, drawn now and used after this one's stages.
        int next = p.n_rows;
        if constexpr (ML::kPersistent) {
          const int64_t e = int64_t(gridDim.x) + atomicAdd(counter, 1);
          if (e < p.n_rows) next = int(e);
        }
        produce<kStages, kHalves>(w, n_steps, g0, t > 0 ? 0 : 1, ring.empty, load_stage);
        if constexpr (!ML::kPersistent) break;
        g0 += n_steps;
        int row = -1, n = 0;
        if (next < p.n_rows) {
          row = p.order[next];
          n = p.cnt[row];
        }
        mbar_wait(ring.qfree, t & 1);  // the consumers are done with this row's Q tile
        ring.rows[(t + 1) & 1] = make_int2(row, n);
        mbar_arrive(ring.rowbar);
        if (row < 0) break;  // no more rows
        w = RowWork(p, row, n);
        n_steps = w.steps<kHalves>();
        ML::load_q(maps, p, w, ring.base, ring.qbar);
      }
    }
    return;
  }

  regs_alloc<kConsumerRegs>();
  const int tid = threadIdx.x - 128 * wg;
  for (int t = 0;; ++t) {
    if (t > 0) {
      mbar_wait(ring.rowbar, (t - 1) & 1);
      const int2 r = ring.rows[t & 1];
      if (r.x < 0) break;
      w = RowWork(p, r.x, r.y);
      n_steps = w.steps<kHalves>();
    }
    typename ML::Consumer c(p, wg - 1, tid, w, ring.base, t & 1);
    mbar_wait(ring.qbar, t & 1);
    if (n_steps > 0) consume<ML>(c, w, ring, n_steps, g0);
    if constexpr (!ML::kOutInQ) mbar_arrive(ring.qfree);
    c.epilogue(maps, ring.base, tid);
    if constexpr (ML::kOutInQ) mbar_arrive(ring.qfree);  // the output was staged in the Q tile
    if constexpr (!ML::kPersistent) break;
    g0 += n_steps;
  }
#else
  __trap();  // built for another architecture: the registry must not offer this
#endif
}

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
