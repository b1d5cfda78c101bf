#include "train/plan.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <system_error>

#include "common/units.h"
#include "train/runtime.h"

namespace strata::train {
namespace {


double Div(double a, double b) { return b > 0 ? a / b : 0.0; }

uint64_t Mul(uint64_t a, double b) { return static_cast<uint64_t>(static_cast<double>(a) * b); }

// Ring collectives: an all-gather or reduce-scatter of a B-byte buffer puts B (W-1)/W bytes on
// each rank's link, an all-reduce twice that.
double Ring(double bytes, int world) {
  return world <= 1 ? 0.0 : bytes * static_cast<double>(world - 1) / world;
}

bool IsCuda(const EstimateInput& in) { return in.device == device::DeviceType::kCuda; }

}  // namespace

uint64_t Hardware::rank_device_budget() const {
  if (device_budget > 0) return device_budget;
  // The CUDA device's default budget (cuda_device.cc): free memory less max(512 MiB, 5%).
  const uint64_t margin = std::max<uint64_t>(512ull << 20, gpu_mem / 20);
  return gpu_mem > margin ? gpu_mem - margin : 0;
}

uint64_t Hardware::host_budget() const { return Mul(cpu_mem, host_fraction); }

Result<double> ParseRate(std::string_view text) {
  std::string_view t = text;
  if (t.size() >= 2 && t.substr(t.size() - 2) == "/s") t.remove_suffix(2);
  size_t n = 0;
  while (n < t.size() && (std::isdigit(static_cast<unsigned char>(t[n])) || t[n] == '.' ||
                          t[n] == 'e' || t[n] == 'E' || t[n] == '+' || t[n] == '-')) {
    // 'e' only as an exponent: a digit must follow it or its sign.
    if ((t[n] == 'e' || t[n] == 'E') &&
        (n + 1 >= t.size() || !(std::isdigit(static_cast<unsigned char>(t[n + 1])) ||
                                t[n + 1] == '+' || t[n + 1] == '-'))) {
      break;
    }
    ++n;
  }
  double value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + n, value);
  std::string_view unit = t.substr(n);
  double mult = 0;
  // "B" bytes, "b" bits ("400Gb/s", as network links are quoted).
  double bits = 1;
  if (!unit.empty() && unit.back() == 'B') {
    unit.remove_suffix(1);
  } else if (!unit.empty() && unit.back() == 'b') {
    unit.remove_suffix(1);
    bits = 8;
  }
  const bool binary = unit.size() == 2 && (unit[1] == 'i' || unit[1] == 'I');
  if (unit.empty()) {
    mult = 1;
  } else if (unit.size() == 1 || binary) {
    const char c = static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0])));
    const int power = c == 'K' ? 1 : c == 'M' ? 2 : c == 'G' ? 3 : c == 'T' ? 4 : c == 'P' ? 5 : 0;
    if (power > 0) mult = std::pow(binary ? 1024.0 : 1000.0, power);
  }
  if (n == 0 || ec != std::errc() || end != t.data() + n || mult == 0 || !(value > 0) ||
      !std::isfinite(value)) {
    return InvalidArgumentError(fmt::format(
        "'{}' is not a rate; expected a positive number with an optional unit and /s, e.g. "
        "25G/s, 12GB/s, 400Gb/s, 1.5e9 (K, M, G, T, P are powers of 1000; Ki, Mi, Gi, Ti, Pi of "
        "1024; B or nothing bytes, b bits)",
        text));
  }
  return value * mult / bits;
}

namespace {

// What the parts of EstimateTime read: the run's shape, per rank.
struct StepShape {
  StepShape(const EstimateInput& input, const MemoryEstimate& memory, const Hardware& hardware)
      : in(input), m(memory), hw(hardware), cfg(input.config) {}
  const EstimateInput& in;
  const MemoryEstimate& m;
  const Hardware& hw;
  const Config& cfg;
  int W = 1;           // ranks
  int stage = 0;
  double csz = 4;      // bytes of a parameter in the compute dtype
  double gas = 1;      // micro-batches per step
  double g = 1;        // ranks per node
  double N = 0;        // a full (gathered) model, padded
  double S = 0;        // one rank's shard
  double T = 1;        // the trainable share of the shard
  double S_cpu = 0;    // the offloaded part of the shard
  double tokens = 0;   // per rank per step
  bool copies = false;  // device memory is not host memory: host-device copies happen
  OffloadDevice param_dev = OffloadDevice::kNone;
  OffloadDevice optim_dev = OffloadDevice::kNone;
};

// Bytes and seconds the parts hand on to the critical path: during forward and backward
// (`_fb`), around the optimizer (`_opt`), and after it.
struct Traffic {
  double coll_fb = 0, coll_after = 0, coll_fb_s = 0, coll_after_s = 0;
  double fetch = 0;  // offloaded parameter shards brought to the device
  double h2d_fb = 0, d2h_fb = 0, h2d_opt = 0, d2h_after = 0;
  double read_fb = 0, write_opt = 0;
  double nvme_fb_s = 0, nvme_opt_s = 0;
};

StepShape ShapeOf(const EstimateInput& in, const MemoryEstimate& m, const Hardware& hw,
                  TimeEstimate* t) {
  StepShape sh(in, m, hw);
  const Config& cfg = in.config;
  sh.W = m.data_parallel;  // ZeRO's ranks (tensor parallelism: the data-parallel group)
  sh.stage = m.stage;
  sh.csz = cfg.precision() == Precision::kFp32 ? 4.0 : 2.0;
  sh.gas = static_cast<double>(std::max<int64_t>(
      1, ResolveBatchSizes(cfg.batch, sh.W).value_or(BatchSizes{}).gradient_accumulation_steps));
  // The data-parallel group's ranks per node (a tensor-parallel group takes tensor_parallel of
  // a node's ranks).
  sh.g = std::max(1, hw.gpus_per_node / std::max(1, m.tensor_parallel));
  sh.N = static_cast<double>(m.padded_elems);
  sh.S = static_cast<double>(m.shard_elems);
  sh.param_dev = sh.stage == 3 ? cfg.zero.offload_param.device : OffloadDevice::kNone;
  sh.optim_dev = sh.stage == 0 ? OffloadDevice::kNone : cfg.zero.offload_optimizer.device;
  // Partial offload (offload_optimizer.ratio): the engine's own split into whole units.
  t->offloaded_fraction =
      sh.optim_dev == OffloadDevice::kNone || m.engine.shard_elems == 0
          ? 0.0
          : static_cast<double>(m.engine.offloaded_optim_elems) /
                static_cast<double>(m.engine.shard_elems);
  t->cpu_optimizer = t->offloaded_fraction > 0;
  // Frozen units (strata.freeze): no gradient reduction, no update, nothing written back.
  t->trainable_fraction = m.engine.shard_elems == 0
                              ? 1.0
                              : static_cast<double>(m.engine.trainable_elems) /
                                    static_cast<double>(m.engine.shard_elems);
  sh.T = t->trainable_fraction;
  sh.S_cpu = t->offloaded_fraction * sh.S;
  sh.tokens = static_cast<double>(m.micro_batch * m.seq_len) * sh.gas;
  sh.copies = IsCuda(in) || cfg.strata.memory.share_host_memory == Toggle::kOff;
  return sh;
}

// Compute: 6N + attention per token, plus, with activation checkpointing, the forward of every
// block but the last again (each recomputes its internals in backward; the last block's are
// still there): blocks' forward = (per-token FLOPs - 6 V H) / 3.
void EstimateCompute(const StepShape& sh, TimeEstimate* t) {
  const model::LlamaConfig& model = sh.in.model;
  // Tensor parallelism divides every matrix product and the attention over the group's ranks.
  const double tp = static_cast<double>(std::max(1, sh.m.tensor_parallel));
  const double per_token = model.TrainFlopsPerToken(sh.m.seq_len) / tp;
  const double head = 6.0 * static_cast<double>(model.vocab_size * model.hidden_size) / tp;
  const double layers = static_cast<double>(std::max<int64_t>(1, model.num_hidden_layers));
  t->model_flops = per_token * sh.tokens;
  t->exec_flops = per_token * sh.tokens;
  if (sh.m.checkpointing) {
    t->exec_flops += (per_token - head) / 3.0 * (layers - 1) / layers * sh.tokens;
  }
  // Frozen units skip their weight-gradient GEMMs (2 FLOPs per matrix parameter and token): the
  // frozen share of the matrices, taken as the frozen share of all elements (LoRA: nearly all).
  const double matrix = model.TrainFlopsPerToken(0) / 6.0 / tp;
  t->exec_flops -= 2.0 * std::min(matrix, (1.0 - sh.T) * sh.N) * sh.tokens;
  // fp32 runs on a GPU use TF32 at half the 16-bit rate; the CPU device computes in fp32 always.
  const double tflops = sh.hw.gpu_tflops *
                        (sh.cfg.precision() == Precision::kFp32 && IsCuda(sh.in) ? 0.5 : 1.0);
  t->compute_s = Div(t->exec_flops, tflops * 1e12 * sh.hw.gpu_efficiency);
  // Tensor parallelism's all-reduces run in the compute's order (the next op needs their
  // result), within the node: per micro-batch and block two in forward (o's and down's
  // outputs), two in backward (the inputs' gradients of q/k/v and gate/up) and one more where a
  // checkpointed block recomputes its attention; the embedding's output and the head's input
  // gradient; each of [tokens, hidden] fp32, a ring all-reduce (2 (T - 1) / T of it per rank).
  // The cross-entropy's per-token pieces are negligible beside them.
  if (tp > 1) {
    const double layers_all = static_cast<double>(model.num_hidden_layers);
    const double per_block = 4.0 + (sh.m.checkpointing ? 1.0 : 0.0);
    const double per_micro_batch = per_block * layers_all + 2.0;
    const double bytes = 4.0 * static_cast<double>(sh.m.micro_batch * sh.m.seq_len) *
                         static_cast<double>(model.hidden_size);
    t->tensor_parallel_bytes = static_cast<uint64_t>(
        sh.gas * per_micro_batch * 2.0 * Ring(bytes, static_cast<int>(tp)));
    t->tensor_parallel_s = Div(static_cast<double>(t->tensor_parallel_bytes), sh.hw.nvlink);
    t->compute_s += t->tensor_parallel_s;
  }
}

// Collectives (gradient_reducer.cc, parameter_store.cc). Gradients are reduced in fp32; only
// trainable units' gradients are reduced and their parameters gathered after the step. Each
// exchange is split into the bytes that stay within a node (at the NVLink rate) and those that
// cross nodes (a ring over several nodes runs at its slowest link: every byte at the lower
// rate). ZeRO++ moves bytes from the second kind to the first or shrinks them:
//   qwZ  the stage-3 gathers move int8 and one fp32 scale per 2048 elements
//   hpZ  backward's gathers (and recomputes') come from the node's secondary copies
//   qgZ  the reduction is an int8 all-to-all within the node, then 1/L of it across nodes
void EstimateCollectives(const StepShape& sh, TimeEstimate* t, Traffic* x) {
  const double N = sh.N, T = sh.T, csz = sh.csz, gas = sh.gas;
  const int W = sh.W;
  const int L = static_cast<int>(sh.g);
  const bool nodes = sh.hw.nodes > 1;
  const ZeroConfig& z = sh.cfg.zero;
  const double int8 = 1.0 + 4.0 / 2048.0;  // bytes per quantized element
  // One exchange's bytes per rank: within the node, and (with several nodes) across them.
  struct Bytes {
    explicit Bytes(bool across) : across_nodes(across) {}
    void AddRing(double bytes, int world) {  // a ring over `world` ranks spanning the nodes
      (across_nodes ? inter : intra) += Ring(bytes, world);
    }
    const bool across_nodes;
    double intra = 0, inter = 0;
  };
  Bytes fb(nodes), after(nodes);
  const bool qgz = z.zero_quantized_gradients && sh.stage >= 2 && W > 1;
  auto reduce = [&](Bytes& b, double elems) {
    if (!qgz) return b.AddRing(4 * elems, W);
    // Parts of elems / W: (L - 1) x (W / L) of them within the node, then one partial sum to
    // each of the other W / L - 1 nodes.
    const double part = int8 * elems / W;
    b.intra += part * (L - 1) * (W / L);
    (nodes ? b.inter : b.intra) += part * (W / L - 1);
  };
  switch (sh.stage) {
    case 0:  // one all-reduce of the accumulated gradients
      after.AddRing(2 * 4 * N * T, W);
      break;
    case 1:  // reduce-scatter at the step's end, all-gather of the updated parameters
      after.AddRing(4 * N * T, W);
      after.AddRing(csz * N * T, W);
      break;
    case 2:  // reduce-scatter per micro-batch, all-gather of the updated parameters
      reduce(fb, gas * N * T);
      after.AddRing(csz * N * T, W);
      break;
    default: {  // gather for forward and for backward (and to recompute), reduce, per micro-batch
      const double gathered = z.zero_quantized_weights ? int8 : csz;
      const double recompute = static_cast<double>(sh.m.recompute_padded_elems);
      const bool hpz = z.zero_hpz_partition_size > 1 && nodes;
      fb.AddRing(gas * gathered * N, W);
      if (hpz) {
        fb.intra += Ring(gas * csz * (N + recompute), L);
      } else {
        fb.AddRing(gas * gathered * (N + recompute), W);
      }
      reduce(fb, gas * N * T);
      break;
    }
  }
  const double slow = nodes ? std::min(sh.hw.nvlink, sh.hw.net) : sh.hw.nvlink;
  x->coll_fb = fb.intra + fb.inter;
  x->coll_after = after.intra + after.inter;
  t->collective_bytes = static_cast<uint64_t>(x->coll_fb + x->coll_after) + t->tensor_parallel_bytes;
  t->collective_inter_bytes = static_cast<uint64_t>(fb.inter + after.inter);
  x->coll_fb_s = Div(fb.intra, sh.hw.nvlink) + Div(fb.inter, slow);
  x->coll_after_s = Div(after.intra, sh.hw.nvlink) + Div(after.inter, slow);
  t->collective_s = x->coll_fb_s + x->coll_after_s;
}

// Host-device copies, only where device memory is not host memory. Offloaded parameter shards
// (stage 3): when the device cache holds them all (zero::OffloadedParamDeviceBudget), only those
// the CPU optimizer updated in host memory are fetched again, once a step (frozen units stay
// cached, and the device optimizer updates its units' device copies in place); else every shard
// for forward and for backward of every micro-batch. Where device copies share host memory, the
// cache is also bounded by the host tier's budget (strata.memory.host_budget).
void EstimateCopies(const StepShape& sh, TimeEstimate* t, Traffic* x) {
  const double csz = sh.csz, S = sh.S, gas = sh.gas;
  if (sh.param_dev != OffloadDevice::kNone) {
    const double all = csz * S, largest = csz * static_cast<double>(sh.m.max_shard_elems);
    const double lookahead = csz * static_cast<double>(sh.cfg.zero.stage3_prefetch_bucket_size);
    double cache = std::min(all + largest, std::max(lookahead + 2 * largest, 4 * largest));
    if (!sh.copies && sh.cfg.strata.memory.host_budget) {
      cache = std::min(cache, static_cast<double>(*sh.cfg.strata.memory.host_budget));
    }
    x->fetch = cache >= all ? csz * sh.S_cpu
                            : gas * (2.0 * all + csz * static_cast<double>(sh.m.recompute_shard_elems));
  }
  if (sh.copies) {
    x->h2d_fb = x->fetch;
    if (t->cpu_optimizer) {
      // Each micro-batch's gradient shard lands on the host.
      if (sh.stage >= 2) {
        x->d2h_fb = gas * 4 * sh.S_cpu;
      } else {
        x->d2h_after = 4 * sh.S_cpu;
      }
      // Updated parameters go back to the device, unless their home is off the device.
      if (sh.param_dev == OffloadDevice::kNone) x->h2d_opt = csz * sh.S_cpu;
    }
    // Stage 3 with offloaded parameters: the device optimizer's updated shards go home.
    if (sh.param_dev != OffloadDevice::kNone) x->d2h_after += csz * (S * sh.T - sh.S_cpu);
    // Offloaded activation checkpoints: out in forward, back in backward, each micro-batch.
    const double ckpt = gas * static_cast<double>(sh.m.checkpoint_host_bytes);
    x->d2h_fb += ckpt;
    x->h2d_fb += ckpt;
  }
  t->h2d_bytes = static_cast<uint64_t>(x->h2d_fb + x->h2d_opt);
  t->d2h_bytes = static_cast<uint64_t>(x->d2h_fb + x->d2h_after);
  t->h2d_s = Div(x->h2d_fb + x->h2d_opt, sh.hw.pcie);
  t->d2h_s = Div(x->d2h_fb + x->d2h_after, sh.hw.pcie);
}

// NVMe, shared by the node's ranks.
void EstimateNvme(const StepShape& sh, TimeEstimate* t, Traffic* x) {
  double read_opt = 0;
  if (sh.param_dev == OffloadDevice::kNvme) {
    x->read_fb = x->fetch;
    x->write_opt += sh.csz * sh.S * sh.T;  // the updated shard (frozen ones stay as they are)
  }
  if (sh.optim_dev == OffloadDevice::kNvme) {
    read_opt += 12 * sh.S_cpu;  // master, m, v in, and out again
    x->write_opt += 12 * sh.S_cpu;
  }
  t->nvme_read_bytes = static_cast<uint64_t>(x->read_fb + read_opt);
  t->nvme_write_bytes = static_cast<uint64_t>(x->write_opt);
  t->nvme_read_s = Div(sh.g * (x->read_fb + read_opt), sh.hw.nvme_read);
  t->nvme_write_s = Div(sh.g * x->write_opt, sh.hw.nvme_write);
  x->nvme_fb_s = Div(sh.g * x->read_fb, sh.hw.nvme_read);
  x->nvme_opt_s = t->nvme_read_s + t->nvme_write_s - x->nvme_fb_s;
}

// The optimizer: on the CPU, the node's rate shared by its ranks; on the device, bound by HBM
// (gradient and states read, states and parameters written).
void EstimateOptimizer(const StepShape& sh, TimeEstimate* t) {
  t->optimizer_params = static_cast<uint64_t>((sh.stage == 0 ? sh.N : sh.S) * sh.T);
  t->optimizer_s = Div(sh.g * sh.S_cpu, sh.hw.cpu_adam);
  t->device_optimizer_s =
      Div((static_cast<double>(t->optimizer_params) - sh.S_cpu) * (28 + sh.csz), sh.hw.hbm);
}

struct Part {
  const char* name;
  double s;
};
const Part& Longest(std::span<const Part> parts) {
  return *std::max_element(parts.begin(), parts.end(),
                           [](const Part& a, const Part& b) { return a.s < b.s; });
}

// The critical path. Forward and backward overlap the gathers, fetches and gradient copies with
// compute; the CPU optimizer (with its NVMe traffic and the parameter upload) overlaps backward
// unless an update waits for the global norm (clipping, fp16, skipping non-finite steps:
// zero.md, "Overlap with backward").
void EstimateCriticalPath(const StepShape& sh, const Traffic& x, TimeEstimate* t) {
  const MemoryEstimate& m = sh.m;
  const Hardware& hw = sh.hw;
  const double pcie_fb_s = Div(std::max(x.h2d_fb, x.d2h_fb), hw.pcie);
  const Part fb[] = {{"compute", t->compute_s},
                     {"collectives", x.coll_fb_s},
                     {"PCIe", pcie_fb_s},
                     {"NVMe", x.nvme_fb_s}};
  const Part& top = Longest(fb);
  t->forward_backward_s = top.s;
  t->bound_by = top.name;
  // The updated parameters go back to the device after the last update (engine_step.cc), so
  // their upload follows the optimizer rather than overlapping it. The NVMe traffic after
  // backward (the optimizer states' and the updated parameters' writes home) runs beside the
  // CPU's update, and happens with the device optimizer too.
  const double opt_work = std::max(t->cpu_optimizer ? t->optimizer_s : 0.0, x.nvme_opt_s);
  // The engine's own decision (its memory plan); stage 1 reduces at the step's end, so its
  // "overlapped" updates start after backward.
  t->optimizer_overlapped = t->cpu_optimizer && sh.stage >= 2 && m.engine.optimizer_overlapped;
  t->shared_cores = hw.shared_cores;
  t->io_cpu_share = std::clamp(hw.io_cpu_share, 0.0, 1.0);
  // The overlapped optimizer runs beside the last micro-batch's backward (3/4 of its compute
  // with recomputation, 2/3 without), and at least the last unit's update is left. With a
  // reduction bucket, the last bucket's units reach the optimizer only at the end of backward:
  // that share of the work is left, and the window before it shrinks by it (all of it, for a
  // model whose shard fits one bucket).
  const double last_bucket =
      m.engine.trainable_elems == 0
          ? 0.0
          : std::min(1.0, static_cast<double>(m.engine.last_bucket_elems) /
                              static_cast<double>(m.engine.trainable_elems));
  const double window =
      t->compute_s / sh.gas * (m.checkpointing ? 0.75 : 2.0 / 3.0) * (1 - last_bucket);
  const double left_share = std::max(1.0 / std::max(1, m.units), last_bucket);
  if (hw.shared_cores) {
    // The CPU device computes on the cores that also run the collectives' copies, the CPU
    // optimizer, hashing and I/O completions: work overlapped in time takes its time from
    // compute, so the parts add up (docs/planning.md, "Checked against measured steps"). An NVMe
    // transfer takes `io_cpu_share` of its time from the cores; the rest is the drive's, and
    // runs beside compute as on a GPU: parameter fetches beside forward and backward, the
    // overlapped optimizer's reads and writes beside backward (less the last unit's).
    const double c = t->io_cpu_share;
    t->forward_backward_s = t->compute_s + x.coll_fb_s + pcie_fb_s + c * x.nvme_fb_s +
                            std::max(0.0, (1 - c) * x.nvme_fb_s - t->compute_s);
    const double drive_left = t->optimizer_overlapped
                                  ? std::max(x.nvme_opt_s - window, x.nvme_opt_s * left_share)
                                  : x.nvme_opt_s;
    t->exposed_optimizer_s =
        t->optimizer_s + c * x.nvme_opt_s + (1 - c) * drive_left + t->device_optimizer_s;
  } else if (t->optimizer_overlapped) {
    // It runs beside backward (`window`; not beside NVMe reads, which share its drives), and
    // `left_share` of it is left. The device's part (the first units, with split states) runs
    // after backward, beside what is left of it.
    t->exposed_optimizer_s =
        std::max({opt_work - window, opt_work * left_share, t->device_optimizer_s});
  } else {
    // The CPU's part is queued first and runs beside the device's.
    t->exposed_optimizer_s = std::max(opt_work, t->device_optimizer_s);
  }
  t->after_step_s = x.coll_after_s + Div(x.d2h_after + x.h2d_opt, hw.pcie);
  t->step_s = t->forward_backward_s + t->exposed_optimizer_s + t->after_step_s;
}

// What the step time says: the bottleneck, throughput, MFU and NVMe wear.
void EstimateRates(const StepShape& sh, const Traffic& x, TimeEstimate* t) {
  const Part all[] = {{"compute", t->compute_s},
                      {"collectives", t->collective_s},
                      {"PCIe", std::max(t->h2d_s, t->d2h_s)},
                      {"NVMe", t->nvme_read_s + t->nvme_write_s},
                      {"CPU optimizer", t->optimizer_s},
                      {"device optimizer", t->device_optimizer_s}};
  t->bottleneck = Longest(all).name;
  t->tokens_per_s = Div(sh.tokens * sh.W, t->step_s);
  t->mfu = Div(t->model_flops, t->step_s * sh.hw.gpu_tflops * 1e12);
  t->nvme_node_write_per_step = sh.g * x.write_opt;
  t->nvme_node_write_per_day = Div(t->nvme_node_write_per_step * 86400.0, t->step_s);
  if (sh.hw.nvme_tbw > 0 && t->nvme_node_write_per_day > 0) {
    t->nvme_days = sh.hw.nvme_tbw / t->nvme_node_write_per_day;
  }
}

}  // namespace

TimeEstimate EstimateTime(const EstimateInput& in, const MemoryEstimate& m, const Hardware& hw) {
  TimeEstimate t;
  const StepShape shape = ShapeOf(in, m, hw, &t);
  Traffic traffic;
  EstimateCompute(shape, &t);
  EstimateCollectives(shape, &t, &traffic);
  EstimateCopies(shape, &t, &traffic);
  EstimateNvme(shape, &t, &traffic);
  EstimateOptimizer(shape, &t);
  EstimateCriticalPath(shape, traffic, &t);
  EstimateRates(shape, traffic, &t);
  return t;
}

std::string FitCheck::Overflow() const {
  std::string out;
  auto add = [&](const char* tier, uint64_t need, uint64_t budget, const char* per) {
    if (need <= budget) return;
    out += fmt::format("{}{}: {} > {} {}", out.empty() ? "" : "; ", tier, FormatBytes(need),
                       FormatBytes(budget), per);
  };
  add("device", device_need, device_budget, "per rank");
  add("host memory", host_need, host_budget, "per node");
  add("NVMe", nvme_need, nvme_budget, "per node");
  return out;
}

FitCheck CheckFit(const EstimateInput& in, const MemoryEstimate& m, const Hardware& hw) {
  FitCheck f;
  const uint64_t g = static_cast<uint64_t>(std::max(1, hw.gpus_per_node));
  f.device_need = m.device_peak();
  f.device_budget = hw.rank_device_budget();
  f.host_need = g * (m.engine.pinned_pool + m.checkpoint_host_bytes + m.setup_host_bytes());
  if (!IsCuda(in)) f.host_need += g * f.device_need;  // the CPU device's memory is host memory
  f.host_budget = hw.host_budget();
  f.nvme_need = g * (m.engine.nvme_param_file + m.engine.nvme_optim_file);
  f.nvme_budget = hw.nvme;
  return f;
}

Status ApplyPlacement(Config* config, const PlanCandidate& c) {
  STRATA_RETURN_IF_ERROR(ResolveOffloadDevices(config, c.param, c.optimizer));
  if (c.optimizer != OffloadDevice::kNone) config->zero.offload_optimizer.ratio = c.ratio;
  return Status::Ok();
}

std::string PlacementName(const PlanCandidate& c) {
  return fmt::format("parameters on {}, optimizer on {}{}", OffloadDeviceName(c.param),
                     OffloadDeviceName(c.optimizer),
                     c.optimizer != OffloadDevice::kNone && c.ratio < 1.0
                         ? fmt::format(" (ratio {:g}: {:.0f}% of its states offloaded)", c.ratio,
                                       c.time.offloaded_fraction /
                                           std::max(c.time.trainable_fraction, 1e-12) * 100)
                         : std::string());
}

Result<PlanCandidate> EstimatePlacement(const EstimateInput& in, const Hardware& hw,
                                        OffloadDevice param, OffloadDevice optimizer,
                                        double ratio) {
  PlanCandidate c;
  c.param = param;
  c.optimizer = optimizer;
  c.ratio = optimizer == OffloadDevice::kNone ? 1.0 : ratio;
  EstimateInput ci = in;
  ci.device_budget = hw.rank_device_budget();  // strata.activation_checkpointing "auto"
  STRATA_RETURN_IF_ERROR(ApplyPlacement(&ci.config, c));
  STRATA_ASSIGN_OR_RETURN(c.memory, EstimateMemory(ci));
  c.time = EstimateTime(ci, c.memory, hw);
  c.fit = CheckFit(ci, c.memory, hw);
  return c;
}

Result<PlacementPlan> PlanPlacement(const EstimateInput& in, const Hardware& hw) {
  const ZeroConfig& z = in.config.zero;
  auto options = [&](OffloadDevice given, bool param) {
    if (given != OffloadDevice::kAuto) return std::vector<OffloadDevice>{given};
    std::vector<OffloadDevice> v = {OffloadDevice::kNone, OffloadDevice::kCpu};
    if (CanUseNvme(in.config, param)) v.push_back(OffloadDevice::kNvme);
    return v;
  };
  // An "auto" optimizer also tries partial offload (1/16 .. 15/16 of its states); a fixed one keeps
  // the config's ratio.
  const bool auto_optimizer = z.offload_optimizer.device == OffloadDevice::kAuto;
  std::vector<double> ratios = {z.offload_optimizer.ratio};
  if (auto_optimizer) {
    ratios.clear();
    // Whole first, then less and less offloaded: a share that rounds to the same units as the
    // one before it is the same placement.
    for (int k = 16; k >= 1; --k) ratios.push_back(k / 16.0);
  }
  PlacementPlan plan;
  for (OffloadDevice p : options(z.offload_param.device, true)) {
    for (OffloadDevice o : options(z.offload_optimizer.device, false)) {
      double last_fraction = -1;
      for (double r : o == OffloadDevice::kNone ? std::vector<double>{1.0} : ratios) {
        STRATA_ASSIGN_OR_RETURN(PlanCandidate c, EstimatePlacement(in, hw, p, o, r));
        // Ratios that round to the same whole units are one candidate, and one that offloads no
        // unit is "none" (a ratio the config fixes stays, whatever it selects).
        if (auto_optimizer && o != OffloadDevice::kNone) {
          if (c.time.offloaded_fraction == last_fraction || c.time.offloaded_fraction == 0) continue;
        }
        last_fraction = c.time.offloaded_fraction;
        plan.candidates.push_back(std::move(c));
      }
    }
  }
  // The fastest that fits, then among those within 2% of it the one that offloads least
  // (simpler, and no drive wear): parameters first, then the optimizer's home, then its share.
  auto weight = [](const PlanCandidate& c) {
    return static_cast<int>(c.param) * 3.0 +
           (c.optimizer == OffloadDevice::kNone
                ? 0.0
                : static_cast<int>(c.optimizer) - 1.0 + c.time.offloaded_fraction);
  };
  double fastest = 0;
  for (const PlanCandidate& c : plan.candidates) {
    if (c.fit.fits() && (fastest == 0 || c.time.step_s < fastest)) fastest = c.time.step_s;
  }
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const PlanCandidate& c = plan.candidates[i];
    if (!c.fit.fits() || c.time.step_s > fastest * 1.02) continue;
    if (plan.chosen < 0 || weight(c) < weight(plan.best()) ||
        (weight(c) == weight(plan.best()) && c.time.step_s < plan.best().time.step_s)) {
      plan.chosen = static_cast<int>(i);
    }
  }
  auto name = [](const PlanCandidate& c) { return PlacementName(c); };
  // The candidates the reasons and errors speak of: every whole home, and of each home's partial
  // offloads (a row per ratio) the fastest that fits, or when none fits the least and the most
  // offloaded (the device overflows at one end, host memory or NVMe at the other).
  auto listed = [&](bool fitting_only_if_any) {
    std::vector<const PlanCandidate*> out;
    for (size_t i = 0; i < plan.candidates.size();) {
      const PlanCandidate& c = plan.candidates[i];
      if (c.optimizer == OffloadDevice::kNone || c.ratio >= 1.0) {
        out.push_back(&c);
        ++i;
        continue;
      }
      size_t j = i;
      const PlanCandidate* fastest_fit = nullptr;
      while (j < plan.candidates.size() && plan.candidates[j].param == c.param &&
             plan.candidates[j].optimizer == c.optimizer && plan.candidates[j].ratio < 1.0) {
        const PlanCandidate& d = plan.candidates[j];
        if (d.fit.fits() && (fastest_fit == nullptr || d.time.step_s < fastest_fit->time.step_s)) {
          fastest_fit = &d;
        }
        ++j;
      }
      if (fastest_fit != nullptr && fitting_only_if_any) {
        out.push_back(fastest_fit);
      } else {
        out.push_back(&plan.candidates[i]);
        if (j - 1 > i) out.push_back(&plan.candidates[j - 1]);
      }
      i = j;
    }
    return out;
  };
  if (plan.chosen < 0) {
    std::string all;
    for (const PlanCandidate* c : listed(false)) {
      all += fmt::format("{}{}: {}", all.empty() ? "" : "; ", name(*c), c->fit.Overflow());
    }
    return ResourceExhaustedError(fmt::format(
        "no placement fits {} node(s) x {} GPU(s) ({} device budget per rank, {} of host memory "
        "and {} of NVMe per node): {}",
        hw.nodes, hw.gpus_per_node, FormatBytes(hw.rank_device_budget()),
        FormatBytes(hw.host_budget()), FormatBytes(hw.nvme), all));
  }
  const PlanCandidate& best = plan.best();
  for (const PlanCandidate* cp : listed(true)) {
    const PlanCandidate& c = *cp;
    if (&c == &best) continue;
    if (!c.fit.fits()) {
      plan.reasons.push_back(fmt::format("not {}: does not fit ({})", name(c), c.fit.Overflow()));
    } else {
      plan.reasons.push_back(fmt::format(
          "not {}: fits, step {:.3g} s ({:.2f}x the chosen; bound by {})", name(c), c.time.step_s,
          Div(c.time.step_s, best.time.step_s), c.time.bound_by));
    }
  }
  plan.reasons.insert(plan.reasons.begin(),
                      fmt::format("chosen: {}: step {:.3g} s, bound by {}{}", name(best),
                                  best.time.step_s, best.time.bound_by,
                                  plan.candidates.size() == 1 ? " (the config fixes both homes)"
                                                              : ", the fastest that fits"));
  return plan;
}

Hardware MachineHardware(const device::Device& dev, const comm::LaunchInfo& launch,
                         const Config& config) {
  Hardware hw;
  hw.gpus_per_node = std::max(1, launch.local_size);
  hw.nodes = std::max(1, launch.world_size / hw.gpus_per_node);
  hw.device_budget = dev.memory_stats().budget;
  hw.gpu_mem = hw.device_budget;
  if (dev.type() == device::DeviceType::kCpu) {
    hw.shared_cores = true;
    // The CPU device computes on the host's cores (fp32 sgemm, about 50 GFLOPS each at best),
    // copies at memory speed, and its CPU optimizer has one thread per rank. Rough rates: they
    // only rank the candidates that fit.
    const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
    hw.gpu_tflops = 0.05 * static_cast<double>(cores) / hw.gpus_per_node;  // the ranks share them
    hw.gpu_efficiency = 1.0;
    hw.pcie = 10e9;
    hw.hbm = 10e9;
    hw.cpu_adam = 0.3e9 * hw.gpus_per_node;
    hw.nvme_read = 2e9;
    hw.nvme_write = 1e9;
  }
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) hw.cpu_mem = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
  // The pools may take 90% of physical memory, and no more than is available now (BuildEngine
  // refuses a pool larger than MemAvailable).
  if (const uint64_t available = HostAvailableBytes(); available > 0 && hw.cpu_mem > 0) {
    hw.host_fraction = std::min(hw.host_fraction, static_cast<double>(available) /
                                                      static_cast<double>(hw.cpu_mem));
  }
  // NVMe: the free space of each distinct filesystem the config's directories are on.
  std::vector<std::string> dirs = config.strata.io.nvme_paths;
  for (const std::string* p : {&config.zero.offload_param.nvme_path,
                               &config.zero.offload_optimizer.nvme_path}) {
    if (!p->empty() && config.strata.io.nvme_paths_auto) dirs.push_back(*p);
  }
  std::vector<dev_t> seen;
  hw.nvme = 0;
  for (const std::string& d : dirs) {
    std::error_code ec;
    std::filesystem::path p = std::filesystem::absolute(d, ec);
    while (!p.empty() && !std::filesystem::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
    struct statvfs st {};
    struct stat sb {};
    if (::statvfs(p.c_str(), &st) != 0 || ::stat(p.c_str(), &sb) != 0) continue;
    if (std::find(seen.begin(), seen.end(), sb.st_dev) != seen.end()) continue;
    seen.push_back(sb.st_dev);
    hw.nvme += static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  }
  return hw;
}

std::string FormatTimeEstimate(const TimeEstimate& t, const Hardware& hw) {
  std::string out = fmt::format(
      "time per step (per rank; {} node(s) x {} GPU(s), {:.3g} TFLOPS at {:.0f}%)\n", hw.nodes,
      hw.gpus_per_node, hw.gpu_tflops, hw.gpu_efficiency * 100);
  auto line = [&](std::string_view what, double s, std::string detail) {
    out += fmt::format("  {:<28} {:>10.4f} s  {}\n", what, s, detail);
  };
  line("compute", t.compute_s,
       fmt::format("{:.3g} TFLOP{}{}", t.exec_flops / 1e12,
                   t.exec_flops > t.model_flops * 1.001 ? " with recomputation" : "",
                   t.tensor_parallel_bytes > 0
                       ? fmt::format(", and {:.4f} s of tensor-parallel all-reduces",
                                     t.tensor_parallel_s)
                       : std::string()));
  const std::string tp_part =
      t.tensor_parallel_bytes > 0
          ? fmt::format(" ({} of it tensor-parallel, within the node)",
                        FormatBytes(t.tensor_parallel_bytes))
          : std::string();
  line("collectives", t.collective_s,
       hw.nodes > 1
           ? fmt::format("{} on the wire{}, {} of it across nodes at {:.0f} GB/s",
                         FormatBytes(t.collective_bytes), tp_part,
                         FormatBytes(t.collective_inter_bytes), std::min(hw.nvlink, hw.net) / 1e9)
           : fmt::format("{} on the wire{} at {:.0f} GB/s", FormatBytes(t.collective_bytes),
                         tp_part, hw.nvlink / 1e9));
  line("PCIe host to device", t.h2d_s, FormatBytes(t.h2d_bytes));
  line("PCIe device to host", t.d2h_s, FormatBytes(t.d2h_bytes));
  line("NVMe read (node's share)", t.nvme_read_s, FormatBytes(t.nvme_read_bytes) + " per rank");
  line("NVMe write (node's share)", t.nvme_write_s, FormatBytes(t.nvme_write_bytes) + " per rank");
  const double params_m = static_cast<double>(t.optimizer_params) / 1e6;
  // The offloaded share of what the optimizer updates (frozen units have no states).
  const double cpu_share =
      t.trainable_fraction > 0 ? std::min(1.0, t.offloaded_fraction / t.trainable_fraction) : 0.0;
  if (t.cpu_optimizer) {
    line("CPU optimizer", t.optimizer_s,
         fmt::format("{:.3g}M parameters per rank", params_m * cpu_share));
  }
  if (cpu_share < 1) {
    line("device optimizer", t.device_optimizer_s,
         fmt::format("{:.3g}M parameters per rank{}", params_m * (1 - cpu_share),
                     t.trainable_fraction < 1
                         ? fmt::format(" ({:.1f}% of the model trains)", t.trainable_fraction * 100)
                         : std::string()));
  }
  out += "critical path\n";
  line("forward + backward", t.forward_backward_s, "bound by " + t.bound_by);
  line("optimizer left after backward", t.exposed_optimizer_s,
       t.shared_cores
           ? (t.io_cpu_share >= 1 ? std::string("shared cores: nothing overlaps (the CPU device)")
                                  : fmt::format("shared cores: only the drive's {:.0f}% of NVMe "
                                                "time overlaps (the CPU device)",
                                                100 * (1 - t.io_cpu_share)))
       : t.optimizer_overlapped ? std::string("the CPU optimizer overlaps backward")
                                : std::string("not overlapped"));
  line("after the step", t.after_step_s, "end-of-step reductions and gathers");
  line("step", t.step_s, "bottleneck: " + t.bottleneck);
  out += fmt::format("  {:.4g} tokens/s over all ranks, MFU {:.1f}%\n", t.tokens_per_s, t.mfu * 100);
  if (t.nvme_node_write_per_step > 0) {
    out += fmt::format("  NVMe writes per node: {} per step, {:.2f} TB per day{}\n",
                       FormatBytes(static_cast<uint64_t>(t.nvme_node_write_per_step)),
                       t.nvme_node_write_per_day / 1e12,
                       t.nvme_days > 0 ? fmt::format(", {:.0f} days to the drives' {:.0f} TBW",
                                                     t.nvme_days, hw.nvme_tbw / 1e12)
                                       : std::string());
  }
  return out;
}

std::string FormatFit(const FitCheck& f) {
  std::string out = "fit\n";
  auto line = [&](const char* tier, uint64_t need, uint64_t budget) {
    out += fmt::format("  {:<28} {:>12} of {:>12}  {}\n", tier, FormatBytes(need),
                       FormatBytes(budget), need <= budget ? "fits" : "DOES NOT FIT");
  };
  line("device per rank", f.device_need, f.device_budget);
  line("host memory per node", f.host_need, f.host_budget);
  line("NVMe per node", f.nvme_need, f.nvme_budget);
  return out;
}

nlohmann::json TimeEstimateJson(const TimeEstimate& t) {
  return {{"model_flops", t.model_flops},
          {"exec_flops", t.exec_flops},
          {"collective_bytes", t.collective_bytes},
          {"collective_inter_bytes", t.collective_inter_bytes},
          {"tensor_parallel_bytes", t.tensor_parallel_bytes},
          {"tensor_parallel_s", t.tensor_parallel_s},
          {"h2d_bytes", t.h2d_bytes},
          {"d2h_bytes", t.d2h_bytes},
          {"nvme_read_bytes", t.nvme_read_bytes},
          {"nvme_write_bytes", t.nvme_write_bytes},
          {"optimizer_params", t.optimizer_params},
          {"compute_s", t.compute_s},
          {"collective_s", t.collective_s},
          {"h2d_s", t.h2d_s},
          {"d2h_s", t.d2h_s},
          {"nvme_read_s", t.nvme_read_s},
          {"nvme_write_s", t.nvme_write_s},
          {"optimizer_s", t.optimizer_s},
          {"device_optimizer_s", t.device_optimizer_s},
          {"offloaded_fraction", t.offloaded_fraction},
          {"trainable_fraction", t.trainable_fraction},
          {"cpu_optimizer", t.cpu_optimizer},
          {"optimizer_overlapped", t.optimizer_overlapped},
          {"shared_cores", t.shared_cores},
          {"io_cpu_share", t.io_cpu_share},
          {"forward_backward_s", t.forward_backward_s},
          {"exposed_optimizer_s", t.exposed_optimizer_s},
          {"after_step_s", t.after_step_s},
          {"step_s", t.step_s},
          {"bound_by", t.bound_by},
          {"bottleneck", t.bottleneck},
          {"tokens_per_s", t.tokens_per_s},
          {"mfu", t.mfu},
          {"nvme_node_write_bytes_per_step", t.nvme_node_write_per_step},
          {"nvme_node_write_bytes_per_day", t.nvme_node_write_per_day},
          {"nvme_days_to_tbw", t.nvme_days}};
}

nlohmann::json FitJson(const FitCheck& f) {
  return {{"fits", f.fits()},
          {"device_need_bytes", f.device_need},
          {"device_budget_bytes", f.device_budget},
          {"host_need_bytes", f.host_need},
          {"host_budget_bytes", f.host_budget},
          {"nvme_need_bytes", f.nvme_need},
          {"nvme_budget_bytes", f.nvme_budget},
          {"overflow", f.Overflow()}};
}

nlohmann::json HardwareJson(const Hardware& hw) {
  return {{"nodes", hw.nodes},
          {"gpus_per_node", hw.gpus_per_node},
          {"gpu_mem_bytes", hw.gpu_mem},
          {"device_budget_bytes", hw.rank_device_budget()},
          {"cpu_mem_bytes", hw.cpu_mem},
          {"host_budget_bytes", hw.host_budget()},
          {"nvme_bytes", hw.nvme},
          {"nvme_read_bps", hw.nvme_read},
          {"nvme_write_bps", hw.nvme_write},
          {"cpu_adam_params_per_s", hw.cpu_adam},
          {"pcie_bps", hw.pcie},
          {"nvlink_bps", hw.nvlink},
          {"net_bps", hw.net},
          {"hbm_bps", hw.hbm},
          {"gpu_tflops", hw.gpu_tflops},
          {"gpu_efficiency", hw.gpu_efficiency},
          {"shared_cores", hw.shared_cores},
          {"io_cpu_share", hw.io_cpu_share},
          {"nvme_tbw_bytes", hw.nvme_tbw}};
}

}  // namespace strata::train
