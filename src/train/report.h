// `strata report`: one self-contained HTML page (inline SVG, no scripts, nothing fetched) from a
// run's --metrics file (and, optionally, its --trace): the loss curve, tokens/s, the step-time
// split as stacked bars, NVMe bytes per step, and peak memory per tier over the steps.
#pragma once

#include <string>

#include "strata/status.h"

namespace strata::train {

struct ReportOptions {
  std::string metrics_path{};  // strata train --metrics (one JSON object per step)
  std::string trace_path{};    // optional: strata train --trace (Chrome trace JSON)
  std::string title{};         // empty: "Strata training report"
};

// The page. A metrics file that is missing, empty or not one JSON object per line is an
// InvalidArgument naming the file and the line.
Result<std::string> RenderReport(const ReportOptions& options);

// RenderReport, written to `out_path` (through a temporary file and a rename).
Status WriteReport(const ReportOptions& options, const std::string& out_path);

}  // namespace strata::train
