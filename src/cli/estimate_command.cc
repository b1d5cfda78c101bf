// `strata estimate`: what a `strata train` run would allocate per rank and per tier (device
// memory, the pinned pool, the NVMe swap files), computed with the engine's own formulas before
// anything is allocated (train/estimate.h, docs/planning.md). Memory only for now: the time
// model and the placement planner of issue 20 are to come.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "model/llama_config.h"
#include "strata/config.h"
#include "train/estimate.h"

namespace strata::cli {
namespace {

struct EstimateArgs {
  std::string model;
  std::string config;
  int ranks = 1;
  int64_t seq_len = 0;
  std::string device = "cuda";
  bool json = false;
};

int RunEstimate(const EstimateArgs& a) {
  constexpr std::string_view kCommand = "estimate";
  train::EstimateInput in;
  Result<model::LlamaConfig> m = model::ResolveModel(a.model);
  if (!m.ok()) return ReportError(kCommand, m.status().WithContext("--model"));
  in.model = *m;
  if (!a.config.empty()) {
    Result<Config> c = LoadConfigFile(a.config);
    if (!c.ok()) return ReportError(kCommand, c.status());
    in.config = *c;
  } else {
    in.config.batch.train_micro_batch_size_per_gpu = 1;
  }
  in.world_size = a.ranks;
  in.seq_len = a.seq_len;
  in.device = a.device == "cpu" ? device::DeviceType::kCpu : device::DeviceType::kCuda;
  Result<train::MemoryEstimate> e = train::EstimateMemory(in);
  if (!e.ok()) return ReportError(kCommand, e.status());
  if (a.json) {
    nlohmann::json j = train::MemoryEstimateJson(*e);
    j["model"] = in.model.name;
    j["device_type"] = a.device;
    fmt::print(stdout, "{}\n", j.dump());
  } else {
    fmt::print(stdout, "strata estimate: model {} on {} ({} device)\n", in.model.name,
               a.config.empty() ? "no DeepSpeed config (stage 0, fp32, micro-batch 1)" : a.config,
               a.device);
    fmt::print(stdout, "{}", train::FormatMemoryEstimate(*e));
  }
  return kExitOk;
}

}  // namespace

void RegisterEstimateCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<EstimateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "What a strata train run would allocate per rank: device memory (activations, parameters, "
      "gradients, optimizer states, step buffers), the pinned pool and the NVMe swap files, "
      "from the engine's own formulas (docs/planning.md). Memory only for now");
  cmd->add_option("--model", args->model, "A model directory (config.json) or a preset")
      ->required();
  cmd->add_option("--config", args->config,
                  "A DeepSpeed config (zero_optimization, bf16/fp16, batch sizes, strata.*)");
  cmd->add_option("--ranks", args->ranks, "Data-parallel ranks")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--seq-len", args->seq_len,
                  "Tokens per sequence (default: as strata train, min(256, max positions))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--device", args->device, "cuda or cpu (the CPU device has no op workspace)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "One JSON object instead of the table");
  cmd->callback([args, exit_code] { *exit_code = RunEstimate(*args); });
}

}  // namespace strata::cli
