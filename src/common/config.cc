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

#include "common/config_schema.h"
#include "common/errno.h"
#include "common/log.h"

namespace strata {

using config_internal::EnumName;
using config_internal::Field;
using config_internal::FieldError;
using config_internal::Ignored;
using config_internal::JoinPath;
using config_internal::Json;
using config_internal::KeySpec;
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

namespace {

// strata.io.nvme_paths when not given: the nvme_path of each section set to "nvme" (param
// first, deduplicated).
std::vector<std::string> DefaultNvmePaths(const ZeroConfig& z) {
  std::vector<std::string> paths;
  auto add = [&](OffloadDevice device, const std::string& path) {
    if (device != OffloadDevice::kNvme || path.empty()) return;
    if (std::find(paths.begin(), paths.end(), path) == paths.end()) paths.push_back(path);
  };
  add(z.offload_param.device, z.offload_param.nvme_path);
  add(z.offload_optimizer.device, z.offload_optimizer.nvme_path);
  return paths;
}

}  // namespace

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

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int kIntMax = std::numeric_limits<int>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr uint64_t kIoAlignment = 4096;

constexpr std::string_view kPositiveInteger = "a positive integer";
constexpr std::string_view kNonNegativeInteger = "a non-negative integer";
constexpr std::string_view kNonNegativeNumber = "a non-negative number";
constexpr std::string_view kAlignedBytes =
    "a positive byte size that is a multiple of 4096 (a number of bytes or a string such as "
    "\"1MiB\")";

// The product of positive values, or nullopt on overflow.
std::optional<int64_t> Multiply(std::initializer_list<int64_t> values) {
  int64_t product = 1;
  for (int64_t v : values) {
    if (__builtin_mul_overflow(product, v, &product)) return std::nullopt;
  }
  return product;
}

template <typename T, typename Read>
Status ReadOptional(const Field& field, std::optional<T>* out, Read read) {
  if (TakeAuto(field)) return Status::Ok();
  T value{};
  STRATA_RETURN_IF_ERROR(read(&value));
  *out = value;
  return Status::Ok();
}

// DeepSpeed's integer byte counts (aio.block_size) must also suit O_DIRECT.
Status ReadAlignedInt(const Field& field, uint64_t* out) {
  int64_t v = static_cast<int64_t>(*out);
  STRATA_RETURN_IF_ERROR(ReadInt64(field, 1, kInt64Max, "a positive multiple of 4096", &v));
  if (static_cast<uint64_t>(v) % kIoAlignment != 0) {
    return ValueError(field, "a positive multiple of 4096");
  }
  *out = static_cast<uint64_t>(v);
  return Status::Ok();
}

// "auto" | "on" | "off" | true | false.
Status ReadToggle(const Field& field, Toggle* out) {
  if (TakeAuto(field)) {
    *out = Toggle::kAuto;
    return Status::Ok();
  }
  bool b = false;
  if (ReadBool(field, &b).ok()) {
    *out = b ? Toggle::kOn : Toggle::kOff;
    return Status::Ok();
  }
  std::optional<size_t> index = config_internal::MatchName(field.value, {"on", "off"});
  if (!index) return ValueError(field, "\"auto\", \"on\", \"off\", true or false");
  *out = *index == 0 ? Toggle::kOn : Toggle::kOff;
  return Status::Ok();
}

// Values that can only be settled once every section has been read.
struct Pending {
  std::optional<bool> overlap_comm;
  bool offload_param_given = false;
  bool offload_optimizer_given = false;
  std::optional<bool> cpu_offload;
  std::optional<bool> cpu_offload_param;
  std::optional<bool> adam_w_mode;
  std::optional<double> warmup_max_lr;
  bool total_num_steps_given = false;
  std::string bf16_key = "bf16";
  std::optional<int> io_threads;
  std::optional<int> io_queue_depth;
  std::optional<uint64_t> io_block_size;
  std::optional<std::vector<std::string>> nvme_paths;
};

class ConfigParser {
 public:
  ConfigParser(Config* config, ParseState* state) : config_(*config), state_(*state) {}

  Status Parse(const Json& root) {
    if (!root.is_object()) {
      return InvalidArgumentError(fmt::format("the top level must be a JSON object, got {}",
                                              config_internal::Describe(root)));
    }
    STRATA_RETURN_IF_ERROR(WalkObject(Field{root, "", &state_}, RootSpecs()));
    // Every bad key and value as one error (the cross-key checks of Finish would only repeat
    // them). Per object, unknown keys come first, then bad values, each in document order.
    if (state_.errors.size() == 1) return state_.errors.front();
    if (!state_.errors.empty()) {
      std::string all;
      for (size_t i = 0; i < state_.errors.size(); ++i) {
        all += fmt::format("{}({}) {}", i == 0 ? "" : "; ", i + 1, state_.errors[i].message());
      }
      return InvalidArgumentError(
          fmt::format("{} errors: {}", state_.errors.size(), all));
    }
    return Finish();
  }

 private:
  // ---- top level ----

  std::vector<KeySpec> RootSpecs() {
    std::vector<KeySpec> specs = {
        {.name = "train_batch_size",
         .parse = [this](const Field& f) { return ReadBatch(f, &config_.batch.train_batch_size); }},
        {.name = "train_micro_batch_size_per_gpu",
         .parse =
             [this](const Field& f) {
               return ReadBatch(f, &config_.batch.train_micro_batch_size_per_gpu);
             }},
        {.name = "gradient_accumulation_steps",
         .parse =
             [this](const Field& f) {
               return ReadBatch(f, &config_.batch.gradient_accumulation_steps);
             }},
        {.name = "gradient_clipping",
         .parse =
             [this](const Field& f) {
               return ReadDouble(f, 0.0, kInf, kNonNegativeNumber, &config_.gradient_clipping);
             }},
        {.name = "steps_per_print",
         .parse =
             [this](const Field& f) {
               return ReadInt64(f, 1, kInt64Max, kPositiveInteger, &config_.steps_per_print);
             }},
        {.name = "optimizer", .parse = [this](const Field& f) { return ParseOptimizer(f); }},
        {.name = "scheduler", .parse = [this](const Field& f) { return ParseScheduler(f); }},
        {.name = "fp16", .parse = [this](const Field& f) { return ParseFp16(f); }},
        // DeepSpeed reads "bf16" and still accepts its older name "bfloat16".
        {.name = "bf16",
         .parse = [this](const Field& f) { return ParseBf16(f); },
         .aliases = {"bfloat16"}},
        {.name = "zero_optimization", .parse = [this](const Field& f) { return ParseZero(f); }},
        {.name = "aio", .parse = [this](const Field& f) { return ParseAio(f); }},
        {.name = "checkpoint", .parse = [this](const Field& f) { return ParseCheckpoint(f); }},
        {.name = "strata", .parse = [this](const Field& f) { return ParseStrata(f); }},
        {.name = "activation_checkpointing",
         .parse = [this](const Field& f) { return ParseActivationCheckpointing(f); }},
        {.name = "tensorboard",
         .parse = [this](const Field& f) { return ParseMonitor(f, &config_.tensorboard); }},
        {.name = "csv_monitor",
         .parse = [this](const Field& f) { return ParseMonitor(f, &config_.csv_monitor); }},
    };
    // DeepSpeed features Strata does not implement. Each is accepted and named in one warning.
    for (std::string_view name : {
             "wall_clock_breakdown",
             "memory_breakdown",
             "wandb",
             "comet",
             "comms_logger",
             "flops_profiler",
             "sparse_attention",
             "pipeline",
             "data_efficiency",
             "curriculum_learning",
             "compression_training",
             "quantize_training",
             "weight_quantization",
             "autotuning",
             "elasticity",
             "communication_data_type",
             "seq_parallel_comm_data_type",
             "seq_parallel_communication_data_type",
             "prescale_gradients",
             "gradient_predivide_factor",
             "gradient_allreduce_op",
             "sparse_gradients",
             "fp32_allreduce",
             "amp",
             "torch_autocast",
             "zero_allow_untested_optimizer",
             "zero_force_ds_cpu_optimizer",
             "dump_state",
             "disable_allgather",
             "dataloader_drop_last",
             "hybrid_engine",
             "compile",
             "nebula",
             "datastates",
             "data_types",
             "eigenvalue",
             "progressive_layer_drop",
             "timers",
             "tensor_parallel",
             "expert_parallel",
             "sequence_parallel_size",
             "graph_harvesting",
             "use_node_local_storage",
             "use_data_before_expert_parallelism",
             "managed_gradient_accumulation",
             "vocabulary_size",
             "log_level",
         }) {
      specs.push_back(Ignored(name));
    }
    return specs;
  }

  Status ReadBatch(const Field& f, std::optional<int64_t>* out) {
    return ReadOptional(
        f, out, [&](int64_t* v) { return ReadInt64(f, 1, kInt64Max, kPositiveInteger, v); });
  }

  // ---- optimizer ----

  // The value of `key` in `f`, or null when `f` is not an object or the key is absent or null.
  static const Json* Member(const Field& f, const std::string& key) {
    if (!f.value.is_object()) return nullptr;
    auto it = f.value.find(key);
    return it == f.value.end() || it->is_null() ? nullptr : &*it;
  }

  static Status AlreadyParsed(const Field&) { return Status::Ok(); }

  Status ParseOptimizer(const Field& f) {
    config_.optimizer.specified = true;
    // "params" depends on "type", which may come after it in the file: read "type" first.
    const Json* type_value = Member(f, "type");
    if (type_value != nullptr) {
      STRATA_RETURN_IF_ERROR(
          ParseOptimizerType(Field{*type_value, JoinPath(f.path, "type"), &state_}));
    }
    std::vector<KeySpec> specs = {
        {.name = "type", .parse = AlreadyParsed},
        {.name = "params", .parse = [this](const Field& v) { return ParseAdamParams(v); }},
        Ignored("legacy_fusion"),
    };
    STRATA_RETURN_IF_ERROR(WalkObject(f, specs));
    if (type_value == nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: missing; expected \"Adam\" or \"AdamW\"", JoinPath(f.path, "type")));
    }
    return Status::Ok();
  }

  Status ParseOptimizerType(const Field& f) {
    static constexpr std::string_view kSupported =
        "supported optimizers are \"Adam\" and \"AdamW\"";
    if (!f.value.is_string()) return ValueError(f, "an optimizer name such as \"AdamW\"");
    std::optional<size_t> index = config_internal::MatchName(f.value, {"Adam", "AdamW"});
    if (!index) {
      // Lamb, OneBitAdam, Lion, Adagrad, a torch.optim class, ...: training with another
      // optimizer than the one asked for would be silently wrong.
      return FieldError(f, StatusCode::kUnimplemented,
                        fmt::format("{} is not implemented by Strata; {}",
                                    config_internal::Describe(f.value), kSupported));
    }
    config_.optimizer.type = *index == 0 ? OptimizerType::kAdam : OptimizerType::kAdamW;
    return Status::Ok();
  }

  Status ParseAdamParams(const Field& f) {
    OptimizerConfig& o = config_.optimizer;
    std::vector<KeySpec> specs = {
        {.name = "lr",
         .parse =
             [&](const Field& v) { return ReadDouble(v, 0, kInf, kNonNegativeNumber, &o.lr); }},
        {.name = "betas", .parse = [&](const Field& v) { return ReadBetas(v); }},
        {.name = "eps",
         .parse =
             [&](const Field& v) { return ReadDouble(v, 0, kInf, kNonNegativeNumber, &o.eps); }},
        {.name = "weight_decay",
         .parse =
             [&](const Field& v) {
               return ReadDouble(v, 0, kInf, kNonNegativeNumber, &o.weight_decay);
             }},
        {.name = "bias_correction",
         .parse = [&](const Field& v) { return ReadBool(v, &o.bias_correction); }},
        {.name = "adam_w_mode",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.adam_w_mode,
                                   [&](bool* b) { return ReadBool(v, b); });
             }},
        {.name = "torch_adam", .parse = [&](const Field& v) { return ReadBool(v, &o.torch_adam); }},
        {.name = "amsgrad",
         .parse =
             [&](const Field& v) {
               bool amsgrad = false;
               STRATA_RETURN_IF_ERROR(ReadBool(v, &amsgrad));
               if (amsgrad) {
                 return FieldError(v, StatusCode::kUnimplemented,
                                   "AMSGrad is not implemented by Strata (DeepSpeed's fused and "
                                   "CPU Adam reject it as well); set it to false");
               }
               return Status::Ok();
             }},
        {.name = "fp32_optimizer_states",
         .parse =
             [&](const Field& v) {
               bool fp32 = true;
               STRATA_RETURN_IF_ERROR(ReadBool(v, &fp32));
               if (!fp32) {
                 return FieldError(v, StatusCode::kUnimplemented,
                                   "Strata keeps optimizer states in fp32; 16-bit optimizer "
                                   "states are not implemented");
               }
               return Status::Ok();
             }},
        {.name = "max_grad_norm",
         .parse =
             [](const Field& v) {
               return FieldError(v, StatusCode::kInvalidArgument,
                                 "not an optimizer parameter (DeepSpeed rejects it too); use the "
                                 "top-level \"gradient_clipping\"");
             }},
        Ignored("set_grad_none"),
        Ignored("foreach"),
        Ignored("fused"),
        Ignored("capturable"),
    };
    return WalkObject(f, specs);
  }

  Status ReadBetas(const Field& f) {
    static constexpr std::string_view kExpected =
        "a list of two numbers in [0, 1), such as [0.9, 0.999]";
    if (TakeAuto(f)) return Status::Ok();
    if (!f.value.is_array() || f.value.size() != 2) return ValueError(f, kExpected);
    double betas[2];
    for (size_t i = 0; i < 2; ++i) {
      const Json& b = f.value[i];
      if (!b.is_number()) return ValueError(f, kExpected);
      betas[i] = b.get<double>();
      if (!(betas[i] >= 0.0 && betas[i] < 1.0)) return ValueError(f, kExpected);
    }
    config_.optimizer.beta1 = betas[0];
    config_.optimizer.beta2 = betas[1];
    return Status::Ok();
  }

  // ---- scheduler ----

  Status ParseScheduler(const Field& f) {
    const Json* type_value = Member(f, "type");  // read first: "params" depends on it
    if (type_value != nullptr) {
      STRATA_RETURN_IF_ERROR(
          ParseSchedulerType(Field{*type_value, JoinPath(f.path, "type"), &state_}));
    }
    std::vector<KeySpec> specs = {
        {.name = "type", .parse = AlreadyParsed},
        {.name = "params", .parse = [this](const Field& v) { return ParseSchedulerParams(v); }},
    };
    STRATA_RETURN_IF_ERROR(WalkObject(f, specs));
    if (type_value == nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: missing; expected \"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\"",
                      JoinPath(f.path, "type")));
    }
    SchedulerType type = config_.scheduler.type;
    if ((type == SchedulerType::kWarmupDecayLR || type == SchedulerType::kWarmupCosineLR) &&
        !pending_.total_num_steps_given) {
      return InvalidArgumentError(fmt::format(
          "{}: required by {} (a number of optimizer steps, or \"auto\" to take the run length)",
          JoinPath(JoinPath(f.path, "params"), "total_num_steps"), SchedulerTypeName(type)));
    }
    return Status::Ok();
  }

  Status ParseSchedulerType(const Field& f) {
    if (!f.value.is_string()) return ValueError(f, "a scheduler name such as \"WarmupLR\"");
    std::optional<size_t> index =
        config_internal::MatchName(f.value, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"});
    if (!index) {
      // OneCycle, LRRangeTest or a torch scheduler: running with a different learning-rate
      // schedule than the one asked for would be silently wrong.
      return FieldError(
          f, StatusCode::kUnimplemented,
          fmt::format("{} is not implemented by Strata; supported schedulers are \"WarmupLR\", "
                      "\"WarmupDecayLR\" and \"WarmupCosineLR\"",
                      config_internal::Describe(f.value)));
    }
    static constexpr SchedulerType kTypes[] = {
        SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR, SchedulerType::kWarmupCosineLR};
    config_.scheduler.type = kTypes[*index];
    return Status::Ok();
  }

  Status ParseSchedulerParams(const Field& f) {
    SchedulerConfig& s = config_.scheduler;
    if (s.type == SchedulerType::kConstant) return Status::Ok();  // "type" missing: reported after
    KeySpec warmup_min_lr{.name = "warmup_min_lr", .parse = [&](const Field& v) {
                            return ReadDouble(v, 0, kInf, kNonNegativeNumber, &s.warmup_min_lr);
                          }};
    KeySpec warmup_max_lr{.name = "warmup_max_lr", .parse = [&](const Field& v) {
                            return ReadOptional(v, &pending_.warmup_max_lr, [&](double* d) {
                              return ReadDouble(v, 0, kInf, kNonNegativeNumber, d);
                            });
                          }};
    KeySpec warmup_num_steps{.name = "warmup_num_steps", .parse = [&](const Field& v) {
                               return ReadInt64(v, 1, kInt64Max, kPositiveInteger,
                                                &s.warmup_num_steps);
                             }};
    KeySpec warmup_type{.name = "warmup_type", .parse = [&](const Field& v) {
                          return ReadEnum<WarmupType>(
                              v, {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}},
                              &s.warmup_type);
                        }};
    KeySpec total_num_steps{.name = "total_num_steps", .parse = [&](const Field& v) {
                              pending_.total_num_steps_given = true;
                              return ReadOptional(v, &s.total_num_steps, [&](int64_t* n) {
                                return ReadInt64(v, 1, kInt64Max, kPositiveInteger, n);
                              });
                            }};
    KeySpec last_batch_iteration{.name = "last_batch_iteration", .parse = [&](const Field& v) {
                                   return ReadInt64(v, -1, kInt64Max, "an integer >= -1",
                                                    &s.last_batch_iteration);
                                 }};
    KeySpec warmup_min_ratio{.name = "warmup_min_ratio", .parse = [&](const Field& v) {
                               return ReadDouble(v, 0, 1, "a number in [0, 1]",
                                                 &s.warmup_min_ratio);
                             }};
    KeySpec cos_min_ratio{.name = "cos_min_ratio", .parse = [&](const Field& v) {
                            return ReadDouble(v, 0, 1, "a number in [0, 1]", &s.cos_min_ratio);
                          }};
    // Each class takes exactly its constructor's arguments, as in DeepSpeed (which passes the
    // params as keyword arguments, so any other key fails there too).
    std::vector<KeySpec> specs;
    switch (s.type) {
      case SchedulerType::kWarmupLR:
        specs = {warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration};
        break;
      case SchedulerType::kWarmupDecayLR:
        specs = {total_num_steps,  warmup_min_lr, warmup_max_lr,
                 warmup_num_steps, warmup_type,   last_batch_iteration};
        break;
      case SchedulerType::kWarmupCosineLR:
        specs = {total_num_steps, warmup_min_ratio, warmup_num_steps,
                 cos_min_ratio,   warmup_type,      last_batch_iteration};
        break;
      case SchedulerType::kConstant:
        break;
    }
    return WalkObject(f, specs);
  }

  // ---- precision ----

  Status ParseFp16(const Field& f) {
    Fp16Config& p = config_.fp16;
    std::vector<KeySpec> specs = {
        {.name = "enabled", .parse = [&](const Field& v) { return ReadBool(v, &p.enabled); }},
        {.name = "auto_cast", .parse = [&](const Field& v) { return ReadBool(v, &p.auto_cast); }},
        {.name = "loss_scale",
         .parse =
             [&](const Field& v) {
               return ReadDouble(v, 0, kInf, "a non-negative number (0 = dynamic)", &p.loss_scale);
             }},
        {.name = "initial_scale_power",
         .parse =
             [&](const Field& v) {
               return ReadInt(v, 0, 64, "an integer from 0 to 64", &p.initial_scale_power);
             }},
        {.name = "loss_scale_window",
         .parse =
             [&](const Field& v) {
               return ReadInt(v, 1, kIntMax, kPositiveInteger, &p.loss_scale_window);
             }},
        {.name = "hysteresis",
         .parse =
             [&](const Field& v) {
               return ReadInt(v, 1, kIntMax, kPositiveInteger, &p.hysteresis);
             }},
        {.name = "consecutive_hysteresis",
         .parse = [&](const Field& v) { return ReadBool(v, &p.consecutive_hysteresis); }},
        {.name = "min_loss_scale",
         .parse =
             [&](const Field& v) {
               return ReadDouble(v, std::numeric_limits<double>::min(), kInf, "a positive number",
                                 &p.min_loss_scale);
             }},
        Ignored("fp16_master_weights_and_grads"),
        Ignored("fused_mode"),
    };
    return WalkObject(f, specs);
  }

  Status ParseBf16(const Field& f) {
    pending_.bf16_key = f.path;
    std::vector<KeySpec> specs = {
        {.name = "enabled",
         .parse = [this](const Field& v) { return ReadBool(v, &config_.bf16.enabled); }},
        Ignored("immediate_grad_update"),
        Ignored("check_grad_overflow"),
        Ignored("bf16_master_weights_and_grads"),
        Ignored("bf16_optimizer_states"),
    };
    return WalkObject(f, specs);
  }

  // ---- zero_optimization ----

  Status ParseZero(const Field& f) {
    ZeroConfig& z = config_.zero;
    if (f.value.is_boolean()) {
      // DeepSpeed's oldest form: "zero_optimization": true means stage 1.
      z.stage = f.value.get<bool>() ? 1 : 0;
      state_.deprecated_keys.push_back(
          fmt::format("{} (a boolean; now {{\"stage\": {}}})", f.path, z.stage));
      return Status::Ok();
    }
    auto count = [](int64_t* out) {
      return [out](const Field& v) { return ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, out); };
    };
    auto flag = [](bool* out) { return [out](const Field& v) { return ReadBool(v, out); }; };
    std::vector<KeySpec> specs = {
        {.name = "stage",
         .parse =
             [&](const Field& v) { return ReadInt(v, 0, 3, "an integer 0, 1, 2 or 3", &z.stage); }},
        {.name = "contiguous_gradients", .parse = flag(&z.contiguous_gradients)},
        {.name = "reduce_scatter", .parse = flag(&z.reduce_scatter)},
        {.name = "reduce_bucket_size", .parse = count(&z.reduce_bucket_size)},
        {.name = "allgather_partitions", .parse = flag(&z.allgather_partitions)},
        {.name = "allgather_bucket_size", .parse = count(&z.allgather_bucket_size)},
        {.name = "overlap_comm",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.overlap_comm,
                                   [&](bool* b) { return ReadBool(v, b); });
             }},
        {.name = "load_from_fp32_weights", .parse = flag(&z.load_from_fp32_weights)},
        {.name = "elastic_checkpoint", .parse = flag(&z.elastic_checkpoint)},
        {.name = "sub_group_size", .parse = count(&z.sub_group_size)},
        {.name = "offload_param",
         .parse =
             [&](const Field& v) {
               pending_.offload_param_given = true;
               return ParseOffloadParam(v);
             }},
        {.name = "offload_optimizer",
         .parse =
             [&](const Field& v) {
               pending_.offload_optimizer_given = true;
               return ParseOffloadOptimizer(v);
             }},
        {.name = "cpu_offload",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.cpu_offload,
                                   [&](bool* b) { return ReadBool(v, b); });
             },
         .deprecated_by = "offload_optimizer"},
        {.name = "cpu_offload_param",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.cpu_offload_param,
                                   [&](bool* b) { return ReadBool(v, b); });
             },
         .deprecated_by = "offload_param"},
        // DeepSpeed names these fields without the prefix and accepts both spellings.
        {.name = "stage3_prefetch_bucket_size",
         .parse = count(&z.stage3_prefetch_bucket_size),
         .aliases = {"prefetch_bucket_size"}},
        {.name = "stage3_param_persistence_threshold",
         .parse = count(&z.stage3_param_persistence_threshold),
         .aliases = {"param_persistence_threshold"}},
        {.name = "stage3_model_persistence_threshold",
         .parse = count(&z.stage3_model_persistence_threshold),
         .aliases = {"model_persistence_threshold"}},
        {.name = "stage3_max_live_parameters",
         .parse = count(&z.stage3_max_live_parameters),
         .aliases = {"max_live_parameters"}},
        {.name = "stage3_max_reuse_distance",
         .parse = count(&z.stage3_max_reuse_distance),
         .aliases = {"max_reuse_distance"}},
        {.name = "stage3_gather_16bit_weights_on_model_save",
         .parse = flag(&z.stage3_gather_16bit_weights_on_model_save),
         .aliases = {"gather_16bit_weights_on_model_save"},
         .deprecated_aliases = {"stage3_gather_fp16_weights_on_model_save"}},
        {.name = "ignore_unused_parameters", .parse = flag(&z.ignore_unused_parameters)},
        {.name = "round_robin_gradients", .parse = flag(&z.round_robin_gradients)},
        // Accepted, no effect in Strata: ZeRO++ (hpZ, quantized weights/gradients), MiCS,
        // module-granularity fetching, PyTorch-module hooks and debugging aids.
        Ignored("cpu_offload_use_pin_memory"),
        Ignored("use_multi_rank_bucket_allreduce"),
        Ignored("compute_grad_norm"),
        Ignored("parameter_alignment"),
        Ignored("stage3_module_granularity_threshold", {"module_granularity_threshold"}),
        Ignored("stage3_use_all_reduce_for_fetch_params", {"use_all_reduce_for_fetch_params"}),
        Ignored("stage3_allgather_sequential", {"allgather_sequential"}),
        Ignored("stage3_partition_stream_chunk_size", {"partition_stream_chunk_size"}),
        Ignored("legacy_stage1"),
        Ignored("zero_hpz_partition_size"),
        Ignored("zero_quantized_weights"),
        Ignored("zero_quantized_nontrainable_weights"),
        Ignored("zero_quantized_gradients"),
        Ignored("zeropp_loco_param"),
        Ignored("mics_shard_size"),
        Ignored("mics_hierarchical_params_gather"),
        Ignored("memory_efficient_linear"),
        Ignored("pipeline_loading_checkpoint"),
        Ignored("override_module_apply"),
        Ignored("log_trace_cache_warnings"),
        Ignored("enable_sanity_checks"),
        Ignored("save_muon_momentum_buffer_in_memory"),
        Ignored("leaf_module"),
        Ignored("zenflow"),
    };
    return WalkObject(f, specs);
  }

  static Status ReadOffloadDevice(const Field& f, OffloadDevice* out) {
    // "auto" is a home here (the planner's choice), not "the default" as for other enums.
    auto is_auto = [](const std::string& v) {
      return v.size() == 4 && std::equal(v.begin(), v.end(), "auto", [](char a, char b) {
               return std::tolower(static_cast<unsigned char>(a)) == b;
             });
    };
    if (f.value.is_string() && is_auto(f.value.get_ref<const std::string&>())) {
      *out = OffloadDevice::kAuto;
      return Status::Ok();
    }
    return ReadEnum<OffloadDevice>(f,
                                   {{"none", OffloadDevice::kNone},
                                    {"cpu", OffloadDevice::kCpu},
                                    {"nvme", OffloadDevice::kNvme},
                                    {"auto", OffloadDevice::kAuto}},
                                   out);
  }

  Status ParseOffloadParam(const Field& f) {
    OffloadParamConfig& o = config_.zero.offload_param;
    std::vector<KeySpec> specs = {
        {.name = "device",
         .parse = [&](const Field& v) { return ReadOffloadDevice(v, &o.device); }},
        {.name = "nvme_path",
         .parse = [&](const Field& v) { return ReadString(v, "a directory path", &o.nvme_path); }},
        {.name = "buffer_count",
         .parse =
             [&](const Field& v) {
               return ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, &o.buffer_count);
             }},
        {.name = "buffer_size",
         .parse =
             [&](const Field& v) {
               return ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, &o.buffer_size);
             }},
        {.name = "max_in_cpu",
         .parse =
             [&](const Field& v) {
               return ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, &o.max_in_cpu);
             }},
        {.name = "pin_memory", .parse = [&](const Field& v) { return ReadBool(v, &o.pin_memory); }},
    };
    return WalkObject(f, specs);
  }

  Status ParseOffloadOptimizer(const Field& f) {
    OffloadOptimizerConfig& o = config_.zero.offload_optimizer;
    std::vector<KeySpec> specs = {
        {.name = "device",
         .parse = [&](const Field& v) { return ReadOffloadDevice(v, &o.device); }},
        {.name = "nvme_path",
         .parse = [&](const Field& v) { return ReadString(v, "a directory path", &o.nvme_path); }},
        {.name = "buffer_count",
         .parse =
             [&](const Field& v) {
               return ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, &o.buffer_count);
             }},
        {.name = "pin_memory", .parse = [&](const Field& v) { return ReadBool(v, &o.pin_memory); }},
        {.name = "pipeline_read",
         .parse = [&](const Field& v) { return ReadBool(v, &o.pipeline_read); }},
        {.name = "pipeline_write",
         .parse = [&](const Field& v) { return ReadBool(v, &o.pipeline_write); }},
        {.name = "fast_init", .parse = [&](const Field& v) { return ReadBool(v, &o.fast_init); }},
        {.name = "ratio",
         .parse =
             [&](const Field& v) {
               constexpr std::string_view kFraction =
                   "a fraction in (0, 1]: the share of the optimizer states to offload (for "
                   "none, \"device\": \"none\")";
               STRATA_RETURN_IF_ERROR(ReadDouble(v, 0.0, 1.0, kFraction, &o.ratio));
               return o.ratio > 0.0 ? Status::Ok() : ValueError(v, kFraction);
             }},
        // Superchip offload and CPU-Adam core share.
        Ignored("super_offload"),
        Ignored("convert_grad_on_cpu"),
        Ignored("cpuadam_cores_perc"),
    };
    return WalkObject(f, specs);
  }

  // ---- aio ----

  Status ParseAio(const Field& f) {
    AioConfig& a = config_.aio;
    std::vector<KeySpec> specs = {
        {.name = "block_size",
         .parse = [&](const Field& v) { return ReadAlignedInt(v, &a.block_size); }},
        {.name = "queue_depth",
         .parse =
             [&](const Field& v) {
               return ReadInt(v, 1, kIntMax, kPositiveInteger, &a.queue_depth);
             }},
        // Current DeepSpeed spells it intra_op_parallelism; older releases thread_count.
        {.name = "intra_op_parallelism",
         .parse =
             [&](const Field& v) {
               return ReadInt(v, 1, kIntMax, kPositiveInteger, &a.intra_op_parallelism);
             },
         .aliases = {"thread_count", "num_threads"}},
        {.name = "single_submit",
         .parse = [&](const Field& v) { return ReadBool(v, &a.single_submit); }},
        {.name = "overlap_events",
         .parse = [&](const Field& v) { return ReadBool(v, &a.overlap_events); }},
        Ignored("use_gds"),
    };
    return WalkObject(f, specs);
  }

  // ---- checkpoint ----

  Status ParseCheckpoint(const Field& f) {
    CheckpointConfig& c = config_.checkpoint;
    std::vector<KeySpec> specs = {
        {.name = "tag_validation",
         .parse =
             [&](const Field& v) {
               return ReadEnum<TagValidation>(v,
                                              {{"Ignore", TagValidation::kIgnore},
                                               {"Warn", TagValidation::kWarn},
                                               {"Fail", TagValidation::kFail}},
                                              &c.tag_validation);
             }},
        {.name = "load_universal",
         .parse = [&](const Field& v) { return ReadBool(v, &c.load_universal); }},
        {.name = "use_node_local_storage",
         .parse = [&](const Field& v) { return ReadBool(v, &c.use_node_local_storage); }},
        Ignored("parallel_write"),
        Ignored("checkpoint_serialization"),
        Ignored("writer"),
    };
    return WalkObject(f, specs);
  }

  // ---- monitoring ----

  Status ParseMonitor(const Field& f, MonitorConfig* m) {
    std::vector<KeySpec> specs = {
        {.name = "enabled", .parse = [m](const Field& v) { return ReadBool(v, &m->enabled); }},
        {.name = "output_path",
         .parse = [this, m](const Field& v) {
           return ReadString(v, "a directory path", &m->output_path);
         }},
        {.name = "job_name",
         .parse = [this, m](const Field& v) { return ReadString(v, "a name", &m->job_name); }},
    };
    return WalkObject(f, specs);
  }

  // ---- activation_checkpointing (DeepSpeed's) ----

  // cpu_checkpointing true: the checkpointed block inputs in host memory, as
  // strata.offload_checkpoints on (applied in Validate, where an explicit strata value that says
  // otherwise is an error). The model decides what is checkpointed (each decoder block's input),
  // so the other keys have no effect.
  Status ParseActivationCheckpointing(const Field& f) {
    std::vector<KeySpec> specs = {
        {.name = "cpu_checkpointing",
         .parse = [this](const Field& v) { return ReadBool(v, &ds_cpu_checkpointing_); }},
        Ignored("partition_activations"),
        Ignored("contiguous_memory_optimization"),
        Ignored("number_checkpoints"),
        Ignored("synchronize_checkpoint_boundary"),
        Ignored("profile"),
    };
    return WalkObject(f, specs);
  }

  // ---- strata.lora (PEFT's LoraConfig names) ----

  Status ParseLora(const Field& f) {
    LoraSettings& l = config_.strata.lora;
    std::vector<KeySpec> specs = {
        {.name = "r",
         .parse = [&](const Field& v) { return ReadInt(v, 0, 65536, "an integer from 0 to 65536", &l.r); }},
        {.name = "lora_alpha",
         .parse =
             [&](const Field& v) {
               return ReadDouble(v, 0, kInf, kNonNegativeNumber, &l.lora_alpha);
             }},
        {.name = "lora_dropout",
         .parse =
             [&](const Field& v) {
               STRATA_RETURN_IF_ERROR(ReadDouble(v, 0, 1, "a number from 0 to 1", &l.lora_dropout));
               if (l.lora_dropout != 0.0) {
                 return Status(StatusCode::kUnimplemented,
                               fmt::format("{}: {}: LoRA dropout is not implemented; use 0",
                                           v.path, l.lora_dropout));
               }
               return Status::Ok();
             }},
        {.name = "target_modules",
         .parse =
             [&](const Field& v) {
               return ReadStringList(v, "a list of projection names (\"q_proj\", ..., "
                                        "\"down_proj\") or \"all-linear\"",
                                     &l.target_modules);
             }},
        Ignored("bias"),
        Ignored("task_type"),
    };
    return WalkObject(f, specs);
  }

  // ---- strata ----

  Status ParseStrata(const Field& f) {
    StrataSettings& s = config_.strata;
    std::vector<KeySpec> specs = {
        {.name = "io", .parse = [this](const Field& v) { return ParseIo(v); }},
        {.name = "memory", .parse = [this](const Field& v) { return ParseMemory(v); }},
        {.name = "prefetch", .parse = [this](const Field& v) { return ParsePrefetch(v); }},
        {.name = "device",
         .parse =
             [&](const Field& v) {
               return ReadEnum<DeviceKind>(v,
                                           {{"auto", DeviceKind::kAuto},
                                            {"cpu", DeviceKind::kCpu},
                                            {"cuda", DeviceKind::kCuda}},
                                           &s.device);
             }},
        {.name = "tf32", .parse = [&](const Field& v) { return ReadBool(v, &s.tf32); }},
        {.name = "activation_checkpointing",
         .parse = [&](const Field& v) { return ReadToggle(v, &s.activation_checkpointing); }},
        {.name = "split_blocks",
         .parse = [&](const Field& v) { return ReadToggle(v, &s.split_blocks); }},
        {.name = "offload_checkpoints",
         .parse = [&](const Field& v) { return ReadToggle(v, &s.offload_checkpoints); }},
        {.name = "on_nonfinite",
         .parse =
             [&](const Field& v) {
               return ReadEnum<NonFinitePolicy>(
                   v, {{"error", NonFinitePolicy::kError}, {"skip", NonFinitePolicy::kSkip}},
                   &s.on_nonfinite);
             }},
        {.name = "cpu_adam_threads",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &s.cpu_adam_threads, [&](int* n) {
                 return ReadInt(v, 1, 1024, "an integer from 1 to 1024 or \"auto\"", n);
               });
             }},
        {.name = "freeze",
         .parse =
             [&](const Field& v) {
               return ReadStringList(v, "a list of parameter-name patterns", &s.freeze);
             }},
        {.name = "trainable",
         .parse =
             [&](const Field& v) {
               return ReadStringList(v, "a list of parameter-name patterns", &s.trainable);
             }},
        {.name = "lora", .parse = [this](const Field& v) { return ParseLora(v); }},
        {.name = "seed",
         .parse =
             [&](const Field& v) {
               int64_t seed = static_cast<int64_t>(s.seed);
               STRATA_RETURN_IF_ERROR(ReadInt64(v, 0, kInt64Max, kNonNegativeInteger, &seed));
               s.seed = static_cast<uint64_t>(seed);
               return Status::Ok();
             }},
    };
    return WalkObject(f, specs);
  }

  Status ParseIo(const Field& f) {
    IoSettings& io = config_.strata.io;
    auto flag = [](bool* out) { return [out](const Field& v) { return ReadBool(v, out); }; };
    std::vector<KeySpec> specs = {
        {.name = "backend",
         .parse =
             [&](const Field& v) {
               return ReadEnum<IoBackend>(v,
                                          {{"auto", IoBackend::kAuto},
                                           {"uring", IoBackend::kUring},
                                           {"posix", IoBackend::kPosix},
                                           {"io_uring", IoBackend::kUring}},
                                          &io.backend);
             }},
        {.name = "direct", .parse = [&](const Field& v) { return ReadToggle(v, &io.direct); }},
        {.name = "threads",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.io_threads, [&](int* n) {
                 return ReadInt(v, 1, kIntMax, "a positive integer or \"auto\"", n);
               });
             }},
        {.name = "queue_depth",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.io_queue_depth, [&](int* n) {
                 return ReadInt(v, 1, kIntMax, "a positive integer or \"auto\"", n);
               });
             }},
        {.name = "block_size",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.io_block_size, [&](uint64_t* n) {
                 return ReadBytes(v, kIoAlignment, kIoAlignment, kAlignedBytes, n);
               });
             }},
        {.name = "stripe_unit",
         .parse =
             [&](const Field& v) {
               return ReadBytes(v, kIoAlignment, kIoAlignment, kAlignedBytes, &io.stripe_unit);
             }},
        {.name = "nvme_paths",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &pending_.nvme_paths, [&](std::vector<std::string>* paths) {
                 return ReadStringList(v, "a non-empty list of directory paths", paths);
               });
             }},
        {.name = "huge_pages",
         .parse = [&](const Field& v) { return ReadToggle(v, &io.huge_pages); }},
        {.name = "sqpoll", .parse = flag(&io.sqpoll)},
        {.name = "register_buffers", .parse = flag(&io.register_buffers)},
        {.name = "register_files", .parse = flag(&io.register_files)},
        {.name = "durable_writes", .parse = flag(&io.durable_writes)},
        {.name = "checksums", .parse = flag(&io.checksums)},
        {.name = "numa_bind", .parse = flag(&io.numa_bind)},
    };
    return WalkObject(f, specs);
  }

  Status ParseMemory(const Field& f) {
    MemorySettings& m = config_.strata.memory;
    static constexpr std::string_view kBudget =
        "a positive byte size (a number of bytes or a string such as \"64GiB\") or \"auto\"";
    auto budget = [](std::optional<uint64_t>* out) {
      return [out](const Field& v) {
        return ReadOptional(v, out, [&](uint64_t* n) { return ReadBytes(v, 1, 1, kBudget, n); });
      };
    };
    std::vector<KeySpec> specs = {
        {.name = "pinned_pool", .parse = budget(&m.pinned_pool)},
        {.name = "device_budget", .parse = budget(&m.device_budget)},
        {.name = "host_budget", .parse = budget(&m.host_budget)},
        {.name = "share_host_memory",
         .parse = [&m](const Field& v) { return ReadToggle(v, &m.share_host_memory); }},
    };
    return WalkObject(f, specs);
  }

  Status ParsePrefetch(const Field& f) {
    PrefetchSettings& p = config_.strata.prefetch;
    std::vector<KeySpec> specs = {
        {.name = "host_lookahead",
         .parse =
             [&](const Field& v) {
               return ReadOptional(v, &p.host_lookahead, [&](uint64_t* n) {
                 return ReadBytes(v, 0, 1,
                                  "a byte size (a number of bytes or a string such as \"8GiB\") "
                                  "or \"auto\"",
                                  n);
               });
             }},
    };
    return WalkObject(f, specs);
  }

  // ---- rules across sections, and defaults that depend on other keys ----

  Status Finish() {
    ZeroConfig& z = config_.zero;

    // Deprecated booleans: DeepSpeed maps them onto the new sections and refuses both at once.
    std::string optimizer_offload_key = "zero_optimization.offload_optimizer.device";
    std::string param_offload_key = "zero_optimization.offload_param.device";
    if (pending_.cpu_offload.value_or(false)) {
      if (pending_.offload_optimizer_given) {
        return InvalidArgumentError(
            "zero_optimization.cpu_offload: cannot be combined with zero_optimization."
            "offload_optimizer (it is the deprecated form of it); keep only offload_optimizer");
      }
      z.offload_optimizer.device = OffloadDevice::kCpu;
      optimizer_offload_key = "zero_optimization.cpu_offload";
    }
    if (pending_.cpu_offload_param.value_or(false)) {
      if (pending_.offload_param_given) {
        return InvalidArgumentError(
            "zero_optimization.cpu_offload_param: cannot be combined with zero_optimization."
            "offload_param (it is the deprecated form of it); keep only offload_param");
      }
      z.offload_param.device = OffloadDevice::kCpu;
      param_offload_key = "zero_optimization.cpu_offload_param";
    }

    // Offload and stage. DeepSpeed documents offload_param as stage-3 only and ignores it below;
    // many real configs (e.g. generated for several stages) carry it at stage 1 or 2, so Strata
    // accepts it there too, says that it has no effect, and keeps the parameters on the device.
    // "auto" where only one home is possible is that home (parameters below stage 3, the
    // optimizer at stage 0 stay on the device): nothing for the planner to choose.
    if (z.offload_param.device == OffloadDevice::kAuto && z.stage != 3) {
      z.offload_param.device = OffloadDevice::kNone;
    }
    if (z.offload_optimizer.device == OffloadDevice::kAuto && z.stage == 0) {
      z.offload_optimizer.device = OffloadDevice::kNone;
    }
    if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
      config_.diagnostics.warnings.push_back(fmt::format(
          "{}: parameter offload to {} needs zero_optimization.stage 3 and has no effect at stage "
          "{} (DeepSpeed ignores it too); parameters stay on the device",
          param_offload_key, OffloadDeviceName(z.offload_param.device), z.stage));
      z.offload_param.device = OffloadDevice::kNone;
    }
    if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
      return InvalidArgumentError(fmt::format(
          "{}: optimizer offload to {} requires zero_optimization.stage 1, 2 or 3, got stage 0",
          optimizer_offload_key, OffloadDeviceName(z.offload_optimizer.device)));
    }

    // NVMe needs somewhere to put the files.
    const bool explicit_paths = pending_.nvme_paths.has_value();
    if (z.offload_param.device == OffloadDevice::kNvme && z.offload_param.nvme_path.empty() &&
        !explicit_paths) {
      return InvalidArgumentError(
          "zero_optimization.offload_param.nvme_path: required when offload_param.device is "
          "\"nvme\" (or list the directories in strata.io.nvme_paths)");
    }
    if (z.offload_optimizer.device == OffloadDevice::kNvme &&
        z.offload_optimizer.nvme_path.empty() && !explicit_paths) {
      return InvalidArgumentError(
          "zero_optimization.offload_optimizer.nvme_path: required when offload_optimizer.device "
          "is \"nvme\" (or list the directories in strata.io.nvme_paths)");
    }

    z.overlap_comm = pending_.overlap_comm.value_or(z.stage == 3);

    if (config_.fp16.enabled && config_.bf16.enabled) {
      return InvalidArgumentError(
          fmt::format("fp16.enabled and {}.enabled are both true; enable at most one of them",
                      pending_.bf16_key));
    }

    // Adam: DeepSpeed's "Adam" means decoupled weight decay unless adam_w_mode is false;
    // "AdamW" is decoupled whatever adam_w_mode says.
    OptimizerConfig& o = config_.optimizer;
    o.decoupled_weight_decay =
        o.type == OptimizerType::kAdamW || pending_.adam_w_mode.value_or(true);

    SchedulerConfig& s = config_.scheduler;
    if (pending_.warmup_max_lr) {
      s.warmup_max_lr = *pending_.warmup_max_lr;
    } else if (s.type == SchedulerType::kWarmupLR) {
      s.warmup_max_lr = o.lr;
    }

    STRATA_RETURN_IF_ERROR(CheckBatchTriple(config_.batch));

    if (!config_.strata.freeze.empty() && !config_.strata.trainable.empty()) {
      return InvalidArgumentError(
          "strata.freeze and strata.trainable are both given; give one of them (freeze: the "
          "parameters that match are frozen; trainable: only those that match train)");
    }
    if (config_.strata.lora.enabled() && !config_.strata.freeze.empty()) {
      return InvalidArgumentError(
          "strata.lora and strata.freeze are both given: LoRA freezes every base weight already; "
          "to train some base weights with the adapters, list them in strata.trainable");
    }

    if (ds_cpu_checkpointing_) {
      if (config_.strata.offload_checkpoints == Toggle::kOff) {
        return InvalidArgumentError(
            "activation_checkpointing.cpu_checkpointing is true and strata.offload_checkpoints "
            "is off: give one of the two");
      }
      config_.strata.offload_checkpoints = Toggle::kOn;
    }
    if (config_.strata.offload_checkpoints == Toggle::kOn &&
        config_.strata.activation_checkpointing == Toggle::kOff) {
      return InvalidArgumentError(
          "strata.offload_checkpoints is on and strata.activation_checkpointing is off: only "
          "checkpointed block inputs can be offloaded; turn checkpointing on (or \"auto\") or "
          "drop strata.offload_checkpoints");
    }

    if (config_.strata.split_blocks == Toggle::kOn && config_.strata.lora.enabled()) {
      return InvalidArgumentError(
          "strata.split_blocks and strata.lora are both given: a LoRA run's trained units are "
          "its small adapter units already; drop strata.split_blocks");
    }

    IoSettings& io = config_.strata.io;
    const AioConfig& aio = config_.aio;
    io.threads = pending_.io_threads.value_or(aio.intra_op_parallelism);
    io.threads_auto = !pending_.io_threads.has_value();
    io.queue_depth = pending_.io_queue_depth.value_or(aio.queue_depth);
    io.queue_depth_auto = !pending_.io_queue_depth.has_value();
    io.block_size = pending_.io_block_size.value_or(aio.block_size);
    io.block_size_auto = !pending_.io_block_size.has_value();
    io.nvme_paths_auto = !explicit_paths;
    if (explicit_paths) {
      io.nvme_paths = *pending_.nvme_paths;
    } else {
      io.nvme_paths = DefaultNvmePaths(z);
    }
    return Status::Ok();
  }

  // The parts of the batch rule that do not depend on the world size: a triple that no world
  // size can satisfy is an error now rather than at launch.
  static Status CheckBatchTriple(const BatchConfig& b) {
    const auto& t = b.train_batch_size;
    const auto& m = b.train_micro_batch_size_per_gpu;
    const auto& g = b.gradient_accumulation_steps;
    if (t && m && g) {
      std::optional<int64_t> per_rank = Multiply({*m, *g});
      if (!per_rank || *t % *per_rank != 0) {
        return InvalidArgumentError(fmt::format(
            "train_batch_size {} is not a multiple of train_micro_batch_size_per_gpu {} * "
            "gradient_accumulation_steps {}, so no world size satisfies train_batch_size = "
            "micro * gas * world_size",
            *t, *m, *g));
      }
    } else if (t && m && *t % *m != 0) {
      return InvalidArgumentError(fmt::format(
          "train_batch_size {} is not a multiple of train_micro_batch_size_per_gpu {}", *t, *m));
    } else if (t && g && *t % *g != 0) {
      return InvalidArgumentError(fmt::format(
          "train_batch_size {} is not a multiple of gradient_accumulation_steps {}", *t, *g));
    }
    return Status::Ok();
  }

  Config& config_;
  ParseState& state_;
  Pending pending_;
  bool ds_cpu_checkpointing_ = false;  // activation_checkpointing.cpu_checkpointing
};

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
