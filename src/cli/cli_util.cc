#include "cli/cli_util.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "common/units.h"

namespace strata::cli {

int ExitCodeFor(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return kExitOk;
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kPermissionDenied:
    case StatusCode::kFailedPrecondition:
      return kExitUsage;
    default:
      return kExitFailure;
  }
}

int ReportError(std::string_view command, const Status& status) {
  std::string message(status.ok() ? "OK" : status.message());
  if (message.empty()) message = std::string(StatusCodeName(status.code()));
  std::replace(message.begin(), message.end(), '\n', ' ');
  std::string prefix = command.empty() ? "strata" : fmt::format("strata {}", command);
  fmt::print(stderr, "{}: error: {}\n", prefix, message);
  std::fflush(stderr);
  return ExitCodeFor(status);
}

size_t DisplayWidth(std::string_view text) {
  // Every byte that is not a UTF-8 continuation byte starts a code point.
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

Table::Table(std::vector<std::string> header, std::vector<Align> align)
    : header_(std::move(header)), align_(std::move(align)) {}

void Table::AddRow(std::vector<std::string> cells) {
  rows_.push_back(std::move(cells));
}

std::string Table::Render(std::string_view indent) const {
  size_t columns = header_.size();
  for (const auto& row : rows_)
    columns = std::max(columns, row.size());
  std::vector<size_t> width(columns, 0);
  auto measure = [&](const std::vector<std::string>& row) {
    for (size_t c = 0; c < row.size(); ++c)
      width[c] = std::max(width[c], DisplayWidth(row[c]));
  };
  measure(header_);
  for (const auto& row : rows_)
    measure(row);

  std::string out;
  auto emit = [&](const std::vector<std::string>& row) {
    std::string line(indent);
    for (size_t c = 0; c < columns; ++c) {
      const std::string empty;
      const std::string& cell = c < row.size() ? row[c] : empty;
      size_t pad = width[c] - DisplayWidth(cell);
      bool right = c < align_.size() && align_[c] == kRight;
      if (c > 0) line += "  ";
      if (right) line.append(pad, ' ');
      line += cell;
      if (!right) line.append(pad, ' ');
    }
    while (line.size() > indent.size() && line.back() == ' ')
      line.pop_back();
    out += line;
    out += '\n';
  };
  if (!header_.empty()) {
    emit(header_);
    if (rule_) {
      std::vector<std::string> rule;
      for (size_t c = 0; c < columns; ++c)
        rule.emplace_back(width[c], '-');
      emit(rule);
    }
  }
  for (const auto& row : rows_)
    emit(row);
  return out;
}

void Table::Print(std::FILE* out, std::string_view indent) const {
  std::string text = Render(indent);
  std::fwrite(text.data(), 1, text.size(), out);
}

CLI::Validator ByteSize() {
  CLI::Validator v(
      [](std::string& text) -> std::string {
        Result<uint64_t> bytes = ParseByteSize(text);
        if (!bytes.ok()) return std::string(bytes.status().message());
        text = std::to_string(*bytes);
        return {};
      },
      "SIZE", "byte size");
  return v;
}

ProgressLine::ProgressLine(std::FILE* out, std::chrono::milliseconds interval, Mode mode)
    : out_(out),
      interval_(interval),
      terminal_(mode == Mode::kTerminal ||
                (mode == Mode::kAuto && out != nullptr && isatty(fileno(out)) == 1)) {}

ProgressLine::~ProgressLine() {
  if (line_open_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

void ProgressLine::Update(std::string_view text) {
  auto now = std::chrono::steady_clock::now();
  if (terminal_) {
    // Carriage return, the text, then erase whatever a longer previous line left behind.
    fmt::print(out_, "\r{}\033[K", text);
    std::fflush(out_);
    line_open_ = true;
    return;
  }
  if (printed_any_ && now - last_print_ < interval_) return;
  fmt::print(out_, "{}\n", text);
  std::fflush(out_);
  printed_any_ = true;
  last_print_ = now;
}

void ProgressLine::Finish(std::string_view text) {
  if (terminal_) {
    fmt::print(out_, "\r{}\033[K\n", text);
    line_open_ = false;
  } else {
    fmt::print(out_, "{}\n", text);
  }
  std::fflush(out_);
  printed_any_ = true;
  last_print_ = std::chrono::steady_clock::now();
}

void ProgressLine::Clear() {
  if (terminal_ && line_open_) {
    std::fputs("\r\033[K", out_);
    std::fflush(out_);
    line_open_ = false;
  }
}

}  // namespace strata::cli
