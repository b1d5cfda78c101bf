// `strata env`: the facts about this machine that decide how Strata should be configured on it,
// as readable sections or (--json) as one JSON object with the same content.
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/errno.h"
#include "common/host_memory.h"
#include "common/proc_files.h"
#include "common/units.h"
#include "device/gpu_info.h"
#include "io/numa.h"
#include "io/path_info.h"
#include "io/uring_probe.h"
#include "strata/version.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace strata::cli {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Facts

struct IsaFlag {
  const char* name;
  bool present;
};

#if defined(__x86_64__) || defined(__i386__)
// Which register state the OS saves (XCR0): a CPU feature is usable only if the OS enables it.
uint64_t ReadXcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

std::vector<IsaFlag> DetectIsa() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  bool sse42 = false, avx = false, fma = false, avx2 = false, avx512f = false, avx512bw = false,
       avx512vl = false, avx512bf16 = false, amx_tile = false, amx_bf16 = false, amx_int8 = false;
  if (__get_cpuid(1, &a, &b, &c, &d) != 0) {
    sse42 = (c & (1U << 20)) != 0;
    const bool osxsave = (c & (1U << 27)) != 0;
    const uint64_t xcr0 = osxsave ? ReadXcr0() : 0;
    const bool avx_state = (xcr0 & 0x6) == 0x6;                    // SSE + AVX registers
    const bool avx512_state = avx_state && (xcr0 & 0xE0) == 0xE0;  // opmask + ZMM
    const bool amx_state = (xcr0 & 0x60000) == 0x60000;            // TILECFG + TILEDATA
    avx = avx_state && (c & (1U << 28)) != 0;
    fma = avx_state && (c & (1U << 12)) != 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) != 0) {
      const unsigned max_subleaf = a;
      avx2 = avx_state && (b & (1U << 5)) != 0;
      avx512f = avx512_state && (b & (1U << 16)) != 0;
      avx512bw = avx512_state && (b & (1U << 30)) != 0;
      avx512vl = avx512_state && (b & (1U << 31)) != 0;
      amx_bf16 = amx_state && (d & (1U << 22)) != 0;
      amx_tile = amx_state && (d & (1U << 24)) != 0;
      amx_int8 = amx_state && (d & (1U << 25)) != 0;
      if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0) {
        avx512bf16 = avx512_state && (a & (1U << 5)) != 0;
      }
    }
  }
  return {{"sse4.2", sse42},      {"avx", avx},
          {"avx2", avx2},         {"fma", fma},
          {"avx512f", avx512f},   {"avx512bw", avx512bw},
          {"avx512vl", avx512vl}, {"avx512bf16", avx512bf16},
          {"amx-tile", amx_tile}, {"amx-bf16", amx_bf16},
          {"amx-int8", amx_int8}};
}
#else
std::vector<IsaFlag> DetectIsa() {
  return {};
}
#endif

std::string CpuModel() {
  auto text = procfs::ReadSmallFile("/proc/cpuinfo", size_t{4} << 20);
  if (!text) return "unknown";
  for (const char* key : {"model name", "Model", "Processor", "cpu model"}) {
    std::string_view all = *text;
    for (std::string_view line : procfs::Lines(all)) {
      size_t colon = line.find(':');
      if (colon == std::string_view::npos) continue;
      if (procfs::Trim(line.substr(0, colon)) == key) {
        std::string_view value = procfs::Trim(line.substr(colon + 1));
        if (!value.empty()) return std::string(value);
      }
    }
  }
  return "unknown";
}

struct MemoryFacts {
  uint64_t total = 0, available = 0;
};

MemoryFacts QueryMemory() {
  MemoryFacts m;
  if (auto text = procfs::ReadSmallFile("/proc/meminfo")) {
    m.total = procfs::MeminfoField(*text, "MemTotal").value_or(0) * 1024;
    m.available = procfs::MeminfoField(*text, "MemAvailable").value_or(0) * 1024;
  }
  return m;
}

struct MemlockFacts {
  Status status;
  std::optional<uint64_t> soft, hard;  // nullopt: unlimited
  bool cap_ipc_lock = false;           // the limit does not apply
};

MemlockFacts QueryMemlock() {
  MemlockFacts m;
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
    m.status = ErrnoToStatus(errno, "getrlimit(RLIMIT_MEMLOCK)");
  } else {
    if (rl.rlim_cur != RLIM_INFINITY) m.soft = rl.rlim_cur;
    if (rl.rlim_max != RLIM_INFINITY) m.hard = rl.rlim_max;
  }
  // CapEff is a hex mask; CAP_IPC_LOCK is bit 14.
  if (auto status = procfs::ReadSmallFile("/proc/self/status")) {
    size_t pos = status->find("CapEff:");
    if (pos != std::string::npos) {
      std::string hex(procfs::Trim(std::string_view(*status).substr(pos + 7, 24)));
      hex = hex.substr(0, hex.find('\n'));
      uint64_t caps = std::strtoull(hex.c_str(), nullptr, 16);
      m.cap_ipc_lock = (caps >> 14) & 1;
    }
  }
  return m;
}

struct HugePageFacts {
  HugePageInfo info;
  Status region_status;  // the 4 MiB test allocation
  size_t region_bytes = 0;
  size_t region_huge_bytes = 0;
  HostBacking region_backing = HostBacking::kSmallPages;
};

HugePageFacts QueryHugePageFacts() {
  HugePageFacts h;
  h.info = QueryHugePages();
  Result<HostRegion> region = HostRegion::Allocate(size_t{4} << 20, HugePages::kAuto);
  if (region.ok()) {
    h.region_bytes = region->size();
    h.region_huge_bytes = region->huge_page_bytes();
    h.region_backing = region->backing();
  } else {
    h.region_status = region.status();
  }
  return h;
}

struct PathFacts {
  io::PathInfo info;
  std::optional<io::BlockDevice> device;
};

struct EnvFacts {
  BuildInfo build;
  std::string kernel, hostname;
  std::string cpu_model;
  std::vector<IsaFlag> isa;
  Result<io::NumaTopology> numa = InternalError("not queried");
  MemoryFacts memory;
  MemlockFacts memlock;
  HugePageFacts huge;
  device::GpuReport gpu;
  io::UringSupport uring;
  std::vector<PathFacts> paths;
};

// ---------------------------------------------------------------------------------------------
// JSON

json OptionalBytes(const std::optional<uint64_t>& v) {
  return v ? json(*v) : json(nullptr);
}

json ToJson(const EnvFacts& f) {
  json j;
  j["strata"] = {{"version", f.build.version},           {"build_type", f.build.build_type},
                 {"cxx_compiler", f.build.cxx_compiler}, {"cuda_compiler", f.build.cuda_compiler},
                 {"with_cuda", f.build.with_cuda},       {"with_nccl", f.build.with_nccl},
                 {"with_mpi", f.build.with_mpi},         {"sanitizers", f.build.sanitizers}};
  j["system"] = {{"kernel", f.kernel}, {"hostname", f.hostname}};

  json isa = json::object();
  for (const IsaFlag& flag : f.isa)
    isa[flag.name] = flag.present;
  j["cpu"] = {{"model", f.cpu_model}, {"isa", isa}};
  if (f.numa.ok()) {
    j["cpu"]["packages"] = f.numa->packages;
    j["cpu"]["cores"] = f.numa->cores;
    j["cpu"]["threads"] = f.numa->pus;
    json nodes = json::array();
    for (const io::NumaNode& n : f.numa->nodes) {
      nodes.push_back({{"index", n.index}, {"cpus", n.cpus}, {"memory_bytes", n.memory_bytes}});
    }
    j["numa"] = {{"nodes", nodes}};
  } else {
    j["numa"] = {{"nodes", json::array()}, {"error", f.numa.status().message()}};
  }

  j["memory"] = {{"total_bytes", f.memory.total},
                 {"available_bytes", f.memory.available},
                 {"memlock",
                  {{"soft_bytes", OptionalBytes(f.memlock.soft)},  // null: unlimited
                   {"hard_bytes", OptionalBytes(f.memlock.hard)},
                   {"cap_ipc_lock", f.memlock.cap_ipc_lock}}}};
  if (!f.memlock.status.ok()) j["memory"]["memlock"]["error"] = f.memlock.status.message();

  json region;
  if (f.huge.region_status.ok()) {
    region = {{"bytes", f.huge.region_bytes},
              {"huge_page_bytes", f.huge.region_huge_bytes},
              {"backing", HostBackingName(f.huge.region_backing)}};
  } else {
    region = {{"error", f.huge.region_status.message()}};
  }
  j["huge_pages"] = {{"thp_mode", f.huge.info.thp_mode},
                     {"hugetlb_2m_total", f.huge.info.hugetlb_total},
                     {"hugetlb_2m_free", f.huge.info.hugetlb_free},
                     {"hugetlb_2m_reserved", f.huge.info.hugetlb_reserved},
                     {"test_region", region}};

  json gpus = json::array();
  for (const device::GpuInfo& g : f.gpu.gpus) {
    gpus.push_back(
        {{"index", g.index},
         {"name", g.name},
         {"memory_bytes", g.memory_bytes},
         {"compute_capability", fmt::format("{}.{}", g.compute_major, g.compute_minor)},
         {"multiprocessors", g.multiprocessors},
         {"pci_bus_id", g.pci_bus_id},
         {"pcie",
          {{"current_gts", g.pcie_current_gts},
           {"current_width", g.pcie_current_width},
           {"max_gts", g.pcie_max_gts},
           {"max_width", g.pcie_max_width},
           {"generation", device::PcieGeneration(g.pcie_max_gts)},
           {"max_bytes_per_s", device::PcieBytesPerSecond(g.pcie_max_gts, g.pcie_max_width)}}},
         {"numa_node", g.numa_node}});
  }
  j["gpu"] = {{"built_with_cuda", f.gpu.built_with_cuda},
              {"runtime_version", f.gpu.runtime_version},
              {"driver_version", f.gpu.driver_version},
              {"nccl_version", f.gpu.nccl_version},
              {"devices", gpus}};
  if (f.gpu.gpus.empty()) j["gpu"]["none_reason"] = f.gpu.none_reason;

  j["io_uring"] = {{"available", f.uring.available},
                   {"disabled_sysctl", f.uring.disabled_sysctl},
                   {"setup_flags_ok", f.uring.setup_flags_ok},
                   {"setup_flags_rejected", f.uring.setup_flags_rejected},
                   {"features", f.uring.features},
                   {"register_buffers", f.uring.register_buffers},
                   {"register_files", f.uring.register_files}};
  if (!f.uring.available) j["io_uring"]["error"] = f.uring.error;

  json paths = json::array();
  for (const PathFacts& p : f.paths) {
    json jp = {{"path", p.info.path},
               {"filesystem", p.info.filesystem},
               {"free_bytes", p.info.free_bytes},
               {"total_bytes", p.info.total_bytes},
               {"o_direct", p.info.o_direct ? json(*p.info.o_direct) : json(nullptr)},
               {"numa_node", p.info.numa_node}};
    if (p.device) {
      jp["block_device"] = {{"name", p.device->name},
                            {"disk", p.device->disk},
                            {"backing_disks", p.device->backing_disks}};
    } else {
      jp["block_device"] = nullptr;
    }
    if (p.info.queue) {
      const io::QueueLimits& q = *p.info.queue;
      jp["queue"] = {{"device", q.device},
                     {"max_segments", q.max_segments},
                     {"max_segment_size", q.max_segment_size},
                     {"max_sectors_kb", q.max_sectors_kb},
                     {"max_hw_sectors_kb", q.max_hw_sectors_kb},
                     {"logical_block_size", q.logical_block_size},
                     {"physical_block_size", q.physical_block_size},
                     {"nr_requests", q.nr_requests},
                     {"rotational", q.rotational},
                     {"scheduler", q.scheduler},
                     {"max_request_bytes_4k_pages", q.MaxRequestBytes(4096)},
                     {"max_request_bytes_2m_pages", q.MaxRequestBytes(kHugePageSize)}};
    } else {
      jp["queue"] = nullptr;
    }
    paths.push_back(std::move(jp));
  }
  j["paths"] = paths;
  return j;
}

// ---------------------------------------------------------------------------------------------
// Human-readable sections

struct Section {
  std::string title;
  std::vector<std::pair<std::string, std::string>> rows;
  void Add(std::string key, std::string value) {
    rows.emplace_back(std::move(key), std::move(value));
  }
};

std::string Join(const std::vector<std::string>& items, std::string_view sep = " ") {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += sep;
    out += item;
  }
  return out;
}

std::string YesNo(bool v) {
  return v ? "yes" : "no";
}

std::string LimitText(const std::optional<uint64_t>& v) {
  return v ? FormatBytes(*v) : "unlimited";
}

// "13000" -> "13.0"
std::string CudaVersionText(int v) {
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

// "PCIe gen5 x16 (max gen5 x16): 63.0 GB/s per direction; NUMA node 0", or what is unknown.
std::string PcieText(const device::GpuInfo& g) {
  auto link = [](double gts, int width) {
    const int gen = device::PcieGeneration(gts);
    const std::string rate = gen > 0   ? fmt::format("gen{}", gen)
                             : gts > 0 ? fmt::format("{:g} GT/s", gts)
                                       : "speed unknown";
    return width > 0 ? fmt::format("{} x{}", rate, width) : rate + " width unknown";
  };
  std::string text = fmt::format("PCIe {} (max {})", link(g.pcie_current_gts, g.pcie_current_width),
                                 link(g.pcie_max_gts, g.pcie_max_width));
  const double limit = device::PcieBytesPerSecond(g.pcie_max_gts, g.pcie_max_width);
  if (limit > 0) text += fmt::format(": {:.1f} GB/s per direction", limit / 1e9);
  text += g.numa_node >= 0 ? fmt::format("; NUMA node {}", g.numa_node) : "; NUMA node unknown";
  return text;
}

// Splits a long value into lines of at most `width` display columns, at spaces.
std::vector<std::string> Wrap(const std::string& text, size_t width) {
  std::vector<std::string> lines;
  std::string line;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t space = text.find(' ', pos);
    if (space == std::string::npos) space = text.size();
    std::string word = text.substr(pos, space - pos);
    pos = space + 1;
    if (!line.empty() && DisplayWidth(line) + 1 + DisplayWidth(word) > width) {
      lines.push_back(std::move(line));
      line.clear();
    }
    if (!line.empty()) line += ' ';
    line += word;
  }
  if (!line.empty() || lines.empty()) lines.push_back(std::move(line));
  return lines;
}

std::vector<Section> ToSections(const EnvFacts& f) {
  std::vector<Section> sections;

  Section strata{fmt::format("strata {}", f.build.version), {}};
  std::string build = fmt::format("{}, {}", f.build.build_type, f.build.cxx_compiler);
  build += f.build.with_cuda ? fmt::format(", CUDA ({})", f.build.cuda_compiler) : ", no CUDA";
  build += f.build.with_nccl ? ", NCCL" : ", no NCCL";
  build += f.build.with_mpi ? ", MPI" : ", no MPI";
  build += f.build.sanitizers.empty() ? ", no sanitizers"
                                      : fmt::format(", sanitizers {}", f.build.sanitizers);
  strata.Add("build", build);
  strata.Add("kernel", f.kernel);
  strata.Add("host", f.hostname);
  sections.push_back(std::move(strata));

  Section cpu{"cpu", {}};
  cpu.Add("model", f.cpu_model);
  std::vector<std::string> have, missing;
  for (const IsaFlag& flag : f.isa)
    (flag.present ? have : missing).emplace_back(flag.name);
  cpu.Add("isa", have.empty() ? "none detected" : Join(have));
  if (!missing.empty()) cpu.Add("isa missing", Join(missing));
  if (f.numa.ok()) {
    const io::NumaTopology& t = *f.numa;
    cpu.Add("topology", fmt::format("{} package(s), {} core(s), {} hardware thread(s), {} NUMA "
                                    "node(s)",
                                    t.packages, t.cores, t.pus, t.nodes.size()));
    for (const io::NumaNode& n : t.nodes) {
      cpu.Add(fmt::format("node {}", n.index),
              fmt::format("cpus {}, memory {}", n.cpus.empty() ? "none" : n.cpus,
                          FormatBytes(n.memory_bytes)));
    }
  } else {
    cpu.Add("topology", fmt::format("unknown: {}", f.numa.status().message()));
  }
  sections.push_back(std::move(cpu));

  Section mem{"memory", {}};
  mem.Add("total", fmt::format("{} ({} available)", FormatBytes(f.memory.total),
                               FormatBytes(f.memory.available)));
  if (f.memlock.status.ok()) {
    std::string memlock =
        fmt::format("soft {}, hard {}", LimitText(f.memlock.soft), LimitText(f.memlock.hard));
    if (f.memlock.cap_ipc_lock) {
      memlock += " (not enforced: CAP_IPC_LOCK)";
    } else if (f.memlock.soft && *f.memlock.soft < (uint64_t{1} << 30)) {
      memlock += " (limits pinned and io_uring-registered buffers; raise with ulimit -l)";
    }
    mem.Add("memlock", memlock);
  } else {
    mem.Add("memlock", fmt::format("unknown: {}", f.memlock.status.message()));
  }
  mem.Add("thp", f.huge.info.thp_mode);
  mem.Add("hugetlbfs",
          fmt::format("2 MiB pages: {} in pool, {} free, {} reserved", f.huge.info.hugetlb_total,
                      f.huge.info.hugetlb_free, f.huge.info.hugetlb_reserved));
  if (f.huge.region_status.ok()) {
    mem.Add(
        "test region",
        fmt::format("{}: {} on huge pages ({})", FormatBytesExact(f.huge.region_bytes),
                    FormatBytes(f.huge.region_huge_bytes), HostBackingName(f.huge.region_backing)));
  } else {
    mem.Add("test region", fmt::format("failed: {}", f.huge.region_status.message()));
  }
  sections.push_back(std::move(mem));

  Section gpu{"gpu", {}};
  if (f.gpu.built_with_cuda) {
    gpu.Add("cuda",
            fmt::format("runtime {}, driver {}", CudaVersionText(f.gpu.runtime_version),
                        f.gpu.driver_version > 0 ? CudaVersionText(f.gpu.driver_version) : "none"));
  } else {
    gpu.Add("cuda", "not built in");
  }
  if (!f.gpu.nccl_version.empty()) gpu.Add("nccl", f.gpu.nccl_version + " (headers)");
  if (f.gpu.gpus.empty()) {
    gpu.Add("gpus", fmt::format("none: {}", f.gpu.none_reason));
  } else {
    for (const device::GpuInfo& g : f.gpu.gpus) {
      gpu.Add(fmt::format("gpu {}", g.index),
              fmt::format("{}, {}, sm_{}{}, {} SMs, {}", g.name, FormatBytes(g.memory_bytes),
                          g.compute_major, g.compute_minor, g.multiprocessors, g.pci_bus_id));
      gpu.Add(fmt::format("gpu {} link", g.index), PcieText(g));
    }
  }
  sections.push_back(std::move(gpu));

  Section uring{"io_uring", {}};
  if (f.uring.available) {
    uring.Add("available", "yes");
    uring.Add("setup flags",
              f.uring.setup_flags_ok.empty() ? "none" : Join(f.uring.setup_flags_ok));
    uring.Add("rejected",
              f.uring.setup_flags_rejected.empty() ? "none" : Join(f.uring.setup_flags_rejected));
    uring.Add("features", Join(f.uring.features));
    uring.Add("registered", fmt::format("buffers {}, files {}", YesNo(f.uring.register_buffers),
                                        YesNo(f.uring.register_files)));
  } else {
    uring.Add("available",
              fmt::format("no: {} (Strata will use the pread/pwrite backend)", f.uring.error));
  }
  uring.Add("sysctl", f.uring.disabled_sysctl < 0
                          ? "kernel.io_uring_disabled absent"
                          : fmt::format("kernel.io_uring_disabled = {}", f.uring.disabled_sysctl));
  sections.push_back(std::move(uring));

  for (const PathFacts& p : f.paths) {
    Section s{fmt::format("path {}", p.info.path), {}};
    s.Add("filesystem", p.info.filesystem);
    s.Add("space", fmt::format("{} free of {}", FormatBytes(p.info.free_bytes),
                               FormatBytes(p.info.total_bytes)));
    s.Add("O_DIRECT", p.info.o_direct ? YesNo(*p.info.o_direct) : "unknown (could not probe)");
    if (p.device) {
      std::string dev = p.device->name;
      if (p.device->disk != p.device->name) dev += fmt::format(" on {}", p.device->disk);
      if (p.device->backing_disks.size() != 1 || p.device->backing_disks[0] != p.device->disk) {
        dev += fmt::format(" (disks: {})", p.device->backing_disks.empty()
                                               ? "none listed"
                                               : Join(p.device->backing_disks, ", "));
      }
      s.Add("block device", dev);
    } else {
      s.Add("block device", "none (not on a local block device)");
    }
    if (p.info.queue) {
      const io::QueueLimits& q = *p.info.queue;
      s.Add("queue", fmt::format("{}, scheduler {}, nr_requests {}",
                                 q.rotational ? "rotational" : "non-rotational", q.scheduler,
                                 q.nr_requests));
      s.Add("segments", fmt::format("max_segments {}, max_segment_size {}", q.max_segments,
                                    q.max_segment_size));
      s.Add("sectors", fmt::format("max_sectors_kb {}, max_hw_sectors_kb {}", q.max_sectors_kb,
                                   q.max_hw_sectors_kb));
      s.Add("block size",
            fmt::format("logical {}, physical {}", q.logical_block_size, q.physical_block_size));
      auto req = [](uint64_t bytes) { return bytes ? FormatBytesExact(bytes) : "unknown"; };
      s.Add("max request",
            fmt::format("{} from 4 KiB pages, {} from 2 MiB pages", req(q.MaxRequestBytes(4096)),
                        req(q.MaxRequestBytes(kHugePageSize))));
    }
    s.Add("numa node",
          p.info.numa_node >= 0 ? std::to_string(p.info.numa_node) : "unknown or single-node");
    sections.push_back(std::move(s));
  }
  return sections;
}

void PrintSections(const std::vector<Section>& sections, std::FILE* out) {
  size_t key_width = 0;
  for (const Section& s : sections) {
    for (const auto& [key, value] : s.rows)
      key_width = std::max(key_width, DisplayWidth(key));
  }
  constexpr size_t kIndent = 2;
  constexpr size_t kLineWidth = 100;
  const size_t value_width = std::max<size_t>(40, kLineWidth - kIndent - key_width - 2);
  bool first = true;
  for (const Section& s : sections) {
    if (!first) std::fputc('\n', out);
    first = false;
    fmt::print(out, "{}\n", s.title);
    for (const auto& [key, value] : s.rows) {
      std::vector<std::string> lines = Wrap(value, value_width);
      for (size_t i = 0; i < lines.size(); ++i) {
        const std::string& k = i == 0 ? key : std::string();
        std::string pad(key_width - DisplayWidth(k) + 2, ' ');
        fmt::print(out, "{:{}}{}{}{}\n", "", kIndent, k, pad, lines[i]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------

struct EnvOptions {
  std::vector<std::string> paths;
  bool json = false;
};

int RunEnv(const EnvOptions& options) {
  // Check every path before gathering anything, so a typo fails fast with one line.
  for (const std::string& path : options.paths) {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) {
      return ReportError("env", ErrnoToStatus(errno, fmt::format("--path {}", path)));
    }
  }

  EnvFacts f;
  f.build = GetBuildInfo();
  utsname uts{};
  if (uname(&uts) == 0) {
    f.kernel = fmt::format("{} {} {}", uts.sysname, uts.release, uts.machine);
    f.hostname = uts.nodename;
  }
  f.cpu_model = CpuModel();
  f.isa = DetectIsa();
  f.numa = io::QueryNumaTopology();
  f.memory = QueryMemory();
  f.memlock = QueryMemlock();
  f.huge = QueryHugePageFacts();
  f.gpu = device::QueryGpus();
  f.uring = io::ProbeUring();
  for (const std::string& path : options.paths) {
    Result<io::PathInfo> info = io::DescribePath(path, /*probe_direct=*/true);
    if (!info.ok()) return ReportError("env", info.status());
    f.paths.push_back({std::move(info).value(), io::BlockDeviceForPath(path)});
  }

  if (options.json) {
    std::string text = ToJson(f).dump(2, ' ', false, json::error_handler_t::replace);
    fmt::print(stdout, "{}\n", text);
  } else {
    PrintSections(ToSections(f), stdout);
  }
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace

void RegisterEnvCommand(CLI::App& app, int* exit_code) {
  auto options = std::make_shared<EnvOptions>();
  CLI::App* cmd = app.add_subcommand(
      "env",
      "Show what this machine offers Strata: CPU and NUMA layout, memory and huge pages, "
      "GPUs, io_uring support, and the storage behind each --path");
  cmd->add_option("--path", options->paths,
                  "A directory (or file) to describe: filesystem, free space, O_DIRECT, block "
                  "device queue limits, NUMA node; repeatable")
      ->type_name("DIR")
      ->allow_extra_args(false);
  cmd->add_flag("--json", options->json, "Print one JSON object instead of text sections");
  cmd->callback([options, exit_code] { *exit_code = RunEnv(*options); });
}

}  // namespace strata::cli
