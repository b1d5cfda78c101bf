// Options `strata train` and `strata eval` share, registered the same way for both.
#pragma once

#include <CLI/CLI.hpp>

#include "train/trainer.h"

namespace strata::cli {

// --data-dtype, --seq-len and --device into `o`.
void AddDataShapeAndDeviceOptions(CLI::App* cmd, train::TrainOptions* o);

}  // namespace strata::cli
