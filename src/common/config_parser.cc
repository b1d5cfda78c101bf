// The config parser: the walk from the top level, the batch keys, and the rules and defaults that
// span sections (config_parser.h).
#include "common/config_parser.h"

#include "common/log.h"

namespace strata::config_internal {

Status ConfigParser::Parse(const Json& root) {
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


std::vector<KeySpec> ConfigParser::RootSpecs() {
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
      {.name = "tensor_parallel",
       .parse = [this](const Field& f) { return ParseTensorParallel(f); }},
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

Status ConfigParser::ReadBatch(const Field& f, std::optional<int64_t>* out) {
  return ReadOptional(
      f, out, [&](int64_t* v) { return ReadInt64(f, 1, kInt64Max, kPositiveInteger, v); });
}

const Json* ConfigParser::Member(const Field& f, const std::string& key) {
  if (!f.value.is_object()) return nullptr;
  auto it = f.value.find(key);
  return it == f.value.end() || it->is_null() ? nullptr : &*it;
}

Status ConfigParser::AlreadyParsed(const Field&) { return Status::Ok(); }

Status ConfigParser::Finish() {
  STRATA_RETURN_IF_ERROR(FinishOffload());
  STRATA_RETURN_IF_ERROR(FinishOptimizer());
  STRATA_RETURN_IF_ERROR(CheckBatchTriple(config_.batch));
  STRATA_RETURN_IF_ERROR(FinishStrata());
  FinishIo();
  return Status::Ok();
}

Status ConfigParser::FinishOffload() {
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
  if (z.zero_quantized_weights && z.stage != 3) {
    config_.diagnostics.warnings.push_back(fmt::format(
        "zero_optimization.zero_quantized_weights: quantizes stage 3's parameter all-gather and "
        "has no effect at stage {} (DeepSpeed ignores it too)",
        z.stage));
    z.zero_quantized_weights = false;
  }
  if (z.zero_hpz_partition_size > 1 && z.stage != 3) {
    config_.diagnostics.warnings.push_back(fmt::format(
        "zero_optimization.zero_hpz_partition_size: keeps a node-local copy of stage 3's "
        "gathered parameters and has no effect at stage {} (DeepSpeed ignores it too)",
        z.stage));
    z.zero_hpz_partition_size = 1;
  }
  if (z.zero_quantized_gradients && z.stage < 2) {
    config_.diagnostics.warnings.push_back(fmt::format(
        "zero_optimization.zero_quantized_gradients: quantizes the gradient reduce-scatter of "
        "stages 2 and 3 and has no effect at stage {}",
        z.stage));
    z.zero_quantized_gradients = false;
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
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.offload_optimizer.nvme_path.empty() &&
      !explicit_paths) {
    return InvalidArgumentError(
        "zero_optimization.offload_optimizer.nvme_path: required when offload_optimizer.device "
        "is \"nvme\" (or list the directories in strata.io.nvme_paths)");
  }
  z.overlap_comm = pending_.overlap_comm.value_or(z.stage == 3);
  return Status::Ok();
}

Status ConfigParser::FinishOptimizer() {
  if (config_.fp16.enabled && config_.bf16.enabled) {
    return InvalidArgumentError(
        fmt::format("fp16.enabled and {}.enabled are both true; enable at most one of them",
                    pending_.bf16_key));
  }
  // Adam: DeepSpeed's "Adam" means decoupled weight decay unless adam_w_mode is false;
  // "AdamW" is decoupled whatever adam_w_mode says.
  OptimizerConfig& o = config_.optimizer;
  o.decoupled_weight_decay = o.type == OptimizerType::kAdamW || pending_.adam_w_mode.value_or(true);
  SchedulerConfig& s = config_.scheduler;
  if (pending_.warmup_max_lr) {
    s.warmup_max_lr = *pending_.warmup_max_lr;
  } else if (s.type == SchedulerType::kWarmupLR) {
    s.warmup_max_lr = o.lr;
  }
  return Status::Ok();
}

Status ConfigParser::FinishStrata() {
  StrataSettings& strata = config_.strata;
  if (!strata.freeze.empty() && !strata.trainable.empty()) {
    return InvalidArgumentError(
        "strata.freeze and strata.trainable are both given; give one of them (freeze: the "
        "parameters that match are frozen; trainable: only those that match train)");
  }
  if (strata.lora.enabled() && !strata.freeze.empty()) {
    return InvalidArgumentError(
        "strata.lora and strata.freeze are both given: LoRA freezes every base weight already; "
        "to train some base weights with the adapters, list them in strata.trainable");
  }
  if (ds_cpu_checkpointing_) {
    if (strata.offload_checkpoints == Toggle::kOff) {
      return InvalidArgumentError(
          "activation_checkpointing.cpu_checkpointing is true and strata.offload_checkpoints is "
          "off: give one of the two");
    }
    strata.offload_checkpoints = Toggle::kOn;
  }
  if (strata.offload_checkpoints == Toggle::kOn &&
      strata.activation_checkpointing == Toggle::kOff) {
    return InvalidArgumentError(
        "strata.offload_checkpoints is on and strata.activation_checkpointing is off: only "
        "checkpointed block inputs can be offloaded; turn checkpointing on (or \"auto\") or "
        "drop strata.offload_checkpoints");
  }
  if (strata.split_blocks == Toggle::kOn && strata.lora.enabled()) {
    return InvalidArgumentError(
        "strata.split_blocks and strata.lora are both given: a LoRA run's trained units are its "
        "small adapter units already; drop strata.split_blocks");
  }
  return Status::Ok();
}

// strata.io's settings that default to DeepSpeed's aio section, and the NVMe paths.
void ConfigParser::FinishIo() {
  IoSettings& io = config_.strata.io;
  const AioConfig& aio = config_.aio;
  io.threads = pending_.io_threads.value_or(aio.intra_op_parallelism);
  io.threads_auto = !pending_.io_threads.has_value();
  io.queue_depth = pending_.io_queue_depth.value_or(aio.queue_depth);
  io.queue_depth_auto = !pending_.io_queue_depth.has_value();
  io.block_size = pending_.io_block_size.value_or(aio.block_size);
  io.block_size_auto = !pending_.io_block_size.has_value();
  const bool explicit_paths = pending_.nvme_paths.has_value();
  io.nvme_paths_auto = !explicit_paths;
  io.nvme_paths = explicit_paths ? *pending_.nvme_paths : DefaultNvmePaths(config_.zero);
}

Status ConfigParser::CheckBatchTriple(const BatchConfig& b) {
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

}  // namespace strata::config_internal
