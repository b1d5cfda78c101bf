// `strata eval`: the loss and perplexity of a model on a token file (train/trainer.h, eval_only).
#include <memory>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/run_options.h"
#include "train/trainer.h"

namespace strata::cli {

void RegisterEvalCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<train::TrainOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Mean loss and perplexity of a model (a Hugging Face directory, a checkpoint step "
      "directory or a preset) on a token file: forward only, with the engine and offload of "
      "training, on 1..N ranks");
  cmd->add_option("--model", o->model,
                  "Hugging Face model directory (config.json + model.safetensors), a checkpoint "
                  "step directory (DIR/latest), or a preset (random weights)")
      ->required();
  cmd->add_option("--data", o->eval_data,
                  "Token data: prepared documents (strata data prepare: the loss is over their "
                  "trained tokens), FILE.npy or raw FILE.bin")
      ->required();
  cmd->add_flag_function(
      "--no-packing", [o = o.get()](int64_t) { o->packing = false; },
      "Prepared data: one document per sequence instead of packing several");
  cmd->add_option("--long-docs", o->long_docs,
                  "Prepared data: a document longer than a sequence is cut into pieces (split, "
                  "the default) or left out (drop)")
      ->check(CLI::IsMember({"split", "drop"}));
  cmd->add_option("--adapter", o->adapter_dir,
                  "Apply a PEFT LoRA adapter directory (adapter_config.json + "
                  "adapter_model.safetensors; a LoRA run's checkpoint step directory is one) to "
                  "the model");
  AddDataShapeAndDeviceOptions(cmd, o.get());
  cmd->add_option("--sequences", o->eval_sequences,
                  "Evaluate the first N sequences (default: all of the file, in whole batches)")
      ->check(CLI::Range(int64_t{1}, int64_t{1'000'000'000'000}));
  cmd->add_option("--config", o->config_path,
                  "DeepSpeed JSON config: ZeRO stage, offload, precision, micro-batch (default: "
                  "stage 0, fp32, --micro-batch sequences per rank)");
  cmd->add_option("--micro-batch", o->eval_micro_batch,
                  "Sequences per rank per forward pass without --config")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--json", o->eval_json, "Also write the result as a JSON object to this file");
  cmd->callback([o, exit_code] {
    o->eval_only = true;
    o->data = o->eval_data;
    o->steps = 1;
    const Status st = train::RunTraining(*o);
    *exit_code = st.ok() ? kExitOk : ReportError("eval", st);
  });
}

}  // namespace strata::cli
