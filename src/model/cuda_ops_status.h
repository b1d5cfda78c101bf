// The C++20 side of the CUDA ops (cuda_ops.h): their errors as Status, a context on a
// device::Stream, and the data-error check. Only built with CUDA (STRATA_WITH_CUDA).
#pragma once

#include "model/cpu_ops.h"
#include "model/cuda_ops.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::model::cuda {

// The one place where an OpError becomes a Status: OK on success, otherwise
// "<op>: <call> failed: <text> (<name>)" (or "<op>: <reason>" for kArgument), with a code that
// says what to do: ResourceExhausted for out of memory, InvalidArgument for bad arguments,
// Unavailable for no GPU or driver, Internal otherwise. Clears CUDA's last-error state.
Status ToStatus(const OpError& error);

// A context on `stream`, which must be a stream of a CUDA device (InvalidArgument otherwise).
// Makes the stream's GPU the calling thread's current device, as every op needs.
Result<OpsContextPtr> CreateOpsContext(device::Stream& stream);

// Waits for the context's stream; InvalidArgument naming the bad token or target (as the CPU
// ops word it) when a kernel recorded one since the last check, which it then forgets.
Status CheckDataErrors(OpsContext* context);

// The same weight descriptor, for device memory.
Weight ToCudaWeight(cpu::Weight weight);
// The same dtype (the enums are numbered alike).
DType ToCudaDType(device::DType dtype);

}  // namespace strata::model::cuda
