// The shape of a Llama-family decoder: from a Hugging Face config.json, or a named preset.
//
//   STRATA_ASSIGN_OR_RETURN(LlamaConfig c, ResolveModel("/models/llama-70b"));   // a directory
//   STRATA_ASSIGN_OR_RETURN(LlamaConfig c, ResolveModel("llama-20m"));           // a preset
//
// The keys read from config.json (Hugging Face's LlamaConfig names): vocab_size, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default:
// num_attention_heads), max_position_embeddings, rms_norm_eps, the RoPE base (default 10000) from
// `rope_theta`, `rope_parameters.rope_theta` (transformers 5) or `rope_scaling.rope_theta`, which
// must agree where several are given, tie_word_embeddings (default false), model_type (must be
// "llama" or "mistral" when present), hidden_act (must be "silu" when present), pad_token_id
// (that row of the embedding gets no gradient from the lookup, as nn.Embedding's padding_idx),
// bos_token_id / eos_token_id (carried through to the configs Strata writes).
//
// Keys with which transformers builds a model Strata does not compute are refused (Unimplemented,
// naming the key and the value) instead of ignored: a RoPE type other than "default" in
// `rope_parameters` or `rope_scaling`, RoPE settings per layer type, partial_rotary_factor other
// than 1, attention_bias or mlp_bias true, attention_dropout other than 0, a quantization_config,
// and a head_dim other than hidden_size / num_attention_heads. Keys transformers' Llama does not
// read either are ignored. Errors name the file and the key, and say what was expected.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::model {

struct LlamaConfig {
  std::string name;  // the preset's name, or the directory it was read from
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t max_position_embeddings = 4096;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  // bos_token_id / eos_token_id as JSON text (a number, a list or null), kept from config.json.
  std::string bos_token_id_json = "1";
  std::string eos_token_id_json = "2";
  // pad_token_id, -1 when there is none. As transformers' nn.Embedding(padding_idx), the lookup of
  // this token adds no gradient to its embedding row.
  int64_t pad_token_id = -1;
  // "llama", or "mistral": the same decoder with sliding-window attention. Strata computes full
  // causal attention, which is Mistral's for sequences of at most `sliding_window` tokens (0: no
  // window); `strata train` refuses longer ones. Written back as it was read (ToHfConfigJson).
  std::string model_type = "llama";
  int64_t sliding_window = 0;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t kv_dim() const { return head_dim() * num_key_value_heads; }
  // Parameters of one decoder block: q, k, v, o projections, gate/up/down, two RMSNorm weights.
  int64_t BlockParameters() const;
  // All parameters: embeddings, blocks, final norm, and the LM head unless tied.
  int64_t ParameterCount() const;
  // Forward + backward FLOPs per token for a sequence of `seq_len` (6 * matrix parameters plus
  // the attention score and value products), for TFLOPS reporting.
  double TrainFlopsPerToken(int64_t seq_len) const;

  // InvalidArgument, naming the field, for non-positive sizes, heads that do not divide the
  // hidden size, kv heads that do not divide the heads, an odd head dimension (rotary embedding
  // rotates pairs), eps <= 0 or theta <= 0.
  Status Validate() const;

  friend bool operator==(const LlamaConfig&, const LlamaConfig&) = default;
};

// Parses a config.json text; `source` names it in errors.
Result<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source);
// Reads `path`: a config.json file, or a directory holding one. NotFound names the path when
// there is none.
Result<LlamaConfig> LoadLlamaConfig(const std::string& path, FileSystem& fs = LocalFileSystem());
// A named preset: "llama-tiny" (tests), "llama-20m" (the main job), "llama2-7b", "llama2-13b",
// "llama2-70b", "llama3-8b", "llama3-70b". NotFound lists the names.
Result<LlamaConfig> LlamaPreset(std::string_view name);
std::vector<std::string> LlamaPresetNames();
// A directory (or config.json path) if one exists at `model`, else a preset name.
Result<LlamaConfig> ResolveModel(const std::string& model);
// A Hugging Face config.json for `config` (LlamaForCausalLM), which `transformers` loads.
// `torch_dtype`: "float32", "bfloat16" or "float16".
std::string ToHfConfigJson(const LlamaConfig& config, std::string_view torch_dtype);

}  // namespace strata::model
