// A checkpoint save crashed at every sync point, through the file seam: after each crash the
// save directory still resolves to a complete checkpoint — the previous one, or the new one once
// it was published — whose every byte matches its checksums and loads; `latest` never names a
// partial one. Also when the crashed save replaces an existing save of the same step.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "common/crash_file_system.h"
#include "model/llama_model.h"
#include "train/checkpoint.h"
#include "train/runtime.h"
#include "train/safetensors.h"

namespace strata::train {
namespace {

constexpr const char* kSaveDir = "/ckpt";

class CheckpointCrashTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model::LlamaConfig mc;
    mc.name = "crash-tiny";
    mc.vocab_size = 64;
    mc.hidden_size = 32;
    mc.intermediate_size = 48;
    mc.num_hidden_layers = 2;
    mc.num_attention_heads = 4;
    mc.num_key_value_heads = 2;
    mc.max_position_embeddings = 64;
    model_config_ = mc;
    auto config = ParseConfig(R"({"train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "strata": {"device": "cpu"}})",
                              "<test>");
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    config_ = *config;
    RuntimeOptions ro;
    ro.launch = comm::LaunchInfo{};
    auto rt = OpenRuntime(config_, ro);
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    runtime_ = std::move(*rt);
    auto m = model::LlamaModel::Create(*runtime_.device, mc, kSeq, 1);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    auto stack = BuildEngine(runtime_, *model_, config_);
    ASSERT_TRUE(stack.ok()) << stack.status().ToString();
    stack_ = std::move(*stack);
  }
  void TearDown() override { stack_.Reset(); }

  // One training step, so that the next save holds other weights.
  void Step() {
    model::LlamaBatch b;
    for (int i = 0; i <= kSeq; ++i) b.tokens.push_back((i * 7 + step_) % 64);
    const zero::Batch* one[1] = {&b};
    auto r = stack_.engine->TrainStep(one);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ++step_;
  }

  Result<std::string> Save(FileSystem& fs) {
    TrainerState st;
    st.step = step_;
    st.counters = stack_.engine->counters();
    st.world_size = 1;
    st.global_batch = 1;
    st.seq_len = kSeq;
    st.seed = 1;
    st.compute_dtype = "float32";
    st.data_path = "tokens.bin";
    st.data_tokens = 1000;
    SaveOptions o;
    o.fs = &fs;
    o.max_shard_bytes = 24 << 10;  // several shards and an index
    return SaveCheckpoint(*stack_.engine, *runtime_.comm, *runtime_.device, model_config_, st,
                          kSaveDir, o);
  }

  // The checkpoint `latest` names after a restart: complete, verified, loadable. Returns its step
  // and the bytes of its parameter files (to compare with a reference save).
  struct Found {
    int64_t step = -1;
    std::string params;
  };
  Found Check(FileSystem& fs) {
    Found found;
    auto dir = ResolveCheckpoint(kSaveDir, fs);
    EXPECT_TRUE(dir.ok()) << dir.status().ToString();
    if (!dir.ok()) return found;
    auto state = ReadTrainerState(*dir, fs);
    EXPECT_TRUE(state.ok()) << state.status().ToString();
    if (!state.ok()) return found;
    found.step = state->step;
    const Status verified = VerifyCheckpoint(*dir, *runtime_.comm, *runtime_.device, {}, fs);
    EXPECT_TRUE(verified.ok()) << *dir << ": " << verified.ToString();
    EXPECT_TRUE(CheckSameModel(*dir, model_config_, fs).ok());
    auto files = StateFiles::OpenCheckpoint(*dir, model_->units(), {}, {}, fs);
    EXPECT_TRUE(files.ok()) << files.status().ToString();
    // Every parameter file's bytes, in name order.
    auto model = SafetensorsModel::Open(*dir, fs);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    if (model.ok()) {
      for (const auto& f : (*model)->files()) {
        found.params += *ReadFileToString(fs, f->path());
      }
    }
    return found;
  }

  // SAVE/step-00000001 and SAVE/latest of `from`, made durable in `to`.
  static void CopyCheckpoint(CrashFileSystem& from, CrashFileSystem& to) {
    const std::string step = std::string(kSaveDir) + "/step-00000001";
    ASSERT_TRUE(to.CreateDirs(step).ok());
    const auto names = from.List(step);
    ASSERT_TRUE(names.ok());
    for (const std::string& name : *names) {
      const std::string path = step + "/" + name;
      ASSERT_TRUE(WriteFileDurable(to, path, *ReadFileToString(from, path)).ok());
    }
    ASSERT_TRUE(to.Symlink("step-00000001", std::string(kSaveDir) + "/latest").ok());
    for (const std::string& d : {std::string("/"), std::string(kSaveDir), step}) {
      ASSERT_TRUE(to.SyncDir(d).ok());
    }
  }

  static constexpr int kSeq = 8;
  model::LlamaConfig model_config_;
  Config config_;
  Runtime runtime_;
  std::unique_ptr<model::LlamaModel> model_;
  EngineStack stack_;
  int64_t step_ = 1;
};

TEST_F(CheckpointCrashTest, ACrashAtEverySyncPointLeavesALoadableCheckpoint) {
  // What the two saves look like when nothing crashes.
  CrashFileSystem reference;
  ASSERT_TRUE(Save(reference).ok());
  const Found first = Check(reference);
  ASSERT_EQ(first.step, 1);
  const int64_t syncs_before = reference.sync_points();
  Step();
  ASSERT_TRUE(Save(reference).ok());
  const int64_t syncs_per_save = reference.sync_points() - syncs_before;
  const Found second = Check(reference);
  ASSERT_EQ(second.step, 2);
  ASSERT_NE(first.params, second.params);
  ASSERT_GT(syncs_per_save, 8);

  // The second save, crashed after each of its sync points in turn.
  int saw_old = 0, saw_new = 0;
  for (int64_t k = 1; k <= syncs_per_save; ++k) {
    SCOPED_TRACE("crash after sync point " + std::to_string(k) + " of " +
                 std::to_string(syncs_per_save));
    CrashFileSystem fs;
    step_ = 1;
    // The first checkpoint as it was: the weights of step 1 are gone from the engine, so its
    // files are copied from the reference run's.
    CopyCheckpoint(reference, fs);
    ASSERT_EQ(Check(fs).params, first.params);

    step_ = 2;
    fs.CrashAfterSyncs(fs.sync_points() + k);
    const Result<std::string> saved = Save(fs);
    EXPECT_TRUE(fs.crashed());
    EXPECT_FALSE(saved.ok() && k < syncs_per_save) << "the save went on after the crash";
    fs.Restart();
    const Found found = Check(fs);
    ASSERT_TRUE(found.step == 1 || found.step == 2) << found.step;
    EXPECT_EQ(found.params, found.step == 1 ? first.params : second.params);
    (found.step == 1 ? saw_old : saw_new) += 1;
  }
  // Early crashes keep the old checkpoint; once `latest` is durable, the new one is there.
  EXPECT_GT(saw_old, 0);
  EXPECT_GT(saw_new, 0);
}

// A resumed run saving the same step again replaces the step directory; a crash at any point of
// that leaves either save, whole.
TEST_F(CheckpointCrashTest, ACrashWhileReplacingASaveOfTheSameStepLeavesOneOfThem) {
  CrashFileSystem first_fs;  // step 1 with the first weights
  ASSERT_TRUE(Save(first_fs).ok());
  const Found before = Check(first_fs);
  Step();
  step_ = 1;  // the same step number, other weights
  CrashFileSystem reference;
  ASSERT_TRUE(Save(reference).ok());
  const Found after = Check(reference);
  ASSERT_EQ(after.step, 1);
  ASSERT_NE(before.params, after.params);
  const int64_t syncs_per_save = reference.sync_points();
  int saw_before = 0, saw_after = 0;
  for (int64_t k = 1; k <= syncs_per_save + 2; ++k) {
    SCOPED_TRACE("crash after sync point " + std::to_string(k));
    CrashFileSystem fs;
    CopyCheckpoint(first_fs, fs);
    fs.CrashAfterSyncs(fs.sync_points() + k);
    (void)Save(fs);
    if (!fs.crashed()) fs.Crash();
    fs.Restart();
    const Found found = Check(fs);
    EXPECT_EQ(found.step, 1);
    EXPECT_TRUE(found.params == before.params || found.params == after.params);
    (found.params == before.params ? saw_before : saw_after) += 1;
  }
  EXPECT_GT(saw_before, 0);
  EXPECT_GT(saw_after, 0);
}

}  // namespace
}  // namespace strata::train
