// LrSchedule: the learning rate of each optimizer step, as DeepSpeed's schedulers
// (deepspeed/runtime/lr_schedules.py) set it.
//
//   STRATA_ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::Create(config.scheduler,
//                                                                  config.optimizer));
//   hyper.lr = schedule.LrAt(applied_steps);
//
// How DeepSpeed drives a scheduler, which this reproduces: the scheduler starts at
// last_batch_iteration = L (-1 for a fresh run) and is stepped (L += 1) after every optimizer
// step that was applied, never after one skipped for an fp16 overflow. The step taken after k
// applied steps therefore runs with f(L + k), where f(i) for i >= 0 is the schedule below and
// f(i < 0) is what the scheduler sets before it has started: warmup_min_lr (WarmupLR,
// WarmupDecayLR) or 0 (WarmupCosineLR). (On resume DeepSpeed restores the optimizer's lr from the
// checkpoint, which holds f(L) for the L saved; f(L + 0) is that value.)
//
// With W = max(2, warmup_num_steps) (DeepSpeed's floor), T = total_num_steps and, during warmup
// (i < W), gamma(i) = ln(i + 1) / ln(W) (log) or i / W (linear):
//   constant        f(i) = optimizer.lr
//   WarmupLR        f(i) = min + (max - min) * (i < W ? gamma(i) : 1)
//   WarmupDecayLR   f(i) = min + (max - min) * (i < W ? gamma(i) : max(0, (T - i) / max(1, T - W)))
//   WarmupCosineLR  f(i) = optimizer.lr * ratio(i), ratio(i) =
//                     i < W:  wmr + (1 - wmr) * gamma(i)
//                     else:   max(0, cmr + (1 - cmr) * (1 + cos(pi * min(1, (i - W + 1) /
//                                                                    max(1, T - W)))) / 2)
// where min / max are warmup_min_lr / warmup_max_lr, wmr = warmup_min_ratio and
// cmr = cos_min_ratio. The cosine's progress is clamped at 1 as current DeepSpeed does, so the
// rate stays at cos_min_ratio * lr after T instead of rising again.
//
// Thread safety: a value type; const methods may be called from any thread.
#pragma once

#include <cstdint>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::optim {

class LrSchedule {
 public:
  // FailedPrecondition, naming scheduler.params.total_num_steps, when the type needs
  // total_num_steps (WarmupDecayLR, WarmupCosineLR) and it is still nullopt ("auto": the trainer
  // must fill it in from the run length first). InvalidArgument for values a loaded Config never
  // holds (warmup_num_steps < 1, a negative or non-finite rate, total_num_steps < 1).
  static Result<LrSchedule> Create(const SchedulerConfig& scheduler,
                                   const OptimizerConfig& optimizer);

  // The learning rate of the optimizer step taken after `step` applied steps (0 for the first
  // step of the run or of the resumed run). step >= 0.
  double LrAt(int64_t step) const;

  SchedulerType type() const { return config_.type; }

 private:
  LrSchedule(const SchedulerConfig& scheduler, double optimizer_lr);

  // DeepSpeed's warmup fraction gamma(i) for 0 <= i < W.
  double WarmupGamma(int64_t i) const;

  SchedulerConfig config_;
  double optimizer_lr_ = 0.0;
  int64_t warmup_steps_ = 2;  // W
  int64_t total_steps_ = 0;   // T (0 when the type does not use it)
};

}  // namespace strata::optim
