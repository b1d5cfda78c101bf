#include "optim/lr_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace strata::optim {
namespace {

bool NeedsTotalSteps(SchedulerType type) {
  return type == SchedulerType::kWarmupDecayLR || type == SchedulerType::kWarmupCosineLR;
}

Status CheckRate(std::string_view key, double value) {
  if (value >= 0.0 && std::isfinite(value)) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("LR schedule: {} is {}; expected a finite value >= 0", key, value));
}

}  // namespace

Result<LrSchedule> LrSchedule::Create(const SchedulerConfig& scheduler,
                                      const OptimizerConfig& optimizer) {
  const std::string_view name = SchedulerTypeName(scheduler.type);
  STRATA_RETURN_IF_ERROR(CheckRate("optimizer.params.lr", optimizer.lr));
  if (scheduler.type == SchedulerType::kConstant) {
    return LrSchedule(scheduler, optimizer.lr);
  }
  if (scheduler.warmup_num_steps < 1) {
    return InvalidArgumentError(
        fmt::format("LR schedule {}: scheduler.params.warmup_num_steps is {}; expected >= 1", name,
                    scheduler.warmup_num_steps));
  }
  if (scheduler.type == SchedulerType::kWarmupCosineLR) {
    STRATA_RETURN_IF_ERROR(
        CheckRate("scheduler.params.warmup_min_ratio", scheduler.warmup_min_ratio));
    STRATA_RETURN_IF_ERROR(CheckRate("scheduler.params.cos_min_ratio", scheduler.cos_min_ratio));
  } else {
    STRATA_RETURN_IF_ERROR(CheckRate("scheduler.params.warmup_min_lr", scheduler.warmup_min_lr));
    STRATA_RETURN_IF_ERROR(CheckRate("scheduler.params.warmup_max_lr", scheduler.warmup_max_lr));
  }
  if (NeedsTotalSteps(scheduler.type)) {
    if (!scheduler.total_num_steps.has_value()) {
      return FailedPreconditionError(fmt::format(
          "LR schedule {}: scheduler.params.total_num_steps is \"auto\" and was not resolved; "
          "set it from the run length before building the schedule",
          name));
    }
    if (*scheduler.total_num_steps < 1) {
      return InvalidArgumentError(
          fmt::format("LR schedule {}: scheduler.params.total_num_steps is {}; expected >= 1", name,
                      *scheduler.total_num_steps));
    }
  }
  return LrSchedule(scheduler, optimizer.lr);
}

LrSchedule::LrSchedule(const SchedulerConfig& scheduler, double optimizer_lr)
    : config_(scheduler),
      optimizer_lr_(optimizer_lr),
      warmup_steps_(std::max<int64_t>(2, scheduler.warmup_num_steps)),
      total_steps_(scheduler.total_num_steps.value_or(0)) {}

double LrSchedule::WarmupGamma(int64_t i) const {
  const auto w = static_cast<double>(warmup_steps_);
  if (config_.warmup_type == WarmupType::kLinear) return static_cast<double>(i) / w;
  return std::log(static_cast<double>(i) + 1.0) / std::log(w);
}

double LrSchedule::LrAt(int64_t step) const {
  if (config_.type == SchedulerType::kConstant) return optimizer_lr_;
  const int64_t i = config_.last_batch_iteration + std::max<int64_t>(0, step);
  const double min_lr = config_.warmup_min_lr;
  const double delta = config_.warmup_max_lr - config_.warmup_min_lr;
  switch (config_.type) {
    case SchedulerType::kConstant:
      return optimizer_lr_;
    case SchedulerType::kWarmupLR:
      if (i < 0) return min_lr;
      return min_lr + delta * (i < warmup_steps_ ? WarmupGamma(i) : 1.0);
    case SchedulerType::kWarmupDecayLR: {
      if (i < 0) return min_lr;
      if (i < warmup_steps_) return min_lr + delta * WarmupGamma(i);
      const double decay = static_cast<double>(total_steps_ - i) /
                           std::max(1.0, static_cast<double>(total_steps_ - warmup_steps_));
      return min_lr + delta * std::max(0.0, decay);
    }
    case SchedulerType::kWarmupCosineLR: {
      if (i < 0) return 0.0;
      if (i < warmup_steps_) {
        const double wmr = config_.warmup_min_ratio;
        return optimizer_lr_ * (wmr + (1.0 - wmr) * WarmupGamma(i));
      }
      const double progress = std::min(
          1.0, static_cast<double>(i - warmup_steps_ + 1) /
                   static_cast<double>(std::max<int64_t>(1, total_steps_ - warmup_steps_)));
      const double cmr = config_.cos_min_ratio;
      const double ratio = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
      return optimizer_lr_ * std::max(0.0, cmr + (1.0 - cmr) * ratio);
    }
  }
  return optimizer_lr_;
}

}  // namespace strata::optim
