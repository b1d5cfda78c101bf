#include "io/fault_injection.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <condition_variable>
#include <queue>
#include <thread>

#include "common/errno.h"
#include "io/io_internal.h"
#include "io/store_wrapper.h"

namespace strata::io {

FaultInjector::FaultInjector(uint64_t seed, Clock* clock)
    : clock_(clock != nullptr ? clock : &RealClock()), rng_(seed) {}

size_t FaultInjector::AddRule(FaultRule rule) {
  std::lock_guard lock(mu_);
  return rules_.Add(std::move(rule));
}

void FaultInjector::Clear() {
  std::lock_guard lock(mu_);
  rules_.Clear();
}

FaultDecision FaultInjector::Decide(IoOp op, std::string_view path, uint64_t offset,
                                    uint64_t length, uint32_t alignment) {
  FaultDecision d;
  d.length = length;
  std::lock_guard lock(mu_);
  for (auto& rs : rules_.entries()) {
    const FaultRule& r = rs.rule;
    if (r.op && *r.op != op) continue;
    if (!r.path_contains.empty() && path.find(r.path_contains) == std::string_view::npos) continue;
    if (offset + length <= r.offset_begin || offset >= r.offset_end) continue;
    if (r.max_hits >= 0 && rs.hits >= static_cast<uint64_t>(r.max_hits)) continue;
    const uint64_t ordinal = rs.seen++;
    bool hit;
    if (!r.ordinals.empty()) {
      hit = std::find(r.ordinals.begin(), r.ordinals.end(), ordinal) != r.ordinals.end();
    } else if (r.probability >= 1.0) {
      hit = true;
    } else {
      hit = std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < r.probability;
    }
    if (!hit) continue;
    switch (r.kind) {
      case FaultKind::kError:
        if (d.error == 0) {
          d.error = r.error;
          ++rs.hits;
        }
        break;
      case FaultKind::kShortTransfer: {
        const uint64_t a = std::max<uint32_t>(alignment, 1);
        uint64_t n = r.short_bytes > 0 ? r.short_bytes : length / 2;
        n = n / a * a;
        if (n > 0 && n < length) {
          d.length = std::min(d.length, n);
          ++rs.hits;
        }
        break;
      }
      case FaultKind::kCorrupt:
        if (op == IoOp::kRead && !d.corrupt) {
          d.corrupt = true;
          ++rs.hits;
        }
        break;
      case FaultKind::kLatency:
        d.latency = std::max(d.latency, r.latency);
        ++rs.hits;
        break;
    }
  }
  return d;
}

uint64_t FaultInjector::hits(size_t index) const {
  std::lock_guard lock(mu_);
  return rules_.hits(index);
}

uint64_t FaultInjector::total_hits() const {
  std::lock_guard lock(mu_);
  return rules_.total_hits();
}

namespace {

// Delays or fails requests on their way to the inner store. A single timer thread runs the
// scheduled actions in deadline order; callbacks of failed requests run on it.
//
// Every request the wrapper accepted is counted until its callback has returned: `scheduled_`
// (waiting for its deadline), `running_` (its action running now) and `forwarded_` (passed to the
// inner store). The destructor waits for all three to be zero at once, which also covers
// callbacks that submit more work, and only then stops the timer and destroys the inner store.
class FaultInjectingStore final : public internal::StoreWrapper {
 public:
  FaultInjectingStore(std::unique_ptr<BlockStore> inner, std::shared_ptr<FaultInjector> faults)
      : StoreWrapper(std::move(inner), "faulty", "", "delayed request(s)"),
        faults_(std::move(faults)),
        timer_([this] { TimerLoop(); }) {}

  ~FaultInjectingStore() override {
    {
      std::unique_lock lock(mu_);
      idle_cv_.wait(lock, [&] { return scheduled_.empty() && running_ == 0 && forwarded_ == 0; });
      stop_ = true;
    }
    cv_.notify_all();
    timer_.join();
    inner_.reset();
  }

  Status Submit(std::span<IoRequest> requests) override {
    // Validate everything first so that acceptance stays all-or-nothing.
    std::vector<FileInfo> infos;
    infos.reserve(requests.size());
    for (const IoRequest& r : requests) {
      STRATA_ASSIGN_OR_RETURN(FileInfo info, inner_->Info(r.file));
      STRATA_RETURN_IF_ERROR(internal::ValidateRequest(r, info, internal::DescribePaths(info)));
      infos.push_back(std::move(info));
    }
    std::vector<IoRequest> now;
    std::vector<size_t> later;
    std::vector<FaultDecision> decisions(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      const IoRequest& r = requests[i];
      decisions[i] =
          faults_->Decide(r.op, infos[i].paths.front(), r.offset, r.length, infos[i].alignment);
      if (decisions[i].error == 0 && decisions[i].latency.count() == 0) {
        // A copy: the caller's request stays intact on failure.
        now.push_back(Forwarded(r, false, decisions[i].corrupt));
      } else {
        later.push_back(i);
      }
    }
    if (!now.empty()) {
      {
        std::lock_guard lock(mu_);
        forwarded_ += static_cast<int64_t>(now.size());
      }
      Status st = inner_->Submit(now);
      if (!st.ok()) {
        std::lock_guard lock(mu_);
        forwarded_ -= static_cast<int64_t>(now.size());
        if (Idle()) idle_cv_.notify_all();
        return st;
      }
    }
    const Clock::TimePoint t0 = faults_->clock().Now();
    for (size_t i : later) {
      Action a;
      a.deadline = t0 + decisions[i].latency;
      a.request = std::move(requests[i]);
      a.corrupt = decisions[i].corrupt;
      if (decisions[i].error != 0) {
        a.error = ErrnoToStatus(
            decisions[i].error,
            internal::DescribeTransfer(a.request.op, internal::DescribePaths(infos[i]),
                                       a.request.offset, a.request.length) +
                " (injected fault)");
      }
      Schedule(std::move(a));
    }
    return Status::Ok();
  }

 private:
  struct Action {
    Clock::TimePoint deadline;
    IoRequest request;
    Status error;  // non-OK: complete with it instead of forwarding
    bool corrupt = false;
  };
  struct Later {
    bool operator()(const std::shared_ptr<Action>& a, const std::shared_ptr<Action>& b) const {
      return a->deadline > b->deadline;
    }
  };

  bool Idle() const { return scheduled_.empty() && running_ == 0 && forwarded_ == 0; }

  // A copy of `r` whose callback also counts the request done once the caller's callback returns.
  // With `held`, the request was delayed by the wrapper, and stops counting as held before the
  // caller's callback runs (so that a caller woken by it may close the file at once).
  // With `corrupt`, a successful read's bytes are changed first (one bit in every 512 bytes, at
  // positions that depend on the offset).
  IoRequest Forwarded(const IoRequest& r, bool held, bool corrupt) {
    IoRequest copy = r;
    copy.done = [this, user = r.done, held, corrupt, file = r.file, buffer = r.buffer,
                 offset = r.offset, length = r.length](const Status& s) {
      if (corrupt && s.ok()) {
        auto* bytes = static_cast<unsigned char*>(buffer);
        for (uint64_t at = (offset * 2654435761u) % 512; at < length; at += 512) {
          bytes[at] ^= static_cast<unsigned char>(1u << (at % 8));
        }
      }
      if (held) LetGo(file);
      user(s);
      std::lock_guard lock(mu_);
      if (--forwarded_ == 0 && Idle()) idle_cv_.notify_all();
    };
    return copy;
  }

  void Schedule(Action a) {
    Hold(a.request.file);  // a request scheduled by the wrapper counts for Close
    {
      std::lock_guard lock(mu_);
      scheduled_.push(std::make_shared<Action>(std::move(a)));
    }
    cv_.notify_all();
  }

  void TimerLoop() {
    std::unique_lock lock(mu_);
    while (true) {
      if (scheduled_.empty()) {
        if (stop_) return;
        cv_.wait(lock);
        continue;
      }
      auto next = scheduled_.top();
      if (faults_->clock().Now() < next->deadline) {
        faults_->clock().WaitUntil(cv_, lock, next->deadline);
        continue;
      }
      scheduled_.pop();
      ++running_;
      lock.unlock();
      Run(*next);
      lock.lock();
      --running_;
      if (Idle()) idle_cv_.notify_all();
    }
  }

  void Run(Action& a) {
    if (!a.error.ok()) {
      LetGo(a.request.file);
      a.request.done(a.error);
      return;
    }
    IoRequest forwarded = Forwarded(a.request, true, a.corrupt);
    {
      std::lock_guard lock(mu_);
      ++forwarded_;
    }
    Status st = inner_->Submit(forwarded);
    if (!st.ok()) {
      {
        std::lock_guard lock(mu_);
        --forwarded_;
      }
      LetGo(a.request.file);
      a.request.done(st);  // e.g. the inner store failed meanwhile
    }
  }

  std::shared_ptr<FaultInjector> faults_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::priority_queue<std::shared_ptr<Action>, std::vector<std::shared_ptr<Action>>, Later>
      scheduled_;
  int running_ = 0;
  int64_t forwarded_ = 0;
  bool stop_ = false;
  std::thread timer_;
};

}  // namespace

std::unique_ptr<BlockStore> CreateFaultInjectingStore(std::unique_ptr<BlockStore> inner,
                                                      std::shared_ptr<FaultInjector> faults) {
  return std::make_unique<FaultInjectingStore>(std::move(inner), std::move(faults));
}

Result<FaultPlan> ParseFaultSpec(std::string_view spec) {
  FaultPlan plan;
  plan.text = std::string(spec);
  uint64_t seed = 1;
  struct Want {
    std::string kind;
    double p;
  };
  std::vector<Want> wants;
  size_t at = 0;
  while (at <= spec.size()) {
    size_t end = spec.find(',', at);
    if (end == std::string_view::npos) end = spec.size();
    const std::string_view item = spec.substr(at, end - at);
    at = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key(item.substr(0, eq));
    const std::string value = eq == std::string_view::npos ? "" : std::string(item.substr(eq + 1));
    auto bad = [&](std::string_view why) {
      return InvalidArgumentError(fmt::format(
          "STRATA_FAULT_INJECT='{}': '{}': {}; expected kind=probability with kinds eio, enospc, "
          "eagain, short, corrupt, and seed=N",
          spec, item, why));
    };
    if (eq == std::string_view::npos || value.empty()) return bad("no value");
    char* stop = nullptr;
    if (key == "seed") {
      seed = std::strtoull(value.c_str(), &stop, 10);
      if (*stop != '\0') return bad("not a whole number");
      continue;
    }
    if (key != "eio" && key != "enospc" && key != "eagain" && key != "short" && key != "corrupt") {
      return bad("unknown kind");
    }
    const double p = std::strtod(value.c_str(), &stop);
    if (*stop != '\0' || !(p >= 0.0 && p <= 1.0)) return bad("not a probability in [0, 1]");
    wants.push_back({key, p});
  }
  if (wants.empty()) return InvalidArgumentError(fmt::format("STRATA_FAULT_INJECT='{}': no fault kind given", spec));
  plan.backend = std::make_shared<FaultInjector>(seed);
  plan.wrapper = std::make_shared<FaultInjector>(seed ^ 0x9e3779b97f4a7c15ull);
  for (const Want& w : wants) {
    FaultRule r;
    r.probability = w.p;
    FaultInjector* target = plan.wrapper.get();
    if (w.kind == "eio") {
      r.error = EIO;
    } else if (w.kind == "enospc") {
      r.error = ENOSPC;
      r.op = IoOp::kWrite;
    } else if (w.kind == "corrupt") {
      r.kind = FaultKind::kCorrupt;
      r.op = IoOp::kRead;
    } else if (w.kind == "eagain") {
      r.error = EAGAIN;
      target = plan.backend.get();
    } else {
      r.kind = FaultKind::kShortTransfer;
      target = plan.backend.get();
    }
    plan.rules_.push_back({w.kind, {target, target->AddRule(r)}});
  }
  return plan;
}

uint64_t FaultPlan::total() const {
  uint64_t n = 0;
  for (const auto& [kind, rule] : rules_) n += rule.first->hits(rule.second);
  return n;
}

std::string FaultPlan::Summary() const {
  std::string out;
  for (const auto& [kind, rule] : rules_) {
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", kind, rule.first->hits(rule.second));
  }
  return fmt::format("{} ({} in all)", out, total());
}

}  // namespace strata::io
