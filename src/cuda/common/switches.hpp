// Developer switches of the CUDA backend, read from the environment once (the
// first time any is asked for) and nowhere else. They exist for A/B
// measurements and for tests that must prove which kernel ran; users need
// none of them.
//   SPARGE_PDL=0                  launches without programmatic dependent launch
//   SPARGE_SM90_EPILOGUE=direct   sm_90a kernels store the output from registers
//                                 instead of through shared memory and TMA
//   SPARGE_FP16_KERNEL=portable   FP16-mode plans run the portable mma.sync kernel
//   SPARGE_GRAPHS=0               repeated attention calls launch their kernels one
//                                 by one instead of replaying the key's CUDA graph
//   SPARGE_FP16_KERNEL=sm90       an FP16 call the sm_90a kernel cannot take is an
//                                 error instead of a fallback to the portable kernel
//   SPARGE_SM90_PERSIST=0 / 1     dense calls of the sm_90a 16-bit kernels never / always
//                                 run on persistent CTAs (default: where the rule of
//                                 sm90::use_persistent says)
//   SPARGE_SM90_PERSIST_GRID=N    at most N persistent CTAs (tests: many rows per CTA
//                                 on small problems)
//   SPARGE_SM90_WIDE=0            dense FP16 calls at D = 64 run the masked calls'
//                                 two-consumer kernel instead of the three-consumer one
//   SPARGE_SM90_SHORT=0 / 1       FP16 calls at D = 64 never / always run the short-row
//                                 kernel (two CTAs per SM, 64-key steps; default: where
//                                 the rule of sm90::use_short says)
// and one documented setting (docs/API.md), read the same way:
//   SPARGE_KERNEL_FAMILY=portable plans choose the portable (mma.sync) family on any
//                                 GPU, also where an architecture-specific one exists
#pragma once

namespace sparge {
namespace cuda {

enum class Fp16Choice { kAuto, kPortable, kSm90Only };

struct DevSwitches {
  bool pdl = true;
  bool tma_store = true;
  Fp16Choice fp16 = Fp16Choice::kAuto;
  bool force_portable = false;
  bool graphs = true;
  int persist = -1;      // SPARGE_SM90_PERSIST: 0, 1, or -1 (the rule)
  int persist_grid = 0;  // SPARGE_SM90_PERSIST_GRID: the most persistent CTAs (0: one per SM)
  int wide = -1;         // SPARGE_SM90_WIDE: 0, 1, or -1 (the default: wide)
  int shrt = -1;         // SPARGE_SM90_SHORT: 0, 1, or -1 (the rule)
};

const DevSwitches& dev_switches();

}  // namespace cuda
}  // namespace sparge
