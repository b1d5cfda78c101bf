// strata_zero_step_bench: one ZeRO-3 training step with parameters and optimizer states on NVMe,
// split into compute, exposed communication, exposed I/O and exposed optimizer time — with the
// optimizer overlapped with backward and without.
//
//   mpirun -np 2 strata_zero_step_bench --path /mnt/nvme [--layers 12] [--width 1024]
//          [--tokens 256] [--steps 5] [--json]
//
// The model is an MLP of --layers units, each a [width x width] fp32 weight and a bias with a
// tanh (the last: a linear head with a mean-squared-error loss), computed with OpenBLAS sgemm on
// the CPU device — real work of the shape a transformer block's matrix products have. Each rank
// trains on its own --tokens rows per step. Step 1 records the prefetch trace and is not
// reported; the table shows the mean of steps 2+ on rank 0 (every rank runs the same sequence).
//
// "exposed X" is time the step waited for X with nothing else to do: for the optimizer, the time
// between the end of backward and the last unit's update; for I/O, the time the driving thread
// waited for a parameter shard while the compute stream was idle; for communication, the time
// the compute stream waited for a gather, plus the reductions and gathers after backward. The
// target (issue 4): the overlapped optimizer's exposed time is at most half the sequential one.
#include <cblas.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "device/pinned_pool.h"
#include "strata/block_store.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "train/runtime.h"
#include "zero/engine.h"

namespace {

using namespace strata;

struct Rows : zero::Batch {
  std::vector<float> x, t;
};

// tanh MLP on sgemm. Activations live in host vectors (the CPU device's memory is host memory).
class GemmMlp final : public zero::Model {
 public:
  GemmMlp(device::Device& dev, int layers, int width, int tokens)
      : dev_(dev), layers_(layers), width_(width), tokens_(tokens) {}

  std::vector<zero::UnitSpec> units() const override {
    std::vector<zero::UnitSpec> out;
    for (int i = 0; i < layers_; ++i) {
      out.push_back({fmt::format("layer.{}", i), {{"weight", {width_, width_}}, {"bias", {width_}}}});
    }
    return out;
  }
  Status InitUnit(int unit, const std::vector<zero::ParamSlot>& slots,
                  std::span<float> flat) const override {
    std::mt19937 rng(17 + unit);
    std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(static_cast<float>(width_)));
    for (int64_t i = 0; i < slots[0].numel; ++i) flat[slots[0].offset + i] = n(rng);
    return Status::Ok();
  }
  Status BeginMicroBatch(const zero::Batch& batch, float, device::Stream& s) override {
    const auto& b = dynamic_cast<const Rows&>(batch);
    return dev_.HostTask(
        s,
        [this, x = b.x, t = b.t]() mutable {
          acts_.assign(layers_ + 1, {});
          acts_[0] = std::move(x);
          target_ = std::move(t);
          return Status::Ok();
        },
        "begin");
  }
  Status Forward(int u, const zero::UnitView& p, device::Stream& s) override {
    return dev_.HostTask(
        s,
        [this, u, p]() {
          const int w = width_, m = tokens_;
          auto& y = acts_[u + 1];
          y.assign(static_cast<size_t>(m) * w, 0.0f);
          const auto* wt = static_cast<const float*>(p.param(0));
          const auto* b = static_cast<const float*>(p.param(1));
          for (int r = 0; r < m; ++r) std::copy(b, b + w, y.data() + static_cast<size_t>(r) * w);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, w, w, 1.0f, acts_[u].data(), w,
                      wt, w, 1.0f, y.data(), w);
          if (u + 1 < layers_) {
            for (float& v : y) v = std::tanh(v);
          } else {
            double loss = 0.0;
            dy_.resize(y.size());
            for (size_t k = 0; k < y.size(); ++k) {
              const float d = y[k] - target_[k];
              loss += 0.5 * d * d;
              dy_[k] = d / static_cast<float>(m);
            }
            loss_ = loss / m;
          }
          return Status::Ok();
        },
        "forward");
  }
  Status Backward(int u, const zero::UnitView& p, const zero::UnitView& g,
                  device::Stream& s) override {
    return dev_.HostTask(
        s,
        [this, u, p, g]() {
          const int w = width_, m = tokens_;
          std::vector<float> dz = dy_;
          if (u + 1 < layers_) {
            const auto& y = acts_[u + 1];
            for (size_t k = 0; k < dz.size(); ++k) dz[k] *= 1.0f - y[k] * y[k];
          }
          auto* gw = static_cast<float*>(g.param(0));
          auto* gb = static_cast<float*>(g.param(1));
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w, w, m, 1.0f, dz.data(), w,
                      acts_[u].data(), w, 0.0f, gw, w);
          for (int r = 0; r < m; ++r) {
            for (int j = 0; j < w; ++j) gb[j] += dz[static_cast<size_t>(r) * w + j];
          }
          dy_.assign(static_cast<size_t>(m) * w, 0.0f);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, w, w, 1.0f, dz.data(), w,
                      static_cast<const float*>(p.param(0)), w, 0.0f, dy_.data(), w);
          return Status::Ok();
        },
        "backward");
  }
  Result<double> EndMicroBatch(device::Stream& s) override {
    STRATA_RETURN_IF_ERROR(dev_.Synchronize(s));
    return loss_;
  }

 private:
  device::Device& dev_;
  int layers_, width_, tokens_;
  std::vector<std::vector<float>> acts_;
  std::vector<float> target_, dy_;
  double loss_ = 0.0;
};

struct Mean {
  double step = 0, compute = 0, comm = 0, io = 0, opt_exposed = 0, opt_total = 0, loss = 0;
  int n = 0;
  void Add(const zero::StepResult& r) {
    step += r.step_s;
    compute += r.compute_s;
    comm += r.exposed_comm_s;
    io += r.exposed_io_s;
    opt_exposed += r.exposed_optimizer_s;
    opt_total += r.optimizer_s;
    loss = r.loss;
    ++n;
  }
  nlohmann::json Json() const {
    const double k = n > 0 ? 1.0 / n : 0.0;
    return {{"step_s", step * k},           {"compute_s", compute * k},
            {"exposed_comm_s", comm * k},   {"exposed_io_s", io * k},
            {"exposed_optimizer_s", opt_exposed * k}, {"optimizer_s", opt_total * k},
            {"final_loss", loss}};
  }
};

#define CHECK_OK(expr)                                          \
  do {                                                          \
    ::strata::Status _st = ::strata::internal::AsStatus(expr);            \
    if (!_st.ok()) {                                            \
      fmt::print(stderr, "strata_zero_step_bench: {}\n", _st.ToString());  \
      std::exit(1);                                             \
    }                                                           \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One ZeRO-3 step with parameters and optimizer on NVMe: where the time goes"};
  std::string path;
  int layers = 12, width = 1024, tokens = 256, steps = 5, adam_threads = 1;
  int64_t sub_group = 1 << 20;
  bool json = false;
  app.add_option("--path", path, "directory for the NVMe swap files")->required();
  app.add_option("--layers", layers, "units")->check(CLI::Range(2, 1000));
  app.add_option("--width", width, "hidden size")->check(CLI::Range(64, 16384));
  app.add_option("--tokens", tokens, "rows per rank per step")->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", steps, "steps per mode (the first is not reported)")
      ->check(CLI::Range(2, 1000));
  app.add_option("--sub-group-size", sub_group, "optimizer sub-group, elements");
  app.add_option("--adam-threads", adam_threads, "CPU AdamW threads");
  app.add_flag("--json", json, "print one JSON object after the table");
  CLI11_PARSE(app, argc, argv);
  openblas_set_num_threads(1);

  const std::string cfg_text = fmt::format(
      R"({{"optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
          "zero_optimization": {{"stage": 3, "sub_group_size": {},
            "offload_param": {{"device": "nvme", "nvme_path": "{}"}},
            "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}},
            "stage3_param_persistence_threshold": 0}}}})",
      sub_group, path, path);
  auto config = ParseConfig(cfg_text, "<zero_step_bench>");
  CHECK_OK(config.status());

  // Wired as `strata train` wires a run (train/runtime.h), on the CPU device; the pinned pool is
  // the engine's own plan for this model and config.
  train::RuntimeOptions ropt;
  ropt.device = DeviceKind::kCpu;
  auto runtime = train::OpenRuntime(*config, ropt);
  CHECK_OK(runtime.status());
  const int rank = runtime->comm->rank(), world = runtime->comm->world_size();
  std::filesystem::create_directories(path);

  nlohmann::json out = {{"benchmark", "zero_step"}, {"world_size", world}, {"layers", layers},
                        {"width", width}, {"tokens_per_rank", tokens}, {"steps", steps}};
  Mean means[2];
  for (int mode = 0; mode < 2; ++mode) {
    const bool overlap = mode == 0;
    GemmMlp model(*runtime->device, layers, width, tokens);
    train::BuildOptions bopt;
    bopt.overlap_optimizer = overlap;
    bopt.cpu_adam_threads = adam_threads;
    auto stack = train::BuildEngine(*runtime, model, *config, std::move(bopt));
    CHECK_OK(stack.status());
    zero::Engine* engine = stack->engine.get();
    std::mt19937 rng(99 + rank);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int s = 0; s < steps; ++s) {
      Rows rows;
      rows.x.resize(static_cast<size_t>(tokens) * width);
      rows.t.resize(rows.x.size());
      for (auto& v : rows.x) v = u(rng);
      for (size_t k = 0; k < rows.t.size(); ++k) rows.t[k] = 0.5f * rows.x[k];
      const zero::Batch* b = &rows;
      auto r = engine->TrainStep(std::span<const zero::Batch* const>(&b, 1));
      CHECK_OK(r.status());
      if (s > 0) means[mode].Add(*r);
    }
    stack->Reset();
  }

  if (rank == 0) {
    const char* names[2] = {"overlapped", "sequential"};
    fmt::print("ZeRO-3 step, {} rank(s), {} units of {}x{} fp32, {} tokens/rank, params + optimizer "
               "on NVMe ({}), mean of steps 2..{}\n",
               world, layers, width, width, tokens, path, steps);
    fmt::print("{:<11} {:>9} {:>9} {:>11} {:>10} {:>13} {:>11}\n", "optimizer", "step s",
               "compute s", "exp. comm s", "exp. io s", "exp. optim s", "optim work s");
    for (int mode = 0; mode < 2; ++mode) {
      const auto j = means[mode].Json();
      fmt::print("{:<11} {:>9.3f} {:>9.3f} {:>11.3f} {:>10.3f} {:>13.3f} {:>11.3f}\n",
                 names[mode], j["step_s"].get<double>(), j["compute_s"].get<double>(),
                 j["exposed_comm_s"].get<double>(), j["exposed_io_s"].get<double>(),
                 j["exposed_optimizer_s"].get<double>(), j["optimizer_s"].get<double>());
      out[names[mode]] = j;
    }
    const double a = means[0].Json()["exposed_optimizer_s"].get<double>();
    const double b = means[1].Json()["exposed_optimizer_s"].get<double>();
    const double ratio = b > 0 ? a / b : 0.0;
    out["exposed_optimizer_ratio"] = ratio;
    out["target_ratio"] = 0.5;
    out["meets_target"] = ratio <= 0.5;
    fmt::print("exposed optimizer time, overlapped / sequential: {:.3f} (target <= 0.5: {})\n",
               ratio, ratio <= 0.5 ? "met" : "NOT met");
    if (json) fmt::print("{}\n", out.dump());
  }
  return 0;
}
