// The MPI backend: the Collective of the CPU device over MPI. Operations are checked at enqueue
// and handed to the process's MPI runtime (mpi_runtime.h), which runs every rank's operations in
// enqueue order on its own thread, in stream order (a host task on the stream waits for each).
// Buffers are the CPU device's memory (host memory). All-gathers and broadcasts are MPI's own;
// reductions send each rank its part point to point and add the parts received in rank order in
// fp32, rounding once to the element type (mpi_runtime.h).
//
// The runtime is shared by every MPI Collective of the process, so a failure (a timeout, a dead
// peer, an MPI error) fails every one of them, and their operations share one sequence of numbers.
#pragma once

#include <memory>

#include "comm/mpi_runtime.h"
#include "strata/collective.h"

namespace strata::comm::internal {

// Creates an MPI Collective for `device` (must be a CPU device: InvalidArgument otherwise),
// starting the MPI runtime on first use (Unavailable when it cannot start). Unavailable as well
// when the launcher's rank or world size (`launch`, unless its launcher is "none") disagrees with
// MPI's: the binary then uses another MPI than the launcher that started it.
Result<std::unique_ptr<Collective>> CreateMpiCollective(device::Device& device,
                                                        const CollectiveOptions& options,
                                                        const LaunchInfo& launch,
                                                        const MpiTuning& tuning = {});

}  // namespace strata::comm::internal
