#include "model/llama_config.h"

#include <gtest/gtest.h>

#include <fstream>

#include "test_support.h"

namespace strata::model {
namespace {

TEST(LlamaConfigTest, PresetsAreValidAndHaveTheKnownSizes) {
  for (const std::string& name : LlamaPresetNames()) {
    auto c = LlamaPreset(name);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE(c->Validate().ok()) << name;
  }
  // Published parameter counts.
  EXPECT_EQ(LlamaPreset("llama2-7b")->ParameterCount(), 6'738'415'616);
  EXPECT_EQ(LlamaPreset("llama2-70b")->ParameterCount(), 68'976'648'192);
  EXPECT_EQ(LlamaPreset("llama3-8b")->ParameterCount(), 8'030'261'248);
  // The main job's model is in the 10-50M range.
  const int64_t main_job = LlamaPreset("llama-20m")->ParameterCount();
  EXPECT_GT(main_job, 10'000'000);
  EXPECT_LT(main_job, 50'000'000);
  // The planning preset: a Llama-3-shaped model of 1.03T parameters (docs/planning.md).
  const int64_t one_t = LlamaPreset("llama-1t")->ParameterCount();
  EXPECT_GT(one_t, 1'000'000'000'000);
  EXPECT_LT(one_t, 1'050'000'000'000);
  auto missing = LlamaPreset("llama-2t");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("llama2-7b"), std::string::npos);
}

TEST(LlamaConfigTest, ParsesAHuggingFaceConfigAndRoundTrips) {
  const std::string text = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": [128001, 128009], "rope_scaling": null, "attention_bias": false})";
  auto c = ParseLlamaConfig(text, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim(), 128);
  EXPECT_EQ(c->kv_dim(), 1024);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  auto again = ParseLlamaConfig(ToHfConfigJson(*c, "bfloat16"), "config.json");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *c);
  EXPECT_NE(ToHfConfigJson(*c, "bfloat16").find("128009"), std::string::npos);
}

// Found by fuzz/hf_config_fuzz: a number too large for a double made the JSON library throw
// out_of_range past the parse_error handler, and the process aborted.
TEST(LlamaConfigTest, NumbersTooLargeForADoubleAreAnError) {
  auto c = ParseLlamaConfig(R"({"hidden_size": 5555555555555555E555555})", "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(c.status().message()).find("config.json: not valid JSON"),
            std::string::npos)
      << c.status().message();
}

TEST(LlamaConfigTest, DefaultsForOptionalKeys) {
  auto c = ParseLlamaConfig(R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4})",
                            "cfg");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_FALSE(c->tie_word_embeddings);
}

TEST(LlamaConfigTest, BadConfigsNameTheFileAndTheKey) {
  struct Case {
    const char* json;
    const char* expect;
  } cases[] = {
      {"{", "not valid JSON"},
      {R"({"hidden_size": 32})", "'vocab_size' is missing"},
      {R"({"vocab_size": 100, "hidden_size": "big", "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4})",
       "'hidden_size' must be an integer"},
      {R"({"vocab_size": 100, "hidden_size": 30, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4})",
       "not a multiple of num_attention_heads"},
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3})",
       "not a multiple of num_key_value_heads"},
      {R"({"model_type": "gpt2", "vocab_size": 100})", "model_type is 'gpt2'"},
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 0, "num_attention_heads": 4})",
       "num_hidden_layers is 0"},
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})",
       "rope_scaling.rope_type is \"llama3\""},
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": true})",
       "attention_bias is true"},
  };
  for (const Case& c : cases) {
    auto r = ParseLlamaConfig(c.json, "/models/x/config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("/models/x"), std::string::npos) << r.status().ToString();
  }
}

// Mistral: the Llama decoder with sliding-window attention; accepted, kept as Mistral when
// written back (its window with it), and a bad window is an error naming the key.
TEST(LlamaConfigTest, MistralKeepsItsTypeAndWindow) {
  const std::string text = R"({"model_type": "mistral", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "sliding_window": 4096})";
  auto c = ParseLlamaConfig(text, "m.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->model_type, "mistral");
  EXPECT_EQ(c->sliding_window, 4096);
  const std::string written = ToHfConfigJson(*c, "float32");
  EXPECT_NE(written.find("\"MistralForCausalLM\""), std::string::npos) << written;
  EXPECT_NE(written.find("\"sliding_window\": 4096"), std::string::npos) << written;
  auto again = ParseLlamaConfig(written, "again.json");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->sliding_window, 4096);
  // A Llama config has no window, and writes none.
  auto llama = ParseLlamaConfig(R"({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
      "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 8})", "l.json");
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->sliding_window, 0);
  EXPECT_EQ(ToHfConfigJson(*llama, "float32").find("sliding_window"), std::string::npos);
  auto bad = ParseLlamaConfig(R"({"model_type": "mistral", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
      "sliding_window": -3})", "b.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("b.json: sliding_window is -3"),
            std::string::npos)
      << bad.status().ToString();
}

// transformers 5 writes the RoPE base inside `rope_parameters` and no top-level rope_theta. A
// config it saved must give its own theta, not the default 10000 (which trains another model).
TEST(LlamaConfigTest, ReadsTheRopeBaseFromRopeParameters) {
  const std::string transformers5 = R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 1, "dtype": "float32", "eos_token_id": 2, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 256, "mlp_bias": false,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": false, "transformers_version": "5.24.0", "use_cache": true,
    "vocab_size": 128})";
  auto c = ParseLlamaConfig(transformers5, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->pad_token_id, -1);
  // What Strata writes reads back with the same base.
  auto again = ParseLlamaConfig(ToHfConfigJson(*c, "float32"), "again.json");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_DOUBLE_EQ(again->rope_theta, 500000.0);

  // The older keys: a top-level rope_theta, and a base inside rope_scaling.
  const std::string sizes = R"("vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4)";
  auto top = ParseLlamaConfig("{" + sizes + R"(, "rope_theta": 1234.0})", "a.json");
  ASSERT_TRUE(top.ok());
  EXPECT_DOUBLE_EQ(top->rope_theta, 1234.0);
  auto scaling = ParseLlamaConfig(
      "{" + sizes + R"(, "rope_scaling": {"rope_type": "default", "rope_theta": 77.0}})", "b.json");
  ASSERT_TRUE(scaling.ok()) << scaling.status().ToString();
  EXPECT_DOUBLE_EQ(scaling->rope_theta, 77.0);
  // The same base in two places is fine; two different ones are an error naming both.
  auto same = ParseLlamaConfig(
      "{" + sizes + R"(, "rope_theta": 5.0, "rope_parameters": {"rope_theta": 5.0}})", "c.json");
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  auto conflict = ParseLlamaConfig(
      "{" + sizes + R"(, "rope_theta": 5.0, "rope_parameters": {"rope_theta": 6.0}})", "d.json");
  ASSERT_FALSE(conflict.ok());
  EXPECT_NE(conflict.status().message().find("rope_theta is 5 but rope_parameters.rope_theta is 6"),
            std::string::npos)
      << conflict.status().ToString();
}

// Keys with which transformers builds another model are refused, naming the key and the value,
// wherever they sit; at their neutral values they are accepted.
TEST(LlamaConfigTest, RefusesKeysThatChangeTheModel) {
  const std::string sizes = R"("vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4)";
  struct Case {
    const char* extra;
    const char* expect;
  } refused[] = {
      // Llama 3.1 as transformers 5 saves it: the scaling sits in rope_parameters.
      {R"("rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192})",
       "rope_parameters.rope_type is \"llama3\""},
      {R"("rope_scaling": {"type": "linear", "factor": 2.0})", "rope_scaling.type is \"linear\""},
      {R"("rope_parameters": {"full_attention": {"rope_theta": 1.0}})",
       "rope_parameters.full_attention holds RoPE settings per layer type"},
      {R"("rope_parameters": {"rope_theta": 1.0, "partial_rotary_factor": 0.5})",
       "rope_parameters.partial_rotary_factor is 0.5"},
      {R"("rope_parameters": "yes")", "rope_parameters is \"yes\"; expected an object"},
      {R"("partial_rotary_factor": 0.25)", "partial_rotary_factor is 0.25"},
      {R"("mlp_bias": true)", "mlp_bias is true"},
      {R"("attention_dropout": 0.1)", "attention_dropout is 0.1"},
      {R"("quantization_config": {"quant_method": "bitsandbytes"})", "quantization_config is"},
      {R"("head_dim": 16)", "head_dim is 16; Strata's attention uses hidden_size / "
                            "num_attention_heads = 8"},
      {R"("pad_token_id": 100)", "pad_token_id 100 is not below vocab_size 100"},
      {R"("pad_token_id": "x")", "pad_token_id is \"x\""},
  };
  for (const Case& c : refused) {
    auto r = ParseLlamaConfig("{" + sizes + ", " + c.extra + "}", "/m/config.json");
    ASSERT_FALSE(r.ok()) << c.extra;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().ToString();
  }
  const char* accepted[] = {
      R"("rope_scaling": null, "rope_parameters": null)",
      R"("rope_parameters": {"rope_type": "default", "rope_theta": 10000.0})",
      R"("attention_bias": false, "mlp_bias": false, "attention_dropout": 0.0)",
      R"("partial_rotary_factor": 1.0, "quantization_config": null, "head_dim": 8)",
      R"("pretraining_tp": 1, "use_cache": true, "transformers_version": "5.24.0")",
  };
  for (const char* extra : accepted) {
    auto r = ParseLlamaConfig("{" + sizes + ", " + extra + "}", "/m/config.json");
    EXPECT_TRUE(r.ok()) << extra << ": " << r.status().ToString();
  }
  // pad_token_id is kept and written back.
  auto pad = ParseLlamaConfig("{" + sizes + R"(, "pad_token_id": 7})", "p.json");
  ASSERT_TRUE(pad.ok()) << pad.status().ToString();
  EXPECT_EQ(pad->pad_token_id, 7);
  EXPECT_NE(ToHfConfigJson(*pad, "float32").find("\"pad_token_id\": 7"), std::string::npos);
}

TEST(LlamaConfigTest, ResolvesDirectoriesAndPresets) {
  strata::testing::TempDir dir;
  auto missing = LoadLlamaConfig(dir.path().string());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("config.json"), std::string::npos);
  {
    std::ofstream out(dir.file("config.json"));
    out << ToHfConfigJson(*LlamaPreset("llama-tiny"), "float32");
  }
  auto from_dir = ResolveModel(dir.path().string());
  ASSERT_TRUE(from_dir.ok()) << from_dir.status().ToString();
  EXPECT_EQ(from_dir->hidden_size, 64);
  auto preset = ResolveModel("llama-tiny");
  ASSERT_TRUE(preset.ok());
  auto neither = ResolveModel("/no/such/dir");
  ASSERT_FALSE(neither.ok());
  EXPECT_NE(neither.status().message().find("preset"), std::string::npos);
}

}  // namespace
}  // namespace strata::model
