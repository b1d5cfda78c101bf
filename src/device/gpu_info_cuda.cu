// placeholder
#include "device/gpu_info.h"
namespace strata::device {
GpuReport QueryGpus() { return {}; }
}
