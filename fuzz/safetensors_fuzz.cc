// The safetensors reader's header validation on arbitrary files: errors, never a crash; a file it
// accepts can be read back tensor by tensor within its size.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/fuzz_file.h"
#include "train/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = strata::fuzz::ScratchPath(".safetensors");
  if (!strata::fuzz::WriteScratch(path, data, size)) return 0;
  auto f = strata::train::SafetensorsFile::Open(path);
  if (!f.ok()) return 0;
  std::vector<float> buf;
  for (const auto& t : (*f)->tensors()) {
    const uint64_t n = std::min<uint64_t>(t.num_elements, 4096);
    buf.resize(n);
    (void)(*f)->ReadRange(t.name, 0, n, buf.data(), strata::device::DType::kF32);
  }
  return 0;
}
