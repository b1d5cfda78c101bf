#include "model/llama_config.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

namespace strata::model {

namespace {

using Json = nlohmann::json;

// ---- presets ------------------------------------------------------------------------------------

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

// Llama 3.1's RoPE: rope_type "llama3", factor 8, low 1, high 4, original 8192.
LlamaConfig Llama31(LlamaConfig c) {
  c.rope_scaling.kind = RopeScaling::kLlama3;
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max = 8192.0;
  c.bos_token_id_json = "128000";
  c.eos_token_id_json = "128001";
  return c;
}

LlamaConfig Qwen(LlamaConfig c, const char* type) {
  c.model_type = type;
  c.qkv_bias = c.model_type == "qwen2";
  c.qk_norm = c.model_type == "qwen3";
  c.bos_token_id_json = "151643";
  c.eos_token_id_json = "151645";
  return c;
}

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = [] {
    std::vector<Preset> p = {
        {"llama-tiny", Make("llama-tiny", 256, 64, 160, 2, 4, 2, 128, 1e-5, 10000.0, false)},
        {"llama-20m", Make("llama-20m", 1024, 384, 1024, 12, 6, 2, 512, 1e-5, 10000.0, false)},
        {"llama2-7b",
         Make("llama2-7b", 32000, 4096, 11008, 32, 32, 32, 4096, 1e-5, 10000.0, false)},
        {"llama2-13b",
         Make("llama2-13b", 32000, 5120, 13824, 40, 40, 40, 4096, 1e-5, 10000.0, false)},
        {"llama2-70b",
         Make("llama2-70b", 32000, 8192, 28672, 80, 64, 8, 4096, 1e-5, 10000.0, false)},
        {"llama3-8b",
         Make("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 8192, 1e-5, 500000.0, false)},
        {"llama3-70b",
         Make("llama3-70b", 128256, 8192, 28672, 80, 64, 8, 8192, 1e-5, 500000.0, false)},
        // Llama 3.1 / 3.3 (the 70B shapes are the same; 3.3 is a fine-tune of 3.1's shape).
        {"llama3.1-8b", Llama31(Make("llama3.1-8b", 128256, 4096, 14336, 32, 32, 8, 131072,
                                     1e-5, 500000.0, false))},
        {"llama3.1-70b", Llama31(Make("llama3.1-70b", 128256, 8192, 28672, 80, 64, 8, 131072,
                                      1e-5, 500000.0, false))},
        // Qwen2.5 (q, k, v biases) and Qwen3 (q/k norms, head_dim 128).
        {"qwen2.5-7b", Qwen(Make("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 32768, 1e-6,
                                 1000000.0, false),
                            "qwen2")},
        {"qwen2.5-72b", Qwen(Make("qwen2.5-72b", 152064, 8192, 29568, 80, 64, 8, 32768, 1e-6,
                                  1000000.0, false),
                             "qwen2")},
        {"qwen3-8b", [] {
           LlamaConfig c = Qwen(Make("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 40960, 1e-6,
                                     1000000.0, false),
                                "qwen3");
           c.explicit_head_dim = 128;
           return c;
         }()},
        // Planning only (strata estimate): a Llama-3-shaped model of 1.03T parameters, 128 layers
        // of hidden 25600 (200 heads of 128, 8 KV heads), FFN 86016. docs/planning.md.
        {"llama-1t",
         Make("llama-1t", 128256, 25600, 86016, 128, 200, 8, 8192, 1e-5, 500000.0, false)},
    };
    return p;
  }();
  return presets;
}

// ---- reading keys ---------------------------------------------------------------------------------

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

Result<bool> GetBool(const Json& j, const char* key, std::string_view source, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    return InvalidArgumentError(
        fmt::format("{}: '{}' must be true or false, got {}", source, key, it->dump()));
  }
  return it->get<bool>();
}

// ---- families -------------------------------------------------------------------------------------

struct Family {
  const char* model_type;
  const char* architecture;
};
constexpr Family kFamilies[] = {
    {"llama", "LlamaForCausalLM"},
    {"mistral", "MistralForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},
};

const Family* FindFamily(std::string_view model_type) {
  for (const Family& f : kFamilies) {
    if (model_type == f.model_type) return &f;
  }
  return nullptr;
}

Result<std::string> ReadModelType(const Json& j, std::string_view source) {
  auto it = j.find("model_type");
  if (it == j.end() || it->is_null()) return std::string("llama");
  if (!it->is_string()) {
    return InvalidArgumentError(
        fmt::format("{}: model_type is {}; expected a string", source, it->dump()));
  }
  const std::string type = it->get<std::string>();
  if (FindFamily(type) == nullptr) {
    return InvalidArgumentError(fmt::format(
        "{}: model_type is '{}'; Strata trains the Llama family of decoders: \"llama\" (Llama "
        "2, 3, 3.1-3.3), \"mistral\", \"qwen2\" (Qwen2, Qwen2.5) and \"qwen3\" (dense)",
        source, type));
  }
  return type;
}

// ---- RoPE -----------------------------------------------------------------------------------------

// One place a config keeps RoPE settings: the object and its name ("rope_parameters", ...).
struct RopeSource {
  const Json* object;
  std::string key;
};

Result<double> RopeNumber(const RopeSource& r, const char* key, std::string_view source,
                          std::optional<double> fallback) {
  auto it = r.object->find(key);
  if (it == r.object->end() || it->is_null()) {
    if (fallback) return *fallback;
    return InvalidArgumentError(
        fmt::format("{}: {}.{} is missing; the RoPE type needs it", source, r.key, key));
  }
  if (!it->is_number() || !std::isfinite(it->get<double>())) {
    return InvalidArgumentError(
        fmt::format("{}: {}.{} is {}; expected a number", source, r.key, key, it->dump()));
  }
  return it->get<double>();
}

// YaRN's correction range (pairs) from beta_fast, beta_slow and the original context, as
// transformers' _compute_yarn_parameters computes it.
void YarnRange(RopeScaling* s, double theta, int64_t head_dim, double beta_fast, double beta_slow,
               bool truncate) {
  const double dim = static_cast<double>(head_dim);
  const double pi = 3.14159265358979323846;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(s->original_max / (rotations * 2.0 * pi)) / (2.0 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  s->yarn_low = std::max(low, 0.0);
  s->yarn_high = std::min(high, dim - 1.0);
}

// The scaling in one place (rope_parameters or rope_scaling), or nullopt where it says none.
Result<std::optional<RopeScaling>> ReadRopeScaling(const RopeSource& r, const LlamaConfig& c,
                                                   double theta, std::string_view source) {
  std::optional<std::string> type;
  const char* type_from = "rope_type";
  for (const char* type_key : {"rope_type", "type"}) {
    auto t = r.object->find(type_key);
    if (t == r.object->end() || t->is_null()) continue;
    if (!t->is_string()) {
      return InvalidArgumentError(fmt::format("{}: {}.{} is {}; expected a string", source, r.key,
                                              type_key, t->dump()));
    }
    type = t->get<std::string>();
    type_from = type_key;
    break;
  }
  if (auto f = r.object->find("partial_rotary_factor");
      f != r.object->end() && !f->is_null() && !(f->is_number() && f->get<double>() == 1.0)) {
    return UnimplementedError(fmt::format(
        "{}: {}.partial_rotary_factor is {}; Strata rotates the whole head", source, r.key,
        f->dump()));
  }
  if (!type || *type == "default") return std::optional<RopeScaling>();
  RopeScaling s;
  const std::optional<double> one = 1.0;
  if (*type == "dynamic") {
    // transformers rescales the base only for positions beyond max_position_embeddings, which
    // Strata never trains on: the default frequencies.
    STRATA_ASSIGN_OR_RETURN(s.factor, RopeNumber(r, "factor", source, std::nullopt));
    return std::optional<RopeScaling>(RopeScaling{});
  }
  if (*type == "linear") {
    s.kind = RopeScaling::kLinear;
    STRATA_ASSIGN_OR_RETURN(s.factor, RopeNumber(r, "factor", source, std::nullopt));
  } else if (*type == "llama3") {
    s.kind = RopeScaling::kLlama3;
    STRATA_ASSIGN_OR_RETURN(s.factor, RopeNumber(r, "factor", source, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(s.low_freq_factor, RopeNumber(r, "low_freq_factor", source, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(s.high_freq_factor,
                            RopeNumber(r, "high_freq_factor", source, std::nullopt));
    STRATA_ASSIGN_OR_RETURN(s.original_max,
                            RopeNumber(r, "original_max_position_embeddings", source, std::nullopt));
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      return InvalidArgumentError(fmt::format(
          "{}: {}.high_freq_factor {} is not above low_freq_factor {}", source, r.key,
          s.high_freq_factor, s.low_freq_factor));
    }
  } else if (*type == "yarn") {
    s.kind = RopeScaling::kYarn;
    STRATA_ASSIGN_OR_RETURN(s.original_max,
                            RopeNumber(r, "original_max_position_embeddings", source,
                                       static_cast<double>(c.max_position_embeddings)));
    STRATA_ASSIGN_OR_RETURN(
        s.factor, RopeNumber(r, "factor", source,
                             static_cast<double>(c.max_position_embeddings) / s.original_max));
    // attention_factor, else mscale / mscale_all_dim, else from the factor (transformers').
    auto mscale = [](double scale, double m) {
      return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    STRATA_ASSIGN_OR_RETURN(const double m, RopeNumber(r, "mscale", source, 0.0));
    STRATA_ASSIGN_OR_RETURN(const double m_all, RopeNumber(r, "mscale_all_dim", source, 0.0));
    const double inferred =
        m != 0.0 && m_all != 0.0 ? mscale(s.factor, m) / mscale(s.factor, m_all)
                                 : mscale(s.factor, 1.0);
    STRATA_ASSIGN_OR_RETURN(s.attention_factor, RopeNumber(r, "attention_factor", source, inferred));
    STRATA_ASSIGN_OR_RETURN(double beta_fast, RopeNumber(r, "beta_fast", source, 32.0));
    STRATA_ASSIGN_OR_RETURN(double beta_slow, RopeNumber(r, "beta_slow", source, one));
    if (beta_fast == 0.0) beta_fast = 32.0;  // transformers' `or 32`
    if (beta_slow == 0.0) beta_slow = 1.0;
    bool truncate = true;
    if (auto t = r.object->find("truncate"); t != r.object->end() && !t->is_null()) {
      if (!t->is_boolean()) {
        return InvalidArgumentError(fmt::format("{}: {}.truncate is {}; expected true or false",
                                                source, r.key, t->dump()));
      }
      truncate = t->get<bool>();
    }
    YarnRange(&s, theta, c.head_dim(), beta_fast, beta_slow, truncate);
  } else {
    return UnimplementedError(fmt::format(
        "{}: {}.{} is \"{}\"; Strata computes RoPE types \"default\", \"linear\", "
        "\"dynamic\", \"llama3\" and \"yarn\"",
        source, r.key, type_from, *type));
  }
  return std::optional<RopeScaling>(s);
}

// The RoPE base and scaling, wherever a config keeps them. transformers 5 writes them as
// `rope_parameters` ({"rope_theta": ..., "rope_type": ..., ...}, no top-level rope_theta);
// earlier releases wrote a top-level `rope_theta` and a `rope_scaling` object ("type" or
// "rope_type"). Every place is read and they must agree, so that no model trains with other
// positions than transformers gives it.
Status ReadRope(const Json& j, std::string_view source, LlamaConfig* c) {
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
  std::vector<RopeSource> places;
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
    places.push_back({&*it, key});
  }
  c->rope_theta = theta.value_or(10000.0);
  std::optional<RopeScaling> scaling;
  std::string scaling_from;
  for (const RopeSource& r : places) {
    STRATA_ASSIGN_OR_RETURN(std::optional<RopeScaling> s,
                            ReadRopeScaling(r, *c, c->rope_theta, source));
    if (!s) continue;
    if (scaling && !(*scaling == *s)) {
      return InvalidArgumentError(fmt::format(
          "{}: {} and {} state different RoPE scalings; give one", source, scaling_from, r.key));
    }
    scaling = s;
    scaling_from = r.key;
  }
  c->rope_scaling = scaling.value_or(RopeScaling{});
  return Status::Ok();
}

// ---- the family's keys ------------------------------------------------------------------------------

// Keys with which transformers builds a different model than Strata's, accepted at their neutral
// value (absent and null too) and refused otherwise, naming the key and the value.
Status RefuseUnimplementedKeys(const Json& j, std::string_view source) {
  struct Neutral {
    const char* key;
    Json value;
    const char* why;
  };
  const Neutral keys[] = {
      {"attention_dropout", 0.0, "Strata trains without dropout"},
      {"partial_rotary_factor", 1.0, "Strata rotates the whole head"},
      {"quantization_config", nullptr, "Strata trains unquantized weights"},
  };
  for (const Neutral& n : keys) {
    auto it = j.find(n.key);
    if (it == j.end() || it->is_null() || *it == n.value) continue;
    return UnimplementedError(fmt::format("{}: {} is {}; {}", source, n.key, it->dump(), n.why));
  }
  if (auto it = j.find("hidden_act"); it != j.end() && it->is_string() && *it != "silu") {
    return InvalidArgumentError(fmt::format(
        "{}: hidden_act is {}; the Llama family's MLP Strata implements uses \"silu\"", source,
        it->dump()));
  }
  return Status::Ok();
}

// Biases and q/k norms, by family: Llama's attention_bias (q, k, v, o) and mlp_bias; Qwen2's
// q, k, v biases (always); Qwen3's q/k norms (always) and attention_bias (q, k, v, o).
Status ReadFamilyFeatures(const Json& j, std::string_view source, LlamaConfig* c) {
  const std::string& t = c->model_type;
  if (t == "llama" || t == "qwen3") {
    STRATA_ASSIGN_OR_RETURN(const bool attention_bias, GetBool(j, "attention_bias", source, false));
    c->qkv_bias = c->o_bias = attention_bias;
  }
  if (t == "llama") {
    STRATA_ASSIGN_OR_RETURN(c->mlp_bias, GetBool(j, "mlp_bias", source, false));
  }
  if (t == "qwen2") c->qkv_bias = true;
  if (t == "qwen3") c->qk_norm = true;
  return Status::Ok();
}

// The shortest attention window any layer uses. Mistral: sliding_window. Qwen2 and Qwen3: the
// layers of layer_types marked "sliding_attention" (by default, with use_sliding_window, those
// from max_window_layers on) use sliding_window.
Status ReadSlidingWindow(const Json& j, std::string_view source, LlamaConfig* c) {
  auto window = [&]() -> Result<int64_t> {
    auto it = j.find("sliding_window");
    if (it == j.end() || it->is_null()) return int64_t{0};
    if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
      return InvalidArgumentError(fmt::format(
          "{}: sliding_window is {}; expected a positive integer or null", source, it->dump()));
    }
    return it->get<int64_t>();
  };
  if (c->model_type == "mistral") {
    STRATA_ASSIGN_OR_RETURN(c->sliding_window, window());
    return Status::Ok();
  }
  if (c->model_type != "qwen2" && c->model_type != "qwen3") return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(const bool use, GetBool(j, "use_sliding_window", source, false));
  bool any_sliding = false;
  if (auto lt = j.find("layer_types"); lt != j.end() && !lt->is_null()) {
    if (!lt->is_array()) {
      return InvalidArgumentError(
          fmt::format("{}: layer_types is {}; expected a list", source, lt->dump()));
    }
    for (const Json& v : *lt) {
      if (v == "sliding_attention") {
        any_sliding = true;
      } else if (v != "full_attention") {
        return UnimplementedError(fmt::format(
            "{}: layer_types holds {}; Strata computes \"full_attention\" and "
            "\"sliding_attention\" layers",
            source, v.dump()));
      }
    }
  } else if (use) {
    STRATA_ASSIGN_OR_RETURN(const int64_t first,
                            GetInt(j, "max_window_layers", source, false, 28));
    STRATA_ASSIGN_OR_RETURN(const int64_t layers,
                            GetInt(j, "num_hidden_layers", source, true, 0));
    any_sliding = first < layers;
  }
  if (any_sliding && use) {
    STRATA_ASSIGN_OR_RETURN(c->sliding_window, window());
  }
  return Status::Ok();
}

Status ReadShape(const Json& j, std::string_view source, LlamaConfig* c) {
  STRATA_ASSIGN_OR_RETURN(c->vocab_size, GetInt(j, "vocab_size", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c->hidden_size, GetInt(j, "hidden_size", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c->intermediate_size, GetInt(j, "intermediate_size", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c->num_hidden_layers, GetInt(j, "num_hidden_layers", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c->num_attention_heads,
                          GetInt(j, "num_attention_heads", source, true, 0));
  STRATA_ASSIGN_OR_RETURN(c->num_key_value_heads, GetInt(j, "num_key_value_heads", source, false,
                                                         c->num_attention_heads));
  STRATA_ASSIGN_OR_RETURN(c->explicit_head_dim, GetInt(j, "head_dim", source, false, 0));
  if (c->explicit_head_dim < 0) {
    return InvalidArgumentError(fmt::format("{}: head_dim is {}; expected a positive integer",
                                            source, c->explicit_head_dim));
  }
  // A head_dim equal to the derived one is the same model: keep the derived form.
  if (c->num_attention_heads > 0 && c->explicit_head_dim * c->num_attention_heads == c->hidden_size) {
    c->explicit_head_dim = 0;
  }
  STRATA_ASSIGN_OR_RETURN(c->max_position_embeddings,
                          GetInt(j, "max_position_embeddings", source, false, 2048));
  STRATA_ASSIGN_OR_RETURN(c->rms_norm_eps, GetDouble(j, "rms_norm_eps", source, 1e-6));
  STRATA_ASSIGN_OR_RETURN(c->tie_word_embeddings, GetBool(j, "tie_word_embeddings", source, false));
  if (auto it = j.find("pad_token_id"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return InvalidArgumentError(fmt::format(
          "{}: pad_token_id is {}; expected a token id or null", source, it->dump()));
    }
    c->pad_token_id = it->get<int64_t>();
  }
  // Token ids are carried through to the configs Strata writes (a number or a list).
  for (auto [key, out] : {std::pair{"bos_token_id", &c->bos_token_id_json},
                          std::pair{"eos_token_id", &c->eos_token_id_json}}) {
    if (auto it = j.find(key); it != j.end()) *out = it->dump();
  }
  return Status::Ok();
}

}  // namespace

// ---- LlamaConfig ----------------------------------------------------------------------------------

int64_t LlamaConfig::BlockParameters() const {
  const int64_t h = hidden_size, q = q_dim(), kv = kv_dim();
  int64_t n = h * q * 2 + h * kv * 2 + 3 * h * intermediate_size + 2 * h;
  if (qkv_bias) n += q + 2 * kv;
  if (o_bias) n += h;
  if (mlp_bias) n += 2 * intermediate_size + h;
  if (qk_norm) n += 2 * head_dim();
  return n;
}

int64_t LlamaConfig::ParameterCount() const {
  const int64_t embed = vocab_size * hidden_size;
  return embed + num_hidden_layers * BlockParameters() + hidden_size +
         (tie_word_embeddings ? 0 : embed);
}

double LlamaConfig::TrainFlopsPerToken(int64_t seq_len) const {
  const int64_t h = hidden_size;
  const double block_matrices = static_cast<double>(h * q_dim() * 2 + h * kv_dim() * 2 +
                                                    3 * h * intermediate_size);
  const double matrix = static_cast<double>(num_hidden_layers) * block_matrices +
                        static_cast<double>(vocab_size) * static_cast<double>(hidden_size);
  // Attention: q k^T and p v, each 2 * seq * q_dim per token forward (causal: half of it).
  const double attention = static_cast<double>(num_hidden_layers) * 2.0 * 2.0 *
                           static_cast<double>(seq_len) * static_cast<double>(q_dim()) * 0.5;
  return 6.0 * matrix + 3.0 * attention;
}

Status LlamaConfig::Validate() const {
  // Positive, and no larger than any model anyone means (a typo, or a fuzzer's billion layers,
  // is refused naming the key before anything is sized from it).
  struct Size {
    const char* key;
    int64_t value;
    int64_t most;
  };
  const Size sizes[] = {
      {"vocab_size", vocab_size, int64_t{1} << 26},
      {"hidden_size", hidden_size, int64_t{1} << 20},
      {"intermediate_size", intermediate_size, int64_t{1} << 22},
      {"num_hidden_layers", num_hidden_layers, int64_t{1} << 14},
      {"num_attention_heads", num_attention_heads, int64_t{1} << 14},
      {"num_key_value_heads", num_key_value_heads, int64_t{1} << 14},
      {"max_position_embeddings", max_position_embeddings, int64_t{1} << 26},
  };
  for (const auto& [key, value, most] : sizes) {
    if (value <= 0) {
      return InvalidArgumentError(
          fmt::format("model '{}': {} is {}; expected a positive integer", name, key, value));
    }
    if (value > most) {
      return InvalidArgumentError(fmt::format(
          "model '{}': {} is {}; larger than any model Strata can train (at most {})", name, key,
          value, most));
    }
  }
  if (explicit_head_dim == 0 && hidden_size % num_attention_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': hidden_size {} is not a multiple of num_attention_heads {} (and no head_dim "
        "is given)",
        name, hidden_size, num_attention_heads));
  }
  if (explicit_head_dim > 4096) {
    return InvalidArgumentError(fmt::format(
        "model '{}': head_dim is {}; larger than any model Strata can train (at most 4096)", name,
        explicit_head_dim));
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': num_attention_heads {} is not a multiple of num_key_value_heads {}", name,
        num_attention_heads, num_key_value_heads));
  }
  if (head_dim() % 2 != 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': the head dimension {} is odd; rotary embeddings need an even one", name,
        head_dim()));
  }
  if (!(rms_norm_eps > 0.0)) {
    return InvalidArgumentError(
        fmt::format("model '{}': rms_norm_eps is {}; expected > 0", name, rms_norm_eps));
  }
  if (pad_token_id >= vocab_size) {
    return InvalidArgumentError(fmt::format(
        "model '{}': pad_token_id {} is not below vocab_size {}", name, pad_token_id, vocab_size));
  }
  if (!(rope_theta > 0.0) || !std::isfinite(rope_theta)) {
    return InvalidArgumentError(
        fmt::format("model '{}': rope_theta is {}; expected > 0", name, rope_theta));
  }
  const RopeScaling& r = rope_scaling;
  if (r.kind != RopeScaling::kDefault &&
      (!(r.factor > 0.0) || !std::isfinite(r.factor) ||
       (r.kind == RopeScaling::kLlama3 &&
        !(r.original_max > 0.0 && r.low_freq_factor > 0.0 && r.high_freq_factor > 0.0)) ||
       (r.kind == RopeScaling::kYarn && !(r.original_max > 0.0)))) {
    return InvalidArgumentError(fmt::format(
        "model '{}': the RoPE scaling's factor {} (or its original_max_position_embeddings {}, "
        "low_freq_factor {}, high_freq_factor {}) is not positive",
        name, r.factor, r.original_max, r.low_freq_factor, r.high_freq_factor));
  }
  // Every parameter count is an int64_t: 100T parameters is far below its limit.
  if (static_cast<double>(ParameterCount()) > 1e14 || BlockParameters() <= 0) {
    return InvalidArgumentError(fmt::format(
        "model '{}': {} layers of {} parameters each is larger than any model Strata can train",
        name, num_hidden_layers, BlockParameters()));
  }
  return Status::Ok();
}

bool LlamaConfig::SameModel(const LlamaConfig& o) const {
  LlamaConfig a = *this, b = o;
  a.name = b.name = "";
  a.source_json = b.source_json = "";
  a.bos_token_id_json = b.bos_token_id_json = "";
  a.eos_token_id_json = b.eos_token_id_json = "";
  return a == b;
}

// ---- reading and writing config.json ----------------------------------------------------------------

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
  LlamaConfig c;
  c.name = std::string(source);
  STRATA_ASSIGN_OR_RETURN(c.model_type, ReadModelType(j, source));
  STRATA_RETURN_IF_ERROR(RefuseUnimplementedKeys(j, source));
  STRATA_RETURN_IF_ERROR(ReadShape(j, source, &c));
  STRATA_RETURN_IF_ERROR(ReadFamilyFeatures(j, source, &c));
  STRATA_RETURN_IF_ERROR(ReadSlidingWindow(j, source, &c));
  // The sizes first: RoPE's YaRN range reads head_dim.
  if (Status st = c.Validate(); !st.ok()) return st;
  STRATA_RETURN_IF_ERROR(ReadRope(j, source, &c));
  if (Status st = c.Validate(); !st.ok()) return st;
  c.source_json = j.dump();
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

namespace {

// A preset's RoPE scaling as transformers 4 and 5 both read it (rope_scaling with rope_type).
Json RopeScalingJson(const RopeScaling& r) {
  switch (r.kind) {
    case RopeScaling::kLinear:
      return {{"rope_type", "linear"}, {"factor", r.factor}};
    case RopeScaling::kLlama3:
      return {{"rope_type", "llama3"},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", static_cast<int64_t>(r.original_max)}};
    case RopeScaling::kYarn:
      return {{"rope_type", "yarn"},
              {"factor", r.factor},
              {"original_max_position_embeddings", static_cast<int64_t>(r.original_max)},
              {"attention_factor", r.attention_factor}};
    default:
      return nullptr;
  }
}

}  // namespace

std::string ToHfConfigJson(const LlamaConfig& c, std::string_view torch_dtype) {
  Json j = c.source_json.empty() ? Json::object() : Json::parse(c.source_json, nullptr, false);
  if (!j.is_object()) j = Json::object();
  const Family* family = FindFamily(c.model_type);
  const bool fresh = c.source_json.empty();
  if (fresh || !j.contains("architectures")) {
    j["architectures"] = {family != nullptr ? family->architecture : "LlamaForCausalLM"};
  }
  j["model_type"] = c.model_type;
  j["hidden_act"] = "silu";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  if (c.explicit_head_dim > 0 || j.contains("head_dim")) j["head_dim"] = c.head_dim();
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (fresh) {
    // The RoPE settings as read are kept in a source's config; a preset writes its own.
    j["rope_theta"] = c.rope_theta;
    if (c.rope_scaling.kind != RopeScaling::kDefault) j["rope_scaling"] = RopeScalingJson(c.rope_scaling);
    if (c.model_type == "llama" || c.model_type == "qwen3") j["attention_bias"] = c.qkv_bias;
    if (c.model_type == "llama") j["mlp_bias"] = c.mlp_bias;
    if (c.model_type == "mistral") {
      j["sliding_window"] = c.sliding_window > 0 ? Json(c.sliding_window) : Json(nullptr);
    }
    j["initializer_range"] = 0.02;
    j["bos_token_id"] = Json::parse(c.bos_token_id_json, nullptr, false);
    j["eos_token_id"] = Json::parse(c.eos_token_id_json, nullptr, false);
  }
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  // transformers 5 writes "dtype", earlier releases "torch_dtype"; both read either.
  j[j.contains("dtype") && !j.contains("torch_dtype") ? "dtype" : "torch_dtype"] =
      std::string(torch_dtype);
  return j.dump(2) + "\n";
}

}  // namespace strata::model
