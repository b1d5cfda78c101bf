// Tensor parallelism through the ZeRO engine under mpirun (ctest train_tensor_parallel_np4,
// label mpi): every process is a rank on the MPI backend, which runs every group's operations in
// one queue in enqueue order. The model enqueues its all-reduces when the engine calls it
// (DeferredOps), in program order with the engine's gathers and reductions on every rank; this is
// the test that it does. Each rank runs plain data parallelism on the 4 ranks, then TP = 2 x DP = 2
// and TP = 4, and compares its own results (tensor_parallel_run.h).
//
// TensorParallelMpiGpuTest does the same on the CUDA device, one GPU per rank, with NCCL and its
// sub-communicators (the model's all-reduces on its stream, the vocabulary-parallel kernels). It
// needs 4 GPUs on the node and skips with fewer, saying how many there are.
#include <gtest/gtest.h>

#include <string>

#include "device/gpu_info.h"
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

// Each rank on its node's GPU of its local rank, over NCCL.
RankRun RunOnGpus(int tp, const std::string& zero, const std::string& dir) {
  RuntimeOptions ro;
  ro.device = DeviceKind::kCuda;
  return testing::TrainRank(ro, comm::DetectLaunch().world_size, tp, zero, false, TinyConfig(),
                            0.05, dir);
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

TEST(TensorParallelMpiGpuTest, Tp2Dp2AndTp4TrainLikeDp4OnGpus) {
  const comm::LaunchInfo launch = comm::DetectLaunch();
  if (launch.world_size != 4) GTEST_SKIP() << "needs mpirun -np 4";
  const device::GpuReport gpus = device::QueryGpus();
  if (gpus.gpus.size() < 4) {
    GTEST_SKIP() << "tensor parallelism on GPUs needs a GPU per rank: 4 ranks, " << gpus.gpus.size()
                 << " GPU(s) here"
                 << (gpus.none_reason.empty() ? "" : " (" + gpus.none_reason + ")");
  }
  strata::testing::TempDir dir;
  const std::string zero = R"("stage": 3, "stage3_param_persistence_threshold": 0)";
  const RankRun want = RunOnGpus(1, zero, dir.path().string());
  const RankRun tp2 = RunOnGpus(2, zero, dir.path().string());
  testing::ExpectSliceOfDataParallel(want, tp2, 2, false,
                                     fmt::format("GPU TP 2, rank {}", launch.rank));
  const RankRun tp4 = RunOnGpus(4, zero, dir.path().string());
  testing::ExpectSliceOfDataParallel(want, tp4, 4, false,
                                     fmt::format("GPU TP 4, rank {}", launch.rank));
}

}  // namespace
}  // namespace strata::train
