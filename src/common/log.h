// Logging: the one header through which Strata logs. spdlog is used only in log.cc.
//
//   STRATA_LOG(info, io, "opened {} ({} bytes)", path, size);
//   STRATA_LOG_ONCE(warn, io, "io_uring unavailable ({}); using the pread/pwrite backend", why);
//
// Each message carries a subsystem (io, config, ...) and a level. The level is checked before any
// formatting, so a disabled debug line costs one relaxed atomic load.
//
// Configuration comes from the environment variable STRATA_LOG_LEVEL, read on first use:
//   STRATA_LOG_LEVEL=debug                 every subsystem at debug
//   STRATA_LOG_LEVEL=warn,io=debug         io at debug, the rest at warn
//   STRATA_LOG_LEVEL=off                   nothing
// Levels: trace, debug, info (the default), warn, error, off. Subsystems: see Subsystem below.
//
// Lines go to stderr as "HH:MM:SS.mmm L r<rank>/<world> [subsystem] message"; the rank part
// appears when the process is one of several ranks (from OMPI_COMM_WORLD_RANK, PMI_RANK,
// PMIX_RANK, SLURM_PROCID or RANK, or from SetRank()).
//
// Thread safety: every function here may be called from any thread.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata::log {

enum class Level : int { trace = 0, debug = 1, info = 2, warn = 3, error = 4, off = 5 };

enum class Subsystem : int {
  core = 0,
  config,
  io,
  device,
  comm,
  offload,
  zero,
  optim,
  model,
  train,
  cli,
  bench,
  kCount,
};

std::string_view LevelName(Level level);
std::string_view SubsystemName(Subsystem subsystem);
std::optional<Level> ParseLevel(std::string_view name);
std::optional<Subsystem> ParseSubsystem(std::string_view name);

namespace internal {
// Per-subsystem minimum level; initialised from STRATA_LOG_LEVEL on first use.
extern std::atomic<int> g_min_level[static_cast<int>(Subsystem::kCount)];
void EnsureInitialized();
extern std::atomic<bool> g_initialized;
}  // namespace internal

// True when a message at `level` for `subsystem` would be written.
inline bool Enabled(Subsystem subsystem, Level level) {
  if (!internal::g_initialized.load(std::memory_order_acquire)) [[unlikely]] {
    internal::EnsureInitialized();
  }
  return static_cast<int>(level) >=
         internal::g_min_level[static_cast<int>(subsystem)].load(std::memory_order_relaxed);
}

// Writes one already-formatted line. Prefer the macros.
void Write(Subsystem subsystem, Level level, std::string_view message);

// Replaces the current levels with those described by `spec` (the STRATA_LOG_LEVEL syntax).
// On a malformed spec, returns InvalidArgument naming the bad part and leaves the levels as they
// were.
Status Configure(std::string_view spec);

// Sets the rank shown in the prefix (world <= 1 hides it).
void SetRank(int rank, int world);

}  // namespace strata::log

#define STRATA_LOG(level, subsystem, ...)                                                    \
  do {                                                                                       \
    if (::strata::log::Enabled(::strata::log::Subsystem::subsystem,                          \
                               ::strata::log::Level::level)) {                               \
      ::strata::log::Write(::strata::log::Subsystem::subsystem, ::strata::log::Level::level, \
                           ::fmt::format(__VA_ARGS__));                                      \
    }                                                                                        \
  } while (false)

// Logs at most once per call site for the life of the process.
#define STRATA_LOG_ONCE(level, subsystem, ...)                                                   \
  do {                                                                                           \
    static ::std::once_flag strata_log_once_flag_;                                               \
    ::std::call_once(strata_log_once_flag_, [&] { STRATA_LOG(level, subsystem, __VA_ARGS__); }); \
  } while (false)
