// `strata train`: trains a Llama-family model with the ZeRO engine (see train/trainer.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/run_options.h"
#include "common/signals.h"
#include "model/llama_config.h"
#include "train/trainer.h"

namespace strata::cli {

void AddDataShapeAndDeviceOptions(CLI::App* cmd, train::TrainOptions* o) {
  cmd->add_option("--data-dtype", o->data_dtype, "Token type of a raw .bin file")
      ->check(CLI::IsMember({"uint16", "uint32", "int32"}))
      ->capture_default_str();
  cmd->add_option("--seq-len", o->seq_len,
                  "Tokens per sequence (default: min(256, max_position_embeddings))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--device", o->device,
                  "cpu, cuda (GPU <local rank>) or auto (cuda when a GPU is usable); default: "
                  "the config's strata.device, else auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
}

void RegisterTrainCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<train::TrainOptions>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a Llama-family model with ZeRO (stages 0-3) and offload to host memory or NVMe, "
      "from a DeepSpeed config; launch with mpirun / srun for several ranks");
  cmd->add_option("--config", o->config_path, "DeepSpeed JSON config")->required();
  cmd->add_option("--model", o->model,
                  fmt::format("Hugging Face model directory (config.json) or a preset ({}); a "
                              "directory with model.safetensors (or its index) is fine-tuned "
                              "from those weights. Optional with --resume",
                              fmt::join(model::LlamaPresetNames(), ", ")));
  cmd->add_option("--data", o->data,
                  "Token data: prepared documents (strata data prepare), FILE.npy, or raw "
                  "FILE.bin (see --data-dtype)")
      ->required();
  cmd->add_flag_function(
      "--no-packing", [o = o.get()](int64_t) { o->packing = false; },
      "Prepared data: one document per sequence, padded, instead of packing several "
      "(default: packed; a resumed run keeps its checkpoint's)");
  cmd->add_option("--long-docs", o->long_docs,
                  "Prepared data: a document longer than a sequence is cut into sequence-long "
                  "pieces (split, the default) or left out (drop)")
      ->check(CLI::IsMember({"split", "drop"}));
  AddDataShapeAndDeviceOptions(cmd, o.get());
  cmd->add_option("--steps", o->steps,
                  "Training steps to reach (a resumed run continues up to this total)")
      ->check(CLI::Range(int64_t{1}, int64_t{1'000'000'000'000}))
      ->capture_default_str();
  cmd->add_option("--save", o->save_dir,
                  "Write checkpoints here: DIR/step-N/ (Hugging Face model + optimizer and "
                  "trainer state) and DIR/latest");
  cmd->add_option("--adapter", o->adapter_dir,
                  "Start from a PEFT LoRA adapter directory (adapter_config.json + "
                  "adapter_model.safetensors) on the --model weights: its settings are "
                  "strata.lora's, its tensors the initial adapters");
  cmd->add_option("--resume", o->resume_dir,
                  "Continue from a checkpoint: a --save directory (its latest) or a step "
                  "directory; any number of ranks");
  cmd->add_option("--save-shard-size", o->max_shard_bytes,
                  "Split checkpoint files above this many bytes, with an index (default 5GiB)")
      ->transform(ByteSize())
      ->check(CLI::Range(uint64_t{4096}, uint64_t{1} << 50));
  cmd->add_option("--save-every", o->save_every, "Also save every N steps (0: only at the end)")
      ->check(CLI::Range(int64_t{0}, int64_t{1'000'000'000'000}));
  cmd->add_option("--trace", o->trace_path, "Write a Chrome / Perfetto timeline (per rank)");
  cmd->add_option("--metrics", o->metrics_path, "Write one JSON object per step (rank 0)");
  cmd->add_flag("--profile-ops", o->profile_ops,
                "Time every model op on the device (two timestamps per op) and print at the end "
                "where the steps after the first spent their time");
  cmd->add_option("--sampling", o->sampling,
                  "Order of the training sequences (default random; a resumed run keeps its "
                  "checkpoint's)")
      ->check(CLI::IsMember({"random", "sequential"}));
  cmd->add_option("--seed", o->seed,
                  "Seed of the data order (default 1234; a resumed run keeps its checkpoint's)");
  cmd->add_option("--eval-data", o->eval_data,
                  "Token data for validation loss (prepared, or a token file with --data-dtype)");
  cmd->add_option("--eval-every", o->eval_every,
                  "Report the validation loss on --eval-data every N steps and after the last")
      ->check(CLI::Range(int64_t{1}, int64_t{1'000'000'000'000}));
  cmd->add_option("--eval-sequences", o->eval_sequences,
                  "Validate on the first N sequences of --eval-data (default: all)")
      ->check(CLI::Range(int64_t{1}, int64_t{1'000'000'000'000}));
  cmd->add_flag("--save-on-signal", o->save_on_signal,
                "On SIGINT or SIGTERM, save a checkpoint of the last finished step before stopping "
                "(with --save)");
  cmd->callback([o, exit_code] {
    // SIGINT / SIGTERM: finish the step, save if asked, remove the swap files, exit 128 + signal.
    signals::InstallStopHandlers(o->save_on_signal && !o->save_dir.empty()
                                     ? "finishing the current step, then saving a checkpoint"
                                     : "finishing the current step, then stopping");
    o->stop_signal = &signals::StopSignal;
    const Status st = train::RunTraining(*o);
    if (st.code() == StatusCode::kCancelled && signals::StopSignal() != 0) {
      std::fprintf(stderr, "strata train: %s\n", std::string(st.message()).c_str());
      *exit_code = 128 + signals::StopSignal();
      return;
    }
    *exit_code = st.ok() ? kExitOk : ReportError("train", st);
  });
}

}  // namespace strata::cli
