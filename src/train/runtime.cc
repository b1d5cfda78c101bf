#include "train/runtime.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "common/log.h"
#include "common/proc_files.h"
#include "common/units.h"
#include "comm/single_collective.h"
#include "device/gpu_info.h"
#include "io/checksum_store.h"
#include "io/memory_store.h"

namespace strata::train {

uint64_t HostAvailableBytes() {
  if (auto text = procfs::ReadSmallFile("/proc/meminfo")) {
    return procfs::MeminfoField(*text, "MemAvailable").value_or(0) * 1024;
  }
  return 0;
}

uint64_t PeakResidentBytes() {
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // kilobytes on Linux
}

Runtime::~Runtime() {
  data_parallel_group.reset();
  tensor_parallel.reset();
  comm.reset();
  device.reset();
}

Runtime& Runtime::operator=(Runtime&& other) noexcept {
  if (this != &other) {
    data_parallel_group.reset();
    tensor_parallel.reset();
    comm.reset();
    device.reset();
    choice = std::move(other.choice);
    launch = std::move(other.launch);
    device = std::move(other.device);
    topology = other.topology;
    traffic = std::move(other.traffic);
    comm = std::move(other.comm);
    tensor_parallel_size = other.tensor_parallel_size;
    tensor_parallel = std::move(other.tensor_parallel);
    data_parallel_group = std::move(other.data_parallel_group);
    data_parallel_topology = other.data_parallel_topology;
  }
  return *this;
}

namespace {

// Tensor parallelism's groups (Runtime): T must divide the ranks of a node, so that each group
// is within one node, and the data-parallel ranks form nodes of ranks_per_node / T.
Status SplitTensorParallel(const Config& config, Runtime& rt) {
  const int t = config.tensor_parallel_size;
  rt.tensor_parallel_size = t;
  rt.data_parallel_topology = rt.topology;
  if (t == 1) return Status::Ok();
  const comm::Topology& topo = rt.topology;
  if (topo.ranks_per_node % t != 0) {
    return InvalidArgumentError(fmt::format(
        "tensor_parallel.autotp_size {} does not divide the {} rank(s) per node of this run ({}): "
        "a tensor-parallel group must lie within one node",
        t, topo.ranks_per_node, topo.Describe()));
  }
  const int r = rt.comm->rank();
  STRATA_ASSIGN_OR_RETURN(rt.tensor_parallel, rt.comm->Split(r / t, r % t));
  STRATA_ASSIGN_OR_RETURN(rt.data_parallel_group, rt.comm->Split(r % t, r / t));
  STRATA_ASSIGN_OR_RETURN(rt.data_parallel_topology,
                          comm::Topology::Uniform(r / t, topo.world / t, topo.ranks_per_node / t));
  return Status::Ok();
}

}  // namespace

void EngineStack::Reset() {
  engine.reset();
  pool.reset();
  store.reset();
  if (faults && faults->backend) {  // (not a moved-from plan)
    STRATA_LOG(warn, io, "STRATA_FAULT_INJECT: injected {}", faults->Summary());
    faults.reset();
  }
}

EngineStack& EngineStack::operator=(EngineStack&& other) noexcept {
  if (this != &other) {
    Reset();
    faults = std::move(other.faults);
    other.faults.reset();
    store = std::move(other.store);
    pool = std::move(other.pool);
    engine = std::move(other.engine);
    optimizer_pipeline_depth = other.optimizer_pipeline_depth;
    cpu_adam_threads = other.cpu_adam_threads;
  }
  return *this;
}

Result<Runtime> OpenRuntime(const Config& config, const RuntimeOptions& options) {
  Runtime rt;
  rt.launch = options.standalone ? comm::LaunchInfo{.launcher = "none"}
              : options.launch   ? *options.launch
                                 : comm::DetectLaunch();
  const DeviceKind kind = options.device.value_or(config.strata.device);
  std::optional<std::string> visible;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) visible = v;
  const device::GpuReport gpus = options.gpus ? *options.gpus
                                 : kind == DeviceKind::kCpu ? device::GpuReport{}
                                                            : device::QueryGpus();
  STRATA_ASSIGN_OR_RETURN(rt.choice,
                          ChooseDevice(kind, rt.launch.rank, rt.launch.local_rank, gpus, visible));
  device::DeviceOptions dopt;
  dopt.type = rt.choice.type;
  dopt.ordinal = rt.choice.ordinal;
  // strata.memory.device_budget: everything the run holds on the device (parameters, gradients,
  // optimizer states on the device, activations, workspaces); "auto": all free memory on a GPU,
  // 1/4 of RAM for the CPU device.
  dopt.memory_budget =
      options.device_budget.value_or(config.strata.memory.device_budget.value_or(0));
  dopt.trace = options.trace;
  STRATA_ASSIGN_OR_RETURN(rt.device, device::CreateDevice(dopt));
  if (options.wrap_device) rt.device = options.wrap_device(std::move(rt.device));
  comm::CollectiveOptions copt;
  copt.trace = options.trace;
  copt.backend = options.backend;
  if (options.comm_timeout) copt.timeout = *options.comm_timeout;
  if (options.make_collective) {
    STRATA_ASSIGN_OR_RETURN(rt.comm, options.make_collective(*rt.device));
  } else if (options.standalone) {
    // Directly: CreateCollective refuses a world of one when the launcher started several ranks.
    rt.comm = std::make_unique<comm::internal::SingleCollective>(*rt.device, copt);
  } else {
    STRATA_ASSIGN_OR_RETURN(rt.comm, comm::CreateCollective(*rt.device, copt));
  }
  if (rt.comm->world_size() > 1) {
    STRATA_ASSIGN_OR_RETURN(
        rt.topology,
        comm::DiscoverTopology(*rt.comm, *rt.device,
                               options.host_identity.value_or(comm::HostIdentity()),
                               rt.launch.local_rank));
  }
  rt.traffic = std::make_unique<comm::TrafficCounters>();
  rt.comm = comm::CountTraffic(std::move(rt.comm), rt.topology, rt.traffic.get(), *rt.device);
  STRATA_RETURN_IF_ERROR(SplitTensorParallel(config, rt));
  return rt;
}

int CpuAdamThreads(const Config& config, device::DeviceType device, int local_ranks,
                   unsigned hardware_threads) {
  if (config.strata.cpu_adam_threads) return *config.strata.cpu_adam_threads;
  if (device == device::DeviceType::kCpu) return 1;
  const int per_rank = static_cast<int>(hardware_threads) / std::max(local_ranks, 1);
  return std::max(1, per_rank - 2);
}

Result<EngineStack> BuildEngine(Runtime& runtime, zero::Model& model, const Config& config,
                                BuildOptions options) {
  EngineStack s;
  const IoSettings& io_cfg = config.strata.io;
  io::StoreOptions store_opt;
  store_opt.backend = io_cfg.backend == IoBackend::kUring   ? io::Backend::kUring
                      : io_cfg.backend == IoBackend::kPosix ? io::Backend::kPosix
                                                            : io::Backend::kAuto;
  store_opt.threads = options.io_threads.value_or(io_cfg.threads);
  store_opt.queue_depth = io_cfg.queue_depth;
  store_opt.sqpoll = io_cfg.sqpoll;
  store_opt.register_files = io_cfg.register_files;
  store_opt.register_buffers = io_cfg.register_buffers;
  // STRATA_FAULT_INJECT: a testing aid (docs/testing.md), never set in production.
  if (const char* spec = std::getenv("STRATA_FAULT_INJECT"); spec != nullptr && *spec != '\0') {
    STRATA_ASSIGN_OR_RETURN(io::FaultPlan plan, io::ParseFaultSpec(spec));
    STRATA_LOG(warn, io, "STRATA_FAULT_INJECT='{}': injecting I/O faults (a testing aid)", spec);
    s.faults = std::move(plan);
  }
  std::shared_ptr<io::FaultInjector> backend_faults = s.faults ? s.faults->backend : nullptr;
  if (options.memory_store) {
    STRATA_ASSIGN_OR_RETURN(s.store, io::CreateMemoryStore(store_opt, backend_faults));
  } else {
    STRATA_ASSIGN_OR_RETURN(s.store, io::CreateBlockStore(store_opt, backend_faults));
  }
  if (s.faults) s.store = io::CreateFaultInjectingStore(std::move(s.store), s.faults->wrapper);
  if (options.wrap_store) s.store = options.wrap_store(std::move(s.store));
  // Above everything else, so that whatever happens below (the drive, the file, an injected fault)
  // is caught.
  if (io_cfg.checksums) s.store = io::CreateChecksummingStore(std::move(s.store));
  // offload_optimizer.buffer_count: the optimizer sub-groups in host memory at once (read-ahead,
  // current, write-behind), at least 3.
  s.optimizer_pipeline_depth = static_cast<int>(
      std::clamp<int64_t>(config.zero.offload_optimizer.buffer_count, 3, 1024));
  uint64_t pool_bytes = 0;
  if (options.pinned_pool || config.strata.memory.pinned_pool) {
    pool_bytes = options.pinned_pool.value_or(config.strata.memory.pinned_pool.value_or(0));
  } else {
    STRATA_ASSIGN_OR_RETURN(pool_bytes, zero::Engine::PlanPinnedPoolBytes(
                                            model.units(), config,
                                            runtime.data_parallel().world_size(),
                                            s.optimizer_pipeline_depth, runtime.device->type(),
                                            options.overlap_optimizer.value_or(true)));
    // "auto" sizes from the host too: a plan the machine cannot pin fails here, clearly, rather
    // than as a failed allocation or the OOM killer later. Every rank on the node pins its own.
    const uint64_t available = HostAvailableBytes();
    if (available > 0 && pool_bytes > available) {
      return ResourceExhaustedError(fmt::format(
          "the pinned pool this run needs ({} on rank {}) is more than the host's available "
          "memory ({}): offload to NVMe (offload_param / offload_optimizer \"nvme\"), use more "
          "ranks, or set strata.memory.pinned_pool",
          FormatBytes(pool_bytes), runtime.comm->rank(), FormatBytes(available)));
    }
  }
  device::PinnedPoolOptions popt;
  popt.bytes = pool_bytes;
  popt.huge_pages = options.huge_pages ? *options.huge_pages
                    : io_cfg.huge_pages == Toggle::kOn  ? HugePages::kOn
                    : io_cfg.huge_pages == Toggle::kOff ? HugePages::kOff
                                                        : HugePages::kAuto;
  popt.device = runtime.device.get();
  popt.store = s.store.get();
  STRATA_ASSIGN_OR_RETURN(s.pool, device::PinnedPool::Create(popt));
  zero::EngineOptions eo;
  eo.config = config;
  eo.device = runtime.device.get();
  eo.comm = &runtime.data_parallel();
  eo.file_rank = runtime.comm->rank();
  eo.tensor_parallel = runtime.tensor_parallel.get();
  eo.traffic = runtime.traffic.get();
  eo.topology = runtime.data_parallel_topology;
  eo.pool = s.pool.get();
  eo.store = s.store.get();
  eo.trace = options.trace;
  eo.optimizer_pipeline_depth = s.optimizer_pipeline_depth;
  eo.param_host_budget =
      options.param_host_budget.value_or(config.strata.memory.host_budget.value_or(0));
  eo.param_device_budget = options.param_device_budget;
  eo.cpu_adam_threads = CpuAdamThreads(config, runtime.device->type(), runtime.launch.local_size,
                                       std::thread::hardware_concurrency());
  if (options.cpu_adam_threads) eo.cpu_adam_threads = *options.cpu_adam_threads;
  s.cpu_adam_threads = eo.cpu_adam_threads;
  if (options.overlap_optimizer) eo.overlap_optimizer = *options.overlap_optimizer;
  if (options.initial) eo.initial = std::move(*options.initial);
  STRATA_ASSIGN_OR_RETURN(s.engine, zero::Engine::Create(model, eo));
  return s;
}

}  // namespace strata::train
