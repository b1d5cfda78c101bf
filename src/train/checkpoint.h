// Checkpoints: the model's unpartitioned states, written by every rank into its own byte ranges
// of shared files, so that a checkpoint saved on N ranks loads on M ranks, under any ZeRO stage
// and offload.
//
//   SAVE/step-00000300/
//     config.json                        Hugging Face LlamaConfig
//     model.safetensors                  parameters in the compute dtype, HF tensor names
//                                        (or model-0000i-of-0000n.safetensors + model.safetensors
//                                        .index.json above max_shard_bytes) — transformers loads
//                                        the directory as it is
//     optimizer.safetensors              fp32 "master.<name>", "exp_avg.<name>",
//                                        "exp_avg_sq.<name>" (sharded the same way, with
//                                        optimizer.safetensors.index.json)
//     trainer_state.json                 step, optimizer steps, data position (SamplerState),
//                                        loss-scaler state, LR-schedule length, batch shape, seed
//   SAVE/latest -> step-00000300         symlink to the newest complete checkpoint
//
// A save is atomic: everything is written under SAVE/.step-00000300.tmp/, every file synced, then
// the directory is renamed into place and `latest` is replaced (a new symlink renamed over it);
// the parent directory is synced after each. A crash at any point leaves the previous checkpoint
// and `latest` intact (tests/train/checkpoint_crash_test.cc crashes a save at every sync point).
// Every file goes through the file seam (strata/file_system.h). docs/formats.md describes the
// files.
//
// Loading streams each rank's own pieces (zero::StatePiece) from the files with positioned reads,
// converting any of F32 / BF16 / F16 to fp32: no rank ever holds more than one piece of the model
// at once. The same reader loads a Hugging Face model directory's weights for fine-tuning.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "model/llama_model.h"
#include "strata/collective.h"
#include "strata/device.h"
#include "strata/file_system.h"
#include "strata/status.h"
#include "train/data.h"
#include "train/tensor_parts.h"
#include "zero/engine.h"
#include "zero/model.h"

namespace strata::train {

inline constexpr int kCheckpointFormatVersion = 1;

// What trainer_state.json holds.
struct TrainerState {
  int64_t step = 0;  // trainer steps completed (the next step to run is step + 1)
  zero::EngineCounters counters;
  SamplerState sampler;
  int world_size = 1;       // of the run that saved (informational)
  int tensor_parallel = 1;  // its tensor_parallel.autotp_size (informational)
  uint64_t global_batch = 0;
  uint64_t seq_len = 0;
  int64_t scheduler_total_steps = 0;  // the LR schedule's length when it was derived from --steps
  uint64_t seed = 0;                  // the sampler's seed
  std::string compute_dtype;          // "float32", "bfloat16", "float16"
  std::string data_path;
  uint64_t data_tokens = 0;
  // Prepared data (train/training_data.h): how its documents became rows, which the data order
  // depends on. Absent from the JSON for a token stream.
  bool data_prepared = false;
  bool data_packed = true;
  std::string data_long_docs = "split";
};

// The files SaveOptions::tokenizer_dir contributes to a checkpoint.
inline constexpr const char* kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "generation_config.json", "tokenizer.model"};

struct SaveOptions {
  // Parameter and optimizer files are split into shards of at most this many bytes of tensor
  // data (a tensor is never split), with an index, as transformers does for large models.
  uint64_t max_shard_bytes = 5ull << 30;
  // Rank 0's progress lines ("saving checkpoint: 12/34 units").
  std::function<void(const std::string&)> print;
  // A LoRA run: the adapters go to adapter_model.safetensors (PEFT's names), not to
  // model.safetensors, with an adapter_config.json whose base_model_name_or_path is the step
  // directory itself (absolute): its model.safetensors holds the base weights the adapters go
  // with (trained ones too, under strata.trainable), and transformers' from_pretrained of the
  // directory loads them and then the adapters (lora_files.h).
  model::LlamaLora lora;
  // A model directory whose tokenizer and generation files (kTokenizerFiles: those present) are
  // copied into every step directory, so that a checkpoint is a whole model for transformers'
  // pipelines and for `strata data prepare`; empty: none.
  std::string tokenizer_dir;
  // Where the files go (the file seam); null: the local file system. Tests pass a
  // CrashFileSystem (common/crash_file_system.h) to crash the save at each sync point.
  FileSystem* fs = nullptr;
  // Tensor parallelism: where this rank's parts lie in the whole tensors the files hold
  // (tensor_parts.h); null: the engine holds whole tensors.
  const TensorParts* parts = nullptr;
};

// Collective (every rank, between steps): writes `state` and the engine's states as
// SAVE/step-<state.step>/ and points SAVE/latest at it. Returns the step directory. When any
// rank fails, every rank returns an error (naming the failing ranks) and the previous
// checkpoint stays in place.
Result<std::string> SaveCheckpoint(zero::Engine& engine, comm::Collective& comm,
                                   device::Device& device, const model::LlamaConfig& config,
                                   const TrainerState& state, const std::string& save_dir,
                                   const SaveOptions& options);

// The step directory `path` names: itself when it holds trainer_state.json, else what its
// `latest` link points to. NotFound / InvalidArgument naming the path otherwise.
Result<std::string> ResolveCheckpoint(const std::string& path, FileSystem& fs = LocalFileSystem());
// Collective: every rank reads back its share of the checkpoint's checksummed ranges
// (checksum_manifest.h) and all agree. DataLoss listing what differs (at most a few lines, with
// the count of the rest) when anything does; OK with a note through `print` when the checkpoint
// has no checksums.json (saved before checkpoints had them). `print`: rank 0's progress lines.
Status VerifyCheckpoint(const std::string& step_dir, comm::Collective& comm,
                        device::Device& device,
                        const std::function<void(const std::string&)>& print = {},
                        FileSystem& fs = LocalFileSystem());

// The text of trainer_state.json for `state` (ReadTrainerState reads it back).
std::string TrainerStateJson(const TrainerState& state);
// Reads and validates DIR/trainer_state.json.
Result<TrainerState> ReadTrainerState(const std::string& step_dir,
                                      FileSystem& fs = LocalFileSystem());

// InvalidArgument naming the checkpoint and the first field that differs when `step_dir` holds a
// different model than `config` ("hidden_size is 384 in the checkpoint, 512 in the run").
Status CheckSameModel(const std::string& step_dir, const model::LlamaConfig& config,
                      FileSystem& fs = LocalFileSystem());

// Parameter (and optimizer) tensors opened for loading into an engine.
class StateFiles {
 public:
  // A Hugging Face model directory (or .safetensors / index file): weights only. Every parameter
  // of `units` must be there with its shape (errors name the file, the tensor and both shapes).
  // LoRA adapter parameters (model::IsLoraParamName) come from `adapter_dir`'s
  // adapter_model.safetensors under PEFT's names; without one, their units start from
  // Model::InitUnit (InitialStates::init_from_model). With tensor parallelism `parts` says
  // which part of each whole tensor this rank's units hold (the file's shape is checked against
  // the whole tensor's).
  static Result<std::unique_ptr<StateFiles>> OpenWeights(const std::string& path,
                                                         const std::vector<zero::UnitSpec>& units,
                                                         const std::string& adapter_dir = "",
                                                         const TensorParts& parts = {},
                                                         FileSystem& fs = LocalFileSystem());
  // A checkpoint step directory: weights and optimizer states (those of the units not `frozen`,
  // per unit; none given: every unit's).
  static Result<std::unique_ptr<StateFiles>> OpenCheckpoint(
      const std::string& step_dir, const std::vector<zero::UnitSpec>& units,
      const std::vector<char>& frozen = {}, const TensorParts& parts = {},
      FileSystem& fs = LocalFileSystem());
  ~StateFiles();

  // EngineOptions::initial / Engine::LoadStates for these files (with the optimizer states when
  // they were opened from a checkpoint). The StateFiles must outlive its use.
  zero::InitialStates Initial(zero::StateProgress progress = {}) const;
  bool has_optimizer() const;
  // What was opened (for messages).
  const std::string& source() const;
  // Bytes of tensor data a full load reads, summed over all ranks.
  uint64_t total_bytes() const;

 private:
  struct Impl;
  explicit StateFiles(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A progress callback for saves and loads: "  <what>: 12/34 units (3.1 s)", at most once a
// second (nothing for operations that finish sooner). Null when `print` is.
zero::StateProgress UnitProgress(std::function<void(const std::string&)> print, std::string what);

// "float32", "bfloat16", "float16": the torch_dtype of config.json and trainer_state.json.
const char* TorchDtypeName(device::DType dtype);

// True when `dir` holds weights (model.safetensors or model.safetensors.index.json).
bool HasWeights(const std::string& dir, FileSystem& fs = LocalFileSystem());

// The directory a --model argument names: itself, or the folder of a config.json given directly
// (the weights sit beside it).
std::string ModelDirOf(const std::string& model_arg, FileSystem& fs = LocalFileSystem());

}  // namespace strata::train
