// Configuration: a DeepSpeed JSON file, read verbatim, plus Strata's own "strata" section.
//
//   STRATA_ASSIGN_OR_RETURN(Config config, LoadConfigFile("ds_config.json"));
//   STRATA_ASSIGN_OR_RETURN(BatchSizes batch, ResolveBatchSizes(config.batch, world_size));
//
// What the loader guarantees about a Config it returns:
//   - Every value is final. A key that is absent, null or "auto" holds its default (DeepSpeed's
//     *code* default, not its documentation's); defaults that depend on other keys are resolved
//     (overlap_comm from the stage, strata.io.threads from aio.intra_op_parallelism, ...).
//     The one exception is the batch triple, which needs the world size: see ResolveBatchSizes.
//   - Every value passed validation: ranges, alignment (4 KiB multiples for I/O sizes), and the
//     rules between keys (fp16 and bf16 not both on, offload_param only with stage 3, an NVMe
//     offload has a path, ...).
//   - Keys DeepSpeed has but Strata does not implement were accepted and are listed in
//     diagnostics.ignored_keys; one warning naming all of them was logged.
//
// What makes it fail (the Status message always names the file and the full key path):
//   InvalidArgument  malformed JSON (with line and column), an unknown or misspelled key (with a
//                    suggestion), a duplicate key, a value of the wrong type or out of range, an
//                    inconsistent combination of keys.
//   Unimplemented    a recognised DeepSpeed choice that Strata does not implement and that would
//                    change the training math if ignored: an optimizer other than Adam/AdamW, an
//                    LR scheduler other than WarmupLR/WarmupDecayLR/WarmupCosineLR, amsgrad.
//   NotFound / PermissionDenied / ...  LoadConfigFile could not read the file.
//
// docs/configuration.md lists every key with its default and where Strata differs from DeepSpeed.
//
// Thread safety: the functions are reentrant; a Config is a plain value.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"

namespace strata {

// ---- zero_optimization -----------------------------------------------------------------------

// Where a state class lives when it is not in use ("device" in offload_param / offload_optimizer).
// kAuto (Strata's extension, "auto"): the placement planner (train/plan.h) chooses none, cpu or
// nvme; `strata train` resolves it before the engine is built, and the engine refuses it.
enum class OffloadDevice { kNone, kCpu, kNvme, kAuto };
std::string_view OffloadDeviceName(OffloadDevice device);  // "none", "cpu", "nvme", "auto"

// zero_optimization.offload_param: the home of the (16-bit) parameters. Only valid with stage 3;
// the loader rejects a device other than kNone at stages 0-2.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  // Directory for NVMe-resident parameters; non-empty whenever device is kNvme, unless
  // strata.io.nvme_paths was given (then that list is used and this may be empty).
  std::string nvme_path;
  // DeepSpeed's swap-buffer pool shape. Strata sizes its pinned pool from strata.memory instead;
  // these are kept as hints for the planner. Counts of buffers and of elements, not bytes.
  int64_t buffer_count = 5;
  int64_t buffer_size = 100'000'000;   // elements per buffer
  int64_t max_in_cpu = 1'000'000'000;  // parameter elements kept in host memory with NVMe offload
  // Whether host-tier copies are kept in page-locked memory. Transfers always stage through
  // Strata's pinned pool regardless.
  bool pin_memory = false;

  friend bool operator==(const OffloadParamConfig&, const OffloadParamConfig&) = default;
};

// zero_optimization.offload_optimizer: the home of fp32 master weights and Adam moments. Valid
// with stages 1-3; the optimizer step then runs on the CPU.
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;  // as OffloadParamConfig::nvme_path
  int64_t buffer_count = 4;
  bool pin_memory = false;
  // Read-ahead / write-behind of optimizer tiles. Strata always pipelines; kept for reporting.
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  // Partial offload (DeepSpeed's key): the fraction of the rank's optimizer states homed in
  // `device` and updated by the CPU optimizer, in (0, 1]. The engine offloads whole units, from
  // the last (whose gradients arrive first in backward, so their CPU updates overlap the most
  // compute) towards the first, while at least half of the next unit stays within the fraction;
  // the rest keep their states on the device and take the fused device AdamW
  // (zero::OffloadedUnits). 1: every unit offloaded. Ignored when device is "none".
  double ratio = 1.0;

  friend bool operator==(const OffloadOptimizerConfig&, const OffloadOptimizerConfig&) = default;
};

// zero_optimization. Sizes are counts of elements (as in DeepSpeed), not bytes.
struct ZeroConfig {
  // 0: plain data parallel; 1: optimizer states partitioned; 2: + gradients; 3: + parameters.
  int stage = 0;
  // Copy gradients into one contiguous buffer as backward produces them.
  bool contiguous_gradients = true;
  // Average gradients with reduce-scatter (each rank receives its shard) instead of all-reduce.
  bool reduce_scatter = true;
  // Elements per gradient reduction bucket: bounds the memory of one in-flight reduction.
  int64_t reduce_bucket_size = 500'000'000;
  // Gather updated parameter shards with all-gather (true) or a series of broadcasts (false).
  bool allgather_partitions = true;
  // Elements per all-gather bucket.
  int64_t allgather_bucket_size = 500'000'000;
  // Resolved: when the key is absent or "auto", true for stage 3 and false otherwise.
  bool overlap_comm = false;
  // On resume, initialise fp32 master weights from the checkpoint's fp32 copy (true) or from its
  // 16-bit parameters (false, loses precision).
  bool load_from_fp32_weights = true;
  // Strata's checkpoints always load on any rank count; the flag is kept for reporting.
  bool elastic_checkpoint = false;
  // Elements per optimizer sub-group; 0 is accepted (as in DeepSpeed) and means no tiling.
  int64_t sub_group_size = 1'000'000'000;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  // Stage-3 knobs. The JSON keys carry a "stage3_" prefix; DeepSpeed also accepts them without.
  // The prefetcher's device lookahead: elements gathered ahead of the compute cursor.
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  // Parameters with fewer elements stay gathered on every rank (never partitioned).
  int64_t stage3_param_persistence_threshold = 100'000;
  // Upper bound on the total elements kept persistent by the rule above (default: unbounded).
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  // Gathered elements allowed resident on a device before the least useful is released.
  int64_t stage3_max_live_parameters = 1'000'000'000;
  // A gathered parameter reused within this many elements of compute is kept, not released.
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  // Gather full 16-bit weights when saving the model. Also spelled without the prefix, and
  // stage3_gather_fp16_weights_on_model_save (deprecated).
  bool stage3_gather_16bit_weights_on_model_save = false;
  // Tolerate parameters that receive no gradient (false: that is an error).
  bool ignore_unused_parameters = true;
  // Stages 1-2 with CPU offload: spread gradient copies to the host across ranks.
  bool round_robin_gradients = false;
  // ZeRO++ qwZ: stage 3's parameter all-gather moves each shard as int8 blocks of
  // kQuantBlockElems (2048) with one fp32 scale each, dequantized into the compute dtype on
  // arrival; master weights, the optimizer and checkpoints stay exact (docs/zero.md).
  bool zero_quantized_weights = false;
  // ZeRO++ hpZ: the ranks of one node (it must equal them; 1: off). Stage 3 keeps, after each
  // unit's forward gather, a secondary copy of its gathered parameters sharded within the node,
  // and backward gathers the unit from it over the node's ranks only (docs/zero.md).
  int zero_hpz_partition_size = 1;
  // ZeRO++ qgZ: stages 2-3 reduce gradients by a two-level all-to-all of int8 blocks (within the
  // node, then across nodes), dequantized and summed in fp32 at each level (docs/zero.md).
  bool zero_quantized_gradients = false;

  friend bool operator==(const ZeroConfig&, const ZeroConfig&) = default;
};

// ---- aio --------------------------------------------------------------------------------------

// aio: DeepSpeed's NVMe I/O settings. Strata's own I/O settings (strata.io) default to these.
struct AioConfig {
  uint64_t block_size = 1'048'576;  // bytes; a positive multiple of 4096
  int queue_depth = 8;              // requests in flight per I/O thread, >= 1
  // Also spelled thread_count (older DeepSpeed) and num_threads; two spellings with different
  // values are an error.
  int intra_op_parallelism = 1;  // >= 1
  bool single_submit = false;    // submit requests one at a time rather than in batches
  bool overlap_events = true;    // keep submitting without waiting for earlier completions

  friend bool operator==(const AioConfig&, const AioConfig&) = default;
};

// ---- optimizer and scheduler ------------------------------------------------------------------

// optimizer.type as written (case-insensitive in the file).
enum class OptimizerType { kAdam, kAdamW };

// optimizer. When the section is absent, Strata trains with AdamW and these defaults
// (DeepSpeed would expect the client to pass an optimizer object; Strata has no such path).
struct OptimizerConfig {
  bool specified = false;  // false when the file has no "optimizer" section
  OptimizerType type = OptimizerType::kAdamW;
  // Resolved weight-decay rule: true = decoupled (AdamW), false = L2 added to the gradient.
  // As in DeepSpeed, type "Adam" is decoupled unless params.adam_w_mode is false, and type
  // "AdamW" is always decoupled (adam_w_mode is then ignored).
  bool decoupled_weight_decay = true;
  double lr = 1e-3;      // the peak learning rate when a scheduler is used
  double beta1 = 0.9;    // params.betas[0], in [0, 1)
  double beta2 = 0.999;  // params.betas[1], in [0, 1)
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  // DeepSpeed's switch between torch.optim and its fused kernels; the math is the same, so
  // Strata records it and uses its own implementation either way.
  bool torch_adam = false;

  friend bool operator==(const OptimizerConfig&, const OptimizerConfig&) = default;
};

enum class SchedulerType { kConstant, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
std::string_view SchedulerTypeName(SchedulerType type);  // "constant", "WarmupLR", ...

enum class WarmupType { kLog, kLinear };

// scheduler. kConstant (no "scheduler" section) keeps optimizer.lr for the whole run. Step
// counts are optimizer steps. The fields a type does not use keep their defaults.
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kConstant;
  // WarmupLR, WarmupDecayLR: LR rises from warmup_min_lr to warmup_max_lr over warmup_num_steps.
  double warmup_min_lr = 0.0;
  // Resolved: when absent or "auto", WarmupLR takes optimizer.lr (current DeepSpeed) and
  // WarmupDecayLR takes 1e-3 (DeepSpeed's default for that class).
  double warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;  // >= 1
  WarmupType warmup_type = WarmupType::kLog;
  // WarmupDecayLR, WarmupCosineLR: required in the file. nullopt when given as "auto": the
  // trainer must supply it (from the run length) before building the schedule.
  std::optional<int64_t> total_num_steps;
  // WarmupCosineLR: ratios of optimizer.lr.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  // The step to resume from; -1 starts at the beginning.
  int64_t last_batch_iteration = -1;

  friend bool operator==(const SchedulerConfig&, const SchedulerConfig&) = default;
};

// ---- precision --------------------------------------------------------------------------------

// fp16. Loss scaling applies only when enabled.
struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0.0;       // 0 = dynamic loss scaling; > 0 = this static scale
  int initial_scale_power = 16;  // dynamic scaling starts at 2^initial_scale_power
  int loss_scale_window = 1000;  // overflow-free steps before the scale is raised
  int hysteresis = 2;            // overflows tolerated before the scale is lowered
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;

  bool dynamic_loss_scale() const { return loss_scale == 0.0; }

  friend bool operator==(const Fp16Config&, const Fp16Config&) = default;
};

// bf16 (older key: "bfloat16").
struct Bf16Config {
  bool enabled = false;  // bf16 compute with fp32 master weights; no loss scaling

  friend bool operator==(const Bf16Config&, const Bf16Config&) = default;
};

enum class Precision { kFp32, kFp16, kBf16 };
std::string_view PrecisionName(Precision precision);  // "fp32", "fp16", "bf16"

// ---- checkpoint -------------------------------------------------------------------------------

// checkpoint.tag_validation: what to do when ranks disagree on a checkpoint tag.
enum class TagValidation { kIgnore, kWarn, kFail };

struct CheckpointConfig {
  TagValidation tag_validation = TagValidation::kWarn;
  // Strata checkpoints are always rank-count independent; the flag is kept for reporting.
  bool load_universal = false;
  // Each node writes its part of a checkpoint to node-local storage.
  bool use_node_local_storage = false;

  friend bool operator==(const CheckpointConfig&, const CheckpointConfig&) = default;
};

// ---- monitoring ---------------------------------------------------------------------------------

// DeepSpeed's "tensorboard" and "csv_monitor" sections: rank 0 writes every step's metrics under
// output_path/job_name/ (TensorBoard event files, or one CSV file per metric).
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;  // empty: the current directory
  std::string job_name = "DeepSpeedJobName";

  friend bool operator==(const MonitorConfig&, const MonitorConfig&) = default;
};

// ---- batch sizes ------------------------------------------------------------------------------

// The batch triple as written; nullopt where absent or "auto". Each given value is >= 1, and the
// loader already rejected triples that no world size can satisfy.
struct BatchConfig {
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;

  friend bool operator==(const BatchConfig&, const BatchConfig&) = default;
};

// The resolved triple: train_batch_size == micro * gas * world_size.
struct BatchSizes {
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  int world_size = 0;

  friend bool operator==(const BatchSizes&, const BatchSizes&) = default;
};

// Derives the missing members of the triple for `world_size` data-parallel ranks, as DeepSpeed
// does: given train_batch_size and micro, gas = train / (micro * world); given train and gas,
// micro = train / (world * gas); given micro and gas, train = micro * gas * world; given only
// train, gas = 1 and micro = train / world; given only micro, gas = 1 and train = micro * world.
// Unlike DeepSpeed (which floors), a division that is not exact is an error.
// InvalidArgument, naming the values, when world_size < 1, when neither train_batch_size nor
// train_micro_batch_size_per_gpu is known, when a division is not exact, or when a full triple
// does not satisfy the rule.
Result<BatchSizes> ResolveBatchSizes(const BatchConfig& batch, int world_size);

// ---- strata -----------------------------------------------------------------------------------

enum class IoBackend { kAuto, kUring, kPosix };     // kAuto: probe io_uring, fall back to posix
std::string_view IoBackendName(IoBackend backend);  // "auto", "uring", "posix"

// A three-way switch: kAuto lets Strata decide at run time (by probing).
enum class Toggle { kAuto, kOn, kOff };
std::string_view ToggleName(Toggle toggle);  // "auto", "on", "off"

// strata.io. Every field is final; the *_auto flags say whether the value was derived.
struct IoSettings {
  IoBackend backend = IoBackend::kAuto;
  Toggle direct = Toggle::kAuto;  // O_DIRECT
  int threads = 1;                // I/O threads (one ring each); default aio.intra_op_parallelism
  bool threads_auto = true;
  int queue_depth = 8;  // per thread; default aio.queue_depth
  bool queue_depth_auto = true;
  uint64_t block_size = 1'048'576;  // largest single I/O, bytes, multiple of 4096; default aio
  bool block_size_auto = true;
  uint64_t stripe_unit = 1'048'576;  // bytes per stripe on each path, multiple of 4096
  // Directories the NVMe-resident state is striped over. Default: the offload sections'
  // nvme_path values for devices set to "nvme" (deduplicated, param first). Empty when nothing
  // is on NVMe.
  std::vector<std::string> nvme_paths;
  bool nvme_paths_auto = true;
  Toggle huge_pages = Toggle::kAuto;  // back the pinned pool with huge pages
  bool sqpoll = false;
  bool register_buffers = true;
  bool register_files = true;
  bool durable_writes = false;  // fsync/FUA offload writes (normally scratch data)
  // Every offloaded shard read back from NVMe is checked against the XXH3 checksum of the bytes
  // written (io/checksum_store.h); a mismatch stops the step with DataLoss.
  bool checksums = true;
  bool numa_bind = true;

  friend bool operator==(const IoSettings&, const IoSettings&) = default;
};

// strata.memory: hard byte budgets. nullopt ("auto") lets the planner size them from the machine.
struct MemorySettings {
  std::optional<uint64_t> pinned_pool;
  std::optional<uint64_t> device_budget;
  std::optional<uint64_t> host_budget;
  // A device whose memory is host memory (the CPU device) reads offloaded parameter shards in
  // place in their pinned host copies instead of copying them (TierManagerOptions::
  // share_host_memory). auto: on for the CPU device; on: an error for any other device.
  Toggle share_host_memory = Toggle::kAuto;

  friend bool operator==(const MemorySettings&, const MemorySettings&) = default;
};

// strata.prefetch.
struct PrefetchSettings {
  std::optional<uint64_t> host_lookahead;  // bytes read ahead from NVMe; nullopt = auto

  friend bool operator==(const PrefetchSettings&, const PrefetchSettings&) = default;
};

enum class DeviceKind { kAuto, kCpu, kCuda };

// strata.on_nonfinite: a step whose gradient norm (or loss) is not finite, outside fp16's loss
// scaling (which skips such steps and lowers the scale).
enum class NonFinitePolicy {
  kError,  // stop: TrainStep returns Aborted naming the step (the default)
  kSkip,   // skip the update, as fp16 does on overflow (turns off the overlapped CPU optimizer,
           // whose updates would otherwise be applied before the norm is known)
};
std::string_view NonFinitePolicyName(NonFinitePolicy policy);  // "error", "skip"

std::string_view DeviceKindName(DeviceKind kind);  // "auto", "cpu", "cuda"

// LoRA adapters (strata.lora; PEFT's LoraConfig keys): every targeted projection W of each
// decoder layer computes W x + (lora_alpha / r) B A x, A [r, in] and B [out, r] trained, the
// base weights frozen. r == 0: no adapters.
struct LoraSettings {
  int r = 0;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;  // only 0 is implemented (a non-zero value is an error)
  // Projection names ("q_proj", ..., "down_proj"), or "all-linear" for all seven. Default (empty):
  // q_proj and v_proj, as PEFT's default for Llama.
  std::vector<std::string> target_modules;

  bool enabled() const { return r > 0; }
  friend bool operator==(const LoraSettings&, const LoraSettings&) = default;
};

struct StrataSettings {
  IoSettings io;
  MemorySettings memory;
  PrefetchSettings prefetch;
  DeviceKind device = DeviceKind::kAuto;
  // fp32 GEMMs on a GPU may use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation),
  // as torch.backends.cuda.matmul.allow_tf32 allows. Off: fp32 GEMMs are fp32 throughout.
  bool tf32 = false;
  // Activation checkpointing: kOn keeps only each decoder block's input in forward and recomputes
  // its internals in backward (one block's internals in device memory at a time, a quarter more
  // compute); kOff keeps every block's internals from forward to backward (no recomputation).
  // kAuto: off when the run's device memory plan with every block's internals kept fits the
  // device budget (train/estimate.h, EstimateMemory), on otherwise. Evaluation never keeps them.
  Toggle activation_checkpointing = Toggle::kAuto;
  // Each decoder block as four units instead of one (model/llama_model.h): attention (input
  // norm, q/k/v/o), gate (post-attention norm, gate), up, down. The engine then gathers, reduces
  // and updates one MLP matrix at a time, so the largest unit in flight is a matrix, not a block
  // (a 70B-shaped block is 0.86B parameters; its largest matrix 0.23B). With activation
  // checkpointing a block is recomputed part by part, each part gathered again for it; not with
  // strata.lora. kAuto: split only when the run's device plan with whole blocks exceeds the
  // device budget and the plan with split blocks is smaller (train/estimate.h, EstimateMemory).
  Toggle split_blocks = Toggle::kAuto;
  // Activation checkpoints in host memory (model/llama_model.h, offload_checkpoints): with
  // checkpointing, every block input but the last two goes to pinned host memory during forward
  // and comes back during backward, on a copy stream beside the compute; the device keeps three
  // block inputs instead of L + 1. kAuto: on only when the run's device plan with checkpoints on
  // the device exceeds the device budget (train/estimate.h, EstimateMemory). kOn with
  // activation_checkpointing off is an error.
  Toggle offload_checkpoints = Toggle::kAuto;
  // Threads of the CPU AdamW step (offload_optimizer cpu/nvme). nullopt ("auto"): on a GPU run
  // the host's cores divided among the node's ranks, less one each for I/O and the run's own
  // thread; on the CPU device 1, since the cores compute the model.
  std::optional<int> cpu_adam_threads;
  NonFinitePolicy on_nonfinite = NonFinitePolicy::kError;
  uint64_t seed = 1234;
  // Frozen parameters (fine-tuning): glob patterns (fnmatch: *, ?, [...]) on the model's
  // parameter names (Hugging Face names for a Llama: "model.layers.3.mlp.up_proj.weight").
  // `freeze`: the parameters that match are frozen; `trainable`: only those that match train.
  // At most one of the two. A frozen parameter gets no gradient reduction, no optimizer state and
  // no update (zero::FrozenUnits; the engine freezes whole units, so a pattern that splits a unit
  // is an error naming it).
  std::vector<std::string> freeze;
  std::vector<std::string> trainable;
  // LoRA fine-tuning (docs/training.md, "LoRA adapters"): adapters train, every base weight is
  // frozen unless `trainable` names it (whole units, as above). `freeze` cannot be combined.
  LoraSettings lora;

  friend bool operator==(const StrataSettings&, const StrataSettings&) = default;
};

// ---- the whole file ---------------------------------------------------------------------------

// What the loader noticed besides errors. Key paths use dots ("zero_optimization.stage") and
// appear in document order, spelled as in the file.
struct ConfigDiagnostics {
  // DeepSpeed keys accepted but not implemented by Strata (they have no effect). A whole
  // section appears once, by its own path, not once per key inside it.
  std::vector<std::string> ignored_keys;
  // Keys whose value was "auto" (resolved to the default); a front end may override these.
  std::vector<std::string> auto_keys;
  // Deprecated spellings that were accepted, e.g. "zero_optimization.cpu_offload".
  std::vector<std::string> deprecated_keys;
  // Settings that are valid but have no effect in this combination, each a full sentence naming
  // the key (e.g. offload_param below stage 3, which DeepSpeed ignores too). Each is logged.
  std::vector<std::string> warnings;

  // The single warning logged for ignored_keys (empty when there are none).
  std::string IgnoredKeysMessage(std::string_view source_name) const;

  friend bool operator==(const ConfigDiagnostics&, const ConfigDiagnostics&) = default;
};

struct Config {
  std::string source_name;  // the file name given to the loader
  BatchConfig batch;
  double gradient_clipping = 0.0;  // max global gradient norm; 0 disables clipping
  // tensor_parallel.autotp_size: Megatron tensor parallelism over this many consecutive ranks of
  // a node, ZeRO over the ranks with the same place in their groups (docs/zero.md "Tensor
  // parallelism"). 1: none.
  int tensor_parallel_size = 1;
  int64_t steps_per_print = 10;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  ZeroConfig zero;
  AioConfig aio;
  CheckpointConfig checkpoint;
  MonitorConfig tensorboard;
  MonitorConfig csv_monitor;
  StrataSettings strata;
  ConfigDiagnostics diagnostics;

  // kFp16 or kBf16 when that section is enabled (never both), else kFp32.
  Precision precision() const {
    if (fp16.enabled) return Precision::kFp16;
    if (bf16.enabled) return Precision::kBf16;
    return Precision::kFp32;
  }

  friend bool operator==(const Config&, const Config&) = default;
};

// Parses and validates a configuration held in memory. `source_name` (a file name, or something
// like "<command line>") prefixes every error message and the ignored-keys warning. Logs at most
// one warning for ignored keys and one for deprecated spellings. A default-constructed Config
// equals the result of parsing "{}" apart from source_name.
Result<Config> ParseConfig(std::string_view json_text, std::string_view source_name);

// Reads `path` and parses it with source_name = path.
Result<Config> LoadConfigFile(const std::string& path, FileSystem& fs = LocalFileSystem());

// "auto" offload homes (OffloadDevice::kAuto), which the placement planner resolves.
bool HasAutoOffload(const Config& config);
// Whether NVMe has a directory for the parameters (`param`) or the optimizer states: the
// section's nvme_path, or strata.io.nvme_paths.
bool CanUseNvme(const Config& config, bool param);
// Sets the offload homes the planner chose (each must be what the config says, or replace
// "auto") and derives strata.io.nvme_paths again when the config did not list them.
// InvalidArgument naming the key for a home the config or the stage does not allow.
Status ResolveOffloadDevices(Config* config, OffloadDevice param, OffloadDevice optimizer);

}  // namespace strata
