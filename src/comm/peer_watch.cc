#include "comm/peer_watch.h"

#include <fmt/format.h>

namespace strata::comm::internal {

namespace {

double Seconds(Clock::Duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

PeerWatch::PeerWatch(int rank, int world, Clock& clock)
    : rank_(rank), clock_(clock), peers_(static_cast<size_t>(world)) {
  const Clock::TimePoint now = clock_.Now();
  for (Peer& peer : peers_)
    peer.heard = now;
}

void PeerWatch::Heard(int peer, const Beat& beat) {
  Peer& p = peers_[Index(peer)];
  p.last = beat;
  p.heard = clock_.Now();
  p.ever_heard = true;
  if (beat.state == kGoodbye) p.goodbye = true;
}

void PeerWatch::Unreachable(int peer, const Status& error) {
  peers_[Index(peer)].error = error;
}

Clock::Duration PeerWatch::silence(int peer) const {
  return clock_.Now() - peers_[Index(peer)].heard;
}

Status PeerWatch::Problem(std::string_view context, int64_t seq) const {
  for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
    const Peer& peer = peers_[Index(p)];
    if (p == rank_) continue;
    if (!peer.error.ok()) {
      return AbortedError(fmt::format("{}: rank {} cannot be reached: {}; {}", context, p,
                                      peer.error.message(), WaitingFor(seq, false)));
    }
    if (peer.last.completed >= seq) continue;
    if (peer.last.state == kFailed) {
      return AbortedError(
          fmt::format("{}: rank {} reported a failure of its collectives (at its op #{}); {}",
                      context, p, peer.last.started, WaitingFor(seq, false)));
    }
    if (peer.goodbye) {
      return AbortedError(fmt::format(
          "{}: rank {} shut down its MPI runtime (its process is exiting) after op #{}: the ranks "
          "did not enqueue the same collectives; {}",
          context, p, peer.last.completed, WaitingFor(seq, false)));
    }
  }
  return Status::Ok();
}

std::string PeerWatch::WaitingFor(int64_t seq, bool include_late) const {
  const Clock::TimePoint now = clock_.Now();
  std::string waiting;
  for (int p = 0; p < static_cast<int>(peers_.size()); ++p) {
    const Peer& peer = peers_[Index(p)];
    if (p == rank_) continue;
    if (peer.error.ok() && peer.last.completed >= seq) continue;  // done: not waited for
    const Clock::Duration silence = now - peer.heard;
    std::string why;
    if (!peer.error.ok()) {
      why = fmt::format("unreachable: {}", peer.error.message());
    } else if (peer.goodbye) {
      why = fmt::format("shut down after op #{}", peer.last.completed);
    } else if (peer.last.state == kFailed) {
      why = fmt::format("its collectives failed at op #{}", peer.last.started);
    } else if (silence >= kSilentAfter) {
      why = peer.ever_heard
                ? fmt::format(
                      "no heartbeat for {:.1f} s: dead or hung; its last one reported op "
                      "#{} started, #{} completed",
                      Seconds(silence), peer.last.started, peer.last.completed)
                : fmt::format("no heartbeat for {:.1f} s: dead or hung; never heard from",
                              Seconds(silence));
    } else if (include_late && peer.last.started < seq) {
      why = fmt::format(
          "alive (heard {:.1f} s ago) but has not reached this operation: it started op #{} and "
          "completed #{}",
          Seconds(silence), peer.last.started, peer.last.completed);
    } else {
      continue;  // it reached the operation and is alive
    }
    waiting += fmt::format("{}rank {} ({})", waiting.empty() ? "" : "; ", p, why);
  }
  if (waiting.empty()) {
    return include_late
               ? "every other rank reached this operation and is alive; MPI did not complete it"
               : "no other rank is known to have failed";
  }
  return "waiting for " + waiting;
}

}  // namespace strata::comm::internal
