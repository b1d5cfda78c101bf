// strata_comm_dead_rank: what the survivors see when a rank dies in the middle of a sequence of
// collectives. Run under mpirun with 2 or more ranks (tests/comm/run_dead_rank.cmake does):
//
//   mpirun -n 4 --enable-recovery strata_comm_dead_rank --timeout-ms 3000 --mode kill
//
// Every rank runs --ops all-reduces (sum of the rank numbers) on the CPU device with the MPI
// backend and the given timeout. Rank 1 dies just before operation --die-at (1-based sequence
// number): --mode kill raises SIGKILL, --mode exit calls _exit(1) (no MPI_Finalize, no atexit),
// --mode leave returns from main normally (its MPI runtime says goodbye to the others, which then
// know at once that the ranks did not enqueue the same collectives).
// Each survivor checks its own error against the contract and prints one line:
//   "strata_comm_dead_rank: rank R: survivor OK: <error>"   or   "... survivor BAD: <why>: ..."
// The error must be DeadlineExceeded or Aborted, name rank 1 and "all-reduce #<die-at>", arrive
// within the timeout plus 2 s, and a later operation must fail at once with the same code.
// Exit codes: 3 for a survivor that saw a correct error, 4 for a wrong one, 5 when no error came.
//
// --mode mismatch: nobody dies; at op --die-at every rank runs a reduce-scatter and rank 1 gives
// it one element more per rank than the others (the ranks disagree on the operation's size).
// Every rank must fail (InvalidArgument, or Aborted because a peer reported its failure first),
// and prints "mismatch OK: <error>" (exit 3) or "mismatch BAD: ..." (exit 4).
//
// What mpirun itself does (Open MPI 4.1): without --enable-recovery it kills the survivors within
// about a second of the death and prints its own message, so they never print theirs; with it,
// the survivors run until Strata's timeout fails them. See tests/comm/CMakeLists.txt.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "strata/collective.h"
#include "strata/device.h"

namespace {

using strata::Status;
using strata::StatusCode;

struct Flags {
  int timeout_ms = 3000;
  int ops = 20;
  int die_at = 6;
  std::string mode = "kill";
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i + 1 >= argc) return false;
    const char* value = argv[++i];
    if (arg == "--timeout-ms") {
      flags->timeout_ms = std::atoi(value);
    } else if (arg == "--ops") {
      flags->ops = std::atoi(value);
    } else if (arg == "--die-at") {
      flags->die_at = std::atoi(value);
    } else if (arg == "--mode") {
      flags->mode = value;
    } else {
      return false;
    }
  }
  return flags->timeout_ms > 0 && flags->die_at >= 1 && flags->ops >= flags->die_at &&
         (flags->mode == "kill" || flags->mode == "exit" || flags->mode == "leave" ||
          flags->mode == "mismatch");
}

void Print(int rank, std::string_view line) {
  std::fprintf(stderr, "strata_comm_dead_rank: rank %d: %.*s\n", rank,
               static_cast<int>(line.size()), line.data());
  std::fflush(stderr);
}

int Fail(int rank, std::string_view what, const Status& status) {
  Print(rank, fmt::format("setup failed: {}: {}", what, status.ToString()));
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    std::fprintf(
        stderr,
        "usage: %s [--timeout-ms N] [--ops N] [--die-at N] [--mode kill|exit|leave|mismatch]\n",
        argv[0]);
    return 2;
  }
  const strata::comm::LaunchInfo launch = strata::comm::DetectLaunch();
  const int rank = launch.rank;
  if (launch.world_size < 2) {
    Print(rank, "run me under mpirun with at least 2 ranks");
    return 2;
  }

  strata::device::DeviceOptions device_options;
  device_options.memory_budget = uint64_t{64} << 20;
  auto device = strata::device::CreateDevice(device_options);
  if (!device.ok()) return Fail(rank, "CreateDevice", device.status());
  auto stream = (*device)->CreateStream("comm");
  if (!stream.ok()) return Fail(rank, "CreateStream", stream.status());
  strata::comm::CollectiveOptions options;
  options.backend = strata::comm::Backend::kMpi;
  options.timeout = std::chrono::milliseconds(flags.timeout_ms);
  auto collective = strata::comm::CreateCollective(**device, options);
  if (!collective.ok()) return Fail(rank, "CreateCollective", collective.status());

  constexpr size_t kCount = 4096;
  auto buffer = (*device)->Alloc(kCount * sizeof(float));
  if (!buffer.ok()) return Fail(rank, "Alloc", buffer.status());
  auto* data = static_cast<float*>(*buffer);
  const float expected = static_cast<float>(launch.world_size * (launch.world_size - 1) / 2);

  if (flags.mode == "mismatch") {
    for (int seq = 1; seq < flags.die_at; ++seq) {
      Status status = (*collective)
                          ->AllReduce(data, data, kCount, strata::device::DType::kF32,
                                      strata::comm::ReduceOp::kSum, **stream);
      if (status.ok()) status = (*device)->Synchronize(**stream);
      if (!status.ok()) return Fail(rank, fmt::format("op #{}", seq), status);
    }
    const size_t per_rank = kCount / static_cast<size_t>(launch.world_size) - 1 + (rank == 1);
    Status status =
        (*collective)
            ->ReduceScatter(data, data + static_cast<size_t>(rank) * per_rank, per_rank,
                            strata::device::DType::kF32, strata::comm::ReduceOp::kSum, **stream);
    if (status.ok()) status = (*device)->Synchronize(**stream);
    const bool own =
        status.code() == StatusCode::kInvalidArgument &&
        (status.message().find("disagree on the operation's size") != std::string_view::npos ||
         status.message().find("MPI_ERR_TRUNCATE") != std::string_view::npos ||
         status.message().find("truncat") != std::string_view::npos);
    const bool peer = status.code() == StatusCode::kAborted &&
                      status.message().find("reported a failure") != std::string_view::npos;
    Print(rank, fmt::format("mismatch {}: {}", own || peer ? "OK" : "BAD", status.ToString()));
    (*device)->Free(data);
    return own || peer ? 3 : 4;
  }

  int exit_code = 5;
  for (int seq = 1; seq <= flags.ops; ++seq) {
    if (rank == 1 && seq == flags.die_at) {
      Print(rank, fmt::format("dying ({}) before op #{}", flags.mode, seq));
      if (flags.mode == "kill") std::raise(SIGKILL);
      if (flags.mode == "exit") _exit(1);
      exit_code = 0;  // leave: stop taking part and exit through main
      break;
    }
    const auto start = std::chrono::steady_clock::now();
    Status status = (*device)->Fill(data, strata::device::DType::kF32, static_cast<float>(rank),
                                    kCount, **stream);
    if (status.ok()) {
      status = (*collective)
                   ->AllReduce(data, data, kCount, strata::device::DType::kF32,
                               strata::comm::ReduceOp::kSum, **stream);
    }
    if (status.ok()) status = (*device)->Synchronize(**stream);
    if (status.ok()) {
      if (data[0] != expected || data[kCount - 1] != expected) {
        Print(rank,
              fmt::format("survivor BAD: op #{} gave {}, expected {}", seq, data[0], expected));
        exit_code = 4;
        break;
      }
      continue;
    }

    // The failure: check it against the contract.
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<std::string> problems;
    if (status.code() != StatusCode::kDeadlineExceeded && status.code() != StatusCode::kAborted) {
      problems.push_back("code is neither DEADLINE_EXCEEDED nor ABORTED");
    }
    if (status.message().find("rank 1 (") == std::string_view::npos) {
      problems.push_back("the dead rank 1 is not named");
    }
    if (status.message().find(fmt::format("all-reduce #{}", flags.die_at)) ==
        std::string_view::npos) {
      problems.push_back(fmt::format("the operation all-reduce #{} is not named", flags.die_at));
    }
    if (seq != flags.die_at) problems.push_back(fmt::format("it failed at op #{}", seq));
    if (seconds > flags.timeout_ms / 1000.0 + 2.0) {
      problems.push_back(fmt::format("it took {:.2f} s", seconds));
    }
    // Every later operation fails at once, with the same error.
    const auto again_start = std::chrono::steady_clock::now();
    Status again = (*collective)
                       ->AllReduce(data, data, kCount, strata::device::DType::kF32,
                                   strata::comm::ReduceOp::kSum, **stream);
    if (again.ok()) again = (*device)->Synchronize(**stream);
    const double again_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - again_start).count();
    if (again.ok() || again.code() != status.code() || again_seconds > 0.5) {
      problems.push_back(fmt::format("the next operation gave {} after {:.2f} s", again.ToString(),
                                     again_seconds));
    }
    if (problems.empty()) {
      Print(rank,
            fmt::format("survivor OK: failed after {:.2f} s: {}", seconds, status.ToString()));
      exit_code = 3;
    } else {
      std::string why;
      for (const auto& p : problems)
        why += (why.empty() ? "" : "; ") + p;
      Print(rank, fmt::format("survivor BAD: {}: {}", why, status.ToString()));
      exit_code = 4;
    }
    break;
  }
  if (exit_code == 5) Print(rank, "survivor BAD: no operation failed");
  if (rank == 1 && exit_code == 0) Print(rank, "left early");
  (*device)->Free(data);
  stream->reset();
  collective->reset();
  device->reset();
  return exit_code;
}
