// Clock: the time that timing logic reads and waits on, passed in so that the logic can be tested
// without sleeping (LevelDB's Env::NowMicros / SleepForMicroseconds, as an object of its own).
//
//   RealClock()   std::chrono::steady_clock. The default wherever a clock can be given.
//   ManualClock   a test's clock: its time stands still until the test calls Advance. Sleepers
//                 and timed waits end when the time they wait for has been reached.
//
// Time points are steady_clock time points on both, so a deadline is `Now() + duration` whatever
// the clock, and RealClock's NowNs() equals TraceRecorder::NowNs() (the same steady clock).
//
// What goes through a clock: deadlines and durations that decide what code does (a request's
// injected latency, a pacing horizon, a collective's timeout, a measured stall). What does not:
// progress polls with no deadline of their own (a spin that backs off), which a fake clock
// would only slow down.
//
// Threading: every method may be called from any thread. A ManualClock must outlive everything
// that waits on it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace strata {

class Clock {
 public:
  using Duration = std::chrono::steady_clock::duration;
  using TimePoint = std::chrono::steady_clock::time_point;

  virtual ~Clock() = default;

  virtual TimePoint Now() const = 0;
  // Now() in nanoseconds since the clock's epoch.
  int64_t NowNs() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Now().time_since_epoch()).count();
  }

  // Blocks the calling thread until Now() >= deadline.
  virtual void SleepUntil(TimePoint deadline) = 0;
  void SleepFor(Duration duration) { SleepUntil(Now() + duration); }

  // condition_variable::wait_until on this clock: `lock` holds the mutex `cv` waits with. Returns
  // when `cv` is notified, when Now() >= deadline, or spuriously, with the lock held again: the
  // caller loops and looks at its state and at Now(), as with wait_until.
  virtual void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         TimePoint deadline) = 0;

 protected:
  Clock() = default;
  Clock(const Clock&) = delete;
  Clock& operator=(const Clock&) = delete;
};

// The process's steady clock. Never destroyed.
Clock& RealClock();

// A clock that moves only when told to. Starts at an arbitrary fixed time point (one hour after
// the steady clock's epoch, so that "now minus a timeout" is still a valid time).
//
// SleepUntil blocks until Advance reaches the deadline. WaitUntil cannot be woken by Advance
// through the caller's condition variable (the clock does not know its mutex: taking it from
// Advance could deadlock), so it waits in real-time slices of at most kWaitSlice and returns
// once the deadline has been reached: a timed wait ends within one slice of the Advance that
// reaches its deadline, and never earlier.
class ManualClock final : public Clock {
 public:
  static constexpr std::chrono::milliseconds kWaitSlice{1};

  ManualClock();

  TimePoint Now() const override;
  void SleepUntil(TimePoint deadline) override;
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 TimePoint deadline) override;

  // Moves the time forward by `by` (>= 0) and wakes the sleepers whose deadline it reached.
  void Advance(Duration by);

  // Threads now blocked in SleepUntil on this clock.
  int sleepers() const;
  // Blocks, in real time, until at least `n` threads sleep on this clock (a test's way to know
  // that background work reached its sleep before it advances the time). False when that did not
  // happen within `real_timeout`.
  bool AwaitSleepers(int n, std::chrono::milliseconds real_timeout = std::chrono::seconds(30));
  // WaitUntil calls so far that waited (their deadline was not reached), and a wait, in real time,
  // until there are more than `seen`: a waiter computes its deadline before it waits, so once it
  // waited an Advance past that deadline is seen by it.
  uint64_t timed_waits() const;
  bool AwaitTimedWaits(uint64_t seen,
                       std::chrono::milliseconds real_timeout = std::chrono::seconds(30));

 private:
  mutable std::mutex mu_;
  std::condition_variable changed_;  // the time moved, or a sleeper came or went
  TimePoint now_;
  int sleepers_ = 0;
  uint64_t timed_waits_ = 0;  // WaitUntil calls that waited
};

}  // namespace strata
