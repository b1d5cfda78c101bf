// The NCCL backend: the Collective of the CUDA device.
//
// One NCCL communicator per Collective, created from a unique id that rank 0 makes and the MPI
// runtime broadcasts (mpi_runtime.h; a world of one needs no MPI). Operations are NCCL calls on
// the stream's cudaStream_t, so stream order is CUDA's own. Calls are serialised by a mutex, in
// enqueue order, as NCCL requires.
//
// Arithmetic (op.h): fp32 reductions are ncclSum followed, for kAvg, by the device's Scale by
// 1.0f / world. 16-bit reductions are staged through fp32 device scratch (Cast, ncclSum in fp32,
// Scale, Cast back), so that they round once exactly as the other backends do; this moves twice
// the bytes of a native 16-bit reduction. Every rank gets the same bits (NCCL's ring and tree
// algorithms distribute one result).
//
// Failures: the communicator is non-blocking (ncclCommInitRankConfig with blocking = 0), so its
// creation and every call can be bounded by CollectiveOptions::timeout. A watchdog thread polls
// ncclCommGetAsyncError and the operations in flight (their start and end are Notify callbacks
// on the stream); an asynchronous NCCL error, or an operation running longer than the timeout,
// makes it call ncclCommAbort (the stuck kernels return) and fail the Collective. A host task
// after every operation turns that failure into the device's sticky error. NCCL cannot tell
// which rank is missing; the message says so.
#pragma once

#include <memory>

#include "strata/collective.h"

namespace strata::comm::internal {

// Creates an NCCL Collective for `device` (must be a CUDA device: InvalidArgument otherwise).
// With a launcher world size > 1 this starts the MPI runtime (Unavailable when the build has no
// MPI or it cannot start).
Result<std::unique_ptr<Collective>> CreateNcclCollective(device::Device& device,
                                                         const CollectiveOptions& options,
                                                         const LaunchInfo& launch);

}  // namespace strata::comm::internal
