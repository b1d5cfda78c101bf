// CpuAdamStep: validation, the per-step scalars, ISA dispatch, the split into chunks and the
// helper-thread pool; and the double-precision reference. The kernels live in one translation
// unit per instruction set (adam_kernels.h); this file is compiled for baseline x86-64 and calls
// a wider kernel only after asking the CPU (__builtin_cpu_supports, which also checks that the
// OS saves the wider registers).
#include <fmt/format.h>
#include <pthread.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/log.h"
#include "device/dtype_convert.h"
#include "optim/adam.h"
#include "optim/adam_internal.h"
#include "optim/adam_kernels.h"

namespace strata::optim {
namespace {

using detail::AdamKernelRange;
using detail::AdamStepScalars;
using detail::DecayMode;
using detail::OutKind;

// Shards whose arrays together exceed this many bytes write the 16-bit copy with streaming
// stores: far beyond the last-level cache nothing of it would still be cached when it is read.
constexpr size_t kStreamingThresholdBytes = size_t{64} << 20;

#if defined(__x86_64__) || defined(__i386__)
// F16C from CPUID leaf 1 (clang's __builtin_cpu_supports does not know "f16c").
bool CpuHasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
#endif

bool CpuHas(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

// ---- the helper threads ------------------------------------------------------------------------

// A fixed set of threads that run the chunks of CpuAdamStep calls. A call hands its chunks
// 1..count-1 to the pool and runs chunk 0 itself, then also takes any of its chunks that no helper
// has started yet, so a call always finishes even when every helper is busy with another call
// (or none could be started). Threads are added on demand, up to the largest count asked for,
// and joined when the process exits.
class WorkerPool {
 public:
  using ChunkFn = void (*)(const void* context, int chunk);

  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_)
      t.join();
  }

  void Run(int count, ChunkFn fn, const void* context) {
    if (count <= 1) {
      if (count == 1) fn(context, 0);
      return;
    }
    Job job{fn, context, count};
    {
      std::lock_guard<std::mutex> lock(mu_);
      GrowLocked(count - 1);
      queue_.push_back(&job);
    }
    work_cv_.notify_all();
    fn(context, 0);
    std::unique_lock<std::mutex> lock(mu_);
    while (job.next < job.count) {
      const int chunk = ClaimLocked(job);
      lock.unlock();
      fn(context, chunk);
      lock.lock();
      --job.remaining;
    }
    // A helper decrements `remaining` and notifies while holding mu_, so once this wait returns
    // no helper touches `job` again.
    job.done.wait(lock, [&] { return job.remaining == 0; });
  }

 private:
  struct Job {
    Job(ChunkFn f, const void* c, int n) : fn(f), context(c), count(n), remaining(n - 1) {}
    ChunkFn fn;
    const void* context;
    int count;
    int next = 1;   // the next chunk nobody has claimed
    int remaining;  // chunks 1..count-1 not yet finished
    std::condition_variable done;
  };

  // Takes the next chunk of `job` (which has one left); drops the job from the queue when that
  // was its last.
  int ClaimLocked(Job& job) {
    const int chunk = job.next++;
    if (job.next == job.count) std::erase(queue_, &job);
    return chunk;
  }

  void GrowLocked(int wanted) {
    while (static_cast<int>(workers_.size()) < wanted) {
      try {
        workers_.emplace_back([this] { WorkerLoop(); });
      } catch (const std::system_error& e) {
        // The caller runs what no helper takes; fewer threads only cost speed.
        STRATA_LOG_ONCE(warn, optim,
                        "CPU Adam: could not start a helper thread ({}); running with {}", e.what(),
                        workers_.size());
        return;
      }
    }
  }

  void WorkerLoop() {
    pthread_setname_np(pthread_self(), "strata-adam");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      Job& job = *queue_.front();
      const int chunk = ClaimLocked(job);
      lock.unlock();
      job.fn(job.context, chunk);
      lock.lock();
      if (--job.remaining == 0) job.done.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<Job*> queue_;  // jobs with unclaimed chunks, oldest first
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

WorkerPool& Pool() {
  static WorkerPool pool;
  return pool;
}

// ---- validation -------------------------------------------------------------------------------

Status ValidateHyper(const AdamHyper& h, std::string_view caller) {
  auto bad = [&](std::string_view what, double value, std::string_view expected) {
    return InvalidArgumentError(
        fmt::format("{}: {} is {}; expected {}", caller, what, value, expected));
  };
  if (h.step < 1) {
    return InvalidArgumentError(fmt::format("{}: step is {}; expected >= 1", caller, h.step));
  }
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0)) return bad("beta1", h.beta1, "a value in [0, 1)");
  if (!(h.beta2 >= 0.0 && h.beta2 < 1.0)) return bad("beta2", h.beta2, "a value in [0, 1)");
  if (!(h.eps > 0.0 && std::isfinite(h.eps))) return bad("eps", h.eps, "a finite value > 0");
  if (!(h.lr >= 0.0 && std::isfinite(h.lr))) return bad("lr", h.lr, "a finite value >= 0");
  if (!(h.weight_decay >= 0.0 && std::isfinite(h.weight_decay))) {
    return bad("weight_decay", h.weight_decay, "a finite value >= 0");
  }
  if (!(h.grad_scale >= 0.0 && std::isfinite(h.grad_scale))) {
    return bad("grad_scale", h.grad_scale, "a finite value >= 0");
  }
  return Status::Ok();
}

Result<OutKind> OutKindOf(const AdamShard& s, std::string_view caller) {
  if (s.out16 == nullptr) return OutKind::kNone;
  switch (s.out_dtype) {
    case device::DType::kF32:
      return OutKind::kF32;
    case device::DType::kBF16:
      return OutKind::kBF16;
    case device::DType::kF16:
      return OutKind::kF16;
  }
  return InvalidArgumentError(fmt::format("{}: out_dtype {} is not fp32, bf16 or fp16", caller,
                                          static_cast<int>(s.out_dtype)));
}

Status ValidateShard(const AdamShard& s, std::string_view caller) {
  if (s.n == 0) return Status::Ok();
  struct Array {
    std::string_view name;
    const void* ptr;
    size_t bytes;
  };
  std::vector<Array> arrays = {{"master", s.master, s.n * 4},
                               {"grad", s.grad, s.n * 4},
                               {"m", s.m, s.n * 4},
                               {"v", s.v, s.n * 4}};
  for (const Array& a : arrays) {
    if (a.ptr == nullptr) {
      return InvalidArgumentError(
          fmt::format("{}: shard.{} is null with n = {}", caller, a.name, s.n));
    }
  }
  if (s.out16 != nullptr)
    arrays.push_back({"out16", s.out16, s.n * device::DTypeSize(s.out_dtype)});
  for (size_t i = 0; i < arrays.size(); ++i) {
    for (size_t j = i + 1; j < arrays.size(); ++j) {
      const auto a = reinterpret_cast<uintptr_t>(arrays[i].ptr);
      const auto b = reinterpret_cast<uintptr_t>(arrays[j].ptr);
      if (a < b + arrays[j].bytes && b < a + arrays[i].bytes) {
        return InvalidArgumentError(fmt::format("{}: shard.{} and shard.{} overlap", caller,
                                                arrays[i].name, arrays[j].name));
      }
    }
  }
  return Status::Ok();
}

// ---- one step ----------------------------------------------------------------------------------

using KernelFn = void (*)(const AdamStepScalars&, const AdamKernelRange&);

// Only called for an ISA that CpuHas; the SIMD kernels are built on x86 only.
KernelFn KernelFor(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == Isa::kAvx2) return detail::AdamKernelAvx2;
  if (isa == Isa::kAvx512) return detail::AdamKernelAvx512;
#else
  (void)isa;
#endif
  return detail::AdamKernelScalar;
}

// What every chunk of one call shares.
struct StepPlan {
  KernelFn kernel;
  AdamStepScalars scalars;
  AdamKernelRange whole;  // the shard
  size_t chunk_elements;
  size_t out_bytes;  // bytes per out16 element (0 without out16)
};

void RunChunk(const void* context, int chunk) {
  const auto& plan = *static_cast<const StepPlan*>(context);
  const size_t begin = static_cast<size_t>(chunk) * plan.chunk_elements;
  const size_t end = std::min(plan.whole.n, begin + plan.chunk_elements);
  AdamKernelRange r = plan.whole;
  r.master += begin;
  r.grad += begin;
  r.m += begin;
  r.v += begin;
  if (r.out16 != nullptr) r.out16 = static_cast<char*>(r.out16) + begin * plan.out_bytes;
  r.n = end - begin;
  plan.kernel(plan.scalars, r);
}

}  // namespace

namespace detail {

// Not static: device_adam.cc launches the CUDA kernel with the same scalars.
AdamStepScalars ComputeAdamStepScalars(const AdamHyper& h) {
  const double t = static_cast<double>(h.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  AdamStepScalars s{};
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.lr_weight_decay = static_cast<float>(h.lr * h.weight_decay);
  s.step_size = static_cast<float>(h.lr / bc1);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.decay = h.weight_decay == 0.0 ? DecayMode::kNone
            : h.decoupled         ? DecayMode::kDecoupled
                                  : DecayMode::kL2;
  return s;
}

Status ValidateAdamStep(const AdamHyper& hyper, const AdamShard& shard, std::string_view caller) {
  STRATA_RETURN_IF_ERROR(ValidateHyper(hyper, caller));
  STRATA_RETURN_IF_ERROR(OutKindOf(shard, caller));
  return ValidateShard(shard, caller);
}

}  // namespace detail

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (CpuHas(isa)) isas.push_back(isa);
  }
  return isas;
}

Isa BestIsa() {
  const std::vector<Isa> supported = SupportedIsas();
  if (const char* env = std::getenv("STRATA_ADAM_ISA"); env != nullptr && *env != '\0') {
    const std::string_view wanted(env);
    for (Isa isa : supported) {
      if (IsaName(isa) == wanted) return isa;
    }
    STRATA_LOG_ONCE(warn, optim,
                    "STRATA_ADAM_ISA={} is not an ISA this CPU and build support (scalar, "
                    "avx2, avx512 where available); ignoring it",
                    wanted);
  }
  return supported.back();
}

Status CpuAdamStep(const AdamHyper& hyper, const AdamShard& shard, const CpuAdamOptions& options) {
  STRATA_RETURN_IF_ERROR(detail::ValidateAdamStep(hyper, shard, "CpuAdamStep"));
  if (options.threads < 1) {
    return InvalidArgumentError(
        fmt::format("CpuAdamStep: threads is {}; expected >= 1", options.threads));
  }
  if (!CpuHas(options.isa)) {
    return InvalidArgumentError(
        fmt::format("CpuAdamStep: ISA {} is not supported by this CPU", IsaName(options.isa)));
  }
  if (shard.n == 0) return Status::Ok();

  STRATA_ASSIGN_OR_RETURN(const OutKind out, OutKindOf(shard, "CpuAdamStep"));
  StepPlan plan;
  plan.kernel = KernelFor(options.isa);
  plan.scalars = detail::ComputeAdamStepScalars(hyper);
  plan.out_bytes = out == OutKind::kNone ? 0 : device::DTypeSize(shard.out_dtype);
  const size_t total_bytes = shard.n * (16 + plan.out_bytes);
  plan.whole =
      AdamKernelRange{shard.master, shard.grad, shard.m, shard.v,
                      shard.out16,  shard.n,    out,     total_bytes >= kStreamingThresholdBytes};

  // Chunks of at least kAdamMinChunkElements, boundaries on kAdamChunkAlignElements.
  const size_t by_size = std::max<size_t>(1, shard.n / kAdamMinChunkElements);
  const size_t count = std::min(static_cast<size_t>(options.threads), by_size);
  const size_t per_chunk = (shard.n + count - 1) / count;
  plan.chunk_elements =
      (per_chunk + kAdamChunkAlignElements - 1) / kAdamChunkAlignElements * kAdamChunkAlignElements;
  const size_t chunks = (shard.n + plan.chunk_elements - 1) / plan.chunk_elements;
  Pool().Run(static_cast<int>(chunks), RunChunk, &plan);
  return Status::Ok();
}

void ReferenceAdamStepDouble(const AdamHyper& h, const AdamShard& s) {
  const double t = static_cast<double>(h.step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  for (size_t i = 0; i < s.n; ++i) {
    double p = s.master[i];
    double g = static_cast<double>(s.grad[i]) * h.grad_scale;
    double m = s.m[i];
    double v = s.v[i];
    if (h.weight_decay != 0.0) {
      if (h.decoupled) {
        p -= h.lr * h.weight_decay * p;
      } else {
        g += h.weight_decay * p;
      }
    }
    m = h.beta1 * m + (1.0 - h.beta1) * g;
    v = h.beta2 * v + (1.0 - h.beta2) * g * g;
    p -= h.lr * (m / bc1) / (std::sqrt(v / bc2) + h.eps);
    const auto pf = static_cast<float>(p);
    s.master[i] = pf;
    s.m[i] = static_cast<float>(m);
    s.v[i] = static_cast<float>(v);
    if (s.out16 == nullptr) continue;
    switch (s.out_dtype) {
      case device::DType::kBF16:
        static_cast<uint16_t*>(s.out16)[i] = device::convert::FloatToBf16(pf);
        break;
      case device::DType::kF16:
        static_cast<uint16_t*>(s.out16)[i] = device::convert::FloatToF16(pf);
        break;
      case device::DType::kF32:
        static_cast<float*>(s.out16)[i] = pf;
        break;
    }
  }
}

}  // namespace strata::optim
