// Saving and loading the engine's states (the checkpoint seam, Engine::SaveStates / LoadStates /
// EngineOptions::initial) on one rank: the pieces a rank hands out cover every element of every
// parameter exactly once; states saved under one stage / offload configuration and loaded into
// another continue training bit for bit like the run that was never interrupted; a weights-only
// load sets the master weights to the values read and the parameters to their compute-dtype
// rounding; reader errors surface from Engine::Create; counters are checked on restore.
// The multi-rank (N ranks -> M ranks) resume is tested through the checkpoint files in
// tests/train.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <map>
#include <tuple>

#include "toy_model.h"

namespace strata::zero {
namespace {

using testing::MemoryCheckpoint;
using testing::ToyRun;

std::string Json(int stage, const std::string& param_dev, const std::string& optim_dev,
                 const std::string& extra = "", const std::string& optim_extra = "") {
  return testing::ToyConfigJson(stage, param_dev, optim_dev,
                                R"(, "sub_group_size": 2048, "stage3_param_persistence_threshold": 0)",
                                R"(, "gradient_clipping": 1.0)" + extra, optim_extra);
}

ToyRun::Options Opts(const std::string& json) {
  ToyRun::Options o;
  o.config_json = json;
  o.layers = 3;
  o.width = 40;  // 1640-element units: several parameters per shard, alignment gaps
  return o;
}

TEST(EngineStatesTest, PiecesCoverEveryElementOnce) {
  for (const std::string& json : {Json(0, "none", "none"), Json(2, "none", "cpu"),
                                  Json(3, "nvme", "nvme"), Json(3, "none", "none")}) {
    SCOPED_TRACE(json);
    ToyRun run;
    Status st = run.Setup(Opts(json));
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_TRUE(run.Step(0).ok());
    MemoryCheckpoint ck;
    st = ck.Save(*run.engine);
    ASSERT_TRUE(st.ok()) << st.ToString();
    size_t tensors = 0;
    for (const auto& l : run.engine->layouts()) tensors += l.slots.size();
    ASSERT_EQ(ck.writes.size(), 4 * tensors);
    for (const auto& [key, w] : ck.writes) {
      for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], 1) << "element " << i;
    }
    // The saved parameters and master weights are the engine's.
    auto params = run.Params();
    auto masters = run.Masters();
    ASSERT_TRUE(params.ok() && masters.ok());
    for (const auto& l : run.engine->layouts()) {
      for (size_t s = 0; s < l.slots.size(); ++s) {
        const auto& p = ck.values.at({l.index, static_cast<int>(s), StateKind::kParams});
        const auto& m = ck.values.at({l.index, static_cast<int>(s), StateKind::kMaster});
        for (int64_t i = 0; i < l.slots[s].numel; ++i) {
          ASSERT_EQ(p[i], (*params)[l.index][l.slots[s].offset + i]);
          ASSERT_EQ(m[i], (*masters)[l.index][l.slots[s].offset + i]);
        }
      }
    }
  }
}

// Save after 3 steps under one configuration, load into another, train 3 more: the losses and
// final master weights equal those of the uninterrupted run bit for bit (on one rank every stage
// and offload does the same arithmetic).
TEST(EngineStatesTest, ResumeInAnotherConfigurationContinuesBitIdentically) {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {Json(3, "nvme", "nvme"), Json(0, "none", "none")},
      {Json(0, "none", "none"), Json(3, "nvme", "nvme")},
      {Json(1, "none", "none"), Json(2, "none", "nvme")},
      {Json(3, "cpu", "cpu", R"(, "bf16": {"enabled": true})"),
       Json(3, "none", "none", R"(, "bf16": {"enabled": true})")},
      {Json(2, "none", "cpu", R"(, "fp16": {"enabled": true, "initial_scale_power": 8})"),
       Json(3, "nvme", "nvme", R"(, "fp16": {"enabled": true, "initial_scale_power": 8})")},
      // Partial optimizer offload: half the units' states on the device, half offloaded.
      {Json(3, "nvme", "nvme", "", R"(, "ratio": 0.5)"), Json(2, "none", "cpu")},
      {Json(1, "none", "cpu"), Json(3, "cpu", "nvme", "", R"(, "ratio": 0.5)")},
      // Frozen units: only their parameters are saved, and they come back as they were.
      {Json(3, "nvme", "nvme", R"(, "strata": {"freeze": ["layer.0.*"]})"),
       Json(1, "none", "none", R"(, "strata": {"freeze": ["layer.0.*"]})")},
      // ... in bf16, where a frozen unit's parameters are read in the compute dtype.
      {Json(3, "nvme", "nvme", R"(, "bf16": {"enabled": true}, "strata": {"freeze": ["layer.0.*"]})"),
       Json(2, "none", "cpu", R"(, "bf16": {"enabled": true}, "strata": {"freeze": ["layer.0.*"]})")},
  };
  for (const auto& [from, to] : pairs) {
    SCOPED_TRACE(from + "  ->  " + to);
    ToyRun a;
    Status st = a.Setup(Opts(from));
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int s = 0; s < 3; ++s) ASSERT_TRUE(a.Step(s).ok());
    MemoryCheckpoint ck;
    st = ck.Save(*a.engine);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ck.counters = a.engine->counters();
    for (int s = 3; s < 6; ++s) ASSERT_TRUE(a.Step(s).ok());

    ToyRun b;
    ToyRun::Options ob = Opts(to);
    ob.initial = ck.Reader(true);
    st = b.Setup(ob);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = b.engine->RestoreCounters(ck.counters);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int s = 3; s < 6; ++s) ASSERT_TRUE(b.Step(s).ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(b.results[i].loss, a.results[3 + i].loss) << "step " << 3 + i;
      EXPECT_EQ(b.results[i].lr, a.results[3 + i].lr);
      EXPECT_EQ(b.results[i].loss_scale, a.results[3 + i].loss_scale);
      EXPECT_EQ(b.results[i].step, a.results[3 + i].step);
    }
    auto ma = a.Masters();
    auto mb = b.Masters();
    ASSERT_TRUE(ma.ok() && mb.ok());
    EXPECT_EQ(*ma, *mb);
    auto pa = a.Params();
    auto pb = b.Params();
    ASSERT_TRUE(pa.ok() && pb.ok());
    EXPECT_EQ(*pa, *pb);
  }
}

// LoadStates on a running engine replaces everything: afterwards it behaves like the saved one.
TEST(EngineStatesTest, LoadStatesIntoARunningEngine) {
  ToyRun a, b;
  ASSERT_TRUE(a.Setup(Opts(Json(3, "nvme", "nvme"))).ok());
  ToyRun::Options ob = Opts(Json(3, "nvme", "nvme"));
  ob.width = 40;
  ASSERT_TRUE(b.Setup(ob).ok());
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(a.Step(s).ok());
  for (int s = 10; s < 15; ++s) ASSERT_TRUE(b.Step(s).ok());  // b drifts elsewhere
  MemoryCheckpoint ck;
  ASSERT_TRUE(ck.Save(*a.engine).ok());
  Status st = b.engine->LoadStates(ck.Reader(true));
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(b.engine->RestoreCounters(a.engine->counters()).ok());
  ASSERT_TRUE(a.Step(2).ok());
  ASSERT_TRUE(b.Step(2).ok());
  EXPECT_EQ(a.results.back().loss, b.results.back().loss);
  auto ma = a.Masters();
  auto mb = b.Masters();
  ASSERT_TRUE(ma.ok() && mb.ok());
  EXPECT_EQ(*ma, *mb);
}

// Weights only (fine-tuning a model): master = the values read, parameters = their rounding to
// the compute dtype, moments zero (the first step equals a fresh engine's first step from the
// same weights: checked against an engine whose model initialises to the same values).
TEST(EngineStatesTest, WeightsOnlyLoad) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    const std::string extra = bf16 ? R"(, "bf16": {"enabled": true})" : "";
    // Values to load: a saved fresh run's master weights, perturbed.
    ToyRun src;
    ASSERT_TRUE(src.Setup(Opts(Json(0, "none", "none"))).ok());
    MemoryCheckpoint ck;
    ASSERT_TRUE(ck.Save(*src.engine).ok());
    for (auto& [key, v] : ck.values) {
      if (std::get<2>(key) != StateKind::kParams) continue;
      for (size_t i = 0; i < v.size(); ++i) v[i] = v[i] * 1.5f + 1e-3f * static_cast<float>(i % 7);
    }
    ToyRun run;
    ToyRun::Options o = Opts(Json(3, "nvme", "nvme", extra));
    o.initial = ck.Reader(false);
    int calls = 0, last_total = 0;
    o.initial->progress = [&](int done, int total) {
      ++calls;
      EXPECT_EQ(done, calls);
      last_total = total;
    };
    Status st = run.Setup(o);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(calls, static_cast<int>(run.engine->layouts().size()));
    EXPECT_EQ(last_total, calls);
    auto masters = run.Masters();
    auto params = run.Params();
    ASSERT_TRUE(masters.ok() && params.ok());
    for (const auto& l : run.engine->layouts()) {
      for (size_t s = 0; s < l.slots.size(); ++s) {
        const auto& want = ck.values.at({l.index, static_cast<int>(s), StateKind::kParams});
        for (int64_t i = 0; i < l.slots[s].numel; ++i) {
          const float m = (*masters)[l.index][l.slots[s].offset + i];
          ASSERT_EQ(m, want[i]);
          const float rounded = bf16 ? device::Bf16ToFloat(device::FloatToBf16(want[i])) : want[i];
          ASSERT_EQ((*params)[l.index][l.slots[s].offset + i], rounded);
        }
      }
    }
    MemoryCheckpoint after;
    ASSERT_TRUE(after.Save(*run.engine).ok());
    for (const auto& [key, v] : after.values) {
      if (std::get<2>(key) == StateKind::kExpAvg || std::get<2>(key) == StateKind::kExpAvgSq) {
        for (float x : v) ASSERT_EQ(x, 0.0f);
      }
    }
    EXPECT_EQ(run.engine->counters().optimizer_steps, 0);
    ASSERT_TRUE(run.Step(0).ok());
    EXPECT_TRUE(std::isfinite(run.results[0].loss));
  }
}

TEST(EngineStatesTest, ReaderErrorsSurfaceFromCreate) {
  ToyRun run;
  ToyRun::Options o = Opts(Json(3, "nvme", "nvme"));
  InitialStates init;
  init.read = [](const StatePiece& p, void*, device::DType) -> Status {
    if (p.unit == 2) return DataLossError("model.safetensors: tensor 'x' is truncated");
    return Status::Ok();
  };
  o.initial = init;
  Status st = run.Setup(o);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.ToString().find("tensor 'x' is truncated"), std::string::npos) << st.ToString();
}

TEST(EngineStatesTest, RestoreCountersChecksWhatItGets) {
  ToyRun fp32, fp16;
  ASSERT_TRUE(fp32.Setup(Opts(Json(3, "none", "none"))).ok());
  ASSERT_TRUE(
      fp16.Setup(Opts(Json(3, "none", "none", R"(, "fp16": {"enabled": true})"))).ok());
  EngineCounters c;
  c.optimizer_steps = -1;
  EXPECT_EQ(fp32.engine->RestoreCounters(c).code(), StatusCode::kInvalidArgument);
  c.optimizer_steps = 7;
  Status st = fp16.engine->RestoreCounters(c);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.ToString().find("fp16"), std::string::npos) << st.ToString();
  c.loss_scaler = fp16.engine->counters().loss_scaler;
  EXPECT_EQ(fp32.engine->RestoreCounters(c).code(), StatusCode::kInvalidArgument);
  c.loss_scaler->scale = 1024.0;
  ASSERT_TRUE(fp16.engine->RestoreCounters(c).ok());
  EXPECT_EQ(fp16.engine->counters().optimizer_steps, 7);
  EXPECT_EQ(fp16.engine->counters().loss_scaler->scale, 1024.0);
  c.loss_scaler->scale = -1.0;
  EXPECT_EQ(fp16.engine->RestoreCounters(c).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::zero
