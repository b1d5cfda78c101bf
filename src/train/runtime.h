// The composition root of a training run: the one place that turns a loaded Config into the
// objects a run is made of, in the order they depend on each other.
//
//   Runtime  (OpenRuntime)   the device (ChooseDevice: --device / strata.device, the local rank,
//                            strata.memory.device_budget) and the collective (NCCL, MPI or
//                            single-rank, as the device and the launcher decide)
//   the model                built by the caller on runtime.device (its shape and micro-batch
//                            come from the config and the data)
//   EngineStack (BuildEngine) the block store (strata.io), the pinned pool (strata.memory.
//                            pinned_pool, else planned), the ZeRO engine and its tier managers
//                            (strata.memory.host_budget, offload_optimizer.buffer_count)
//
// `strata train` uses it, and so do the model's engine tests, so that what they test is wired as
// what users run. Destruction order is the reverse of construction: an EngineStack must be
// destroyed before the model it drives, and both before their Runtime.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "device/pinned_pool.h"
#include "io/fault_injection.h"
#include "comm/topology.h"
#include "strata/block_store.h"
#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "train/device_choice.h"
#include "zero/engine.h"

namespace strata {
class TraceRecorder;
}

namespace strata::train {

struct RuntimeOptions {
  // Overrides strata.device when set ("cpu", "cuda", "auto": the --device flag).
  std::optional<DeviceKind> device;
  // Recorded into when set; must outlive the Runtime.
  TraceRecorder* trace = nullptr;
  // Launcher and GPUs, for tests; DetectLaunch() and QueryGpus() when unset.
  std::optional<comm::LaunchInfo> launch;
  std::optional<device::GpuReport> gpus;
  // Tests and benchmarks; each replaces what the config or the launcher would choose.
  std::optional<uint64_t> device_budget;  // strata.memory.device_budget
  comm::Backend backend = comm::Backend::kAuto;
  std::optional<std::chrono::milliseconds> comm_timeout;
  // A world of one even inside a launcher's job (a reference run beside an mpirun test's ranks).
  bool standalone = false;
  // Tests: wraps the device as soon as it is made, before anything uses it (a fault-injecting
  // device, device/fault_device.h). Called on the calling thread.
  std::function<std::unique_ptr<device::Device>(std::unique_ptr<device::Device>)> wrap_device;
  // Tests: makes the collective on the (wrapped) device instead of the backend the launcher and
  // `backend` would choose (a rank of an in-process world, comm/in_process_collective.h). Set
  // `launch` to the rank and world it stands for.
  std::function<Result<std::unique_ptr<comm::Collective>>(device::Device&)> make_collective;
  // Tests: this rank's host identity for finding the nodes (comm/topology.h) instead of
  // HostIdentity(): an in-process world's ranks then stand for ranks on several nodes.
  std::optional<std::string> host_identity;
};

struct Runtime {
  DeviceChoice choice;
  comm::LaunchInfo launch;
  std::unique_ptr<device::Device> device;
  // Where the ranks are (every rank all-gathers its host at start-up), and the bytes `comm` and
  // its groups send within and across nodes: `comm` counts into `traffic`.
  comm::Topology topology;
  std::unique_ptr<comm::TrafficCounters> traffic;
  std::unique_ptr<comm::Collective> comm;
  // Tensor parallelism (tensor_parallel.autotp_size = T > 1): rank r is rank r mod T of the
  // tensor-parallel group of ranks [r - r mod T, + T) (within a node), and rank r div T of the
  // data-parallel group of the ranks with the same r mod T, which the engine partitions over.
  // Both are split from `comm` (and counted with it). Without: null, and data_parallel() is comm.
  int tensor_parallel_size = 1;
  std::unique_ptr<comm::Collective> tensor_parallel;
  std::unique_ptr<comm::Collective> data_parallel_group;
  // The data-parallel group's nodes (its ranks in nodes of ranks_per_node / T): the engine's.
  comm::Topology data_parallel_topology;

  comm::Collective& data_parallel() const {
    return data_parallel_group ? *data_parallel_group : *comm;
  }
  int tensor_parallel_rank() const { return tensor_parallel ? tensor_parallel->rank() : 0; }

  ~Runtime();  // the collectives before the device they use
  Runtime() = default;
  Runtime(Runtime&&) = default;
  Runtime& operator=(Runtime&& other) noexcept;  // releases its own in that order first
};

Result<Runtime> OpenRuntime(const Config& config, const RuntimeOptions& options = {});

// MemAvailable from /proc/meminfo, in bytes (0 when unknown): what a pinned pool may take now.
uint64_t HostAvailableBytes();

// This process's peak resident set (getrusage's ru_maxrss), in bytes: on the CPU device, what
// the device allocator, the pinned pool and set-up together made resident.
uint64_t PeakResidentBytes();

struct EngineStack {
  // STRATA_FAULT_INJECT (a testing aid): the faults injected into the store; Reset logs how many.
  std::optional<io::FaultPlan> faults;
  std::unique_ptr<io::BlockStore> store;
  std::unique_ptr<device::PinnedPool> pool;
  std::unique_ptr<zero::Engine> engine;
  int optimizer_pipeline_depth = 3;
  int cpu_adam_threads = 1;  // the engine's CPU optimizer threads (strata.cpu_adam_threads)

  ~EngineStack() { Reset(); }
  EngineStack() = default;
  EngineStack(EngineStack&&) = default;
  EngineStack& operator=(EngineStack&& other) noexcept;  // releases its own first (Reset)
  // The engine, then the pool, then the store.
  void Reset();
};

struct BuildOptions {
  // The states to start from (a checkpoint, a model's weights); the model's own initialisation
  // when unset.
  std::optional<zero::InitialStates> initial;
  TraceRecorder* trace = nullptr;  // must outlive the EngineStack

  // Tests and benchmarks; each replaces what the config would choose.
  std::optional<uint64_t> pinned_pool;        // strata.memory.pinned_pool, else the plan
  std::optional<uint64_t> param_host_budget;  // strata.memory.host_budget
  uint64_t param_device_budget = 0;           // 0: the device's own budget
  std::optional<int> cpu_adam_threads;        // strata.cpu_adam_threads
  std::optional<bool> overlap_optimizer;      // the engine's choice (EngineOptions)
  std::optional<int> io_threads;              // strata.io.threads
  std::optional<HugePages> huge_pages;        // strata.io.huge_pages
  bool memory_store = false;  // "NVMe" blocks kept in memory (io::CreateMemoryStore)
  // Wraps the block store (fault injection) before anything uses it.
  std::function<std::unique_ptr<io::BlockStore>(std::unique_ptr<io::BlockStore>)> wrap_store;
};

// Builds the store, the pool and the engine for `model` on `runtime`.
Result<EngineStack> BuildEngine(Runtime& runtime, zero::Model& model, const Config& config,
                                BuildOptions options = {});

// strata.cpu_adam_threads resolved for this rank: the configured count, else on a GPU run the
// cores of the node shared among its ranks, less one for I/O and one for the rank's own thread
// (at least 1); on the CPU device 1.
int CpuAdamThreads(const Config& config, device::DeviceType device, int local_ranks,
                   unsigned hardware_threads);

}  // namespace strata::train
