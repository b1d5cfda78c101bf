// The Llama decoder on the CPU device: one forward and backward against the PyTorch reference
// (tests/oracle/llama_ref.py, float64), and training through the ZeRO engine.
//
// Oracle tolerances (fp32 kernels against a float64 reference, tiny model): the loss within
// 1e-5 relative; every gradient element within 1e-5 * max|reference gradient of that tensor| +
// 1e-4 * |reference element|. Measured: every tensor's worst error is below 4e-7 of its largest
// gradient (STRATA_ORACLE_VERBOSE=1 prints them).
#include "model/llama_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "comm/single_collective.h"
#include "device/pinned_pool.h"
#include "strata/block_store.h"
#include "test_support.h"
#include "zero/engine.h"
#include "zero/partition.h"

namespace strata::model {
namespace {

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
  // What is not supported says so.
  LlamaConfig tied = TinyConfig();
  tied.tie_word_embeddings = true;
  auto t = LlamaModel::Create(**dev, tied, 8, 2);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tie_word_embeddings"), std::string::npos);
  auto long_seq = LlamaModel::Create(**dev, TinyConfig(), 65, 2);
  ASSERT_FALSE(long_seq.ok());
  EXPECT_NE(long_seq.status().message().find("max_position_embeddings"), std::string::npos);
}

TEST(LlamaModelTest, ForwardAndBackwardMatchPyTorch) {
  if (!HaveTorch()) GTEST_SKIP() << "needs Debian's /usr/bin/python3 with torch (python3-torch)";
  const LlamaConfig cfg = TinyConfig();
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
  for (int u = 0; u < n; ++u) {
    zero::UnitView p{params[u].data(), device::DType::kF32, &(*layouts)[u].slots};
    ASSERT_TRUE((*model)->Forward(u, p, **stream).ok());
  }
  for (int u = n - 1; u >= 0; --u) {
    zero::UnitView p{params[u].data(), device::DType::kF32, &(*layouts)[u].slots};
    zero::UnitView g{grads[u].data(), device::DType::kF32, &(*layouts)[u].slots};
    ASSERT_TRUE((*model)->Backward(u, p, g, **stream).ok());
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

TEST(LlamaModelTest, TrainsThroughTheZeroEngineWithNvmeOffload) {
  const LlamaConfig cfg = TinyConfig();
  const int64_t batch = 4, seq = 16;
  auto dev = device::CreateDevice({});
  ASSERT_TRUE(dev.ok());
  comm::CollectiveOptions copt;
  comm::internal::SingleCollective comm(**dev, copt);
  io::StoreOptions sopt;
  auto store = io::CreateBlockStore(sopt);
  ASSERT_TRUE(store.ok());
  device::PinnedPoolOptions popt;
  popt.bytes = 64 << 20;
  popt.device = dev->get();
  popt.store = store->get();
  auto pool = device::PinnedPool::Create(popt);
  ASSERT_TRUE(pool.ok());
  strata::testing::TempDir dir;
  auto config = ParseConfig(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "gradient_clipping": 1.0, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" +
                                dir.path().string() + R"("},
        "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.path().string() +
                                R"("}}})",
                            "<test>");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto model = LlamaModel::Create(**dev, cfg, seq, batch, 1);
  ASSERT_TRUE(model.ok());
  zero::EngineOptions eo;
  eo.config = *config;
  eo.device = dev->get();
  eo.comm = &comm;
  eo.pool = pool->get();
  eo.store = store->get();
  auto engine = zero::Engine::Create(**model, eo);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
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
    auto r = (*engine)->TrainStep(std::span<const zero::Batch* const>(&ptr, 1));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    losses.push_back(r->loss);
  }
  EXPECT_NEAR(losses.front(), std::log(static_cast<double>(cfg.vocab_size)), 0.5);
  EXPECT_LT(losses.back(), 0.5 * losses.front()) << "first " << losses.front() << " last "
                                                  << losses.back();
}

}  // namespace
}  // namespace strata::model
