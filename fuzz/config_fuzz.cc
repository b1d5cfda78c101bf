// The DeepSpeed/Strata config loader on arbitrary text: errors, never a crash.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::Result<strata::Config> c = strata::ParseConfig(text, "fuzz.json");
  if (c.ok()) (void)strata::ResolveBatchSizes(c->batch, 8);
  return 0;
}
