#include "train/step_report.h"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <string>
#include <nlohmann/json.hpp>

#include "common/units.h"
#include "device/pinned_pool.h"

namespace strata::train {

struct StepReporter::Figures {
  zero::EngineStats stats;
  double tokens_per_s = 0;
  double tflops = 0;
  uint64_t nvme_read = 0;
  uint64_t nvme_write = 0;
  // Pageable host<->device copies made by the step (a bug on a GPU, where they stall the
  // stream): counted by the device, zero in every test configuration.
  uint64_t pageable = 0;
  // Bytes this rank sent in the step, per phase (comm/topology.h).
  std::array<comm::Traffic, comm::kTrafficPhases> net{};
  comm::Traffic net_total() const {
    comm::Traffic t;
    for (const comm::Traffic& p : net) {
      t.intra_bytes += p.intra_bytes;
      t.inter_bytes += p.inter_bytes;
    }
    return t;
  }
};

namespace {

// "forward_gathers" for the metrics' keys.
std::string PhaseKey(comm::TrafficPhase phase) {
  std::string key(comm::TrafficPhaseName(phase));
  for (char& c : key)
    if (c == ' ') c = '_';
  return key;
}

}  // namespace

StepReporter::StepReporter(const RunPlan& plan, Run& run)
    : plan_(plan),
      run_(run),
      flops_per_token_(plan.model.TrainFlopsPerToken(plan.seq_len)),
      tokens_per_step_(plan.layout.global_batch() * static_cast<uint64_t>(plan.seq_len)),
      pageable_seen_(run.device().memory_stats().pageable_copies) {}

Result<std::unique_ptr<StepReporter>> StepReporter::Open(const RunPlan& plan, Run& run) {
  std::unique_ptr<StepReporter> r(new StepReporter(plan, run));
  const TrainOptions& o = plan.options;
  if (!o.metrics_path.empty() && run.rank() == 0) {
    Result<std::unique_ptr<File>> f = LocalFileSystem().Open(
        o.metrics_path, plan.resumed ? OpenMode::kAppend : OpenMode::kCreate);
    if (!f.ok()) {
      return Status(f.status().code(), fmt::format("--metrics {}: cannot open for writing: {}",
                                                   o.metrics_path, f.status().message()));
    }
    r->metrics_ = std::move(f).value();
    STRATA_ASSIGN_OR_RETURN(r->metrics_size_, r->metrics_->Size());
  }
  if (run.rank() == 0 && !plan.eval_only()) {
    STRATA_ASSIGN_OR_RETURN(r->monitors_, CreateMonitors(plan.config));
    for (const auto& m : r->monitors_) run.say(fmt::format("  monitor: {}", m->where()));
  }
  return r;
}

void StepReporter::ForgetPageableCopies() {
  pageable_seen_ = run_.device().memory_stats().pageable_copies;
}

StepReporter::~StepReporter() = default;

void StepReporter::Measure(const zero::StepResult& r) {
  current_ = std::make_unique<Figures>();
  Figures& f = *current_;
  const uint64_t pageable_now = run_.device().memory_stats().pageable_copies;
  f.pageable = pageable_now - pageable_seen_;
  pageable_seen_ = pageable_now;
  f.stats = run_.engine().stats();
  f.tokens_per_s = static_cast<double>(tokens_per_step_) / r.step_s;
  f.tflops = f.tokens_per_s * flops_per_token_ / 1e12;
  const zero::EngineStats& st = f.stats;
  f.nvme_read = (st.param_nvme_read_bytes + st.optim_nvme_read_bytes) -
                (last_.param_nvme_read_bytes + last_.optim_nvme_read_bytes);
  f.nvme_write = (st.param_nvme_write_bytes + st.optim_nvme_write_bytes) -
                 (last_.param_nvme_write_bytes + last_.optim_nvme_write_bytes);
  for (size_t p = 0; p < f.net.size(); ++p) {
    f.net[p].intra_bytes = st.traffic[p].intra_bytes - last_.traffic[p].intra_bytes;
    f.net[p].inter_bytes = st.traffic[p].inter_bytes - last_.traffic[p].inter_bytes;
  }
  last_ = st;
}

std::string StepReporter::Line(int64_t done, const zero::StepResult& r, const Figures& f) const {
  return fmt::format(
      "step {:>5} | loss {:.4f} | lr {:.3e} | {:.0f} tok/s | {:.3f} TFLOPS | step {:.3f} s = "
      "compute {:.3f} + comm {:.3f} + io {:.3f} + optim {:.3f} | nvme r {} w {} | prefetch hit "
      "{:.0f}% | peak device {} host {}{}{}{}",
      done, r.loss, r.lr, f.tokens_per_s, f.tflops, r.step_s, r.compute_s, r.exposed_comm_s,
      r.exposed_io_s, r.exposed_optimizer_s, FormatBytes(f.nvme_read), FormatBytes(f.nvme_write),
      100.0 * f.stats.prefetch_hit_rate, FormatBytes(f.stats.device_peak_bytes),
      FormatBytes(f.stats.host_peak_bytes),
      run_.world() == 1 ? ""
                        : fmt::format(" | sent node {} across {}",
                                      FormatBytes(f.net_total().intra_bytes),
                                      FormatBytes(f.net_total().inter_bytes)),
      !r.skipped                   ? ""
      : plan_.config.fp16.enabled ? " | skipped (fp16 overflow)"
                                  : " | skipped (non-finite gradients, strata.on_nonfinite skip)",
      f.pageable > 0 ? fmt::format(" | {} pageable copies", f.pageable) : "");
}

Status StepReporter::WriteMetrics(int64_t done, const zero::StepResult& r, const Figures& f,
                                const std::optional<EvalResult>& eval) {
  const device::PinnedPoolStats pool =
      run_.stack.pool ? run_.stack.pool->stats() : device::PinnedPoolStats{};
  const zero::EngineStats& st = f.stats;
  nlohmann::json j = {
      {"step", done},
      {"loss", r.loss},
      {"lr", r.lr},
      {"grad_norm", r.grad_norm},
      {"loss_scale", r.loss_scale},
      {"skipped", r.skipped},
      {"tokens_per_s", f.tokens_per_s},
      {"tflops", f.tflops},
      {"step_s", r.step_s},
      {"compute_s", r.compute_s},
      {"exposed_comm_s", r.exposed_comm_s},
      {"exposed_io_s", r.exposed_io_s},
      {"exposed_optimizer_s", r.exposed_optimizer_s},
      {"nvme_read_bytes", f.nvme_read},
      {"nvme_write_bytes", f.nvme_write},
      {"prefetch_hit_rate", st.prefetch_hit_rate},
      {"device_peak_bytes", st.device_peak_bytes},
      {"param_device_peak_bytes", st.param_device_peak_bytes},
      {"param_device_budget_bytes", st.param_device_budget_bytes},
      {"host_peak_bytes", st.host_peak_bytes},
      {"pinned_pool_bytes", pool.size},
      {"pinned_pool_peak_bytes", pool.peak},
      {"host_rss_peak_bytes", PeakResidentBytes()},
      {"pageable_copies", f.pageable},
      {"model_device_bytes", run_.model->activation_bytes() + run_.model->workspace_bytes()}};
  j["net_intra_bytes"] = f.net_total().intra_bytes;
  j["net_inter_bytes"] = f.net_total().inter_bytes;
  for (int p = 1; p < comm::kTrafficPhases; ++p) {  // "other" is the total's remainder
    const auto phase = static_cast<comm::TrafficPhase>(p);
    j["net_intra_bytes_" + PhaseKey(phase)] = f.net[static_cast<size_t>(p)].intra_bytes;
    j["net_inter_bytes_" + PhaseKey(phase)] = f.net[static_cast<size_t>(p)].inter_bytes;
  }
  if (eval) {
    j["eval_loss"] = eval->loss;
    j["eval_perplexity"] = std::exp(eval->loss);
  }
  const std::string line = j.dump() + "\n";
  STRATA_RETURN_IF_ERROR(metrics_->WriteAt(metrics_size_, line.data(), line.size()));
  metrics_size_ += line.size();
  return Status::Ok();
}

Status StepReporter::WriteMonitors(int64_t done, const zero::StepResult& r, const Figures& f,
                                   const std::optional<EvalResult>& eval) {
  // DeepSpeed's tags count samples; Strata's own count optimizer steps.
  const int64_t samples = done * static_cast<int64_t>(plan_.layout.global_batch());
  std::vector<MonitorEvent> events = {
      {"Train/Samples/train_loss", r.loss, samples},
      {"Train/Samples/lr", r.lr, samples},
      {"Train/Strata/tokens_per_s", f.tokens_per_s, done},
      {"Train/Strata/tflops", f.tflops, done},
      {"Train/Strata/step_s", r.step_s, done},
      {"Train/Strata/compute_s", r.compute_s, done},
      {"Train/Strata/exposed_comm_s", r.exposed_comm_s, done},
      {"Train/Strata/exposed_io_s", r.exposed_io_s, done},
      {"Train/Strata/exposed_optimizer_s", r.exposed_optimizer_s, done},
      {"Train/Strata/grad_norm", r.grad_norm, done},
      {"Train/Strata/nvme_read_bytes", static_cast<double>(f.nvme_read), done},
      {"Train/Strata/nvme_write_bytes", static_cast<double>(f.nvme_write), done},
      {"Train/Strata/device_peak_bytes", static_cast<double>(f.stats.device_peak_bytes), done},
      {"Train/Strata/host_peak_bytes", static_cast<double>(f.stats.host_peak_bytes), done}};
  if (plan_.config.fp16.enabled) events.push_back({"Train/Samples/loss_scale", r.loss_scale, samples});
  if (eval) {
    events.push_back({"Train/Strata/eval_loss", eval->loss, done});
    events.push_back({"Train/Strata/eval_perplexity", std::exp(eval->loss), done});
  }
  for (const auto& m : monitors_) STRATA_RETURN_IF_ERROR(m->Write(events));
  return Status::Ok();
}

void StepReporter::SayStep(int64_t done, const zero::StepResult& r) {
  Measure(r);
  run_.say(Line(done, r, *current_));
}

Status StepReporter::Record(int64_t done, const zero::StepResult& r,
                            const std::optional<EvalResult>& eval) {
  if (eval) run_.say(fmt::format("eval at step {}: {}", done, EvalLine(plan_, run_, *eval)));
  if (metrics_) STRATA_RETURN_IF_ERROR(WriteMetrics(done, r, *current_, eval));
  if (!monitors_.empty()) STRATA_RETURN_IF_ERROR(WriteMonitors(done, r, *current_, eval));
  return Status::Ok();
}

}  // namespace strata::train
