// One op's share of a per-op profile (OpProfiler, strata train --profile-ops).
#pragma once

#include <cstdint>
#include <string>

namespace strata::model {

struct OpTime {
  std::string op;       // the LlamaOps method, e.g. "AttentionBackward"
  int64_t calls = 0;    // calls profiled
  double seconds = 0;   // their device time in all
};

}  // namespace strata::model
