// The developer switches (cuda/common/switches.hpp).
#include <cstdlib>
#include <cstring>

#include <algorithm>

#include "cuda/common/switches.hpp"

namespace sparge {
namespace cuda {

namespace {
bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::strcmp(e, value) == 0;
}
}  // namespace

const DevSwitches& dev_switches() {
  static const DevSwitches s = [] {
    DevSwitches d;
    d.pdl = !env_is("SPARGE_PDL", "0");
    d.tma_store = !env_is("SPARGE_SM90_EPILOGUE", "direct");
    if (env_is("SPARGE_FP16_KERNEL", "portable")) d.fp16 = Fp16Choice::kPortable;
    if (env_is("SPARGE_FP16_KERNEL", "sm90")) d.fp16 = Fp16Choice::kSm90Only;
    d.force_portable = env_is("SPARGE_KERNEL_FAMILY", "portable");
    d.graphs = !env_is("SPARGE_GRAPHS", "0");
    if (env_is("SPARGE_SM90_PERSIST", "0")) d.persist = 0;
    if (env_is("SPARGE_SM90_PERSIST", "1")) d.persist = 1;
    if (const char* g = std::getenv("SPARGE_SM90_PERSIST_GRID")) d.persist_grid = std::max(0, std::atoi(g));
    if (env_is("SPARGE_SM90_WIDE", "0")) d.wide = 0;
    if (env_is("SPARGE_SM90_WIDE", "1")) d.wide = 1;
    if (env_is("SPARGE_SM90_SHORT", "0")) d.shrt = 0;
    if (env_is("SPARGE_SM90_SHORT", "1")) d.shrt = 1;
    return d;
  }();
  return s;
}

}  // namespace cuda
}  // namespace sparge
