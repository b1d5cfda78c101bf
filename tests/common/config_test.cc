#include "strata/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/config_schema.h"
#include "test_support.h"

namespace strata {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

Result<Config> Parse(std::string_view json) {
  return ParseConfig(json, "test.json");
}

// Parses `json`, expects failure, and returns the message.
std::string ErrorOf(std::string_view json, StatusCode code = StatusCode::kInvalidArgument) {
  Result<Config> result = Parse(json);
  EXPECT_FALSE(result.ok()) << "expected an error for: " << json;
  if (result.ok()) return "";
  EXPECT_EQ(result.status().code(), code) << result.status().ToString();
  return std::string(result.status().message());
}

// Parses `json`, expects success, and returns the config.
Config Ok(std::string_view json) {
  Result<Config> result = Parse(json);
  EXPECT_TRUE(result.ok()) << result.status().ToString() << "\nfor: " << json;
  return result.ok() ? *result : Config{};
}

std::vector<std::filesystem::path> ExampleFiles() {
  std::vector<std::filesystem::path> files;
  for (const auto& entry :
       std::filesystem::directory_iterator(testing::SourceDir() / "docs" / "examples")) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// ---- the shipped examples ----

TEST(ConfigExamplesTest, EveryExampleLoads) {
  std::vector<std::filesystem::path> files = ExampleFiles();
  ASSERT_GE(files.size(), 6u) << "docs/examples should hold the example configs";
  for (const auto& path : files) {
    Result<Config> config = LoadConfigFile(path.string());
    EXPECT_TRUE(config.ok()) << path << ": " << config.status().ToString();
  }
}

TEST(ConfigExamplesTest, ExamplesWithConcreteBatchSizesResolveOnEightRanks) {
  for (const char* name : {"zero3_nvme_offload.json", "zero2_fp16.json", "strata_nvme_striped.json",
                           "zero3_nvme_offload_bf16.json"}) {
    Result<Config> config =
        LoadConfigFile((testing::SourceDir() / "docs" / "examples" / name).string());
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    Result<BatchSizes> batch = ResolveBatchSizes(config->batch, 8);
    EXPECT_TRUE(batch.ok()) << name << ": " << batch.status().ToString();
  }
}

TEST(ConfigExamplesTest, NvmeExampleValues) {
  Result<Config> loaded = LoadConfigFile(
      (testing::SourceDir() / "docs" / "examples" / "zero3_nvme_offload.json").string());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Config& c = *loaded;
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 1'000'000'000);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);  // spelled thread_count in the file
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.block_size, 262144u);
  // strata.io takes its defaults from aio.
  EXPECT_EQ(c.strata.io.queue_depth, 32);
  EXPECT_TRUE(c.strata.io.queue_depth_auto);
  EXPECT_EQ(c.strata.io.block_size, 262144u);
  // Both offload sections name the same directory: it is listed once.
  EXPECT_THAT(c.strata.io.nvme_paths, ElementsAre("/local_nvme"));
  EXPECT_EQ(c.precision(), Precision::kFp16);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(c.scheduler.total_num_steps, 20000);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLinear);
  // cpu_checkpointing: the checkpointed block inputs in host memory; the section's other keys
  // have no effect (the model checkpoints each decoder block's input).
  EXPECT_EQ(c.strata.offload_checkpoints, Toggle::kOn);
  EXPECT_THAT(c.diagnostics.ignored_keys,
              ElementsAre("wall_clock_breakdown", "memory_breakdown",
                          "zero_allow_untested_optimizer",
                          "activation_checkpointing.partition_activations",
                          "activation_checkpointing.contiguous_memory_optimization",
                          "activation_checkpointing.synchronize_checkpoint_boundary",
                          "activation_checkpointing.profile"));
}

TEST(ConfigExamplesTest, StrataSectionExample) {
  Result<Config> loaded = LoadConfigFile(
      (testing::SourceDir() / "docs" / "examples" / "strata_nvme_striped.json").string());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const StrataSettings& s = loaded->strata;
  EXPECT_EQ(s.io.threads, 4);  // "auto" = aio.intra_op_parallelism
  EXPECT_TRUE(s.io.threads_auto);
  EXPECT_EQ(s.io.queue_depth, 64);
  EXPECT_FALSE(s.io.queue_depth_auto);
  EXPECT_EQ(s.io.block_size, 1048576u);
  EXPECT_EQ(s.io.stripe_unit, 1048576u);
  EXPECT_EQ(s.io.nvme_paths.size(), 4u);
  EXPECT_FALSE(s.io.nvme_paths_auto);
  EXPECT_EQ(s.memory.pinned_pool, 64ull << 30);
  EXPECT_EQ(s.memory.device_budget, std::nullopt);
  EXPECT_EQ(s.memory.host_budget, 768ull << 30);
  EXPECT_EQ(s.prefetch.host_lookahead, 16ull << 30);
  EXPECT_EQ(s.device, DeviceKind::kCuda);
  EXPECT_EQ(s.seed, 42u);
  EXPECT_TRUE(loaded->diagnostics.ignored_keys.empty());
}

// ---- defaults ----

TEST(ConfigDefaultsTest, EmptyObjectGivesDeepSpeedCodeDefaults) {
  Config c = Ok("{}");
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_model_persistence_threshold, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(c.zero.allgather_bucket_size, 500'000'000);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_TRUE(c.zero.contiguous_gradients);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1'000'000'000);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_TRUE(c.fp16.dynamic_loss_scale());
  EXPECT_EQ(c.precision(), Precision::kFp32);
  EXPECT_FALSE(c.optimizer.specified);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kConstant);
  EXPECT_EQ(c.checkpoint.tag_validation, TagValidation::kWarn);
  EXPECT_EQ(c.strata.io.threads, 1);
  EXPECT_EQ(c.strata.io.queue_depth, 8);
  EXPECT_EQ(c.strata.io.block_size, 1048576u);
  EXPECT_EQ(c.strata.io.stripe_unit, 1048576u);
  EXPECT_TRUE(c.strata.io.nvme_paths.empty());
  EXPECT_TRUE(c.strata.io.register_buffers);
  EXPECT_FALSE(c.strata.io.sqpoll);
  EXPECT_EQ(c.strata.seed, 1234u);
  EXPECT_EQ(c.strata.device, DeviceKind::kAuto);
  EXPECT_FALSE(c.batch.train_batch_size.has_value());
}

TEST(ConfigDefaultsTest, DefaultConstructedEqualsParsedEmptyObject) {
  Config parsed = Ok("{}");
  Config constructed;
  constructed.source_name = "test.json";
  EXPECT_TRUE(parsed == constructed);
}

TEST(ConfigDefaultsTest, OverlapCommDefaultsFromStage) {
  EXPECT_TRUE(Ok(R"({"zero_optimization": {"stage": 3}})").zero.overlap_comm);
  EXPECT_FALSE(Ok(R"({"zero_optimization": {"stage": 2}})").zero.overlap_comm);
  EXPECT_FALSE(
      Ok(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})").zero.overlap_comm);
  EXPECT_TRUE(Ok(R"({"zero_optimization": {"stage": 1, "overlap_comm": true}})").zero.overlap_comm);
  EXPECT_TRUE(
      Ok(R"({"zero_optimization": {"stage": 3, "overlap_comm": "auto"}})").zero.overlap_comm);
}

TEST(ConfigDefaultsTest, NullMeansAbsent) {
  Config c = Ok(R"({"train_batch_size": null, "aio": {"queue_depth": null}, "tensorboard": null})");
  EXPECT_FALSE(c.batch.train_batch_size.has_value());
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_TRUE(c.diagnostics.ignored_keys.empty());
}

// ---- "auto" ----

TEST(ConfigAutoTest, AutoMeansTheDefault) {
  Config c = Ok(R"({
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "AUTO"},
    "aio": {"queue_depth": "auto"}
  })");
  EXPECT_FALSE(c.batch.train_batch_size.has_value());
  EXPECT_FALSE(c.batch.train_micro_batch_size_per_gpu.has_value());
  EXPECT_FALSE(c.batch.gradient_accumulation_steps.has_value());
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.precision(), Precision::kFp32);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_THAT(
      c.diagnostics.auto_keys,
      ElementsAre("train_batch_size", "train_micro_batch_size_per_gpu",
                  "gradient_accumulation_steps", "gradient_clipping", "optimizer.params.lr",
                  "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
                  "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
                  "zero_optimization.stage3_prefetch_bucket_size",
                  "zero_optimization.stage3_param_persistence_threshold", "aio.queue_depth"));
}

TEST(ConfigAutoTest, AutoInStrataIoTakesAioValues) {
  Config c = Ok(R"({
    "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 8},
    "strata": {"io": {"threads": "auto", "queue_depth": 4, "block_size": "auto"}}
  })");
  EXPECT_EQ(c.strata.io.threads, 8);
  EXPECT_TRUE(c.strata.io.threads_auto);
  EXPECT_EQ(c.strata.io.queue_depth, 4);
  EXPECT_FALSE(c.strata.io.queue_depth_auto);
  EXPECT_EQ(c.strata.io.block_size, 262144u);
  EXPECT_TRUE(c.strata.io.block_size_auto);
}

// ---- value forms ----

TEST(ConfigValueTest, TrueFalseStringsAreBooleans) {
  Config c = Ok(R"({"fp16": {"enabled": "true", "auto_cast": "False"},
                   "zero_optimization": {"stage": 2, "contiguous_gradients": "false"},
                   "aio": {"single_submit": "TRUE"}})");
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_FALSE(c.fp16.auto_cast);
  EXPECT_FALSE(c.zero.contiguous_gradients);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_EQ(ErrorOf(R"({"fp16": {"enabled": "yes"}})"),
            "test.json: fp16.enabled: expected true or false, got \"yes\"");
  EXPECT_EQ(ErrorOf(R"({"fp16": {"enabled": 3}})"),
            "test.json: fp16.enabled: expected true or false, got 3");
}

TEST(ConfigValueTest, ScientificNotationIsAcceptedForIntegralValues) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8,
                                           "stage3_max_live_parameters": 3e9}})");
  EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 3'000'000'000);
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"reduce_bucket_size": 1.5}})"),
            "test.json: zero_optimization.reduce_bucket_size: expected a non-negative integer, "
            "got 1.5");
  EXPECT_EQ(ErrorOf(R"({"train_batch_size": 2.5})"),
            "test.json: train_batch_size: expected a positive integer, got 2.5");
}

TEST(ConfigValueTest, ZeroIsAcceptedWhereDeepSpeedAcceptsIt) {
  // Seen in real configs (e.g. axolotl's zero3.json).
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "sub_group_size": 0,
                   "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}})");
  EXPECT_EQ(c.zero.sub_group_size, 0);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 0);
}

// ---- aio ----

TEST(ConfigAioTest, ThreeSpellingsOfIntraOpParallelism) {
  for (const char* key : {"intra_op_parallelism", "thread_count", "num_threads"}) {
    std::string json = std::string(R"({"aio": {")") + key + R"(": 6}})";
    EXPECT_EQ(Ok(json).aio.intra_op_parallelism, 6) << key;
  }
}

TEST(ConfigAioTest, TwoSpellingsWithTheSameValueAreFine) {
  EXPECT_EQ(
      Ok(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 2}})").aio.intra_op_parallelism, 2);
}

TEST(ConfigAioTest, TwoSpellingsWithDifferentValuesAreAnError) {
  EXPECT_EQ(ErrorOf(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})"),
            "test.json: aio.intra_op_parallelism: given with different values as 'thread_count' "
            "(2) and 'intra_op_parallelism' (4); these spellings name the same setting");
  EXPECT_THAT(ErrorOf(R"({"aio": {"num_threads": 2, "thread_count": 3}})"),
              HasSubstr("'num_threads' (2) and 'thread_count' (3)"));
}

TEST(ConfigAioTest, BlockSizeMustBeAPositiveMultipleOf4096) {
  EXPECT_EQ(ErrorOf(R"({"aio": {"block_size": 1000}})"),
            "test.json: aio.block_size: expected a positive multiple of 4096, got 1000");
  EXPECT_THAT(ErrorOf(R"({"aio": {"block_size": 0}})"), HasSubstr("got 0"));
  EXPECT_EQ(Ok(R"({"aio": {"block_size": 8192}})").aio.block_size, 8192u);
}

TEST(ConfigAioTest, QueueDepthMessage) {
  EXPECT_EQ(ErrorOf(R"({"aio": {"queue_depth": "deep"}})"),
            "test.json: aio.queue_depth: expected a positive integer, got \"deep\"");
  EXPECT_EQ(ErrorOf(R"({"aio": {"queue_depth": 0}})"),
            "test.json: aio.queue_depth: expected a positive integer, got 0");
}

// ---- monitors ----

TEST(ConfigMonitorTest, TensorBoardAndCsvSectionsAreRead) {
  Config c = Ok(R"({"tensorboard": {"enabled": true, "output_path": "runs", "job_name": "a"},
                    "csv_monitor": {"enabled": true}})");
  EXPECT_EQ(c.tensorboard, (MonitorConfig{.enabled = true, .output_path = "runs", .job_name = "a"}));
  EXPECT_EQ(c.csv_monitor, (MonitorConfig{.enabled = true, .output_path = "",
                                          .job_name = "DeepSpeedJobName"}));
  EXPECT_TRUE(c.diagnostics.ignored_keys.empty());
  EXPECT_FALSE(Ok("{}").tensorboard.enabled);
  EXPECT_EQ(ErrorOf(R"({"csv_monitor": {"enabled": "yes"}})"),
            "test.json: csv_monitor.enabled: expected true or false, got \"yes\"");
  EXPECT_THAT(ErrorOf(R"({"tensorboard": {"enabled": true, "team": "x"}})"),
              HasSubstr("tensorboard.team"));
}

// ---- keys Strata accepts but ignores ----

TEST(ConfigZeroPlusPlusTest, QuantizedWeightsIsReadAtStage3AndSaidToHaveNoEffectBelow) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": true}})");
  EXPECT_TRUE(c.zero.zero_quantized_weights);
  EXPECT_THAT(c.diagnostics.ignored_keys, ::testing::IsEmpty());
  Config two = Ok(R"({"zero_optimization": {"stage": 2, "zero_quantized_weights": true}})");
  EXPECT_FALSE(two.zero.zero_quantized_weights);
  ASSERT_EQ(two.diagnostics.warnings.size(), 1u);
  EXPECT_THAT(two.diagnostics.warnings[0], HasSubstr("no effect at stage 2"));
  EXPECT_FALSE(Ok("{}").zero.zero_quantized_weights);
}

TEST(ConfigZeroPlusPlusTest, HpzAndQuantizedGradientsAreReadAndSaidToHaveNoEffectWhereTheyHaveNone) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8,
                                          "zero_quantized_gradients": true}})");
  EXPECT_EQ(c.zero.zero_hpz_partition_size, 8);
  EXPECT_TRUE(c.zero.zero_quantized_gradients);
  EXPECT_THAT(c.diagnostics.ignored_keys, ::testing::IsEmpty());
  EXPECT_THAT(c.diagnostics.warnings, ::testing::IsEmpty());
  // qgZ works at stage 2 too; hpZ is stage 3's.
  Config two = Ok(R"({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8,
                                            "zero_quantized_gradients": true}})");
  EXPECT_EQ(two.zero.zero_hpz_partition_size, 1);
  EXPECT_TRUE(two.zero.zero_quantized_gradients);
  ASSERT_EQ(two.diagnostics.warnings.size(), 1u);
  EXPECT_THAT(two.diagnostics.warnings[0],
              AllOf(HasSubstr("zero_hpz_partition_size"), HasSubstr("no effect at stage 2")));
  Config one = Ok(R"({"zero_optimization": {"stage": 1, "zero_quantized_gradients": true}})");
  EXPECT_FALSE(one.zero.zero_quantized_gradients);
  ASSERT_EQ(one.diagnostics.warnings.size(), 1u);
  EXPECT_THAT(one.diagnostics.warnings[0], HasSubstr("no effect at stage 1"));
  EXPECT_EQ(Ok("{}").zero.zero_hpz_partition_size, 1);
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}})"),
              HasSubstr("zero_optimization.zero_hpz_partition_size"));
}

TEST(ConfigZeroPlusPlusTest, TensorParallelDegreeIsRead) {
  // A degree of 1 is plain data parallelism; DeepSpeed's module-rewriting keys are reported.
  Config one = Ok(R"({"tensor_parallel": {"autotp_size": 1, "tp_grain_size": 64}})");
  EXPECT_EQ(one.tensor_parallel_size, 1);
  EXPECT_THAT(one.diagnostics.ignored_keys, ElementsAre("tensor_parallel.tp_grain_size"));
  EXPECT_EQ(Ok(R"({"tensor_parallel": {"autotp_size": 8}})").tensor_parallel_size, 8);
  EXPECT_EQ(Ok("{}").tensor_parallel_size, 1);
  EXPECT_THAT(ErrorOf(R"({"tensor_parallel": {"autotp_size": 0}})"),
              HasSubstr("tensor_parallel.autotp_size"));
}

TEST(ConfigIgnoredTest, EveryIgnoredKeyIsListedOnceWithItsPath) {
  Config c = Ok(R"({
    "wall_clock_breakdown": false,
    "zero_allow_untested_optimizer": true,
    "wandb": {"enabled": true, "project": "runs"},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "set_grad_none": true}},
    "zero_optimization": {
      "stage": 3,
      "zero_quantized_nontrainable_weights": true,
      "mics_shard_size": 8,
      "stage3_module_granularity_threshold": 0,
      "offload_optimizer": {"device": "cpu", "super_offload": true}
    },
    "bf16": {"enabled": true, "immediate_grad_update": true},
    "checkpoint": {"parallel_write": {"pipeline_stage": false}},
    "aio": {"use_gds": false}
  })");
  EXPECT_THAT(
      c.diagnostics.ignored_keys,
      ElementsAre("wall_clock_breakdown", "zero_allow_untested_optimizer", "wandb",
                  "optimizer.params.set_grad_none",
                  "zero_optimization.zero_quantized_nontrainable_weights",
                  "zero_optimization.mics_shard_size",
                  "zero_optimization.stage3_module_granularity_threshold",
                  "zero_optimization.offload_optimizer.super_offload", "bf16.immediate_grad_update",
                  "checkpoint.parallel_write", "aio.use_gds"));
  std::string warning = c.diagnostics.IgnoredKeysMessage("test.json");
  EXPECT_THAT(warning, StartsWith("test.json: "));
  for (const std::string& key : c.diagnostics.ignored_keys)
    EXPECT_THAT(warning, HasSubstr(key));
  // Implemented keys are not reported.
  EXPECT_THAT(warning, ::testing::Not(HasSubstr("offload_optimizer.device")));
}

TEST(ConfigIgnoredTest, NoIgnoredKeysNoWarning) {
  Config c = Ok(R"({"zero_optimization": {"stage": 1}})");
  EXPECT_TRUE(c.diagnostics.ignored_keys.empty());
  EXPECT_EQ(c.diagnostics.IgnoredKeysMessage("test.json"), "");
}

// ---- unknown and misspelled keys ----

TEST(ConfigUnknownKeyTest, MisspelledTopLevelKeySuggestsTheNearest) {
  EXPECT_EQ(ErrorOf(R"({"trian_batch_size": 8})"),
            "test.json: trian_batch_size: unknown key; did you mean 'train_batch_size'?");
  EXPECT_EQ(ErrorOf(R"({"zero_optimisation": {}})"),
            "test.json: zero_optimisation: unknown key; did you mean 'zero_optimization'?");
}

TEST(ConfigUnknownKeyTest, MisspelledZeroKeySuggestsTheNearest) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage3_prefetch_bucket_sise": 5e7}})"),
            "test.json: zero_optimization.stage3_prefetch_bucket_sise: unknown key; did you mean "
            "'stage3_prefetch_bucket_size'?");
}

TEST(ConfigUnknownKeyTest, MisspelledKeysInNestedSections) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 3,
                        "offload_param": {"device": "nvme", "nvme_pth": "/x"}}})"),
            "test.json: zero_optimization.offload_param.nvme_pth: unknown key; did you mean "
            "'nvme_path'?");
  EXPECT_EQ(ErrorOf(R"({"strata": {"io": {"queue_dpeth": 8}}})"),
            "test.json: strata.io.queue_dpeth: unknown key; did you mean 'queue_depth'?");
  EXPECT_EQ(ErrorOf(R"({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}})"),
            "test.json: optimizer.params.weight_decy: unknown key; did you mean 'weight_decay'?");
  EXPECT_EQ(ErrorOf(R"({"aio": {"thread_cnt": 1}})"),
            "test.json: aio.thread_cnt: unknown key; did you mean 'thread_count'?");
}

TEST(ConfigUnknownKeyTest, NoCloseMatchListsTheValidKeys) {
  std::string message = ErrorOf(R"({"aio": {"banana": 1}})");
  EXPECT_EQ(message,
            "test.json: aio.banana: unknown key; valid keys here are: block_size, queue_depth, "
            "intra_op_parallelism, single_submit, overlap_events");
}

TEST(ConfigUnknownKeyTest, SchedulerParamsMustMatchTheType) {
  // total_num_steps belongs to WarmupDecayLR, not WarmupLR (DeepSpeed fails on it too).
  EXPECT_THAT(ErrorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 100}}})"),
              StartsWith("test.json: scheduler.params.total_num_steps: unknown key;"));
}

// ---- type and range errors ----

TEST(ConfigValueErrorTest, StageOutOfRange) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 5}})"),
            "test.json: zero_optimization.stage: expected an integer 0, 1, 2 or 3, got 5");
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": "3"}})"),
            "test.json: zero_optimization.stage: expected an integer 0, 1, 2 or 3, got \"3\"");
}

TEST(ConfigValueErrorTest, Messages) {
  EXPECT_EQ(ErrorOf(R"({"gradient_clipping": -1})"),
            "test.json: gradient_clipping: expected a non-negative number, got -1");
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})"),
            "test.json: zero_optimization.offload_param.device: expected one of \"none\", \"cpu\", "
            "\"nvme\" or \"auto\", got \"gpu\"");
  EXPECT_EQ(ErrorOf(R"({"aio": 5})"), "test.json: aio: expected an object, got 5");
  EXPECT_EQ(ErrorOf(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})"),
            "test.json: optimizer.params.betas: expected a list of two numbers in [0, 1), such as "
            "[0.9, 0.999], got [0.9]");
  EXPECT_EQ(ErrorOf(R"({"fp16": {"initial_scale_power": 100}})"),
            "test.json: fp16.initial_scale_power: expected an integer from 0 to 64, got 100");
  EXPECT_EQ(ErrorOf(R"({"steps_per_print": 0})"),
            "test.json: steps_per_print: expected a positive integer, got 0");
  EXPECT_EQ(ErrorOf("[1, 2]"), "test.json: the top level must be a JSON object, got [1,2]");
}

// ---- malformed JSON ----

TEST(ConfigJsonTest, MalformedJsonNamesFileLineAndColumn) {
  // Line 3 has a value that is not JSON: the error points at its first bad character.
  std::string message = ErrorOf("{\n  \"train_batch_size\": 8,\n  \"fp16\": tru\n}");
  EXPECT_THAT(message, StartsWith("test.json:3:"));
  EXPECT_THAT(message, HasSubstr("malformed JSON"));
  message = ErrorOf("{\n  \"a\": 1,,\n}");
  EXPECT_THAT(message, StartsWith("test.json:2:10: malformed JSON: "));
  message = ErrorOf("");
  EXPECT_THAT(message, StartsWith("test.json:1:1: malformed JSON: "));
}

TEST(ConfigJsonTest, DuplicateKeysAreRejected) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 2, "stage": 3}})"),
            "test.json: zero_optimization.stage: duplicate key (each key may appear only once in "
            "an object)");
  EXPECT_EQ(ErrorOf(R"({"aio": {}, "aio": {}})"),
            "test.json: aio: duplicate key (each key may appear only once in an object)");
}

TEST(ConfigJsonTest, CommentsAreAllowed) {
  Config c = Ok("{\n  // ZeRO-2\n  \"zero_optimization\": {\"stage\": 2} /* no offload */\n}");
  EXPECT_EQ(c.zero.stage, 2);
}

// ---- batch sizes ----

BatchConfig Batch(std::optional<int64_t> train, std::optional<int64_t> micro,
                  std::optional<int64_t> gas) {
  BatchConfig b;
  b.train_batch_size = train;
  b.train_micro_batch_size_per_gpu = micro;
  b.gradient_accumulation_steps = gas;
  return b;
}

TEST(ConfigBatchTest, ConsistentTriple) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(64, 4, 2), 8);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->train_batch_size, 64);
  EXPECT_EQ(b->train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(b->gradient_accumulation_steps, 2);
  EXPECT_EQ(b->world_size, 8);
}

TEST(ConfigBatchTest, InconsistentTripleNamesTheValues) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(64, 4, 2), 4);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b.status().message(),
            "train_batch_size 64 != train_micro_batch_size_per_gpu 4 * "
            "gradient_accumulation_steps 2 * world_size 4 (= 32)");
}

TEST(ConfigBatchTest, DerivesGradientAccumulation) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(512, 8, std::nullopt), 8);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->gradient_accumulation_steps, 8);
  b = ResolveBatchSizes(Batch(512, 8, std::nullopt), 3);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message(),
            "train_batch_size 512 is not divisible by train_micro_batch_size_per_gpu 8 * "
            "world_size 3 (= 24); cannot derive gradient_accumulation_steps");
}

TEST(ConfigBatchTest, DerivesMicroBatch) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(96, std::nullopt, 3), 4);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->train_micro_batch_size_per_gpu, 8);
  b = ResolveBatchSizes(Batch(96, std::nullopt, 3), 5);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("cannot derive train_micro_batch_size_per_gpu"));
}

TEST(ConfigBatchTest, DerivesTrainBatch) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(std::nullopt, 2, 16), 8);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->train_batch_size, 256);
}

TEST(ConfigBatchTest, OnlyOneGiven) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(32, std::nullopt, std::nullopt), 4);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->gradient_accumulation_steps, 1);
  EXPECT_EQ(b->train_micro_batch_size_per_gpu, 8);
  EXPECT_FALSE(ResolveBatchSizes(Batch(30, std::nullopt, std::nullopt), 4).ok());

  b = ResolveBatchSizes(Batch(std::nullopt, 3, std::nullopt), 4);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->gradient_accumulation_steps, 1);
  EXPECT_EQ(b->train_batch_size, 12);
}

TEST(ConfigBatchTest, NeitherTrainNorMicroIsAnError) {
  for (const BatchConfig& batch :
       {Batch(std::nullopt, std::nullopt, std::nullopt), Batch(std::nullopt, std::nullopt, 4)}) {
    Result<BatchSizes> b = ResolveBatchSizes(batch, 1);
    ASSERT_FALSE(b.ok());
    EXPECT_THAT(b.status().message(),
                HasSubstr("train_batch_size or train_micro_batch_size_per_gpu"));
  }
}

TEST(ConfigBatchTest, WorldSizeMustBePositive) {
  Result<BatchSizes> b = ResolveBatchSizes(Batch(8, 1, 1), 0);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().message(), "world_size must be at least 1, got 0");
}

TEST(ConfigBatchTest, ImpossibleTripleIsRejectedWhenLoading) {
  EXPECT_EQ(ErrorOf(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 2})"),
            "test.json: train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu "
            "4 * gradient_accumulation_steps 2, so no world size satisfies train_batch_size = "
            "micro * gas * world_size");
  EXPECT_THAT(
      ErrorOf(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})"),
      HasSubstr("train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 4"));
  EXPECT_EQ(ErrorOf(R"({"train_batch_size": 0})"),
            "test.json: train_batch_size: expected a positive integer, got 0");
}

// ---- precision ----

TEST(ConfigPrecisionTest, Fp16AndBf16BothEnabledIsAnError) {
  EXPECT_EQ(ErrorOf(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
            "test.json: fp16.enabled and bf16.enabled are both true; enable at most one of them");
  EXPECT_EQ(ErrorOf(R"({"fp16": {"enabled": true}, "bfloat16": {"enabled": true}})"),
            "test.json: fp16.enabled and bfloat16.enabled are both true; enable at most one of "
            "them");
}

TEST(ConfigPrecisionTest, Bfloat16IsTheOlderNameOfBf16) {
  EXPECT_EQ(Ok(R"({"bfloat16": {"enabled": true}})").precision(), Precision::kBf16);
  EXPECT_EQ(Ok(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})").precision(),
            Precision::kBf16);
  EXPECT_THAT(ErrorOf(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": false}})"),
              HasSubstr("given with different values"));
}

TEST(ConfigPrecisionTest, Fp16Settings) {
  Config c = Ok(R"({"fp16": {"enabled": true, "loss_scale": 128, "initial_scale_power": 32,
                   "loss_scale_window": 500, "hysteresis": 4, "consecutive_hysteresis": true,
                   "min_loss_scale": 0.5}})");
  EXPECT_EQ(c.precision(), Precision::kFp16);
  EXPECT_FALSE(c.fp16.dynamic_loss_scale());
  EXPECT_EQ(c.fp16.loss_scale, 128.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 32);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 4);
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_THAT(ErrorOf(R"({"fp16": {"min_loss_scale": 0}})"), HasSubstr("a positive number"));
}

// ---- offload rules ----

TEST(ConfigOffloadTest, NvmeWithoutAPathIsAnError) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})"),
            "test.json: zero_optimization.offload_param.nvme_path: required when "
            "offload_param.device is \"nvme\" (or list the directories in strata.io.nvme_paths)");
  EXPECT_THAT(
      ErrorOf(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})"),
      StartsWith("test.json: zero_optimization.offload_optimizer.nvme_path: required"));
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
                   "strata": {"io": {"nvme_paths": ["/a", "/b"]}}})");
  EXPECT_THAT(c.strata.io.nvme_paths, ElementsAre("/a", "/b"));
}

TEST(ConfigOffloadTest, NvmePathsDefaultFromOffloadSections) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/p"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/o"}}})");
  EXPECT_THAT(c.strata.io.nvme_paths, ElementsAre("/p", "/o"));
  EXPECT_TRUE(c.strata.io.nvme_paths_auto);
  // A path under a section that is not on NVMe does not count.
  c = Ok(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "nvme_path": "/p"}}})");
  EXPECT_TRUE(c.strata.io.nvme_paths.empty());
}

TEST(ConfigOffloadTest, ParamOffloadBelowStage3IsIgnoredWithAWarning) {
  Config c = Ok(R"({"zero_optimization": {"stage": 2,
      "offload_param": {"device": "nvme", "nvme_path": "/p"}}})");
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_TRUE(c.strata.io.nvme_paths.empty());
  EXPECT_THAT(c.diagnostics.warnings,
              ElementsAre("zero_optimization.offload_param.device: parameter offload to nvme "
                          "needs zero_optimization.stage 3 and has no effect at stage 2 "
                          "(DeepSpeed ignores it too); parameters stay on the device"));
  // At stage 3 it takes effect and nothing is said.
  c = Ok(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})");
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.diagnostics.warnings.empty());
  // "none" is no offload and fine at any stage.
  EXPECT_EQ(Ok(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}})")
                .zero.offload_param.device,
            OffloadDevice::kNone);
}

TEST(ConfigOffloadTest, OptimizerOffloadNeedsStage1OrAbove) {
  EXPECT_EQ(
      ErrorOf(R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})"),
      "test.json: zero_optimization.offload_optimizer.device: optimizer offload to cpu requires "
      "zero_optimization.stage 1, 2 or 3, got stage 0");
  EXPECT_EQ(Ok(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})")
                .zero.offload_optimizer.device,
            OffloadDevice::kCpu);
}

TEST(ConfigOffloadTest, DeprecatedCpuOffloadBooleans) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "cpu_offload": true,
                   "cpu_offload_param": true}})");
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_THAT(
      c.diagnostics.deprecated_keys,
      ElementsAre("zero_optimization.cpu_offload (now 'zero_optimization.offload_optimizer')",
                  "zero_optimization.cpu_offload_param (now "
                  "'zero_optimization.offload_param')"));
  EXPECT_EQ(Ok(R"({"zero_optimization": {"stage": 2, "cpu_offload": false}})")
                .zero.offload_optimizer.device,
            OffloadDevice::kNone);
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 2, "cpu_offload": true,
                          "offload_optimizer": {"device": "cpu"}}})"),
              StartsWith("test.json: zero_optimization.cpu_offload: cannot be combined with"));
  EXPECT_THAT(Ok(R"({"zero_optimization": {"stage": 2, "cpu_offload_param": true}})")
                  .diagnostics.warnings,
              ElementsAre(StartsWith("zero_optimization.cpu_offload_param: parameter offload to "
                                     "cpu needs zero_optimization.stage 3")));
}

TEST(ConfigOffloadTest, OffloadSettings) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "pin_memory": true, "buffer_count": 8,
                        "buffer_size": 2e8, "max_in_cpu": 5e9},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": 6,
                            "pipeline_read": true, "pipeline_write": true, "fast_init": true}}})");
  EXPECT_TRUE(c.zero.offload_param.pin_memory);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 8);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 200'000'000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 5'000'000'000);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 6);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_read);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_write);
  EXPECT_TRUE(c.zero.offload_optimizer.fast_init);
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path, "/n");
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 1.0);
}

// Partial optimizer offload: a fraction in (0, 1]; anything else names the key and the range.
TEST(ConfigOffloadTest, OptimizerRatio) {
  Config c = Ok(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})");
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 0.3);
  EXPECT_TRUE(c.diagnostics.ignored_keys.empty());
  for (const char* bad : {"0", "1.5", "-0.2", "\"half\""}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(ErrorOf(fmt::format(R"({{"zero_optimization": {{"stage": 2,
        "offload_optimizer": {{"device": "cpu", "ratio": {}}}}}}})", bad)),
                AllOf(HasSubstr("zero_optimization.offload_optimizer.ratio"),
                      HasSubstr("a fraction in (0, 1]")));
  }
}

// strata.freeze / strata.trainable: lists of patterns, at most one of the two.
TEST(ConfigStrataTest, FreezeAndTrainable) {
  Config c = Ok(R"({"strata": {"freeze": ["model.embed_tokens.*", "model.layers.[0-3].*"]}})");
  EXPECT_THAT(c.strata.freeze, ElementsAre("model.embed_tokens.*", "model.layers.[0-3].*"));
  EXPECT_TRUE(c.strata.trainable.empty());
  EXPECT_THAT(Ok(R"({"strata": {"trainable": "lm_head.*"}})").strata.trainable,
              ElementsAre("lm_head.*"));
  EXPECT_THAT(ErrorOf(R"({"strata": {"freeze": ["a*"], "trainable": ["b*"]}})"),
              HasSubstr("strata.freeze and strata.trainable are both given"));
  EXPECT_THAT(ErrorOf(R"({"strata": {"freeze": [3]}})"),
              HasSubstr("strata.freeze"));
}

// ---- zero_optimization spellings ----

TEST(ConfigZeroTest, Stage3KeysWithoutPrefixAndDeprecatedFp16Name) {
  Config c = Ok(R"({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e7,
      "param_persistence_threshold": 10, "model_persistence_threshold": 20,
      "max_live_parameters": 30, "max_reuse_distance": 40,
      "stage3_gather_fp16_weights_on_model_save": true}})");
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 10'000'000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 10);
  EXPECT_EQ(c.zero.stage3_model_persistence_threshold, 20);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 30);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 40);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_THAT(c.diagnostics.deprecated_keys,
              ElementsAre("zero_optimization.stage3_gather_fp16_weights_on_model_save (now "
                          "'zero_optimization.stage3_gather_16bit_weights_on_model_save')"));
  EXPECT_TRUE(Ok(R"({"zero_optimization": {"gather_16bit_weights_on_model_save": true}})")
                  .zero.stage3_gather_16bit_weights_on_model_save);
}

TEST(ConfigZeroTest, AllBooleanKnobs) {
  Config c = Ok(R"({"zero_optimization": {"stage": 2, "contiguous_gradients": false,
      "reduce_scatter": false, "allgather_partitions": false, "load_from_fp32_weights": false,
      "elastic_checkpoint": true, "ignore_unused_parameters": false,
      "round_robin_gradients": true}})");
  EXPECT_FALSE(c.zero.contiguous_gradients);
  EXPECT_FALSE(c.zero.reduce_scatter);
  EXPECT_FALSE(c.zero.allgather_partitions);
  EXPECT_FALSE(c.zero.load_from_fp32_weights);
  EXPECT_TRUE(c.zero.elastic_checkpoint);
  EXPECT_FALSE(c.zero.ignore_unused_parameters);
  EXPECT_TRUE(c.zero.round_robin_gradients);
}

TEST(ConfigZeroTest, BooleanFormMeansStage1) {
  Config c = Ok(R"({"zero_optimization": true})");
  EXPECT_EQ(c.zero.stage, 1);
  EXPECT_EQ(c.diagnostics.deprecated_keys.size(), 1u);
  EXPECT_EQ(Ok(R"({"zero_optimization": false})").zero.stage, 0);
}

// ---- optimizer ----

TEST(ConfigOptimizerTest, AdamIsDecoupledUnlessAdamWModeIsFalse) {
  Config adam = Ok(R"({"optimizer": {"type": "Adam", "params": {"lr": 2e-4}}})");
  EXPECT_TRUE(adam.optimizer.specified);
  EXPECT_EQ(adam.optimizer.type, OptimizerType::kAdam);
  EXPECT_TRUE(adam.optimizer.decoupled_weight_decay);
  EXPECT_EQ(adam.optimizer.lr, 2e-4);

  Config l2 = Ok(R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": false}}})");
  EXPECT_FALSE(l2.optimizer.decoupled_weight_decay);

  // "AdamW" is decoupled whatever adam_w_mode says (as in DeepSpeed).
  Config adamw = Ok(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})");
  EXPECT_EQ(adamw.optimizer.type, OptimizerType::kAdamW);
  EXPECT_TRUE(adamw.optimizer.decoupled_weight_decay);
}

TEST(ConfigOptimizerTest, AllAdamParams) {
  Config c = Ok(R"({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95],
      "eps": 1e-6, "weight_decay": 0.1, "bias_correction": false, "torch_adam": true,
      "amsgrad": false, "fp32_optimizer_states": true}}})");
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_FALSE(c.optimizer.bias_correction);
  EXPECT_TRUE(c.optimizer.torch_adam);
}

TEST(ConfigOptimizerTest, UnsupportedOptimizersAreUnimplemented) {
  EXPECT_EQ(ErrorOf(R"({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})",
                    StatusCode::kUnimplemented),
            "test.json: optimizer.type: \"Lamb\" is not implemented by Strata; supported "
            "optimizers are \"Adam\" and \"AdamW\"");
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"type": "OneBitAdam"}})", StatusCode::kUnimplemented),
              HasSubstr("\"OneBitAdam\" is not implemented"));
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})",
                      StatusCode::kUnimplemented),
              StartsWith("test.json: optimizer.params.amsgrad: AMSGrad is not implemented"));
}

TEST(ConfigOptimizerTest, MaxGradNormPointsToGradientClipping) {
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})"),
              AllOf(StartsWith("test.json: optimizer.params.max_grad_norm: "),
                    HasSubstr("gradient_clipping")));
}

TEST(ConfigOptimizerTest, TypeIsRequired) {
  EXPECT_EQ(ErrorOf(R"({"optimizer": {"params": {"lr": 1e-3}}})"),
            "test.json: optimizer.type: missing; expected \"Adam\" or \"AdamW\"");
}

// ---- scheduler ----

TEST(ConfigSchedulerTest, WarmupLRDefaultsAndMaxLrFromOptimizer) {
  Config c = Ok(R"({"optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
                   "scheduler": {"type": "WarmupLR"}})");
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 5e-5);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLog);
  c = Ok(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-4,
             "warmup_min_lr": 1e-6, "warmup_num_steps": 10, "warmup_type": "linear",
             "last_batch_iteration": 99}}})");
  EXPECT_EQ(c.scheduler.warmup_max_lr, 1e-4);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 1e-6);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 10);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLinear);
  EXPECT_EQ(c.scheduler.last_batch_iteration, 99);
}

TEST(ConfigSchedulerTest, WarmupDecayLRNeedsTotalNumSteps) {
  EXPECT_EQ(ErrorOf(R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})"),
            "test.json: scheduler.params.total_num_steps: required by WarmupDecayLR (a number of "
            "optimizer steps, or \"auto\" to take the run length)");
  Config c = Ok(R"({"optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})");
  EXPECT_EQ(c.scheduler.total_num_steps, std::nullopt);
  // Unlike WarmupLR, DeepSpeed's WarmupDecayLR defaults warmup_max_lr to 1e-3.
  EXPECT_EQ(c.scheduler.warmup_max_lr, 1e-3);
  c = Ok(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1e4}}})");
  EXPECT_EQ(c.scheduler.total_num_steps, 10000);
}

TEST(ConfigSchedulerTest, WarmupCosineLR) {
  Config c = Ok(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}})");
  EXPECT_EQ(c.scheduler.warmup_min_ratio, 0.0);
  EXPECT_EQ(c.scheduler.cos_min_ratio, 1e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);
  EXPECT_THAT(ErrorOf(R"({"scheduler": {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 100, "cos_min_ratio": 2}}})"),
              HasSubstr("cos_min_ratio: expected a number in [0, 1], got 2"));
  EXPECT_THAT(ErrorOf(R"({"scheduler": {"type": "WarmupCosineLR"}})"),
              HasSubstr("total_num_steps: required by WarmupCosineLR"));
}

TEST(ConfigSchedulerTest, UnsupportedSchedulersAreUnimplemented) {
  EXPECT_EQ(
      ErrorOf(R"({"scheduler": {"type": "OneCycle", "params": {}}})", StatusCode::kUnimplemented),
      "test.json: scheduler.type: \"OneCycle\" is not implemented by Strata; supported "
      "schedulers are \"WarmupLR\", \"WarmupDecayLR\" and \"WarmupCosineLR\"");
  EXPECT_THAT(ErrorOf(R"({"scheduler": {"type": "LRRangeTest"}})", StatusCode::kUnimplemented),
              HasSubstr("supported schedulers"));
  EXPECT_EQ(ErrorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})"),
            "test.json: scheduler.params.warmup_type: expected one of \"log\" or \"linear\", got "
            "\"cubic\"");
}

// ---- checkpoint ----

TEST(ConfigCheckpointTest, TagValidation) {
  EXPECT_EQ(Ok(R"({"checkpoint": {"tag_validation": "fail"}})").checkpoint.tag_validation,
            TagValidation::kFail);
  EXPECT_EQ(Ok(R"({"checkpoint": {"tag_validation": "Ignore"}})").checkpoint.tag_validation,
            TagValidation::kIgnore);
  EXPECT_EQ(ErrorOf(R"({"checkpoint": {"tag_validation": "Maybe"}})"),
            "test.json: checkpoint.tag_validation: expected one of \"Ignore\", \"Warn\" or "
            "\"Fail\", got \"Maybe\"");
  Config c = Ok(R"({"checkpoint": {"load_universal": true, "use_node_local_storage": true}})");
  EXPECT_TRUE(c.checkpoint.load_universal);
  EXPECT_TRUE(c.checkpoint.use_node_local_storage);
}

// ---- strata section ----

TEST(ConfigStrataTest, ByteSizesAcceptNumbersAndStrings) {
  Config c = Ok(R"({"strata": {"memory": {"pinned_pool": 1073741824, "host_budget": "2TiB",
                   "device_budget": "70GB"}, "io": {"stripe_unit": "256K"}}})");
  EXPECT_EQ(c.strata.memory.pinned_pool, 1ull << 30);
  EXPECT_EQ(c.strata.memory.host_budget, 2ull << 40);
  EXPECT_EQ(c.strata.memory.device_budget, 70'000'000'000ull);
  EXPECT_EQ(c.strata.io.stripe_unit, 256u * 1024);
  EXPECT_THAT(ErrorOf(R"({"strata": {"memory": {"pinned_pool": "lots"}}})"),
              StartsWith("test.json: strata.memory.pinned_pool: 'lots' is not a byte size"));
  EXPECT_EQ(ErrorOf(R"({"strata": {"io": {"stripe_unit": 1000}}})"),
            "test.json: strata.io.stripe_unit: expected a positive byte size that is a multiple "
            "of 4096 (a number of bytes or a string such as \"1MiB\"), got 1000");
  EXPECT_THAT(ErrorOf(R"({"strata": {"io": {"block_size": "6K"}}})"),
              HasSubstr("strata.io.block_size: expected a positive byte size that is a multiple"));
}

TEST(ConfigStrataTest, TogglesAndEnums) {
  Config c = Ok(R"({"strata": {"io": {"direct": true, "huge_pages": "off", "backend": "io_uring",
                   "sqpoll": true, "register_buffers": false, "register_files": false,
                   "durable_writes": true, "numa_bind": false}, "device": "cpu", "seed": 7}})");
  EXPECT_EQ(c.strata.io.direct, Toggle::kOn);
  EXPECT_EQ(c.strata.io.huge_pages, Toggle::kOff);
  EXPECT_EQ(c.strata.io.backend, IoBackend::kUring);
  EXPECT_TRUE(c.strata.io.sqpoll);
  EXPECT_FALSE(c.strata.io.register_buffers);
  EXPECT_FALSE(c.strata.io.register_files);
  EXPECT_TRUE(c.strata.io.durable_writes);
  EXPECT_FALSE(c.strata.io.numa_bind);
  EXPECT_EQ(c.strata.device, DeviceKind::kCpu);
  EXPECT_EQ(c.strata.seed, 7u);
  EXPECT_EQ(Ok(R"({"strata": {"io": {"direct": "false"}}})").strata.io.direct, Toggle::kOff);
  EXPECT_EQ(ErrorOf(R"({"strata": {"io": {"direct": "maybe"}}})"),
            "test.json: strata.io.direct: expected \"auto\", \"on\", \"off\", true or false, got "
            "\"maybe\"");
  EXPECT_EQ(ErrorOf(R"({"strata": {"io": {"backend": "libaio"}}})"),
            "test.json: strata.io.backend: expected one of \"auto\", \"uring\" or \"posix\", got "
            "\"libaio\"");
  EXPECT_THAT(ErrorOf(R"({"strata": {"io": {"threads": 0}}})"),
              HasSubstr("strata.io.threads: expected a positive integer or \"auto\", got 0"));
  EXPECT_THAT(ErrorOf(R"({"strata": {"io": {"nvme_paths": []}}})"),
              HasSubstr("strata.io.nvme_paths: expected a non-empty list of directory paths"));
  EXPECT_EQ(Ok("{}").strata.memory.share_host_memory, Toggle::kAuto);
  EXPECT_EQ(Ok(R"({"strata": {"memory": {"share_host_memory": false}}})")
                .strata.memory.share_host_memory,
            Toggle::kOff);
  EXPECT_EQ(Ok(R"({"strata": {"memory": {"share_host_memory": "on"}}})")
                .strata.memory.share_host_memory,
            Toggle::kOn);
  EXPECT_EQ(ErrorOf(R"({"strata": {"memory": {"share_host_memory": 2}}})"),
            "test.json: strata.memory.share_host_memory: expected \"auto\", \"on\", \"off\", true "
            "or false, got 2");
  EXPECT_EQ(Ok("{}").strata.activation_checkpointing, Toggle::kAuto);
  EXPECT_EQ(Ok(R"({"strata": {"activation_checkpointing": false}})").strata.activation_checkpointing,
            Toggle::kOff);
  EXPECT_EQ(Ok(R"({"strata": {"activation_checkpointing": "on"}})").strata.activation_checkpointing,
            Toggle::kOn);
  EXPECT_EQ(ErrorOf(R"({"strata": {"activation_checkpointing": "sometimes"}})"),
            "test.json: strata.activation_checkpointing: expected \"auto\", \"on\", \"off\", "
            "true or false, got \"sometimes\"");
  EXPECT_EQ(Ok("{}").strata.split_blocks, Toggle::kAuto);
  EXPECT_EQ(Ok(R"({"strata": {"split_blocks": true}})").strata.split_blocks, Toggle::kOn);
  EXPECT_EQ(Ok(R"({"strata": {"split_blocks": "off"}})").strata.split_blocks, Toggle::kOff);
  // "auto" never splits a LoRA run: no error with it.
  EXPECT_EQ(Ok(R"({"strata": {"lora": {"r": 4}}})").strata.split_blocks, Toggle::kAuto);
  EXPECT_EQ(Ok(R"({"strata": {"split_blocks": true, "activation_checkpointing": "on"}})")
                .strata.activation_checkpointing,
            Toggle::kOn);
  EXPECT_THAT(ErrorOf(R"({"strata": {"split_blocks": true, "lora": {"r": 4}}})"),
              HasSubstr("strata.split_blocks and strata.lora are both given"));
  EXPECT_THAT(ErrorOf(R"({"strata": {"split_blocks": 2}})"), HasSubstr("strata.split_blocks"));
  // Checkpoints in host memory: strata.offload_checkpoints, or DeepSpeed's cpu_checkpointing.
  EXPECT_EQ(Ok("{}").strata.offload_checkpoints, Toggle::kAuto);
  EXPECT_EQ(Ok(R"({"strata": {"offload_checkpoints": true}})").strata.offload_checkpoints,
            Toggle::kOn);
  EXPECT_EQ(Ok(R"({"activation_checkpointing": {"cpu_checkpointing": true}})")
                .strata.offload_checkpoints,
            Toggle::kOn);
  EXPECT_EQ(Ok(R"({"activation_checkpointing": {"cpu_checkpointing": false}})")
                .strata.offload_checkpoints,
            Toggle::kAuto);
  EXPECT_THAT(ErrorOf(R"({"activation_checkpointing": {"cpu_checkpointing": true},
                          "strata": {"offload_checkpoints": false}})"),
              HasSubstr("activation_checkpointing.cpu_checkpointing is true and "
                        "strata.offload_checkpoints is off"));
  EXPECT_THAT(ErrorOf(R"({"strata": {"offload_checkpoints": "on",
                                     "activation_checkpointing": "off"}})"),
              HasSubstr("strata.offload_checkpoints is on and strata.activation_checkpointing "
                        "is off"));
  EXPECT_THAT(ErrorOf(R"({"activation_checkpointing": {"cpu_checkpointing": "yes"}})"),
              HasSubstr("activation_checkpointing.cpu_checkpointing"));
  EXPECT_FALSE(Ok("{}").strata.tf32);
  EXPECT_TRUE(Ok(R"({"strata": {"tf32": true}})").strata.tf32);
  EXPECT_THAT(ErrorOf(R"({"strata": {"tf32": "yes"}})"), HasSubstr("strata.tf32"));
  // Issue 19's keys.
  EXPECT_EQ(Ok("{}").strata.on_nonfinite, NonFinitePolicy::kError);
  EXPECT_EQ(Ok(R"({"strata": {"on_nonfinite": "skip"}})").strata.on_nonfinite,
            NonFinitePolicy::kSkip);
  EXPECT_THAT(ErrorOf(R"({"strata": {"on_nonfinite": "ignore"}})"),
              HasSubstr("strata.on_nonfinite"));
  EXPECT_FALSE(Ok("{}").strata.cpu_adam_threads.has_value());
  EXPECT_EQ(Ok(R"({"strata": {"cpu_adam_threads": 6}})").strata.cpu_adam_threads, 6);
  EXPECT_FALSE(Ok(R"({"strata": {"cpu_adam_threads": "auto"}})").strata.cpu_adam_threads);
  EXPECT_THAT(ErrorOf(R"({"strata": {"cpu_adam_threads": 0}})"),
              HasSubstr("strata.cpu_adam_threads"));
  EXPECT_TRUE(Ok("{}").strata.io.checksums);
  EXPECT_FALSE(Ok(R"({"strata": {"io": {"checksums": false}}})").strata.io.checksums);
}

// Found by fuzz/config_fuzz: a number too large for a double made the JSON library throw
// out_of_range, which ended the process. Now it is one error like any malformed JSON.
TEST(ConfigErrorsTest, NumbersTooLargeForADoubleAreAnError) {
  const std::string e = ErrorOf(R"({"gradient_clipping": 5555555555555555E555555})");
  EXPECT_THAT(e, HasSubstr("malformed JSON"));
  EXPECT_THAT(e, HasSubstr("test.json"));
}

// One load names every mistake in the file, not only the first (per object: unknown keys, then
// bad values, each in document order).
TEST(ConfigErrorsTest, EveryErrorInTheFileIsReported) {
  const std::string e = ErrorOf(R"({"train_micro_batch_size_per_gpu": -1,
      "zero_optimisation": {"stage": 3},
      "optimizer": {"type": "AdamW", "params": {"lr": "fast", "betas": [0.9]}},
      "strata": {"tf32": "yes", "devise": "cpu"}})");
  EXPECT_THAT(e, HasSubstr("6 errors: (1) "));
  EXPECT_THAT(e, HasSubstr("optimizer.params.betas"));
  EXPECT_THAT(e, HasSubstr("train_micro_batch_size_per_gpu"));
  EXPECT_THAT(e, HasSubstr("zero_optimisation"));
  EXPECT_THAT(e, HasSubstr("optimizer.params.lr"));
  EXPECT_THAT(e, HasSubstr("strata.tf32"));
  EXPECT_THAT(e, HasSubstr("strata.devise"));
  // One error alone reads as before: no count.
  EXPECT_THAT(ErrorOf(R"({"strata": {"tf32": "yes"}})"), ::testing::Not(HasSubstr("errors:")));
}

// ---- files ----

TEST(ConfigFileTest, MissingFileIsNotFound) {
  Result<Config> c = LoadConfigFile("/nonexistent/ds_config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/ds_config.json"));
}

TEST(ConfigFileTest, ErrorsNameTheFile) {
  testing::TempDir dir;
  std::string path = dir.file("ds.json");
  std::ofstream(path) << R"({"zero_optimization": {"stage": 7}})";
  Result<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(),
            path + ": zero_optimization.stage: expected an integer 0, 1, 2 or 3, got 7");
}

// ---- internals ----

TEST(ConfigSchemaTest, KeyDistance) {
  EXPECT_EQ(config_internal::KeyDistance("stage", "stage"), 0);
  EXPECT_EQ(config_internal::KeyDistance("trian", "train"), 1);  // transposition
  EXPECT_EQ(config_internal::KeyDistance("Stage", "stage"), 0);  // case-insensitive
  EXPECT_EQ(config_internal::KeyDistance("sise", "size"), 1);
  EXPECT_EQ(config_internal::KeyDistance("", "abc"), 3);
}

}  // namespace
}  // namespace strata
