// The CLI's byte-size parser ("4MiB", "1e9", "512K", lists "256K,1M") on arbitrary text.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/units.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto one = strata::ParseByteSize(text);
  if (one.ok()) (void)strata::FormatBytes(*one);
  (void)strata::ParseByteSizeList(text);
  return 0;
}
