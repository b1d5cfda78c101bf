// The configuration loader: one table of keys per section (see config_schema.h for the walker),
// then the rules that span sections, then the defaults that depend on other keys.
//
// Defaults and accepted keys follow DeepSpeed's code; docs/configuration.md records where each
// was checked and where Strata deliberately differs.
#include "strata/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <limits>
#include <memory>
#include <utility>

#include "common/config_parser.h"
#include "common/config_schema.h"
#include "common/errno.h"
#include "common/log.h"

namespace strata {

using config_internal::ConfigParser;
using config_internal::DefaultNvmePaths;
using config_internal::EnumName;
using config_internal::Field;
using config_internal::FieldError;
using config_internal::Ignored;
using config_internal::JoinPath;
using config_internal::Json;
using config_internal::KeySpec;
using config_internal::Multiply;
using config_internal::ParseState;
using config_internal::ReadBool;
using config_internal::ReadBytes;
using config_internal::ReadDouble;
using config_internal::ReadEnum;
using config_internal::ReadInt;
using config_internal::ReadInt64;
using config_internal::ReadString;
using config_internal::ReadStringList;
using config_internal::TakeAuto;
using config_internal::ValueError;
using config_internal::WalkObject;

std::string_view OffloadDeviceName(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
    case OffloadDevice::kAuto:
      return "auto";
  }
  return "?";
}

bool HasAutoOffload(const Config& config) {
  return config.zero.offload_param.device == OffloadDevice::kAuto ||
         config.zero.offload_optimizer.device == OffloadDevice::kAuto;
}

bool CanUseNvme(const Config& config, bool param) {
  const auto& z = config.zero;
  if (!config.strata.io.nvme_paths_auto && !config.strata.io.nvme_paths.empty()) return true;
  return !(param ? z.offload_param.nvme_path : z.offload_optimizer.nvme_path).empty();
}

Status ResolveOffloadDevices(Config* config, OffloadDevice param, OffloadDevice optimizer) {
  ZeroConfig& z = config->zero;
  auto check = [&](const char* key, OffloadDevice current, OffloadDevice chosen, bool is_param) {
    if (chosen == OffloadDevice::kAuto) {
      return InvalidArgumentError(fmt::format("{}: \"auto\" cannot be the resolved home", key));
    }
    if (current != OffloadDevice::kAuto && current != chosen) {
      return InvalidArgumentError(fmt::format("{}: is \"{}\" in the config; only \"auto\" may "
                                              "be resolved to \"{}\"",
                                              key, OffloadDeviceName(current),
                                              OffloadDeviceName(chosen)));
    }
    if (chosen == OffloadDevice::kNvme && !CanUseNvme(*config, is_param)) {
      return InvalidArgumentError(fmt::format(
          "{}: \"nvme\" needs a directory (nvme_path or strata.io.nvme_paths)", key));
    }
    if (is_param && chosen != OffloadDevice::kNone && z.stage != 3) {
      return InvalidArgumentError(fmt::format("{}: parameters are offloaded only at stage 3", key));
    }
    if (!is_param && chosen != OffloadDevice::kNone && z.stage == 0) {
      return InvalidArgumentError(fmt::format("{}: the optimizer is offloaded only at stages 1-3", key));
    }
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(check("zero_optimization.offload_param.device", z.offload_param.device,
                               param, true));
  STRATA_RETURN_IF_ERROR(check("zero_optimization.offload_optimizer.device",
                               z.offload_optimizer.device, optimizer, false));
  z.offload_param.device = param;
  z.offload_optimizer.device = optimizer;
  if (config->strata.io.nvme_paths_auto) config->strata.io.nvme_paths = DefaultNvmePaths(z);
  return Status::Ok();
}

std::string_view SchedulerTypeName(SchedulerType type) {
  switch (type) {
    case SchedulerType::kConstant:
      return "constant";
    case SchedulerType::kWarmupLR:
      return "WarmupLR";
    case SchedulerType::kWarmupDecayLR:
      return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR:
      return "WarmupCosineLR";
  }
  return "?";
}

std::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kFp16:
      return "fp16";
    case Precision::kBf16:
      return "bf16";
  }
  return "?";
}

std::string_view IoBackendName(IoBackend backend) {
  switch (backend) {
    case IoBackend::kAuto:
      return "auto";
    case IoBackend::kUring:
      return "uring";
    case IoBackend::kPosix:
      return "posix";
  }
  return "?";
}

std::string_view ToggleName(Toggle toggle) {
  switch (toggle) {
    case Toggle::kAuto:
      return "auto";
    case Toggle::kOn:
      return "on";
    case Toggle::kOff:
      return "off";
  }
  return "?";
}

std::string_view DeviceKindName(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto:
      return "auto";
    case DeviceKind::kCpu:
      return "cpu";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "?";
}

std::string_view NonFinitePolicyName(NonFinitePolicy policy) {
  return policy == NonFinitePolicy::kSkip ? "skip" : "error";
}

std::string ConfigDiagnostics::IgnoredKeysMessage(std::string_view source_name) const {
  if (ignored_keys.empty()) return "";
  return fmt::format(
      "{}: accepted but not implemented by Strata, so these DeepSpeed settings have no effect: "
      "{} (see docs/configuration.md)",
      source_name, fmt::join(ignored_keys, ", "));
}

namespace {


// Line and column (1-based) of the byte at `offset`, as an editor shows them.
std::pair<size_t, size_t> LineAndColumn(std::string_view text, size_t offset) {
  size_t line = 1;
  size_t column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

// Parses JSON (comments allowed, duplicate keys rejected as DeepSpeed does).
Result<Json> ParseJson(std::string_view text, std::string_view source_name) {
  // The parser callback sees every key; a stack of open containers tracks the keys seen in
  // each object so that a repeated key is caught (nlohmann would silently keep the last one).
  struct Container {
    bool is_object;
    std::string key;  // the most recent key read in this object
    std::vector<std::string> keys;
  };
  std::vector<Container> open;
  std::string duplicate;
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open.push_back({true, {}, {}});
        break;
      case Json::parse_event_t::array_start:
        open.push_back({false, {}, {}});
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!open.empty()) open.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (open.empty() || !parsed.is_string()) break;
        Container& top = open.back();
        top.key = parsed.get<std::string>();
        bool seen = false;
        for (const std::string& k : top.keys)
          seen = seen || k == top.key;
        if (seen && duplicate.empty()) {
          for (const Container& c : open) {
            if (c.is_object) duplicate = JoinPath(duplicate, c.key);
          }
        }
        top.keys.push_back(top.key);
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/true);
  } catch (const Json::parse_error& e) {
    // e.byte counts the characters read, so the offending one is at e.byte - 1.
    auto [line, column] = LineAndColumn(text, e.byte == 0 ? 0 : e.byte - 1);
    // Keep nlohmann's explanation but drop its own prefix and position.
    std::string_view what = e.what();
    size_t colon = what.find(": ", what.find("parse error"));
    std::string_view reason = colon == std::string_view::npos ? what : what.substr(colon + 2);
    return InvalidArgumentError(
        fmt::format("{}:{}:{}: malformed JSON: {}", source_name, line, column, reason));
  } catch (const Json::exception& e) {
    // E.g. out_of_range for a number too large for a double (found by fuzz/config_fuzz).
    std::string_view what = e.what();
    size_t bracket = what.find("] ");
    return InvalidArgumentError(fmt::format(
        "{}: malformed JSON: {}", source_name,
        bracket == std::string_view::npos ? what : what.substr(bracket + 2)));
  }
  if (!duplicate.empty()) {
    return InvalidArgumentError(
        fmt::format("{}: {}: duplicate key (each key may appear only once in an object)",
                    source_name, duplicate));
  }
  return root;
}

}  // namespace

Result<BatchSizes> ResolveBatchSizes(const BatchConfig& batch, int world_size) {
  if (world_size < 1) {
    return InvalidArgumentError(fmt::format("world_size must be at least 1, got {}", world_size));
  }
  const int64_t w = world_size;
  std::optional<int64_t> t = batch.train_batch_size;
  std::optional<int64_t> m = batch.train_micro_batch_size_per_gpu;
  std::optional<int64_t> g = batch.gradient_accumulation_steps;
  auto overflow = [] { return InvalidArgumentError("the batch sizes overflow a 64-bit integer"); };
  // Divides train by `divisor`, which is the product of the named factors.
  auto derive = [&](std::string_view factors, std::optional<int64_t> divisor,
                    std::string_view derived) -> Result<int64_t> {
    if (!divisor) return overflow();
    if (*t % *divisor != 0) {
      return InvalidArgumentError(
          fmt::format("train_batch_size {} is not divisible by {} (= {}); cannot derive {}", *t,
                      factors, *divisor, derived));
    }
    return *t / *divisor;
  };

  if (t && m && g) {
    std::optional<int64_t> product = Multiply({*m, *g, w});
    if (!product || *product != *t) {
      return InvalidArgumentError(fmt::format(
          "train_batch_size {} != train_micro_batch_size_per_gpu {} * gradient_accumulation_steps "
          "{} * world_size {}{}",
          *t, *m, *g, w, product ? fmt::format(" (= {})", *product) : std::string()));
    }
  } else if (t && m) {
    STRATA_ASSIGN_OR_RETURN(
        g, derive(fmt::format("train_micro_batch_size_per_gpu {} * world_size {}", *m, w),
                  Multiply({*m, w}), "gradient_accumulation_steps"));
  } else if (t && g) {
    STRATA_ASSIGN_OR_RETURN(
        m, derive(fmt::format("gradient_accumulation_steps {} * world_size {}", *g, w),
                  Multiply({*g, w}), "train_micro_batch_size_per_gpu"));
  } else if (m && g) {
    t = Multiply({*m, *g, w});
    if (!t) return overflow();
  } else if (t) {
    g = 1;
    if (*t % w != 0) {
      return InvalidArgumentError(
          fmt::format("train_batch_size {} is not divisible by world_size {}; cannot derive "
                      "train_micro_batch_size_per_gpu",
                      *t, w));
    }
    m = *t / w;
  } else if (m) {
    g = 1;
    t = Multiply({*m, w});
    if (!t) return overflow();
  } else {
    return InvalidArgumentError(
        "the batch size is undetermined: set train_batch_size or train_micro_batch_size_per_gpu "
        "(gradient_accumulation_steps alone is not enough)");
  }
  BatchSizes out;
  out.train_batch_size = *t;
  out.train_micro_batch_size_per_gpu = *m;
  out.gradient_accumulation_steps = *g;
  out.world_size = world_size;
  return out;
}

Result<Config> ParseConfig(std::string_view json_text, std::string_view source_name) {
  STRATA_ASSIGN_OR_RETURN(Json root, ParseJson(json_text, source_name));
  Config config;
  config.source_name = std::string(source_name);
  ParseState state;
  Status status = ConfigParser(&config, &state).Parse(root);
  if (!status.ok()) return source_name.empty() ? status : status.WithContext(source_name);

  config.diagnostics.ignored_keys = std::move(state.ignored_keys);
  config.diagnostics.auto_keys = std::move(state.auto_keys);
  config.diagnostics.deprecated_keys = std::move(state.deprecated_keys);
  if (!config.diagnostics.ignored_keys.empty()) {
    STRATA_LOG(warn, config, "{}", config.diagnostics.IgnoredKeysMessage(source_name));
  }
  for (const std::string& warning : config.diagnostics.warnings) {
    STRATA_LOG(warn, config, "{}: {}", source_name, warning);
  }
  if (!config.diagnostics.deprecated_keys.empty()) {
    STRATA_LOG(warn, config, "{}: deprecated DeepSpeed spellings accepted: {}", source_name,
               fmt::join(config.diagnostics.deprecated_keys, ", "));
  }
  return config;
}

Result<Config> LoadConfigFile(const std::string& path, FileSystem& fs) {
  Result<std::string> text = ReadFileToString(fs, path);
  if (!text.ok()) return text.status().WithContext("config file");
  return ParseConfig(*text, path);
}

}  // namespace strata
