// The sm_90a attention kernel skeleton: one warp-specialized kernel for every
// mainloop (mainloop_int8_fp8.cuh: INT8_FP8 and split V;
// mainloop_16bit.cuh: FP16 and INT8_FP16).
//
// One CTA computes one 128-row query block of one (batch, head) over the key
// blocks listed for it (the scheduling stage's work lists). Three warpgroups
// (a mainloop with kConsumers = 3, dense calls only, has a third consumer and
// 192-row tiles; the turns pass round the consumers in order):
//   WG0  producer: one thread issues the mainloop's TMA loads of Q (once) and,
//        per step, of the step's listed K and V blocks into a ring of
//        shared-memory stages guarded by full/empty mbarriers (Q and stage 0
//        before the CTA-wide barrier); its second warp does the mainloop's
//        side work (INT8_FP8: the V scales for the epilogue);
//   WG1, WG2  consumers, 64 query rows each, steps of the mainloop's
//        kHalves listed blocks. In its turn a warpgroup issues Q.K^T(u) then
//        P.V(u-1); it takes the row max of step u while P.V(u-1) runs, then
//        folds P.V(u-1) (after_pv) alongside the exponentials of step u,
//        which overwrite the P registers P.V(u-1) read. The other warpgroup
//        has its turn meanwhile, so one's softmax overlaps the other's matrix
//        products.
// Dense work of the 16-bit FP16 mainloop may instead run on persistent CTAs
// (at most one per SM, persistent_cta): a CTA takes its rows in turn, its
// producer thread loads each row's Q into one of one or two Q buffers
// (qfull / qempty barriers) and the ring of stages runs on across rows; there
// is no producer side work (FP16 has none). With two Q buffers (D = 64; D =
// 128 with a ring of two stages whose K and V have barriers of their own,
// PersistLayout) the next row's Q loads during the current row, and the
// non-causal consumers pipeline across rows (consume_stream); with one
// (D = 256), it loads once the previous row's output has left the buffer.
// The online softmax (../common/softmax.cuh) and the epilogue writer (cta.cuh) are
// shared; a mainloop supplies its layout, loads, matrix products, fold and
// output scaling. Host side: launch_sm90.cuh.
#pragma once
#include <cuda.h>

#include "cuda/attention/sm90/cta.cuh"
#include "cuda/attention/sm90/primitives.cuh"
#include "cuda/attention/sm90/trace.cuh"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {

// setmaxnreg budgets: 128*24 + 256*240 <= 64K registers of the SM (two
// consumer warpgroups); 128*32 + 384*160 = 64K (three); two CTAs per SM
// (kOcc 2) launch at 80 registers (2 * 384 * 80 <= 64K), and a CTA's 30 720
// hold 128*24 + 256*104.
template <int kCW>
constexpr uint32_t kProducerRegs = kCW == 2 ? 24 : 32;
template <int kCW, int kOcc = 1>
constexpr uint32_t kConsumerRegs = kOcc == 2 ? 104 : kCW == 2 ? 240 : 160;
// The consumer warpgroup that takes the turn after cw.
template <int kCW>
__device__ __forceinline__ int next_consumer(int cw) {
  return cw + 1 == kCW ? 0 : cw + 1;
}

// This thread's warpgroup, through a shuffle so that the compiler knows it is
// warp-uniform: what derives from it (a consumer's Q descriptor, its row
// range, its visible steps) then stays in uniform registers, and the
// descriptors of a turn's wgmma batch are not rebuilt per instruction.
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0); }

// The pieces of the consumers' turns, shared by consume and consume_stream.
// A row's first Q.K^T, waited for (nothing is in flight to pair it with).
template <class C>
__device__ __forceinline__ void first_qk(C& c, uint64_t dk, int me, int other) {
  turn_begin(me);
  c.issue_qk(dk);
  wgmma_commit();
  turn_end(other);
  wgmma_wait<0>();
  fence_regs(c.s);
}
// Step u's turn: Q.K^T(u) (issue_qk) and P.V(u-1) from stage descriptor dv.
template <class C, class IssueQK, class PA>
__device__ __forceinline__ void step_turn(C& c, IssueQK issue_qk, uint64_t dv, const PA& pa, int me, int other) {
  turn_begin(me);
  issue_qk();
  wgmma_commit();
  c.issue_pv(dv, pa);
  wgmma_commit();
  turn_end(other);
}
// After step u's turn: the row max of Q.K^T(u) while P.V(u-1) runs, then the
// exponentials; Q.K^T(u)'s completion releases K of ring step g (split
// rings), P.V(u-1)'s V of step g - 1, and O is rescaled. ap: the previous
// step's rescale factors, in and out.
template <class ML, class C, class PA, int kHalves, class Ring>
__device__ __forceinline__ void step_softmax(C& c, const int (&kb)[kHalves], const float (&ksc)[kHalves], PA& pa,
                                             const Ring& ring, int g, float& ap0, float& ap1) {
  float ac0, ac1;  // rescale factors of the current step
  wgmma_wait<1>();  // Q.K^T(u) done
  fence_regs(c.s);
  ring.release_k(g);
  const auto st = c.sm.row_max(c.s, kb, ksc, ac0, ac1);
  if constexpr (ML::kMaxUnderPV) {
    // The wait sits inside the exponentials' branch arms: ptxas schedules
    // within a basic block and would otherwise sink the row max below it.
    c.sm.exponentiate(c.s, st, ac0, ac1, pa, [&] {
      wgmma_wait<0>();  // P.V(u-1) done
      c.fence_pv();
      fence_regs(pa);
      ring.release_v(g - 1);
      c.after_pv(ap0, ap1, ac0, ac1);
    });
  } else {
    wgmma_wait<0>();  // P.V(u-1) done
    c.fence_pv();
    fence_regs(pa);
    ring.release_v(g - 1);
    c.sm.exponentiate(c.s, st, ac0, ac1, pa, [&] { c.after_pv(ap0, ap1, ac0, ac1); });
  }
  ap0 = ac0;
  ap1 = ac1;
}
// The last turn: P.V of ring step g (the row's last), waited for; the last
// warpgroup hands no turn on, which balances the initial arrive of consume /
// consume_stream (hand_on: turns follow, consume's passed turns).
template <int kCW, class C, class PA, class Ring>
__device__ __forceinline__ void last_pv(C& c, const PA& pa, const Ring& ring, int g, int me, int other, float ap0,
                                        float ap1, bool hand_on = false) {
  const uint64_t dv = c.desc_v(g % Ring::kStagesC);
  ring.wait_v(g);
  turn_begin(me);
  c.issue_pv(dv, pa);
  wgmma_commit();
  if (hand_on || me != kCW - 1) turn_end(other);
  wgmma_wait<0>();
  c.fence_pv();
  ring.release_v(g);
  c.after_last_pv(ap0, ap1);
}

// consume's steps 0 .. n-1 (n >= 0; none, no turn) with their n + 1 turns;
// hand_on: the last turn hands on whichever warpgroup this is.
template <class ML, class C, class Ring>
__device__ __forceinline__ void consume_steps(C& c, const RowWork& w, const Ring& ring, int n_steps, int g0, int me,
                                              int other, bool hand_on) {
  constexpr int kHalves = ML::kHalves;
  constexpr int kStages = Ring::kStagesC, kCW = ML::kConsumers;
  if (n_steps == 0) return;
  uint32_t pa[ML::KS][4];
  float ap0, ap1;  // rescale factors of the previous step
  int kb[kHalves];
  float ksc[kHalves];  // int8 Q.K^T: the step's K block scales
  auto blocks = [&](int u) {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) kb[hh] = w.block<kHalves>(u, hh);
    c.load_kscale(kb, ksc);
  };
  // Step 0: Q.K^T alone, waited for.
  blocks(0);
  ring.wait_k(g0);
  trace_event(c.p, me, 1);
  first_qk(c, c.desc_k(g0 % kStages), me, other);
  trace_event(c.p, me, 2);
  ring.release_k(g0);
  {
    const auto st = c.sm.row_max(c.s, kb, ksc, ap0, ap1);
    c.sm.exponentiate(c.s, st, ap0, ap1, pa, [] {});
  }
  WgTrace tr;
  for (int u = 1; u < n_steps; ++u) {
    const int g = g0 + u, s = g % kStages, sp = (g - 1) % kStages;
    tr.begin();
    ring.wait_k(g);
    ring.wait_v(g - 1);
    tr.end(0);
    const uint64_t dk = c.desc_k(s), dv = c.desc_v(sp);
    blocks(u);
    tr.begin();
    step_turn(c, [&] { c.issue_qk(dk); }, dv, pa, me, other);
    tr.end(1);
    tr.count(3);
    step_softmax<ML>(c, kb, ksc, pa, ring, g, ap0, ap1);
  }
  tr.count(4);
  tr.flush(c.p, me);
  trace_event(c.p, me, 3);
  last_pv<kCW>(c, pa, ring, g0 + n_steps - 1, me, other, ap0, ap1, hand_on);
  trace_event(c.p, me, 4);
}

// The steps of a row that warpgroup c's rows can see: none when they are all
// past the problem's last row (the padding of the last tile); with causality
// and a dense row (blocks listed in key order), none past the last key of its
// last row (dense_blocks of its 64 rows). The steps left out hold only masked
// scores for these rows, which change neither their max, nor their sums, nor
// O: same bits.
template <class ML, class C>
__device__ __forceinline__ int visible_steps(const C& c, const RowWork& w, int n_steps) {
  const int row_lo = c.sm.wg_row_min;
  if (row_lo >= c.p.Lq) return 0;
  if (!ML::kCausalC || w.tiles != nullptr) return n_steps;
  const int blocks = dense_blocks(row_lo / 64, 1, c.p.Lq, c.p.Lkv, c.p.nKB, 64);
  const int n = (blocks + ML::kHalves - 1) / ML::kHalves;
  return n < n_steps ? n : n_steps;
}

// The consumers' steps 0 .. n_steps-1 of one row (see the file comment).
// g0: the ring's step count before the row (0 unless CTAs are persistent):
// step u of the row uses stage (g0 + u) % kStages. A warpgroup computes only
// the steps its rows can see (visible_steps); for the others it releases the
// stage once loaded and passes its turn, so every warpgroup takes n_steps + 1
// turns and every stage gets all its arrivals.
template <class ML, class C, class Ring>
__device__ __forceinline__ void consume(C& c, const RowWork& w, const Ring& ring, int n_steps, int g0 = 0) {
  constexpr int kCW = ML::kConsumers;
  const int me = c.cw, other = next_consumer<kCW>(c.cw);
  if (me == kCW - 1) turn_end(0);  // warpgroup 0 goes first
  const int n_mine = visible_steps<ML>(c, w, n_steps);  // uniform over the warpgroup (warpgroup())
  consume_steps<ML>(c, w, ring, n_mine, g0, me, other, n_mine < n_steps);
  if (n_mine == n_steps) return;
  // The steps this warpgroup's rows do not see: each stage released once
  // loaded, each turn passed on (the last warpgroup's last one not).
  for (int u = n_mine; u < n_steps; ++u) {
    const int g = g0 + u;
    ring.wait_k(g);
    ring.wait_v(g);
    ring.release_k(g);
    ring.release_v(g);
    named_bar_sync(kTurnBar0 + me, 256);
    if (n_mine == 0 || u + 1 < n_steps || me != kCW - 1) turn_end(other);
  }
  if (n_mine == 0) {  // the turn of the row's last P.V
    named_bar_sync(kTurnBar0 + me, 256);
    if (me != kCW - 1) turn_end(other);
  }
}

// The steps of one row without turns (mainloops with kSerialSteps: the
// short-row kernel, whose 104-register consumers cannot hold a step's scores
// beside the operands of the previous P.V still in flight, so ptxas would
// serialize the wgmmas). A warpgroup issues Q.K^T(u), waits for it, takes
// the step's softmax (O *= alpha first), issues P.V(u) and waits for it; the
// SM's other consumer warpgroups (two per CTA, two CTAs) fill the tensor pipe
// meanwhile. Every stage still gets its arrivals from every consumer thread.
template <class ML, class C, class Ring>
__device__ __forceinline__ void consume_serial(C& c, const RowWork& w, const Ring& ring, int n_steps) {
  constexpr int kHalves = ML::kHalves, kStages = Ring::kStagesC;
  const int n_mine = visible_steps<ML>(c, w, n_steps);  // uniform over the warpgroup
  uint32_t pa[ML::KS][4];
  int kb[kHalves];
  float ksc[kHalves];
  float ap0 = 1.f, ap1 = 1.f;  // the last step's rescale factors
  for (int u = 0; u < n_mine; ++u) {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) kb[hh] = w.block<kHalves>(u, hh);
    c.load_kscale(kb, ksc);
    ring.wait_k(u);
    wgmma_fence();
    c.issue_qk(c.desc_k(u % kStages));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(c.s);
    ring.release_k(u);
    float ac0, ac1;
    const auto st = c.sm.row_max(c.s, kb, ksc, ac0, ac1);
    c.sm.exponentiate(c.s, st, ac0, ac1, pa, [&] {
      if (u > 0) c.after_pv(ap0, ap1, ac0, ac1);  // O *= alpha(u); O is still 0 at step 0
    });
    ring.wait_v(u);
    wgmma_fence();
    c.issue_pv(c.desc_v(u % kStages), pa);
    wgmma_commit();
    wgmma_wait<0>();
    c.fence_pv();
    fence_regs(pa);  // the next step's P is written after P.V(u) has read this one
    ring.release_v(u);
    ap0 = ac0;
    ap1 = ac1;
  }
  if (n_mine > 0) c.after_last_pv(ap0, ap1);
  for (int u = n_mine; u < n_steps; ++u) {  // steps these rows cannot see: released once loaded
    ring.wait_k(u);
    ring.wait_v(u);
    ring.release_k(u);
    ring.release_v(u);
  }
}

// The consumers of a persistent CTA with two Q buffers: one software pipeline
// across the CTA's rows. The first step of a row is issued in the same turn
// as the last P.V of the row before (its Q already loaded into the other
// buffer), and the finished row's epilogue runs while the other warpgroup has
// its turn; so neither the row's first Q.K^T nor its last P.V is waited for
// alone. Non-causal kernels only (every row has a step): measured on an H100
// (PERF-NOTES v50), it gains on non-causal rows and loses on causal ones,
// which keep one row at a time.
template <class ML, class Ring, class QBuf>
__device__ __forceinline__ void consume_stream(const Maps& maps, const Params& p, const Ring& ring, uint64_t* qfull,
                                               uint64_t* qempty, QBuf qbuf, int tid) {
  constexpr int kHalves = ML::kHalves;
  constexpr int kStages = Ring::kStagesC, kCW = ML::kConsumers;
  const int cw = warpgroup() - 1, me = cw, other = next_consumer<kCW>(cw);
  int k = 0;
  // The CTA's next row (past the slots without one); -1 past the last.
  auto next_row = [&]() -> int {
    for (;;) {
      const int r = attn::persistent_row(p, blockIdx.x, gridDim.x, k++);
      if (r != -2) return r;
    }
  };
  int row = next_row();
  if (row < 0) return;
  RowWork w(p, row);
  int n = w.steps<kHalves>();
  typename ML::Consumer c(p, cw, tid, w, ring.base, qbuf(0));
  if (me == kCW - 1) turn_end(0);  // warpgroup 0 goes first
  uint32_t pa[ML::KS][4];
  float ap0, ap1;
  int kb[kHalves];
  float ksc[kHalves];
  auto blocks = [&](const RowWork& ww, int u) {
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) kb[hh] = ww.block<kHalves>(u, hh);
    c.load_kscale(kb, ksc);
  };
  // The first row's step 0: Q.K^T alone.
  blocks(w, 0);
  mbar_wait(&qfull[0], 0);
  ring.wait_k(0);
  first_qk(c, c.desc_k(0), me, other);
  ring.release_k(0);
  {
    const auto st = c.sm.row_max(c.s, kb, ksc, ap0, ap1);
    c.sm.exponentiate(c.s, st, ap0, ap1, pa, [] {});
  }
  int g = 1, u = 1, i = 0;  // the ring's next step, the row's next step, the row's index in the CTA
  WgTrace tr;
  for (;;) {
    int next = -1;
    if (u == n) {
      next = next_row();
      if (next < 0) break;
    }
    const bool boundary = next >= 0;
    const int s = g % kStages, sp = (g - 1) % kStages;
    uint64_t dq = c.desc_q;
    if (boundary) {
      blocks(RowWork(p, next), 0);
      mbar_wait(&qfull[(i + 1) & 1], ((i + 1) >> 1) & 1);
      dq = c.q_desc_at(qbuf((i + 1) & 1));
    } else {
      blocks(w, u);
    }
    tr.begin();
    ring.wait_k(g);
    ring.wait_v(g - 1);
    tr.end(0);
    const uint64_t dk = c.desc_k(s), dv = c.desc_v(sp);
    tr.begin();
    step_turn(c, [&] { c.issue_qk(dk, dq); }, dv, pa, me, other);
    tr.end(1);
    tr.count(3);
    if (!boundary) {
      step_softmax<ML>(c, kb, ksc, pa, ring, g, ap0, ap1);
      ++u;
    } else {
      // The row's last P.V and the next row's first Q.K^T are done: the row's
      // output leaves through its Q buffer, then the state starts afresh.
      wgmma_wait<0>();
      fence_regs(c.s);
      c.fence_pv();
      fence_regs(pa);
      ring.release_k(g);
      ring.release_v(g - 1);
      c.after_last_pv(ap0, ap1);
      tr.begin();
      c.epilogue(maps, ring.base, tid);
      tr.end(2);
      tr.count(4);
      mbar_arrive(&qempty[i & 1]);
      ++i;
      w = RowWork(p, next);
      n = w.steps<kHalves>();
      c.retarget(w, tid, qbuf(i & 1));
      const auto st = c.sm.row_max(c.s, kb, ksc, ap0, ap1);
      c.sm.exponentiate(c.s, st, ap0, ap1, pa, [] {});
      u = 1;
    }
    ++g;
  }
  // The last row's last P.V.
  last_pv<kCW>(c, pa, ring, g - 1, me, other, ap0, ap1);
  tr.begin();
  c.epilogue(maps, ring.base, tid);
  tr.end(2);
  tr.count(4);
  tr.flush(p, me);
  trace_done(p, me);
  mbar_arrive(&qempty[i & 1]);
}

// Shared memory of the persistent kernel: the mainloop's layout with the
// ring's barriers and qfull[2], qempty[2] at its barrier offset, and Q in one
// or two buffers (kQBufs = 2: row i's Q loads while row i-1 runs and stores
// its output through the other buffer; 1: row i's Q loads once row i-1 has
// stored its output, after row i's first stages). The second buffer goes
// after the barriers where it fits (the layout's ring, D = 64); else, where
// the layout has three stages or more, in the slot of its last K stage, the
// ring one stage shorter and split into K and V barriers (D = 128: two stages
// cover the loads once K's slot frees a step before V's); else (D = 256) there
// is one buffer.
template <class L>
struct PersistLayout {
  static constexpr int kQ2After = (L::kBar + (SmemRing<L::kStages>::kBarriers + 4) * 8 + 1023) / 1024 * 1024;
  static constexpr bool kAfter = kQ2After + L::kQBytes + 1024 <= 227 * 1024;
  static constexpr bool kSplit = !kAfter && L::kStages >= 3 && L::kKStage >= L::kQBytes;
  static constexpr int kStages = kSplit ? L::kStages - 1 : L::kStages;
  static constexpr int kQBufs = (kAfter || kSplit) ? 2 : 1;
  using Ring = SmemRing<kStages, kSplit>;
  static constexpr int kBarBytes = (Ring::kBarriers + 4) * 8;  // the ring's, qfull[2], qempty[2]
  static constexpr int kQ2 = kAfter ? kQ2After : L::kK + kStages * L::kKStage;
  static constexpr int kAlloc = (kAfter ? kQ2 + L::kQBytes : L::kBar + kBarBytes) + 1024;
};

// The persistent CTA (dense work of the 16-bit mainloops): the rows of
// attn::persistent_row in turn, the ring of K/V stages running on across rows
// so that the producer loads the next row's Q and first stages while the
// consumers finish a row and store its output.
template <class ML>
__device__ __forceinline__ void persistent_cta(const Maps& maps, const Params& p, uint8_t* smem_raw) {
  using L = typename ML::Layout;
  using PL = PersistLayout<L>;
  constexpr int kStages = PL::kStages, kHalves = ML::kHalves, kQBufs = PL::kQBufs;
  constexpr int kCW = ML::kConsumers, kConsumerThreads = 128 * kCW;
  // No producer side work, no K scales (consume_stream loads a row's first
  // step's blocks before retargeting), the row max under the P.V.
  static_assert(ML::kPersistOK && !ML::kI8C && ML::kMaxUnderPV, "persistent CTAs: the FP16 mainloop only");
  const typename PL::Ring ring(smem_raw, L::kBar);
  uint64_t* qfull = ring.qbar;  // [2]
  uint64_t* qempty = ring.qbar + 2;  // [2]: the consumer threads, once a row's output has left the buffer
  auto qbuf = [&](int i) { return ring.base + (i == 0 ? L::kQ : PL::kQ2); };
  const int wg = warpgroup();
  if (threadIdx.x == 0) {
    trace_start(p, 0);
    ring.init(kConsumerThreads);
    for (int i = 0; i < 2; ++i) {
      mbar_init(&qfull[i], 1);
      mbar_init(&qempty[i], kConsumerThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 0) {
    regs_dealloc<kProducerRegs<kCW>>();
    if (threadIdx.x != 0) return;
    int g = 0, i = 0;  // the ring's steps so far; this CTA's rows so far
    for (int k = 0;; ++k) {
      const int row = attn::persistent_row(p, blockIdx.x, gridDim.x, k);
      if (row == -1) break;
      if (row < 0) continue;
      const RowWork w(p, row);
      const int n = w.steps<kHalves>(), qi = i % kQBufs;
      // Ring step g + u <- step u's blocks: K and V together, or (split)
      // K once its slot is free, then V once its slot is.
      auto stage = [&](int u) {
        const int gg = g + u, s = gg % kStages, ph = ((gg / kStages) - 1) & 1;
        int kbh[kHalves];
#pragma unroll
        for (int hh = 0; hh < kHalves; ++hh) {
          const int kb = w.block<kHalves>(u, hh);
          kbh[hh] = kb >= 0 ? kb : w.block<kHalves>(u, 0);  // as load_stage in attn_sm90_kernel
        }
        uint8_t* sk = ring.base + L::kK + s * L::kKStage;
        uint8_t* sv = ring.base + L::kV + s * L::kVStage;
        if (gg >= kStages) mbar_wait(&ring.empty[s], ph);
        if constexpr (PL::kSplit) {
          mbar_arrive_expect_tx(&ring.full[s], L::kKStage);
#pragma unroll
          for (int hh = 0; hh < kHalves; ++hh) ML::template load_part<false>(maps, w, sk, &ring.full[s], hh, kbh[hh]);
          if (gg >= kStages) mbar_wait(&ring.emptyv[s], ph);
          mbar_arrive_expect_tx(&ring.fullv[s], L::kVStage);
#pragma unroll
          for (int hh = 0; hh < kHalves; ++hh) ML::template load_part<true>(maps, w, sv, &ring.fullv[s], hh, kbh[hh]);
        } else {
          mbar_arrive_expect_tx(&ring.full[s], L::kKStage + L::kVStage);
#pragma unroll
          for (int hh = 0; hh < kHalves; ++hh) ML::load_block(maps, p, w, sk, sv, &ring.full[s], hh, kbh[hh]);
        }
      };
      // One Q buffer: the row's first stages before its Q, which waits for
      // the previous row's output to leave the buffer.
      const int pre = (kQBufs == 1 && i > 0) ? (n < kStages ? n : kStages) : 0;
      for (int u = 0; u < pre; ++u) stage(u);
      if (i >= kQBufs) mbar_wait(&qempty[qi], ((i / kQBufs) - 1) & 1);
      ML::load_q_to(maps, p, w, qbuf(qi), &qfull[qi]);
      for (int u = pre; u < n; ++u) stage(u);
      g += n;
      ++i;
    }
    return;
  }

  regs_alloc<kConsumerRegs<kCW, ML::kOcc>>();
  const int tid = threadIdx.x - 128 * wg;
  if constexpr (kQBufs == 2 && !ML::kCausalC) {
    consume_stream<ML>(maps, p, ring, qfull, qempty, qbuf, tid);
    return;
  }
  int g = 0, i = 0;
  for (int k = 0;; ++k) {
    const int row = attn::persistent_row(p, blockIdx.x, gridDim.x, k);
    if (row == -1) break;
    if (row < 0) continue;
    const RowWork w(p, row);
    const int n = w.steps<kHalves>(), qi = i % kQBufs;
    typename ML::Consumer c(p, wg - 1, tid, w, ring.base, qbuf(qi));
    mbar_wait(&qfull[qi], (i / kQBufs) & 1);
    if (n > 0) consume<ML>(c, w, ring, n, g);
    c.epilogue(maps, ring.base, tid);
    mbar_arrive(&qempty[qi]);
    g += n;
    ++i;
  }
}

// One CTA per mask row (blockIdx.x indexes the work order).
template <class ML>
__device__ __forceinline__ void row_cta(const Maps& maps, const Params& p, uint8_t* smem_raw) {
  using L = typename ML::Layout;
  constexpr int kStages = L::kStages, kHalves = ML::kHalves, kCW = ML::kConsumers;
  static_assert(kHalves <= kListReadAhead, "the first step reads more list entries than the scheduler defines");
  const RowWork w(p);
  const int n_steps = w.steps<kHalves>();
  if (n_steps == 0) {  // nothing to compute: zeros and LSE -inf, written directly (attn::write_empty_row)
    if (threadIdx.x == 0) trace_start(p, 0);
    attn::write_empty_row(p, w, ML::kHeadDim, threadIdx.x, ML::kThreads);
    if (threadIdx.x == 128 || threadIdx.x == 256) trace_done(p, threadIdx.x / 128 - 1);
    return;
  }
  const SmemRing<kStages> ring(smem_raw, L::kBar);
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
  const int wg = warpgroup();
  if (threadIdx.x == 0) {
    trace_start(p, n_steps);
    start_ring<kHalves>(w, p.nKB, 128 * kCW, ring, [&] { ML::load_q(maps, p, w, ring.base, ring.qbar); },
                        load_stage);
  }
  __syncthreads();

  if (wg == 0) {
    regs_dealloc<kProducerRegs<kCW>>();
    if (threadIdx.x == 0) {
      produce<kStages, kHalves>(w, n_steps, ring.empty, load_stage);
    } else if (threadIdx.x >= 32 && threadIdx.x < 64) {
      ML::producer_side(p, w, ring.base, threadIdx.x - 32);
    }
    return;
  }

  regs_alloc<kConsumerRegs<kCW, ML::kOcc>>();
  typename ML::Consumer c(p, wg - 1, threadIdx.x - 128 * wg, w, ring.base);
  mbar_wait(ring.qbar, 0);
  trace_event(p, wg - 1, 0);
  if constexpr (ML::kSerialSteps)
    consume_serial<ML>(c, w, ring, n_steps);
  else
    consume<ML>(c, w, ring, n_steps);
  c.epilogue(maps, ring.base, threadIdx.x - 128 * wg);
  trace_done(p, wg - 1);
}

// kPersist: dense work on persistent CTAs (persistent_cta; the grid is at
// most one CTA per SM); else one CTA per mask row (row_cta), ML::kOcc of them
// per SM.
template <class ML, bool kPersist>
__global__ void __launch_bounds__(ML::kThreads, ML::kOcc) attn_sm90_kernel(const __grid_constant__ Maps maps, const Params p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  extern __shared__ uint8_t smem_raw[];
  if constexpr (kPersist)
    persistent_cta<ML>(maps, p, smem_raw);
  else
    row_cta<ML>(maps, p, smem_raw);
#else
  __trap();  // built for another architecture: the registry must not offer this
#endif
}

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
