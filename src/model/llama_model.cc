#include "model/llama_model.h"

#include <fmt/format.h>

#include <cmath>
#include <random>

#include "model/cpu_ops.h"

namespace strata::model {

namespace {

using cpu::Accumulate;
using cpu::Weight;

// Indices of a block's parameters in its unit.
enum BlockParam { kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown };

Weight W(const zero::UnitView& p, size_t i) { return Weight{p.param(i), p.dtype}; }
float* G(const zero::UnitView& g, size_t i) { return static_cast<float*>(g.param(i)); }

}  // namespace

int LlamaNumUnits(const LlamaConfig& c) { return static_cast<int>(c.num_hidden_layers) + 2; }

std::vector<zero::ParamSpec> LlamaUnitParams(const LlamaConfig& c, int unit) {
  const int64_t h = c.hidden_size, kv = c.kv_dim(), inter = c.intermediate_size;
  if (unit == 0) return {{"model.embed_tokens.weight", {c.vocab_size, h}}};
  if (unit == LlamaNumUnits(c) - 1) {
    if (c.tie_word_embeddings) return {{"model.norm.weight", {h}}};  // the LM head is the embedding
    return {{"model.norm.weight", {h}}, {"lm_head.weight", {c.vocab_size, h}}};
  }
  const std::string prefix = fmt::format("model.layers.{}.", unit - 1);
  return {
      {prefix + "input_layernorm.weight", {h}},
      {prefix + "self_attn.q_proj.weight", {h, h}},
      {prefix + "self_attn.k_proj.weight", {kv, h}},
      {prefix + "self_attn.v_proj.weight", {kv, h}},
      {prefix + "self_attn.o_proj.weight", {h, h}},
      {prefix + "post_attention_layernorm.weight", {h}},
      {prefix + "mlp.gate_proj.weight", {inter, h}},
      {prefix + "mlp.up_proj.weight", {inter, h}},
      {prefix + "mlp.down_proj.weight", {h, inter}},
  };
}

struct LlamaModel::State {
  float loss_scale = 1.0f;
  std::vector<int32_t> inputs;   // [T]
  std::vector<int32_t> targets;  // [T]
  // block_in[i]: the input of block i (block_in[L]: the final norm's input). [T, H] each.
  std::vector<std::vector<float>> block_in;
  // Head: normalised input, its rstd, logits and their log-sum-exp.
  std::vector<float> head_x, head_rstd, logits, lse;
  double loss = 0.0;
  // The gradient of the residual stream flowing backward. [T, H]
  std::vector<float> dres;
  Status error;  // the first error of a task (also returned by the task)
};

LlamaModel::LlamaModel(device::Device& device, const LlamaConfig& config, int64_t seq_len,
                       int64_t micro_batch, uint64_t init_seed)
    : device_(device),
      config_(config),
      seq_len_(seq_len),
      micro_batch_(micro_batch),
      init_seed_(init_seed),
      state_(std::make_unique<State>()) {}

LlamaModel::~LlamaModel() = default;

Result<std::unique_ptr<LlamaModel>> LlamaModel::Create(device::Device& device,
                                                       const LlamaConfig& config, int64_t seq_len,
                                                       int64_t micro_batch, uint64_t init_seed) {
  STRATA_RETURN_IF_ERROR(config.Validate());
  if (device.type() != device::DeviceType::kCpu) {
    return UnimplementedError(fmt::format(
        "the Llama model runs on the CPU device only for now (got the {} device)",
        device::DeviceTypeName(device.type())));
  }
  if (seq_len < 1 || seq_len > config.max_position_embeddings) {
    return InvalidArgumentError(fmt::format(
        "sequence length {} is outside [1, max_position_embeddings = {}] of model '{}'", seq_len,
        config.max_position_embeddings, config.name));
  }
  if (micro_batch < 1) {
    return InvalidArgumentError(fmt::format("micro-batch size {} < 1", micro_batch));
  }
  return std::unique_ptr<LlamaModel>(
      new LlamaModel(device, config, seq_len, micro_batch, init_seed));
}

std::vector<zero::UnitSpec> LlamaModel::units() const {
  std::vector<zero::UnitSpec> out;
  const int n = LlamaNumUnits(config_);
  for (int u = 0; u < n; ++u) {
    std::string name = u == 0 ? "embed" : u == n - 1 ? "head" : fmt::format("layers.{}", u - 1);
    out.push_back({std::move(name), LlamaUnitParams(config_, u)});
  }
  return out;
}

Status LlamaModel::InitUnit(int unit, const std::vector<zero::ParamSlot>& slots,
                            std::span<float> flat) const {
  for (size_t i = 0; i < slots.size(); ++i) {
    const zero::ParamSlot& s = slots[i];
    float* dst = flat.data() + s.offset;
    const bool norm = s.shape.size() == 1;
    if (norm) {
      std::fill(dst, dst + s.numel, 1.0f);
      continue;
    }
    std::mt19937_64 rng(init_seed_ * 1000003u + static_cast<uint64_t>(unit) * 131u + i + 1);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (int64_t k = 0; k < s.numel; ++k) dst[k] = normal(rng);
  }
  return Status::Ok();
}

Status LlamaModel::BeginMicroBatch(const zero::Batch& batch, float loss_scale,
                                   device::Stream& stream) {
  const auto* b = dynamic_cast<const LlamaBatch*>(&batch);
  if (b == nullptr) return InvalidArgumentError("LlamaModel: the batch is not a LlamaBatch");
  const size_t row = static_cast<size_t>(seq_len_) + 1;
  if (b->tokens.size() != row * static_cast<size_t>(micro_batch_)) {
    return InvalidArgumentError(fmt::format(
        "LlamaModel: a micro-batch holds {} tokens; expected {} sequences of {} (seq_len + 1)",
        b->tokens.size(), micro_batch_, row));
  }
  std::vector<int32_t> inputs, targets;
  inputs.reserve(static_cast<size_t>(seq_len_ * micro_batch_));
  targets.reserve(inputs.capacity());
  for (int64_t s = 0; s < micro_batch_; ++s) {
    const int32_t* seq = b->tokens.data() + s * row;
    inputs.insert(inputs.end(), seq, seq + seq_len_);
    targets.insert(targets.end(), seq + 1, seq + row);
  }
  return device_.HostTask(
      stream,
      [this, loss_scale, inputs = std::move(inputs), targets = std::move(targets)]() mutable {
        State& st = *state_;
        st.loss_scale = loss_scale;
        st.inputs = std::move(inputs);
        st.targets = std::move(targets);
        st.block_in.assign(static_cast<size_t>(config_.num_hidden_layers) + 1, {});
        st.loss = 0.0;
        return Status::Ok();
      },
      "llama begin");
}

Status LlamaModel::Forward(int unit, const zero::UnitView& params, device::Stream& stream) {
  const int n = LlamaNumUnits(config_);
  zero::UnitView p = params;
  return device_.HostTask(
      stream,
      [this, unit, n, p]() -> Status {
        State& st = *state_;
        const size_t t = st.inputs.size(), h = static_cast<size_t>(config_.hidden_size);
        if (unit == 0) {
          st.block_in[0].resize(t * h);
          return cpu::EmbeddingForward(st.inputs.data(), t, W(p, 0),
                                       static_cast<size_t>(config_.vocab_size), h,
                                       st.block_in[0].data());
        }
        if (unit == n - 1) {
          if (config_.tie_word_embeddings) {
            return InternalError("llama: the tied head needs the embedding unit (ForwardShared)");
          }
          return HeadForward(p, p.param(1));
        }
        return BlockForward(unit - 1, p);
      },
      "llama forward");
}

Status LlamaModel::Backward(int unit, const zero::UnitView& params, const zero::UnitView& grads,
                            device::Stream& stream) {
  const int n = LlamaNumUnits(config_);
  zero::UnitView p = params, g = grads;
  return device_.HostTask(
      stream,
      [this, unit, n, p, g]() -> Status {
        State& st = *state_;
        const size_t t = st.inputs.size(), h = static_cast<size_t>(config_.hidden_size);
        if (unit == 0) {
          return cpu::EmbeddingBackward(st.inputs.data(), t, st.dres.data(),
                                        static_cast<size_t>(config_.vocab_size), h, G(g, 0));
        }
        if (unit == n - 1) {
          if (config_.tie_word_embeddings) {
            return InternalError("llama: the tied head needs the embedding unit (BackwardShared)");
          }
          return HeadBackward(p, g, p.param(1), G(g, 1));
        }
        return BlockBackward(unit - 1, p, g);
      },
      "llama backward");
}

std::vector<int> LlamaModel::SharedUnits(int unit) const {
  if (config_.tie_word_embeddings && unit == LlamaNumUnits(config_) - 1) return {0};
  return {};
}

Status LlamaModel::ForwardShared(int unit, std::span<const zero::UnitView> params,
                                 device::Stream& stream) {
  if (unit != LlamaNumUnits(config_) - 1 || params.size() != 2) {
    return InternalError(fmt::format("llama: unit {} shares no parameters", unit));
  }
  zero::UnitView p = params[0], embed = params[1];
  return device_.HostTask(
      stream, [this, p, embed]() { return HeadForward(p, embed.param(0)); }, "llama forward");
}

Status LlamaModel::BackwardShared(int unit, std::span<const zero::UnitView> params,
                                  std::span<const zero::UnitView> grads, device::Stream& stream) {
  if (unit != LlamaNumUnits(config_) - 1 || params.size() != 2 || grads.size() != 2) {
    return InternalError(fmt::format("llama: unit {} shares no parameters", unit));
  }
  zero::UnitView p = params[0], embed = params[1], g = grads[0], gembed = grads[1];
  return device_.HostTask(
      stream,
      [this, p, embed, g, gembed]() {
        return HeadBackward(p, g, embed.param(0), G(gembed, 0));
      },
      "llama backward");
}

Result<double> LlamaModel::EndMicroBatch(device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(device_.Synchronize(stream));
  return state_->loss;
}

// ---- the blocks ---------------------------------------------------------------------------------

namespace {

// A block's internals, recomputed from its input in backward.
struct BlockActs {
  std::vector<float> h1, rstd1, q, k, v, attn, lse, x2, h2, rstd2, gate, up, hm;
};

void BlockInternals(const LlamaConfig& c, int64_t batch, int64_t seq, const zero::UnitView& p,
                    const float* x, BlockActs& a, float* out) {
  const size_t t = static_cast<size_t>(batch * seq), h = static_cast<size_t>(c.hidden_size);
  const size_t kv = static_cast<size_t>(c.kv_dim()), inter = static_cast<size_t>(c.intermediate_size);
  const size_t nh = static_cast<size_t>(c.num_attention_heads);
  const size_t nkv = static_cast<size_t>(c.num_key_value_heads);
  const size_t d = static_cast<size_t>(c.head_dim());
  const float eps = static_cast<float>(c.rms_norm_eps), theta = static_cast<float>(c.rope_theta);
  a.h1.resize(t * h);
  a.rstd1.resize(t);
  cpu::RmsNormForward(x, W(p, kInNorm), t, h, eps, a.h1.data(), a.rstd1.data());
  a.q.resize(t * h);
  a.k.resize(t * kv);
  a.v.resize(t * kv);
  cpu::LinearForward(a.h1.data(), W(p, kQ), t, h, h, a.q.data());
  cpu::LinearForward(a.h1.data(), W(p, kK), t, h, kv, a.k.data());
  cpu::LinearForward(a.h1.data(), W(p, kV), t, h, kv, a.v.data());
  cpu::RopeForward(a.q.data(), static_cast<size_t>(batch), static_cast<size_t>(seq), nh, d, theta);
  cpu::RopeForward(a.k.data(), static_cast<size_t>(batch), static_cast<size_t>(seq), nkv, d, theta);
  a.attn.resize(t * h);
  a.lse.resize(static_cast<size_t>(batch) * nh * static_cast<size_t>(seq));
  cpu::AttentionForward(a.q.data(), a.k.data(), a.v.data(), static_cast<size_t>(batch),
                        static_cast<size_t>(seq), nh, nkv, d, a.attn.data(), a.lse.data());
  a.x2.resize(t * h);
  cpu::LinearForward(a.attn.data(), W(p, kO), t, h, h, a.x2.data());
  cpu::ResidualAdd(x, a.x2.data(), t * h, a.x2.data());
  a.h2.resize(t * h);
  a.rstd2.resize(t);
  cpu::RmsNormForward(a.x2.data(), W(p, kPostNorm), t, h, eps, a.h2.data(), a.rstd2.data());
  a.gate.resize(t * inter);
  a.up.resize(t * inter);
  a.hm.resize(t * inter);
  cpu::LinearForward(a.h2.data(), W(p, kGate), t, h, inter, a.gate.data());
  cpu::LinearForward(a.h2.data(), W(p, kUp), t, h, inter, a.up.data());
  cpu::SiluMulForward(a.gate.data(), a.up.data(), t * inter, a.hm.data());
  if (out != nullptr) {
    cpu::LinearForward(a.hm.data(), W(p, kDown), t, inter, h, out);
    cpu::ResidualAdd(a.x2.data(), out, t * h, out);
  }
}

}  // namespace

Status LlamaModel::BlockForward(int layer, const zero::UnitView& p) {
  State& st = *state_;
  const size_t t = st.inputs.size(), h = static_cast<size_t>(config_.hidden_size);
  BlockActs a;
  auto& out = st.block_in[static_cast<size_t>(layer) + 1];
  out.resize(t * h);
  BlockInternals(config_, micro_batch_, seq_len_, p, st.block_in[static_cast<size_t>(layer)].data(),
                 a, out.data());
  return Status::Ok();
}

Status LlamaModel::BlockBackward(int layer, const zero::UnitView& p, const zero::UnitView& g) {
  State& st = *state_;
  const LlamaConfig& c = config_;
  const size_t t = st.inputs.size(), h = static_cast<size_t>(c.hidden_size);
  const size_t kv = static_cast<size_t>(c.kv_dim()), inter = static_cast<size_t>(c.intermediate_size);
  const size_t nh = static_cast<size_t>(c.num_attention_heads);
  const size_t nkv = static_cast<size_t>(c.num_key_value_heads);
  const size_t d = static_cast<size_t>(c.head_dim());
  const size_t b = static_cast<size_t>(micro_batch_), s = static_cast<size_t>(seq_len_);
  const float theta = static_cast<float>(c.rope_theta);
  const float* x = st.block_in[static_cast<size_t>(layer)].data();
  BlockActs a;
  BlockInternals(c, micro_batch_, seq_len_, p, x, a, nullptr);  // recompute (checkpointing)

  std::vector<float>& dres = st.dres;  // d out, [T, H]
  // MLP.
  std::vector<float> dhm(t * inter), dgate(t * inter), dup(t * inter), dh2(t * h);
  cpu::LinearBackward(a.hm.data(), W(p, kDown), dres.data(), t, inter, h, dhm.data(),
                      Accumulate::kOverwrite, G(g, kDown));
  cpu::SiluMulBackward(a.gate.data(), a.up.data(), dhm.data(), t * inter, dgate.data(), dup.data());
  cpu::LinearBackward(a.h2.data(), W(p, kGate), dgate.data(), t, h, inter, dh2.data(),
                      Accumulate::kOverwrite, G(g, kGate));
  cpu::LinearBackward(a.h2.data(), W(p, kUp), dup.data(), t, h, inter, dh2.data(),
                      Accumulate::kAdd, G(g, kUp));
  std::vector<float> dx2(t * h);
  cpu::RmsNormBackward(a.x2.data(), W(p, kPostNorm), a.rstd2.data(), dh2.data(), t, h,
                       dx2.data(), G(g, kPostNorm));
  cpu::AccumulateGradient(dres.data(), t * h, dx2.data());  // the residual path
  // Attention.
  std::vector<float> dattn(t * h), dq(t * h), dk(t * kv), dv(t * kv), dh1(t * h);
  cpu::LinearBackward(a.attn.data(), W(p, kO), dx2.data(), t, h, h, dattn.data(),
                      Accumulate::kOverwrite, G(g, kO));
  cpu::AttentionBackward(a.q.data(), a.k.data(), a.v.data(), a.attn.data(), a.lse.data(),
                         dattn.data(), b, s, nh, nkv, d, dq.data(), dk.data(), dv.data());
  cpu::RopeBackward(dq.data(), b, s, nh, d, theta);
  cpu::RopeBackward(dk.data(), b, s, nkv, d, theta);
  cpu::LinearBackward(a.h1.data(), W(p, kQ), dq.data(), t, h, h, dh1.data(),
                      Accumulate::kOverwrite, G(g, kQ));
  cpu::LinearBackward(a.h1.data(), W(p, kK), dk.data(), t, h, kv, dh1.data(), Accumulate::kAdd,
                      G(g, kK));
  cpu::LinearBackward(a.h1.data(), W(p, kV), dv.data(), t, h, kv, dh1.data(), Accumulate::kAdd,
                      G(g, kV));
  std::vector<float> dx(t * h);
  cpu::RmsNormBackward(x, W(p, kInNorm), a.rstd1.data(), dh1.data(), t, h, dx.data(),
                       G(g, kInNorm));
  cpu::AccumulateGradient(dx2.data(), t * h, dx.data());
  dres = std::move(dx);
  return Status::Ok();
}

Status LlamaModel::HeadForward(const zero::UnitView& p, const void* lm) {
  State& st = *state_;
  const size_t t = st.inputs.size(), h = static_cast<size_t>(config_.hidden_size);
  const size_t v = static_cast<size_t>(config_.vocab_size);
  const auto& x = st.block_in.back();
  st.head_x.resize(t * h);
  st.head_rstd.resize(t);
  cpu::RmsNormForward(x.data(), W(p, 0), t, h, static_cast<float>(config_.rms_norm_eps),
                      st.head_x.data(), st.head_rstd.data());
  st.logits.resize(t * v);
  cpu::LinearForward(st.head_x.data(), cpu::Weight{lm, p.dtype}, t, h, v, st.logits.data());
  st.lse.resize(t);
  STRATA_ASSIGN_OR_RETURN(float loss,
                          cpu::CrossEntropyForward(st.logits.data(), st.targets.data(), t, v,
                                                   cpu::kIgnoreIndex, st.lse.data()));
  st.loss = loss;
  return Status::Ok();
}

Status LlamaModel::HeadBackward(const zero::UnitView& p, const zero::UnitView& g, const void* lm,
                                float* dlm) {
  State& st = *state_;
  const size_t t = st.inputs.size(), h = static_cast<size_t>(config_.hidden_size);
  const size_t v = static_cast<size_t>(config_.vocab_size);
  std::vector<float> dlogits(t * v);
  STRATA_RETURN_IF_ERROR(cpu::CrossEntropyBackward(st.logits.data(), st.targets.data(),
                                                   st.lse.data(), t, v, cpu::kIgnoreIndex,
                                                   st.loss_scale, dlogits.data()));
  std::vector<float> dxn(t * h);
  cpu::LinearBackward(st.head_x.data(), cpu::Weight{lm, p.dtype}, dlogits.data(), t, h, v,
                      dxn.data(), Accumulate::kOverwrite, dlm);
  st.dres.assign(t * h, 0.0f);
  cpu::RmsNormBackward(st.block_in.back().data(), W(p, 0), st.head_rstd.data(), dxn.data(), t, h,
                       st.dres.data(), G(g, 0));
  return Status::Ok();
}

}  // namespace strata::model
