// Tensor parallelism through the ZeRO engine with the ranks as threads of this process, each
// with its own CPU device, in an in-process world (tensor_parallel_run.h says what is compared;
// tensor_parallel_mpi.cc runs the same under mpirun).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "comm/in_process_collective.h"
#include "tensor_parallel_run.h"
#include "test_support.h"

namespace strata::train {
namespace {

using model::LlamaConfig;
using testing::RankRun;
using testing::TinyConfig;

// Every rank of a world of `world` in-process ranks (one node).
std::vector<RankRun> Train(int world, int tp, const std::string& zero, bool lora,
                           const LlamaConfig& cfg = TinyConfig(), double clipping = 0.0) {
  std::vector<RankRun> out(static_cast<size_t>(world));
  auto made = comm::InProcessWorld::Create({.world_size = world});
  if (!made.ok()) {
    for (auto& r : out) r.status = made.status();
    return out;
  }
  strata::testing::TempDir dir;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r, w = *made] {
      RuntimeOptions ro;
      ro.launch = comm::LaunchInfo{
          .rank = r, .world_size = world, .local_rank = r, .local_size = world, .launcher = "test"};
      ro.make_collective = [&w, r](device::Device& d) { return w->Join(r, d); };
      ro.host_identity = "node0";
      out[static_cast<size_t>(r)] =
          testing::TrainRank(ro, world, tp, zero, lora, cfg, clipping, dir.path().string());
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// The tensor-parallel run against plain data parallelism on as many ranks.
void ExpectLikeDataParallel(int world, int tp, const std::string& zero, bool lora,
                            double clipping = 0.0) {
  const std::vector<RankRun> want = Train(world, 1, zero, lora, TinyConfig(), clipping);
  const std::vector<RankRun> got = Train(world, tp, zero, lora, TinyConfig(), clipping);
  for (size_t r = 0; r < got.size(); ++r) {
    testing::ExpectSliceOfDataParallel(want[0], got[r], tp, lora, fmt::format("rank {}", r));
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
