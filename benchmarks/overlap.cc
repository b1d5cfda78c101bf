// strata_overlap_bench: how well the prefetch scheduler hides layer streaming behind compute.
//
// A model of L units ("layers") of --unit-size bytes each is homed on NVMe. One training step
// uses every unit once forward (0..L-1) and once backward (L-1..0); each use acquires the unit in
// device memory through the PrefetchScheduler, runs a GEMM that reads it on a compute stream of the
// device, waits for that GEMM (the next layer needs its output) and releases the unit. Step 1
// records the scheduler's trace and is not reported; steps 2+ are.
//
// --device cpu (the default) runs on the CPU device: OpenBLAS GEMMs in host tasks. --device cuda
// runs the same loops on a CUDA GPU: units in device memory (copied, never shared with the host
// copy), cuBLAS GEMMs, and each access's check through a D2H copy (overlap_compute.h). Both sit
// behind UnitCompute, so that the loops below are the same for both.
//
// For each L it measures four runs, each on freshly built device, store, pool, tier manager and
// scheduler (so that peaks and counters belong to that run alone):
//   io-only       the same loop with the GEMM left out: what the transfers cost on their own;
//   compute-only  the same GEMMs over the same access sequence, data already in device memory;
//   prefetch      the full loop with the scheduler's lookahead;
//   no-prefetch   the full loop with PrefetchOptions::enabled = false (on-demand transfers).
// Overlap efficiency = step time / max(io-only, compute-only): 1.0 means the transfers are fully
// hidden (or the compute is), 2.0 means nothing overlaps when the two are balanced.
//
// With --compute-ms auto (the default) the GEMM is calibrated so that compute-only takes as long
// as io-only for that L, which is the hardest case for overlap. It keeps at least --gemm-rows rows
// (64) and narrows the columns it reads when those rows over the whole unit take too long: a GEMM
// of a few rows is memory-bound, and on the CPU device it would compete with the disk's DMA for
// the memory bus, which a GPU's compute (in HBM) does not.
//
// Every access checks three floats of the unit against what was written (a mismatch is an error).
// Each GEMM is timed (cpu: host clock; cuda: CUDA events), so that a prefetch step splits into
// compute (against compute-only's), time with no compute running, and the consumer's waits for
// data.
// The table also reports how much CPU other processes used during each L's runs: on a small
// shared machine that, not the engine, is often what moves the numbers.
//
// With --disk-rate R the NVMe files are replaced by an in-memory store paced to R bytes per
// second (io/paced_store.h): a disk of steady bandwidth, so that the schedule can be measured
// apart from a real disk's swings between runs. The default is the real disk under --path.
//
// Every Status is checked; on error the program prints it and exits 1. The offload files are
// created in the --path directories and removed when each run's tier manager goes away.
#include <cblas.h>
#include <fmt/format.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/units.h"
#include "device/cuda_device.h"
#include "device/pinned_pool.h"
#include "io/memory_store.h"
#include "io/paced_store.h"
#include "offload/prefetch_scheduler.h"
#include "offload/tier_manager.h"
#include "overlap_compute.h"
#include "strata/block_store.h"
#include "strata/device.h"
#include "strata/status.h"
#include "strata/trace.h"

extern "C" void openblas_set_num_threads(int);

namespace strata::bench {
namespace {

using nlohmann::json;
using offload::Tier;

constexpr double kEfficiencyTarget = 1.10;

// --gemm-rows' limits: a CPU GEMM of more rows than this is slower than any disk; a GPU's is 100
// times faster, so the calibration needs far more rows there (capped again by kCudaGemmBytes).
constexpr int kMaxCpuGemmRows = 4096;
constexpr int kMaxCudaGemmRows = 65536;
// Device memory for the cuda GEMM's x and y together, per device: it bounds M for large units.
constexpr uint64_t kCudaGemmBytes = uint64_t{2} << 30;

// Set by SIGINT / SIGTERM: the current run stops at its next access and the program exits 1
// after its tier manager has removed the offload files.
std::atomic<bool> g_interrupted{false};
extern "C" void OnInterrupt(int) {
  g_interrupted.store(true);
}

Status CheckInterrupted() {
  return g_interrupted.load() ? CancelledError("interrupted") : Status::Ok();
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The 1-minute load average (/proc/loadavg), or -1 when it cannot be read. Other work on the
// machine distorts every number here, so it is reported with them.
double LoadAverage() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double load = -1;
  if (std::fscanf(f, "%lf", &load) != 1) load = -1;
  std::fclose(f);
  return load;
}

// CPU time used by other processes while a run went on, in CPUs (0.5 = half a CPU on average):
// system-wide busy time from /proc/stat minus this process's own (getrusage). On a shared machine
// this says which numbers to distrust.
class ForeignCpu {
 public:
  ForeignCpu() : start_busy_(SystemBusySeconds()), start_self_(SelfSeconds()), t0_(NowSeconds()) {}
  double Cpus() const {
    const double wall = NowSeconds() - t0_;
    const double busy = SystemBusySeconds() - start_busy_;
    const double self = SelfSeconds() - start_self_;
    if (start_busy_ < 0 || wall <= 0) return -1;
    return std::max(0.0, (busy - self) / wall);
  }

 private:
  static double SystemBusySeconds() {
    std::FILE* f = std::fopen("/proc/stat", "r");
    if (f == nullptr) return -1;
    unsigned long long v[8] = {};
    const int got = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1],
                                &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]);
    std::fclose(f);
    if (got != 8) return -1;
    // user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
    const unsigned long long busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
    return static_cast<double>(busy) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }
  static double SelfSeconds() {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    auto sec = [](const timeval& tv) { return tv.tv_sec + tv.tv_usec * 1e-6; };
    return sec(ru.ru_utime) + sec(ru.ru_stime);
  }
  double start_busy_, start_self_, t0_;
};

struct Args {
  std::vector<std::string> paths;
  std::string units_text = "8,32,128";
  std::string unit_size_text = "8MiB";
  int steps = 8;
  std::string compute_ms_text = "auto";
  int device_lookahead = 2;
  int host_lookahead = 6;
  int reuse_distance = 2;  // units
  int min_accesses = 512;  // per run: small L runs more steps, so its mean is not noise
  int rounds = 3;          // io-only, compute-only and prefetch runs repeated, interleaved
  int paired_cycles = -1;  // cycles of the paired run; -1: as many as the runs' measured steps
  std::optional<int> host_budget;
  int io_threads = 1;
  int queue_depth = 2;
  int run_ahead = 0;  // accesses whose compute may be queued behind the one running
  // The GEMM's least row count M: enough rows to keep it compute-bound (see --gemm-rows).
  int gemm_rows = 64;
  std::string backend = "auto";
  std::string device_name = "cpu";
  std::string device_alloc = "cached";
  std::string host_memory = "auto";  // resolved by ParseArgs: shared (cpu) or copied (cuda)
  std::string trace_file;
  std::string disk_rate_text;  // empty: the real disk under --path
  bool json_output = false;

  // Parsed.
  device::DeviceType device = device::DeviceType::kCpu;
  std::vector<int> units;
  uint64_t unit_bytes = 0;
  std::optional<double> compute_ms;  // empty: auto
  std::optional<double> disk_rate;   // bytes per second of the paced in-memory disk
};

// The offload files' directory when the disk is the paced in-memory store: a path that cannot
// exist (/dev/null is not a directory), so that the layout's unlink at teardown touches nothing.
constexpr const char* kPacedDiskDir = "/dev/null/paced-disk";

// The most GEMM rows the cuda calibration may use: kMaxCudaGemmRows, or fewer where x [M, N] and
// y [M, K] would not fit kCudaGemmBytes. Needs a.unit_bytes.
int CudaMaxRows(const Args& a) {
  const uint64_t row_bytes = (a.unit_bytes / sizeof(float) / kGemmK + kGemmK) * sizeof(float);
  return static_cast<int>(
      std::min<uint64_t>(kMaxCudaGemmRows, std::max<uint64_t>(1, kCudaGemmBytes / row_bytes)));
}

Status ParseArgs(Args& a) {
  // The device first: what else is valid depends on it.
  if (a.device_name == "cpu") {
    a.device = device::DeviceType::kCpu;
  } else if (a.device_name == "cuda") {
    a.device = device::DeviceType::kCuda;
  } else {
    return InvalidArgumentError(fmt::format("--device '{}': expected cpu or cuda", a.device_name));
  }
  const bool cuda = a.device == device::DeviceType::kCuda;
  if (a.host_memory == "auto") {
    a.host_memory = cuda ? "copied" : "shared";
  } else if (a.host_memory == "shared" && cuda) {
    return InvalidArgumentError(
        "--host-memory shared needs --device cpu: with --device cuda a unit's device copy is "
        "GPU memory, which cannot be the pinned host copy (use --host-memory copied, or auto)");
  }
  a.units.clear();
  size_t start = 0;
  while (start <= a.units_text.size()) {
    const size_t comma = std::min(a.units_text.find(',', start), a.units_text.size());
    const std::string item = a.units_text.substr(start, comma - start);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 3 || v > 100000) {
      return InvalidArgumentError(fmt::format(
          "--units '{}': expected a comma-separated list of unit counts, each at least 3 "
          "(e.g. 8,32,128)",
          a.units_text));
    }
    a.units.push_back(static_cast<int>(v));
    start = comma + 1;
  }
  Result<uint64_t> size = ParseByteSize(a.unit_size_text);
  if (!size.ok()) return size.status().WithContext("--unit-size");
  a.unit_bytes = *size;
  if (a.unit_bytes == 0 || a.unit_bytes % 4096 != 0) {
    return InvalidArgumentError(fmt::format(
        "--unit-size {}: expected a positive multiple of 4 KiB (the unit is a {} x N fp32 matrix)",
        a.unit_size_text, kGemmK));
  }
  if (a.compute_ms_text != "auto") {
    char* end = nullptr;
    const double v = std::strtod(a.compute_ms_text.c_str(), &end);
    if (a.compute_ms_text.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v)) {
      return InvalidArgumentError(fmt::format(
          "--compute-ms '{}': expected a positive number of milliseconds per unit, or auto",
          a.compute_ms_text));
    }
    a.compute_ms = v;
  }
  if (a.steps < 2) {
    return InvalidArgumentError(fmt::format(
        "--steps {}: expected at least 2 (step 1 records the trace and is not reported)", a.steps));
  }
  if (a.device_lookahead < 1) {
    return InvalidArgumentError(
        fmt::format("--device-lookahead {}: expected at least 1 unit", a.device_lookahead));
  }
  if (a.host_lookahead < 0) {
    return InvalidArgumentError(
        fmt::format("--host-lookahead {}: expected 0 or more units", a.host_lookahead));
  }
  if (a.host_budget && *a.host_budget < 1) {
    return InvalidArgumentError(
        fmt::format("--host-budget {}: expected at least 1 unit", *a.host_budget));
  }
  if (a.io_threads < 1 || a.queue_depth < 1) {
    return InvalidArgumentError("--io-threads and --qd: expected at least 1");
  }
  if (!cuda && (a.gemm_rows < 1 || a.gemm_rows > kMaxCpuGemmRows)) {
    return InvalidArgumentError(
        fmt::format("--gemm-rows {}: expected 1 to {} rows", a.gemm_rows, kMaxCpuGemmRows));
  }
  if (cuda && (a.gemm_rows < 1 || a.gemm_rows > kMaxCudaGemmRows)) {
    return InvalidArgumentError(fmt::format(
        "--gemm-rows {}: expected 1 to {} rows with --device cuda", a.gemm_rows, kMaxCudaGemmRows));
  }
  if (cuda && a.gemm_rows > CudaMaxRows(a)) {
    return InvalidArgumentError(fmt::format(
        "--gemm-rows {}: with --unit-size {} at most {} rows fit the {} of device memory the "
        "cuda GEMM's activations may take",
        a.gemm_rows, a.unit_size_text, CudaMaxRows(a), FormatBytesExact(kCudaGemmBytes)));
  }
  if (a.run_ahead < 0 || a.run_ahead > 8) {
    return InvalidArgumentError(
        fmt::format("--run-ahead {}: expected 0 to 8 accesses", a.run_ahead));
  }
  if (!a.disk_rate_text.empty()) {
    std::string text = a.disk_rate_text;
    if (text.size() > 2 && text.ends_with("/s")) text.resize(text.size() - 2);
    Result<uint64_t> rate = ParseByteSize(text);
    if (!rate.ok() || *rate < (uint64_t{1} << 20)) {
      return InvalidArgumentError(fmt::format(
          "--disk-rate '{}': expected bytes per second, at least 1MiB (e.g. 3GiB or 3GiB/s)",
          a.disk_rate_text));
    }
    a.disk_rate = static_cast<double>(*rate);
    if (!a.paths.empty()) {
      return InvalidArgumentError(
          fmt::format("--disk-rate {} streams from memory: leave out --path (given: {})",
                      a.disk_rate_text, fmt::join(a.paths, ", ")));
    }
    a.paths = {kPacedDiskDir};
  }
  if (a.paths.empty()) {
    return InvalidArgumentError(
        "--path is required: the directory for the offload files (or --disk-rate, for a paced "
        "in-memory disk)");
  }
  return Status::Ok();
}

io::Backend ToBackend(std::string_view name) {
  if (name == "uring") return io::Backend::kUring;
  if (name == "posix") return io::Backend::kPosix;
  return io::Backend::kAuto;
}

// Units of host memory the tier manager gets for L units: fewer than L, so the model never fits
// in host memory and every step streams from NVMe.
int HostBudgetUnits(const Args& a, int units) {
  const int wanted = a.host_budget.value_or(a.host_lookahead + 4);
  return std::max(1, std::min(wanted, units - 2));
}

// The cpu unit compute: one host task per access on the compute stream, which checks the unit's
// floats in place (the CPU device's memory is host memory) and runs C (M x N) = A (M x K) *
// W (K x N), single-threaded OpenBLAS. W is the unit's leading K x N block (row stride ldw, the
// unit's full width): N is the full width except when even one row (M = 1) takes longer than the
// target.
class CpuUnitCompute final : public UnitCompute {
 public:
  // `shape` empty: the check alone. `full_cols`: the unit's width (W's row stride).
  CpuUnitCompute(device::Device& device, device::Stream& stream, std::optional<GemmShape> shape,
                 int full_cols)
      : device_(&device), stream_(&stream) {
    if (shape) {
      m_ = shape->m;
      n_ = shape->n;
      ldw_ = full_cols;
      a_.resize(static_cast<size_t>(m_) * kGemmK);
      c_.assign(static_cast<size_t>(m_) * n_, 0.0f);
      FloatStream(12345).Fill(a_.data(), a_.size());
    }
  }
  // The host tasks use a_, c_ and run_s_.
  ~CpuUnitCompute() override { device_->Synchronize(*stream_).IgnoreError(); }

  Status Enqueue(const float* w, const UnitCheck* check, bool gemm,
                 std::string_view label) override {
    if (gemm && a_.empty()) {
      return InvalidArgumentError(
          fmt::format("{}: a GEMM was asked of a unit compute made without a shape", label));
    }
    std::optional<UnitCheck> c;
    if (check != nullptr) c = *check;
    CpuUnitCompute* g = gemm ? this : nullptr;
    return device_->HostTask(
        *stream_,
        [w, c, g]() -> Status {
          if (c) {
            for (size_t i = 0; i < c->positions.size(); ++i) {
              if (std::memcmp(&w[c->positions[i]], &c->expect[i], sizeof(float)) != 0) {
                return DataLossError(
                    fmt::format("layer.{}: float {} reads {} in device memory, {} was written",
                                c->unit, c->positions[i], w[c->positions[i]], c->expect[i]));
              }
            }
          }
          if (g != nullptr) g->Run(w);
          return Status::Ok();
        },
        label);
  }

  // Written on the compute stream's thread; read only after the stream was drained, which
  // orders the two.
  Result<double> GemmSeconds() override { return run_s_; }

 private:
  void Run(const float* w) {
    const double t0 = NowSeconds();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m_, n_, kGemmK, 1.0f, a_.data(), kGemmK,
                w, ldw_, 0.0f, c_.data(), n_);
    run_s_ += NowSeconds() - t0;
  }

  device::Device* device_;
  device::Stream* stream_;
  int m_ = 1, n_ = 1, ldw_ = 1;
  std::vector<float> a_;  // M x K activations (host memory: not model state)
  std::vector<float> c_;  // M x N output
  double run_s_ = 0;      // time inside Run, summed
};

// The unit compute of `a.device` on `stream` of `device` (see overlap_compute.h).
Result<std::unique_ptr<UnitCompute>> CreateUnitCompute(const Args& a, device::Device& device,
                                                       device::Stream& stream,
                                                       std::optional<GemmShape> shape) {
  if (a.device == device::DeviceType::kCpu) {
    const int full_cols = static_cast<int>(a.unit_bytes / sizeof(float) / kGemmK);
    return std::unique_ptr<UnitCompute>(
        std::make_unique<CpuUnitCompute>(device, stream, shape, full_cols));
  }
#if defined(STRATA_WITH_CUDA)
  return CreateCudaUnitCompute(device, stream, shape, a.run_ahead);
#else
  return UnimplementedError("--device cuda: this build of strata_overlap_bench has no CUDA");
#endif
}

// Samples of each unit's content, to check that what compute reads is what was written.
struct Samples {
  size_t count = 0;  // floats per unit
  std::vector<std::array<float, 3>> values;
  std::array<size_t, 3> Positions() const { return {0, count / 2, count - 1}; }
};

enum class Mode { kIoOnly, kPrefetch, kNoPrefetch };
std::string_view ModeName(Mode m) {
  switch (m) {
    case Mode::kIoOnly:
      return "io-only";
    case Mode::kPrefetch:
      return "prefetch";
    case Mode::kNoPrefetch:
      return "no-prefetch";
  }
  return "?";
}

struct RunResult {
  std::vector<double> step_s;  // steps 2+
  double mean_step_s = 0;
  uint64_t device_peak = 0;        // tier manager's device tier peak over the whole run
  uint64_t device_alloc_peak = 0;  // the device's own allocation peak over the whole run
  uint64_t device_budget = 0;
  uint64_t host_peak = 0;  // tier manager's host tier peak, including the initial write
  uint64_t host_budget = 0;
  double nvme_read_bytes_per_step = 0;
  double h2d_bytes_per_step = 0;
  double hit_rate = 0;  // steps 2+
  double stall_s_per_step = 0;
  uint64_t prefetches_issued = 0;  // steps 2+
  uint64_t no_room = 0;
  uint64_t divergences = 0;
  std::string store_name;
  bool direct = false;
  double foreign_cpus = 0;  // other processes' CPU use during the measured steps
  // The store's busy time (StoreStats::busy_ns: a read outstanding) during each of steps 2+, and
  // its share of those steps' time.
  std::vector<double> busy_s;
  double busy_fraction = 0;
  // Time inside the GEMMs during each of steps 2+ (Gemm::run_s): against compute-only's, how much
  // slower the compute ran beside the I/O.
  std::vector<double> gemm_s;
  // Paired run only: the io-only and compute-only step measured right before each prefetch step
  // (step_s), and each cycle's efficiency.
  std::vector<double> io_step_s, compute_step_s, cycle_efficiency;
};

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v)
    s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// How far the consumer runs ahead of its compute stream. After enqueueing an access's work it
// records an event and waits for the event `depth` accesses back, so that at most `depth`
// accesses' work is queued behind the one running — as a GPU training loop launches the next
// layer's kernels while the current ones run. Depth 0 waits for each access's work before the
// next Acquire.
class ComputeWindow {
 public:
  static Result<ComputeWindow> Create(device::Device& device, device::Stream& stream, int depth) {
    ComputeWindow w(device, stream);
    for (int i = 0; i <= depth; ++i) {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> e, device.CreateEvent());
      w.events_.push_back(std::move(e));
    }
    return w;
  }
  // After an access's work was enqueued; returns how many accesses' work is now known to have
  // run (0 or 1), oldest first.
  Result<int> Enqueued() {
    device::Event& e = *events_[next_ % events_.size()];
    STRATA_RETURN_IF_ERROR(device_->Record(e, *stream_));
    ++next_;
    if (next_ - waited_ < events_.size()) return 0;
    STRATA_RETURN_IF_ERROR(device_->Synchronize(*events_[waited_ % events_.size()]));
    ++waited_;
    return 1;
  }
  // At the end of a step: everything enqueued has run.
  Status Drain() {
    STRATA_RETURN_IF_ERROR(device_->Synchronize(*stream_));
    waited_ = next_;
    return Status::Ok();
  }

 private:
  ComputeWindow(device::Device& device, device::Stream& stream)
      : device_(&device), stream_(&stream) {}
  device::Device* device_;
  device::Stream* stream_;
  std::vector<std::unique_ptr<device::Event>> events_;
  size_t next_ = 0, waited_ = 0;
};

// Everything one streaming run needs; members are destroyed in reverse order: the scheduler
// before the tier manager (which removes the offload files), the compute stream after the
// manager's copies are gone, the pool (registered with store and device) before those two.
struct Rig {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<io::BlockStore> store;
  std::unique_ptr<device::PinnedPool> pool;
  std::unique_ptr<device::Stream> compute;
  std::unique_ptr<offload::TierManager> manager;
  std::unique_ptr<offload::PrefetchScheduler> scheduler;
};

uint64_t UnitAlloc(const Args& a) {
  return RoundUp(a.unit_bytes, io::kDirectIoAlignment);
}
// The prefetch budget: the unit in use, the device lookahead, two units kept for reuse at the
// forward/backward turn, and the run-ahead. The tier manager enforces it (a prefetch that does
// not fit is not issued), so the peak can never exceed it; what the runs show is that the peak
// does not grow with L.
int DeviceUnits(const Args& a) {
  return a.device_lookahead + 3 + a.run_ahead;
}
uint64_t DeviceBudget(const Args& a) {
  return static_cast<uint64_t>(DeviceUnits(a)) * UnitAlloc(a);
}

// The block the CUDA device's caching allocator takes from the GPU for a request
// (device::CudaAllocationBytes). A cuda device budget counted in these blocks lets the allocator
// keep every block a run needs: when the blocks it holds would pass its budget it gives cached
// ones back with cudaFree, which synchronizes the whole GPU, inside a step.
uint64_t CudaBlockBytes(uint64_t bytes) {
#if defined(STRATA_WITH_CUDA)
  return device::CudaAllocationBytes(bytes);
#else
  return bytes;  // a build without CUDA refuses --device cuda before any budget is sized
#endif
}
// The cuda budget of a device that holds DeviceUnits units and, with `shape`, the GEMM's x and y.
uint64_t CudaDeviceBudget(const Args& a, const GemmShape* shape) {
  uint64_t bytes = static_cast<uint64_t>(DeviceUnits(a)) * CudaBlockBytes(UnitAlloc(a));
  if (shape != nullptr) {
    bytes += CudaBlockBytes(GemmInputBytes(*shape)) + CudaBlockBytes(GemmOutputBytes(*shape));
  }
  return bytes;
}

// Options of a device for this run: "<device>:<role>", its budget `budget`.
device::DeviceOptions DeviceOptionsFor(const Args& a, std::string_view role, uint64_t budget,
                                       TraceRecorder* trace) {
  device::DeviceOptions dopt;
  dopt.type = a.device;
  dopt.ordinal = 0;
  dopt.memory_budget = budget;
  dopt.name = fmt::format("{}:{}", a.device_name, role);
  dopt.trace = trace;
  return dopt;
}

// Builds the rig for L units, writes every unit's initial content to NVMe and empties the host.
// `shape`: the GEMM the run's accesses will run (null: none), for the cuda device's budget.
Status BuildRig(const Args& a, int units, bool prefetch, const GemmShape* shape,
                TraceRecorder* trace, Samples& samples, Rig& rig) {
  if (a.device == device::DeviceType::kCpu) {
    STRATA_ASSIGN_OR_RETURN(rig.device,
                            device::CreateDevice(DeviceOptionsFor(a, "0", DeviceBudget(a), trace)));
  } else {
    // The tier manager's units (its own budget stays DeviceBudget) and the GEMM's x and y.
    STRATA_ASSIGN_OR_RETURN(rig.device, device::CreateDevice(DeviceOptionsFor(
                                            a, "0", CudaDeviceBudget(a, shape), trace)));
    // Fill the allocator's cache with the unit blocks the tier manager will take, so that no
    // step calls cudaMalloc (the prefetch steps hold more units at once than step 1 does).
    std::vector<void*> blocks;
    Status warm;
    for (int i = 0; i < DeviceUnits(a) && warm.ok(); ++i) {
      Result<void*> p = rig.device->Alloc(UnitAlloc(a));
      if (p.ok()) {
        blocks.push_back(*p);
      } else {
        warm = p.status();
      }
    }
    for (void* p : blocks)
      rig.device->Free(p);  // nothing was enqueued on them
    STRATA_RETURN_IF_ERROR(warm.WithContext("reserving the device memory for the units"));
    rig.device->ResetPeak();
  }

  io::StoreOptions sopt;
  sopt.backend = ToBackend(a.backend);
  sopt.threads = a.io_threads;
  sopt.queue_depth = a.queue_depth;
  if (a.disk_rate) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<io::BlockStore> memory, io::CreateMemoryStore(sopt));
    STRATA_ASSIGN_OR_RETURN(rig.store, io::CreatePacedStore(std::move(memory), *a.disk_rate));
  } else {
    STRATA_ASSIGN_OR_RETURN(rig.store, io::CreateBlockStore(sopt));
  }

  const uint64_t host_budget = static_cast<uint64_t>(HostBudgetUnits(a, units)) *
                               device::PinnedPool::SizeClass(UnitAlloc(a));
  device::PinnedPoolOptions popt;
  popt.bytes = host_budget;  // already rounded to the size class of a unit
  popt.device = rig.device.get();
  popt.store = rig.store.get();
  STRATA_ASSIGN_OR_RETURN(rig.pool, device::PinnedPool::Create(popt));

  STRATA_ASSIGN_OR_RETURN(rig.compute, rig.device->CreateStream("compute"));

  offload::TierManagerOptions mopt;
  mopt.device = rig.device.get();
  mopt.pool = rig.pool.get();
  mopt.store = rig.store.get();
  mopt.device_budget = DeviceBudget(a);
  mopt.host_budget = host_budget;
  mopt.nvme.paths = a.paths;
  mopt.nvme.prefix = fmt::format("strata-overlap-{}", ::getpid());
  mopt.trace = trace;
  mopt.share_host_memory = a.host_memory == "shared";
  STRATA_ASSIGN_OR_RETURN(rig.manager, offload::TierManager::Create(mopt));
  for (int u = 0; u < units; ++u) {
    offload::ShardSpec spec;
    spec.id = static_cast<offload::ShardId>(u);
    spec.bytes = a.unit_bytes;
    spec.home = Tier::kNvme;
    spec.name = fmt::format("layer.{}", u);
    STRATA_RETURN_IF_ERROR(rig.manager->Register(spec));
  }
  STRATA_RETURN_IF_ERROR(rig.manager->Start());

  // Initial content: pseudo-random floats in [-1, 1), written through the host tier to NVMe.
  samples.count = a.unit_bytes / sizeof(float);
  samples.values.assign(static_cast<size_t>(units), {});
  for (int u = 0; u < units; ++u) {
    STRATA_RETURN_IF_ERROR(CheckInterrupted());
    Result<offload::Lease> lease =
        rig.manager->Acquire(static_cast<offload::ShardId>(u), Tier::kHost,
                             offload::Access::kOverwrite, "initial write");
    if (!lease.ok()) return lease.status().WithContext("writing the initial content");
    float* p = static_cast<float*>(lease->data());
    FloatStream(static_cast<uint64_t>(u) + 1).Fill(p, samples.count);
    const auto pos = samples.Positions();
    for (size_t i = 0; i < pos.size(); ++i)
      samples.values[u][i] = p[pos[i]];
    lease->Release(/*dirty=*/true);
  }
  STRATA_RETURN_IF_ERROR(rig.manager->FlushAll());
  for (int u = 0; u < units; ++u) {
    STRATA_RETURN_IF_ERROR(rig.manager->Evict(static_cast<offload::ShardId>(u), Tier::kHost));
  }
  rig.manager->WaitIdle();

  offload::PrefetchOptions sched;
  sched.enabled = prefetch;
  sched.compute_tier = Tier::kDevice;
  sched.device_lookahead_bytes = static_cast<uint64_t>(a.device_lookahead) * a.unit_bytes;
  sched.host_lookahead_bytes = static_cast<uint64_t>(a.host_lookahead) * a.unit_bytes;
  sched.persistence_threshold_bytes = 0;
  // Units reused within this many units' bytes (around the forward/backward turn) stay on the
  // device instead of being read again.
  sched.max_reuse_distance_bytes = static_cast<uint64_t>(a.reuse_distance) * a.unit_bytes;
  sched.max_live_bytes = std::numeric_limits<uint64_t>::max() / 2;
  sched.trace = trace;
  rig.scheduler = std::make_unique<offload::PrefetchScheduler>(*rig.manager, sched);
  for (int u = 0; u < units; ++u) {
    STRATA_RETURN_IF_ERROR(rig.scheduler->AddUnit(static_cast<offload::UnitId>(u),
                                                  {static_cast<offload::ShardId>(u)},
                                                  fmt::format("layer.{}", u)));
  }
  return Status::Ok();
}

// The unit used by access k of a step: forward 0..L-1, then backward L-1..0.
int UnitOfAccess(int k, int units) {
  return k < units ? k : 2 * units - 1 - k;
}

// One streaming run (io-only, prefetch or no-prefetch) for L units.
class ComputeOnly;
Result<double> ComputeOnlyStep(ComputeOnly& compute, int units);

// One run on a fresh rig. With `paired` (mode kPrefetch): after step 1 each measured cycle runs
// an io-only step (no GEMM) and a compute-only step (`paired`, weights already in device memory)
// right before the prefetch step, on this same rig, so that the three times a cycle's efficiency
// compares are taken within about a second of each other. The scheduler statistics then cover
// the prefetch steps only. `shape`: the GEMM of each access (null: none, io-only).
Result<RunResult> RunStreaming(const Args& a, int units, Mode mode, const GemmShape* shape,
                               TraceRecorder* trace, ComputeOnly* paired = nullptr) {
  Samples samples;
  Rig rig;
  STRATA_RETURN_IF_ERROR(BuildRig(a, units, mode != Mode::kNoPrefetch, shape, trace, samples, rig));
  const uint32_t step_track = trace != nullptr ? trace->Track("bench steps") : 0;
  const uint32_t consumer_track = trace != nullptr ? trace->Track("bench consumer") : 0;

  offload::PrefetchStats sched0;
  offload::TierStats dev0;
  io::StoreStats store0;
  RunResult r;
  r.store_name = std::string(rig.store->name());
  r.direct = rig.manager->nvme_layout() != nullptr && rig.manager->nvme_layout()->direct();
  const auto positions = samples.Positions();
  std::optional<ForeignCpu> foreign;
  STRATA_ASSIGN_OR_RETURN(ComputeWindow window,
                          ComputeWindow::Create(*rig.device, *rig.compute, a.run_ahead));
  // Accesses whose work was enqueued and whose units are still held, oldest first; a unit is
  // released once its work has run (so the scheduler can let it go at once).
  struct Held {
    int unit;
    std::vector<offload::Lease> leases;
    std::string owner;
  };
  std::deque<Held> pending;
  // Declared after `pending`, so that on an early return it is destroyed first: it waits for the
  // compute stream before the leases still held are released.
  std::optional<GemmShape> gemm_shape;
  if (shape != nullptr) gemm_shape = *shape;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<UnitCompute> compute,
                          CreateUnitCompute(a, *rig.device, *rig.compute, gemm_shape));
  auto release = [&](int n) -> Status {
    for (; n > 0; --n) {
      Held& h = pending.front();
      Status rel = rig.scheduler->Release(static_cast<offload::UnitId>(h.unit), h.leases,
                                          /*dirty=*/false, rig.compute.get());
      if (!rel.ok()) return rel.WithContext(h.owner);
      pending.pop_front();
    }
    return Status::Ok();
  };
  // One step over the access sequence; `gemm` false: the check alone (io-only).
  auto run_step = [&](bool gemm, int step, std::string_view label) -> Result<double> {
    const double t0 = NowSeconds();
    const int64_t t0_ns = trace != nullptr ? TraceRecorder::NowNs() : 0;
    rig.scheduler->BeginStep();
    for (int k = 0; k < 2 * units; ++k) {
      STRATA_RETURN_IF_ERROR(CheckInterrupted());
      const int u = UnitOfAccess(k, units);
      const std::string owner = fmt::format("{} layer.{}", k < units ? "forward" : "backward", u);
      const int64_t a0 = trace != nullptr ? TraceRecorder::NowNs() : 0;
      Result<std::vector<offload::Lease>> leases =
          rig.scheduler->Acquire(static_cast<offload::UnitId>(u), offload::Access::kRead, owner);
      if (!leases.ok()) return leases.status().WithContext(owner);
      const int64_t a1 = trace != nullptr ? TraceRecorder::NowNs() : 0;
      const float* w = static_cast<const float*>((*leases)[0].data());
      const UnitCheck check{u, positions, samples.values[u]};
      Status enq = compute->Enqueue(w, &check, gemm, gemm ? "gemm" : "check");
      if (!enq.ok()) return enq.WithContext(owner);
      pending.push_back({u, std::move(*leases), owner});
      const int64_t a2 = trace != nullptr ? TraceRecorder::NowNs() : 0;
      Result<int> ran = window.Enqueued();
      if (!ran.ok()) return ran.status().WithContext(owner);
      const int64_t a3 = trace != nullptr ? TraceRecorder::NowNs() : 0;
      STRATA_RETURN_IF_ERROR(release(*ran));
      if (trace != nullptr) {
        // The consumer thread: where it spends each access (scheduler calls vs waiting for the
        // compute stream).
        const int64_t a4 = TraceRecorder::NowNs();
        const double unit = static_cast<double>(u);
        trace->Complete(consumer_track, "acquire", "consumer", a0, a1, {{"unit", unit}});
        trace->Complete(consumer_track, "wait compute", "consumer", a2, a3, {{"unit", unit}});
        trace->Complete(consumer_track, "release", "consumer", a3, a4, {{"unit", unit}});
      }
    }
    STRATA_RETURN_IF_ERROR(window.Drain());
    STRATA_RETURN_IF_ERROR(release(static_cast<int>(pending.size())));
    rig.scheduler->EndStep();
    const double dt = NowSeconds() - t0;
    if (trace != nullptr) {
      trace->Complete(step_track, fmt::format("{} {}", label, step), "step", t0_ns,
                      TraceRecorder::NowNs());
    }
    fmt::print(stderr, "  [L={} {}] step {}/{}: {:.3f} s{}\n", units, label, step, a.steps, dt,
               step == 1 ? " (records the trace; not reported)" : "");
    return dt;
  };
  // Counters summed over the measured (prefetch) steps.
  uint64_t accesses = 0, hits = 0, issued = 0, no_room = 0, stall_ns = 0, read_bytes = 0,
           fill_bytes = 0;
  const std::string label(ModeName(mode));
  for (int step = 1; step <= a.steps; ++step) {
    if (step == 2) foreign.emplace();
    if (step > 1 && paired != nullptr) {
      STRATA_ASSIGN_OR_RETURN(double io_s, run_step(false, step, "paired io-only"));
      STRATA_ASSIGN_OR_RETURN(double c_s, ComputeOnlyStep(*paired, units));
      r.io_step_s.push_back(io_s);
      r.compute_step_s.push_back(c_s);
    }
    sched0 = rig.scheduler->stats();
    dev0 = rig.manager->stats(Tier::kDevice);
    store0 = rig.store->stats();
    // Every step ends with the compute stream drained, so the GEMM time can be read here.
    STRATA_ASSIGN_OR_RETURN(const double gemm0, compute->GemmSeconds());
    STRATA_ASSIGN_OR_RETURN(double dt, run_step(shape != nullptr, step, label));
    if (step == 1) continue;
    r.step_s.push_back(dt);
    STRATA_ASSIGN_OR_RETURN(const double gemm1, compute->GemmSeconds());
    r.gemm_s.push_back(gemm1 - gemm0);
    const io::StoreStats store1 = rig.store->stats();
    r.busy_s.push_back(static_cast<double>(store1.busy_ns - store0.busy_ns) * 1e-9);
    if (paired != nullptr) {
      r.cycle_efficiency.push_back(dt / std::max(r.io_step_s.back(), r.compute_step_s.back()));
    }
    const offload::PrefetchStats sched1 = rig.scheduler->stats();
    const offload::TierStats dev1 = rig.manager->stats(Tier::kDevice);
    accesses += sched1.accesses - sched0.accesses;
    hits += sched1.hits - sched0.hits;
    issued += sched1.issued - sched0.issued;
    no_room += sched1.no_room - sched0.no_room;
    stall_ns += dev1.stall_ns - dev0.stall_ns;
    read_bytes += store1.bytes_read - store0.bytes_read;
    fill_bytes += dev1.fill_bytes - dev0.fill_bytes;
  }
  r.foreign_cpus = foreign->Cpus();
  rig.manager->WaitIdle();
  const double measured = static_cast<double>(a.steps - 1);
  const offload::PrefetchStats sched1 = rig.scheduler->stats();
  const offload::TierStats dev1 = rig.manager->stats(Tier::kDevice);
  const offload::TierStats host1 = rig.manager->stats(Tier::kHost);
  r.mean_step_s = Mean(r.step_s);
  r.busy_fraction = r.step_s.empty() ? 0.0 : Mean(r.busy_s) / r.mean_step_s;
  r.device_peak = dev1.peak;
  r.device_alloc_peak = rig.device->memory_stats().peak;
  r.device_budget = dev1.budget;
  r.host_peak = host1.peak;
  r.host_budget = host1.budget;
  r.nvme_read_bytes_per_step = static_cast<double>(read_bytes) / measured;
  r.h2d_bytes_per_step = static_cast<double>(fill_bytes) / measured;
  r.hit_rate = accesses == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(accesses);
  r.stall_s_per_step = static_cast<double>(stall_ns) * 1e-9 / measured;
  r.prefetches_issued = issued;
  r.no_room = no_room;
  r.divergences = sched1.divergences;
  return r;
}

// The GEMMs alone, over the same access sequence, on weights already in device memory. The
// weights are spread over as many buffers as the streaming runs' device budget holds, so that
// caches see a similar footprint.
class ComputeOnly {
 public:
  // `trace` (may be null) records every GEMM on a "compute-only" track, and each step.
  static Result<std::unique_ptr<ComputeOnly>> Create(const Args& a, TraceRecorder* trace) {
    std::unique_ptr<ComputeOnly> c(new ComputeOnly(a));
    c->trace_ = trace;
    if (trace != nullptr) c->step_track_ = trace->Track("bench compute-only steps");
    const bool cuda = a.device == device::DeviceType::kCuda;
    // cuda: the units and the largest x and y the calibration may try (one GEMM's at a time).
    const GemmShape largest{CudaMaxRows(a), c->n_, 1};
    const uint64_t budget = cuda ? CudaDeviceBudget(a, &largest) : DeviceBudget(a);
    Result<std::unique_ptr<device::Device>> device =
        device::CreateDevice(DeviceOptionsFor(a, "compute-only", budget, trace));
    if (!device.ok()) {
      return cuda ? device.status().WithContext("--device cuda") : device.status();
    }
    c->device_ = std::move(*device);
    STRATA_ASSIGN_OR_RETURN(c->stream_, c->device_->CreateStream("compute-only"));
    STRATA_ASSIGN_OR_RETURN(ComputeWindow window,
                            ComputeWindow::Create(*c->device_, *c->stream_, a.run_ahead));
    c->window_.emplace(std::move(window));
    const size_t floats = a.unit_bytes / sizeof(float);
    std::vector<float> staging(cuda ? floats : 0);
    for (int i = 0; i < DeviceUnits(a); ++i) {
      STRATA_ASSIGN_OR_RETURN(void* p, c->device_->Alloc(UnitAlloc(a)));
      c->buffers_.push_back(static_cast<float*>(p));
      FloatStream content(static_cast<uint64_t>(i) + 1000);
      if (!cuda) {
        content.Fill(static_cast<float*>(p), floats);  // the CPU device's memory is host memory
        continue;
      }
      content.Fill(staging.data(), floats);
      Status copied = c->device_->CopyAsync(p, staging.data(), floats * sizeof(float),
                                            device::CopyKind::kHostToDevice, *c->stream_);
      // The copy reads `staging`: wait for it before the next fill, also after a failure.
      Status synced = c->device_->Synchronize(*c->stream_);
      STRATA_RETURN_IF_ERROR(copied);
      STRATA_RETURN_IF_ERROR(synced);
    }
    return c;
  }
  ~ComputeOnly() {
    compute_.reset();  // waits for the stream; frees its buffers on the device
    window_.reset();
    stream_.reset();
    for (float* p : buffers_)
      device_->Free(p);
  }
  ComputeOnly(const ComputeOnly&) = delete;
  ComputeOnly& operator=(const ComputeOnly&) = delete;

  int n() const { return n_; }

  // Makes `shape` the GEMM of Steps and OneStep.
  Status UseShape(const GemmShape& shape) {
    compute_.reset();  // its x and y leave the device's budget first
    STRATA_ASSIGN_OR_RETURN(compute_, CreateUnitCompute(*args_, *device_, *stream_, shape));
    return Status::Ok();
  }

  // Seconds for `accesses` GEMMs of `compute`, enqueued as the streaming runs do (--run-ahead).
  Result<double> Time(UnitCompute& compute, int accesses, int first_unit, std::string_view label) {
    const double t0 = NowSeconds();
    for (int k = 0; k < accesses; ++k) {
      STRATA_RETURN_IF_ERROR(
          Enqueue(compute, buffers_[static_cast<size_t>(first_unit + k) % buffers_.size()], label));
    }
    STRATA_RETURN_IF_ERROR(window_->Drain());
    return NowSeconds() - t0;
  }

  // Enqueues one GEMM on `w` and keeps the consumer within --run-ahead of the stream.
  Status Enqueue(UnitCompute& compute, const float* w, std::string_view label) {
    STRATA_RETURN_IF_ERROR(compute.Enqueue(w, /*check=*/nullptr, /*gemm=*/true, label));
    return window_->Enqueued().status();
  }

  // Steps of the forward/backward sequence for L units, with the GEMM of UseShape; returns the
  // times of steps 2+. `foreign_cpus`: other processes' CPU use during steps 2+ (see
  // ForeignCpu); `gemm_s`: the time inside the GEMMs, summed over steps 2+.
  Result<std::vector<double>> Steps(int units, int steps, double* foreign_cpus, double* gemm_s) {
    if (Compute() == nullptr) return FailedPreconditionError("compute-only: no GEMM shape set");
    std::vector<double> out;
    std::optional<ForeignCpu> foreign;
    double gemm0 = 0;
    for (int step = 1; step <= steps; ++step) {
      if (step == 2) {
        foreign.emplace();
        STRATA_ASSIGN_OR_RETURN(gemm0, Compute()->GemmSeconds());  // step 1 was drained
      }
      STRATA_ASSIGN_OR_RETURN(double dt, OneStep(units, fmt::format("step {}/{}", step, steps)));
      if (step > 1) out.push_back(dt);
    }
    STRATA_ASSIGN_OR_RETURN(const double gemm1, Compute()->GemmSeconds());
    *gemm_s = gemm1 - gemm0;
    *foreign_cpus = foreign->Cpus();
    return out;
  }

  // One step of the access sequence (seconds), with the GEMM of UseShape; `label` names it in
  // the trace and on stderr.
  Result<double> OneStep(int units, const std::string& label) {
    UnitCompute* compute = Compute();
    if (compute == nullptr) return FailedPreconditionError("compute-only: no GEMM shape set");
    const double t0 = NowSeconds();
    for (int k = 0; k < 2 * units; ++k) {
      STRATA_RETURN_IF_ERROR(CheckInterrupted());
      STRATA_RETURN_IF_ERROR(
          Enqueue(*compute, buffers_[static_cast<size_t>(UnitOfAccess(k, units)) % buffers_.size()],
                  "gemm"));
    }
    STRATA_RETURN_IF_ERROR(window_->Drain());
    const double dt = NowSeconds() - t0;
    if (trace_ != nullptr) {
      const int64_t end = TraceRecorder::NowNs();
      trace_->Complete(step_track_, fmt::format("L={} {}", units, label), "step",
                       end - static_cast<int64_t>(dt * 1e9), end);
    }
    fmt::print(stderr, "  [L={} compute-only] {}: {:.3f} s\n", units, label, dt);
    return dt;
  }

  // The row count M >= `min_rows` whose GEMM (with its enqueue and synchronize) takes about
  // `target_s`; when M = min_rows over the whole unit already takes longer, the column count N is
  // narrowed instead. On cuda M is at most CudaMaxRows, and when that many rows still run faster
  // than the target the GEMM is repeated: `reps` times per access, with M chosen for the rest.
  // Forgets the shape of UseShape.
  Result<GemmShape> Calibrate(double target_s, int min_rows) {
    compute_.reset();  // its x and y would count against the budget the calibration needs
    const bool cuda = args_->device == device::DeviceType::kCuda;
    // cpu: the search extends M up to 2^16 rows at most, as it always did; cuda: to CudaMaxRows.
    const int extend_below = cuda ? CudaMaxRows(*args_) : (1 << 16);
    const int max_rows = cuda ? CudaMaxRows(*args_) : std::numeric_limits<int>::max();
    // t(M) grows with M but not quite linearly (OpenBLAS blocks M), so bracket the target and
    // narrow the bracket by interpolation, keeping the M measured closest to it. Each value is the
    // median of several short samples, so that one preempted sample does not steer the search.
    int cols = n_;
    int reps = 1;
    auto measure = [&](int m) -> Result<double> {
      STRATA_ASSIGN_OR_RETURN(
          std::unique_ptr<UnitCompute> g,
          CreateUnitCompute(*args_, *device_, *stream_, GemmShape{m, cols, reps}));
      // Page faults, OpenBLAS buffers; cuBLAS's first use of a kernel.
      STRATA_RETURN_IF_ERROR(Time(*g, 2, 0, "calibration"));
      std::vector<double> t;
      for (int rep = 0; rep < 9; ++rep) {
        STRATA_ASSIGN_OR_RETURN(double s, Time(*g, 2, rep, "calibration"));
        t.push_back(s / 2);
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    int best_m = 1;
    double best_t = 0;
    auto consider = [&](int m, double t) {
      if (best_t == 0 || std::abs(t - target_s) < std::abs(best_t - target_s)) {
        best_m = m;
        best_t = t;
      }
    };
    int lo = min_rows, hi = std::min(std::max(128, 2 * min_rows), max_rows);
    STRATA_ASSIGN_OR_RETURN(double t_lo, measure(lo));
    consider(lo, t_lo);
    if (t_lo > 1.02 * target_s) {
      // The least row count is too much: keep it and bisect the columns (t is about linear in N).
      int c_lo = 16, c_hi = n_;
      double best_c_t = t_lo;
      int best_c = n_;
      for (int iter = 0; iter < 10 && c_hi - c_lo > 16; ++iter) {
        cols = std::clamp((c_lo + c_hi) / 2 / 16 * 16, 16, n_);
        STRATA_ASSIGN_OR_RETURN(double t, measure(min_rows));
        if (std::abs(t - target_s) < std::abs(best_c_t - target_s)) {
          best_c_t = t;
          best_c = cols;
        }
        (t < target_s ? c_lo : c_hi) = cols;
        if (std::abs(t - target_s) < 0.02 * target_s) break;
      }
      fmt::print(stderr,
                 "  calibrated GEMM: M = {}, N = {} of {} ({} x {} x {}): {:.3f} ms per unit "
                 "(target {:.3f})\n",
                 min_rows, best_c, n_, min_rows, kGemmK, best_c, best_c_t * 1e3, target_s * 1e3);
      return GemmShape{min_rows, best_c, 1};
    }
    STRATA_ASSIGN_OR_RETURN(double t_hi, measure(hi));
    consider(hi, t_hi);
    while (t_hi < target_s && hi < extend_below) {  // the target lies above: extend the bracket
      lo = hi;
      t_lo = t_hi;
      hi = std::min(2 * hi, max_rows);
      STRATA_ASSIGN_OR_RETURN(t_hi, measure(hi));
      consider(hi, t_hi);
    }
    if (cuda && t_hi < target_s) {
      // Even the most rows run faster than the target: repeat the GEMM, and look for M between
      // half the rows and all of them (with r = ceil(target / t(max)), r t(max / 2) is below the
      // target and r t(max) is not, t being about linear in M). Times now cover r GEMMs.
      reps = static_cast<int>(std::min(1e5, std::ceil(target_s / t_hi)));
      lo = std::max(min_rows, hi / 2);
      best_t = 0;
      STRATA_ASSIGN_OR_RETURN(t_lo, measure(lo));
      consider(lo, t_lo);
      STRATA_ASSIGN_OR_RETURN(t_hi, measure(hi));
      consider(hi, t_hi);
    }
    for (int iter = 0; iter < 8 && t_lo < target_s && hi - lo > 1; ++iter) {
      if (std::abs(best_t - target_s) < 0.02 * target_s) break;
      const double frac = (target_s - t_lo) / std::max(t_hi - t_lo, 1e-9);
      const int m =
          std::clamp(lo + static_cast<int>(std::lround(frac * (hi - lo))), lo + 1, hi - 1);
      STRATA_ASSIGN_OR_RETURN(double t, measure(m));
      consider(m, t);
      if (t < target_s) {
        lo = m;
        t_lo = t;
      } else {
        hi = m;
        t_hi = t;
      }
    }
    fmt::print(
        stderr, "  calibrated GEMM: M = {} ({} x {} x {}){}: {:.3f} ms per unit (target {:.3f})\n",
        best_m, best_m, kGemmK, n_, reps > 1 ? fmt::format(", run {} times per access", reps) : "",
        best_t * 1e3, target_s * 1e3);
    return GemmShape{best_m, n_, reps};
  }

 private:
  explicit ComputeOnly(const Args& a)
      : args_(&a), n_(static_cast<int>(a.unit_bytes / sizeof(float) / kGemmK)) {}
  UnitCompute* Compute() { return compute_.get(); }

  const Args* args_;  // outlives the object (Run's)
  int n_ = 1;         // the unit's width (columns)
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<device::Stream> stream_;
  std::optional<ComputeWindow> window_;  // on stream_
  std::vector<float*> buffers_;
  std::unique_ptr<UnitCompute> compute_;  // on stream_, the GEMM of UseShape
  TraceRecorder* trace_ = nullptr;
  uint32_t step_track_ = 0;
};

Result<double> ComputeOnlyStep(ComputeOnly& compute, int units) {
  return compute.OneStep(units, "paired step");
}

struct Row {
  int units = 0;
  int host_budget_units = 0;
  int gemm_m = 0;
  int gemm_n = 0;     // columns of the unit the GEMM uses (all but at the smallest targets)
  int gemm_reps = 1;  // GEMMs per access (cuda, when the most rows are too fast)
  double compute_target_ms = 0;
  RunResult io_only, prefetch, no_prefetch;
  std::vector<double> compute_only_steps;
  double compute_only_s = 0;
  double compute_only_gemm_s = 0;  // per step: the time inside the GEMMs
  double compute_only_foreign_cpus = 0;
  // The most CPU other processes used during any of this L's four runs.
  double MaxForeignCpus() const {
    return std::max({io_only.foreign_cpus, prefetch.foreign_cpus, no_prefetch.foreign_cpus,
                     compute_only_foreign_cpus});
  }
  double efficiency = 0, no_prefetch_efficiency = 0, balance = 0;
  // With several rounds: each round's efficiency (its prefetch step over the max of its own
  // io-only and compute-only), for the spread.
  std::vector<double> round_efficiencies;
  // The paired run (see RunStreaming): the median of its cycles' efficiencies.
  RunResult paired;
  double paired_efficiency = 0;
};

json RunJson(const RunResult& r) {
  return json{{"step_s", r.mean_step_s},
              {"steps_s", r.step_s},
              {"device_peak_bytes", r.device_peak},
              {"device_alloc_peak_bytes", r.device_alloc_peak},
              {"host_peak_bytes", r.host_peak},
              {"nvme_read_bytes_per_step", r.nvme_read_bytes_per_step},
              {"h2d_bytes_per_step", r.h2d_bytes_per_step},
              {"hit_rate", r.hit_rate},
              {"stall_s_per_step", r.stall_s_per_step},
              {"prefetches_issued", r.prefetches_issued},
              {"prefetch_no_room", r.no_room},
              {"divergences", r.divergences},
              {"foreign_cpus", r.foreign_cpus},
              {"disk_busy_s_per_step", Mean(r.busy_s)},
              {"disk_busy_steps_s", r.busy_s},
              {"disk_busy_fraction", r.busy_fraction},
              {"gemm_s_per_step", Mean(r.gemm_s)}};
}

std::string MiB(double bytes) {
  return fmt::format("{:.0f}", bytes / (1 << 20));
}

void PrintTable(std::FILE* out, const Args& a, const std::vector<Row>& rows) {
  // cuda: an r column (GEMMs per access) after N.
  const bool cuda = a.device == device::DeviceType::kCuda;
  auto reps = [cuda](const std::string& v) { return cuda ? fmt::format(" {:>3}", v) : ""; };
  fmt::print(out,
             "\nOverlap (layer streaming) on the {} device: unit {} ({} x {} fp32), steps 2-{} "
             "averaged, device lookahead {} units, host lookahead {} units (reads in flight), "
             "run-ahead {}\n",
             a.device_name, FormatBytesExact(a.unit_bytes), kGemmK, a.unit_bytes / 4 / kGemmK,
             a.steps, a.device_lookahead, a.host_lookahead, a.run_ahead);
  fmt::print(out,
             "{:>5} {:>5} {:>5} {:>5}{} {:>10} {:>10} {:>8} {:>7} {:>10} {:>7} {:>8} {:>6} {:>12} "
             "{:>10} {:>8} {:>9} {:>9} {:>9}\n",
             "L", "host", "M", "N", reps("r"), "io-only s", "compute s", "balance", "step s",
             "efficiency", "paired", "no-pf s", "no-pf", "dev peak MiB", "budget MiB", "hit rate",
             "NVMe MiB", "other CPU", "disk busy");
  for (const Row& r : rows) {
    fmt::print(out,
               "{:>5} {:>5} {:>5} {:>5}{} {:>10.3f} {:>10.3f} {:>8.2f} {:>7.3f} {:>10.3f} {:>7.3f} "
               "{:>8.3f} {:>6.2f} {:>12} {:>10} {:>8.3f} {:>9} {:>9.2f} {:>9.2f}\n",
               r.units, r.host_budget_units, r.gemm_m, r.gemm_n, reps(std::to_string(r.gemm_reps)),
               r.io_only.mean_step_s, r.compute_only_s, r.balance, r.prefetch.mean_step_s,
               r.efficiency, r.paired_efficiency, r.no_prefetch.mean_step_s,
               r.no_prefetch_efficiency, MiB(static_cast<double>(r.prefetch.device_peak)),
               MiB(static_cast<double>(r.prefetch.device_budget)), r.prefetch.hit_rate,
               MiB(r.prefetch.nvme_read_bytes_per_step), r.MaxForeignCpus(),
               r.prefetch.busy_fraction);
  }
  fmt::print(out,
             "host = host budget (units); M x N = GEMM rows x the unit's columns it uses;{} "
             "balance = compute/io; efficiency = step / "
             "max(io-only, compute), each mode's median run; paired = the median over the paired "
             "run's cycles of the same ratio, its three steps taken in turn; no-pf = prefetch off "
             "(its step time and efficiency); dev "
             "peak = device bytes held by the tier manager, whole run; NVMe MiB = read per "
             "step; other CPU = the most CPUs other processes used during one of the L's runs; "
             "disk busy = "
             "the share of the prefetch steps' time with a read outstanding\n",
             cuda ? " r = GEMMs per access;" : "");
}

int Run(Args& a) {
  if (Status st = ParseArgs(a); !st.ok()) {
    fmt::print(stderr, "strata_overlap_bench: {}\n", st.ToString());
    return 1;
  }
  openblas_set_num_threads(1);
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGTERM, OnInterrupt);
  if (a.device == device::DeviceType::kCpu && a.device_alloc == "cached") {
    // The CPU device allocates "device memory" with operator new, one allocation per device copy.
    // With glibc's defaults an 8 MiB block is mmap'ed (or trimmed from the heap top when freed),
    // so every copy faults its pages in again during its H2D copy: several ms per 8 MiB of
    // kernel page zeroing on the copy thread, which a GPU's caching allocator never pays. Keep
    // freed memory mapped instead, so that the measurement is of the offload pipeline.
    if (::mallopt(M_MMAP_MAX, 0) != 1 || ::mallopt(M_TRIM_THRESHOLD, INT32_MAX) != 1) {
      fmt::print(stderr, "warning: mallopt failed; --device-alloc cached has no effect\n");
    }
  }
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  const double load_start = LoadAverage();
  if (load_start > 0.5) {
    fmt::print(stderr,
               "warning: load average {:.2f} on {} CPUs before the benchmark: other work is "
               "running, and the timings will show it\n",
               load_start, cpus);
  }

  auto fail = [](const Status& st) {
    fmt::print(stderr, "strata_overlap_bench: error: {}\n", st.ToString());
    return 1;
  };

  // With --trace: every L's compute-only steps (for comparison) and the last L's prefetch run.
  std::unique_ptr<TraceRecorder> trace;
  if (!a.trace_file.empty()) trace = std::make_unique<TraceRecorder>(0, "overlap bench");
  Result<std::unique_ptr<ComputeOnly>> compute = ComputeOnly::Create(a, trace.get());
  if (!compute.ok()) return fail(compute.status());
  const int n = (*compute)->n();

  std::vector<Row> rows;
  std::string store_name;
  bool direct = false;
  for (size_t li = 0; li < a.units.size(); ++li) {
    const int units = a.units[li];
    const bool last = li + 1 == a.units.size();
    // A step at small L lasts a few ms; run enough steps that each run makes min_accesses.
    Args al = a;
    al.steps = std::max(a.steps, 1 + (a.min_accesses + 2 * units - 1) / (2 * units));
    Row row;
    row.units = units;
    row.host_budget_units = HostBudgetUnits(a, units);
    fmt::print(stderr,
               "L={}: {} units of {}, host budget {} units, device budget {} units, {} steps\n",
               units, units, FormatBytesExact(a.unit_bytes), row.host_budget_units,
               a.device_lookahead + 3 + a.run_ahead, al.steps);

    fmt::print(stderr, " L={}: io-only (the same loop without the GEMM)\n", units);
    Result<RunResult> io = RunStreaming(al, units, Mode::kIoOnly, nullptr, nullptr);
    if (!io.ok()) return fail(io.status().WithContext(fmt::format("L={} io-only", units)));
    row.io_only = *io;
    store_name = io->store_name;
    direct = io->direct;

    row.compute_target_ms = a.compute_ms.value_or(io->mean_step_s / (2.0 * units) * 1e3);
    fmt::print(stderr, " L={}: calibrating the GEMM for {:.3f} ms per unit{}\n", units,
               row.compute_target_ms, a.compute_ms ? "" : " (auto: io-only time per access)");
    Result<GemmShape> shape = (*compute)->Calibrate(row.compute_target_ms * 1e-3, a.gemm_rows);
    if (!shape.ok()) return fail(shape.status().WithContext("calibrating the GEMM"));
    row.gemm_m = shape->m;
    row.gemm_n = shape->n;
    row.gemm_reps = shape->reps;
    const GemmShape gemm = *shape;
    if (Status st = (*compute)->UseShape(gemm); !st.ok()) {
      return fail(st.WithContext("setting up the compute-only GEMM"));
    }

    // Rounds of compute-only, prefetch and (after the first) io-only runs; each mode's median
    // run is the one reported.
    std::vector<RunResult> ios{*io}, pfs;
    std::vector<std::vector<double>> computes;
    std::vector<double> compute_means, compute_foreign, compute_gemm;
    for (int round = 0; round < a.rounds; ++round) {
      if (round > 0) {
        fmt::print(stderr, " L={}: io-only, round {}\n", units, round + 1);
        Result<RunResult> again = RunStreaming(al, units, Mode::kIoOnly, nullptr, nullptr);
        if (!again.ok())
          return fail(again.status().WithContext(fmt::format("L={} io-only", units)));
        ios.push_back(*again);
      }
      fmt::print(stderr, " L={}: compute-only (the GEMMs alone, weights in device memory){}\n",
                 units, a.rounds > 1 ? fmt::format(", round {}", round + 1) : "");
      double foreign = 0, gemm_total = 0;
      Result<std::vector<double>> c = (*compute)->Steps(units, al.steps, &foreign, &gemm_total);
      if (!c.ok()) return fail(c.status().WithContext(fmt::format("L={} compute-only", units)));
      computes.push_back(*c);
      compute_means.push_back(Mean(*c));
      compute_foreign.push_back(foreign);
      compute_gemm.push_back(gemm_total / static_cast<double>(c->size()));

      fmt::print(stderr, " L={}: streaming with prefetch{}\n", units,
                 a.rounds > 1 ? fmt::format(", round {}", round + 1) : "");
      Result<RunResult> pf = RunStreaming(al, units, Mode::kPrefetch, &gemm,
                                          last && round + 1 == a.rounds ? trace.get() : nullptr);
      if (!pf.ok()) return fail(pf.status().WithContext(fmt::format("L={} prefetch", units)));
      pfs.push_back(*pf);
      row.round_efficiencies.push_back(pf->mean_step_s /
                                       std::max(ios.back().mean_step_s, compute_means.back()));
    }
    auto median_index = [](std::vector<double> v) {
      std::vector<size_t> idx(v.size());
      for (size_t i = 0; i < idx.size(); ++i)
        idx[i] = i;
      std::sort(idx.begin(), idx.end(), [&](size_t x, size_t y) { return v[x] < v[y]; });
      return idx[idx.size() / 2];
    };
    {
      std::vector<double> v;
      for (const auto& r : ios)
        v.push_back(r.mean_step_s);
      row.io_only = ios[median_index(v)];
      v.clear();
      for (const auto& r : pfs)
        v.push_back(r.mean_step_s);
      row.prefetch = pfs[median_index(v)];
      const size_t ci = median_index(compute_means);
      row.compute_only_steps = computes[ci];
      row.compute_only_s = compute_means[ci];
      row.compute_only_gemm_s = compute_gemm[ci];
      row.compute_only_foreign_cpus =
          *std::max_element(compute_foreign.begin(), compute_foreign.end());
    }

    const int cycles = a.paired_cycles < 0 ? al.steps - 1 : a.paired_cycles;
    if (cycles > 0) {
      fmt::print(stderr,
                 " L={}: paired run (io-only, compute-only and prefetch steps in turn, on one "
                 "rig)\n",
                 units);
      Args ap = al;
      ap.steps = 1 + cycles;
      Result<RunResult> pr =
          RunStreaming(ap, units, Mode::kPrefetch, &gemm, nullptr, compute->get());
      if (!pr.ok()) return fail(pr.status().WithContext(fmt::format("L={} paired", units)));
      row.paired = *pr;
      std::vector<double> e = pr->cycle_efficiency;
      std::sort(e.begin(), e.end());
      row.paired_efficiency = e[e.size() / 2];
    }

    fmt::print(stderr, " L={}: streaming with prefetch off\n", units);
    Result<RunResult> np = RunStreaming(al, units, Mode::kNoPrefetch, &gemm, nullptr);
    if (!np.ok()) return fail(np.status().WithContext(fmt::format("L={} no-prefetch", units)));
    row.no_prefetch = *np;

    const double bound = std::max(row.io_only.mean_step_s, row.compute_only_s);
    row.efficiency = row.prefetch.mean_step_s / bound;
    row.no_prefetch_efficiency = row.no_prefetch.mean_step_s / bound;
    row.balance = row.compute_only_s / row.io_only.mean_step_s;
    fmt::print(stderr,
               " L={}: io-only {:.3f} s, compute-only {:.3f} s, step {:.3f} s (efficiency "
               "{:.3f}), no prefetch {:.3f} s ({:.3f})\n",
               units, row.io_only.mean_step_s, row.compute_only_s, row.prefetch.mean_step_s,
               row.efficiency, row.no_prefetch.mean_step_s, row.no_prefetch_efficiency);
    {
      // How busy the disk was: in the prefetch steps, what is left of a step beyond the disk's
      // time is lost to the schedule (at the forward/backward turn and the step boundary, at
      // least one access's compute each when balanced: docs/benchmarks.md, "The floor"); a
      // prefetch step's disk time above io-only's is the disk reading slower.
      const double busy = Mean(row.prefetch.busy_s);
      const double per_access_ms = row.compute_only_s / (2.0 * units) * 1e3;
      fmt::print(stderr,
                 " L={}: disk busy {:.0f}% of the prefetch steps ({:.3f} s per step, {:.1f} ms "
                 "idle; one access's compute {:.2f} ms), {:.0f}% of the io-only steps ({:.3f} s "
                 "for the same reads); step / max(its own disk time, compute-only) {:.3f}\n",
                 units, 100 * row.prefetch.busy_fraction, busy,
                 (row.prefetch.mean_step_s - busy) * 1e3, per_access_ms,
                 100 * row.io_only.busy_fraction, Mean(row.io_only.busy_s),
                 row.prefetch.mean_step_s / std::max(busy, row.compute_only_s));
    }
    {
      // Where a prefetch step's time went: the GEMMs (slower than compute-only's when the I/O
      // competes for the cores and the memory bus), and the time the compute stream had no GEMM
      // to run (waits for data, scheduler calls, stream hand-offs), against compute-only's. The
      // consumer's waits for data fall inside that idle time with --run-ahead 0; with run-ahead
      // they may overlap a GEMM still running.
      const double g = Mean(row.prefetch.gemm_s);
      const double step = row.prefetch.mean_step_s;
      fmt::print(stderr,
                 " L={}: a prefetch step: GEMMs {:.3f} s ({:+.1f}% against compute-only's "
                 "{:.3f} s); no GEMM running {:.3f} s (compute-only {:.3f} s); the consumer "
                 "waited for data {:.3f} s\n",
                 units, g, 100.0 * (g / row.compute_only_gemm_s - 1.0), row.compute_only_gemm_s,
                 step - g, row.compute_only_s - row.compute_only_gemm_s,
                 row.prefetch.stall_s_per_step);
    }
    if (row.round_efficiencies.size() > 1) {
      fmt::print(stderr, " L={}: efficiency of each round: {:.3f}\n", units,
                 fmt::join(row.round_efficiencies, ", "));
    }
    if (cycles > 0) {
      fmt::print(stderr, " L={}: paired efficiency {:.3f} (median of {} cycles: {:.3f})\n", units,
                 row.paired_efficiency, row.paired.cycle_efficiency.size(),
                 fmt::join(row.paired.cycle_efficiency, ", "));
    }
    rows.push_back(std::move(row));
  }

  if (trace) {
    if (Status st = trace->WriteChromeJson(a.trace_file); !st.ok()) return fail(st);
    fmt::print(stderr, "trace of L={} with prefetch written to {}\n", rows.back().units,
               a.trace_file);
  }

  const double load_end = LoadAverage();
  bool met_efficiency = true, met_paired = true, met_peak = true;
  std::vector<int> paired_met_at, paired_missed_at;
  for (const Row& r : rows) {
    met_efficiency &= r.efficiency <= kEfficiencyTarget;
    const bool p = r.paired_efficiency > 0 && r.paired_efficiency <= kEfficiencyTarget;
    met_paired &= p;
    (p ? paired_met_at : paired_missed_at).push_back(r.units);
    met_peak &= r.prefetch.device_peak <= r.prefetch.device_budget &&
                r.prefetch.device_peak == rows.front().prefetch.device_peak;
  }
  const bool met = met_efficiency && met_peak;

  PrintTable(a.json_output ? stderr : stdout, a, rows);
  fmt::print(a.json_output ? stderr : stdout,
             "target: efficiency <= {:.2f} with prefetch: {} (separate runs); paired: met at L = "
             "{}, not at L = {}; device peak the same at every L (within the budget, which the "
             "tier manager enforces): {}\n"
             "floor for a forward-then-backward sweep with a host budget below L and exactly "
             "balanced, disk-bound I/O: (L + 2) / L (docs/benchmarks.md)\n"
             "store {}, O_DIRECT {}, device alloc {}, host memory {}; load average {:.2f} before, "
             "{:.2f} after ({} CPUs)\n",
             kEfficiencyTarget, met_efficiency ? "met" : "NOT met",
             paired_met_at.empty() ? "-" : fmt::format("{}", fmt::join(paired_met_at, ", ")),
             paired_missed_at.empty() ? "-" : fmt::format("{}", fmt::join(paired_missed_at, ", ")),
             met_peak ? "yes" : "NO", store_name, direct ? "on" : "off",
             a.device == device::DeviceType::kCpu ? a.device_alloc : "- (cuda)", a.host_memory,
             load_start, load_end, cpus);

  if (a.json_output) {
    json results = json::array();
    for (const Row& r : rows) {
      results.push_back(json{
          {"units", r.units},
          {"accesses_per_step", 2 * r.units},
          {"host_budget_units", r.host_budget_units},
          {"gemm_m", r.gemm_m},
          {"gemm_k", kGemmK},
          {"gemm_n", r.gemm_n},
          {"gemm_reps", r.gemm_reps},
          {"unit_cols", n},
          {"compute_ms_target", r.compute_target_ms},
          {"io_only_s", r.io_only.mean_step_s},
          {"compute_only_s", r.compute_only_s},
          {"compute_only_gemm_s", r.compute_only_gemm_s},
          {"compute_only_steps_s", r.compute_only_steps},
          {"compute_only_foreign_cpus", r.compute_only_foreign_cpus},
          {"max_foreign_cpus", r.MaxForeignCpus()},
          {"balance", r.balance},
          {"step_s", r.prefetch.mean_step_s},
          {"efficiency", r.efficiency},
          {"round_efficiencies", r.round_efficiencies},
          {"paired_efficiency", r.paired_efficiency},
          {"paired_cycle_efficiencies", r.paired.cycle_efficiency},
          {"paired_io_only_steps_s", r.paired.io_step_s},
          {"paired_compute_only_steps_s", r.paired.compute_step_s},
          {"paired_prefetch_steps_s", r.paired.step_s},
          {"paired_hit_rate", r.paired.hit_rate},
          {"sweep_floor", static_cast<double>(r.units + 2) / r.units},
          {"no_prefetch_step_s", r.no_prefetch.mean_step_s},
          {"no_prefetch_efficiency", r.no_prefetch_efficiency},
          {"device_peak_bytes", r.prefetch.device_peak},
          {"device_budget_bytes", r.prefetch.device_budget},
          {"device_lookahead_bytes", static_cast<uint64_t>(a.device_lookahead) * a.unit_bytes},
          {"host_peak_bytes", r.prefetch.host_peak},
          {"host_budget_bytes", r.prefetch.host_budget},
          {"nvme_read_bytes_per_step", r.prefetch.nvme_read_bytes_per_step},
          {"hit_rate", r.prefetch.hit_rate},
          {"stall_s_per_step", r.prefetch.stall_s_per_step},
          {"io_only", RunJson(r.io_only)},
          {"prefetch", RunJson(r.prefetch)},
          {"no_prefetch", RunJson(r.no_prefetch)},
      });
    }
    json doc{{"benchmark", "overlap"},
             {"device", a.device_name},
             {"unit_bytes", a.unit_bytes},
             {"steps", a.steps},
             {"measured_steps", a.steps - 1},
             {"paths", a.paths},
             {"backend", store_name},
             {"disk_rate_bytes_per_s", a.disk_rate ? json(*a.disk_rate) : json(nullptr)},
             {"direct", direct},
             {"device_alloc",
              a.device == device::DeviceType::kCpu ? json(a.device_alloc) : json(nullptr)},
             {"host_memory", a.host_memory},
             {"io_threads", a.io_threads},
             {"queue_depth", a.queue_depth},
             {"run_ahead_accesses", a.run_ahead},
             {"device_lookahead_units", a.device_lookahead},
             {"host_lookahead_units", a.host_lookahead},
             {"compute_ms", a.compute_ms ? json(*a.compute_ms) : json("auto")},
             {"gemm_rows_min", a.gemm_rows},
             {"cpus", cpus},
             {"load_average_start", load_start},
             {"load_average_end", load_end},
             {"results", results},
             {"target", {{"efficiency_max", kEfficiencyTarget}, {"device_peak_constant", true}}},
             {"met_efficiency", met_efficiency},
             {"met_paired_efficiency", met_paired},
             {"met_device_peak", met_peak},
             {"met", met}};
    fmt::print("{}\n", doc.dump(2));
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::Args args;
  CLI::App app{
      "Layer-streaming overlap benchmark: L units homed on NVMe, a GEMM per unit, forward then "
      "backward; reports step time against compute-only and I/O-only time, with and without "
      "the prefetch scheduler"};
  app.add_option("--path", args.paths,
                 "Directory for the offload files (repeatable: striped over every --path); the "
                 "files are removed at the end. Required unless --disk-rate is given (the two "
                 "exclude each other)");
  app.add_option("--units", args.units_text, "Comma-separated unit counts L to measure")
      ->capture_default_str();
  app.add_option("--unit-size", args.unit_size_text,
                 "Bytes per unit (a multiple of 4 KiB), e.g. 8MiB")
      ->capture_default_str();
  app.add_option("--steps", args.steps, "Steps per run; step 1 records the trace, 2+ are reported")
      ->capture_default_str();
  app.add_option("--compute-ms", args.compute_ms_text,
                 "Compute per unit access in ms, or auto (= the io-only time per access)")
      ->capture_default_str();
  app.add_option("--device-lookahead", args.device_lookahead, "Device prefetch lookahead, in units")
      ->capture_default_str();
  app.add_option("--host-lookahead", args.host_lookahead, "Host prefetch lookahead, in units")
      ->capture_default_str();
  app.add_option("--rounds", args.rounds,
                 "Repeat the io-only, compute-only and prefetch runs this many times, interleaved, "
                 "and take each one's median (the VM's speed drifts between runs)")
      ->check(CLI::Range(1, 99))
      ->capture_default_str();
  app.add_option("--paired-cycles", args.paired_cycles,
                 "Cycles of the paired run, which measures an io-only, a compute-only and a "
                 "prefetch step in turn on one rig (-1: as many as the other runs' measured "
                 "steps; 0: no paired run)")
      ->check(CLI::Range(-1, 100000))
      ->capture_default_str();
  app.add_option("--min-accesses", args.min_accesses,
                 "Run at least this many unit accesses per run (more steps at small L)")
      ->capture_default_str();
  app.add_option("--reuse-distance", args.reuse_distance,
                 "Keep a unit on the device when it is used again within this many other units "
                 "(stage3_max_reuse_distance, in units)")
      ->capture_default_str();
  app.add_option("--host-budget", args.host_budget,
                 "Host (pinned pool) budget in units [default: host lookahead + 4]; capped at "
                 "L - 2 so that the model never fits in host memory");
  app.add_option("--io-threads", args.io_threads, "I/O threads of the block store")
      ->capture_default_str();
  app.add_option(
         "--run-ahead", args.run_ahead,
         "Accesses whose compute may be queued behind the one running: 0 waits for each GEMM "
         "before the next Acquire; 1 enqueues unit k+1's GEMM while unit k's runs, as a GPU "
         "training loop launches ahead of its kernels (one more unit held; with shared host memory "
         "it also pins one more host unit). The compute-only runs and the calibration do the same")
      ->capture_default_str();
  app.add_option(
         "--gemm-rows", args.gemm_rows,
         "The GEMM's least row count M (activation rows per unit access). The calibration starts "
         "at M over the unit's full width and raises M until the GEMM takes the target time; when "
         "M rows already take longer, it narrows the columns N instead. With few rows the GEMM is "
         "memory-bound and competes with the disk's DMA for the memory bus (on a GPU the two use "
         "different memories); 64 rows keep it compute-bound. 1 reproduces the earlier "
         "calibration, which reads the whole unit. At most 4096 on cpu; on cuda at most 65536 "
         "(fewer for units above 28 MiB: x and y take at most 2 GiB), and when even the most rows "
         "run faster than the target the GEMM is repeated (the table's r)")
      ->capture_default_str();
  app.add_option("--qd", args.queue_depth,
                 "Requests in flight per I/O thread (large units: 2 keep the disk busy; more only "
                 "delay the unit needed next)")
      ->capture_default_str();
  app.add_option("--backend", args.backend, "I/O backend: auto, uring or posix")
      ->check(CLI::IsMember({"auto", "uring", "posix"}))
      ->capture_default_str();
  app.add_option("--device", args.device_name,
                 "cpu: the CPU device, OpenBLAS GEMMs in host tasks; cuda: GPU 0, units in device "
                 "memory, cuBLAS GEMMs (needs a build with CUDA and a GPU)")
      ->capture_default_str();
  app.add_option("--device-alloc", args.device_alloc,
                 "CPU device only. cached: keep freed heap memory mapped (glibc mallopt), so that "
                 "the CPU device's per-copy allocations reuse faulted-in pages as a GPU caching "
                 "allocator would; system: glibc's defaults (every device copy faults its pages "
                 "in during its H2D copy)")
      ->check(CLI::IsMember({"cached", "system"}))
      ->capture_default_str();
  app.add_option("--host-memory", args.host_memory,
                 "shared: a unit the device only reads is used in place in its pinned host copy "
                 "(the CPU device's memory is host memory; TierManagerOptions::share_host_memory), "
                 "so the streamed bytes are the NVMe reads alone; copied: every device copy is a "
                 "host-to-device memcpy on the copy stream, as a GPU's would be a DMA; auto: "
                 "shared on cpu, copied on cuda (where shared is refused)")
      ->check(CLI::IsMember({"auto", "shared", "copied"}))
      ->capture_default_str();
  app.add_option("--trace", args.trace_file,
                 "Write a Chrome / Perfetto trace of the last L's prefetch run and of every L's "
                 "compute-only steps to this file");
  app.add_option("--disk-rate", args.disk_rate_text,
                 "Instead of files under --path, stream from an in-memory store paced to this many "
                 "bytes per second, one request at a time (e.g. 3GiB/s): a disk of steady "
                 "bandwidth, to measure the schedule apart from a real disk's swings");
  app.add_flag("--json", args.json_output,
               "Print one JSON document on stdout (the table goes to stderr)");
  CLI11_PARSE(app, argc, argv);
  return strata::bench::Run(args);
}
