// `strata train` end to end on one process: a tiny Llama trained for a few steps with ZeRO-3 and
// NVMe offload, its progress lines, metrics and checkpoints (Hugging Face model + optimizer and
// trainer state); resuming continues the loss curve bit for bit, also from sharded files;
// fine-tuning loads a model directory's weights; and clear errors for bad input. Resuming on a
// different number of ranks is tested under mpirun (tests/train/resume_ranks.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <signal.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include "cli_test_util.h"
#include "common/file_lock.h"
#include "strata/device.h"
#include "test_support.h"

namespace strata::cli {
namespace {

using ::testing::HasSubstr;
using strata::testing::RunStrata;
using strata::testing::TempDir;
using strata::testing::WriteLlamaModelDir;

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

// DIR/NAME: micro-batch 2, AdamW at `lr`, the given zero_optimization and "strata" sections.
std::string WriteStrataConfig(const TempDir& dir, const std::string& name, double lr,
                              const std::string& zero, const std::string& strata) {
  const std::string path = dir.file(name);
  std::ofstream out(path);
  out << R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": )"
      << lr << R"(}}, "zero_optimization": )" << zero << R"(, "strata": )" << strata << "}";
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
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors",
                        "trainer_state.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir.file(std::string("ckpt/step-00000006/") + f))) << f;
  }
  EXPECT_EQ(std::filesystem::read_symlink(dir.file("ckpt/latest")), "step-00000006");
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
  // A tensor-parallel degree larger than the run: refused with both numbers.
  const std::string tp = dir.file("tp.json");
  std::ofstream(tp) << R"({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}})";
  r = RunStrata({"train", "--config", tp, "--model", "llama-tiny", "--data", data});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err,
              HasSubstr("tensor_parallel.autotp_size 2 does not divide the run's 1 rank(s)"));
}

// The whole file, byte for byte.
std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<double> Losses(const std::string& metrics_path) {
  std::vector<double> out;
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);) {
    out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  }
  return out;
}

// Train 6 steps saving every 3; resume from step 3 (whole files, and files split into shards
// with an index): steps 4-6 give the same losses, bit for bit.
TEST(TrainCommandTest, ResumeContinuesTheLossCurveExactly) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"}).exit_code, 0);
  const std::string config = WriteConfig(
      dir, R"(, "gradient_clipping": 1.0, "scheduler": {"type": "WarmupCosineLR",
              "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}})");
  for (const std::string shard : {"5GiB", "20000"}) {
    SCOPED_TRACE("--save-shard-size " + shard);
    const std::string ck = dir.file("ck" + shard);
    auto full = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                           "--seq-len", "32", "--steps", "6", "--save", ck, "--save-every", "3",
                           "--save-shard-size", shard, "--sampling", "sequential",
                           "--metrics", dir.file("full.jsonl")},
                          std::chrono::seconds(120));
    ASSERT_EQ(full.exit_code, 0) << full.out << full.err;
    if (shard != "5GiB") {
      EXPECT_TRUE(std::filesystem::exists(ck + "/step-00000003/model.safetensors.index.json"));
      EXPECT_TRUE(std::filesystem::exists(ck + "/step-00000003/optimizer.safetensors.index.json"));
      EXPECT_FALSE(std::filesystem::exists(ck + "/step-00000003/model.safetensors"));
    }
    // (No --sampling: the checkpoint's sequential order is kept. The metrics file is appended.)
    std::ofstream(dir.file("resumed.jsonl")) << "{\"step\": 0, \"loss\": 0.0}\n";
    auto resumed = RunStrata({"train", "--config", config, "--data", data, "--steps", "6",
                              "--resume", ck + "/step-00000003", "--metrics",
                              dir.file("resumed.jsonl")},
                             std::chrono::seconds(120));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
    EXPECT_THAT(resumed.out, HasSubstr("resumed " + ck + "/step-00000003 at step 3"));
    EXPECT_THAT(resumed.out, HasSubstr("loading weights and optimizer states from"));
    const auto a = Losses(dir.file("full.jsonl"));
    const auto b = Losses(dir.file("resumed.jsonl"));
    ASSERT_EQ(a.size(), 6u);
    ASSERT_EQ(b.size(), 4u);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(a[3 + i], b[1 + i]) << "step " << 4 + i;
    // Another order than the checkpoint's is refused.
    auto other = RunStrata({"train", "--config", config, "--data", data, "--steps", "6",
                            "--resume", ck + "/step-00000003", "--sampling", "random"});
    EXPECT_NE(other.exit_code, 0);
    EXPECT_THAT(other.err, HasSubstr("sequential sampling"));
    // --resume on the save directory takes its latest: step 6, nothing left to do.
    auto done = RunStrata({"train", "--config", config, "--data", data, "--steps", "6",
                           "--resume", ck});
    ASSERT_EQ(done.exit_code, 0) << done.err;
    EXPECT_THAT(done.out, HasSubstr("nothing to do"));
  }
}

// A Hugging Face directory with weights is fine-tuned from them (in another dtype: saved bf16,
// trained fp32): the first loss is the trained model's, not a random one's.
// offload_optimizer.ratio 0.5: the run says how the states are split, and on one rank the losses
// are those of the run with every state offloaded, bit for bit.
TEST(TrainCommandTest, PartialOptimizerOffloadTrainsLikeFullOffload) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  std::vector<double> losses[2];
  for (int half = 0; half < 2; ++half) {
    const std::string config = dir.file("ds" + std::to_string(half) + ".json");
    {
      std::ofstream out(config);
      out << R"({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.005}},
                 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                   "nvme_path": ")"
          << dir.path().string() << R"(", "ratio": )" << (half ? "0.5" : "1") << "}}}";
    }
    const std::string metrics = dir.file("m" + std::to_string(half) + ".jsonl");
    auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                        "--seq-len", "32", "--steps", "4", "--metrics", metrics},
                       std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    if (half) {
      EXPECT_THAT(r.out, HasSubstr("optimizer on nvme (ratio 0.5; the other units' states on the "
                                   "device)"));
    }
    losses[half] = Losses(metrics);
    ASSERT_EQ(losses[half].size(), 4u);
  }
  EXPECT_EQ(losses[0], losses[1]);
}

// strata.freeze: the run says what is frozen; the frozen tensors of the saved checkpoint are the
// initial ones bit for bit, its optimizer file holds no state for them; a resume with the same
// freeze continues, and one that would train them is a clear error.
TEST(TrainCommandTest, FrozenLayersStayAsTheyWereAndResume) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  auto config = [&](const std::string& name, const std::string& strata) {
    return WriteStrataConfig(dir, name, 0.005, R"({"stage": 2})", strata);
  };
  const std::string frozen =
      config("frozen.json", R"({"freeze": ["model.embed_tokens.*", "model.layers.0.*"]})");
  auto r = RunStrata({"train", "--config", frozen, "--model", "llama-tiny", "--data", data,
                      "--seq-len", "32", "--steps", "3", "--save", dir.file("ckpt"),
                      "--save-every", "1"},
                     std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("frozen (strata.freeze): 2 of 4 units (embed, layers.0)"));
  // Step 1's and step 3's embedding and first layer are the same bytes; the rest moved. (The
  // files are read by hand: safetensors is an 8-byte header length, a JSON header, the data.)
  auto tensor = [&](const std::string& file, const std::string& name) -> std::string {
    std::ifstream in(dir.file("ckpt/" + file), std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    in.read(header.data(), static_cast<std::streamsize>(n));
    const auto j = nlohmann::json::parse(header);
    if (!j.contains(name)) return "";
    const uint64_t begin = j[name]["data_offsets"][0], end = j[name]["data_offsets"][1];
    std::string bytes(end - begin, '\0');
    in.seekg(static_cast<std::streamoff>(8 + n + begin));
    in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return bytes;
  };
  const std::string first = "step-00000001/model.safetensors", last = "step-00000003/model.safetensors";
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"}) {
    EXPECT_FALSE(tensor(first, name).empty()) << name;
    EXPECT_EQ(tensor(first, name), tensor(last, name)) << name;
  }
  EXPECT_NE(tensor(first, "model.layers.1.mlp.up_proj.weight"),
            tensor(last, "model.layers.1.mlp.up_proj.weight"));
  const std::string optim = "step-00000003/optimizer.safetensors";
  EXPECT_EQ(tensor(optim, "exp_avg.model.embed_tokens.weight"), "");
  EXPECT_NE(tensor(optim, "exp_avg.model.layers.1.mlp.up_proj.weight"), "");

  r = RunStrata({"train", "--config", frozen, "--model", "llama-tiny", "--data", data,
                 "--seq-len", "32", "--steps", "4", "--resume", dir.file("ckpt")},
                std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string all = config("all.json", R"({})");
  r = RunStrata({"train", "--config", all, "--model", "llama-tiny", "--data", data, "--seq-len",
                 "32", "--steps", "4", "--resume", dir.file("ckpt")},
                std::chrono::seconds(120));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("has no optimizer state for them"));
  EXPECT_THAT(r.err, HasSubstr("master.model.embed_tokens.weight' is missing"));
}

// LoRA (strata.lora): the run says what trains; the checkpoint holds the adapters in PEFT's
// layout beside untouched base weights; a resume continues the loss curve bit for bit; eval with
// the adapter equals eval of `strata checkpoint merge-lora`'s output; bad settings are clear
// errors. (tests/oracle: the same against PyTorch; tests/hf/lora_peft.py: against PEFT.)
TEST(TrainCommandTest, LoraAdaptersTrainResumeAndMerge) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  auto config = [&](const std::string& name, const std::string& strata) {
    return WriteStrataConfig(dir, name, 0.01,
                             R"({"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}})",
                             strata);
  };
  const std::string lora = config(
      "lora.json", R"({"lora": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]}})");
  // A base model with weights: one plain step, saved.
  const std::string plain = config("plain.json", "{}");
  auto base = RunStrata({"train", "--config", plain, "--model", "llama-tiny", "--data", data,
                         "--seq-len", "32", "--steps", "1", "--save", dir.file("base")},
                        std::chrono::seconds(120));
  ASSERT_EQ(base.exit_code, 0) << base.out << base.err;
  const std::string base_dir = dir.file("base/latest");
  auto straight = RunStrata({"train", "--config", lora, "--model", base_dir, "--data", data,
                             "--seq-len", "32", "--steps", "6", "--save", dir.file("straight"),
                             "--metrics", dir.file("straight.jsonl")},
                            std::chrono::seconds(120));
  ASSERT_EQ(straight.exit_code, 0) << straight.out << straight.err;
  EXPECT_THAT(straight.out, HasSubstr("LoRA: r 4, lora_alpha 16 (scale 4) on q_proj, down_proj"));
  EXPECT_THAT(straight.out, HasSubstr("frozen (strata.trainable): 4 of 6 units"));
  const std::string step = dir.file("straight/latest");
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors", "model.safetensors"}) {
    EXPECT_TRUE(std::filesystem::exists(step + "/" + f)) << f;
  }
  const auto adapter_config = nlohmann::json::parse(std::ifstream(step + "/adapter_config.json"));
  EXPECT_EQ(adapter_config["peft_type"], "LORA");
  EXPECT_EQ(adapter_config["r"], 4);
  EXPECT_EQ(adapter_config["target_modules"], (nlohmann::json{"q_proj", "down_proj"}));
  // The base weights are the loaded ones, byte for byte (the same header and data).
  EXPECT_EQ(FileBytes(step + "/model.safetensors"), FileBytes(base_dir + "/model.safetensors"));

  // 3 steps, then a resume to 6: the same losses, bit for bit.
  auto first = RunStrata({"train", "--config", lora, "--model", base_dir, "--data", data,
                          "--seq-len", "32", "--steps", "3", "--save", dir.file("split"),
                          "--metrics", dir.file("split.jsonl")},
                         std::chrono::seconds(120));
  ASSERT_EQ(first.exit_code, 0) << first.out << first.err;
  auto resumed = RunStrata({"train", "--config", lora, "--data", data, "--steps", "6",
                            "--resume", dir.file("split"), "--metrics", dir.file("split.jsonl")},
                           std::chrono::seconds(120));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_EQ(Losses(dir.file("split.jsonl")), Losses(dir.file("straight.jsonl")));

  // Eval with the adapter = eval of the merged weights; without it, another loss.
  auto merge = RunStrata({"checkpoint", "merge-lora", "--base", step, "--adapter", step, "--out",
                          dir.file("merged")});
  ASSERT_EQ(merge.exit_code, 0) << merge.out << merge.err;
  EXPECT_THAT(merge.out, HasSubstr("4 weights merged"));
  auto eval = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"eval", "--data", data, "--seq-len", "32", "--sequences",
                                     "8", "--micro-batch", "4", "--json", dir.file("e.json")};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = RunStrata(args, std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return nlohmann::json::parse(std::ifstream(dir.file("e.json")))["loss"].get<double>();
  };
  const double adapted = eval({"--model", step, "--adapter", step});
  const double merged = eval({"--model", dir.file("merged")});
  const double unadapted = eval({"--model", base_dir});
  EXPECT_NEAR(adapted, merged, 1e-5 * adapted);
  EXPECT_GT(std::fabs(adapted - unadapted), 1e-4);
  // A LoRA step directory as --model carries its adapters.
  EXPECT_EQ(eval({"--model", step}), adapted);
  // adapter_config.json names the step directory itself as the base model.
  EXPECT_EQ(adapter_config["base_model_name_or_path"].get<std::string>(),
            std::filesystem::absolute(dir.file("straight/step-00000006")).string());
  // Merging again into the same directory would overwrite it: refused.
  merge = RunStrata({"checkpoint", "merge-lora", "--base", step, "--adapter", step, "--out",
                     dir.file("merged")});
  EXPECT_NE(merge.exit_code, 0);
  EXPECT_THAT(merge.err, HasSubstr("holds model weights already"));

  // Bad settings.
  auto bad = [&](const std::string& name, const std::string& strata) {
    auto r = RunStrata({"train", "--config", config(name, strata), "--model", base_dir, "--data",
                        data, "--seq-len", "32", "--steps", "1"});
    EXPECT_NE(r.exit_code, 0) << name;
    return r.err;
  };
  EXPECT_THAT(bad("t.json", R"({"lora": {"r": 4, "target_modules": ["lm_head"]}})"),
              HasSubstr("'lm_head' is not a projection of a Llama block"));
  EXPECT_THAT(bad("d.json", R"({"lora": {"r": 4, "lora_dropout": 0.1}})"),
              HasSubstr("LoRA dropout is not implemented"));
  EXPECT_THAT(bad("f.json", R"({"lora": {"r": 4}, "freeze": ["model.embed_tokens.*"]})"),
              HasSubstr("strata.lora and strata.freeze are both given"));
  auto mismatch = RunStrata({"train", "--config", config("m.json", R"({"lora": {"r": 8}})"),
                             "--model", base_dir, "--adapter", step, "--data", data,
                             "--seq-len", "32", "--steps", "1"});
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_THAT(mismatch.err, HasSubstr("differs from"));
  // A rank larger than a projection's smaller side (llama-tiny: k_proj is 64 in, 32 out).
  EXPECT_THAT(bad("r.json", R"({"lora": {"r": 33, "target_modules": ["k_proj"]}})"),
              HasSubstr("strata.lora.r 33 is larger than k_proj's smaller side"));
}

// `strata eval`: the loss of the weights on the first sequences equals the loss of step 1 of a
// training run on them (before its update); bad input is one clear error.
TEST(EvalCommandTest, MatchesTheFirstTrainingStepAndSaysWhatIsWrong) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  const std::string config = dir.file("ds.json");
  std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}})";
  const std::string metrics = dir.file("m.jsonl");
  auto train = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                          "--seq-len", "32", "--steps", "1", "--sampling", "sequential",
                          "--metrics", metrics});
  ASSERT_EQ(train.exit_code, 0) << train.out << train.err;
  const std::vector<double> step = Losses(metrics);
  ASSERT_EQ(step.size(), 1u);
  const std::string result = dir.file("eval.json");
  auto eval = RunStrata({"eval", "--config", config, "--model", "llama-tiny", "--data", data,
                         "--seq-len", "32", "--sequences", "4", "--json", result});
  ASSERT_EQ(eval.exit_code, 0) << eval.out << eval.err;
  EXPECT_THAT(eval.out, HasSubstr("forward only (no optimizer state)"));
  EXPECT_THAT(eval.out, HasSubstr("eval: loss "));
  std::ifstream in(result);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["sequences"].get<int>(), 4);
  EXPECT_EQ(j["tokens"].get<int>(), 128);
  EXPECT_DOUBLE_EQ(j["loss"].get<double>(), step[0]);
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(step[0]), 1e-9 * std::exp(step[0]));
  // The whole file, by default, in whole batches of 4.
  auto all = RunStrata({"eval", "--model", "llama-tiny", "--data", data, "--seq-len", "32",
                        "--micro-batch", "4"});
  ASSERT_EQ(all.exit_code, 0) << all.err;
  EXPECT_THAT(all.out, HasSubstr("over 624 sequence(s) x 32 tokens"));
  // Too few sequences for one batch, validation without its data, an unknown model.
  auto few = RunStrata({"eval", "--model", "llama-tiny", "--data", data, "--seq-len", "32",
                        "--micro-batch", "8", "--sequences", "5"});
  EXPECT_NE(few.exit_code, 0);
  EXPECT_THAT(few.err, HasSubstr("(--sequences 5); one evaluation batch needs 8"));
  auto no_data = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                            "--seq-len", "32", "--steps", "2", "--eval-every", "1"});
  EXPECT_NE(no_data.exit_code, 0);
  EXPECT_THAT(no_data.err, HasSubstr("--eval-every 1: needs --eval-data"));
  // Validation data too small for one batch is refused before the first step, not at the first
  // evaluation (when the steps before it would be lost).
  const std::string tiny = dir.file("tiny.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", tiny, "--tokens", "100", "--vocab", "256"})
                .exit_code,
            0);
  auto small_eval = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data",
                               data, "--seq-len", "32", "--steps", "5", "--eval-data", tiny,
                               "--eval-every", "4"});
  EXPECT_NE(small_eval.exit_code, 0);
  EXPECT_THAT(small_eval.err, HasSubstr("one evaluation batch needs 4"));
  EXPECT_THAT(small_eval.out, ::testing::Not(HasSubstr("step     1")));
  auto bad_model = RunStrata({"eval", "--model", dir.file("nothing"), "--data", data});
  EXPECT_NE(bad_model.exit_code, 0);
  EXPECT_THAT(bad_model.err, HasSubstr("neither a model directory"));
}

TEST(TrainCommandTest, FineTunesAModelDirectory) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"}).exit_code, 0);
  auto pre = RunStrata({"train", "--config", WriteConfig(dir), "--model", "llama-tiny", "--data",
                        data, "--seq-len", "32", "--steps", "30", "--save", dir.file("pre"),
                        "--metrics", dir.file("pre.jsonl")},
                       std::chrono::seconds(120));
  ASSERT_EQ(pre.exit_code, 0) << pre.out << pre.err;
  const std::string fp32 = dir.file("fp32.json");
  std::ofstream(fp32) << R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
      "params": {"lr": 0.001}}, "zero_optimization": {"stage": 2}})";
  auto ft = RunStrata({"train", "--config", fp32, "--model", dir.file("pre/latest"), "--data",
                       data, "--seq-len", "32", "--steps", "2", "--metrics",
                       dir.file("ft.jsonl")},
                      std::chrono::seconds(120));
  ASSERT_EQ(ft.exit_code, 0) << ft.out << ft.err;
  EXPECT_THAT(ft.out, HasSubstr("loading weights from"));
  const auto before = Losses(dir.file("pre.jsonl"));
  const auto after = Losses(dir.file("ft.jsonl"));
  ASSERT_EQ(after.size(), 2u);
  // ln(256) = 5.55 at random init; the pre-trained model is well below.
  EXPECT_LT(after[0], before[0] - 0.3) << "first loss " << after[0] << " vs " << before[0];
  EXPECT_LT(after[0], before.back() + 0.3) << "first loss " << after[0] << " vs " << before.back();
}

TEST(TrainCommandTest, BadModelsAndCheckpointsAreClearErrors) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"}).exit_code, 0);
  const std::string config = WriteConfig(dir);
  auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                      "--seq-len", "16", "--steps", "1", "--save", dir.file("ck")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string step = dir.file("ck/step-00000001");
  namespace fs = std::filesystem;

  // A model directory without config.json.
  fs::create_directories(dir.file("empty"));
  r = RunStrata({"train", "--config", config, "--model", dir.file("empty"), "--data", data});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(dir.file("empty")));
  EXPECT_THAT(r.err, HasSubstr("config.json"));

  // A safetensors file with a truncated header.
  fs::create_directories(dir.file("trunc"));
  fs::copy_file(step + "/config.json", dir.file("trunc/config.json"));
  {
    std::ifstream in(step + "/model.safetensors", std::ios::binary);
    std::string bytes(200, '\0');
    in.read(bytes.data(), 200);
    std::ofstream(dir.file("trunc/model.safetensors"), std::ios::binary) << bytes;
  }
  r = RunStrata({"train", "--config", config, "--model", dir.file("trunc"), "--data", data,
                 "--seq-len", "16", "--steps", "1"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr(dir.file("trunc/model.safetensors")));

  // Weights of another shape: a config claiming a wider model than the tensors hold.
  fs::create_directories(dir.file("shape"));
  fs::copy_file(step + "/model.safetensors", dir.file("shape/model.safetensors"));
  {
    std::ifstream in(step + "/config.json");
    auto j = nlohmann::json::parse(in);
    j["intermediate_size"] = j["intermediate_size"].get<int>() * 2;
    std::ofstream(dir.file("shape/config.json")) << j.dump();
  }
  r = RunStrata({"train", "--config", config, "--model", dir.file("shape"), "--data", data,
                 "--seq-len", "16", "--steps", "1"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("has shape"));
  EXPECT_THAT(r.err, HasSubstr("mlp"));

  // A checkpoint of a different model.
  r = RunStrata({"train", "--config", config, "--model", "llama-20m", "--data", data,
                 "--resume", dir.file("ck")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("different model"));
  EXPECT_THAT(r.err, HasSubstr("vocab_size is 256 in the checkpoint, 1024 in this run"));

  // Something that is not a checkpoint; a model directory (no optimizer states) as --resume.
  r = RunStrata({"train", "--config", config, "--data", data, "--resume", dir.file("empty")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("not a Strata checkpoint"));
  fs::copy(step, dir.file("noopt"));
  fs::remove(dir.file("noopt/optimizer.safetensors"));
  // With its checksums the missing file is damage, named as such ...
  r = RunStrata({"train", "--config", config, "--data", data, "--resume", dir.file("noopt")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("optimizer.safetensors: open"));
  // ... and without them (a checkpoint from before checksums) the loader says what is missing.
  fs::remove(dir.file("noopt/checksums.json"));
  r = RunStrata({"train", "--config", config, "--data", data, "--resume", dir.file("noopt")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("no optimizer states"));

  // A damaged trainer state.
  std::ofstream(dir.file("noopt/trainer_state.json")) << "{\"format\": \"strata-checkpoint\"";
  r = RunStrata({"train", "--config", config, "--data", data, "--resume", dir.file("noopt")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("trainer_state.json"));

  // Resuming with another sequence length.
  r = RunStrata({"train", "--config", config, "--data", data, "--resume", dir.file("ck"),
                 "--seq-len", "32", "--steps", "3"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("sequence length cannot change"));
}

// A checkpoint carries checksums of every byte (checksums.json): `strata checkpoint verify`
// checks one without training, and resuming checks first. Bytes changed in the optimizer states
// (which before checksums loaded silently) are an error naming the file, the bytes and the tensor,
// from both; a checkpoint that was not touched verifies, sharded or not.
TEST(TrainCommandTest, ChecksumsCatchADamagedCheckpoint) {
  TempDir dir;
  namespace fs = std::filesystem;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"}).exit_code, 0);
  const std::string config = WriteConfig(dir);
  for (const std::string shard : {"5GiB", "20000"}) {
    SCOPED_TRACE("--save-shard-size " + shard);
    const std::string ck = dir.file("ck" + shard);
    auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                        "--seq-len", "16", "--steps", "2", "--save", ck, "--save-shard-size",
                        shard});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(fs::exists(ck + "/step-00000002/checksums.json"));
    // No per-rank leftovers in the published directory.
    for (const auto& e : fs::directory_iterator(ck + "/step-00000002")) {
      EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
    }
    auto v = RunStrata({"checkpoint", "verify", ck});
    ASSERT_EQ(v.exit_code, 0) << v.out << v.err;
    EXPECT_THAT(v.out, HasSubstr("every byte matches its checksum"));
    EXPECT_THAT(v.out, HasSubstr("trainer_state.json"));
    auto js = RunStrata({"checkpoint", "verify", ck, "--json"});
    ASSERT_EQ(js.exit_code, 0) << js.err;
    auto j = nlohmann::json::parse(js.out);
    EXPECT_TRUE(j["ok"].get<bool>());
    EXPECT_GT(j["bytes"].get<uint64_t>(), 0u);
  }
  // 1 KiB of other bytes in the middle of the optimizer states.
  const std::string step = dir.file("ck5GiB/step-00000002");
  const std::string optim = step + "/optimizer.safetensors";
  const uint64_t at = fs::file_size(optim) / 2;
  {
    std::fstream f(optim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    const std::string junk(1024, '\x7f');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  auto v = RunStrata({"checkpoint", "verify", step});
  EXPECT_EQ(v.exit_code, 1);
  EXPECT_THAT(v.out, HasSubstr("damaged: optimizer.safetensors: bytes ["));
  EXPECT_THAT(v.err, HasSubstr("is damaged"));
  EXPECT_THAT(v.out, ::testing::ContainsRegex("\\((exp_avg|exp_avg_sq|master)\\."));
  auto r = RunStrata({"train", "--config", config, "--data", data, "--steps", "3", "--resume",
                      step});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("checkpoint " + step + " is damaged: optimizer.safetensors"));
  // Not a checkpoint with checksums: a clear error, not a crash.
  fs::create_directories(dir.file("none"));
  v = RunStrata({"checkpoint", "verify", dir.file("none")});
  EXPECT_NE(v.exit_code, 0);
  EXPECT_THAT(v.err, HasSubstr(dir.file("none")));
}

// A learning rate that overflows the weights: the step that makes them infinite still has a
// finite loss, so a save right after it must refuse to write them; the next step's loss is not
// finite and stops the run naming the step. Nothing is saved and no temporary directory is left.
TEST(TrainCommandTest, NonFiniteWeightsAreNeverSavedAndStopTheRun) {
  TempDir dir;
  namespace fs = std::filesystem;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"}).exit_code, 0);
  const std::string config = dir.file("huge_lr.json");
  std::ofstream(config) << R"({"train_micro_batch_size_per_gpu": 2,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e39}},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})";
  const std::string ck = dir.file("ck");
  auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                      "--seq-len", "16", "--steps", "3", "--save", ck, "--save-every", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("is not finite: not saving a checkpoint of non-finite weights"));
  EXPECT_FALSE(fs::exists(ck + "/latest"));
  if (fs::exists(ck)) {
    for (const auto& e : fs::directory_iterator(ck)) ADD_FAILURE() << "left behind: " << e.path();
  }
  // Without saving, the next step stops the run.
  r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                 "--seq-len", "16", "--steps", "3"});
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("step 2: the loss is"));
  EXPECT_THAT(r.err, HasSubstr("strata.on_nonfinite"));
}

// What a run owns is locked: a second run on the same NVMe files or the same --save directory is
// refused before it touches them, naming the path and the process holding it. Outputs that cannot
// be written, and numbers out of range, are refused before the first step.
TEST(TrainCommandTest, SecondRunsAndUnwritableOutputsAreRefusedUpFront) {
  TempDir dir;
  namespace fs = std::filesystem;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"}).exit_code, 0);
  const std::string config = WriteConfig(dir);
  const std::vector<std::string> base = {"train", "--config", config, "--model", "llama-tiny",
                                         "--data", data, "--seq-len", "16", "--steps", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    return RunStrata(args);
  };
  {
    // "Another run" holds rank 0's parameter swap file.
    const std::string swap = dir.file("strata.rank0.param.swap");
    auto held = FileLock::Acquire(swap, "NVMe offload file");
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    auto r = with({});
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(swap + " is in use by another process: pid " +
                                 std::to_string(::getpid())));
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step     1")));
  }
  {
    const std::string ck = dir.file("ck");
    fs::create_directories(ck);
    auto held = FileLock::Acquire(ck, "checkpoint directory", ck + "/.strata.lock");
    ASSERT_TRUE(held.ok());
    auto r = with({"--save", ck});
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("the checkpoint directory " + ck + " is in use"));
  }
  // Once the holder is gone the same run works, and leaves no lock files behind.
  auto ok = with({"--save", dir.file("ck")});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_FALSE(fs::exists(dir.file("ck/.strata.lock")));
  EXPECT_FALSE(fs::exists(dir.file("strata.rank0.param.swap.lock")));
  // Outputs that cannot be written: found before anything trains.
  std::ofstream(dir.file("a_file")) << "x";
  for (const std::string flag : {"--save", "--metrics", "--trace"}) {
    SCOPED_TRACE(flag);
    const std::string bad = dir.file("a_file/out");
    auto r = with({flag, bad});
    EXPECT_NE(r.exit_code, 0);
    EXPECT_THAT(r.err, HasSubstr(flag + " " + dir.file("a_file")));
    EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step     1")));
  }
  // Numbers out of range name the option.
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--seq-len", "0"}, {"--steps", "-3"}, {"--save-every", "-1"},
           {"--save-shard-size", "100"}}) {
    SCOPED_TRACE(flag);
    auto r = with({flag, value});
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr(flag));
  }
}

// SIGTERM (what Slurm sends before it kills a job) in the middle of a long run: the step in
// progress finishes, a checkpoint of it is saved (--save-on-signal), the swap and lock files are
// removed, and the exit status is 128 + 15; the checkpoint resumes.
TEST(TrainCommandTest, SigtermSavesAndStopsCleanly) {
  TempDir dir;
  namespace fs = std::filesystem;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"}).exit_code, 0);
  const std::string config = WriteConfig(dir);
  const std::string ck = dir.file("ck");
  bool sent = false;
  auto r = strata::testing::RunStrataWatching(
      {"train", "--config", config, "--model", "llama-tiny", "--data", data, "--seq-len", "16",
       "--steps", "1000000", "--save", ck, "--save-on-signal"},
      [&](pid_t pid, const std::string& out) {
        if (!sent && out.find("step     3 |") != std::string::npos) {
          ::kill(pid, SIGTERM);
          sent = true;
        }
      },
      std::chrono::seconds(120));
  ASSERT_TRUE(sent) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("SIGTERM received: finishing the current step, then saving"));
  EXPECT_THAT(r.err, ::testing::ContainsRegex("stopped by SIGTERM after step [0-9]+ of 1000000: "
                                              "checkpoint .*continue with --resume"));
  ASSERT_TRUE(fs::exists(ck + "/latest"));
  const std::string step = (fs::path(ck) / fs::read_symlink(ck + "/latest")).string();
  EXPECT_TRUE(fs::exists(step + "/checksums.json"));
  EXPECT_FALSE(fs::exists(ck + "/.strata.lock"));
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().string().find(".swap"), std::string::npos) << "left behind: " << e.path();
  }
  auto v = RunStrata({"checkpoint", "verify", ck});
  EXPECT_EQ(v.exit_code, 0) << v.out << v.err;
}

}  // namespace
}  // namespace strata::cli

namespace strata::cli {
namespace {

// Every host<->device copy a training step makes goes through registered (pinned) memory: the
// device counts pageable ones and the metrics report them per step. Checked on the CPU device
// with device memory apart from host memory (every parameter copied, as on a GPU) and shared, for
// parameters and optimizer in device memory, the optimizer on the CPU, and both on NVMe.
TEST(TrainCommandTest, StepsMakeNoPageableCopies) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "50k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  const std::string nvme = dir.path().string();
  const std::string zeros[] = {
      R"({"stage": 0})",
      R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})",
      R"({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})",
      R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" + nvme +
          R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + nvme + R"("}})"};
  int run = 0;
  for (const std::string& zero : zeros) {
    for (const char* share : {"off", "on"}) {
      SCOPED_TRACE(zero + " share_host_memory " + share);
      const std::string config = dir.file("ds" + std::to_string(run) + ".json");
      {
        std::ofstream out(config);
        out << R"({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
                   "strata": {"memory": {"share_host_memory": ")"
            << share << R"("}}, "zero_optimization": )" << zero << "}";
      }
      const std::string metrics = dir.file("m" + std::to_string(run++) + ".jsonl");
      auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                          "--seq-len", "32", "--steps", "4", "--device", "cpu", "--metrics",
                          metrics},
                         std::chrono::seconds(120));
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      std::ifstream in(metrics);
      int steps = 0;
      for (std::string line; std::getline(in, line); ++steps) {
        const auto j = nlohmann::json::parse(line);
        EXPECT_EQ(j["pageable_copies"].get<uint64_t>(), 0u) << "step " << j["step"];
        EXPECT_GT(j["model_device_bytes"].get<uint64_t>(), 0u);
      }
      EXPECT_EQ(steps, 4);
    }
  }
}

// strata.activation_checkpointing: on (each block recomputed in backward) and off (every block's
// internals kept) train to the same losses, bit for bit, through the ZeRO-3 engine with the
// optimizer offloaded; the header says which ran, and "auto" on a roomy device keeps them.
TEST(TrainCommandTest, ActivationCheckpointingChangesNoLoss) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"})
                .exit_code,
            0);
  auto run = [&](const std::string& checkpointing) {
    const std::string config = dir.file("ds-" + checkpointing + ".json");
    {
      std::ofstream out(config);
      out << R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                 "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.003}},
                 "strata": {"activation_checkpointing": )"
          << checkpointing << "}}";
    }
    const std::string metrics = dir.file("metrics-" + checkpointing + ".jsonl");
    auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                        "--seq-len", "32", "--steps", "4", "--device", "cpu", "--metrics",
                        metrics},
                       std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return std::make_pair(r.out, Losses(metrics));
  };
  const auto [on_out, on] = run("true");
  const auto [off_out, off] = run("false");
  const auto [auto_out, automatic] = run("\"auto\"");
  EXPECT_THAT(on_out, HasSubstr("(checkpointed: each block recomputed in backward)"));
  EXPECT_THAT(off_out, HasSubstr("(every block's kept: no recomputation)"));
  EXPECT_THAT(auto_out, HasSubstr("(every block's kept: no recomputation)"));
  ASSERT_EQ(on.size(), 4u);
  EXPECT_EQ(off, on);
  EXPECT_EQ(automatic, on);
}

// strata.split_blocks: four units per block train, through ZeRO-3 with parameters and optimizer
// on NVMe, to the losses and the weights of whole blocks, bit for bit, with their internals kept
// or recomputed part by part; a checkpoint written by one resumes in the other (checkpoints name
// parameters, not units).
TEST(TrainCommandTest, SplitBlocksTrainAsWholeBlocks) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"})
                .exit_code,
            0);
  auto run = [&](const std::string& name, const std::string& strata,
                 std::vector<std::string> extra) {
    const std::string config = WriteConfig(dir, R"(, "strata": )" + strata);
    const std::string renamed = dir.file(name + ".json");
    std::filesystem::rename(config, renamed);
    std::vector<std::string> args = {"train", "--config", renamed, "--data", data,
                                     "--device", "cpu", "--metrics", dir.file(name + ".jsonl")};
    args.insert(args.end(), extra.begin(), extra.end());
    auto r = RunStrata(args, std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return r.out;
  };
  const std::vector<std::string> fresh = {"--model", "llama-tiny", "--seq-len", "32"};
  auto with = [&](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::string whole = R"({"activation_checkpointing": false})";
  const std::string split = R"({"split_blocks": true})";
  run("whole", whole, with(fresh, {"--steps", "6", "--save", dir.file("whole")}));
  const std::string out = run("split", split, with(fresh, {"--steps", "6", "--save", dir.file("split")}));
  EXPECT_THAT(out, HasSubstr("each block as four units, strata.split_blocks"));
  const std::vector<double> want = Losses(dir.file("whole.jsonl"));
  ASSERT_EQ(want.size(), 6u);
  EXPECT_EQ(Losses(dir.file("split.jsonl")), want);
  EXPECT_EQ(FileBytes(dir.file("split/latest/model.safetensors")),
            FileBytes(dir.file("whole/latest/model.safetensors")));
  // 3 steps split, resumed as whole blocks to 6: the straight run's losses.
  run("half", split, with(fresh, {"--steps", "3", "--save", dir.file("half")}));
  run("half", whole, {"--steps", "6", "--resume", dir.file("half")});
  EXPECT_EQ(Losses(dir.file("half.jsonl")), want);
  // With activation checkpointing a split block is recomputed part by part: the same losses.
  const std::string recomputed =
      run("recomputed", R"({"split_blocks": true, "activation_checkpointing": true})",
          with(fresh, {"--steps", "6"}));
  EXPECT_THAT(recomputed, HasSubstr("each block recomputed part by part in backward"));
  EXPECT_EQ(Losses(dir.file("recomputed.jsonl")), want);
}

// strata.offload_checkpoints: every block input but the last two in host memory, through ZeRO-3
// with parameters and optimizer on NVMe and two micro-batches a step, with whole blocks and with
// split blocks: the losses and the weights of checkpoints kept on the device, bit for bit.
TEST(TrainCommandTest, OffloadedCheckpointsTrainAsOnTheDevice) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(
      RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"}).exit_code,
      0);
  const std::string model = WriteLlamaModelDir(dir.file("model"), 256, 64, 160, 5, 128);
  auto run = [&](const std::string& name, const std::string& strata) {
    const std::string config =
        WriteConfig(dir, R"(, "gradient_accumulation_steps": 2, "strata": )" + strata);
    const std::string renamed = dir.file(name + ".json");
    std::filesystem::rename(config, renamed);
    auto r = RunStrata({"train", "--config", renamed, "--model", model, "--data", data, "--seq-len",
                        "32", "--steps", "4", "--device", "cpu", "--metrics",
                        dir.file(name + ".jsonl"), "--save", dir.file(name)},
                       std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return r.out;
  };
  run("device", R"({"activation_checkpointing": true, "offload_checkpoints": false})");
  const std::string out = run("host", R"({"offload_checkpoints": true})");
  // Blocks 0-2's inputs: 3 x 2 sequences x 32 tokens x 64 x 4 bytes.
  EXPECT_THAT(out,
              HasSubstr("48.00 KiB of checkpoints in host memory, strata.offload_checkpoints"));
  const std::vector<double> want = Losses(dir.file("device.jsonl"));
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(Losses(dir.file("host.jsonl")), want);
  EXPECT_EQ(FileBytes(dir.file("host/latest/model.safetensors")),
            FileBytes(dir.file("device/latest/model.safetensors")));
  run("split", R"({"offload_checkpoints": true, "split_blocks": true})");
  EXPECT_EQ(Losses(dir.file("split.jsonl")), want);
  // Only checkpointed block inputs can go to host memory.
  const std::string bad = WriteConfig(
      dir, R"(, "strata": {"offload_checkpoints": true, "activation_checkpointing": false})");
  auto r = RunStrata({"train", "--config", bad, "--model", model, "--data", data, "--seq-len", "32",
                      "--steps", "1", "--device", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("strata.offload_checkpoints is on and "
                               "strata.activation_checkpointing is off"));
}

// --profile-ops: a table of every op the decoder runs, per profiled step (the steps after the
// first), whose op times add up to no more than the step; the losses are those of a plain run.
TEST(TrainCommandTest, ProfileOpsSaysWhereTheStepWent) {
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  ASSERT_EQ(RunStrata({"data", "synth", "--out", data, "--tokens", "20k", "--vocab", "256"})
                .exit_code,
            0);
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
               "optimizer": {"type": "AdamW", "params": {"lr": 0.003}}})";
  }
  auto run = [&](bool profile) {
    std::vector<std::string> args = {"train", "--config", config, "--model", "llama-tiny",
                                     "--data", data, "--seq-len", "32", "--steps", "3",
                                     "--device", "cpu"};
    if (profile) args.push_back("--profile-ops");
    return RunStrata(args, std::chrono::seconds(120));
  };
  auto plain = run(false);
  auto profiled = run(true);
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(profiled.exit_code, 0) << profiled.err;
  EXPECT_EQ(plain.out.find("op profile"), std::string::npos);
  EXPECT_NE(profiled.out.find("op profile: device time per step, 2 step(s) after the first"),
            std::string::npos)
      << profiled.out;
  for (const char* op : {"AttentionForward", "AttentionBackward", "LinearForward",
                         "LinearBackward", "CrossEntropyForward", "RmsNormBackward"}) {
    EXPECT_NE(profiled.out.find(std::string("  ") + op), std::string::npos) << op;
  }
  // "all ops" takes its share of the step: above 0%, at most 100%.
  const size_t all = profiled.out.find("  all ops");
  ASSERT_NE(all, std::string::npos);
  const std::string line = profiled.out.substr(all, profiled.out.find('\n', all) - all);
  const double share = std::stod(line.substr(line.rfind(' ', line.size() - 2) + 1));
  EXPECT_GT(share, 0.0) << line;
  EXPECT_LE(share, 100.0) << line;
  // The same losses (the profile only reads clocks).
  auto losses = [](const std::string& out) {
    std::vector<std::string> v;
    for (size_t at = out.find("| loss "); at != std::string::npos; at = out.find("| loss ", at + 1)) {
      v.push_back(out.substr(at, 15));
    }
    return v;
  };
  EXPECT_EQ(losses(profiled.out), losses(plain.out));
  EXPECT_EQ(losses(plain.out).size(), 3u);
}

// `strata train --device cuda` for 20 steps against the same run on the CPU device (same data,
// seed, initial weights): ZeRO-3 in fp32 with everything in HBM, with the optimizer offloaded to
// the CPU (all of it, and half of it), with parameters and optimizer on NVMe, and LoRA. fp32 GEMMs
// on both (no TF32): every step's loss within 1e-4 relative; with bf16 within 3e-2: the GPU keeps
// every activation and activation gradient in bf16 (LlamaActivationDType) and multiplies on the
// tensor cores, the CPU computes activations in fp32 on bf16-rounded weights.
struct GpuRun {
  const char* name;
  const char* precision;  // "" (fp32) or DeepSpeed sections (bf16, strata)
  const char* zero;       // the zero_optimization object, "@DIR@" for the NVMe path
  double rtol;
};

class TrainGpuTest : public ::testing::TestWithParam<GpuRun> {};

TEST_P(TrainGpuTest, TwentyStepsOnCudaMatchTheCpuDevice) {
  strata::device::DeviceOptions gpu;
  gpu.type = strata::device::DeviceType::kCuda;
  auto probe = strata::device::CreateDevice(gpu);
  if (!probe.ok()) GTEST_SKIP() << "no CUDA device: " << probe.status().ToString();
  probe->reset();
  const GpuRun& run = GetParam();
  TempDir dir;
  const std::string data = dir.file("tokens.bin");
  auto synth = RunStrata({"data", "synth", "--out", data, "--tokens", "200k", "--vocab", "256"});
  ASSERT_EQ(synth.exit_code, 0) << synth.err;
  std::string zero = run.zero;
  for (size_t pos; (pos = zero.find("@DIR@")) != std::string::npos;) {
    zero.replace(pos, 5, dir.path().string());
  }
  const std::string config = dir.file("ds.json");
  {
    std::ofstream out(config);
    out << R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
               "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.003}})"
        << run.precision << R"(, "zero_optimization": )" << zero << "}";
  }
  std::vector<double> losses[2];
  const char* devices[2] = {"cpu", "cuda"};
  for (int d = 0; d < 2; ++d) {
    const std::string metrics = dir.file(std::string("metrics-") + devices[d] + ".jsonl");
    auto r = RunStrata({"train", "--config", config, "--model", "llama-tiny", "--data", data,
                        "--seq-len", "64", "--steps", "20", "--device", devices[d], "--metrics",
                        metrics},
                       std::chrono::seconds(240));
    ASSERT_EQ(r.exit_code, 0) << devices[d] << ":\n" << r.out << r.err;
    if (d == 1) {
      EXPECT_THAT(r.out, HasSubstr("device: GPU 0"));
    }
    losses[d] = Losses(metrics);
    ASSERT_EQ(losses[d].size(), 20u) << devices[d];
  }
  for (size_t s = 0; s < 20; ++s) {
    EXPECT_NEAR(losses[1][s], losses[0][s], run.rtol * std::fabs(losses[0][s]))
        << "step " << s + 1 << ": cuda " << losses[1][s] << ", cpu " << losses[0][s];
  }
  EXPECT_LT(losses[1].back(), losses[1].front()) << "the loss goes down on the GPU";
}

INSTANTIATE_TEST_SUITE_P(
    Offload, TrainGpuTest,
    ::testing::Values(
        GpuRun{"Hbm", "", R"({"stage": 3})", 1e-4},
        GpuRun{"CpuOptimizer", "", R"({"stage": 3, "offload_optimizer": {"device": "cpu"}})", 1e-4},
        // Split optimizer homes: the first units' states in HBM (fused device AdamW), the
        // rest on the CPU.
        GpuRun{"HalfOffloadedOptimizer", "",
               R"({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})", 1e-4},
        GpuRun{"Nvme", "",
               R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
                   "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})",
               1e-4},
        GpuRun{"HbmBf16", R"(, "bf16": {"enabled": true})", R"({"stage": 3})", 3e-2},
        // "auto" keeps every block's internals on a GPU this size; this one recomputes them.
        GpuRun{"HbmBf16Checkpointed",
               R"(, "bf16": {"enabled": true}, "strata": {"activation_checkpointing": true})",
               R"({"stage": 3})", 3e-2},
        // The placement the planner chose for Llama-3-8B on one H100: parameters homed in
        // pinned host memory, half of the optimizer states on the device, half on the CPU.
        GpuRun{"HostParamsHalfOffloadedOptimizerBf16", R"(, "bf16": {"enabled": true})",
               R"({"stage": 3, "offload_param": {"device": "cpu"},
                   "offload_optimizer": {"device": "cpu", "ratio": 0.5}})",
               3e-2},
        // Split blocks (four units per block) recomputed part by part, each part gathered again
        // from pinned host memory, the optimizer on the CPU.
        GpuRun{"SplitBlocksCheckpointedHostBf16",
               R"(, "bf16": {"enabled": true},
                   "strata": {"split_blocks": true, "activation_checkpointing": true})",
               R"({"stage": 3, "offload_param": {"device": "cpu"},
                   "offload_optimizer": {"device": "cpu"}})",
               3e-2},
        // LoRA on every projection, the frozen base weights and the adapters' states on NVMe.
        GpuRun{
            "LoraNvme",
            R"(, "strata": {"lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}})",
            R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
                   "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})",
            1e-4}),
    [](const auto& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace strata::cli
