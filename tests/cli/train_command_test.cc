// `strata train` end to end on one process: a tiny Llama trained for a few steps with ZeRO-3 and
// NVMe offload, its progress lines, metrics and Hugging Face checkpoint; and clear errors for
// bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_test_util.h"
#include "test_support.h"

namespace strata::cli {
namespace {

using ::testing::HasSubstr;
using strata::testing::RunStrata;
using strata::testing::TempDir;

std::string WriteConfig(const TempDir& dir, const std::string& extra = "") {
  const std::string path = dir.file("ds.json");
  std::ofstream out(path);
  out << R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
             "params": {"lr": 0.005}}, "bf16": {"enabled": true},
             "zero_optimization": {"stage": 3,
               "offload_param": {"device": "nvme", "nvme_path": ")"
      << dir.path().string() << R"("},
               "offload_optimizer": {"device": "nvme", "nvme_path": ")"
      << dir.path().string() << R"("}})" << extra << "}";
  return path;
}

TEST(TrainCommandTest, TrainsATinyLlamaAndSavesAHuggingFaceCheckpoint) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  const std::string config = WriteConfig(dir);
  auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                      "--seq-len", "32", "--steps", "6", "--save", dir.file("ckpt"), "--metrics",
                      dir.file("metrics.jsonl")},
                     std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("ZeRO stage 3, parameters on nvme, optimizer on nvme, bf16"));
  EXPECT_THAT(r.out, HasSubstr("step     6 | loss "));
  EXPECT_THAT(r.out, HasSubstr("from_pretrained"));
  EXPECT_TRUE(std::filesystem::exists(dir.file("ckpt/model.safetensors")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("ckpt/config.json")));
  // One metrics line per step, with the fields the docs list.
  std::ifstream metrics(dir.file("metrics.jsonl"));
  int lines = 0;
  for (std::string line; std::getline(metrics, line); ++lines) {
    auto j = nlohmann::json::parse(line);
    EXPECT_TRUE(j.contains("loss") && j.contains("tokens_per_s") && j.contains("exposed_io_s"));
    EXPECT_EQ(j["step"].get<int>(), lines + 1);
  }
  EXPECT_EQ(lines, 6);
}

TEST(TrainCommandTest, BadInputIsOneClearError) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "10k", "--vocab", "4000"})
                .exit_code,
            0);
  const std::string config = WriteConfig(dir);
  // Token ids beyond the model's vocabulary (256).
  auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                      "--seq-len", "16", "--steps", "1"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(data));
  EXPECT_THAT(r.err, HasSubstr("vocab"));
  // A model that is neither a directory nor a preset.
  r = RunStrata({"train", "--config", config, "--model", "/no/such/model", "--data", data});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("/no/such/model"));
  // A misspelled config key.
  const std::string bad = dir.file("bad.json");
  std::ofstream(bad) << R"({"zero_optimisation": {"stage": 3}})";
  r = RunStrata({"train", "--config", bad, "--model", "llama-tiny", "--data", data});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("zero_optimization"));
  // A data file whose size is not a whole number of tokens.
  const std::string odd = dir.file("odd.bin");
  std::ofstream(odd) << "abc";
  r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", odd});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(odd));
}

}  // namespace
}  // namespace strata::cli
