// `strata estimate` against what `strata train` then measures on the CPU device: the device
// allocator's peak per rank (--metrics device_peak_bytes) must match the estimate within 5%
// (issue 20's bound) for every stage and placement, with host memory shared and not, and the
// NVMe swap files must have exactly the estimated sizes. Also: bad input is one clear error.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "test_support.h"

namespace strata::cli {
namespace {

using strata::testing::RunStrata;
using strata::testing::TempDir;
using strata::testing::WriteLlamaModelDir;

struct Placement {
  const char* name;
  const char* zero;  // the zero_optimization object; @DIR@ is the NVMe path
  const char* precision;
  bool both_sharings;  // also with share_host_memory off (it matters for offloaded stage-3 shards)
  const char* strata = "";  // more keys of the strata section
  const char* memory = "";  // more keys of strata.memory
};

// A model small enough for quick runs, with units of several sizes: 5.6M parameters, the
// embedding and the head (2048 x 256) larger than a layer.
std::string WriteSmallModel(const TempDir& dir) {
  return WriteLlamaModelDir(dir.file("model"), 2048, 256, 704, 4, 256);
}

TEST(EstimateTest, DevicePeakMatchesWhatTrainingMeasures) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "100k", "--vocab", "2048"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  const std::string model = WriteSmallModel(dir);
  const std::string nvme = dir.file("nvme");
  std::filesystem::create_directories(nvme);
  const Placement placements[] = {
      {"stage 0 fp32", R"({"stage": 0})", "", false},
      {"stage 1 bf16, optimizer on the CPU",
       R"({"stage": 1, "offload_optimizer": {"device": "cpu"}})", R"("bf16": {"enabled": true},)",
       false},
      {"stage 2 bf16, optimizer on the CPU",
       R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})", R"("bf16": {"enabled": true},)",
       false},
      {"stage 2 fp32, optimizer on the device", R"({"stage": 2})", "", false},
      {"stage 2 fp32, half the optimizer on NVMe",
       R"({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@", "ratio": 0.5}})",
       "", false},
      {"stage 2 bf16, embedding and 2 layers frozen, optimizer on the CPU",
       R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})", R"("bf16": {"enabled": true},)",
       false, R"("freeze": ["model.embed_tokens.*", "model.layers.[01].*"], )"},
      {"stage 3 bf16, layers 0-1 frozen, everything on the device", R"({"stage": 3})",
       R"("bf16": {"enabled": true},)", false, R"("freeze": ["model.layers.[01].*"], )"},
      // LoRA: adapter units between the blocks, every base unit frozen (no gradient buffers).
      {"stage 3 bf16, LoRA r 16 on every projection, everything on the device", R"({"stage": 3})",
       R"("bf16": {"enabled": true},)", false,
       R"("lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}, )"},
      // The live-buffer limit from the largest unit: a frozen base unit's gathered copy only.
      {"stage 3 bf16, LoRA r 8, parameters on the CPU, live limit from the largest unit",
       R"({"stage": 3, "stage3_max_live_parameters": 1000, "offload_param": {"device": "cpu"}})",
       R"("bf16": {"enabled": true},)", false, R"("lora": {"r": 8}, )"},
      {"stage 2 fp32, LoRA r 8 on q and v, optimizer on the CPU",
       R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})", "", false,
       R"("lora": {"r": 8}, )"},
      {"stage 3 bf16, parameters on the CPU, 3/4 of the optimizer",
       R"({"stage": 3, "offload_param": {"device": "cpu"},
           "offload_optimizer": {"device": "cpu", "ratio": 0.75}})",
       R"("bf16": {"enabled": true},)", true},
      {"stage 3 bf16, everything on the device", R"({"stage": 3})", R"("bf16": {"enabled": true},)",
       false},
      {"stage 3 bf16, parameters and optimizer on the CPU",
       R"({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})",
       R"("bf16": {"enabled": true},)", true},
      {"stage 3 bf16, parameters and optimizer on NVMe",
       R"({"stage": 3, "stage3_prefetch_bucket_size": 500000, "stage3_max_live_parameters": 1000000,
           "sub_group_size": 300000,
           "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
           "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})",
       R"("bf16": {"enabled": true},)", true},
      // Split blocks (strata.split_blocks), every block's internals kept, as in the 70B full
      // trial; and recomputed part by part, each part gathered again before its down part.
      {"stage 3 bf16, split blocks, parameters and optimizer on NVMe",
       R"({"stage": 3, "stage3_prefetch_bucket_size": 500000, "stage3_max_live_parameters": 1000000,
           "sub_group_size": 300000,
           "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
           "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})",
       R"("bf16": {"enabled": true},)", false, R"("split_blocks": true, )"},
      // Checkpoints in host memory (strata.offload_checkpoints): two of the four block inputs.
      {"stage 3 bf16, checkpoints in host memory, parameters and optimizer on NVMe",
       R"({"stage": 3, "stage3_prefetch_bucket_size": 500000, "stage3_max_live_parameters": 1000000,
           "sub_group_size": 300000,
           "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
           "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})",
       R"("bf16": {"enabled": true},)", false, R"("offload_checkpoints": true, )"},
      {"stage 3 bf16, split blocks recomputed, everything on the device",
       R"({"stage": 3, "stage3_max_live_parameters": 1000})", R"("bf16": {"enabled": true},)",
       false, R"("split_blocks": true, "activation_checkpointing": true, )"},
      // The two-layer 70B trial's placement in small (benchmarks/llama70b_layers.py --stream):
      // frozen base weights on NVMe with the host tier bounded below the model, so that they
      // stream every step; the pool is planned from strata.memory.host_budget. (The live limit
      // binds, as in the trial: else the gathers a throttled host gets ahead vary.)
      {"stage 3 bf16, LoRA, parameters and optimizer on NVMe, host budget below the model",
       R"({"stage": 3, "stage3_max_live_parameters": 1000,
           "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
           "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})",
       R"("bf16": {"enabled": true},)", false,
       R"("lora": {"r": 16, "target_modules": "all-linear"}, )", R"("host_budget": 4000000, )"},
  };
  int run = 0;
  for (const Placement& p : placements) {
    for (const char* share : {"on", "off"}) {
      if (!p.both_sharings && std::string(share) == "off") continue;
      SCOPED_TRACE(std::string(p.name) + ", share_host_memory " + share);
      std::string zero = p.zero;
      for (size_t at; (at = zero.find("@DIR@")) != std::string::npos;) zero.replace(at, 5, nvme);
      const std::string config = dir.file("ds" + std::to_string(run) + ".json");
      {
        std::ofstream out(config);
        out << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, )"
            << p.precision
            << R"( "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                   "strata": {)"
            << p.strata << R"("memory": {)" << p.memory << R"("share_host_memory": ")" << share
            << R"("}}, "zero_optimization": )" << zero << "}";
      }
      auto est = RunStrata({"estimate", "--model", model, "--config", config, "--seq-len", "128",
                            "--device", "cpu", "--json"});
      ASSERT_EQ(est.exit_code, 0) << est.err;
      const auto e = nlohmann::json::parse(est.out);
      // Offloaded checkpoints: blocks 0 and 1's inputs, 2 x 128 tokens x 256 x 4 bytes each.
      const bool offload = std::string(p.strata).find("offload_checkpoints") != std::string::npos;
      EXPECT_EQ(e["device"]["offload_checkpoints"].get<bool>(), offload);
      EXPECT_EQ(e["checkpoint_host_bytes"].get<uint64_t>(), offload ? 2u * 2 * 128 * 256 * 4 : 0u);
      const std::string metrics = dir.file("m" + std::to_string(run++) + ".jsonl");
      auto r = RunStrata({"train", "--config", config, "--model", model, "--data", data,
                          "--seq-len", "128", "--steps", "2", "--device", "cpu", "--metrics",
                          metrics},
                         std::chrono::seconds(300));
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      uint64_t measured = 0, pool = 0, pool_peak = 0, rss = 0;
      std::ifstream in(metrics);
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        measured = std::max(measured, j["device_peak_bytes"].get<uint64_t>());
        pool = j["pinned_pool_bytes"].get<uint64_t>();
        pool_peak = std::max(pool_peak, j["pinned_pool_peak_bytes"].get<uint64_t>());
        rss = std::max(rss, j["host_rss_peak_bytes"].get<uint64_t>());
      }
      // The pool the run made is the planned one (rounded up to whole huge pages), and what the
      // engine held of it stayed inside; the process's resident peak holds at least the device
      // peak (the CPU device's memory is host memory).
      const auto planned_pool = e["pinned_pool_bytes"].get<uint64_t>();
      EXPECT_GE(pool, planned_pool);
      EXPECT_LE(pool, planned_pool + (2u << 20));
      EXPECT_LE(pool_peak, pool);
      EXPECT_GT(rss, measured);
      const auto estimated = e["device"]["peak_bytes"].get<uint64_t>();
      const double ratio = static_cast<double>(measured) / static_cast<double>(estimated);
      std::printf("  %-52s share %-3s device peak: measured %llu, estimated %llu (%.4f)\n",
                  p.name, share, static_cast<unsigned long long>(measured),
                  static_cast<unsigned long long>(estimated), ratio);
      EXPECT_NEAR(ratio, 1.0, 0.05) << "measured " << measured << ", estimated " << estimated;
    }
  }
}

TEST(EstimateTest, SwapFilesHaveTheEstimatedSizes) {
  TempDir dir;
  const std::string nvme = dir.file("nvme");
  std::filesystem::create_directories(nvme);
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
               "zero_optimization": {"stage": 3, "sub_group_size": 300000,
                 "offload_param": {"device": "nvme", "nvme_path": ")"
        << nvme << R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" << nvme
        << R"("}}})";
  }
  auto est = RunStrata({"estimate", "--model", "llama-tiny", "--config", config, "--device", "cpu",
                        "--json"});
  ASSERT_EQ(est.exit_code, 0) << est.err;
  const auto e = nlohmann::json::parse(est.out);
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"}).exit_code,
            0);
  // The swap files are removed when the run ends; their sizes, fixed when they are created, are
  // in the debug log ("NVMe file for 'param' state: ... (N B)").
  auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                      "--seq-len", "32", "--steps", "1", "--device", "cpu"},
                     std::chrono::seconds(120), {"STRATA_LOG_LEVEL=debug"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto param = e["nvme"]["param_file_bytes"].get<uint64_t>();
  const auto optim = e["nvme"]["optim_file_bytes"].get<uint64_t>();
  EXPECT_GT(param, 0u);
  EXPECT_GT(optim, 0u);
  const std::string log = r.out + r.err;
  EXPECT_NE(log.find("'param' state: " ), std::string::npos) << log;
  EXPECT_NE(log.find("(" + std::to_string(param) + " B)"), std::string::npos)
      << "the log does not give the parameter file " << param << " bytes:\n" << log;
  EXPECT_NE(log.find("(" + std::to_string(optim) + " B)"), std::string::npos)
      << "the log does not give the optimizer file " << optim << " bytes:\n" << log;
}

// strata train checks the same plan before it allocates anything: a run whose set-up alone
// exceeds the device budget is one error naming the need, its largest parts and the budget.
TEST(EstimateTest, TrainRefusesAPlanOverTheDeviceBudgetUpFront) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "1024"}).exit_code,
            0);
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
               "strata": {"memory": {"device_budget": "64MiB"}}})";
  }
  auto r = RunStrata({"train", "--config", config, "--model", "llama-20m", "--data", data,
                      "--steps", "1", "--device", "cpu", "--save", dir.file("out")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("device memory: this run needs"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("AdamW master, exp_avg, exp_avg_sq"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("device budget of 64.00 MiB"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
}

// --plan: the config the planner chooses for "auto" homes on stdout (JSON a run can take), the
// reasons on stderr; the placement depends on the hardware given.
TEST(EstimateTest, PlanPrintsTheChosenConfigAndWhy) {
  TempDir dir;
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
               "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                     "offload_optimizer": {"device": "auto"}}})";
  }
  // A config with a deprecated spelling beside: the plan drops it, so the printed config loads.
  const std::string deprecated = dir.file("deprecated.json");
  {
    std::ofstream out(deprecated);
    out << R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
               "zero_optimization": {"stage": 2, "cpu_offload": true}})";
  }
  {
    auto p = RunStrata({"estimate", "--model", "llama-tiny", "--config", deprecated, "--plan"});
    ASSERT_EQ(p.exit_code, 0) << p.err;
    const std::string planned = dir.file("planned.json");
    std::ofstream(planned) << p.out;
    auto again = RunStrata({"estimate", "--model", "llama-tiny", "--config", planned});
    EXPECT_EQ(again.exit_code, 0) << p.out << again.err;
    EXPECT_NE(again.out.find("optimizer on cpu"), std::string::npos) << again.out;
  }
  // Llama-3-8B on one 80 GB GPU with 1 TB of host memory: the optimizer states (96 GB) leave
  // the GPU for host memory.
  auto r = RunStrata({"estimate", "--model", "llama3-8b", "--config", config, "--gpus", "1",
                      "--seq-len", "1024", "--plan", "--nvme-path", dir.file("nvme")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["zero_optimization"]["stage"], 3);
  EXPECT_EQ(j["zero_optimization"]["offload_optimizer"]["device"], "cpu") << r.out;
  EXPECT_EQ(j["bf16"]["enabled"], true);  // the rest of the config as given
  EXPECT_NE(r.err.find("chosen: parameters on"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("does not fit (device"), std::string::npos) << r.err;
  // Without --config the printed config is whole (a micro-batch, bf16), and estimates as it is.
  auto bare = RunStrata({"estimate", "--model", "llama3-8b", "--gpus", "1", "--seq-len", "1024",
                         "--plan", "--nvme-path", dir.file("nvme")});
  ASSERT_EQ(bare.exit_code, 0) << bare.err;
  const auto b = nlohmann::json::parse(bare.out);
  EXPECT_EQ(b["train_micro_batch_size_per_gpu"], 1) << bare.out;
  EXPECT_EQ(b["bf16"]["enabled"], true) << bare.out;
  EXPECT_EQ(b["zero_optimization"]["stage"], 3) << bare.out;
  const std::string bare_planned = dir.file("planned-bare.json");
  std::ofstream(bare_planned) << bare.out;
  auto bare_again = RunStrata({"estimate", "--model", "llama3-8b", "--config", bare_planned,
                               "--gpus", "1", "--seq-len", "1024"});
  ASSERT_EQ(bare_again.exit_code, 0) << bare_again.err;
  EXPECT_EQ(bare_again.out.find("DOES NOT FIT"), std::string::npos) << bare_again.out;
  // The lent GPU machine (80 GB HBM, 128 GB of RAM, a 64 GB disk): the states fit no single
  // home (docs/planning.md), so they are split, a share in host memory and the rest on the GPU.
  r = RunStrata({"estimate", "--model", "llama3-8b", "--config", config, "--gpus", "1",
                 "--seq-len", "1024", "--plan", "--cpu-mem", "128GB", "--nvme", "64GB",
                 "--nvme-path", dir.file("nvme")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto k = nlohmann::json::parse(r.out);
  EXPECT_EQ(k["zero_optimization"]["offload_optimizer"]["device"], "cpu") << r.out;
  const double ratio = k["zero_optimization"]["offload_optimizer"]["ratio"].get<double>();
  EXPECT_GT(ratio, 0.0);
  EXPECT_LT(ratio, 1.0);
  EXPECT_NE(r.err.find("optimizer on cpu: does not fit (host memory"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("optimizer on nvme: does not fit (NVMe"), std::string::npos) << r.err;
  // The printed config trains as planned: estimated again, it fits with that ratio.
  const std::string planned = dir.file("planned-8b.json");
  std::ofstream(planned) << r.out;
  auto again = RunStrata({"estimate", "--model", "llama3-8b", "--config", planned, "--gpus", "1",
                          "--seq-len", "1024", "--cpu-mem", "128GB", "--nvme", "64GB"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find(fmt::format("optimizer on cpu (ratio {:g}", ratio)), std::string::npos)
      << again.out;
  EXPECT_EQ(again.out.find("DOES NOT FIT"), std::string::npos) << again.out;
  // With half of that machine's memory nothing fits: one error naming each candidate.
  r = RunStrata({"estimate", "--model", "llama3-8b", "--config", config, "--gpus", "1",
                 "--seq-len", "1024", "--plan", "--gpu-mem", "40GB", "--cpu-mem", "64GB",
                 "--nvme", "32GB", "--nvme-path", dir.file("nvme")});
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.err.find("no placement fits"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("parameters on nvme, optimizer on nvme: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("parameters on nvme, optimizer on cpu (ratio 0.0625"), std::string::npos)
      << r.err;
}

// A model directory that holds weights is loaded, not randomly initialised: set-up holds the
// largest unit's shard being read (a frozen unit's in the compute dtype only), and the fit counts
// that. The same model without weights is estimated with random initialisation.
TEST(EstimateTest, SetUpOfAModelWithWeightsIsItsLoad) {
  TempDir dir;
  const std::string model = WriteSmallModel(dir);
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "2048"}).exit_code, 0);
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
               "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
               "zero_optimization": {"stage": 3}})";
  }
  auto r = RunStrata({"train", "--config", config, "--model", model, "--data", data, "--seq-len",
                      "64", "--steps", "1", "--device", "cpu", "--save", dir.file("ckpt")});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string weights = dir.file("ckpt/latest");
  auto estimate = [&](const std::string& m, const std::string& extra) {
    const std::string c = dir.file("e.json");
    {
      std::ofstream out(c);
      out << R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}, )" << extra
          << R"("zero_optimization": {"stage": 3}})";
    }
    auto e = RunStrata({"estimate", "--model", m, "--config", c, "--device", "cpu", "--json"});
    EXPECT_EQ(e.exit_code, 0) << e.err;
    return nlohmann::json::parse(e.out);
  };
  const auto fresh = estimate(model, "");
  const auto loaded = estimate(weights, "");
  EXPECT_FALSE(fresh["from_weights"].get<bool>());
  EXPECT_EQ(fresh["host_setup_bytes"], fresh["host_init_bytes"]);
  EXPECT_TRUE(loaded["from_weights"].get<bool>());
  EXPECT_EQ(loaded["host_setup_bytes"], loaded["host_load_bytes"]);
  // One rank, stage 3: the largest unit's shard in fp32 and bf16 either way (its master weights
  // and their cast; the moments start at zero in place).
  EXPECT_EQ(loaded["host_load_bytes"].get<uint64_t>(), loaded["host_init_bytes"].get<uint64_t>());
  EXPECT_EQ(loaded["fit"]["host_need_bytes"].get<uint64_t>(),
            loaded["pinned_pool_bytes"].get<uint64_t>() + loaded["host_load_bytes"].get<uint64_t>() +
                loaded["device"]["peak_bytes"].get<uint64_t>());
  // Frozen (LoRA's base units): 2 bytes a parameter of the largest base unit's shard.
  const auto lora = estimate(weights, R"("strata": {"lora": {"r": 4}}, )");
  EXPECT_EQ(lora["host_setup_bytes"], lora["host_load_bytes"]);
  EXPECT_LT(lora["host_load_bytes"].get<uint64_t>(), lora["host_init_bytes"].get<uint64_t>());
  auto text = RunStrata({"estimate", "--model", weights, "--device", "cpu"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("loading the largest unit's shard from the weights"), std::string::npos)
      << text.out;
}

// The table and the JSON carry the fit and the time model.
TEST(EstimateTest, JsonHasFitAndTime) {
  auto r = RunStrata({"estimate", "--model", "llama3-70b", "--gpus", "8", "--nodes", "2",
                      "--seq-len", "4096", "--json", "--nvme-tbw", "14000T"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["world_size"], 16);
  EXPECT_EQ(j["hardware"]["nodes"], 2);
  EXPECT_FALSE(j["fit"]["fits"].get<bool>());  // stage 0, fp32: 70B does not fit a GPU
  EXPECT_NE(j["fit"]["overflow"].get<std::string>().find("device"), std::string::npos);
  EXPECT_GT(j["time"]["step_s"].get<double>(), 0.0);
  EXPECT_GT(j["time"]["collective_bytes"].get<double>(), 0.0);
  EXPECT_EQ(j["time"]["bound_by"], "compute");
  // Endurance is an amount of bytes, not a rate.
  r = RunStrata({"estimate", "--model", "llama-tiny", "--nvme-tbw", "14PB/s"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--nvme-tbw: '14PB/s' is not an amount of bytes"), std::string::npos) << r.err;
  r = RunStrata({"estimate", "--model", "llama-tiny"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* line : {"fit\n", "device per rank", "time per step", "critical path",
                           "tokens/s over all ranks, MFU"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
}

// strata train with "auto" homes plans for this machine, logs the choice and trains.
TEST(EstimateTest, TrainResolvesAutoHomes) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"}).exit_code,
            0);
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
               "zero_optimization": {"stage": 3,
                 "offload_param": {"device": "auto", "nvme_path": ")"
        << dir.file("nvme") << R"("},
                 "offload_optimizer": {"device": "auto", "nvme_path": ")"
        << dir.file("nvme") << R"("}}})";
  }
  auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                      "--steps", "2", "--device", "cpu", "--seq-len", "64"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("placement (\"auto\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("chosen: parameters on"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("parameters on auto"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step     2"), std::string::npos) << r.out;
  // A budget nothing fits: one error from the planner, before anything is allocated.
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
               "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                     "offload_optimizer": {"device": "auto"}},
               "strata": {"memory": {"device_budget": "64KiB"}}})";
  }
  r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                 "--steps", "1", "--device", "cpu", "--seq-len", "64"});
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.err.find("placement planner"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no placement fits"), std::string::npos) << r.err;
}

TEST(EstimateTest, BadInputIsOneClearError) {
  auto r = RunStrata({"estimate", "--model", "no-such-model"});
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--model"), std::string::npos) << r.err;
  r = RunStrata({"estimate", "--model", "llama-tiny", "--ranks", "0"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  r = RunStrata({"estimate", "--model", "llama-tiny", "--config", "/nonexistent/ds.json"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("/nonexistent/ds.json"), std::string::npos) << r.err;
  r = RunStrata({"estimate", "--model", "llama-tiny", "--nvme-read", "fast"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--nvme-read: 'fast' is not a rate"), std::string::npos) << r.err;
  r = RunStrata({"estimate", "--model", "llama-tiny", "--ranks", "3", "--nodes", "2"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--ranks 3 does not equal"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strata::cli
