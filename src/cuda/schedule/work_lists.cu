// Mask -> per-row index lists for the attention kernels, launched on their
// own (after a predicted mask; with a caller's mask they run inside the
// preparation's launches, prepare.cu). Device code: schedule/lists.cuh.
#include "core/error.hpp"
#include "cuda/common/internal.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/predict/predict.cuh"
#include "cuda/schedule/lists.cuh"

namespace sparge {
namespace cuda {
namespace {

using namespace lists;

constexpr int kOrderThreads = 512;

__global__ void __launch_bounds__(kListWarps * 32) mask_to_lists_kernel(const ListArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  mask_to_lists(a, blockIdx.x);
}

__global__ void __launch_bounds__(kOrderThreads) order_kernel(const OrderArgs a) {
  pdl_grid_sync();  // launched by launch_pdl (cuda/common/launch.cuh)
  extern __shared__ int hist[];  // nbins = nKB + 1 counters
  order_rows<kOrderThreads>(a, blockIdx.x, hist);
}

}  // namespace

namespace lists {

sparge_status_t list_args(const Plan& plan, const MaskView& mask, void* ws, ListArgs* la, OrderArgs* oa,
                          int64_t* list_ctas, int64_t* groups) {
  const Problem& p = plan.prob;
  const WorkspaceLayout& L = plan.ws;
  SPARGE_TRY(predict_supported(p));
  if (L.idx == 0 || L.cnt == 0 || L.order == 0)
    return fail(SPARGE_ERR_INTERNAL, "CUDA index lists: workspace layout lacks idx/cnt/order");
  char* base = static_cast<char*>(ws);
  const int64_t rows = p.B * p.Hq * p.nQB;
  if (rows > int64_t(0x7fffffff)) return fail(SPARGE_ERR_UNSUPPORTED, "too many query blocks");
  la->prob = p;
  la->mask = mask;
  la->idx = ws_ptr<int32_t>(base, L.idx);
  la->cnt = ws_ptr<int32_t>(base, L.cnt);
  oa->cnt = la->cnt;
  oa->group_rows = p.group() * p.nQB;
  oa->nbins = int(p.nKB + 1);
  oa->order = ws_ptr<int32_t>(base, L.order);
  *list_ctas = rows <= 0 ? 0 : ceil_div(rows, kListWarps);
  *groups = rows <= 0 ? 0 : p.B * p.Hkv;
  return SPARGE_OK;
}

sparge_status_t launch_order(const Plan& plan, const OrderArgs& oa, int64_t groups, cudaStream_t stream) {
  if (groups <= 0) return SPARGE_OK;
  const size_t smem = size_t(oa.nbins) * sizeof(int);
  // Once per kernel, size and device (cuda/common/launch.cuh; nothing up to 48 KB); the
  // backend made the plan's device current.
  SPARGE_TRY(ensure_smem_attr(reinterpret_cast<const void*>(&order_kernel), int(smem), plan.prob.device_id));
  SPARGE_PDL_CHECK(launch_pdl(order_kernel, dim3(unsigned(groups)), dim3(kOrderThreads), smem, stream, oa),
                   "sparge work-order kernel");
  return SPARGE_OK;
}

}  // namespace lists

sparge_status_t launch_mask_to_lists(const Plan& plan, const MaskView& mask, void* ws, cudaStream_t stream) {
  using namespace lists;
  ListArgs la;
  OrderArgs oa;
  int64_t ctas = 0, groups = 0;
  SPARGE_TRY(list_args(plan, mask, ws, &la, &oa, &ctas, &groups));
  if (ctas <= 0) return SPARGE_OK;
  SPARGE_PDL_CHECK(launch_pdl(mask_to_lists_kernel, dim3(unsigned(ctas)), dim3(kListWarps * 32), 0, stream, la),
                   "sparge mask-to-lists kernel");
  return launch_order(plan, oa, groups, stream);
}

sparge_status_t launch_work_order(const Plan& plan, void* ws, cudaStream_t stream) {
  lists::ListArgs la;
  lists::OrderArgs oa;
  int64_t ctas = 0, groups = 0;
  const MaskView none{};
  SPARGE_TRY(lists::list_args(plan, none, ws, &la, &oa, &ctas, &groups));
  return lists::launch_order(plan, oa, groups, stream);
}

}  // namespace cuda
}  // namespace sparge
