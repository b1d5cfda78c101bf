// What a `strata train` run allocates per rank, by tier, before it allocates anything: the
// model's activations and op workspace, the engine's states and step buffers
// (zero::Engine::PlanMemory), the pinned pool, the NVMe swap files. The memory half of
// `strata estimate` (issue 20; docs/planning.md gives the formulas and how they were checked).
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/llama_config.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "zero/engine.h"

namespace strata::train {

struct EstimateInput {
  model::LlamaConfig model;
  Config config;
  int world_size = 1;
  int64_t seq_len = 0;  // 0: as strata train, min(256, max_position_embeddings)
  device::DeviceType device = device::DeviceType::kCpu;
  // The run starts from weights (a model directory holding them, or a checkpoint) rather than
  // random initialisation: set-up holds one unit's shard being loaded instead of a whole unit.
  bool from_weights = false;
  // ... and the optimizer's moments with them (resuming a checkpoint): more set-up memory.
  bool with_moments = false;
  // The rank's device budget, for strata.activation_checkpointing "auto" (checkpointing off when
  // the device peak with every block's internals kept fits it). 0: unknown, checkpointing on.
  uint64_t device_budget = 0;
};

struct MemoryEstimate {
  int world_size = 1;
  // tensor_parallel.autotp_size, and the data-parallel ranks ZeRO partitions over
  // (world_size / tensor_parallel). With tensor parallelism a rank holds its part of the model
  // (model::LlamaTensorParallelConfig): parameters, layouts and activations below are the part's.
  int tensor_parallel = 1;
  int data_parallel = 1;
  int64_t seq_len = 0;
  int64_t micro_batch = 0;
  int stage = 0;                // zero_optimization.stage
  uint64_t parameters = 0;      // the model's (with LoRA adapters); one TP rank's part with TP
  uint64_t trainable_parameters = 0;  // those that train (all, unless frozen or LoRA)
  bool lora = false;                  // strata.lora: the base units are frozen
  bool from_weights = false;          // EstimateInput::from_weights
  bool with_moments = false;          // EstimateInput::with_moments
  uint64_t activations = 0;     // LlamaActivationBytes (device), as the run allocates them
  // Their dtype (model::LlamaActivationDType): the compute dtype on CUDA, fp32 on the CPU.
  device::DType activation_dtype = device::DType::kF32;
  // Activation checkpointing, resolved (strata.activation_checkpointing), and the activations
  // with it and without (every block's internals kept).
  bool checkpointing = true;
  bool split_blocks = false;  // strata.split_blocks: four units per block
  // strata.offload_checkpoints, resolved: every block input but the last two in registered host
  // memory (checkpoint_host_bytes of it, per rank), not on the device.
  bool offload_checkpoints = false;
  uint64_t checkpoint_host_bytes = 0;
  uint64_t activations_checkpointed = 0;
  uint64_t activations_kept = 0;
  uint64_t workspace = 0;       // the CUDA ops' workspace (device; 0 on the CPU device)
  uint64_t rank_agreement = 0;  // the trainer's per-step agreement buffer (device, several ranks)
  zero::EngineMemoryPlan engine;
  // The partition (zero::LayoutModel): units, and elements over all units padded for
  // `world_size` ranks, in one rank's shard, in the largest shard.
  int units = 0;
  uint64_t padded_elems = 0;
  uint64_t shard_elems = 0;
  uint64_t max_shard_elems = 0;
  // Split blocks with checkpointing: elements gathered again per micro-batch to recompute
  // (LlamaRecomputeUnits), over the whole model and in one rank's shard.
  uint64_t recompute_padded_elems = 0;
  uint64_t recompute_shard_elems = 0;

  // The device allocator's peak per rank: what `device_peak_bytes` in --metrics reports.
  uint64_t device_peak() const;
  // Host memory outside the budgets during set-up: loading the largest unit (from_weights) or
  // randomly initialising it.
  uint64_t setup_host_bytes() const {
    return from_weights ? load_host_bytes() : engine.init_host_bytes;
  }
  uint64_t load_host_bytes() const {
    return with_moments ? engine.load_host_bytes : engine.load_weights_host_bytes;
  }
};

Result<MemoryEstimate> EstimateMemory(const EstimateInput& input);

// The up-front check of `strata train` (before it allocates anything): the estimate's set-up
// allocations (activations, workspace, the engine's states) against `device_budget`.
// ResourceExhausted naming the need, its largest parts and the budget when they do not fit.
// `*warning` is set (else cleared) when only the step's transients would go over (they depend
// on how far the host runs ahead, so the run is not refused for them).
Status CheckDevicePlan(const MemoryEstimate& estimate, uint64_t device_budget,
                       std::string* warning);

// The table for people (one line per item, per tier, with totals) and the JSON for tools.
std::string FormatMemoryEstimate(const MemoryEstimate& estimate);
nlohmann::json MemoryEstimateJson(const MemoryEstimate& estimate);

}  // namespace strata::train
