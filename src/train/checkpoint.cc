#include "train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/errno.h"
#include "common/log.h"
#include "common/units.h"
#include "train/checksum_manifest.h"
#include "train/lora_files.h"
#include "train/rank_gather.h"
#include "train/safetensors.h"

namespace strata::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTrainerStateFile = "trainer_state.json";
constexpr const char* kLatest = "latest";

std::string StepDirName(int64_t step) { return fmt::format("step-{:08d}", step); }

std::string OptimizerName(zero::StateKind kind, const std::string& param) {
  return std::string(zero::StateKindName(kind)) + "." + param;
}

}  // namespace

const char* TorchDtypeName(device::DType d) {
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

namespace {


// A set of tensors split into files of at most max_bytes of data each (in the given order; a
// tensor larger than max_bytes gets a file of its own).
struct FileSet {
  std::string base;  // "model" or "optimizer"
  std::vector<std::string> files;
  std::vector<SafetensorsLayout> layouts;
  std::map<std::string, size_t, std::less<>> file_of;
  uint64_t total_bytes = 0;

  std::string index_name() const { return base + ".safetensors.index.json"; }
  bool sharded() const { return files.size() > 1; }
};

Result<FileSet> PlanFiles(const std::string& base, const std::vector<SafetensorsTensorSpec>& specs,
                          uint64_t max_bytes) {
  FileSet set;
  set.base = base;
  std::vector<std::vector<SafetensorsTensorSpec>> groups(1);
  uint64_t in_group = 0;
  for (const auto& s : specs) {
    uint64_t n = SafetensorsDTypeSize(s.dtype);
    for (uint64_t d : s.shape) n *= d;
    if (in_group > 0 && in_group + n > max_bytes) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(s);
    in_group += n;
    set.total_bytes += n;
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::string name =
        groups.size() == 1 ? base + ".safetensors"
                           : fmt::format("{}-{:05d}-of-{:05d}.safetensors", base, i + 1, groups.size());
    STRATA_ASSIGN_OR_RETURN(SafetensorsLayout layout,
                            SafetensorsLayout::Compute(groups[i], {{"format", "pt"}}));
    for (const auto& s : groups[i]) set.file_of[s.name] = i;
    set.files.push_back(name);
    set.layouts.push_back(std::move(layout));
  }
  return set;
}

// Every rank learns whether every rank succeeded. Returns this rank's own error, or Aborted
// naming the ranks that failed.
Status AgreeOk(comm::Collective& comm, device::Device& dev, device::Stream& stream,
               const Status& mine, std::string_view what) {
  if (comm.world_size() == 1) return mine;
  // Collectives run in enqueue order whatever their stream (strata/collective.h), so this one
  // follows the caller's on every rank; nothing here may fail on one rank before the gather.
  (void)stream;
  Result<std::vector<float>> flags = [&]() -> Result<std::vector<float>> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<RankGather> gather, RankGather::Create(dev, comm));
    return gather->Gather(mine.ok() ? 0.0f : 1.0f);
  }();
  if (!mine.ok()) return mine;
  STRATA_RETURN_IF_ERROR(flags.status());
  std::string failed;
  for (size_t r = 0; r < flags->size(); ++r) {
    if ((*flags)[r] != 0.0f) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  }
  if (failed.empty()) return Status::Ok();
  return Status(StatusCode::kAborted, fmt::format("{}: failed on rank(s) {} (see their error)", what, failed));
}

// The first element of `data` that is not finite (NaN or infinite), or -1.
int64_t FirstNonFinite(const void* data, uint64_t count, device::DType dtype) {
  if (dtype == device::DType::kF32) {
    const float* f = static_cast<const float*>(data);
    for (uint64_t i = 0; i < count; ++i) {
      if (!std::isfinite(f[i])) return static_cast<int64_t>(i);
    }
    return -1;
  }
  // bf16 and fp16: the exponent bits all set.
  const uint16_t mask = dtype == device::DType::kBF16 ? 0x7f80 : 0x7c00;
  const uint16_t* h = static_cast<const uint16_t*>(data);
  for (uint64_t i = 0; i < count; ++i) {
    if ((h[i] & mask) == mask) return static_cast<int64_t>(i);
  }
  return -1;
}

nlohmann::json SamplerToJson(const SamplerState& s) {
  return {{"step", s.step},       {"epoch", s.epoch},
          {"position", s.position}, {"seq_len", s.seq_len},
          {"num_windows", s.num_windows}, {"seed", s.seed},
          {"mode", std::string(SamplingModeName(s.mode))}};
}

nlohmann::json StateToJson(const TrainerState& st) {
  nlohmann::json j;
  j["format"] = "strata-checkpoint";
  j["version"] = kCheckpointFormatVersion;
  j["step"] = st.step;
  j["optimizer_steps"] = st.counters.optimizer_steps;
  if (st.counters.loss_scaler.has_value()) {
    const auto& ls = *st.counters.loss_scaler;
    j["loss_scaler"] = {{"scale", ls.scale},
                        {"iteration", ls.iteration},
                        {"last_overflow_iteration", ls.last_overflow_iteration},
                        {"hysteresis_left", ls.hysteresis_left},
                        {"overflows_at_min_scale", ls.overflows_at_min_scale}};
  } else {
    j["loss_scaler"] = nullptr;
  }
  j["sampler"] = SamplerToJson(st.sampler);
  j["world_size"] = st.world_size;
  if (st.tensor_parallel > 1) j["tensor_parallel"] = st.tensor_parallel;
  j["global_batch"] = st.global_batch;
  j["seq_len"] = st.seq_len;
  j["scheduler_total_steps"] = st.scheduler_total_steps;
  j["seed"] = st.seed;
  j["compute_dtype"] = st.compute_dtype;
  j["data"] = {{"path", st.data_path}, {"tokens", st.data_tokens}};
  if (st.data_prepared) {
    j["data"]["prepared"] = {{"packed", st.data_packed}, {"long_docs", st.data_long_docs}};
  }
  return j;
}

// The shape of slot `s`'s tensor in the files (`parts` null: the engine holds whole tensors).
std::vector<uint64_t> FileShape(const zero::ParamSlot& s, const TensorParts* parts) {
  return parts != nullptr ? parts->FileShape(s.name, s.shape)
                          : std::vector<uint64_t>(s.shape.begin(), s.shape.end());
}

// The parameters: the model's (`adapters` false), or its LoRA adapters under PEFT's names.
std::vector<SafetensorsTensorSpec> ParamSpecs(const std::vector<zero::UnitLayout>& layouts,
                                              SafetensorsDType dtype, bool adapters,
                                              const TensorParts* parts) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& l : layouts) {
    for (const auto& s : l.slots) {
      if (model::IsLoraParamName(s.name) != adapters) continue;
      specs.push_back(
          {adapters ? model::PeftAdapterName(s.name) : s.name, dtype, FileShape(s, parts)});
    }
  }
  return specs;
}

// Frozen units have no optimizer state (strata.freeze): none is written for them.
std::vector<SafetensorsTensorSpec> OptimizerSpecs(const std::vector<zero::UnitLayout>& layouts,
                                                  const std::vector<char>& frozen,
                                                  const TensorParts* parts) {
  std::vector<SafetensorsTensorSpec> specs;
  for (zero::StateKind kind :
       {zero::StateKind::kMaster, zero::StateKind::kExpAvg, zero::StateKind::kExpAvgSq}) {
    for (const auto& l : layouts) {
      if (static_cast<size_t>(l.index) < frozen.size() && frozen[static_cast<size_t>(l.index)]) {
        continue;
      }
      for (const auto& s : l.slots) {
        specs.push_back({OptimizerName(kind, s.name), SafetensorsDType::kF32, FileShape(s, parts)});
      }
    }
  }
  return specs;
}

}  // namespace

std::string TrainerStateJson(const TrainerState& state) {
  return StateToJson(state).dump(2) + "\n";
}

// ---- progress ----------------------------------------------------------------------------------

zero::StateProgress UnitProgress(std::function<void(const std::string&)> print, std::string what) {
  if (!print) return {};
  struct State {
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point last = t0;
  };
  auto state = std::make_shared<State>();
  return [print = std::move(print), what = std::move(what), state](int done, int total) {
    const auto now = std::chrono::steady_clock::now();
    if (done >= total || now - state->last < std::chrono::seconds(1)) return;
    state->last = now;
    print(fmt::format("  {}: {}/{} units ({:.1f} s)", what, done, total,
                      std::chrono::duration<double>(now - state->t0).count()));
  };
}

// ---- saving ------------------------------------------------------------------------------------

namespace {

// One save: where it goes, the files it writes, and what each rank has opened.
struct Save {
  FileSystem& files;
  std::string save_dir;
  std::string final_dir;  // SAVE/step-NNNNNNNN
  std::string tmp_dir;    // SAVE/.step-NNNNNNNN.tmp, renamed to final_dir when complete
  // The parameters, the optimizer states and, for a LoRA run, the adapters (kParams, kOptim,
  // kAdapter).
  std::vector<FileSet> sets;
  std::vector<std::vector<std::unique_ptr<SafetensorsWriter>>> writers;  // [set][file]
  static constexpr size_t kParams = 0, kOptim = 1, kAdapter = 2;

  uint64_t Bytes(size_t set) const { return set < sets.size() ? sets[set].total_bytes : 0; }

  std::string TmpPath(const std::string& name) const { return (fs::path(tmp_dir) / name).string(); }
};

Result<Save> PlanSave(const zero::Engine& engine, const TrainerState& state,
                      const std::string& save_dir, const SaveOptions& options) {
  Save save{options.fs ? *options.fs : LocalFileSystem(), save_dir, {}, {}, {}, {}};
  save.final_dir = (fs::path(save_dir) / StepDirName(state.step)).string();
  save.tmp_dir = (fs::path(save_dir) / ("." + StepDirName(state.step) + ".tmp")).string();
  const auto& layouts = engine.layouts();
  const SafetensorsDType param_dtype = ToSafetensorsDType(engine.compute_dtype());
  STRATA_ASSIGN_OR_RETURN(FileSet params,
                          PlanFiles("model", ParamSpecs(layouts, param_dtype, false, options.parts),
                                    options.max_shard_bytes));
  STRATA_ASSIGN_OR_RETURN(
      FileSet optim,
      PlanFiles("optimizer", OptimizerSpecs(layouts, engine.frozen_units(), options.parts),
                options.max_shard_bytes));
  save.sets.push_back(std::move(params));
  save.sets.push_back(std::move(optim));
  // A LoRA run's adapters: one adapter_model.safetensors, as PEFT writes it.
  const std::vector<SafetensorsTensorSpec> adapter_specs =
      ParamSpecs(layouts, param_dtype, true, options.parts);
  if (!adapter_specs.empty()) {
    STRATA_ASSIGN_OR_RETURN(FileSet adapter,
                            PlanFiles("adapter_model", adapter_specs, ~uint64_t{0}));
    save.sets.push_back(std::move(adapter));
  }
  save.writers.resize(save.sets.size());
  return save;
}

// Rank 0: the temporary directory (a save that crashed earlier left one: it goes), and every
// file created with its header and size.
Status CreateFiles(Save& save) {
  Status st = save.files.CreateDirs(save.save_dir);
  if (!st.ok()) return st.WithContext("--save");
  STRATA_RETURN_IF_ERROR(save.files.RemoveAll(save.tmp_dir));
  STRATA_RETURN_IF_ERROR(save.files.CreateDirs(save.tmp_dir));
  for (size_t k = 0; k < save.sets.size(); ++k) {
    for (size_t f = 0; f < save.sets[k].files.size(); ++f) {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                              SafetensorsWriter::Create(save.TmpPath(save.sets[k].files[f]),
                                                        save.sets[k].layouts[f], save.files));
      save.writers[k].push_back(std::move(w));
    }
  }
  return Status::Ok();
}

// The other ranks, after rank 0 created them.
Status OpenFiles(Save& save) {
  for (size_t k = 0; k < save.sets.size(); ++k) {
    for (size_t f = 0; f < save.sets[k].files.size(); ++f) {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                              SafetensorsWriter::Open(save.TmpPath(save.sets[k].files[f]),
                                                      save.sets[k].layouts[f], save.files));
      save.writers[k].push_back(std::move(w));
    }
  }
  return Status::Ok();
}

// Every rank writes its pieces of the engine's states. A checkpoint is the run's durable copy:
// one with NaN or infinite values is never written, so `latest` never moves to one.
Status WritePieces(zero::Engine& engine, Save& save, const TensorParts* parts,
                   const zero::StateProgress& progress) {
  const auto& layouts = engine.layouts();
  return engine.SaveStates(
      [&](const zero::StatePiece& p, const void* data, device::DType dtype) -> Status {
        const std::string& pname = layouts[p.unit].slots[p.slot].name;
        const bool params_kind = p.kind == zero::StateKind::kParams;
        const size_t k = !params_kind ? 1 : model::IsLoraParamName(pname) ? 2 : 0;
        const std::string name = k == 0   ? pname
                                 : k == 2 ? model::PeftAdapterName(pname)
                                          : OptimizerName(p.kind, pname);
        if (const int64_t bad = FirstNonFinite(data, static_cast<uint64_t>(p.count), dtype);
            bad >= 0) {
          return Status(StatusCode::kAborted,
                        fmt::format("tensor '{}' element {} is not finite: not saving a "
                                    "checkpoint of non-finite weights ({} is unchanged)",
                                    name, static_cast<int64_t>(p.offset) + bad,
                                    (fs::path(save.save_dir) / kLatest).string()));
        }
        auto it = save.sets[k].file_of.find(name);
        if (it == save.sets[k].file_of.end()) {
          return InternalError(fmt::format("checkpoint: no file for tensor '{}'", name));
        }
        // Tensor parallelism: this rank's part goes into the whole tensor, by its first holder.
        const TensorPart* part = parts != nullptr ? parts->Find(pname) : nullptr;
        if (part != nullptr && !part->writes) return Status::Ok();
        SafetensorsWriter& writer = *save.writers[k][it->second];
        const uint64_t size = device::DTypeSize(dtype);
        for (const PartRun& run : TensorParts::Runs(part, static_cast<uint64_t>(p.offset),
                                                    static_cast<uint64_t>(p.count))) {
          STRATA_RETURN_IF_ERROR(
              writer.WriteStrided(name, run.offset, run.chunk, run.chunks, run.stride,
                                  static_cast<const char*>(data) + run.part_offset * size, dtype));
        }
        return Status::Ok();
      },
      progress);
}

// Every rank syncs what it wrote (the first error wins; every file is finished regardless) and,
// after a good save, leaves the ranges it wrote, hashed as written, for the manifest.
Status FinishFiles(Save& save, int rank, Status st) {
  for (auto& writers : save.writers) {
    for (auto& w : writers) {
      Status f = w->Finish();
      if (st.ok()) st = f;
    }
  }
  if (!st.ok()) return st;
  std::map<std::string, std::vector<SafetensorsWriter::WrittenRange>> written;
  for (size_t k = 0; k < save.sets.size(); ++k) {
    for (size_t f = 0; f < save.writers[k].size(); ++f) {
      written[save.sets[k].files[f]] = save.writers[k][f]->written();
    }
  }
  return WriteManifestPart(save.tmp_dir, rank, written, save.files);
}

// Rank 0: the indexes, config.json, trainer_state.json, adapter_config.json and the manifest,
// then the temporary directory synced.
Status WriteSmallFiles(Save& save, const zero::Engine& engine, const model::LlamaConfig& config,
                       const TrainerState& state, const SaveOptions& options, int world) {
  std::vector<std::string> small = {"config.json", kTrainerStateFile};
  for (const FileSet& set : save.sets) {
    if (!set.sharded()) continue;
    std::map<std::string, std::string> weight_map;
    for (const auto& [name, f] : set.file_of) weight_map[name] = set.files[f];
    STRATA_RETURN_IF_ERROR(WriteSafetensorsIndex(save.TmpPath(set.index_name()), set.total_bytes,
                                                 weight_map, save.files));
    small.push_back(set.index_name());
  }
  STRATA_RETURN_IF_ERROR(
      WriteFileDurable(save.files, save.TmpPath("config.json"),
                       model::ToHfConfigJson(config, TorchDtypeName(engine.compute_dtype()))));
  STRATA_RETURN_IF_ERROR(
      WriteFileDurable(save.files, save.TmpPath(kTrainerStateFile), TrainerStateJson(state)));
  if (options.lora.enabled()) {
    STRATA_RETURN_IF_ERROR(WriteFileDurable(
        save.files, save.TmpPath(std::string(kAdapterConfigFile)),
        AdapterConfigJson(options.lora, fs::absolute(save.final_dir).string())));
    small.emplace_back(kAdapterConfigFile);
  }
  if (!options.tokenizer_dir.empty()) {
    for (const char* name : kTokenizerFiles) {
      const std::string from = (fs::path(options.tokenizer_dir) / name).string();
      if (!save.files.Exists(from)) continue;
      STRATA_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(save.files, from));
      STRATA_RETURN_IF_ERROR(WriteFileDurable(save.files, save.TmpPath(name), text));
      small.emplace_back(name);
    }
  }
  STRATA_RETURN_IF_ERROR(WriteManifest(save.tmp_dir, world, small, save.files));
  return save.files.SyncDir(save.tmp_dir);
}

// Rank 0: the complete temporary directory becomes SAVE/step-N, then SAVE/latest points at it.
// An older save of the same step (a resumed run saving again) is moved aside only now, to
// "<step>.old", which ResolveCheckpoint falls back to while `latest` names a step being replaced.
Status Publish(Save& save, const TrainerState& state) {
  FileSystem& files = save.files;
  const std::string old_dir = save.final_dir + ".old";
  if (files.Exists(save.final_dir)) {
    STRATA_RETURN_IF_ERROR(files.RemoveAll(old_dir));
    Status st = files.Rename(save.final_dir, old_dir);
    if (!st.ok()) return st.WithContext(fmt::format("move the old {} aside", save.final_dir));
  }
  STRATA_RETURN_IF_ERROR(files.Rename(save.tmp_dir, save.final_dir));
  STRATA_RETURN_IF_ERROR(files.SyncDir(save.save_dir));
  // The link: a new one beside it, renamed over it (atomic).
  const std::string link = (fs::path(save.save_dir) / kLatest).string();
  const std::string link_tmp = (fs::path(save.save_dir) / ".latest.tmp").string();
  STRATA_RETURN_IF_ERROR(files.RemoveAll(link_tmp));
  if (files.Exists(link) && !files.IsSymlink(link)) {
    return FailedPreconditionError(
        fmt::format("{} exists and is not a symbolic link; not replacing it", link));
  }
  Status st = files.Symlink(StepDirName(state.step), link_tmp);
  if (st.ok()) st = files.Rename(link_tmp, link);
  if (!st.ok()) return st.WithContext(fmt::format("point {} at {}", link, save.final_dir));
  STRATA_RETURN_IF_ERROR(files.SyncDir(save.save_dir));
  return files.RemoveAll(old_dir);
}

}  // namespace

Result<std::string> SaveCheckpoint(zero::Engine& engine, comm::Collective& comm,
                                   device::Device& device, const model::LlamaConfig& config,
                                   const TrainerState& state, const std::string& save_dir,
                                   const SaveOptions& options) {
  const int rank = comm.rank();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::Stream> stream,
                          device.CreateStream("checkpoint"));
  STRATA_ASSIGN_OR_RETURN(Save save, PlanSave(engine, state, save_dir, options));
  const std::string what = fmt::format("saving checkpoint {}", save.final_dir);
  const auto t0 = std::chrono::steady_clock::now();
  // A save that fails anywhere leaves no temporary directory behind (rank 0 made it).
  struct RemoveUnlessPublished {
    Save& save;
    bool active;
    ~RemoveUnlessPublished() {
      if (active) (void)save.files.RemoveAll(save.tmp_dir);
    }
  } cleanup{save, rank == 0};
  const zero::StateProgress progress =
      UnitProgress(rank == 0 ? options.print : nullptr, "saving checkpoint");

  // 1. Rank 0 creates every file; 2. every rank writes its pieces and its manifest part;
  // 3. rank 0 writes the small files and publishes the directory. The ranks agree after each.
  STRATA_RETURN_IF_ERROR(
      AgreeOk(comm, device, *stream, rank == 0 ? CreateFiles(save) : Status::Ok(), what));
  Status st = rank == 0 ? Status::Ok() : OpenFiles(save);
  if (st.ok()) st = WritePieces(engine, save, options.parts, progress);
  STRATA_RETURN_IF_ERROR(AgreeOk(comm, device, *stream, FinishFiles(save, rank, st), what));
  if (rank == 0) {
    st = WriteSmallFiles(save, engine, config, state, options, comm.world_size());
    if (st.ok()) st = Publish(save, state);
  }
  STRATA_RETURN_IF_ERROR(AgreeOk(comm, device, *stream, st, what));
  if (rank == 0 && options.print) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const uint64_t adapter_bytes = save.Bytes(Save::kAdapter);
    const double bytes = static_cast<double>(save.Bytes(Save::kParams) +
                                             save.Bytes(Save::kOptim) + adapter_bytes);
    options.print(fmt::format(
        "saved checkpoint {} ({} parameters{} + {} optimizer states) in {:.1f} s ({:.0f} MB/s)",
        save.final_dir, FormatBytes(save.Bytes(Save::kParams)),
        adapter_bytes > 0 ? fmt::format(" + {} LoRA adapters", FormatBytes(adapter_bytes))
                          : std::string(),
        FormatBytes(save.Bytes(Save::kOptim)), s, bytes / std::max(s, 1e-6) / 1e6));
  }
  return save.final_dir;
}

// ---- reading -----------------------------------------------------------------------------------

Status VerifyCheckpoint(const std::string& step_dir, comm::Collective& comm,
                        device::Device& device,
                        const std::function<void(const std::string&)>& print, FileSystem& files) {
  const int rank = comm.rank();
  const auto t0 = std::chrono::steady_clock::now();
  Result<Manifest> manifest = ReadManifest(step_dir, files);
  if (manifest.status().code() == StatusCode::kNotFound) {
    if (rank == 0 && print) {
      print(fmt::format("  note: {} has no {} (saved before checkpoints had checksums): not "
                        "verified",
                        step_dir, kChecksumsFile));
    }
    return Status::Ok();
  }
  Status st = manifest.status();
  VerifyResult result;
  if (st.ok()) {
    result = VerifyManifest(step_dir, *manifest, rank, comm.world_size(), files);
    if (!result.problems.empty()) {
      std::string lines;
      const size_t shown = std::min<size_t>(result.problems.size(), 3);
      for (size_t i = 0; i < shown; ++i) lines += (i ? "; " : "") + result.problems[i];
      if (result.problems.size() > shown) {
        lines += fmt::format("; and {} more (strata checkpoint verify {} lists them all)",
                             result.problems.size() - shown, step_dir);
      }
      st = Status(StatusCode::kDataLoss,
                  fmt::format("checkpoint {} is damaged: {}", step_dir, lines));
    }
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::Stream> stream, device.CreateStream("verify"));
  STRATA_RETURN_IF_ERROR(
      AgreeOk(comm, device, *stream, st, fmt::format("verifying checkpoint {}", step_dir)));
  if (rank == 0 && print) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    print(fmt::format("  verified {} against its checksums in {:.1f} s ({} on rank 0)", step_dir,
                      s, FormatBytes(result.bytes)));
  }
  return Status::Ok();
}

bool HasWeights(const std::string& dir, FileSystem& files) {
  return files.Exists((fs::path(dir) / kSafetensorsModelFile).string()) ||
         files.Exists((fs::path(dir) / kSafetensorsIndexFile).string());
}

std::string ModelDirOf(const std::string& model_arg, FileSystem& files) {
  fs::path dir(model_arg);
  if (!files.IsDirectory(model_arg) && dir.filename() == "config.json") {
    dir = dir.parent_path().empty() ? "." : dir.parent_path();
  }
  return dir.string();
}

Result<std::string> ResolveCheckpoint(const std::string& path, FileSystem& files) {
  if (!files.Exists(path)) return NotFoundError(fmt::format("--resume {}: no such directory", path));
  if (!files.IsDirectory(path)) {
    return InvalidArgumentError(fmt::format("--resume {}: not a directory", path));
  }
  if (files.Exists((fs::path(path) / kTrainerStateFile).string())) return path;
  const std::string latest = (fs::path(path) / kLatest).string();
  if (files.Exists((fs::path(latest) / kTrainerStateFile).string())) {
    const Result<std::string> target = files.ReadLink(latest);
    return target.ok() ? (fs::path(path) / *target).string() : latest;
  }
  // A crash while an existing step directory was being replaced leaves it as "<step>.old".
  if (files.IsSymlink(latest)) {
    const Result<std::string> target = files.ReadLink(latest);
    const fs::path old = fs::path(path) / ((target.ok() ? *target : std::string()) + ".old");
    if (target.ok() && files.Exists((old / kTrainerStateFile).string())) return old.string();
  }
  return NotFoundError(fmt::format(
      "--resume {}: not a Strata checkpoint (no {} in it, and no '{}' link to a step directory "
      "holding one)",
      path, kTrainerStateFile, kLatest));
}

Result<TrainerState> ReadTrainerState(const std::string& step_dir, FileSystem& files) {
  const std::string path = (fs::path(step_dir) / kTrainerStateFile).string();
  Result<std::string> text = ReadFileToString(files, path);
  if (!text.ok()) return NotFoundError(fmt::format("{}: cannot open", path));
  TrainerState st;
  try {
    const nlohmann::json j = nlohmann::json::parse(*text);
    if (j.value("format", std::string()) != "strata-checkpoint") {
      return InvalidArgumentError(fmt::format("{}: not a Strata trainer state (\"format\" is not "
                                              "\"strata-checkpoint\")", path));
    }
    const int version = j.at("version").get<int>();
    if (version != kCheckpointFormatVersion) {
      return InvalidArgumentError(fmt::format("{}: format version {}; this build reads version {}",
                                              path, version, kCheckpointFormatVersion));
    }
    st.step = j.at("step").get<int64_t>();
    st.counters.optimizer_steps = j.at("optimizer_steps").get<int64_t>();
    if (!j.at("loss_scaler").is_null()) {
      const auto& ls = j.at("loss_scaler");
      optim::LossScalerState s;
      s.scale = ls.at("scale").get<double>();
      s.iteration = ls.at("iteration").get<int64_t>();
      s.last_overflow_iteration = ls.at("last_overflow_iteration").get<int64_t>();
      s.hysteresis_left = ls.at("hysteresis_left").get<int>();
      s.overflows_at_min_scale = ls.at("overflows_at_min_scale").get<int64_t>();
      st.counters.loss_scaler = s;
    }
    const auto& sj = j.at("sampler");
    st.sampler.step = sj.at("step").get<uint64_t>();
    st.sampler.epoch = sj.at("epoch").get<uint64_t>();
    st.sampler.position = sj.at("position").get<uint64_t>();
    st.sampler.seq_len = sj.at("seq_len").get<uint64_t>();
    st.sampler.num_windows = sj.at("num_windows").get<uint64_t>();
    st.sampler.seed = sj.at("seed").get<uint64_t>();
    STRATA_ASSIGN_OR_RETURN(st.sampler.mode, ParseSamplingMode(sj.at("mode").get<std::string>()));
    st.world_size = j.at("world_size").get<int>();
    st.tensor_parallel = j.value("tensor_parallel", 1);
    st.global_batch = j.at("global_batch").get<uint64_t>();
    st.seq_len = j.at("seq_len").get<uint64_t>();
    st.scheduler_total_steps = j.at("scheduler_total_steps").get<int64_t>();
    st.seed = j.at("seed").get<uint64_t>();
    st.compute_dtype = j.at("compute_dtype").get<std::string>();
    st.data_path = j.at("data").at("path").get<std::string>();
    st.data_tokens = j.at("data").at("tokens").get<uint64_t>();
    if (j.at("data").contains("prepared")) {
      const auto& pj = j.at("data").at("prepared");
      st.data_prepared = true;
      st.data_packed = pj.at("packed").get<bool>();
      st.data_long_docs = pj.at("long_docs").get<std::string>();
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(fmt::format("{}: {}", path, e.what()));
  }
  if (st.step < 0 || st.counters.optimizer_steps < 0 || st.counters.optimizer_steps > st.step) {
    return InvalidArgumentError(fmt::format("{}: step {} / optimizer_steps {} are inconsistent",
                                            path, st.step, st.counters.optimizer_steps));
  }
  return st;
}

Status CheckSameModel(const std::string& step_dir, const model::LlamaConfig& c, FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(model::LlamaConfig saved, model::LoadLlamaConfig(step_dir, files));
  auto differ = [&](const char* field, auto a, auto b) -> Status {
    if (a == b) return Status::Ok();
    return InvalidArgumentError(fmt::format(
        "checkpoint {} is from a different model: {} is {} in the checkpoint, {} in this run",
        step_dir, field, a, b));
  };
  STRATA_RETURN_IF_ERROR(differ("vocab_size", saved.vocab_size, c.vocab_size));
  STRATA_RETURN_IF_ERROR(differ("hidden_size", saved.hidden_size, c.hidden_size));
  STRATA_RETURN_IF_ERROR(differ("intermediate_size", saved.intermediate_size, c.intermediate_size));
  STRATA_RETURN_IF_ERROR(differ("num_hidden_layers", saved.num_hidden_layers, c.num_hidden_layers));
  STRATA_RETURN_IF_ERROR(
      differ("num_attention_heads", saved.num_attention_heads, c.num_attention_heads));
  STRATA_RETURN_IF_ERROR(
      differ("num_key_value_heads", saved.num_key_value_heads, c.num_key_value_heads));
  STRATA_RETURN_IF_ERROR(differ("tie_word_embeddings", saved.tie_word_embeddings, c.tie_word_embeddings));
  STRATA_RETURN_IF_ERROR(differ("rms_norm_eps", saved.rms_norm_eps, c.rms_norm_eps));
  STRATA_RETURN_IF_ERROR(differ("rope_theta", saved.rope_theta, c.rope_theta));
  STRATA_RETURN_IF_ERROR(differ("pad_token_id", saved.pad_token_id, c.pad_token_id));
  STRATA_RETURN_IF_ERROR(differ("model_type", saved.model_type, c.model_type));
  STRATA_RETURN_IF_ERROR(differ("head_dim", saved.head_dim(), c.head_dim()));
  STRATA_RETURN_IF_ERROR(differ("q/k/v biases", saved.qkv_bias, c.qkv_bias));
  STRATA_RETURN_IF_ERROR(differ("o_proj bias", saved.o_bias, c.o_bias));
  STRATA_RETURN_IF_ERROR(differ("mlp_bias", saved.mlp_bias, c.mlp_bias));
  STRATA_RETURN_IF_ERROR(differ("q/k norms", saved.qk_norm, c.qk_norm));
  if (saved.rope_scaling != c.rope_scaling) {
    return InvalidArgumentError(fmt::format(
        "checkpoint {} is from a different model: its RoPE scaling differs from this run's",
        step_dir));
  }
  return differ("max_position_embeddings", saved.max_position_embeddings,
                c.max_position_embeddings);
}

// ---- loading -----------------------------------------------------------------------------------

struct StateFiles::Impl {
  std::string source;
  std::unique_ptr<SafetensorsModel> weights;
  // LoRA adapters (PEFT names); null: the adapter units start from the model's init.
  std::unique_ptr<SafetensorsModel> adapter;
  std::vector<char> init_from_model;  // per unit (InitialStates::init_from_model)
  std::unique_ptr<SafetensorsModel> optimizer;  // null for weights only
  std::vector<std::vector<std::string>> names;   // [unit][slot]
  uint64_t total_bytes = 0;
  TensorParts parts;  // tensor parallelism: this rank's parts of the files' whole tensors
};

namespace {

std::string ShapeString(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Every tensor `name` of `units` (through `rename`) must exist in `m` with the parameter's shape
// (the whole tensor's under tensor parallelism) and a float dtype.
Status CheckTensors(const SafetensorsModel& m, const std::vector<zero::UnitSpec>& units,
                    const std::function<std::string(const std::string&)>& rename,
                    const TensorParts& parts, uint64_t* bytes) {
  for (const auto& u : units) {
    for (const auto& p : u.params) {
      const std::string name = rename(p.name);
      Result<const SafetensorsTensor*> t = m.Find(name);
      if (!t.ok()) {
        return NotFoundError(fmt::format("{}: the model's tensor '{}' is missing", m.source(), name));
      }
      const std::vector<uint64_t> want = parts.FileShape(p.name, p.shape);
      Result<const SafetensorsFile*> file = m.FileOf(name);
      const std::string where = file.ok() ? (*file)->path() : m.source();
      if ((*t)->shape != want) {
        return InvalidArgumentError(fmt::format("{}: tensor '{}' has shape {}; the model needs {}",
                                                where, name, ShapeString((*t)->shape),
                                                ShapeString(want)));
      }
      if (!ToDeviceDType((*t)->dtype).has_value()) {
        return InvalidArgumentError(fmt::format(
            "{}: tensor '{}' is {}; loading reads F32, BF16 or F16", where, name,
            SafetensorsDTypeName((*t)->dtype)));
      }
      *bytes += (*t)->num_bytes();
    }
  }
  return Status::Ok();
}

std::vector<std::vector<std::string>> SlotNames(const std::vector<zero::UnitSpec>& units) {
  std::vector<std::vector<std::string>> names;
  for (const auto& u : units) {
    names.emplace_back();
    for (const auto& p : u.params) names.back().push_back(p.name);
  }
  return names;
}

}  // namespace

StateFiles::StateFiles(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StateFiles::~StateFiles() = default;

Result<std::unique_ptr<StateFiles>> StateFiles::OpenWeights(
    const std::string& path, const std::vector<zero::UnitSpec>& units,
    const std::string& adapter_dir, const TensorParts& parts, FileSystem& files) {
  auto impl = std::make_unique<Impl>();
  impl->source = path;
  impl->parts = parts;
  STRATA_ASSIGN_OR_RETURN(impl->weights, SafetensorsModel::Open(path, files));
  // The base weights here; LoRA adapters (units of their own) from the adapter directory.
  std::vector<zero::UnitSpec> base, adapters;
  impl->init_from_model.assign(units.size(), 0);
  for (size_t u = 0; u < units.size(); ++u) {
    base.push_back({units[u].name, {}});
    adapters.push_back({units[u].name, {}});
    for (const auto& p : units[u].params) {
      (model::IsLoraParamName(p.name) ? adapters : base).back().params.push_back(p);
    }
    if (!adapters.back().params.empty() && adapter_dir.empty()) impl->init_from_model[u] = 1;
  }
  STRATA_RETURN_IF_ERROR(CheckTensors(
      *impl->weights, base, [](const std::string& n) { return n; }, parts, &impl->total_bytes));
  if (!adapter_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(
        impl->adapter,
        SafetensorsModel::Open((fs::path(adapter_dir) / kAdapterModelFile).string(), files));
    STRATA_RETURN_IF_ERROR(CheckTensors(
        *impl->adapter, adapters, [](const std::string& n) { return model::PeftAdapterName(n); },
        parts, &impl->total_bytes));
  }
  impl->names = SlotNames(units);
  return std::unique_ptr<StateFiles>(new StateFiles(std::move(impl)));
}

Result<std::unique_ptr<StateFiles>> StateFiles::OpenCheckpoint(
    const std::string& step_dir, const std::vector<zero::UnitSpec>& units,
    const std::vector<char>& frozen, const TensorParts& parts, FileSystem& files) {
  // A LoRA run's checkpoint holds its adapters in PEFT's layout beside the weights.
  bool has_adapters = false;
  for (const auto& u : units) {
    for (const auto& p : u.params) has_adapters = has_adapters || model::IsLoraParamName(p.name);
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<StateFiles> opened,
                          OpenWeights(step_dir, units, has_adapters ? step_dir : "", parts, files));
  Impl& impl = *opened->impl_;
  const fs::path dir(step_dir);
  const std::string single = (dir / "optimizer.safetensors").string();
  const std::string index = (dir / "optimizer.safetensors.index.json").string();
  const bool has_single = files.Exists(single);
  if (!has_single && !files.Exists(index)) {
    return NotFoundError(fmt::format(
        "{}: no optimizer states (optimizer.safetensors or its index); a model directory without "
        "them is loaded with --model, not --resume",
        step_dir));
  }
  STRATA_ASSIGN_OR_RETURN(impl.optimizer,
                          SafetensorsModel::Open(has_single ? single : index, files));
  impl.total_bytes = 0;  // a resume reads the master weights, not the parameter file
  std::vector<zero::UnitSpec> trained, kept;  // frozen units have no optimizer state
  for (size_t u = 0; u < units.size(); ++u) {
    (u >= frozen.size() || !frozen[u] ? trained : kept).push_back(units[u]);
  }
  // Frozen units load their parameters from the weights (counted for the progress lines).
  for (const auto& u : kept) {
    for (const auto& p : u.params) {
      if (model::IsLoraParamName(p.name)) {
        return InvalidArgumentError(fmt::format(
            "{}: LoRA adapter '{}' is frozen in this run; adapters always train", step_dir, p.name));
      }
    }
  }
  STRATA_RETURN_IF_ERROR(CheckTensors(
      *impl.weights, kept, [](const std::string& n) { return n; }, parts, &impl.total_bytes));
  for (zero::StateKind kind :
       {zero::StateKind::kMaster, zero::StateKind::kExpAvg, zero::StateKind::kExpAvgSq}) {
    Status st = CheckTensors(
        *impl.optimizer, trained, [&](const std::string& n) { return OptimizerName(kind, n); },
        parts, &impl.total_bytes);
    if (st.code() == StatusCode::kNotFound) {
      return st.WithContext(fmt::format(
          "resuming from {} (a checkpoint saved with these parameters frozen, strata.freeze or "
          "strata.trainable, has no optimizer state for them: to train them, start from its "
          "weights with --model instead of --resume)",
          step_dir));
    }
    STRATA_RETURN_IF_ERROR(st);
  }
  return opened;
}

zero::InitialStates StateFiles::Initial(zero::StateProgress progress) const {
  zero::InitialStates init;
  init.with_optimizer = impl_->optimizer != nullptr;
  init.progress = std::move(progress);
  init.init_from_model = impl_->init_from_model;
  const Impl* impl = impl_.get();
  init.read = [impl](const zero::StatePiece& p, void* out, device::DType dtype) -> Status {
    if (p.unit < 0 || static_cast<size_t>(p.unit) >= impl->names.size() || p.slot < 0 ||
        static_cast<size_t>(p.slot) >= impl->names[p.unit].size()) {
      return InternalError(fmt::format("checkpoint: no parameter {} of unit {}", p.slot, p.unit));
    }
    const std::string& name = impl->names[p.unit][p.slot];
    // The file and the tensor's name in it.
    const SafetensorsModel* file = impl->weights.get();
    std::string file_name = name;
    if (p.kind != zero::StateKind::kParams) {
      if (!impl->optimizer) return InternalError("checkpoint: no optimizer states opened");
      file = impl->optimizer.get();
      file_name = OptimizerName(p.kind, name);
    } else if (model::IsLoraParamName(name)) {
      if (!impl->adapter)
        return InternalError(fmt::format("checkpoint: no adapter file for '{}'", name));
      file = impl->adapter.get();
      file_name = model::PeftAdapterName(name);
    }
    // Tensor parallelism: this rank's part of the whole tensor, run by run.
    const uint64_t size = device::DTypeSize(dtype);
    for (const PartRun& run :
         TensorParts::Runs(impl->parts.Find(name), static_cast<uint64_t>(p.offset),
                           static_cast<uint64_t>(p.count))) {
      for (uint64_t c = 0; c < run.chunks; ++c) {
        STRATA_RETURN_IF_ERROR(file->ReadRange(
            file_name, run.offset + c * run.stride, run.chunk,
            static_cast<char*>(out) + (run.part_offset + c * run.chunk) * size, dtype));
      }
    }
    return Status::Ok();
  };
  return init;
}

bool StateFiles::has_optimizer() const { return impl_->optimizer != nullptr; }
const std::string& StateFiles::source() const { return impl_->source; }
uint64_t StateFiles::total_bytes() const { return impl_->total_bytes; }

}  // namespace strata::train
