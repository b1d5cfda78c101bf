// Partitioned training matches unpartitioned training, with the ranks as threads of this process:
// the checks of engine_mpi_test.cc (which stays, under mpirun) as ordinary unit tests. Each test
// starts an in-process world (comm/in_process_collective.h) of 2 or 4 ranks; every rank is a
// thread with its own CPU device, built through the composition root (train/runtime.h) as
// `strata train` builds a rank, and trains the toy model for 12 steps on its part of the global
// batch. The final fp32 master weights of every rank must equal, bit for bit, those of one
// unpartitioned (stage 0) run on one rank over the same global batch (its micro-batches
// accumulated in the order of the ranks).
//
// Why bit for bit: the in-process backend reduces exactly as the MPI backend does (every element
// summed over the ranks in rank order, in fp32, rounded once), and the stage-0 reference
// accumulates the micro-batches' gradients in that same order, scaled by the same 1 / (ranks x
// micro-batches). Gradient clipping is off here: with it, the global norm is summed per rank and
// rounded to fp32 for the all-reduce, which moves the clipping factor by an ulp — the MPI tests
// keep a tolerance for that, and ClippedRunsMatchWithinTheMpiTolerance below runs that case.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>
#include <thread>
#include <utility>

#include "comm/in_process_collective.h"
#include "device/device_wrapper.h"
#include "toy_model.h"

namespace strata::zero {
namespace {

using testing::MaxRelDiff;
using testing::ToyRun;

constexpr int kSteps = 12;
using Masters = std::vector<std::vector<float>>;

// `where` as in engine_mpi_test.cc: "none", "cpu" or "nvme" for both homes; "cpu@R" / "nvme@R"
// for the optimizer states only, with offload_optimizer.ratio R. `top` goes at the top level
// (gradient clipping, strata.freeze).
std::string ConfigJson(int stage, const std::string& where, const std::string& zero_extra = "",
                       const std::string& top = "") {
  const size_t at = where.find('@');
  const std::string home = where.substr(0, at);
  const std::string ratio =
      at == std::string::npos ? "" : fmt::format(R"(, "ratio": {})", where.substr(at + 1));
  return testing::ToyConfigJson(
      stage, ratio.empty() && stage == 3 ? home : "none", home,
      R"(, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0)" + zero_extra, top,
      ratio);
}

struct RankResult {
  Status status;
  Masters masters;
  std::vector<double> losses;
  // The bytes the rank sent over the whole run, per phase (comm/topology.h).
  std::array<comm::Traffic, comm::kTrafficPhases> traffic{};
  EngineStats stats;  // at the end of the run
};

// Trains `o` on a world of `world` ranks, one thread each, and returns every rank's outcome.
std::vector<RankResult> TrainRanks(int world, const ToyRun::Options& o) {
  std::vector<RankResult> out(static_cast<size_t>(world));
  auto made = comm::InProcessWorld::Create({.world_size = world, .timeout = o.comm_timeout});
  if (!made.ok()) {
    for (auto& r : out)
      r.status = made.status();
    return out;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r, w = *made] {
      RankResult& result = out[static_cast<size_t>(r)];
      ToyRun run;
      ToyRun::Options mine = o;
      mine.world = w;
      mine.rank = r;
      result.status = run.Setup(mine);
      if (result.status.ok()) result.status = run.Train();
      if (result.status.ok()) {
        Result<Masters> m = run.Masters();
        result.status = m.status();
        if (m.ok()) result.masters = std::move(*m);
      }
      for (const StepResult& s : run.results)
        result.losses.push_back(s.loss);
      if (run.engine) {
        result.traffic = run.engine->stats().traffic;
        result.stats = run.engine->stats();
      }
    });
  }
  for (auto& t : threads)
    t.join();
  return out;
}

// One rank, stage 0, the global batch of `world` ranks as that many micro-batches.
Masters Reference(int world, const std::string& top = "") {
  ToyRun run;
  ToyRun::Options o;
  o.config_json = ConfigJson(0, "none", "", top);
  o.accumulation = world;
  o.steps = kSteps;
  Status st = run.Setup(o);
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (st.ok()) st = run.Train();
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto m = run.Masters();
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : Masters{};
}

// The references, computed once per world size (and top-level config) in this process.
const Masters& ReferenceFor(int world, const std::string& top = "") {
  static std::map<std::pair<int, std::string>, Masters>* cache =
      new std::map<std::pair<int, std::string>, Masters>();
  auto it = cache->find({world, top});
  if (it == cache->end()) it = cache->emplace(std::pair{world, top}, Reference(world, top)).first;
  return it->second;
}

// Trains the configuration on `world` ranks; every rank must succeed, see a falling loss, and
// end with the reference's master weights (bit for bit, or within `tolerance` when it is > 0).
void Check(int world, int stage, const std::string& where, const std::string& zero_extra = "",
           const std::string& top = "", double tolerance = 0.0) {
  SCOPED_TRACE(
      fmt::format("world {} stage {} offload {}{}{}", world, stage, where, zero_extra, top));
  const Masters& reference = ReferenceFor(world, top);
  ASSERT_FALSE(reference.empty());
  ToyRun::Options o;
  o.config_json = ConfigJson(stage, where, zero_extra, top);
  o.steps = kSteps;
  const std::vector<RankResult> ranks = TrainRanks(world, o);
  for (int r = 0; r < world; ++r) {
    const RankResult& got = ranks[static_cast<size_t>(r)];
    ASSERT_TRUE(got.status.ok()) << "rank " << r << ": " << got.status.ToString();
    const double diff = MaxRelDiff(got.masters, reference);
    if (tolerance == 0.0) {
      EXPECT_EQ(diff, 0.0) << "rank " << r << " differs from the unpartitioned run";
    } else {
      EXPECT_LE(diff, tolerance) << "rank " << r;
      if (r == 0) {
        std::printf(
            "[ world %d stage %d offload %s ] max relative difference to the "
            "unpartitioned run: %.3g\n",
            world, stage, where.c_str(), diff);
      }
    }
    EXPECT_EQ(got.masters, ranks[0].masters) << "rank " << r << " differs from rank 0";
    ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(got.losses, ranks[0].losses) << "rank " << r << " saw another loss";
    EXPECT_LT(got.losses.back(), got.losses.front());
  }
}

class InProcessEquivalenceTest : public ::testing::TestWithParam<int> {
 protected:
  int world() const { return GetParam(); }
};

TEST_P(InProcessEquivalenceTest, Stage1NoOffload) {
  Check(world(), 1, "none");
}
TEST_P(InProcessEquivalenceTest, Stage1CpuOffload) {
  Check(world(), 1, "cpu");
}
TEST_P(InProcessEquivalenceTest, Stage1NvmeOffload) {
  Check(world(), 1, "nvme");
}
TEST_P(InProcessEquivalenceTest, Stage2NoOffload) {
  Check(world(), 2, "none");
}
TEST_P(InProcessEquivalenceTest, Stage2CpuOffload) {
  Check(world(), 2, "cpu");
}
TEST_P(InProcessEquivalenceTest, Stage2NvmeOffload) {
  Check(world(), 2, "nvme");
}
TEST_P(InProcessEquivalenceTest, Stage3NoOffload) {
  Check(world(), 3, "none");
}
TEST_P(InProcessEquivalenceTest, Stage3CpuOffload) {
  Check(world(), 3, "cpu");
}
TEST_P(InProcessEquivalenceTest, Stage3NvmeOffload) {
  Check(world(), 3, "nvme");
}
// Partial optimizer offload: the first units on the device optimizer, the rest on the CPU one.
TEST_P(InProcessEquivalenceTest, Stage1HalfOffloaded) {
  Check(world(), 1, "cpu@0.5");
}
TEST_P(InProcessEquivalenceTest, Stage2HalfOffloaded) {
  Check(world(), 2, "nvme@0.5");
}
TEST_P(InProcessEquivalenceTest, Stage3HalfOffloaded) {
  Check(world(), 3, "cpu@0.5");
}
// Reduction buckets of one unit per rank, two units, and none at all.
TEST_P(InProcessEquivalenceTest, Stage2OneUnitBucket) {
  Check(world(), 2, "cpu", fmt::format(R"(, "reduce_bucket_size": {})", 2048 * world()));
}
TEST_P(InProcessEquivalenceTest, Stage3TwoUnitBucket) {
  Check(world(), 3, "nvme", fmt::format(R"(, "reduce_bucket_size": {})", 4096 * world()));
}
TEST_P(InProcessEquivalenceTest, Stage3NoBucket) {
  Check(world(), 3, "none", R"(, "reduce_bucket_size": 1)");
}
// Frozen units (strata.freeze, the base weights of a LoRA fine-tune, whose adapters are units of
// their own): they keep their weights and the others train, at each stage, with the optimizer
// states on the device, partly offloaded, and on NVMe.
TEST_P(InProcessEquivalenceTest, FrozenUnitsAtEveryStage) {
  const std::string freeze = R"(, "strata": {"freeze": ["layer.1.*", "head.*"]})";
  Check(world(), 1, "none", "", freeze);
  Check(world(), 2, "cpu@0.5", "", freeze);
  Check(world(), 3, "nvme", "", freeze);
}
// With gradient clipping the norm is summed per rank and rounded to fp32 (see the top): the MPI
// tests' tolerance, and still the same bits on every rank.
TEST_P(InProcessEquivalenceTest, ClippedRunsMatchWithinTheMpiTolerance) {
  Check(world(), 3, "nvme", "", R"(, "gradient_clipping": 1.0)", 2e-4);
}

std::string RanksName(const ::testing::TestParamInfo<int>& param_info) {
  return fmt::format("{}Ranks", param_info.param);
}

INSTANTIATE_TEST_SUITE_P(Ranks, InProcessEquivalenceTest, ::testing::Values(2, 4), RanksName);

// ---- ZeRO++ ------------------------------------------------------------------------------------

// The forward gathers' bytes over the whole run (what qwZ shrinks), summed within and across nodes.
uint64_t ForwardGatherBytes(const RankResult& r) {
  const comm::Traffic& t = r.traffic[static_cast<size_t>(comm::TrafficPhase::kForwardGather)];
  return t.intra_bytes + t.inter_bytes;
}

TEST(InProcessZeroPlusPlusTest, QuantizedWeightsTrainLikePlainStage3WithHalfTheGatherBytes) {
  // 4 ranks as 2 nodes x 2, stage 3 with parameters on NVMe, 50 steps, bf16 compute (the 16-bit
  // all-gather qwZ replaces). Every rank sees the same dequantized weights, so the ranks agree
  // bit for bit; the run follows plain stage 3 within the quantization error; and its forward
  // gathers move (1 + 4 / 2048) / 2 of the bytes.
  constexpr int kWorld = 4;
  constexpr int kLongSteps = 50;
  ToyRun::Options o;
  o.steps = kLongSteps;
  o.ranks_per_node = 2;
  const std::string bf16 = R"(, "bf16": {"enabled": true})";
  o.config_json = ConfigJson(3, "nvme", "", bf16);
  const std::vector<RankResult> plain = TrainRanks(kWorld, o);
  o.config_json = ConfigJson(3, "nvme", R"(, "zero_quantized_weights": true)", bf16);
  const std::vector<RankResult> qwz = TrainRanks(kWorld, o);
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const RankResult& p = plain[static_cast<size_t>(r)];
    const RankResult& q = qwz[static_cast<size_t>(r)];
    ASSERT_TRUE(p.status.ok()) << p.status.ToString();
    ASSERT_TRUE(q.status.ok()) << q.status.ToString();
    ASSERT_EQ(q.losses.size(), static_cast<size_t>(kLongSteps));
    EXPECT_EQ(q.losses, qwz[0].losses);
    EXPECT_EQ(q.masters, qwz[0].masters);
    const double gather_ratio =
        static_cast<double>(ForwardGatherBytes(q)) / static_cast<double>(ForwardGatherBytes(p));
    EXPECT_DOUBLE_EQ(gather_ratio, (1.0 + 4.0 / 2048.0) / 2.0);
  }
  double worst = 0.0;
  bool differs = false;
  for (int k = 0; k < kLongSteps; ++k) {
    const double a = plain[0].losses[static_cast<size_t>(k)];
    const double b = qwz[0].losses[static_cast<size_t>(k)];
    worst = std::max(worst, std::abs(a - b) / std::abs(a));
    differs = differs || a != b;
  }
  std::printf("[ qwZ, 4 ranks, 50 steps ] worst relative loss difference to plain stage 3: %.3g; "
              "loss %.4f -> %.4f (plain %.4f -> %.4f)\n",
              worst, qwz[0].losses.front(), qwz[0].losses.back(), plain[0].losses.front(),
              plain[0].losses.back());
  EXPECT_TRUE(differs) << "the quantized run gave plain stage 3's losses: was qwZ on?";
  EXPECT_LE(worst, 0.02);
  EXPECT_LT(qwz[0].losses.back(), 0.5 * qwz[0].losses.front());
}

TEST(InProcessZeroPlusPlusTest, TrafficIsCountedWithinAndAcrossNodes) {
  // 4 ranks as 2 nodes x 2 against 4 ranks on one node: the same bytes, split differently. A rank
  // has 1 peer on its node and 2 on the other: a third of a gather stays within the node.
  ToyRun::Options o;
  o.steps = 2;
  o.config_json = ConfigJson(3, "none");
  const std::vector<RankResult> one_node = TrainRanks(4, o);
  o.ranks_per_node = 2;
  const std::vector<RankResult> two_nodes = TrainRanks(4, o);
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(one_node[static_cast<size_t>(r)].status.ok());
    ASSERT_TRUE(two_nodes[static_cast<size_t>(r)].status.ok());
    for (const auto phase : {comm::TrafficPhase::kForwardGather,
                             comm::TrafficPhase::kBackwardGather, comm::TrafficPhase::kReduce}) {
      const comm::Traffic a = one_node[static_cast<size_t>(r)].traffic[static_cast<size_t>(phase)];
      const comm::Traffic b =
          two_nodes[static_cast<size_t>(r)].traffic[static_cast<size_t>(phase)];
      EXPECT_GT(a.intra_bytes, 0u) << comm::TrafficPhaseName(phase);
      EXPECT_EQ(a.inter_bytes, 0u) << comm::TrafficPhaseName(phase);
      EXPECT_EQ(b.intra_bytes + b.inter_bytes, a.intra_bytes) << comm::TrafficPhaseName(phase);
      EXPECT_EQ(2 * b.intra_bytes, b.inter_bytes) << comm::TrafficPhaseName(phase);
    }
  }
}

uint64_t InterBytes(const RankResult& r, comm::TrafficPhase phase) {
  return r.traffic[static_cast<size_t>(phase)].inter_bytes;
}
uint64_t AllInterBytes(const RankResult& r) {
  uint64_t total = 0;
  for (const comm::Traffic& t : r.traffic) total += t.inter_bytes;
  return total;
}

// The worst relative difference between two runs' losses, step by step.
double WorstLossDifference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
    worst = std::max(worst, std::abs(a[k] - b[k]) / std::abs(a[k]));
  }
  return worst;
}

TEST(InProcessZeroPlusPlusTest, HpzBackwardGathersStayWithinTheNodeAndGiveTheSameBits) {
  // 4 ranks as 2 nodes x 2, stage 3 with parameters on NVMe, 50 steps. hpZ gathers the very
  // bytes plain stage 3 gathers, only from the node's secondary copies in backward: the same
  // losses and weights bit for bit, and backward's gathers never leave the node.
  constexpr int kWorld = 4;
  ToyRun::Options o;
  o.steps = 50;
  o.ranks_per_node = 2;
  o.config_json = ConfigJson(3, "nvme");
  const std::vector<RankResult> plain = TrainRanks(kWorld, o);
  o.config_json = ConfigJson(3, "nvme", R"(, "zero_hpz_partition_size": 2)");
  const std::vector<RankResult> hpz = TrainRanks(kWorld, o);
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const RankResult& p = plain[static_cast<size_t>(r)];
    const RankResult& h = hpz[static_cast<size_t>(r)];
    ASSERT_TRUE(p.status.ok()) << p.status.ToString();
    ASSERT_TRUE(h.status.ok()) << h.status.ToString();
    EXPECT_EQ(h.losses, p.losses);
    EXPECT_EQ(h.masters, p.masters);
    const comm::Traffic& back = h.traffic[static_cast<size_t>(comm::TrafficPhase::kBackwardGather)];
    EXPECT_EQ(back.inter_bytes, 0u);
    EXPECT_GT(back.intra_bytes, 0u);
    EXPECT_GT(InterBytes(p, comm::TrafficPhase::kBackwardGather), 0u);
    EXPECT_EQ(ForwardGatherBytes(h), ForwardGatherBytes(p));
  }
  // With qwZ the secondary copy holds forward's dequantized values, which plain qwZ's backward
  // gathers again: the same bits too (bf16, where qwZ applies).
  const std::string bf16 = R"(, "bf16": {"enabled": true})";
  o.steps = 4;
  o.config_json = ConfigJson(3, "nvme", R"(, "zero_quantized_weights": true)", bf16);
  const std::vector<RankResult> qwz = TrainRanks(kWorld, o);
  o.config_json = ConfigJson(
      3, "nvme", R"(, "zero_quantized_weights": true, "zero_hpz_partition_size": 2)", bf16);
  const std::vector<RankResult> both = TrainRanks(kWorld, o);
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(fmt::format("qwZ, rank {}", r));
    ASSERT_TRUE(both[static_cast<size_t>(r)].status.ok());
    EXPECT_EQ(both[static_cast<size_t>(r)].losses, qwz[static_cast<size_t>(r)].losses);
    EXPECT_EQ(both[static_cast<size_t>(r)].masters, qwz[static_cast<size_t>(r)].masters);
  }
}

TEST(InProcessZeroPlusPlusTest, HpzPartitionSizeMustBeTheRanksPerNode) {
  ToyRun::Options o;
  o.steps = 1;
  o.ranks_per_node = 2;
  o.config_json = ConfigJson(3, "none", R"(, "zero_hpz_partition_size": 4)");
  for (const RankResult& r : TrainRanks(4, o)) {
    EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument) << r.status.ToString();
    EXPECT_NE(r.status.message().find("zero_hpz_partition_size is 4"), std::string_view::npos)
        << r.status.ToString();
    EXPECT_NE(r.status.message().find("2 node(s) x 2 rank(s)"), std::string_view::npos)
        << r.status.ToString();
  }
  // One node of 4: every gather is within it already; the run is plain stage 3's.
  o.ranks_per_node = 0;
  o.steps = 3;
  const std::vector<RankResult> one_node = TrainRanks(4, o);
  o.config_json = ConfigJson(3, "none");
  const std::vector<RankResult> plain = TrainRanks(4, o);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(one_node[static_cast<size_t>(r)].status.ok())
        << one_node[static_cast<size_t>(r)].status.ToString();
    EXPECT_EQ(one_node[static_cast<size_t>(r)].losses, plain[static_cast<size_t>(r)].losses);
  }
}

TEST(InProcessZeroPlusPlusTest, QuantizedGradientsTrainLikePlainZeroWithAFractionOfTheBytes) {
  // 4 ranks as 2 nodes x 2, 50 steps, at stage 3 (parameters and optimizer on NVMe) and stage 2
  // (the optimizer on the CPU): every rank ends with the same weights, the losses follow plain
  // ZeRO's within the two quantizations' error, and the gradient reductions send an eighth of
  // the bytes across nodes (int8 partial sums of a node's 2 ranks against fp32 parts), plus the
  // scales.
  constexpr int kWorld = 4;
  constexpr int kLongSteps = 50;
  for (const auto& [stage, where] : {std::pair<int, std::string>{3, "nvme"}, {2, "cpu"}}) {
    SCOPED_TRACE(fmt::format("stage {}, {}", stage, where));
    ToyRun::Options o;
    o.steps = kLongSteps;
    o.ranks_per_node = 2;
    o.config_json = ConfigJson(stage, where);
    const std::vector<RankResult> plain = TrainRanks(kWorld, o);
    o.config_json = ConfigJson(stage, where, R"(, "zero_quantized_gradients": true)");
    const std::vector<RankResult> qgz = TrainRanks(kWorld, o);
    for (int r = 0; r < kWorld; ++r) {
      SCOPED_TRACE(fmt::format("rank {}", r));
      const RankResult& p = plain[static_cast<size_t>(r)];
      const RankResult& q = qgz[static_cast<size_t>(r)];
      ASSERT_TRUE(p.status.ok()) << p.status.ToString();
      ASSERT_TRUE(q.status.ok()) << q.status.ToString();
      ASSERT_EQ(q.losses.size(), static_cast<size_t>(kLongSteps));
      EXPECT_EQ(q.losses, qgz[0].losses);
      EXPECT_EQ(q.masters, qgz[0].masters);
      const double ratio = static_cast<double>(InterBytes(q, comm::TrafficPhase::kReduce)) /
                           static_cast<double>(InterBytes(p, comm::TrafficPhase::kReduce));
      EXPECT_GT(ratio, 0.0);
      EXPECT_LE(ratio, (1.0 + 4.0 / 2048.0) / 8.0);
    }
    const double worst = WorstLossDifference(plain[0].losses, qgz[0].losses);
    std::printf("[ qgZ, stage %d, 4 ranks, 50 steps ] worst relative loss difference to plain: "
                "%.3g; loss %.4f -> %.4f (plain %.4f -> %.4f)\n",
                stage, worst, qgz[0].losses.front(), qgz[0].losses.back(),
                plain[0].losses.front(), plain[0].losses.back());
    EXPECT_NE(qgz[0].losses, plain[0].losses) << "qgZ gave plain ZeRO's losses: was it on?";
    EXPECT_LE(worst, 0.02);
    EXPECT_LT(qgz[0].losses.back(), 0.5 * qgz[0].losses.front());
  }
}

TEST(InProcessZeroPlusPlusTest, AllThreeCutTheBytesAcrossNodesAndTrainLikePlainStage3) {
  // qwZ + hpZ + qgZ on 2 nodes x 2, stage 3, bf16, NVMe, 50 steps, against plain stage 3.
  constexpr int kWorld = 4;
  constexpr int kLongSteps = 50;
  ToyRun::Options o;
  o.steps = kLongSteps;
  o.ranks_per_node = 2;
  const std::string bf16 = R"(, "bf16": {"enabled": true})";
  o.config_json = ConfigJson(3, "nvme", "", bf16);
  const std::vector<RankResult> plain = TrainRanks(kWorld, o);
  o.config_json = ConfigJson(3, "nvme",
                             R"(, "zero_quantized_weights": true, "zero_hpz_partition_size": 2,)"
                             R"( "zero_quantized_gradients": true)",
                             bf16);
  const std::vector<RankResult> zpp = TrainRanks(kWorld, o);
  double ratio = 0.0;
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(plain[static_cast<size_t>(r)].status.ok());
    ASSERT_TRUE(zpp[static_cast<size_t>(r)].status.ok()) << zpp[static_cast<size_t>(r)].status.ToString();
    EXPECT_EQ(zpp[static_cast<size_t>(r)].masters, zpp[0].masters);
    EXPECT_EQ(InterBytes(zpp[static_cast<size_t>(r)], comm::TrafficPhase::kBackwardGather), 0u);
    ratio = static_cast<double>(AllInterBytes(zpp[static_cast<size_t>(r)])) /
            static_cast<double>(AllInterBytes(plain[static_cast<size_t>(r)]));
    EXPECT_LE(ratio, 0.3);
  }
  const double worst = WorstLossDifference(plain[0].losses, zpp[0].losses);
  std::printf("[ ZeRO++ (qwZ + hpZ + qgZ), 2 x 2, 50 steps ] bytes across nodes %.3f of plain "
              "stage 3's; worst relative loss difference %.3g; final loss %.4f (plain %.4f)\n",
              ratio, worst, zpp[0].losses.back(), plain[0].losses.back());
  EXPECT_LE(worst, 0.03);
}

TEST(InProcessZeroPlusPlusTest, TheEstimatePlansHpzCopiesAndQgzStaging) {
  // Engine::PlanMemory (strata estimate's inventory) lists hpZ's node-local copies as the engine
  // holds them at the end of forward, and qgZ's staging at its largest (planned at one rank per
  // node, which the plan cannot know); the run's own counts say what it held.
  constexpr int kWorld = 4;
  ToyRun::Options o;
  o.steps = 2;
  o.ranks_per_node = 2;
  const std::string hpz_json = ConfigJson(3, "none", R"(, "zero_hpz_partition_size": 2)");
  const std::string qgz_json = ConfigJson(3, "none", R"(, "zero_quantized_gradients": true)");
  auto planned = [&](const std::string& json, std::string_view what) -> uint64_t {
    Result<Config> config = ParseConfig(json, "<test config>");
    EXPECT_TRUE(config.ok()) << config.status().ToString();
    if (!config.ok()) return 0;
    config->batch.train_micro_batch_size_per_gpu = o.samples_per_micro_batch;
    device::DeviceOptions d;
    auto device = device::CreateDevice(d);
    EXPECT_TRUE(device.ok());
    if (!device.ok()) return 0;
    testing::ToyModel model(**device, o.layers, o.width);
    auto plan = Engine::PlanMemory(model.units(), {}, *config, kWorld);
    EXPECT_TRUE(plan.ok()) << plan.status().ToString();
    if (!plan.ok()) return 0;
    for (const auto* items : {&plan->device, &plan->device_step}) {
      for (const MemoryPlanItem& i : *items) {
        if (i.what.find(what) != std::string::npos) return i.bytes;
      }
    }
    ADD_FAILURE() << "the plan has no line '" << what << "'";
    return 0;
  };
  const uint64_t hpz_planned = planned(hpz_json, "hpZ node-local parameter copies");
  const uint64_t qgz_planned = planned(qgz_json, "qgZ staging");
  o.config_json = hpz_json;
  const std::vector<RankResult> hpz = TrainRanks(kWorld, o);
  o.config_json = qgz_json;
  const std::vector<RankResult> qgz = TrainRanks(kWorld, o);
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const RankResult& h = hpz[static_cast<size_t>(r)];
    const RankResult& q = qgz[static_cast<size_t>(r)];
    ASSERT_TRUE(h.status.ok()) << h.status.ToString();
    ASSERT_TRUE(q.status.ok()) << q.status.ToString();
    EXPECT_EQ(h.stats.hpz_copies_peak_bytes, hpz_planned);
    EXPECT_EQ(h.stats.qgz_staging_bytes, 0u);
    EXPECT_EQ(q.stats.hpz_copies_peak_bytes, 0u);
    EXPECT_GT(q.stats.qgz_staging_bytes, 0u);
    EXPECT_LE(q.stats.qgz_staging_bytes, qgz_planned);
  }
}

// A device whose allocations of exactly `refused` bytes fail (ResourceExhausted, as a full
// device's do).
class RefusingDevice final : public device::DeviceWrapper {
 public:
  RefusingDevice(std::unique_ptr<device::Device> inner, size_t refused)
      : DeviceWrapper(std::move(inner)), refused_(refused) {}
  Result<void*> Alloc(size_t bytes) override {
    if (bytes == refused_) return ResourceExhaustedError("the test's device refuses this size");
    return DeviceWrapper::Alloc(bytes);
  }

 private:
  const size_t refused_;
};

TEST(InProcessZeroPlusPlusTest, HpzCopiesThatDoNotFitNameHpzAndTheUnit) {
  // Every rank's device refuses the size of a unit's node-local copy (half a gathered unit):
  // the step fails with an error that says what could not be allocated, and why it was wanted.
  ToyRun::Options o;
  o.steps = 1;
  o.ranks_per_node = 2;
  o.config_json = ConfigJson(3, "none", R"(, "zero_hpz_partition_size": 2)");
  device::DeviceOptions d;
  Result<std::unique_ptr<device::Device>> probe = device::CreateDevice(d);
  ASSERT_TRUE(probe.ok());
  const testing::ToyModel probe_model(**probe, o.layers, o.width);
  Result<std::vector<UnitLayout>> layouts = LayoutModel(probe_model.units(), 4);
  ASSERT_TRUE(layouts.ok());
  const size_t copy_bytes = static_cast<size_t>(layouts->front().padded_numel()) / 2 * 4;
  o.wrap_device = [copy_bytes](std::unique_ptr<device::Device> inner) {
    return std::unique_ptr<device::Device>(
        std::make_unique<RefusingDevice>(std::move(inner), copy_bytes));
  };
  for (const RankResult& r : TrainRanks(4, o)) {
    EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted) << r.status.ToString();
    EXPECT_NE(r.status.message().find("hpZ (zero_optimization.zero_hpz_partition_size)"),
              std::string_view::npos)
        << r.status.ToString();
    EXPECT_NE(r.status.message().find("node-local copy"), std::string_view::npos)
        << r.status.ToString();
  }
}

TEST(InProcessZeroPlusPlusTest, AZeroPlusPlusRunResumesOnAnotherRankCount) {
  // Saved after 3 steps on 4 ranks (2 nodes x 2, all three features on), resumed on 2 ranks of
  // one node with the same config (hpZ then has nothing to do): every state comes back exactly,
  // and training goes on as the 4-rank run does, within the quantization error.
  const std::string config =
      ConfigJson(3, "nvme",
                 R"(, "zero_quantized_weights": true, "zero_hpz_partition_size": 2,)"
                 R"( "zero_quantized_gradients": true)",
                 R"(, "bf16": {"enabled": true})");
  testing::MemoryCheckpoint ck;
  std::vector<std::vector<double>> continued(4);
  std::vector<Masters> saved(4);
  {
    auto w = comm::InProcessWorld::Create({.world_size = 4});
    ASSERT_TRUE(w.ok());
    std::vector<std::thread> threads;
    std::vector<Status> st(4);
    for (int r = 0; r < 4; ++r) {
      threads.emplace_back([&, r] {
        ToyRun run;
        ToyRun::Options o;
        o.config_json = config;
        o.world = *w;
        o.rank = r;
        o.ranks_per_node = 2;
        o.samples_per_micro_batch = 2;  // the global batch of 8 the 2-rank run keeps
        st[r] = run.Setup(o);
        for (int s = 0; s < 3 && st[r].ok(); ++s) st[r] = run.Step(s);
        if (st[r].ok()) st[r] = ck.Save(*run.engine);
        if (r == 0) ck.counters = run.engine->counters();
        if (st[r].ok()) {
          auto m = run.Masters();
          st[r] = m.status();
          if (m.ok()) saved[r] = std::move(*m);
        }
        for (int s = 3; s < 6 && st[r].ok(); ++s) st[r] = run.Step(s);
        for (size_t k = 3; k < run.results.size(); ++k) continued[r].push_back(run.results[k].loss);
      });
    }
    for (auto& t : threads) t.join();
    for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  }
  auto w = comm::InProcessWorld::Create({.world_size = 2});
  ASSERT_TRUE(w.ok());
  std::vector<std::thread> threads;
  std::vector<Status> st(2);
  std::vector<std::vector<double>> resumed(2);
  std::vector<Masters> loaded(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ToyRun run;
      ToyRun::Options o;
      o.config_json = config;
      o.world = *w;
      o.rank = r;
      o.ranks_per_node = 2;
      o.samples_per_micro_batch = 4;
      o.initial = ck.Reader(true);
      st[r] = run.Setup(o);
      if (st[r].ok()) st[r] = run.engine->RestoreCounters(ck.counters);
      if (st[r].ok()) {
        auto m = run.Masters();
        st[r] = m.status();
        if (m.ok()) loaded[r] = std::move(*m);
      }
      for (int s = 3; s < 6 && st[r].ok(); ++s) st[r] = run.Step(s);
      for (const StepResult& res : run.results) resumed[r].push_back(res.loss);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(loaded[0], saved[0]);
  EXPECT_EQ(loaded[1], saved[0]);
  ASSERT_EQ(resumed[0].size(), 3u);
  EXPECT_EQ(resumed[0], resumed[1]);
  const double worst = WorstLossDifference(continued[0], resumed[0]);
  std::printf("[ ZeRO++ resume 4 -> 2 ranks ] worst relative loss difference over 3 steps: %.3g\n",
              worst);
  EXPECT_LE(worst, 0.02);
}

}  // namespace
}  // namespace strata::zero
