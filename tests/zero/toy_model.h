// A small multi-unit model for the ZeRO engine's tests: an MLP of `layers` units
//   hidden units  x_{i+1} = tanh(W_i x_i + b_i)     W_i: [width, width]
//   head unit     y = W x + b,  loss = mean over samples of 0.5 * |y - t|^2
// computed in fp32 on the CPU device (HostTask on the engine's compute stream; the CPU device's
// memory is host memory), with parameters read in the compute dtype. The data is a fixed random
// regression problem with a learnable target (a fixed random linear map of the inputs), split
// deterministically into micro-batches so that any (world size, accumulation) combination sees
// the same global batch.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "comm/in_process_collective.h"
#include "comm/single_collective.h"
#include "device/pinned_pool.h"
#include "io/fault_injection.h"
#include "io/memory_store.h"
#include "strata/block_store.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "test_support.h"
#include "train/runtime.h"
#include "zero/engine.h"
#include "zero/model.h"

namespace strata::zero::testing {

inline float ReadAs(const void* base, device::DType dtype, size_t i) {
  switch (dtype) {
    case device::DType::kF32:
      return static_cast<const float*>(base)[i];
    case device::DType::kBF16:
      return device::Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case device::DType::kF16:
      return device::F16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

struct ToyBatch : Batch {
  int samples = 0;
  std::vector<float> x;  // samples x width
  std::vector<float> t;  // samples x width
};

// Deterministic data: sample s of step `step` (global index), width w.
inline void MakeSample(int64_t step, int64_t s, int width, float* x, float* t) {
  std::mt19937_64 rng(static_cast<uint64_t>(step) * 1000003u + static_cast<uint64_t>(s) * 7919u + 1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int i = 0; i < width; ++i) x[i] = u(rng);
  // Target: a fixed smooth function of x, the same for every sample.
  for (int j = 0; j < width; ++j) {
    float acc = 0.0f;
    for (int i = 0; i < width; ++i) acc += std::sin(0.37f * static_cast<float>((j + 1) * (i + 2))) * x[i];
    t[j] = 0.5f * std::tanh(acc);
  }
}

// Micro-batch `index` (0-based, over the global batch) of `samples` samples.
inline ToyBatch MakeBatch(int64_t step, int64_t index, int samples, int width) {
  ToyBatch b;
  b.samples = samples;
  b.x.resize(static_cast<size_t>(samples) * width);
  b.t.resize(static_cast<size_t>(samples) * width);
  for (int s = 0; s < samples; ++s) {
    MakeSample(step, index * samples + s, width, &b.x[static_cast<size_t>(s) * width],
               &b.t[static_cast<size_t>(s) * width]);
  }
  return b;
}

class ToyModel final : public Model {
 public:
  ToyModel(device::Device& device, int layers, int width)
      : device_(device), layers_(layers), width_(width) {}

  std::vector<UnitSpec> units() const override {
    std::vector<UnitSpec> out;
    for (int i = 0; i < layers_; ++i) {
      UnitSpec u;
      u.name = i + 1 == layers_ ? "head" : "layer." + std::to_string(i);
      u.params.push_back({u.name + ".weight", {width_, width_}});
      u.params.push_back({u.name + ".bias", {width_}});
      out.push_back(std::move(u));
    }
    return out;
  }

  Status InitUnit(int unit, const std::vector<ParamSlot>& slots,
                  std::span<float> flat) const override {
    std::mt19937_64 rng(4242 + static_cast<uint64_t>(unit));
    const float bound = 1.0f / std::sqrt(static_cast<float>(width_));
    std::uniform_real_distribution<float> u(-bound, bound);
    for (const ParamSlot& s : slots) {
      for (int64_t i = 0; i < s.numel; ++i) flat[static_cast<size_t>(s.offset + i)] = u(rng);
    }
    return Status::Ok();
  }

  Status BeginMicroBatch(const Batch& batch, float loss_scale, device::Stream& stream) override {
    const auto& b = dynamic_cast<const ToyBatch&>(batch);
    auto x = b.x;
    auto t = b.t;
    const int n = b.samples;
    return device_.HostTask(
        stream,
        [this, x = std::move(x), t = std::move(t), n, loss_scale]() mutable {
          n_ = n;
          scale_ = loss_scale;
          acts_.assign(static_cast<size_t>(layers_) + 1, {});
          acts_[0] = std::move(x);
          target_ = std::move(t);
          loss_ = 0.0;
          return Status::Ok();
        },
        "toy begin");
  }

  Status Forward(int unit, const UnitView& params, device::Stream& stream) override {
    UnitView p = params;
    return device_.HostTask(
        stream,
        [this, unit, p]() {
          const int w = width_;
          const auto& x = acts_[static_cast<size_t>(unit)];
          std::vector<float> y(static_cast<size_t>(n_) * w);
          const bool head = unit + 1 == layers_;
          for (int s = 0; s < n_; ++s) {
            for (int j = 0; j < w; ++j) {
              float acc = ReadAs(p.param(1), p.dtype, static_cast<size_t>(j));
              for (int i = 0; i < w; ++i) {
                acc += ReadAs(p.param(0), p.dtype, static_cast<size_t>(j) * w + i) *
                       x[static_cast<size_t>(s) * w + i];
              }
              y[static_cast<size_t>(s) * w + j] = head ? acc : std::tanh(acc);
            }
          }
          if (head) {
            double loss = 0.0;
            dy_.assign(y.size(), 0.0f);
            for (size_t k = 0; k < y.size(); ++k) {
              const float d = y[k] - target_[k];
              loss += 0.5 * static_cast<double>(d) * d;
              dy_[k] = d / static_cast<float>(n_) * scale_;
            }
            loss_ = loss / n_;
          }
          acts_[static_cast<size_t>(unit) + 1] = std::move(y);
          return Status::Ok();
        },
        "toy forward");
  }

  // Called on the driving thread at each Backward call (tests use it to kill a rank mid-step).
  std::function<void(int unit)> on_backward;

  Status Backward(int unit, const UnitView& params, const UnitView& grads,
                  device::Stream& stream) override {
    if (on_backward) on_backward(unit);
    UnitView p = params;
    UnitView g = grads;
    return device_.HostTask(
        stream,
        [this, unit, p, g]() {
          const int w = width_;
          const bool head = unit + 1 == layers_;
          // delta = dL/d(pre-activation)
          std::vector<float> delta = dy_;
          if (!head) {
            const auto& a = acts_[static_cast<size_t>(unit) + 1];
            for (size_t k = 0; k < delta.size(); ++k) delta[k] *= 1.0f - a[k] * a[k];
          }
          const auto& x = acts_[static_cast<size_t>(unit)];
          // A frozen unit has no gradient buffer (zero/model.h): only dx is computed.
          const bool frozen = g.data == nullptr;
          auto* gw = frozen ? nullptr : static_cast<float*>(g.param(0));
          auto* gb = frozen ? nullptr : static_cast<float*>(g.param(1));
          for (int j = 0; j < w && !frozen; ++j) {
            float sb = 0.0f;
            for (int s = 0; s < n_; ++s) sb += delta[static_cast<size_t>(s) * w + j];
            gb[j] = sb;
            for (int i = 0; i < w; ++i) {
              float acc = 0.0f;
              for (int s = 0; s < n_; ++s) {
                acc += delta[static_cast<size_t>(s) * w + j] * x[static_cast<size_t>(s) * w + i];
              }
              gw[static_cast<size_t>(j) * w + i] = acc;
            }
          }
          if (p.dtype == device::DType::kF16 && !frozen) {
            // fp16 training keeps gradients in fp16: values beyond its range become inf, which
            // is what the loss scaler must notice.
            for (int k = 0; k < w * w; ++k) gw[k] = device::F16ToFloat(device::FloatToF16(gw[k]));
            for (int k = 0; k < w; ++k) gb[k] = device::F16ToFloat(device::FloatToF16(gb[k]));
          }
          std::vector<float> dx(x.size(), 0.0f);
          for (int s = 0; s < n_; ++s) {
            for (int i = 0; i < w; ++i) {
              float acc = 0.0f;
              for (int j = 0; j < w; ++j) {
                acc += delta[static_cast<size_t>(s) * w + j] *
                       ReadAs(p.param(0), p.dtype, static_cast<size_t>(j) * w + i);
              }
              dx[static_cast<size_t>(s) * w + i] = acc;
            }
          }
          dy_ = std::move(dx);
          return Status::Ok();
        },
        "toy backward");
  }

  Result<double> EndMicroBatch(device::Stream& stream) override {
    STRATA_RETURN_IF_ERROR(device_.Synchronize(stream));
    return loss_;
  }

  int width() const { return width_; }

 private:
  device::Device& device_;
  const int layers_;
  const int width_;
  // Touched only by the compute stream's tasks (and read after Synchronize).
  int n_ = 0;
  float scale_ = 1.0f;
  std::vector<std::vector<float>> acts_;
  std::vector<float> target_;
  std::vector<float> dy_;
  double loss_ = 0.0;
};

// A DeepSpeed config for the toy model: AdamW (lr 0.01, weight decay 0.01) and ZeRO `stage`,
// parameters / optimizer states homed on `param_dev` / `optim_dev` ("none", "cpu", "nvme"; the
// NVMe path is "@NVME@", which ToyRun::Setup replaces). `zero_extra` goes inside
// zero_optimization and `extra` at the top level; both start with a comma when not empty.
inline std::string ToyConfigJson(int stage, const std::string& param_dev,
                                 const std::string& optim_dev, const std::string& zero_extra,
                                 const std::string& extra = "",
                                 const std::string& optim_extra = "") {
  std::string zero = "\"stage\": " + std::to_string(stage);
  if (stage == 3 && param_dev != "none") {
    zero += R"(, "offload_param": {"device": ")" + param_dev + R"(", "nvme_path": "@NVME@"})";
  }
  if (stage >= 1 && optim_dev != "none") {
    zero += R"(, "offload_optimizer": {"device": ")" + optim_dev + R"(", "nvme_path": "@NVME@")" +
            optim_extra + "}";
  }
  return R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "zero_optimization": {)" +
         zero + zero_extra + "}" + extra + "}";
}

// Everything one engine run needs, on the CPU device.
struct ToyRun {
  struct Options {
    std::string config_json = "{}";
    comm::Backend backend = comm::Backend::kSingle;
    int layers = 4;
    int width = 24;
    int samples_per_micro_batch = 16;
    int steps = 10;
    // The global batch is world_size(of the run) * accumulation micro-batches; a run with world
    // size 1 and accumulation = W * A sees the same global batch as one with W ranks and A.
    int accumulation = 1;
    bool overlap_optimizer = true;
    bool real_files = true;
    std::shared_ptr<io::FaultInjector> faults;  // wrap the store when set
    uint64_t device_budget = 256ull << 20;
    uint64_t pool_bytes = 64ull << 20;
    uint64_t param_device_budget = 0;
    uint64_t param_host_budget = 0;
    std::chrono::milliseconds comm_timeout{60'000};
    std::optional<InitialStates> initial;  // EngineOptions::initial
    // Wraps the device before anything uses it (train::RuntimeOptions::wrap_device).
    std::function<std::unique_ptr<device::Device>(std::unique_ptr<device::Device>)> wrap_device;
    // Set: the run is rank `rank` of this in-process world (one thread per rank, each with its
    // own ToyRun); `backend` is then ignored.
    std::shared_ptr<comm::InProcessWorld> world;
    int rank = 0;
    // With `world`: the ranks stand for nodes of this many ranks each (their host identities
    // "node-0", "node-1", ... found by the runtime's topology discovery); 0: one node.
    int ranks_per_node = 0;
  };

  Options o;
  Config config;
  // Built by the composition root (train/runtime.h) as `strata train` builds a run; destroyed in
  // reverse: the engine stack, the model, then the device and collective.
  train::Runtime runtime;
  std::unique_ptr<strata::testing::TempDir> dir;
  std::unique_ptr<ToyModel> model;
  train::EngineStack stack;
  std::unique_ptr<device::Device>& device = runtime.device;
  std::unique_ptr<comm::Collective>& comm = runtime.comm;
  std::unique_ptr<io::BlockStore>& store = stack.store;
  std::unique_ptr<device::PinnedPool>& pool = stack.pool;
  std::unique_ptr<Engine>& engine = stack.engine;
  std::vector<StepResult> results;

  ToyRun() = default;
  ToyRun(const ToyRun&) = delete;
  ToyRun& operator=(const ToyRun&) = delete;

  Status Setup(const Options& options) {
    stack.Reset();  // a second Setup: the old run goes, engine first
    model.reset();
    o = options;
    dir = std::make_unique<strata::testing::TempDir>();
    const std::string nvme = (dir->path() / "nvme").string();
    std::filesystem::create_directories(nvme);
    std::string json = o.config_json;
    size_t pos = 0;
    while ((pos = json.find("@NVME@")) != std::string::npos) json.replace(pos, 6, nvme);
    STRATA_ASSIGN_OR_RETURN(config, ParseConfig(json, "<test config>"));
    // A config without batch sizes gets the run's: the engine plans by them (one micro-batch a
    // step lets gradient shards stream through the pinned pool).
    if (!config.batch.train_batch_size && !config.batch.train_micro_batch_size_per_gpu) {
      config.batch.train_micro_batch_size_per_gpu = o.samples_per_micro_batch;
      config.batch.gradient_accumulation_steps = o.accumulation;
    }
    // The test's own budgets, store and backend; everything else as the config says.
    train::RuntimeOptions ro;
    ro.device = DeviceKind::kCpu;
    ro.device_budget = o.device_budget;
    ro.backend = o.backend;
    ro.comm_timeout = o.comm_timeout;
    // A reference run also works inside an mpirun job.
    ro.standalone = o.backend == comm::Backend::kSingle;
    ro.wrap_device = o.wrap_device;
    if (o.world) {
      const int world = o.world->world_size();
      ro.standalone = false;
      ro.launch = comm::LaunchInfo{.rank = o.rank,
                                   .world_size = world,
                                   .local_rank = o.rank,
                                   .local_size = world,
                                   .launcher = "threads"};
      ro.make_collective = [w = o.world, rank = o.rank](device::Device& d) {
        return w->Join(rank, d);
      };
      if (o.ranks_per_node > 0) {
        ro.host_identity = "node-" + std::to_string(o.rank / o.ranks_per_node);
        ro.launch->local_rank = o.rank % o.ranks_per_node;
        ro.launch->local_size = o.ranks_per_node;
      }
    }
    STRATA_ASSIGN_OR_RETURN(runtime, train::OpenRuntime(config, ro));
    model = std::make_unique<ToyModel>(*device, o.layers, o.width);
    train::BuildOptions bo;
    bo.initial = o.initial;
    bo.pinned_pool = o.pool_bytes;
    bo.param_host_budget = o.param_host_budget;
    bo.param_device_budget = o.param_device_budget;
    bo.cpu_adam_threads = 1;
    bo.overlap_optimizer = o.overlap_optimizer;
    bo.io_threads = 1;
    bo.huge_pages = HugePages::kOff;
    bo.memory_store = !o.real_files;
    if (o.faults) {
      bo.wrap_store = [faults = o.faults](std::unique_ptr<io::BlockStore> inner) {
        return io::CreateFaultInjectingStore(std::move(inner), faults);
      };
    }
    STRATA_ASSIGN_OR_RETURN(stack, train::BuildEngine(runtime, *model, config, std::move(bo)));
    return Status::Ok();
  }

  Status Step(int64_t step) {
    const int world = comm->world_size();
    const int rank = comm->rank();
    std::vector<ToyBatch> batches;
    for (int a = 0; a < o.accumulation; ++a) {
      batches.push_back(
          MakeBatch(step, static_cast<int64_t>(a) * world + rank, o.samples_per_micro_batch, o.width));
    }
    std::vector<const Batch*> ptrs;
    for (const auto& b : batches) ptrs.push_back(&b);
    STRATA_ASSIGN_OR_RETURN(StepResult r, engine->TrainStep(ptrs));
    results.push_back(r);
    return Status::Ok();
  }

  Status Train() {
    for (int s = 0; s < o.steps; ++s) STRATA_RETURN_IF_ERROR(Step(s));
    return Status::Ok();
  }

  Result<std::vector<std::vector<float>>> Masters() {
    std::vector<std::vector<float>> out;
    for (size_t u = 0; u < engine->layouts().size(); ++u) {
      STRATA_ASSIGN_OR_RETURN(auto m, engine->GatherMaster(static_cast<int>(u)));
      out.push_back(std::move(m));
    }
    return out;
  }
  Result<std::vector<std::vector<float>>> Params() {
    std::vector<std::vector<float>> out;
    for (size_t u = 0; u < engine->layouts().size(); ++u) {
      STRATA_ASSIGN_OR_RETURN(auto m, engine->GatherParams(static_cast<int>(u)));
      out.push_back(std::move(m));
    }
    return out;
  }
};

// Runs `fn` on its own thread; true when it returned within `seconds`. On a timeout the thread
// is detached and whatever `fn` captured by shared_ptr stays alive (leaked) with it, so that a
// test that would hang reports the failure and the rest of the suite still runs.
inline bool FinishesWithin(std::function<void()> fn, int seconds) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto state = std::make_shared<State>();
  std::thread t([state, fn = std::move(fn)] {
    fn();
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->done = true;
    }
    state->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(state->mu);
  const bool done =
      state->cv.wait_for(lock, std::chrono::seconds(seconds), [&] { return state->done; });
  lock.unlock();
  if (done) {
    t.join();
  } else {
    t.detach();
  }
  return done;
}

// Largest |a - b| / (|b| + 1e-3) over all elements, and whether the shapes match.
inline double MaxRelDiff(const std::vector<std::vector<float>>& a,
                         const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0.0;
  for (size_t u = 0; u < a.size(); ++u) {
    if (a[u].size() != b[u].size()) return INFINITY;
    for (size_t i = 0; i < a[u].size(); ++i) {
      const double d = std::fabs(static_cast<double>(a[u][i]) - b[u][i]) /
                       (std::fabs(static_cast<double>(b[u][i])) + 1e-3);
      if (std::isnan(d)) return INFINITY;
      worst = std::max(worst, d);
    }
  }
  return worst;
}

// A checkpoint in memory: per (unit, slot, kind), the whole tensor in fp32, and how many times
// each element was written. The ranks of an in-process world may save into one and read from it
// at once (each its own pieces): `mu` guards the maps.
struct MemoryCheckpoint {
  using Key = std::tuple<int, int, StateKind>;
  std::map<Key, std::vector<float>> values;
  std::map<Key, std::vector<int>> writes;
  EngineCounters counters;
  std::mutex mu;

  Status Save(Engine& engine) {
    const auto& layouts = engine.layouts();
    return engine.SaveStates([&](const StatePiece& p, const void* data, device::DType dtype) {
      std::lock_guard lock(mu);
      const ParamSlot& slot = layouts.at(p.unit).slots.at(p.slot);
      const Key key{p.unit, p.slot, p.kind};
      auto& v = values[key];
      auto& w = writes[key];
      v.resize(static_cast<size_t>(slot.numel));
      w.resize(static_cast<size_t>(slot.numel));
      if (p.offset < 0 || p.count <= 0 || p.offset + p.count > slot.numel) {
        return InternalError(fmt::format("piece [{}, +{}) outside '{}'", p.offset, p.count, slot.name));
      }
      if ((p.kind == StateKind::kParams) != (dtype == engine.compute_dtype()) &&
          dtype != device::DType::kF32) {
        return InternalError("unexpected dtype");
      }
      device::ConvertHost(data, dtype, v.data() + p.offset, device::DType::kF32,
                          static_cast<size_t>(p.count));
      for (int64_t i = 0; i < p.count; ++i) w[static_cast<size_t>(p.offset + i)]++;
      return Status::Ok();
    });
  }

  InitialStates Reader(bool with_optimizer) {
    InitialStates init;
    init.with_optimizer = with_optimizer;
    init.read = [this](const StatePiece& p, void* out, device::DType dtype) -> Status {
      // fp32, or the compute dtype for a frozen unit's parameters (StateReader's contract).
      if (dtype != device::DType::kF32 && p.kind != StateKind::kParams) {
        return InternalError("reader asked for a non-fp32 optimizer state");
      }
      std::lock_guard lock(mu);
      auto it = values.find(Key{p.unit, p.slot, p.kind});
      if (it == values.end()) return NotFoundError("no such state");
      device::ConvertHost(it->second.data() + p.offset, device::DType::kF32, out, dtype,
                          static_cast<size_t>(p.count));
      return Status::Ok();
    };
    return init;
  }
};

}  // namespace strata::zero::testing
