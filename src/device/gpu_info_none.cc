#include "device/gpu_info.h"

namespace strata::device {

GpuReport QueryGpus() {
  GpuReport report;
  report.built_with_cuda = false;
  report.none_reason = "this binary was built without CUDA";
  return report;
}

}  // namespace strata::device
