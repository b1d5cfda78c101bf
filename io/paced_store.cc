#include "io/paced_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "common/units.h"
#include "io/io_internal.h"
#include "io/store_wrapper.h"

namespace strata::io {
namespace {

// One accepted request: it completes once both its paced service has ended (the timer thread saw
// its deadline pass) and the inner store has finished it; whichever comes second runs the callback.
struct Entry {
  Clock::TimePoint deadline;
  FileId file = 0;
  IoCallback done;
  Status status;
  bool deadline_passed = false;
  bool inner_done = false;
};

// Requests are counted in `outstanding_` from Submit until their callback returned; the destructor
// waits for zero (which also covers callbacks that submit more), then stops the timer and destroys
// the inner store. Deadlines never decrease in submission order, so the timer's queue is a FIFO.
class PacedStore final : public internal::StoreWrapper {
 public:
  PacedStore(std::unique_ptr<BlockStore> inner, double bytes_per_second, Clock& clock)
      : StoreWrapper(std::move(inner), "paced",
                     FormatBytes(static_cast<uint64_t>(bytes_per_second)) + "/s", "request(s)"),
        ns_per_byte_(1e9 / bytes_per_second),
        clock_(clock),
        busy_(&clock),
        timer_([this] { TimerLoop(); }) {}

  ~PacedStore() override {
    {
      std::unique_lock lock(mu_);
      idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
      stop_ = true;
    }
    cv_.notify_all();
    timer_.join();
    inner_.reset();
  }

  StoreStats stats() const override {
    StoreStats s = inner_->stats();
    s.busy_ns = busy_.TotalNs();
    return s;
  }

  Status Submit(std::span<IoRequest> requests) override {
    if (requests.empty()) return Status::Ok();
    // Everything that can throw is built before the lock; under it, only the deadlines are set
    // and the entries queued, so that a batch is either all queued and counted or not at all.
    std::vector<std::shared_ptr<Entry>> entries;
    std::vector<IoRequest> forwarded;
    entries.reserve(requests.size());
    forwarded.reserve(requests.size());
    for (const IoRequest& r : requests) {
      auto e = std::make_shared<Entry>();
      e->file = r.file;
      e->done = r.done;  // a copy: the caller's request stays intact if the inner store refuses
      IoRequest copy = r;
      copy.done = [this, e](const Status& s) { OnInnerDone(e, s); };
      forwarded.push_back(std::move(copy));
      entries.push_back(std::move(e));
    }
    Clock::TimePoint before;
    uint64_t batch = 0;
    {
      std::lock_guard lock(mu_);
      before = horizon_;
      batch = ++batches_;
      Clock::TimePoint t = std::max(clock_.Now(), horizon_);
      for (size_t i = 0; i < requests.size(); ++i) {
        t += std::chrono::nanoseconds(
            std::llround(static_cast<double>(requests[i].length) * ns_per_byte_));
        entries[i]->deadline = t;
        queue_.push_back(entries[i]);
        Hold(entries[i]->file);
        busy_.Enter();
      }
      horizon_ = t;
      outstanding_ += static_cast<int64_t>(requests.size());
    }
    cv_.notify_all();
    Status st = inner_->Submit(forwarded);
    if (!st.ok()) {
      // Nothing was accepted: take the entries out of the timer's queue (the timer must not wait
      // for their deadlines), and give the service time back if no later batch was paced behind
      // this one (otherwise those requests keep their deadlines, and the gap stays).
      {
        std::lock_guard lock(mu_);
        if (batches_ == batch) horizon_ = before;
        std::erase_if(queue_, [&](const std::shared_ptr<Entry>& q) {
          return std::find(entries.begin(), entries.end(), q) != entries.end();
        });
        for (const auto& e : entries) {
          LetGo(e->file);
          busy_.Leave();
        }
        outstanding_ -= static_cast<int64_t>(entries.size());
        if (outstanding_ == 0) idle_cv_.notify_all();
      }
      cv_.notify_all();
      return st;
    }
    return Status::Ok();
  }

 private:
  void OnInnerDone(const std::shared_ptr<Entry>& e, const Status& s) {
    bool finish = false;
    {
      std::lock_guard lock(mu_);
      e->status = s;
      e->inner_done = true;
      finish = e->deadline_passed;
    }
    if (finish) Finish(*e);
  }

  void Finish(Entry& e) {
    LetGo(e.file);  // before the callback, so that the caller may close the file once called back
    IoCallback done = std::move(e.done);
    done(e.status);
    busy_.Leave();
    std::lock_guard lock(mu_);
    if (--outstanding_ == 0) idle_cv_.notify_all();
  }

  void TimerLoop() {
    std::unique_lock lock(mu_);
    while (true) {
      if (queue_.empty()) {
        if (stop_) return;
        cv_.wait(lock);
        continue;
      }
      std::shared_ptr<Entry> next = queue_.front();
      if (clock_.Now() < next->deadline) {
        clock_.WaitUntil(cv_, lock, next->deadline);
        continue;
      }
      queue_.pop_front();
      next->deadline_passed = true;
      if (!next->inner_done) continue;  // the inner store's callback will finish it
      lock.unlock();
      Finish(*next);
      lock.lock();
    }
  }

  const double ns_per_byte_;
  Clock& clock_;
  internal::BusyClock busy_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::shared_ptr<Entry>> queue_;
  Clock::TimePoint horizon_{};   // when the last queued request's service ends
  uint64_t batches_ = 0;         // batches paced so far (a refused batch rolls back only if last)
  int64_t outstanding_ = 0;
  bool stop_ = false;
  std::thread timer_;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> CreatePacedStore(std::unique_ptr<BlockStore> inner,
                                                     double bytes_per_second, Clock* clock) {
  if (inner == nullptr) return InvalidArgumentError("paced store: no inner store");
  if (!std::isfinite(bytes_per_second) || bytes_per_second < 1024.0 * 1024.0) {
    return InvalidArgumentError(fmt::format(
        "paced store: bandwidth {} bytes/s is not a finite rate of at least 1 MiB/s",
        bytes_per_second));
  }
  return std::unique_ptr<BlockStore>(std::make_unique<PacedStore>(
      std::move(inner), bytes_per_second, clock != nullptr ? *clock : RealClock()));
}

}  // namespace strata::io
