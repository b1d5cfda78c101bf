#include "model/llama_config.h"

#include <gtest/gtest.h>

#include <cmath>
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
  // Llama-3.1-70B and Qwen2.5-72B as published (70.55B, 72.71B: within 0.5%).
  EXPECT_NEAR(static_cast<double>(LlamaPreset("llama3.1-70b")->ParameterCount()), 70.55e9,
              0.005 * 70.55e9);
  EXPECT_NEAR(static_cast<double>(LlamaPreset("qwen2.5-72b")->ParameterCount()), 72.71e9,
              0.005 * 72.71e9);
  EXPECT_EQ(LlamaPreset("qwen2.5-7b")->ParameterCount(), 7'615'616'512);
  EXPECT_EQ(LlamaPreset("qwen3-8b")->ParameterCount(), 8'190'735'360);
  // The synthetic job's model (llama-20m) is in the 10-50M range.
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
       "rope_scaling.low_freq_factor is missing"},
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": "yes"})",
       "'attention_bias' must be true or false"},
      // Sizes that cannot be meant: refused naming the key, before anything is sized from them.
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1000000000, "num_attention_heads": 4})",
       "num_hidden_layers is 1000000000; larger than any model"},
      {R"({"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 100000})",
       "head_dim is 100000"},
      {R"({"model_type": "gemma", "vocab_size": 100})", "model_type is 'gemma'"},
      {R"({"model_type": "qwen3_moe", "vocab_size": 100})", "model_type is 'qwen3_moe'"},
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
  EXPECT_EQ(llama->sliding_window, 0);  // transformers' Llama does not read it either
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
      {R"("rope_parameters": {"rope_theta": 1.0, "rope_type": "longrope", "factor": 4.0})",
       "rope_parameters.rope_type is \"longrope\""},
      {R"("rope_parameters": {"full_attention": {"rope_theta": 1.0}})",
       "rope_parameters.full_attention holds RoPE settings per layer type"},
      {R"("rope_parameters": {"rope_theta": 1.0, "partial_rotary_factor": 0.5})",
       "rope_parameters.partial_rotary_factor is 0.5"},
      {R"("rope_parameters": "yes")", "rope_parameters is \"yes\"; expected an object"},
      {R"("rope_parameters": {"rope_type": "linear", "factor": 2.0},
          "rope_scaling": {"rope_type": "linear", "factor": 4.0})",
       "state different RoPE scalings"},
      {R"("partial_rotary_factor": 0.25)", "partial_rotary_factor is 0.25"},
      {R"("attention_dropout": 0.1)", "attention_dropout is 0.1"},
      {R"("quantization_config": {"quant_method": "bitsandbytes"})", "quantization_config is"},
      {R"("pad_token_id": 100)", "pad_token_id 100 is not below vocab_size 100"},
      {R"("pad_token_id": "x")", "pad_token_id is \"x\""},
      {R"("hidden_act": "gelu")", "hidden_act is \"gelu\""},
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

// The families' features, from the keys each family's config uses.
TEST(LlamaConfigTest, FamiliesSetTheirFeatures) {
  const std::string sizes = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2)";
  auto llama = ParseLlamaConfig("{" + sizes + R"(, "attention_bias": true, "mlp_bias": true})",
                                "l.json");
  ASSERT_TRUE(llama.ok()) << llama.status().ToString();
  EXPECT_TRUE(llama->qkv_bias && llama->o_bias && llama->mlp_bias && !llama->qk_norm);
  auto qwen2 = ParseLlamaConfig("{" + sizes + R"(, "model_type": "qwen2", "attention_bias": true})",
                                "q2.json");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status().ToString();
  EXPECT_TRUE(qwen2->qkv_bias && !qwen2->o_bias && !qwen2->mlp_bias && !qwen2->qk_norm);
  auto qwen3 = ParseLlamaConfig("{" + sizes + R"(, "model_type": "qwen3", "head_dim": 32})",
                                "q3.json");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  EXPECT_TRUE(qwen3->qk_norm && !qwen3->qkv_bias);
  EXPECT_EQ(qwen3->head_dim(), 32);
  EXPECT_EQ(qwen3->q_dim(), 128);
  EXPECT_EQ(qwen3->kv_dim(), 64);
  // Parameters: q [128, 64], k and v [64, 64], o [64, 128], the MLP, two norms, q/k norms [32].
  EXPECT_EQ(qwen3->BlockParameters(), 64 * 128 * 2 + 64 * 64 * 2 + 3 * 64 * 96 + 2 * 64 + 2 * 32);
  // Qwen2 with sliding layers: the window counts only when use_sliding_window is on.
  auto off = ParseLlamaConfig("{" + sizes + R"(, "model_type": "qwen2", "sliding_window": 16,
      "max_window_layers": 1})", "w.json");
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->sliding_window, 0);
  auto on = ParseLlamaConfig("{" + sizes + R"(, "model_type": "qwen2", "sliding_window": 16,
      "max_window_layers": 1, "use_sliding_window": true})", "w.json");
  ASSERT_TRUE(on.ok());
  EXPECT_EQ(on->sliding_window, 16);
  auto full = ParseLlamaConfig("{" + sizes + R"(, "model_type": "qwen2", "sliding_window": 16,
      "use_sliding_window": true, "layer_types": ["full_attention", "full_attention"]})", "w.json");
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->sliding_window, 0);
}

// RoPE scaling as transformers computes it (modeling_rope_utils.py), and the keys it reads.
TEST(LlamaConfigTest, ReadsRopeScalings) {
  const std::string sizes = R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256)";
  auto llama3 = ParseLlamaConfig("{" + sizes + R"(, "rope_parameters": {"rope_theta": 500000.0,
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}})", "l3.json");
  ASSERT_TRUE(llama3.ok()) << llama3.status().ToString();
  EXPECT_EQ(llama3->rope_scaling.kind, RopeScaling::kLlama3);
  EXPECT_DOUBLE_EQ(llama3->rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(llama3->rope_scaling.original_max, 64.0);
  // Pair 0 (wavelength 2 pi) is kept; the last pairs (longest wavelengths) are divided by 8.
  const RopeScaling& r = llama3->rope_scaling;
  EXPECT_DOUBLE_EQ(RopeInvFreq(500000.0, r, 0, 16), 1.0);
  EXPECT_DOUBLE_EQ(RopeInvFreq(500000.0, r, 7, 16), std::pow(500000.0, -14.0 / 16) / 8.0);
  // The same in transformers 4's form.
  auto legacy = ParseLlamaConfig("{" + sizes + R"(, "rope_theta": 500000.0, "rope_scaling": {
      "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}})", "l3.json");
  ASSERT_TRUE(legacy.ok()) << legacy.status().ToString();
  EXPECT_TRUE(legacy->rope_scaling == llama3->rope_scaling);
  // Linear: every frequency divided by the factor. Dynamic: the default below the longest
  // sequence Strata trains. YaRN: its attention factor from the factor (0.1 ln 4 + 1).
  auto linear = ParseLlamaConfig("{" + sizes + R"(, "rope_scaling": {"type": "linear", "factor": 2.0}})", "x");
  ASSERT_TRUE(linear.ok());
  EXPECT_DOUBLE_EQ(RopeInvFreq(10000.0, linear->rope_scaling, 3, 16),
                   std::pow(10000.0, -6.0 / 16) / 2.0);
  auto dynamic = ParseLlamaConfig("{" + sizes + R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0}})", "x");
  ASSERT_TRUE(dynamic.ok());
  EXPECT_EQ(dynamic->rope_scaling.kind, RopeScaling::kDefault);
  auto yarn = ParseLlamaConfig("{" + sizes + R"(, "rope_scaling": {"rope_type": "yarn",
      "factor": 4.0, "original_max_position_embeddings": 64}})", "x");
  ASSERT_TRUE(yarn.ok()) << yarn.status().ToString();
  EXPECT_EQ(yarn->rope_scaling.kind, RopeScaling::kYarn);
  EXPECT_NEAR(yarn->rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);
  EXPECT_GE(yarn->rope_scaling.yarn_high, yarn->rope_scaling.yarn_low);
}

// A checkpoint's config.json is the one the model came from, every key kept.
TEST(LlamaConfigTest, WrittenConfigsKeepTheSourcesKeys) {
  const std::string text = R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
      "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1000000.0,
      "use_sliding_window": false, "max_window_layers": 21, "custom_key": {"kept": true},
      "dtype": "bfloat16"})";
  auto c = ParseLlamaConfig(text, "q.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const std::string written = ToHfConfigJson(*c, "float32");
  for (const char* kept : {"\"Qwen2ForCausalLM\"", "\"max_window_layers\": 21",
                           "\"custom_key\"", "\"dtype\": \"float32\""}) {
    EXPECT_NE(written.find(kept), std::string::npos) << kept << " in " << written;
  }
  auto again = ParseLlamaConfig(written, "again.json");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->SameModel(*c));
  // A preset writes a complete config of its family.
  const std::string qwen = ToHfConfigJson(*LlamaPreset("qwen2.5-72b"), "bfloat16");
  EXPECT_NE(qwen.find("\"Qwen2ForCausalLM\""), std::string::npos) << qwen;
  const std::string l31 = ToHfConfigJson(*LlamaPreset("llama3.1-70b"), "bfloat16");
  EXPECT_NE(l31.find("\"llama3\""), std::string::npos) << l31;
  auto back = ParseLlamaConfig(l31, "l31.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->SameModel(*LlamaPreset("llama3.1-70b")));
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
