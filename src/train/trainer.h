// The trainer behind `strata train`: a Llama-family model, a DeepSpeed config and token data (a
// token stream, or documents prepared by `strata data prepare`: train/training_data.h),
// trained with the ZeRO engine on the ranks mpirun / srun started (or one process).
//
//   mpirun -np 2 strata train --config ds.json --model llama-20m --data tokens.bin --steps 300
//       --save out/ckpt
//
// Per step, rank 0 prints one line (step, loss, lr, tokens/s, TFLOPS, the step-time split into
// compute and exposed communication / I/O / optimizer, NVMe bytes moved, prefetch hit rate, peak
// memory) and, with --metrics FILE, appends the same as one JSON object per line. --trace FILE
// writes a Chrome / Perfetto timeline of every stream, I/O queue and collective on each rank
// (FILE gets ".rank<r>" before its extension when there are several ranks).
//
// --save DIR writes a checkpoint at the end (and every --save-every steps): DIR/step-NNNNNNNN/
// with the model in Hugging Face layout (config.json, model.safetensors; `transformers` loads the
// directory directly), the optimizer states and the trainer state beside it, and DIR/latest
// pointing at the newest (train/checkpoint.h). Every rank writes its own part; a save is
// atomic. --resume DIR (a save directory or one step directory) continues a run exactly where
// it stopped — same data order, LR schedule, loss scale — on any number of ranks; --steps is the
// total to reach. --model DIR with model.safetensors (or its index) in it fine-tunes those
// weights (streamed per rank into its shards, converted to the compute dtype).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "strata/status.h"

namespace strata::train {

struct TrainOptions {
  std::string config_path;       // DeepSpeed JSON
  // A Hugging Face model directory (config.json, and weights when model.safetensors or its index
  // is there) or a preset. May be empty with resume_dir (the checkpoint's config is used).
  std::string model;
  std::string data;  // token file (.npy, raw .bin with data_dtype, or prepared data)
  std::string data_dtype = "uint16";
  // Prepared data (`strata data prepare`): several documents per row (packing, the default) or
  // one (false); what to do with a document longer than a row: "split" (the default) or "drop".
  // Unset: the default, or what a resumed checkpoint used.
  std::optional<bool> packing;
  std::string long_docs;
  int64_t seq_len = 0;           // 0: min(256, max_position_embeddings)
  int64_t steps = 100;
  std::string save_dir;          // empty: no checkpoint
  int64_t save_every = 0;        // 0: only at the end
  std::string resume_dir;        // a checkpoint to continue from (save dir or step dir)
  // A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to start
  // from: its settings become strata.lora, its tensors the initial adapters.
  std::string adapter_dir;
  uint64_t max_shard_bytes = 5ull << 30;  // checkpoint files are split above this
  std::string trace_path;
  std::string metrics_path;
  // Time every op of the model on the device and print, at the end, where the steps after the
  // first spent their time (rank 0's).
  bool profile_ops = false;
  // "random" or "sequential"; empty: random, or what a resumed checkpoint used.
  std::string sampling;
  std::optional<uint64_t> seed;  // data order (default 1234; a resumed run keeps its own)
  // "cpu", "cuda" or "auto" (train/device_choice.h); empty: the config's strata.device.
  std::string device;
  // Where rank 0's progress lines go (default: stdout).
  std::function<void(const std::string&)> print;
  // Polled between steps: a signal number (SIGINT, SIGTERM) asks the run to stop there (the CLI
  // passes signals::StopSignal). All ranks stop after the same step. Unset: never.
  std::function<int()> stop_signal;
  // On a stop by signal, save a checkpoint of the last finished step first (needs save_dir).
  // A run stopped by a signal returns Cancelled ("stopped by SIGTERM after step N ...").
  bool save_on_signal = false;

  // Evaluation: the mean loss (and perplexity) of the model on eval_data's sequential windows of
  // seq_len + 1 tokens (the first eval_sequences of them; 0: all), forward only, as many whole
  // global batches (ranks x micro-batch) as they fill. During training every eval_every steps
  // (0: never); with eval_only (`strata eval`) once, without training: no optimizer state is
  // built (every unit frozen), config_path may be empty (stage 0, eval_micro_batch sequences
  // per rank), and the result goes to eval_json too when given.
  std::string eval_data;
  int64_t eval_every = 0;
  int64_t eval_sequences = 0;
  bool eval_only = false;
  int64_t eval_micro_batch = 1;
  std::string eval_json;
};


// Runs the whole training. Errors name what was wrong (a file, a key, a flag).
Status RunTraining(const TrainOptions& options);

}  // namespace strata::train
