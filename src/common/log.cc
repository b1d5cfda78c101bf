#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <array>
#include <cstdlib>
#include <string>
#include <vector>

namespace strata::log {

namespace internal {
std::atomic<int> g_min_level[static_cast<int>(Subsystem::kCount)];
std::atomic<bool> g_initialized{false};
}  // namespace internal

namespace {

constexpr std::array<std::string_view, static_cast<int>(Subsystem::kCount)> kSubsystemNames = {
    "core", "config", "io",    "device", "comm", "offload",
    "zero", "optim",  "model", "train",  "cli",  "bench"};

std::mutex g_mu;  // guards the logger and the rank prefix
std::shared_ptr<spdlog::logger> g_logger;
std::string g_rank_prefix;  // "r0/2 " or ""

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end != nullptr && *end == '\0') ? static_cast<int>(x) : fallback;
}

std::string RankPrefixFromEnv() {
  int rank = -1;
  int world = -1;
  for (const char* r : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"}) {
    rank = EnvInt(r, -1);
    if (rank >= 0) break;
  }
  for (const char* w : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"}) {
    world = EnvInt(w, -1);
    if (world >= 0) break;
  }
  if (rank < 0 || world <= 1) return "";
  return fmt::format("r{}/{} ", rank, world);
}

// Parses the STRATA_LOG_LEVEL syntax into `levels` without touching the globals.
Status ParseSpec(std::string_view spec,
                 std::array<int, static_cast<int>(Subsystem::kCount)>* levels) {
  levels->fill(static_cast<int>(Level::info));
  std::vector<std::pair<Subsystem, Level>> overrides;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string_view::npos) comma = spec.size();
    std::string_view part = spec.substr(pos, comma - pos);
    while (!part.empty() && part.front() == ' ')
      part.remove_prefix(1);
    while (!part.empty() && part.back() == ' ')
      part.remove_suffix(1);
    pos = comma + 1;
    if (part.empty()) continue;
    size_t eq = part.find('=');
    if (eq == std::string_view::npos) {
      auto level = ParseLevel(part);
      if (!level) {
        return InvalidArgumentError(
            fmt::format("STRATA_LOG_LEVEL: '{}' is not a level; expected trace, debug, info, warn, "
                        "error or off",
                        part));
      }
      levels->fill(static_cast<int>(*level));
    } else {
      std::string_view sub_name = part.substr(0, eq);
      std::string_view level_name = part.substr(eq + 1);
      auto sub = ParseSubsystem(sub_name);
      if (!sub) {
        std::string names;
        for (auto n : kSubsystemNames)
          names += (names.empty() ? "" : ", ") + std::string(n);
        return InvalidArgumentError(fmt::format(
            "STRATA_LOG_LEVEL: '{}' is not a subsystem; expected one of {}", sub_name, names));
      }
      auto level = ParseLevel(level_name);
      if (!level) {
        return InvalidArgumentError(fmt::format(
            "STRATA_LOG_LEVEL: '{}' (for {}) is not a level; expected trace, debug, info, warn, "
            "error or off",
            level_name, sub_name));
      }
      overrides.emplace_back(*sub, *level);
    }
  }
  // Subsystem overrides win over a global level wherever they appear in the spec.
  for (auto [sub, level] : overrides)
    (*levels)[static_cast<int>(sub)] = static_cast<int>(level);
  return Status::Ok();
}

void CreateLoggerLocked() {
  if (g_logger) return;
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  g_logger = std::make_shared<spdlog::logger>("strata", std::move(sink));
  g_logger->set_pattern("%H:%M:%S.%e %L %v");
  g_logger->set_level(spdlog::level::trace);  // filtering happens in Enabled()
  g_logger->flush_on(spdlog::level::trace);
}

}  // namespace

std::string_view LevelName(Level level) {
  switch (level) {
    case Level::trace:
      return "trace";
    case Level::debug:
      return "debug";
    case Level::info:
      return "info";
    case Level::warn:
      return "warn";
    case Level::error:
      return "error";
    case Level::off:
      return "off";
  }
  return "?";
}

std::string_view SubsystemName(Subsystem subsystem) {
  int i = static_cast<int>(subsystem);
  return (i >= 0 && i < static_cast<int>(Subsystem::kCount)) ? kSubsystemNames[i] : "?";
}

std::optional<Level> ParseLevel(std::string_view name) {
  if (name == "trace") return Level::trace;
  if (name == "debug") return Level::debug;
  if (name == "info") return Level::info;
  if (name == "warn" || name == "warning") return Level::warn;
  if (name == "error") return Level::error;
  if (name == "off" || name == "none") return Level::off;
  return std::nullopt;
}

std::optional<Subsystem> ParseSubsystem(std::string_view name) {
  for (size_t i = 0; i < kSubsystemNames.size(); ++i) {
    if (kSubsystemNames[i] == name) return static_cast<Subsystem>(i);
  }
  return std::nullopt;
}

namespace internal {
void EnsureInitialized() {
  std::lock_guard lock(g_mu);
  if (g_initialized.load(std::memory_order_relaxed)) return;
  std::array<int, static_cast<int>(Subsystem::kCount)> levels;
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  Status st = ParseSpec(env ? env : "", &levels);
  if (!st.ok()) {
    levels.fill(static_cast<int>(Level::info));
  }
  for (size_t i = 0; i < levels.size(); ++i) {
    g_min_level[i].store(levels[i], std::memory_order_relaxed);
  }
  g_rank_prefix = RankPrefixFromEnv();
  CreateLoggerLocked();
  g_initialized.store(true, std::memory_order_release);
  if (!st.ok()) {
    g_logger->warn("{}[core] {} (using info)", g_rank_prefix, st.message());
  }
}
}  // namespace internal

void Write(Subsystem subsystem, Level level, std::string_view message) {
  internal::EnsureInitialized();
  spdlog::level::level_enum sl = spdlog::level::info;
  switch (level) {
    case Level::trace:
      sl = spdlog::level::trace;
      break;
    case Level::debug:
      sl = spdlog::level::debug;
      break;
    case Level::info:
      sl = spdlog::level::info;
      break;
    case Level::warn:
      sl = spdlog::level::warn;
      break;
    case Level::error:
      sl = spdlog::level::err;
      break;
    case Level::off:
      return;
  }
  std::lock_guard lock(g_mu);
  g_logger->log(sl, "{}[{}] {}", g_rank_prefix, SubsystemName(subsystem), message);
}

Status Configure(std::string_view spec) {
  internal::EnsureInitialized();
  std::array<int, static_cast<int>(Subsystem::kCount)> levels;
  STRATA_RETURN_IF_ERROR(ParseSpec(spec, &levels));
  for (size_t i = 0; i < levels.size(); ++i) {
    internal::g_min_level[i].store(levels[i], std::memory_order_relaxed);
  }
  return Status::Ok();
}

void SetRank(int rank, int world) {
  internal::EnsureInitialized();
  std::lock_guard lock(g_mu);
  g_rank_prefix = world > 1 ? fmt::format("r{}/{} ", rank, world) : "";
}

}  // namespace strata::log
