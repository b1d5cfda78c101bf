// LoRA adapters on disk, in PEFT's layout, and merging them into a model's weights.
//
//   DIR/adapter_config.json        PEFT's LoraConfig: peft_type "LORA", r, lora_alpha,
//                                  target_modules, ... (what peft's PeftModel.from_pretrained reads)
//   DIR/adapter_model.safetensors  "base_model.model.<module>.lora_A.weight" [r, in] and
//                                  ".lora_B.weight" [out, r] per adapted projection
//
// A checkpoint of a LoRA run holds both beside the base weights (checkpoint.h), so the step
// directory is at once a transformers model directory and a PEFT adapter directory.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "model/llama_model.h"
#include "strata/config.h"
#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::train {

inline constexpr std::string_view kAdapterConfigFile = "adapter_config.json";
inline constexpr std::string_view kAdapterModelFile = "adapter_model.safetensors";

// True when `dir` holds adapter_config.json.
bool HasAdapter(const std::string& dir, FileSystem& fs = LocalFileSystem());

// DIR/adapter_config.json as LoRA settings. InvalidArgument naming the file and key for what
// Strata does not run: a peft_type other than LORA, DoRA, rsLoRA, fan_in_fan_out, biases,
// modules_to_save, layers_to_transform, per-module rank or alpha patterns. A non-zero
// lora_dropout is read as 0 (Strata trains without dropout) and said in `*note`.
Result<LoraSettings> ReadAdapterConfig(const std::string& dir, std::string* note = nullptr,
                                       FileSystem& fs = LocalFileSystem());

// With strata.lora on: adds the adapters' names ("*.lora_A.weight", "*.lora_B.weight") to
// strata.trainable (once), so that they train and every other unit is frozen.
void AddLoraTrainablePatterns(Config* config);

// PEFT's adapter_config.json for `lora` on the model at `base_model` (a path or a name).
std::string AdapterConfigJson(const model::LlamaLora& lora, std::string_view base_model);

// `strata checkpoint merge-lora`: OUT gets BASE's weights with every adapter of ADAPTER merged,
// W + (lora_alpha / r) B A (in fp32, stored in each tensor's own dtype), and BASE's config.json
// and tokenizer files: a plain transformers model directory. OUT must not hold weights already.
// Errors name the tensor: an adapter for a tensor BASE lacks, or shapes that do not fit.
struct MergeStats {
  int merged_tensors = 0;
  int copied_tensors = 0;
  uint64_t bytes = 0;
};
Result<MergeStats> MergeLora(const std::string& base_dir, const std::string& adapter_dir,
                             const std::string& out_dir,
                             const std::function<void(const std::string&)>& print = {},
                             FileSystem& fs = LocalFileSystem());

}  // namespace strata::train
