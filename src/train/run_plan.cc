#include "train/run_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "common/units.h"
#include "train/estimate.h"
#include "train/lora_files.h"

namespace strata::train {

namespace {

Status CheckFlags(const TrainOptions& o) {
  if (o.steps < 1) return InvalidArgumentError(fmt::format("--steps {}: expected >= 1", o.steps));
  if (o.eval_every < 0 || o.eval_sequences < 0) {
    return InvalidArgumentError("--eval-every and --eval-sequences: expected >= 0");
  }
  if (o.eval_every > 0 && o.eval_data.empty()) {
    return InvalidArgumentError(
        fmt::format("--eval-every {}: needs --eval-data (the token file to evaluate on)",
                    o.eval_every));
  }
  return Status::Ok();
}

// The DeepSpeed config; `strata eval` without one runs stage 0 with its micro-batch. An
// evaluation is forward only: every unit frozen, so no gradient buffer and no optimizer state.
Result<Config> LoadRunConfig(const TrainOptions& o) {
  Config config;
  if (o.eval_only && o.config_path.empty()) {
    if (o.eval_micro_batch < 1) {
      return InvalidArgumentError(
          fmt::format("--micro-batch {}: expected >= 1", o.eval_micro_batch));
    }
    STRATA_ASSIGN_OR_RETURN(
        config, ParseConfig(fmt::format(R"({{"train_micro_batch_size_per_gpu": {}}})",
                                        o.eval_micro_batch),
                            "<strata eval>"));
  } else {
    STRATA_ASSIGN_OR_RETURN(config, LoadConfigFile(o.config_path));
  }
  if (o.eval_only) {
    config.strata.freeze = {"*"};
    config.strata.trainable.clear();
    config.zero.offload_optimizer.device = OffloadDevice::kNone;
  }
  return config;
}

// LoRA adapters: strata.lora, or an adapter directory's (or the resumed checkpoint's)
// adapter_config.json; where both are given they must agree.
Status AdoptLora(RunPlan* plan, const std::string& dir) {
  STRATA_ASSIGN_OR_RETURN(const LoraSettings from_dir, ReadAdapterConfig(dir, &plan->adapter_note));
  LoraSettings& configured = plan->config.strata.lora;
  if (!configured.enabled()) {
    configured = from_dir;
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(const model::LlamaLora mine, model::ResolveLlamaLora(configured));
  STRATA_ASSIGN_OR_RETURN(const model::LlamaLora theirs, model::ResolveLlamaLora(from_dir));
  if (mine.rank != theirs.rank || mine.alpha != theirs.alpha || mine.targets != theirs.targets) {
    return InvalidArgumentError(fmt::format(
        "strata.lora (r {}, lora_alpha {}, on {}) differs from {}/{} (r {}, lora_alpha {}, on "
        "{}); drop strata.lora from the config to take the directory's",
        mine.rank, mine.alpha, fmt::join(mine.target_names(), ", "), dir, kAdapterConfigFile,
        theirs.rank, theirs.alpha, fmt::join(theirs.target_names(), ", ")));
  }
  return Status::Ok();
}

Status ResolveLora(RunPlan* plan) {
  const TrainOptions& o = plan->options;
  if (plan->resumed && HasAdapter(plan->resume_dir)) {
    STRATA_RETURN_IF_ERROR(AdoptLora(plan, plan->resume_dir));
  } else if (plan->resumed && plan->config.strata.lora.enabled()) {
    return InvalidArgumentError(fmt::format(
        "strata.lora: the checkpoint {} has no LoRA adapters ({}); it was not saved by a LoRA run",
        plan->resume_dir, kAdapterConfigFile));
  }
  // A LoRA run's step directory as --model carries its adapters (its model.safetensors holds the
  // base weights only): they are loaded as with --adapter.
  plan->adapter_dir = o.adapter_dir;
  if (plan->adapter_dir.empty() && !plan->resumed && std::filesystem::is_directory(o.model) &&
      HasAdapter(o.model)) {
    plan->adapter_dir = o.model;
  }
  if (!plan->adapter_dir.empty()) {
    if (plan->resumed) {
      return InvalidArgumentError(
          "--adapter and --resume: a resumed run continues the checkpoint's own adapters");
    }
    STRATA_RETURN_IF_ERROR(AdoptLora(plan, plan->adapter_dir));
  }
  STRATA_ASSIGN_OR_RETURN(plan->lora, model::ResolveLlamaLora(plan->config.strata.lora));
  // The adapters train; the base weights are frozen unless strata.trainable names them.
  if (!o.eval_only) AddLoraTrainablePatterns(&plan->config);
  return Status::Ok();
}

// The sequence length and the data seed: the flags, or what a resumed checkpoint fixed (a
// resumed run keeps its data order, so neither may change).
Status ResolveSequence(RunPlan* plan) {
  const TrainOptions& o = plan->options;
  const std::optional<TrainerState>& resumed = plan->resumed;
  if (resumed && o.seq_len > 0 && static_cast<uint64_t>(o.seq_len) != resumed->seq_len) {
    return InvalidArgumentError(fmt::format(
        "--seq-len {}: the checkpoint {} was trained with sequences of {} tokens; resuming keeps "
        "the data order, so the sequence length cannot change",
        o.seq_len, plan->resume_dir, resumed->seq_len));
  }
  plan->seq_len = o.seq_len > 0 ? o.seq_len
                  : resumed     ? static_cast<int64_t>(resumed->seq_len)
                                : std::min<int64_t>(256, plan->model.max_position_embeddings);
  const model::LlamaConfig& m = plan->model;
  if (m.sliding_window > 0 && plan->seq_len > m.sliding_window) {
    return UnimplementedError(fmt::format(
        "{}: sliding_window is {} (Mistral's sliding-window attention); Strata computes full "
        "causal attention, which is the same only for sequences of at most {} tokens, and "
        "--seq-len is {}",
        m.name, m.sliding_window, m.sliding_window, plan->seq_len));
  }
  if (resumed && o.seed.has_value() && *o.seed != resumed->seed) {
    return InvalidArgumentError(fmt::format(
        "--seed {}: the checkpoint {} was trained with data seed {}; resuming keeps the data order",
        *o.seed, plan->resume_dir, resumed->seed));
  }
  plan->seed = resumed ? resumed->seed : o.seed.value_or(1234);
  return Status::Ok();
}

// Ranks, micro-batches and accumulation; the LR schedule's length; the sampler.
Status ResolveBatches(RunPlan* plan) {
  const TrainOptions& o = plan->options;
  const std::optional<TrainerState>& resumed = plan->resumed;
  if (plan->world() % plan->tensor_parallel() != 0) {
    return InvalidArgumentError(fmt::format(
        "tensor_parallel.autotp_size {} does not divide the run's {} rank(s): each tensor-parallel "
        "group is that many ranks",
        plan->tensor_parallel(), plan->world()));
  }
  // The batch is split over the data-parallel ranks; a tensor-parallel group reads one share.
  STRATA_ASSIGN_OR_RETURN(BatchSizes batch,
                          ResolveBatchSizes(plan->config.batch, plan->data_world()));
  if (!plan->config.scheduler.total_num_steps.has_value() &&
      (plan->config.scheduler.type == SchedulerType::kWarmupDecayLR ||
       plan->config.scheduler.type == SchedulerType::kWarmupCosineLR)) {
    // The schedule's length is the run's: a resumed run keeps the one it started with.
    plan->scheduler_total_steps =
        resumed && resumed->scheduler_total_steps > 0 ? resumed->scheduler_total_steps : o.steps;
    plan->config.scheduler.total_num_steps = plan->scheduler_total_steps;
  }
  STRATA_ASSIGN_OR_RETURN(plan->token_dtype, ParseTokenDtype(o.data_dtype));
  plan->layout =
      BatchLayout{plan->data_world(), static_cast<int>(batch.train_micro_batch_size_per_gpu),
                  static_cast<int>(batch.gradient_accumulation_steps)};
  SamplerOptions& s = plan->sampler;
  s.seq_len = static_cast<uint64_t>(plan->seq_len);
  s.global_batch = plan->layout.global_batch();
  if (o.sampling.empty()) {
    s.mode = resumed ? resumed->sampler.mode : SamplingMode::kRandom;
  } else {
    STRATA_ASSIGN_OR_RETURN(s.mode, ParseSamplingMode(o.sampling));
    if (resumed && s.mode != resumed->sampler.mode) {
      return InvalidArgumentError(fmt::format(
          "--sampling {}: the checkpoint {} was trained with {} sampling; resuming keeps the data "
          "order",
          o.sampling, plan->resume_dir, SamplingModeName(resumed->sampler.mode)));
    }
  }
  s.seed = plan->seed;
  return Status::Ok();
}

// How the data is read: the vocabulary bound, the rows, and for prepared data the packing (a
// resumed run keeps the checkpoint's, since its data order depends on it).
Status ResolveData(RunPlan* plan) {
  const TrainOptions& o = plan->options;
  const std::optional<TrainerState>& resumed = plan->resumed;
  DataOptions& d = plan->data;
  d.vocab_size = static_cast<uint64_t>(plan->model.vocab_size);
  d.seq_len = static_cast<uint64_t>(plan->seq_len);
  d.stream_dtype = plan->token_dtype;
  const bool keep = resumed && resumed->data_prepared;
  d.pack = o.packing.value_or(keep ? resumed->data_packed : true);
  STRATA_ASSIGN_OR_RETURN(
      d.long_documents,
      ParseLongDocuments(o.long_docs.empty() ? (keep ? resumed->data_long_docs : "split")
                                             : o.long_docs));
  if (keep && d.pack != resumed->data_packed) {
    return InvalidArgumentError(fmt::format(
        "{}: the checkpoint {} was trained {} packing; resuming keeps the data order",
        d.pack ? "packing" : "--no-packing", plan->resume_dir,
        resumed->data_packed ? "with" : "without"));
  }
  if (keep && LongDocumentsName(d.long_documents) != resumed->data_long_docs) {
    return InvalidArgumentError(fmt::format(
        "--long-docs {}: the checkpoint {} was trained with --long-docs {}; resuming keeps the "
        "data order",
        LongDocumentsName(d.long_documents), plan->resume_dir, resumed->data_long_docs));
  }
  return Status::Ok();
}

}  // namespace

Result<RunPlan> ResolveRun(const TrainOptions& options, const comm::LaunchInfo& launch) {
  RunPlan plan;
  plan.options = options;
  plan.launch = launch;
  STRATA_RETURN_IF_ERROR(CheckFlags(options));
  STRATA_ASSIGN_OR_RETURN(plan.config, LoadRunConfig(options));
  // A checkpoint to resume: its trainer state fixes the data order, the schedule and the model.
  if (!options.resume_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(plan.resume_dir, ResolveCheckpoint(options.resume_dir));
    STRATA_ASSIGN_OR_RETURN(TrainerState st, ReadTrainerState(plan.resume_dir));
    plan.resumed = st;
  } else if (options.model.empty()) {
    return InvalidArgumentError(
        "--model: required (a model directory or preset) unless --resume is given");
  }
  plan.model_arg = options.model.empty() ? plan.resume_dir : options.model;
  plan.model_dir = ModelDirOf(plan.model_arg);
  STRATA_RETURN_IF_ERROR(ResolveLora(&plan));
  STRATA_ASSIGN_OR_RETURN(plan.model, model::ResolveModel(plan.model_arg));
  if (plan.resumed) STRATA_RETURN_IF_ERROR(CheckSameModel(plan.resume_dir, plan.model));
  STRATA_RETURN_IF_ERROR(ResolveSequence(&plan));
  STRATA_RETURN_IF_ERROR(ResolveBatches(&plan));
  STRATA_RETURN_IF_ERROR(ResolveData(&plan));
  return plan;
}

EstimateInput RunEstimateInput(const RunPlan& plan, const MachineFacts& machine) {
  EstimateInput in;
  in.model = plan.model;
  in.config = plan.config;
  in.world_size = plan.world();
  in.seq_len = plan.seq_len;
  in.device = machine.device;
  in.from_weights = plan.resumed.has_value() || HasWeights(plan.model_dir);
  in.with_moments = plan.resumed.has_value();
  in.device_budget = machine.device_budget;
  if (plan.eval_only()) {
    // Evaluation runs no backward: nothing to keep a block's internals for, nor to offload.
    in.config.strata.activation_checkpointing = Toggle::kOn;
    in.config.strata.offload_checkpoints = Toggle::kOff;
  }
  return in;
}

Result<std::optional<PlacementChoice>> PlanRunPlacement(const RunPlan& plan,
                                                        const MachineFacts& machine) {
  if (!HasAutoOffload(plan.config)) return std::optional<PlacementChoice>();
  EstimateInput in = RunEstimateInput(plan, machine);
  in.config = plan.config;  // the placement is planned on the config as given
  const Hardware& hw = machine.hardware;
  STRATA_ASSIGN_OR_RETURN(const PlacementPlan planned, PlanPlacement(in, hw));
  PlacementChoice choice;
  choice.candidate = planned.best();
  // The ratio is k/16 (PlanPlacement's grid) or the config's own, the same on every rank.
  choice.fingerprint = static_cast<float>(
      (static_cast<int>(choice.candidate.param) * 4 + static_cast<int>(choice.candidate.optimizer)) *
          1024 +
      std::lround(choice.candidate.ratio * 1000));
  choice.lines.push_back(fmt::format(
      "  placement (\"auto\", for {} rank(s) per node, {} device budget, {} host memory, {} NVMe "
      "free):",
      hw.gpus_per_node, FormatBytes(hw.rank_device_budget()), FormatBytes(hw.cpu_mem),
      FormatBytes(hw.nvme)));
  for (const std::string& r : planned.reasons) choice.lines.push_back("    " + r);
  return std::optional<PlacementChoice>(std::move(choice));
}

Result<MemoryChoice> PlanRunMemory(const RunPlan& plan, const MachineFacts& machine) {
  STRATA_ASSIGN_OR_RETURN(const MemoryEstimate estimate,
                          EstimateMemory(RunEstimateInput(plan, machine)));
  MemoryChoice choice;
  STRATA_RETURN_IF_ERROR(CheckDevicePlan(estimate, machine.device_budget, &choice.warning));
  choice.keep_activations = !estimate.checkpointing;
  choice.split_blocks = estimate.split_blocks;
  choice.offload_checkpoints = estimate.offload_checkpoints;
  return choice;
}

std::string RankPath(const std::string& path, int rank, int world) {
  if (world <= 1) return path;
  std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) +
                             p.extension().string()))
      .string();
}

}  // namespace strata::train
