// The injectable clock (common/clock.h): the real one reads the steady clock; the manual one
// moves only when a test advances it, and its sleepers and timed waiters end exactly then.
#include "common/clock.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace strata {
namespace {

using std::chrono::seconds;

TEST(ClockTest, RealClockIsTheSteadyClock) {
  Clock& clock = RealClock();
  const auto before = std::chrono::steady_clock::now();
  const auto now = clock.Now();
  EXPECT_GE(now, before);
  EXPECT_LE(now, std::chrono::steady_clock::now());
  clock.SleepFor(std::chrono::milliseconds(1));
  EXPECT_GE(clock.Now() - now, std::chrono::milliseconds(1));
  EXPECT_EQ(&RealClock(), &clock);
}

TEST(ClockTest, ManualClockStandsStillUntilAdvanced) {
  ManualClock clock;
  const Clock::TimePoint start = clock.Now();
  EXPECT_EQ(clock.Now(), start);
  clock.Advance(seconds(3));
  EXPECT_EQ(clock.Now(), start + seconds(3));
  EXPECT_EQ(
      clock.NowNs() -
          std::chrono::duration_cast<std::chrono::nanoseconds>(start.time_since_epoch()).count(),
      3'000'000'000);
  clock.Advance(-seconds(1));  // the time never goes back
  EXPECT_EQ(clock.Now(), start + seconds(3));
}

TEST(ClockTest, ASleeperWakesWhenTheManualClockReachesItsDeadline) {
  ManualClock clock;
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(seconds(10));
    woke = true;
  });
  ASSERT_TRUE(clock.AwaitSleepers(1));
  clock.Advance(seconds(9));
  EXPECT_EQ(clock.sleepers(), 1);
  EXPECT_FALSE(woke.load());
  clock.Advance(seconds(1));
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_EQ(clock.sleepers(), 0);
  clock.SleepUntil(clock.Now());  // a deadline already reached does not block
}

TEST(ClockTest, ATimedWaitOnTheManualClockEndsOnlyOnceItsDeadlineIsReached) {
  ManualClock clock;
  std::mutex mu;
  std::condition_variable cv;
  bool notified = false;
  std::atomic<bool> timed_out{false};
  const uint64_t waits = clock.timed_waits();
  std::thread waiter([&] {
    std::unique_lock lock(mu);
    const Clock::TimePoint deadline = clock.Now() + seconds(60);
    while (!notified && clock.Now() < deadline)
      clock.WaitUntil(cv, lock, deadline);
    timed_out = !notified;
  });
  ASSERT_TRUE(clock.AwaitTimedWaits(waits));
  clock.Advance(seconds(59));
  EXPECT_FALSE(timed_out.load());
  clock.Advance(seconds(1));
  waiter.join();
  EXPECT_TRUE(timed_out.load());
}

TEST(ClockTest, ATimedWaitOnTheManualClockEndsWhenNotified) {
  ManualClock clock;
  std::mutex mu;
  std::condition_variable cv;
  bool notified = false;
  std::thread waiter([&] {
    std::unique_lock lock(mu);
    const Clock::TimePoint deadline = clock.Now() + seconds(60);
    while (!notified && clock.Now() < deadline)
      clock.WaitUntil(cv, lock, deadline);
    EXPECT_TRUE(notified);
  });
  {
    std::lock_guard lock(mu);
    notified = true;
  }
  cv.notify_all();
  waiter.join();
}

}  // namespace
}  // namespace strata
