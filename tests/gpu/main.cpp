// Entry point of the GPU test suite. Exits 77 (ctest: SKIPPED) when no CUDA
// device is usable, so CPU-only machines skip the suite instead of failing it.
//
// Environment:
//   SPARGE_TEST_SEED=<n>      reproduce a run (the base seed is printed first)
//   SPARGE_GPU_TEST_CSV=<f>   also write the measured accuracy table as CSV
#define SPARGE_CATCH2_SESSION
#include "catch_compat.hpp"

#include <cstdio>

#include "gpu_util.hpp"

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "device count 0");
    return 77;
  }
  if (!sparge_has_cuda()) {
    std::printf("SKIPPED: libsparge was built without the CUDA backend\n");
    return 77;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceProperties failed)\n");
    return 77;
  }
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  int maj = 0, min = 0, pat = 0;
  sparge_version(&maj, &min, &pat);
  std::printf("libsparge %d.%d.%d GPU tests on %s (sm_%d%d, %d SMs), runtime %d, driver %d\n", maj, min, pat,
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, rt, drv);
  std::printf("base seed 0x%016llx (set SPARGE_TEST_SEED to reproduce)\n",
              static_cast<unsigned long long>(sgt::base_seed()));
  std::fflush(stdout);
  const int rc = Catch::Session().run(argc, argv);
  sgt::print_records();
  return rc;
}
