// Which device a training rank runs on: `--device` / `strata.device` (cpu, cuda, auto), the
// launcher's local rank and the GPUs this process can see.
//
//   cpu   the CPU device.
//   cuda  GPU number <local rank> among the visible ones (CUDA_VISIBLE_DEVICES is applied by the
//         CUDA runtime before Strata counts). A local rank with no GPU of its own is an error
//         naming the rank and the rank it would share with: two ranks never share a GPU. One
//         exception: when CUDA_VISIBLE_DEVICES is set and shows exactly one GPU, the launcher is
//         taken to bind one GPU per rank (srun --gpus-per-task, a per-rank wrapper) and every
//         local rank uses it.
//   auto  cuda when the build has CUDA and the process sees a GPU, else cpu; `reason` says why,
//         for the one log line.
#pragma once

#include <optional>
#include <string>

#include "device/gpu_info.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::train {

struct DeviceChoice {
  device::DeviceType type = device::DeviceType::kCpu;
  int ordinal = 0;     // the CUDA device index (0 on the CPU)
  std::string reason;  // one sentence: what was picked and why
};

// `visible_devices` is CUDA_VISIBLE_DEVICES (nullopt when unset). Errors: InvalidArgument for
// "cuda" without a usable GPU (with the report's reason) or a local rank without a GPU.
Result<DeviceChoice> ChooseDevice(DeviceKind requested, int rank, int local_rank,
                                  const device::GpuReport& gpus,
                                  const std::optional<std::string>& visible_devices);

// Parses a --device value ("cpu", "cuda", "auto"); InvalidArgument naming the flag otherwise.
Result<DeviceKind> ParseDeviceKind(const std::string& text);

}  // namespace strata::train
