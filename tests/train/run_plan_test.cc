// The first stage of a run, without a device or MPI: what ResolveRun decides from the options and
// the files they name, and what PlanRunPlacement / PlanRunMemory decide from a machine.
#include "train/run_plan.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/units.h"
#include "test_support.h"

namespace strata::train {
namespace {

using strata::testing::TempDir;

class RunPlanTest : public ::testing::Test {
 protected:
  // A DeepSpeed config file with `body` (a JSON object's members).
  std::string Config(const std::string& body, const std::string& name = "ds.json") {
    std::ofstream(dir_.file(name)) << "{" << body << "}";
    return dir_.file(name);
  }
  TrainOptions Options(const std::string& config_body) {
    TrainOptions o;
    o.config_path = Config(config_body);
    o.model = "llama-tiny";
    o.data = dir_.file("tokens.bin");  // not opened by ResolveRun
    o.steps = 10;
    return o;
  }
  static comm::LaunchInfo Ranks(int world, int rank = 0) {
    comm::LaunchInfo l;
    l.world_size = world;
    l.local_size = world;
    l.rank = rank;
    l.local_rank = rank;
    l.launcher = world > 1 ? "mpirun" : "none";
    return l;
  }
  // A checkpoint step directory holding the tiny preset's config and `state`.
  std::string Checkpoint(const TrainerState& state) {
    const std::filesystem::path step = dir_.path() / "ckpt" / "step-00000004";
    std::filesystem::create_directories(step);
    std::ofstream(step / "config.json")
        << model::ToHfConfigJson(*model::LlamaPreset("llama-tiny"), "float32");
    std::ofstream(step / "trainer_state.json") << TrainerStateJson(state);
    std::filesystem::create_symlink("step-00000004", dir_.path() / "ckpt" / "latest");
    return (dir_.path() / "ckpt").string();
  }
  static TrainerState SavedState() {
    TrainerState st;
    st.step = 4;
    st.counters.optimizer_steps = 4;
    st.world_size = 2;
    st.global_batch = 4;
    st.seq_len = 32;
    st.scheduler_total_steps = 50;
    st.seed = 77;
    st.compute_dtype = "float32";
    st.sampler.step = 4;
    st.sampler.seq_len = 32;
    st.sampler.num_windows = 100;
    st.sampler.seed = 77;
    st.sampler.mode = SamplingMode::kSequential;
    st.data_path = "tokens.bin";
    st.data_tokens = 3300;
    return st;
  }

  TempDir dir_;
};

TEST_F(RunPlanTest, ResolvesTheBatchLayoutTheScheduleAndTheSequence) {
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
      "scheduler": {"type": "WarmupCosineLR",
                    "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}})");
  auto plan = ResolveRun(o, Ranks(4));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->layout.world_size, 4);
  EXPECT_EQ(plan->layout.micro_batch, 3);
  EXPECT_EQ(plan->layout.grad_accum, 2);
  EXPECT_EQ(plan->sampler.global_batch, 24u);
  // The schedule's length is the run's when the config leaves it out.
  EXPECT_EQ(plan->scheduler_total_steps, 10);
  EXPECT_EQ(plan->config.scheduler.total_num_steps, 10);
  // The sequence: min(256, max_position_embeddings) of the tiny preset (128).
  EXPECT_EQ(plan->seq_len, 128);
  EXPECT_EQ(plan->sampler.seq_len, 128u);
  EXPECT_EQ(plan->seed, 1234u);
  EXPECT_EQ(plan->sampler.mode, SamplingMode::kRandom);
  EXPECT_FALSE(plan->resumed.has_value());
  EXPECT_EQ(plan->model.name, "llama-tiny");
  EXPECT_TRUE(plan->model_dir.empty() || !std::filesystem::exists(plan->model_dir));
}

TEST_F(RunPlanTest, BadFlagsNameTheFlag) {
  struct Case {
    void (*edit)(TrainOptions&);
    const char* expect;
  } cases[] = {
      {[](TrainOptions& o) { o.steps = 0; }, "--steps 0: expected >= 1"},
      {[](TrainOptions& o) { o.eval_every = 5; }, "--eval-every 5: needs --eval-data"},
      {[](TrainOptions& o) { o.eval_sequences = -1; }, "--eval-every and --eval-sequences"},
      {[](TrainOptions& o) { o.model.clear(); }, "--model: required"},
      {[](TrainOptions& o) { o.sampling = "shuffled"; }, "shuffled"},
      {[](TrainOptions& o) { o.data_dtype = "float8"; }, "float8"},
      {[](TrainOptions& o) { o.model = "/no/such/model"; }, "/no/such/model"},
  };
  for (const Case& c : cases) {
    TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 1)");
    c.edit(o);
    auto plan = ResolveRun(o, Ranks(1));
    ASSERT_FALSE(plan.ok()) << c.expect;
    EXPECT_NE(plan.status().message().find(c.expect), std::string::npos) << plan.status().ToString();
  }
}

TEST_F(RunPlanTest, AMistralWindowShorterThanTheSequenceIsRefused) {
  std::ofstream(dir_.file("config.json")) << R"({"model_type": "mistral", "vocab_size": 256,
      "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
      "num_attention_heads": 4, "sliding_window": 16})";
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 1)");
  o.model = dir_.path().string();
  o.seq_len = 32;
  auto plan = ResolveRun(o, Ranks(1));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(plan.status().message().find("sliding_window is 16"), std::string::npos);
  o.seq_len = 16;
  EXPECT_TRUE(ResolveRun(o, Ranks(1)).ok());
}

TEST_F(RunPlanTest, EvaluationIsForwardOnlyWithItsOwnMicroBatch) {
  TrainOptions o;
  o.model = "llama-tiny";
  o.data = dir_.file("tokens.bin");
  o.eval_only = true;
  o.eval_micro_batch = 5;
  auto plan = ResolveRun(o, Ranks(2));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->layout.micro_batch, 5);
  EXPECT_EQ(plan->config.strata.freeze, std::vector<std::string>{"*"});
  EXPECT_EQ(plan->config.zero.offload_optimizer.device, OffloadDevice::kNone);
  o.eval_micro_batch = 0;
  auto bad = ResolveRun(o, Ranks(1));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--micro-batch 0"), std::string::npos);
}

// A resumed checkpoint fixes the data order, the sequence length and the schedule's length;
// flags that would change them are refused naming the flag and the checkpoint.
TEST_F(RunPlanTest, AResumedCheckpointFixesTheDataOrder) {
  const std::string ckpt = Checkpoint(SavedState());
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 2,
      "scheduler": {"type": "WarmupDecayLR",
                    "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}})");
  o.model.clear();
  o.resume_dir = ckpt;
  auto plan = ResolveRun(o, Ranks(1));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->resume_dir, (std::filesystem::path(ckpt) / "step-00000004").string());
  EXPECT_EQ(plan->model_arg, plan->resume_dir);
  EXPECT_EQ(plan->seq_len, 32);
  EXPECT_EQ(plan->seed, 77u);
  EXPECT_EQ(plan->sampler.mode, SamplingMode::kSequential);
  EXPECT_EQ(plan->scheduler_total_steps, 50);  // the run's own, not --steps
  EXPECT_EQ(plan->model.hidden_size, 64);

  struct Case {
    void (*edit)(TrainOptions&);
    const char* expect;
  } cases[] = {
      {[](TrainOptions& edited) { edited.seq_len = 64; }, "--seq-len 64: the checkpoint"},
      {[](TrainOptions& edited) { edited.seed = 5; }, "--seed 5: the checkpoint"},
      {[](TrainOptions& edited) { edited.sampling = "random"; }, "--sampling random: the checkpoint"},
      {[](TrainOptions& edited) { edited.adapter_dir = "/x"; }, "--adapter and --resume"},
      {[](TrainOptions& edited) { edited.model = "llama-20m"; }, "from a different model"},
  };
  for (const Case& c : cases) {
    TrainOptions bad = o;
    c.edit(bad);
    auto r = ResolveRun(bad, Ranks(1));
    ASSERT_FALSE(r.ok()) << c.expect;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().ToString();
  }
  // Flags equal to what the checkpoint fixed are fine.
  o.seq_len = 32;
  o.seed = 77;
  o.sampling = "sequential";
  EXPECT_TRUE(ResolveRun(o, Ranks(1)).ok());
}

TEST_F(RunPlanTest, LoraFromTheConfigMakesTheAdaptersTrainable) {
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 1,
      "strata": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}})");
  auto plan = ResolveRun(o, Ranks(1));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_TRUE(plan->lora.enabled());
  EXPECT_EQ(plan->lora.rank, 4);
  EXPECT_FALSE(plan->config.strata.trainable.empty());
  // A checkpoint without adapters cannot continue a LoRA run.
  TrainOptions resumed = o;
  resumed.model.clear();
  resumed.resume_dir = Checkpoint(SavedState());
  auto r = ResolveRun(resumed, Ranks(1));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("has no LoRA adapters"), std::string::npos);
}

TEST_F(RunPlanTest, SavesAndEvaluationsAreDueWhereTheFlagsSay) {
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 1)");
  o.steps = 10;
  o.save_dir = dir_.file("out");
  o.save_every = 4;
  o.eval_every = 3;
  o.eval_data = dir_.file("eval.bin");
  auto plan = ResolveRun(o, Ranks(1));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<int64_t> saves, evals;
  for (int64_t done = 1; done <= 10; ++done) {
    if (plan->SaveDue(done, false)) saves.push_back(done);
    if (plan->EvalDue(done)) evals.push_back(done);
  }
  EXPECT_EQ(saves, (std::vector<int64_t>{4, 8, 10}));
  EXPECT_EQ(evals, (std::vector<int64_t>{3, 6, 9, 10}));
  EXPECT_FALSE(plan->SaveDue(5, true));  // a signal saves only with --save-on-signal
  plan->options.save_on_signal = true;
  EXPECT_TRUE(plan->SaveDue(5, true));
}

// The memory side, from a machine described as data.
TEST_F(RunPlanTest, TheMemoryPlanSettlesCheckpointingAndRefusesWhatDoesNotFit) {
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 2,
      "zero_optimization": {"stage": 3})");
  o.seq_len = 64;
  auto plan = ResolveRun(o, Ranks(2));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  MachineFacts roomy;
  roomy.device_budget = 8ull << 30;
  auto memory = PlanRunMemory(*plan, roomy);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  // "auto" checkpointing: off when every block's internals fit.
  EXPECT_TRUE(memory->keep_activations);
  EXPECT_FALSE(memory->offload_checkpoints);
  MachineFacts tiny;
  tiny.device_budget = 64 << 10;
  auto refused = PlanRunMemory(*plan, tiny);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
  // Without "auto" homes there is no placement to plan.
  auto none = PlanRunPlacement(*plan, roomy);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

TEST_F(RunPlanTest, AutoHomesArePlannedForTheMachine) {
  TrainOptions o = Options(R"("train_micro_batch_size_per_gpu": 2, "zero_optimization": {
      "stage": 3, "offload_param": {"device": "auto"}, "offload_optimizer": {"device": "auto"}})");
  o.seq_len = 64;
  auto plan = ResolveRun(o, Ranks(1));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  MachineFacts machine;
  machine.device_budget = 8ull << 30;
  machine.hardware.gpus_per_node = 1;
  machine.hardware.gpu_mem = 8ull << 30;
  machine.hardware.cpu_mem = 16ull << 30;
  machine.hardware.nvme = 0;
  auto choice = PlanRunPlacement(*plan, machine);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  ASSERT_TRUE(choice->has_value());
  // Everything fits the device: nothing is offloaded, and the banner says why.
  EXPECT_EQ((*choice)->candidate.param, OffloadDevice::kNone);
  EXPECT_EQ((*choice)->candidate.optimizer, OffloadDevice::kNone);
  ASSERT_FALSE((*choice)->lines.empty());
  EXPECT_NE((*choice)->lines[0].find("placement (\"auto\""), std::string::npos);
  EXPECT_GT((*choice)->fingerprint, 0.0f);
}

TEST(RunPlanPaths, RankPathAddsTheRankBeforeTheExtension) {
  EXPECT_EQ(RankPath("/t/trace.json", 0, 1), "/t/trace.json");
  EXPECT_EQ(RankPath("/t/trace.json", 3, 4), "/t/trace.rank3.json");
}

}  // namespace
}  // namespace strata::train
