#include "comm/mpi_runtime.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <future>
#include <new>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "comm/peer_watch.h"
#include "common/clock.h"
#include "common/log.h"
#include "strata/trace.h"

namespace strata::comm::internal {

namespace {

// The runtime's own deadlines and heartbeat interval; the heartbeats' bookkeeping (PeerWatch)
// reads the same clock through RealClock().
using SteadyClock = std::chrono::steady_clock;

// Heartbeats: one tiny message per peer per interval. All-to-all, so a rank handles
// (world - 1) / interval messages a second: a few thousand for a thousand ranks. A peer not heard
// from for PeerWatch::kSilentAfter is reported as "dead or hung" when an operation times out.
constexpr auto kHeartbeatInterval = std::chrono::milliseconds(200);
// At exit, a healthy runtime waits for every peer's goodbye as long as the peer keeps sending
// heartbeats; one silent for this long is taken for dead and MPI_Finalize is skipped.
constexpr auto kExitSilence = std::chrono::seconds(30);
constexpr int kHeartbeatTag = 0x5354;  // "ST"
// The point-to-point messages of reductions (on the operations' communicator, whose collectives
// MPI keeps apart from point-to-point traffic).
constexpr int kReduceTag = 0x5352;  // "SR"
// How often an operation in progress looks at the heartbeats and the peers' states.
constexpr auto kCheckInterval = std::chrono::milliseconds(1);

// The process-wide instance. Leaked on purpose: it must outlive every Collective, and the
// atexit handler is its end.
std::mutex g_instance_mu;
MpiRuntime* g_instance = nullptr;
Status* g_start_error = nullptr;  // a failed start, returned forever after
bool g_exiting = false;

MPI_Datatype ElementType(device::DType dtype) {
  return dtype == device::DType::kF32 ? MPI_FLOAT : MPI_UINT16_T;
}

StatusCode CodeForMpiClass(int error_class) {
  switch (error_class) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_ROOT:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_TRUNCATE:  // the ranks disagree on an operation's size
      return StatusCode::kInvalidArgument;
    case MPI_ERR_NO_MEM:
      return StatusCode::kResourceExhausted;
    case MPI_ERR_INTERN:
      return StatusCode::kInternal;
    default:  // a communication failure: the runtime cannot go on
      return StatusCode::kAborted;
  }
}

}  // namespace

Status MpiStatus(int rc, std::string_view call, std::string_view context) {
  if (rc == MPI_SUCCESS) return Status::Ok();
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "MPI error code %d", rc);
  }
  int error_class = MPI_ERR_OTHER;
  if (MPI_Error_class(rc, &error_class) != MPI_SUCCESS) error_class = MPI_ERR_OTHER;
  return Status(CodeForMpiClass(error_class), fmt::format("{}: {} failed: {} (MPI error class {})",
                                                          context, call, text, error_class));
}

// ---- the MPI thread ----------------------------------------------------------------------------

class MpiRuntime::Thread {
 public:
  explicit Thread(MpiRuntime& runtime) : rt_(runtime) {}

  // The thread's body: Init, report it through `started`, then Loop and Shutdown.
  void Main(std::chrono::milliseconds timeout, std::promise<Status>* started);

  std::thread thread;

 private:
  // The MPI side of a peer's heartbeats; what they say is in watch_.
  struct Peer {
    Beat in;   // the receive buffer of `recv`
    Beat out;  // the send buffer of `send`
    MPI_Request recv = MPI_REQUEST_NULL;
    MPI_Request send = MPI_REQUEST_NULL;
  };

  Status Init(std::chrono::milliseconds timeout);
  void Loop();
  void Shutdown();
  bool Goodbye();

  void Execute(MpiOp& op);
  Status Run(const MpiOp& op);
  Status RunAllGather(const MpiOp& op);
  Status RunReduceScatter(const MpiOp& op);
  Status RunAllToAll(const MpiOp& op);
  Status RunAllReduce(const MpiOp& op);
  Status RunBroadcast(const MpiOp& op);
  Status RunBarrier(const MpiOp& op);
  Status RunSplit(const MpiOp& op);

  // A communicator the runtime runs operations over; groups_[0] is the world (ops_).
  struct Group {
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0;
    int size = 1;
  };
  const Group& GroupOf(const MpiOp& op) const { return groups_[static_cast<size_t>(op.group)]; }

  // Checks the return code of a call that starts a non-blocking operation.
  Status Started(int rc, std::string_view call, const MpiOp& op);
  // Polls the `count` requests until all complete, servicing heartbeats in between. Fails when
  // a peer reports a failure, when the process exits, or when `op.timeout` passes first. Their
  // statuses go to `statuses` (`count` of them) when given.
  Status Await(MPI_Request* requests, int count, std::string_view call, const MpiOp& op,
               MPI_Status* statuses = nullptr);

  // Reductions are point-to-point, not MPI's reduce-scatter (whose algorithms for large counts
  // were 2.5-3x slower on shared memory, and whose order of additions is MPI's choice): each rank
  // sends every peer that peer's part and adds the parts it receives in rank order.
  // The most elements of one rank's part per exchange (its inbox holds world - 1 of them).
  size_t ReducePieceMax(const MpiOp& op) const;
  // One exchange: parts[q] (counts[q] elements of the operation's dtype) goes to rank q, and
  // out = the operation's scale * (sum over q, in rank order, of rank q's part for this rank),
  // counts[rank] elements, added in fp32 and rounded once. `out` may be parts[rank].
  Status ReducePiece(const MpiOp& op, const std::byte* const* parts, const int* counts,
                     std::byte* out);

  void ServiceHeartbeats();
  void ReceiveBeats();
  void SendBeats();
  // Aborted when a peer said it failed or left, or cannot be reached (PeerWatch::Problem).
  Status PeerProblem(const MpiOp& op) const;
  // Whom `op` waits for (PeerWatch::WaitingFor).
  std::string WaitingFor(const MpiOp& op, bool include_late) const;
  std::string Context(const MpiOp& op) const;

  // Makes `error` the runtime's failure (the first one wins) and tells the peers.
  void Fail(const Status& error);

  // Host scratch of at least `bytes` (kept and reused; only this thread uses it).
  Result<void*> Scratch(size_t bytes);

  MpiRuntime& rt_;
  int rank_ = 0;
  int world_ = 1;
  bool own_mpi_ = true;  // this thread called MPI_Init_thread, so it calls MPI_Finalize
  MPI_Comm ops_ = MPI_COMM_NULL;
  MPI_Comm beats_ = MPI_COMM_NULL;
  std::vector<Group> groups_;  // by MpiGroup::id; only this thread touches it
  std::vector<Peer> peers_;
  std::optional<PeerWatch> watch_;  // made by Init
  Beat me_;
  bool failed_ = false;  // this thread's copy of !rt_.failure_.ok()
  SteadyClock::time_point next_beat_;
  std::unique_ptr<float[]> scratch_;
  size_t scratch_bytes_ = 0;
};

void MpiRuntime::Thread::Main(std::chrono::milliseconds timeout, std::promise<Status>* started) {
  Status init = Init(timeout);
  const bool ok = init.ok();
  started->set_value(std::move(init));
  if (!ok) return;
  Loop();
  Shutdown();
}

Status MpiRuntime::Thread::Init(std::chrono::milliseconds timeout) {
  int initialized = 0;
  STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Initialized(&initialized), "MPI_Initialized", "mpi"));
  if (initialized != 0) {
    // The application owns MPI. Calls from this thread are only allowed with THREAD_MULTIPLE.
    int level = MPI_THREAD_SINGLE;
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Query_thread(&level), "MPI_Query_thread", "mpi"));
    if (level != MPI_THREAD_MULTIPLE) {
      return UnavailableError(fmt::format(
          "mpi: MPI was initialised by the application with thread level {}; Strata makes its MPI "
          "calls from its own thread and then needs MPI_THREAD_MULTIPLE (or leave MPI_Init to "
          "Strata)",
          level));
    }
    own_mpi_ = false;
  } else {
    int provided = MPI_THREAD_SINGLE;
    STRATA_RETURN_IF_ERROR(
        MpiStatus(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided),
                  "MPI_Init_thread", "mpi"));
    if (provided < MPI_THREAD_FUNNELED) {
      return UnavailableError(fmt::format(
          "mpi: MPI_Init_thread provided thread level {}, below MPI_THREAD_FUNNELED", provided));
    }
    // Errors come back as codes (converted by MpiStatus) instead of aborting the job.
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN),
                                     "MPI_Comm_set_errhandler", "mpi"));
  }
  STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank", "mpi"));
  STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_size(MPI_COMM_WORLD, &world_), "MPI_Comm_size", "mpi"));

  // Private communicators, so that nothing else in the process can match our messages. The
  // duplication is collective: a rank that never starts its runtime must not hang this one.
  const auto deadline = SteadyClock::now() + timeout;
  for (MPI_Comm* comm : {&ops_, &beats_}) {
    MPI_Request request = MPI_REQUEST_NULL;
    STRATA_RETURN_IF_ERROR(
        MpiStatus(MPI_Comm_idup(MPI_COMM_WORLD, comm, &request), "MPI_Comm_idup", "mpi"));
    for (;;) {
      int done = 0;
      STRATA_RETURN_IF_ERROR(
          MpiStatus(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test", "mpi start"));
      if (done != 0) break;
      if (SteadyClock::now() >= deadline) {
        return DeadlineExceededError(fmt::format(
            "mpi: rank {} of {}: the other ranks did not start their MPI runtime (MPI_Comm_idup) "
            "within {} ms",
            rank_, world_, timeout.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    STRATA_RETURN_IF_ERROR(MpiStatus(MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN),
                                     "MPI_Comm_set_errhandler", "mpi"));
  }

  groups_.push_back(Group{.comm = ops_, .rank = rank_, .size = world_});
  watch_.emplace(rank_, world_, RealClock());
  peers_.resize(static_cast<size_t>(world_));
  for (int p = 0; p < world_; ++p) {
    Peer& peer = peers_[static_cast<size_t>(p)];
    if (p == rank_) continue;
    STRATA_RETURN_IF_ERROR(
        MpiStatus(MPI_Irecv(&peer.in, sizeof(Beat), MPI_BYTE, p, kHeartbeatTag, beats_, &peer.recv),
                  "MPI_Irecv", "mpi heartbeat"));
  }
  next_beat_ = SteadyClock::now();
  rt_.rank_ = rank_;
  rt_.world_ = world_;
  STRATA_LOG(debug, comm, "mpi: rank {} of {} started (thread level funneled, own MPI: {})", rank_,
             world_, own_mpi_);
  return Status::Ok();
}

void MpiRuntime::Thread::Loop() {
  for (;;) {
    std::shared_ptr<MpiOp> op;
    bool stop = false;
    {
      std::unique_lock lock(rt_.mu_);
      // The first queued operation runs once its stream reached it (or was cancelled), or at
      // once after a failure (it then fails without touching its buffers).
      auto runnable = [&] {
        return !rt_.queue_.empty() &&
               (rt_.queue_.front()->state != MpiOp::State::kQueued || !rt_.failure_.ok());
      };
      rt_.work_cv_.wait_until(lock, next_beat_, [&] { return rt_.stop_ || runnable(); });
      if (runnable()) {
        op = std::move(rt_.queue_.front());
        rt_.queue_.pop_front();
      } else {
        stop = rt_.stop_;
      }
    }
    if (op != nullptr) {
      Execute(*op);
    } else if (stop) {
      return;
    }
    ServiceHeartbeats();
  }
}

void MpiRuntime::Thread::Execute(MpiOp& op) {
  Status failure;
  MpiOp::State state;
  Status cancel_reason;
  {
    std::lock_guard lock(rt_.mu_);
    failure = rt_.failure_;
    state = op.state;
    cancel_reason = op.cancel_reason;
  }
  const int64_t start_ns = op.trace != nullptr ? TraceRecorder::NowNs() : 0;
  Status result;
  if (!failure.ok()) {
    result = failure;
  } else if (state == MpiOp::State::kCancelled) {
    // Its stream failed before reaching it. The other ranks will wait for this rank in vain, so
    // the runtime fails; they learn it from the next heartbeat.
    result = AbortedError(fmt::format("{}: not run: its stream failed first: {}", Context(op),
                                      cancel_reason.ToString()));
    Fail(result);
  } else {
    me_.started = static_cast<int64_t>(op.seq);
    result = Run(op);
    if (result.ok()) {
      me_.completed = static_cast<int64_t>(op.seq);
    } else {
      Fail(result);
    }
  }
  if (op.trace != nullptr) {
    op.trace->Complete(op.track, TraceName(op.desc), "comm", start_ns, TraceRecorder::NowNs(),
                       {{"bytes", static_cast<double>(OpBytes(op.desc, GroupOf(op).size))},
                        {"seq", static_cast<double>(op.seq)}});
  }
  {
    std::lock_guard lock(rt_.mu_);
    op.result = std::move(result);
    op.state = MpiOp::State::kDone;
  }
  rt_.done_cv_.notify_all();
}

void MpiRuntime::Thread::Fail(const Status& error) {
  bool first = false;
  {
    std::lock_guard lock(rt_.mu_);
    if (rt_.failure_.ok()) {
      rt_.failure_ = error;
      first = true;
    }
  }
  failed_ = true;
  next_beat_ = SteadyClock::now();  // tell the peers now, not at the next interval
  if (first) {
    STRATA_LOG(error, comm, "{}; every later MPI collective of this process fails with this error",
               error.ToString());
  }
}

std::string MpiRuntime::Thread::Context(const MpiOp& op) const {
  return fmt::format("{} on rank {}", op.name, rank_);
}

Status MpiRuntime::Thread::Started(int rc, std::string_view call, const MpiOp& op) {
  return MpiStatus(rc, call, Context(op));
}

Status MpiRuntime::Thread::Await(MPI_Request* requests, int count, std::string_view call,
                                 const MpiOp& op, MPI_Status* statuses) {
  // MPI_Testall reports a failed request as MPI_ERR_IN_STATUS; the request's own error (e.g. a
  // truncation: the ranks disagree on a size) is in its status.
  std::vector<MPI_Status> own;
  if (statuses == nullptr) {
    own.resize(static_cast<size_t>(count));
    statuses = own.data();
  }
  const auto deadline = SteadyClock::now() + op.timeout;
  auto next_check = SteadyClock::now() + kCheckInterval;
  // Spin briefly (small operations finish in microseconds), then back off so that ranks
  // sharing cores still make progress. MPI only progresses inside MPI calls, so the nap is short.
  int polls = 0;
  auto nap = std::chrono::microseconds(10);
  for (;;) {
    int done = 0;
    int rc = MPI_Testall(count, requests, &done, statuses);
    if (rc == MPI_ERR_IN_STATUS) {
      for (int i = 0; i < count; ++i) {
        if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING) {
          rc = statuses[i].MPI_ERROR;
          break;
        }
      }
    }
    if (rc != MPI_SUCCESS) {
      const Status error = MpiStatus(rc, call, Context(op));
      return Status(error.code(),
                    fmt::format("{}; {}", error.message(), WaitingFor(op, /*include_late=*/true)));
    }
    if (done != 0) return Status::Ok();
    const auto now = SteadyClock::now();
    if (now >= next_check) {  // heartbeats cost O(world) MPI calls: not on every poll
      next_check = now + kCheckInterval;
      ServiceHeartbeats();
      STRATA_RETURN_IF_ERROR(PeerProblem(op));
      if (rt_.stopping_.load(std::memory_order_acquire)) {
        return CancelledError(
            fmt::format("{}: the process is exiting with the operation in progress", Context(op)));
      }
    }
    if (now >= deadline) {
      return DeadlineExceededError(fmt::format("{}: no progress within {} ms ({}); {}", Context(op),
                                               op.timeout.count(), call,
                                               WaitingFor(op, /*include_late=*/true)));
    }
    if (++polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(250));
    }
  }
}

// ---- heartbeats --------------------------------------------------------------------------------

void MpiRuntime::Thread::ServiceHeartbeats() {
  ReceiveBeats();
  const auto now = SteadyClock::now();
  if (now >= next_beat_) {
    SendBeats();
    next_beat_ = now + kHeartbeatInterval;
  }
}

void MpiRuntime::Thread::ReceiveBeats() {
  for (int p = 0; p < world_; ++p) {
    Peer& peer = peers_[static_cast<size_t>(p)];
    while (peer.recv != MPI_REQUEST_NULL) {
      int done = 0;
      int rc = MPI_Test(&peer.recv, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        watch_->Unreachable(p, MpiStatus(rc, "MPI_Test", fmt::format("heartbeat from rank {}", p)));
        peer.recv = MPI_REQUEST_NULL;
        break;
      }
      if (done == 0) break;
      watch_->Heard(p, peer.in);
      if (peer.in.state == kGoodbye) break;  // its last message on this communicator
      rc = MPI_Irecv(&peer.in, sizeof(Beat), MPI_BYTE, p, kHeartbeatTag, beats_, &peer.recv);
      if (rc != MPI_SUCCESS) {
        watch_->Unreachable(p,
                            MpiStatus(rc, "MPI_Irecv", fmt::format("heartbeat from rank {}", p)));
        peer.recv = MPI_REQUEST_NULL;
      }
    }
  }
}

void MpiRuntime::Thread::SendBeats() {
  me_.state = failed_ ? kFailed : kRunning;
  for (int p = 0; p < world_; ++p) {
    Peer& peer = peers_[static_cast<size_t>(p)];
    if (p == rank_ || !watch_->reachable(p)) continue;
    if (peer.send != MPI_REQUEST_NULL) {
      // At most one heartbeat in flight per peer: a peer that stopped receiving (dead) must not
      // make us queue messages without bound.
      int done = 0;
      const int rc = MPI_Test(&peer.send, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        watch_->Unreachable(p, MpiStatus(rc, "MPI_Test", fmt::format("heartbeat to rank {}", p)));
        peer.send = MPI_REQUEST_NULL;
        continue;
      }
      if (done == 0) continue;
    }
    peer.out = me_;
    const int rc =
        MPI_Isend(&peer.out, sizeof(Beat), MPI_BYTE, p, kHeartbeatTag, beats_, &peer.send);
    if (rc != MPI_SUCCESS) {
      watch_->Unreachable(p, MpiStatus(rc, "MPI_Isend", fmt::format("heartbeat to rank {}", p)));
      peer.send = MPI_REQUEST_NULL;
    }
  }
}

Status MpiRuntime::Thread::PeerProblem(const MpiOp& op) const {
  return watch_->Problem(Context(op), static_cast<int64_t>(op.seq));
}

std::string MpiRuntime::Thread::WaitingFor(const MpiOp& op, bool include_late) const {
  return watch_->WaitingFor(static_cast<int64_t>(op.seq), include_late);
}

// ---- exit --------------------------------------------------------------------------------------

void MpiRuntime::Thread::Shutdown() {
  bool had_queued = false;
  {
    std::lock_guard lock(rt_.mu_);
    for (auto& op : rt_.queue_) {
      op->result = CancelledError(fmt::format("{}: not run: the process is exiting", op->name));
      op->state = MpiOp::State::kDone;
      had_queued = true;
    }
    rt_.queue_.clear();
  }
  rt_.done_cv_.notify_all();
  if (had_queued) {
    Fail(CancelledError("mpi: the process exited with collective operations still queued"));
  }
  if (failed_) {
    STRATA_LOG(warn, comm,
               "mpi: not calling MPI_Finalize after a failure (it could hang on a dead peer or a "
               "pending operation); the launcher may report that this process exited without it");
    return;
  }
  if (!Goodbye()) {
    STRATA_LOG(warn, comm,
               "mpi: not every rank said goodbye (a peer failed or went silent for {} s); not "
               "calling MPI_Finalize",
               std::chrono::duration_cast<std::chrono::seconds>(kExitSilence).count());
    return;
  }
  for (size_t g = 1; g < groups_.size(); ++g) {
    MpiStatus(MPI_Comm_free(&groups_[g].comm), "MPI_Comm_free", "mpi exit").IgnoreError();
  }
  MpiStatus(MPI_Comm_free(&ops_), "MPI_Comm_free", "mpi exit").IgnoreError();
  MpiStatus(MPI_Comm_free(&beats_), "MPI_Comm_free", "mpi exit").IgnoreError();
  if (own_mpi_) {
    const Status finalized = MpiStatus(MPI_Finalize(), "MPI_Finalize", "mpi exit");
    if (!finalized.ok()) STRATA_LOG(warn, comm, "{}", finalized.ToString());
  }
}

bool MpiRuntime::Thread::Goodbye() {
  // Every peer gets a goodbye (after the heartbeat in flight to it, if any) and sends one; on
  // one communicator messages from one sender arrive in order, so after its goodbye nothing more
  // comes from a peer, and no receive is left posted when MPI_Finalize runs.
  me_.state = kGoodbye;
  std::vector<bool> sent(static_cast<size_t>(world_), false);
  for (;;) {
    ReceiveBeats();
    bool done = true;
    for (int p = 0; p < world_; ++p) {
      Peer& peer = peers_[static_cast<size_t>(p)];
      if (p == rank_) continue;
      if (!watch_->reachable(p) || watch_->last(p).state == kFailed) return false;
      if (peer.send != MPI_REQUEST_NULL) {
        int complete = 0;
        if (MPI_Test(&peer.send, &complete, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
      }
      if (!sent[static_cast<size_t>(p)] && peer.send == MPI_REQUEST_NULL) {
        peer.out = me_;
        if (MPI_Isend(&peer.out, sizeof(Beat), MPI_BYTE, p, kHeartbeatTag, beats_, &peer.send) !=
            MPI_SUCCESS) {
          return false;
        }
        sent[static_cast<size_t>(p)] = true;
      }
      if (!watch_->said_goodbye(p)) {
        if (watch_->silence(p) >= kExitSilence) return false;
        done = false;
      }
      if (!sent[static_cast<size_t>(p)] || peer.send != MPI_REQUEST_NULL) done = false;
    }
    if (done) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---- the operations ----------------------------------------------------------------------------

Result<void*> MpiRuntime::Thread::Scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    const size_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
    scratch_.reset(new (std::nothrow) float[floats]);
    scratch_bytes_ = scratch_ != nullptr ? floats * sizeof(float) : 0;
    if (scratch_ == nullptr) {
      return ResourceExhaustedError(
          fmt::format("mpi: cannot allocate {} bytes of staging memory", bytes));
    }
  }
  return static_cast<void*>(scratch_.get());
}

Status MpiRuntime::Thread::Run(const MpiOp& op) {
  if (op.split != nullptr) return RunSplit(op);
  switch (op.desc.kind) {
    case OpKind::kAllGather:
      return RunAllGather(op);
    case OpKind::kReduceScatter:
      return RunReduceScatter(op);
    case OpKind::kAllReduce:
      return RunAllReduce(op);
    case OpKind::kAllToAll:
      return RunAllToAll(op);
    case OpKind::kBroadcast:
      return RunBroadcast(op);
    case OpKind::kBarrier:
      return RunBarrier(op);
  }
  return InternalError(fmt::format("{}: unknown operation", Context(op)));
}

Status MpiRuntime::Thread::RunSplit(const MpiOp& op) {
  const Group& parent = GroupOf(op);
  // Everyone arrives first (bounded by the timeout, watched by the heartbeats); MPI_Comm_split,
  // which blocks, then only waits for ranks that are already in it.
  std::vector<int> args(2 * static_cast<size_t>(parent.size));
  const int mine[2] = {op.split->color, op.split->key};
  MPI_Request request = MPI_REQUEST_NULL;
  STRATA_RETURN_IF_ERROR(Started(
      MPI_Iallgather(mine, 2, MPI_INT, args.data(), 2, MPI_INT, parent.comm, &request),
      "MPI_Iallgather", op));
  STRATA_RETURN_IF_ERROR(Await(&request, 1, "MPI_Iallgather", op));
  std::vector<std::pair<int, int>> color_key;
  for (int q = 0; q < parent.size; ++q) {
    color_key.emplace_back(args[2 * static_cast<size_t>(q)], args[2 * static_cast<size_t>(q) + 1]);
  }
  const SplitPlace place = PlaceInSplit(color_key, parent.rank);
  Group group;
  STRATA_RETURN_IF_ERROR(Started(
      MPI_Comm_split(parent.comm, op.split->color, op.split->key, &group.comm), "MPI_Comm_split",
      op));
  STRATA_RETURN_IF_ERROR(Started(MPI_Comm_set_errhandler(group.comm, MPI_ERRORS_RETURN),
                                 "MPI_Comm_set_errhandler", op));
  STRATA_RETURN_IF_ERROR(
      Started(MPI_Comm_rank(group.comm, &group.rank), "MPI_Comm_rank", op));
  STRATA_RETURN_IF_ERROR(
      Started(MPI_Comm_size(group.comm, &group.size), "MPI_Comm_size", op));
  if (group.rank != place.rank || group.size != place.size()) {
    return InternalError(fmt::format(
        "{}: MPI_Comm_split placed this rank at {} of {}, where the (color, key) pairs place it "
        "at {} of {}",
        Context(op), group.rank, group.size, place.rank, place.size()));
  }
  groups_.push_back(group);
  op.split->result = MpiGroup{
      .id = static_cast<int>(groups_.size() - 1), .rank = group.rank, .size = group.size};
  return Status::Ok();
}

Status MpiRuntime::Thread::RunBarrier(const MpiOp& op) {
  const Group& g = GroupOf(op);
  MPI_Request request = MPI_REQUEST_NULL;
  STRATA_RETURN_IF_ERROR(Started(MPI_Ibarrier(g.comm, &request), "MPI_Ibarrier", op));
  return Await(&request, 1, "MPI_Ibarrier", op);
}

Status MpiRuntime::Thread::RunBroadcast(const MpiOp& op) {
  const Group& g = GroupOf(op);
  auto* buf = static_cast<std::byte*>(op.desc.recv);
  const size_t bytes = op.desc.count;
  const size_t chunk = std::max<size_t>(1, op.tuning.max_call_elements);
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t length = std::min(chunk, bytes - offset);
    MPI_Request request = MPI_REQUEST_NULL;
    STRATA_RETURN_IF_ERROR(Started(
        MPI_Ibcast(buf + offset, static_cast<int>(length), MPI_BYTE, op.desc.root, g.comm, &request),
        "MPI_Ibcast", op));
    STRATA_RETURN_IF_ERROR(Await(&request, 1, "MPI_Ibcast", op));
  }
  return Status::Ok();
}

Status MpiRuntime::Thread::RunAllGather(const MpiOp& op) {
  const Group& g = GroupOf(op);
  const OpDesc& d = op.desc;
  const size_t n = d.count;
  const size_t elem = device::DTypeSize(d.dtype);
  const MPI_Datatype type = ElementType(d.dtype);
  const auto* send = static_cast<const std::byte*>(d.send);
  auto* recv = static_cast<std::byte*>(d.recv);
  const auto world = static_cast<size_t>(g.size);
  const auto rank = static_cast<size_t>(g.rank);

  if (n <= op.tuning.max_call_elements) {
    MPI_Request request = MPI_REQUEST_NULL;
    const void* source = IsInPlace(d, g.rank) ? MPI_IN_PLACE : d.send;
    STRATA_RETURN_IF_ERROR(Started(MPI_Iallgather(source, static_cast<int>(n), type, recv,
                                                  static_cast<int>(n), type, g.comm, &request),
                                   "MPI_Iallgather", op));
    return Await(&request, 1, "MPI_Iallgather", op);
  }
  // Too many elements for one call: gather piece by piece through scratch, where rank q's piece
  // sits at q * piece (one rank's piece would be strided in recv).
  const size_t piece_max =
      std::max<size_t>(1, std::min(op.tuning.stage_elements * sizeof(float) / (world * elem),
                                   op.tuning.max_call_elements));
  STRATA_ASSIGN_OR_RETURN(void* scratch_ptr, Scratch(world * piece_max * elem));
  auto* scratch = static_cast<std::byte*>(scratch_ptr);
  for (size_t offset = 0; offset < n; offset += piece_max) {
    const size_t piece = std::min(piece_max, n - offset);
    std::memcpy(scratch + rank * piece * elem, send + offset * elem, piece * elem);
    MPI_Request request = MPI_REQUEST_NULL;
    STRATA_RETURN_IF_ERROR(Started(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, scratch,
                                                  static_cast<int>(piece), type, g.comm, &request),
                                   "MPI_Iallgather", op));
    STRATA_RETURN_IF_ERROR(Await(&request, 1, "MPI_Iallgather", op));
    for (size_t q = 0; q < world; ++q) {
      std::memcpy(recv + (q * n + offset) * elem, scratch + q * piece * elem, piece * elem);
    }
  }
  return Status::Ok();
}

Status MpiRuntime::Thread::RunAllToAll(const MpiOp& op) {
  const Group& g = GroupOf(op);
  const OpDesc& d = op.desc;
  const size_t n = d.count;
  const size_t elem = device::DTypeSize(d.dtype);
  const MPI_Datatype type = ElementType(d.dtype);
  const auto* send = static_cast<const std::byte*>(d.send);
  auto* recv = static_cast<std::byte*>(d.recv);
  const auto world = static_cast<size_t>(g.size);

  if (n <= op.tuning.max_call_elements) {
    MPI_Request request = MPI_REQUEST_NULL;
    STRATA_RETURN_IF_ERROR(Started(MPI_Ialltoall(send, static_cast<int>(n), type, recv,
                                                 static_cast<int>(n), type, g.comm, &request),
                                   "MPI_Ialltoall", op));
    return Await(&request, 1, "MPI_Ialltoall", op);
  }
  // Too many elements for one call: piece by piece through scratch (the send half, then the
  // receive half), where peer q's piece sits at q * piece.
  const size_t piece_max =
      std::max<size_t>(1, std::min(op.tuning.stage_elements * sizeof(float) / (2 * world * elem),
                                   op.tuning.max_call_elements));
  STRATA_ASSIGN_OR_RETURN(void* scratch_ptr, Scratch(2 * world * piece_max * elem));
  auto* out = static_cast<std::byte*>(scratch_ptr);
  std::byte* in = out + world * piece_max * elem;
  for (size_t offset = 0; offset < n; offset += piece_max) {
    const size_t piece = std::min(piece_max, n - offset);
    for (size_t q = 0; q < world; ++q) {
      std::memcpy(out + q * piece * elem, send + (q * n + offset) * elem, piece * elem);
    }
    MPI_Request request = MPI_REQUEST_NULL;
    STRATA_RETURN_IF_ERROR(Started(MPI_Ialltoall(out, static_cast<int>(piece), type, in,
                                                 static_cast<int>(piece), type, g.comm, &request),
                                   "MPI_Ialltoall", op));
    STRATA_RETURN_IF_ERROR(Await(&request, 1, "MPI_Ialltoall", op));
    for (size_t q = 0; q < world; ++q) {
      std::memcpy(recv + (q * n + offset) * elem, in + q * piece * elem, piece * elem);
    }
  }
  return Status::Ok();
}

Status MpiRuntime::Thread::RunReduceScatter(const MpiOp& op) {
  const Group& g = GroupOf(op);
  const OpDesc& d = op.desc;
  const size_t n = d.count;
  const size_t elem = device::DTypeSize(d.dtype);
  const auto* send = static_cast<const std::byte*>(d.send);
  auto* recv = static_cast<std::byte*>(d.recv);
  const auto world = static_cast<size_t>(g.size);
  const size_t piece_max = ReducePieceMax(op);
  std::vector<const std::byte*> parts(world);
  std::vector<int> counts(world);
  for (size_t offset = 0; offset < n; offset += piece_max) {
    const size_t piece = std::min(piece_max, n - offset);
    for (size_t q = 0; q < world; ++q) {
      parts[q] = send + (q * n + offset) * elem;
      counts[q] = static_cast<int>(piece);
    }
    STRATA_RETURN_IF_ERROR(ReducePiece(op, parts.data(), counts.data(), recv + offset * elem));
  }
  return Status::Ok();
}

Status MpiRuntime::Thread::RunAllReduce(const MpiOp& op) {
  const Group& g = GroupOf(op);
  // A reduce-scatter (each element is summed on exactly one rank, in rank order) followed by an
  // all-gather of the results, round by round: every rank receives the very same bits.
  const OpDesc& d = op.desc;
  const size_t n = d.count;
  const size_t elem = device::DTypeSize(d.dtype);
  const MPI_Datatype type = ElementType(d.dtype);
  const auto* send = static_cast<const std::byte*>(d.send);
  auto* recv = static_cast<std::byte*>(d.recv);
  const auto world = static_cast<size_t>(g.size);
  const auto rank = static_cast<size_t>(g.rank);
  // A round gives each rank at most one reduction piece, and its offsets stay ints.
  const size_t round_max = std::min<size_t>(ReducePieceMax(op) * world, INT_MAX);
  std::vector<const std::byte*> parts(world);
  std::vector<int> counts(world);
  std::vector<int> displs(world);
  for (size_t offset = 0; offset < n; offset += round_max) {
    const size_t length = std::min(round_max, n - offset);
    // Rank q owns counts[q] elements of the round at displs[q] (the first length % world ranks
    // one more).
    size_t at = 0;
    for (size_t q = 0; q < world; ++q) {
      counts[q] = static_cast<int>(length / world + (q < length % world ? 1 : 0));
      displs[q] = static_cast<int>(at);
      parts[q] = send + (offset + at) * elem;
      at += static_cast<size_t>(counts[q]);
    }
    std::byte* round = recv + offset * elem;
    STRATA_RETURN_IF_ERROR(ReducePiece(op, parts.data(), counts.data(),
                                       round + static_cast<size_t>(displs[rank]) * elem));
    MPI_Request request = MPI_REQUEST_NULL;
    STRATA_RETURN_IF_ERROR(
        Started(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, round, counts.data(),
                                displs.data(), type, g.comm, &request),
                "MPI_Iallgatherv", op));
    STRATA_RETURN_IF_ERROR(Await(&request, 1, "MPI_Iallgatherv", op));
  }
  return Status::Ok();
}

size_t MpiRuntime::Thread::ReducePieceMax(const MpiOp& op) const {
  const Group& g = GroupOf(op);
  return std::max<size_t>(1, std::min(op.tuning.stage_elements / static_cast<size_t>(g.size),
                                      op.tuning.max_call_elements));
}

Status MpiRuntime::Thread::ReducePiece(const MpiOp& op, const std::byte* const* parts,
                                       const int* counts, std::byte* out) {
  const Group& g = GroupOf(op);
  const OpDesc& d = op.desc;
  const size_t elem = device::DTypeSize(d.dtype);
  const MPI_Datatype type = ElementType(d.dtype);
  const auto world = static_cast<size_t>(g.size);
  const auto rank = static_cast<size_t>(g.rank);
  const auto mine = static_cast<size_t>(counts[rank]);
  STRATA_ASSIGN_OR_RETURN(void* scratch, Scratch((world - 1) * mine * elem));
  auto* inbox = static_cast<std::byte*>(scratch);
  // Peer q's piece lands in slot q (q < rank) or q - 1 (q > rank). Receives are posted first;
  // the k-th exchange goes to rank + k and comes from rank - k, so no rank is everyone's first.
  std::vector<MPI_Request> requests(2 * (world - 1), MPI_REQUEST_NULL);
  std::vector<const std::byte*> sources(world);
  sources[rank] = parts[rank];
  for (size_t k = 1; k < world; ++k) {
    const size_t from = (rank + world - k) % world;
    std::byte* slot = inbox + (from < rank ? from : from - 1) * mine * elem;
    sources[from] = slot;
    STRATA_RETURN_IF_ERROR(
        Started(MPI_Irecv(slot, static_cast<int>(mine), type, static_cast<int>(from), kReduceTag,
                          g.comm, &requests[k - 1]),
                "MPI_Irecv", op));
  }
  for (size_t k = 1; k < world; ++k) {
    const size_t to = (rank + k) % world;
    STRATA_RETURN_IF_ERROR(Started(MPI_Isend(parts[to], counts[to], type, static_cast<int>(to),
                                             kReduceTag, g.comm, &requests[world - 1 + k - 1]),
                                   "MPI_Isend", op));
  }
  std::vector<MPI_Status> statuses(requests.size());
  STRATA_RETURN_IF_ERROR(Await(requests.data(), static_cast<int>(requests.size()),
                               "MPI_Isend/MPI_Irecv", op, statuses.data()));
  // A shorter message than expected is no MPI error (a longer one is a truncation).
  for (size_t k = 1; k < world; ++k) {
    int received = 0;
    STRATA_RETURN_IF_ERROR(
        MpiStatus(MPI_Get_count(&statuses[k - 1], type, &received), "MPI_Get_count", Context(op)));
    if (received != static_cast<int>(mine)) {
      return InvalidArgumentError(fmt::format(
          "{}: rank {} sent {} elements for this rank's part where {} were expected: the ranks "
          "disagree on the operation's size",
          Context(op), (rank + world - k) % world, received, mine));
    }
  }
  ReduceInRankOrder(sources.data(), world, d.dtype, d.op, out, mine);
  return Status::Ok();
}

// ---- MpiRuntime --------------------------------------------------------------------------------

Result<MpiRuntime*> MpiRuntime::Instance(std::chrono::milliseconds timeout) {
  std::lock_guard lock(g_instance_mu);
  if (g_exiting) {
    return FailedPreconditionError("mpi: the process is exiting; the MPI runtime has shut down");
  }
  if (g_instance != nullptr) return g_instance;
  if (g_start_error != nullptr) return *g_start_error;

  // The logger must exist before the atexit handler is registered, so that it is destroyed
  // after the handler ran (the handler logs).
  (void)log::Enabled(log::Subsystem::comm, log::Level::debug);
  auto runtime = std::unique_ptr<MpiRuntime>(new MpiRuntime());
  Status started = runtime->Start(timeout);
  if (!started.ok()) {
    // MPI cannot be initialised twice in a process: the failure is final.
    g_start_error = new Status(
        UnavailableError(fmt::format("the MPI backend cannot start: {}", started.ToString())));
    return *g_start_error;
  }
  if (std::atexit(&MpiRuntime::ShutdownAtExit) != 0) {
    STRATA_LOG(warn, comm, "mpi: cannot register the exit handler; MPI_Finalize will not run");
  }
  g_instance = runtime.release();
  return g_instance;
}

Status MpiRuntime::Start(std::chrono::milliseconds timeout) {
  thread_ = std::make_unique<Thread>(*this);
  // Shared with the thread, so that the promise outlives its set_value even when this function
  // has returned by then.
  auto started = std::make_shared<std::promise<Status>>();
  std::future<Status> result = started->get_future();
  try {
    thread_->thread = std::thread(
        [thread = thread_.get(), timeout, started] { thread->Main(timeout, started.get()); });
  } catch (const std::system_error& e) {
    return ResourceExhaustedError(fmt::format("mpi: cannot start the MPI thread: {}", e.what()));
  }
  Status status = result.get();
  if (!status.ok()) thread_->thread.join();
  return status;
}

void MpiRuntime::ShutdownAtExit() {
  MpiRuntime* runtime = nullptr;
  {
    std::lock_guard lock(g_instance_mu);
    g_exiting = true;
    runtime = g_instance;
  }
  if (runtime != nullptr) runtime->Stop();
}

void MpiRuntime::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  stopping_.store(true, std::memory_order_release);
  work_cv_.notify_all();
  if (thread_ != nullptr && thread_->thread.joinable()) thread_->thread.join();
}

Status MpiRuntime::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

Status MpiRuntime::Submit(std::shared_ptr<MpiOp> op, device::Device* device,
                          device::Stream* stream) {
  std::lock_guard submit_lock(submit_mu_);
  {
    std::lock_guard lock(mu_);
    if (!failure_.ok()) return failure_;
    if (stop_) return FailedPreconditionError("mpi: the process is exiting");
  }
  op->seq = next_seq_ + 1;
  op->name = op->split != nullptr
                 ? fmt::format("mpi split #{} (color {}, key {})", op->seq, op->split->color,
                               op->split->key)
                 : fmt::format("mpi {}", DescribeOp(op->desc, op->seq));
  if (op->group != 0) op->name += fmt::format(" in group {}", op->group);
  Status notified;
  if (device != nullptr) {
    STRATA_RETURN_IF_ERROR(device->HostTask(
        *stream, [this, op] { return StreamTask(*op); }, op->name));
    // Only a device failure (sticky error) makes this fail now; the op is then queued cancelled
    // (unless its host task already ran), so that the host task does not wait forever.
    notified =
        device->Notify(*stream, [this, op](const Status& status) { StreamDone(*op, status); });
  }
  ++next_seq_;
  {
    std::lock_guard lock(mu_);
    if (device == nullptr) {
      op->state = MpiOp::State::kReady;
    } else if (!notified.ok() && op->state == MpiOp::State::kQueued) {
      op->state = MpiOp::State::kCancelled;
      op->cancel_reason = notified;
    }
    queue_.push_back(std::move(op));
  }
  work_cv_.notify_all();
  return notified;
}

Status MpiRuntime::RunNow(std::shared_ptr<MpiOp> op) {
  STRATA_RETURN_IF_ERROR(Submit(op, nullptr, nullptr));
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return op->state == MpiOp::State::kDone; });
  return op->result;
}

Result<MpiGroup> MpiRuntime::Split(int parent, int color, int key,
                                   std::chrono::milliseconds timeout) {
  STRATA_RETURN_IF_ERROR(ValidateSplit("mpi", color));
  MpiSplit split{.parent = parent, .color = color, .key = key, .result = {}};
  auto op = std::make_shared<MpiOp>();
  op->timeout = timeout;
  op->group = parent;
  op->split = &split;
  STRATA_RETURN_IF_ERROR(RunNow(op));
  return split.result;
}

Status MpiRuntime::StreamTask(MpiOp& op) {
  std::unique_lock lock(mu_);
  if (op.state == MpiOp::State::kQueued) {
    op.state = MpiOp::State::kReady;
    work_cv_.notify_all();
  }
  done_cv_.wait(lock, [&] { return op.state == MpiOp::State::kDone; });
  return op.result;
}

void MpiRuntime::StreamDone(MpiOp& op, const Status& device_status) {
  std::lock_guard lock(mu_);
  if (op.state != MpiOp::State::kQueued) return;
  op.state = MpiOp::State::kCancelled;
  op.cancel_reason =
      device_status.ok() ? InternalError("its host task did not run") : device_status;
  work_cv_.notify_all();
}

}  // namespace strata::comm::internal
