#include "train/trainer.h"

#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/log.h"
#include "common/units.h"
#include "device/pinned_pool.h"
#include "model/llama_config.h"
#include "model/llama_model.h"
#include "strata/block_store.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/trace.h"
#include "common/errno.h"
#include "common/file_lock.h"
#include "common/host_memory.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/lora_files.h"
#include "train/estimate.h"
#include "train/monitor.h"
#include "train/plan.h"
#include "train/rank_gather.h"
#include "train/runtime.h"
#include "train/safetensors.h"
#include "zero/engine.h"
#include "zero/partition.h"

namespace strata::train {

namespace {

std::string RankPath(const std::string& path, int rank, int world) {
  if (world <= 1) return path;
  std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) +
                             p.extension().string()))
      .string();
}



// Creates `dir` if needed and proves it writable by creating and removing a file in it.
Status ProbeDirectory(const std::string& dir, std::string_view what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return ErrnoToStatus(ec.value(), fmt::format("{} {}: cannot create the directory", what, dir));
  }
  const std::string probe =
      (std::filesystem::path(dir) / fmt::format(".strata-probe-{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return ErrnoToStatus(errno, fmt::format("{} {}: cannot write in the directory", what, dir));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::Ok();
}

// Opens `path` for appending (creating it, never truncating) to prove it can be written.
Status ProbeFile(const std::string& path, std::string_view what) {
  const std::filesystem::path p(path);
  if (!p.parent_path().empty()) STRATA_RETURN_IF_ERROR(ProbeDirectory(p.parent_path().string(), what));
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("{} {}: cannot open for writing", what, path));
  ::close(fd);
  return Status::Ok();
}

// Everything the run will write, checked before anything is allocated or trained: a read-only
// --save found after hours of training loses them all.
Status ProbeOutputs(const TrainOptions& o, const Config& config, const comm::LaunchInfo& launch) {
  if (!o.save_dir.empty()) STRATA_RETURN_IF_ERROR(ProbeDirectory(o.save_dir, "--save"));
  if (!o.metrics_path.empty() && launch.rank == 0) {
    STRATA_RETURN_IF_ERROR(ProbeFile(o.metrics_path, "--metrics"));
  }
  if (!o.trace_path.empty()) {
    STRATA_RETURN_IF_ERROR(
        ProbeFile(RankPath(o.trace_path, launch.rank, launch.world_size), "--trace"));
  }
  for (const std::string& dir : config.strata.io.nvme_paths) {
    STRATA_RETURN_IF_ERROR(ProbeDirectory(dir, "nvme_path"));
  }
  // An "auto" home may become NVMe: its directory is a candidate, probed alike.
  if (config.zero.offload_param.device == OffloadDevice::kAuto &&
      !config.zero.offload_param.nvme_path.empty()) {
    STRATA_RETURN_IF_ERROR(ProbeDirectory(config.zero.offload_param.nvme_path, "nvme_path"));
  }
  if (config.zero.offload_optimizer.device == OffloadDevice::kAuto &&
      !config.zero.offload_optimizer.nvme_path.empty()) {
    STRATA_RETURN_IF_ERROR(ProbeDirectory(config.zero.offload_optimizer.nvme_path, "nvme_path"));
  }
  return Status::Ok();
}

// --profile-ops: each op's device time per profiled step, largest first, and what the ops leave
// of the step (the engine's own work: collectives, copies, the optimizer, waits).
void PrintOpProfile(const std::vector<model::OpTime>& ops, int64_t steps, double step_s,
                    const std::function<void(const std::string&)>& say) {
  if (steps == 0 || ops.empty()) {
    say("op profile: no step after the first to profile (--steps 2 or more)");
    return;
  }
  const double per = 1.0 / static_cast<double>(steps);
  double total = 0.0;
  for (const model::OpTime& t : ops) total += t.seconds;
  say(fmt::format("op profile: device time per step, {} step(s) after the first, rank 0 "
                  "(--profile-ops)",
                  steps));
  say(fmt::format("  {:<22} {:>10} {:>10} {:>8}", "op", "calls/step", "ms/step", "of step"));
  for (const model::OpTime& t : ops) {
    say(fmt::format("  {:<22} {:>10.0f} {:>10.3f} {:>7.1f}%", t.op,
                    static_cast<double>(t.calls) * per, t.seconds * per * 1e3,
                    100.0 * t.seconds / step_s));
  }
  say(fmt::format("  {:<22} {:>10} {:>10.3f} {:>7.1f}%", "all ops", "", total * per * 1e3,
                  100.0 * total / step_s));
  say(fmt::format("  {:<22} {:>10} {:>10.3f} {:>7.1f}%", "the step", "", step_s * per * 1e3,
                  100.0));
}

}  // namespace

Status RunTraining(const TrainOptions& o) {
  auto print = o.print ? o.print : [](const std::string& line) {
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
  };
  if (o.steps < 1) return InvalidArgumentError(fmt::format("--steps {}: expected >= 1", o.steps));
  if (o.eval_every < 0 || o.eval_sequences < 0) {
    return InvalidArgumentError("--eval-every and --eval-sequences: expected >= 0");
  }
  if (o.eval_every > 0 && o.eval_data.empty()) {
    return InvalidArgumentError(
        fmt::format("--eval-every {}: needs --eval-data (the token file to evaluate on)",
                    o.eval_every));
  }
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
    // Forward only: every unit frozen, so no gradient buffer and no optimizer state is built.
    config.strata.freeze = {"*"};
    config.strata.trainable.clear();
    config.zero.offload_optimizer.device = OffloadDevice::kNone;
  }

  // A checkpoint to resume: its trainer state fixes the data order, the schedule and the model.
  std::string resume_dir;
  std::optional<TrainerState> resumed;
  if (!o.resume_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(resume_dir, ResolveCheckpoint(o.resume_dir));
    STRATA_ASSIGN_OR_RETURN(TrainerState st, ReadTrainerState(resume_dir));
    resumed = st;
  } else if (o.model.empty()) {
    return InvalidArgumentError("--model: required (a model directory or preset) unless --resume is given");
  }
  const std::string model_arg = o.model.empty() ? resume_dir : o.model;
  const std::string model_dir = ModelDirOf(model_arg);

  // LoRA adapters: strata.lora, or an adapter directory's (or the resumed checkpoint's)
  // adapter_config.json; where both are given they must agree.
  std::string adapter_note;
  auto adopt_lora = [&](const std::string& dir) -> Status {
    STRATA_ASSIGN_OR_RETURN(const LoraSettings from_dir, ReadAdapterConfig(dir, &adapter_note));
    if (!config.strata.lora.enabled()) {
      config.strata.lora = from_dir;
      return Status::Ok();
    }
    STRATA_ASSIGN_OR_RETURN(const model::LlamaLora mine, model::ResolveLlamaLora(config.strata.lora));
    STRATA_ASSIGN_OR_RETURN(const model::LlamaLora theirs, model::ResolveLlamaLora(from_dir));
    if (mine.rank != theirs.rank || mine.alpha != theirs.alpha || mine.targets != theirs.targets) {
      return InvalidArgumentError(fmt::format(
          "strata.lora (r {}, lora_alpha {}, on {}) differs from {}/{} (r {}, lora_alpha {}, on "
          "{}); drop strata.lora from the config to take the directory's",
          mine.rank, mine.alpha, fmt::join(mine.target_names(), ", "), dir, kAdapterConfigFile,
          theirs.rank, theirs.alpha, fmt::join(theirs.target_names(), ", ")));
    }
    return Status::Ok();
  };
  if (resumed && HasAdapter(resume_dir)) {
    STRATA_RETURN_IF_ERROR(adopt_lora(resume_dir));
  } else if (resumed && config.strata.lora.enabled()) {
    return InvalidArgumentError(fmt::format(
        "strata.lora: the checkpoint {} has no LoRA adapters ({}); it was not saved by a LoRA run",
        resume_dir, kAdapterConfigFile));
  }
  // A LoRA run's step directory as --model carries its adapters (its model.safetensors holds the
  // base weights only): they are loaded as with --adapter.
  std::string adapter_dir = o.adapter_dir;
  if (adapter_dir.empty() && !resumed && std::filesystem::is_directory(o.model) &&
      HasAdapter(o.model)) {
    adapter_dir = o.model;
  }
  if (!adapter_dir.empty()) {
    if (resumed) {
      return InvalidArgumentError(
          "--adapter and --resume: a resumed run continues the checkpoint's own adapters");
    }
    STRATA_RETURN_IF_ERROR(adopt_lora(adapter_dir));
  }
  STRATA_ASSIGN_OR_RETURN(const model::LlamaLora lora, model::ResolveLlamaLora(config.strata.lora));
  // The adapters train; the base weights are frozen unless strata.trainable names them.
  if (!o.eval_only) AddLoraTrainablePatterns(&config);
  STRATA_ASSIGN_OR_RETURN(model::LlamaConfig mcfg, model::ResolveModel(model_arg));
  if (resumed) STRATA_RETURN_IF_ERROR(CheckSameModel(resume_dir, mcfg));
  if (resumed && o.seq_len > 0 && static_cast<uint64_t>(o.seq_len) != resumed->seq_len) {
    return InvalidArgumentError(fmt::format(
        "--seq-len {}: the checkpoint {} was trained with sequences of {} tokens; resuming keeps "
        "the data order, so the sequence length cannot change",
        o.seq_len, resume_dir, resumed->seq_len));
  }
  const int64_t seq_len =
      o.seq_len > 0 ? o.seq_len
                    : (resumed ? static_cast<int64_t>(resumed->seq_len)
                               : std::min<int64_t>(256, mcfg.max_position_embeddings));
  if (mcfg.sliding_window > 0 && seq_len > mcfg.sliding_window) {
    return UnimplementedError(fmt::format(
        "{}: sliding_window is {} (Mistral's sliding-window attention); Strata computes full "
        "causal attention, which is the same only for sequences of at most {} tokens, and "
        "--seq-len is {}",
        mcfg.name, mcfg.sliding_window, mcfg.sliding_window, seq_len));
  }
  if (resumed && o.seed.has_value() && *o.seed != resumed->seed) {
    return InvalidArgumentError(fmt::format(
        "--seed {}: the checkpoint {} was trained with data seed {}; resuming keeps the data order",
        *o.seed, resume_dir, resumed->seed));
  }
  const uint64_t seed = resumed ? resumed->seed : o.seed.value_or(1234);

  // Devices and ranks (train/runtime.h: the composition root).
  const comm::LaunchInfo launch = comm::DetectLaunch();
  STRATA_RETURN_IF_ERROR(ProbeOutputs(o, config, launch));
  // One run per --save directory: a second one would race for `latest`. (Rank 0 saves.)
  FileLock save_lock;
  if (!o.save_dir.empty() && launch.rank == 0) {
    STRATA_ASSIGN_OR_RETURN(
        save_lock,
        FileLock::Acquire(o.save_dir, "checkpoint directory",
                          (std::filesystem::path(o.save_dir) / ".strata.lock").string()));
  }
  std::unique_ptr<TraceRecorder> trace;
  if (!o.trace_path.empty()) {
    trace = std::make_unique<TraceRecorder>(launch.rank, fmt::format("rank {}", launch.rank));
  }
  RuntimeOptions ropt;
  if (!o.device.empty()) {
    STRATA_ASSIGN_OR_RETURN(ropt.device, ParseDeviceKind(o.device));
  }
  ropt.trace = trace.get();
  ropt.launch = launch;
  STRATA_ASSIGN_OR_RETURN(Runtime runtime, OpenRuntime(config, ropt));
  device::Device* dev = runtime.device.get();
  comm::Collective* comm = runtime.comm.get();
  const int rank = comm->rank(), world = comm->world_size();
  auto say = [&](const std::string& line) {
    if (rank == 0) print(line);
  };

  STRATA_ASSIGN_OR_RETURN(BatchSizes batch, ResolveBatchSizes(config.batch, world));
  int64_t scheduler_total_steps = 0;
  if (!config.scheduler.total_num_steps.has_value() &&
      (config.scheduler.type == SchedulerType::kWarmupDecayLR ||
       config.scheduler.type == SchedulerType::kWarmupCosineLR)) {
    // The schedule's length is the run's: a resumed run keeps the one it started with.
    scheduler_total_steps =
        resumed && resumed->scheduler_total_steps > 0 ? resumed->scheduler_total_steps : o.steps;
    config.scheduler.total_num_steps = scheduler_total_steps;
  }

  // Data.
  STRATA_ASSIGN_OR_RETURN(TokenDtype token_dtype, ParseTokenDtype(o.data_dtype));
  STRATA_ASSIGN_OR_RETURN(TokenDataset data,
                          TokenDataset::Open(o.data, static_cast<uint64_t>(mcfg.vocab_size),
                                             token_dtype));
  BatchLayout layout{world, static_cast<int>(batch.train_micro_batch_size_per_gpu),
                     static_cast<int>(batch.gradient_accumulation_steps)};
  SamplerOptions sopt;
  sopt.seq_len = static_cast<uint64_t>(seq_len);
  sopt.global_batch = layout.global_batch();
  if (o.sampling.empty()) {
    sopt.mode = resumed ? resumed->sampler.mode : SamplingMode::kRandom;
  } else {
    STRATA_ASSIGN_OR_RETURN(sopt.mode, ParseSamplingMode(o.sampling));
    if (resumed && sopt.mode != resumed->sampler.mode) {
      return InvalidArgumentError(fmt::format(
          "--sampling {}: the checkpoint {} was trained with {} sampling; resuming keeps the data "
          "order",
          o.sampling, resume_dir, SamplingModeName(resumed->sampler.mode)));
    }
  }
  sopt.seed = seed;
  // The training order (none for an evaluation, which reads its windows in order).
  std::optional<SequenceSampler> sampler;
  if (!o.eval_only) {
    STRATA_ASSIGN_OR_RETURN(SequenceSampler s, SequenceSampler::Create(&data, sopt));
    sampler.emplace(std::move(s));
  }

  // The ranks' agreement between steps (and on the placement below).
  std::unique_ptr<RankGather> agreement;
  if (world > 1) {
    STRATA_ASSIGN_OR_RETURN(agreement, RankGather::Create(*dev, *comm));
  }
  // "auto" offload homes: the planner (train/plan.h, what `strata estimate --plan` prints)
  // chooses the fastest placement that fits this machine; every rank must choose the same.
  EstimateInput plan_in;
  plan_in.model = mcfg;
  plan_in.config = config;
  plan_in.world_size = world;
  plan_in.seq_len = seq_len;
  plan_in.device = dev->type();
  plan_in.from_weights = resumed.has_value() || HasWeights(model_dir);
  plan_in.with_moments = resumed.has_value();
  plan_in.device_budget = dev->memory_stats().budget;
  std::vector<std::string> placement_lines;  // printed with the run's header
  if (HasAutoOffload(config)) {
    const Hardware hw = MachineHardware(*dev, launch, config);
    Result<PlacementPlan> planned = PlanPlacement(plan_in, hw);
    // Every rank learns every rank's choice (-1: its planner failed), so that none waits in a
    // collective for a rank that stopped. The ratio is k/16 (PlanPlacement's grid) or the
    // config's own, the same on every rank.
    const float mine =
        planned.ok() ? static_cast<float>((static_cast<int>(planned->best().param) * 4 +
                                           static_cast<int>(planned->best().optimizer)) *
                                              1024 +
                                          std::lround(planned->best().ratio * 1000))
                     : -1.0f;
    std::vector<float> all = {mine};
    if (world > 1) {
      STRATA_ASSIGN_OR_RETURN(all, agreement->Gather(mine));
    }
    if (!planned.ok()) {
      return planned.status().WithContext("offload device \"auto\" (the placement planner)");
    }
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] < 0) {
        return FailedPreconditionError(fmt::format(
            "offload device \"auto\": the placement planner failed on rank {} (see its error)", r));
      }
      if (all[r] != all[0]) {
        return FailedPreconditionError(fmt::format(
            "offload device \"auto\": rank {} chose another placement than rank 0 (the nodes' "
            "memory or disks differ); set offload_param and offload_optimizer explicitly "
            "(strata estimate --plan shows the choices)",
            r));
      }
    }
    const PlacementPlan& plan = *planned;
    const PlanCandidate& best = plan.best();
    STRATA_RETURN_IF_ERROR(ApplyPlacement(&config, best));
    placement_lines.push_back(fmt::format(
        "  placement (\"auto\", for {} rank(s) per node, {} device budget, {} host memory, {} "
        "NVMe free):",
        hw.gpus_per_node, FormatBytes(hw.rank_device_budget()), FormatBytes(hw.cpu_mem),
        FormatBytes(hw.nvme)));
    for (const std::string& r : plan.reasons) placement_lines.push_back("    " + r);
  }
  // The run's memory plan per rank (train/estimate.h, what `strata estimate` prints), against
  // the device budget before anything is allocated.
  // It settles activation checkpointing too (strata.activation_checkpointing "auto": off when
  // every block's internals fit beside the rest).
  bool keep_activations = false;
  bool split_blocks = false;  // strata.split_blocks, resolved
  bool offload_checkpoints = false;  // strata.offload_checkpoints, resolved
  {
    plan_in.config = config;  // with the placement resolved
    // Evaluation runs no backward: nothing to keep a block's internals for, nor to offload.
    if (o.eval_only) {
      plan_in.config.strata.activation_checkpointing = Toggle::kOn;
      plan_in.config.strata.offload_checkpoints = Toggle::kOff;
    }
    STRATA_ASSIGN_OR_RETURN(const MemoryEstimate plan, EstimateMemory(plan_in));
    std::string warning;
    STRATA_RETURN_IF_ERROR(CheckDevicePlan(plan, dev->memory_stats().budget, &warning));
    if (!warning.empty() && rank == 0) STRATA_LOG(warn, train, "{}", warning);  // same on every rank
    keep_activations = !plan.checkpointing;
    split_blocks = plan.split_blocks;
    offload_checkpoints = plan.offload_checkpoints;
  }

  // Model, store, pool, engine.
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<model::LlamaModel> llama,
      model::LlamaModel::Create(*dev, mcfg, seq_len, batch.train_micro_batch_size_per_gpu,
                                config.strata.seed,
                                {.allow_tf32 = config.strata.tf32,
                                 .profile_ops = o.profile_ops,
                                 .lora = lora,
                                 .keep_activations = keep_activations,
                                 .split_blocks = split_blocks,
                                 .offload_checkpoints = offload_checkpoints}));
  say(fmt::format(
      "strata {}: model {} ({:.1f}M parameters, {} layers), {} rank(s), ZeRO stage {}, "
      "parameters on {}, {}{}, {}",
      o.eval_only ? "eval" : "train", mcfg.name,
      static_cast<double>(mcfg.ParameterCount()) / 1e6, mcfg.num_hidden_layers, world,
      config.zero.stage, OffloadDeviceName(config.zero.offload_param.device),
      o.eval_only ? "forward only (no optimizer state)"
                  : fmt::format("optimizer on {}",
                                OffloadDeviceName(config.zero.offload_optimizer.device)),
      config.zero.offload_optimizer.device != OffloadDevice::kNone &&
              config.zero.offload_optimizer.ratio < 1.0
          ? fmt::format(" (ratio {:g}; the other units' states on the device)",
                        config.zero.offload_optimizer.ratio)
          : std::string(),
      PrecisionName(config.precision())));
  say(fmt::format(
      "  device: {}; device memory budget {}, activations {} ({}){}", runtime.choice.reason,
      FormatBytes(dev->memory_stats().budget),
      FormatBytes(llama->activation_bytes() + llama->workspace_bytes()),
      o.eval_only ? "forward only"
      : split_blocks && keep_activations
          ? "every block's kept; each block as four units, strata.split_blocks"
      : split_blocks     ? "checkpointed: each block recomputed part by part in backward, "
                           "strata.split_blocks"
      : keep_activations ? "every block's kept: no recomputation"
                         : "checkpointed: each block recomputed in backward",
      offload_checkpoints
          ? fmt::format("; {} of checkpoints in host memory, strata.offload_checkpoints",
                        FormatBytes(llama->checkpoint_host_bytes()))
          : std::string()));
  for (const std::string& line : placement_lines) say(line);
  if (lora.enabled()) {
    int64_t adapter_params = 0;
    for (const auto& u : llama->units()) {
      for (const auto& p : u.params) {
        if (model::IsLoraParamName(p.name)) adapter_params += p.numel();
      }
    }
    say(fmt::format("  LoRA: r {}, lora_alpha {:g} (scale {:g}) on {}: {:.3f}M adapter parameters{}",
                    lora.rank, lora.alpha, lora.scale, fmt::join(lora.target_names(), ", "),
                    static_cast<double>(adapter_params) / 1e6,
                    adapter_dir.empty() ? std::string()
                                          : fmt::format(", loaded from {}", adapter_dir)));
    if (!adapter_note.empty()) say("  note: " + adapter_note);
  }
  // Frozen parameters (strata.freeze / strata.trainable), whole units.
  STRATA_ASSIGN_OR_RETURN(
      const std::vector<char> frozen,
      zero::FrozenUnits(llama->units(), config.strata.freeze, config.strata.trainable));
  if (!o.eval_only &&
      std::count(frozen.begin(), frozen.end(), 1) == static_cast<std::ptrdiff_t>(frozen.size())) {
    return InvalidArgumentError(fmt::format(
        "{}: every parameter is frozen; there is nothing to train (strata eval evaluates a "
        "model)",
        config.strata.freeze.empty() ? "strata.trainable" : "strata.freeze"));
  }
  if (!o.eval_only && std::count(frozen.begin(), frozen.end(), 1) > 0) {
    const std::vector<zero::UnitSpec> units = llama->units();
    int64_t all = 0, trained = 0;
    std::string names;
    for (size_t u = 0; u < units.size(); ++u) {
      int64_t n = 0;
      for (const auto& p : units[u].params) n += p.numel();
      all += n;
      if (frozen[u]) {
        names += (names.empty() ? "" : ", ") + units[u].name;
      } else {
        trained += n;
      }
    }
    say(fmt::format("  frozen ({}): {} of {} units ({}); {:.2f}M of {:.2f}M parameters train",
                    config.strata.freeze.empty() ? "strata.trainable" : "strata.freeze",
                    std::count(frozen.begin(), frozen.end(), 1), units.size(), names,
                    static_cast<double>(trained) / 1e6, static_cast<double>(all) / 1e6));
  }
  if (o.eval_only) {
    say(fmt::format("  data {} ({} tokens), sequences of {} tokens, {} per rank per pass",
                    o.data, data.size(), seq_len, layout.micro_batch));
  } else {
    say(fmt::format("  data {} ({} tokens), sequence {} x global batch {} ({} per rank x {} "
                    "accumulation), {} steps{}",
                    o.data, data.size(), seq_len, layout.global_batch(), layout.micro_batch,
                    layout.grad_accum, o.steps,
                    o.eval_every > 0 ? fmt::format("; validation on {} every {} steps",
                                                   o.eval_data, o.eval_every)
                                     : std::string()));
  }
  // Initial states: a checkpoint, a model directory's weights, or the model's own init.
  std::unique_ptr<StateFiles> files;
  if (resumed) {
    // Every byte read back is checked first (the ranks share the work): a damaged checkpoint is
    // an error naming the file and tensor, never weights that train on silently.
    STRATA_RETURN_IF_ERROR(VerifyCheckpoint(resume_dir, *comm, *dev, say));
    STRATA_ASSIGN_OR_RETURN(files,
                            StateFiles::OpenCheckpoint(resume_dir, llama->units(), frozen));
  } else {
    if (HasWeights(model_dir)) {
      STRATA_ASSIGN_OR_RETURN(files, StateFiles::OpenWeights(model_dir, llama->units(),
                                                             adapter_dir));
    } else if (!adapter_dir.empty()) {
      return InvalidArgumentError(fmt::format(
          "--adapter {}: adapters need the base model's weights, and {} holds none "
          "(model.safetensors)",
          adapter_dir, model_arg));
    } else if (std::filesystem::is_directory(model_dir)) {
      say(fmt::format("  {} holds no weights (model.safetensors): starting from random weights",
                      model_dir));
    }
  }
  const auto load_t0 = std::chrono::steady_clock::now();
  std::optional<zero::InitialStates> initial;
  if (files) {
    say(fmt::format("  loading {} from {} ({} over all ranks)",
                    files->has_optimizer() ? "weights and optimizer states" : "weights",
                    files->source(), FormatBytes(files->total_bytes())));
    initial = files->Initial(UnitProgress(rank == 0 ? print : nullptr, "loading"));
  }
  BuildOptions build;
  build.initial = std::move(initial);
  build.trace = trace.get();
  STRATA_ASSIGN_OR_RETURN(EngineStack stack,
                          BuildEngine(runtime, *llama, config, std::move(build)));
  zero::Engine* engine = stack.engine.get();
  if (config.zero.stage > 0 && config.zero.offload_optimizer.device != OffloadDevice::kNone) {
    say(fmt::format("  CPU AdamW: {} thread(s) per rank (strata.cpu_adam_threads{})",
                    stack.cpu_adam_threads, config.strata.cpu_adam_threads ? "" : " auto"));
  }
  int64_t first_step = 0;
  if (files) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_t0).count();
    say(fmt::format("  loaded in {:.1f} s ({:.0f} MB/s over all ranks)", s,
                    static_cast<double>(files->total_bytes()) / std::max(s, 1e-6) / 1e6));
  }
  // Evaluation (forward only) on the eval data's sequential windows: each rank reads its
  // micro-batch of every global batch.
  struct EvalResult {
    double loss = 0;
    uint64_t sequences = 0, dropped = 0;
    double seconds = 0;
  };
  std::optional<TokenDataset> eval_data;
  if (!o.eval_data.empty()) {
    STRATA_ASSIGN_OR_RETURN(TokenDtype eval_dtype, ParseTokenDtype(o.data_dtype));
    STRATA_ASSIGN_OR_RETURN(TokenDataset d,
                            TokenDataset::Open(o.eval_data, static_cast<uint64_t>(mcfg.vocab_size),
                                               eval_dtype));
    eval_data.emplace(std::move(d));
  }
  auto evaluate = [&]() -> Result<EvalResult> {
    const uint64_t seq = static_cast<uint64_t>(seq_len);
    const uint64_t windows = eval_data->size() > seq ? (eval_data->size() - 1) / seq : 0;
    const uint64_t wanted =
        o.eval_sequences > 0 ? std::min<uint64_t>(windows, static_cast<uint64_t>(o.eval_sequences))
                             : windows;
    const uint64_t per_rank = static_cast<uint64_t>(layout.micro_batch);
    const uint64_t global = per_rank * static_cast<uint64_t>(world);
    const uint64_t batches = wanted / global;
    if (batches == 0) {
      return InvalidArgumentError(fmt::format(
          "{} {}: {} tokens hold {} sequence(s) of {} + 1 tokens{}; one evaluation batch needs "
          "{} ({} rank(s) x {} per rank)",
          o.eval_only ? "--data" : "--eval-data", o.eval_data, eval_data->size(), windows, seq,
          wanted < windows
              ? fmt::format(" ({} {})", o.eval_only ? "--sequences" : "--eval-sequences", wanted)
              : "",
          global, world, per_rank));
    }
    const auto t0 = std::chrono::steady_clock::now();
    model::LlamaBatch mb;
    mb.tokens.resize(static_cast<size_t>(per_rank * (seq + 1)));
    double sum = 0;
    for (uint64_t b = 0; b < batches; ++b) {
      for (uint64_t s = 0; s < per_rank; ++s) {
        const uint64_t w = b * global + static_cast<uint64_t>(rank) * per_rank + s;
        STRATA_RETURN_IF_ERROR(eval_data->Read(
            w * seq, std::span<int32_t>(mb.tokens.data() + s * (seq + 1), seq + 1)));
      }
      const zero::Batch* one[1] = {&mb};
      STRATA_ASSIGN_OR_RETURN(double loss, engine->EvalLoss(one));
      sum += loss;
    }
    EvalResult r;
    r.loss = sum / static_cast<double>(batches);
    r.sequences = batches * global;
    r.dropped = wanted - r.sequences;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  auto eval_line = [&](const EvalResult& r) {
    return fmt::format(
        "loss {:.4f}, perplexity {:.4g} over {} sequence(s) x {} tokens of {}{} in {:.2f} s "
        "({:.0f} tok/s)",
        r.loss, std::exp(r.loss), r.sequences, seq_len, o.eval_data,
        r.dropped > 0 ? fmt::format(" ({} left out: not a whole batch of {} rank(s) x {})",
                                    r.dropped, world, layout.micro_batch)
                      : std::string(),
        r.seconds, static_cast<double>(r.sequences * static_cast<uint64_t>(seq_len)) / r.seconds);
  };
  if (o.eval_only) {
    STRATA_ASSIGN_OR_RETURN(const EvalResult r, evaluate());
    say("eval: " + eval_line(r));
    if (!o.eval_json.empty() && rank == 0) {
      nlohmann::json j = {{"model", model_arg},
                          {"data", o.eval_data},
                          {"seq_len", seq_len},
                          {"sequences", r.sequences},
                          {"tokens", r.sequences * static_cast<uint64_t>(seq_len)},
                          {"left_out", r.dropped},
                          {"ranks", world},
                          {"micro_batch", layout.micro_batch},
                          {"loss", r.loss},
                          {"perplexity", std::exp(r.loss)},
                          {"seconds", r.seconds}};
      std::ofstream out(o.eval_json, std::ios::trunc);
      out << j.dump(1) << "\n";
      if (!out) {
        return Status(StatusCode::kPermissionDenied,
                      fmt::format("--json {}: cannot write", o.eval_json));
      }
    }
    return Status::Ok();
  }

  if (resumed) {
    STRATA_RETURN_IF_ERROR(engine->RestoreCounters(resumed->counters)
                               .WithContext(fmt::format("resuming {}", resume_dir)));
    STRATA_RETURN_IF_ERROR(
        sampler->Restore(resumed->sampler).WithContext(fmt::format("resuming {}", resume_dir)));
    if (resumed->global_batch != layout.global_batch()) {
      say(fmt::format("  note: the checkpoint was trained with a global batch of {} sequences, "
                      "this run uses {}: the loss curve continues, but not as the old run would "
                      "have",
                      resumed->global_batch, layout.global_batch()));
    }
    first_step = resumed->step;
    say(fmt::format("  resumed {} at step {} (saved on {} rank(s), now {})", resume_dir,
                    first_step, resumed->world_size, world));
    if (first_step >= o.steps) {
      say(fmt::format("the checkpoint is at step {}; --steps {}: nothing to do", first_step,
                      o.steps));
      return Status::Ok();
    }
  }

  std::unique_ptr<std::ofstream> metrics;
  if (!o.metrics_path.empty() && rank == 0) {
    // A resumed run appends: the file then holds the whole curve (rewritten from the resumed
    // step on if it went further).
    metrics = std::make_unique<std::ofstream>(o.metrics_path,
                                              resumed ? std::ios::app : std::ios::trunc);
    if (!*metrics) {
      return Status(StatusCode::kPermissionDenied,
                    fmt::format("--metrics {}: cannot open for writing", o.metrics_path));
    }
  }

  // DeepSpeed's "tensorboard" and "csv_monitor" sections (rank 0 writes them).
  std::vector<std::unique_ptr<MonitorWriter>> monitors;
  if (rank == 0 && !o.eval_only) {
    STRATA_ASSIGN_OR_RETURN(monitors, CreateMonitors(config));
    for (const auto& m : monitors) say(fmt::format("  monitor: {}", m->where()));
  }

  const double flops_per_token = mcfg.TrainFlopsPerToken(seq_len);
  const uint64_t tokens_per_step = layout.global_batch() * static_cast<uint64_t>(seq_len);
  const size_t row = static_cast<size_t>(seq_len) + 1;
  zero::EngineStats last{};
  std::string last_save;
  // Pageable host<->device copies made by the steps (a bug on a GPU, where they stall the
  // stream): counted by the device, reported per step, zero in every test configuration.
  uint64_t pageable_seen = dev->memory_stats().pageable_copies;
  // A signal, or the launcher gone (mpirun died: this rank was re-parented), stops the run
  // between steps; every rank learns what any rank saw, so all stop after the same step.
  const pid_t launcher_pid = ::getppid();
  auto stop_reason = [&]() -> Result<int> {
    int mine = o.stop_signal ? o.stop_signal() : 0;
    if (launch.launcher != "none" && ::getppid() != launcher_pid) mine = -1;
    if (world == 1) return mine;
    STRATA_ASSIGN_OR_RETURN(std::vector<float> all, agreement->Gather(static_cast<float>(mine)));
    int reason = 0;
    for (float v : all) {
      if (v < 0) return -1;  // a launcher gone outranks a signal: nothing more is written
      if (v > 0 && reason == 0) reason = static_cast<int>(v);
    }
    return reason;
  };
  auto make_state = [&](int64_t done_steps) {
    TrainerState ts;
    ts.step = done_steps;
    ts.counters = engine->counters();
    ts.sampler = sampler->state();
    ts.world_size = world;
    ts.global_batch = layout.global_batch();
    ts.seq_len = static_cast<uint64_t>(seq_len);
    ts.scheduler_total_steps = scheduler_total_steps;
    ts.seed = seed;
    ts.compute_dtype = TorchDtypeName(engine->compute_dtype());
    ts.data_path = o.data;
    ts.data_tokens = data.size();
    return ts;
  };
  SaveOptions save_options;
  save_options.max_shard_bytes = o.max_shard_bytes;
  save_options.lora = lora;
  save_options.print = say;
  double profiled_s = 0.0;  // --profile-ops: the profiled steps' time
  int64_t profiled_steps = 0;
  for (int64_t step = first_step; step < o.steps; ++step) {
    std::vector<model::LlamaBatch> mbs(static_cast<size_t>(layout.grad_accum));
    std::vector<const zero::Batch*> ptrs;
    for (int a = 0; a < layout.grad_accum; ++a) {
      mbs[a].tokens.resize(row * static_cast<size_t>(layout.micro_batch));
      STRATA_RETURN_IF_ERROR(sampler->ReadRankBatch(static_cast<uint64_t>(step), layout, rank, a,
                                                   mbs[a].tokens));
      ptrs.push_back(&mbs[a]);
    }
    STRATA_ASSIGN_OR_RETURN(zero::StepResult r, engine->TrainStep(ptrs));
    sampler->Advance();
    if (o.profile_ops) {  // the first step warms up (allocations, cuBLAS's choices): not profiled
      if (step == first_step) {
        llama->ResetOpProfile();
      } else {
        profiled_s += r.step_s;
        ++profiled_steps;
      }
    }
    const uint64_t pageable_now = dev->memory_stats().pageable_copies;
    const uint64_t pageable = pageable_now - pageable_seen;
    pageable_seen = pageable_now;
    const zero::EngineStats st = engine->stats();
    const double tok_s = static_cast<double>(tokens_per_step) / r.step_s;
    const double tflops = tok_s * flops_per_token / 1e12;
    const uint64_t nvme_read = (st.param_nvme_read_bytes + st.optim_nvme_read_bytes) -
                               (last.param_nvme_read_bytes + last.optim_nvme_read_bytes);
    const uint64_t nvme_write = (st.param_nvme_write_bytes + st.optim_nvme_write_bytes) -
                                (last.param_nvme_write_bytes + last.optim_nvme_write_bytes);
    last = st;
    say(fmt::format(
        "step {:>5} | loss {:.4f} | lr {:.3e} | {:.0f} tok/s | {:.3f} TFLOPS | step {:.3f} s = "
        "compute {:.3f} + comm {:.3f} + io {:.3f} + optim {:.3f} | nvme r {} w {} | prefetch "
        "hit {:.0f}% | peak device {} host {}{}{}",
        step + 1, r.loss, r.lr, tok_s, tflops, r.step_s, r.compute_s, r.exposed_comm_s,
        r.exposed_io_s, r.exposed_optimizer_s, FormatBytes(nvme_read), FormatBytes(nvme_write),
        100.0 * st.prefetch_hit_rate, FormatBytes(st.device_peak_bytes),
        FormatBytes(st.host_peak_bytes),
        !r.skipped                ? ""
        : config.fp16.enabled     ? " | skipped (fp16 overflow)"
                                  : " | skipped (non-finite gradients, strata.on_nonfinite skip)",
        pageable > 0 ? fmt::format(" | {} pageable copies", pageable) : ""));
    std::optional<EvalResult> evaluated;
    if (o.eval_every > 0 && ((step + 1) % o.eval_every == 0 || step + 1 == o.steps)) {
      STRATA_ASSIGN_OR_RETURN(EvalResult e, evaluate());
      say(fmt::format("eval at step {}: {}", step + 1, eval_line(e)));
      evaluated = e;
    }
    if (metrics) {
      const device::PinnedPoolStats pool_stats =
          stack.pool ? stack.pool->stats() : device::PinnedPoolStats{};
      nlohmann::json j = {{"step", step + 1},
                          {"loss", r.loss},
                          {"lr", r.lr},
                          {"grad_norm", r.grad_norm},
                          {"loss_scale", r.loss_scale},
                          {"skipped", r.skipped},
                          {"tokens_per_s", tok_s},
                          {"tflops", tflops},
                          {"step_s", r.step_s},
                          {"compute_s", r.compute_s},
                          {"exposed_comm_s", r.exposed_comm_s},
                          {"exposed_io_s", r.exposed_io_s},
                          {"exposed_optimizer_s", r.exposed_optimizer_s},
                          {"nvme_read_bytes", nvme_read},
                          {"nvme_write_bytes", nvme_write},
                          {"prefetch_hit_rate", st.prefetch_hit_rate},
                          {"device_peak_bytes", st.device_peak_bytes},
                          {"param_device_peak_bytes", st.param_device_peak_bytes},
                          {"param_device_budget_bytes", st.param_device_budget_bytes},
                          {"host_peak_bytes", st.host_peak_bytes},
                          {"pinned_pool_bytes", pool_stats.size},
                          {"pinned_pool_peak_bytes", pool_stats.peak},
                          {"host_rss_peak_bytes", PeakResidentBytes()},
                          {"pageable_copies", pageable},
                          {"model_device_bytes",
                           llama->activation_bytes() + llama->workspace_bytes()}};
      if (evaluated) {
        j["eval_loss"] = evaluated->loss;
        j["eval_perplexity"] = std::exp(evaluated->loss);
      }
      *metrics << j.dump() << "\n";
      metrics->flush();
    }
    if (!monitors.empty()) {
      // DeepSpeed's tags count samples; Strata's own count optimizer steps.
      const int64_t samples = (step + 1) * static_cast<int64_t>(layout.global_batch());
      std::vector<MonitorEvent> events = {
          {"Train/Samples/train_loss", r.loss, samples},
          {"Train/Samples/lr", r.lr, samples},
          {"Train/Strata/tokens_per_s", tok_s, step + 1},
          {"Train/Strata/tflops", tflops, step + 1},
          {"Train/Strata/step_s", r.step_s, step + 1},
          {"Train/Strata/compute_s", r.compute_s, step + 1},
          {"Train/Strata/exposed_comm_s", r.exposed_comm_s, step + 1},
          {"Train/Strata/exposed_io_s", r.exposed_io_s, step + 1},
          {"Train/Strata/exposed_optimizer_s", r.exposed_optimizer_s, step + 1},
          {"Train/Strata/grad_norm", r.grad_norm, step + 1},
          {"Train/Strata/nvme_read_bytes", static_cast<double>(nvme_read), step + 1},
          {"Train/Strata/nvme_write_bytes", static_cast<double>(nvme_write), step + 1},
          {"Train/Strata/device_peak_bytes", static_cast<double>(st.device_peak_bytes), step + 1},
          {"Train/Strata/host_peak_bytes", static_cast<double>(st.host_peak_bytes), step + 1}};
      if (config.fp16.enabled) events.push_back({"Train/Samples/loss_scale", r.loss_scale, samples});
      if (evaluated) {
        events.push_back({"Train/Strata/eval_loss", evaluated->loss, step + 1});
        events.push_back({"Train/Strata/eval_perplexity", std::exp(evaluated->loss), step + 1});
      }
      for (const auto& m : monitors) STRATA_RETURN_IF_ERROR(m->Write(events));
    }
    const bool last_step = step + 1 == o.steps;
    STRATA_ASSIGN_OR_RETURN(const int stop, stop_reason());
    if (stop < 0) {
      return Status(StatusCode::kAborted,
                    fmt::format("after step {}: the launcher ({}) that started this rank is gone; "
                                "stopping without writing anything more",
                                step + 1, launch.launcher));
    }
    const bool periodic = o.save_every > 0 && (step + 1) % o.save_every == 0;
    if (!o.save_dir.empty() && (last_step || periodic || (stop > 0 && o.save_on_signal))) {
      STRATA_ASSIGN_OR_RETURN(last_save, SaveCheckpoint(*engine, *comm, *dev, mcfg,
                                                        make_state(step + 1), o.save_dir,
                                                        save_options));
      pageable_seen = dev->memory_stats().pageable_copies;  // a save's copies are not a step's
    }
    if (stop > 0 && !last_step) {
      if (trace) {
        STRATA_RETURN_IF_ERROR(trace->WriteChromeJson(RankPath(o.trace_path, rank, world)));
      }
      const std::string saved =
          o.save_on_signal && !last_save.empty()
              ? fmt::format("checkpoint {}: continue with --resume {}", last_save, o.save_dir)
          : o.save_dir.empty() || !o.save_on_signal
              ? std::string("nothing saved (--save DIR --save-on-signal saves on a signal)")
              : std::string("nothing saved");
      return Status(StatusCode::kCancelled,
                    fmt::format("stopped by SIG{} after step {} of {}: {}",
                                ::sigabbrev_np(stop) ? ::sigabbrev_np(stop) : "?", step + 1,
                                o.steps, saved));
    }
  }
  if (o.profile_ops) PrintOpProfile(llama->op_profile(), profiled_steps, profiled_s, say);
  if (trace) {
    STRATA_RETURN_IF_ERROR(trace->WriteChromeJson(RankPath(o.trace_path, rank, world)));
    say(fmt::format("trace written to {}", RankPath(o.trace_path, 0, world)));
  }
  if (!last_save.empty()) {
    say(fmt::format("the model is in {} (also {}/latest), in Hugging Face layout: "
                    "transformers.AutoModelForCausalLM.from_pretrained(\"{}\") loads it; "
                    "continue training with --resume {}",
                    last_save, o.save_dir, last_save, o.save_dir));
  }
  return Status::Ok();
}

}  // namespace strata::train
