// The .npy token-file header parser on arbitrary files: errors, never a crash; an accepted file
// reads back within its size.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/fuzz_file.h"
#include "train/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = strata::fuzz::ScratchPath(".npy");
  if (!strata::fuzz::WriteScratch(path, data, size)) return 0;
  auto d = strata::train::TokenDataset::Open(path, 1 << 20);
  if (!d.ok()) return 0;
  std::vector<int32_t> tokens(static_cast<size_t>(std::min<uint64_t>(d->size(), 64)));
  (void)d->Read(0, tokens);
  return 0;
}
