// The config parser's zero_optimization section with its offload sections, and aio, checkpoint,
// the monitors and activation_checkpointing (config_parser.h).
#include "common/config_parser.h"

#include "common/log.h"

namespace strata::config_internal {

Status ConfigParser::ParseZero(const Field& f) {
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
      {.name = "zero_quantized_weights", .parse = flag(&z.zero_quantized_weights)},
      {.name = "zero_hpz_partition_size",
       .parse =
           [&](const Field& v) {
             return ReadInt(v, 1, 1 << 20, "a positive integer (the ranks of one node)",
                            &z.zero_hpz_partition_size);
           }},
      {.name = "zero_quantized_gradients", .parse = flag(&z.zero_quantized_gradients)},
      // Accepted, no effect in Strata: MiCS, module-granularity fetching, PyTorch-module hooks
      // and debugging aids.
      Ignored("cpu_offload_use_pin_memory"),
      Ignored("use_multi_rank_bucket_allreduce"),
      Ignored("compute_grad_norm"),
      Ignored("parameter_alignment"),
      Ignored("stage3_module_granularity_threshold", {"module_granularity_threshold"}),
      Ignored("stage3_use_all_reduce_for_fetch_params", {"use_all_reduce_for_fetch_params"}),
      Ignored("stage3_allgather_sequential", {"allgather_sequential"}),
      Ignored("stage3_partition_stream_chunk_size", {"partition_stream_chunk_size"}),
      Ignored("legacy_stage1"),
      Ignored("zero_quantized_nontrainable_weights"),
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

Status ConfigParser::ReadOffloadDevice(const Field& f, OffloadDevice* out) {
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

Status ConfigParser::ParseOffloadParam(const Field& f) {
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

Status ConfigParser::ParseOffloadOptimizer(const Field& f) {
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

Status ConfigParser::ParseAio(const Field& f) {
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

// DeepSpeed's AutoTP training section: autotp_size is the tensor-parallel degree over the ranks
// of a node, as in DeepSpeed. Its other keys configure DeepSpeed's module rewriting and have no
// meaning here (Strata's Llama model has its tensor-parallel layers built in). Whether the degree
// fits the ranks and the model is checked where those are known (train/runtime.h,
// model::LlamaTensorParallelConfig).
Status ConfigParser::ParseTensorParallel(const Field& f) {
  std::vector<KeySpec> specs = {
      {.name = "autotp_size",
       .parse =
           [&](const Field& v) {
             return ReadInt(v, 1, kIntMax, kPositiveInteger, &config_.tensor_parallel_size);
           }},
      Ignored("tp_size"),
      Ignored("tp_grain_size"),
      Ignored("enabled"),
      Ignored("partition_config"),
      Ignored("preset_model"),
      Ignored("tp_overlap_comm"),
      Ignored("keep_module_on_host"),
      Ignored("injection_policy_tuple"),
  };
  return WalkObject(f, specs);
}

Status ConfigParser::ParseCheckpoint(const Field& f) {
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

Status ConfigParser::ParseMonitor(const Field& f, MonitorConfig* m) {
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

Status ConfigParser::ParseActivationCheckpointing(const Field& f) {
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

}  // namespace strata::config_internal
