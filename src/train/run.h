// The second stage of a run (trainer.h): the objects a RunPlan names, built through the
// composition root (runtime.h) in the order they depend on each other, and what is said about
// them.
//
//   OpenRun(plan)       checks every output can be written, takes the --save directory's lock,
//                       opens the device and collective, the token data and its sampler, makes
//                       the ranks agree on the "auto" placement, plans memory against the device
//                       budget, and builds the model. Nothing is loaded or trained yet.
//   DescribeRun         the run's banner: model, ranks, placement, device memory, LoRA, frozen
//                       units, data (printed by rank 0).
//   LoadRun             the initial states (a checkpoint, verified first; a model's weights; or
//                       the model's own init), the store, pinned pool and engine that hold them,
//                       and the validation data; prints what it loads and how fast.
//   ResumeRun           restores the engine's counters and the sampler from the checkpoint.
//   Evaluate            the mean loss over the validation (or --data for `strata eval`) windows.
//
// A Run is used by one thread (the rank's main thread); the engine has threads of its own.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/file_lock.h"
#include "model/llama_model.h"
#include "strata/status.h"
#include "strata/trace.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/training_data.h"
#include "train/rank_gather.h"
#include "train/run_plan.h"
#include "train/runtime.h"

namespace strata::train {

using Say = std::function<void(const std::string&)>;

struct Run {
  // Construction order; members are destroyed in reverse: the engine before the model it drives,
  // the model before the runtime, the save lock last.
  FileLock save_lock;                   // rank 0 with --save: one run per save directory
  std::unique_ptr<TraceRecorder> trace;  // --trace
  Runtime runtime;
  std::unique_ptr<TrainingData> data;
  std::optional<SequenceSampler> sampler;  // the training order of data's rows (none for eval)
  std::unique_ptr<RankGather> agreement;   // several ranks: agreement between steps
  std::vector<std::string> placement_lines;
  MemoryChoice memory;
  std::unique_ptr<model::LlamaModel> model;
  std::vector<char> frozen;  // per unit
  TensorParts parts;         // tensor parallelism: where the model's parts lie in whole tensors
  std::unique_ptr<StateFiles> files;
  EngineStack stack;
  std::unique_ptr<TrainingData> eval_data;  // --eval-data (--data for `strata eval`)
  int64_t first_step = 0;                   // the resumed checkpoint's step, else 0

  // Rank 0's lines (the other ranks say nothing).
  Say say;

  device::Device& device() const { return *runtime.device; }
  comm::Collective& comm() const { return *runtime.comm; }
  zero::Engine& engine() const { return *stack.engine; }
  int rank() const { return runtime.comm->rank(); }
  int world() const { return runtime.comm->world_size(); }
};

// OpenRun's work (see above). plan->config gains the "auto" homes the ranks agreed on.
Result<std::unique_ptr<Run>> OpenRun(RunPlan* plan);

// The banner lines, in order.
std::vector<std::string> DescribeRun(const RunPlan& plan, const Run& run);

// LoadRun's work (see above).
Status LoadRun(const RunPlan& plan, Run* run);

// Continues a resumed plan's counters and data order. Returns false when the checkpoint has
// already reached --steps (said, nothing to do).
Result<bool> ResumeRun(const RunPlan& plan, Run* run);

struct EvalResult {
  double loss = 0;
  uint64_t sequences = 0;  // evaluated: whole global batches of them
  uint64_t targets = 0;    // trained targets in them (the loss's mean is over these)
  uint64_t dropped = 0;    // wanted but not a whole batch
  double seconds = 0;
};

// Forward only on the evaluation data's rows in order (windows of seq_len + 1 tokens, or packed
// documents): each rank reads its micro-batch of every global batch. The loss is the mean over
// every trained token evaluated. InvalidArgument when the rows do not fill one batch.
Result<EvalResult> Evaluate(const RunPlan& plan, Run& run);
// "loss 3.1234, perplexity 22.8 over ... in 1.20 s (1234 tok/s)".
std::string EvalLine(const RunPlan& plan, const Run& run, const EvalResult& result);
// `strata eval --json`: the result as one JSON object (rank 0 writes it).
Status WriteEvalJson(const RunPlan& plan, const Run& run, const EvalResult& result);

}  // namespace strata::train
