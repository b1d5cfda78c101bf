// The first stage of a run (trainer.h): everything `strata train` and `strata eval` decide from
// their options and files before anything is opened, as plain data.
//
//   ResolveRun(options, launch)   flags, the DeepSpeed config, the checkpoint to resume and what
//                                 it fixes (data order, sequence length, schedule, model), LoRA
//                                 (strata.lora, --adapter, the checkpoint's adapters), the model
//                                 config, the batch layout and the sampler: a RunPlan. It reads
//                                 files (the config, the checkpoint's trainer state, adapter and
//                                 model configs) but opens no device, collective or data file.
//   PlanRunMemory(plan, machine)  once the device is known: the placement of "auto" offload homes
//                                 (train/plan.h, the fastest that fits) and the memory plan per
//                                 rank (train/estimate.h) that settles activation checkpointing,
//                                 split blocks and checkpoints in host memory, checked against the
//                                 device budget. Pure: the machine is a plain struct.
//
// Both are tested without a device or MPI (tests/train/run_plan_test.cc). OpenRun (run.h) then
// builds what the plan names, and TrainLoop (trainer.cc) runs it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "model/llama_model.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/plan.h"
#include "train/trainer.h"
#include "train/training_data.h"

namespace strata::train {

struct RunPlan {
  TrainOptions options;     // as given (print and stop_signal included)
  comm::LaunchInfo launch;  // this rank and the world it was started in
  // The DeepSpeed config, resolved: forward only for an evaluation (every unit frozen, no
  // optimizer offload), LoRA's trainable patterns, the LR schedule's length, and after
  // PlanRunMemory the "auto" offload homes.
  Config config;

  // The checkpoint to resume (a step directory), and its trainer state; empty / unset for a
  // fresh run.
  std::string resume_dir;
  std::optional<TrainerState> resumed;

  // The model: --model, or the resumed checkpoint; its directory (empty for a preset).
  std::string model_arg;
  std::string model_dir;
  model::LlamaConfig model;
  model::LlamaLora lora;     // strata.lora resolved (disabled when there are no adapters)
  std::string adapter_dir;   // adapters to start from: --adapter, or a LoRA step dir as --model
  std::string adapter_note;  // what ReadAdapterConfig noted about the adapter config

  int64_t seq_len = 0;
  uint64_t seed = 0;                  // the data order's
  BatchLayout layout;                 // data-parallel ranks x micro-batch x accumulation
  int64_t scheduler_total_steps = 0;  // the LR schedule's length when derived from --steps
  SamplerOptions sampler;
  TokenDtype token_dtype = TokenDtype::kUint16;
  DataOptions data;  // how --data (and --eval-data) are read: vocabulary, rows, packing

  bool eval_only() const { return options.eval_only; }
  int world() const { return launch.world_size; }
  int rank() const { return launch.rank; }
  // Tensor parallelism (tensor_parallel.autotp_size = T): ranks [r - r mod T, + T) split the
  // model and read the same rows; the data-parallel ranks are world / T, this one r div T (as
  // the runtime splits them, runtime.h).
  int tensor_parallel() const { return std::max(config.tensor_parallel_size, 1); }
  int data_world() const { return world() / tensor_parallel(); }
  int data_rank() const { return rank() / tensor_parallel(); }
  // Validation during training is due after `done` steps (the last step always has one).
  bool EvalDue(int64_t done) const {
    return options.eval_every > 0 && (done % options.eval_every == 0 || done == options.steps);
  }
  // A checkpoint is due after `done` steps: the last step, every --save-every, or a stop by
  // signal with --save-on-signal.
  bool SaveDue(int64_t done, bool stopping) const {
    if (options.save_dir.empty()) return false;
    const bool periodic = options.save_every > 0 && done % options.save_every == 0;
    return done == options.steps || periodic || (stopping && options.save_on_signal);
  }
};

// The first stage: validates the options and resolves them against the files they name. Errors
// name the flag, key or file that was wrong.
Result<RunPlan> ResolveRun(const TrainOptions& options, const comm::LaunchInfo& launch);

// What PlanRunMemory needs to know of the machine.
struct MachineFacts {
  device::DeviceType device = device::DeviceType::kCpu;
  uint64_t device_budget = 0;  // the rank's
  Hardware hardware;           // for "auto" homes (train/plan.h MachineHardware)
};

// The placement the planner chose for "auto" homes, as every rank must agree on it.
struct PlacementChoice {
  PlanCandidate candidate;
  std::vector<std::string> lines;  // the banner's "placement" lines and the planner's reasons
  // A number that differs when two ranks' choices differ (the rank agreement compares it).
  float fingerprint = 0.0f;
};

// The memory plan's decisions for the model and engine (train/estimate.h MemoryEstimate).
struct MemoryChoice {
  bool keep_activations = false;     // no activation checkpointing
  bool split_blocks = false;         // strata.split_blocks, resolved
  bool offload_checkpoints = false;  // strata.offload_checkpoints, resolved
  std::string warning;               // CheckDevicePlan's, to log once
};

// The planner's choice for the plan's "auto" homes (nullopt when the config has none).
Result<std::optional<PlacementChoice>> PlanRunPlacement(const RunPlan& plan,
                                                        const MachineFacts& machine);
// The memory plan of `plan` (with its homes resolved) against the device budget:
// ResourceExhausted, naming what does not fit, before anything is allocated.
Result<MemoryChoice> PlanRunMemory(const RunPlan& plan, const MachineFacts& machine);
// The EstimateInput both take.
EstimateInput RunEstimateInput(const RunPlan& plan, const MachineFacts& machine);

// `path` with ".rank<r>" before its extension when there are several ranks (--trace).
std::string RankPath(const std::string& path, int rank, int world);

}  // namespace strata::train
