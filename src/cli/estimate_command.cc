// `strata estimate`: what a `strata train` run would allocate per rank and per tier (device
// memory, the pinned pool, the NVMe swap files), computed with the engine's own formulas before
// anything is allocated (train/estimate.h); whether that fits the hardware; how long a step
// takes by the time model (train/plan.h); and with --plan, the placement the planner chooses
// for "auto" homes, printed as the config it would run.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "model/llama_config.h"
#include "strata/config.h"
#include "train/checkpoint.h"
#include "train/estimate.h"
#include "train/plan.h"
#include "train/plan_measure.h"

namespace strata::cli {
namespace {

struct EstimateArgs {
  std::string model;
  std::string config;
  int ranks = 0;
  int tensor_parallel = 0;  // 0: the config's tensor_parallel.autotp_size
  int64_t seq_len = 0;
  std::string device = "cuda";
  bool json = false;
  bool plan = false;
  bool measure = false;
  std::string nvme_path;
  // Hardware, as text until parsed (rates take units and /s).
  int gpus = 1;
  int nodes = 1;
  uint64_t gpu_mem = 80'000'000'000;
  uint64_t device_budget = 0;
  uint64_t cpu_mem = 1'000'000'000'000;
  uint64_t nvme = 8'000'000'000'000;
  std::string nvme_read = "25G/s", nvme_write = "12G/s", pcie = "50G/s", cpu_adam = "1.5G/s";
  std::string nvlink = "300G/s", net = "50G/s", hbm = "3.35T/s", nvme_tbw = "0";
  double gpu_tflops = 989;
  double gpu_efficiency = 0.5;
  double io_cpu_share = 1.0;
};

Result<train::Hardware> ParseHardware(const EstimateArgs& a) {
  train::Hardware hw;
  hw.gpus_per_node = a.gpus;
  hw.nodes = a.nodes;
  hw.gpu_mem = a.gpu_mem;
  hw.device_budget = a.device_budget;
  hw.cpu_mem = a.cpu_mem;
  hw.nvme = a.nvme;
  hw.gpu_tflops = a.gpu_tflops;
  hw.gpu_efficiency = a.gpu_efficiency;
  hw.io_cpu_share = a.io_cpu_share;
  const std::pair<const char*, std::pair<const std::string*, double*>> rates[] = {
      {"--nvme-read", {&a.nvme_read, &hw.nvme_read}},
      {"--nvme-write", {&a.nvme_write, &hw.nvme_write}},
      {"--pcie", {&a.pcie, &hw.pcie}},
      {"--cpu-adam", {&a.cpu_adam, &hw.cpu_adam}},
      {"--nvlink", {&a.nvlink, &hw.nvlink}},
      {"--net", {&a.net, &hw.net}},
      {"--hbm", {&a.hbm, &hw.hbm}}};
  for (const auto& [flag, r] : rates) {
    Result<double> v = train::ParseRate(*r.first);
    if (!v.ok()) return v.status().WithContext(flag);
    *r.second = *v;
  }
  if (a.nvme_tbw != "0") {
    // Endurance is bytes (e.g. 14000T for 8 drives of 1.75 PB): the rate parser's units, no /s.
    Result<double> v = a.nvme_tbw.ends_with("/s") ? Result<double>(InvalidArgumentError("a rate"))
                                                  : train::ParseRate(a.nvme_tbw);
    if (!v.ok()) {
      return InvalidArgumentError(fmt::format(
          "--nvme-tbw: '{}' is not an amount of bytes; expected the drives' rated endurance, "
          "e.g. 14000T, 14P or 14PB (K, M, G, T, P are powers of 1000; Ki .. Pi of 1024)",
          a.nvme_tbw));
    }
    hw.nvme_tbw = *v;
  }
  return hw;
}

// What --plan plans without --config: ZeRO-3 in bf16, one sequence per GPU, both homes open.
constexpr const char* kDefaultPlanConfig =
    R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                              "offload_optimizer": {"device": "auto"}}})";

// The user's config file with the planned homes written in (or kDefaultPlanConfig's), for
// --plan: a config strata train runs as it is.
nlohmann::json PlannedConfig(const std::string& path, const train::PlanCandidate& c,
                             const Config& cfg) {
  nlohmann::json j = nlohmann::json::parse(kDefaultPlanConfig);
  if (!path.empty()) {
    const Result<std::string> text = ReadFileToString(LocalFileSystem(), path);
    j = text.ok() ? nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false,
                                          /*ignore_comments=*/true)
                  : nlohmann::json(nlohmann::json::value_t::discarded);
    if (j.is_discarded() || !j.is_object()) j = nlohmann::json::object();
  }
  nlohmann::json& z = j["zero_optimization"];
  if (!z.is_object()) z = nlohmann::json::object();
  // The deprecated spellings of the sections cannot stand beside them.
  z.erase("cpu_offload");
  z.erase("cpu_offload_param");
  z["stage"] = cfg.zero.stage;
  auto set = [&](const char* key, OffloadDevice d, const std::string& nvme_path) {
    nlohmann::json& o = z[key];
    if (!o.is_object()) o = nlohmann::json::object();
    o["device"] = std::string(OffloadDeviceName(d));
    if (d == OffloadDevice::kNvme && !nvme_path.empty()) o["nvme_path"] = nvme_path;
    return &o;
  };
  if (cfg.zero.stage == 3) set("offload_param", c.param, cfg.zero.offload_param.nvme_path);
  if (cfg.zero.stage >= 1) {
    nlohmann::json* o = set("offload_optimizer", c.optimizer, cfg.zero.offload_optimizer.nvme_path);
    if (c.optimizer != OffloadDevice::kNone && c.ratio < 1.0) {
      (*o)["ratio"] = c.ratio;
    } else {
      o->erase("ratio");
    }
  }
  return j;
}

int RunEstimate(const EstimateArgs& a) {
  constexpr std::string_view kCommand = "estimate";
  train::EstimateInput in;
  Result<model::LlamaConfig> m = model::ResolveModel(a.model);
  if (!m.ok()) return ReportError(kCommand, m.status().WithContext("--model"));
  in.model = *m;
  // A model directory holding weights (or its config.json): set-up loads them.
  in.from_weights = train::HasWeights(train::ModelDirOf(a.model));
  std::string config_text;
  if (!a.config.empty()) {
    Result<Config> c = LoadConfigFile(a.config);
    if (!c.ok()) return ReportError(kCommand, c.status());
    in.config = *c;
  } else if (a.plan) {
    // Nothing given: plan ZeRO-3 in bf16 with both homes open.
    Result<Config> c = ParseConfig(kDefaultPlanConfig, "<strata estimate --plan default>");
    if (!c.ok()) return ReportError(kCommand, c.status());
    in.config = *c;
  } else {
    in.config.batch.train_micro_batch_size_per_gpu = 1;
  }
  if (!a.nvme_path.empty()) {
    // A directory for "auto" and "nvme" homes that name none.
    for (auto* path :
         {&in.config.zero.offload_param.nvme_path, &in.config.zero.offload_optimizer.nvme_path}) {
      if (path->empty()) *path = a.nvme_path;
    }
  }
  if (static_cast<int64_t>(a.nodes) * a.gpus > (1 << 20)) {
    return ReportError(
        kCommand, InvalidArgumentError(fmt::format("--nodes {} x --gpus {}: more than 2^20 ranks",
                                                   a.nodes, a.gpus)));
  }
  Result<train::Hardware> hw = ParseHardware(a);
  if (!hw.ok()) return ReportError(kCommand, hw.status());
  in.world_size = a.ranks > 0 ? a.ranks : hw->world_size();
  if (a.ranks > 0 && a.ranks != hw->world_size()) {
    // --ranks alone (the memory estimate's old form): one node of that many GPUs.
    if (a.nodes != 1) {
      return ReportError(kCommand, InvalidArgumentError(fmt::format(
                                       "--ranks {} does not equal --nodes {} x --gpus {}", a.ranks,
                                       a.nodes, a.gpus)));
    }
    hw->gpus_per_node = a.ranks;
  }
  if (a.tensor_parallel > 0) in.config.tensor_parallel_size = a.tensor_parallel;
  if (hw->gpus_per_node % in.config.tensor_parallel_size != 0) {
    return ReportError(kCommand,
                       InvalidArgumentError(fmt::format(
                           "tensor parallelism of {} does not divide the {} GPU(s) per node: a "
                           "tensor-parallel group lies within one node",
                           in.config.tensor_parallel_size, hw->gpus_per_node)));
  }
  in.seq_len = a.seq_len;
  in.device = a.device == "cpu" ? device::DeviceType::kCpu : device::DeviceType::kCuda;
  hw->shared_cores = in.device == device::DeviceType::kCpu;
  nlohmann::json measured = nullptr;
  if (a.measure) {
    train::MeasureOptions mo;
    mo.device = in.device;
    mo.nvme_path = a.nvme_path;
    mo.ranks_per_node = hw->gpus_per_node;
    fmt::print(stderr, "strata estimate: measuring this machine's rates (a few seconds)\n");
    Result<std::vector<std::string>> lines = train::MeasureHardware(mo, &*hw);
    if (!lines.ok()) return ReportError(kCommand, lines.status().WithContext("--measure"));
    for (const auto& l : *lines)
      fmt::print(stderr, "  measured: {}\n", l);
    measured = *lines;
  }

  Result<train::PlacementPlan> plan = train::PlanPlacement(in, *hw);
  if (!plan.ok()) {
    // Nothing fits: still show the config as given when it has no "auto" (the memory table is
    // what tells the user why), else the planner's error.
    if (HasAutoOffload(in.config) || a.plan) return ReportError(kCommand, plan.status());
  }
  // The estimate shown: the chosen placement, or the config's own when it does not fit.
  train::PlanCandidate shown;
  if (plan.ok()) {
    shown = plan->best();
  } else {
    Result<train::PlanCandidate> own = train::EstimatePlacement(
        in, *hw, in.config.zero.offload_param.device, in.config.zero.offload_optimizer.device,
        in.config.zero.offload_optimizer.ratio);
    if (!own.ok()) return ReportError(kCommand, own.status());
    shown = *own;
  }
  Config chosen_cfg = in.config;
  if (Status s = train::ApplyPlacement(&chosen_cfg, shown); !s.ok()) {
    return ReportError(kCommand, s);
  }

  if (a.json) {
    nlohmann::json j = train::MemoryEstimateJson(shown.memory);
    j["model"] = in.model.name;
    j["device_type"] = a.device;
    j["hardware"] = train::HardwareJson(*hw);
    if (a.measure) j["measured"] = measured;
    j["fit"] = train::FitJson(shown.fit);
    j["time"] = train::TimeEstimateJson(shown.time);
    j["placement"] = {{"offload_param", OffloadDeviceName(shown.param)},
                      {"offload_optimizer", OffloadDeviceName(shown.optimizer)},
                      {"offload_optimizer_ratio", shown.ratio},
                      {"offloaded_fraction", shown.time.offloaded_fraction}};
    if (plan.ok()) {
      nlohmann::json c = nlohmann::json::array();
      for (const auto& cand : plan->candidates) {
        c.push_back({{"offload_param", OffloadDeviceName(cand.param)},
                     {"offload_optimizer", OffloadDeviceName(cand.optimizer)},
                     {"offload_optimizer_ratio", cand.ratio},
                     {"offloaded_fraction", cand.time.offloaded_fraction},
                     {"fits", cand.fit.fits()},
                     {"overflow", cand.fit.Overflow()},
                     {"step_s", cand.time.step_s},
                     {"device_peak_bytes", cand.memory.device_peak()}});
      }
      j["candidates"] = c;
      j["reasons"] = plan->reasons;
      if (a.plan) j["config"] = PlannedConfig(a.config, shown, chosen_cfg);
    }
    fmt::print(stdout, "{}\n", j.dump());
    return kExitOk;
  }
  if (a.plan) {
    // The config alone on stdout (it can be redirected to a file); the reasons on stderr.
    for (const auto& r : plan->reasons)
      fmt::print(stderr, "strata estimate --plan: {}\n", r);
    fmt::print(stdout, "{}\n", PlannedConfig(a.config, shown, chosen_cfg).dump(2));
    return kExitOk;
  }
  fmt::print(stdout, "strata estimate: model {} on {} ({} device), {}\n", in.model.name,
             a.config.empty() ? "no DeepSpeed config (stage 0, fp32, micro-batch 1)" : a.config,
             a.device, train::PlacementName(shown));
  fmt::print(stdout, "{}", train::FormatMemoryEstimate(shown.memory));
  fmt::print(stdout, "{}", train::FormatFit(shown.fit));
  fmt::print(stdout, "{}", train::FormatTimeEstimate(shown.time, *hw));
  if (plan.ok() && plan->candidates.size() > 1) {
    fmt::print(stdout, "placement (\"auto\")\n");
    for (const auto& r : plan->reasons)
      fmt::print(stdout, "  {}\n", r);
  }
  return kExitOk;
}

}  // namespace

void RegisterEstimateCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<EstimateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "What a strata train run would allocate per rank and tier (device memory, the pinned pool, "
      "the NVMe swap files) from the engine's own formulas, whether it fits the hardware, how "
      "long a step takes by the time model, and (--plan) the placement for \"auto\" homes "
      "(docs/planning.md)");
  cmd->add_option("--model", args->model,
                  fmt::format("A model directory (config.json) or a preset ({})",
                              fmt::join(model::LlamaPresetNames(), ", ")))
      ->required();
  cmd->add_option("--config", args->config,
                  "A DeepSpeed config (zero_optimization, bf16/fp16, batch sizes, strata.*); "
                  "offload devices may be \"auto\"");
  cmd->add_option("--ranks", args->ranks,
                  "Data-parallel ranks (default --nodes x --gpus; alone it means one node of "
                  "that many GPUs)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--tensor-parallel", args->tensor_parallel,
                  "Tensor-parallel ranks per group, within a node (default: the config's "
                  "tensor_parallel.autotp_size, else 1)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--seq-len", args->seq_len,
                  "Tokens per sequence (default: as strata train, min(256, max positions))")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--device", args->device, "cuda or cpu (the CPU device has no op workspace)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "One JSON object instead of the table");
  cmd->add_flag("--plan", args->plan,
                "Print the config the planner chooses for \"auto\" homes (stdout) and why "
                "(stderr); without --config, plans ZeRO-3 bf16 with both homes \"auto\"");
  cmd->add_option("--nvme-path", args->nvme_path,
                  "A directory for NVMe homes that name none (lets \"auto\" consider NVMe); "
                  "--measure benchmarks it");
  cmd->add_flag("--measure", args->measure,
                "Measure this machine's rates instead of the flags' (CPU AdamW with the engine's "
                "kernel; NVMe in --nvme-path with nvme-bench's engine; on --device cpu OpenBLAS "
                "sgemm; on cuda the GPUs' count, memory and peak by name)");
  auto* hw = cmd->add_option_group("hardware", "What the run is planned for (per GPU / per node)");
  hw->add_option("--gpus", args->gpus, "GPUs (ranks) per node")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  hw->add_option("--nodes", args->nodes, "Nodes")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  hw->add_option("--gpu-mem", args->gpu_mem, "Memory per GPU (default 80GB)")
      ->transform(ByteSize());
  hw->add_option("--device-budget", args->device_budget,
                 "Device budget per rank (default: --gpu-mem less max(512 MiB, 5%), as the CUDA "
                 "device leaves)")
      ->transform(ByteSize());
  hw->add_option("--cpu-mem", args->cpu_mem,
                 "Host memory per node (default 1TB; 90% may be planned)")
      ->transform(ByteSize());
  hw->add_option("--nvme", args->nvme, "NVMe capacity per node for swap files (default 8TB)")
      ->transform(ByteSize());
  hw->add_option("--nvme-read", args->nvme_read, "NVMe read per node, all drives")
      ->capture_default_str();
  hw->add_option("--nvme-write", args->nvme_write, "NVMe write per node")->capture_default_str();
  hw->add_option("--nvme-tbw", args->nvme_tbw,
                 "Endurance of a node's drives together, bytes written (e.g. 14000T): prints the "
                 "days until it is used up");
  hw->add_option("--pcie", args->pcie, "PCIe per GPU, each way")->capture_default_str();
  hw->add_option("--cpu-adam", args->cpu_adam, "CPU AdamW parameters per second per node")
      ->capture_default_str();
  hw->add_option("--nvlink", args->nvlink, "Collective bus bandwidth per GPU within a node")
      ->capture_default_str();
  hw->add_option("--net", args->net, "Collective bandwidth per GPU across nodes")
      ->capture_default_str();
  hw->add_option("--hbm", args->hbm, "GPU memory bandwidth")->capture_default_str();
  hw->add_option("--gpu-tflops", args->gpu_tflops, "Dense 16-bit peak TFLOPS per GPU")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  hw->add_option("--io-cpu-share", args->io_cpu_share,
                 "The CPU device: the share of compute its NVMe transfers take while they run (1: "
                 "their whole time adds to the step; --measure measures it)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  hw->add_option("--gpu-efficiency", args->gpu_efficiency,
                 "Fraction of the peak the model's kernels reach")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  cmd->callback([args, exit_code] { *exit_code = RunEstimate(*args); });
}

}  // namespace strata::cli
