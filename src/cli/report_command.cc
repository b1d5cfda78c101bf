// `strata report`: an HTML page of a training run's metrics (train/report.h).
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "train/report.h"

namespace strata::cli {

void RegisterReportCommand(CLI::App& app, int* exit_code) {
  struct Args {
    train::ReportOptions report;
    std::string out;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "report",
      "Write one self-contained HTML page of a training run: the loss curve, tokens/s, the "
      "step-time split, NVMe bytes per step and peak memory per tier, from strata train "
      "--metrics (and --trace)");
  cmd->add_option("metrics", a->report.metrics_path, "The run's --metrics file (JSON lines)")
      ->required();
  cmd->add_option("--trace", a->report.trace_path,
                  "The run's --trace file: adds a table of time by span");
  cmd->add_option("--out", a->out, "The HTML file (default: the metrics file's name, .html)");
  cmd->add_option("--title", a->report.title, "The page's title");
  cmd->callback([a, exit_code] {
    std::string out = a->out;
    if (out.empty()) out = std::filesystem::path(a->report.metrics_path).replace_extension(".html");
    const Status st = train::WriteReport(a->report, out);
    if (!st.ok()) {
      *exit_code = ReportError("report", st);
      return;
    }
    fmt::print("strata report: wrote {}\n", out);
    *exit_code = kExitOk;
  });
}

}  // namespace strata::cli
