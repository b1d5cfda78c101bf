#include "train/plan_measure.h"

#include <cblas.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "common/host_memory.h"
#include "common/units.h"
#include "device/gpu_info.h"
#include "io/nvme_bench.h"
#include "optim/adam.h"

namespace strata::train {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CPU AdamW elements per second on `threads` threads (the median of 5 steps after a warm-up).
Result<double> AdamRate(int threads) {
  // Huge-page backed, as the engine's pinned pool (4 KiB pages cost the kernel up to half its
  // rate in TLB misses).
  const size_t n = size_t{1} << 24;
  STRATA_ASSIGN_OR_RETURN(HostRegion region, HostRegion::Allocate(n * (4 * 4 + 2)));
  float* master = reinterpret_cast<float*>(region.data());
  float* grad = master + n;
  float* m = grad + n;
  float* v = m + n;
  std::fill(master, master + n, 0.5f);
  std::fill(grad, grad + n, 1e-3f);
  optim::AdamShard shard{master, grad, m, v, n, v + n, device::DType::kBF16};
  optim::CpuAdamOptions opt{optim::BestIsa(), threads};
  std::vector<double> s;
  for (int i = 0; i < 6; ++i) {
    optim::AdamHyper h;
    h.step = i + 1;
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(optim::CpuAdamStep(h, shard, opt));
    if (i > 0) s.push_back(Seconds(t0));
  }
  return static_cast<double>(n) / Median(s);
}

// fp32 sgemm products at a square size typical of a layer's, on OpenBLAS's threads.
class SquareSgemm {
 public:
  static constexpr int kDim = 1024;
  static constexpr double kFlops = 2.0 * kDim * kDim * kDim;  // per product

  // Seconds for n products.
  double Run(int n) {
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kDim, kDim, kDim, 1.0f, a_.data(), kDim,
                  b_.data(), kDim, 0.0f, c_.data(), kDim);
    }
    return Seconds(t0);
  }

 private:
  std::vector<float> a_ = std::vector<float>(static_cast<size_t>(kDim) * kDim, 0.01f), b_ = a_,
                     c_ = std::vector<float>(a_.size());
};

// fp32 sgemm FLOPS (the median of 3 products after a warm-up).
double SgemmFlops() {
  SquareSgemm gemm;
  gemm.Run(1);
  std::vector<double> s;
  for (int i = 0; i < 3; ++i) s.push_back(gemm.Run(1));
  return SquareSgemm::kFlops / Median(s);
}

// The share of the CPU device's compute that its NVMe transfers take while they run
// (Hardware::io_cpu_share): sgemm's time for a fixed amount of work alone, against the same work
// while the nvme-bench engine writes, then reads, the laid-out file `c` (through the
// checksumming store, as `strata train` uses it by default). 1 - alone / with is the share lost.
// The transfers are stopped once the products are done.
Result<double> IoCpuShare(io::BenchConfig c) {
  SquareSgemm gemm;
  gemm.Run(2);  // warm-up
  // About 0.3 s of products per measurement.
  const int n = std::clamp(static_cast<int>(0.3 / std::max(1e-6, gemm.Run(2) / 2)), 3, 2000);
  std::vector<double> shares;
  for (const bool write : {true, false}) {
    const double alone = gemm.Run(n);
    io::BenchConfig phase = c;
    phase.write = write;
    phase.read = !write;
    phase.runtime = 60;  // stopped below
    phase.keep = true;
    phase.checksums = true;
    std::atomic<bool> stop{false};
    Status io_status;
    std::atomic<bool> started{false};
    std::thread io([&] {
      started = true;
      Result<io::BenchResult> r = io::RunBench(phase, nullptr, &stop);
      if (!r.ok() && r.status().code() != StatusCode::kCancelled) io_status = r.status();
    });
    while (!started) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the transfers under way
    const double with = gemm.Run(n);
    stop = true;
    io.join();
    STRATA_RETURN_IF_ERROR(io_status);
    shares.push_back(std::clamp(1.0 - alone / with, 0.0, 1.0));
  }
  return (shares[0] + shares[1]) / 2;
}

}  // namespace

double GpuPeakTflops(const std::string& name) {
  // Dense bf16 tensor-core peaks from the vendors' data sheets (without sparsity).
  struct Peak {
    const char* match;
    double tflops;
  };
  static const Peak peaks[] = {{"H200", 989}, {"H100 PCIe", 756}, {"H100 NVL", 835},
                               {"H100", 989}, {"GH200", 989},     {"A100", 312},
                               {"L40S", 362}, {"L40", 181},       {"A10G", 70},
                               {"L4", 121}};
  for (const Peak& p : peaks) {
    if (name.find(p.match) != std::string::npos) return p.tflops;
  }
  return 0;
}

Result<std::vector<std::string>> MeasureHardware(const MeasureOptions& o, Hardware* hw) {
  std::vector<std::string> lines;
  const int cores = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  const int ranks = std::max(1, o.ranks_per_node);
  if (o.device == device::DeviceType::kCpu) {
    // The CPU device: each rank's optimizer has one thread; the ranks share the cores' sgemm.
    STRATA_ASSIGN_OR_RETURN(const double adam, AdamRate(1));
    hw->cpu_adam = adam * std::min(ranks, cores);
    const double flops = SgemmFlops();
    hw->gpu_tflops = flops / 1e12 / ranks;
    hw->gpu_efficiency = 1.0;
    lines.push_back(fmt::format(
        "CPU AdamW {:.2f} G elements/s on 1 thread ({:.2f} G/s for the node's {} rank(s)); "
        "OpenBLAS sgemm {:.1f} GFLOPS on {} core(s) ({:.1f} per rank; the model's other ops make "
        "its effective rate lower)",
        adam / 1e9, hw->cpu_adam / 1e9, ranks, flops / 1e9, cores, flops / 1e9 / ranks));
  } else {
    // A GPU run gives the CPU optimizer the node's cores, less two per rank's I/O and own thread.
    const int threads = std::max(1, cores - 2 * ranks);
    STRATA_ASSIGN_OR_RETURN(const double adam, AdamRate(threads));
    hw->cpu_adam = adam;
    lines.push_back(fmt::format("CPU AdamW {:.2f} G elements/s on {} thread(s)", adam / 1e9, threads));
    const device::GpuReport gpus = device::QueryGpus();
    if (gpus.gpus.empty()) {
      lines.push_back(fmt::format("GPU: none usable here ({}); the GPU rates stay as given",
                                  gpus.none_reason));
    } else {
      const device::GpuInfo& g = gpus.gpus.front();
      hw->gpu_mem = g.memory_bytes;
      const double peak = GpuPeakTflops(g.name);
      if (peak > 0) hw->gpu_tflops = peak;
      lines.push_back(fmt::format("GPU: {} x {} ({}), {}", gpus.gpus.size(), g.name,
                                  FormatBytes(g.memory_bytes),
                                  peak > 0 ? fmt::format("{:.0f} dense 16-bit TFLOPS peak", peak)
                                           : std::string("peak unknown: --gpu-tflops as given")));
    }
  }
  if (!o.nvme_path.empty()) {
    io::BenchConfig c;
    c.paths = {o.nvme_path};
    c.file_name = fmt::format("strata-estimate-measure-{}.dat", ::getpid());
    c.size = o.nvme_bytes;
    c.keep = o.device == device::DeviceType::kCpu;  // the CPU device measures on it again below
    Result<io::BenchResult> measured = io::RunBench(c);
    auto remove = [&] {
      if (!c.keep) return;
      Result<io::BenchFile> f = io::ResolveBenchFile(o.nvme_path, c.file_name);
      if (f.ok() && f->bench_owned) ::unlink(f->path.c_str());
    };
    if (!measured.ok()) {
      remove();
      return measured.status();
    }
    const io::BenchResult& r = *measured;
    for (const auto& p : r.phases) {
      // A phase too short to time keeps the rate as given (a zero rate would make NVMe free).
      if (p.bytes_per_second() > 0) {
        (p.op == io::IoOp::kWrite ? hw->nvme_write : hw->nvme_read) = p.bytes_per_second();
      }
    }
    lines.push_back(fmt::format("NVMe at {}: read {:.2f} GB/s, write {:.2f} GB/s ({}, 1 MiB "
                                "requests, queue depth 32, {}{})",
                                o.nvme_path, hw->nvme_read / 1e9, hw->nvme_write / 1e9,
                                FormatBytes(c.size), r.backend, r.direct ? ", O_DIRECT" : ""));
    if (o.device == device::DeviceType::kCpu) {
      Result<double> share = IoCpuShare(c);
      remove();
      STRATA_RETURN_IF_ERROR(share.status());
      hw->io_cpu_share = *share;
      lines.push_back(fmt::format(
          "NVMe transfers take {:.0f}% of the CPU device's compute while they run (sgemm alone "
          "and beside nvme-bench's writes and reads, checksummed)",
          100.0 * *share));
    }
  } else {
    lines.push_back("NVMe: not measured (no --nvme-path); --nvme-read/--nvme-write as given");
  }
  return lines;
}

}  // namespace strata::train
