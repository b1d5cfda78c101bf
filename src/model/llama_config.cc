#include "model/llama_config.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

namespace strata::model {

namespace {

using Json = nlohmann::json;

struct Preset {
  const char* name;
  LlamaConfig config;
};

LlamaConfig Make(const char* name, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers,
                 int64_t heads, int64_t kv_heads, int64_t max_pos, double eps, double theta,
                 bool tied) {
  LlamaConfig c;
  c.name = name;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.max_position_embeddings = max_pos;
  c.rms_norm_eps = eps;
  c.rope_theta = theta;
  c.tie_word_embeddings = tied;
  return c;
}

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = {
      {"llama-tiny", Make("llama-tiny", 256, 64, 160, 2, 4, 2, 128, 1e-5, 10000.0, false)},
      {"llama-20m", Make("llama-20m", 1024, 384, 1024, 12, 6, 2, 512, 1e-5, 10000.0, false)},
      {"llama2-7b", Make("llama2-7b", 32000, 4096, 11008, 32, 32, 32, 4096, 1e-5, 10000.0, false)},
      {"llama2-13b",
       Make("llama2-13b", 32000, 5120, 13824, 40, 40, 40, 4096, 1e-5, 10000.0, false)},
      {"llama2-70b", Make("llama2-70b", 32000, 8192, 28672, 80, 64, 8, 4096, 1e-5, 10000.0, false)},
      {"llama3-8b", Make("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 8192, 1e-5, 500000.0, false)},
      {"llama3-70b",
       Make("llama3-70b", 128256, 8192, 28672, 80, 64, 8, 8192, 1e-5, 500000.0, false)},
      // Planning only (strata estimate): a Llama-3-shaped model of 1.03T parameters, 128 layers
      // of hidden 25600 (200 heads of 128, 8 KV heads), FFN 86016. docs/planning.md.
      {"llama-1t", Make("llama-1t", 128256, 25600, 86016, 128, 200, 8, 8192, 1e-5, 500000.0, false)},
  };
  return presets;
}

Result<int64_t> GetInt(const Json& j, const char* key, std::string_view source, bool required,
                       int64_t fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) {
      return InvalidArgumentError(fmt::format("{}: the key '{}' is missing", source, key));
    }
    return fallback;
  }
  if (!it->is_number_integer()) {
    return InvalidArgumentError(
        fmt::format("{}: '{}' must be an integer, got {}", source, key, it->dump()));
  }
  return it->get<int64_t>();
}

Result<double> GetDouble(const Json& j, const char* key, std::string_view source,
                         double fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number()) {
    return InvalidArgumentError(
        fmt::format("{}: '{}' must be a number, got {}", source, key, it->dump()));
  }
  return it->get<double>();
}


// The RoPE settings, wherever a config keeps them. transformers 5 writes them as
// `rope_parameters` ({"rope_theta": ..., "rope_type": ...}, no top-level rope_theta); earlier
// releases wrote a top-level `rope_theta` and a `rope_scaling` object ("type" or "rope_type").
// Every place is read and they must agree; a scaling Strata does not compute is refused, naming
// the key and the value, so that no model trains with other positions than transformers gives it.
Result<double> ParseRope(const Json& j, std::string_view source) {
  std::optional<double> theta;
  std::string theta_from;
  auto take_theta = [&](const Json& obj, const std::string& where) -> Status {
    auto it = obj.find("rope_theta");
    if (it == obj.end() || it->is_null()) return Status::Ok();
    if (!it->is_number()) {
      return InvalidArgumentError(
          fmt::format("{}: '{}' must be a number, got {}", source, where, it->dump()));
    }
    const double v = it->get<double>();
    if (theta && *theta != v) {
      return InvalidArgumentError(fmt::format(
          "{}: {} is {} but {} is {}; the config states two RoPE bases", source, theta_from,
          *theta, where, v));
    }
    theta = v;
    theta_from = where;
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(take_theta(j, "rope_theta"));
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_object()) {
      return InvalidArgumentError(fmt::format("{}: {} is {}; expected an object or null", source,
                                              key, it->dump()));
    }
    for (const auto& [name, value] : it->items()) {
      if (value.is_object()) {
        return UnimplementedError(fmt::format(
            "{}: {}.{} holds RoPE settings per layer type; Strata computes one RoPE for every "
            "layer",
            source, key, name));
      }
    }
    STRATA_RETURN_IF_ERROR(take_theta(*it, std::string(key) + ".rope_theta"));
    for (const char* type_key : {"rope_type", "type"}) {
      auto t = it->find(type_key);
      if (t == it->end() || t->is_null()) continue;
      if (!t->is_string()) {
        return InvalidArgumentError(fmt::format("{}: {}.{} is {}; expected a string", source,
                                                key, type_key, t->dump()));
      }
      if (*t != "default") {
        return UnimplementedError(fmt::format(
            "{}: {}.{} is {}; Strata computes plain rotary embeddings (rope_type \"default\") "
            "only",
            source, key, type_key, t->dump()));
      }
    }
    if (auto f = it->find("partial_rotary_factor");
        f != it->end() && !(f->is_number() && f->get<double>() == 1.0)) {
      return UnimplementedError(fmt::format(
          "{}: {}.partial_rotary_factor is {}; Strata rotates the whole head", source, key,
          f->dump()));
    }
  }
  return theta.value_or(10000.0);
}

// Keys with which transformers builds a different model than Strata's. Each is accepted at its
// neutral value (absent and null too) and refused otherwise, naming the key and the value, so a
// model Strata cannot compute is never trained as plain Llama. Keys transformers' Llama and
// Mistral do not read are ignored, as transformers ignores them.
Status RefuseUnimplementedKeys(const Json& j, std::string_view source) {
  struct Neutral {
    const char* key;
    Json value;
    const char* why;
  };
  const Neutral keys[] = {
      {"attention_bias", false, "Strata's Llama has no bias terms"},
      {"mlp_bias", false, "Strata's Llama has no bias terms"},
      {"attention_dropout", 0.0, "Strata trains without dropout"},
      {"partial_rotary_factor", 1.0, "Strata rotates the whole head"},
      {"quantization_config", nullptr, "Strata trains unquantized weights"},
  };
  for (const Neutral& n : keys) {
    auto it = j.find(n.key);
    if (it == j.end() || it->is_null() || *it == n.value) continue;
    return UnimplementedError(fmt::format("{}: {} is {}; {}", source, n.key, it->dump(), n.why));
  }
  // An explicit head_dim that differs from hidden_size / num_attention_heads (Mistral-Nemo, Qwen3)
  // changes every attention projection's shape.
  auto hd = j.find("head_dim");
  auto hidden = j.find("hidden_size");
  auto heads = j.find("num_attention_heads");
  if (hd != j.end() && !hd->is_null() && hidden != j.end() && heads != j.end() &&
      hidden->is_number_integer() && heads->is_number_integer() && heads->get<int64_t>() > 0 &&
      !(hd->is_number_integer() &&
        hd->get<int64_t>() == hidden->get<int64_t>() / heads->get<int64_t>())) {
    return UnimplementedError(fmt::format(
        "{}: head_dim is {}; Strata's attention uses hidden_size / num_attention_heads = {}",
        source, hd->dump(), hidden->get<int64_t>() / heads->get<int64_t>()));
  }
  return Status::Ok();
}

}  // namespace

int64_t LlamaConfig::BlockParameters() const {
  const int64_t h = hidden_size;
  return h * h * 2 + h * kv_dim() * 2 + 3 * h * intermediate_size + 2 * h;
}

int64_t LlamaConfig::ParameterCount() const {
  const int64_t embed = vocab_size * hidden_size;
  return embed + num_hidden_layers * BlockParameters() + hidden_size +
         (tie_word_embeddings ? 0 : embed);
}

double LlamaConfig::TrainFlopsPerToken(int64_t seq_len) const {
  const double matrix = static_cast<double>(num_hidden_layers) *
                            static_cast<double>(BlockParameters() - 2 * hidden_size) +
                        static_cast<double>(vocab_size) * static_cast<double>(hidden_size);
  // Attention: q k^T and p v, each 2 * seq * hidden per token forward (causal: half of it).
  const double attention = static_cast<double>(num_hidden_layers) * 2.0 * 2.0 *
                           static_cast<double>(seq_len) * static_cast<double>(hidden_size) * 0.5;
  return 6.0 * matrix + 3.0 * attention;
}

Status LlamaConfig::Validate() const {
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"max_position_embeddings", max_position_embeddings},
  };
  for (const auto& [key, value] : sizes) {
    if (value <= 0) {
      return InvalidArgumentError(
          fmt::format("model '{}': {} is {}; expected a positive integer", name, key, value));
    }
  }
  if (hidden_size % num_attention_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': hidden_size {} is not a multiple of num_attention_heads {}", name,
        hidden_size, num_attention_heads));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': num_attention_heads {} is not a multiple of num_key_value_heads {}", name,
        num_attention_heads, num_key_value_heads));
  }
  if (head_dim() % 2 != 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': the head dimension {} (hidden_size / num_attention_heads) is odd; rotary "
        "embeddings need an even one",
        name, head_dim()));
  }
  if (!(rms_norm_eps > 0.0)) {
    return InvalidArgumentError(
        fmt::format("model '{}': rms_norm_eps is {}; expected > 0", name, rms_norm_eps));
  }
  if (pad_token_id >= vocab_size) {
    return InvalidArgumentError(fmt::format(
        "model '{}': pad_token_id {} is not below vocab_size {}", name, pad_token_id, vocab_size));
  }
  if (!(rope_theta > 0.0)) {
    return InvalidArgumentError(
        fmt::format("model '{}': rope_theta is {}; expected > 0", name, rope_theta));
  }
  return Status::Ok();
}

Result<LlamaConfig> ParseLlamaConfig(std::string_view json_text, std::string_view source) {
  Json j;
  try {
    j = Json::parse(json_text);
  } catch (const Json::exception& e) {
    // parse_error, and out_of_range for a number too large for a double (fuzz/hf_config_fuzz).
    return InvalidArgumentError(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
  if (!j.is_object()) {
    return InvalidArgumentError(fmt::format("{}: expected a JSON object", source));
  }
  std::string model_type = "llama";
  if (auto it = j.find("model_type"); it != j.end() && it->is_string()) {
    model_type = it->get<std::string>();
    if (model_type != "llama" && model_type != "mistral") {
      return InvalidArgumentError(fmt::format(
          "{}: model_type is '{}'; Strata trains Llama-family decoders (\"llama\", and "
          "\"mistral\" within its sliding window)",
          source, model_type));
    }
  }
  if (auto it = j.find("hidden_act"); it != j.end() && it->is_string() && *it != "silu") {
    return InvalidArgumentError(fmt::format(
        "{}: hidden_act is {}; the Llama MLP Strata implements uses \"silu\"", source,
        it->dump()));
  }
  STRATA_RETURN_IF_ERROR(RefuseUnimplementedKeys(j, source));
  LlamaConfig c;
  c.name = std::string(source);
  c.model_type = model_type;
  if (auto it = j.find("sliding_window"); model_type == "mistral" && it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
      return InvalidArgumentError(fmt::format(
          "{}: sliding_window is {}; expected a positive integer or null", source, it->dump()));
    }
    c.sliding_window = it->get<int64_t>();
  }
  // Token ids are carried through to the configs Strata writes (a number or a list).
  for (auto [key, out] : {std::pair{"bos_token_id", &c.bos_token_id_json},
                          std::pair{"eos_token_id", &c.eos_token_id_json}}) {
    if (auto it = j.find(key); it != j.end()) *out = it->dump();
  }
  STRATA_ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c.hidden_size, GetInt(j, "hidden_size", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c.intermediate_size, GetInt(j, "intermediate_size", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c.num_hidden_layers, GetInt(j, "num_hidden_layers", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c.num_attention_heads,
                          GetInt(j, "num_attention_heads", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c.num_key_value_heads, GetInt(j, "num_key_value_heads", source, false,
                                                        c.num_attention_heads));
  STRATA_ASSIGN_OR_RETURN(c.max_position_embeddings,
                          GetInt(j, "max_position_embeddings", source, false, 2048));
  STRATA_ASSIGN_OR_RETURN(c.rms_norm_eps, GetDouble(j, "rms_norm_eps", source, 1e-6));
  STRATA_ASSIGN_OR_RETURN(c.rope_theta, ParseRope(j, source));
  if (auto it = j.find("pad_token_id"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return InvalidArgumentError(fmt::format(
          "{}: pad_token_id is {}; expected a token id or null", source, it->dump()));
    }
    c.pad_token_id = it->get<int64_t>();
  }
  if (auto it = j.find("tie_word_embeddings"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) {
      return InvalidArgumentError(fmt::format(
          "{}: 'tie_word_embeddings' must be true or false, got {}", source, it->dump()));
    }
    c.tie_word_embeddings = it->get<bool>();
  }
  Status valid = c.Validate();
  if (!valid.ok()) return valid;
  return c;
}

Result<LlamaConfig> LoadLlamaConfig(const std::string& path, FileSystem& fs) {
  std::filesystem::path p(path);
  if (fs.IsDirectory(path)) p /= "config.json";
  Result<std::string> text = ReadFileToString(fs, p.string());
  if (!text.ok()) {
    return NotFoundError(fmt::format(
        "{}: no model config (a Hugging Face model directory holds config.json)", p.string()));
  }
  STRATA_ASSIGN_OR_RETURN(LlamaConfig c, ParseLlamaConfig(*text, p.string()));
  c.name = path;
  return c;
}

Result<LlamaConfig> LlamaPreset(std::string_view name) {
  for (const Preset& p : Presets()) {
    if (name == p.name) return p.config;
  }
  std::string names;
  for (const Preset& p : Presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
  return NotFoundError(fmt::format("no model preset '{}' (presets: {})", name, names));
}

std::vector<std::string> LlamaPresetNames() {
  std::vector<std::string> out;
  for (const Preset& p : Presets()) out.emplace_back(p.name);
  return out;
}

Result<LlamaConfig> ResolveModel(const std::string& model) {
  std::error_code ec;
  if (std::filesystem::exists(model, ec)) return LoadLlamaConfig(model);
  Result<LlamaConfig> preset = LlamaPreset(model);
  if (preset.ok()) return preset;
  return NotFoundError(fmt::format(
      "'{}' is neither a model directory (with config.json) nor a preset ({})", model,
      [] {
        std::string names;
        for (const auto& n : LlamaPresetNames()) names += (names.empty() ? "" : ", ") + n;
        return names;
      }()));
}

std::string ToHfConfigJson(const LlamaConfig& c, std::string_view torch_dtype) {
  const bool mistral = c.model_type == "mistral";
  Json j = {
      {"architectures", {mistral ? "MistralForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", mistral ? "mistral" : "llama"},
      {"hidden_act", "silu"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"attention_bias", false},
      {"initializer_range", 0.02},
      {"torch_dtype", std::string(torch_dtype)},
  };
  if (mistral) {
    j["sliding_window"] = c.sliding_window > 0 ? Json(c.sliding_window) : Json(nullptr);
    j.erase("attention_bias");
  }
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  j["bos_token_id"] = Json::parse(c.bos_token_id_json, nullptr, false);
  j["eos_token_id"] = Json::parse(c.eos_token_id_json, nullptr, false);
  return j.dump(2) + "\n";
}

}  // namespace strata::model
