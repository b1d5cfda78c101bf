// Reading the launcher's environment (mpirun, srun, an MPICH-style PMI launcher) into a
// LaunchInfo. DetectLaunch (strata/collective.h) is ParseLaunch over the real environment.
#pragma once

#include <functional>

#include "strata/collective.h"
#include "strata/status.h"

namespace strata::comm::internal {

// Looks a variable up; nullptr when unset. Tests pass a map; DetectLaunch passes std::getenv.
using GetEnvFn = std::function<const char*(const char*)>;

// The launcher is the first of these whose rank variable is set:
//   "mpirun"  OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK (Open MPI)
//   "pmi"     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (MPICH / Intel MPI's hydra)
//   "srun"    SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID
// and "none" ({0, 1, 0}) when none is. The local rank is 0 when its variable is unset.
// InvalidArgument, naming the variable and its value, when a set variable is not a
// non-negative integer, the size is missing or < 1, or rank / local rank are not below it.
Result<LaunchInfo> ParseLaunch(const GetEnvFn& getenv);

}  // namespace strata::comm::internal
