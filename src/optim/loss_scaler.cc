#include "optim/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/log.h"

namespace strata::optim {

Result<LossScaler> LossScaler::Create(const Fp16Config& fp16) {
  if (!(fp16.loss_scale >= 0.0 && std::isfinite(fp16.loss_scale))) {
    return InvalidArgumentError(fmt::format(
        "fp16.loss_scale is {}; expected 0 (dynamic) or a finite scale > 0", fp16.loss_scale));
  }
  if (!fp16.enabled) return LossScaler(fp16, false, 1.0);
  if (!fp16.dynamic_loss_scale()) return LossScaler(fp16, false, fp16.loss_scale);
  if (fp16.initial_scale_power < 0 || fp16.initial_scale_power > 127) {
    return InvalidArgumentError(fmt::format(
        "fp16.initial_scale_power is {}; expected a value in [0, 127]", fp16.initial_scale_power));
  }
  if (fp16.loss_scale_window < 1) {
    return InvalidArgumentError(
        fmt::format("fp16.loss_scale_window is {}; expected >= 1", fp16.loss_scale_window));
  }
  if (fp16.hysteresis < 1) {
    return InvalidArgumentError(
        fmt::format("fp16.hysteresis is {}; expected >= 1", fp16.hysteresis));
  }
  if (!(fp16.min_loss_scale > 0.0 && std::isfinite(fp16.min_loss_scale))) {
    return InvalidArgumentError(
        fmt::format("fp16.min_loss_scale is {}; expected a finite value > 0", fp16.min_loss_scale));
  }
  return LossScaler(fp16, true, std::ldexp(1.0, fp16.initial_scale_power));
}

LossScaler::LossScaler(const Fp16Config& fp16, bool dynamic, double initial_scale)
    : config_(fp16), dynamic_(dynamic) {
  state_.scale = initial_scale;
  state_.hysteresis_left = std::max(1, fp16.hysteresis);
}

bool LossScaler::Update(bool overflow) {
  if (!dynamic_) return overflow;
  LossScalerState& s = state_;
  if (overflow) {
    if (config_.hysteresis == 1 || s.hysteresis_left == 1) {
      if (s.scale == config_.min_loss_scale) ++s.overflows_at_min_scale;
      const double next = std::max(s.scale / 2.0, config_.min_loss_scale);
      STRATA_LOG(info, optim, "fp16 overflow at step {}: skipping it; loss scale {} -> {}",
                 s.iteration, s.scale, next);
      s.scale = next;
    } else {
      --s.hysteresis_left;
      STRATA_LOG(info, optim,
                 "fp16 overflow at step {}: skipping it; loss scale stays {} (hysteresis left {})",
                 s.iteration, s.scale, s.hysteresis_left);
    }
    s.last_overflow_iteration = s.iteration;
  } else {
    if (config_.consecutive_hysteresis) s.hysteresis_left = config_.hysteresis;
    const int64_t stable = s.iteration - s.last_overflow_iteration - 1;
    if (stable > 0 && stable % config_.loss_scale_window == 0) {
      if (!config_.consecutive_hysteresis) s.hysteresis_left = config_.hysteresis;
      s.scale *= 2.0;
    }
  }
  ++s.iteration;
  return overflow;
}

Status LossScaler::Restore(const LossScalerState& state) {
  if (!(state.scale > 0.0 && std::isfinite(state.scale))) {
    return InvalidArgumentError(
        fmt::format("loss scaler state: scale {} is not a finite value > 0", state.scale));
  }
  if (state.hysteresis_left < 1 || state.hysteresis_left > std::max(1, config_.hysteresis)) {
    return InvalidArgumentError(
        fmt::format("loss scaler state: hysteresis_left {} is outside [1, {}]",
                    state.hysteresis_left, std::max(1, config_.hysteresis)));
  }
  state_ = state;
  return Status::Ok();
}

bool HasInfOrNan(const float* x, size_t n) {
  // Blocks of branch-free exponent tests (the compiler vectorises the inner loop), with an early
  // exit between blocks.
  constexpr size_t kBlock = 4096;
  for (size_t begin = 0; begin < n; begin += kBlock) {
    const size_t end = std::min(n, begin + kBlock);
    uint32_t any = 0;
    for (size_t i = begin; i < end; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, sizeof(bits));
      any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    if (any != 0) return true;
  }
  return false;
}

}  // namespace strata::optim
