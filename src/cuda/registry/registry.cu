// The kernel registry (registry.hpp): the generated sm_90a tables and the
// portable family's table, looked up by key.
#include "cuda/registry/registry.hpp"

#include <cstdio>

#include "core/error.hpp"
#include "cuda/common/switches.hpp"

namespace sparge {
namespace cuda {

#define SPARGE_SM90_TABLE(t) \
  extern const KernelEntry t[];   \
  extern const int t##_count;
#include "cuda/registry/sm90_table.inc"
#undef SPARGE_SM90_TABLE

namespace {

struct Table {
  const KernelEntry* entries;
  const int* count;
};

const Table kTables[] = {
#define SPARGE_SM90_TABLE(t) {t, &t##_count},
#include "cuda/registry/sm90_table.inc"
#undef SPARGE_SM90_TABLE
#if defined(SPARGE_WITH_PORTABLE)
    {kPortableKernels, &kPortableKernelCount},
    {portable::kPortableInt8Kernels, &portable::kPortableInt8KernelCount},
#endif
    {nullptr, nullptr},
};

const char* precision_name(sparge_precision_t p) {
  switch (p) {
    case SPARGE_PRECISION_INT8_FP8: return "INT8_FP8";
    case SPARGE_PRECISION_FP16: return "FP16";
    case SPARGE_PRECISION_EXACT: return "EXACT";
    case SPARGE_PRECISION_INT8_FP8_SPLIT_V: return "INT8_FP8_SPLIT_V";
    case SPARGE_PRECISION_INT8_FP16: return "INT8_FP16";
    case SPARGE_PRECISION_AUTO: return "AUTO";
  }
  return "?";
}

bool same_key(const KernelKey& a, const KernelKey& b) {
  return a.family == b.family && a.precision == b.precision && a.head_dim == b.head_dim && a.dtype == b.dtype &&
         a.causal == b.causal;
}

// Head dims the family carries for a precision and dtype, as "64, 128".
void list_head_dims(Family f, sparge_precision_t prec, sparge_dtype_t dt, char* buf, size_t n) {
  buf[0] = '\0';
  size_t used = 0;
  for (int d = 1; d <= 256; ++d) {
    bool found = false;
    for (int i = 0; i < kernel_count() && !found; ++i) {
      const KernelKey& k = kernel_at(i)->key;
      found = k.family == f && k.precision == prec && k.dtype == dt && k.head_dim == d;
    }
    if (!found) continue;
    const int w = std::snprintf(buf + used, n - used, "%s%d", used ? ", " : "", d);
    if (w < 0 || size_t(w) >= n - used) break;
    used += size_t(w);
  }
  if (used == 0) std::snprintf(buf, n, "none");
}

}  // namespace

const char* family_name(Family f) { return f == Family::kSm90 ? "sm90" : "portable"; }

int kernel_count() {
  int n = 0;
  for (const Table* t = kTables; t->entries != nullptr; ++t) n += *t->count;
  return n;
}

const KernelEntry* kernel_at(int i) {
  for (const Table* t = kTables; t->entries != nullptr; ++t) {
    if (i < *t->count) return &t->entries[i];
    i -= *t->count;
  }
  return nullptr;
}

const KernelEntry* find_kernel(const KernelKey& key) {
  for (const Table* t = kTables; t->entries != nullptr; ++t)
    for (int i = 0; i < *t->count; ++i)
      if (same_key(t->entries[i].key, key)) return &t->entries[i];
  return nullptr;
}

int image_arch_of(const void* kernel) {
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return fa.ptxVersion;
}

bool family_for_device(int sm_version, Family* out) {
  // sm_90a code runs on compute capability 9.0 only (the 'a' features are not
  // forward compatible); mma.sync code on 8.0 and newer.
#if defined(SPARGE_WITH_SM90)
  if (sm_version == 90 && !dev_switches().force_portable) {
    *out = Family::kSm90;
    return true;
  }
#endif
#if defined(SPARGE_WITH_PORTABLE)
  if (sm_version >= 80) {
    *out = Family::kPortable;
    return true;
  }
#endif
  return false;
}

namespace {

// What the device must offer the chosen kernel: its instructions' compute
// capability, an image of this build for the device, and its shared memory.
sparge_status_t check_entry_on_device(const KernelEntry& e, const Problem& p, int sm_version) {
  if (e.min_sm > sm_version)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "problem->precision %s: kernel %s needs compute capability %d.%d (fp8 tensor cores), the device "
                "has %d.%d; INT8_FP16 (int8 Q.K^T, 16-bit P.V) and FP16 run there",
                precision_name(p.precision), e.name, e.min_sm / 10, e.min_sm % 10, sm_version / 10, sm_version % 10);
  if (e.image_arch != nullptr) {
    const int arch = e.image_arch();
    if (arch == 0)
      return fail(SPARGE_ERR_UNSUPPORTED,
                  "kernel %s: this build carries no code that runs on compute capability %d.%d (see the "
                  "SPARGE_CUDA_ARCHS and SPARGE_CUDA_PTX build options)",
                  e.name, sm_version / 10, sm_version % 10);
    if (arch < e.min_sm)
      return fail(SPARGE_ERR_UNSUPPORTED,
                  "kernel %s: this build carries it for this device only as compute_%d PTX, below the compute "
                  "capability %d.%d its instructions need (add SASS for the device or compute_%d PTX)",
                  e.name, arch, e.min_sm / 10, e.min_sm % 10, e.min_sm);
  }
  int smem = 0;
  if (cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, p.device_id) != cudaSuccess) {
    (void)cudaGetLastError();
    smem = 0;
  }
  if (smem > 0 && e.smem_bytes > smem)
    return fail(SPARGE_ERR_UNSUPPORTED, "kernel %s needs %d bytes of shared memory per CTA, the device offers %d",
                e.name, e.smem_bytes, smem);
  return SPARGE_OK;
}

}  // namespace

sparge_status_t choose_kernel(const Problem& p, int sm_version, const KernelEntry** out) {
  *out = nullptr;
  Family fam;
  if (!family_for_device(sm_version, &fam))
    return fail(SPARGE_ERR_UNSUPPORTED,
                "compute capability %d.%d: this build carries attention kernels for %s",
                sm_version / 10, sm_version % 10,
#if defined(SPARGE_WITH_PORTABLE)
                "compute capability 8.0 and newer (mma.sync)"
#else
                "compute capability 9.0 (sm_90a) only"
#endif
    );
  if (p.precision == SPARGE_PRECISION_FP16 && dev_switches().fp16 == Fp16Choice::kPortable)
    fam = Family::kPortable;
  const KernelKey key{fam, p.precision, static_cast<int>(p.D), p.dtype, p.causal};
  const KernelEntry* e = find_kernel(key);
  if (e == nullptr) {
    char dims[64];
    list_head_dims(fam, p.precision, p.dtype, dims, sizeof dims);
    const char* hint = (p.precision == SPARGE_PRECISION_INT8_FP8 || p.precision == SPARGE_PRECISION_INT8_FP8_SPLIT_V)
                           ? " (INT8_FP8's two fp32 output accumulators do not fit a thread's registers at "
                             "head_dim 256; INT8_FP16 has the same int8 Q.K^T with 16-bit P.V)"
                           : "";
    return fail(SPARGE_ERR_UNSUPPORTED,
                "problem->head_dim %lld, precision %s, dtype %d: the %s kernel family of this build has head dims "
                "%s for this precision and dtype%s",
                static_cast<long long>(p.D), precision_name(p.precision), int(p.dtype), family_name(fam), dims,
                (p.D == 256 && hint[0]) ? hint : "");
  }
  SPARGE_TRY(e->supports(p));
  SPARGE_TRY(check_entry_on_device(*e, p, sm_version));
  *out = e;
  return SPARGE_OK;
}

}  // namespace cuda
}  // namespace sparge
