#include "train/trainer.h"

#include <signal.h>
#include <string.h>
#include <fmt/format.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "train/checkpoint.h"
#include "train/run.h"
#include "train/run_plan.h"
#include "train/step_report.h"

namespace strata::train {

namespace {

// --profile-ops: each op's device time per profiled step, largest first, and what the ops leave
// of the step (the engine's own work: collectives, copies, the optimizer, waits). The first step
// warms up (allocations, cuBLAS's choices) and is not profiled.
class OpProfile {
 public:
  OpProfile(const RunPlan& plan, Run& run) : enabled_(plan.options.profile_ops), run_(run) {}

  void Step(int64_t step, const zero::StepResult& r) {
    if (!enabled_) return;
    if (step == run_.first_step) {
      run_.model->ResetOpProfile();
    } else {
      seconds_ += r.step_s;
      ++steps_;
    }
  }

  void Print() const {
    if (!enabled_) return;
    const std::vector<model::OpTime> ops = run_.model->op_profile();
    const Say& say = run_.say;
    if (steps_ == 0 || ops.empty()) {
      say("op profile: no step after the first to profile (--steps 2 or more)");
      return;
    }
    const double per = 1.0 / static_cast<double>(steps_);
    double total = 0.0;
    for (const model::OpTime& t : ops) total += t.seconds;
    say(fmt::format("op profile: device time per step, {} step(s) after the first, rank 0 "
                    "(--profile-ops)",
                    steps_));
    say(fmt::format("  {:<22} {:>10} {:>10} {:>8}", "op", "calls/step", "ms/step", "of step"));
    for (const model::OpTime& t : ops) {
      say(fmt::format("  {:<22} {:>10.0f} {:>10.3f} {:>7.1f}%", t.op,
                      static_cast<double>(t.calls) * per, t.seconds * per * 1e3,
                      100.0 * t.seconds / seconds_));
    }
    say(fmt::format("  {:<22} {:>10} {:>10.3f} {:>7.1f}%", "all ops", "", total * per * 1e3,
                    100.0 * total / seconds_));
    say(fmt::format("  {:<22} {:>10} {:>10.3f} {:>7.1f}%", "the step", "",
                    seconds_ * per * 1e3, 100.0));
  }

 private:
  bool enabled_;
  Run& run_;
  double seconds_ = 0.0;  // the profiled steps' time
  int64_t steps_ = 0;
};

// Between steps: a signal (TrainOptions::stop_signal), or the launcher gone (mpirun died: this
// rank was re-parented), stops the run; every rank learns what any rank saw, so all stop after
// the same step. 0: go on; a signal number; -1: the launcher is gone (it outranks a signal:
// nothing more is written).
class StopPoll {
 public:
  StopPoll(const RunPlan& plan, Run& run)
      : plan_(plan), run_(run), launcher_pid_(::getppid()) {}

  Result<int> Poll() {
    int mine = plan_.options.stop_signal ? plan_.options.stop_signal() : 0;
    if (plan_.launch.launcher != "none" && ::getppid() != launcher_pid_) mine = -1;
    if (run_.world() == 1) return mine;
    STRATA_ASSIGN_OR_RETURN(std::vector<float> all, run_.agreement->Gather(static_cast<float>(mine)));
    int reason = 0;
    for (float v : all) {
      if (v < 0) return -1;
      if (v > 0 && reason == 0) reason = static_cast<int>(v);
    }
    return reason;
  }

 private:
  const RunPlan& plan_;
  Run& run_;
  const pid_t launcher_pid_;
};

// The step's micro-batches, this rank's rows of each. With prepared data each micro-batch's
// loss weight makes the step's loss the mean over the global batch's trained tokens
// (training_data.h LossWeights), which needs the trained-token count of every rank's rows.
class StepBatches {
 public:
  explicit StepBatches(const RunPlan& plan) : mbs_(static_cast<size_t>(plan.layout.grad_accum)) {
    for (auto& mb : mbs_) ptrs_.push_back(&mb);
  }

  Status Read(const RunPlan& plan, const Run& run, int64_t step) {
    const auto s = static_cast<uint64_t>(step);
    std::vector<uint64_t> mine(mbs_.size());
    for (size_t a = 0; a < mbs_.size(); ++a) {
      STRATA_ASSIGN_OR_RETURN(
          const std::vector<uint64_t> rows,
          run.sampler->RankWindows(s, plan.layout, plan.data_rank(), static_cast<int>(a)));
      STRATA_ASSIGN_OR_RETURN(mine[a], run.data->Read(rows, &mbs_[a]));
    }
    if (!run.data->prepared()) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, run.sampler->GlobalBatchWindows(s));
    STRATA_ASSIGN_OR_RETURN(const uint64_t global, run.data->TrainedTargets(all));
    const std::vector<double> weights = LossWeights(mine, global, plan.data_world());
    for (size_t a = 0; a < mbs_.size(); ++a) mbs_[a].loss_weight = weights[a];
    return Status::Ok();
  }
  std::span<const zero::Batch* const> batches() const { return ptrs_; }

 private:
  std::vector<model::LlamaBatch> mbs_;
  std::vector<const zero::Batch*> ptrs_;
};

TrainerState StateAfter(const RunPlan& plan, const Run& run, int64_t done_steps) {
  TrainerState ts;
  ts.step = done_steps;
  ts.counters = run.engine().counters();
  ts.sampler = run.sampler->state();
  ts.world_size = run.world();
  ts.tensor_parallel = plan.tensor_parallel();
  ts.global_batch = plan.layout.global_batch();
  ts.seq_len = static_cast<uint64_t>(plan.seq_len);
  ts.scheduler_total_steps = plan.scheduler_total_steps;
  ts.seed = plan.seed;
  ts.compute_dtype = TorchDtypeName(run.engine().compute_dtype());
  ts.data_path = plan.options.data;
  ts.data_tokens = run.data->tokens();
  ts.data_prepared = run.data->prepared();
  ts.data_packed = plan.data.pack;
  ts.data_long_docs = std::string(LongDocumentsName(plan.data.long_documents));
  return ts;
}

Result<std::string> Save(const RunPlan& plan, Run& run, int64_t done) {
  SaveOptions options;
  options.max_shard_bytes = plan.options.max_shard_bytes;
  options.lora = plan.lora;
  options.print = run.say;
  options.tokenizer_dir = plan.model_dir;
  options.parts = &run.parts;
  return SaveCheckpoint(run.engine(), run.comm(), run.device(), plan.model,
                        StateAfter(plan, run, done), plan.options.save_dir, options);
}

Status WriteTrace(const RunPlan& plan, const Run& run) {
  if (!run.trace) return Status::Ok();
  return run.trace->WriteChromeJson(RankPath(plan.options.trace_path, run.rank(), run.world()));
}

// Cancelled: stopped by a signal after `done` steps, with what was saved.
Status Stopped(const RunPlan& plan, int signal, int64_t done, const std::string& last_save) {
  const TrainOptions& o = plan.options;
  const std::string saved =
      o.save_on_signal && !last_save.empty()
          ? fmt::format("checkpoint {}: continue with --resume {}", last_save, o.save_dir)
      : o.save_dir.empty() || !o.save_on_signal
          ? std::string("nothing saved (--save DIR --save-on-signal saves on a signal)")
          : std::string("nothing saved");
  return Status(StatusCode::kCancelled,
                fmt::format("stopped by SIG{} after step {} of {}: {}",
                            ::sigabbrev_np(signal) ? ::sigabbrev_np(signal) : "?", done, o.steps,
                            saved));
}

// The third stage: sample, step, log, evaluate, save, stop. Every rank runs it; rank 0 speaks.
Status TrainLoop(const RunPlan& plan, Run& run) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StepReporter> report, StepReporter::Open(plan, run));
  StopPoll stop_poll(plan, run);
  OpProfile profile(plan, run);
  StepBatches batches(plan);
  std::string last_save;
  for (int64_t step = run.first_step; step < plan.options.steps; ++step) {
    const int64_t done = step + 1;
    STRATA_RETURN_IF_ERROR(batches.Read(plan, run, step));
    STRATA_ASSIGN_OR_RETURN(const zero::StepResult r, run.engine().TrainStep(batches.batches()));
    run.sampler->Advance();
    profile.Step(step, r);
    report->SayStep(done, r);
    std::optional<EvalResult> eval;
    if (plan.EvalDue(done)) {
      STRATA_ASSIGN_OR_RETURN(eval, Evaluate(plan, run));
    }
    STRATA_RETURN_IF_ERROR(report->Record(done, r, eval));

    STRATA_ASSIGN_OR_RETURN(const int stop, stop_poll.Poll());
    if (stop < 0) {
      return Status(StatusCode::kAborted,
                    fmt::format("after step {}: the launcher ({}) that started this rank is gone; "
                                "stopping without writing anything more",
                                done, plan.launch.launcher));
    }
    if (plan.SaveDue(done, stop > 0)) {
      STRATA_ASSIGN_OR_RETURN(last_save, Save(plan, run, done));
      report->ForgetPageableCopies();  // a save's copies are not a step's
    }
    if (stop > 0 && done != plan.options.steps) {
      STRATA_RETURN_IF_ERROR(WriteTrace(plan, run));
      return Stopped(plan, stop, done, last_save);
    }
  }
  profile.Print();
  if (run.trace) {
    STRATA_RETURN_IF_ERROR(WriteTrace(plan, run));
    run.say(fmt::format("trace written to {}", RankPath(plan.options.trace_path, 0, run.world())));
  }
  if (!last_save.empty()) {
    run.say(fmt::format("the model is in {} (also {}/latest), in Hugging Face layout: "
                        "transformers.AutoModelForCausalLM.from_pretrained(\"{}\") loads it; "
                        "continue training with --resume {}",
                        last_save, plan.options.save_dir, last_save, plan.options.save_dir));
  }
  return Status::Ok();
}

// `strata eval`: one evaluation, said and written, without training.
Status EvalOnly(const RunPlan& plan, Run& run) {
  STRATA_ASSIGN_OR_RETURN(const EvalResult r, Evaluate(plan, run));
  run.say("eval: " + EvalLine(plan, run, r));
  return WriteEvalJson(plan, run, r);
}

}  // namespace

Status RunTraining(const TrainOptions& options) {
  STRATA_ASSIGN_OR_RETURN(RunPlan plan, ResolveRun(options, comm::DetectLaunch()));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Run> run, OpenRun(&plan));
  for (const std::string& line : DescribeRun(plan, *run)) run->say(line);
  STRATA_RETURN_IF_ERROR(LoadRun(plan, run.get()));
  if (plan.eval_only()) return EvalOnly(plan, *run);
  STRATA_ASSIGN_OR_RETURN(const bool steps_left, ResumeRun(plan, run.get()));
  if (!steps_left) return Status::Ok();
  return TrainLoop(plan, *run);
}

}  // namespace strata::train
