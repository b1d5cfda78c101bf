// The composition root (train/runtime.h): the device, budgets and pool a config asks for.
#include "train/runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model/llama_model.h"
#include "test_support.h"

namespace strata::train {
namespace {

using ::testing::HasSubstr;

Config Parse(const std::string& json) {
  auto c = ParseConfig(json, "<test>");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

RuntimeOptions OneRank() {
  RuntimeOptions o;
  o.launch = comm::LaunchInfo{};
  return o;
}

TEST(RuntimeTest, TheDeviceTakesTheConfiguredBudget) {
  const Config c = Parse(R"({"train_micro_batch_size_per_gpu": 1,
      "strata": {"device": "cpu", "memory": {"device_budget": "96MiB"}}})");
  auto rt = OpenRuntime(c, OneRank());
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  EXPECT_EQ(rt->device->type(), device::DeviceType::kCpu);
  EXPECT_EQ(rt->device->memory_stats().budget, uint64_t{96} << 20);
  EXPECT_EQ(rt->comm->world_size(), 1);
  EXPECT_THAT(rt->choice.reason, HasSubstr("CPU"));
}

TEST(RuntimeTest, CudaWithoutADeviceNamesTheReason) {
  const Config c = Parse(R"({"train_micro_batch_size_per_gpu": 1})");
  RuntimeOptions o = OneRank();
  o.device = DeviceKind::kCuda;
  o.gpus = device::GpuReport{};
  o.gpus->none_reason = "no CUDA driver is installed";
  auto rt = OpenRuntime(c, o);
  ASSERT_FALSE(rt.ok());
  EXPECT_THAT(rt.status().message(), HasSubstr("no CUDA driver is installed"));
  // auto falls back to the CPU.
  o.device = DeviceKind::kAuto;
  auto cpu = OpenRuntime(c, o);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  EXPECT_EQ(cpu->device->type(), device::DeviceType::kCpu);
}

TEST(RuntimeTest, BuildsTheEngineWithTheConfiguredPoolAndHostBudget) {
  model::LlamaConfig mc;
  mc.name = "rt-tiny";
  mc.vocab_size = 64;
  mc.hidden_size = 32;
  mc.intermediate_size = 48;
  mc.num_hidden_layers = 2;
  mc.num_attention_heads = 4;
  mc.num_key_value_heads = 2;
  mc.max_position_embeddings = 64;
  const Config c = Parse(R"({"train_micro_batch_size_per_gpu": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                            "offload_optimizer": {"device": "cpu"}},
      "strata": {"device": "cpu", "memory": {"pinned_pool": "24MiB"}}})");
  auto rt = OpenRuntime(c, OneRank());
  ASSERT_TRUE(rt.ok()) << rt.status().ToString();
  auto model = model::LlamaModel::Create(*rt->device, mc, 8, 1);
  ASSERT_TRUE(model.ok());
  {
    auto stack = BuildEngine(*rt, **model, c);
    ASSERT_TRUE(stack.ok()) << stack.status().ToString();
    EXPECT_EQ(stack->pool->size(), uint64_t{24} << 20);
    EXPECT_EQ(stack->optimizer_pipeline_depth, 4);  // DeepSpeed's buffer_count default
  }
  // A host budget (for NVMe-homed parameters' host copies) beyond the pool is an error naming
  // both keys.
  strata::testing::TempDir dir;
  const Config big = Parse(R"({"train_micro_batch_size_per_gpu": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" +
                           dir.path().string() + R"("}},
      "strata": {"device": "cpu", "memory": {"pinned_pool": "8MiB", "host_budget": "1GiB"}}})");
  auto bad = BuildEngine(*rt, **model, big);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("strata.memory.host_budget"));
}

}  // namespace
}  // namespace strata::train
