// `strata checkpoint`: tools for saved checkpoints. `strata checkpoint verify DIR` reads every
// byte of a checkpoint back against the checksums written with it (checksums.json, see
// train/checksum_manifest.h) without loading a model or starting a run.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/units.h"
#include "train/checkpoint.h"
#include "train/checksum_manifest.h"

namespace strata::cli {
namespace {

struct VerifyArgs {
  std::string dir;
  bool json = false;
};

int RunVerify(const VerifyArgs& a) {
  constexpr std::string_view kCommand = "checkpoint verify";
  Result<std::string> step_dir = train::ResolveCheckpoint(a.dir);
  if (!step_dir.ok()) return ReportError(kCommand, step_dir.status());
  Result<train::Manifest> manifest = train::ReadManifest(*step_dir);
  if (!manifest.ok()) return ReportError(kCommand, manifest.status());
  const auto t0 = std::chrono::steady_clock::now();
  const train::VerifyResult r = train::VerifyManifest(*step_dir, *manifest);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  uint64_t total = 0;
  for (const auto& [name, f] : *manifest) total += f.size;
  if (a.json) {
    nlohmann::json j = {{"checkpoint", *step_dir},     {"ok", r.problems.empty()},
                        {"files", manifest->size()},   {"ranges", r.ranges},
                        {"bytes", r.bytes},            {"seconds", s},
                        {"problems", r.problems}};
    fmt::print(stdout, "{}\n", j.dump());
  } else {
    Table t({"file", "bytes", "ranges"}, {Table::kLeft, Table::kRight, Table::kRight});
    for (const auto& [name, f] : *manifest) {
      t.AddRow({name, FormatBytes(f.size), std::to_string(f.ranges.size())});
    }
    t.Print(stdout, "  ");
    for (const std::string& p : r.problems) fmt::print(stdout, "  damaged: {}\n", p);
    fmt::print(stdout, "{}: {} files, {} read in {:.1f} s ({:.0f} MB/s): {}\n", *step_dir,
               manifest->size(), FormatBytes(r.bytes), s,
               static_cast<double>(r.bytes) / std::max(s, 1e-6) / 1e6,
               r.problems.empty() ? "every byte matches its checksum"
                                  : fmt::format("{} problem(s)", r.problems.size()));
  }
  if (r.problems.empty()) return kExitOk;
  return ReportError(kCommand,
                     Status(StatusCode::kDataLoss,
                            fmt::format("{} is damaged: {}", *step_dir, r.problems.front())));
}

}  // namespace

void RegisterCheckpointCommand(CLI::App& app, int* exit_code) {
  CLI::App* ck = app.add_subcommand("checkpoint", "Tools for saved checkpoints");
  ck->require_subcommand(1);
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* verify = ck->add_subcommand(
      "verify",
      "Read every byte of a checkpoint back and compare it with the checksums saved with it "
      "(checksums.json). Exit 0 when all match, 1 naming each damaged file, byte range and "
      "tensor otherwise");
  verify->add_option("DIR", args->dir, "A checkpoint step directory, or a --save directory (its latest)")
      ->required();
  verify->add_flag("--json", args->json, "One JSON object instead of the table");
  verify->callback([args, exit_code] { *exit_code = RunVerify(*args); });
}

}  // namespace strata::cli
