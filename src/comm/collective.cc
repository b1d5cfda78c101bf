// What every backend shares: names, and CreateCollective, which picks the backend.
#include "strata/collective.h"

#include <fmt/format.h>

#include <cstdlib>

#include "comm/launch.h"
#include "comm/single_collective.h"

#if defined(STRATA_COMM_WITH_MPI)
#include "comm/mpi_collective.h"
#endif
#if defined(STRATA_COMM_WITH_NCCL)
#include "comm/nccl_collective.h"
#endif

namespace strata::comm {

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

std::string_view BackendName(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kSingle:
      return "single";
    case Backend::kMpi:
      return "mpi";
    case Backend::kNccl:
      return "nccl";
    case Backend::kInProcess:
      return "in-process";
  }
  return "unknown";
}

Result<std::unique_ptr<Collective>> CreateCollective(device::Device& device,
                                                     const CollectiveOptions& options) {
  STRATA_ASSIGN_OR_RETURN(
      LaunchInfo launch, internal::ParseLaunch([](const char* name) { return std::getenv(name); }));
  if (options.timeout.count() <= 0) {
    return InvalidArgumentError(
        fmt::format("collective timeout must be positive, got {} ms", options.timeout.count()));
  }
  Backend backend = options.backend;
  if (backend == Backend::kAuto) {
    if (launch.world_size <= 1) {
      backend = Backend::kSingle;
    } else {
      backend = device.type() == device::DeviceType::kCpu ? Backend::kMpi : Backend::kNccl;
    }
  }
  switch (backend) {
    case Backend::kSingle:
      if (launch.world_size > 1) {
        return InvalidArgumentError(fmt::format(
            "the single backend is a world of one process, but the launcher ({}) started {} "
            "ranks; use the auto, mpi or nccl backend",
            launch.launcher, launch.world_size));
      }
      return std::unique_ptr<Collective>(
          std::make_unique<internal::SingleCollective>(device, options));
    case Backend::kMpi:
#if defined(STRATA_COMM_WITH_MPI)
      return internal::CreateMpiCollective(device, options, launch);
#else
      return UnimplementedError(
          "the mpi backend is not built in: CMake found no MPI (install libopenmpi-dev and "
          "re-run CMake)");
#endif
    case Backend::kNccl:
#if defined(STRATA_COMM_WITH_NCCL)
      return internal::CreateNcclCollective(device, options, launch);
#else
      return UnimplementedError(
          "the nccl backend is not built in: CMake found no CUDA toolkit with NCCL");
#endif
    case Backend::kInProcess:
      return InvalidArgumentError(
          "the in-process backend is a world of threads, not of processes: its ranks join a "
          "comm::InProcessWorld (comm/in_process_collective.h)");
    case Backend::kAuto:
      break;
  }
  return InvalidArgumentError(
      fmt::format("unknown collective backend {}", static_cast<int>(options.backend)));
}

}  // namespace strata::comm
