// Clock stamps of the sm_90a attention kernels, for where a CTA's time goes
// (docs/PERF-NOTES.md v56; tools/bench/trace_sm90.py reads them). Compiled in
// only with -DSPARGE_SM90_TRACE (CMake option SPARGE_SM90_TRACE, a developer
// build); otherwise every call below is empty and the kernels' code is that of
// a plain build. With SPARGE_SM90_TRACE_OUT=file set, each launch clears the
// stamps, synchronizes after the kernel and writes them to the file
// (launch_sm90.cuh: the last launch of a process wins; with SPARGE_GRAPHS=0,
// since a replayed CUDA graph writes none).
//
// Per CTA (blockIdx.x < kTraceCtas) kTraceSlots 64-bit slots:
//   0  %globaltimer at the start          1  %clock64 at the start
//   2  %smid | row steps << 32 (one CTA per row; persistent CTAs: steps 0)
//   3 + 6 cw + e  %clock64 of consumer warpgroup cw's (0, 1) event e of its
//      (last) row: 0 Q in shared memory, 1 first K stage loaded, 2 first
//      Q.K^T done, 3 loop done (before the last P.V), 4 last P.V done,
//      5 epilogue done
//   15 %globaltimer when warpgroup 0 is done
//   16 + 8 cw + k  warpgroup cw's sums over its rows: k = 0 cycles in the
//      ring's data waits, 1 cycles in step turns (turn wait and issue),
//      2 cycles in epilogues (persistent CTAs), 3 steps, 4 rows
#pragma once
#include <cstdint>

#include "cuda/attention/common/work.cuh"

namespace sparge {
namespace cuda {
namespace sm90 {

constexpr int kTraceSlots = 32;
constexpr int kTraceCtas = 65536;

#ifdef SPARGE_SM90_TRACE
__device__ __forceinline__ unsigned long long trace_clock() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
  return c;
}
__device__ __forceinline__ unsigned long long trace_gtime() {
  unsigned long long c;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(c));
  return c;
}
__device__ __forceinline__ unsigned long long* trace_cta(const attn::Params& p) {
  return (p.trace != nullptr && blockIdx.x < unsigned(kTraceCtas)) ? p.trace + size_t(blockIdx.x) * kTraceSlots
                                                                   : nullptr;
}
// Thread 0 at the CTA's start (steps: the row's, 0 for persistent CTAs).
__device__ __forceinline__ void trace_start(const attn::Params& p, int steps) {
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (unsigned long long* t = trace_cta(p)) {
    t[0] = trace_gtime();
    t[1] = trace_clock();
    t[2] = smid | (static_cast<unsigned long long>(steps) << 32);
  }
}
// The first thread of consumer warpgroup cw writes its stamps.
__device__ __forceinline__ bool trace_writer(int cw) { return cw < 2 && (threadIdx.x & 127) == 0; }
// Event e of consumer warpgroup cw.
__device__ __forceinline__ void trace_event(const attn::Params& p, int cw, int e) {
  if (trace_writer(cw))
    if (unsigned long long* t = trace_cta(p)) t[3 + 6 * cw + e] = trace_clock();
}
__device__ __forceinline__ void trace_done(const attn::Params& p, int cw) {
  trace_event(p, cw, 5);
  if (cw == 0 && trace_writer(cw))
    if (unsigned long long* t = trace_cta(p)) t[15] = trace_gtime();
}
// A consumer warpgroup's sums (slots 16 + 8 cw + k).
struct WgTrace {
  unsigned long long acc[5] = {0, 0, 0, 0, 0}, t0 = 0;
  __device__ __forceinline__ void begin() { t0 = trace_clock(); }
  __device__ __forceinline__ void end(int k) { acc[k] += trace_clock() - t0; }
  __device__ __forceinline__ void count(int k) { acc[k] += 1; }
  __device__ __forceinline__ void flush(const attn::Params& p, int cw) const {
    if (trace_writer(cw))
      if (unsigned long long* t = trace_cta(p))
        for (int k = 0; k < 5; ++k) atomicAdd(&t[16 + 8 * cw + k], acc[k]);
  }
};
#else
__device__ __forceinline__ void trace_start(const attn::Params&, int) {}
__device__ __forceinline__ void trace_event(const attn::Params&, int, int) {}
__device__ __forceinline__ void trace_done(const attn::Params&, int) {}
struct WgTrace {
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ void end(int) {}
  __device__ __forceinline__ void count(int) {}
  __device__ __forceinline__ void flush(const attn::Params&, int) const {}
};
#endif

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
