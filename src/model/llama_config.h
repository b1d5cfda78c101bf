// The shape of a Llama-family decoder: from a Hugging Face config.json, or a named preset.
//
//   STRATA_ASSIGN_OR_RETURN(LlamaConfig c, ResolveModel("/models/llama-70b"));   // a directory
//   STRATA_ASSIGN_OR_RETURN(LlamaConfig c, ResolveModel("llama-20m"));           // a preset
//
// Model families are data: a config says which features its decoder uses, and the ops implement
// each once. The families (model_type) and what they add to Llama's decoder:
//   "llama"    (Llama 2, 3, 3.1, 3.2, 3.3; DeepSeek-R1-Distill-Llama) attention_bias (q, k, v, o
//              biases) and mlp_bias (gate, up, down biases) when the config says so
//   "mistral"  (Mistral, Mistral-Nemo) sliding-window attention, computed as full causal attention,
//              which it is for sequences of at most sliding_window tokens (longer ones are refused)
//   "qwen2"    (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen) q, k, v biases; sliding-window layers
//              as Mistral's when use_sliding_window is on
//   "qwen3"    per-head RMSNorm of q and k before RoPE (q_norm, k_norm), attention_bias
// Every family: an explicit head_dim (Mistral-Nemo, Qwen3), RoPE scaling (rope.h: "llama3",
// "linear", "yarn", and "dynamic", which is the default below max_position_embeddings), tied
// embeddings, pad_token_id (that embedding row gets no gradient from its lookups, as
// nn.Embedding's padding_idx).
//
// The keys read from config.json (Hugging Face's names): vocab_size, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default:
// num_attention_heads), head_dim, max_position_embeddings, rms_norm_eps, the RoPE base (default
// 10000) and scaling from `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters`
// (transformers 5), which must agree where both are given, tie_word_embeddings, attention_bias,
// mlp_bias, the sliding-window keys, hidden_act (must be "silu"), pad_token_id, bos_token_id and
// eos_token_id. Keys with which transformers builds a model Strata does not compute are refused
// (Unimplemented, naming the key and the value) instead of ignored: another model_type (Gemma,
// Phi, mixtures of experts, MLA: one line naming it), a RoPE type Strata does not compute
// ("longrope", ...), RoPE per layer type, partial_rotary_factor other than 1, attention_dropout
// other than 0, a quantization_config. Sizes that cannot be meant (a billion layers) are refused
// naming the key before anything is allocated. Keys the family's transformers model does not read
// either are ignored, and kept: the config.json Strata writes is the one it read, with the keys
// it owns brought up to date (ToHfConfigJson), so that AutoModelForCausalLM loads a checkpoint as
// the class it came from.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/rope.h"
#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::model {

struct LlamaConfig {
  std::string name;  // the preset's name, or the directory it was read from
  // "llama", "mistral", "qwen2" or "qwen3" (above).
  std::string model_type = "llama";
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t max_position_embeddings = 4096;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;  // kind kDefault: none
  bool tie_word_embeddings = false;
  // An explicit head_dim (0: hidden_size / num_attention_heads).
  int64_t explicit_head_dim = 0;
  bool qkv_bias = false;  // q, k and v projections have biases (attention_bias; Qwen2 always)
  bool o_bias = false;    // the o projection has a bias (Llama's and Qwen3's attention_bias)
  bool mlp_bias = false;  // gate, up and down have biases (Llama's mlp_bias)
  bool qk_norm = false;   // RMSNorm of each head of q and k before RoPE (Qwen3)
  // The shortest attention window any layer uses (0: none): Strata computes full causal
  // attention, which is the window's for sequences of at most this many tokens; `strata train`
  // refuses longer ones.
  int64_t sliding_window = 0;
  // bos_token_id / eos_token_id as JSON text (a number, a list or null), kept from config.json.
  std::string bos_token_id_json = "1";
  std::string eos_token_id_json = "2";
  // pad_token_id, -1 when there is none. As transformers' nn.Embedding(padding_idx), the lookup of
  // this token adds no gradient to its embedding row.
  int64_t pad_token_id = -1;
  // The config.json this was read from (empty for a preset): ToHfConfigJson keeps its keys.
  std::string source_json;

  int64_t head_dim() const {
    return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_attention_heads;
  }
  int64_t q_dim() const { return head_dim() * num_attention_heads; }
  int64_t kv_dim() const { return head_dim() * num_key_value_heads; }
  // Parameters of one decoder block: q, k, v, o projections, gate/up/down, two RMSNorm weights,
  // and the family's biases and q/k norms.
  int64_t BlockParameters() const;
  // All parameters: embeddings, blocks, final norm, and the LM head unless tied.
  int64_t ParameterCount() const;
  // Forward + backward FLOPs per token for a sequence of `seq_len` (6 * matrix parameters plus
  // the attention score and value products), for TFLOPS reporting.
  double TrainFlopsPerToken(int64_t seq_len) const;

  // InvalidArgument, naming the field, for sizes that are not positive or cannot be meant, heads
  // that do not divide the hidden size (without an explicit head_dim), kv heads that do not divide
  // the heads, an odd head dimension (rotary embedding rotates pairs), eps <= 0, theta <= 0, or a
  // RoPE scaling whose factors are not positive.
  Status Validate() const;

  // The family's fields (all but name and source_json) equal: the same model.
  bool SameModel(const LlamaConfig& other) const;
  friend bool operator==(const LlamaConfig&, const LlamaConfig&) = default;
};

// Parses a config.json text; `source` names it in errors.
Result<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source);
// Reads `path`: a config.json file, or a directory holding one. NotFound names the path when
// there is none.
Result<LlamaConfig> LoadLlamaConfig(const std::string& path, FileSystem& fs = LocalFileSystem());
// A named preset: "llama-tiny" (tests), "llama-20m" (the main job), "llama2-7b", "llama2-13b",
// "llama2-70b", "llama3-8b", "llama3-70b", "llama3.1-8b", "llama3.1-70b", "qwen2.5-7b",
// "qwen2.5-72b", "qwen3-8b", "llama-1t" (planning). NotFound lists the names.
Result<LlamaConfig> LlamaPreset(std::string_view name);
std::vector<std::string> LlamaPresetNames();
// A directory (or config.json path) if one exists at `model`, else a preset name.
Result<LlamaConfig> ResolveModel(const std::string& model);
// A Hugging Face config.json for `config`, which `transformers` loads as the family's class
// (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM): the config it was
// read from with every key kept, or for a preset a complete one. `torch_dtype`: "float32",
// "bfloat16" or "float16" (written as the source's "dtype" or "torch_dtype").
std::string ToHfConfigJson(const LlamaConfig& config, std::string_view torch_dtype);

}  // namespace strata::model
