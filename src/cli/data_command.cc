// `strata data`: token data utilities. `strata data synth` writes a learnable synthetic token
// corpus (a sparse Markov chain with noise; see train/data.h) for smoke tests and loss-curve
// checks without a tokenizer or a download; `strata data prepare` is data_prepare_command.cc.
#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/units.h"
#include "train/data.h"

namespace strata::cli {
namespace {

struct SynthArgs {
  std::string out;
  std::string tokens;  // parsed by ParseTokenCount: "1000000", "10M", ...
  int64_t vocab = 0;   // signed so that a negative value is reported as such
  uint64_t seed = 1;
  std::string dtype = "auto";
};

// Below this many tokens a run takes well under a second: no progress line.
constexpr uint64_t kProgressMinTokens = uint64_t{8} << 20;

// A whole number, optionally followed by k, M, G or T (powers of 1000: token counts are decimal).
std::optional<uint64_t> ParseTokenCount(const std::string& text) {
  uint64_t value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(first, last, value);
  if (ec != std::errc() || ptr == first) return std::nullopt;
  uint64_t scale = 1;
  if (ptr != last) {
    if (ptr + 1 != last) return std::nullopt;
    switch (*ptr) {
      case 'k':
      case 'K':
        scale = 1000;
        break;
      case 'M':
        scale = 1000 * 1000;
        break;
      case 'G':
        scale = 1000 * 1000 * 1000;
        break;
      case 'T':
        scale = uint64_t{1000} * 1000 * 1000 * 1000;
        break;
      default:
        return std::nullopt;
    }
  }
  if (value > UINT64_MAX / scale) return std::nullopt;
  return value * scale;
}

int RunSynth(const SynthArgs& a) {
  constexpr std::string_view kCommand = "data synth";
  const std::filesystem::path out(a.out);
  if (out.extension() != ".bin" && out.extension() != ".npy") {
    return ReportError(kCommand, InvalidArgumentError(fmt::format(
                                     "--out {}: expected a file name ending in .bin (raw tokens) "
                                     "or .npy (a NumPy array)",
                                     a.out)));
  }
  std::optional<uint64_t> tokens = ParseTokenCount(a.tokens);
  if (!tokens.has_value() || *tokens == 0) {
    return ReportError(kCommand, InvalidArgumentError(fmt::format(
                                     "--tokens '{}': expected a positive whole number, "
                                     "optionally with k, M, G or T (10^3, 10^6, 10^9, 10^12)",
                                     a.tokens)));
  }
  if (a.vocab < 1 || static_cast<uint64_t>(a.vocab) > train::kMaxVocabSize) {
    return ReportError(kCommand, InvalidArgumentError(fmt::format("--vocab {}: expected 1 to {}",
                                                                  a.vocab, train::kMaxVocabSize)));
  }
  train::SynthOptions options;
  options.tokens = *tokens;
  options.vocab = static_cast<uint64_t>(a.vocab);
  options.seed = a.seed;
  if (a.dtype == "auto") {
    options.dtype = a.vocab <= 65536 ? train::TokenDtype::kUint16 : train::TokenDtype::kUint32;
  } else {
    Result<train::TokenDtype> dtype = train::ParseTokenDtype(a.dtype);
    if (!dtype.ok()) return ReportError(kCommand, dtype.status());
    options.dtype = *dtype;
  }
  if (options.dtype == train::TokenDtype::kUint16 && a.vocab > 65536) {
    return ReportError(kCommand, InvalidArgumentError(fmt::format(
                                     "--vocab {} does not fit --dtype uint16 (at most 65536 "
                                     "tokens); use --dtype uint32",
                                     a.vocab)));
  }

  ProgressLine progress_line(stderr, std::chrono::seconds(5));
  train::SynthProgress progress;
  if (options.tokens >= kProgressMinTokens) {
    const auto start = std::chrono::steady_clock::now();
    progress = [&progress_line, start](uint64_t done, uint64_t total) {
      // Nothing for the first second: a short run needs no progress line.
      if (std::chrono::steady_clock::now() - start < std::chrono::seconds(1)) return;
      progress_line.Update(
          fmt::format("strata data synth: {:3.0f}% ({} of {} tokens)",
                      100.0 * static_cast<double>(done) / static_cast<double>(total), done, total));
    };
  }
  Status written = train::WriteSyntheticCorpus(a.out, options, progress);
  progress_line.Clear();
  if (!written.ok())
    return ReportError(kCommand, written.WithContext(fmt::format("--out {}", a.out)));

  const uint64_t bytes =
      (out.extension() == ".npy" ? train::NpyHeader(options.dtype, options.tokens).size() : 0) +
      options.tokens * train::TokenDtypeSize(options.dtype);
  fmt::print(stdout, "strata data synth: wrote {} tokens (vocab {}, seed {}, {} {}) to {}, {}\n",
             options.tokens, options.vocab, options.seed, train::TokenDtypeName(options.dtype),
             out.extension() == ".npy" ? ".npy" : "raw", a.out, FormatBytes(bytes));
  return kExitOk;
}

}  // namespace

void RegisterDataCommand(CLI::App& app, int* exit_code) {
  CLI::App* data = app.add_subcommand(
      "data", "Token data for training: tokenize datasets (prepare), write a synthetic corpus");
  data->require_subcommand(1);

  auto args = std::make_shared<SynthArgs>();
  CLI::App* synth = data->add_subcommand(
      "synth",
      "Write a learnable synthetic token corpus: a fixed random sparse Markov chain (4 successors "
      "per token, 5% uniform noise), so a small model's loss falls well below ln(vocab) within a "
      "few hundred steps. Written atomically (temporary name, fsync, rename)");
  synth->add_option("--out", args->out, "Output file: FILE.bin (raw little-endian) or FILE.npy")
      ->required();
  synth
      ->add_option("--tokens", args->tokens,
                   "Number of tokens, e.g. 1000000 or 10M (k, M, G, T are powers of 1000)")
      ->required();
  synth->add_option("--vocab", args->vocab, "Vocabulary size: token ids are in [0, vocab)")
      ->required();
  synth->add_option("--seed", args->seed, "Seed of the chain and the sampling")
      ->capture_default_str();
  synth
      ->add_option("--dtype", args->dtype,
                   "Token type on disk: uint16, uint32, or auto (uint16 when vocab <= 65536)")
      ->check(CLI::IsMember({"auto", "uint16", "uint32"}))
      ->capture_default_str();
  synth->callback([args, exit_code] { *exit_code = RunSynth(*args); });
  RegisterDataPrepareCommand(data, exit_code);
}

}  // namespace strata::cli
