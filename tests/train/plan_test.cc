// The time model and the placement planner (train/plan.h): the bytes and FLOPs a step moves per
// resource, the overlap the engine does, the fit per tier, the planner's choice and its errors,
// and the "auto" offload homes in the config.
#include "train/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "model/llama_config.h"
#include "model/llama_model.h"
#include "zero/engine.h"

namespace strata::train {
namespace {

using ::testing::HasSubstr;

model::LlamaConfig SmallModel() {
  model::LlamaConfig m;
  m.name = "test";
  m.vocab_size = 2048;
  m.hidden_size = 256;
  m.intermediate_size = 704;
  m.num_hidden_layers = 4;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.max_position_embeddings = 256;
  return m;
}

Config Parse(const std::string& json) {
  Result<Config> c = ParseConfig(json, "<test>");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Config{};
}

EstimateInput Input(const std::string& zero, int world = 1, const std::string& extra = "") {
  EstimateInput in;
  in.model = SmallModel();
  in.config = Parse(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                        "bf16": {"enabled": true}, )" +
                    extra + R"("zero_optimization": )" + zero + "}");
  in.world_size = world;
  in.seq_len = 128;
  in.device = device::DeviceType::kCuda;
  return in;
}

Hardware Big(int gpus) {
  Hardware hw;
  hw.gpus_per_node = gpus;
  return hw;
}

TEST(ParseRateTest, UnitsAndForms) {
  EXPECT_DOUBLE_EQ(*ParseRate("25G/s"), 25e9);
  EXPECT_DOUBLE_EQ(*ParseRate("12GB/s"), 12e9);
  EXPECT_DOUBLE_EQ(*ParseRate("1.5G"), 1.5e9);
  EXPECT_DOUBLE_EQ(*ParseRate("50e9"), 50e9);
  EXPECT_DOUBLE_EQ(*ParseRate("3.35T/s"), 3.35e12);
  EXPECT_DOUBLE_EQ(*ParseRate("1GiB/s"), 1073741824.0);
  EXPECT_DOUBLE_EQ(*ParseRate("800M"), 800e6);
  EXPECT_DOUBLE_EQ(*ParseRate("400Gb/s"), 50e9);  // bits, as network links are quoted
  EXPECT_DOUBLE_EQ(*ParseRate("14PB"), 14e15);      // drive endurance (--nvme-tbw)
  for (const char* bad : {"", "fast", "-1G/s", "0", "5Q/s", "G/s", "1e", "2GG"}) {
    Result<double> r = ParseRate(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_THAT(std::string(r.status().message()), HasSubstr("is not a rate")) << bad;
    }
  }
}

// Split blocks with checkpointing: four units per block, and a third gather per micro-batch of
// the attention, gate and up units of every block but the last (LlamaRecomputeUnits).
TEST(TimeModelTest, SplitBlocksGatherTheRecomputedPartsAgain) {
  const std::string zero = R"({"stage": 3})";
  const EstimateInput whole = Input(zero, 2, R"("strata": {"activation_checkpointing": true}, )");
  const EstimateInput split = Input(
      zero, 2, R"("strata": {"split_blocks": true, "activation_checkpointing": true}, )");
  Result<MemoryEstimate> mw = EstimateMemory(whole), ms = EstimateMemory(split);
  ASSERT_TRUE(mw.ok() && ms.ok()) << ms.status().ToString();
  EXPECT_EQ(mw->units, 4 + 2);
  EXPECT_EQ(ms->units, 4 * 4 + 2);
  EXPECT_TRUE(ms->split_blocks && ms->checkpointing);
  EXPECT_EQ(mw->recompute_padded_elems, 0u);
  // Three of the four blocks recompute; per block everything but the down projection.
  const model::LlamaConfig c = SmallModel();
  const uint64_t down = static_cast<uint64_t>(c.hidden_size * c.intermediate_size);
  const uint64_t block = (static_cast<uint64_t>(c.ParameterCount()) -
                          2 * static_cast<uint64_t>(c.vocab_size * c.hidden_size) -
                          static_cast<uint64_t>(c.hidden_size)) /
                         4;
  EXPECT_GE(ms->recompute_padded_elems, 3 * (block - down));
  EXPECT_LT(ms->recompute_padded_elems, 3 * (block - down) + 3 * 3 * 4096);  // shard padding
  const TimeEstimate tw = EstimateTime(whole, *mw, Big(2)), ts = EstimateTime(split, *ms, Big(2));
  // Per micro-batch (2), the third gather of those elements in bf16 over 2 ranks.
  const double extra = 2.0 * 2 * static_cast<double>(ms->recompute_padded_elems) / 2;
  EXPECT_NEAR(static_cast<double>(ts.collective_bytes) - static_cast<double>(tw.collective_bytes),
              extra + 2.0 * (2 * 2 + 4) * static_cast<double>(ms->padded_elems - mw->padded_elems) / 2,
              8.0);
  EXPECT_DOUBLE_EQ(ts.exec_flops, tw.exec_flops);
}

// Activations in the run's dtype (model::LlamaActivationDType): bf16 on a CUDA device with bf16
// compute, so the estimate charges what the model allocates; fp32 on the CPU device, and on
// CUDA with STRATA_ACTIVATIONS=fp32.
TEST(EstimateTest, ActivationsTakeTheComputeDTypeOnCuda) {
  const EstimateInput cuda = Input(R"({"stage": 3})");
  EstimateInput cpu = cuda;
  cpu.device = device::DeviceType::kCpu;
  Result<MemoryEstimate> g = EstimateMemory(cuda), c = EstimateMemory(cpu);
  ASSERT_TRUE(g.ok() && c.ok()) << g.status().ToString() << c.status().ToString();
  EXPECT_EQ(g->activation_dtype, device::DType::kBF16);
  EXPECT_EQ(c->activation_dtype, device::DType::kF32);
  auto charged = [](uint64_t bytes) { return (bytes + 255) / 256 * 256; };
  const model::LlamaConfig m = SmallModel();
  for (const auto& [e, dtype] :
       {std::pair{&*g, device::DType::kBF16}, std::pair{&*c, device::DType::kF32}}) {
    EXPECT_EQ(e->activations_checkpointed,
              charged(model::LlamaActivationBytes(m, 128, 2, {}, false, false, false, 0, dtype)));
    EXPECT_EQ(e->activations_kept,
              charged(model::LlamaActivationBytes(m, 128, 2, {}, true, false, false, 0, dtype)));
  }
  // Half the bytes, less the fp32 statistics and the token ids.
  EXPECT_LT(g->activations_kept, c->activations_kept * 55 / 100);
  EXPECT_GT(g->activations_kept, c->activations_kept / 2);
  EXPECT_EQ(MemoryEstimateJson(*g)["device"]["activation_dtype"], "bf16");
  EXPECT_THAT(FormatMemoryEstimate(*g), HasSubstr("activations in bf16"));
  ::setenv("STRATA_ACTIVATIONS", "fp32", 1);
  Result<MemoryEstimate> forced = EstimateMemory(cuda);
  ::unsetenv("STRATA_ACTIVATIONS");
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(forced->activation_dtype, device::DType::kF32);
  EXPECT_EQ(forced->activations_kept, c->activations_kept);
}

// strata.split_blocks "auto": whole blocks while their plan fits the device budget; split blocks
// when it does not and theirs is smaller; never with LoRA.
TEST(PlannerTest, SplitBlocksFollowTheDeviceBudget) {
  const std::string zero = R"({"stage": 3, "stage3_max_live_parameters": 1000})";
  EstimateInput whole = Input(zero, 1, R"("strata": {"split_blocks": false}, )");
  EstimateInput split = Input(zero, 1, R"("strata": {"split_blocks": true}, )");
  EstimateInput automatic = Input(zero, 1);
  EstimateInput lora = Input(zero, 1, R"("strata": {"lora": {"r": 4}}, )");
  ASSERT_EQ(automatic.config.strata.split_blocks, Toggle::kAuto);
  Result<MemoryEstimate> w = EstimateMemory(whole), s = EstimateMemory(split);
  ASSERT_TRUE(w.ok() && s.ok()) << s.status().ToString();
  ASSERT_LT(s->device_peak(), w->device_peak());
  // Room for whole blocks: they stay.
  automatic.device_budget = w->device_peak();
  Result<MemoryEstimate> a = EstimateMemory(automatic);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->split_blocks);
  EXPECT_EQ(a->device_peak(), w->device_peak());
  // Not enough: split.
  automatic.device_budget = (w->device_peak() + s->device_peak()) / 2;
  a = EstimateMemory(automatic);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->split_blocks);
  EXPECT_EQ(a->units, 4 * 4 + 2);
  EXPECT_LE(a->device_peak(), automatic.device_budget);
  lora.device_budget = automatic.device_budget;
  a = EstimateMemory(lora);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_FALSE(a->split_blocks);
}

// Stage 3 on 2 ranks, optimizer on NVMe: every byte of the step counted from the partition.
TEST(TimeModelTest, CountsTheBytesOfAStage3NvmeStep) {
  const EstimateInput in = Input(
      R"({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}})", 2);
  Result<MemoryEstimate> m = EstimateMemory(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const double S = static_cast<double>(m->shard_elems), N = static_cast<double>(m->padded_elems);
  EXPECT_EQ(m->padded_elems, 2 * m->shard_elems);
  EXPECT_GE(m->padded_elems, static_cast<uint64_t>(SmallModel().ParameterCount()));
  Hardware hw = Big(2);
  const TimeEstimate t = EstimateTime(in, *m, hw);
  EXPECT_EQ(t.nvme_read_bytes, static_cast<uint64_t>(12 * S));
  EXPECT_EQ(t.nvme_write_bytes, static_cast<uint64_t>(12 * S));
  EXPECT_EQ(t.optimizer_params, m->shard_elems);
  // Per micro-batch (2 of them): two bf16 gathers and one fp32 reduce-scatter, (W-1)/W each.
  EXPECT_EQ(t.collective_bytes, static_cast<uint64_t>(2 * (2 * 2 * N + 4 * N) / 2));
  // Gradient shards leave each micro-batch; updated parameters (homed on the device) return.
  EXPECT_EQ(t.d2h_bytes, static_cast<uint64_t>(2 * 4 * S));
  EXPECT_EQ(t.h2d_bytes, static_cast<uint64_t>(2 * S));
  // The node's two ranks share the drives.
  EXPECT_DOUBLE_EQ(t.nvme_write_s, 2 * 12 * S / hw.nvme_write);
  EXPECT_DOUBLE_EQ(t.nvme_read_s, 2 * 12 * S / hw.nvme_read);
  EXPECT_DOUBLE_EQ(t.optimizer_s, 2 * S / hw.cpu_adam);
  EXPECT_TRUE(t.cpu_optimizer);
  EXPECT_TRUE(t.optimizer_overlapped);
  // Compute: 6N + attention per token, plus the blocks' forward again.
  const double tokens = 2.0 * 128 * 2;
  EXPECT_DOUBLE_EQ(t.model_flops, SmallModel().TrainFlopsPerToken(128) * tokens);
  EXPECT_GT(t.exec_flops, t.model_flops);
  EXPECT_LT(t.exec_flops, t.model_flops * 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(t.compute_s, t.exec_flops / (hw.gpu_tflops * 1e12 * hw.gpu_efficiency));
  EXPECT_DOUBLE_EQ(t.step_s, t.forward_backward_s + t.exposed_optimizer_s + t.after_step_s);
  EXPECT_DOUBLE_EQ(t.tokens_per_s, tokens * 2 / t.step_s);
  EXPECT_DOUBLE_EQ(t.nvme_node_write_per_step, 2 * 12 * S);
  EXPECT_EQ(t.nvme_days, 0.0);  // no endurance given
  hw.nvme_tbw = 1e15;
  const TimeEstimate w = EstimateTime(in, *m, hw);
  EXPECT_DOUBLE_EQ(w.nvme_days, 1e15 / (2 * 12 * S * 86400.0 / w.step_s));
}

TEST(TimeModelTest, ZeroPlusPlusMovesBytesOffTheNetwork) {
  // 2 nodes x 8 GPUs, stage 3, bf16, 2 micro-batches: plain ZeRO-3 puts every gather and
  // reduction on rings that cross nodes; qwZ shrinks the gathers to int8, hpZ keeps backward's
  // gathers in the node, qgZ sends 1/8 of the int8 reduction across nodes.
  const std::string plain = R"({"stage": 3})";
  const std::string zeropp =
      R"({"stage": 3, "zero_quantized_weights": true, "zero_hpz_partition_size": 8,
          "zero_quantized_gradients": true})";
  Hardware hw = Big(8);
  hw.nodes = 2;
  const EstimateInput a = Input(plain, 16), b = Input(zeropp, 16);
  Result<MemoryEstimate> ma = EstimateMemory(a), mb = EstimateMemory(b);
  ASSERT_TRUE(ma.ok() && mb.ok());
  const TimeEstimate ta = EstimateTime(a, *ma, hw), tb = EstimateTime(b, *mb, hw);
  const double N = static_cast<double>(ma->padded_elems), W = 16, q = 1 + 4.0 / 2048;
  // Plain: two bf16 gathers and one fp32 reduce-scatter per micro-batch, all across nodes.
  EXPECT_NEAR(static_cast<double>(ta.collective_inter_bytes), 2 * (2 * 2 * N + 4 * N) * 15 / W,
              2.0);
  EXPECT_EQ(ta.collective_inter_bytes, ta.collective_bytes);
  // ZeRO++: the int8 forward gather across nodes, and one int8 part per other node.
  EXPECT_NEAR(static_cast<double>(tb.collective_inter_bytes), 2 * (q * N * 15 / W + q * N / W),
              2.0);
  EXPECT_LT(static_cast<double>(tb.collective_inter_bytes),
            0.3 * static_cast<double>(ta.collective_inter_bytes));
  EXPECT_LT(tb.collective_s, ta.collective_s);
  // One node: nothing crosses, and hpZ has nothing to do.
  const TimeEstimate one = EstimateTime(b, *mb, Big(16));
  EXPECT_EQ(one.collective_inter_bytes, 0u);
}

TEST(TimeModelTest, TensorParallelismSplitsTheModelAndKeepsItsAllReducesInTheNode) {
  // 2 nodes x 8 GPUs, stage 3, bf16: TP 8 within each node and ZeRO over the 2 data-parallel
  // ranks, against ZeRO-3 over all 16.
  Hardware hw = Big(8);
  hw.nodes = 2;
  EstimateInput plain = Input(R"({"stage": 3})", 16);
  EstimateInput tp = Input(R"({"stage": 3})", 16, R"("tensor_parallel": {"autotp_size": 8}, )");
  for (EstimateInput* in : {&plain, &tp}) {  // eight heads of 32, each with its own KV head
    in->model.num_attention_heads = 8;
    in->model.num_key_value_heads = 8;
  }
  Result<MemoryEstimate> mp = EstimateMemory(plain), mt = EstimateMemory(tp);
  ASSERT_TRUE(mp.ok() && mt.ok()) << mt.status().ToString();
  EXPECT_EQ(mt->tensor_parallel, 8);
  EXPECT_EQ(mt->data_parallel, 2);
  EXPECT_EQ(mp->data_parallel, 16);
  // A rank holds an eighth of every split matrix and the whole norms.
  const model::LlamaConfig part = *model::LlamaTensorParallelConfig(tp.model, 8);
  EXPECT_EQ(mt->parameters, static_cast<uint64_t>(part.ParameterCount()));
  EXPECT_EQ(mt->parameters * 8, mp->parameters + 7 * (2 * 4 + 1) * 256);
  EXPECT_LT(mt->activations, mp->activations);
  const TimeEstimate a = EstimateTime(plain, *mp, hw), b = EstimateTime(tp, *mt, hw);
  // Per micro-batch and block 4 all-reduces and 1 for the recomputed attention, plus the
  // embedding's and the head's, of 2 x 128 tokens x 256 fp32 each: a ring of 8.
  const double ar = 2.0 * 7.0 / 8.0 * 4.0 * 2 * 128 * 256;
  EXPECT_NEAR(static_cast<double>(b.tensor_parallel_bytes), 2 * (5 * 4 + 2) * ar, 2.0);
  EXPECT_DOUBLE_EQ(b.tensor_parallel_s, static_cast<double>(b.tensor_parallel_bytes) / hw.nvlink);
  // ZeRO's rings span 2 ranks (one per node), over an eighth of the model: far fewer bytes
  // cross the nodes, and none of tensor parallelism's.
  const double Np = static_cast<double>(mt->padded_elems);
  EXPECT_NEAR(static_cast<double>(b.collective_inter_bytes), 2 * (2 * 2 * Np + 4 * Np) / 2, 2.0);
  EXPECT_LT(static_cast<double>(b.collective_inter_bytes),
            0.2 * static_cast<double>(a.collective_inter_bytes));
  EXPECT_EQ(b.collective_bytes, b.collective_inter_bytes + b.tensor_parallel_bytes);
  // Each rank computes an eighth of the FLOPs on the same tokens.
  EXPECT_NEAR(b.model_flops * 8, a.model_flops, 1e-9 * a.model_flops);
  EXPECT_DOUBLE_EQ(b.tokens_per_s, 2.0 * 128 * 2 * 2 / b.step_s);
  // A degree that does not divide the ranks, or the model, is refused.
  EXPECT_FALSE(EstimateMemory(Input(R"({"stage": 3})", 12, R"("tensor_parallel": {"autotp_size": 8}, )")).ok());
  Result<MemoryEstimate> uneven =
      EstimateMemory(Input(R"({"stage": 3})", 24, R"("tensor_parallel": {"autotp_size": 3}, )"));
  ASSERT_FALSE(uneven.ok());
  EXPECT_THAT(std::string(uneven.status().message()), HasSubstr("num_attention_heads = 4"));
}

TEST(TimeModelTest, SingleRankStage0HasNoCollectivesAndADeviceOptimizer) {
  const EstimateInput in = Input(R"({"stage": 0})");
  Result<MemoryEstimate> m = EstimateMemory(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const TimeEstimate t = EstimateTime(in, *m, Big(1));
  EXPECT_EQ(t.collective_bytes, 0u);
  EXPECT_EQ(t.h2d_bytes + t.d2h_bytes + t.nvme_read_bytes + t.nvme_write_bytes, 0u);
  EXPECT_FALSE(t.cpu_optimizer);
  EXPECT_EQ(t.bound_by, "compute");
  EXPECT_EQ(t.optimizer_s, 0.0);
  EXPECT_GT(t.device_optimizer_s, 0.0);
  EXPECT_DOUBLE_EQ(t.step_s, t.compute_s + t.device_optimizer_s);
}

// offload_optimizer.ratio: the offloaded share's bytes cross PCIe and NVMe and its update runs on
// the CPU, beside the device's update of the rest.
TEST(TimeModelTest, PartialOffloadSplitsTheOptimizer) {
  const EstimateInput all = Input(
      R"({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}})", 2);
  const EstimateInput half = Input(
      R"({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "ratio": 0.5}})",
      2);
  Result<MemoryEstimate> ma = EstimateMemory(all);
  Result<MemoryEstimate> mh = EstimateMemory(half);
  ASSERT_TRUE(ma.ok() && mh.ok());
  const Hardware hw = Big(2);
  const TimeEstimate ta = EstimateTime(all, *ma, hw);
  const TimeEstimate th = EstimateTime(half, *mh, hw);
  EXPECT_EQ(ta.offloaded_fraction, 1.0);
  EXPECT_EQ(ta.device_optimizer_s, 0.0);
  // Whole units: about half, exactly what the engine's plan offloads.
  const double f = th.offloaded_fraction;
  EXPECT_GT(f, 0.3);
  EXPECT_LT(f, 0.7);
  EXPECT_DOUBLE_EQ(f, static_cast<double>(mh->engine.offloaded_optim_elems) /
                          static_cast<double>(mh->engine.shard_elems));
  EXPECT_NEAR(static_cast<double>(th.nvme_write_bytes), f * static_cast<double>(ta.nvme_write_bytes), 2);
  EXPECT_NEAR(static_cast<double>(th.d2h_bytes), f * static_cast<double>(ta.d2h_bytes), 2);
  EXPECT_DOUBLE_EQ(th.optimizer_s, f * ta.optimizer_s);
  EXPECT_GT(th.device_optimizer_s, 0.0);
  EXPECT_LT(th.step_s, ta.step_s);  // on an H100 node the device's update is far cheaper
  EXPECT_EQ(mh->engine.nvme_optim_file, mh->engine.offloaded_optim_elems * 12);
}

// Parameters on NVMe with the optimizer on the device: the updated shards' writes home are on the
// step's critical path (they follow the update), and the device's updated shards cross PCIe.
TEST(TimeModelTest, NvmeParameterWritesCountWithTheDeviceOptimizer) {
  const EstimateInput in = Input(
      R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}})", 2);
  Result<MemoryEstimate> m = EstimateMemory(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Hardware hw = Big(2);
  hw.nvme_write = 1e6;  // slow enough to dominate
  const TimeEstimate t = EstimateTime(in, *m, hw);
  EXPECT_FALSE(t.cpu_optimizer);
  EXPECT_GT(t.nvme_write_s, 0.0);
  EXPECT_GE(t.step_s, t.nvme_write_s);
  EXPECT_EQ(t.bottleneck, "NVMe");
  EXPECT_GE(t.d2h_bytes, static_cast<uint64_t>(2 * m->shard_elems));  // bf16 shards home
}

// strata.freeze: frozen units' gradients are neither reduced nor applied.
TEST(TimeModelTest, FrozenUnitsNeedNoReductionNorUpdate) {
  const std::string zero = R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  const EstimateInput all = Input(zero, 2);
  const EstimateInput frozen = Input(
      zero, 2, R"("strata": {"freeze": ["model.embed_tokens.*", "model.layers.*"]}, )");
  Result<MemoryEstimate> ma = EstimateMemory(all);
  Result<MemoryEstimate> mf = EstimateMemory(frozen);
  ASSERT_TRUE(ma.ok() && mf.ok()) << mf.status().ToString();
  const Hardware hw = Big(2);
  const TimeEstimate ta = EstimateTime(all, *ma, hw);
  const TimeEstimate tf = EstimateTime(frozen, *mf, hw);
  const double T = tf.trainable_fraction;
  EXPECT_EQ(ta.trainable_fraction, 1.0);
  EXPECT_GT(T, 0.0);
  EXPECT_LT(T, 0.5);  // the head (norm + LM head) of a small model
  EXPECT_DOUBLE_EQ(T, static_cast<double>(mf->engine.trainable_elems) /
                          static_cast<double>(mf->engine.shard_elems));
  EXPECT_NEAR(static_cast<double>(tf.optimizer_params), T * static_cast<double>(ta.optimizer_params), 1);
  EXPECT_NEAR(static_cast<double>(tf.collective_bytes), T * static_cast<double>(ta.collective_bytes),
              static_cast<double>(ta.collective_bytes) * 1e-9 + 2);
  EXPECT_NEAR(static_cast<double>(tf.d2h_bytes), T * static_cast<double>(ta.d2h_bytes), 2);
  EXPECT_LT(tf.optimizer_s, ta.optimizer_s);
  EXPECT_LT(mf->engine.pinned_pool, ma->engine.pinned_pool);
}

// NVMe-homed parameters of a model of few units: the pool never plans more host copies than
// every shard plus two in flight, a set strata.memory.host_budget is what it plans instead, and
// the time model fetches shards every micro-batch only when the host tier cannot keep them all
// (on the CPU device, whose device copies are host copies), and never fetches frozen shards again.
TEST(TimeModelTest, NvmeParameterBudgetsAndFetches) {
  const std::string zero =
      R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"},
          "offload_optimizer": {"device": "cpu"}})";
  auto cpu = [](EstimateInput in) {
    in.device = device::DeviceType::kCpu;
    in.model.hidden_size = 1024;  // layers of 25 MB in bf16: pools above the 16 MiB minimum
    in.model.intermediate_size = 2816;
    in.model.num_attention_heads = 8;
    return in;
  };
  const EstimateInput kept = cpu(Input(zero, 1));
  Result<MemoryEstimate> mk = EstimateMemory(kept);
  ASSERT_TRUE(mk.ok()) << mk.status().ToString();
  const double S = static_cast<double>(mk->shard_elems);
  const double all = 2 * S, largest = 2 * static_cast<double>(mk->max_shard_elems);
  // The parameters' host tier is at most every shard plus two (size classes add at most 1/8 to
  // each); the pool adds the CPU optimizer's gradient shards, landing buffer and states.
  Result<MemoryEstimate> no_optim = EstimateMemory(cpu(Input(
      R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}})", 1)));
  ASSERT_TRUE(no_optim.ok()) << no_optim.status().ToString();
  EXPECT_LE(static_cast<double>(no_optim->engine.pinned_pool),
            1.25 * 1.125 * (all + 2 * largest) + (4 << 20) + 1);
  // Every shard cached: the CPU optimizer's updated shards are read again, once a step.
  const Hardware hw = Big(1);
  EXPECT_DOUBLE_EQ(static_cast<double>(EstimateTime(kept, *mk, hw).nvme_read_bytes), all);
  // The device optimizer updates the cached copies in place: nothing is read again.
  EXPECT_EQ(EstimateTime(cpu(Input(R"({"stage": 3, "offload_param": {"device": "nvme",
                                        "nvme_path": "/tmp/x"}})", 1)),
                         *no_optim, hw).nvme_read_bytes,
            0u);

  // A host budget of two and a half layer shards: a smaller pool, and every shard read for
  // forward and again for backward of each of the 2 micro-batches.
  const uint64_t budget = static_cast<uint64_t>(2.5 * largest);
  const std::string memory =
      R"("strata": {"memory": {"host_budget": )" + std::to_string(budget) + "}}, ";
  const EstimateInput streamed = cpu(Input(zero, 1, memory));
  Result<MemoryEstimate> ms = EstimateMemory(streamed);
  ASSERT_TRUE(ms.ok()) << ms.status().ToString();
  EXPECT_LT(ms->engine.pinned_pool, mk->engine.pinned_pool);
  EXPECT_EQ(no_optim->engine.pinned_pool - mk->engine.pinned_pool + ms->engine.pinned_pool,
            EstimateMemory(cpu(Input(R"({"stage": 3, "offload_param": {"device": "nvme",
                                         "nvme_path": "/tmp/x"}})", 1, memory)))
                    ->engine.pinned_pool);
  EXPECT_DOUBLE_EQ(static_cast<double>(EstimateTime(streamed, *ms, hw).nvme_read_bytes),
                   2 * 2 * all);

  // LoRA with the shards kept: only the (trained, CPU-updated) adapter shards are read again.
  const EstimateInput lora = cpu(Input(zero, 1, R"("strata": {"lora": {"r": 8}}, )"));
  Result<MemoryEstimate> ml = EstimateMemory(lora);
  ASSERT_TRUE(ml.ok()) << ml.status().ToString();
  const TimeEstimate tl = EstimateTime(lora, *ml, hw);
  EXPECT_LT(tl.trainable_fraction, 0.1);
  EXPECT_NEAR(static_cast<double>(tl.nvme_read_bytes),
              2 * static_cast<double>(ml->engine.trainable_elems), 2);
}

// The CPU optimizer overlaps backward unless an update waits for the global norm.
TEST(TimeModelTest, ClippingExposesTheWholeOptimizer) {
  const std::string zero = R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})";
  const EstimateInput overlapped = Input(zero);
  const EstimateInput clipped = Input(zero, 1, R"("gradient_clipping": 1.0, )");
  Result<MemoryEstimate> m = EstimateMemory(overlapped);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Hardware hw = Big(1);
  hw.cpu_adam = 1e6;  // slow enough to matter
  // The overlap decision is the engine's, from the run's own memory plan.
  Result<MemoryEstimate> mc = EstimateMemory(clipped);
  ASSERT_TRUE(mc.ok()) << mc.status().ToString();
  EXPECT_TRUE(m->engine.optimizer_overlapped);
  EXPECT_FALSE(mc->engine.optimizer_overlapped);
  const TimeEstimate a = EstimateTime(overlapped, *m, hw);
  const TimeEstimate b = EstimateTime(clipped, *mc, hw);
  EXPECT_TRUE(a.optimizer_overlapped);
  EXPECT_FALSE(b.optimizer_overlapped);
  EXPECT_DOUBLE_EQ(b.exposed_optimizer_s, b.optimizer_s);
  EXPECT_LT(a.exposed_optimizer_s, b.exposed_optimizer_s);
  EXPECT_EQ(a.bottleneck, "CPU optimizer");
  // Stage 1 reduces at the step's end: its updates cannot overlap backward.
  const EstimateInput s1 = Input(R"({"stage": 1, "offload_optimizer": {"device": "cpu"}})");
  Result<MemoryEstimate> m1 = EstimateMemory(s1);
  ASSERT_TRUE(m1.ok()) << m1.status().ToString();
  const TimeEstimate c = EstimateTime(s1, *m1, hw);
  EXPECT_FALSE(c.optimizer_overlapped);
  EXPECT_DOUBLE_EQ(c.exposed_optimizer_s, c.optimizer_s);
  // The updated parameters' upload follows the last update.
  EXPECT_GT(c.h2d_bytes, 0u);
  EXPECT_GE(c.after_step_s, c.h2d_s);
}

// With a reduction bucket (stages 2-3, several ranks) a unit's gradient reaches the overlapped
// optimizer when its bucket is reduced; the last bucket at the end of backward. The engine caps
// the bucket at a quarter of the shard when the CPU optimizer overlaps backward
// (zero::ReduceBucketCapacity), so DeepSpeed's default 5e8 no longer holds a small model whole.
TEST(TimeModelTest, TheLastReductionBucketWaitsForTheEndOfBackward) {
  auto memory = [](const std::string& bucket) {
    const EstimateInput in = Input(
        R"({"stage": 2, "offload_optimizer": {"device": "cpu"})" + bucket + "}", 2);
    Result<MemoryEstimate> m = EstimateMemory(in);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return std::pair{in, *m};
  };
  Hardware hw = Big(2);
  hw.cpu_adam = 1e6;  // slow enough to matter
  hw.gpu_tflops = 1;  // and backward long enough to hide much of it
  const auto [in, capped] = memory("");
  const uint64_t trainable = capped.engine.trainable_elems;
  EXPECT_GT(capped.engine.last_bucket_elems, 0u);
  EXPECT_LE(capped.engine.last_bucket_elems, trainable / 4);
  const TimeEstimate t = EstimateTime(in, capped, hw);
  EXPECT_TRUE(t.optimizer_overlapped);
  EXPECT_GE(t.exposed_optimizer_s,
            t.optimizer_s * static_cast<double>(capped.engine.last_bucket_elems) /
                    static_cast<double>(trainable) -
                1e-12);
  // A shard reduced whole at the end of backward (what an uncapped bucket would do): nothing
  // overlaps.
  MemoryEstimate whole = capped;
  whole.engine.last_bucket_elems = trainable;
  const TimeEstimate w = EstimateTime(in, whole, hw);
  EXPECT_DOUBLE_EQ(w.exposed_optimizer_s, w.optimizer_s);
  EXPECT_LT(t.exposed_optimizer_s, w.exposed_optimizer_s);
  // No unit fits a one-element bucket: no bucket, each update starts when its unit is reduced.
  const auto [in1, none] = memory(R"(, "reduce_bucket_size": 1)");
  EXPECT_EQ(none.engine.last_bucket_elems, 0u);
  EXPECT_LE(EstimateTime(in1, none, hw).exposed_optimizer_s, t.exposed_optimizer_s);
}

// On shared cores (the CPU device) nothing overlaps: the step is the sum of its parts.
TEST(TimeModelTest, SharedCoresAddUp) {
  EstimateInput in = Input(
      R"({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}})", 2);
  in.device = device::DeviceType::kCpu;
  Result<MemoryEstimate> m = EstimateMemory(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Hardware hw = Big(2);
  const TimeEstimate overlapped = EstimateTime(in, *m, hw);
  hw.shared_cores = true;
  const TimeEstimate t = EstimateTime(in, *m, hw);
  EXPECT_TRUE(t.shared_cores);
  EXPECT_DOUBLE_EQ(t.forward_backward_s, t.compute_s + t.collective_s);  // no NVMe in forward
  EXPECT_DOUBLE_EQ(t.exposed_optimizer_s, t.optimizer_s + t.nvme_read_s + t.nvme_write_s);
  EXPECT_GT(t.step_s, overlapped.step_s);
  EXPECT_EQ(t.h2d_bytes + t.d2h_bytes, 0u);  // the CPU device's memory is host memory
}

// Hardware::io_cpu_share: the share of an NVMe transfer's time that takes the shared cores; the
// rest is the drive's and runs beside compute (the overlapped optimizer's transfers beside
// backward, less at least the last unit's share).
TEST(TimeModelTest, SharedCoresOverlapTheDrivesShareOfNvmeTime) {
  EstimateInput in = Input(
      R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"},
          "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}})",
      1);
  in.device = device::DeviceType::kCpu;
  Result<MemoryEstimate> m = EstimateMemory(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Hardware hw = Big(1);
  hw.shared_cores = true;
  hw.nvme_read = 2e9;  // a drive slow enough to matter beside compute
  hw.nvme_write = 2e9;
  auto at = [&](double share) {
    Hardware h = hw;
    h.io_cpu_share = share;
    return EstimateTime(in, *m, h);
  };
  const TimeEstimate all = at(1.0), none = at(0.0), half = at(0.5);
  ASSERT_TRUE(all.optimizer_overlapped);
  EXPECT_DOUBLE_EQ(all.io_cpu_share, 1.0);
  // Share 1 adds every part (as SharedCoresAddUp), which gives the two NVMe times: the fetches'
  // in forward and backward (one rank: no collectives, and no PCIe on the CPU device), and the
  // optimizer's after it.
  ASSERT_EQ(all.collective_s, 0.0);
  const double fetch = all.forward_backward_s - all.compute_s;
  const double states = all.exposed_optimizer_s - all.optimizer_s - all.device_optimizer_s;
  ASSERT_GT(fetch, 0.0);
  ASSERT_GT(states, 0.0);
  EXPECT_NEAR(fetch + states, all.nvme_read_s + all.nvme_write_s, 1e-12);
  // The last of Input's 2 micro-batches' backward.
  const double backward = all.compute_s / 2 * (m->checkpointing ? 0.75 : 2.0 / 3.0);
  const double left = std::max(states - backward, states / m->units);
  for (const auto& [share, t] : {std::pair{0.0, none}, std::pair{0.5, half}}) {
    SCOPED_TRACE(share);
    EXPECT_NEAR(t.forward_backward_s,
                t.compute_s + share * fetch + std::max(0.0, (1 - share) * fetch - t.compute_s),
                1e-12);
    EXPECT_NEAR(t.exposed_optimizer_s,
                t.optimizer_s + t.device_optimizer_s + share * states + (1 - share) * left, 1e-12);
    // The bytes and the drive's own times do not change.
    EXPECT_EQ(t.nvme_read_bytes, all.nvme_read_bytes);
    EXPECT_DOUBLE_EQ(t.nvme_write_s, all.nvme_write_s);
  }
  EXPECT_LT(none.step_s, half.step_s);
  EXPECT_LT(half.step_s, all.step_s);
}

TEST(FitTest, EachTierAgainstItsCapacity) {
  const EstimateInput in =
      Input(R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"},
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}})", 4);
  Result<MemoryEstimate> m = EstimateMemory(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  Hardware hw = Big(4);
  FitCheck f = CheckFit(in, *m, hw);
  EXPECT_TRUE(f.fits());
  EXPECT_EQ(f.Overflow(), "");
  EXPECT_EQ(f.device_need, m->device_peak());
  EXPECT_EQ(f.nvme_need, 4 * (m->engine.nvme_param_file + m->engine.nvme_optim_file));
  EXPECT_EQ(f.host_need, 4 * (m->engine.pinned_pool + m->setup_host_bytes()));
  hw.nvme = f.nvme_need - 1;
  hw.cpu_mem = 1;
  f = CheckFit(in, *m, hw);
  EXPECT_FALSE(f.fits());
  EXPECT_THAT(f.Overflow(), HasSubstr("NVMe"));
  EXPECT_THAT(f.Overflow(), HasSubstr("host memory"));
  EXPECT_THAT(f.Overflow(), ::testing::Not(HasSubstr("device")));
}

TEST(ConfigAutoTest, AutoHomesParseAndResolve) {
  Config c = Parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                       "offload_optimizer": {"device": "auto", "nvme_path": "/tmp/n"}}})");
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kAuto);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kAuto);
  EXPECT_TRUE(HasAutoOffload(c));
  EXPECT_EQ(Parse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "aUto"}}})")
                .zero.offload_param.device,
            OffloadDevice::kAuto);
  EXPECT_FALSE(CanUseNvme(c, /*param=*/true));
  EXPECT_TRUE(CanUseNvme(c, /*param=*/false));
  EXPECT_TRUE(c.strata.io.nvme_paths.empty());
  // The engine will not plan or build an unresolved config.
  const std::vector<zero::UnitSpec> units = {{"u", {{"w", {4096}}}}};
  Result<zero::EngineMemoryPlan> p = zero::Engine::PlanMemory(units, {{}}, c, 1);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("\"auto\""));
  // NVMe for the parameters has no directory; for the optimizer it has.
  Config bad = c;
  Status s = ResolveOffloadDevices(&bad, OffloadDevice::kNvme, OffloadDevice::kCpu);
  EXPECT_THAT(std::string(s.message()), HasSubstr("offload_param.device"));
  ASSERT_TRUE(ResolveOffloadDevices(&c, OffloadDevice::kCpu, OffloadDevice::kNvme).ok());
  EXPECT_EQ(c.strata.io.nvme_paths, std::vector<std::string>{"/tmp/n"});
  EXPECT_FALSE(HasAutoOffload(c));
  // A home the config fixes is not the planner's to change.
  s = ResolveOffloadDevices(&c, OffloadDevice::kNone, OffloadDevice::kNvme);
  EXPECT_THAT(std::string(s.message()), HasSubstr("only \"auto\""));
  // Where only one home is possible, "auto" is it.
  Config s0 = Parse(R"({"zero_optimization": {"stage": 0, "offload_param": {"device": "auto"},
                        "offload_optimizer": {"device": "auto"}}})");
  EXPECT_FALSE(HasAutoOffload(s0));
  EXPECT_EQ(s0.zero.offload_optimizer.device, OffloadDevice::kNone);
  // The error for a bad value lists "auto" among the homes.
  Result<Config> typo =
      ParseConfig(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "ram"}}})", "t");
  ASSERT_FALSE(typo.ok());
  EXPECT_THAT(std::string(typo.status().message()), HasSubstr("auto"));
}

const char* kAuto = R"({"stage": 3, "offload_param": {"device": "auto", "nvme_path": "/tmp/p"},
                        "offload_optimizer": {"device": "auto", "nvme_path": "/tmp/p"}})";

// strata.activation_checkpointing "auto": every block's internals kept (no recomputation, a
// quarter less compute) when the device peak with them fits the rank's budget, checkpointed when
// only that fits; "on" and "off" as given, whatever the budget.
TEST(PlannerTest, ActivationCheckpointingFollowsTheDeviceBudget) {
  const char* zero = R"({"stage": 3})";
  EstimateInput in = Input(zero, 1);
  Hardware hw = Big(1);
  Result<PlanCandidate> roomy =
      EstimatePlacement(in, hw, OffloadDevice::kNone, OffloadDevice::kNone, 1.0);
  ASSERT_TRUE(roomy.ok()) << roomy.status().ToString();
  const MemoryEstimate& kept = roomy->memory;
  EXPECT_FALSE(kept.checkpointing);
  EXPECT_EQ(kept.activations, kept.activations_kept);
  EXPECT_GT(kept.activations_kept, kept.activations_checkpointed);
  // The compute without recomputation is the model's own FLOPs.
  EXPECT_DOUBLE_EQ(roomy->time.exec_flops, roomy->time.model_flops);

  // A budget one byte short of the kept peak: checkpointed, and it fits.
  hw.device_budget = kept.device_peak() - 1;
  Result<PlanCandidate> tight = EstimatePlacement(in, hw, OffloadDevice::kNone, OffloadDevice::kNone, 1.0);
  ASSERT_TRUE(tight.ok());
  EXPECT_TRUE(tight->memory.checkpointing);
  EXPECT_EQ(tight->memory.activations, kept.activations_checkpointed);
  EXPECT_EQ(tight->memory.device_peak(),
            kept.device_peak() - kept.activations_kept + kept.activations_checkpointed);
  EXPECT_TRUE(tight->fit.fits());
  // Recomputing every block's forward but the last: (L - 1) / L of the blocks' forward FLOPs more.
  EXPECT_GT(tight->time.exec_flops, roomy->time.exec_flops * 1.1);
  EXPECT_GT(tight->time.compute_s, roomy->time.compute_s);
  // At exactly the kept peak, kept.
  hw.device_budget = kept.device_peak();
  EXPECT_FALSE(EstimatePlacement(in, hw, OffloadDevice::kNone, OffloadDevice::kNone, 1.0)
                   ->memory.checkpointing);

  // Fixed by the config, whatever the budget (on: checkpointed with room to spare; off: kept, and
  // then it does not fit).
  in = Input(zero, 1, R"("strata": {"activation_checkpointing": true}, )");
  EXPECT_TRUE(EstimatePlacement(in, Big(1), OffloadDevice::kNone, OffloadDevice::kNone, 1.0)
                  ->memory.checkpointing);
  in = Input(zero, 1, R"("strata": {"activation_checkpointing": "off"}, )");
  hw.device_budget = kept.device_peak() - 1;
  Result<PlanCandidate> forced = EstimatePlacement(in, hw, OffloadDevice::kNone, OffloadDevice::kNone, 1.0);
  ASSERT_TRUE(forced.ok());
  EXPECT_FALSE(forced->memory.checkpointing);
  EXPECT_FALSE(forced->fit.fits());
  // Without a budget (EstimateMemory on its own), "auto" checkpoints.
  in = Input(zero, 1);
  Result<MemoryEstimate> alone = EstimateMemory(in);
  ASSERT_TRUE(alone.ok());
  EXPECT_TRUE(alone->checkpointing);
}

TEST(PlannerTest, ChoosesTheFastestPlacementThatFits) {
  // Checkpointing fixed on: the budgets below are set between placements' peaks with it.
  const EstimateInput in = Input(kAuto, 2, R"("strata": {"activation_checkpointing": true}, )");
  // Room everywhere: nothing offloaded (nothing is faster than the device).
  Result<PlacementPlan> p = PlanPlacement(in, Big(2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  // 3 x 3 whole homes, and partial offloads of the optimizer (ratios that give distinct units).
  auto whole = [](const PlacementPlan& plan) {
    return std::count_if(plan.candidates.begin(), plan.candidates.end(),
                         [](const PlanCandidate& c) { return c.ratio == 1.0; });
  };
  EXPECT_EQ(whole(*p), 9);
  EXPECT_GT(p->candidates.size(), 9u);
  EXPECT_EQ(p->best().param, OffloadDevice::kNone);
  EXPECT_EQ(p->best().optimizer, OffloadDevice::kNone);
  EXPECT_THAT(p->reasons.front(), HasSubstr("chosen: parameters on none, optimizer on none"));
  // The choice, why not each of the 8 other whole homes, and one line for the fastest partial
  // offload of each (parameters, optimizer) pair: 6 of them.
  ASSERT_EQ(p->reasons.size(), 15u);

  // A device budget that holds the offloaded placements but not the optimizer states.
  uint64_t none_peak = 0, offloaded_peak = 0;
  for (const auto& c : p->candidates) {
    if (c.param == OffloadDevice::kNone && c.optimizer == OffloadDevice::kNone) {
      none_peak = c.memory.device_peak();
    }
    if (c.param == OffloadDevice::kNone && c.optimizer == OffloadDevice::kCpu) {
      offloaded_peak = c.memory.device_peak();
    }
  }
  ASSERT_LT(offloaded_peak, none_peak);
  Hardware hw = Big(2);
  hw.device_budget = (none_peak + offloaded_peak) / 2;
  p = PlanPlacement(in, hw);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->best().optimizer, OffloadDevice::kCpu);  // host memory beats NVMe
  EXPECT_TRUE(p->best().fit.fits());
  bool told = false;
  for (const auto& r : p->reasons) told = told || r.find("does not fit (device") != std::string::npos;
  EXPECT_TRUE(told);

  // Host memory too small for all the states on the CPU, whatever the parameters' home: NVMe,
  // or a share of them on the CPU with the rest on the device.
  uint64_t cpu_host = ~uint64_t{0};
  for (const auto& c : p->candidates) {
    if (c.optimizer == OffloadDevice::kCpu && c.ratio == 1.0) {
      cpu_host = std::min(cpu_host, c.fit.host_need);
    }
  }
  hw.cpu_mem = static_cast<uint64_t>(static_cast<double>(cpu_host) / hw.host_fraction) - 4096;
  p = PlanPlacement(in, hw);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->best().optimizer == OffloadDevice::kNvme || p->best().ratio < 1.0)
      << p->reasons.front();
  EXPECT_TRUE(p->best().fit.fits());

  // Without a disk, the host memory of the smallest partial offload minus a page: one error
  // naming every candidate's overflow.
  uint64_t least_host = ~uint64_t{0};
  for (const auto& c : p->candidates) least_host = std::min(least_host, c.fit.host_need);
  hw.cpu_mem = static_cast<uint64_t>(static_cast<double>(least_host) / hw.host_fraction) - 4096;
  hw.nvme = 0;
  p = PlanPlacement(in, hw);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("no placement fits"));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("parameters on nvme, optimizer on nvme: "));
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("NVMe: "));
}

TEST(PlannerTest, NvmeOnlyWithADirectoryAndFixedHomesStay) {
  EstimateInput in = Input(R"({"stage": 3, "offload_param": {"device": "cpu"},
                               "offload_optimizer": {"device": "auto"}})");
  Result<PlacementPlan> p = PlanPlacement(in, Big(1));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  // none, cpu and cpu with partial offload: no directory for NVMe.
  for (const auto& c : p->candidates) {
    EXPECT_EQ(c.param, OffloadDevice::kCpu);
    EXPECT_NE(c.optimizer, OffloadDevice::kNvme);
    EXPECT_TRUE(c.ratio == 1.0 || c.optimizer == OffloadDevice::kCpu);
  }
  EXPECT_GT(p->candidates.size(), 2u);
  // Without "auto": the config's one placement.
  in = Input(R"({"stage": 2})");
  p = PlanPlacement(in, Big(1));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->candidates.size(), 1u);
  EXPECT_THAT(p->reasons.front(), HasSubstr("the config fixes both homes"));
}

}  // namespace
}  // namespace strata::train
