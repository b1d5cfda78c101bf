// The DeepSpeed config parser's internals, shared by its files (private to src/common): one file
// per group of sections, each a set of ConfigParser methods.
//   config_parser.cc     the walk from the top level, the batch keys, the rules across sections
//   config_optimizer.cc  optimizer, scheduler, fp16, bf16
//   config_zero.cc       zero_optimization and its offload sections, aio, checkpoint, monitors,
//                        activation_checkpointing
//   config_strata.cc     the "strata" section: io, memory, prefetch, lora, ...
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/config_schema.h"
#include "strata/config.h"

namespace strata::config_internal {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int kIntMax = std::numeric_limits<int>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr uint64_t kIoAlignment = 4096;

constexpr std::string_view kPositiveInteger = "a positive integer";
constexpr std::string_view kNonNegativeInteger = "a non-negative integer";
constexpr std::string_view kNonNegativeNumber = "a non-negative number";
constexpr std::string_view kAlignedBytes =
    "a positive byte size that is a multiple of 4096 (a number of bytes or a string such as "
    "\"1MiB\")";

// The product of positive values, or nullopt on overflow.
inline std::optional<int64_t> Multiply(std::initializer_list<int64_t> values) {
  int64_t product = 1;
  for (int64_t v : values) {
    if (__builtin_mul_overflow(product, v, &product)) return std::nullopt;
  }
  return product;
}

template <typename T, typename Read>
Status ReadOptional(const Field& field, std::optional<T>* out, Read read) {
  if (TakeAuto(field)) return Status::Ok();
  T value{};
  STRATA_RETURN_IF_ERROR(read(&value));
  *out = value;
  return Status::Ok();
}

// DeepSpeed's integer byte counts (aio.block_size) must also suit O_DIRECT.
inline Status ReadAlignedInt(const Field& field, uint64_t* out) {
  int64_t v = static_cast<int64_t>(*out);
  STRATA_RETURN_IF_ERROR(ReadInt64(field, 1, kInt64Max, "a positive multiple of 4096", &v));
  if (static_cast<uint64_t>(v) % kIoAlignment != 0) {
    return ValueError(field, "a positive multiple of 4096");
  }
  *out = static_cast<uint64_t>(v);
  return Status::Ok();
}

// "auto" | "on" | "off" | true | false.
inline Status ReadToggle(const Field& field, Toggle* out) {
  if (TakeAuto(field)) {
    *out = Toggle::kAuto;
    return Status::Ok();
  }
  bool b = false;
  if (ReadBool(field, &b).ok()) {
    *out = b ? Toggle::kOn : Toggle::kOff;
    return Status::Ok();
  }
  std::optional<size_t> index = config_internal::MatchName(field.value, {"on", "off"});
  if (!index) return ValueError(field, "\"auto\", \"on\", \"off\", true or false");
  *out = *index == 0 ? Toggle::kOn : Toggle::kOff;
  return Status::Ok();
}

// Values that can only be settled once every section has been read.
struct Pending {
  std::optional<bool> overlap_comm;
  bool offload_param_given = false;
  bool offload_optimizer_given = false;
  std::optional<bool> cpu_offload;
  std::optional<bool> cpu_offload_param;
  std::optional<bool> adam_w_mode;
  std::optional<double> warmup_max_lr;
  bool total_num_steps_given = false;
  std::string bf16_key = "bf16";
  std::optional<int> io_threads;
  std::optional<int> io_queue_depth;
  std::optional<uint64_t> io_block_size;
  std::optional<std::vector<std::string>> nvme_paths;
};

// strata.io.nvme_paths when not given: the nvme_path of each section set to "nvme" (param
// first, deduplicated).
inline std::vector<std::string> DefaultNvmePaths(const ZeroConfig& z) {
  std::vector<std::string> paths;
  auto add = [&](OffloadDevice device, const std::string& path) {
    if (device != OffloadDevice::kNvme || path.empty()) return;
    if (std::find(paths.begin(), paths.end(), path) == paths.end()) paths.push_back(path);
  };
  add(z.offload_param.device, z.offload_param.nvme_path);
  add(z.offload_optimizer.device, z.offload_optimizer.nvme_path);
  return paths;
}


class ConfigParser {
 public:
  ConfigParser(Config* config, ParseState* state) : config_(*config), state_(*state) {}


  Status Parse(const Json& root);

 private:
  // ---- top level ----

  std::vector<KeySpec> RootSpecs();


  Status ReadBatch(const Field& f, std::optional<int64_t>* out);

  // The value of `key` in `f`, or null when `f` is not an object or the key is absent or null.
  static const Json* Member(const Field& f, const std::string& key);


  static Status AlreadyParsed(const Field&);


  Status ParseOptimizer(const Field& f);


  Status ParseOptimizerType(const Field& f);


  Status ParseAdamParams(const Field& f);


  Status ReadBetas(const Field& f);

  // ---- scheduler ----

  Status ParseScheduler(const Field& f);


  Status ParseSchedulerType(const Field& f);


  Status ParseSchedulerParams(const Field& f);

  // ---- precision ----

  Status ParseFp16(const Field& f);


  Status ParseBf16(const Field& f);

  // ---- zero_optimization ----

  Status ParseZero(const Field& f);


  static Status ReadOffloadDevice(const Field& f, OffloadDevice* out);


  Status ParseOffloadParam(const Field& f);


  Status ParseOffloadOptimizer(const Field& f);

  // ---- aio ----

  Status ParseAio(const Field& f);
  Status ParseTensorParallel(const Field& f);

  // ---- checkpoint ----

  Status ParseCheckpoint(const Field& f);

  // ---- monitoring ----

  Status ParseMonitor(const Field& f, MonitorConfig* m);

  // cpu_checkpointing true: the checkpointed block inputs in host memory, as
  // strata.offload_checkpoints on (applied in Validate, where an explicit strata value that says
  // otherwise is an error). The model decides what is checkpointed (each decoder block's input),
  // so the other keys have no effect.
  Status ParseActivationCheckpointing(const Field& f);

  // ---- strata.lora (PEFT's LoraConfig names) ----

  Status ParseLora(const Field& f);

  // ---- strata ----

  Status ParseStrata(const Field& f);


  Status ParseIo(const Field& f);


  Status ParseMemory(const Field& f);


  Status ParsePrefetch(const Field& f);

  // ---- rules across sections, and defaults that depend on other keys ----

  Status Finish();
  // Finish's parts: offload homes and their paths; precision, Adam's mode and the warm-up peak;
  // Strata's cross-key rules; the I/O settings that default to aio's.
  Status FinishOffload();
  Status FinishOptimizer();
  Status FinishStrata();
  void FinishIo();

  // The parts of the batch rule that do not depend on the world size: a triple that no world
  // size can satisfy is an error now rather than at launch.
  static Status CheckBatchTriple(const BatchConfig& b);

  Config& config_;
  ParseState& state_;
  Pending pending_;
  bool ds_cpu_checkpointing_ = false;  // activation_checkpointing.cpu_checkpointing
};

}  // namespace strata::config_internal
