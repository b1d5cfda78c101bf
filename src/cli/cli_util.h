// Pieces shared by the `strata` subcommands: turning a Status into one error line and an exit
// code, aligned text tables, a CLI11 transformer for byte sizes, and a progress line.
//
// Everything here writes to the FILE* it is given (stdout for results, stderr for errors and
// progress) and is meant for the CLI's main thread; none of it is thread-safe.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::cli {

// Exit codes of the `strata` command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the command ran and failed (I/O error, internal, ...)
inline constexpr int kExitUsage = 2;    // the command could not run as asked: fix the invocation

// The exit code for an error Status. Codes that mean "what you asked for is wrong or cannot be
// had here" map to kExitUsage (2):
//   InvalidArgument    a bad flag value or combination
//   NotFound           a path, file or device given on the command line does not exist
//   PermissionDenied   the user may not do this (a read-only directory, a missing capability)
//   FailedPrecondition the system is not set up for it (e.g. io_uring disabled when forced)
// Everything else (ResourceExhausted, DataLoss, Internal, Unavailable, ...) maps to
// kExitFailure (1). OK maps to kExitOk.
int ExitCodeFor(const Status& status);

// Prints "strata <command>: error: <message>" (or "strata: error: ..." for an empty command) as
// one line on stderr and returns ExitCodeFor(status). Newlines in the message are replaced by
// spaces so the error stays on one line.
int ReportError(std::string_view command, const Status& status);

// A text table with aligned columns, separated by two spaces, without trailing blanks.
//   Table t({"size", "GB/s"}, {Table::kLeft, Table::kRight});
//   t.AddRow({"4 KiB", "0.41"});
//   t.Print(stdout);
// Widths count UTF-8 code points, so "µs" lines up. Rows may have fewer cells than columns.
class Table {
 public:
  enum Align { kLeft, kRight };

  // `header` may be empty (no header line). `align` defaults to kLeft for unlisted columns.
  explicit Table(std::vector<std::string> header = {}, std::vector<Align> align = {});

  void AddRow(std::vector<std::string> cells);
  // A header rule of dashes under the header line (default on when there is a header).
  void set_rule(bool rule) { rule_ = rule; }

  // Each line prefixed with `indent`, ending in '\n'.
  std::string Render(std::string_view indent = "") const;
  void Print(std::FILE* out, std::string_view indent = "") const;

 private:
  std::vector<std::string> header_;
  std::vector<Align> align_;
  std::vector<std::vector<std::string>> rows_;
  bool rule_ = true;
};

// Display width of UTF-8 text (code points; no East Asian wide handling).
size_t DisplayWidth(std::string_view text);

// A CLI11 transformer that accepts a byte size as strata::ParseByteSize does ("4MiB", "1e9",
// "512K") and hands the option its value in bytes as a decimal string, so it can be bound to an
// integer:   uint64_t bytes; cmd->add_option("--size", bytes)->transform(ByteSize());
// With a vector option and ->delimiter(','), each element is transformed on its own. A bad value
// is rejected with ParseByteSize's message ("--size: '12Q' is not a byte size; expected ...").
CLI::Validator ByteSize();

// One line of progress for long operations (sweeps, checkpoint saves).
// On a terminal, each Update rewrites the same line (carriage return + clear to end of line).
// Otherwise (a pipe, a log file) an Update is printed as its own line only when `interval` has
// passed since the last printed one, so logs get a line every few seconds, not thousands.
// Finish always prints its text as a final line. Output that is not progress should be printed
// after Clear() (or Finish) so that it does not land in the middle of the progress line.
class ProgressLine {
 public:
  enum class Mode { kAuto, kTerminal, kLines };  // kAuto: kTerminal when `out` is a TTY

  explicit ProgressLine(std::FILE* out = stderr,
                        std::chrono::milliseconds interval = std::chrono::seconds(5),
                        Mode mode = Mode::kAuto);
  // Ends a pending terminal line with a newline.
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  void Update(std::string_view text);
  void Finish(std::string_view text);
  // Terminal: erases the progress line; lines mode: nothing.
  void Clear();

  bool terminal() const { return terminal_; }

 private:
  std::FILE* out_;
  std::chrono::milliseconds interval_;
  bool terminal_;
  bool line_open_ = false;  // terminal: a progress line is on screen without a newline
  bool printed_any_ = false;
  std::chrono::steady_clock::time_point last_print_{};
};

}  // namespace strata::cli
