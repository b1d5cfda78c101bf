// DeviceAdamStep: one Adam / AdamW step over a shard that lives in a Device's memory, in stream
// order. The arithmetic is adam.h's.
#pragma once

#include "optim/adam.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::optim {

// Enqueues one step on `stream` of `device`; it runs after the work enqueued on the stream so
// far, and later work waits for it. The shard's arrays are memory of `device` (the CPU device:
// host memory) and must stay valid, and untouched by other streams, until the step completed
// (record an event after it and wait on that).
//   CPU device:  a HostTask that runs CpuAdamStep(hyper, shard, cpu) on the stream's thread (plus
//                cpu.threads - 1 helpers). hyper and shard are copied into the task.
//   CUDA device: the fused kernel of adam_cuda_kernel.h on the stream; `cpu` is not used. It
//                matches CpuAdamStep with Isa::kScalar bit for bit.
// Errors: InvalidArgument at once for what CpuAdamStep rejects (bad hyper-parameters, null or
// overlapping arrays, an unknown out_dtype; on the CPU device also a bad ISA or thread count);
// the launch error of the kernel, converted to a Status; Unimplemented for a CUDA device in a
// build without CUDA. An error while a CPU step runs becomes the device's sticky error.
Status DeviceAdamStep(device::Device& device, device::Stream& stream, const AdamHyper& hyper,
                      const AdamShard& shard, const CpuAdamOptions& cpu);

}  // namespace strata::optim
