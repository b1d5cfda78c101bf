// Tensor parallelism through the ZeRO engine, one rank's run, wired by the composition root as
// `strata train` wires a rank (train/runtime.h): shared by the in-process tests
// (tensor_parallel_test.cc) and the MPI ones (tensor_parallel_mpi.cc). A run of T-way tensor
// parallelism on W ranks (ZeRO over W / T data-parallel ranks) must train as plain data
// parallelism on W ranks over the same global batch: the same loss and gradient norm every step
// and, at the end, every rank's master weights equal to its slices of the data-parallel run's (to
// fp32 tolerance: the splits change the order of sums, and Adam carries the differences).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/llama_model.h"
#include "train/runtime.h"
#include "zero/engine.h"

namespace strata::train::testing {

using model::LlamaConfig;

constexpr int kSteps = 6;
constexpr int kGlobalMicroBatches = 4;  // every run's global batch
constexpr int64_t kSeq = 16, kBatch = 2;

LlamaConfig TinyConfig() {
  LlamaConfig c;
  c.name = "tp-tiny";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  return c;
}

// Global micro-batch `m` of step `step`: sequences that count up from a random start.
model::LlamaBatch MicroBatch(int step, int m, int64_t vocab) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * step + m + 1));
  model::LlamaBatch b;
  for (int64_t s = 0; s < kBatch; ++s) {
    const auto start = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    for (int64_t i = 0; i <= kSeq; ++i) {
      b.tokens.push_back(static_cast<int32_t>((start + i * (1 + s)) % vocab));
    }
  }
  return b;
}

struct RankRun {
  Status status;
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;  // this rank's parameters, by name
  int tp_rank = 0;
  std::vector<double> grad_norms;
};

// `zero` goes into zero_optimization; "@DIR@" becomes a temporary directory (nvme_path).
std::string ConfigJson(int tp, int accumulation, const std::string& zero, bool lora,
                       double clipping) {
  return fmt::format(
      R"({{"train_micro_batch_size_per_gpu": {}, "gradient_accumulation_steps": {},
        "gradient_clipping": {},
        "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}},
        "tensor_parallel": {{"autotp_size": {}}},
        "zero_optimization": {{{}}}{}}})",
      kBatch, accumulation, clipping, tp, zero,
      lora ? R"(, "strata": {"lora": {"r": 2, "lora_alpha": 4, "target_modules": ["all-linear"]}})"
           : "");
}

// One rank of a run of `world` ranks with tensor-parallel degree `tp` (1: plain data
// parallelism), `zero` in zero_optimization, `dir` for NVMe homes; `ro` says how the rank finds
// the others (its launch and collective) and on which device it runs (the CPU unless it says).
// Every rank trains kSteps steps on its data-parallel rank's share of kGlobalMicroBatches
// micro-batches.
inline RankRun TrainRank(RuntimeOptions ro, int world, int tp, const std::string& zero, bool lora,
                         const LlamaConfig& cfg, double clipping, const std::string& dir) {
  RankRun result;
  const int dp = world / tp, accumulation = kGlobalMicroBatches / std::max(dp, 1);
  std::string json = ConfigJson(tp, accumulation, zero, lora, clipping);
  for (size_t pos; (pos = json.find("@DIR@")) != std::string::npos;) json.replace(pos, 5, dir);
  result.status = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(Config config, ParseConfig(json, "<tp test>"));
    if (!ro.device) ro.device = DeviceKind::kCpu;
    STRATA_ASSIGN_OR_RETURN(Runtime runtime, OpenRuntime(config, ro));
    model::LlamaModelOptions mo;
    STRATA_ASSIGN_OR_RETURN(mo.lora, model::ResolveLlamaLora(config.strata.lora));
    mo.tensor_parallel = {.rank = runtime.tensor_parallel_rank(),
                          .size = runtime.tensor_parallel_size,
                          .group = runtime.tensor_parallel.get()};
    result.tp_rank = mo.tensor_parallel.rank;
    STRATA_ASSIGN_OR_RETURN(auto model,
                            model::LlamaModel::Create(*runtime.device, cfg, kSeq, kBatch, 1, mo));
    STRATA_ASSIGN_OR_RETURN(EngineStack stack, BuildEngine(runtime, *model, config));
    const int dp_rank = runtime.data_parallel().rank();
    Status trained = [&]() -> Status {
      for (int step = 0; step < kSteps; ++step) {
        std::vector<model::LlamaBatch> batches;
        for (int k = 0; k < accumulation; ++k) {
          batches.push_back(MicroBatch(step, dp_rank * accumulation + k, cfg.vocab_size));
        }
        std::vector<const zero::Batch*> ptrs;
        for (const auto& b : batches) ptrs.push_back(&b);
        STRATA_ASSIGN_OR_RETURN(zero::StepResult s, stack.engine->TrainStep(ptrs));
        result.losses.push_back(s.loss);
        result.grad_norms.push_back(s.grad_norm);
      }
      const auto& layouts = stack.engine->layouts();
      for (size_t u = 0; u < layouts.size(); ++u) {
        STRATA_ASSIGN_OR_RETURN(std::vector<float> m,
                                stack.engine->GatherMaster(static_cast<int>(u)));
        for (const auto& s : layouts[u].slots) {
          result.masters[s.name].assign(m.begin() + s.offset, m.begin() + s.offset + s.numel);
        }
      }
      return Status::Ok();
    }();
    stack.Reset();
    model.reset();
    return trained;
  }();
  return result;
}

// `got` (a rank of a run with tensor-parallel degree `tp`) against `want` (a rank of the
// data-parallel run): losses within 2e-5, gradient norms within 1e-4, and each master weight its
// slice of the data-parallel one within 1e-4 of the tensor's largest.
inline void ExpectSliceOfDataParallel(const RankRun& want, const RankRun& got, int tp, bool lora,
                                      const std::string& rank) {
  const LlamaConfig cfg = TinyConfig();
  ASSERT_TRUE(want.status.ok()) << want.status.ToString();
  ASSERT_TRUE(got.status.ok()) << rank << ": " << got.status.ToString();
  model::LlamaLora l;  // as the config's strata.lora resolves (the shapes only)
  if (lora) {
    l.rank = 2;
    l.targets.fill(true);
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (int u = 0; u < model::LlamaNumUnits(cfg, l); ++u) {
    for (const auto& p : model::LlamaUnitParams(cfg, u, l)) shapes[p.name] = p.shape;
  }
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < got.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 2e-5 * std::fabs(want.losses[s]))
        << rank << " step " << s;
    // The global gradient norm: every element of the model counted once.
    EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], 1e-4 * want.grad_norms[s])
        << rank << " step " << s;
  }
  EXPECT_LT(got.losses.back(), got.losses.front());
  int split = 0;
  for (const auto& [name, mine] : got.masters) {
    const model::TensorSlice slice = model::LlamaTensorParallelSlice(cfg, got.tp_rank, tp, name);
    split += slice.dim >= 0 ? 1 : 0;
    const std::vector<float> whole_slice =
        model::SliceTensor(want.masters.at(name), shapes.at(name), slice);
    ASSERT_EQ(mine.size(), whole_slice.size()) << name;
    double scale = 0, worst = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      scale = std::max(scale, std::fabs(double{whole_slice[i]}));
      worst = std::max(worst, std::fabs(double{mine[i]} - whole_slice[i]));
    }
    EXPECT_LE(worst, 1e-4 * scale + 1e-7) << rank << ": " << name;
  }
  EXPECT_GT(split, 0);
}

}  // namespace strata::train::testing
