// The trainer behind `strata train`: a Llama-family model, a DeepSpeed config and a token file,
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
// --save DIR writes, at the end (and every --save-every steps), the model in Hugging Face layout:
// DIR/config.json and DIR/model.safetensors (parameters in the compute dtype; `transformers`
// loads the directory directly), atomically (temporary names, fsync, rename). Interim: rank 0
// gathers one unit at a time and writes the file; optimizer state and resume come next.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "strata/status.h"

namespace strata::train {

struct TrainOptions {
  std::string config_path;       // DeepSpeed JSON
  std::string model;             // a Hugging Face model directory (config.json) or a preset
  std::string data;              // token file (.npy, or raw .bin with data_dtype)
  std::string data_dtype = "uint16";
  int64_t seq_len = 0;           // 0: min(256, max_position_embeddings)
  int64_t steps = 100;
  std::string save_dir;          // empty: no checkpoint
  int64_t save_every = 0;        // 0: only at the end
  std::string trace_path;
  std::string metrics_path;
  std::string sampling = "random";  // "random" or "sequential"
  uint64_t seed = 1234;
  // Where rank 0's progress lines go (default: stdout).
  std::function<void(const std::string&)> print;
};

// Runs the whole training. Errors name what was wrong (a file, a key, a flag).
Status RunTraining(const TrainOptions& options);

}  // namespace strata::train
