// The config parser's optimizer, scheduler, fp16 and bf16 sections (config_parser.h).
#include "common/config_parser.h"

#include "common/log.h"

namespace strata::config_internal {

Status ConfigParser::ParseOptimizer(const Field& f) {
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

Status ConfigParser::ParseOptimizerType(const Field& f) {
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

Status ConfigParser::ParseAdamParams(const Field& f) {
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

Status ConfigParser::ReadBetas(const Field& f) {
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

Status ConfigParser::ParseScheduler(const Field& f) {
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

Status ConfigParser::ParseSchedulerType(const Field& f) {
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

Status ConfigParser::ParseSchedulerParams(const Field& f) {
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

Status ConfigParser::ParseFp16(const Field& f) {
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

Status ConfigParser::ParseBf16(const Field& f) {
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

}  // namespace strata::config_internal
