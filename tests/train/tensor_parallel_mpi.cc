// Tensor parallelism through the ZeRO engine under mpirun (ctest train_tensor_parallel_np4,
// label mpi): every process is a rank on the MPI backend, which runs every group's operations in
// one queue in enqueue order. The model enqueues its all-reduces when the engine calls it
// (DeferredOps), in program order with the engine's gathers and reductions on every rank; this is
// the test that it does. Each rank runs plain data parallelism on the 4 ranks, then TP = 2 x DP = 2
// and TP = 4, and compares its own results (tensor_parallel_run.h).
#include <gtest/gtest.h>

#include <string>

#include "tensor_parallel_run.h"
#include "test_support.h"

namespace strata::train {
namespace {

using testing::RankRun;
using testing::TinyConfig;

RankRun RunOnMpi(int tp, const std::string& zero, bool lora, double clipping,
                 const std::string& dir) {
  RuntimeOptions ro;
  ro.backend = comm::Backend::kMpi;
  return testing::TrainRank(ro, comm::DetectLaunch().world_size, tp, zero, lora, TinyConfig(),
                            clipping, dir);
}

class TensorParallelMpiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (comm::DetectLaunch().world_size != 4) GTEST_SKIP() << "needs mpirun -np 4";
  }
};

TEST_F(TensorParallelMpiTest, Tp2Dp2AndTp4TrainLikeDp4) {
  const int rank = comm::DetectLaunch().rank;
  strata::testing::TempDir dir;
  const std::string zero = R"("stage": 3, "stage3_param_persistence_threshold": 0,
      "offload_optimizer": {"device": "cpu"})";
  const RankRun want = RunOnMpi(1, zero, true, 0.05, dir.path().string());
  const RankRun tp2 = RunOnMpi(2, zero, true, 0.05, dir.path().string());
  testing::ExpectSliceOfDataParallel(want, tp2, 2, true, fmt::format("TP 2, rank {}", rank));
  const RankRun tp4 = RunOnMpi(4, zero, true, 0.05, dir.path().string());
  testing::ExpectSliceOfDataParallel(want, tp4, 4, true, fmt::format("TP 4, rank {}", rank));
}

}  // namespace
}  // namespace strata::train
