// Byte sizes as people write them: "4GiB", "512M", "1e9", "1048576".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata {

// Parses a byte count. Accepted forms (case of the unit letter does not matter, spaces are not
// allowed): a plain integer ("1048576"), a number in scientific notation ("5e8"), or a number
// with a unit suffix: K, M, G, T, KiB, MiB, GiB, TiB are powers of 1024 (as in fio);
// kB, MB, GB, TB are powers of 1000; B means bytes. A fractional number is accepted when the
// result is a whole number of bytes ("1.5K" = 1536). Errors name the text and the expected form.
Result<uint64_t> ParseByteSize(std::string_view text);

// Parses a comma-separated list of byte sizes ("256K,1M,4M").
Result<std::vector<uint64_t>> ParseByteSizeList(std::string_view text);

// "1.00 GiB", "512 KiB", "4096 B": binary units with up to two decimals.
std::string FormatBytes(uint64_t bytes);

// "1 MiB", "4 KiB", "1536 B": an exact short form used in tables and file names.
std::string FormatBytesExact(uint64_t bytes);

// Rounds `value` up to a multiple of `alignment` (a power of two or any positive number).
constexpr uint64_t RoundUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}
constexpr bool IsAligned(uint64_t value, uint64_t alignment) {
  return value % alignment == 0;
}

}  // namespace strata
