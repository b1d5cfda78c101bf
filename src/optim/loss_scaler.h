// LossScaler: fp16 loss scaling with DeepSpeed's semantics (deepspeed/runtime/fp16/
// loss_scaler.py, DynamicLossScaler and LossScaler), from the "fp16" config section.
//
//   STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::Create(config.fp16));
//   loss *= scaler.scale();            ... backward, reduce ...
//   const bool overflow = <any rank saw HasInfOrNan in its gradients>;
//   if (scaler.Update(overflow)) { skip the optimizer step (and the LR scheduler's step) }
//   else { grad_scale = 1 / scaler.scale() as it was for this step, ... }
//
// Dynamic scaling (fp16.enabled and fp16.loss_scale == 0) starts at 2^initial_scale_power. Update
// is called once per optimizer step with whether the gradients overflowed, and counts steps from
// 0 (DeepSpeed's cur_iter), remembering the step of the last overflow (-1 at first):
//   overflow:     if hysteresis == 1 or the remaining hysteresis is 1, the scale is halved (not
//                 below min_loss_scale); otherwise the remaining hysteresis drops by one. The
//                 step is remembered as the last overflow.
//   no overflow:  with consecutive_hysteresis the remaining hysteresis is refilled. When
//                 (step - last overflow - 1) is a positive multiple of loss_scale_window the scale
//                 doubles (and, without consecutive_hysteresis, the hysteresis is refilled then).
// Note that the remaining hysteresis is not refilled when the scale is halved, so after it ran
// out every further overflow halves the scale until a refill. Where DeepSpeed raises an exception
// (an overflow at min_loss_scale, when raise_error_at_min_scale is set), this scaler stays at the
// minimum, skips the step and counts it in overflows_at_min_scale(): the trainer decides.
//
// Static scaling (fp16.loss_scale > 0) keeps that scale; when fp16 is off the scale is 1. In both
// cases Update changes nothing and still returns `overflow`: an overflowing step is skipped.
//
// Thread safety: not synchronized; one owner (the trainer loop) calls Update.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/config.h"
#include "strata/status.h"

namespace strata::optim {

// The scaler's mutable state, for checkpoints (DeepSpeed saves cur_scale, cur_iter,
// last_overflow_iter and cur_hysteresis too).
struct LossScalerState {
  double scale = 1.0;
  int64_t iteration = 0;  // Update calls so far (cur_iter)
  int64_t last_overflow_iteration = -1;
  int hysteresis_left = 1;  // cur_hysteresis
  int64_t overflows_at_min_scale = 0;

  friend bool operator==(const LossScalerState&, const LossScalerState&) = default;
};

class LossScaler {
 public:
  // InvalidArgument, naming the fp16.* key, for values a loaded Config never holds: a negative or
  // non-finite loss_scale, initial_scale_power outside [0, 127] (2^128 overflows fp32),
  // loss_scale_window < 1, hysteresis < 1, min_loss_scale <= 0 or non-finite.
  static Result<LossScaler> Create(const Fp16Config& fp16);

  // The current scale (exact: a power of two, or the static value rounded to fp32).
  float scale() const { return static_cast<float>(state_.scale); }
  bool dynamic() const { return dynamic_; }

  // Records one step's overflow flag and adjusts the scale as described above. Returns true when
  // the step must be skipped (it overflowed).
  bool Update(bool overflow);

  // Overflows seen while the scale was already at min_loss_scale (DeepSpeed aborts the run at
  // the first; see above).
  int64_t overflows_at_min_scale() const { return state_.overflows_at_min_scale; }

  const LossScalerState& state() const { return state_; }
  // Restores a state saved from a scaler with the same config. InvalidArgument for a scale that
  // is not finite and > 0 or a hysteresis outside [1, fp16.hysteresis].
  Status Restore(const LossScalerState& state);

 private:
  LossScaler(const Fp16Config& fp16, bool dynamic, double initial_scale);

  Fp16Config config_;
  bool dynamic_ = false;
  LossScalerState state_;
};

// True when any of x[0..n) is +-Inf or NaN. x may be null when n == 0.
bool HasInfOrNan(const float* x, size_t n);

}  // namespace strata::optim
