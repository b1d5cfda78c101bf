// Hugging Face config.json parsing (LlamaConfig) on arbitrary text.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "model/llama_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = strata::model::ParseLlamaConfig(text, "config.json");
  if (c.ok()) {
    (void)c->ParameterCount();
    (void)c->TrainFlopsPerToken(128);
  }
  return 0;
}
