#include "zero/cpu_optimizer_worker.h"

#include <algorithm>
#include <utility>

#include "strata/trace.h"

namespace strata::zero::engine_internal {

void CpuOptimizerWorker::Prepare(int units) {
  MutexLock lock(mu_);
  sum_squares_.assign(static_cast<size_t>(units), 0.0);
  sum_squares_ready_.assign(static_cast<size_t>(units), 0);
}

void CpuOptimizerWorker::Start(Work work) {
  work_ = std::move(work);
  thread_ = std::thread([this] { Loop(); });
}

void CpuOptimizerWorker::Stop() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  changed_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

std::optional<CpuOptimizerWorker::Job> CpuOptimizerWorker::Next() {
  MutexLock lock(mu_);
  while (!stop_ && queue_.empty()) changed_.Wait(mu_);
  if (queue_.empty()) return std::nullopt;
  Job job = queue_.front();
  queue_.pop_front();
  return job;
}

bool CpuOptimizerWorker::Failed() {
  MutexLock lock(mu_);
  return !error_.ok();
}

void CpuOptimizerWorker::Loop() {
  for (;;) {
    std::optional<Job> job = Next();
    if (!job) return;
    const int u = job->unit;
    Status st;
    if (job->grads_ready) st = device_.Synchronize(*job->grads_ready);
    const int64_t t0 = TraceRecorder::NowNs();
    const bool skip = Failed();  // an earlier job of the step failed: leave the unit as it is
    // Overlapped with backward: the unit's gradient is final, so its share of the gradient norm
    // is taken here too, off the step's critical path (on one H100 machine the norm of a 1.1B
    // model's host gradients, summed after backward, was most of a 1.65 s step).
    double sum_squares = 0.0;
    const bool take_norm = st.ok() && !skip && work_.take_sum_squares;
    if (take_norm) sum_squares = work_.grad_sum_squares(u);
    if (st.ok() && !skip) st = work_.update(u, job->hyper);
    const int64_t t1 = TraceRecorder::NowNs();
    // A streamed gradient shard is done with once its update succeeded (its share of the norm
    // is taken); a failed or skipped job keeps it for the step's norm.
    const bool free_grad = work_.free_grad_shards && st.ok() && !skip;
    if (free_grad) work_.free_grad_shard(u);
    {
      MutexLock lock(mu_);
      if (free_grad) ++grad_shards_freed_;
      if (take_norm) {
        sum_squares_[static_cast<size_t>(u)] = sum_squares;
        sum_squares_ready_[static_cast<size_t>(u)] = true;
      }
      work_ns_ += t1 - t0;
      if (!st.ok() && error_.ok()) error_ = st;
      --pending_;
    }
    changed_.NotifyAll();
  }
}

void CpuOptimizerWorker::BeginStep() {
  MutexLock lock(mu_);
  work_ns_ = 0;
  std::fill(sum_squares_ready_.begin(), sum_squares_ready_.end(), 0);
}

void CpuOptimizerWorker::Queue(Job job) {
  {
    MutexLock lock(mu_);
    queue_.push_back(std::move(job));
    ++pending_;
  }
  changed_.NotifyAll();
}

Status CpuOptimizerWorker::Wait(int64_t* waited_ns) {
  const int64_t t0 = TraceRecorder::NowNs();
  MutexLock lock(mu_);
  while (pending_ != 0) changed_.Wait(mu_);
  *waited_ns += TraceRecorder::NowNs() - t0;
  Status st = error_;
  error_ = Status::Ok();
  return st;
}

void CpuOptimizerWorker::CancelQueued() {
  MutexLock lock(mu_);
  pending_ -= static_cast<int>(queue_.size());
  queue_.clear();
  while (pending_ != 0) changed_.Wait(mu_);
  error_ = Status::Ok();
}

void CpuOptimizerWorker::AddWorkTime(int64_t ns) {
  MutexLock lock(mu_);
  work_ns_ += ns;
}

int64_t CpuOptimizerWorker::work_ns() {
  MutexLock lock(mu_);
  return work_ns_;
}

std::optional<double> CpuOptimizerWorker::TakeSumSquares(int unit, bool wait,
                                                         int64_t* waited_ns) {
  const auto u = static_cast<size_t>(unit);
  MutexLock lock(mu_);
  if (wait) {
    const int64_t t0 = TraceRecorder::NowNs();
    while (!(sum_squares_ready_[u] || pending_ == 0)) changed_.Wait(mu_);
    *waited_ns += TraceRecorder::NowNs() - t0;
  }
  if (sum_squares_ready_[u]) return sum_squares_[u];
  return std::nullopt;
}

Result<bool> CpuOptimizerWorker::WaitForFreedGradShard() {
  MutexLock lock(mu_);
  if (!error_.ok()) return error_;
  if (pending_ == 0) return false;
  const uint64_t seen = grad_shards_freed_;
  while (!(grad_shards_freed_ != seen || pending_ == 0 || !error_.ok())) changed_.Wait(mu_);
  return true;
}

}  // namespace strata::zero::engine_internal
