#include "common/units.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace strata {

namespace {
Status BadSize(std::string_view text) {
  return InvalidArgumentError(fmt::format(
      "'{}' is not a byte size; expected a whole number of bytes such as 1048576, 5e8, 512K, 4MiB "
      "or 2GB (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; kB/MB/GB/TB powers of 1000)",
      text));
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}
}  // namespace

Result<uint64_t> ParseByteSize(std::string_view text) {
  if (text.empty()) return BadSize(text);
  // Split into the numeric part and the unit suffix.
  size_t i = 0;
  while (i < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.' ||
          ((text[i] == 'e' || text[i] == 'E') && i > 0 && i + 1 < text.size() &&
           (std::isdigit(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '+')) ||
          (text[i] == '+' && i > 0 && (text[i - 1] == 'e' || text[i - 1] == 'E')))) {
    ++i;
  }
  std::string number(text.substr(0, i));
  std::string_view unit = text.substr(i);
  if (number.empty() || !std::isdigit(static_cast<unsigned char>(number[0]))) return BadSize(text);

  long double multiplier = 1;
  struct UnitDef {
    std::string_view name;
    long double factor;
    bool exact_case;
  };
  static constexpr UnitDef kUnits[] = {
      {"", 1, false},
      {"B", 1, false},
      {"K", 1024.0L, false},
      {"KiB", 1024.0L, false},
      {"M", 1048576.0L, false},
      {"MiB", 1048576.0L, false},
      {"G", 1073741824.0L, false},
      {"GiB", 1073741824.0L, false},
      {"T", 1099511627776.0L, false},
      {"TiB", 1099511627776.0L, false},
      {"kB", 1e3L, false},
      {"MB", 1e6L, false},
      {"GB", 1e9L, false},
      {"TB", 1e12L, false},
  };
  bool found = false;
  for (const auto& u : kUnits) {
    if (EqualsIgnoreCase(unit, u.name)) {
      multiplier = u.factor;
      found = true;
      break;
    }
  }
  if (!found) return BadSize(text);

  char* end = nullptr;
  long double value = std::strtold(number.c_str(), &end);
  if (end == nullptr || *end != '\0' || !std::isfinite(value) || value < 0) return BadSize(text);
  long double bytes = value * multiplier;
  if (bytes > static_cast<long double>(std::numeric_limits<uint64_t>::max())) {
    return InvalidArgumentError(fmt::format("'{}' is too large for a byte size", text));
  }
  long double whole = std::floor(bytes);
  if (whole != bytes) {
    return InvalidArgumentError(
        fmt::format("'{}' is not a whole number of bytes ({})", text, static_cast<double>(bytes)));
  }
  return static_cast<uint64_t>(whole);
}

Result<std::vector<uint64_t>> ParseByteSizeList(std::string_view text) {
  std::vector<uint64_t> out;
  size_t pos = 0;
  while (true) {
    size_t comma = text.find(',', pos);
    std::string_view part =
        text.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    STRATA_ASSIGN_OR_RETURN(uint64_t v, ParseByteSize(part));
    out.push_back(v);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", v, kNames[unit]);
}

std::string FormatBytesExact(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (unit < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++unit;
  }
  return fmt::format("{} {}", bytes, kNames[unit]);
}

}  // namespace strata
