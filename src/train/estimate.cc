#include "train/estimate.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/units.h"
#include "model/llama_model.h"
#include "model/llama_ops.h"
#include "train/lora_files.h"
#include "zero/partition.h"

namespace strata::train {

uint64_t MemoryEstimate::device_peak() const {
  return activations + workspace + rank_agreement + engine.device_total();
}

namespace {

// The estimate with split blocks on or off (strata.split_blocks resolved).
Result<MemoryEstimate> EstimateMemoryAs(const EstimateInput& in, bool split) {
  if (in.world_size < 1) {
    return InvalidArgumentError(fmt::format("world size {}: expected at least 1", in.world_size));
  }
  // Tensor parallelism: a rank holds its part of the model, and ZeRO partitions over the
  // data-parallel ranks.
  const int tp = in.config.tensor_parallel_size;
  if (in.world_size % tp != 0) {
    return InvalidArgumentError(fmt::format(
        "tensor_parallel.autotp_size {} does not divide the {} rank(s)", tp, in.world_size));
  }
  STRATA_ASSIGN_OR_RETURN(const model::LlamaConfig part,
                          model::LlamaTensorParallelConfig(in.model, tp));
  const int dp = in.world_size / tp;
  STRATA_ASSIGN_OR_RETURN(BatchSizes batch, ResolveBatchSizes(in.config.batch, dp));
  MemoryEstimate e;
  e.world_size = in.world_size;
  e.tensor_parallel = tp;
  e.data_parallel = dp;
  e.seq_len = in.seq_len > 0 ? in.seq_len
                             : std::min<int64_t>(256, part.max_position_embeddings);
  e.micro_batch = batch.train_micro_batch_size_per_gpu;
  e.stage = in.config.zero.stage;
  if (e.seq_len > part.max_position_embeddings) {
    return InvalidArgumentError(fmt::format(
        "sequence length {} is outside [1, max_position_embeddings = {}] of model '{}'", e.seq_len,
        part.max_position_embeddings, part.name));
  }
  e.parameters = static_cast<uint64_t>(part.ParameterCount());
  // The model (llama_model.cc SetUp): one device block for every activation, the CUDA ops'
  // workspace beside it; both charged rounded up to 256 bytes.
  auto charged = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
  STRATA_ASSIGN_OR_RETURN(const model::LlamaLora lora, model::ResolveLlamaLora(in.config.strata.lora));
  Config config = in.config;
  AddLoraTrainablePatterns(&config);
  // Activations in the run's dtype: 16 bits on CUDA with bf16 or fp16 compute.
  e.activation_dtype = model::LlamaActivationDType(in.device, zero::ComputeDType(config));
  e.activations_checkpointed = charged(model::LlamaActivationBytes(
      part, e.seq_len, e.micro_batch, lora, false, false, tp > 1, 0, e.activation_dtype));
  e.activations_kept = charged(model::LlamaActivationBytes(
      part, e.seq_len, e.micro_batch, lora, true, false, tp > 1, 0, e.activation_dtype));
  if (in.device == device::DeviceType::kCuda) {
    e.workspace = charged(model::CudaLlamaOpsWorkspaceBytes(
        model::LlamaOpsShapeFor(part, e.seq_len, e.micro_batch, tp > 1, e.activation_dtype)));
  }
  // The trainer's stop agreement (RankGather), on several ranks.
  if (in.world_size > 1) e.rank_agreement = charged(static_cast<uint64_t>(in.world_size) * 4);

  e.split_blocks = split;
  const int n = model::LlamaNumUnits(part, lora, split);
  std::vector<zero::UnitSpec> units;
  std::vector<std::vector<int>> shared(static_cast<size_t>(n));
  for (int u = 0; u < n; ++u) {
    units.push_back({fmt::format("unit {}", u), model::LlamaUnitParams(part, u, lora, split)});
    // LlamaModel::SharedUnits: a LoRA block reads its adapter unit.
    if (model::LlamaUnitAt(part, lora, u, split).kind == model::LlamaUnit::kBlock &&
        lora.enabled()) {
      shared[static_cast<size_t>(u)] = {u - 1};
    }
  }
  if (part.tie_word_embeddings && n > 1) shared.back() = {0};  // LlamaModel::SharedUnits
  STRATA_ASSIGN_OR_RETURN(const std::vector<zero::UnitLayout> layouts,
                          zero::LayoutModel(units, dp));
  e.units = n;
  for (const auto& l : layouts) {
    e.padded_elems += static_cast<uint64_t>(l.padded_numel());
    e.shard_elems += static_cast<uint64_t>(l.shard_numel);
    e.max_shard_elems = std::max<uint64_t>(e.max_shard_elems, static_cast<uint64_t>(l.shard_numel));
  }
  const int depth = static_cast<int>(
      std::clamp<int64_t>(in.config.zero.offload_optimizer.buffer_count, 3, 1024));
  STRATA_ASSIGN_OR_RETURN(e.engine, zero::Engine::PlanMemory(units, shared, config,
                                                             dp, depth, in.device));
  // Parameters with the adapters, and those that train (frozen units: strata.freeze /
  // trainable, every base unit under LoRA).
  STRATA_ASSIGN_OR_RETURN(const std::vector<char> frozen,
                          zero::FrozenUnits(units, config.strata.freeze, config.strata.trainable));
  e.parameters = 0;
  e.lora = lora.enabled();
  e.from_weights = in.from_weights;
  e.with_moments = in.with_moments;
  for (size_t u = 0; u < units.size(); ++u) {
    for (const auto& p : units[u].params) {
      e.parameters += static_cast<uint64_t>(p.numel());
      if (!frozen[u]) e.trainable_parameters += static_cast<uint64_t>(p.numel());
    }
  }
  // Activation checkpointing: "auto" keeps every block's internals when the whole device peak
  // with them fits the budget.
  switch (in.config.strata.activation_checkpointing) {
    case Toggle::kOn:
      e.checkpointing = true;
      break;
    case Toggle::kOff:
      e.checkpointing = false;
      break;
    case Toggle::kAuto:
      e.activations = e.activations_kept;
      // Offloading checkpoints (strata.offload_checkpoints on) needs them.
      e.checkpointing = in.device_budget == 0 || e.device_peak() > in.device_budget ||
                        in.config.strata.offload_checkpoints == Toggle::kOn;
      break;
  }
  // Split blocks with checkpointing gather a block's first three parts again in backward
  // (LlamaModel::RecomputeUnits): the step's transients follow that order.
  if (split && e.checkpointing) {
    std::vector<std::vector<int>> recompute(static_cast<size_t>(n));
    for (int u = 0; u < n; ++u) {
      recompute[static_cast<size_t>(u)] = model::LlamaRecomputeUnits(part, u, true, false);
      for (const int r : recompute[static_cast<size_t>(u)]) {
        e.recompute_padded_elems += static_cast<uint64_t>(layouts[static_cast<size_t>(r)].padded_numel());
        e.recompute_shard_elems += static_cast<uint64_t>(layouts[static_cast<size_t>(r)].shard_numel);
      }
    }
    STRATA_ASSIGN_OR_RETURN(e.engine, zero::Engine::PlanMemory(units, shared, config, dp,
                                                               depth, in.device, recompute));
  }
  e.activations = e.checkpointing ? e.activations_checkpointed : e.activations_kept;
  // Checkpoints in host memory: "auto" when the device plan with them on the device exceeds
  // the budget. Nothing to offload with two blocks or fewer.
  const Toggle offload = in.config.strata.offload_checkpoints;
  e.offload_checkpoints =
      e.checkpointing && model::LlamaOffloadedCheckpoints(part, false, true) > 0 &&
      (offload == Toggle::kOn ||
       (offload == Toggle::kAuto && in.device_budget > 0 && e.device_peak() > in.device_budget));
  if (e.offload_checkpoints) {
    e.activations = charged(model::LlamaActivationBytes(part, e.seq_len, e.micro_batch, lora, false,
                                                        true, tp > 1, 0, e.activation_dtype));
    e.checkpoint_host_bytes = model::LlamaCheckpointHostBytes(part, e.seq_len, e.micro_batch, false,
                                                              true, e.activation_dtype);
  }
  return e;
}

}  // namespace

Result<MemoryEstimate> EstimateMemory(const EstimateInput& in) {
  const Toggle split = in.config.strata.split_blocks;
  if (split != Toggle::kAuto) return EstimateMemoryAs(in, split == Toggle::kOn);
  // "auto": whole blocks unless their plan exceeds the device budget and split blocks' is
  // smaller (never with LoRA, whose trained units are small already).
  STRATA_ASSIGN_OR_RETURN(MemoryEstimate whole, EstimateMemoryAs(in, false));
  if (in.device_budget == 0 || whole.device_peak() <= in.device_budget ||
      in.config.strata.lora.enabled()) {
    return whole;
  }
  Result<MemoryEstimate> parts = EstimateMemoryAs(in, true);
  if (parts.ok() && parts->device_peak() < whole.device_peak()) return parts;
  return whole;
}

Status CheckDevicePlan(const MemoryEstimate& e, uint64_t budget, std::string* warning) {
  warning->clear();
  std::vector<zero::MemoryPlanItem> parts = {{"activations", e.activations},
                                             {"CUDA op workspace", e.workspace}};
  for (const auto& i : e.engine.device) parts.push_back(i);
  uint64_t setup = e.rank_agreement;
  for (const auto& i : parts) setup += i.bytes;
  if (setup > budget) {
    std::sort(parts.begin(), parts.end(),
              [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
    std::string largest;
    for (size_t i = 0; i < parts.size() && i < 3 && parts[i].bytes > 0; ++i) {
      largest += fmt::format("{}{} {}", i == 0 ? "" : ", ", parts[i].what, FormatBytes(parts[i].bytes));
    }
    const int stage = e.stage;
    const char* advice =
        stage == 0 ? "ZeRO stages 1-3 partition the states across ranks and can offload the "
                     "optimizer (offload_optimizer); a shorter micro-batch or sequence shrinks "
                     "the activations"
        : stage < 3 ? "offload the optimizer states (offload_optimizer cpu or nvme), use stage 3 "
                      "to partition or offload the parameters, add ranks, or shorten the "
                      "micro-batch or sequence"
                    : "offload the parameters and optimizer states (offload_param, "
                      "offload_optimizer: cpu or nvme), add ranks, or shorten the micro-batch or "
                      "sequence";
    return ResourceExhaustedError(fmt::format(
        "device memory: this run needs {} per rank before its first step ({}), more than the "
        "device budget of {} (strata.memory.device_budget; `strata estimate` gives every part). "
        "To fit: {}",
        FormatBytes(setup), largest, FormatBytes(budget), advice));
  }
  if (e.device_peak() > budget) {
    *warning = fmt::format(
        "device memory: the step's transient buffers may take the run to {} per rank, above the "
        "device budget of {}; {}",
        FormatBytes(e.device_peak()), FormatBytes(budget),
        e.stage == 3 ? "lower stage3_max_live_parameters (gathered units and gradients) or "
                       "stage3_prefetch_bucket_size (cached offloaded shards) if a step runs out"
                     : "the per-unit gradient buffers (two of the largest unit in fp32) are the "
                       "least a step needs; a smaller model unit or a larger budget is needed if "
                       "a step runs out");
  }
  return Status::Ok();
}

namespace {

std::string Line(std::string_view what, uint64_t bytes) {
  return fmt::format("  {:<72} {:>12}\n", what, FormatBytes(bytes));
}

}  // namespace

std::string FormatMemoryEstimate(const MemoryEstimate& e) {
  std::string out = fmt::format(
      "memory per rank: {:.1f}M parameters{}, {} rank(s){}, micro-batch {} x {} tokens\n",
      static_cast<double>(e.parameters) / 1e6,
      e.trainable_parameters < e.parameters
          ? fmt::format(" of which {:.1f}M train ({})",
                        static_cast<double>(e.trainable_parameters) / 1e6,
                        e.lora ? "LoRA: the base weights are frozen" : "the rest are frozen")
          : std::string(),
      e.world_size,
      e.tensor_parallel > 1
          ? fmt::format(" = tensor-parallel {} x data-parallel {}", e.tensor_parallel,
                        e.data_parallel)
          : std::string(),
      e.micro_batch, e.seq_len);
  out += "device\n";
  out += e.offload_checkpoints
             ? Line(e.split_blocks
                        ? "activations (checkpoints in host memory, recomputed part by part)"
                        : "activations (checkpoints in host memory, each block recomputed)",
                    e.activations)
         : e.checkpointing
             ? Line(e.split_blocks
                        ? "activations (one micro-batch; checkpointed, recomputed part by part)"
                        : "activations (one micro-batch; checkpointed, each block recomputed)",
                    e.activations)
             : Line("activations (one micro-batch; every block's kept, none recomputed)",
                    e.activations);
  if (e.activation_dtype != device::DType::kF32) {
    out += fmt::format("  (activations in {}; their statistics and the loss in fp32)\n",
                       device::DTypeName(e.activation_dtype));
  }
  out += e.checkpointing
             ? Line("  (without checkpointing they would take)", e.activations_kept)
             : Line("  (with checkpointing they would take)", e.activations_checkpointed);
  if (e.workspace > 0) out += Line("CUDA op workspace", e.workspace);
  if (e.rank_agreement > 0) out += Line("per-step rank agreement", e.rank_agreement);
  for (const auto& i : e.engine.device) out += Line(i.what, i.bytes);
  for (const auto& i : e.engine.device_step) out += Line("step: " + i.what, i.bytes);
  out += Line("device peak", e.device_peak());
  out += "pinned host\n";
  out += Line("pinned pool (strata.memory.pinned_pool \"auto\")", e.engine.pinned_pool);
  if (e.offload_checkpoints) {
    out += Line("activation checkpoints (strata.offload_checkpoints)", e.checkpoint_host_bytes);
  }
  out += "NVMe (per rank)\n";
  out += Line("parameter swap file", e.engine.nvme_param_file);
  out += Line("optimizer swap file", e.engine.nvme_optim_file);
  out += "host memory outside the budgets\n";
  out += e.from_weights
             ? Line("loading the largest unit's shard from the weights (set-up only)",
                    e.load_host_bytes())
             : Line(e.stage == 0 ? "random initialisation of the largest unit (set-up only)"
                                 : "random initialisation of the largest unit's shard (set-up only)",
                    e.engine.init_host_bytes);
  return out;
}

nlohmann::json MemoryEstimateJson(const MemoryEstimate& e) {
  auto items = [](const std::vector<zero::MemoryPlanItem>& v) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& i : v) a.push_back({{"what", i.what}, {"bytes", i.bytes}});
    return a;
  };
  return {{"world_size", e.world_size},
          {"tensor_parallel", e.tensor_parallel},
          {"data_parallel", e.data_parallel},
          {"seq_len", e.seq_len},
          {"micro_batch", e.micro_batch},
          {"parameters", e.parameters},
          {"trainable_parameters", e.trainable_parameters},
          {"device",
           {{"peak_bytes", e.device_peak()},
            {"activations_bytes", e.activations},
            {"activation_dtype", std::string(device::DTypeName(e.activation_dtype))},
            {"activation_checkpointing", e.checkpointing},
            {"split_blocks", e.split_blocks},
            {"offload_checkpoints", e.offload_checkpoints},
            {"activations_checkpointed_bytes", e.activations_checkpointed},
            {"activations_kept_bytes", e.activations_kept},
            {"workspace_bytes", e.workspace},
            {"rank_agreement_bytes", e.rank_agreement},
            {"engine", items(e.engine.device)},
            {"step", items(e.engine.device_step)}}},
          {"pinned_pool_bytes", e.engine.pinned_pool},
          {"checkpoint_host_bytes", e.checkpoint_host_bytes},
          {"nvme",
           {{"param_file_bytes", e.engine.nvme_param_file},
            {"optim_file_bytes", e.engine.nvme_optim_file}}},
          {"host_init_bytes", e.engine.init_host_bytes},
          {"host_load_bytes", e.load_host_bytes()},
          {"from_weights", e.from_weights},
          {"host_setup_bytes", e.setup_host_bytes()}};
}

}  // namespace strata::train
