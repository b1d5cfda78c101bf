// CpuOptimizerWorker: the thread that runs the CPU optimizer's per-unit jobs, its queue, its
// sticky error, and the books it keeps for the step — optimizer time, per-unit sums of squares
// of the gradient shards it took, and how many streamed gradient shards it freed. Private to
// src/zero.
//
// A job updates one unit. The driving thread queues it once the unit's gradient shard is final
// on the host (with an event to wait on when the shard's copy may still be in flight); the
// worker runs the jobs in queue order:
//
//   Queue(job) ──▶ queue ──▶ worker: wait grads_ready ─▶ [sum of squares] ─▶ update ─▶ [free
//   the gradient shard] ─▶ books under mu_; --pending; notify
//
// After a job fails, later jobs of the step are skipped (their units keep their states) and
// the first error is returned by Wait, which ends the step's optimizer work. What a job does is
// the engine's (Work); the worker owns when and on which thread.
//
// Ownership of a unit's host buffers (its gradient shard, its staged parameters) passes with
// the job: the driving thread writes them before Queue, the worker uses them (and may free the
// gradient shard) until the job is counted done, and the driving thread reads them again after
// Wait, or after TakeSumSquares / WaitForFreedGradShard saw the job done. mu_'s release and
// acquire at those points order the accesses.
//
// Threading: Start, Queue, Wait, BeginStep, CancelQueued, AddWorkTime, work_ns, TakeSumSquares,
// WaitForFreedGradShard and Stop are called by the engine's driving thread; the Work functions
// run on the worker's thread. mu_ guards every field below it; Work and the flags are written by
// Start before the thread exists and only read after.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "optim/adam.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::zero::engine_internal {

class CpuOptimizerWorker {
 public:
  struct Job {
    int unit = 0;
    std::shared_ptr<device::Event> grads_ready;  // the gradient shard is final on the host
    optim::AdamHyper hyper;                      // this job's own copy (no sharing with Step)
  };
  // What a job does, supplied by the engine.
  struct Work {
    std::function<double(int unit)> grad_sum_squares;  // when take_sum_squares
    std::function<Status(int unit, const optim::AdamHyper& hyper)> update;
    std::function<void(int unit)> free_grad_shard;  // when free_grad_shards, after a good update
    // Overlapped with backward: the job also takes the unit's share of the gradient norm.
    bool take_sum_squares = false;
    // Streamed gradient shards: a job frees its unit's once the update succeeded.
    bool free_grad_shards = false;
  };

  explicit CpuOptimizerWorker(device::Device& device) : device_(device) {}
  ~CpuOptimizerWorker() { Stop(); }
  CpuOptimizerWorker(const CpuOptimizerWorker&) = delete;
  CpuOptimizerWorker& operator=(const CpuOptimizerWorker&) = delete;

  // Sizes the per-unit books (every engine, with or without a CPU optimizer: the device
  // optimizer's time is counted here too).
  void Prepare(int units) EXCLUDES(mu_);
  // Starts the thread (engines with a CPU optimizer).
  void Start(Work work);
  // Stops and joins the thread once the queue is empty (the engine's destructor).
  void Stop() EXCLUDES(mu_);

  // A new step: the previous step's jobs are all done; its books start from zero.
  void BeginStep() EXCLUDES(mu_);
  void Queue(Job job) EXCLUDES(mu_);
  // Waits for every queued job; adds the wait to *waited_ns; returns and clears the first
  // error of the step's jobs.
  Status Wait(int64_t* waited_ns) EXCLUDES(mu_);
  // After a failed step: drops the jobs not started, waits for the running one, clears the
  // error.
  void CancelQueued() EXCLUDES(mu_);

  // Optimizer work this step (the jobs' and what AddWorkTime added: the device optimizer).
  void AddWorkTime(int64_t ns) EXCLUDES(mu_);
  int64_t work_ns() EXCLUDES(mu_);

  // Unit u's sum of squares as its job took it, if it did. `wait`: first wait until the job
  // took it or no job is pending (the wait is added to *waited_ns).
  std::optional<double> TakeSumSquares(int unit, bool wait, int64_t* waited_ns) EXCLUDES(mu_);
  // A streamed gradient shard found the pool full: waits until a job frees one, and returns
  // true (try again). False when no job is pending (none will free one); a job's error.
  Result<bool> WaitForFreedGradShard() EXCLUDES(mu_);

 private:
  void Loop() EXCLUDES(mu_);
  // The next job, or nothing once stopped with an empty queue.
  std::optional<Job> Next() EXCLUDES(mu_);
  bool Failed() EXCLUDES(mu_);

  device::Device& device_;
  Work work_;
  std::thread thread_;

  Mutex mu_;
  CondVar changed_;  // signalled on a new job, a finished job, and Stop
  std::deque<Job> queue_ GUARDED_BY(mu_);
  int pending_ GUARDED_BY(mu_) = 0;  // queued or running
  bool stop_ GUARDED_BY(mu_) = false;
  Status error_ GUARDED_BY(mu_);     // the step's first job error
  int64_t work_ns_ GUARDED_BY(mu_) = 0;
  uint64_t grad_shards_freed_ GUARDED_BY(mu_) = 0;
  // Per unit: the sum of squares of its host gradient shard, taken by the unit's job.
  std::vector<double> sum_squares_ GUARDED_BY(mu_);
  std::vector<char> sum_squares_ready_ GUARDED_BY(mu_);
};

}  // namespace strata::zero::engine_internal
