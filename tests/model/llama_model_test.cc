// The Llama decoder on the CPU device: one forward and backward against the PyTorch reference
// (tests/oracle/llama_ref.py, float64), and training through the ZeRO engine.
//
// Oracle tolerances (fp32 kernels against a float64 reference, tiny model): the loss within
// 1e-5 relative; every gradient element within 1e-5 * max|reference gradient of that tensor| +
// 1e-4 * |reference element|. Measured: every tensor's worst error is below 4e-7 of its largest
// gradient (STRATA_ORACLE_VERBOSE=1 prints them).
#include "model/llama_model.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "comm/in_process_collective.h"
#include "comm/single_collective.h"
#include "device/pinned_pool.h"
#include "model/llama_ops.h"
#include "strata/block_store.h"
#include "test_support.h"
#include "train/runtime.h"
#include "train/training_data.h"
#include "zero/engine.h"
#include "zero/partition.h"

namespace strata::model {
namespace {

constexpr int32_t kIgnoreIndexForTests = -100;  // cpu::kIgnoreIndex

LlamaConfig TinyConfig() {
  LlamaConfig c;
  c.name = "oracle-tiny";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  return c;
}

bool HaveTorch() {
  return std::filesystem::exists("/usr/bin/python3") &&
         std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") == 0;
}

template <typename T>
void WriteRaw(const std::string& path, const std::vector<T>& v) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

std::vector<double> ReadDoubles(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<double> out(bytes.size() / sizeof(double));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(double));
  return out;
}

TEST(LlamaModelTest, UnitsCarryHuggingFaceNames) {
  auto dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  auto m = LlamaModel::Create(**dev, TinyConfig(), 8, 2);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const auto units = (*m)->units();
  ASSERT_EQ(units.size(), 4u);
  EXPECT_EQ(units[0].params[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(units[1].params[2].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(units[1].params[2].shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(units[3].params[1].name, "lm_head.weight");
  int64_t total = 0;
  for (const auto& u : units) {
    for (const auto& p : u.params) total += p.numel();
  }
  EXPECT_EQ(total, TinyConfig().ParameterCount());
  // Tied embeddings: no lm_head.weight; the head reads the embedding unit.
  LlamaConfig tied = TinyConfig();
  tied.tie_word_embeddings = true;
  auto t = LlamaModel::Create(**dev, tied, 8, 2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const auto tied_units = (*t)->units();
  ASSERT_EQ(tied_units[3].params.size(), 1u);
  EXPECT_EQ(tied_units[3].params[0].name, "model.norm.weight");
  EXPECT_EQ((*t)->SharedUnits(3), std::vector<int>{0});
  EXPECT_TRUE((*t)->SharedUnits(0).empty());
  total = 0;
  for (const auto& u : tied_units) {
    for (const auto& p : u.params) total += p.numel();
  }
  EXPECT_EQ(total, tied.ParameterCount());
  auto long_seq = LlamaModel::Create(**dev, TinyConfig(), 65, 2);
  ASSERT_FALSE(long_seq.ok());
  EXPECT_NE(long_seq.status().message().find("max_position_embeddings"), std::string::npos);
}

// Random weights: N(0, 0.02) for matrices, 1 for norms; the same for the same seed (whatever the
// number of threads that fill them), different for another seed or another matrix.
TEST(LlamaModelTest, RandomInitialisationIsNormalAndReproducible) {
  auto dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  LlamaConfig cfg = TinyConfig();
  cfg.vocab_size = 40000;  // an embedding of 40000 x 32: 1.28M values, filled by several threads
  auto fill = [&](uint64_t seed) {
    auto m = LlamaModel::Create(**dev, cfg, 8, 2, seed);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    auto layouts = zero::LayoutModel((*m)->units(), 1);
    EXPECT_TRUE(layouts.ok());
    std::vector<std::vector<float>> out;
    for (const auto& l : *layouts) {
      out.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
      EXPECT_TRUE((*m)->InitUnit(l.index, l.slots, out.back()).ok());
    }
    return std::make_pair(out, *layouts);
  };
  const auto [a, layouts] = fill(5);
  const auto b = fill(5).first;
  const auto c = fill(6).first;
  EXPECT_EQ(a, b);
  EXPECT_NE(a[0], c[0]);
  const std::vector<float>& embed = a[0];
  const int64_t n = cfg.vocab_size * cfg.hidden_size;
  double sum = 0, sq = 0, big = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += embed[static_cast<size_t>(i)];
    sq += static_cast<double>(embed[static_cast<size_t>(i)]) * embed[static_cast<size_t>(i)];
    if (std::abs(embed[static_cast<size_t>(i)]) > 3 * 0.02) ++big;
  }
  const double mean = sum / static_cast<double>(n);
  const double sd = std::sqrt(sq / static_cast<double>(n) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(sd, 0.02, 0.0002);
  EXPECT_NEAR(big / static_cast<double>(n), 0.0027, 0.0005);  // beyond 3 sigma: 0.27%
  // A layer: norms are 1, and its q and k matrices differ.
  const auto& layer = layouts[1];
  const auto& slots = layer.slots;
  EXPECT_EQ(a[1][static_cast<size_t>(slots[0].offset)], 1.0f);
  EXPECT_NE(a[1][static_cast<size_t>(slots[1].offset)], a[1][static_cast<size_t>(slots[2].offset)]);
}

// A rank at stages 1-3 initialises only its shard (InitUnitRange): every range must hold exactly
// the values the whole unit gets, across parameter boundaries, the generator's 64 Ki blocks,
// odd starts, the padding and LoRA's adapters; and the unit is the same however the model is
// partitioned.
TEST(LlamaModelTest, RangeInitialisationIsTheWholeUnitsValues) {
  auto dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  LlamaConfig cfg = TinyConfig();
  cfg.vocab_size = 5000;         // an embedding of 160000 values: three generator blocks
  cfg.intermediate_size = 2100;  // 67200-value FFN matrices: past one block
  LlamaLora lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.scale = 2.0f;
  lora.targets.fill(true);
  auto m = LlamaModel::Create(**dev, cfg, 8, 1, 9, {.lora = lora});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  for (const int ranks : {1, 3}) {
    auto layouts = zero::LayoutModel((*m)->units(), ranks);
    ASSERT_TRUE(layouts.ok());
    std::mt19937_64 rng(3);
    for (const auto& l : *layouts) {
      SCOPED_TRACE(fmt::format("unit {} ({}), {} ranks", l.index, l.name, ranks));
      std::vector<float> full(static_cast<size_t>(l.padded_numel()), 0.0f);
      ASSERT_TRUE((*m)->InitUnit(l.index, l.slots, std::span<float>(full.data(), l.used_numel)).ok());
      auto check = [&](int64_t begin, int64_t count) {
        std::vector<float> part(static_cast<size_t>(count), -7.0f);
        ASSERT_TRUE((*m)->InitUnitRange(l.index, l.slots, l.used_numel, begin, part).ok());
        for (int64_t i = 0; i < count; ++i) {
          ASSERT_EQ(part[static_cast<size_t>(i)], full[static_cast<size_t>(begin + i)])
              << "element " << begin + i << " of a range [" << begin << ", +" << count << ")";
        }
      };
      for (int r = 0; r < ranks; ++r) check(l.shard_offset(r), l.shard_numel);  // the shards
      const int64_t n = l.padded_numel();
      for (int t = 0; t < 20; ++t) {
        const int64_t begin = static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
        check(begin, 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - begin)));
      }
      check(n - 1, 1);
      if (n > 65537) check(65535, 3);  // a pair split by a block boundary
    }
  }
}

class LlamaOracleTest : public ::testing::TestWithParam<bool> {};

// Untied and tied (tie_word_embeddings: the head and the embedding share one matrix, whose
// gradient sums both uses).
TEST_P(LlamaOracleTest, ForwardAndBackwardMatchPyTorch) {
  if (!HaveTorch()) GTEST_SKIP() << "needs Debian's /usr/bin/python3 with torch (python3-torch)";
  LlamaConfig cfg = TinyConfig();
  cfg.tie_word_embeddings = GetParam();
  const int64_t batch = 2, seq = 8;
  auto dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  auto model = LlamaModel::Create(**dev, cfg, seq, batch, 7);
  ASSERT_TRUE(model.ok());
  auto stream = (*dev)->CreateStream("compute");
  ASSERT_TRUE(stream.ok());
  auto layouts = zero::LayoutModel((*model)->units(), 1);
  ASSERT_TRUE(layouts.ok());
  std::vector<std::vector<float>> params, grads;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> jitter(0.8f, 1.2f);
  for (const auto& l : *layouts) {
    params.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
    grads.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
    ASSERT_TRUE((*model)->InitUnit(l.index, l.slots, params.back()).ok());
    for (const auto& s : l.slots) {  // norm weights away from 1, so their gradients matter
      if (s.shape.size() == 1) {
        for (int64_t i = 0; i < s.numel; ++i) params.back()[s.offset + i] *= jitter(rng);
      }
    }
  }
  LlamaBatch b;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));
  b.tokens[seq] = -100;  // sequence 0's last target is ignored (it is never an input)

  ASSERT_TRUE((*model)->BeginMicroBatch(b, 1.0f, **stream).ok());
  const int n = static_cast<int>(layouts->size());
  auto pview = [&](int u) {
    return zero::UnitView{params[u].data(), device::DType::kF32, &(*layouts)[u].slots};
  };
  auto gview = [&](int u) {
    return zero::UnitView{grads[u].data(), device::DType::kF32, &(*layouts)[u].slots};
  };
  for (int u = 0; u < n; ++u) {
    if (cfg.tie_word_embeddings && u == n - 1) {
      const zero::UnitView views[2] = {pview(u), pview(0)};
      ASSERT_TRUE((*model)->ForwardShared(u, views, **stream).ok());
    } else {
      ASSERT_TRUE((*model)->Forward(u, pview(u), **stream).ok());
    }
  }
  for (int u = n - 1; u >= 0; --u) {
    if (cfg.tie_word_embeddings && u == n - 1) {
      const zero::UnitView views[2] = {pview(u), pview(0)};
      const zero::UnitView gviews[2] = {gview(u), gview(0)};
      ASSERT_TRUE((*model)->BackwardShared(u, views, gviews, **stream).ok());
    } else {
      ASSERT_TRUE((*model)->Backward(u, pview(u), gview(u), **stream).ok());
    }
  }
  auto loss = (*model)->EndMicroBatch(**stream);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();

  strata::testing::TempDir dir;
  nlohmann::json meta = {{"batch", batch}, {"seq_len", seq}};
  meta["config"] = nlohmann::json::parse(ToHfConfigJson(cfg, "float32"));
  for (int u = 0; u < n; ++u) {
    for (const auto& s : (*layouts)[u].slots) {
      meta["params"].push_back({{"name", s.name}, {"shape", s.shape}});
      WriteRaw(dir.file(s.name + ".bin"),
               std::vector<float>(params[u].begin() + s.offset,
                                  params[u].begin() + s.offset + s.numel));
    }
  }
  {
    std::ofstream out(dir.file("meta.json"));
    out << meta.dump();
  }
  WriteRaw(dir.file("tokens.bin"), b.tokens);
  const std::string cmd = "/usr/bin/python3 " + (strata::testing::SourceDir() / "tests/oracle/llama_ref.py").string() +
                          " " + dir.path().string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream lf(dir.file("loss.txt"));
  double ref_loss = 0;
  lf >> ref_loss;
  EXPECT_NEAR(*loss, ref_loss, 1e-5 * std::fabs(ref_loss)) << "loss";
  for (int u = 0; u < n; ++u) {
    for (const auto& s : (*layouts)[u].slots) {
      const auto ref = ReadDoubles(dir.file("grad." + s.name + ".bin"));
      ASSERT_EQ(ref.size(), static_cast<size_t>(s.numel)) << s.name;
      double scale = 0;
      for (double r : ref) scale = std::max(scale, std::fabs(r));
      ASSERT_GT(scale, 0.0) << s.name << " has an all-zero reference gradient";
      int bad = 0;
      double worst = 0;
      for (int64_t i = 0; i < s.numel; ++i) {
        const double got = grads[u][s.offset + i];
        const double err = std::fabs(got - ref[i]);
        worst = std::max(worst, err / scale);
        if (err > 1e-5 * scale + 1e-4 * std::fabs(ref[i])) ++bad;
      }
      EXPECT_EQ(bad, 0) << s.name << ": worst error " << worst << " of the tensor's max";
      if (std::getenv("STRATA_ORACLE_VERBOSE")) std::printf("%s worst %.3g\n", s.name.c_str(), worst);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, LlamaOracleTest, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "Tied" : "Untied"; });

// A LlamaModel in the ZeRO engine on one rank of the CPU device, wired by the composition root
// strata train uses (train/runtime.h); "@DIR@" in the config JSON becomes a temporary directory
// (for nvme_path).
struct EngineRun {
  strata::testing::TempDir dir;
  train::Runtime runtime;
  std::unique_ptr<LlamaModel> model;
  train::EngineStack stack;
  zero::Engine* engine = nullptr;

  ~EngineRun() {
    stack.Reset();  // before the model it drives
    model.reset();
  }

  Status Setup(const LlamaConfig& cfg, int64_t seq, int64_t batch, std::string config_json) {
    for (size_t pos; (pos = config_json.find("@DIR@")) != std::string::npos;) {
      config_json.replace(pos, 5, dir.path().string());
    }
    STRATA_ASSIGN_OR_RETURN(Config config, ParseConfig(config_json, "<test>"));
    train::RuntimeOptions ro;
    ro.device = DeviceKind::kCpu;
    ro.launch = comm::LaunchInfo{};
    STRATA_ASSIGN_OR_RETURN(runtime, train::OpenRuntime(config, ro));
    STRATA_ASSIGN_OR_RETURN(model, LlamaModel::Create(*runtime.device, cfg, seq, batch, 1));
    STRATA_ASSIGN_OR_RETURN(stack, train::BuildEngine(runtime, *model, config));
    engine = stack.engine.get();
    return Status::Ok();
  }
};

TEST(LlamaModelTest, TrainsThroughTheZeroEngineWithNvmeOffload) {
  const LlamaConfig cfg = TinyConfig();
  const int64_t batch = 4, seq = 16;
  EngineRun run;
  Status st = run.Setup(cfg, seq, batch, R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "gradient_clipping": 1.0, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}}})");
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto& engine = run.engine;
  // A learnable stream: each sequence counts up from a random start (next = prev + 1 mod V).
  std::mt19937 rng(5);
  std::vector<double> losses;
  for (int step = 0; step < 40; ++step) {
    LlamaBatch b;
    for (int64_t s = 0; s < batch; ++s) {
      int32_t t = static_cast<int32_t>(rng() % cfg.vocab_size);
      for (int64_t i = 0; i <= seq; ++i) b.tokens.push_back((t + i) % cfg.vocab_size);
    }
    const zero::Batch* ptr = &b;
    auto r = engine->TrainStep(std::span<const zero::Batch* const>(&ptr, 1));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    losses.push_back(r->loss);
  }
  EXPECT_NEAR(losses.front(), std::log(static_cast<double>(cfg.vocab_size)), 0.5);
  EXPECT_LT(losses.back(), 0.5 * losses.front()) << "first " << losses.front() << " last "
                                                  << losses.back();
}

// Tied embeddings through the engine: the head gathers the embedding unit too and both
// gradients are summed into it. On one rank every stage and offload does the same arithmetic,
// so stage 0 (everything resident) and stage 3 with NVMe offload, and stage 2 with the CPU
// optimizer, give bit-identical losses and weights; and the loss falls.
TEST(LlamaModelTest, TiedEmbeddingsTrainIdenticallyUnderEveryStage) {
  LlamaConfig cfg = TinyConfig();
  cfg.tie_word_embeddings = true;
  const int64_t batch = 4, seq = 16;
  auto run = [&](const std::string& zero_json, std::vector<double>* losses,
                 std::vector<std::vector<float>>* masters) {
    EngineRun er;
    Status st = er.Setup(cfg, seq, batch, R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "gradient_clipping": 1.0, "zero_optimization": )" + zero_json + "}");
    ASSERT_TRUE(st.ok()) << st.ToString();
    auto& engine = er.engine;
    std::mt19937 rng(5);
    for (int step = 0; step < 30; ++step) {
      std::vector<LlamaBatch> mbs(2);  // two micro-batches: accumulation into the tied gradient
      std::vector<const zero::Batch*> ptrs;
      for (auto& b : mbs) {
        for (int64_t s = 0; s < batch; ++s) {
          int32_t t = static_cast<int32_t>(rng() % cfg.vocab_size);
          for (int64_t i = 0; i <= seq; ++i) b.tokens.push_back((t + i) % cfg.vocab_size);
        }
        ptrs.push_back(&b);
      }
      auto r = engine->TrainStep(ptrs);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      losses->push_back(r->loss);
    }
    for (size_t u = 0; u < engine->layouts().size(); ++u) {
      auto m = engine->GatherMaster(static_cast<int>(u));
      ASSERT_TRUE(m.ok());
      masters->push_back(*m);
    }
  };
  std::vector<double> l0, l3, l2;
  std::vector<std::vector<float>> m0, m3, m2;
  run(R"({"stage": 0})", &l0, &m0);
  run(R"({"stage": 3, "stage3_param_persistence_threshold": 0,
          "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
          "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}})", &l3, &m3);
  run(R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})", &l2, &m2);
  ASSERT_EQ(l0.size(), 30u);
  EXPECT_EQ(l0, l3);
  EXPECT_EQ(l0, l2);
  EXPECT_EQ(m0, m3);
  EXPECT_EQ(m0, m2);
  EXPECT_LT(l0.back(), 0.5 * l0.front()) << "first " << l0.front() << " last " << l0.back();
}

// The engine sums the head's and the embedding's gradients into the tied matrix: AdamW's first
// step moves every element by -lr * g / (|g| + eps) (bias-corrected m / sqrt(v)), so the update
// of the embedding matrix after one stage-3 step must have the sign of the model's own tied
// gradient (computed here without the engine) wherever that gradient is not tiny — including
// the rows of tokens that are never inputs, which only the head's contribution reaches.
TEST(LlamaModelTest, TiedGradientReachesTheEmbeddingThroughTheEngine) {
  LlamaConfig cfg = TinyConfig();
  cfg.tie_word_embeddings = true;
  const int64_t batch = 2, seq = 8;
  auto dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  LlamaBatch b;
  for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(static_cast<int32_t>((i * 7) % 40));
  // The model's own gradient (tokens 40..63 never appear as inputs).
  auto ref_model = LlamaModel::Create(**dev, cfg, seq, batch, 1);
  ASSERT_TRUE(ref_model.ok());
  auto stream = (*dev)->CreateStream("ref");
  ASSERT_TRUE(stream.ok());
  auto layouts = zero::LayoutModel((*ref_model)->units(), 1);
  ASSERT_TRUE(layouts.ok());
  const int n = static_cast<int>(layouts->size());
  std::vector<std::vector<float>> params(n), grads(n);
  for (int u = 0; u < n; ++u) {
    params[u].assign(static_cast<size_t>((*layouts)[u].padded_numel()), 0.0f);
    grads[u].assign(params[u].size(), 0.0f);
    ASSERT_TRUE((*ref_model)->InitUnit(u, (*layouts)[u].slots, params[u]).ok());
  }
  auto view = [&](std::vector<std::vector<float>>& v, int u) {
    return zero::UnitView{v[u].data(), device::DType::kF32, &(*layouts)[u].slots};
  };
  ASSERT_TRUE((*ref_model)->BeginMicroBatch(b, 1.0f, **stream).ok());
  for (int u = 0; u < n - 1; ++u) ASSERT_TRUE((*ref_model)->Forward(u, view(params, u), **stream).ok());
  const zero::UnitView hp[2] = {view(params, n - 1), view(params, 0)};
  const zero::UnitView hg[2] = {view(grads, n - 1), view(grads, 0)};
  ASSERT_TRUE((*ref_model)->ForwardShared(n - 1, hp, **stream).ok());
  ASSERT_TRUE((*ref_model)->BackwardShared(n - 1, hp, hg, **stream).ok());
  for (int u = n - 2; u >= 0; --u) {
    ASSERT_TRUE((*ref_model)->Backward(u, view(params, u), view(grads, u), **stream).ok());
  }
  ASSERT_TRUE((*ref_model)->EndMicroBatch(**stream).ok());

  EngineRun run;
  Status st = run.Setup(cfg, seq, batch, R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.001,
      "weight_decay": 0.0, "eps": 1e-12}}, "zero_optimization": {"stage": 3,
      "stage3_param_persistence_threshold": 0,
      "offload_param": {"device": "nvme", "nvme_path": "@DIR@"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "@DIR@"}}})");
  ASSERT_TRUE(st.ok()) << st.ToString();
  const zero::Batch* ptr = &b;
  ASSERT_TRUE(run.engine->TrainStep(std::span<const zero::Batch* const>(&ptr, 1)).ok());
  auto after = run.engine->GatherMaster(0);
  ASSERT_TRUE(after.ok());
  const auto& slot = (*layouts)[0].slots[0];
  double gmax = 0;
  for (int64_t i = 0; i < slot.numel; ++i) gmax = std::max(gmax, std::fabs(double(grads[0][i])));
  int checked = 0, unseen_rows = 0, wrong = 0;
  const int64_t h = cfg.hidden_size;
  for (int64_t i = 0; i < slot.numel; ++i) {
    const double g = grads[0][slot.offset + i];
    if (std::fabs(g) < 1e-3 * gmax) continue;
    const double delta = static_cast<double>((*after)[slot.offset + i]) - params[0][slot.offset + i];
    ++checked;
    if (i / h >= 40) ++unseen_rows;
    if (!(delta * g < 0) || std::fabs(std::fabs(delta) - 0.001) > 2e-4) ++wrong;
  }
  EXPECT_GT(unseen_rows, 100) << "rows only the head's gradient reaches";
  EXPECT_GT(checked, 1000);
  EXPECT_EQ(wrong, 0) << "of " << checked << " elements";
}

}  // namespace
}  // namespace strata::model

namespace strata::model {
namespace {

// Activations live in device memory, allocated once by Create under the device's budget.
TEST(LlamaModelTest, ActivationsComeFromTheDeviceBudget) {
  const LlamaConfig cfg = TinyConfig();
  const int64_t batch = 2, seq = 16;
  const uint64_t need = LlamaActivationBytes(cfg, seq, batch);
  // T V logits alone: 32 tokens x 64 vocab x 4 bytes.
  EXPECT_GE(need, static_cast<uint64_t>(batch * seq * cfg.vocab_size * 4));
  {
    device::DeviceOptions opt;
    opt.memory_budget = need + (1 << 20);
    auto dev = device::CreateDevice(opt);
    ASSERT_TRUE(dev.ok());
    auto m = LlamaModel::Create(**dev, cfg, seq, batch);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->activation_bytes(), need);
    EXPECT_EQ((*m)->workspace_bytes(), 0u);  // the CPU ops need none
    EXPECT_GE((*dev)->memory_stats().in_use, need);
    m->reset();
    EXPECT_EQ((*dev)->memory_stats().in_use, 0u) << "the model frees its activations";
  }
  device::DeviceOptions opt;
  opt.memory_budget = need / 2;
  auto dev = device::CreateDevice(opt);
  ASSERT_TRUE(dev.ok());
  auto m = LlamaModel::Create(**dev, cfg, seq, batch);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kResourceExhausted) << m.status().ToString();
  EXPECT_NE(m.status().message().find("activations for a micro-batch of 2 x 16 tokens"),
            std::string::npos)
      << m.status().ToString();
}

// One micro-batch (forward, backward, loss) of `cfg` on `dev`, with the parameters `params`
// (host fp32, converted to `dtype` on the device) and gradients read back to the host.
struct MicroBatchResult {
  double loss = 0;
  std::vector<double> more_losses;  // of the `more` micro-batches
  std::vector<std::vector<float>> grads;
};

Result<MicroBatchResult> RunMicroBatch(device::Device& dev, const LlamaConfig& cfg, int64_t seq,
                                       int64_t batch, const std::vector<zero::UnitLayout>& layouts,
                                       const std::vector<std::vector<float>>& params,
                                       device::DType dtype, const LlamaBatch& b,
                                       const LlamaModelOptions& options = {},
                                       const std::vector<char>& frozen = {},
                                       const std::vector<LlamaBatch>& more = {}) {
  STRATA_ASSIGN_OR_RETURN(auto model, LlamaModel::Create(dev, cfg, seq, batch, 7, options));
  STRATA_ASSIGN_OR_RETURN(auto stream, dev.CreateStream("compute"));
  std::vector<void*> p_dev, g_dev, staging;
  auto free_all = [&] {
    (void)dev.Synchronize(*stream);
    for (void* p : p_dev) dev.Free(p);
    for (void* p : g_dev) dev.Free(p);
    for (void* p : staging) dev.Free(p);
  };
  MicroBatchResult out;
  Status st = [&]() -> Status {
    for (size_t u = 0; u < layouts.size(); ++u) {
      const size_t n = params[u].size();
      STRATA_ASSIGN_OR_RETURN(void* f32, dev.Alloc(n * 4));
      staging.push_back(f32);
      STRATA_ASSIGN_OR_RETURN(void* p, dev.Alloc(n * device::DTypeSize(dtype)));
      p_dev.push_back(p);
      STRATA_ASSIGN_OR_RETURN(void* g, dev.Alloc(n * 4));
      g_dev.push_back(g);
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(f32, params[u].data(), n * 4,
                                           device::CopyKind::kHostToDevice, *stream));
      STRATA_RETURN_IF_ERROR(dev.Cast(f32, device::DType::kF32, p, dtype, n, *stream));
      STRATA_RETURN_IF_ERROR(dev.Fill(g, device::DType::kF32, 0.0f, n, *stream));
    }
    const int n = static_cast<int>(layouts.size());
    auto pv = [&](int u) { return zero::UnitView{p_dev[u], dtype, &layouts[u].slots}; };
    // A frozen unit's gradient view is null (zero/model.h); its buffer stays zero.
    auto gv = [&](int u) {
      const bool f = static_cast<size_t>(u) < frozen.size() && frozen[static_cast<size_t>(u)];
      return zero::UnitView{f ? nullptr : g_dev[u], device::DType::kF32, &layouts[u].slots};
    };
    // `b`, then each of `more` (gradient accumulation: the gradients add up).
    for (size_t mb = 0; mb <= more.size(); ++mb) {
      STRATA_RETURN_IF_ERROR(model->BeginMicroBatch(mb == 0 ? b : more[mb - 1], 1.0f, *stream));
      for (int u = 0; u < n; ++u) {
        const std::vector<int> shared = model->SharedUnits(u);
        if (!shared.empty()) {
          const zero::UnitView views[2] = {pv(u), pv(shared[0])};
          STRATA_RETURN_IF_ERROR(model->ForwardShared(u, views, *stream));
        } else {
          STRATA_RETURN_IF_ERROR(model->Forward(u, pv(u), *stream));
        }
      }
      for (int u = n - 1; u >= 0; --u) {
        for (const int r : model->RecomputeUnits(u)) {  // as the engine does
          STRATA_RETURN_IF_ERROR(model->Recompute(r, pv(r), *stream));
        }
        const std::vector<int> shared = model->SharedUnits(u);
        if (!shared.empty()) {
          const zero::UnitView views[2] = {pv(u), pv(shared[0])};
          const zero::UnitView gviews[2] = {gv(u), gv(shared[0])};
          STRATA_RETURN_IF_ERROR(model->BackwardShared(u, views, gviews, *stream));
        } else {
          STRATA_RETURN_IF_ERROR(model->Backward(u, pv(u), gv(u), *stream));
        }
      }
      STRATA_ASSIGN_OR_RETURN(const double loss, model->EndMicroBatch(*stream));
      (mb == 0 ? out.loss : out.more_losses.emplace_back()) = loss;
    }
    for (size_t u = 0; u < layouts.size(); ++u) {
      out.grads.emplace_back(params[u].size());
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(out.grads.back().data(), g_dev[u],
                                           params[u].size() * 4, device::CopyKind::kDeviceToHost,
                                           *stream));
    }
    return dev.Synchronize(*stream);
  }();
  free_all();
  STRATA_RETURN_IF_ERROR(st);
  return out;
}

// The parameters LlamaModel::Create(dev, cfg, seq, batch, 7, options) initialises, by unit, with
// the units' layouts on one rank. LoRA's B starts at zero: with `rng`, every adapter unit is
// drawn from N(0, 0.1) instead, so that the adapters' gradients matter.
struct InitialWeights {
  std::vector<zero::UnitLayout> layouts;
  std::vector<std::vector<float>> params;
};
Result<InitialWeights> InitialParams(device::Device& dev, const LlamaConfig& cfg, int64_t seq,
                                     int64_t batch, const LlamaModelOptions& options,
                                     std::mt19937* rng = nullptr) {
  STRATA_ASSIGN_OR_RETURN(auto probe, LlamaModel::Create(dev, cfg, seq, batch, 7, options));
  InitialWeights w;
  STRATA_ASSIGN_OR_RETURN(w.layouts, zero::LayoutModel(probe->units(), 1));
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (const auto& l : w.layouts) {
    w.params.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
    STRATA_RETURN_IF_ERROR(probe->InitUnit(l.index, l.slots, w.params.back()));
    if (rng != nullptr &&
        LlamaUnitAt(cfg, options.lora, l.index, options.split_blocks).kind == LlamaUnit::kAdapter) {
      for (float& x : w.params.back())
        x = normal(*rng);
    }
  }
  return w;
}

// The decoder on a GPU against the same micro-batch on the CPU device. fp32 weights (fp32 GEMMs,
// no TF32): every gradient within 1e-4 of its tensor's largest element, the loss within 1e-5
// relative. bf16 weights: both devices use the same rounded weights, but the GPU also rounds the
// GEMM inputs (activations, output gradients) to bf16 for the tensor cores (2^-8 relative each),
// so the bound is 3e-2 of each tensor's largest gradient and 1e-2 relative on the loss. fp32 with
// strata.tf32 (inputs rounded to TF32's 10-bit mantissa): 1e-2 and 1e-3. The tiny model's heads
// (head_dim 8) take the exact attention kernels; `wide_heads` gives head_dim 64, which bf16 runs
// on the tensor-core attention (q, k, v and the probabilities rounded to bf16 as well).
struct GpuCase {
  device::DType dtype;
  bool tf32;
  double grad_tol, loss_tol;
  const char* name;
  bool wide_heads = false;
  bool lora = false;  // LoRA adapters (random, B non-zero) on every projection
  bool act16 = false;  // activations in `dtype` on the GPU (LlamaModelOptions::activation_dtype)
};

// Parameters of a model (layouts from LayoutModel), by name: unit, offset and shape.
struct NamedParam {
  size_t unit;
  int64_t offset;
  std::vector<int64_t> shape;
};
std::map<std::string, NamedParam> ByName(const std::vector<zero::UnitLayout>& layouts) {
  std::map<std::string, NamedParam> out;
  for (size_t u = 0; u < layouts.size(); ++u) {
    for (const auto& s : layouts[u].slots) out[s.name] = {u, s.offset, s.shape};
  }
  return out;
}

// LoRA against the merged model. With adapters (random A and B, B non-zero) on six of the seven
// projections, the loss is the merged model's (W + scale B A); each base weight's gradient is
// the merged weight's dW, and the adapters' are dB = scale dW A^T and dA = scale B^T dW. With the
// base units frozen (null gradient views) the adapters' gradients are the same, bit for bit.
// Two packed documents, A (7 tokens, its first 3 a prompt) and B (6 tokens, all trained), then
// 4 pads, in one sequence of 16 inputs; and the same documents each alone at the start of its
// own sequence (the rest of it ignored). The packed micro-batch's targets, positions and key
// starts as train/packing.h makes them.
struct PackedPair {
  LlamaBatch packed, alone;
};
PackedPair MakePackedPair(const LlamaConfig& cfg, std::mt19937& rng) {
  const int64_t seq = 16;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  std::vector<int32_t> a(7), b(6);
  for (auto& t : a) t = tok(rng);
  for (auto& t : b) t = tok(rng);
  const int prompt = 3;  // A's tokens 0..2 are not trained as targets
  PackedPair p;
  LlamaBatch& k = p.packed;
  k.tokens = a;
  k.tokens.insert(k.tokens.end(), b.begin(), b.end());
  while (k.tokens.size() < static_cast<size_t>(seq + 1)) k.tokens.push_back(tok(rng));  // pads
  for (int64_t i = 0; i < seq; ++i) {
    const bool in_a = i < 7, in_b = i >= 7 && i < 13;
    k.positions.push_back(static_cast<int32_t>(in_a ? i : in_b ? i - 7 : 0));
    k.key_start.push_back(static_cast<int32_t>(in_a ? 0 : in_b ? 7 : i));
    const bool trains = (in_a && i + 1 < 7 && i + 1 >= prompt) || (in_b && i + 1 < 13);
    k.targets.push_back(trains ? k.tokens[static_cast<size_t>(i) + 1] : kIgnoreIndexForTests);
  }
  LlamaBatch& l = p.alone;  // two sequences, causal over each, positions 0.. (the plain path)
  for (const auto* doc : {&a, &b}) {
    const size_t base = l.tokens.size();
    l.tokens.insert(l.tokens.end(), doc->begin(), doc->end());
    while (l.tokens.size() < base + static_cast<size_t>(seq + 1)) l.tokens.push_back(tok(rng));
    for (int64_t i = 0; i < seq; ++i) {
      const bool trains = i + 1 < static_cast<int64_t>(doc->size()) && (doc == &b || i + 1 >= prompt);
      l.targets.push_back(trains ? l.tokens[base + static_cast<size_t>(i) + 1]
                                 : kIgnoreIndexForTests);
    }
  }
  return p;
}

// Relative gap between two runs' gradients: the worst over tensors of max |g - h| / max |h|.
double WorstGradGap(const std::vector<zero::UnitLayout>& layouts,
                    const std::vector<std::vector<float>>& got,
                    const std::vector<std::vector<float>>& want, double scale_got = 1.0) {
  double worst = 0;
  for (size_t u = 0; u < layouts.size(); ++u) {
    for (const auto& s : layouts[u].slots) {
      double top = 0, gap = 0;
      for (int64_t i = 0; i < s.numel; ++i) {
        const double w = want[u][static_cast<size_t>(s.offset + i)];
        top = std::max(top, std::fabs(w));
        gap = std::max(gap, std::fabs(scale_got * got[u][static_cast<size_t>(s.offset + i)] - w));
      }
      if (top > 0) worst = std::max(worst, gap / top);
    }
  }
  return worst;
}

// Packed documents train as if each were alone: the same loss and gradients (fp32; only the
// order of summation differs, 1e-5 relative), in the plain Llama and in the Qwen3 shape (q, k,
// v biases and q/k norms), kept and recomputed activations. What the pads hold changes nothing,
// bit for bit. Weights are drawn with std 0.1 so attention is far from uniform and a document
// seeing the other would show (the check that the test can fail: causal attention over the whole
// packed sequence, no key starts, is over 100 times the tolerance away).
TEST(LlamaModelTest, PackedDocumentsTrainAsIfEachWereAlone) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t seq = 16;
  for (const bool qwen : {false, true}) {
    for (const bool keep : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (qwen ? "qwen3 shape" : "llama") << " keep " << keep);
      LlamaConfig cfg = TinyConfig();
      cfg.qkv_bias = qwen;
      cfg.qk_norm = qwen;
      std::mt19937 rng(11);
      auto one = InitialParams(**cpu, cfg, seq, 1, {});
      ASSERT_TRUE(one.ok()) << one.status().ToString();
      std::normal_distribution<float> noise(0.0f, 0.1f);
      for (auto& p : one->params) {
        for (float& x : p) x += noise(rng);
      }
      const PackedPair pair = MakePackedPair(cfg, rng);
      LlamaModelOptions options;
      options.keep_activations = keep;
      auto packed = RunMicroBatch(**cpu, cfg, seq, 1, one->layouts, one->params,
                                  device::DType::kF32, pair.packed, options);
      ASSERT_TRUE(packed.ok()) << packed.status().ToString();
      auto alone = RunMicroBatch(**cpu, cfg, seq, 2, one->layouts, one->params,
                                 device::DType::kF32, pair.alone, options);
      ASSERT_TRUE(alone.ok()) << alone.status().ToString();
      EXPECT_NEAR(packed->loss, alone->loss, 1e-5 * std::fabs(alone->loss));
      EXPECT_LE(WorstGradGap(one->layouts, packed->grads, alone->grads), 1e-5);

      // Other pads: bit for bit.
      LlamaBatch repadded = pair.packed;
      for (size_t i = 13; i < repadded.tokens.size(); ++i) {
        repadded.tokens[i] = (repadded.tokens[i] + 5) % static_cast<int32_t>(cfg.vocab_size);
      }
      auto again = RunMicroBatch(**cpu, cfg, seq, 1, one->layouts, one->params,
                                 device::DType::kF32, repadded, options);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(again->loss, packed->loss);
      for (size_t u = 0; u < again->grads.size(); ++u) {
        EXPECT_EQ(again->grads[u], packed->grads[u]) << one->layouts[u].name;
      }

      // Without key starts B sees A: far from the documents alone.
      LlamaBatch leaky = pair.packed;
      leaky.positions.clear();
      leaky.key_start.clear();
      auto leaked = RunMicroBatch(**cpu, cfg, seq, 1, one->layouts, one->params,
                                  device::DType::kF32, leaky, options);
      ASSERT_TRUE(leaked.ok());
      EXPECT_GT(WorstGradGap(one->layouts, leaked->grads, alone->grads), 1e-3);
    }
  }
}

// Gradient accumulation over micro-batches with different numbers of trained tokens: with the
// trainer's loss weights (train/training_data.h LossWeights: micro-batch a scaled by
// micro-batches x n_a / N) the accumulated loss and gradients, divided by the number of
// micro-batches as the engine does, are one big batch's: the mean over all N trained tokens.
// Unweighted (each micro-batch's own mean, averaged) they are not.
TEST(LlamaModelTest, WeightedUnevenMicroBatchesAreOneBigBatch) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t seq = 16;
  LlamaConfig cfg = TinyConfig();
  std::mt19937 rng(4);
  auto init = InitialParams(**cpu, cfg, seq, 1, {});
  ASSERT_TRUE(init.ok());
  std::normal_distribution<float> noise(0.0f, 0.1f);
  for (auto& p : init->params) {
    for (float& x : p) x += noise(rng);
  }
  // Micro-batch 1: the packed pair (9 trained targets); micro-batch 2: a plain sequence with
  // all 16 targets trained.
  const PackedPair pair = MakePackedPair(cfg, rng);
  LlamaBatch first = pair.packed;
  LlamaBatch second;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  for (int64_t i = 0; i <= seq; ++i) second.tokens.push_back(tok(rng));
  for (int64_t i = 0; i < seq; ++i) {
    second.targets.push_back(second.tokens[static_cast<size_t>(i) + 1]);
    second.positions.push_back(static_cast<int32_t>(i));
    second.key_start.push_back(0);
  }
  // The big batch: both sequences in one micro-batch.
  LlamaBatch big = first;
  for (auto v : {&LlamaBatch::tokens, &LlamaBatch::targets, &LlamaBatch::positions,
                 &LlamaBatch::key_start}) {
    (big.*v).insert((big.*v).end(), (second.*v).begin(), (second.*v).end());
  }
  auto want = RunMicroBatch(**cpu, cfg, seq, 2, init->layouts, init->params, device::DType::kF32,
                            big);
  ASSERT_TRUE(want.ok()) << want.status().ToString();

  const uint64_t n[2] = {9, 16};
  const std::vector<double> w = train::LossWeights(n, 25, 1);
  first.loss_weight = w[0];
  second.loss_weight = w[1];
  auto got = RunMicroBatch(**cpu, cfg, seq, 1, init->layouts, init->params, device::DType::kF32,
                           first, {}, {}, {second});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_NEAR((got->loss + got->more_losses[0]) / 2, want->loss, 1e-5 * want->loss);
  EXPECT_LE(WorstGradGap(init->layouts, got->grads, want->grads, 0.5), 1e-5);

  first.loss_weight = second.loss_weight = 1.0;
  auto unweighted = RunMicroBatch(**cpu, cfg, seq, 1, init->layouts, init->params,
                                  device::DType::kF32, first, {}, {}, {second});
  ASSERT_TRUE(unweighted.ok());
  EXPECT_GT(WorstGradGap(init->layouts, unweighted->grads, want->grads, 0.5), 1e-3);
}

TEST(LlamaModelTest, LoraMatchesTheMergedModel) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const LlamaConfig cfg = TinyConfig();
  LlamaLora lora;
  lora.rank = 3;
  lora.alpha = 6;
  lora.scale = 2.0f;
  lora.targets.fill(true);
  lora.targets[1] = false;  // no adapter on k_proj
  const int64_t batch = 2, seq = 16;
  auto probe = LlamaModel::Create(**cpu, cfg, seq, batch, 7, {.lora = lora});
  ASSERT_TRUE(probe.ok()) << probe.status().ToString();
  ASSERT_EQ(static_cast<int>((*probe)->units().size()), LlamaNumUnits(cfg, lora));
  EXPECT_EQ((*probe)->units()[1].name, "lora.0");
  EXPECT_EQ((*probe)->SharedUnits(2), std::vector<int>{1});
  auto layouts = zero::LayoutModel((*probe)->units(), 1);
  ASSERT_TRUE(layouts.ok());
  std::vector<std::vector<float>> params;
  for (const auto& l : *layouts) {
    params.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
    ASSERT_TRUE((*probe)->InitUnit(l.index, l.slots, params.back()).ok());
  }
  probe->reset();
  const auto named = ByName(*layouts);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (const auto& [name, p] : named) {
    if (!IsLoraParamName(name)) continue;
    if (name.find("lora_B") != std::string::npos) {
      // PEFT's init: B = 0, so the adapted model starts as the base model.
      for (int64_t i = 0; i < p.shape[0] * p.shape[1]; ++i) {
        ASSERT_EQ(params[p.unit][p.offset + i], 0.0f) << name;
      }
    }
    for (int64_t i = 0; i < p.shape[0] * p.shape[1]; ++i) params[p.unit][p.offset + i] = normal(rng);
  }

  // The merged model: the same base weights with scale B A added.
  auto plain = LlamaModel::Create(**cpu, cfg, seq, batch, 7);
  ASSERT_TRUE(plain.ok());
  auto merged_layouts = zero::LayoutModel((*plain)->units(), 1);
  ASSERT_TRUE(merged_layouts.ok());
  plain->reset();
  const auto merged_named = ByName(*merged_layouts);
  std::vector<std::vector<float>> merged;
  for (const auto& l : *merged_layouts) merged.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
  for (const auto& [name, mp] : merged_named) {
    const NamedParam& p = named.at(name);
    int64_t n = 1;
    for (int64_t d : mp.shape) n *= d;
    std::copy_n(params[p.unit].begin() + p.offset, n, merged[mp.unit].begin() + mp.offset);
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    if (!named.contains(module + ".lora_A.weight")) continue;
    const NamedParam& a = named.at(module + ".lora_A.weight");
    const NamedParam& bp = named.at(module + ".lora_B.weight");
    const int64_t out = mp.shape[0], in = mp.shape[1], r = lora.rank;
    for (int64_t i = 0; i < out; ++i) {
      for (int64_t j = 0; j < in; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) {
          acc += double{params[bp.unit][bp.offset + i * r + k]} * params[a.unit][a.offset + k * in + j];
        }
        merged[mp.unit][mp.offset + i * in + j] += static_cast<float>(lora.scale * acc);
      }
    }
  }

  LlamaBatch b;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));
  auto want = RunMicroBatch(**cpu, cfg, seq, batch, *merged_layouts, merged, device::DType::kF32, b);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  auto got = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, device::DType::kF32, b,
                           {.allow_tf32 = false, .profile_ops = false, .lora = lora});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_NEAR(got->loss, want->loss, 1e-5 * std::fabs(want->loss));
  int adapters_checked = 0;
  for (const auto& [name, mp] : merged_named) {
    const NamedParam& p = named.at(name);
    int64_t n = 1;
    for (int64_t d : mp.shape) n *= d;
    double scale = 0, worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double w = want->grads[mp.unit][mp.offset + i];
      scale = std::max(scale, std::fabs(w));
      worst = std::max(worst, std::fabs(got->grads[p.unit][p.offset + i] - w));
    }
    EXPECT_LE(worst, 1e-4 * scale) << name;
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    if (!named.contains(module + ".lora_A.weight")) continue;
    const NamedParam& a = named.at(module + ".lora_A.weight");
    const NamedParam& bp = named.at(module + ".lora_B.weight");
    const int64_t out = mp.shape[0], in = mp.shape[1], r = lora.rank;
    const float* dw = want->grads[mp.unit].data() + mp.offset;
    double da_scale = 0, da_worst = 0, db_scale = 0, db_worst = 0;
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t j = 0; j < in; ++j) {  // dA[k, j] = scale sum_i B[i, k] dW[i, j]
        double acc = 0;
        for (int64_t i = 0; i < out; ++i) acc += double{params[bp.unit][bp.offset + i * r + k]} * dw[i * in + j];
        acc *= lora.scale;
        da_scale = std::max(da_scale, std::fabs(acc));
        da_worst = std::max(da_worst, std::fabs(got->grads[a.unit][a.offset + k * in + j] - acc));
      }
    }
    for (int64_t i = 0; i < out; ++i) {
      for (int64_t k = 0; k < r; ++k) {  // dB[i, k] = scale sum_j dW[i, j] A[k, j]
        double acc = 0;
        for (int64_t j = 0; j < in; ++j) acc += double{dw[i * in + j]} * params[a.unit][a.offset + k * in + j];
        acc *= lora.scale;
        db_scale = std::max(db_scale, std::fabs(acc));
        db_worst = std::max(db_worst, std::fabs(got->grads[bp.unit][bp.offset + i * r + k] - acc));
      }
    }
    EXPECT_LE(da_worst, 1e-4 * da_scale) << module << ".lora_A";
    EXPECT_LE(db_worst, 1e-4 * db_scale) << module << ".lora_B";
    EXPECT_GT(da_scale, 0.0) << module;
    ++adapters_checked;
  }
  EXPECT_EQ(adapters_checked, 2 * 6);  // two layers, six adapted projections each

  // The base units frozen: no weight gradients (their buffers stay zero), the same adapter
  // gradients bit for bit.
  std::vector<char> frozen(layouts->size(), 1);
  for (size_t u = 0; u < layouts->size(); ++u) {
    if (LlamaUnitAt(cfg, lora, static_cast<int>(u)).kind == LlamaUnit::kAdapter) frozen[u] = 0;
  }
  auto lean = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, device::DType::kF32, b,
                            {.allow_tf32 = false, .profile_ops = false, .lora = lora}, frozen);
  ASSERT_TRUE(lean.ok()) << lean.status().ToString();
  EXPECT_EQ(lean->loss, got->loss);
  for (size_t u = 0; u < layouts->size(); ++u) {
    if (frozen[u]) {
      EXPECT_TRUE(std::all_of(lean->grads[u].begin(), lean->grads[u].end(),
                              [](float g) { return g == 0.0f; }))
          << (*layouts)[u].name;
    } else {
      EXPECT_EQ(lean->grads[u], got->grads[u]) << (*layouts)[u].name;
    }
  }
}

// Activation checkpointing off (keep_activations): every block's internals kept from forward,
// none recomputed. The same ops on the same inputs: the loss and every gradient bit-identical to
// the checkpointed run, in fp32 and bf16, with and without LoRA adapters and tied embeddings;
// the activation block grows by L - 1 sets of a block's internals.
TEST(LlamaModelTest, KeptActivationsGiveTheCheckpointedRunBitForBit) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t batch = 2, seq = 16;
  for (bool with_lora : {false, true}) {
    for (bool tied : {false, true}) {
      for (device::DType dtype : {device::DType::kF32, device::DType::kBF16}) {
        SCOPED_TRACE(::testing::Message() << "lora " << with_lora << " tied " << tied << " dtype "
                                          << device::DTypeName(dtype));
        LlamaConfig cfg = TinyConfig();
        cfg.num_hidden_layers = 3;
        cfg.tie_word_embeddings = tied;
        LlamaLora lora;
        if (with_lora) {
          lora.rank = 2;
          lora.alpha = 4;
          lora.scale = 2.0f;
          lora.targets.fill(true);
        }
        const uint64_t checkpointed = LlamaActivationBytes(cfg, seq, batch, lora, false);
        const uint64_t kept = LlamaActivationBytes(cfg, seq, batch, lora, true);
        const uint64_t t = batch * seq, h = 32, kv = 16, inter = 48;
        // Per block: h1, q, attn, x2, h2 [T, H]; k, v [T, kv]; gate, up, hm [T, I]; two rstd
        // [T]; the log-sum-exp [heads T]; with LoRA x A^T [T, r] per projection; each piece
        // rounded up to the device alignment.
        auto piece = [](uint64_t floats) {
          return (4 * floats + device::kDeviceAlignment - 1) / device::kDeviceAlignment *
                 device::kDeviceAlignment;
        };
        uint64_t block = 5 * piece(t * h) + 2 * piece(t * kv) + 3 * piece(t * inter) +
                         2 * piece(t) + piece(4 * t);
        if (with_lora) block += 7 * piece(t * 2);
        EXPECT_EQ(kept - checkpointed, 2 * block);

        std::mt19937 rng(5);
        auto initial = InitialParams(**cpu, cfg, seq, batch, {.lora = lora}, &rng);
        ASSERT_TRUE(initial.ok()) << initial.status().ToString();
        const auto* layouts = &initial->layouts;
        const auto& params = initial->params;
        LlamaBatch b;
        std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
        for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));

        LlamaModelOptions options{.lora = lora};
        auto want = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, dtype, b, options);
        ASSERT_TRUE(want.ok()) << want.status().ToString();
        options.keep_activations = true;
        auto model = LlamaModel::Create(**cpu, cfg, seq, batch, 7, options);
        ASSERT_TRUE(model.ok());
        EXPECT_EQ((*model)->activation_bytes(), kept);
        model->reset();
        auto got = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, dtype, b, options);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ(got->loss, want->loss);
        ASSERT_EQ(got->grads.size(), want->grads.size());
        for (size_t u = 0; u < got->grads.size(); ++u) {
          EXPECT_EQ(got->grads[u], want->grads[u]) << (*layouts)[u].name;
          EXPECT_TRUE(std::any_of(got->grads[u].begin(), got->grads[u].end(),
                                  [](float g) { return g != 0.0f; }))
              << (*layouts)[u].name;
        }
      }
    }
  }
}

// The head's cross-entropy in chunks of tokens (LlamaHeadChunkTokens): chunks of 5 of 32 tokens
// (a partial last chunk), with ignored targets spread unevenly (one chunk has none counted), tied
// and untied embeddings, fp32 and bf16, over two accumulated micro-batches: the loss and every
// gradient as with the whole [T, V] logits, to fp32 rounding (the chunks' means are weighted and
// the head's gradient summed chunk by chunk). The logits buffer is [5, V] instead of [32, V].
TEST(LlamaModelTest, TheHeadInChunksGivesTheWholeHeadsLossAndGradients) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t batch = 2, seq = 16, chunk = 5;
  for (bool tied : {false, true}) {
    for (device::DType dtype : {device::DType::kF32, device::DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << "tied " << tied << " dtype "
                                        << device::DTypeName(dtype));
      LlamaConfig cfg = TinyConfig();
      cfg.num_hidden_layers = 2;
      cfg.tie_word_embeddings = tied;
      const uint64_t whole = LlamaActivationBytes(cfg, seq, batch);
      const uint64_t chunked = LlamaActivationBytes(cfg, seq, batch, {}, false, false, false, chunk);
      const uint64_t v = static_cast<uint64_t>(cfg.vocab_size);
      EXPECT_GE(whole - chunked, 4 * (batch * seq - chunk) * v - device::kDeviceAlignment);

      std::mt19937 rng(11);
      auto initial = InitialParams(**cpu, cfg, seq, batch, {}, &rng);
      ASSERT_TRUE(initial.ok()) << initial.status().ToString();
      std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
      std::vector<LlamaBatch> batches(2);
      for (size_t m = 0; m < batches.size(); ++m) {
        LlamaBatch& b = batches[m];
        for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));
        for (int64_t s = 0; s < batch; ++s) {
          for (int64_t i = 0; i < seq; ++i) {
            b.targets.push_back(b.tokens[static_cast<size_t>(s * (seq + 1) + i + 1)]);
          }
        }
        // Tokens 5-9 (the second chunk) ignored in the first micro-batch, and a few elsewhere.
        for (size_t i : {5, 6, 7, 8, 9, 13, 20, 31}) {
          if (m == 0 || i > 10) b.targets[i] = kIgnoreIndexForTests;
        }
      }
      const std::vector<LlamaBatch> more(batches.begin() + 1, batches.end());
      auto want = RunMicroBatch(**cpu, cfg, seq, batch, initial->layouts, initial->params, dtype,
                                batches[0], {}, {}, more);
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      LlamaModelOptions options;
      options.head_chunk_tokens = chunk;
      auto model = LlamaModel::Create(**cpu, cfg, seq, batch, 7, options);
      ASSERT_TRUE(model.ok());
      EXPECT_EQ((*model)->activation_bytes(), chunked);
      model->reset();
      auto got = RunMicroBatch(**cpu, cfg, seq, batch, initial->layouts, initial->params, dtype,
                               batches[0], options, {}, more);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_NEAR(got->loss, want->loss, 1e-6 * std::abs(want->loss));
      ASSERT_EQ(got->more_losses.size(), 1u);
      EXPECT_NEAR(got->more_losses[0], want->more_losses[0], 1e-6 * std::abs(want->loss));
      ASSERT_EQ(got->grads.size(), want->grads.size());
      for (size_t u = 0; u < got->grads.size(); ++u) {
        float largest = 0;
        for (float g : want->grads[u]) largest = std::max(largest, std::abs(g));
        ASSERT_GT(largest, 0.0f) << initial->layouts[u].name;
        for (size_t i = 0; i < got->grads[u].size(); ++i) {
          ASSERT_NEAR(got->grads[u][i], want->grads[u][i], 1e-5f * largest)
              << initial->layouts[u].name << "[" << i << "]";
        }
      }
    }
  }
}

// Llama 3's vocabulary at 4 x 2048 tokens: no [T, V] logits (4 GiB); chunks of 523 tokens
// (256 MiB of logits) instead, and whole below that.
TEST(LlamaModelTest, LargeVocabulariesTakeTheHeadInChunks) {
  LlamaConfig cfg = TinyConfig();
  cfg.vocab_size = 128256;
  EXPECT_EQ(LlamaHeadChunkTokens(cfg, 4 * 2048), 523);
  EXPECT_EQ(LlamaHeadChunkTokens(cfg, 4 * 2048, /*vocab_split=*/true), 4 * 2048);
  EXPECT_EQ(LlamaHeadChunkTokens(cfg, 500), 500);
  // Every activation together takes less than the whole logits alone would.
  EXPECT_LT(LlamaActivationBytes(cfg, 2048, 4), uint64_t{4} * 2048 * 128256 * 4);
  cfg.vocab_size = 32000;
  EXPECT_EQ(LlamaHeadChunkTokens(cfg, 2048), 2048);  // 250 MiB of logits: whole
}

// 16-bit activations (LlamaModelOptions::activation_dtype) are a CUDA device's: the CPU device
// refuses them at Create and its ops refuse a 16-bit tensor, naming the op; runs take them from
// LlamaActivationDType; they halve the activations' bytes but for the fp32 statistics, and the
// offloaded checkpoints' host bytes exactly.
TEST(LlamaModelTest, SixteenBitActivationsAreTheCudaDevicesOnly) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const LlamaConfig cfg = TinyConfig();
  LlamaModelOptions bf16;
  bf16.activation_dtype = device::DType::kBF16;
  auto refused = LlamaModel::Create(**cpu, cfg, 16, 2, 7, bf16);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("bf16 activations: the cpu device computes "
                                            "activations in fp32 only"),
            std::string::npos)
      << refused.status().ToString();

  std::unique_ptr<LlamaOps> ops = CreateCpuLlamaOps();
  std::vector<float> x(64, 1.0f), y(64), rstd(2);
  const std::vector<float> w(32, 1.0f);
  const LlamaOps::Weight weight{w.data(), device::DType::kF32};
  EXPECT_TRUE(ops->RmsNormForward(x.data(), weight, 2, 32, 1e-5f, y.data(), rstd.data()).ok());
  const Status st = ops->RmsNormForward(CAct(x.data(), device::DType::kBF16), weight, 2, 32, 1e-5f,
                                        y.data(), rstd.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("RmsNormForward: the CPU ops take fp32 activations, not bf16"),
            std::string::npos)
      << st.ToString();

  EXPECT_EQ(LlamaActivationDType(device::DeviceType::kCpu, device::DType::kBF16),
            device::DType::kF32);
  EXPECT_EQ(LlamaActivationDType(device::DeviceType::kCuda, device::DType::kBF16),
            device::DType::kBF16);
  EXPECT_EQ(LlamaActivationDType(device::DeviceType::kCuda, device::DType::kF32),
            device::DType::kF32);
  ::setenv("STRATA_ACTIVATIONS", "fp32", 1);
  EXPECT_EQ(LlamaActivationDType(device::DeviceType::kCuda, device::DType::kF16),
            device::DType::kF32);
  ::unsetenv("STRATA_ACTIVATIONS");

  LlamaConfig big = TinyConfig();
  big.hidden_size = 256;
  big.intermediate_size = 512;
  big.num_hidden_layers = 4;
  for (bool keep : {false, true}) {
    const uint64_t f32 = LlamaActivationBytes(big, 128, 2, {}, keep);
    const uint64_t b16 =
        LlamaActivationBytes(big, 128, 2, {}, keep, false, false, 0, device::DType::kBF16);
    EXPECT_GT(b16, f32 / 2) << keep;
    EXPECT_LT(b16, f32 * 53 / 100) << keep;
  }
  EXPECT_EQ(2 * LlamaCheckpointHostBytes(big, 128, 2, false, true, device::DType::kBF16),
            LlamaCheckpointHostBytes(big, 128, 2, false, true));
}

// strata.offload_checkpoints: every block input but the last two goes to host memory on the
// model's copy stream in forward and comes back in backward, through a ring of two device slots.
// The same loss and gradients, bit for bit, as checkpoints on the device: whole blocks and split
// blocks (recomputed part by part), with LoRA, fp32 and bf16, over three micro-batches of
// different tokens (accumulated), so a stale or early-overwritten slot would change a number.
// The device holds L - 2 block inputs less; the host region holds exactly those.
TEST(LlamaModelTest, OffloadedCheckpointsGiveTheDeviceCheckpointsRunBitForBit) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t batch = 2, seq = 16;
  struct Case {
    const char* name;
    bool split, lora;
    device::DType dtype;
    int layers;
  };
  for (const Case& c : {Case{"whole fp32", false, false, device::DType::kF32, 5},
                        Case{"whole bf16", false, false, device::DType::kBF16, 6},
                        Case{"split fp32", true, false, device::DType::kF32, 5},
                        Case{"split bf16", true, false, device::DType::kBF16, 4},
                        Case{"lora fp32", false, true, device::DType::kF32, 5},
                        Case{"three layers", false, false, device::DType::kF32, 3}}) {
    SCOPED_TRACE(c.name);
    LlamaConfig cfg = TinyConfig();
    cfg.num_hidden_layers = c.layers;
    LlamaLora lora;
    if (c.lora) {
      lora.rank = 2;
      lora.alpha = 4;
      lora.scale = 2.0f;
      lora.targets.fill(true);
    }
    const uint64_t t = batch * seq, h = 32;
    const uint64_t slot = (4 * t * h + device::kDeviceAlignment - 1) / device::kDeviceAlignment *
                          device::kDeviceAlignment;
    EXPECT_EQ(LlamaOffloadedCheckpoints(cfg, false, true), c.layers - 2);
    EXPECT_EQ(LlamaOffloadedCheckpoints(cfg, true, true), 0) << "nothing without checkpointing";
    EXPECT_EQ(LlamaActivationBytes(cfg, seq, batch, lora, false, false) -
                  LlamaActivationBytes(cfg, seq, batch, lora, false, true),
              static_cast<uint64_t>(c.layers - 2) * 4 * t * h)
        << "the block inputs are one carve, " << slot << " bytes a slot";
    const LlamaModelOptions on_device{.lora = lora, .split_blocks = c.split};
    LlamaModelOptions offloaded = on_device;
    offloaded.offload_checkpoints = true;

    auto probe = LlamaModel::Create(**cpu, cfg, seq, batch, 7, offloaded);
    ASSERT_TRUE(probe.ok()) << probe.status().ToString();
    EXPECT_EQ((*probe)->checkpoint_host_bytes(), static_cast<uint64_t>(c.layers - 2) * 4 * t * h);
    EXPECT_EQ((*probe)->checkpoint_host_bytes(),
              LlamaCheckpointHostBytes(cfg, seq, batch, false, true));
    EXPECT_EQ((*probe)->activation_bytes(),
              LlamaActivationBytes(cfg, seq, batch, lora, false, true));
    probe->reset();
    std::mt19937 rng(11);
    auto initial = InitialParams(**cpu, cfg, seq, batch, on_device, &rng);
    ASSERT_TRUE(initial.ok()) << initial.status().ToString();
    const auto* layouts = &initial->layouts;
    const auto& params = initial->params;
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
    std::vector<LlamaBatch> batches(3);
    for (LlamaBatch& b : batches) {
      for (int64_t i = 0; i < batch * (seq + 1); ++i)
        b.tokens.push_back(tok(rng));
    }
    const std::vector<LlamaBatch> more(batches.begin() + 1, batches.end());
    auto want = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, c.dtype, batches[0],
                              on_device, {}, more);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    auto got = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, c.dtype, batches[0],
                             offloaded, {}, more);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->loss, want->loss);
    EXPECT_EQ(got->more_losses, want->more_losses);
    ASSERT_EQ(want->more_losses.size(), 2u);
    EXPECT_NE(want->more_losses[0], want->loss) << "the micro-batches differ";
    ASSERT_EQ(got->grads.size(), want->grads.size());
    for (size_t u = 0; u < got->grads.size(); ++u) {
      EXPECT_EQ(got->grads[u], want->grads[u]) << (*layouts)[u].name;
      EXPECT_TRUE(std::any_of(got->grads[u].begin(), got->grads[u].end(), [](float g) {
        return g != 0.0f;
      })) << (*layouts)[u].name;
    }
  }
  // Checkpoints kept on the host need checkpointing; two layers have none to offload.
  LlamaConfig cfg = TinyConfig();
  cfg.num_hidden_layers = 3;
  LlamaModelOptions both;
  both.keep_activations = true;
  both.offload_checkpoints = true;
  auto kept = LlamaModel::Create(**cpu, cfg, seq, batch, 7, both);
  ASSERT_FALSE(kept.ok());
  EXPECT_NE(kept.status().message().find("strata.offload_checkpoints"), std::string::npos)
      << kept.status().ToString();
  cfg.num_hidden_layers = 2;
  LlamaModelOptions offload;
  offload.offload_checkpoints = true;
  auto two = LlamaModel::Create(**cpu, cfg, seq, batch, 7, offload);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ((*two)->checkpoint_host_bytes(), 0u);
  EXPECT_EQ((*two)->activation_bytes(), LlamaActivationBytes(cfg, seq, batch));
}

// strata.split_blocks: each block as four units (attention, gate, up, down). The same initial
// weights, the same loss and the same gradient of every parameter, bit for bit, as whole blocks,
// with every block's internals kept and with them recomputed part by part (RecomputeUnits);
// only the units differ.
TEST(LlamaModelTest, SplitBlocksGiveTheWholeBlocksRunBitForBit) {
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t batch = 2, seq = 16;
  for (bool tied : {false, true}) {
    for (device::DType dtype : {device::DType::kF32, device::DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << "tied " << tied << " dtype " << device::DTypeName(dtype));
      LlamaConfig cfg = TinyConfig();
      cfg.num_hidden_layers = 3;
      cfg.tie_word_embeddings = tied;
      ASSERT_EQ(LlamaNumUnits(cfg, {}, true), 3 * 4 + 2);
      EXPECT_EQ(LlamaUnitAt(cfg, {}, 6, true).layer, 1);
      EXPECT_EQ(LlamaUnitAt(cfg, {}, 6, true).part, LlamaUnit::kMlpGate);
      LlamaModelOptions whole, split;
      whole.keep_activations = split.keep_activations = true;
      split.split_blocks = true;
      // Each unit's parameters initialised by its model, and by name: {unit, offset, numel}.
      struct Where {
        size_t unit;
        int64_t offset, numel;
      };
      auto init = [&](const LlamaModelOptions& o, std::vector<zero::UnitLayout>* layouts,
                      std::vector<std::vector<float>>* params,
                      std::map<std::string, Where>* names) {
        auto probe = LlamaModel::Create(**cpu, cfg, seq, batch, 7, o);
        ASSERT_TRUE(probe.ok()) << probe.status().ToString();
        auto l = zero::LayoutModel((*probe)->units(), 1);
        ASSERT_TRUE(l.ok());
        *layouts = *l;
        for (const auto& u : *layouts) {
          params->emplace_back(static_cast<size_t>(u.padded_numel()), 0.0f);
          ASSERT_TRUE((*probe)->InitUnit(u.index, u.slots, params->back()).ok());
          for (const auto& slot : u.slots) {
            (*names)[slot.name] = {static_cast<size_t>(u.index), slot.offset, slot.numel};
          }
        }
      };
      std::vector<zero::UnitLayout> wl, sl;
      std::vector<std::vector<float>> wp, sp;
      std::map<std::string, Where> wn, sn;
      init(whole, &wl, &wp, &wn);
      init(split, &sl, &sp, &sn);
      ASSERT_EQ(sl.size(), 14u);
      EXPECT_EQ(sl[2].name, "layers.0.gate");
      EXPECT_EQ(sl[4].slots[0].name, "model.layers.0.mlp.down_proj.weight");
      ASSERT_EQ(wn.size(), sn.size());
      for (const auto& [name, w] : wn) {
        const Where s = sn.at(name);
        ASSERT_EQ(w.numel, s.numel) << name;
        EXPECT_TRUE(std::equal(wp[w.unit].begin() + w.offset, wp[w.unit].begin() + w.offset + w.numel,
                               sp[s.unit].begin() + s.offset))
            << name << ": split blocks initialised it differently";
      }
      std::mt19937 rng(5);
      LlamaBatch b;
      std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
      for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));
      auto want = RunMicroBatch(**cpu, cfg, seq, batch, wl, wp, dtype, b, whole);
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      for (bool keep : {true, false}) {
        SCOPED_TRACE(keep ? "kept" : "recomputed part by part");
        split.keep_activations = keep;
        auto got = RunMicroBatch(**cpu, cfg, seq, batch, sl, sp, dtype, b, split);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ(got->loss, want->loss);
        for (const auto& [name, w] : wn) {
          const Where s = sn.at(name);
          const auto& gw = want->grads[w.unit];
          const auto& gs = got->grads[s.unit];
          EXPECT_TRUE(std::equal(gw.begin() + w.offset, gw.begin() + w.offset + w.numel,
                                 gs.begin() + s.offset))
              << name;
          EXPECT_TRUE(std::any_of(gs.begin() + s.offset, gs.begin() + s.offset + s.numel,
                                  [](float g) { return g != 0.0f; }))
              << name;
        }
      }
      // Only the down part of a block that is not the last recomputes, and what it recomputes
      // is its block's other three parts.
      auto model = LlamaModel::Create(**cpu, cfg, seq, batch, 7, split);
      ASSERT_TRUE(model.ok());
      for (int u = 0; u < 14; ++u) {
        const std::vector<int> want_r = u == 4 || u == 8 ? std::vector<int>{u - 3, u - 2, u - 1}
                                                         : std::vector<int>{};
        EXPECT_EQ((*model)->RecomputeUnits(u), want_r) << "unit " << u;
      }
    }
  }
  // Split blocks take no LoRA.
  LlamaConfig cfg = TinyConfig();
  LlamaLora lora;
  lora.rank = 2;
  lora.scale = 1.0f;
  lora.targets.fill(true);
  auto with_lora = LlamaModel::Create(**cpu, cfg, seq, batch, 7,
                                      {.lora = lora, .keep_activations = true, .split_blocks = true});
  ASSERT_FALSE(with_lora.ok());
  EXPECT_NE(with_lora.status().message().find("LoRA"), std::string::npos);
}

TEST(LlamaModelTest, LoraSettingsAreCheckedAndNamedAsPeft) {
  LoraSettings s;
  s.r = 8;
  s.lora_alpha = 16;
  auto def = ResolveLlamaLora(s);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(def->target_names(), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_FLOAT_EQ(def->scale, 2.0f);
  s.target_modules = {"q_proj", "lm_head"};
  auto bad = ResolveLlamaLora(s);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'lm_head' is not a projection"), std::string::npos)
      << bad.status().ToString();
  s.target_modules = {"all-linear"};
  EXPECT_EQ(ResolveLlamaLora(s)->target_names().size(), 7u);
  s.lora_dropout = 0.05;
  EXPECT_EQ(ResolveLlamaLora(s).status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(IsLoraParamName("model.layers.0.mlp.up_proj.lora_B.weight"));
  EXPECT_FALSE(IsLoraParamName("model.layers.0.mlp.up_proj.weight"));
  EXPECT_EQ(PeftAdapterName("model.layers.0.mlp.up_proj.lora_B.weight"),
            "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight");
}

class LlamaModelGpuTest : public ::testing::TestWithParam<GpuCase> {};

TEST_P(LlamaModelGpuTest, MicroBatchMatchesTheCpuDevice) {
  device::DeviceOptions gopt;
  gopt.type = device::DeviceType::kCuda;
  auto gpu = device::CreateDevice(gopt);
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device: " << gpu.status().ToString();
  const device::DType dtype = GetParam().dtype;
  LlamaConfig cfg = TinyConfig();
  cfg.vocab_size = 320;  // a head GEMM wider than one tile
  if (GetParam().wide_heads) {
    cfg.hidden_size = 128;
    cfg.intermediate_size = 192;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
  }
  const int64_t batch = 2, seq = 48;
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  LlamaModelOptions options{.allow_tf32 = GetParam().tf32, .profile_ops = false, .lora = {}};
  if (GetParam().act16) options.activation_dtype = dtype;
  if (GetParam().lora) {
    options.lora.rank = 4;
    options.lora.alpha = 8;
    options.lora.scale = 2.0f;
    options.lora.targets.fill(true);
  }
  auto probe = LlamaModel::Create(**cpu, cfg, seq, batch, 7, {.lora = options.lora});
  ASSERT_TRUE(probe.ok());
  auto layouts = zero::LayoutModel((*probe)->units(), 1);
  ASSERT_TRUE(layouts.ok());
  std::vector<std::vector<float>> params;
  std::mt19937 init_rng(3);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (const auto& l : *layouts) {
    params.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
    ASSERT_TRUE((*probe)->InitUnit(l.index, l.slots, params.back()).ok());
    if (LlamaUnitAt(cfg, options.lora, l.index).kind == LlamaUnit::kAdapter) {
      for (size_t i = 0; i < static_cast<size_t>(l.used_numel); ++i) params.back()[i] = normal(init_rng);
    }
  }
  probe->reset();
  LlamaBatch b;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));
  b.tokens[seq] = -100;
  auto want = RunMicroBatch(**cpu, cfg, seq, batch, *layouts, params, dtype, b,
                            {.allow_tf32 = false, .profile_ops = false, .lora = options.lora});
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  auto got = RunMicroBatch(**gpu, cfg, seq, batch, *layouts, params, dtype, b, options);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_NEAR(got->loss, want->loss, GetParam().loss_tol * std::fabs(want->loss));
  const double tol = GetParam().grad_tol;
  for (size_t u = 0; u < layouts->size(); ++u) {
    for (const auto& s : (*layouts)[u].slots) {
      double scale = 0, worst = 0;
      for (int64_t i = 0; i < s.numel; ++i) {
        scale = std::max(scale, std::fabs(double{want->grads[u][s.offset + i]}));
      }
      for (int64_t i = 0; i < s.numel; ++i) {
        worst = std::max(worst, std::fabs(double{got->grads[u][s.offset + i]} -
                                          want->grads[u][s.offset + i]));
      }
      EXPECT_LE(worst, tol * scale) << s.name << ": worst " << worst << " of max " << scale;
    }
  }
  // Every block's internals kept (no recomputation): the same GPU run, bit for bit.
  LlamaModelOptions kept = options;
  kept.keep_activations = true;
  auto again = RunMicroBatch(**gpu, cfg, seq, batch, *layouts, params, dtype, b, kept);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->loss, got->loss);
  for (size_t u = 0; u < layouts->size(); ++u) {
    EXPECT_EQ(again->grads[u], got->grads[u]) << (*layouts)[u].name;
  }
  // Checkpoints in host memory (offload_checkpoints) on a four-layer twin, two micro-batches:
  // the GPU run with them on the device, bit for bit (the copies run on the model's copy stream,
  // ordered by events against its compute).
  {
    LlamaConfig deep = cfg;
    deep.num_hidden_layers = 4;
    auto deep_initial = InitialParams(**cpu, deep, seq, batch, {.lora = options.lora});
    ASSERT_TRUE(deep_initial.ok()) << deep_initial.status().ToString();
    const auto* deep_layouts = &deep_initial->layouts;
    const auto& deep_params = deep_initial->params;
    LlamaBatch b2;
    for (int64_t i = 0; i < batch * (seq + 1); ++i)
      b2.tokens.push_back(tok(rng));
    LlamaModelOptions offloaded = options;
    offloaded.offload_checkpoints = true;
    auto on_device = RunMicroBatch(**gpu, deep, seq, batch, *deep_layouts, deep_params, dtype, b,
                                   options, {}, {b2});
    ASSERT_TRUE(on_device.ok()) << on_device.status().ToString();
    auto on_host = RunMicroBatch(**gpu, deep, seq, batch, *deep_layouts, deep_params, dtype, b,
                                 offloaded, {}, {b2});
    ASSERT_TRUE(on_host.ok()) << on_host.status().ToString();
    EXPECT_EQ(on_host->loss, on_device->loss);
    EXPECT_EQ(on_host->more_losses, on_device->more_losses);
    for (size_t u = 0; u < deep_layouts->size(); ++u) {
      EXPECT_EQ(on_host->grads[u], on_device->grads[u]) << (*deep_layouts)[u].name;
    }
  }
  // The model's memory came from the GPU's budget, and all of it went back.
  EXPECT_EQ((*gpu)->memory_stats().in_use, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    DTypes, LlamaModelGpuTest,
    ::testing::Values(GpuCase{device::DType::kF32, false, 1e-4, 1e-5, "fp32"},
                      GpuCase{device::DType::kF32, true, 1e-2, 1e-3, "fp32_tf32"},
                      GpuCase{device::DType::kBF16, false, 3e-2, 1e-2, "bf16"},
                      GpuCase{device::DType::kBF16, false, 3e-2, 1e-2, "bf16_head_dim_64", true},
                      GpuCase{device::DType::kF32, false, 1e-4, 1e-5, "fp32_lora", false, true},
                      GpuCase{device::DType::kBF16, false, 3e-2, 1e-2, "bf16_lora", false, true},
                      // 16-bit activations: every activation and activation gradient is rounded
                      // to bf16 once more per op (2^-8 relative), against the CPU's fp32 ones.
                      GpuCase{device::DType::kBF16, false, 6e-2, 2e-2, "bf16_activations", false,
                              false, true},
                      GpuCase{device::DType::kBF16, false, 6e-2, 2e-2,
                              "bf16_activations_head_dim_64", true, false, true},
                      GpuCase{device::DType::kBF16, false, 6e-2, 2e-2, "bf16_activations_lora",
                              false, true, true}),
    [](const auto& p) { return std::string(p.param.name); });

// Packed documents on a GPU (positions into RoPE, key starts into attention: the exact
// attention kernels, since the tensor-core ones take no key starts) against the CPU device, fp32
// and bf16 (head_dim 64, where bf16 would otherwise take the tensor-core attention), with the
// Qwen3 shape's biases and q/k norms; the tolerances of MicroBatchMatchesTheCpuDevice.
TEST(LlamaModelGpuPackedTest, PackedMicroBatchMatchesTheCpuDevice) {
  device::DeviceOptions gopt;
  gopt.type = device::DeviceType::kCuda;
  auto gpu = device::CreateDevice(gopt);
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device: " << gpu.status().ToString();
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t seq = 16;
  for (const device::DType dtype : {device::DType::kF32, device::DType::kBF16}) {
    SCOPED_TRACE(device::DTypeName(dtype));
    LlamaConfig cfg = TinyConfig();
    cfg.hidden_size = 128;
    cfg.intermediate_size = 192;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
    cfg.qkv_bias = true;
    cfg.qk_norm = true;
    std::mt19937 rng(8);
    auto init = InitialParams(**cpu, cfg, seq, 1, {});
    ASSERT_TRUE(init.ok()) << init.status().ToString();
    std::normal_distribution<float> noise(0.0f, 0.05f);
    for (auto& p : init->params) {
      for (float& x : p) x += noise(rng);
    }
    const PackedPair pair = MakePackedPair(cfg, rng);
    auto want = RunMicroBatch(**cpu, cfg, seq, 1, init->layouts, init->params, dtype, pair.packed);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    auto got = RunMicroBatch(**gpu, cfg, seq, 1, init->layouts, init->params, dtype, pair.packed);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    const bool bf16 = dtype == device::DType::kBF16;
    EXPECT_NEAR(got->loss, want->loss, (bf16 ? 1e-2 : 1e-5) * std::fabs(want->loss));
    EXPECT_LE(WorstGradGap(init->layouts, got->grads, want->grads), bf16 ? 3e-2 : 1e-4);
  }
}


// ---- tensor parallelism -------------------------------------------------------------------------

// Rank `rank`'s part of a whole tensor (LlamaTensorParallelSlice), as a flat vector.
std::vector<float> SliceOf(const float* whole, const std::vector<int64_t>& shape,
                           const TensorSlice& slice) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return SliceTensor(std::span<const float>(whole, static_cast<size_t>(numel)), shape, slice);
}

struct TpCase {
  const char* name;
  int tp;
  LlamaConfig config;
  LlamaModelOptions options;
  bool random_adapters = false;
};

void PrintTo(const TpCase& c, std::ostream* os) { *os << c.name; }

std::string TpCaseName(const ::testing::TestParamInfo<TpCase>& param_info) {
  return param_info.param.name;
}

// One micro-batch of the whole model on one rank against the same micro-batch on `tp`
// tensor-parallel ranks (threads of an in-process world, each with its own CPU device), every
// rank holding its slices of the same weights: every rank's loss is the whole model's, and every
// gradient it computes is its slice of the whole model's gradient (to fp32 tolerance: the splits
// change the order of the sums). The ranks' own initialisation is their slice of the whole
// model's, bit for bit.
class LlamaTensorParallelTest : public ::testing::TestWithParam<TpCase> {};

TEST_P(LlamaTensorParallelTest, EveryRankHasTheWholeModelsLossAndItsSliceOfTheGradients) {
  const TpCase& c = GetParam();
  auto cpu = device::CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  const int64_t batch = 2, seq = 16;
  std::mt19937 rng(5);
  auto whole = InitialParams(**cpu, c.config, seq, batch, c.options, c.random_adapters ? &rng : nullptr);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  LlamaBatch b;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.config.vocab_size) - 1);
  for (int64_t i = 0; i < batch * (seq + 1); ++i) b.tokens.push_back(tok(rng));
  b.tokens[5] = static_cast<int32_t>(c.config.vocab_size) - 1;  // the last rank's last row
  auto want = RunMicroBatch(**cpu, c.config, seq, batch, whole->layouts, whole->params,
                            device::DType::kF32, b, c.options);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  const auto whole_named = ByName(whole->layouts);

  auto world = comm::InProcessWorld::Create({.world_size = c.tp});
  ASSERT_TRUE(world.ok());
  struct RankOutcome {
    Status status;
    std::vector<zero::UnitLayout> layouts;
    std::vector<std::vector<float>> init, params;
    MicroBatchResult got;
  };
  std::vector<RankOutcome> ranks(static_cast<size_t>(c.tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < c.tp; ++r) {
    threads.emplace_back([&, r] {
      RankOutcome& out = ranks[static_cast<size_t>(r)];
      out.status = [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(auto dev, device::CreateDevice({}));
        STRATA_ASSIGN_OR_RETURN(auto group, (*world)->Join(r, *dev));
        LlamaModelOptions o = c.options;
        o.tensor_parallel = {.rank = r, .size = c.tp, .group = group.get()};
        {
          STRATA_ASSIGN_OR_RETURN(auto probe, LlamaModel::Create(*dev, c.config, seq, batch, 7, o));
          STRATA_ASSIGN_OR_RETURN(out.layouts, zero::LayoutModel(probe->units(), 1));
          for (const auto& l : out.layouts) {
            out.init.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
            STRATA_RETURN_IF_ERROR(probe->InitUnit(l.index, l.slots, out.init.back()));
            out.params.emplace_back(static_cast<size_t>(l.padded_numel()), 0.0f);
            for (const auto& s : l.slots) {
              const NamedParam& w = whole_named.at(s.name);
              const std::vector<float> part =
                  SliceOf(whole->params[w.unit].data() + w.offset, w.shape,
                          LlamaTensorParallelSlice(c.config, r, c.tp, s.name));
              if (static_cast<int64_t>(part.size()) != s.numel) {
                return InternalError(fmt::format("{}: {} elements, the slice {}", s.name, s.numel, part.size()));
              }
              std::copy(part.begin(), part.end(), out.params.back().begin() + s.offset);
            }
          }
        }
        STRATA_ASSIGN_OR_RETURN(out.got, RunMicroBatch(*dev, c.config, seq, batch, out.layouts,
                                                       out.params, device::DType::kF32, b, o));
        return Status::Ok();
      }();
    });
  }
  for (auto& t : threads) t.join();

  int split_params = 0;
  for (int r = 0; r < c.tp; ++r) {
    const RankOutcome& out = ranks[static_cast<size_t>(r)];
    ASSERT_TRUE(out.status.ok()) << "rank " << r << ": " << out.status.ToString();
    EXPECT_NEAR(out.got.loss, want->loss, 1e-5 * std::fabs(want->loss)) << "rank " << r;
    for (size_t u = 0; u < out.layouts.size(); ++u) {
      for (const auto& s : out.layouts[u].slots) {
        const NamedParam& w = whole_named.at(s.name);
        const TensorSlice slice = LlamaTensorParallelSlice(c.config, r, c.tp, s.name);
        split_params += slice.dim >= 0 ? 1 : 0;
        if (!c.random_adapters || !IsLoraParamName(s.name)) {
          const std::vector<float> init_want = SliceOf(whole->params[w.unit].data() + w.offset, w.shape, slice);
          EXPECT_TRUE(std::equal(init_want.begin(), init_want.end(), out.init[u].begin() + s.offset))
              << "rank " << r << " initialises " << s.name << " otherwise than its slice";
        }
        const std::vector<float> g_want = SliceOf(want->grads[w.unit].data() + w.offset, w.shape, slice);
        double scale = 0, worst = 0;
        for (size_t i = 0; i < g_want.size(); ++i) {
          scale = std::max(scale, std::fabs(double{g_want[i]}));
          worst = std::max(worst, std::fabs(double{out.got.grads[u][static_cast<size_t>(s.offset) + i]} - g_want[i]));
        }
        EXPECT_LE(worst, 1e-4 * scale + 1e-9) << "rank " << r << ": " << s.name;
      }
    }
  }
  EXPECT_GT(split_params, 0);
}

LlamaConfig QwenLikeConfig() {
  LlamaConfig c = TinyConfig();
  c.model_type = "qwen3";
  c.qk_norm = true;
  c.qkv_bias = true;
  c.o_bias = true;
  c.mlp_bias = true;
  return c;
}

LlamaModelOptions LoraOptions() {
  LlamaModelOptions o;
  o.lora.rank = 2;
  o.lora.alpha = 4;
  o.lora.scale = 2.0f;
  o.lora.targets.fill(true);
  return o;
}

LlamaModelOptions SplitBlockOptions() {
  LlamaModelOptions o;
  o.split_blocks = true;
  return o;
}

LlamaModelOptions KeptActivationOptions() {
  LlamaModelOptions o;
  o.keep_activations = true;
  return o;
}

LlamaConfig TiedConfig() {
  LlamaConfig c = TinyConfig();
  c.tie_word_embeddings = true;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Splits, LlamaTensorParallelTest,
    ::testing::Values(TpCase{"Tp2", 2, TinyConfig(), {}},
                      // Two KV heads over four ranks: each replicated on two.
                      TpCase{"Tp4ReplicatedKvHeads", 4, TinyConfig(), {}},
                      TpCase{"Tp2QkNormAndBiases", 2, QwenLikeConfig(), {}},
                      TpCase{"Tp4QkNormAndBiases", 4, QwenLikeConfig(), {}},
                      TpCase{"Tp2Lora", 2, TinyConfig(), LoraOptions(), true},
                      TpCase{"Tp4Lora", 4, TinyConfig(), LoraOptions(), true},
                      TpCase{"Tp2TiedEmbeddings", 2, TiedConfig(), {}},
                      TpCase{"Tp2SplitBlocks", 2, TinyConfig(), SplitBlockOptions()},
                      TpCase{"Tp2KeptActivations", 2, TinyConfig(), KeptActivationOptions()}),
    TpCaseName);

TEST(LlamaTensorParallelConfigTest, UnevenShapesAreRefusedNamingTheDimension) {
  const LlamaConfig c = TinyConfig();  // 4 heads, 2 KV heads, intermediate 48, vocabulary 64
  auto local = LlamaTensorParallelConfig(c, 2);
  ASSERT_TRUE(local.ok());
  EXPECT_EQ(local->num_attention_heads, 2);
  EXPECT_EQ(local->num_key_value_heads, 1);
  EXPECT_EQ(local->intermediate_size, 24);
  EXPECT_EQ(local->vocab_size, 32);
  EXPECT_EQ(local->head_dim(), c.head_dim());
  auto four = LlamaTensorParallelConfig(c, 4);
  ASSERT_TRUE(four.ok());
  EXPECT_EQ(four->num_key_value_heads, 1);  // replicated on two ranks each
  struct Uneven {
    const char* dimension;
    int tp;
    LlamaConfig config;
  };
  LlamaConfig vocab = c, inter = c, heads = c, kv = c;
  vocab.vocab_size = 66;
  inter.intermediate_size = 50;
  heads.num_attention_heads = 6;
  heads.num_key_value_heads = 6;
  kv.num_attention_heads = 12;
  kv.num_key_value_heads = 3;
  kv.explicit_head_dim = 8;
  for (const Uneven& u : {Uneven{"vocab_size = 66", 4, vocab}, Uneven{"intermediate_size = 50", 4, inter},
                          Uneven{"num_attention_heads = 6", 4, heads},
                          Uneven{"num_key_value_heads = 3", 4, kv}}) {
    auto r = LlamaTensorParallelConfig(u.config, u.tp);
    ASSERT_FALSE(r.ok()) << u.dimension;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(u.dimension), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("autotp_size 4"), std::string::npos) << r.status().ToString();
  }
  auto bad_size = LlamaTensorParallelConfig(c, 0);
  EXPECT_FALSE(bad_size.ok());
}

TEST(LlamaTensorParallelConfigTest, SlicesFollowMegatronsSplits) {
  const LlamaConfig c = TinyConfig();  // q_dim 32, kv_dim 16 (head_dim 8), intermediate 48
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.embed_tokens.weight").begin, 32);
  const TensorSlice q = LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q.dim, 0);
  EXPECT_EQ(q.begin, 16);
  EXPECT_EQ(q.count, 16);
  const TensorSlice o = LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o.dim, 1);
  EXPECT_EQ(o.begin, 16);
  const TensorSlice down = LlamaTensorParallelSlice(c, 1, 4, "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(down.dim, 1);
  EXPECT_EQ(down.begin, 12);
  EXPECT_EQ(down.count, 12);
  // Two KV heads on four ranks: ranks 2 and 3 hold the second.
  const TensorSlice k = LlamaTensorParallelSlice(c, 3, 4, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(k.dim, 0);
  EXPECT_EQ(k.begin, 8);
  EXPECT_EQ(k.count, 8);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.input_layernorm.weight").dim, -1);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.self_attn.o_proj.bias").dim, -1);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.self_attn.q_proj.lora_A.weight").dim, -1);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.self_attn.q_proj.lora_B.weight").dim, 0);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.mlp.down_proj.lora_A.weight").dim, 1);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 1, 2, "model.layers.0.mlp.down_proj.lora_B.weight").dim, -1);
  EXPECT_EQ(LlamaTensorParallelSlice(c, 0, 1, "lm_head.weight").dim, -1);
}

}  // namespace
}  // namespace strata::model
