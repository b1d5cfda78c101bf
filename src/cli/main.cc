// The `strata` command: parses the command line with CLI11 and runs one subcommand.
//
// Exit codes: 0 success (and --help / --version), 1 the command failed, 2 a usage error (an
// unknown flag or command, a bad value, a missing path: see cli/cli_util.h). Every error is
// one line on stderr; nothing escapes as an exception.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "strata/version.h"

namespace strata::cli {
namespace {

// "strata 0.1.0" and a one-line summary of how the binary was built.
std::string VersionText() {
  const BuildInfo& b = GetBuildInfo();
  std::string line =
      fmt::format("strata {}\nbuilt {} with {}", b.version, b.build_type, b.cxx_compiler);
  line += b.with_cuda ? fmt::format(", CUDA ({})", b.cuda_compiler) : ", no CUDA";
  line += b.with_nccl ? ", NCCL" : ", no NCCL";
  line += b.with_mpi ? ", MPI" : ", no MPI";
  if (!b.sanitizers.empty()) line += fmt::format(", sanitizers {}", b.sanitizers);
  return line;
}

// "strata env" for the deepest subcommand that was being parsed, else "strata".
std::string CommandPath(const CLI::App& app) {
  std::string path;
  const CLI::App* current = &app;
  while (true) {
    auto subs = current->get_subcommands();
    if (subs.empty()) break;
    current = subs.front();
    path += (path.empty() ? "" : " ") + current->get_name();
  }
  return path;
}

std::string CommandNames(const CLI::App& app) {
  std::string names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  return names;
}

int Run(int argc, char** argv) {
  CLI::App app(
      "Strata trains transformer models larger than GPU memory: ZeRO partitioning across ranks "
      "with parameters and optimizer states offloaded to pinned host memory and NVMe.",
      "strata");
  app.set_version_flag("--version", VersionText(), "Print the version and build information");
  app.require_subcommand(0, 1);

  int exit_code = kExitOk;
  RegisterEnvCommand(app, &exit_code);
  RegisterNvmeBenchCommand(app, &exit_code);
  RegisterDataCommand(app, &exit_code);
  RegisterTrainCommand(app, &exit_code);
  RegisterEvalCommand(app, &exit_code);
  RegisterCheckpointCommand(app, &exit_code);
  RegisterEstimateCommand(app, &exit_code);
  RegisterReportCommand(app, &exit_code);
  // Set after the subcommands are added, so that they do not inherit it.
  app.footer("Run 'strata <command> --help' for the options of a command.");

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    // --help or --version: printed to stdout, exit 0.
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string command = CommandPath(app);
    std::string message = e.what();
    // A first word that is not a command reads better as such than as an "extra argument".
    if (command.empty() && dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr && argc > 1 &&
        argv[1][0] != '-') {
      message =
          fmt::format("'{}' is not a strata command; commands: {}", argv[1], CommandNames(app));
    }
    std::string where = command.empty() ? "strata" : "strata " + command;
    fmt::print(stderr, "{}: error: {} (see '{} --help')\n", where, message, where);
    return kExitUsage;
  }

  if (app.get_subcommands().empty()) {
    std::cerr << app.help();
    fmt::print(stderr, "strata: error: a command is required; commands: {}\n", CommandNames(app));
    return kExitUsage;
  }
  return exit_code;
}

}  // namespace
}  // namespace strata::cli

int main(int argc, char** argv) {
  try {
    return strata::cli::Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: internal error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "strata: internal error: an unknown exception escaped\n");
  }
  return strata::cli::kExitFailure;
}
