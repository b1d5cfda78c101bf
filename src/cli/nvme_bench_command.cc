// Placeholder until the nvme-bench command lands: the subcommand exists (so `strata --help` lists
// it) and reports that it is not implemented yet.
#include "cli/cli_util.h"
#include "cli/commands.h"

namespace strata::cli {

void RegisterNvmeBenchCommand(CLI::App& app, int* exit_code) {
  CLI::App* cmd = app.add_subcommand(
      "nvme-bench",
      "Benchmark NVMe paths for offload and suggest aio settings (not implemented yet)");
  cmd->callback([exit_code] {
    *exit_code = ReportError("nvme-bench", UnimplementedError("nvme-bench is not implemented yet"));
  });
}

}  // namespace strata::cli
