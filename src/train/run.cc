#include "train/run.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>

#include "common/log.h"
#include "common/units.h"
#include "train/lora_files.h"
#include "zero/partition.h"

namespace strata::train {

namespace {

// Creates `dir` if needed and proves it writable by creating and removing a file in it.
Status ProbeDirectory(const std::string& dir, std::string_view what) {
  FileSystem& fs = LocalFileSystem();
  if (Status st = fs.CreateDirs(dir); !st.ok()) {
    return Status(st.code(), fmt::format("{} {}: {}", what, dir, st.message()));
  }
  const std::string probe =
      (std::filesystem::path(dir) / fmt::format(".strata-probe-{}", ::getpid())).string();
  Result<std::unique_ptr<File>> f = fs.Open(probe, OpenMode::kCreate);
  if (!f.ok()) {
    return Status(f.status().code(), fmt::format("{} {}: cannot write in the directory: {}", what,
                                                 dir, f.status().message()));
  }
  f->reset();
  return fs.RemoveAll(probe);
}

// Opens `path` for appending (creating it, never truncating) to prove it can be written.
Status ProbeFile(const std::string& path, std::string_view what) {
  const std::filesystem::path p(path);
  if (!p.parent_path().empty())
    STRATA_RETURN_IF_ERROR(ProbeDirectory(p.parent_path().string(), what));
  Result<std::unique_ptr<File>> f = LocalFileSystem().Open(path, OpenMode::kAppend);
  if (!f.ok()) {
    return Status(f.status().code(), fmt::format("{} {}: cannot open for writing: {}", what, path,
                                                 f.status().message()));
  }
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
  const std::pair<OffloadDevice, const std::string*> homes[] = {
      {config.zero.offload_param.device, &config.zero.offload_param.nvme_path},
      {config.zero.offload_optimizer.device, &config.zero.offload_optimizer.nvme_path}};
  for (const auto& [device, nvme_path] : homes) {
    if (device == OffloadDevice::kAuto && !nvme_path->empty()) {
      STRATA_RETURN_IF_ERROR(ProbeDirectory(*nvme_path, "nvme_path"));
    }
  }
  return Status::Ok();
}

// The output lock (one run per --save directory: a second would race for `latest`; rank 0
// saves), the trace recorder and the device and collective.
Status OpenRuntimeOf(const RunPlan& plan, Run* run) {
  const TrainOptions& o = plan.options;
  if (!o.save_dir.empty() && plan.rank() == 0) {
    STRATA_ASSIGN_OR_RETURN(
        run->save_lock,
        FileLock::Acquire(o.save_dir, "checkpoint directory",
                          (std::filesystem::path(o.save_dir) / ".strata.lock").string()));
  }
  if (!o.trace_path.empty()) {
    run->trace = std::make_unique<TraceRecorder>(plan.rank(), fmt::format("rank {}", plan.rank()));
  }
  RuntimeOptions ropt;
  if (!o.device.empty()) {
    STRATA_ASSIGN_OR_RETURN(ropt.device, ParseDeviceKind(o.device));
  }
  ropt.trace = run->trace.get();
  ropt.launch = plan.launch;
  STRATA_ASSIGN_OR_RETURN(run->runtime, OpenRuntime(plan.config, ropt));
  if (run->rank() != plan.rank() || run->world() != plan.world()) {
    return InternalError(
        fmt::format("the collective is rank {} of {}, the launcher said rank {} of {}", run->rank(),
                    run->world(), plan.rank(), plan.world()));
  }
  auto print = plan.options.print ? plan.options.print : [](const std::string& line) {
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
  };
  run->say = [print, rank = plan.rank()](const std::string& line) {
    if (rank == 0) print(line);
  };
  return Status::Ok();
}

// Prepared data names the tokenizer it was made with; the model directory's must be the same
// one (a different tokenizer's ids would train silently on the wrong text).
Status CheckTokenizer(const RunPlan& plan, const TrainingData& data, const std::string& flag) {
  const PreparedTokens* p = data.prepared_tokens();
  if (p == nullptr || plan.model_dir.empty()) return Status::Ok();
  Result<std::string> hash = TokenizerHash(plan.model_dir);
  if (!hash.ok()) return Status::Ok();  // no tokenizer.json: a preset or a bare config
  if (*hash != p->tokenizer_hash()) {
    return InvalidArgumentError(fmt::format(
        "{} {}: prepared with a tokenizer whose hash is {}, but {}'s tokenizer hashes to {}: the "
        "token ids would mean other text. Prepare the data again with this model (strata data "
        "prepare --model {} ...)",
        flag, data.path(), p->tokenizer_hash(), plan.model_dir, *hash, plan.model_dir));
  }
  return Status::Ok();
}

Status OpenData(const RunPlan& plan, Run* run) {
  STRATA_ASSIGN_OR_RETURN(run->data, TrainingData::Open(plan.options.data, plan.data));
  STRATA_RETURN_IF_ERROR(CheckTokenizer(plan, *run->data, "--data"));
  if (!plan.eval_only()) {
    STRATA_ASSIGN_OR_RETURN(
        SequenceSampler s,
        run->data->prepared()
            ? SequenceSampler::Create(run->data->rows(), run->data->path(), plan.sampler)
            : SequenceSampler::Create(run->data->stream(), plan.sampler));
    run->sampler.emplace(std::move(s));
  }
  return Status::Ok();
}

// "auto" offload homes: the planner chooses on every rank, and every rank learns every rank's
// choice (-1: its planner failed), so that none waits in a collective for a rank that stopped.
Status AgreeOnPlacement(RunPlan* plan, Run* run, const MachineFacts& machine) {
  if (!HasAutoOffload(plan->config)) return Status::Ok();
  Result<std::optional<PlacementChoice>> planned = PlanRunPlacement(*plan, machine);
  const float mine = planned.ok() ? (*planned)->fingerprint : -1.0f;
  std::vector<float> all = {mine};
  if (run->world() > 1) {
    STRATA_ASSIGN_OR_RETURN(all, run->agreement->Gather(mine));
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
  STRATA_RETURN_IF_ERROR(ApplyPlacement(&plan->config, (*planned)->candidate));
  run->placement_lines = std::move((*planned)->lines);
  return Status::Ok();
}

Status BuildModel(const RunPlan& plan, Run* run) {
  const MemoryChoice& memory = run->memory;
  STRATA_ASSIGN_OR_RETURN(
      run->model,
      model::LlamaModel::Create(run->device(), plan.model, plan.seq_len, plan.layout.micro_batch,
                                plan.config.strata.seed,
                                {.allow_tf32 = plan.config.strata.tf32,
                                 .profile_ops = plan.options.profile_ops,
                                 .lora = plan.lora,
                                 .keep_activations = memory.keep_activations,
                                 .split_blocks = memory.split_blocks,
                                 .offload_checkpoints = memory.offload_checkpoints,
                                 .tensor_parallel = {.rank = run->runtime.tensor_parallel_rank(),
                                                     .size = plan.tensor_parallel(),
                                                     .group = run->runtime.tensor_parallel.get()},
                                 .attention_dtype = zero::ComputeDType(plan.config),
                                 .activation_dtype = model::LlamaActivationDType(
                                     run->device().type(), zero::ComputeDType(plan.config))}));
  run->parts = TensorParts::Of(*run->model);
  // Frozen parameters (strata.freeze / strata.trainable), whole units.
  const Config& config = plan.config;
  STRATA_ASSIGN_OR_RETURN(run->frozen, zero::FrozenUnits(run->model->units(), config.strata.freeze,
                                                         config.strata.trainable));
  if (!plan.eval_only() && std::count(run->frozen.begin(), run->frozen.end(), 1) ==
                               static_cast<std::ptrdiff_t>(run->frozen.size())) {
    return InvalidArgumentError(fmt::format(
        "{}: every parameter is frozen; there is nothing to train (strata eval evaluates a "
        "model)",
        config.strata.freeze.empty() ? "strata.trainable" : "strata.freeze"));
  }
  return Status::Ok();
}

// " with ZeRO++ qwZ, hpZ 2, qgZ": the ZeRO++ features the config turns on.
std::string ZeroPlusPlusNames(const Config& config) {
  std::vector<std::string> on;
  if (config.zero.zero_quantized_weights) on.push_back("qwZ");
  if (config.zero.zero_hpz_partition_size > 1) {
    on.push_back(fmt::format("hpZ {}", config.zero.zero_hpz_partition_size));
  }
  if (config.zero.zero_quantized_gradients) on.push_back("qgZ");
  return on.empty() ? std::string() : fmt::format(" with ZeRO++ {}", fmt::join(on, ", "));
}

std::string ModelLine(const RunPlan& plan, const Run& run) {
  const Config& config = plan.config;
  return fmt::format(
      "strata {}: model {} ({:.1f}M parameters, {} layers), {} rank(s){}{}, ZeRO stage {}{}, "
      "parameters on {}, {}{}, {}",
      plan.eval_only() ? "eval" : "train", plan.model.name,
      static_cast<double>(plan.model.ParameterCount()) / 1e6, plan.model.num_hidden_layers,
      run.world(),
      plan.tensor_parallel() > 1 ? fmt::format(" (tensor parallelism {} x data parallelism {})",
                                               plan.tensor_parallel(), plan.data_world())
                                 : std::string(),
      run.runtime.topology.nodes() > 1 ? " on " + run.runtime.topology.Describe() : std::string(),
      config.zero.stage, ZeroPlusPlusNames(config),
      OffloadDeviceName(config.zero.offload_param.device),
      plan.eval_only()
          ? "forward only (no optimizer state)"
          : fmt::format("optimizer on {}", OffloadDeviceName(config.zero.offload_optimizer.device)),
      config.zero.offload_optimizer.device != OffloadDevice::kNone &&
              config.zero.offload_optimizer.ratio < 1.0
          ? fmt::format(" (ratio {:g}; the other units' states on the device)",
                        config.zero.offload_optimizer.ratio)
          : std::string(),
      PrecisionName(config.precision()));
}

std::string DeviceLine(const RunPlan& plan, const Run& run) {
  const MemoryChoice& m = run.memory;
  const model::LlamaModel& llama = *run.model;
  return fmt::format(
      "  device: {}; device memory budget {}, activations {} ({}){}", run.runtime.choice.reason,
      FormatBytes(run.device().memory_stats().budget),
      FormatBytes(llama.activation_bytes() + llama.workspace_bytes()),
      plan.eval_only() ? "forward only"
      : m.split_blocks && m.keep_activations
          ? "every block's kept; each block as four units, strata.split_blocks"
      : m.split_blocks     ? "checkpointed: each block recomputed part by part in backward, "
                             "strata.split_blocks"
      : m.keep_activations ? "every block's kept: no recomputation"
                           : "checkpointed: each block recomputed in backward",
      m.offload_checkpoints
          ? fmt::format("; {} of checkpoints in host memory, strata.offload_checkpoints",
                        FormatBytes(llama.checkpoint_host_bytes()))
          : std::string());
}

void AddLoraLines(const RunPlan& plan, const Run& run, std::vector<std::string>* lines) {
  const model::LlamaLora& lora = plan.lora;
  if (!lora.enabled()) return;
  int64_t adapter_params = 0;
  for (const auto& u : run.model->units()) {
    for (const auto& p : u.params) {
      if (model::IsLoraParamName(p.name)) adapter_params += p.numel();
    }
  }
  lines->push_back(
      fmt::format("  LoRA: r {}, lora_alpha {:g} (scale {:g}) on {}: {:.3f}M adapter parameters{}",
                  lora.rank, lora.alpha, lora.scale, fmt::join(lora.target_names(), ", "),
                  static_cast<double>(adapter_params) / 1e6,
                  plan.adapter_dir.empty() ? std::string()
                                           : fmt::format(", loaded from {}", plan.adapter_dir)));
  if (!plan.adapter_note.empty()) lines->push_back("  note: " + plan.adapter_note);
}

void AddFrozenLine(const RunPlan& plan, const Run& run, std::vector<std::string>* lines) {
  const std::vector<char>& frozen = run.frozen;
  const auto count = std::count(frozen.begin(), frozen.end(), 1);
  if (plan.eval_only() || count == 0) return;
  const std::vector<zero::UnitSpec> units = run.model->units();
  int64_t all = 0, trained = 0;
  std::string names;
  for (size_t u = 0; u < units.size(); ++u) {
    int64_t n = 0;
    for (const auto& p : units[u].params)
      n += p.numel();
    all += n;
    if (frozen[u]) {
      names += (names.empty() ? "" : ", ") + units[u].name;
    } else {
      trained += n;
    }
  }
  lines->push_back(fmt::format(
      "  frozen ({}): {} of {} units ({}); {:.2f}M of {:.2f}M parameters train",
      plan.config.strata.freeze.empty() ? "strata.trainable" : "strata.freeze", count, units.size(),
      names, static_cast<double>(trained) / 1e6, static_cast<double>(all) / 1e6));
}

std::string DataLine(const RunPlan& plan, const Run& run) {
  const TrainOptions& o = plan.options;
  const BatchLayout& layout = plan.layout;
  if (plan.eval_only()) {
    return fmt::format("  data {} ({}), sequences of {} tokens, {} per rank per pass", o.data,
                       run.data->Describe(), plan.seq_len, layout.micro_batch);
  }
  return fmt::format(
      "  data {} ({}), sequence {} x global batch {} ({} per rank x {} accumulation), {} "
      "steps{}",
      o.data, run.data->Describe(), plan.seq_len, layout.global_batch(), layout.micro_batch,
      layout.grad_accum, o.steps,
      o.eval_every > 0 ? fmt::format("; validation on {} every {} steps", o.eval_data, o.eval_every)
                       : std::string());
}

// Initial states: a checkpoint (every byte read back is checked first, the ranks sharing the
// work: a damaged checkpoint is an error naming the file and tensor, never weights that train
// on silently), a model directory's weights, or the model's own init (null).
Status OpenStateFiles(const RunPlan& plan, Run* run) {
  const std::vector<zero::UnitSpec> units = run->model->units();
  if (plan.resumed) {
    STRATA_RETURN_IF_ERROR(VerifyCheckpoint(plan.resume_dir, run->comm(), run->device(), run->say));
    STRATA_ASSIGN_OR_RETURN(
        run->files, StateFiles::OpenCheckpoint(plan.resume_dir, units, run->frozen, run->parts));
  } else if (HasWeights(plan.model_dir)) {
    STRATA_ASSIGN_OR_RETURN(
        run->files, StateFiles::OpenWeights(plan.model_dir, units, plan.adapter_dir, run->parts));
  } else if (!plan.adapter_dir.empty()) {
    return InvalidArgumentError(
        fmt::format("--adapter {}: adapters need the base model's weights, and {} holds none "
                    "(model.safetensors)",
                    plan.adapter_dir, plan.model_arg));
  } else if (std::filesystem::is_directory(plan.model_dir)) {
    run->say(fmt::format("  {} holds no weights (model.safetensors): starting from random weights",
                         plan.model_dir));
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Run>> OpenRun(RunPlan* plan) {
  auto run = std::make_unique<Run>();
  STRATA_RETURN_IF_ERROR(ProbeOutputs(plan->options, plan->config, plan->launch));
  STRATA_RETURN_IF_ERROR(OpenRuntimeOf(*plan, run.get()));
  STRATA_RETURN_IF_ERROR(OpenData(*plan, run.get()));
  if (run->world() > 1) {
    STRATA_ASSIGN_OR_RETURN(run->agreement, RankGather::Create(run->device(), run->comm()));
  }
  MachineFacts machine;
  machine.device = run->device().type();
  machine.device_budget = run->device().memory_stats().budget;
  if (HasAutoOffload(plan->config)) {
    machine.hardware = MachineHardware(run->device(), plan->launch, plan->config);
  }
  STRATA_RETURN_IF_ERROR(AgreeOnPlacement(plan, run.get(), machine));
  // The run's memory plan per rank, against the device budget before anything is allocated.
  STRATA_ASSIGN_OR_RETURN(run->memory, PlanRunMemory(*plan, machine));
  if (!run->memory.warning.empty() && run->rank() == 0) {
    STRATA_LOG(warn, train, "{}", run->memory.warning);  // the same on every rank
  }
  STRATA_RETURN_IF_ERROR(BuildModel(*plan, run.get()));
  return run;
}

std::vector<std::string> DescribeRun(const RunPlan& plan, const Run& run) {
  std::vector<std::string> lines = {ModelLine(plan, run), DeviceLine(plan, run)};
  lines.insert(lines.end(), run.placement_lines.begin(), run.placement_lines.end());
  AddLoraLines(plan, run, &lines);
  AddFrozenLine(plan, run, &lines);
  lines.push_back(DataLine(plan, run));
  return lines;
}

// How many sequences an evaluation reads (the data's rows, or fewer with --eval-sequences) and in
// how many whole batches (each global: micro-batch x ranks); an error naming the file when they
// make less than one batch. Checked when the data is opened, so that a training run does not stop
// at its first evaluation.
struct EvalSize {
  uint64_t wanted = 0;
  uint64_t batches = 0;
};
static Result<EvalSize> EvalBatches(const RunPlan& plan, const TrainingData& data, int world) {
  const TrainOptions& o = plan.options;
  const uint64_t rows = data.rows();
  const uint64_t wanted = o.eval_sequences > 0
                              ? std::min<uint64_t>(rows, static_cast<uint64_t>(o.eval_sequences))
                              : rows;
  const uint64_t per_rank = static_cast<uint64_t>(plan.layout.micro_batch);
  const uint64_t global = per_rank * static_cast<uint64_t>(world);
  const uint64_t batches = wanted / global;
  if (batches == 0) {
    return InvalidArgumentError(fmt::format(
        "{} {} ({}): {} sequence(s) of {} + 1 tokens{}; one evaluation batch needs {} "
        "({} rank(s) x {} per rank)",
        o.eval_only ? "--data" : "--eval-data", o.eval_data, data.Describe(), rows, plan.seq_len,
        wanted < rows
            ? fmt::format(" ({} {})", o.eval_only ? "--sequences" : "--eval-sequences", wanted)
            : "",
        global, world, per_rank));
  }
  return EvalSize{wanted, batches};
}

Status LoadRun(const RunPlan& plan, Run* run) {
  STRATA_RETURN_IF_ERROR(OpenStateFiles(plan, run));
  const auto t0 = std::chrono::steady_clock::now();
  BuildOptions build;
  if (run->files) {
    run->say(fmt::format("  loading {} from {} ({} over all ranks)",
                         run->files->has_optimizer() ? "weights and optimizer states" : "weights",
                         run->files->source(), FormatBytes(run->files->total_bytes())));
    build.initial =
        run->files->Initial(UnitProgress(run->rank() == 0 ? run->say : nullptr, "loading"));
  }
  build.trace = run->trace.get();
  STRATA_ASSIGN_OR_RETURN(run->stack,
                          BuildEngine(run->runtime, *run->model, plan.config, std::move(build)));
  const Config& config = plan.config;
  if (config.zero.stage > 0 && config.zero.offload_optimizer.device != OffloadDevice::kNone) {
    run->say(fmt::format("  CPU AdamW: {} thread(s) per rank (strata.cpu_adam_threads{})",
                         run->stack.cpu_adam_threads,
                         config.strata.cpu_adam_threads ? "" : " auto"));
  }
  if (run->files) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    run->say(fmt::format("  loaded in {:.1f} s ({:.0f} MB/s over all ranks)", s,
                         static_cast<double>(run->files->total_bytes()) / std::max(s, 1e-6) / 1e6));
  }
  if (!plan.options.eval_data.empty()) {
    STRATA_ASSIGN_OR_RETURN(run->eval_data, TrainingData::Open(plan.options.eval_data, plan.data));
    STRATA_RETURN_IF_ERROR(CheckTokenizer(plan, *run->eval_data, "--eval-data"));
    const Result<EvalSize> size = EvalBatches(plan, *run->eval_data, plan.data_world());
    if (!size.ok()) return size.status();
  }
  return Status::Ok();
}

Result<bool> ResumeRun(const RunPlan& plan, Run* run) {
  if (!plan.resumed) return true;
  const TrainerState& resumed = *plan.resumed;
  const std::string context = fmt::format("resuming {}", plan.resume_dir);
  STRATA_RETURN_IF_ERROR(run->engine().RestoreCounters(resumed.counters).WithContext(context));
  STRATA_RETURN_IF_ERROR(run->sampler->Restore(resumed.sampler).WithContext(context));
  if (resumed.global_batch != plan.layout.global_batch()) {
    run->say(fmt::format(
        "  note: the checkpoint was trained with a global batch of {} sequences, this run uses "
        "{}: the loss curve continues, but not as the old run would have",
        resumed.global_batch, plan.layout.global_batch()));
  }
  run->first_step = resumed.step;
  const auto tp = [](int t) {
    return t > 1 ? fmt::format(" with tensor parallelism {}", t) : std::string();
  };
  run->say(fmt::format("  resumed {} at step {} (saved on {} rank(s){}, now {}{})", plan.resume_dir,
                       run->first_step, resumed.world_size, tp(resumed.tensor_parallel),
                       run->world(), tp(plan.tensor_parallel())));
  if (run->first_step >= plan.options.steps) {
    run->say(fmt::format("the checkpoint is at step {}; --steps {}: nothing to do", run->first_step,
                         plan.options.steps));
    return false;
  }
  return true;
}

Result<EvalResult> Evaluate(const RunPlan& plan, Run& run) {
  const TrainingData& data = *run.eval_data;
  const uint64_t per_rank = static_cast<uint64_t>(plan.layout.micro_batch);
  const uint64_t global = per_rank * static_cast<uint64_t>(plan.data_world());
  STRATA_ASSIGN_OR_RETURN(const EvalSize size, EvalBatches(plan, data, plan.data_world()));
  const uint64_t batches = size.batches;
  const auto t0 = std::chrono::steady_clock::now();
  model::LlamaBatch mb;
  std::vector<uint64_t> mine(per_rank), all(global);
  // Each batch's loss is the mean over its trained targets (LossWeights with one micro-batch);
  // the batches are then weighted by their targets, so the result is the mean over all of them.
  double sum = 0;
  uint64_t targets = 0;
  for (uint64_t b = 0; b < batches; ++b) {
    for (uint64_t s = 0; s < global; ++s)
      all[s] = b * global + s;
    for (uint64_t s = 0; s < per_rank; ++s) {
      mine[s] = b * global + static_cast<uint64_t>(plan.data_rank()) * per_rank + s;
    }
    STRATA_ASSIGN_OR_RETURN(const uint64_t n, data.Read(mine, &mb));
    uint64_t batch_targets = n * static_cast<uint64_t>(plan.data_world());
    if (data.prepared()) {
      STRATA_ASSIGN_OR_RETURN(batch_targets, data.TrainedTargets(all));
      const uint64_t one[1] = {n};
      mb.loss_weight = LossWeights(one, batch_targets, plan.data_world())[0];
    }
    const zero::Batch* one[1] = {&mb};
    STRATA_ASSIGN_OR_RETURN(double loss, run.engine().EvalLoss(one));
    sum += data.prepared() ? loss * static_cast<double>(batch_targets) : loss;
    targets += batch_targets;
  }
  EvalResult r;
  r.loss = data.prepared() ? (targets > 0 ? sum / static_cast<double>(targets) : 0.0)
                           : sum / static_cast<double>(batches);
  r.sequences = batches * global;
  r.targets = targets;
  r.dropped = size.wanted - r.sequences;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::string EvalLine(const RunPlan& plan, const Run& /*run*/, const EvalResult& r) {
  return fmt::format(
      "loss {:.4f}, perplexity {:.4g} over {} sequence(s) x {} tokens of {}{} in {:.2f} s ({:.0f} "
      "tok/s)",
      r.loss, std::exp(r.loss), r.sequences, plan.seq_len, plan.options.eval_data,
      r.dropped > 0 ? fmt::format(" ({} left out: not a whole batch of {} rank(s) x {})", r.dropped,
                                  plan.data_world(), plan.layout.micro_batch)
                    : std::string(),
      r.seconds,
      static_cast<double>(r.sequences * static_cast<uint64_t>(plan.seq_len)) / r.seconds);
}

Status WriteEvalJson(const RunPlan& plan, const Run& run, const EvalResult& r) {
  const TrainOptions& o = plan.options;
  if (o.eval_json.empty() || run.rank() != 0) return Status::Ok();
  const nlohmann::json j = {{"model", plan.model_arg},
                            {"data", o.eval_data},
                            {"seq_len", plan.seq_len},
                            {"sequences", r.sequences},
                            {"tokens", r.sequences * static_cast<uint64_t>(plan.seq_len)},
                            {"targets", r.targets},
                            {"left_out", r.dropped},
                            {"ranks", run.world()},
                            {"micro_batch", plan.layout.micro_batch},
                            {"loss", r.loss},
                            {"perplexity", std::exp(r.loss)},
                            {"seconds", r.seconds}};
  const std::string text = j.dump(1) + "\n";
  Result<std::unique_ptr<File>> out = LocalFileSystem().Open(o.eval_json, OpenMode::kCreate);
  Status st = out.ok() ? (*out)->WriteAt(0, text.data(), text.size()) : out.status();
  if (!st.ok()) return st.WithContext("--json");
  return Status::Ok();
}

}  // namespace strata::train
