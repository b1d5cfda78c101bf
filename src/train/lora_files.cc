#include "train/lora_files.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace strata::train {

namespace fs = std::filesystem;

bool HasAdapter(const std::string& dir, FileSystem& files) {
  return files.Exists((fs::path(dir) / kAdapterConfigFile).string());
}

Result<LoraSettings> ReadAdapterConfig(const std::string& dir, std::string* note,
                                       FileSystem& files) {
  const std::string path = (fs::path(dir) / kAdapterConfigFile).string();
  Result<std::string> text = ReadFileToString(files, path);
  if (!text.ok()) {
    return NotFoundError(fmt::format("{}: no such file (a PEFT adapter directory holds it)", path));
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(fmt::format("{}: not JSON: {}", path, e.what()));
  }
  if (!j.is_object()) return InvalidArgumentError(fmt::format("{}: not a JSON object", path));
  auto bad = [&](std::string_view key, std::string_view why) {
    return InvalidArgumentError(fmt::format("{}: {}: {}", path, key, why));
  };
  LoraSettings s;
  try {
    if (j.value("peft_type", std::string("LORA")) != "LORA") {
      return bad("peft_type",
                 fmt::format("{}; Strata runs LoRA adapters only", j["peft_type"].dump()));
    }
    if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int>() < 1) {
      return bad("r", "missing or not a positive integer");
    }
    s.r = j["r"].get<int>();
    s.lora_alpha = j.value("lora_alpha", 8.0);
    const double dropout = j.value("lora_dropout", 0.0);
    if (dropout != 0.0 && note != nullptr) {
      *note = fmt::format("{}: lora_dropout {} is not applied (Strata trains LoRA without dropout)",
                          path, dropout);
    }
    const nlohmann::json& targets = j.value("target_modules", nlohmann::json());
    if (targets.is_string()) {
      s.target_modules = {targets.get<std::string>()};
    } else if (targets.is_array()) {
      for (const auto& t : targets)
        s.target_modules.push_back(t.get<std::string>());
    } else {
      return bad("target_modules", "missing (expected a list of projection names)");
    }
    for (const char* key : {"use_dora", "use_rslora", "fan_in_fan_out"}) {
      if (j.value(key, false)) return bad(key, "true is not implemented");
    }
    if (j.value("bias", std::string("none")) != "none")
      return bad("bias", "only \"none\" is implemented");
    for (const char* key : {"modules_to_save", "layers_to_transform", "layers_pattern"}) {
      if (j.contains(key) && !j[key].is_null() && !(j[key].is_array() && j[key].empty())) {
        return bad(key, "is not implemented (adapters on every layer only)");
      }
    }
    for (const char* key : {"rank_pattern", "alpha_pattern"}) {
      if (j.contains(key) && !j[key].is_null() && !j[key].empty()) {
        return bad(key, "per-module ranks or alphas are not implemented");
      }
    }
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(fmt::format("{}: {}", path, e.what()));
  }
  return s;
}

void AddLoraTrainablePatterns(Config* config) {
  // (strata eval freezes everything with strata.freeze "*": nothing trains.)
  if (!config->strata.lora.enabled() || !config->strata.freeze.empty()) return;
  for (const char* pattern : {"*.lora_A.weight", "*.lora_B.weight"}) {
    auto& t = config->strata.trainable;
    if (std::find(t.begin(), t.end(), pattern) == t.end()) t.emplace_back(pattern);
  }
}

std::string AdapterConfigJson(const model::LlamaLora& lora, std::string_view base_model) {
  nlohmann::json j = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", std::string(base_model)},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", 0.0},
      {"target_modules", lora.target_names()},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"use_rslora", false},
      {"use_dora", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
  };
  return j.dump(2) + "\n";
}

namespace {

// The adapter tensor of base tensor `name` ("x.weight" -> "base_model.model.x.lora_A.weight"),
// in either of PEFT's spellings (with or without the adapter's name, "default").
const SafetensorsTensor* FindAdapter(const SafetensorsModel& adapter, const std::string& name,
                                     char which, std::string* found) {
  constexpr std::string_view kSuffix = ".weight";
  if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) return nullptr;
  const std::string module = name.substr(0, name.size() - kSuffix.size());
  for (const std::string& candidate :
       {fmt::format("base_model.model.{}.lora_{}.weight", module, which),
        fmt::format("base_model.model.{}.lora_{}.default.weight", module, which)}) {
    Result<const SafetensorsTensor*> t = adapter.Find(candidate);
    if (t.ok()) {
      *found = candidate;
      return *t;
    }
  }
  return nullptr;
}

}  // namespace

Result<MergeStats> MergeLora(const std::string& base_dir, const std::string& adapter_dir,
                             const std::string& out_dir,
                             const std::function<void(const std::string&)>& print,
                             FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(const LoraSettings settings,
                          ReadAdapterConfig(adapter_dir, nullptr, files));
  const float scale = static_cast<float>(settings.lora_alpha / settings.r);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsModel> base,
                          SafetensorsModel::Open(base_dir, files));
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<SafetensorsModel> adapter,
      SafetensorsModel::Open((fs::path(adapter_dir) / kAdapterModelFile).string(), files));
  if (HasWeights(out_dir, files)) {
    return AlreadyExistsError(fmt::format(
        "--out {}: holds model weights already; not overwriting them (choose another directory)",
        out_dir));
  }
  if (Status st = files.CreateDirs(out_dir); !st.ok()) return st.WithContext("--out");

  // Which base tensors take which adapters; every adapter tensor must be used.
  struct Pair {
    const SafetensorsTensor* a = nullptr;
    const SafetensorsTensor* b = nullptr;
    std::string a_name, b_name;
  };
  std::map<std::string, Pair> pairs;
  std::set<std::string> used;
  std::vector<SafetensorsTensorSpec> specs;
  for (const std::string& name : base->TensorNames()) {
    STRATA_ASSIGN_OR_RETURN(const SafetensorsTensor* t, base->Find(name));
    specs.push_back({name, t->dtype, t->shape});
    Pair p;
    p.a = FindAdapter(*adapter, name, 'A', &p.a_name);
    p.b = FindAdapter(*adapter, name, 'B', &p.b_name);
    if ((p.a == nullptr) != (p.b == nullptr)) {
      return InvalidArgumentError(fmt::format("{}: '{}' has lora_{} but not lora_{}",
                                              adapter->source(), name, p.a ? 'A' : 'B',
                                              p.a ? 'B' : 'A'));
    }
    if (p.a == nullptr) continue;
    const auto r = static_cast<uint64_t>(settings.r);
    if (t->shape.size() != 2 || p.a->shape != std::vector<uint64_t>{r, t->shape[1]} ||
        p.b->shape != std::vector<uint64_t>{t->shape[0], r}) {
      return InvalidArgumentError(fmt::format(
          "{}: the adapter of '{}' does not fit it: lora_A {}, lora_B {} for a [{}] weight with "
          "r {}",
          adapter->source(), name, fmt::join(p.a->shape, "x"), fmt::join(p.b->shape, "x"),
          fmt::join(t->shape, ", "), r));
    }
    used.insert(p.a_name);
    used.insert(p.b_name);
    pairs[name] = p;
  }
  for (const std::string& name : adapter->TensorNames()) {
    if (!used.contains(name)) {
      return InvalidArgumentError(
          fmt::format("{}: adapter tensor '{}' matches no weight of {} (a different base model?)",
                      adapter->source(), name, base->source()));
    }
  }

  // {"format": "pt"}: transformers refuses a safetensors file without it.
  STRATA_ASSIGN_OR_RETURN(SafetensorsLayout layout,
                          SafetensorsLayout::Compute(specs, {{"format", "pt"}}));
  const std::string tmp = (fs::path(out_dir) / ".model.safetensors.tmp").string();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                          SafetensorsWriter::Create(tmp, layout, files));
  // A merge that fails leaves no partial file behind.
  struct RemoveOnFailure {
    FileSystem& files;
    const std::string& path;
    bool active = true;
    ~RemoveOnFailure() {
      if (active) (void)files.RemoveAll(path);
    }
  } cleanup{files, tmp};
  MergeStats stats;
  stats.bytes = layout.file_size();
  constexpr uint64_t kBlockElems = uint64_t{16} << 20;  // 64 MiB of fp32 per block
  std::vector<float> w, a, b;
  for (const SafetensorsTensorSpec& spec : specs) {
    STRATA_ASSIGN_OR_RETURN(const SafetensorsTensor* t, base->Find(spec.name));
    const auto it = pairs.find(spec.name);
    const uint64_t cols =
        t->shape.size() == 2 ? t->shape[1] : std::max<uint64_t>(t->num_elements, 1);
    const uint64_t rows = t->num_elements / std::max<uint64_t>(cols, 1);
    const uint64_t block_rows = std::max<uint64_t>(1, kBlockElems / std::max<uint64_t>(cols, 1));
    const uint64_t r = static_cast<uint64_t>(settings.r);
    if (it != pairs.end()) {
      a.resize(r * cols);
      b.resize(rows * r);
      STRATA_RETURN_IF_ERROR(
          adapter->ReadRange(it->second.a_name, 0, a.size(), a.data(), device::DType::kF32));
      STRATA_RETURN_IF_ERROR(
          adapter->ReadRange(it->second.b_name, 0, b.size(), b.data(), device::DType::kF32));
    }
    for (uint64_t row0 = 0; row0 < rows; row0 += block_rows) {
      const uint64_t n = std::min(block_rows, rows - row0);
      w.resize(n * cols);
      STRATA_RETURN_IF_ERROR(
          base->ReadRange(spec.name, row0 * cols, n * cols, w.data(), device::DType::kF32));
      if (it != pairs.end()) {
        // W[i, :] += scale * sum_k B[i, k] A[k, :]
        for (uint64_t i = 0; i < n; ++i) {
          float* wr = w.data() + i * cols;
          for (uint64_t k = 0; k < r; ++k) {
            const float s = scale * b[(row0 + i) * r + k];
            const float* ar = a.data() + k * cols;
            for (uint64_t c = 0; c < cols; ++c)
              wr[c] += s * ar[c];
          }
        }
      }
      STRATA_RETURN_IF_ERROR(
          writer->WriteRange(spec.name, row0 * cols, n * cols, w.data(), device::DType::kF32));
    }
    (it != pairs.end() ? stats.merged_tensors : stats.copied_tensors) += 1;
    if (print && it != pairs.end()) print(fmt::format("  merged {}", spec.name));
  }
  STRATA_RETURN_IF_ERROR(writer->Finish());
  STRATA_RETURN_IF_ERROR(files.Rename(tmp, (fs::path(out_dir) / kSafetensorsModelFile).string()));
  cleanup.active = false;
  // The model's other files (config, tokenizer, chat template, generation config), so OUT loads
  // as it is.
  const fs::path base_path =
      files.IsDirectory(base_dir) ? fs::path(base_dir) : fs::path(base_dir).parent_path();
  std::vector<std::string> names = {"config.json"};
  names.insert(names.end(), std::begin(kTokenizerFiles), std::end(kTokenizerFiles));
  for (const std::string& name : names) {
    const std::string from = (base_path / name).string();
    if (!files.Exists(from)) continue;
    STRATA_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(files, from));
    Status st = WriteFileDurable(files, (fs::path(out_dir) / name).string(), text);
    if (!st.ok()) return st.WithContext(fmt::format("copy {} to {}", from, out_dir));
  }
  STRATA_RETURN_IF_ERROR(files.SyncDir(out_dir));
  return stats;
}

}  // namespace strata::train
