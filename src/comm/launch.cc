#include "comm/launch.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "common/log.h"

namespace strata::comm {

namespace internal {

namespace {

struct LauncherVars {
  std::string_view launcher;
  const char* rank;
  const char* sizes[2];  // the first one set wins
  const char* local_rank;
  const char* local_size;  // ranks on this node; unset: assume every rank is on this node
};

constexpr LauncherVars kLaunchers[] = {
    {"mpirun",
     "OMPI_COMM_WORLD_RANK",
     {"OMPI_COMM_WORLD_SIZE", nullptr},
     "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"pmi", "PMI_RANK", {"PMI_SIZE", nullptr}, "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    // Inside a job step SLURM_STEP_NUM_TASKS is the step's size; SLURM_NTASKS (the job's) is the
    // fallback for older Slurm versions.
    {"srun", "SLURM_PROCID", {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, "SLURM_LOCALID",
     "SLURM_NTASKS_PER_NODE"},
};

// The variable's value as a non-negative int; nullopt when unset; InvalidArgument when malformed.
Result<std::optional<int>> ReadInt(const GetEnvFn& getenv, const char* name) {
  const char* value = getenv(name);
  if (value == nullptr) return std::optional<int>();
  std::string_view text(value);
  int parsed = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), parsed);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || parsed < 0) {
    return InvalidArgumentError(
        fmt::format("launcher environment: {}='{}' is not a non-negative integer", name, text));
  }
  return std::optional<int>(parsed);
}

}  // namespace

Result<LaunchInfo> ParseLaunch(const GetEnvFn& getenv) {
  for (const LauncherVars& vars : kLaunchers) {
    STRATA_ASSIGN_OR_RETURN(std::optional<int> rank, ReadInt(getenv, vars.rank));
    if (!rank) continue;
    std::optional<int> size;
    const char* size_name = vars.sizes[0];
    for (const char* name : vars.sizes) {
      if (name == nullptr) break;
      STRATA_ASSIGN_OR_RETURN(size, ReadInt(getenv, name));
      size_name = name;
      if (size) break;
    }
    if (!size || *size < 1) {
      return InvalidArgumentError(fmt::format(
          "launcher environment: {} is set ({}) but {} is {}", vars.rank, *rank, size_name,
          size ? fmt::format("{} (expected >= 1)", *size) : std::string("unset")));
    }
    if (*rank >= *size) {
      return InvalidArgumentError(fmt::format("launcher environment: {}={} is not below {}={}",
                                              vars.rank, *rank, size_name, *size));
    }
    STRATA_ASSIGN_OR_RETURN(std::optional<int> local, ReadInt(getenv, vars.local_rank));
    if (local && *local >= *size) {
      return InvalidArgumentError(fmt::format("launcher environment: {}={} is not below {}={}",
                                              vars.local_rank, *local, size_name, *size));
    }
    STRATA_ASSIGN_OR_RETURN(std::optional<int> local_size, ReadInt(getenv, vars.local_size));
    if (local_size && (*local_size < 1 || *local_size > *size ||
                       (local && *local >= *local_size))) {
      return InvalidArgumentError(fmt::format(
          "launcher environment: {}={} is not between {} and {}={}", vars.local_size, *local_size,
          local ? *local + 1 : 1, size_name, *size));
    }
    LaunchInfo info;
    info.rank = *rank;
    info.world_size = *size;
    info.local_rank = local.value_or(0);
    info.local_size = local_size.value_or(*size);
    info.launcher = std::string(vars.launcher);
    return info;
  }
  LaunchInfo none;
  none.launcher = "none";
  return none;
}

}  // namespace internal

LaunchInfo DetectLaunch() {
  Result<LaunchInfo> info =
      internal::ParseLaunch([](const char* name) { return std::getenv(name); });
  if (info.ok()) return *info;
  STRATA_LOG_ONCE(warn, comm, "{}; assuming a single process (rank 0 of 1)",
                  info.status().message());
  LaunchInfo none;
  none.launcher = "none";
  return none;
}

}  // namespace strata::comm
