// Partitioned training matches unpartitioned training. Runs under `mpirun -np 2` and `-np 4`
// (ctest label mpi). Every rank trains the toy model for 12 steps with each stage (1, 2, 3) and
// each home of the states (device, cpu, nvme: parameters and optimizer), and compares the final
// fp32 master weights with a single-process, unpartitioned (stage 0) run over the same global
// batch, which each rank computes by itself with the single-rank collective.
//
// Tolerances: the distributed runs sum each gradient over ranks in a different order than the
// reference sums it over micro-batches, so results differ by fp32 rounding (~1e-7 relative per
// gradient), which Adam's normalisation can enlarge for elements whose gradients are tiny.
// Measured worst case on the development machine: 6e-6 with 2 ranks, 1e-5 with 4. Runs with the same world size do identical arithmetic
// whatever the stage and the homes, so those must agree bit for bit.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "toy_model.h"

namespace strata::zero {
namespace {

using testing::MaxRelDiff;
using testing::ToyRun;

// Largest relative difference (|a-b| / (|b| + 1e-3)) allowed between the partitioned runs and
// the unpartitioned reference after 12 AdamW steps.
constexpr double kTolerance = 2e-4;
constexpr int kSteps = 12;

// `where`: "none", "cpu" or "nvme" for both homes; "cpu@R" / "nvme@R" for the optimizer states
// only, with offload_optimizer.ratio R (partial offload; parameters stay on the device).
std::string ConfigJson(int stage, const std::string& where, const std::string& extra = "") {
  std::string zero = fmt::format(R"("stage": {})", stage);
  const size_t at = where.find('@');
  const std::string home = where.substr(0, at);
  const std::string ratio =
      at == std::string::npos ? "" : fmt::format(R"(, "ratio": {})", where.substr(at + 1));
  if (stage == 3 && home != "none" && ratio.empty()) {
    zero += fmt::format(R"(, "offload_param": {{"device": "{}", "nvme_path": "@NVME@"}})", home);
  }
  if (stage >= 1 && home != "none") {
    zero += fmt::format(R"(, "offload_optimizer": {{"device": "{}", "nvme_path": "@NVME@"{}}})",
                        home, ratio);
  }
  zero += R"(, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0)" + extra;
  return fmt::format(
      R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.01}}}},
          "gradient_clipping": 1.0, "zero_optimization": {{{}}}}})",
      zero);
}

class EngineMpiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The reference: one process, no partitioning, the whole global batch as micro-batches.
    const comm::LaunchInfo launch = comm::DetectLaunch();
    world_ = launch.world_size;
    ToyRun run;
    ToyRun::Options o;
    o.config_json = ConfigJson(0, "none");
    o.backend = comm::Backend::kSingle;
    o.accumulation = world_;
    o.steps = kSteps;
    Status st = run.Setup(o);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = run.Train();
    ASSERT_TRUE(st.ok()) << st.ToString();
    auto m = run.Masters();
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    reference_ = new std::vector<std::vector<float>>(std::move(*m));
  }
  static void TearDownTestSuite() {
    delete reference_;
    reference_ = nullptr;
    delete first_;
    first_ = nullptr;
  }

  void Check(int stage, const std::string& where, const std::string& extra = "") {
    ASSERT_NE(reference_, nullptr);
    ToyRun run;
    ToyRun::Options o;
    o.config_json = ConfigJson(stage, where, extra);
    o.backend = comm::Backend::kAuto;
    o.steps = kSteps;
    Status st = run.Setup(o);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_EQ(run.comm->world_size(), world_) << "run this test under mpirun";
    st = run.Train();
    ASSERT_TRUE(st.ok()) << st.ToString();
    auto m = run.Masters();
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const double diff = MaxRelDiff(*m, *reference_);
    EXPECT_LE(diff, kTolerance) << "stage " << stage << " offload " << where;
    if (run.comm->rank() == 0) {
      fmt::print("[ world {} stage {} offload {:4} ] max relative difference to the "
                 "unpartitioned run: {:.3g}\n",
                 world_, stage, where, diff);
    }
    // Same world size, same arithmetic: bit-identical whatever the stage and the homes.
    if (first_ == nullptr) {
      first_ = new std::vector<std::vector<float>>(*m);
    } else {
      EXPECT_EQ(MaxRelDiff(*m, *first_), 0.0) << "stage " << stage << " offload " << where;
    }
    // The loss is the same on every rank and falls.
    EXPECT_LT(run.results.back().loss, run.results.front().loss);
  }

  static int world_;
  static std::vector<std::vector<float>>* reference_;
  static std::vector<std::vector<float>>* first_;
};

int EngineMpiTest::world_ = 1;
std::vector<std::vector<float>>* EngineMpiTest::reference_ = nullptr;
std::vector<std::vector<float>>* EngineMpiTest::first_ = nullptr;

TEST_F(EngineMpiTest, Stage1NoOffload) { Check(1, "none"); }
TEST_F(EngineMpiTest, Stage1CpuOffload) { Check(1, "cpu"); }
TEST_F(EngineMpiTest, Stage1NvmeOffload) { Check(1, "nvme"); }
TEST_F(EngineMpiTest, Stage2NoOffload) { Check(2, "none"); }
TEST_F(EngineMpiTest, Stage2CpuOffload) { Check(2, "cpu"); }
TEST_F(EngineMpiTest, Stage2NvmeOffload) { Check(2, "nvme"); }
TEST_F(EngineMpiTest, Stage3NoOffload) { Check(3, "none"); }
TEST_F(EngineMpiTest, Stage3CpuOffload) { Check(3, "cpu"); }
TEST_F(EngineMpiTest, Stage3NvmeOffload) { Check(3, "nvme"); }
// Partial optimizer offload: the first half of the units on the device optimizer, the rest on
// the CPU one, in the same step.
TEST_F(EngineMpiTest, Stage1HalfOffloaded) { Check(1, "cpu@0.5"); }
TEST_F(EngineMpiTest, Stage2HalfOffloaded) { Check(2, "nvme@0.5"); }
TEST_F(EngineMpiTest, Stage3HalfOffloaded) { Check(3, "cpu@0.5"); }
// Reduction buckets: the default (5e8 elements) holds every unit of the toy model, so the tests
// above without a CPU optimizer reduce one bucket per micro-batch (with the overlapped CPU
// optimizer the engine caps it at a quarter of the shard: several buckets). Here: a bucket of one unit per rank (flushed per
// unit), two units, and none at all (every unit reduced on its own) — the same bits each time.
TEST_F(EngineMpiTest, Stage2OneUnitBucket) {
  Check(2, "cpu", fmt::format(R"(, "reduce_bucket_size": {})", 2048 * world_));
}
TEST_F(EngineMpiTest, Stage3TwoUnitBucket) {
  Check(3, "nvme", fmt::format(R"(, "reduce_bucket_size": {})", 4096 * world_));
}
TEST_F(EngineMpiTest, Stage3NoBucket) { Check(3, "none", R"(, "reduce_bucket_size": 1)"); }

}  // namespace
}  // namespace strata::zero
