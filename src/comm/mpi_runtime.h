// The process's MPI runtime: one thread that makes every MPI call of the process, runs the
// collective operations of every MPI Collective (and the NCCL backend's id broadcast) one at a
// time in the order they were submitted, and watches the other ranks with heartbeats.
//
// Why one thread: every rank must run the same sequence of MPI collectives. Submitting them to
// one FIFO, in the order the callers enqueued them, gives that sequence by construction, whatever
// streams, threads and Collective objects they came from; and MPI only needs
// MPI_THREAD_FUNNELED (that thread calls MPI_Init_thread and MPI_Finalize too).
//
// How an operation meets its stream (MpiRuntime::Submit): at enqueue the operation is given the
// next sequence number and queued here, and two items go onto its stream:
//   1. a HostTask that marks the operation ready (the stream's earlier work has completed, so its
//      buffers hold their inputs) and then blocks the stream until the operation is done; its
//      Status (the operation's result) becomes the device's sticky error on failure;
//   2. a Notify that cancels the operation if the HostTask never ran (the device skips host tasks
//      after a sticky error), so that the MPI thread does not wait for it forever.
// The MPI thread takes operations strictly in sequence order: it waits until the first one is
// ready, runs it, completes it, then looks at the next. So the operation starts after the
// stream's earlier work, later work on the stream waits for it (the HostTask blocks), and
// operations on different streams run in enqueue order. A consequence (as with NCCL): an
// operation must not depend, through events, on work enqueued after a later operation.
//
// Reductions: point-to-point exchanges (each rank sends every peer that peer's part) and a sum in
// rank order on the receiving rank, not MPI's reduce-scatter (docs/comm.md says why).
//
// Timeouts and dead peers: every MPI call is non-blocking (MPI_Iallgather, MPI_Isend, ...) and
// polled with MPI_Test / MPI_Testall. Between polls the thread exchanges heartbeats with every
// other rank on a private duplicated communicator (small MPI_Isend / MPI_Irecv, at most one send in
// flight per peer), carrying the sequence numbers of the operation it last started and completed
// and whether its runtime failed or is shutting down. A call that makes no progress for the
// operation's timeout fails with DeadlineExceeded naming the operation, its sequence number and,
// from the heartbeats, the ranks it waits for: silent ones ("dead or hung") and live ones that have
// not reached it. A peer whose heartbeat says it failed or shut down makes the operation fail at
// once (Aborted). The first failure is the runtime's sticky failure: every later operation of
// every MPI Collective fails with it at enqueue, and the runtime skips MPI_Finalize at exit
// (an MPI_Finalize with an operation still pending, or with a dead peer, may hang).
//
// Exit: an atexit handler stops the thread. On a healthy runtime it sends every peer a goodbye,
// waits for theirs (as long as they keep sending heartbeats; a peer silent for 30 s is taken for
// dead), frees its communicators and calls MPI_Finalize. Operations still queued at exit fail
// with Cancelled.
//
// Threading: every public method may be called from any thread except the MPI thread.
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "comm/op.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata {
class TraceRecorder;
}

namespace strata::comm::internal {

// Sizes of the pieces an operation is cut into. The defaults suit production; tests shrink them
// to exercise the chunked paths with small buffers.
struct MpiTuning {
  // fp32 elements' worth of host scratch one round may use: a reduction's inbox (the parts the
  // other ranks send this one, at most (world - 1) / world of it) and the staging of very large
  // all-gathers. 64 MiB by default.
  size_t stage_elements = size_t{1} << 24;
  // The most elements (bytes for Broadcast) one MPI call is given; MPI counts are ints.
  size_t max_call_elements = INT_MAX;
};

// A group of ranks the runtime runs operations over: group 0 is the world (the runtime's
// duplicate of MPI_COMM_WORLD); Split makes more (MPI_Comm_split of a group's communicator).
struct MpiGroup {
  int id = 0;
  int rank = 0;  // this process's rank in the group
  int size = 1;
};

// A split request on its way through the runtime (MpiOp::split).
struct MpiSplit {
  int parent = 0;  // group id
  int color = 0;
  int key = 0;
  MpiGroup result;  // set when the operation succeeded
};

// One operation on its way through the runtime. Created by the submitter; the fields above
// `state` are fixed before Submit. The rest is guarded by the runtime's mutex.
struct MpiOp {
  OpDesc desc;
  std::chrono::milliseconds timeout{0};
  MpiTuning tuning;
  TraceRecorder* trace = nullptr;  // records on `track` when set
  uint32_t track = 0;
  int group = 0;             // the MpiGroup the operation runs over (its ranks are the group's)
  MpiSplit* split = nullptr;  // when set, the operation is this split (desc is not used)

  uint64_t seq = 0;  // set by Submit: 1, 2, ... over the whole process
  std::string name;  // set by Submit: "mpi all-reduce #12 (1000 x bf16, avg)"

  enum class State : uint8_t { kQueued, kReady, kCancelled, kDone };
  State state = State::kQueued;
  Status cancel_reason;  // kCancelled: why it was not run
  Status result;         // kDone: its outcome
};

class MpiRuntime {
 public:
  // The process's runtime, started by the first call: MPI_Init_thread (or an MPI that the
  // application initialised with MPI_THREAD_MULTIPLE), two duplicates of MPI_COMM_WORLD (one for
  // operations, one for heartbeats; `timeout` bounds the wait for the other ranks), and the
  // atexit handler. A failed start is remembered: every later call returns the same error
  // (Unavailable). After the process began to exit it is FailedPrecondition.
  static Result<MpiRuntime*> Instance(std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // OK, or the first failure of any operation (sticky).
  Status failure() const;

  // Queues `op` (with the next sequence number) behind everything submitted before it.
  // With a device and stream: enqueues the HostTask and the Notify described above; an error
  // from the device (e.g. InvalidArgument for a stream of another device) is returned and
  // nothing is queued. Without (both null): the operation's buffers are host memory that is
  // ready now. Returns the sticky failure without queueing anything once there is one.
  Status Submit(std::shared_ptr<MpiOp> op, device::Device* device, device::Stream* stream);

  // Submits `op` without a stream and blocks the caller until it completed; returns its result.
  Status RunNow(std::shared_ptr<MpiOp> op);

  // The world group: every rank of the process's MPI world.
  MpiGroup world_group() const { return MpiGroup{.id = 0, .rank = rank_, .size = world_}; }
  // Splits group `parent` as Collective::Split says: an all-gather of every member's (color,
  // key) on the parent, bounded by `timeout` like any operation, then MPI_Comm_split. Runs in the
  // operation sequence like any other operation (RunNow). The group lives until the runtime
  // shuts down.
  Result<MpiGroup> Split(int parent, int color, int key, std::chrono::milliseconds timeout);

  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

 private:
  class Thread;  // the MPI thread's state (communicators, heartbeats, scratch); mpi_runtime.cc
  friend class Thread;

  MpiRuntime() = default;
  static void ShutdownAtExit();

  // The HostTask body: marks `op` ready, waits until it is done.
  Status StreamTask(MpiOp& op);
  // The Notify body: cancels `op` if its HostTask did not run.
  void StreamDone(MpiOp& op, const Status& device_status);
  // Starts the MPI thread and waits for MPI_Init_thread and the communicators.
  Status Start(std::chrono::milliseconds timeout);
  // Asks the MPI thread to finish (see "Exit" above) and joins it.
  void Stop();

  int rank_ = 0;
  int world_ = 1;

  std::mutex submit_mu_;  // serialises Submit, so sequence numbers follow enqueue order
  uint64_t next_seq_ = 0;

  mutable std::mutex mu_;            // guards the fields below and every MpiOp's state
  std::condition_variable work_cv_;  // the MPI thread waits here: new or ready op, stop
  std::condition_variable done_cv_;  // submitters wait here: an op is done
  std::deque<std::shared_ptr<MpiOp>> queue_;
  Status failure_;
  bool stop_ = false;
  std::atomic<bool> stopping_{
      false};  // stop_, readable without the mutex by the MPI thread's polls

  std::unique_ptr<Thread> thread_;
};

// "<context>: <call> failed: <MPI's error string> (MPI error class N)" with a code for the class;
// OK for MPI_SUCCESS. The one place where an MPI return code becomes a Status.
Status MpiStatus(int rc, std::string_view call, std::string_view context);

}  // namespace strata::comm::internal
