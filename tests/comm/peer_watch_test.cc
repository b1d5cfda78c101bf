// The heartbeats' bookkeeping of the MPI runtime (comm/peer_watch.h), on a manual clock: who is
// silent, failed, gone or late, and the words an operation's error uses for each — without MPI
// and without waiting for a second of silence.
#include "comm/peer_watch.h"

#include <gtest/gtest.h>

#include "common/clock.h"

namespace strata::comm::internal {
namespace {

using std::chrono::milliseconds;

constexpr std::string_view kOp = "mpi all-reduce #3 (16 x fp32, sum) on rank 0";

Beat At(int64_t started, int64_t completed, BeatState state = kRunning) {
  Beat b;
  b.started = started;
  b.completed = completed;
  b.state = state;
  return b;
}

TEST(PeerWatchTest, APeerSilentForASecondIsNamedDeadOrHung) {
  ManualClock clock;
  PeerWatch watch(0, 3, clock);
  watch.Heard(1, At(3, 2));
  watch.Heard(2, At(2, 2));
  clock.Advance(milliseconds(999));
  watch.Heard(2, At(2, 2));  // rank 2 keeps beating; rank 1 goes quiet
  EXPECT_EQ(watch.WaitingFor(3, false), "no other rank is known to have failed");
  clock.Advance(milliseconds(1));
  EXPECT_EQ(watch.WaitingFor(3, false),
            "waiting for rank 1 (no heartbeat for 1.0 s: dead or hung; its last one reported op "
            "#3 started, #2 completed)");
  // Silence is not a failure by itself: the operation goes on until its timeout.
  EXPECT_TRUE(watch.Problem(kOp, 3).ok());
  EXPECT_EQ(watch.silence(1), milliseconds(1000));
}

TEST(PeerWatchTest, APeerNeverHeardFromIsSaidSo) {
  ManualClock clock;
  PeerWatch watch(1, 2, clock);
  clock.Advance(std::chrono::seconds(4));
  EXPECT_EQ(watch.WaitingFor(1, true),
            "waiting for rank 0 (no heartbeat for 4.0 s: dead or hung; never heard from)");
}

TEST(PeerWatchTest, ALivePeerBehindIsNamedOnlyAtATimeout) {
  ManualClock clock;
  PeerWatch watch(0, 2, clock);
  watch.Heard(1, At(2, 2));
  clock.Advance(milliseconds(200));
  EXPECT_EQ(watch.WaitingFor(3, false), "no other rank is known to have failed");
  EXPECT_EQ(watch.WaitingFor(3, true),
            "waiting for rank 1 (alive (heard 0.2 s ago) but has not reached this operation: it "
            "started op #2 and completed #2)");
  watch.Heard(1, At(3, 2));  // it reached the operation: MPI's to complete
  EXPECT_EQ(watch.WaitingFor(3, true),
            "every other rank reached this operation and is alive; MPI did not complete it");
}

TEST(PeerWatchTest, AFailedPeerIsAProblemUnlessItCompletedTheOperation) {
  ManualClock clock;
  PeerWatch watch(0, 2, clock);
  watch.Heard(1, At(5, 4, kFailed));
  EXPECT_TRUE(watch.Problem(kOp, 4).ok()) << "it completed #4 before failing at #5";
  const Status st = watch.Problem(kOp, 5);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_EQ(st.message(),
            "mpi all-reduce #3 (16 x fp32, sum) on rank 0: rank 1 reported a failure of its "
            "collectives (at its op #5); waiting for rank 1 (its collectives failed at op #5)");
}

TEST(PeerWatchTest, APeerThatSaidGoodbyeBeforeTheOperationIsAProblem) {
  ManualClock clock;
  PeerWatch watch(0, 2, clock);
  watch.Heard(1, At(6, 6, kGoodbye));
  EXPECT_TRUE(watch.said_goodbye(1));
  EXPECT_TRUE(watch.Problem(kOp, 6).ok());
  const Status st = watch.Problem(kOp, 7);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_NE(st.message().find("rank 1 shut down its MPI runtime (its process is exiting) after "
                              "op #6: the ranks did not enqueue the same collectives; waiting for "
                              "rank 1 (shut down after op #6)"),
            std::string_view::npos)
      << st.ToString();
}

TEST(PeerWatchTest, AnUnreachablePeerIsAProblemWhateverItCompleted) {
  ManualClock clock;
  PeerWatch watch(1, 3, clock);
  watch.Heard(0, At(9, 9));
  watch.Unreachable(2, InternalError("heartbeat to rank 2: MPI_Isend failed"));
  EXPECT_FALSE(watch.reachable(2));
  const Status st = watch.Problem(kOp, 9);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_EQ(st.message(),
            "mpi all-reduce #3 (16 x fp32, sum) on rank 0: rank 2 cannot be reached: heartbeat to "
            "rank 2: MPI_Isend failed; waiting for rank 2 (unreachable: heartbeat to rank 2: "
            "MPI_Isend failed)");
}

}  // namespace
}  // namespace strata::comm::internal
