// The ZeRO engine on one rank (single-rank collective, CPU device): every stage and offload
// combination gives bit-identical results on one rank (the arithmetic is the same), the loss
// falls, clipping and fp16 loss scaling behave, the optimizer pipeline's host memory stays
// bounded, and an I/O error while optimizer states are written back is reported without
// corrupting them. Multi-rank equivalence is in engine_mpi_test.cc.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "zero/partition.h"
#include "toy_model.h"

namespace strata::zero {
namespace {

using testing::MaxRelDiff;
using testing::ToyRun;

std::string ConfigJson(int stage, const std::string& param_dev, const std::string& optim_dev,
                       const std::string& extra = "", const std::string& optim_extra = "") {
  return testing::ToyConfigJson(
      stage, param_dev, optim_dev,
      R"(, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0)", extra, optim_extra);
}

double MeanLoss(const ToyRun& run, size_t begin, size_t end) {
  double sum = 0.0;
  for (size_t i = begin; i < end; ++i) sum += run.results.at(i).loss;
  return sum / static_cast<double>(end - begin);
}

std::vector<std::vector<float>> TrainAndGetMasters(ToyRun::Options o) {
  ToyRun run;
  Status st = run.Setup(o);
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (!st.ok()) return {};
  st = run.Train();
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto m = run.Masters();
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : std::vector<std::vector<float>>{};
}

// The engine's memory plan for the toy model (4 units of 1024 x 1024; plans only, nothing is
// allocated) under `json`, on one rank.
EngineMemoryPlan PlanToy(const std::string& json) {
  auto probe_device = device::CreateDevice({});
  EXPECT_TRUE(probe_device.ok());
  if (!probe_device.ok()) return {};
  testing::ToyModel probe(**probe_device, 4, 1024);
  auto config = ParseConfig(json, "<t>");
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  if (!config.ok()) return {};
  auto p = Engine::PlanMemory(probe.units(), {}, *config, 1);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? *p : EngineMemoryPlan{};
}

// Device bytes of the plan's held items whose description contains `what`.
uint64_t DeviceItemBytes(const EngineMemoryPlan& p, const char* what) {
  uint64_t b = 0;
  for (const auto& i : p.device) {
    if (i.what.find(what) != std::string::npos) b += i.bytes;
  }
  return b;
}

TEST(PartitionTest, ShardsAreAlignedAndCoverTheUnit) {
  UnitSpec spec{"block", {{"w", {100, 37}}, {"b", {37}}, {"g", {5}}}};
  for (int world : {1, 2, 3, 4, 8}) {
    auto layout = LayoutUnit(0, spec, world);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    EXPECT_EQ(layout->numel, 100 * 37 + 37 + 5);
    EXPECT_EQ(layout->shard_numel % kShardAlignElems, 0);
    EXPECT_GE(layout->padded_numel(), layout->used_numel);
    EXPECT_LT(layout->padded_numel() - layout->used_numel,
              static_cast<int64_t>(world) * kShardAlignElems);
    // 16-bit shards are 4 KiB multiples, fp32 shards 8 KiB multiples.
    EXPECT_EQ(layout->shard_numel * 2 % 4096, 0);
    for (size_t i = 0; i < layout->slots.size(); ++i) {
      EXPECT_EQ(layout->slots[i].offset % kParamAlignElems, 0);
      if (i > 0) {
        EXPECT_GE(layout->slots[i].offset,
                  layout->slots[i - 1].offset + layout->slots[i - 1].numel);
      }
    }
  }
}

TEST(PartitionTest, RejectsBadUnits) {
  EXPECT_FALSE(LayoutUnit(0, UnitSpec{"empty", {}}, 2).ok());
  auto zero_dim = LayoutUnit(0, UnitSpec{"u", {{"w", {4, 0}}}}, 2);
  ASSERT_FALSE(zero_dim.ok());
  EXPECT_NE(zero_dim.status().message().find("'w'"), std::string::npos) << zero_dim.status().ToString();
  auto dup = LayoutUnit(0, UnitSpec{"u", {{"w", {4}}, {"w", {4}}}}, 2);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("twice"), std::string::npos) << dup.status().ToString();
  EXPECT_FALSE(LayoutUnit(0, UnitSpec{"u", {{"w", {4}}}}, 0).ok());
}

TEST(EngineTest, LossFalls) {
  ToyRun run;
  ToyRun::Options o;
  o.config_json = ConfigJson(3, "nvme", "nvme");
  o.steps = 40;
  o.param_host_budget = 16 << 10;  // two shards: parameters must come back from NVMe
  ASSERT_TRUE(run.Setup(o).ok());
  {
    const Status trained = run.Train();
    ASSERT_TRUE(trained.ok()) << trained.ToString();
  }
  const double first = MeanLoss(run, 0, 5);
  const double last = MeanLoss(run, 35, 40);
  EXPECT_LT(last, 0.6 * first) << "first " << first << " last " << last;
  EXPECT_GT(run.engine->stats().param_nvme_read_bytes, 0u);
}

// On one rank every stage and home does the same arithmetic: the results are bit-identical.
TEST(EngineTest, EveryStageAndOffloadIsIdenticalOnOneRank) {
  ToyRun::Options base;
  base.config_json = ConfigJson(0, "none", "none");
  base.accumulation = 2;
  const auto reference = TrainAndGetMasters(base);
  ASSERT_FALSE(reference.empty());
  for (int stage : {1, 2, 3}) {
    for (const char* where : {"none", "cpu", "nvme"}) {
      SCOPED_TRACE(fmt::format("stage {} offload {}", stage, where));
      ToyRun::Options o = base;
      o.config_json = ConfigJson(stage, stage == 3 ? where : "none", where);
      const auto got = TrainAndGetMasters(o);
      EXPECT_EQ(MaxRelDiff(got, reference), 0.0);
    }
  }
}

TEST(PartitionTest, OffloadedUnitsTakeTheLastUnitsUpToTheRatio) {
  std::vector<UnitLayout> layouts(4);
  const int64_t sizes[4] = {4096, 2048, 2048, 8192};  // 16384 in all
  for (int i = 0; i < 4; ++i) {
    layouts[i].index = i;
    layouts[i].shard_numel = sizes[i];
  }
  using V = std::vector<char>;
  EXPECT_EQ(OffloadedUnits(layouts, 1.0), (V{1, 1, 1, 1}));
  EXPECT_EQ(OffloadedUnits(layouts, 0.5), (V{0, 0, 0, 1}));     // 8192 of 16384
  EXPECT_EQ(OffloadedUnits(layouts, 0.24), (V{0, 0, 0, 0}));    // over half of the head is over
  EXPECT_EQ(OffloadedUnits(layouts, 0.25), (V{0, 0, 0, 1}));    // half of it fits
  EXPECT_EQ(OffloadedUnits(layouts, 0.65), (V{0, 0, 1, 1}));    // 10240 of 10649.6
  EXPECT_EQ(OffloadedUnits(layouts, 0.70), (V{0, 1, 1, 1}));    // 12288 of 11468.8: half fits
  EXPECT_EQ(OffloadedUnits(layouts, 0.75), (V{0, 1, 1, 1}));    // 12288 of 12288
  EXPECT_EQ(OffloadedUnits(layouts, 0.86), (V{0, 1, 1, 1}));    // 14336 of 14090: first half over
  EXPECT_EQ(OffloadedUnits(layouts, 0.88), (V{1, 1, 1, 1}));
  EXPECT_EQ(OffloadedUnits(layouts, 0.01), (V{0, 0, 0, 0}));
}

// offload_optimizer.ratio < 1: some units' states on the device (fused device AdamW), the last
// units' offloaded (CPU AdamW), in one step. On one rank still the same arithmetic: bit-identical
// to the reference, at every stage, home, and with the CPU optimizer overlapped or not.
TEST(EngineTest, PartialOptimizerOffloadIsIdenticalOnOneRank) {
  ToyRun::Options base;
  base.config_json = ConfigJson(0, "none", "none");
  base.accumulation = 2;
  const auto reference = TrainAndGetMasters(base);
  ASSERT_FALSE(reference.empty());
  for (int stage : {1, 2, 3}) {
    for (const char* where : {"cpu", "nvme"}) {
      for (bool overlap : {true, false}) {
        SCOPED_TRACE(fmt::format("stage {} offload {} overlap {}", stage, where, overlap));
        ToyRun::Options o = base;
        o.config_json = ConfigJson(stage, stage == 3 ? where : "none", where, "",
                                   R"(, "ratio": 0.5)");
        o.overlap_optimizer = overlap;
        ToyRun run;
        Status st = run.Setup(o);
        ASSERT_TRUE(st.ok()) << st.ToString();
        st = run.Train();
        ASSERT_TRUE(st.ok()) << st.ToString();
        EXPECT_EQ(run.engine->stats().units, 4);
        EXPECT_EQ(run.engine->stats().offloaded_optimizer_units, 2);
        auto got = run.Masters();
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ(MaxRelDiff(*got, reference), 0.0);
      }
    }
  }
}

// A share of the states offloaded: the planned pool and device memory hold exactly the two
// halves (the pool is smaller than with everything offloaded, the device holds the rest).
TEST(EngineTest, PartialOffloadPlansBothHalves) {
  auto adam = [](const EngineMemoryPlan& p) { return DeviceItemBytes(p, "AdamW"); };
  const EngineMemoryPlan all = PlanToy(ConfigJson(2, "none", "nvme"));
  const EngineMemoryPlan half = PlanToy(ConfigJson(2, "none", "nvme", "", R"(, "ratio": 0.5)"));
  const EngineMemoryPlan none = PlanToy(ConfigJson(2, "none", "none"));
  EXPECT_EQ(adam(all), 0u);
  EXPECT_EQ(adam(half) * 2, adam(none));
  EXPECT_EQ(half.nvme_optim_file * 2, all.nvme_optim_file);
  EXPECT_EQ(half.offloaded_optim_elems * 2, half.shard_elems);
  EXPECT_EQ(all.offloaded_optim_elems, all.shard_elems);
  EXPECT_EQ(none.offloaded_optim_elems, 0u);
  EXPECT_LT(half.pinned_pool, all.pinned_pool);
  EXPECT_GT(half.device_total(), all.device_total());
}

TEST(PartitionTest, FrozenUnitsFollowThePatterns) {
  const std::vector<UnitSpec> units = {
      {"embed", {{"model.embed_tokens.weight", {8, 4}}}},
      {"layers.0", {{"model.layers.0.norm.weight", {4}}, {"model.layers.0.proj.weight", {4, 4}}}},
      {"layers.1", {{"model.layers.1.norm.weight", {4}}, {"model.layers.1.proj.weight", {4, 4}}}},
      {"head", {{"model.norm.weight", {4}}, {"lm_head.weight", {8, 4}}}}};
  using V = std::vector<char>;
  auto frozen = [&](std::vector<std::string> freeze, std::vector<std::string> trainable) {
    auto r = FrozenUnits(units, freeze, trainable);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : V{};
  };
  EXPECT_EQ(frozen({}, {}), (V{0, 0, 0, 0}));
  EXPECT_EQ(frozen({"model.embed_tokens.*", "model.layers.0.*"}, {}), (V{1, 1, 0, 0}));
  EXPECT_EQ(frozen({}, {"model.layers.1.*", "lm_head.*", "model.norm.*"}), (V{1, 1, 0, 0}));
  EXPECT_EQ(frozen({"model.layers.[01].*"}, {}), (V{0, 1, 1, 0}));
  // A unit split by the patterns, a pattern that matches nothing, everything frozen.
  auto error = [&](std::vector<std::string> freeze, std::vector<std::string> trainable) {
    auto r = FrozenUnits(units, freeze, trainable);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : std::string(r.status().message());
  };
  const std::string split = error({"lm_head.weight"}, {});
  EXPECT_NE(split.find("strata.freeze: unit 'head' would be split: lm_head.weight is frozen but "
                       "model.norm.weight is not"),
            std::string::npos)
      << split;
  const std::string none = error({}, {"model.layers.7.*"});
  EXPECT_NE(none.find("strata.trainable: the pattern 'model.layers.7.*' matches no parameter"),
            std::string::npos)
      << none;
  EXPECT_EQ(frozen({"*"}, {}), (V{1, 1, 1, 1}));  // evaluation; strata train refuses it
  // Frozen units have no optimizer states to offload: the ratio counts the others.
  std::vector<UnitLayout> layouts(4);
  for (int i = 0; i < 4; ++i) {
    layouts[i].index = i;
    layouts[i].shard_numel = 2048;
  }
  EXPECT_EQ(OffloadedUnits(layouts, 1.0, V{0, 0, 0, 1}), (V{1, 1, 1, 0}));
  EXPECT_EQ(OffloadedUnits(layouts, 0.5, V{0, 1, 0, 1}), (V{0, 0, 1, 0}));
}

// strata.freeze: frozen units keep their weights bit for bit, the others train, and every
// stage and home (with partial optimizer offload too) gives the same bits on one rank.
TEST(EngineTest, FrozenUnitsKeepTheirWeightsAtEveryStageAndHome) {
  const std::string freeze = R"(, "strata": {"freeze": ["layer.1.*", "head.*"]})";
  ToyRun::Options base;
  base.config_json = ConfigJson(0, "none", "none", freeze);
  base.accumulation = 2;
  std::vector<std::vector<float>> initial;
  {
    ToyRun fresh;
    ASSERT_TRUE(fresh.Setup(base).ok());
    auto p = fresh.Params();
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    initial = *p;
  }
  ToyRun ref;
  {
    Status st = ref.Setup(base);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = ref.Train();
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  auto ref_params = ref.Params();
  ASSERT_TRUE(ref_params.ok());
  ASSERT_EQ(ref_params->size(), 4u);
  EXPECT_NE((*ref_params)[0], initial[0]);  // layer.0 trains
  EXPECT_EQ((*ref_params)[1], initial[1]);  // layer.1: frozen
  EXPECT_NE((*ref_params)[2], initial[2]);  // layer.2 trains
  EXPECT_EQ((*ref_params)[3], initial[3]);  // head: frozen
  EXPECT_LT(ref.results.back().loss, ref.results.front().loss);
  EXPECT_EQ(ref.engine->stats().frozen_units, 2);
  for (int stage : {1, 2, 3}) {
    for (const char* where : {"none", "cpu", "nvme", "cpu@0.5"}) {
      SCOPED_TRACE(fmt::format("stage {} offload {}", stage, where));
      const bool partial = std::string(where) == "cpu@0.5";
      ToyRun::Options o = base;
      o.config_json = partial ? ConfigJson(stage, "none", "cpu", freeze, R"(, "ratio": 0.5)")
                              : ConfigJson(stage, stage == 3 ? where : "none", where, freeze);
      ToyRun run;
      Status st = run.Setup(o);
      ASSERT_TRUE(st.ok()) << st.ToString();
      st = run.Train();
      ASSERT_TRUE(st.ok()) << st.ToString();
      auto got = run.Params();
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(*got, *ref_params);
      auto masters = run.Masters();  // a frozen unit's "master" is its parameters
      ASSERT_TRUE(masters.ok()) << masters.status().ToString();
      EXPECT_EQ((*masters)[1], initial[1]);
    }
  }
}

// A frozen unit costs no optimizer state and no gradient accumulator in the plan.
TEST(EngineTest, FrozenUnitsArePlannedWithoutStates) {
  auto item = DeviceItemBytes;
  const std::string freeze = R"(, "strata": {"trainable": ["head.*"]})";  // 3 of 4 frozen
  const EngineMemoryPlan all = PlanToy(ConfigJson(1, "none", "none"));
  const EngineMemoryPlan one = PlanToy(ConfigJson(1, "none", "none", freeze));
  EXPECT_EQ(item(one, "AdamW") * 4, item(all, "AdamW"));
  EXPECT_EQ(item(one, "fp32 gradient accumulators") * 4, item(all, "fp32 gradient accumulators"));
  EXPECT_EQ(one.trainable_elems * 4, one.shard_elems);
  const EngineMemoryPlan nvme = PlanToy(ConfigJson(2, "none", "nvme", freeze));
  const EngineMemoryPlan nvme_all = PlanToy(ConfigJson(2, "none", "nvme"));
  EXPECT_EQ(nvme.nvme_optim_file * 4, nvme_all.nvme_optim_file);
  EXPECT_LT(nvme.pinned_pool, nvme_all.pinned_pool);
  // Bad patterns are the config's error, from the plan as from Create.
  auto bad = ParseConfig(ConfigJson(1, "none", "none", R"(, "strata": {"freeze": ["layer.9.*"]})"),
                         "<t>");
  ASSERT_TRUE(bad.ok());
  auto probe_device = device::CreateDevice({});
  ASSERT_TRUE(probe_device.ok());
  testing::ToyModel probe(**probe_device, 4, 1024);
  auto p = Engine::PlanMemory(probe.units(), {}, *bad, 1);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("'layer.9.*' matches no parameter"),
            std::string::npos)
      << p.status().ToString();
}

TEST(EngineTest, OverlappedOptimizerMatchesSequential) {
  ToyRun::Options o;
  o.config_json = ConfigJson(3, "nvme", "nvme");
  o.overlap_optimizer = true;
  const auto overlapped = TrainAndGetMasters(o);
  o.overlap_optimizer = false;
  const auto sequential = TrainAndGetMasters(o);
  ASSERT_FALSE(overlapped.empty());
  EXPECT_EQ(MaxRelDiff(overlapped, sequential), 0.0);
}

TEST(EngineTest, ClippingIsExactAndBoundsTheUpdate) {
  ToyRun::Options o;
  o.config_json = ConfigJson(0, "none", "none", R"(, "gradient_clipping": 0.05)");
  ToyRun ref;
  ASSERT_TRUE(ref.Setup(o).ok());
  ASSERT_TRUE(ref.Train().ok());
  bool clipped = false;
  for (const auto& r : ref.results) clipped |= r.grad_norm > 0.05;
  EXPECT_TRUE(clipped) << "the test should exercise clipping";
  auto want = ref.Masters();
  ASSERT_TRUE(want.ok());
  o.config_json = ConfigJson(3, "nvme", "nvme", R"(, "gradient_clipping": 0.05)");
  const auto got = TrainAndGetMasters(o);
  EXPECT_EQ(MaxRelDiff(got, *want), 0.0);
  // And clipping changes the result (it is not a no-op).
  o.config_json = ConfigJson(3, "nvme", "nvme");
  const auto unclipped = TrainAndGetMasters(o);
  EXPECT_GT(MaxRelDiff(unclipped, *want), 1e-4);
}

TEST(EngineTest, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  ToyRun::Options o;
  o.config_json = ConfigJson(
      3, "cpu", "cpu",
      R"(, "fp16": {"enabled": true, "initial_scale_power": 40, "hysteresis": 1})");
  ToyRun run;
  Status st = run.Setup(o);
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto before = run.Masters();
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE(run.Step(0).ok());
  EXPECT_TRUE(run.results[0].skipped);
  EXPECT_EQ(run.results[0].step, 0);
  auto after = run.Masters();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(MaxRelDiff(*after, *before), 0.0) << "a skipped step must not change the weights";
  // The scale falls until steps are taken, then training proceeds.
  for (int s = 1; s < 40; ++s) ASSERT_TRUE(run.Step(s).ok());
  EXPECT_LT(run.results.back().loss_scale, run.results[0].loss_scale);
  EXPECT_FALSE(run.results.back().skipped);
  EXPECT_GT(run.results.back().step, 0);
}

TEST(EngineTest, Bf16Trains) {
  ToyRun::Options o;
  o.config_json = ConfigJson(3, "nvme", "nvme", R"(, "bf16": {"enabled": true})");
  o.steps = 30;
  ToyRun run;
  ASSERT_TRUE(run.Setup(o).ok());
  {
    const Status trained = run.Train();
    ASSERT_TRUE(trained.ok()) << trained.ToString();
  }
  EXPECT_LT(MeanLoss(run, 25, 30), 0.7 * MeanLoss(run, 0, 5));
  EXPECT_EQ(run.engine->compute_dtype(), device::DType::kBF16);
  // The parameters the model sees are the master weights rounded to bf16.
  auto masters = run.Masters();
  auto params = run.Params();
  ASSERT_TRUE(masters.ok() && params.ok());
  for (size_t u = 0; u < masters->size(); ++u) {
    for (size_t i = 0; i < (*masters)[u].size(); ++i) {
      ASSERT_EQ((*params)[u][i], device::Bf16ToFloat(device::FloatToBf16((*masters)[u][i])));
    }
  }
}

// The optimizer pipeline holds at most pipeline-depth sub-groups of states in pinned memory,
// however many there are.
TEST(EngineTest, OptimizerPipelineMemoryIsBounded) {
  ToyRun::Options o;
  o.layers = 3;
  o.width = 128;  // 16.5k parameters per unit: 5 sub-groups of 4096 elements each
  o.config_json = ConfigJson(2, "none", "nvme");
  o.steps = 3;
  ToyRun run;
  ASSERT_TRUE(run.Setup(o).ok());
  {
    const Status trained = run.Train();
    ASSERT_TRUE(trained.ok()) << trained.ToString();
  }
  const auto stats = run.engine->stats();
  const uint64_t subgroup_bytes = device::PinnedPool::SizeClass(12ull * 4096);
  EXPECT_LE(stats.host_peak_bytes, 4 * subgroup_bytes);
  EXPECT_GT(stats.optim_nvme_write_bytes, 0u);
  EXPECT_GT(stats.optim_nvme_read_bytes, 0u);
}

// A write-back that fails while the optimizer runs is reported by TrainStep; afterwards every
// sub-group holds either the previous step's states or the new ones, never a mix or garbage.
TEST(EngineTest, OptimizerWriteErrorIsReportedAndStatesStayConsistent) {
  ToyRun::Options o;
  o.layers = 3;
  o.width = 128;
  o.config_json = ConfigJson(2, "none", "nvme");
  o.steps = 0;
  // The fault-free trajectory: states after 2 and after 3 steps.
  ToyRun ref;
  ASSERT_TRUE(ref.Setup(o).ok());
  ASSERT_TRUE(ref.Step(0).ok());
  ASSERT_TRUE(ref.Step(1).ok());
  auto after2 = ref.Masters();
  ASSERT_TRUE(ref.Step(2).ok());
  auto after3 = ref.Masters();
  ASSERT_TRUE(after2.ok() && after3.ok());

  o.faults = std::make_shared<io::FaultInjector>(3);
  ToyRun run;
  ASSERT_TRUE(run.Setup(o).ok());
  ASSERT_TRUE(run.Step(0).ok());
  ASSERT_TRUE(run.Step(1).ok());
  io::FaultRule rule;
  rule.op = io::IoOp::kWrite;
  rule.path_contains = "optim";
  rule.ordinals = {1};
  o.faults->AddRule(rule);
  Status st = run.Step(2);
  ASSERT_FALSE(st.ok()) << "the injected write error must be reported";
  EXPECT_NE(st.message().find("optim"), std::string::npos) << st.ToString();
  o.faults->Clear();
  auto got = run.Masters();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  // Sub-group by sub-group: old or new, exactly.
  const int64_t sg = 4096;
  int old_groups = 0, new_groups = 0;
  for (size_t u = 0; u < got->size(); ++u) {
    for (size_t begin = 0; begin < (*got)[u].size(); begin += sg) {
      const size_t end = std::min((*got)[u].size(), begin + sg);
      auto slice = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + begin, v.begin() + end);
      };
      const auto g = slice((*got)[u]);
      if (g == slice((*after3)[u])) {
        ++new_groups;
      } else if (g == slice((*after2)[u])) {
        ++old_groups;
      } else {
        ADD_FAILURE() << "unit " << u << " elements [" << begin << ", " << end
                      << ") hold neither the old nor the new states";
      }
    }
  }
  EXPECT_GT(old_groups + new_groups, 0);
}

// The planned pinned-pool size is enough to train (and the pool is then not much larger).
TEST(EngineTest, PlannedPinnedPoolIsEnough) {
  for (int stage : {1, 2, 3}) {
    for (const char* where : {"cpu", "nvme", "cpu@0.5"}) {
      SCOPED_TRACE(fmt::format("stage {} offload {}", stage, where));
      const bool partial = std::string(where) == "cpu@0.5";
      ToyRun::Options o;
      o.layers = 3;
      o.width = 96;
      o.steps = 3;
      o.config_json = partial ? ConfigJson(stage, "none", "cpu", "", R"(, "ratio": 0.5)")
                              : ConfigJson(stage, stage == 3 ? where : "none", where);
      auto config = ParseConfig(o.config_json, "<t>");
      ASSERT_TRUE(config.ok()) << config.status().ToString();
      auto probe_device = device::CreateDevice({});
      ASSERT_TRUE(probe_device.ok());
      testing::ToyModel probe(**probe_device, o.layers, o.width);
      auto bytes = Engine::PlanPinnedPoolBytes(probe.units(), *config, 1);
      ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
      o.pool_bytes = *bytes;
      ToyRun run;
      Status st = run.Setup(o);
      ASSERT_TRUE(st.ok()) << st.ToString();
      st = run.Train();
      EXPECT_TRUE(st.ok()) << st.ToString();
    }
  }
}

// With the overlapped CPU optimizer and one micro-batch a step, gradient shards stream through
// the pinned pool (allocated when they land, freed by their optimizer job): the planned pool
// holds four of the largest, not one per unit, and a run in exactly that pool gives the masters
// of the sequential optimizer, which holds every shard for the whole step.
TEST(EngineTest, GradientShardsStreamThroughThePool) {
  for (const char* where : {"cpu", "nvme"}) {
    SCOPED_TRACE(where);
    ToyRun::Options o;
    o.layers = 12;
    o.width = 512;
    o.steps = 3;
    o.config_json = ConfigJson(3, where, where);
    auto config = ParseConfig(o.config_json, "<t>");
    auto clipped = ParseConfig(ConfigJson(3, where, where, R"(, "gradient_clipping": 1e9)"), "<t>");
    auto accumulated = ParseConfig(o.config_json, "<t>");
    ASSERT_TRUE(config.ok() && clipped.ok() && accumulated.ok());
    for (Config* c : {&*config, &*clipped, &*accumulated}) {
      c->batch.train_micro_batch_size_per_gpu = o.samples_per_micro_batch;  // as ToyRun sets
      c->batch.gradient_accumulation_steps = 1;
    }
    accumulated->batch.gradient_accumulation_steps = 2;
    auto probe_device = device::CreateDevice({});
    ASSERT_TRUE(probe_device.ok());
    testing::ToyModel probe(**probe_device, o.layers, o.width);
    auto streamed = Engine::PlanPinnedPoolBytes(probe.units(), *config, 1);
    auto held = Engine::PlanPinnedPoolBytes(probe.units(), *clipped, 1);
    auto held_gas = Engine::PlanPinnedPoolBytes(probe.units(), *accumulated, 1);
    ASSERT_TRUE(streamed.ok() && held.ok() && held_gas.ok()) << streamed.status().ToString();
    // Every unit's gradient shard held, against four streamed: the pool is smaller by at least
    // eight of them (with the 25% margin).
    const uint64_t unit_grad = 4 * static_cast<uint64_t>(probe.units()[1].params[0].numel());
    EXPECT_GE(*held - *streamed, 8 * unit_grad) << *held << " vs " << *streamed;
    EXPECT_EQ(*held_gas, *held) << "accumulation holds every shard";
    o.pool_bytes = *streamed;
    const auto stream_run = TrainAndGetMasters(o);
    o.overlap_optimizer = false;
    o.pool_bytes = *held;
    const auto sequential = TrainAndGetMasters(o);
    ASSERT_FALSE(stream_run.empty());
    EXPECT_EQ(MaxRelDiff(stream_run, sequential), 0.0);
  }
}

TEST(EngineTest, MissingPoolOrPathIsAClearError) {
  ToyRun::Options o;
  o.config_json = ConfigJson(3, "nvme", "nvme");
  ToyRun run;
  o.pool_bytes = 4096;  // far too small for the states
  Status st = run.Setup(o);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("pinned pool"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace strata::zero

namespace strata::zero {
namespace {

// Parameters homed on NVMe are cached in device memory only as far as the prefetch scheduler
// looks ahead (stage3_prefetch_bucket_size) plus the units in use: the tier manager's device
// peak stays within that budget, which is well below the whole partition, and the results are
// those of an unoffloaded run.
TEST(EngineTest, OffloadedParametersUseOnlyThePrefetchBudgetOnTheDevice) {
  ToyRun::Options o;
  o.layers = 8;
  o.width = 64;
  o.steps = 4;
  o.config_json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1,
        "stage3_param_persistence_threshold": 0, "sub_group_size": 4096,
        "offload_param": {"device": "nvme", "nvme_path": "@NVME@"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "@NVME@"}}})";
  ToyRun run;
  Status st = run.Setup(o);
  ASSERT_TRUE(st.ok()) << st.ToString();
  {
    const Status trained = run.Train();
    ASSERT_TRUE(trained.ok()) << trained.ToString();
  }
  const EngineStats stats = run.engine->stats();
  uint64_t all_shards = 0;
  for (const auto& l : run.engine->layouts()) all_shards += static_cast<uint64_t>(l.shard_numel) * 4;
  EXPECT_GT(stats.param_device_peak_bytes, 0u);
  EXPECT_LE(stats.param_device_peak_bytes, stats.param_device_budget_bytes);
  EXPECT_LT(stats.param_device_budget_bytes, all_shards);
  o.config_json = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "zero_optimization": {"stage": 0}})";
  auto reference = TrainAndGetMasters(o);
  auto masters = run.Masters();
  ASSERT_TRUE(masters.ok());
  EXPECT_EQ(*masters, reference);
}

}  // namespace
}  // namespace strata::zero
