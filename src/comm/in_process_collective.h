// The in-process backend: a world of N ranks that are threads of one process, each with its own
// CPU device, whose collectives meet in shared memory. It exists so that everything multi-rank
// (the ZeRO engine's partitioned training, above all) runs as an ordinary unit test, without
// mpirun, and fails there with a debugger-friendly stack instead of a launcher's exit code.
//
//   auto world = InProcessWorld::Create({.world_size = 4});
//   // on rank r's thread, with rank r's own CPU device:
//   auto comm = (*world)->Join(r, *device);   // a Collective of rank r of 4
//
// Results are the MPI backend's, bit for bit: all-gathers and broadcasts copy bytes; reductions
// add every element over the ranks in rank order in fp32 and round once (ReduceInRankOrder in
// comm/op.h, the very function the MPI backend uses), kAvg scaling by AvgScale(world). The
// ordering contract is the MPI backend's too (mpi_runtime.h): an operation is enqueued as one
// host task on its stream, which starts after the stream's earlier work and blocks the stream
// until the operation is done; a rank's operations run strictly in the order they were enqueued
// (sequence numbers 1, 2, ... per rank), whatever streams they were enqueued on; operation k of
// every rank meets operation k of every other rank.
//
// How operation k runs, on rank r's stream thread:
//   1. wait until rank r's operation k - 1 is done;
//   2. arrive: publish the arguments, wait until every rank arrived at k;
//   3. check that the ranks agree on the operation (kind, count, dtype, op, root): if not,
//      every rank fails with InvalidArgument naming the first rank that disagrees;
//   4. compute rank r's result reading the other ranks' buffers (their CPU-device memory);
//   5. depart: wait until every rank has finished reading, so that no rank's stream moves on to
//      overwrite a buffer another rank still reads. (An in-place all-reduce computes into
//      scratch first and copies after the departure: the others read its buffer meanwhile.)
// The world's mutex orders each rank's writes of its inputs before the others' reads, and the
// reads before the writes that follow the operation, so ThreadSanitizer sees the same edges the
// algorithm relies on.
//
// Failures: a rank that does not arrive within `timeout` of the operation's start (on `clock`)
// fails it with DeadlineExceeded naming the operation, its sequence number and the ranks that did
// not arrive ("has not reached this operation: it completed #k"; "left the world" once its
// Collective was destroyed). The first failure of any rank — that, disagreeing ranks, an
// operation whose stream failed before reaching it (its host task skipped by the device's
// sticky error), a rank that left with the others waiting for it — is the world's failure:
// operations waiting in other ranks end at once with Aborted naming the rank that failed, and
// every later operation of every rank fails at enqueue with the world's failure.
//
// Threading: Create and Join from any thread; each Collective as strata/collective.h says. Every
// rank's device must be a CPU device (InvalidArgument otherwise: the ranks read each other's
// device memory). The world outlives its Collectives (each holds a reference).
#pragma once

#include <chrono>
#include <memory>

#include "common/clock.h"
#include "strata/collective.h"
#include "strata/status.h"

namespace strata::comm {

struct InProcessOptions {
  int world_size = 2;  // >= 1
  // How long an operation waits for the other ranks to arrive (and to finish reading its
  // buffers) before it fails with DeadlineExceeded.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Times the timeout; RealClock() when null. Must outlive the world.
  Clock* clock = nullptr;
};

class InProcessWorld {
 public:
  // InvalidArgument for a world size below 1 or a timeout that is not positive.
  static Result<std::shared_ptr<InProcessWorld>> Create(const InProcessOptions& options);
  ~InProcessWorld();
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  int world_size() const;

  // Rank `rank`'s Collective, on `device` (a CPU device, which must outlive it). Each rank joins
  // once: InvalidArgument for a rank out of range, a rank that joined already, or a device that
  // is not a CPU device.
  Result<std::unique_ptr<Collective>> Join(int rank, device::Device& device);

  // OK, or the world's first failure.
  Status failure() const;

  struct State;  // shared with the Collectives; in_process_collective.cc

 private:
  explicit InProcessWorld(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace strata::comm
