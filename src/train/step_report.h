// What a training run says about each step (trainer.h): rank 0's progress line, the --metrics
// JSON line and DeepSpeed's "tensorboard" / "csv_monitor" events, from one StepResult and the
// engine's counters. The NVMe bytes and pageable copies are per step: the reporter keeps what it
// saw last.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"
#include "train/monitor.h"
#include "train/run.h"
#include "zero/engine.h"

namespace strata::train {

class StepReporter {
 public:
  // Opens --metrics on rank 0 (appending when resumed: the file then holds the whole curve) and
  // the config's monitors (saying where each writes). PermissionDenied names a file that cannot
  // be opened.
  static Result<std::unique_ptr<StepReporter>> Open(const RunPlan& plan, Run& run);
  ~StepReporter();

  // Step `done` (1-based) finished with `result`: says its line (rank 0).
  void SayStep(int64_t done, const zero::StepResult& result);
  // Then, after the validation that may follow it (`eval`): says the validation's line and
  // writes the step's metrics line and monitor events (with the figures SayStep measured).
  Status Record(int64_t done, const zero::StepResult& result, const std::optional<EvalResult>& eval);

  // Copies made outside the steps (a checkpoint's) are not counted as the next step's.
  void ForgetPageableCopies();

 private:
  StepReporter(const RunPlan& plan, Run& run);
  // One step's figures, derived from the result and the counters' change since the last step.
  struct Figures;
  void Measure(const zero::StepResult& r);
  std::string Line(int64_t done, const zero::StepResult& r, const Figures& f) const;
  Status WriteMetrics(int64_t done, const zero::StepResult& r, const Figures& f,
                      const std::optional<EvalResult>& eval);
  Status WriteMonitors(int64_t done, const zero::StepResult& r, const Figures& f,
                       const std::optional<EvalResult>& eval);

  const RunPlan& plan_;
  Run& run_;
  double flops_per_token_ = 0;
  uint64_t tokens_per_step_ = 0;
  zero::EngineStats last_{};
  uint64_t pageable_seen_ = 0;
  std::unique_ptr<Figures> current_;  // the step SayStep measured
  std::unique_ptr<File> metrics_;  // --metrics (rank 0)
  uint64_t metrics_size_ = 0;
  std::vector<std::unique_ptr<MonitorWriter>> monitors_;
};

}  // namespace strata::train
