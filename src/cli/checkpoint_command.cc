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
#include "train/lora_files.h"

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

struct MergeArgs {
  std::string base, adapter, out;
};

int RunMerge(const MergeArgs& a) {
  constexpr std::string_view kCommand = "checkpoint merge-lora";
  const auto t0 = std::chrono::steady_clock::now();
  Result<train::MergeStats> r = train::MergeLora(
      a.base, a.adapter, a.out, [](const std::string& line) { fmt::print(stdout, "{}\n", line); });
  if (!r.ok()) return ReportError(kCommand, r.status());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(stdout, "{}: {} weights merged with {}'s adapters, {} copied; {} written in {:.1f} s\n",
             a.out, r->merged_tensors, a.adapter, r->copied_tensors, FormatBytes(r->bytes), s);
  return kExitOk;
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

  auto merge = std::make_shared<MergeArgs>();
  CLI::App* m = ck->add_subcommand(
      "merge-lora",
      "Merge a LoRA adapter into its base model's weights (W + lora_alpha / r * B A) and write a "
      "plain Hugging Face model directory");
  m->add_option("--base", merge->base, "The base model directory (config.json + weights)")
      ->required();
  m->add_option("--adapter", merge->adapter,
                "The adapter directory (adapter_config.json + adapter_model.safetensors); a LoRA "
                "run's checkpoint step directory is one")
      ->required();
  m->add_option("--out", merge->out, "Where to write the merged model (must not hold weights)")
      ->required();
  m->callback([merge, exit_code] { *exit_code = RunMerge(*merge); });
}

}  // namespace strata::cli
