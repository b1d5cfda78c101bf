// The time half of `strata estimate` and the placement planner (issue 20; docs/planning.md).
//
//   Hardware      what a run is planned for: GPUs and nodes, memory per tier, and the rates of
//                 every resource a step uses (GPU, NVLink/network, PCIe, NVMe, CPU Adam)
//   EstimateTime  a step's work per resource (bytes and FLOPs, from the same placement and
//                 layouts the memory estimate uses) turned into seconds, then the critical path
//                 after the overlap Strata's engine really does
//   CheckFit      the memory estimate against each tier's capacity
//   PlanPlacement "device": "auto" for offload_param / offload_optimizer: every candidate home
//                 estimated, the fastest that fits chosen, with the reason for each choice
//
// The time model is a model: it counts every byte and FLOP a step moves, but a rate is what the
// hardware sustains, which the user gives (or `strata estimate` defaults to an H100 node).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "train/estimate.h"

namespace strata::train {

struct Hardware {
  int nodes = 1;
  int gpus_per_node = 1;  // ranks per node
  // Per GPU: its memory, and the budget a rank may charge (0: what the CUDA device leaves by
  // default, memory - max(512 MiB, 5%); on the CPU device, the device's own budget).
  uint64_t gpu_mem = 80'000'000'000;
  uint64_t device_budget = 0;
  // Per node: host memory (the planner lets the pinned pools take 90% of it, `host_fraction`),
  // and NVMe capacity for swap files.
  uint64_t cpu_mem = 1'000'000'000'000;
  double host_fraction = 0.9;
  uint64_t nvme = 8'000'000'000'000;
  // Rates. Per node: NVMe read and write (all drives), CPU Adam (parameters per second, all
  // optimizer threads). Per GPU: PCIe each way, the collective bus bandwidth within a node
  // (NVLink) and across nodes (network), HBM, and dense 16-bit TFLOPS (peak; the kernels reach
  // `gpu_efficiency` of it; fp32 runs use half, TF32).
  double nvme_read = 25e9;
  double nvme_write = 12e9;
  double cpu_adam = 1.5e9;
  double pcie = 50e9;
  double nvlink = 300e9;
  double net = 50e9;
  double hbm = 3.35e12;
  double gpu_tflops = 989.0;
  double gpu_efficiency = 0.5;
  // Endurance of a node's NVMe drives together, bytes written (0: not given).
  double nvme_tbw = 0;
  // Compute shares the cores with the copies, collectives, CPU optimizer and I/O (the CPU
  // device): nothing overlaps, the step is the sum of its parts.
  bool shared_cores = false;
  // With shared cores: the share of the cores' compute that NVMe transfers take while they run
  // (submission, completions, checksums, the kernel's block layer). 1: a transfer's whole time
  // adds to the step; below 1 the rest of its time can run beside compute. `--measure` measures
  // it; 1 (the conservative bound) when not measured.
  double io_cpu_share = 1.0;

  int world_size() const { return nodes * gpus_per_node; }
  uint64_t rank_device_budget() const;
  uint64_t host_budget() const;
};

// Parses a rate as people write it: "25G/s", "12GB/s", "1.5G", "50e9". K, M, G, T (with or
// without B) are powers of 1000, Ki, Mi, Gi, Ti powers of 1024; "/s" is optional.
Result<double> ParseRate(std::string_view text);

struct TimeEstimate {
  // Work per rank per optimizer step.
  double model_flops = 0;    // 6N + attention per token (what MFU counts)
  double exec_flops = 0;     // + the forward recomputed by activation checkpointing, if on
  uint64_t collective_bytes = 0;  // on the wire (ring), all-gathers and reductions
  uint64_t collective_inter_bytes = 0;  // the part of them that crosses nodes
  // Tensor parallelism's all-reduces (within the node; part of collective_bytes), and their
  // seconds, which compute_s includes: they run in the compute's order.
  uint64_t tensor_parallel_bytes = 0;
  double tensor_parallel_s = 0;
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t optimizer_params = 0;  // elements one rank's optimizer updates
  // The share of them whose states are offloaded (offload_optimizer.ratio rounded to whole
  // units; 0 without offload): the CPU optimizer updates those, the device the rest.
  double offloaded_fraction = 0;
  // The share of the rank's shard that trains (1 unless strata.freeze / trainable freeze units).
  double trainable_fraction = 1;
  // Seconds per resource (shared resources: the node's load, e.g. NVMe of every rank).
  double compute_s = 0, collective_s = 0, h2d_s = 0, d2h_s = 0;
  double nvme_read_s = 0, nvme_write_s = 0;
  // The optimizer: the CPU's part (offloaded states) and the device's part (the rest); both run
  // at once when the states are split.
  double optimizer_s = 0, device_optimizer_s = 0;
  bool cpu_optimizer = false;  // some states are offloaded
  bool optimizer_overlapped = false;  // the CPU optimizer runs during backward
  bool shared_cores = false;          // Hardware::shared_cores: the parts add up
  double io_cpu_share = 1.0;          // Hardware::io_cpu_share, with shared cores
  // The critical path: forward + backward (compute with the transfers it overlaps), what is
  // left of the optimizer when backward ends, and what runs after it (stages 0-2: reductions
  // at the step's end, the all-gather of updated parameters).
  double forward_backward_s = 0, exposed_optimizer_s = 0, after_step_s = 0;
  double step_s = 0;
  std::string bound_by;  // the resource behind the forward + backward time
  std::string bottleneck;  // the resource with the most time in the step
  double tokens_per_s = 0;  // all ranks
  double mfu = 0;           // model FLOPs / (step time x peak)
  // NVMe wear: bytes a node writes per step and per day, days until nvme_tbw (0: not given).
  double nvme_node_write_per_step = 0, nvme_node_write_per_day = 0, nvme_days = 0;
};

TimeEstimate EstimateTime(const EstimateInput& input, const MemoryEstimate& memory,
                          const Hardware& hw);

// Memory per tier against the hardware: per rank on the device, per node in host memory (the
// pinned pools, random initialisation, and on the CPU device its device memory) and on NVMe
// (the swap files).
struct FitCheck {
  uint64_t device_need = 0, device_budget = 0;
  uint64_t host_need = 0, host_budget = 0;
  uint64_t nvme_need = 0, nvme_budget = 0;
  bool fits() const {
    return device_need <= device_budget && host_need <= host_budget && nvme_need <= nvme_budget;
  }
  // "" when it fits, else every tier that overflows: "device: 142.2 GiB > 75.0 GiB per rank".
  std::string Overflow() const;
};
FitCheck CheckFit(const EstimateInput& input, const MemoryEstimate& memory, const Hardware& hw);

struct PlanCandidate {
  OffloadDevice param = OffloadDevice::kNone;
  OffloadDevice optimizer = OffloadDevice::kNone;
  double ratio = 1.0;  // offload_optimizer.ratio (partial offload) when optimizer is cpu / nvme
  MemoryEstimate memory;
  TimeEstimate time;
  FitCheck fit;
};

struct PlacementPlan {
  std::vector<PlanCandidate> candidates;  // every home the config leaves open
  int chosen = -1;                        // index into candidates
  std::vector<std::string> reasons;       // one line per choice made
  const PlanCandidate& best() const { return candidates[static_cast<size_t>(chosen)]; }
};

// One placement (homes resolved from "auto" where the config has it): its memory, time and fit.
Result<PlanCandidate> EstimatePlacement(const EstimateInput& input, const Hardware& hw,
                                        OffloadDevice param, OffloadDevice optimizer,
                                        double ratio = 1.0);

// Writes a candidate's homes (and its offload_optimizer.ratio) into `config`'s "auto" keys
// (ResolveOffloadDevices' rules: a home the config fixes must match).
Status ApplyPlacement(Config* config, const PlanCandidate& candidate);
// "parameters on cpu, optimizer on nvme (ratio 0.5)".
std::string PlacementName(const PlanCandidate& candidate);

// Tries every home "auto" allows (none, cpu, and nvme where the config names a directory; a
// home the config fixes stays) and, for an "auto" optimizer, partial offload of 1/16 to 15/16 of
// its states to cpu or nvme; estimates each, and chooses the fastest by the time model among
// those that fit; among nearly equal times (within 2%) the one that offloads less. A config
// without "auto" gives its one candidate. ResourceExhausted naming each candidate's overflow
// when none fits.
Result<PlacementPlan> PlanPlacement(const EstimateInput& input, const Hardware& hw);

// The machine a `strata train` rank runs on: ranks per node and nodes from the launcher, the
// device budget of `dev`, this host's physical memory, and the free space of the NVMe
// directories the config names (for "auto" and "nvme" homes; the nearest existing parent of one
// not made yet). Rates keep Hardware's defaults: they only rank candidates that fit.
Hardware MachineHardware(const device::Device& dev, const comm::LaunchInfo& launch,
                         const Config& config);

// The table for people and the JSON for tools.
std::string FormatTimeEstimate(const TimeEstimate& time, const Hardware& hw);
std::string FormatFit(const FitCheck& fit);
nlohmann::json TimeEstimateJson(const TimeEstimate& time);
nlohmann::json FitJson(const FitCheck& fit);
nlohmann::json HardwareJson(const Hardware& hw);

}  // namespace strata::train
