// PeerWatch: what one rank knows of the others from their heartbeats, and what it says about
// them when an operation cannot finish — the part of the MPI runtime's heartbeats (mpi_runtime.h)
// that is pure bookkeeping, on a Clock (common/clock.h), so that it is tested without MPI and
// without sleeping (tests/comm/peer_watch_test.cc, on a ManualClock). The MPI thread feeds it the
// heartbeats it receives and the errors talking to a peer, and asks it, while an operation waits,
// whether a peer failed, left or went silent, and whom the operation waits for.
//
// A heartbeat (Beat) carries where its sender is in the sequence of operations (the sequence
// numbers of the operation it started last and completed last) and whether its runtime is
// running, failed, or shutting down (a goodbye: its last heartbeat).
//
// Threading: not thread-safe; the MPI runtime uses it from its one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "strata/status.h"

namespace strata::comm::internal {

enum BeatState : int32_t { kRunning = 0, kFailed = 1, kGoodbye = 2 };

// A heartbeat, as sent between ranks (plain bytes).
struct Beat {
  int64_t started = 0;    // sequence number of the operation it started last
  int64_t completed = 0;  // ... and completed last
  int32_t state = kRunning;
  int32_t reserved = 0;
};

class PeerWatch {
 public:
  // A peer not heard from for this long is reported as "dead or hung".
  static constexpr std::chrono::seconds kSilentAfter{1};

  // Rank `rank` of `world`. Every peer counts as heard at construction (the runtime's start).
  // `clock` must outlive the watch.
  PeerWatch(int rank, int world, Clock& clock);

  // A heartbeat from `peer` arrived now. One whose state is kGoodbye is the peer's last.
  void Heard(int peer, const Beat& beat);
  // Talking to `peer` failed with `error` (an MPI error): it is unreachable from now on.
  void Unreachable(int peer, const Status& error);

  bool reachable(int peer) const { return peers_[Index(peer)].error.ok(); }
  bool said_goodbye(int peer) const { return peers_[Index(peer)].goodbye; }
  // Its latest heartbeat (all zero, kRunning, before the first).
  const Beat& last(int peer) const { return peers_[Index(peer)].last; }
  // How long since `peer` was last heard from (since construction before its first heartbeat).
  Clock::Duration silence(int peer) const;

  // For operation `seq`, described in messages as `context` ("mpi all-reduce #3 (...) on rank
  // 0"): Aborted when a peer that has not completed it cannot be reached, reported a failure, or
  // shut down (said goodbye); OK otherwise. A peer that completed the operation has done its
  // part, whatever it did next.
  Status Problem(std::string_view context, int64_t seq) const;

  // Whom operation `seq` waits for, from the heartbeats: "waiting for rank 1 (no heartbeat for
  // 3.2 s: dead or hung; ...)". Unreachable, shut-down, failed and silent peers (kSilentAfter)
  // are named; with `include_late` (at a timeout: a heartbeat may be up to an interval old) also
  // live peers that have not started the operation.
  std::string WaitingFor(int64_t seq, bool include_late) const;

 private:
  struct Peer {
    Beat last;
    Clock::TimePoint heard;  // when `last` arrived (construction before the first)
    bool ever_heard = false;
    bool goodbye = false;
    Status error;  // an error talking to it
  };
  static size_t Index(int peer) { return static_cast<size_t>(peer); }

  const int rank_;
  Clock& clock_;
  std::vector<Peer> peers_;
};

}  // namespace strata::comm::internal
