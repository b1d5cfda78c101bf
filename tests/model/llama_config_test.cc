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
       "rope_scaling is"},
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
