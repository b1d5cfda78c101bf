// The Llama-family decoder as a zero::Model, on the CPU device (the CPU kernels of cpu_ops.h).
//
// Units, in order (their parameters carry Hugging Face's tensor names):
//   0          "embed"      model.embed_tokens.weight [V, H]
//   1 .. L     "layers.i"   model.layers.i.input_layernorm.weight [H],
//                           model.layers.i.self_attn.{q,k,v,o}_proj.weight,
//                           model.layers.i.post_attention_layernorm.weight [H],
//                           model.layers.i.mlp.{gate,up,down}_proj.weight
//   L + 1      "head"       model.norm.weight [H], lm_head.weight [V, H]
// With LoRA adapters (LlamaModelOptions::lora) each block i is preceded by its adapter unit
// "lora.i" (model.layers.i.<module>.<proj>.lora_A.weight [r, in] and .lora_B.weight [out, r] for
// each targeted projection); the block reads it as a shared unit (below), so the engine gathers,
// reduces and updates the adapters as units of their own, and the base units can be frozen.
// With tie_word_embeddings the head has only model.norm.weight and reads the embedding matrix
// as its LM head (zero::Model::SharedUnits): the engine gathers the embedding unit for the head
// too and sums both gradients into it. Checkpoints then hold no lm_head.weight, as Hugging Face's.
// Activation checkpointing (the default; LlamaModelOptions::keep_activations turns it off): each
// block keeps only its input during forward and recomputes its internals in backward (a block's
// internals are ~10x its input). The last block's internals are still there when backward
// starts, so it alone is not recomputed. Either way the arithmetic is the same, bit for bit.
//
// Devices: the same code runs on the CPU device (cpu_ops.h, inside HostTasks on the caller's
// stream) and on the CUDA device (cuda_ops.h: cuBLAS GEMMs on the tensor cores for bf16/fp16
// weights, fp32 accumulation; enqueued on the model's own stream, ordered against the caller's
// stream by events). Every activation, checkpointed block input, gradient temporary and op
// workspace lives in device memory, allocated once by Create under the device's budget
// (activation_bytes() + workspace_bytes()); a step allocates nothing. Tokens go up through a
// registered (pinned) staging buffer; the loss comes back once per micro-batch (EndMicroBatch),
// through the same buffer, and nothing else is read back.
//
// A micro-batch is a LlamaBatch of `micro_batch` sequences of seq_len + 1 tokens: inputs are the
// first seq_len, targets the last seq_len (targets < 0 are ignored). The loss is the mean
// cross-entropy over the micro-batch's (non-ignored) targets. A bad token or target is an
// InvalidArgument error naming it (on CUDA, reported by EndMicroBatch).
//
// Device memory per micro-batch of T = micro_batch * seq_len tokens (fp32): (L + 14) T H for the
// block inputs and a block's internals and gradients, 4 T kv, 5 T I for the MLP, T V for the
// logits (their gradient reuses them), plus the attention's log-sum-exp; without checkpointing
// each block's internals (5 T H + 2 T kv + 3 T I + 2 T + the log-sum-exp) L times, not once;
// with offload_checkpoints three block inputs instead of L + 1, the others in registered host
// memory (LlamaActivationBytes gives the exact figure; docs/model.md the table). No [seq, seq] score matrix lives in device
// memory; the CPU ops keep one row's worth per call (host scratch of up to 8 seq^2 bytes).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "model/op_time.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "zero/model.h"

namespace strata::model {

struct LlamaBatch : zero::Batch {
  std::vector<int32_t> tokens;  // micro_batch * (seq_len + 1)
  // Prepared data (train/packing.h), one entry per input token (micro_batch * seq_len); empty:
  // the targets are the next tokens, positions run 0..seq_len-1 in every sequence, and attention
  // is causal over the whole sequence.
  std::vector<int32_t> targets;  // kIgnoreIndex (-100): not trained
  // Packed documents: each token's position within its document, and the index (within its
  // sequence) of its document's first token: attention sees keys [key_start, i] only. Key
  // starts do not decrease along a sequence.
  std::vector<int32_t> positions, key_start;
  // The micro-batch's loss and gradient are scaled by this: the trainer makes the step's loss
  // the mean over the trained tokens of the whole global batch (train/packing.h LossWeights).
  double loss_weight = 1.0;
};

class LlamaOps;
struct Act;  // llama_ops.h
struct CAct;

// The seven projections of a decoder block, in their order in a unit (and in an adapter unit).
inline constexpr int kLlamaProjections = 7;
// "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj".
std::string_view LlamaProjectionName(int projection);

// LoRA adapters as the model runs them (strata.lora, validated): each targeted projection
// W [out, in] of every block gains A [r, in] and B [out, r], and computes
// y = x W^T + scale * (x A^T) B^T with scale = lora_alpha / r (PEFT's LoRA, dropout 0).
struct LlamaLora {
  int rank = 0;  // 0: no adapters
  float scale = 0.0f;
  double alpha = 0.0;
  std::array<bool, kLlamaProjections> targets{};
  bool enabled() const { return rank > 0; }
  // The targeted projections' names, in block order.
  std::vector<std::string> target_names() const;
};
// InvalidArgument naming a target module that is not one of the seven projections ("all-linear"
// is all seven; none given: q_proj and v_proj, PEFT's default for Llama).
Result<LlamaLora> ResolveLlamaLora(const LoraSettings& settings);
// True for an adapter's parameter name ("model.layers.3.self_attn.q_proj.lora_A.weight").
bool IsLoraParamName(std::string_view name);
// "base_model.model." + name: PEFT's name for an adapter parameter in adapter_model.safetensors.
std::string PeftAdapterName(std::string_view name);

// Units, in order: the embedding; per layer i, with LoRA its adapter unit "lora.i" and then the
// block "layers.i" (which reads the adapter unit as a shared unit); the head.
// With split blocks (strata.split_blocks; never with LoRA) each block is four units instead:
// "layers.i.attn" (input_layernorm, q, k, v, o), "layers.i.gate" (post_attention_layernorm,
// gate), "layers.i.up" (up) and "layers.i.down" (down). The arithmetic is the same as the whole
// block's, op for op; only what the engine gathers at once changes (a matrix, not a block).
// With activation checkpointing the block's internals are recomputed part by part: its
// attention, gate and up units run their forward again just before its down unit's backward.
struct LlamaUnit {
  enum Kind { kEmbed, kAdapter, kBlock, kHead } kind = kEmbed;
  int layer = -1;  // kAdapter, kBlock
  // kBlock: the whole block, or with split blocks one part of it.
  enum Part { kWhole, kAttn, kMlpGate, kMlpUp, kMlpDown } part = kWhole;
};
LlamaUnit LlamaUnitAt(const LlamaConfig& config, const LlamaLora& lora, int unit,
                      bool split_blocks = false);
// Hugging Face names of unit `unit`'s parameters, in the unit's order.
std::vector<zero::ParamSpec> LlamaUnitParams(const LlamaConfig& config, int unit,
                                             const LlamaLora& lora = {}, bool split_blocks = false);
int LlamaNumUnits(const LlamaConfig& config, const LlamaLora& lora = {}, bool split_blocks = false);
// With split blocks and activation checkpointing: the units whose forward runs again before
// unit `unit`'s backward (zero::Model::RecomputeUnits): the attention, gate and up parts of the
// block whose down part `unit` is, except in the last block, whose internals are still there.
std::vector<int> LlamaRecomputeUnits(const LlamaConfig& config, int unit, bool split_blocks,
                                     bool keep_activations);
// The device memory LlamaModel::Create allocates for activations (without the CUDA workspace),
// with activation checkpointing or, with keep_activations, without.
// With offload_checkpoints (LlamaModelOptions) the device holds three block inputs instead of
// L + 1 (LlamaOffloadedCheckpoints of them live in host memory instead).
// With `vocab_split` (tensor parallelism; `config` the rank's LlamaTensorParallelConfig) the
// cross-entropy's per-token pieces besides.
// `head_chunk_tokens`: LlamaModelOptions::head_chunk_tokens (0: LlamaHeadChunkTokens).
// `activation_dtype`: LlamaModelOptions::activation_dtype (16-bit activations take half the
// bytes; row statistics, the loss and the chunk's logits' fp32 pieces stay fp32).
uint64_t LlamaActivationBytes(const LlamaConfig& config, int64_t seq_len, int64_t micro_batch,
                              const LlamaLora& lora = {}, bool keep_activations = false,
                              bool offload_checkpoints = false, bool vocab_split = false,
                              int64_t head_chunk_tokens = 0,
                              device::DType activation_dtype = device::DType::kF32);
// The activations' dtype of a run on `device` computing in `compute` (the engine's compute dtype,
// zero::ComputeDType): `compute` on a CUDA device, fp32 on the CPU device (its only path).
// STRATA_ACTIVATIONS=fp32 in the environment keeps a CUDA run's activations fp32 (to compare).
// `strata train` and `strata estimate` both take it from here, so the estimate is the run's.
device::DType LlamaActivationDType(device::DeviceType device, device::DType compute);
// The head's logits are computed for this many tokens at a time: all `tokens` when their fp32
// logits [tokens, V] take at most kLlamaLogitsBytes, else as many as fit (at least one). With
// fewer than all, the cross-entropy runs chunk by chunk: each chunk's logits, loss and
// log-sum-exp in forward (the mean loss is the chunks' means weighted by their counted targets),
// and in backward each chunk's logits again (one more head GEMM), its gradient and its share of
// the input's and the LM head's gradients. No [T, V] tensor exists: Llama 3's 128256-word
// vocabulary at 4 x 2048 tokens would take 4 GiB. Tensor parallelism (`vocab_split`) keeps all
// tokens (its logits are already a slice of the vocabulary).
inline constexpr uint64_t kLlamaLogitsBytes = uint64_t{256} << 20;
int64_t LlamaHeadChunkTokens(const LlamaConfig& config, int64_t tokens, bool vocab_split = false);
// Activation checkpoints offloaded to host memory (LlamaModelOptions::offload_checkpoints, with
// checkpointing): the inputs of blocks 0 .. L - 3, as many as this returns (0 for L <= 2 or
// without checkpointing). The last two blocks' inputs stay on the device: backward starts with
// them. LlamaCheckpointHostBytes: the registered host memory that holds them (in the
// activations' dtype).
int64_t LlamaOffloadedCheckpoints(const LlamaConfig& config, bool keep_activations,
                                  bool offload_checkpoints);
uint64_t LlamaCheckpointHostBytes(const LlamaConfig& config, int64_t seq_len, int64_t micro_batch,
                                  bool keep_activations, bool offload_checkpoints,
                                  device::DType activation_dtype = device::DType::kF32);

// Tensor parallelism within a node (tensor_parallel.autotp_size; docs/zero.md "Tensor
// parallelism"), Megatron's layers: q, k, v, gate and up (and their biases) are split by output
// rows, o and down by input columns, the embedding and the LM head by vocabulary rows; the
// attention heads are divided over the ranks, and KV heads too when there are at least as many as
// ranks (otherwise each KV head is replicated on size / num_key_value_heads ranks). Norms, o's and
// down's biases are whole on every rank. Four all-reduces of [T, H] per block and micro-batch
// (the outputs of o and down forward; the inputs' gradients of q/k/v and of gate/up backward),
// one of the embedding's output and of the head's input gradient, and the loss's log-sum-exp in
// pieces of [T] (the logits are never gathered). The group's ranks must run the same batches.
struct LlamaTensorParallel {
  int rank = 0;  // in the group
  int size = 1;
  comm::Collective* group = nullptr;  // the tensor-parallel group (rank and size above)
  bool enabled() const { return size > 1; }
};
// What one of `size` tensor-parallel ranks computes with: `config` with its heads, KV heads (at
// least 1), intermediate size and vocabulary divided by `size`, and head_dim explicit.
// InvalidArgument naming the dimension that does not divide (heads, KV heads, intermediate size,
// vocabulary), and both numbers.
Result<LlamaConfig> LlamaTensorParallelConfig(const LlamaConfig& config, int size);
// Where tensor-parallel rank `rank`'s part of parameter `name` (a Hugging Face or PEFT name of
// the whole model `config`) lies in the whole tensor: dim -1 the whole tensor (replicated),
// 0 rows [begin, begin + count), 1 columns [begin, begin + count) of a matrix.
struct TensorSlice {
  int dim = -1;
  int64_t begin = 0;
  int64_t count = 0;
};
TensorSlice LlamaTensorParallelSlice(const LlamaConfig& config, int rank, int size,
                                     std::string_view name);
// The elements of `whole` (a tensor of `shape`, row-major) that `slice` selects, in the part's
// own row-major order.
std::vector<float> SliceTensor(std::span<const float> whole, const std::vector<int64_t>& shape,
                               const TensorSlice& slice);

struct LlamaModelOptions {
  // CUDA: fp32 GEMMs on TF32 tensor cores (strata.tf32). No effect on the CPU device or with
  // 16-bit weights.
  bool allow_tf32 = false;
  // Time every op call (strata train --profile-ops; op_profile()). Costs two stream-ordered
  // timestamps per op.
  bool profile_ops = false;
  // LoRA adapters (ResolveLlamaLora): adapter units between the blocks (LlamaUnitAt).
  LlamaLora lora;
  // Keep every block's internals from forward to backward (strata.activation_checkpointing
  // off): L sets of them in device memory instead of one, and no block's forward runs twice.
  bool keep_activations = false;
  // Each block as four units (LlamaUnitAt; strata.split_blocks); not with LoRA. With activation
  // checkpointing, a block's attention, gate and up parts run their forward again before its
  // down part's backward (RecomputeUnits), each gathered again by the engine.
  bool split_blocks = false;
  // Activation checkpoints in host memory (strata.offload_checkpoints; needs checkpointing):
  // each block input but the last two goes to registered host memory on a copy stream of its
  // own while the block computes, and comes back while the block after it runs backward, so the
  // device holds three block inputs (a ring of two and the final norm's) instead of L + 1. The
  // same arithmetic, bit for bit; L - 2 block inputs each way over PCIe per micro-batch.
  bool offload_checkpoints = false;
  // This rank's place in a tensor-parallel group (LlamaTensorParallel); the model's parameters
  // are then this rank's parts (LlamaTensorParallelSlice), under the whole model's names.
  LlamaTensorParallel tensor_parallel = {};
  // The weights' dtype in compute (the run's precision): on CUDA with bf16 or fp16, Create
  // prepares the attention for it (cuDNN's graphs, cuda::PrepareAttention) so that no step builds
  // them, and logs which attention runs.
  device::DType attention_dtype = device::DType::kF32;
  // Tokens per chunk of the head's cross-entropy (LlamaHeadChunkTokens; 0: that function's
  // choice). Tests set it to check chunked against whole.
  int64_t head_chunk_tokens = 0;
  // The dtype of activations and their gradients in device memory (docs/model.md "16-bit
  // activations"): fp32, or on the CUDA device the compute dtype (bf16, fp16), which halves
  // their bytes and memory traffic and feeds the tensor cores and cuDNN without copies. Row
  // statistics, the loss, and weight gradients stay fp32, and every op accumulates in fp32.
  // The CPU device computes in fp32 only (Create refuses 16 bits there). With 16 bits the
  // attention runs at this dtype whatever the weights'.
  device::DType activation_dtype = device::DType::kF32;
};

class LlamaModel final : public zero::Model {
 public:
  static Result<std::unique_ptr<LlamaModel>> Create(device::Device& device,
                                                    const LlamaConfig& config, int64_t seq_len,
                                                    int64_t micro_batch, uint64_t init_seed = 0,
                                                    const LlamaModelOptions& options = {});
  ~LlamaModel() override;

  std::vector<zero::UnitSpec> units() const override;
  // Hugging Face's initialisation: weights ~ N(0, 0.02), norm weights 1; seeded by init_seed,
  // the unit and the parameter, never by the rank.
  Status InitUnit(int unit, const std::vector<zero::ParamSlot>& slots,
                  std::span<float> flat) const override;
  // The same values for elements [begin, begin + out.size()) only: every generator here can
  // start at any element (counter-seeded blocks, SplitMix64 streams skipped ahead).
  Status InitUnitRange(int unit, const std::vector<zero::ParamSlot>& slots, int64_t used_numel,
                       int64_t begin, std::span<float> out) const override;
  Status BeginMicroBatch(const zero::Batch& batch, float loss_scale,
                         device::Stream& stream) override;
  Status Forward(int unit, const zero::UnitView& params, device::Stream& stream) override;
  Status Backward(int unit, const zero::UnitView& params, const zero::UnitView& grads,
                  device::Stream& stream) override;
  Result<double> EndMicroBatch(device::Stream& stream) override;
  // tie_word_embeddings: the head unit reads the embedding unit's matrix as its LM head.
  std::vector<int> SharedUnits(int unit) const override;
  // Split blocks with activation checkpointing: LlamaRecomputeUnits.
  std::vector<int> RecomputeUnits(int unit) const override;
  Status Recompute(int unit, const zero::UnitView& params, device::Stream& stream) override;
  Status ForwardShared(int unit, std::span<const zero::UnitView> params,
                       device::Stream& stream) override;
  Status BackwardShared(int unit, std::span<const zero::UnitView> params,
                        std::span<const zero::UnitView> grads, device::Stream& stream) override;
  // Tensor parallelism: 1 for the parts LlamaTensorParallelSlice splits, the replicas of a
  // KV head for its k and v (and their biases and adapters' B), 0 for whole parameters.
  int TensorParallelCopies(int unit, size_t param) const override;

  // The whole model's config; with tensor parallelism, local_config() is this rank's part of it
  // (LlamaTensorParallelConfig), config() otherwise.
  const LlamaConfig& config() const { return full_config_; }
  const LlamaConfig& local_config() const { return config_; }
  const LlamaTensorParallel& tensor_parallel() const { return tp_; }
  const LlamaLora& lora() const { return lora_; }
  bool split_blocks() const { return split_blocks_; }
  // Device memory held since Create: activations, and the CUDA ops' workspace (0 on the CPU).
  uint64_t activation_bytes() const;
  uint64_t workspace_bytes() const;
  // Registered host memory holding offloaded activation checkpoints (LlamaCheckpointHostBytes).
  uint64_t checkpoint_host_bytes() const;
  // With LlamaModelOptions::profile_ops: each op's calls and device seconds since the last
  // ResetOpProfile, summed over the micro-batches that ended (EndMicroBatch), largest first.
  std::vector<OpTime> op_profile() const;
  void ResetOpProfile();
  int64_t tokens_per_micro_batch() const { return seq_len_ * micro_batch_; }

 private:
  struct State;
  struct Adapters;
  struct BlockWeights;
  LlamaModel(device::Device& device, const LlamaConfig& config, const LlamaConfig& local,
             int64_t seq_len, int64_t micro_batch, uint64_t init_seed, const LlamaLora& lora,
             bool split_blocks, const LlamaTensorParallel& tp);
  Status SetUp(const LlamaModelOptions& options);
  Status SetUpTensorParallel();
  // The attention's arithmetic: the activations' dtype when it is 16-bit (cuDNN and the tensor
  // cores read them as they are), else `weights` (the weights' dtype: 16-bit attention on fp32
  // activations rounds them first).
  device::DType AttentionDType(device::DType weights) const;
  // Runs `fn` with the device's ops in the order of `stream` (see the header comment).
  Status Run(device::Stream& stream, std::function<Status(LlamaOps&)> fn, std::string_view label);
  // `w`: the block's parameters and gradients, from its whole unit or one part's
  // (BlockWeights); `ad`: the block's LoRA adapters (null without). A null gradient (frozen
  // unit): its weight gradients are not computed.
  // `layer` picks the block's set of internals (one per block without checkpointing).
  // The block's four parts, forward in this order and backward in the reverse; the whole block
  // runs all four.
  Status BlockPartForward(LlamaOps& ops, int layer, LlamaUnit::Part part, const BlockWeights& w,
                          const Adapters* ad, CAct x, Act out);
  Status BlockPartBackward(LlamaOps& ops, int layer, LlamaUnit::Part part, const BlockWeights& w,
                           const Adapters* ad, CAct x);
  Status BlockForward(LlamaOps& ops, int layer, LlamaUnit::Part part, const BlockWeights& w,
                      const Adapters* ad);
  Status BlockBackward(LlamaOps& ops, int layer, LlamaUnit::Part part, const BlockWeights& w,
                       const Adapters* ad);
  // y = x W^T (+ the adapter's scale (x A^T) B^T); y null: only the adapter's x A^T (kept for
  // backward).
  Status Project(LlamaOps& ops, int layer, const Adapters* ad, int proj, CAct x,
                 const BlockWeights& w, size_t in, size_t out, Act y);
  // dx (= or, with dx_add, +=) and the weight gradient (null: frozen) of the base projection and
  // its adapter's.
  Status ProjectBackward(LlamaOps& ops, int layer, const Adapters* ad, int proj, CAct x,
                         const BlockWeights& w, CAct dy, size_t in, size_t out, Act dx,
                         bool dx_add);
  // The head: final norm (params.param(0)) and the LM head matrix `lm` with its gradient `dlm`
  // (the head unit's second parameter, or the tied embedding matrix).
  Status HeadForward(LlamaOps& ops, const zero::UnitView& p, const void* lm);
  Status HeadBackward(LlamaOps& ops, const zero::UnitView& p, const zero::UnitView& g,
                      const void* lm, float* dlm);
  // Tensor parallelism: buf[0, n) summed (or the max) over the group, in the ops' order (called
  // by the ops' code; on the CPU device it waits for the result). Nothing without.
  // `group`: null for the tensor-parallel group.
  // buf: activations in their dtype, or fp32 statistics.
  Status TpAllReduce(Act buf, size_t n, comm::ReduceOp op = comm::ReduceOp::kSum,
                     comm::Collective* group = nullptr);
  // The first vocabulary row this rank holds (0 without tensor parallelism).
  size_t VocabBegin() const {
    return static_cast<size_t>(tp_.rank) * static_cast<size_t>(config_.vocab_size);
  }
  // The gradients of this micro-batch that each rank computed only part of (Qwen3's q/k norms,
  // the adapters' A of the projections split by rows, replicated KV heads' k and v), summed over the
  // ranks that share them, at the end of `part`'s backward.
  Status ReducePartialGradients(LlamaUnit::Part part, const BlockWeights& w, const Adapters* ad);
  // Offloaded checkpoints (LlamaModelOptions::offload_checkpoints), in the order of `stream`:
  // block `layer`'s input to host memory once written, back to its device slot for backward, and
  // the waits before a slot is written or read.
  Status CopyCheckpoint(int layer, bool to_host, device::Stream& stream);
  Status WaitCheckpoint(int layer, bool to_host, device::Stream& stream);
  // Around a unit's forward and backward: the copies and waits above that it needs.
  Status BeforeForward(const LlamaUnit& where, device::Stream& stream);
  Status AfterForward(const LlamaUnit& where, device::Stream& stream);
  Status BeforeBackward(const LlamaUnit& where, device::Stream& stream);
  Status AfterBackward(const LlamaUnit& where, device::Stream& stream);

  device::Device& device_;
  const LlamaConfig full_config_;  // the whole model
  const LlamaConfig config_;       // what this rank computes (the whole model without TP)
  const LlamaTensorParallel tp_;
  const int64_t seq_len_;
  const int64_t micro_batch_;
  const uint64_t init_seed_;
  const LlamaLora lora_;
  const bool split_blocks_;
  std::unique_ptr<State> state_;  // touched in stream order (CPU: by the stream's tasks)
};

}  // namespace strata::model
