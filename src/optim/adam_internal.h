// What adam_cpu.cc shares with device_adam.cc: the validation of a step's arguments and the
// per-step scalars, so the CPU and GPU paths reject the same inputs and use the same fp32 scalars.
#pragma once

#include <string_view>

#include "optim/adam.h"
#include "optim/adam_element.h"
#include "strata/status.h"

namespace strata::optim::detail {

// The scalars of adam.h's arithmetic, computed in double and rounded once to fp32.
AdamStepScalars ComputeAdamStepScalars(const AdamHyper& hyper);

// InvalidArgument (its message starts with "<caller>: ") for bad hyper-parameters, null or
// overlapping arrays, or an unknown out_dtype. Does not look at the ISA or thread count.
Status ValidateAdamStep(const AdamHyper& hyper, const AdamShard& shard, std::string_view caller);

}  // namespace strata::optim::detail
