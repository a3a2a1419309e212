// Host side of the sm_90a kernel skeleton: the registry's supports / setup /
// run for one mainloop. setup fills the parameter block and encodes every
// tensor map (nothing is queued, so every reason to refuse is found before the
// call's first kernel); run launches. Included by the generated instance files
// only (tools/gen/gen_instances.py).
#pragma once
#include <cuda.h>

#include <new>
#include <type_traits>

#include "cuda/attention/sm90/kernel.cuh"
#include "cuda/attention/sm90/tensor_map.hpp"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/registry/registry.hpp"
#ifdef SPARGE_SM90_TRACE
#include <cstdio>
#include <cstdlib>
#include <vector>
#endif

namespace sparge {
namespace cuda {
namespace sm90 {

// Maps a mainloop does not read (v2 without split V, o without the TMA store)
// stay zero: the kernel never touches them.
struct Sm90Launch {
  Maps maps;
  Params p;
  unsigned grid;
  int persist;  // attn_sm90_kernel<ML, true>: dense work on `grid` persistent CTAs
  int wide;     // the kernels of ML::Wide (a dense call; p counts its tiles)
  int shrt;     // the kernel of ML::Short (two CTAs per SM)
};
static_assert(sizeof(Sm90Launch) <= sizeof(LaunchBlob), "the launch blob holds the sm_90a launch");
static_assert(std::is_trivially_copyable<Sm90Launch>::value, "the launch blob is plain data");

#ifdef SPARGE_SM90_TRACE
// Trace builds (trace.cuh): one buffer for every launch, cleared before and,
// with SPARGE_SM90_TRACE_OUT=file, written to the file after each launch
// (uint32 CTA count, then kTraceSlots uint64 per CTA; the last launch wins).
// A launch into a stream being captured (a call's CUDA graph) writes nothing:
// trace runs set SPARGE_GRAPHS=0 so that every call launches.
inline unsigned long long* trace_buffer() {
  static unsigned long long* buf = nullptr;
  if (buf == nullptr && cudaMalloc(&buf, size_t(kTraceCtas) * kTraceSlots * 8) != cudaSuccess) buf = nullptr;  // retried
  return buf;
}
inline void trace_clear(const Sm90Launch& s, cudaStream_t stream) {
  if (s.p.trace != nullptr && std::getenv("SPARGE_SM90_TRACE_OUT") != nullptr)
    (void)cudaMemsetAsync(s.p.trace, 0, size_t(kTraceCtas) * kTraceSlots * 8, stream);
}
inline void trace_write(const Sm90Launch& s, cudaStream_t stream) {
  const char* path = std::getenv("SPARGE_SM90_TRACE_OUT");
  if (path == nullptr || s.p.trace == nullptr || stream_capturing(stream)) return;
  if (cudaStreamSynchronize(stream) != cudaSuccess) return;
  const unsigned n = s.grid < unsigned(kTraceCtas) ? s.grid : unsigned(kTraceCtas);
  std::vector<unsigned long long> h(size_t(n) * kTraceSlots);
  if (cudaMemcpy(h.data(), s.p.trace, h.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) return;
  if (FILE* f = std::fopen(path, "wb")) {
    std::fwrite(&n, 4, 1, f);
    std::fwrite(h.data(), 8, h.size(), f);
    std::fclose(f);
  }
}
#else
inline void trace_clear(const Sm90Launch&, cudaStream_t) {}
inline void trace_write(const Sm90Launch&, cudaStream_t) {}
#endif

// Tile coordinates are 32-bit: rows of the int8 Q and K (and of V^T), key and
// row indices (key0 + 64 must not overflow).
template <class ML>
sparge_status_t supports(const Problem& pb) {
  const int64_t dk = ML::Dk;
  bool ok = pb.B * pb.Hq * pb.nQB < (int64_t(1) << 31) && pb.Lq <= 0x3fffffffLL && pb.Lkv <= 0x3fffffffLL;
  if (ML::kI8C)
    ok = ok && pb.B * pb.Hq * pb.nQB * kGpuBlockQ < (int64_t(1) << 31) &&
         pb.B * pb.Hkv * pb.nKB * kGpuBlockK < (int64_t(1) << 31) && pb.B * pb.Hkv * dk < (int64_t(1) << 31);
  if (ok) return SPARGE_OK;
  return fail(SPARGE_ERR_UNSUPPORTED,
              "problem (batch, heads, len_q, len_kv): too large for the sm_90a kernels' 32-bit tile coordinates "
              "(B*H*L >= 2^31 or L >= 2^30)");
}

// The launch of mainloop ML into *s. Tiles of ML::kRows query rows: 128 (the
// mask rows) or, for a dense call of a Wide mainloop, 192, which p's nQB and
// n_rows then count.
template <class ML>
sparge_status_t setup_launch(const AttnArgs& a, Sm90Launch* s, bool* applies) {
  using L = typename ML::Layout;
  static_assert(L::kAlloc <= 227 * 1024, "shared memory budget of sm_90");
  static_assert(ML::kOcc * (L::kAlloc + 1024) <= 228 * 1024, "kOcc CTAs per SM: 228 KiB, 1 KiB reserved per CTA");
  static_assert(!ML::kPersistOK || PersistLayout<L>::kAlloc <= 227 * 1024, "shared memory budget of sm_90");
  const Problem& pb = a.prob;
  s->p = attn::make_params(a);
  Params& p = s->p;
#ifdef SPARGE_SM90_TRACE
  p.trace = trace_buffer();
#endif
  const int64_t tiles = ML::kRows == kGpuBlockQ ? pb.nQB : (pb.Lq + ML::kRows - 1) / ML::kRows;
  if (ML::kRows != kGpuBlockQ) {
    p.q_rows = ML::kRows;
    p.nQB = static_cast<int>(tiles);
    p.n_rows = static_cast<int>(pb.B * pb.Hq * tiles);
  }
  s->grid = static_cast<unsigned>(pb.B * pb.Hq * tiles);
  const bool bf16 = pb.dtype == SPARGE_DTYPE_BFLOAT16;
  // The FP16 mode reads the caller's tensors by TMA (16-byte rows); the int8
  // modes write the output in 4-byte pairs where the TMA store does not apply.
  if (ML::kI8C) {
    SPARGE_TRY(check_out_pairs(a.out));
  } else {
    SPARGE_TRY(check_rows16(a.q, "q", "fp16"));
    SPARGE_TRY(check_rows16(a.k, "k", "fp16"));
    SPARGE_TRY(check_rows16(a.v, "v", "fp16"));
    SPARGE_TRY(check_rows16(a.out, "out", "fp16"));
  }
  if (s->grid == 0) return SPARGE_OK;
  EncodeTiledFn enc = nullptr;
  SPARGE_TRY(get_encode_fn(&enc));
  const uint64_t bhq = uint64_t(pb.B * pb.Hq), bhk = uint64_t(pb.B * pb.Hkv);
  const uint64_t dk = uint64_t(ML::Dk);
  Maps& m = s->maps;
  if constexpr (ML::kI8C) {
    // int8 rows of Dk bytes (the preparation zero-pads a head dim to Dk), in
    // column blocks of at most 128 bytes with the swizzle of that width.
    constexpr uint32_t w8 = ML::Dk < 128 ? ML::Dk : 128;
    const CUtensorMapSwizzle swz = (w8 == 128) ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
    SPARGE_TRY(make_map(enc, &m.q, a.q_i8, dk, bhq * pb.nQB * kGpuBlockQ, w8, kGpuBlockQ, swz, "q"));
    SPARGE_TRY(make_map(enc, &m.k, a.k_i8, dk, bhk * pb.nKB * kGpuBlockK, w8, kGpuBlockK, swz, "k"));
  }
  if constexpr (ML::kFp8PV) {
    const uint64_t keys = uint64_t(pb.nKB) * kGpuBlockK;
    SPARGE_TRY(make_map(enc, &m.v, a.v_f8, keys, bhk * dk, kGpuBlockK, ML::Dk, CU_TENSOR_MAP_SWIZZLE_64B, "v"));
    if (ML::kVTermsC == 2) {
      SPARGE_TRY(make_map(enc, &m.v2, a.v_f8_lo, keys, bhk * dk, kGpuBlockK, ML::Dk, CU_TENSOR_MAP_SWIZZLE_64B,
                          "v_lo"));
    }
  } else {
    // 16-bit V (and FP16's Q and K) straight from the caller's tensors.
    if (make_map_bhld16(enc, &m.v, a.v.data, bf16, a.v.shape, a.v.stride, kGpuBlockK) != CUDA_SUCCESS) {
      if (ML::kI8C) return check_tma_rows16(a.v, "v", "INT8_FP16");
      *applies = false;  // strides TMA cannot express (e.g. rows that overlap)
      return SPARGE_OK;
    }
    if constexpr (!ML::kI8C) {
      if (make_map_bhld16(enc, &m.q, a.q.data, bf16, a.q.shape, a.q.stride, L::kQBoxRows) != CUDA_SUCCESS ||
          make_map_bhld16(enc, &m.k, a.k.data, bf16, a.k.shape, a.k.stride, kGpuBlockK) != CUDA_SUCCESS) {
        *applies = false;
        return SPARGE_OK;
      }
    }
  }
  // The TMA-store epilogue where the mainloop has room and the output's
  // strides are expressible (else direct stores).
  p.tma_store = 0;
  if (ML::kTmaStore && tma_store_from_env() &&
      make_map_bhld16(enc, &m.o, a.out.data, bf16, a.out.shape, a.out.stride, 64) == CUDA_SUCCESS)
    p.tma_store = 1;
  // Dense work of the FP16 mainloop on persistent CTAs (kernel.cuh) where
  // use_persistent's measured rule says so: at most one CTA per SM.
  if constexpr (ML::kPersistOK) {
    if (a.idx == nullptr && a.sm_count > 0 && use_persistent(pb, a.sm_count, ML::kConsumers)) {
      const int64_t units = persistent_units(pb.B * pb.Hq * tiles, tiles, pb.causal);
      s->persist = 1;
      const int64_t cap = persistent_grid_cap(a.sm_count);
      s->grid = static_cast<unsigned>(units < cap ? units : cap);
      SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(&attn_sm90_kernel<ML, true>),
                                  int(PersistLayout<L>::kAlloc), pb.device_id));
      return SPARGE_OK;
    }
  }
  // Once per kernel and device (cuda/common/launch.cuh); setup runs on the plan's device. Several CTAs per SM
  // (ML::kOcc) also take the largest shared-memory carveout.
  SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(&attn_sm90_kernel<ML, false>), int(L::kAlloc),
                              pb.device_id, ML::kOcc > 1));
  return SPARGE_OK;
}

template <class ML>
sparge_status_t setup(const AttnArgs& a, LaunchBlob* blob, bool* applies) {
  *applies = true;
  Sm90Launch* s = reinterpret_cast<Sm90Launch*>(blob->bytes);  // plain data in a 64-byte aligned blob
  *s = Sm90Launch{};
  // Many short rows take the mainloop's short-row variant where it has one
  // (use_short's rule), dense or masked.
  if constexpr (!std::is_void<typename ML::Short>::value) {
    if (use_short(a.prob, a.sm_count, a.idx != nullptr)) {
      s->shrt = 1;
      return setup_launch<typename ML::Short>(a, s, applies);
    }
  }
  // A dense call takes the mainloop's wide variant where it has one.
  if constexpr (!std::is_void<typename ML::Wide>::value) {
    if (a.idx == nullptr && use_wide()) {
      s->wide = 1;
      return setup_launch<typename ML::Wide>(a, s, applies);
    }
  }
  return setup_launch<ML>(a, s, applies);
}

template <class ML>
sparge_status_t run_launch(const Sm90Launch& s, cudaStream_t stream) {
  trace_clear(s, stream);
  if constexpr (ML::kPersistOK) {
    if (s.persist) {
      SPARGE_PDL_CHECK(launch_pdl(attn_sm90_kernel<ML, true>, dim3(s.grid), dim3(ML::kThreads),
                                  size_t(PersistLayout<typename ML::Layout>::kAlloc), stream, s.maps, s.p),
                       "attn_sm90_kernel (persistent)");
      trace_write(s, stream);
      return SPARGE_OK;
    }
  }
  SPARGE_PDL_CHECK(launch_pdl(attn_sm90_kernel<ML, false>, dim3(s.grid), dim3(ML::kThreads),
                              size_t(ML::Layout::kAlloc), stream, s.maps, s.p),
                   "attn_sm90_kernel");
  trace_write(s, stream);
  return SPARGE_OK;
}

template <class ML>
sparge_status_t run(const LaunchBlob& blob, cudaStream_t stream) {
  const Sm90Launch& s = *reinterpret_cast<const Sm90Launch*>(blob.bytes);
  if (s.grid == 0) return SPARGE_OK;
  if constexpr (!std::is_void<typename ML::Short>::value) {
    if (s.shrt) return run_launch<typename ML::Short>(s, stream);
  }
  if constexpr (!std::is_void<typename ML::Wide>::value) {
    if (s.wide) return run_launch<typename ML::Wide>(s, stream);
  }
  return run_launch<ML>(s, stream);
}

// The registry entry of mainloop ML.
template <class ML>
constexpr KernelEntry entry(sparge_precision_t precision, sparge_dtype_t dtype, const char* name) {
  return KernelEntry{{Family::kSm90, precision, ML::kHeadDim, dtype, ML::kCausalC},
                     name,
                     ML::Dk,
                     kGpuBlockQ,
                     ML::kKeys,
                     ML::Layout::kStages,
                     ML::kThreads,
                     ML::Layout::kAlloc,
                     &supports<ML>,
                     &setup<ML>,
                     &run<ML>};
}

}  // namespace sm90
}  // namespace cuda
}  // namespace sparge
