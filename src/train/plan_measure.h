// `strata estimate --measure`: the rates of this machine, measured in seconds, for the time model
// (train/plan.h). NVMe with the nvme-bench engine (io::RunBench) in a directory; CPU Adam with
// the engine's own kernel (optim::CpuAdamStep) on the threads a rank's optimizer gets; the
// compute of the CPU device with OpenBLAS sgemm (the CPU ops' matrix products); GPUs from the
// driver (their count, memory and a dense 16-bit peak by name).
#pragma once

#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/status.h"
#include "train/plan.h"

namespace strata::train {

struct MeasureOptions {
  device::DeviceType device = device::DeviceType::kCuda;
  std::string nvme_path;  // empty: NVMe is not measured
  uint64_t nvme_bytes = 512ull << 20;
  int ranks_per_node = 1;
};

// Overwrites the fields of `hw` it measures and returns one line per measurement (for people).
// Errors: an NVMe directory that cannot be written, an Adam kernel failure.
Result<std::vector<std::string>> MeasureHardware(const MeasureOptions& options, Hardware* hw);

// Dense 16-bit peak TFLOPS of a GPU by its name ("NVIDIA H100 80GB HBM3"); 0 when unknown.
double GpuPeakTflops(const std::string& name);

}  // namespace strata::train
