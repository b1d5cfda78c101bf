#include "train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "device/pinned_pool.h"
#include "model/llama_config.h"
#include "model/llama_model.h"
#include "strata/block_store.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/trace.h"
#include "train/data.h"
#include "train/safetensors.h"
#include "zero/engine.h"

namespace strata::train {

namespace {

std::string RankPath(const std::string& path, int rank, int world) {
  if (world <= 1) return path;
  std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) +
                             p.extension().string()))
      .string();
}

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return fmt::format("{:.1f} {}", v, units[u]);
}

SafetensorsDType ToSafetensors(device::DType d) {
  switch (d) {
    case device::DType::kBF16:
      return SafetensorsDType::kBF16;
    case device::DType::kF16:
      return SafetensorsDType::kF16;
    case device::DType::kF32:
      break;
  }
  return SafetensorsDType::kF32;
}

const char* TorchDtype(device::DType d) {
  switch (d) {
    case device::DType::kBF16:
      return "bfloat16";
    case device::DType::kF16:
      return "float16";
    case device::DType::kF32:
      break;
  }
  return "float32";
}

// Writes DIR/config.json and DIR/model.safetensors (Hugging Face layout). Collective: every rank
// takes part in the gathers; rank 0 writes.
Status SaveModel(zero::Engine& engine, const model::LlamaConfig& cfg, const std::string& dir,
                 int rank, const std::function<void(const std::string&)>& print) {
  const auto t0 = std::chrono::steady_clock::now();
  const device::DType dtype = engine.compute_dtype();
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& l : engine.layouts()) {
    for (const auto& s : l.slots) {
      specs.push_back({s.name, ToSafetensors(dtype),
                       std::vector<uint64_t>(s.shape.begin(), s.shape.end())});
    }
  }
  STRATA_ASSIGN_OR_RETURN(SafetensorsLayout layout,
                          SafetensorsLayout::Compute(specs, {{"format", "pt"}}));
  std::unique_ptr<SafetensorsWriter> writer;
  const std::string final_path = (std::filesystem::path(dir) / "model.safetensors").string();
  const std::string tmp_path = final_path + ".tmp";
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return Status(StatusCode::kPermissionDenied,
                    fmt::format("--save {}: cannot create the directory: {}", dir, ec.message()));
    }
    STRATA_ASSIGN_OR_RETURN(writer, SafetensorsWriter::Create(tmp_path, layout));
  }
  size_t done = 0;
  for (const auto& l : engine.layouts()) {
    STRATA_ASSIGN_OR_RETURN(std::vector<float> unit, engine.GatherParams(l.index));
    if (rank == 0) {
      for (const auto& s : l.slots) {
        STRATA_RETURN_IF_ERROR(writer->WriteRange(s.name, 0, static_cast<uint64_t>(s.numel),
                                                  unit.data() + s.offset, device::DType::kF32));
      }
      ++done;
      if (print && engine.layouts().size() > 4 && done % 4 == 0) {
        print(fmt::format("  saving: {}/{} units", done, engine.layouts().size()));
      }
    }
  }
  if (rank != 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(writer->Finish());
  STRATA_RETURN_IF_ERROR(CommitFile(tmp_path, final_path));
  const std::string cfg_final = (std::filesystem::path(dir) / "config.json").string();
  {
    std::ofstream out(cfg_final + ".tmp");
    out << model::ToHfConfigJson(cfg, TorchDtype(dtype));
    if (!out) {
      return Status(StatusCode::kPermissionDenied,
                    fmt::format("{}: cannot write the model config", cfg_final));
    }
  }
  STRATA_RETURN_IF_ERROR(CommitFile(cfg_final + ".tmp", cfg_final));
  if (print) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    print(fmt::format("saved {} ({} tensors, {}) in {:.1f} s", dir, specs.size(),
                      HumanBytes(layout.file_size()), s));
  }
  return Status::Ok();
}

}  // namespace

Status RunTraining(const TrainOptions& o) {
  auto print = o.print ? o.print : [](const std::string& line) {
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
  };
  if (o.steps < 1) return InvalidArgumentError(fmt::format("--steps {}: expected >= 1", o.steps));
  STRATA_ASSIGN_OR_RETURN(Config config, LoadConfigFile(o.config_path));
  STRATA_ASSIGN_OR_RETURN(model::LlamaConfig mcfg, model::ResolveModel(o.model));
  const int64_t seq_len =
      o.seq_len > 0 ? o.seq_len : std::min<int64_t>(256, mcfg.max_position_embeddings);

  // Devices and ranks.
  const comm::LaunchInfo launch = comm::DetectLaunch();
  std::unique_ptr<TraceRecorder> trace;
  if (!o.trace_path.empty()) {
    trace = std::make_unique<TraceRecorder>(launch.rank, fmt::format("rank {}", launch.rank));
  }
  device::DeviceOptions dopt;
  dopt.type = device::DeviceType::kCpu;
  dopt.trace = trace.get();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::Device> dev, device::CreateDevice(dopt));
  comm::CollectiveOptions copt;
  copt.trace = trace.get();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Collective> comm,
                          comm::CreateCollective(*dev, copt));
  const int rank = comm->rank(), world = comm->world_size();
  auto say = [&](const std::string& line) {
    if (rank == 0) print(line);
  };

  STRATA_ASSIGN_OR_RETURN(BatchSizes batch, ResolveBatchSizes(config.batch, world));
  if (!config.scheduler.total_num_steps.has_value() &&
      (config.scheduler.type == SchedulerType::kWarmupDecayLR ||
       config.scheduler.type == SchedulerType::kWarmupCosineLR)) {
    config.scheduler.total_num_steps = o.steps;
  }

  // Data.
  STRATA_ASSIGN_OR_RETURN(TokenDtype token_dtype, ParseTokenDtype(o.data_dtype));
  STRATA_ASSIGN_OR_RETURN(TokenDataset data,
                          TokenDataset::Open(o.data, static_cast<uint64_t>(mcfg.vocab_size),
                                             token_dtype));
  BatchLayout layout{world, static_cast<int>(batch.train_micro_batch_size_per_gpu),
                     static_cast<int>(batch.gradient_accumulation_steps)};
  SamplerOptions sopt;
  sopt.seq_len = static_cast<uint64_t>(seq_len);
  sopt.global_batch = layout.global_batch();
  STRATA_ASSIGN_OR_RETURN(sopt.mode, ParseSamplingMode(o.sampling));
  sopt.seed = o.seed;
  STRATA_ASSIGN_OR_RETURN(SequenceSampler sampler, SequenceSampler::Create(&data, sopt));

  // Model, store, pool, engine.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::LlamaModel> llama,
                          model::LlamaModel::Create(*dev, mcfg, seq_len,
                                                    batch.train_micro_batch_size_per_gpu,
                                                    config.strata.seed));
  io::StoreOptions store_opt;
  store_opt.threads = config.strata.io.threads;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<io::BlockStore> store, io::CreateBlockStore(store_opt));
  uint64_t pool_bytes = 0;
  if (config.strata.memory.pinned_pool.has_value()) {
    pool_bytes = *config.strata.memory.pinned_pool;
  } else {
    STRATA_ASSIGN_OR_RETURN(pool_bytes,
                            zero::Engine::PlanPinnedPoolBytes(llama->units(), config, world));
  }
  device::PinnedPoolOptions popt;
  popt.bytes = pool_bytes;
  popt.device = dev.get();
  popt.store = store.get();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::PinnedPool> pool,
                          device::PinnedPool::Create(popt));
  zero::EngineOptions eo;
  eo.config = config;
  eo.device = dev.get();
  eo.comm = comm.get();
  eo.pool = pool.get();
  eo.store = store.get();
  eo.trace = trace.get();
  say(fmt::format(
      "strata train: model {} ({:.1f}M parameters, {} layers), {} rank(s), ZeRO stage {}, "
      "parameters on {}, optimizer on {}, {}",
      mcfg.name, static_cast<double>(mcfg.ParameterCount()) / 1e6, mcfg.num_hidden_layers, world,
      config.zero.stage, OffloadDeviceName(config.zero.offload_param.device),
      OffloadDeviceName(config.zero.offload_optimizer.device), PrecisionName(config.precision())));
  say(fmt::format("  data {} ({} tokens), sequence {} x global batch {} ({} per rank x {} "
                  "accumulation), {} steps",
                  o.data, data.size(), seq_len, layout.global_batch(), layout.micro_batch,
                  layout.grad_accum, o.steps));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<zero::Engine> engine, zero::Engine::Create(*llama, eo));

  std::unique_ptr<std::ofstream> metrics;
  if (!o.metrics_path.empty() && rank == 0) {
    metrics = std::make_unique<std::ofstream>(o.metrics_path, std::ios::trunc);
    if (!*metrics) {
      return Status(StatusCode::kPermissionDenied,
                    fmt::format("--metrics {}: cannot open for writing", o.metrics_path));
    }
  }

  const double flops_per_token = mcfg.TrainFlopsPerToken(seq_len);
  const uint64_t tokens_per_step = layout.global_batch() * static_cast<uint64_t>(seq_len);
  const size_t row = static_cast<size_t>(seq_len) + 1;
  zero::EngineStats last{};
  for (int64_t step = 0; step < o.steps; ++step) {
    std::vector<model::LlamaBatch> mbs(static_cast<size_t>(layout.grad_accum));
    std::vector<const zero::Batch*> ptrs;
    for (int a = 0; a < layout.grad_accum; ++a) {
      mbs[a].tokens.resize(row * static_cast<size_t>(layout.micro_batch));
      STRATA_RETURN_IF_ERROR(sampler.ReadRankBatch(static_cast<uint64_t>(step), layout, rank, a,
                                                   mbs[a].tokens));
      ptrs.push_back(&mbs[a]);
    }
    STRATA_ASSIGN_OR_RETURN(zero::StepResult r, engine->TrainStep(ptrs));
    sampler.Advance();
    const zero::EngineStats st = engine->stats();
    const double tok_s = static_cast<double>(tokens_per_step) / r.step_s;
    const double tflops = tok_s * flops_per_token / 1e12;
    const uint64_t nvme_read = (st.param_nvme_read_bytes + st.optim_nvme_read_bytes) -
                               (last.param_nvme_read_bytes + last.optim_nvme_read_bytes);
    const uint64_t nvme_write = (st.param_nvme_write_bytes + st.optim_nvme_write_bytes) -
                                (last.param_nvme_write_bytes + last.optim_nvme_write_bytes);
    last = st;
    say(fmt::format(
        "step {:>5} | loss {:.4f} | lr {:.3e} | {:.0f} tok/s | {:.3f} TFLOPS | step {:.3f} s = "
        "compute {:.3f} + comm {:.3f} + io {:.3f} + optim {:.3f} | nvme r {} w {} | prefetch "
        "hit {:.0f}% | peak device {} host {}{}",
        step + 1, r.loss, r.lr, tok_s, tflops, r.step_s, r.compute_s, r.exposed_comm_s,
        r.exposed_io_s, r.exposed_optimizer_s, HumanBytes(nvme_read), HumanBytes(nvme_write),
        100.0 * st.prefetch_hit_rate, HumanBytes(st.device_peak_bytes),
        HumanBytes(st.host_peak_bytes), r.skipped ? " | skipped (fp16 overflow)" : ""));
    if (metrics) {
      nlohmann::json j = {{"step", step + 1},
                          {"loss", r.loss},
                          {"lr", r.lr},
                          {"grad_norm", r.grad_norm},
                          {"loss_scale", r.loss_scale},
                          {"skipped", r.skipped},
                          {"tokens_per_s", tok_s},
                          {"tflops", tflops},
                          {"step_s", r.step_s},
                          {"compute_s", r.compute_s},
                          {"exposed_comm_s", r.exposed_comm_s},
                          {"exposed_io_s", r.exposed_io_s},
                          {"exposed_optimizer_s", r.exposed_optimizer_s},
                          {"nvme_read_bytes", nvme_read},
                          {"nvme_write_bytes", nvme_write},
                          {"prefetch_hit_rate", st.prefetch_hit_rate},
                          {"device_peak_bytes", st.device_peak_bytes},
                          {"host_peak_bytes", st.host_peak_bytes}};
      *metrics << j.dump() << "\n";
      metrics->flush();
    }
    const bool last_step = step + 1 == o.steps;
    if (!o.save_dir.empty() && (last_step || (o.save_every > 0 && (step + 1) % o.save_every == 0))) {
      STRATA_RETURN_IF_ERROR(SaveModel(*engine, mcfg, o.save_dir, rank, say));
    }
  }
  if (trace) {
    STRATA_RETURN_IF_ERROR(trace->WriteChromeJson(RankPath(o.trace_path, rank, world)));
    say(fmt::format("trace written to {}", RankPath(o.trace_path, 0, world)));
  }
  if (!o.save_dir.empty()) {
    say(fmt::format("the model is in {} (Hugging Face layout: "
                    "transformers.AutoModelForCausalLM.from_pretrained(\"{}\") loads it)",
                    o.save_dir, o.save_dir));
  }
  return Status::Ok();
}

}  // namespace strata::train
