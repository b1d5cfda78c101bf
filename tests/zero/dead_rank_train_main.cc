// A rank that dies in the middle of a training step: the others' TrainStep fails within the
// collective timeout with an error naming the dead rank, and they exit instead of hanging.
//
//   mpirun -n 4 --enable-recovery strata_zero_dead_rank --timeout-ms 3000 --mode kill
//
// Every rank trains the toy model with ZeRO stage 3 and parameters and optimizer states on NVMe.
// In step 3, rank 1 dies (SIGKILL, or _exit(1) with --mode exit) while it enqueues the backward
// of the middle unit. Each survivor prints "survivor OK" when its step failed with an error that
// names rank 1, within the timeout plus 5 s, else "survivor BAD: <why>". tests/comm's
// run_dead_rank.cmake runs it and counts those lines (see tests/zero/CMakeLists.txt).
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <unistd.h>

#include "toy_model.h"

using namespace strata;

int main(int argc, char** argv) {
  int timeout_ms = 3000;
  std::string mode = "kill";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    if (flag == "--timeout-ms") {
      timeout_ms = std::atoi(argv[i + 1]);
    } else if (flag == "--mode") {
      mode = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: %s [--timeout-ms N] [--mode kill|exit]\n", argv[0]);
      return 2;
    }
  }
  zero::testing::ToyRun run;
  zero::testing::ToyRun::Options o;
  o.config_json = R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "@NVME@"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "@NVME@"},
      "stage3_param_persistence_threshold": 0}})";
  o.backend = comm::Backend::kAuto;
  o.comm_timeout = std::chrono::milliseconds(timeout_ms);
  Status st = run.Setup(o);
  if (!st.ok()) {
    std::printf("setup failed: %s\n", st.ToString().c_str());
    return 2;
  }
  const int rank = run.comm->rank();
  int64_t step = 0;
  run.model->on_backward = [&](int unit) {
    if (rank == 1 && step == 2 && unit == 1) {
      std::fflush(stdout);
      if (mode == "exit") _exit(1);
      std::raise(SIGKILL);
    }
  };
  for (; step < 2; ++step) {
    st = run.Step(step);
    if (!st.ok()) {
      std::printf("rank %d: step %lld failed before the death: %s\n", rank,
                  static_cast<long long>(step), st.ToString().c_str());
      return 2;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  st = run.Step(step);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string why;
  if (st.ok()) {
    why = "the step succeeded although rank 1 died";
  } else if (st.ToString().find("rank 1") == std::string::npos) {
    why = "the error does not name rank 1: " + st.ToString();
  } else if (seconds > timeout_ms / 1000.0 + 5.0) {
    why = "the error came after " + std::to_string(seconds) + " s";
  }
  if (why.empty()) {
    std::printf("rank %d: survivor OK after %.2f s: %s\n", rank, seconds, st.ToString().c_str());
  } else {
    std::printf("rank %d: survivor BAD: %s\n", rank, why.c_str());
  }
  std::fflush(stdout);
  return why.empty() ? 3 : 4;  // non-zero either way: the job lost a rank
}
