#include "common/clock.h"

#include <thread>

namespace strata {

namespace {

class SteadyClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  void SleepUntil(TimePoint deadline) override { std::this_thread::sleep_until(deadline); }
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 TimePoint deadline) override {
    cv.wait_until(lock, deadline);
  }
};

}  // namespace

Clock& RealClock() {
  static SteadyClock* const clock = new SteadyClock();  // never destroyed: threads may outlive main
  return *clock;
}

ManualClock::ManualClock() : now_(TimePoint{} + std::chrono::hours(1)) {}

Clock::TimePoint ManualClock::Now() const {
  std::lock_guard lock(mu_);
  return now_;
}

void ManualClock::SleepUntil(TimePoint deadline) {
  std::unique_lock lock(mu_);
  if (now_ >= deadline) return;
  ++sleepers_;
  changed_.notify_all();
  changed_.wait(lock, [&] { return now_ >= deadline; });
  --sleepers_;
  changed_.notify_all();
}

void ManualClock::WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                            TimePoint deadline) {
  {
    std::lock_guard guard(mu_);
    if (now_ >= deadline) return;
    ++timed_waits_;
  }
  changed_.notify_all();
  // One slice: the caller looks at its state and at Now() again when this returns.
  cv.wait_for(lock, kWaitSlice);
}

void ManualClock::Advance(Duration by) {
  {
    std::lock_guard lock(mu_);
    if (by > Duration::zero()) now_ += by;
  }
  changed_.notify_all();
}

int ManualClock::sleepers() const {
  std::lock_guard lock(mu_);
  return sleepers_;
}

bool ManualClock::AwaitSleepers(int n, std::chrono::milliseconds real_timeout) {
  std::unique_lock lock(mu_);
  return changed_.wait_for(lock, real_timeout, [&] { return sleepers_ >= n; });
}

uint64_t ManualClock::timed_waits() const {
  std::lock_guard lock(mu_);
  return timed_waits_;
}

bool ManualClock::AwaitTimedWaits(uint64_t seen, std::chrono::milliseconds real_timeout) {
  std::unique_lock lock(mu_);
  return changed_.wait_for(lock, real_timeout, [&] { return timed_waits_ > seen; });
}

}  // namespace strata
