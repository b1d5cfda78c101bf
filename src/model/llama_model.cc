#include "model/llama_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numbers>
#include <string_view>
#include <thread>
#include <tuple>

#include "common/host_memory.h"
#include "common/log.h"
#include "common/parallel_blocks.h"
#include "model/cpu_ops.h"
#include "model/llama_ops.h"

namespace strata::model {

namespace {

using cpu::Accumulate;
using cpu::Weight;

// A block's parameters: the nine of every Llama block, then those of a family's features (biases,
// Qwen3's q/k norms). A unit holds those its config has, in PartSlots order.
enum BlockParam {
  kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown,
  kQBias, kKBias, kVBias, kOBias, kGateBias, kUpBias, kDownBias, kQNorm, kKNorm,
  kBlockParams
};

Weight W(const zero::UnitView& p, size_t i) { return Weight{p.param(i), p.dtype}; }

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;  // SplitMix64's step per draw

// Values [lo, hi) of an n-value sequence of N(0, stddev) samples, into dst[0, hi - lo). The
// sequence comes in blocks of 64 Ki values, each from its own SplitMix64 stream (seeded from
// `seed` and the block's index) through Box-Muller: a value depends on the seed and its index
// alone, never on how many threads fill them or where the range starts (a block's stream is
// skipped ahead to the first pair the range needs). A random 8B model's weights take seconds
// (std::normal_distribution over one mt19937 took minutes, seen on the lent H100 machine).
void FillNormalRange(float* dst, int64_t n, int64_t lo, int64_t hi, float stddev,
                     uint64_t seed) {
  constexpr int64_t kBlock = int64_t{1} << 16;
  hi = std::min(hi, n);
  if (lo >= hi) return;
  const int64_t first = lo / kBlock, blocks = (hi - 1) / kBlock + 1 - first;
  auto fill_block = [&](int64_t b) {
    uint64_t state = seed ^ (static_cast<uint64_t>(b) * 0xD1B54A32D192ED03ull);
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    // Values come in pairs from one draw each; blocks start at even indices.
    const int64_t start = std::max(begin, lo - (lo - begin) % 2);
    state += static_cast<uint64_t>((start - begin) / 2) * kSplitMixGamma;
    for (int64_t k = start; k < end && k < hi; k += 2) {
      // Two 24-bit uniforms from one draw, in (0, 1] and [0, 1): float arithmetic (2x double's
      // rate) is ample for an initialisation, whose tails end at 5.8 standard deviations.
      const uint64_t x = SplitMix64(state);
      const float u1 = (static_cast<float>(static_cast<uint32_t>(x >> 40)) + 1.0f) * 0x1.0p-24f;
      const float u2 = static_cast<float>(static_cast<uint32_t>(x) >> 8) * 0x1.0p-24f;
      const float r = std::sqrt(-2.0f * std::log(u1)) * stddev;
      const float a = 2.0f * std::numbers::pi_v<float> * u2;
      if (k >= lo) dst[k - lo] = r * std::cos(a);
      if (k + 1 < end && k + 1 < hi) dst[k + 1 - lo] = r * std::sin(a);
    }
  };
  // At least 16 blocks (1 Mi values) per thread; at most 32 threads.
  ParallelBlocks(static_cast<size_t>(blocks),
                 std::min(32u, std::max(1u, std::thread::hardware_concurrency())), 16,
                 [&](size_t b) { fill_block(first + static_cast<int64_t>(b)); });
}

// Parameter i's gradient; null for a frozen unit (no gradient buffer: weight gradients skipped).
float* G(const zero::UnitView& g, size_t i) {
  return g.data == nullptr ? nullptr : static_cast<float*>(g.param(i));
}

}  // namespace

std::string_view LlamaProjectionName(int projection) {
  static constexpr std::string_view kNames[kLlamaProjections] = {
      "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return projection >= 0 && projection < kLlamaProjections ? kNames[projection] : "?";
}

std::vector<std::string> LlamaLora::target_names() const {
  std::vector<std::string> out;
  for (int p = 0; p < kLlamaProjections; ++p) {
    if (targets[static_cast<size_t>(p)]) out.emplace_back(LlamaProjectionName(p));
  }
  return out;
}

Result<LlamaLora> ResolveLlamaLora(const LoraSettings& settings) {
  LlamaLora lora;
  if (!settings.enabled()) return lora;
  if (settings.lora_dropout != 0.0) {
    return UnimplementedError(fmt::format(
        "strata.lora.lora_dropout {}: LoRA dropout is not implemented; use 0", settings.lora_dropout));
  }
  lora.rank = settings.r;
  lora.alpha = settings.lora_alpha;
  lora.scale = static_cast<float>(settings.lora_alpha / settings.r);
  std::vector<std::string> names = settings.target_modules;
  if (names.empty()) names = {"q_proj", "v_proj"};
  for (const std::string& name : names) {
    if (name == "all-linear") {
      lora.targets.fill(true);
      continue;
    }
    int found = -1;
    for (int p = 0; p < kLlamaProjections; ++p) {
      if (name == LlamaProjectionName(p)) found = p;
    }
    if (found < 0) {
      return InvalidArgumentError(fmt::format(
          "strata.lora.target_modules: '{}' is not a projection of a Llama block; expected "
          "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or \"all-linear\" "
          "(the LM head and the embedding take no adapters)",
          name));
    }
    lora.targets[static_cast<size_t>(found)] = true;
  }
  return lora;
}

bool IsLoraParamName(std::string_view name) {
  return name.find(".lora_A.") != std::string_view::npos ||
         name.find(".lora_B.") != std::string_view::npos;
}

std::string PeftAdapterName(std::string_view name) {
  return fmt::format("base_model.model.{}", name);
}

int LlamaNumUnits(const LlamaConfig& c, const LlamaLora& lora, bool split_blocks) {
  const int per_layer = split_blocks ? 4 : lora.enabled() ? 2 : 1;
  return static_cast<int>(c.num_hidden_layers) * per_layer + 2;
}

LlamaUnit LlamaUnitAt(const LlamaConfig& c, const LlamaLora& lora, int unit, bool split_blocks) {
  const int n = LlamaNumUnits(c, lora, split_blocks);
  if (unit <= 0) return {LlamaUnit::kEmbed, -1};
  if (unit >= n - 1) return {LlamaUnit::kHead, -1};
  if (split_blocks) {
    return {LlamaUnit::kBlock, (unit - 1) / 4,
            static_cast<LlamaUnit::Part>(LlamaUnit::kAttn + (unit - 1) % 4)};
  }
  if (!lora.enabled()) return {LlamaUnit::kBlock, unit - 1};
  return {(unit - 1) % 2 == 0 ? LlamaUnit::kAdapter : LlamaUnit::kBlock, (unit - 1) / 2};
}

namespace {

// in and out features of projection `p` of a block.
std::pair<int64_t, int64_t> ProjectionShape(const LlamaConfig& c, int p) {
  const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), inter = c.intermediate_size;
  switch (p) {
    case 0: return {h, q};
    case 1:
    case 2: return {h, kv};
    case 3: return {q, h};
    case 4:
    case 5: return {h, inter};
    default: return {inter, h};
  }
}

std::string ProjectionPrefix(int layer, int p) {
  return fmt::format("model.layers.{}.{}.{}", layer, p < 4 ? "self_attn" : "mlp",
                     LlamaProjectionName(p));
}

}  // namespace

// ---- tensor parallelism -------------------------------------------------------------------------

Result<LlamaConfig> LlamaTensorParallelConfig(const LlamaConfig& c, int size) {
  if (size < 1) {
    return InvalidArgumentError(fmt::format("tensor_parallel.autotp_size {} < 1", size));
  }
  LlamaConfig local = c;
  if (size == 1) return local;
  const std::pair<const char*, int64_t> dims[] = {
      {"num_attention_heads", c.num_attention_heads},
      {"intermediate_size", c.intermediate_size},
      {"vocab_size", c.vocab_size}};
  for (const auto& [what, value] : dims) {
    if (value % size != 0) {
      return InvalidArgumentError(fmt::format(
          "tensor_parallel.autotp_size {} does not divide {} = {} of model '{}': every "
          "tensor-parallel rank must hold an equal part",
          size, what, value, c.name));
    }
  }
  const int64_t kv = c.num_key_value_heads;
  if (kv >= size ? kv % size != 0 : size % kv != 0) {
    return InvalidArgumentError(fmt::format(
        "tensor_parallel.autotp_size {} and num_key_value_heads = {} of model '{}': the KV heads "
        "must divide over the ranks, or the ranks over the KV heads (each then replicated)",
        size, kv, c.name));
  }
  local.explicit_head_dim = c.head_dim();
  local.num_attention_heads = c.num_attention_heads / size;
  local.num_key_value_heads = std::max<int64_t>(kv / size, 1);
  local.intermediate_size = c.intermediate_size / size;
  local.vocab_size = c.vocab_size / size;
  return local;
}

namespace {

bool EndsWith(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

}  // namespace

TensorSlice LlamaTensorParallelSlice(const LlamaConfig& c, int rank, int size,
                                     std::string_view name) {
  if (size <= 1) return {};
  const int64_t r = rank;
  const int64_t d = c.head_dim();
  const int64_t q_part = c.q_dim() / size, inter_part = c.intermediate_size / size;
  const int64_t kv = c.num_key_value_heads;
  // KV heads: divided, or each replicated on size / kv ranks.
  const int64_t kv_begin = kv >= size ? r * (kv / size) * d : r / (size / kv) * d;
  const int64_t kv_count = kv >= size ? kv / size * d : d;
  if (EndsWith(name, "embed_tokens.weight") || EndsWith(name, "lm_head.weight")) {
    return {0, r * (c.vocab_size / size), c.vocab_size / size};
  }
  // The projection a name belongs to, and whether it is split by rows (its output) or columns.
  struct Split {
    std::string_view proj;
    bool rows;
    int64_t begin, count;
  };
  const Split splits[] = {{"q_proj", true, r * q_part, q_part},
                          {"k_proj", true, kv_begin, kv_count},
                          {"v_proj", true, kv_begin, kv_count},
                          {"o_proj", false, r * q_part, q_part},
                          {"gate_proj", true, r * inter_part, inter_part},
                          {"up_proj", true, r * inter_part, inter_part},
                          {"down_proj", false, r * inter_part, inter_part}};
  for (const Split& sp : splits) {
    const std::string prefix = fmt::format(".{}.", sp.proj);
    const size_t at = name.find(prefix);
    if (at == std::string_view::npos) continue;
    const std::string_view rest = name.substr(at + prefix.size());
    if (rest == "weight") return {sp.rows ? 0 : 1, sp.begin, sp.count};
    if (rest == "bias") return sp.rows ? TensorSlice{0, sp.begin, sp.count} : TensorSlice{};
    // LoRA: A [r, in] is split with its projection's columns, B [out, r] with its rows.
    if (rest == "lora_A.weight") return sp.rows ? TensorSlice{} : TensorSlice{1, sp.begin, sp.count};
    if (rest == "lora_B.weight") return sp.rows ? TensorSlice{0, sp.begin, sp.count} : TensorSlice{};
    return {};
  }
  return {};  // norms: whole on every rank
}

std::vector<float> SliceTensor(std::span<const float> whole, const std::vector<int64_t>& shape,
                               const TensorSlice& slice) {
  if (slice.dim < 0 || shape.empty()) return std::vector<float>(whole.begin(), whole.end());
  const auto row = static_cast<int64_t>(whole.size()) / shape[0];  // elements per row
  if (slice.dim == 0) {
    return std::vector<float>(whole.begin() + slice.begin * row,
                              whole.begin() + (slice.begin + slice.count) * row);
  }
  std::vector<float> out;
  out.reserve(static_cast<size_t>(shape[0] * slice.count));
  for (int64_t r = 0; r < shape[0]; ++r) {
    const auto first = whole.begin() + r * row + slice.begin;
    out.insert(out.end(), first, first + slice.count);
  }
  return out;
}

std::vector<int> LlamaRecomputeUnits(const LlamaConfig& c, int unit, bool split_blocks,
                                     bool keep_activations) {
  if (!split_blocks || keep_activations) return {};
  const LlamaUnit where = LlamaUnitAt(c, {}, unit, true);
  if (where.kind != LlamaUnit::kBlock || where.part != LlamaUnit::kMlpDown ||
      where.layer == c.num_hidden_layers - 1) {
    return {};
  }
  return {unit - 3, unit - 2, unit - 1};
}

namespace {

// The block parameters part `part` holds, in its unit's order (the whole block: every part's,
// attention, gate, up, down). Each projection's bias follows its weight.
std::vector<BlockParam> PartSlots(const LlamaConfig& c, LlamaUnit::Part part) {
  std::vector<BlockParam> slots;
  auto add = [&](BlockParam weight, BlockParam bias, bool has_bias) {
    slots.push_back(weight);
    if (has_bias) slots.push_back(bias);
  };
  const bool whole = part == LlamaUnit::kWhole;
  if (whole || part == LlamaUnit::kAttn) {
    slots.push_back(kInNorm);
    add(kQ, kQBias, c.qkv_bias);
    add(kK, kKBias, c.qkv_bias);
    add(kV, kVBias, c.qkv_bias);
    add(kO, kOBias, c.o_bias);
    if (c.qk_norm) {
      slots.push_back(kQNorm);
      slots.push_back(kKNorm);
    }
  }
  if (whole || part == LlamaUnit::kMlpGate) {
    slots.push_back(kPostNorm);
    add(kGate, kGateBias, c.mlp_bias);
  }
  if (whole || part == LlamaUnit::kMlpUp) add(kUp, kUpBias, c.mlp_bias);
  if (whole || part == LlamaUnit::kMlpDown) add(kDown, kDownBias, c.mlp_bias);
  return slots;
}

// Where part `part`'s parameters start in the whole block's list (PartSlots).
size_t PartOffset(const LlamaConfig& c, LlamaUnit::Part part) {
  if (part == LlamaUnit::kWhole) return 0;
  const std::vector<BlockParam> whole = PartSlots(c, LlamaUnit::kWhole);
  const BlockParam first = PartSlots(c, part).front();
  return static_cast<size_t>(std::find(whole.begin(), whole.end(), first) - whole.begin());
}

// A block parameter's Hugging Face name (after "model.layers.<i>.") and shape.
zero::ParamSpec SlotSpec(const LlamaConfig& c, const std::string& prefix, BlockParam slot) {
  const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), inter = c.intermediate_size;
  const int64_t d = c.head_dim();
  switch (slot) {
    case kInNorm: return {prefix + "input_layernorm.weight", {h}};
    case kQ: return {prefix + "self_attn.q_proj.weight", {q, h}};
    case kK: return {prefix + "self_attn.k_proj.weight", {kv, h}};
    case kV: return {prefix + "self_attn.v_proj.weight", {kv, h}};
    case kO: return {prefix + "self_attn.o_proj.weight", {h, q}};
    case kPostNorm: return {prefix + "post_attention_layernorm.weight", {h}};
    case kGate: return {prefix + "mlp.gate_proj.weight", {inter, h}};
    case kUp: return {prefix + "mlp.up_proj.weight", {inter, h}};
    case kDown: return {prefix + "mlp.down_proj.weight", {h, inter}};
    case kQBias: return {prefix + "self_attn.q_proj.bias", {q}};
    case kKBias: return {prefix + "self_attn.k_proj.bias", {kv}};
    case kVBias: return {prefix + "self_attn.v_proj.bias", {kv}};
    case kOBias: return {prefix + "self_attn.o_proj.bias", {h}};
    case kGateBias: return {prefix + "mlp.gate_proj.bias", {inter}};
    case kUpBias: return {prefix + "mlp.up_proj.bias", {inter}};
    case kDownBias: return {prefix + "mlp.down_proj.bias", {h}};
    case kQNorm: return {prefix + "self_attn.q_norm.weight", {d}};
    case kKNorm: return {prefix + "self_attn.k_norm.weight", {d}};
    case kBlockParams: break;
  }
  return {};
}

}  // namespace

std::vector<zero::ParamSpec> LlamaUnitParams(const LlamaConfig& c, int unit, const LlamaLora& lora,
                                             bool split_blocks) {
  const int64_t h = c.hidden_size;
  const LlamaUnit where = LlamaUnitAt(c, lora, unit, split_blocks);
  if (where.kind == LlamaUnit::kEmbed) return {{"model.embed_tokens.weight", {c.vocab_size, h}}};
  if (where.kind == LlamaUnit::kHead) {
    if (c.tie_word_embeddings) return {{"model.norm.weight", {h}}};  // the LM head is the embedding
    return {{"model.norm.weight", {h}}, {"lm_head.weight", {c.vocab_size, h}}};
  }
  if (where.kind == LlamaUnit::kAdapter) {
    std::vector<zero::ParamSpec> out;
    for (int p = 0; p < kLlamaProjections; ++p) {
      if (!lora.targets[static_cast<size_t>(p)]) continue;
      const auto [in, o] = ProjectionShape(c, p);
      const std::string prefix = ProjectionPrefix(where.layer, p);
      out.push_back({prefix + ".lora_A.weight", {lora.rank, in}});
      out.push_back({prefix + ".lora_B.weight", {o, lora.rank}});
    }
    return out;
  }
  const std::string prefix = fmt::format("model.layers.{}.", where.layer);
  std::vector<zero::ParamSpec> out;
  for (BlockParam slot : PartSlots(c, where.part)) out.push_back(SlotSpec(c, prefix, slot));
  return out;
}

// ---- buffers ------------------------------------------------------------------------------------

namespace {

// Carves aligned pieces out of one device allocation; with base == nullptr it only counts.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* Take(size_t count) {
    return reinterpret_cast<T*>(TakeBytes(count * sizeof(T)));
  }
  // `count` activations of `dtype`.
  Act TakeAct(size_t count, device::DType dtype) {
    return Act(TakeBytes(count * device::DTypeSize(dtype)), dtype);
  }
  size_t bytes() const { return offset_; }

 private:
  // The next piece of `bytes` (at least one), aligned to kDeviceAlignment.
  char* TakeBytes(size_t bytes) {
    char* p = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ += (std::max<size_t>(bytes, 1) + device::kDeviceAlignment - 1) /
               device::kDeviceAlignment * device::kDeviceAlignment;
    return p;
  }

  char* base_;
  size_t offset_ = 0;
};

}  // namespace

// Every buffer a micro-batch uses, in device memory, carved out of one allocation made at
// Create (under the device budget; nothing is allocated during a step). T = micro_batch * seq.
struct LlamaActivations {
  // [4T]: the inputs, the targets, and for packed documents each token's position and the first
  // key of its document within its sequence (LlamaBatch).
  int32_t* tokens = nullptr;
  int32_t* positions() const { return tokens + 2 * t_; }
  int32_t* key_start() const { return tokens + 3 * t_; }
  size_t t_ = 0;
  // Block i's input (block L's: the final norm's), [T, H] each (In): all L + 1 of them, or with
  // offloaded checkpoints three slots: blocks 0 .. L - 1 alternate between the first two (the
  // inputs of blocks 0 .. L - 3 also go to host memory, and come back for backward), block L's
  // is the third.
  Act block_in;
  int64_t offloaded = 0;  // LlamaOffloadedCheckpoints
  int num_layers = 0;
  size_t th = 0;  // T H
  // Every activation's dtype (LlamaModelOptions::activation_dtype); statistics are fp32.
  device::DType act = device::DType::kF32;
  Act In(int layer) const {
    const size_t slot = offloaded == 0        ? static_cast<size_t>(layer)
                        : layer == num_layers ? 2
                                              : static_cast<size_t>(layer % 2);
    return block_in.At(slot * th);
  }
  // A block's internals: what its backward reads besides its input. With activation
  // checkpointing one set, recomputed from the input in backward; without, one set per block,
  // kept from its forward.
  struct Internals {
    Act h1, q, k, v;
    float* rstd1 = nullptr;
    // Qwen3's q/k norms: the projections' outputs before them [T, q], [T, kv], and each head's
    // rstd [T * heads], [T * kv heads] (null without).
    Act q_pre, k_pre;
    float *q_rstd = nullptr, *k_rstd = nullptr;
    Act attn, x2, h2, gate, up, hm;
    float *attn_lse = nullptr, *rstd2 = nullptr;
    // LoRA: per projection, x A^T scaled [T, r] (what the adapter's backward needs).
    std::array<Act, kLlamaProjections> lora_x{};
  };
  std::vector<Internals> blocks;  // 1 (checkpointing) or L
  Internals& Of(int layer) { return blocks[blocks.size() == 1 ? 0 : static_cast<size_t>(layer)]; }
  // Backward temporaries (dgate shares dhm's buffer).
  Act dhm, dup, dh2, dx2, dattn, dq, dk, dv, dh1;
  // The residual stream's gradient and the next one (swapped after each block).
  Act dres, dres_next;
  // The head: normalised input, its rstd, logits [chunk, V] (their gradient in place),
  // log-sum-exp, loss; with chunks (LlamaHeadChunkTokens) a chunk's loss beside it.
  Act head_x, logits;
  float *head_rstd = nullptr, *lse = nullptr;
  float* loss = nullptr;        // one float
  float* chunk_loss = nullptr;  // one float (chunks only)
  size_t head_chunk = 0;        // tokens per chunk of the head (t_: one chunk)
  // Tensor parallelism: the cross-entropy's row maxima [T] and sums [2T] (cpu_ops.h).
  float *ce_max = nullptr, *ce_sums = nullptr;
  // LoRA: the gradient of x A^T [T, r], and the adapter's output [T, out] before it is added
  // (the MLP's dup buffer, free during a block's forward, when it is large enough).
  Act lora_dx, lora_out;

  // Lays the buffers out from `base` (nullptr: only measures); returns the bytes used.
  size_t Layout(char* base, const LlamaConfig& c, size_t batch, size_t seq, const LlamaLora& lora,
                bool keep, bool offload, bool vocab_split, int64_t chunk_tokens,
                device::DType dtype) {
    const size_t t = batch * seq, h = static_cast<size_t>(c.hidden_size);
    const size_t kv = static_cast<size_t>(c.kv_dim()), inter = static_cast<size_t>(c.intermediate_size);
    const size_t vocab = static_cast<size_t>(c.vocab_size);
    const size_t layers = static_cast<size_t>(c.num_hidden_layers);
    const size_t nh = static_cast<size_t>(c.num_attention_heads);
    const size_t nkv = static_cast<size_t>(c.num_key_value_heads);
    const size_t q = static_cast<size_t>(c.q_dim());
    Carver m(base);
    tokens = m.Take<int32_t>(4 * t);
    act = dtype;
    auto take = [&](size_t n) { return m.TakeAct(n, dtype); };
    t_ = t;
    offloaded = LlamaOffloadedCheckpoints(c, keep, offload);
    num_layers = c.num_hidden_layers;
    th = t * h;
    block_in = take((layers + 1 - static_cast<size_t>(offloaded)) * t * h);
    blocks.assign(keep ? layers : 1, Internals{});
    for (Internals& i : blocks) {
      i.h1 = take(t * h);
      i.rstd1 = m.Take<float>(t);
      i.q = take(t * q);
      i.k = take(t * kv);
      i.v = take(t * kv);
      if (c.qk_norm) {
        i.q_pre = take(t * q);
        i.k_pre = take(t * kv);
        i.q_rstd = m.Take<float>(t * nh);
        i.k_rstd = m.Take<float>(t * nkv);
      }
      i.attn = take(t * q);
      i.attn_lse = m.Take<float>(batch * nh * seq);
      i.x2 = take(t * h);
      i.h2 = take(t * h);
      i.rstd2 = m.Take<float>(t);
      i.gate = take(t * inter);
      i.up = take(t * inter);
      i.hm = take(t * inter);
      for (int p = 0; p < kLlamaProjections && lora.enabled(); ++p) {
        if (lora.targets[static_cast<size_t>(p)]) {
          i.lora_x[static_cast<size_t>(p)] = take(t * static_cast<size_t>(lora.rank));
        }
      }
    }
    dhm = take(t * inter);
    dup = take(t * inter);
    dh2 = take(t * h);
    dx2 = take(t * h);
    dattn = take(t * q);
    dq = take(t * q);
    dk = take(t * kv);
    dv = take(t * kv);
    dh1 = take(t * h);
    dres = take(t * h);
    dres_next = take(t * h);
    head_x = take(t * h);
    head_rstd = m.Take<float>(t);
    head_chunk = static_cast<size_t>(
        chunk_tokens > 0 ? std::min<int64_t>(chunk_tokens, static_cast<int64_t>(t))
                         : LlamaHeadChunkTokens(c, static_cast<int64_t>(t), vocab_split));
    logits = take(head_chunk * vocab);
    lse = m.Take<float>(t);
    loss = m.Take<float>(1);
    if (head_chunk < t) chunk_loss = m.Take<float>(1);
    if (vocab_split) {
      ce_max = m.Take<float>(t);
      ce_sums = m.Take<float>(2 * t);
    }
    if (lora.enabled()) {
      lora_dx = take(t * static_cast<size_t>(lora.rank));
      // The adapter's output of any projection: h, q, kv or inter columns.
      const size_t widest = std::max({h, q, inter});
      lora_out = inter >= widest ? dup : take(t * widest);
    }
    return m.bytes();
  }
};

struct LlamaModel::State {
  LlamaActivations a;
  void* block = nullptr;  // the device allocation holding `a`
  size_t block_bytes = 0;
  size_t workspace_bytes = 0;  // the CUDA ops' (allocated by CreateCudaLlamaOps)
  float loss_scale = 1.0f;  // the head's dloss (LlamaBatch::loss_weight included)
  // With the head in chunks: each chunk's share of the micro-batch's counted targets (the weight
  // of its mean loss; 0 with none counted), set with loss_scale.
  std::vector<float> chunk_share;
  double loss_weight = 1.0;  // the micro-batch's LlamaBatch::loss_weight
  bool packed = false;       // the micro-batch has positions and key starts (packed documents)
  size_t tokens = 0;        // T

  // Host staging for the uploads and the loss, registered with the device.
  HostRegion host;
  int32_t* host_tokens = nullptr;  // [4T] (LlamaActivations::tokens), in `host`
  float* host_loss = nullptr;      // after them
  bool host_registered = false;
  std::unique_ptr<device::Event> upload_done;  // the last token upload

  // Offloaded activation checkpoints (LlamaModelOptions::offload_checkpoints): the host copies
  // of the inputs of blocks 0 .. a.offloaded - 1 (registered), the stream that copies them, the
  // compute point a copy starts after, and per device slot its last copy each way.
  HostRegion ckpt_host;
  bool ckpt_registered = false;
  std::unique_ptr<device::Stream> ckpt_stream;
  std::unique_ptr<device::Event> ckpt_ready;
  std::array<std::unique_ptr<device::Event>, 2> ckpt_saved, ckpt_loaded;

  // CPU device: the ops run inside HostTasks on the caller's stream.
  std::unique_ptr<LlamaOps> cpu_ops;
  // CUDA device: the ops run on the model's own stream, ordered against the caller's by events.
  std::unique_ptr<device::Stream> stream;
  std::unique_ptr<device::Event> caller_ready, model_done;
  std::unique_ptr<LlamaOps> cuda_ops;
  OpProfiler* profiler = nullptr;  // the ops' wrapper with LlamaModelOptions::profile_ops

  // Tensor parallelism on the CPU device: the ops recorded as the engine calls the model and
  // enqueued in pieces between the group's all-reduces (DeferredOps), on `run_stream` (the
  // caller's, during Run). With KV heads replicated over the group: the ranks that share this
  // rank's KV head.
  std::unique_ptr<DeferredOps> deferred;
  device::Stream* run_stream = nullptr;
  std::unique_ptr<comm::Collective> kv_group;
};

LlamaModel::LlamaModel(device::Device& device, const LlamaConfig& config, const LlamaConfig& local,
                       int64_t seq_len, int64_t micro_batch, uint64_t init_seed,
                       const LlamaLora& lora, bool split_blocks, const LlamaTensorParallel& tp)
    : device_(device),
      full_config_(config),
      config_(local),
      tp_(tp),
      seq_len_(seq_len),
      micro_batch_(micro_batch),
      init_seed_(init_seed),
      lora_(lora),
      split_blocks_(split_blocks),
      state_(std::make_unique<State>()) {}

LlamaModel::~LlamaModel() {
  State& st = *state_;
  st.cuda_ops.reset();  // waits for the model's stream
  if (st.stream) (void)device_.Synchronize(*st.stream);
  if (st.ckpt_stream) (void)device_.Synchronize(*st.ckpt_stream);
  if (st.ckpt_registered) (void)device_.UnregisterHost(st.ckpt_host.data());
  if (st.host_registered) (void)device_.UnregisterHost(st.host.data());
  device_.Free(st.block);
}

uint64_t LlamaActivationBytes(const LlamaConfig& config, int64_t seq_len, int64_t micro_batch,
                              const LlamaLora& lora, bool keep_activations,
                              bool offload_checkpoints, bool vocab_split, int64_t head_chunk_tokens,
                              device::DType activation_dtype) {
  LlamaActivations a;
  return a.Layout(nullptr, config, static_cast<size_t>(micro_batch), static_cast<size_t>(seq_len),
                  lora, keep_activations, offload_checkpoints, vocab_split, head_chunk_tokens,
                  activation_dtype);
}

device::DType LlamaActivationDType(device::DeviceType device, device::DType compute) {
  if (device != device::DeviceType::kCuda) return device::DType::kF32;
  const char* forced = std::getenv("STRATA_ACTIVATIONS");
  if (forced != nullptr && std::string_view(forced) == "fp32") return device::DType::kF32;
  return compute;
}

int64_t LlamaHeadChunkTokens(const LlamaConfig& config, int64_t tokens, bool vocab_split) {
  const uint64_t row = static_cast<uint64_t>(std::max<int64_t>(config.vocab_size, 1)) * 4;
  if (vocab_split || static_cast<uint64_t>(tokens) * row <= kLlamaLogitsBytes) return tokens;
  return std::max<int64_t>(static_cast<int64_t>(kLlamaLogitsBytes / row), 1);
}

int64_t LlamaOffloadedCheckpoints(const LlamaConfig& config, bool keep_activations,
                                  bool offload_checkpoints) {
  if (!offload_checkpoints || keep_activations) return 0;
  return std::max<int64_t>(config.num_hidden_layers - 2, 0);
}

uint64_t LlamaCheckpointHostBytes(const LlamaConfig& config, int64_t seq_len, int64_t micro_batch,
                                  bool keep_activations, bool offload_checkpoints,
                                  device::DType activation_dtype) {
  return static_cast<uint64_t>(
             LlamaOffloadedCheckpoints(config, keep_activations, offload_checkpoints)) *
         static_cast<uint64_t>(seq_len) * static_cast<uint64_t>(micro_batch) *
         static_cast<uint64_t>(config.hidden_size) * device::DTypeSize(activation_dtype);
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::Create(device::Device& device,
                                                       const LlamaConfig& config, int64_t seq_len,
                                                       int64_t micro_batch, uint64_t init_seed,
                                                       const LlamaModelOptions& options) {
  STRATA_RETURN_IF_ERROR(config.Validate());
  if (seq_len < 1 || seq_len > config.max_position_embeddings) {
    return InvalidArgumentError(fmt::format(
        "sequence length {} is outside [1, max_position_embeddings = {}] of model '{}'", seq_len,
        config.max_position_embeddings, config.name));
  }
  if (micro_batch < 1) {
    return InvalidArgumentError(fmt::format("micro-batch size {} < 1", micro_batch));
  }
  if (options.lora.enabled() && (options.lora.rank < 1 || !std::isfinite(options.lora.scale))) {
    return InvalidArgumentError(fmt::format("LoRA rank {} / scale {}: expected a rank >= 1",
                                            options.lora.rank, options.lora.scale));
  }
  const LlamaTensorParallel& tp = options.tensor_parallel;
  if (tp.enabled() && (tp.group == nullptr || tp.group->world_size() != tp.size ||
                       tp.group->rank() != tp.rank)) {
    return InvalidArgumentError(fmt::format(
        "tensor parallelism: rank {} of {} needs a collective of that rank and size (got {})",
        tp.rank, tp.size,
        tp.group == nullptr ? std::string("none")
                            : fmt::format("rank {} of {}", tp.group->rank(), tp.group->world_size())));
  }
  STRATA_ASSIGN_OR_RETURN(const LlamaConfig local, LlamaTensorParallelConfig(config, tp.size));
  // A rank above a projection's smaller side adds nothing a full update would not (and the CUDA
  // ops' workspace is sized for the model's own widths).
  for (int p = 0; p < kLlamaProjections && options.lora.enabled(); ++p) {
    if (!options.lora.targets[static_cast<size_t>(p)]) continue;
    const auto [in, out] = ProjectionShape(local, p);
    if (options.lora.rank > std::min(in, out)) {
      return InvalidArgumentError(fmt::format(
          "strata.lora.r {} is larger than {}'s smaller side ({} in, {} out) in model '{}'; "
          "use a rank of at most {}",
          options.lora.rank, LlamaProjectionName(p), in, out, config.name, std::min(in, out)));
    }
  }
  if (options.split_blocks && options.lora.enabled()) {
    return InvalidArgumentError(
        "split blocks (strata.split_blocks) and LoRA adapters cannot be combined");
  }
  if (options.activation_dtype != device::DType::kF32 &&
      device.type() != device::DeviceType::kCuda) {
    return InvalidArgumentError(fmt::format(
        "{} activations: the {} device computes activations in fp32 only (16-bit activations "
        "are a CUDA device's)",
        device::DTypeName(options.activation_dtype), device::DeviceTypeName(device.type())));
  }
  if (options.offload_checkpoints && options.keep_activations) {
    return InvalidArgumentError(
        "offloaded activation checkpoints (strata.offload_checkpoints) need activation "
        "checkpointing; every block's internals are kept (strata.activation_checkpointing off)");
  }
  std::unique_ptr<LlamaModel> m(new LlamaModel(device, config, local, seq_len, micro_batch,
                                               init_seed, options.lora, options.split_blocks, tp));
  STRATA_RETURN_IF_ERROR(m->SetUp(options));
  return m;
}

Status LlamaModel::SetUp(const LlamaModelOptions& options) {
  State& st = *state_;
  const size_t b = static_cast<size_t>(micro_batch_), s = static_cast<size_t>(seq_len_);
  st.tokens = b * s;
  const device::DType act = options.activation_dtype;
  st.block_bytes =
      st.a.Layout(nullptr, config_, b, s, lora_, options.keep_activations,
                  options.offload_checkpoints, tp_.enabled(), options.head_chunk_tokens, act);
  Result<void*> block = device_.Alloc(st.block_bytes);
  if (!block.ok()) {
    return block.status().WithContext(fmt::format(
        "model '{}': activations for a micro-batch of {} x {} tokens ({} bytes, of which the "
        "logits take {})",
        config_.name, micro_batch_, seq_len_, st.block_bytes,
        st.a.head_chunk * static_cast<size_t>(config_.vocab_size) * device::DTypeSize(act)));
  }
  st.block = *block;
  st.a.Layout(static_cast<char*>(st.block), config_, b, s, lora_, options.keep_activations,
              options.offload_checkpoints, tp_.enabled(), options.head_chunk_tokens, act);

  STRATA_ASSIGN_OR_RETURN(
      st.host, HostRegion::Allocate(4 * st.tokens * sizeof(int32_t) + sizeof(float),
                                    HugePages::kOff));
  st.host_tokens = reinterpret_cast<int32_t*>(st.host.data());
  st.host_loss = reinterpret_cast<float*>(st.host_tokens + 4 * st.tokens);
  STRATA_RETURN_IF_ERROR(device_.RegisterHost(st.host.data(), st.host.size()));
  st.host_registered = true;
  STRATA_ASSIGN_OR_RETURN(st.upload_done, device_.CreateEvent());
  if (st.a.offloaded > 0) {
    Result<HostRegion> region = HostRegion::Allocate(checkpoint_host_bytes(), HugePages::kOff);
    if (!region.ok()) {
      return region.status().WithContext(
          fmt::format("model '{}': host memory for {} offloaded activation checkpoints "
                      "(strata.offload_checkpoints)",
                      config_.name, st.a.offloaded));
    }
    st.ckpt_host = std::move(*region);
    STRATA_RETURN_IF_ERROR(device_.RegisterHost(st.ckpt_host.data(), st.ckpt_host.size()));
    st.ckpt_registered = true;
    STRATA_ASSIGN_OR_RETURN(st.ckpt_stream, device_.CreateStream("llama-checkpoints"));
    STRATA_ASSIGN_OR_RETURN(st.ckpt_ready, device_.CreateEvent());
    for (size_t i = 0; i < 2; ++i) {
      STRATA_ASSIGN_OR_RETURN(st.ckpt_saved[i], device_.CreateEvent());
      STRATA_ASSIGN_OR_RETURN(st.ckpt_loaded[i], device_.CreateEvent());
    }
  }

  // strata train --profile-ops: every op call timed in stream order (OpProfiler).
  auto profiled = [&](std::unique_ptr<LlamaOps> ops) -> std::unique_ptr<LlamaOps> {
    if (!options.profile_ops) return ops;
    auto profiler = std::make_unique<OpProfiler>(std::move(ops));
    st.profiler = profiler.get();
    return profiler;
  };
  if (tp_.enabled()) STRATA_RETURN_IF_ERROR(SetUpTensorParallel());
  if (device_.type() == device::DeviceType::kCpu) {
    st.cpu_ops = profiled(CreateCpuLlamaOps());
    if (tp_.enabled()) st.deferred = std::make_unique<DeferredOps>(*st.cpu_ops);
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(st.stream, device_.CreateStream("llama"));
  STRATA_ASSIGN_OR_RETURN(st.caller_ready, device_.CreateEvent());
  STRATA_ASSIGN_OR_RETURN(st.model_done, device_.CreateEvent());
  LlamaOpsShape shape = LlamaOpsShapeFor(config_, seq_len_, micro_batch_, tp_.enabled(), act);
  shape.head_tokens = st.a.head_chunk;  // LlamaModelOptions::head_chunk_tokens may set it
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<LlamaOps> cuda_ops,
                          CreateCudaLlamaOps(device_, *st.stream, shape, options.allow_tf32));
  if (tp_.enabled() && !cuda_ops->HasShardOps()) {
    return UnimplementedError(fmt::format(
        "tensor parallelism (tensor_parallel.autotp_size {}): the {} device's ops have no "
        "vocabulary-parallel embedding and cross-entropy",
        tp_.size, device::DeviceTypeName(device_.type())));
  }
  const device::DType attention_dtype = AttentionDType(options.attention_dtype);
  if (attention_dtype != device::DType::kF32) {
    const LlamaConfig& c = config_;
    const char* attention = cuda_ops->PrepareAttention(
        static_cast<size_t>(micro_batch_), static_cast<size_t>(seq_len_),
        static_cast<size_t>(c.num_attention_heads), static_cast<size_t>(c.num_key_value_heads),
        static_cast<size_t>(c.head_dim()), attention_dtype);
    STRATA_LOG(info, model,
               "model '{}': attention on {} ({} x {} tokens, {}/{} heads, head_dim {}), "
               "{} activations",
               c.name, attention, micro_batch_, seq_len_, c.num_attention_heads,
               c.num_key_value_heads, c.head_dim(), device::DTypeName(act));
  }
  st.cuda_ops = profiled(std::move(cuda_ops));
  st.workspace_bytes = CudaLlamaOpsWorkspaceBytes(shape);
  return Status::Ok();
}

device::DType LlamaModel::AttentionDType(device::DType weights) const {
  const device::DType act = state_->a.act;
  return act != device::DType::kF32 ? act : weights;
}

Status LlamaModel::SetUpTensorParallel() {
  State& st = *state_;
  const int64_t kv = full_config_.num_key_value_heads;
  if (kv < tp_.size) {
    // The ranks that share a KV head: size / kv consecutive ranks.
    const int replicas = tp_.size / static_cast<int>(kv);
    STRATA_ASSIGN_OR_RETURN(st.kv_group, tp_.group->Split(tp_.rank / replicas, tp_.rank));
  }
  return Status::Ok();
}

Status LlamaModel::TpAllReduce(Act buf, size_t n, comm::ReduceOp op, comm::Collective* group) {
  if (!tp_.enabled()) return Status::Ok();
  State& st = *state_;
  comm::Collective& over = group != nullptr ? *group : *tp_.group;
  if (st.deferred) {
    // The ops recorded so far go first; the all-reduce follows them on the caller's stream.
    if (st.run_stream == nullptr) return InternalError("llama: an all-reduce outside Run");
    STRATA_RETURN_IF_ERROR(st.deferred->Flush(device_, *st.run_stream, "llama"));
    return over.AllReduce(buf.data, buf.data, n, buf.dtype, op, *st.run_stream);
  }
  return over.AllReduce(buf.data, buf.data, n, buf.dtype, op, *st.stream);
}

std::vector<OpTime> LlamaModel::op_profile() const {
  return state_->profiler != nullptr ? state_->profiler->totals() : std::vector<OpTime>{};
}

void LlamaModel::ResetOpProfile() {
  if (state_->profiler != nullptr) state_->profiler->Reset();
}

uint64_t LlamaModel::activation_bytes() const { return state_->block_bytes; }

uint64_t LlamaModel::workspace_bytes() const { return state_->workspace_bytes; }

uint64_t LlamaModel::checkpoint_host_bytes() const {
  return static_cast<uint64_t>(state_->a.offloaded) * state_->a.th *
         device::DTypeSize(state_->a.act);
}

Status LlamaModel::Run(device::Stream& stream, std::function<Status(LlamaOps&)> fn,
                       std::string_view label) {
  State& st = *state_;
  if (st.deferred) {
    // Tensor parallelism on the CPU device: the code runs now, recording its ops, and they are
    // enqueued in pieces around its all-reduces (TpAllReduce); what is left goes last.
    st.run_stream = &stream;
    Status result = fn(*st.deferred);
    if (result.ok()) result = st.deferred->Flush(device_, stream, label);
    st.deferred->Discard();  // after a failure: none of what was recorded runs
    st.run_stream = nullptr;
    return result;
  }
  if (st.cpu_ops) {
    return device_.HostTask(
        stream, [ops = st.cpu_ops.get(), fn = std::move(fn)]() { return fn(*ops); }, label);
  }
  // The model's stream starts after the caller's work so far; the caller's later work waits for
  // the model's.
  STRATA_RETURN_IF_ERROR(device_.Record(*st.caller_ready, stream));
  STRATA_RETURN_IF_ERROR(device_.Wait(*st.stream, *st.caller_ready));
  Status result = fn(*st.cuda_ops);
  STRATA_RETURN_IF_ERROR(device_.Record(*st.model_done, *st.stream));
  STRATA_RETURN_IF_ERROR(device_.Wait(stream, *st.model_done));
  return result;
}

std::vector<zero::UnitSpec> LlamaModel::units() const {
  std::vector<zero::UnitSpec> out;
  const int n = LlamaNumUnits(config_, lora_, split_blocks_);
  static constexpr std::array<std::string_view, 5> kPartSuffix = {"", ".attn", ".gate", ".up",
                                                                   ".down"};
  for (int u = 0; u < n; ++u) {
    const LlamaUnit where = LlamaUnitAt(config_, lora_, u, split_blocks_);
    std::string name =
        where.kind == LlamaUnit::kEmbed   ? "embed"
        : where.kind == LlamaUnit::kHead  ? "head"
        : where.kind == LlamaUnit::kBlock ? fmt::format("layers.{}{}", where.layer,
                                                        kPartSuffix[static_cast<size_t>(where.part)])
                                          : fmt::format("lora.{}", where.layer);
    out.push_back({std::move(name), LlamaUnitParams(config_, u, lora_, split_blocks_)});
  }
  return out;
}

Status LlamaModel::InitUnit(int unit, const std::vector<zero::ParamSlot>& slots,
                            std::span<float> flat) const {
  return InitUnitRange(unit, slots, static_cast<int64_t>(flat.size()), 0, flat);
}

Status LlamaModel::InitUnitRange(int unit, const std::vector<zero::ParamSlot>& slots,
                                 int64_t used_numel, int64_t begin, std::span<float> out) const {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  const bool adapter = where.kind == LlamaUnit::kAdapter;
  // Split blocks draw the values of the whole block's unit and slot, so that splitting changes
  // no initial weight.
  int seed_unit = unit;
  size_t seed_slot = 0;
  if (split_blocks_) {
    seed_unit = where.kind == LlamaUnit::kEmbed  ? 0
                : where.kind == LlamaUnit::kHead ? config_.num_hidden_layers + 1
                                                 : where.layer + 1;
    seed_slot = where.kind == LlamaUnit::kBlock ? PartOffset(config_, where.part) : 0;
  }
  const int64_t end = std::min(begin + static_cast<int64_t>(out.size()), used_numel);
  std::fill(out.begin(), out.end(), 0.0f);  // alignment gaps and padding
  // With tensor parallelism a parameter holds this rank's part of the whole model's tensor and
  // takes the values the whole tensor has there: the same seeds, the whole tensor's indices.
  const std::vector<zero::ParamSpec> whole =
      tp_.enabled() ? LlamaUnitParams(full_config_, unit, lora_, split_blocks_)
                    : std::vector<zero::ParamSpec>{};
  if (tp_.enabled() && whole.size() != slots.size()) {
    return InternalError(fmt::format("llama: unit {} has {} parameters, the whole model's {}", unit,
                                     slots.size(), whole.size()));
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const zero::ParamSlot& s = slots[i];
    // The part of parameter i in the range: its elements [lo, hi), at out[s.offset + lo - begin].
    const int64_t lo = std::max<int64_t>(0, begin - s.offset);
    const int64_t hi = std::min<int64_t>(s.numel, end - s.offset);
    if (lo >= hi) continue;
    float* dst = out.data() + (s.offset + lo - begin);
    uint64_t seed_state =
        init_seed_ * 1000003u + static_cast<uint64_t>(seed_unit) * 131u + seed_slot + i + 1;
    const std::vector<int64_t>& shape = tp_.enabled() ? whole[i].shape : s.shape;
    int64_t numel = 1;
    for (int64_t extent : shape) numel *= extent;
    const TensorSlice slice = tp_.enabled()
                                  ? LlamaTensorParallelSlice(full_config_, tp_.rank, tp_.size, s.name)
                                  : TensorSlice{};
    // fill(dst, first, last): the whole tensor's elements [first, last) into dst, for each run of
    // this rank's elements [lo, hi) that is consecutive in the whole tensor.
    auto for_runs = [&](auto&& fill) {
      if (slice.dim < 0) return fill(dst, lo, hi);
      const int64_t row = numel / shape[0];  // elements per row of the whole tensor
      if (slice.dim == 0) return fill(dst, slice.begin * row + lo, slice.begin * row + hi);
      for (int64_t k = lo; k < hi;) {  // columns [begin, begin + count) of each row
        const int64_t r = k / slice.count, c = k % slice.count;
        const int64_t run = std::min(hi - k, slice.count - c);
        const int64_t first = r * row + slice.begin + c;
        fill(dst + (k - lo), first, first + run);
        k += run;
      }
    };
    if (adapter) {
      // PEFT's: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5)), B = 0, so
      // the adapted model starts as the base model.
      if (i % 2 == 1) continue;  // zeros
      const float bound = 1.0f / std::sqrt(static_cast<float>(shape[1]));
      const uint64_t stream = SplitMix64(seed_state);
      for_runs([&](float* to, int64_t first, int64_t last) {
        uint64_t state = stream + static_cast<uint64_t>(first) * kSplitMixGamma;
        for (int64_t k = first; k < last; ++k) {
          const float u = static_cast<float>(SplitMix64(state) >> 40) * 0x1.0p-24f;  // [0, 1)
          to[k - first] = (2.0f * u - 1.0f) * bound;
        }
      });
      continue;
    }
    // Hugging Face's init: norm weights 1, biases 0, matrices N(0, 0.02).
    if (s.shape.size() == 1) {
      const bool bias = s.name.size() > 5 && s.name.compare(s.name.size() - 5, 5, ".bias") == 0;
      std::fill(dst, dst + (hi - lo), bias ? 0.0f : 1.0f);
      continue;
    }
    const uint64_t seed = SplitMix64(seed_state);
    for_runs([&](float* to, int64_t first, int64_t last) {
      FillNormalRange(to, numel, first, last, 0.02f, seed);
    });
  }
  return Status::Ok();
}

Status LlamaModel::BeginMicroBatch(const zero::Batch& batch, float loss_scale,
                                   device::Stream& stream) {
  const auto* b = dynamic_cast<const LlamaBatch*>(&batch);
  if (b == nullptr) return InvalidArgumentError("LlamaModel: the batch is not a LlamaBatch");
  const size_t row = static_cast<size_t>(seq_len_) + 1;
  const size_t t = static_cast<size_t>(micro_batch_) * static_cast<size_t>(seq_len_);
  if (b->tokens.size() != row * static_cast<size_t>(micro_batch_)) {
    return InvalidArgumentError(fmt::format(
        "LlamaModel: a micro-batch holds {} tokens; expected {} sequences of {} (seq_len + 1)",
        b->tokens.size(), micro_batch_, row));
  }
  const bool packed = !b->positions.empty();
  const std::tuple<const char*, const std::vector<int32_t>*, bool> fields[] = {
      {"targets", &b->targets, !b->targets.empty()},
      {"positions", &b->positions, packed},
      {"key_start", &b->key_start, packed || !b->key_start.empty()}};
  for (const auto& [what, v, needed] : fields) {
    if (needed && v->size() != t) {
      return InvalidArgumentError(fmt::format(
          "LlamaModel: a micro-batch's {} hold {} entries; expected {} (one per input token)",
          what, v->size(), t));
    }
  }
  if (packed) {
    for (size_t i = 0; i < t; ++i) {
      const size_t in_seq = i % static_cast<size_t>(seq_len_);
      if (b->positions[i] < 0 || b->positions[i] >= seq_len_ || b->key_start[i] < 0 ||
          static_cast<size_t>(b->key_start[i]) > in_seq ||
          (in_seq > 0 && b->key_start[i] < b->key_start[i - 1])) {
        return InvalidArgumentError(fmt::format(
            "LlamaModel: token {} of a micro-batch has position {} and key start {}; expected a "
            "position below {} and key starts that do not decrease along a sequence and do not "
            "pass the token",
            i, b->positions[i], b->key_start[i], seq_len_));
      }
    }
  }
  State& st = *state_;
  // The staging buffer is free once the previous upload has run (long ago, normally).
  STRATA_RETURN_IF_ERROR(device_.Synchronize(*st.upload_done));
  int32_t* inputs = st.host_tokens;
  int32_t* targets = st.host_tokens + st.tokens;
  for (int64_t s = 0; s < micro_batch_; ++s) {
    const int32_t* seq = b->tokens.data() + static_cast<size_t>(s) * row;
    std::memcpy(inputs + s * seq_len_, seq, static_cast<size_t>(seq_len_) * sizeof(int32_t));
    std::memcpy(targets + s * seq_len_, seq + 1, static_cast<size_t>(seq_len_) * sizeof(int32_t));
  }
  if (!b->targets.empty()) std::memcpy(targets, b->targets.data(), t * sizeof(int32_t));
  if (tp_.enabled()) {
    // Each rank holds part of the vocabulary, and its ops cannot tell a bad id from one of
    // another rank's rows: the whole vocabulary is checked here.
    const int64_t v = full_config_.vocab_size;
    for (size_t i = 0; i < t; ++i) {
      if (inputs[i] < 0 || inputs[i] >= v) {
        return InvalidArgumentError(fmt::format(
            "LlamaModel: token id {} at position {} is outside [0, {})", inputs[i], i, v));
      }
      if (targets[i] != cpu::kIgnoreIndex && (targets[i] < 0 || targets[i] >= v)) {
        return InvalidArgumentError(fmt::format(
            "LlamaModel: target {} at position {} is outside [0, {}) and is not the ignore index "
            "{}",
            targets[i], i, v, cpu::kIgnoreIndex));
      }
    }
  }
  size_t upload = 2 * st.tokens;
  if (packed) {
    std::memcpy(st.host_tokens + 2 * t, b->positions.data(), t * sizeof(int32_t));
    std::memcpy(st.host_tokens + 3 * t, b->key_start.data(), t * sizeof(int32_t));
    upload = 4 * st.tokens;
  }
  STRATA_RETURN_IF_ERROR(device_.CopyAsync(st.a.tokens, st.host_tokens, upload * sizeof(int32_t),
                                           device::CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(device_.Record(*st.upload_done, stream));
  const double weight = b->loss_weight;
  // The head's chunks (LlamaHeadChunkTokens): each one's share of the counted targets.
  std::vector<float> share;
  if (st.a.head_chunk < t) {
    std::vector<size_t> counted;
    size_t total = 0;
    for (size_t c0 = 0; c0 < t; c0 += st.a.head_chunk) {
      const size_t end = std::min(t, c0 + st.a.head_chunk);
      counted.push_back(static_cast<size_t>(
          std::count_if(targets + c0, targets + end,
                        [](int32_t target) { return target != cpu::kIgnoreIndex; })));
      total += counted.back();
    }
    for (const size_t n : counted) {
      share.push_back(total == 0 ? 0.0f
                                 : static_cast<float>(static_cast<double>(n) /
                                                      static_cast<double>(total)));
    }
  }
  return Run(
      stream,
      [this, loss_scale, weight, packed, share = std::move(share)](LlamaOps&) {
        state_->chunk_share = share;
        state_->loss_scale = static_cast<float>(loss_scale * weight);
        state_->loss_weight = weight;
        state_->packed = packed;
        return Status::Ok();
      },
      "llama begin");
}

// A block's LoRA adapters, from its adapter unit's views (null entries: no adapter).
struct LlamaModel::Adapters {
  std::array<const void*, kLlamaProjections> a{}, b{};
  std::array<float*, kLlamaProjections> da{}, db{};
  device::DType dtype = device::DType::kF32;

  static Adapters Of(const LlamaLora& lora, const zero::UnitView& p, const zero::UnitView* g) {
    Adapters ad;
    ad.dtype = p.dtype;
    size_t slot = 0;
    for (size_t k = 0; k < kLlamaProjections; ++k) {
      if (!lora.targets[k]) continue;
      ad.a[k] = p.param(slot);
      ad.b[k] = p.param(slot + 1);
      if (g != nullptr) {
        ad.da[k] = G(*g, slot);
        ad.db[k] = G(*g, slot + 1);
      }
      slot += 2;
    }
    return ad;
  }
};

// A block's parameters (BlockParam) and their gradients, from its whole unit or from one part's
// unit (the other parts' entries null, as those the config does not have). A null gradient:
// frozen.
struct LlamaModel::BlockWeights {
  std::array<const void*, kBlockParams> w{};
  std::array<float*, kBlockParams> g{};
  device::DType dtype = device::DType::kF32;

  Weight W(int i) const { return Weight{w[static_cast<size_t>(i)], dtype}; }
  float* G(int i) const { return g[static_cast<size_t>(i)]; }
  bool Has(int i) const { return w[static_cast<size_t>(i)] != nullptr; }
  static BlockWeights Of(const LlamaConfig& c, LlamaUnit::Part part, const zero::UnitView& p,
                         const zero::UnitView* g) {
    BlockWeights bw;
    bw.dtype = p.dtype;
    const std::vector<BlockParam> slots = PartSlots(c, part);
    for (size_t i = 0; i < slots.size(); ++i) {
      bw.w[static_cast<size_t>(slots[i])] = p.param(i);
      if (g != nullptr) bw.g[static_cast<size_t>(slots[i])] = strata::model::G(*g, i);
    }
    return bw;
  }
};

Status LlamaModel::Forward(int unit, const zero::UnitView& params, device::Stream& stream) {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  // An adapter unit computes nothing of its own: its block reads it (ForwardShared).
  if (where.kind == LlamaUnit::kAdapter) return Status::Ok();
  if (where.kind == LlamaUnit::kBlock && lora_.enabled()) {
    return InternalError("llama: a block with LoRA adapters needs its adapter unit (ForwardShared)");
  }
  zero::UnitView p = params;
  STRATA_RETURN_IF_ERROR(BeforeForward(where, stream));
  STRATA_RETURN_IF_ERROR(Run(
      stream,
      [this, where, p](LlamaOps& ops) -> Status {
        State& st = *state_;
        const size_t h = static_cast<size_t>(config_.hidden_size);
        if (where.kind == LlamaUnit::kEmbed) {
          if (!tp_.enabled()) {
            return ops.EmbeddingForward(st.a.tokens, st.tokens, W(p, 0),
                                        static_cast<size_t>(config_.vocab_size), h, st.a.In(0));
          }
          // This rank's rows, zeros for the others' tokens, summed over the group.
          const Status looked_up = ops.ShardEmbeddingForward(
              st.a.tokens, st.tokens, W(p, 0), VocabBegin(), static_cast<size_t>(config_.vocab_size),
              h, st.a.In(0));
          return looked_up.ok() ? TpAllReduce(st.a.In(0), st.tokens * h) : looked_up;
        }
        if (where.kind == LlamaUnit::kHead) {
          if (config_.tie_word_embeddings) {
            return InternalError("llama: the tied head needs the embedding unit (ForwardShared)");
          }
          return HeadForward(ops, p, p.param(1));
        }
        return BlockForward(ops, where.layer, where.part, BlockWeights::Of(config_, where.part, p, nullptr),
                            nullptr);
      },
      "llama forward"));
  return AfterForward(where, stream);
}

Status LlamaModel::Backward(int unit, const zero::UnitView& params, const zero::UnitView& grads,
                            device::Stream& stream) {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  // An adapter unit's gradient was added by its block's BackwardShared.
  if (where.kind == LlamaUnit::kAdapter) return Status::Ok();
  if (where.kind == LlamaUnit::kBlock && lora_.enabled()) {
    return InternalError("llama: a block with LoRA adapters needs its adapter unit (BackwardShared)");
  }
  zero::UnitView p = params, g = grads;
  STRATA_RETURN_IF_ERROR(BeforeBackward(where, stream));
  STRATA_RETURN_IF_ERROR(Run(
      stream,
      [this, where, p, g](LlamaOps& ops) -> Status {
        State& st = *state_;
        const size_t h = static_cast<size_t>(config_.hidden_size);
        if (where.kind == LlamaUnit::kEmbed) {
          if (g.data == nullptr) return Status::Ok();  // frozen: nothing to compute
          if (tp_.enabled()) {
            return ops.ShardEmbeddingBackward(st.a.tokens, st.tokens, st.a.dres, VocabBegin(),
                                              static_cast<size_t>(config_.vocab_size), h, G(g, 0),
                                              static_cast<int32_t>(config_.pad_token_id));
          }
          return ops.EmbeddingBackward(st.a.tokens, st.tokens, st.a.dres,
                                       static_cast<size_t>(config_.vocab_size), h, G(g, 0),
                                       static_cast<int32_t>(config_.pad_token_id));
        }
        if (where.kind == LlamaUnit::kHead) {
          if (config_.tie_word_embeddings) {
            return InternalError("llama: the tied head needs the embedding unit (BackwardShared)");
          }
          return HeadBackward(ops, p, g, p.param(1), G(g, 1));
        }
        return BlockBackward(ops, where.layer, where.part, BlockWeights::Of(config_, where.part, p, &g),
                             nullptr);
      },
      "llama backward"));
  return AfterBackward(where, stream);
}

std::vector<int> LlamaModel::SharedUnits(int unit) const {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  if (where.kind == LlamaUnit::kHead && config_.tie_word_embeddings) return {0};
  if (where.kind == LlamaUnit::kBlock && lora_.enabled()) return {unit - 1};  // its adapters
  return {};
}

std::vector<int> LlamaModel::RecomputeUnits(int unit) const {
  return LlamaRecomputeUnits(config_, unit, split_blocks_, state_->a.blocks.size() > 1);
}

Status LlamaModel::Recompute(int unit, const zero::UnitView& params, device::Stream& stream) {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  if (where.kind != LlamaUnit::kBlock || where.part == LlamaUnit::kWhole) {
    return InternalError(fmt::format("llama: unit {} has nothing to recompute", unit));
  }
  zero::UnitView p = params;
  STRATA_RETURN_IF_ERROR(BeforeBackward(where, stream));  // the block's input, back on the device
  return Run(
      stream,
      [this, where, p](LlamaOps& ops) {
        const CAct x = state_->a.In(where.layer);
        return BlockPartForward(ops, where.layer, where.part,
                                BlockWeights::Of(config_, where.part, p, nullptr), nullptr, x,
                                Act());
      },
      "llama recompute");
}

Status LlamaModel::ForwardShared(int unit, std::span<const zero::UnitView> params,
                                 device::Stream& stream) {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  if (SharedUnits(unit).empty() || params.size() != 2) {
    return InternalError(fmt::format("llama: unit {} shares no parameters", unit));
  }
  zero::UnitView p = params[0], other = params[1];
  if (where.kind == LlamaUnit::kBlock) {
    STRATA_RETURN_IF_ERROR(BeforeForward(where, stream));
    STRATA_RETURN_IF_ERROR(Run(
        stream,
        [this, where, p, other](LlamaOps& ops) {
          const Adapters ad = Adapters::Of(lora_, other, nullptr);
          return BlockForward(ops, where.layer, where.part,
                              BlockWeights::Of(config_, where.part, p, nullptr), &ad);
        },
        "llama forward"));
    return AfterForward(where, stream);
  }
  return Run(
      stream, [this, p, other](LlamaOps& ops) { return HeadForward(ops, p, other.param(0)); },
      "llama forward");
}

Status LlamaModel::BackwardShared(int unit, std::span<const zero::UnitView> params,
                                  std::span<const zero::UnitView> grads, device::Stream& stream) {
  const LlamaUnit where = LlamaUnitAt(config_, lora_, unit, split_blocks_);
  if (SharedUnits(unit).empty() || params.size() != 2 || grads.size() != 2) {
    return InternalError(fmt::format("llama: unit {} shares no parameters", unit));
  }
  zero::UnitView p = params[0], other = params[1], g = grads[0], gother = grads[1];
  if (where.kind == LlamaUnit::kBlock) {
    STRATA_RETURN_IF_ERROR(BeforeBackward(where, stream));
    STRATA_RETURN_IF_ERROR(Run(
        stream,
        [this, where, p, other, g, gother](LlamaOps& ops) {
          const Adapters ad = Adapters::Of(lora_, other, &gother);
          return BlockBackward(ops, where.layer, where.part, BlockWeights::Of(config_, where.part, p, &g),
                               &ad);
        },
        "llama backward"));
    return AfterBackward(where, stream);
  }
  return Run(
      stream,
      [this, p, other, g, gother](LlamaOps& ops) {
        return HeadBackward(ops, p, g, other.param(0), G(gother, 0));
      },
      "llama backward");
}

Result<double> LlamaModel::EndMicroBatch(device::Stream& stream) {
  State& st = *state_;
  // The one read-back of the micro-batch: the loss, through registered memory.
  STRATA_RETURN_IF_ERROR(device_.CopyAsync(st.host_loss, st.a.loss, sizeof(float),
                                           device::CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(device_.Synchronize(stream));
  if (st.cuda_ops) STRATA_RETURN_IF_ERROR(st.cuda_ops->CheckDataErrors());
  if (st.profiler != nullptr) STRATA_RETURN_IF_ERROR(st.profiler->Collect());
  return static_cast<double>(*st.host_loss) * st.loss_weight;
}

// ---- offloaded activation checkpoints -----------------------------------------------------------
//
// Block j's input (j < a.offloaded) lives in device slot j % 2 from its writer's forward (the
// embedding, or block j - 1) to block j + 1's forward, which writes block j + 2's input into the
// same slot; the copy stream takes it to host memory in between, beside block j's forward. In
// backward it comes back into the same slot once block j + 2's backward has read its own input
// there, beside block j + 1's backward. Every copy starts after a point of the caller's stream
// (ckpt_ready) and the compute that overwrites or reads the slot waits for the copy's event.

// Block `layer`'s input between its device slot and host memory (to the host in forward, back
// for backward), on the copy stream after the work enqueued on `stream` so far.
Status LlamaModel::CopyCheckpoint(int layer, bool to_host, device::Stream& stream) {
  State& st = *state_;
  if (layer < 0 || layer >= st.a.offloaded) return Status::Ok();
  const size_t slot = static_cast<size_t>(layer % 2);
  STRATA_RETURN_IF_ERROR(device_.Record(*st.ckpt_ready, stream));
  STRATA_RETURN_IF_ERROR(device_.Wait(*st.ckpt_stream, *st.ckpt_ready));
  const size_t bytes = st.a.th * device::DTypeSize(st.a.act);
  void* host = static_cast<char*>(st.ckpt_host.data()) + static_cast<size_t>(layer) * bytes;
  void* dev = st.a.In(layer).data;
  STRATA_RETURN_IF_ERROR(
      device_.CopyAsync(to_host ? host : dev, to_host ? dev : host, bytes,
                        to_host ? device::CopyKind::kDeviceToHost : device::CopyKind::kHostToDevice,
                        *st.ckpt_stream));
  return device_.Record(to_host ? *st.ckpt_saved[slot] : *st.ckpt_loaded[slot], *st.ckpt_stream);
}

// Work enqueued on `stream` from now on waits for block `layer`'s last copy that way.
Status LlamaModel::WaitCheckpoint(int layer, bool to_host, device::Stream& stream) {
  State& st = *state_;
  if (layer < 0 || layer >= st.a.offloaded) return Status::Ok();
  const size_t slot = static_cast<size_t>(layer % 2);
  return device_.Wait(stream, to_host ? *st.ckpt_saved[slot] : *st.ckpt_loaded[slot]);
}

// The embedding writes block 0's input; a block's whole unit or down part writes the next
// block's, into the slot of the input two blocks back, which must have reached host memory.
Status LlamaModel::BeforeForward(const LlamaUnit& where, device::Stream& stream) {
  if (where.kind != LlamaUnit::kBlock) return Status::Ok();
  if (where.part != LlamaUnit::kWhole && where.part != LlamaUnit::kMlpDown) return Status::Ok();
  return WaitCheckpoint(where.layer - 1, /*to_host=*/true, stream);
}

Status LlamaModel::AfterForward(const LlamaUnit& where, device::Stream& stream) {
  if (where.kind == LlamaUnit::kEmbed) return CopyCheckpoint(0, /*to_host=*/true, stream);
  if (where.kind != LlamaUnit::kBlock) return Status::Ok();
  if (where.part != LlamaUnit::kWhole && where.part != LlamaUnit::kMlpDown) return Status::Ok();
  return CopyCheckpoint(where.layer + 1, /*to_host=*/true, stream);
}

// A block's backward and recomputation read its input; its whole unit's or attention part's
// backward is the last to, after which the slot takes the input two blocks down.
Status LlamaModel::BeforeBackward(const LlamaUnit& where, device::Stream& stream) {
  if (where.kind != LlamaUnit::kBlock) return Status::Ok();
  return WaitCheckpoint(where.layer, /*to_host=*/false, stream);
}

Status LlamaModel::AfterBackward(const LlamaUnit& where, device::Stream& stream) {
  if (where.kind != LlamaUnit::kBlock) return Status::Ok();
  if (where.part != LlamaUnit::kWhole && where.part != LlamaUnit::kAttn) return Status::Ok();
  return CopyCheckpoint(where.layer - 2, /*to_host=*/false, stream);
}

// ---- the blocks ---------------------------------------------------------------------------------

// y = x W^T, plus the adapter's scale (x A^T) B^T: x A^T goes to lora_x[proj] and is scaled
// there (what backward needs), its product with B^T to lora_out, then added to y. y null: only
// lora_x (the block's recompute of the down projection, whose output backward does not need).
// Projection `proj` (0..6) is block parameter proj + 1 (after the input norm) for q, k, v, o and
// proj + 2 (after the post-attention norm) for gate, up, down.
Status LlamaModel::Project(LlamaOps& ops, int layer, const Adapters* ad, int proj, CAct x,
                           const BlockWeights& w, size_t in, size_t out, Act y) {
  const size_t t = state_->tokens;
  const int slot = proj < 4 ? proj + 1 : proj + 2;
  const int bias = kQBias + proj;
  // Tensor parallelism: o and down take this rank's columns of their input, so their products
  // (and the adapter's x A^T) are partial sums, summed over the group before the bias and the
  // adapter's output are added once.
  const bool split_input = tp_.enabled() && (proj == 3 || proj == 6);
  if (y) {
    STRATA_RETURN_IF_ERROR(ops.LinearForward(x, w.W(slot), t, in, out, y));
    if (split_input) STRATA_RETURN_IF_ERROR(TpAllReduce(y, t * out));
    if (w.Has(bias)) STRATA_RETURN_IF_ERROR(ops.BiasForward(y, w.W(bias), t, out));
  }
  const size_t k = static_cast<size_t>(proj);
  if (ad == nullptr || ad->a[k] == nullptr) return Status::Ok();
  LlamaActivations& a = state_->a;
  LlamaActivations::Internals& bi = a.Of(layer);
  const size_t r = static_cast<size_t>(lora_.rank);
  STRATA_RETURN_IF_ERROR(ops.LinearForward(x, Weight{ad->a[k], ad->dtype}, t, in, r, bi.lora_x[k]));
  if (split_input) STRATA_RETURN_IF_ERROR(TpAllReduce(bi.lora_x[k], t * r));
  STRATA_RETURN_IF_ERROR(ops.Scale(bi.lora_x[k], t * r, lora_.scale));
  if (!y) return Status::Ok();
  STRATA_RETURN_IF_ERROR(
      ops.LinearForward(bi.lora_x[k], Weight{ad->b[k], ad->dtype}, t, r, out, a.lora_out));
  return ops.AccumulateGradient(a.lora_out, t * out, y);  // y += the adapter's output
}

// The base projection's backward (its weight gradient null: frozen), then the adapter's:
// dB += dy^T (s x A^T), d(x A^T) = s dy B, dA += d(x A^T)^T x, dx += d(x A^T) A.
Status LlamaModel::ProjectBackward(LlamaOps& ops, int layer, const Adapters* ad, int proj, CAct x,
                                   const BlockWeights& w, CAct dy, size_t in, size_t out, Act dx,
                                   bool dx_add) {
  const size_t t = state_->tokens;
  const int slot = proj < 4 ? proj + 1 : proj + 2;
  const int bias = kQBias + proj;
  STRATA_RETURN_IF_ERROR(ops.LinearBackward(x, w.W(slot), dy, t, in, out, dx,
                                            dx_add ? Accumulate::kAdd : Accumulate::kOverwrite,
                                            w.G(slot)));
  if (w.Has(bias) && w.G(bias) != nullptr) {
    STRATA_RETURN_IF_ERROR(ops.BiasBackward(dy, t, out, w.G(bias)));
  }
  const size_t k = static_cast<size_t>(proj);
  if (ad == nullptr || ad->a[k] == nullptr) return Status::Ok();
  LlamaActivations& a = state_->a;
  LlamaActivations::Internals& bi = a.Of(layer);
  const size_t r = static_cast<size_t>(lora_.rank);
  STRATA_RETURN_IF_ERROR(ops.LinearBackward(bi.lora_x[k], Weight{ad->b[k], ad->dtype}, dy, t, r,
                                            out, a.lora_dx, Accumulate::kOverwrite, ad->db[k]));
  STRATA_RETURN_IF_ERROR(ops.Scale(a.lora_dx, t * r, lora_.scale));
  return ops.LinearBackward(x, Weight{ad->a[k], ad->dtype}, a.lora_dx, t, in, r, dx,
                            Accumulate::kAdd, ad->da[k]);
}

// One part of a block's forward from the block input x into the activation buffers; kMlpDown
// also writes the block's output to `out` (null: only what backward needs).
//   attention: h1 = norm(x), q k v (with Qwen3's norm of each head of q and k), rope,
//              attention, x2 = x + attn o^T (with a whole block's weights, h2 = norm(x2) in
//              the same pass)
//   gate:      h2 = norm(x2) (unless the attention part did), gate = h2 Wgate^T
//   up:        up = h2 Wup^T, hm = silu(gate) * up
//   down:      out = x2 + hm Wdown^T
Status LlamaModel::BlockPartForward(LlamaOps& ops, int layer, LlamaUnit::Part part,
                                    const BlockWeights& w, const Adapters* ad, CAct x, Act out) {
  LlamaActivations::Internals& bi = state_->a.Of(layer);
  const LlamaConfig& c = config_;
  const size_t t = state_->tokens, h = static_cast<size_t>(c.hidden_size);
  const size_t kv = static_cast<size_t>(c.kv_dim()), inter = static_cast<size_t>(c.intermediate_size);
  const size_t nh = static_cast<size_t>(c.num_attention_heads);
  const size_t nkv = static_cast<size_t>(c.num_key_value_heads);
  const size_t d = static_cast<size_t>(c.head_dim()), q = static_cast<size_t>(c.q_dim());
  const size_t b = static_cast<size_t>(micro_batch_), s = static_cast<size_t>(seq_len_);
  const float eps = static_cast<float>(c.rms_norm_eps), theta = static_cast<float>(c.rope_theta);
  const RopeScaling& rope = c.rope_scaling;
  const int32_t* positions = state_->packed ? state_->a.positions() : nullptr;
  const int32_t* key_start = state_->packed ? state_->a.key_start() : nullptr;
  switch (part) {
    case LlamaUnit::kWhole:
      for (LlamaUnit::Part p : {LlamaUnit::kAttn, LlamaUnit::kMlpGate, LlamaUnit::kMlpUp,
                                LlamaUnit::kMlpDown}) {
        STRATA_RETURN_IF_ERROR(BlockPartForward(ops, layer, p, w, ad, x, out));
      }
      return Status::Ok();
    case LlamaUnit::kAttn:
      STRATA_RETURN_IF_ERROR(ops.RmsNormForward(x, w.W(kInNorm), t, h, eps, bi.h1, bi.rstd1));
      if (c.qk_norm) {
        // q_norm(q_proj(h1)) per head, and k's likewise (Qwen3).
        STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 0, bi.h1, w, h, q, bi.q_pre));
        STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 1, bi.h1, w, h, kv, bi.k_pre));
        STRATA_RETURN_IF_ERROR(
            ops.RmsNormForward(bi.q_pre, w.W(kQNorm), t * nh, d, eps, bi.q, bi.q_rstd));
        STRATA_RETURN_IF_ERROR(
            ops.RmsNormForward(bi.k_pre, w.W(kKNorm), t * nkv, d, eps, bi.k, bi.k_rstd));
      } else {
        STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 0, bi.h1, w, h, q, bi.q));
        STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 1, bi.h1, w, h, kv, bi.k));
      }
      STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 2, bi.h1, w, h, kv, bi.v));
      STRATA_RETURN_IF_ERROR(ops.RopeForward(bi.q, b, s, nh, d, theta, rope, positions));
      STRATA_RETURN_IF_ERROR(ops.RopeForward(bi.k, b, s, nkv, d, theta, rope, positions));
      STRATA_RETURN_IF_ERROR(ops.AttentionForward(bi.q, bi.k, bi.v, b, s, nh, nkv, d, bi.attn,
                                                  bi.attn_lse, AttentionDType(w.dtype), key_start));
      STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 3, bi.attn, w, q, h, bi.x2));
      // A whole block's weights hold the post-attention norm's: the residual add and that norm
      // in one pass (the gate part then has its input).
      if (w.Has(kPostNorm)) {
        return ops.ResidualRmsNormForward(x, bi.x2, w.W(kPostNorm), t, h, eps, bi.x2, bi.h2,
                                          bi.rstd2);
      }
      return ops.ResidualAdd(x, bi.x2, t * h, bi.x2);
    case LlamaUnit::kMlpGate:
      if (!w.Has(kInNorm)) {  // the attention part's unit of a split block stopped at the add
        STRATA_RETURN_IF_ERROR(
            ops.RmsNormForward(bi.x2, w.W(kPostNorm), t, h, eps, bi.h2, bi.rstd2));
      }
      return Project(ops, layer, ad, 4, bi.h2, w, h, inter, bi.gate);
    case LlamaUnit::kMlpUp:
      STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 5, bi.h2, w, h, inter, bi.up));
      return ops.SiluMulForward(bi.gate, bi.up, t * inter, bi.hm);
    case LlamaUnit::kMlpDown:
      STRATA_RETURN_IF_ERROR(Project(ops, layer, ad, 6, bi.hm, w, inter, h, out));
      if (out) STRATA_RETURN_IF_ERROR(ops.ResidualAdd(bi.x2, out, t * h, out));
      return Status::Ok();
  }
  return Status::Ok();
}

Status LlamaModel::BlockForward(LlamaOps& ops, int layer, LlamaUnit::Part part,
                                const BlockWeights& w, const Adapters* ad) {
  const LlamaActivations& a = state_->a;
  return BlockPartForward(ops, layer, part, w, ad, a.In(layer), a.In(layer + 1));
}

// One part of a block's backward, from dres (the gradient of the block's output) and the
// internals of its forward:
//   down:      dhm = dres Wdown
//   up:        dgate (in dhm's buffer), dup = silu-mul backward; dh2 = dup Wup
//   gate:      dh2 += dgate Wgate; dx2 = norm backward + dres
//   attention: the rest, to dres_next (x's gradient), then swaps dres and dres_next
Status LlamaModel::BlockPartBackward(LlamaOps& ops, int layer, LlamaUnit::Part part,
                                     const BlockWeights& w, const Adapters* ad, CAct x) {
  State& st = *state_;
  LlamaActivations& a = st.a;
  const LlamaConfig& c = config_;
  const size_t t = st.tokens, h = static_cast<size_t>(c.hidden_size);
  const size_t kv = static_cast<size_t>(c.kv_dim()), inter = static_cast<size_t>(c.intermediate_size);
  const size_t nh = static_cast<size_t>(c.num_attention_heads);
  const size_t nkv = static_cast<size_t>(c.num_key_value_heads);
  const size_t d = static_cast<size_t>(c.head_dim()), q = static_cast<size_t>(c.q_dim());
  const size_t b = static_cast<size_t>(micro_batch_), s = static_cast<size_t>(seq_len_);
  const float theta = static_cast<float>(c.rope_theta);
  const RopeScaling& rope = c.rope_scaling;
  const int32_t* positions = st.packed ? a.positions() : nullptr;
  const int32_t* key_start = st.packed ? a.key_start() : nullptr;
  LlamaActivations::Internals& bi = a.Of(layer);
  const CAct dres = a.dres;  // d out, [T, H]
  const Act dgate = a.dhm;
  switch (part) {
    case LlamaUnit::kWhole:
      for (LlamaUnit::Part p : {LlamaUnit::kMlpDown, LlamaUnit::kMlpUp, LlamaUnit::kMlpGate,
                                LlamaUnit::kAttn}) {
        STRATA_RETURN_IF_ERROR(BlockPartBackward(ops, layer, p, w, ad, x));
      }
      return Status::Ok();
    case LlamaUnit::kMlpDown:
      return ProjectBackward(ops, layer, ad, 6, bi.hm, w, dres, inter, h, a.dhm, false);
    case LlamaUnit::kMlpUp:
      STRATA_RETURN_IF_ERROR(ops.SiluMulBackward(bi.gate, bi.up, a.dhm, t * inter, dgate, a.dup));
      STRATA_RETURN_IF_ERROR(
          ProjectBackward(ops, layer, ad, 5, bi.h2, w, a.dup, h, inter, a.dh2, false));
      return ReducePartialGradients(part, w, ad);
    case LlamaUnit::kMlpGate:
      STRATA_RETURN_IF_ERROR(ProjectBackward(ops, layer, ad, 4, bi.h2, w, dgate, h, inter, a.dh2,
                                             true));
      // Tensor parallelism: each rank's gate and up rows gave part of h2's gradient.
      STRATA_RETURN_IF_ERROR(TpAllReduce(a.dh2, t * h));
      // The norm's input gradient plus the residual path's.
      STRATA_RETURN_IF_ERROR(ops.RmsNormResidualBackward(bi.x2, w.W(kPostNorm), bi.rstd2, a.dh2,
                                                         dres, t, h, a.dx2, w.G(kPostNorm)));
      return ReducePartialGradients(part, w, ad);
    case LlamaUnit::kAttn:
      STRATA_RETURN_IF_ERROR(ProjectBackward(ops, layer, ad, 3, bi.attn, w, a.dx2, q, h, a.dattn,
                                             false));
      STRATA_RETURN_IF_ERROR(ops.AttentionBackward(bi.q, bi.k, bi.v, bi.attn, bi.attn_lse, a.dattn,
                                                   b, s, nh, nkv, d, a.dq, a.dk, a.dv,
                                                   AttentionDType(w.dtype), key_start));
      STRATA_RETURN_IF_ERROR(ops.RopeBackward(a.dq, b, s, nh, d, theta, rope, positions));
      STRATA_RETURN_IF_ERROR(ops.RopeBackward(a.dk, b, s, nkv, d, theta, rope, positions));
      if (c.qk_norm) {  // in place: dq, dk become the projections' output gradients
        STRATA_RETURN_IF_ERROR(ops.RmsNormBackward(bi.q_pre, w.W(kQNorm), bi.q_rstd, a.dq, t * nh,
                                                   d, a.dq, w.G(kQNorm)));
        STRATA_RETURN_IF_ERROR(ops.RmsNormBackward(bi.k_pre, w.W(kKNorm), bi.k_rstd, a.dk, t * nkv,
                                                   d, a.dk, w.G(kKNorm)));
      }
      STRATA_RETURN_IF_ERROR(ProjectBackward(ops, layer, ad, 0, bi.h1, w, a.dq, h, q, a.dh1, false));
      STRATA_RETURN_IF_ERROR(ProjectBackward(ops, layer, ad, 1, bi.h1, w, a.dk, h, kv, a.dh1, true));
      STRATA_RETURN_IF_ERROR(ProjectBackward(ops, layer, ad, 2, bi.h1, w, a.dv, h, kv, a.dh1, true));
      // Tensor parallelism: each rank's heads gave part of h1's gradient.
      STRATA_RETURN_IF_ERROR(TpAllReduce(a.dh1, t * h));
      STRATA_RETURN_IF_ERROR(ops.RmsNormResidualBackward(x, w.W(kInNorm), bi.rstd1, a.dh1, a.dx2, t,
                                                         h, a.dres_next, w.G(kInNorm)));
      std::swap(a.dres, a.dres_next);
      return ReducePartialGradients(part, w, ad);
  }
  return Status::Ok();
}

Status LlamaModel::BlockBackward(LlamaOps& ops, int layer, LlamaUnit::Part part,
                                 const BlockWeights& w, const Adapters* ad) {
  State& st = *state_;
  LlamaActivations& a = st.a;
  const CAct x = a.In(layer);
  // Activation checkpointing (whole blocks only): one set of internals, holding the last block's
  // from forward (the first backward), the others' recomputed from their inputs.
  if (part == LlamaUnit::kWhole && a.blocks.size() == 1 && layer != config_.num_hidden_layers - 1) {
    STRATA_RETURN_IF_ERROR(BlockPartForward(ops, layer, LlamaUnit::kWhole, w, ad, x, Act()));
  }
  return BlockPartBackward(ops, layer, part, w, ad, x);
}

Status LlamaModel::HeadForward(LlamaOps& ops, const zero::UnitView& p, const void* lm) {
  State& st = *state_;
  LlamaActivations& a = st.a;
  const size_t t = st.tokens, h = static_cast<size_t>(config_.hidden_size);
  const size_t v = static_cast<size_t>(config_.vocab_size);
  const CAct x = a.In(config_.num_hidden_layers);
  STRATA_RETURN_IF_ERROR(ops.RmsNormForward(x, W(p, 0), t, h,
                                            static_cast<float>(config_.rms_norm_eps), a.head_x,
                                            a.head_rstd));
  const cpu::Weight head{lm, p.dtype};
  if (a.head_chunk < t) {
    // Chunk by chunk (LlamaHeadChunkTokens): the loss is the chunks' mean losses weighted by
    // their shares of the counted targets.
    for (size_t c0 = 0, i = 0; c0 < t; c0 += a.head_chunk, ++i) {
      const size_t n = std::min(a.head_chunk, t - c0);
      float* loss = i == 0 ? a.loss : a.chunk_loss;
      STRATA_RETURN_IF_ERROR(ops.LinearForward(a.head_x.At(c0 * h), head, n, h, v, a.logits));
      STRATA_RETURN_IF_ERROR(ops.CrossEntropyForward(a.logits, a.tokens + t + c0, n, v,
                                                     cpu::kIgnoreIndex, a.lse + c0, loss));
      STRATA_RETURN_IF_ERROR(ops.Scale(loss, 1, st.chunk_share[i]));
      if (i > 0) STRATA_RETURN_IF_ERROR(ops.AccumulateGradient(a.chunk_loss, 1, a.loss));
    }
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(ops.LinearForward(a.head_x, head, t, h, v, a.logits));
  if (!tp_.enabled()) {
    return ops.CrossEntropyForward(a.logits, a.tokens + t, t, v, cpu::kIgnoreIndex, a.lse, a.loss);
  }
  // This rank's logits are a slice of the vocabulary: the log-sum-exp from the group's maxima and
  // sums (cpu_ops.h), the target's logit from the rank that holds it.
  STRATA_RETURN_IF_ERROR(ops.CrossEntropyShardMax(a.logits, t, v, a.ce_max));
  STRATA_RETURN_IF_ERROR(TpAllReduce(a.ce_max, t, comm::ReduceOp::kMax));
  STRATA_RETURN_IF_ERROR(ops.CrossEntropyShardSums(a.logits, a.tokens + t, t, VocabBegin(), v,
                                                   cpu::kIgnoreIndex, a.ce_max, a.ce_sums));
  STRATA_RETURN_IF_ERROR(TpAllReduce(a.ce_sums, 2 * t));
  return ops.CrossEntropyShardFinish(a.tokens + t, t, cpu::kIgnoreIndex, a.ce_max, a.ce_sums,
                                     a.lse, a.loss);
}

Status LlamaModel::HeadBackward(LlamaOps& ops, const zero::UnitView& p, const zero::UnitView& g,
                                const void* lm, float* dlm) {
  State& st = *state_;
  LlamaActivations& a = st.a;
  const size_t t = st.tokens, h = static_cast<size_t>(config_.hidden_size);
  const size_t v = static_cast<size_t>(config_.vocab_size);
  const Act dlogits = a.logits;  // in place
  const Act dxn = a.dh1;         // free until the next block's backward
  const cpu::Weight head{lm, p.dtype};
  if (a.head_chunk < t) {
    // Chunk by chunk: the chunk's logits again, then its gradient, scaled by its share of the
    // counted targets (CrossEntropyBackward divides by the chunk's own count), and its rows of
    // the input's gradient and its part of the head's.
    for (size_t c0 = 0, i = 0; c0 < t; c0 += a.head_chunk, ++i) {
      const size_t n = std::min(a.head_chunk, t - c0);
      STRATA_RETURN_IF_ERROR(ops.LinearForward(a.head_x.At(c0 * h), head, n, h, v, a.logits));
      STRATA_RETURN_IF_ERROR(ops.CrossEntropyBackward(a.logits, a.tokens + t + c0, a.lse + c0, n,
                                                      v, cpu::kIgnoreIndex,
                                                      st.loss_scale * st.chunk_share[i], dlogits));
      STRATA_RETURN_IF_ERROR(ops.LinearBackward(a.head_x.At(c0 * h), head, dlogits, n, h, v,
                                                dxn.At(c0 * h), Accumulate::kOverwrite, dlm));
    }
    const CAct x = a.In(config_.num_hidden_layers);
    return ops.RmsNormBackward(x, W(p, 0), a.head_rstd, dxn, t, h, a.dres, G(g, 0));
  }
  if (tp_.enabled()) {
    STRATA_RETURN_IF_ERROR(ops.CrossEntropyShardBackward(a.logits, a.tokens + t, a.lse, t,
                                                         VocabBegin(), v, cpu::kIgnoreIndex,
                                                         st.loss_scale, dlogits));
  } else {
    STRATA_RETURN_IF_ERROR(ops.CrossEntropyBackward(a.logits, a.tokens + t, a.lse, t, v,
                                                    cpu::kIgnoreIndex, st.loss_scale, dlogits));
  }
  STRATA_RETURN_IF_ERROR(
      ops.LinearBackward(a.head_x, head, dlogits, t, h, v, dxn, Accumulate::kOverwrite, dlm));
  // Tensor parallelism: each rank's vocabulary rows gave part of the input's gradient.
  STRATA_RETURN_IF_ERROR(TpAllReduce(dxn, t * h));
  const CAct x = a.In(config_.num_hidden_layers);
  return ops.RmsNormBackward(x, W(p, 0), a.head_rstd, dxn, t, h, a.dres, G(g, 0));
}

int LlamaModel::TensorParallelCopies(int unit, size_t param) const {
  if (!tp_.enabled()) return 0;
  const std::vector<zero::ParamSpec> params = LlamaUnitParams(config_, unit, lora_, split_blocks_);
  if (param >= params.size()) return 0;
  const std::string& name = params[param].name;
  if (LlamaTensorParallelSlice(full_config_, tp_.rank, tp_.size, name).dim < 0) return 0;
  // Fewer KV heads than ranks: k and v rows (and what is split with them) on several ranks.
  const int64_t kv = full_config_.num_key_value_heads;
  const bool kv_part = (name.find(".k_proj.") != std::string::npos ||
                        name.find(".v_proj.") != std::string::npos);
  return kv_part && kv < tp_.size ? tp_.size / static_cast<int>(kv) : 1;
}

Status LlamaModel::ReducePartialGradients(LlamaUnit::Part part, const BlockWeights& w,
                                          const Adapters* ad) {
  if (!tp_.enabled()) return Status::Ok();
  const size_t h = static_cast<size_t>(config_.hidden_size);
  const size_t d = static_cast<size_t>(config_.head_dim());
  const size_t kv = static_cast<size_t>(config_.kv_dim());
  const size_t r = static_cast<size_t>(lora_.rank);
  auto reduce = [&](float* grad, size_t n, comm::Collective* group) {
    return grad == nullptr ? Status::Ok() : TpAllReduce(grad, n, comm::ReduceOp::kSum, group);
  };
  // The adapter A of a projection split by rows sees the sum of every rank's rows' gradients.
  auto adapter_a = [&](int proj, size_t in) {
    return ad == nullptr ? Status::Ok() : reduce(ad->da[static_cast<size_t>(proj)], r * in, nullptr);
  };
  switch (part) {
    case LlamaUnit::kAttn: {
      // Qwen3's q and k norms are shared by every head; each rank has its own heads'.
      STRATA_RETURN_IF_ERROR(reduce(w.G(kQNorm), d, nullptr));
      STRATA_RETURN_IF_ERROR(reduce(w.G(kKNorm), d, nullptr));
      for (int proj = 0; proj < 3; ++proj) STRATA_RETURN_IF_ERROR(adapter_a(proj, h));
      comm::Collective* kv_group = state_->kv_group.get();
      if (kv_group == nullptr) return Status::Ok();
      // A replicated KV head: each of its ranks has its own query heads' part of its gradient.
      STRATA_RETURN_IF_ERROR(reduce(w.G(kK), kv * h, kv_group));
      STRATA_RETURN_IF_ERROR(reduce(w.G(kV), kv * h, kv_group));
      STRATA_RETURN_IF_ERROR(reduce(w.G(kKBias), kv, kv_group));
      STRATA_RETURN_IF_ERROR(reduce(w.G(kVBias), kv, kv_group));
      if (ad == nullptr) return Status::Ok();
      STRATA_RETURN_IF_ERROR(reduce(ad->db[1], kv * r, kv_group));
      return reduce(ad->db[2], kv * r, kv_group);
    }
    case LlamaUnit::kMlpGate:
      return adapter_a(4, h);
    case LlamaUnit::kMlpUp:
      return adapter_a(5, h);
    default:
      return Status::Ok();
  }
}

}  // namespace strata::model
