// Tensor parallelism through the ZeRO engine, wired by the composition root as `strata train`
// wires a rank (train/runtime.h): ranks are threads of an in-process world, each with its own CPU
// device. A run of T-way tensor parallelism on W ranks (ZeRO over W / T data-parallel ranks) must
// train as plain data parallelism on W ranks over the same global batch: the same loss every step
// and, at the end, every rank's master weights equal to its slices of the data-parallel run's
// (to fp32 tolerance: the splits change the order of sums, and Adam carries the differences).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/in_process_collective.h"
#include "model/llama_model.h"
#include "test_support.h"
#include "train/runtime.h"
#include "zero/engine.h"

namespace strata::train {
namespace {

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

std::vector<RankRun> Train(int world, int tp, const std::string& zero, bool lora,
                           const LlamaConfig& cfg = TinyConfig(), double clipping = 0.0) {
  std::vector<RankRun> out(static_cast<size_t>(world));
  auto made = comm::InProcessWorld::Create({.world_size = world});
  if (!made.ok()) {
    for (auto& r : out) r.status = made.status();
    return out;
  }
  strata::testing::TempDir dir;
  const int dp = world / tp, accumulation = kGlobalMicroBatches / dp;
  std::string json = ConfigJson(tp, accumulation, zero, lora, clipping);
  for (size_t pos; (pos = json.find("@DIR@")) != std::string::npos;) {
    json.replace(pos, 5, dir.path().string());
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r, w = *made] {
      RankRun& result = out[static_cast<size_t>(r)];
      result.status = [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(Config config, ParseConfig(json, "<tp test>"));
        RuntimeOptions ro;
        ro.device = DeviceKind::kCpu;
        ro.launch = comm::LaunchInfo{
            .rank = r, .world_size = world, .local_rank = r, .local_size = world, .launcher = "test"};
        ro.make_collective = [&w, r](device::Device& d) { return w->Join(r, d); };
        ro.host_identity = "node0";
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
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Rank `rank`'s slice of a whole tensor (model::LlamaTensorParallelSlice).
std::vector<float> SliceOf(const std::vector<float>& whole, const std::vector<int64_t>& shape,
                           const model::TensorSlice& slice) {
  if (slice.dim < 0) return whole;
  const int64_t row = static_cast<int64_t>(whole.size()) / shape[0];
  std::vector<float> out;
  if (slice.dim == 0) {
    return std::vector<float>(whole.begin() + slice.begin * row,
                              whole.begin() + (slice.begin + slice.count) * row);
  }
  for (int64_t r = 0; r < shape[0]; ++r) {
    out.insert(out.end(), whole.begin() + r * row + slice.begin,
               whole.begin() + r * row + slice.begin + slice.count);
  }
  return out;
}

// The tensor-parallel run against plain data parallelism on as many ranks.
void ExpectLikeDataParallel(int world, int tp, const std::string& zero, bool lora,
                            double clipping = 0.0) {
  const LlamaConfig cfg = TinyConfig();
  const std::vector<RankRun> want = Train(world, 1, zero, lora, cfg, clipping);
  for (const RankRun& r : want) ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const std::vector<RankRun> got = Train(world, tp, zero, lora, cfg, clipping);
  model::LlamaLora l;  // as the config's strata.lora resolves (the shapes only)
  if (lora) {
    l.rank = 2;
    l.targets.fill(true);
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (int u = 0; u < model::LlamaNumUnits(cfg, l); ++u) {
    for (const auto& p : model::LlamaUnitParams(cfg, u, l)) shapes[p.name] = p.shape;
  }
  for (size_t r = 0; r < got.size(); ++r) {
    const RankRun& g = got[r];
    ASSERT_TRUE(g.status.ok()) << "rank " << r << ": " << g.status.ToString();
    ASSERT_EQ(g.losses.size(), want[0].losses.size());
    for (size_t s = 0; s < g.losses.size(); ++s) {
      EXPECT_NEAR(g.losses[s], want[0].losses[s], 2e-5 * std::fabs(want[0].losses[s]))
          << "rank " << r << " step " << s;
      // The global gradient norm: every element of the model counted once.
      EXPECT_NEAR(g.grad_norms[s], want[0].grad_norms[s], 1e-4 * want[0].grad_norms[s])
          << "rank " << r << " step " << s;
    }
    EXPECT_LT(g.losses.back(), g.losses.front());
    int split = 0;
    for (const auto& [name, mine] : g.masters) {
      const model::TensorSlice slice = model::LlamaTensorParallelSlice(cfg, g.tp_rank, tp, name);
      split += slice.dim >= 0 ? 1 : 0;
      const std::vector<float> whole_slice = SliceOf(want[0].masters.at(name), shapes.at(name), slice);
      ASSERT_EQ(mine.size(), whole_slice.size()) << name;
      double scale = 0, worst = 0;
      for (size_t i = 0; i < mine.size(); ++i) {
        scale = std::max(scale, std::fabs(double{whole_slice[i]}));
        worst = std::max(worst, std::fabs(double{mine[i]} - whole_slice[i]));
      }
      EXPECT_LE(worst, 1e-4 * scale + 1e-7) << "rank " << r << ": " << name;
    }
    EXPECT_GT(split, 0);
  }
}

TEST(TensorParallelEngineTest, Tp2Dp2Stage0TrainsLikeDp4) {
  ExpectLikeDataParallel(4, 2, R"("stage": 0)", false);
}

TEST(TensorParallelEngineTest, Tp2Dp2Stage3WithNvmeOffloadTrainsLikeDp4) {
  ExpectLikeDataParallel(4, 2,
                         R"("stage": 3, "stage3_param_persistence_threshold": 0,
                            "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"})",
                         false);
}

TEST(TensorParallelEngineTest, Tp2Dp2LoraStage3TrainsLikeDp4) {
  ExpectLikeDataParallel(4, 2, R"("stage": 3, "stage3_param_persistence_threshold": 0)", true);
}

// Clipping that bites every step (the norms are above 0.05): the norm over split and whole
// parameters must be the data-parallel run's, with the optimizer on the device and on the CPU.
TEST(TensorParallelEngineTest, ClippedTp2Dp2TrainsLikeClippedDp4) {
  ExpectLikeDataParallel(4, 2, R"("stage": 2)", false, 0.05);
  ExpectLikeDataParallel(4, 2, R"("stage": 3, "offload_optimizer": {"device": "cpu"})", true, 0.05);
}

TEST(TensorParallelEngineTest, Tp4OnOneNodeTrainsLikeDp4) {
  ExpectLikeDataParallel(4, 4, R"("stage": 2)", false);
}

TEST(TensorParallelEngineTest, GroupsThatLeaveTheNodeOrUnevenShapesAreRefused) {
  // Three ranks cannot hold two-way groups.
  std::vector<RankRun> odd = Train(3, 2, R"("stage": 1)", false);
  for (const RankRun& r : odd) {
    EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument) << r.status.ToString();
    EXPECT_NE(r.status.message().find("autotp_size 2 does not divide the 3 rank(s) per node"),
              std::string::npos)
        << r.status.ToString();
  }
  // An intermediate size of 50 does not divide over 4 ranks: the model names it.
  LlamaConfig uneven = TinyConfig();
  uneven.intermediate_size = 50;
  std::vector<RankRun> bad = Train(4, 4, R"("stage": 1)", false, uneven);
  for (const RankRun& r : bad) {
    EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument) << r.status.ToString();
    EXPECT_NE(r.status.message().find("intermediate_size = 50"), std::string::npos)
        << r.status.ToString();
  }
}

}  // namespace
}  // namespace strata::train
