// CUDA backend entry points (core/backend.hpp): device checks at plan time,
// and the predict / attention pipelines. Everything runs on the caller's
// stream: no allocation, no host synchronization (CUDA-graph capturable).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/switches.hpp"
#include "cuda/predict/predict.cuh"
#include "cuda/prepare/prepare.cuh"
#include "cuda/registry/registry.hpp"

namespace sparge {
namespace cuda {

// The setups of a plan's recent attention calls, keyed by every argument the
// setup and the pointer checks depend on (core/backend.hpp, AttnCallKey). A
// fixed array allocated with the plan; least recently used entry replaced.
// One mutex per plan: a lookup is a scan of hashes and a copy of one blob.
// The call's parameters that the kernels take by value and AttnCallKey does
// not hold (the per-head arrays are device memory: their pointers are in the
// key). Zero-filled before the fields are set, so that memcmp compares them.
struct GraphCfg {
  int32_t mode, smooth_k, sink, window, estimator;
  float topk, cdf, sim;
};

GraphCfg graph_cfg(const PredictConfig& c) {
  GraphCfg g;
  std::memset(&g, 0, sizeof g);
  g.mode = int32_t(c.mode), g.smooth_k = c.smooth_k, g.sink = c.attention_sink, g.window = c.local_window;
  g.estimator = int32_t(c.estimator), g.topk = c.topk, g.cdf = c.cdf_threshold, g.sim = c.sim_threshold;
  return g;
}

// Entries also keep, from the second call of a key on, the call's launch
// sequence as an instantiated CUDA graph (docs/API.md, "Repeated arguments"),
// built from the launches it replaces (no stream capture) and replayed on the
// caller's stream with one cudaGraphLaunch. The graph is a function of the key
// and GraphCfg.
struct CallCache {
  static constexpr int kCapacity = 32;
  struct Entry {
    AttnCallKey key;
    LaunchBlob blob;
    const KernelEntry* kernel;
    uint64_t used;         // clock of the last use
    GraphCfg gcfg;         // the parameters `exec` was built with
    cudaGraphExec_t exec;  // null until the second call of the key
    bool no_graph;         // building it failed: calls of this key launch one by one
  };
  std::mutex mu;
  uint64_t clock = 0;
  int count = 0;
  Entry entries[kCapacity];
};

CallCache* create_call_cache() { return new CallCache(); }  // value-initialized: every entry zero

void destroy_call_cache(CallCache* c) {
  if (c == nullptr) return;
  // In-flight replays finish first: a graph destroyed while it runs is freed on completion.
  for (int i = 0; i < c->count; ++i)
    if (c->entries[i].exec != nullptr) cudaGraphExecDestroy(c->entries[i].exec);
  delete c;
}

sparge_status_t cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return SPARGE_OK;
  return fail(SPARGE_ERR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

namespace {

// Makes `id` the current device for the lifetime of the guard and restores
// the caller's device afterwards.
class DeviceGuard {
 public:
  sparge_status_t enter(int id) {
    SPARGE_CUDA_TRY(cudaGetDevice(&prev_));
    if (prev_ != id) {
      SPARGE_CUDA_TRY(cudaSetDevice(id));
      switched_ = true;
    }
    return SPARGE_OK;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool switched_ = false;
};

MaskView workspace_mask(const Problem& p, void* ws, size_t off) {
  MaskView m;
  m.data = ws_ptr<uint8_t>(ws, off);
  m.stride[3] = 1;
  m.stride[2] = p.nKB;
  m.stride[1] = p.nQB * p.nKB;
  m.stride[0] = p.Hq * p.nQB * p.nKB;
  return m;
}

// The plan's attention kernel for these tensors, set up (every check, the
// tensor maps) with nothing queued. The sm_90a FP16 kernel hands a call whose
// strides its tensor maps cannot express to the portable kernel of the same
// key (an error under SPARGE_FP16_KERNEL=sm90, which tests use to prove the
// kernel they ran).
sparge_status_t setup_attention(const Plan& plan, const AttnArgs& a, LaunchBlob* blob, const KernelEntry** out) {
  const KernelEntry* e = static_cast<const KernelEntry*>(plan.kernel);
  if (e == nullptr) return fail(SPARGE_ERR_INTERNAL, "plan: a CUDA plan without an attention kernel");
  bool applies = false;
  SPARGE_TRY(e->setup(a, blob, &applies));
  if (!applies) {
    if (dev_switches().fp16 == Fp16Choice::kSm90Only)
      return fail(SPARGE_ERR_UNSUPPORTED,
                  "fp16 attention: the sm_90a kernel does not apply (a tensor map for these strides) and "
                  "SPARGE_FP16_KERNEL=sm90 forbids the portable fallback");
    KernelKey key = e->key;
    key.family = Family::kPortable;
    const KernelEntry* f = find_kernel(key);
    if (f == nullptr)
      return fail(SPARGE_ERR_UNSUPPORTED,
                  "q, k, v: the sm_90a %s kernel's tensor maps cannot express these strides (e.g. rows that "
                  "overlap), and the portable family has no kernel for head_dim %d",
                  e->name, key.head_dim);
    SPARGE_TRY(f->supports(a.prob));
    SPARGE_TRY(f->setup(a, blob, &applies));
    if (!applies) return fail(SPARGE_ERR_INTERNAL, "the portable fp16 kernel declined a call");
    e = f;
  }
  *out = e;
  return SPARGE_OK;
}

// SPARGE_CHECK_POINTERS=1 (read once): query where every pointer lives on
// every call, also for arguments the plan has seen before.
bool check_pointers_always() {
  static const bool on = [] {
    const char* e = std::getenv("SPARGE_CHECK_POINTERS");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return on;
}

bool same_key(const AttnCallKey& a, const AttnCallKey& b) {
  return a.hash == b.hash && std::memcmp(&a, &b, sizeof a) == 0;
}

// The entry of `key`, or null; the caller holds the cache's lock.
CallCache::Entry* find_entry(CallCache* c, const AttnCallKey& key) {
  for (int i = 0; i < c->count; ++i)
    if (same_key(c->entries[i].key, key)) return &c->entries[i];
  return nullptr;
}

// Copies the cached setup of `key` into blob / kernel (when non-NULL); false
// when the plan has none.
bool cache_find(const Plan& plan, const AttnCallKey& key, LaunchBlob* blob, const KernelEntry** kernel) {
  CallCache* c = plan.call_cache;
  if (c == nullptr) return false;
  std::lock_guard<std::mutex> lock(c->mu);
  CallCache::Entry* e = find_entry(c, key);
  if (e == nullptr) return false;
  if (blob) *blob = e->blob;
  if (kernel) *kernel = e->kernel;
  e->used = ++c->clock;
  return true;
}

void cache_store(const Plan& plan, const AttnCallKey& key, const LaunchBlob& blob, const KernelEntry* kernel) {
  CallCache* c = plan.call_cache;
  if (c == nullptr) return;
  std::lock_guard<std::mutex> lock(c->mu);
  CallCache::Entry* slot = find_entry(c, key);  // stored meanwhile by another thread
  if (slot == nullptr && c->count < CallCache::kCapacity) slot = &c->entries[c->count++];
  if (slot == nullptr) {
    slot = &c->entries[0];
    for (int i = 1; i < c->count; ++i)
      if (c->entries[i].used < slot->used) slot = &c->entries[i];
  }
  if (!same_key(slot->key, key)) {  // a new or an evicted slot
    if (slot->exec != nullptr) cudaGraphExecDestroy(slot->exec);  // an in-flight replay finishes first
    slot->exec = nullptr;
    slot->no_graph = false;
  }
  slot->key = key;
  slot->blob = blob;
  slot->kernel = kernel;
  slot->used = ++c->clock;
}

// SPARGE_GRAPHS=0 (read once): every call launches its kernels one by one.
bool graphs_enabled() { return dev_switches().graphs; }

}  // namespace

bool stream_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(s, &cs);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // the launches that follow report it
    return true;
  }
  return cs != cudaStreamCaptureStatusNone;
}

bool built() { return true; }

bool call_known(const Plan& plan, const AttnCallKey& key) {
  if (check_pointers_always()) return false;
  return cache_find(plan, key, nullptr, nullptr);
}

void remember_call(const Plan& plan, const AttnCallKey& key) {
  if (check_pointers_always()) return;
  cache_store(plan, key, LaunchBlob{}, nullptr);
}

bool pdl_enabled() { return dev_switches().pdl; }

sparge_status_t check_device(Problem& p, int* sm_version, int* sm_count, const void** kernel) {
  if (sm_version) *sm_version = 0;
  if (sm_count) *sm_count = 0;
  if (kernel) *kernel = nullptr;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear a sticky error
    if (e != cudaSuccess)
      return fail(SPARGE_ERR_NO_DEVICE, "no usable CUDA device: %s (%s)", cudaGetErrorName(e),
                  cudaGetErrorString(e));
    return fail(SPARGE_ERR_NO_DEVICE, "no CUDA device found");
  }
  if (p.device_id < 0 || p.device_id >= n)
    return fail(SPARGE_ERR_NO_DEVICE, "problem.device_id %d: no such CUDA device (%d present)", p.device_id, n);
  cudaDeviceProp prop;
  SPARGE_CUDA_TRY(cudaGetDeviceProperties(&prop, p.device_id));
  const int sm = prop.major * 10 + prop.minor;
  if (sm_version) *sm_version = sm;
  if (sm_count) *sm_count = prop.multiProcessorCount;
  if (p.precision_is_auto) {
    Family fam;
    p.precision = auto_precision(p.Lq, p.Lkv, p.D, family_for_device(sm, &fam) && fam == Family::kSm90);
  }
  if (!p.quantized() && p.precision != SPARGE_PRECISION_FP16)
    return fail(SPARGE_ERR_UNSUPPORTED,
                "precision %d: the CUDA backend runs INT8_FP8, INT8_FP8_SPLIT_V, INT8_FP16 and FP16 only",
                int(p.precision));
  SPARGE_TRY(predict_supported(p));
  DeviceGuard guard;  // choose_kernel queries the device's kernel images
  SPARGE_TRY(guard.enter(p.device_id));
  const KernelEntry* entry = nullptr;
  const sparge_status_t st = choose_kernel(p, sm, &entry);
  if (st != SPARGE_OK) {
    const std::string why = last_error_text();
    return fail(st, "CUDA device %d (%s): %s", p.device_id, prop.name, why.c_str());
  }
  if (kernel) *kernel = entry;
  return SPARGE_OK;
}

sparge_status_t kernel_info(const Plan& plan, sparge_kernel_info_t* info) {
  const KernelEntry* e = static_cast<const KernelEntry*>(plan.kernel);
  if (e == nullptr) return fail(SPARGE_ERR_INTERNAL, "plan: a CUDA plan without an attention kernel");
  sparge_kernel_info_t r;
  std::memset(&r, 0, sizeof r);
  r.struct_size = sizeof r;
  std::snprintf(r.family, sizeof r.family, "%s", family_name(e->key.family));
  std::snprintf(r.name, sizeof r.name, "%s", e->name);
  r.sm_version = plan.sm_version;
  r.head_dim = e->kernel_head_dim;
  r.block_q = e->block_q;
  r.keys_per_step = e->keys_per_step;
  r.stages = e->stages;
  r.threads = e->threads;
  r.smem_bytes = e->smem_bytes;
  *info = r;
  return SPARGE_OK;
}

sparge_status_t pointer_on_device(const void* ptr, int device_id, const char* name) {
  cudaPointerAttributes at;
  const cudaError_t e = cudaPointerGetAttributes(&at, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(SPARGE_ERR_INVALID_ARGUMENT, "%s: %p is not CUDA memory (%s)", name, ptr, cudaGetErrorString(e));
  }
  switch (at.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      if (at.device != device_id)
        return fail(SPARGE_ERR_INVALID_ARGUMENT, "%s: %p is memory of CUDA device %d, the plan runs on device %d",
                    name, ptr, at.device, device_id);
      return SPARGE_OK;
    case cudaMemoryTypeHost:
      return fail(SPARGE_ERR_INVALID_ARGUMENT, "%s: %p is host memory; expected memory of CUDA device %d", name,
                  ptr, device_id);
    default:
      return fail(SPARGE_ERR_INVALID_ARGUMENT,
                  "%s: %p is not CUDA memory (unregistered host pointer); expected memory of CUDA device %d", name,
                  ptr, device_id);
  }
}

sparge_status_t predict(const Plan& plan, const Tensor4& q, const Tensor4& k, const PredictConfig& cfg,
                        const MaskView& mask_out, const KeptView* kept, void* workspace, void* stream) {
  DeviceGuard guard;
  SPARGE_TRY(guard.enter(plan.prob.device_id));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  bool kept_zeroed = false;
  SPARGE_TRY(prepare_impl(plan, q, k, nullptr, cfg, workspace, s, /*quantize=*/false, /*pool=*/true,
                          /*lse_shift=*/false, nullptr, /*zero_tickets=*/true, kept, &kept_zeroed));
  SPARGE_TRY(launch_select(plan, cfg, mask_out, kept, workspace, s, /*lists_too=*/false, kept_zeroed));
  return SPARGE_OK;
}

namespace {

// The call's kernels, queued on `s` in order (the attention kernel set up in `blob`).
// first: the key's first call (the preparation clears its ticket words).
sparge_status_t enqueue(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4& v, const MaskView* mask,
                        const PredictConfig& cfg, const LseView* lse, void* workspace, const LaunchBlob& blob,
                        const KernelEntry* entry, cudaStream_t s, bool first, bool dense) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  // The pooled means and self-similarities are needed only when the mask is
  // predicted here. A dense call (every visible block kept) predicts nothing and
  // builds no lists: the kernels enumerate the blocks (attn::RowWork).
  const bool predict_here = mask == nullptr && !dense;
  // With the caller's mask, the 8-bit preparation's launches also build its index lists.
  bool lists_done = false;
  // the selection's counters: the workspace's (reset by the block-score kernel where one runs)
  KeptView wk;
  wk.data = ws_ptr<int32_t>(workspace, L.kept);
  wk.stride[0] = p.Hq;
  wk.stride[1] = 1;
  bool kept_zeroed = false;
  if (p.quantized()) {
    SPARGE_TRY(prepare_impl(plan, q, k, p.fp8_pv() ? &v : nullptr, cfg, workspace, s, /*quantize=*/true,
                            /*pool=*/predict_here, /*lse_shift=*/lse != nullptr, /*lists_mask=*/mask, first, &wk,
                            &kept_zeroed));
    lists_done = mask != nullptr;
  } else if (predict_here)
    SPARGE_TRY(prepare_impl(plan, q, k, nullptr, cfg, workspace, s, /*quantize=*/false, /*pool=*/true,
                            /*lse_shift=*/false, nullptr, first, &wk, &kept_zeroed));

  if (mask == nullptr && !dense) {
    const MaskView wm = workspace_mask(p, workspace, L.mask);
    SPARGE_TRY(launch_select(plan, cfg, wm, &wk, workspace, s, /*lists_too=*/true, kept_zeroed));
    SPARGE_TRY(launch_work_order(plan, workspace, s));
  } else if (mask != nullptr && !lists_done) {
    SPARGE_TRY(launch_mask_to_lists(plan, *mask, workspace, s));
  }
  return entry->run(blob, s);
}

// Builds `fn(stream)`'s launches into a graph (no launch happens: launch_pdl
// records them, cuda/common/launch.cuh) and instantiates it on the current
// device, the plan's. Called under the cache's lock.
template <class Fn>
sparge_status_t build_graph(cudaStream_t stream, Fn&& fn, cudaGraphExec_t* out) {
  *out = nullptr;
  LaunchRecorder rec;
  SPARGE_CUDA_TRY(cudaGraphCreate(&rec.graph, 0));
  sparge_status_t st;
  {
    RecordLaunches recording(&rec);
    st = fn(stream);
  }
  if (st == SPARGE_OK && rec.last == nullptr) st = fail(SPARGE_ERR_INTERNAL, "a call graph without kernels");
  if (st == SPARGE_OK) {
    const cudaError_t inst = cudaGraphInstantiate(out, rec.graph, 0);
    if (inst != cudaSuccess) {
      *out = nullptr;
      st = cuda_status(inst, "cudaGraphInstantiate");
    }
  }
  cudaGraphDestroy(rec.graph);
  return st;
}

}  // namespace

sparge_status_t attention(const Plan& plan, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                          const MaskView* mask, const PredictConfig& cfg, const Tensor4& out, const LseView* lse,
                          void* workspace, void* stream, const AttnCallKey* key) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  DeviceGuard guard;
  SPARGE_TRY(guard.enter(p.device_id));
  cudaStream_t s = static_cast<cudaStream_t>(stream);

  // A key called before replays its graph (built at its second call) with
  // one launch. Not while the caller captures this stream: the kernels then
  // go into the caller's graph one by one, as below.
  const bool dense = mask == nullptr && keeps_every_block(cfg.mode, cfg.topk, cfg.topk_per_head);
  if (key != nullptr && (key->dense != 0) != dense)
    return fail(SPARGE_ERR_INTERNAL, "attention call key: dense %d, the validated params say %d", int(key->dense),
                int(dense));
  CallCache* c = plan.call_cache;
  if (key != nullptr && c != nullptr && graphs_enabled() && !stream_capturing(s)) {
    std::lock_guard<std::mutex> lock(c->mu);
    CallCache::Entry* e = find_entry(c, *key);
    if (e != nullptr && !e->no_graph) {
      const GraphCfg g = graph_cfg(cfg);
      if (e->exec != nullptr && std::memcmp(&e->gcfg, &g, sizeof g) != 0) {
        cudaGraphExecDestroy(e->exec);
        e->exec = nullptr;
      }
      if (e->exec == nullptr) {
        const LaunchBlob& blob = e->blob;
        const KernelEntry* kern = e->kernel;
        const sparge_status_t st = build_graph(
            s,
            [&](cudaStream_t cs) {
              return enqueue(plan, q, k, v, mask, cfg, lse, workspace, blob, kern, cs, false, dense);
            },
            &e->exec);
        e->gcfg = g;
        // No graph for this key: it launches one by one from now on (and what
        // failed, if it was a launch, is reported by the launches below).
        if (st != SPARGE_OK) {
          (void)cudaGetLastError();
          e->no_graph = true;
        }
      }
      if (e->exec != nullptr) {
        e->used = ++c->clock;
        return cuda_status(cudaGraphLaunch(e->exec, s), "cudaGraphLaunch");
      }
    }
  }

  AttnArgs a;
  a.prob = p;
  if (p.quantized()) {
    a.q_i8 = ws_ptr<const int8_t>(workspace, L.q_i8);
    a.q_scale = ws_ptr<const float>(workspace, L.q_scale);
    a.q_mu = ws_ptr<const float>(workspace, L.q_mu);
    a.k_i8 = ws_ptr<const int8_t>(workspace, L.k_i8);
    a.k_scale = ws_ptr<const float>(workspace, L.k_scale);
    if (p.fp8_pv()) {
      a.v_f8 = ws_ptr<const uint8_t>(workspace, L.v_f8);
      if (p.split_v()) a.v_f8_lo = ws_ptr<const uint8_t>(workspace, L.v_f8_lo);
      a.v_amax = ws_ptr<const float>(workspace, L.v_amax);
    }
  }
  a.q = q;
  a.k = k;
  a.v = v;
  if (!dense) {  // dense work: null lists (attn::RowWork)
    a.idx = ws_ptr<const int32_t>(workspace, L.idx);
    a.cnt = ws_ptr<const int32_t>(workspace, L.cnt);
    a.order = ws_ptr<const int32_t>(workspace, L.order);
  }
  a.out = out;
  if (lse) a.lse = *lse;
  a.sm_count = plan.sm_count;
  // Every check of the attention kernel and its tensor maps, before anything
  // is queued; a call with the arguments of an earlier one takes that call's
  // setup from the plan's cache (the setup is a function of the key alone).
  LaunchBlob blob;
  const KernelEntry* entry = nullptr;
  bool first = false;
  if (key == nullptr || !cache_find(plan, *key, &blob, &entry)) {
    SPARGE_TRY(setup_attention(plan, a, &blob, &entry));
    if (key != nullptr) cache_store(plan, *key, blob, entry);
    first = true;
  }
  return enqueue(plan, q, k, v, mask, cfg, lse, workspace, blob, entry, s, first, dense);
}

}  // namespace cuda
}  // namespace sparge
