// `strata data prepare`: tokenizes JSONL or parquet datasets (plain text, chat messages,
// prompt-completion) with a model directory's own tokenizer into prepared token data
// (train/prepared_data.h) that `strata train --data` packs into rows.
//
// The tokenizing is transformers' (AutoTokenizer and the model's chat template, so the ids are
// exactly what transformers gives): this command hashes the tokenizer, finds the worker script
// (tools/prepare_data.py) and a Python that has the Hugging Face libraries, runs it, and then
// opens the result as `strata train` will and says what it holds.
//
// The Python: --python, else $STRATA_PYTHON, else hf-venv/bin/python beside this executable
// (deploy/hf-venv.sh makes it), else python3 on PATH. The script: $STRATA_TOOLS_DIR, else
// ../share/strata/tools beside this executable, else the source tree this binary was built from.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/errno.h"
#include "common/units.h"
#include "train/prepared_data.h"

#ifndef STRATA_SOURCE_DIR
#define STRATA_SOURCE_DIR ""
#endif

namespace strata::cli {
namespace {

constexpr std::string_view kCommand = "data prepare";

struct PrepareArgs {
  std::string model;
  std::vector<std::string> inputs;
  std::string out;
  std::string format = "auto";
  bool train_on_prompt = false;
  bool skip_bad = false;
  int workers = 0;
  std::string python;
  bool json = false;
};

std::filesystem::path ExeDir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path() : exe.parent_path();
}

Result<std::string> FindScript() {
  std::vector<std::filesystem::path> places;
  if (const char* dir = std::getenv("STRATA_TOOLS_DIR"); dir != nullptr && *dir != '\0') {
    places.emplace_back(dir);
  }
  places.push_back(ExeDir() / ".." / "share" / "strata" / "tools");
  if (*STRATA_SOURCE_DIR != '\0') places.push_back(std::filesystem::path(STRATA_SOURCE_DIR) / "tools");
  std::string tried;
  for (const auto& dir : places) {
    const std::filesystem::path script = dir / "prepare_data.py";
    if (std::filesystem::is_regular_file(script)) return script.string();
    tried += (tried.empty() ? "" : ", ") + script.string();
  }
  return NotFoundError(fmt::format(
      "cannot find the tokenizing worker prepare_data.py (looked at {}); set STRATA_TOOLS_DIR to "
      "the directory that holds it (tools/ in Strata's source tree)",
      tried));
}

std::string FindPython(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("STRATA_PYTHON"); env != nullptr && *env != '\0') return env;
  const std::filesystem::path venv = ExeDir() / "hf-venv" / "bin" / "python";
  if (std::filesystem::exists(venv)) return venv.string();
  return "python3";
}

// Runs argv with stdout into *out (stderr and stdin inherited). Returns the exit status, or
// 128 + the signal that ended it.
Result<int> RunCapturing(const std::vector<std::string>& argv, std::string* out) {
  int fds[2];
  if (::pipe(fds) != 0) return ErrnoToStatus(errno, "pipe");
  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "strata data prepare: error: cannot run %s: %s\n", args[0],
                 std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buffer, sizeof buffer);
    if (n > 0) {
      out->append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return ErrnoToStatus(errno, "waitpid");
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int RunPrepare(const PrepareArgs& a) {
  Result<std::string> hash = train::TokenizerHash(a.model);
  if (!hash.ok()) {
    return ReportError(kCommand,
                       InvalidArgumentError(fmt::format(
                           "--model {}: {}; prepare needs a Hugging Face model directory with its "
                           "tokenizer (tokenizer.json, tokenizer_config.json)",
                           a.model, hash.status().message())));
  }
  const std::filesystem::path out(a.out);
  if (!out.parent_path().empty() && !std::filesystem::is_directory(out.parent_path())) {
    return ReportError(kCommand, NotFoundError(fmt::format("--out {}: the directory {} does not "
                                                           "exist",
                                                           a.out, out.parent_path().string())));
  }
  Result<std::string> script = FindScript();
  if (!script.ok()) return ReportError(kCommand, script.status());
  std::vector<std::string> argv = {FindPython(a.python), *script, "--model", a.model, "--out",
                                   a.out, "--format", a.format, "--tokenizer-hash", *hash,
                                   "--workers", std::to_string(a.workers)};
  for (const std::string& in : a.inputs) {
    argv.push_back("--input");
    argv.push_back(in);
  }
  if (a.train_on_prompt) argv.push_back("--train-on-prompt");
  if (a.skip_bad) argv.push_back("--skip-bad");

  std::string report_text;
  Result<int> status = RunCapturing(argv, &report_text);
  if (!status.ok()) return ReportError(kCommand, status.status());
  if (*status != 0) {
    // The worker said what was wrong on stderr; a crash or signal gets a line of its own.
    if (*status > 2) {
      fmt::print(stderr, "strata data prepare: error: {} {} ended with status {}\n", argv[0],
                 *script, *status);
    }
    return *status == 2 ? kExitUsage : kExitFailure;
  }
  // Open the result as the trainer will: a file the trainer cannot read is this command's error.
  Result<train::PreparedTokens> prepared = train::PreparedTokens::Open(a.out);
  if (!prepared.ok()) return ReportError(kCommand, prepared.status());
  const nlohmann::json report =
      nlohmann::json::parse(report_text.substr(report_text.find('{')), nullptr, false);
  if (a.json) {
    fmt::print("{}\n", report.dump());
    return kExitOk;
  }
  const double seconds = report.is_object() ? report.value("seconds", 0.0) : 0.0;
  const uint64_t skipped = report.is_object() ? report.value("skipped_rows", uint64_t{0}) : 0;
  const auto& p = *prepared;
  fmt::print(
      "strata data prepare: wrote {} ({}): {} {} document(s), {} tokens ({} trained, {:.1f}%; "
      "{:.0f} per document){}, tokenizer {} (hash {}), in {:.1f} s\n",
      a.out, FormatBytes(std::filesystem::file_size(a.out)), p.documents(), p.shape(), p.tokens(),
      p.trained_tokens(),
      100.0 * static_cast<double>(p.trained_tokens()) / static_cast<double>(p.tokens()),
      static_cast<double>(p.tokens()) / static_cast<double>(p.documents()),
      skipped > 0 ? fmt::format(", {} bad row(s) skipped", skipped) : std::string(), a.model,
      p.tokenizer_hash(), seconds);
  return kExitOk;
}

}  // namespace

void RegisterDataPrepareCommand(CLI::App* data, int* exit_code) {
  auto args = std::make_shared<PrepareArgs>();
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenize JSONL or parquet datasets with a model's own tokenizer and chat template into "
      "prepared token data for `strata train --data` (documents, loss mask, tokenizer hash). "
      "Shapes: {\"text\"}, {\"messages\": [{\"role\", \"content\"}]} (assistant turns trained), "
      "{\"prompt\", \"completion\"} (the completion trained)");
  prepare
      ->add_option("--model", args->model,
                   "Hugging Face model directory holding the tokenizer (tokenizer.json, "
                   "tokenizer_config.json, the chat template)")
      ->required();
  prepare->add_option("--input", args->inputs, "A .jsonl or .parquet file (repeat for several)")
      ->required();
  prepare->add_option("--out", args->out, "The prepared file to write (atomically)")->required();
  prepare->add_option("--format", args->format, "The rows' shape (auto: from the first row's keys)")
      ->check(CLI::IsMember({"auto", "text", "messages", "prompt-completion"}))
      ->capture_default_str();
  prepare->add_flag("--train-on-prompt", args->train_on_prompt,
                    "Train on every token (prompts, system and user turns too), not only on the "
                    "assistant turns / completions");
  prepare->add_flag("--skip-bad", args->skip_bad,
                    "Skip rows that cannot be used (bad JSON, missing fields, a template error) "
                    "and count them, instead of stopping at the first");
  prepare->add_option("--workers", args->workers, "Tokenizing processes (0: one per core)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  prepare->add_option("--python", args->python,
                      "The Python with transformers and tokenizers (default: $STRATA_PYTHON, "
                      "hf-venv/bin/python beside strata, python3)");
  prepare->add_flag("--json", args->json, "Print the worker's report as one JSON object");
  prepare->callback([args, exit_code] { *exit_code = RunPrepare(*args); });
}

}  // namespace strata::cli
