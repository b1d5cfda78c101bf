// `strata nvme-bench`: measures the storage behind one or more paths the way Strata's offload
// uses it, sweeps block size x queue depth x threads, and writes the best settings as a
// DeepSpeed-compatible "aio" section plus Strata's own "strata.io" settings (--tune).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/errno.h"
#include "common/units.h"
#include "io/nvme_bench.h"
#include "io/path_info.h"
#include "strata/trace.h"
#include "strata/version.h"

namespace strata::cli {
namespace {

using io::BenchConfig;
using io::BenchPattern;
using io::BenchPhaseResult;
using io::BenchResult;
using nlohmann::json;

std::atomic<bool> g_interrupted{false};

extern "C" void OnInterrupt(int) {
  g_interrupted.store(true);
}

struct NvmeBenchArgs {
  std::vector<std::string> paths;
  std::string rw = "both";
  std::string pattern = "seq";
  std::vector<uint64_t> blocks = {1 << 20};
  std::vector<int> depths = {32};
  std::vector<int> threads = {1};
  uint64_t size = uint64_t{1} << 30;
  double runtime = 0;
  std::string backend = "auto";
  std::string direct = "auto";
  std::string huge_pages = "auto";
  uint64_t stripe_unit = 1 << 20;
  bool sqpoll = false;
  bool no_register = false;
  bool sweep = false;
  bool tune = false;
  std::string tune_file = "strata-io-tuned.json";
  bool verify = false;
  int checksum_cost = 0;  // --checksum-cost N: rounds with and without checksums
  bool keep = false;
  bool json_output = false;
  uint64_t seed = 1;
  std::string trace_file;  // --trace; empty: no trace
  // Which list options were given on the command line (a sweep fills the others with defaults).
  bool blocks_given = false, depths_given = false, threads_given = false;
};

// The grid a sweep uses for a dimension the user did not list.
const std::vector<uint64_t> kSweepBlocks = {256 << 10, 1 << 20, 4 << 20};
const std::vector<int> kSweepDepths = {4, 16, 64};
const std::vector<int> kSweepThreads = {1, 2};

Status Validate(const NvmeBenchArgs& a) {
  for (const std::string& p : a.paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return ErrnoToStatus(errno, fmt::format("--path {}", p));
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
      return InvalidArgumentError(fmt::format("--path {}: not a directory or a regular file", p));
    }
  }
  for (uint64_t b : a.blocks) {
    if (b == 0 || b % 4096 != 0) {
      return InvalidArgumentError(
          fmt::format("--block {}: must be a positive multiple of 4 KiB (4096 bytes)", b));
    }
  }
  for (int d : a.depths) {
    if (d < 1 || d > 4096) {
      return InvalidArgumentError(fmt::format("--qd {}: must be between 1 and 4096", d));
    }
  }
  for (int t : a.threads) {
    if (t < 1 || t > 256) {
      return InvalidArgumentError(fmt::format("--threads {}: must be between 1 and 256", t));
    }
  }
  if (a.stripe_unit == 0 || a.stripe_unit % 4096 != 0) {
    return InvalidArgumentError(fmt::format(
        "--stripe-unit {}: must be a positive multiple of 4 KiB (4096 bytes)", a.stripe_unit));
  }
  if (a.runtime < 0) return InvalidArgumentError("--runtime: must not be negative");
  if (!a.trace_file.empty()) {
    // Checked now rather than after the whole run: the trace is written at the end.
    const std::filesystem::path trace(a.trace_file);
    const std::string dir = trace.has_parent_path() ? trace.parent_path().string() : ".";
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      return ErrnoToStatus(errno, fmt::format("--trace {}: directory {}", a.trace_file, dir));
    }
    if (!S_ISDIR(st.st_mode)) {
      return InvalidArgumentError(
          fmt::format("--trace {}: {} is not a directory", a.trace_file, dir));
    }
  }
  const bool several = a.blocks.size() > 1 || a.depths.size() > 1 || a.threads.size() > 1;
  if (several && !a.sweep && !a.tune) {
    return InvalidArgumentError(
        "several values for --block, --qd or --threads need --sweep (or --tune)");
  }
  return Status::Ok();
}

struct Config {
  uint64_t block;
  int depth;
  int threads;
};

std::vector<Config> Grid(const NvmeBenchArgs& a) {
  const bool grid = a.sweep || a.tune;
  const auto& blocks = grid && !a.blocks_given ? kSweepBlocks : a.blocks;
  const auto& depths = grid && !a.depths_given ? kSweepDepths : a.depths;
  const auto& threads = grid && !a.threads_given ? kSweepThreads : a.threads;
  std::vector<Config> out;
  for (int t : threads) {
    for (uint64_t b : blocks) {
      for (int d : depths)
        out.push_back({b, d, t});
    }
  }
  return out;
}

double PhaseRate(const BenchResult& r, io::IoOp op) {
  for (const BenchPhaseResult& p : r.phases) {
    if (p.op == op) return p.gb_per_second();
  }
  return 0;
}

// What --tune optimises: the harmonic mean of read and write throughput when both were run (an
// offload step reads and writes), else the one that was run.
double Score(const BenchResult& r) {
  const double rd = PhaseRate(r, io::IoOp::kRead);
  const double wr = PhaseRate(r, io::IoOp::kWrite);
  if (rd > 0 && wr > 0) return 2 / (1 / rd + 1 / wr);
  return std::max(rd, wr);
}

// The best configuration: the highest score, or among those within 3% of it, the one that pins
// the least buffer memory (threads x depth x block), then the fewest threads.
size_t PickBest(const std::vector<BenchResult>& results) {
  double best = 0;
  for (const auto& r : results)
    best = std::max(best, Score(r));
  size_t pick = 0;
  bool found = false;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& c = results[i].config;
    if (Score(results[i]) < 0.97 * best) continue;
    if (!found) {
      pick = i;
      found = true;
      continue;
    }
    const auto& p = results[pick].config;
    const uint64_t mem = c.block * static_cast<uint64_t>(c.queue_depth * c.threads);
    const uint64_t pmem = p.block * static_cast<uint64_t>(p.queue_depth * p.threads);
    if (mem < pmem || (mem == pmem && c.threads < p.threads)) pick = i;
  }
  return pick;
}

json PhaseJson(const BenchPhaseResult& p) {
  return json{{"op", std::string(io::IoOpName(p.op))},
              {"bytes", p.bytes},
              {"requests", p.requests},
              {"seconds", p.seconds},
              {"gb_per_s", p.gb_per_second()},
              {"gib_per_s", p.gib_per_second()},
              {"iops", p.iops()},
              {"latency_us",
               {{"mean", p.latency.mean_us},
                {"p50", p.latency.p50_us},
                {"p99", p.latency.p99_us},
                {"max", p.latency.max_us}}},
              {"device_requests", p.device_requests},
              {"verified_blocks", p.verified_blocks}};
}

json ResultJson(const BenchResult& r) {
  json phases = json::array();
  for (const auto& p : r.phases)
    phases.push_back(PhaseJson(p));
  return json{{"block", r.config.block},
              {"queue_depth", r.config.queue_depth},
              {"threads", r.config.threads},
              {"pattern", std::string(io::BenchPatternName(r.config.pattern))},
              {"backend", r.backend},
              {"direct", r.direct},
              {"buffers", r.buffer_backing},
              {"buffer_huge_page_bytes", r.buffer_huge_bytes},
              {"registered_buffer_bytes", r.registered_buffer_bytes},
              {"fixed_buffer_transfers", r.fixed_buffer_transfers},
              {"transfers", r.transfers},
              {"phases", phases}};
}

// The --tune file: a DeepSpeed "aio" section and Strata's "strata.io" settings, loadable as (part
// of) a DeepSpeed config.
json TuneJson(const NvmeBenchArgs& a, const BenchResult& best) {
  const BenchConfig& c = best.config;
  // Backend, O_DIRECT and huge pages as they were asked for ("auto" stays "auto"), so the file
  // does not pin a choice that only held on the bench machine.
  json io = {{"backend", a.backend},         {"direct", a.direct},    {"threads", c.threads},
             {"queue_depth", c.queue_depth}, {"block_size", c.block}, {"huge_pages", a.huge_pages}};
  // Several directories: the striping that was measured. One path is left to the offload
  // sections' nvme_path.
  bool all_dirs = a.paths.size() > 1;
  for (const auto& p : a.paths) {
    struct stat st {};
    all_dirs = all_dirs && ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }
  if (all_dirs) {
    io["nvme_paths"] = a.paths;
    io["stripe_unit"] = a.stripe_unit;
  }
  return json{{"aio",
               {{"block_size", c.block},
                {"queue_depth", c.queue_depth},
                {"intra_op_parallelism", c.threads},
                {"single_submit", false},
                {"overlap_events", true}}},
              {"strata", {{"io", io}}}};
}

std::string Rate(double gbps) {
  return fmt::format("{:.2f}", gbps);
}
std::string Micros(double us) {
  return fmt::format("{:.0f}", us);
}

void PrintTable(const std::vector<BenchResult>& results, std::FILE* out) {
  Table t({"op", "pattern", "block", "qd", "threads", "GB/s", "GiB/s", "IOPS", "p50 µs", "p99 µs",
           "dev req"},
          {Table::kLeft, Table::kLeft, Table::kRight, Table::kRight, Table::kRight, Table::kRight,
           Table::kRight, Table::kRight, Table::kRight, Table::kRight, Table::kRight});
  for (const auto& r : results) {
    for (const auto& p : r.phases) {
      const double per_req =
          p.requests > 0 ? static_cast<double>(p.device_requests) / static_cast<double>(p.requests)
                         : 0;
      t.AddRow({std::string(io::IoOpName(p.op)),
                std::string(io::BenchPatternName(r.config.pattern)),
                FormatBytesExact(r.config.block), std::to_string(r.config.queue_depth),
                std::to_string(r.config.threads), Rate(p.gb_per_second()), Rate(p.gib_per_second()),
                fmt::format("{:.0f}", p.iops()), Micros(p.latency.p50_us), Micros(p.latency.p99_us),
                fmt::format("{:.2f}", per_req)});
    }
  }
  t.Print(out);
  std::fprintf(out,
               "GB/s is 10^9 bytes per second, GiB/s 2^30; dev req = device requests per request "
               "(after striping and queue-limit splitting).\n");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// --checksum-cost: what offload checksums (io/checksum_store.h) cost at this storage's speed.
// Rounds alternate between the plain store and the checksumming one (write then read, one
// configuration), so drift in the drive or the VM falls on both; the cost is 1 - the median
// checksummed / plain bandwidth per phase. Also reported: the hash's own rate on this CPU and
// the share of a transfer's time it would take if it were not overlapped with the I/O.
Result<json> ChecksumCost(const NvmeBenchArgs& a, const BenchConfig& base,
                          const BenchConfig& measured, std::FILE* human) {
  BenchConfig c = base;
  c.block = measured.block;
  c.queue_depth = measured.queue_depth;
  c.threads = measured.threads;
  c.write = true;
  c.read = true;
  c.trace = nullptr;
  std::vector<double> plain[2], summed[2], ratio[2];
  uint64_t hashed = 0, hash_ns = 0, mismatches = 0, verified = 0;
  for (int round = 0; round < a.checksum_cost; ++round) {
    double bw[2][2] = {};
    for (int with = 0; with < 2; ++with) {
      c.checksums = with == 1;
      STRATA_ASSIGN_OR_RETURN(BenchResult r, io::RunBench(c, nullptr, &g_interrupted));
      for (const auto& p : r.phases)
        bw[with][p.op == io::IoOp::kWrite ? 0 : 1] = p.gb_per_second();
      if (with == 1) {
        hashed += r.checksum_bytes;
        hash_ns += r.checksum_ns;
        mismatches += r.checksum_mismatches;
        verified += r.checksum_verified;
      }
    }
    for (int k = 0; k < 2; ++k) {
      plain[k].push_back(bw[0][k]);
      summed[k].push_back(bw[1][k]);
      ratio[k].push_back(bw[0][k] > 0 ? bw[1][k] / bw[0][k] : 0.0);
    }
  }
  const double hash_gbps =
      hash_ns > 0 ? static_cast<double>(hashed) / static_cast<double>(hash_ns) : 0;
  json out = {
      {"rounds", a.checksum_cost},  {"block", c.block},         {"queue_depth", c.queue_depth},
      {"threads", c.threads},       {"hash", "xxh3-64"},        {"hash_gb_per_s", hash_gbps},
      {"verified_reads", verified}, {"mismatches", mismatches}, {"target_cost", 0.02}};
  std::fprintf(human,
               "\nchecksum cost (%d interleaved rounds, block %s, qd %d, threads %d; "
               "XXH3 hashes %.1f GB/s on one core here):\n",
               a.checksum_cost, FormatBytesExact(c.block).c_str(), c.queue_depth, c.threads,
               hash_gbps);
  std::fprintf(human, "  %-6s %12s %16s %8s %14s\n", "phase", "plain GB/s", "checksummed GB/s",
               "cost", "hash share");
  bool met = mismatches == 0;
  for (int k = 0; k < 2; ++k) {
    const char* name = k == 0 ? "write" : "read";
    const double cost = 1.0 - Median(ratio[k]);
    const double share = hash_gbps > 0 ? Median(plain[k]) / hash_gbps : 0.0;
    met = met && cost < 0.02;
    std::fprintf(human, "  %-6s %12.2f %16.2f %7.1f%% %13.1f%%\n", name, Median(plain[k]),
                 Median(summed[k]), 100.0 * cost, 100.0 * share);
    out[name] = {{"plain_gb_per_s", Median(plain[k])},
                 {"checksummed_gb_per_s", Median(summed[k])},
                 {"cost", cost},
                 {"hash_share_of_transfer_time", share}};
  }
  out["meets_target"] = met;
  std::fprintf(human,
               "  cost = 1 - checksummed/plain (median of the rounds' ratios), target < 2%%: %s; "
               "hash share = the hashing's time over the transfer's, if it were not overlapped\n",
               met ? "met" : "NOT met");
  return out;
}

// The configuration every point of the grid shares; a point sets block, depth and threads.
BenchConfig BaseConfig(const NvmeBenchArgs& a) {
  BenchConfig c;
  c.paths = a.paths;
  c.file_name = fmt::format("strata-nvme-bench-{}.dat", ::getpid());
  c.size = a.size;
  c.write = a.rw != "read";
  c.read = a.rw != "write";
  c.pattern = a.pattern == "rand" ? BenchPattern::kRandom : BenchPattern::kSequential;
  c.backend = a.backend == "uring"   ? io::Backend::kUring
              : a.backend == "posix" ? io::Backend::kPosix
                                     : io::Backend::kAuto;
  c.direct = a.direct == "on"    ? io::DirectMode::kOn
             : a.direct == "off" ? io::DirectMode::kOff
                                 : io::DirectMode::kAuto;
  c.huge_pages = a.huge_pages == "on"    ? HugePages::kOn
                 : a.huge_pages == "off" ? HugePages::kOff
                                         : HugePages::kAuto;
  c.stripe_unit = a.stripe_unit;
  c.sqpoll = a.sqpoll;
  c.register_buffers = !a.no_register;
  c.register_files = !a.no_register;
  c.verify = a.verify;
  c.runtime = a.runtime;
  c.seed = a.seed;
  // Intermediate configurations of a sweep keep the file; it is removed after the last one.
  c.keep = true;
  return c;
}

// The first line: where the file goes, how large, what runs.
void PrintHeader(const NvmeBenchArgs& a, const std::vector<Config>& grid, std::FILE* human) {
  std::string where;
  for (const auto& p : a.paths) {
    Result<io::PathInfo> info = io::DescribePath(p, /*probe_direct=*/false);
    where +=
        fmt::format("{}{} ({})", where.empty() ? "" : ", ", p, info.ok() ? info->filesystem : "?");
  }
  std::fprintf(human, "strata nvme-bench: %s; file %s%s; %s, %s; %zu configuration(s)\n",
               where.c_str(), FormatBytes(a.size / grid.front().block * grid.front().block).c_str(),
               a.paths.size() > 1
                   ? fmt::format(" striped in {} units", FormatBytesExact(a.stripe_unit)).c_str()
                   : "",
               a.rw == "both" ? "write then read" : a.rw.c_str(),
               a.pattern == "rand" ? "random" : "sequential", grid.size());
  std::fflush(human);
}

// Runs every point of the grid in order, a progress line for each; stops at the first error or
// interruption (kCancelled), keeping what was measured before it in *results.
Status RunGrid(const BenchConfig& base, const std::vector<Config>& grid,
               std::vector<BenchResult>* results) {
  ProgressLine progress_line(stderr, std::chrono::seconds(5));
  for (size_t i = 0; i < grid.size(); ++i) {
    BenchConfig c = base;
    c.block = grid[i].block;
    c.queue_depth = grid[i].depth;
    c.threads = grid[i].threads;
    const std::string label = fmt::format("[{}/{}] block {} qd {} threads {}", i + 1, grid.size(),
                                          FormatBytesExact(c.block), c.queue_depth, c.threads);
    auto progress = [&](const io::BenchProgress& p) {
      std::string pct = p.bytes_total > 0
                            ? fmt::format("{:3.0f}%", 100.0 * static_cast<double>(p.bytes_done) /
                                                          static_cast<double>(p.bytes_total))
                            : fmt::format("{:.0f}s", p.elapsed);
      progress_line.Update(
          fmt::format("{} {:>7} {} {:.2f} GB/s", label, p.phase, pct, p.rate / 1e9));
    };
    Result<BenchResult> r = io::RunBench(c, progress, &g_interrupted);
    if (!r.ok()) return r.status();
    std::string summary;
    for (const auto& p : r->phases) {
      summary += fmt::format(" {} {:.2f} GB/s (p99 {:.0f} µs)", io::IoOpName(p.op),
                             p.gb_per_second(), p.latency.p99_us);
    }
    progress_line.Finish(label + ":" + summary);
    results->push_back(std::move(r).value());
  }
  return Status::Ok();
}

int Run(NvmeBenchArgs a) {
  Status valid = Validate(a);
  if (!valid.ok()) return ReportError("nvme-bench", valid);

  std::FILE* human = a.json_output ? stderr : stdout;
  const std::vector<Config> grid = Grid(a);
  // Checked against the whole grid, so that a sweep cannot fail halfway on its largest block.
  uint64_t largest = 0;
  for (const Config& c : grid)
    largest = std::max(largest, c.block);
  if (a.size < largest) {
    return ReportError("nvme-bench", InvalidArgumentError(fmt::format(
                                         "--size {} is smaller than --block {}",
                                         FormatBytes(a.size), FormatBytesExact(largest))));
  }

  BenchConfig base = BaseConfig(a);
  // Bounded so that a long --runtime with small blocks cannot exhaust memory (about 200 bytes an
  // event); later requests are counted as dropped.
  constexpr size_t kMaxTraceEvents = 1'000'000;
  std::unique_ptr<TraceRecorder> trace;
  if (!a.trace_file.empty()) {
    trace = std::make_unique<TraceRecorder>(0, "strata nvme-bench", kMaxTraceEvents);
    base.trace = trace.get();
  }

  PrintHeader(a, grid, human);

  // Interrupted or hung up: stop, and still remove the bench files. A closed pipe on stdout must
  // not kill the process before it cleans up either.
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGTERM, OnInterrupt);
  std::signal(SIGHUP, OnInterrupt);
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<BenchResult> results;
  Status failure = RunGrid(base, grid, &results);
  // Remove the bench files (one per directory path) unless asked to keep them.
  if (!a.keep) {
    for (const auto& p : a.paths) {
      Result<io::BenchFile> f = io::ResolveBenchFile(p, base.file_name);
      if (f.ok() && f->bench_owned) ::unlink(f->path.c_str());
    }
  }
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGHUP, SIG_DFL);
  // The trace is written even after a failure or an interruption: it shows what ran until then.
  std::string trace_note;
  if (trace != nullptr) {
    Status written = trace->WriteChromeJson(a.trace_file);
    if (!written.ok() && failure.ok()) return ReportError("nvme-bench", written);
    if (written.ok()) {
      const size_t dropped = trace->dropped();
      trace_note = fmt::format("trace: wrote {}{}\n", a.trace_file,
                               dropped > 0 ? fmt::format(" ({} requests beyond {} events were "
                                                         "not recorded)",
                                                         dropped, kMaxTraceEvents)
                                           : "");
      if (!failure.ok()) std::fputs(trace_note.c_str(), stderr);
    }
  }
  if (!failure.ok()) {
    // What was measured before the failure is still worth seeing.
    if (!results.empty()) {
      std::fprintf(stderr, "\nresults before the %s:\n",
                   failure.code() == StatusCode::kCancelled ? "interruption" : "error");
      PrintTable(results, stderr);
    }
    if (failure.code() == StatusCode::kCancelled) {
      std::fprintf(stderr, "strata nvme-bench: interrupted%s\n",
                   a.keep ? "" : "; bench files removed");
      return 130;
    }
    return ReportError("nvme-bench", failure);
  }

  std::fprintf(human, "\n");
  PrintTable(results, human);
  if (!results.empty()) {
    const BenchResult& r0 = results[0];
    std::fprintf(human, "backend %s, direct I/O %s, buffers %s (%s on huge pages, %s registered)\n",
                 r0.backend.c_str(), r0.direct ? "on" : "off (buffered)", r0.buffer_backing.c_str(),
                 FormatBytes(r0.buffer_huge_bytes).c_str(),
                 FormatBytes(r0.registered_buffer_bytes).c_str());
  }

  std::fputs(trace_note.c_str(), human);

  json out = {{"strata_version", std::string(Version())},
              {"paths", a.paths},
              {"size", a.size},
              {"rw", a.rw},
              {"pattern", a.pattern},
              {"units", {{"gb_per_s", "1e9 bytes/s"}, {"gib_per_s", "2^30 bytes/s"}}}};
  json all = json::array();
  for (const auto& r : results)
    all.push_back(ResultJson(r));
  out["results"] = all;

  if (a.tune && !results.empty()) {
    const BenchResult& best = results[PickBest(results)];
    json tuned = TuneJson(a, best);
    if (Status st = WriteFileAtomic(LocalFileSystem(), a.tune_file, tuned.dump(2) + "\n");
        !st.ok()) {
      return ReportError("nvme-bench", st.WithContext("--tune-file"));
    }
    std::fprintf(human,
                 "best: block %s, queue depth %d, threads %d (score %.2f GB/s); wrote %s "
                 "(merge its \"aio\" and \"strata\" sections into your DeepSpeed config)\n",
                 FormatBytesExact(best.config.block).c_str(), best.config.queue_depth,
                 best.config.threads, Score(best), a.tune_file.c_str());
    out["best"] = ResultJson(best);
    out["tune_file"] = a.tune_file;
    out["tuned"] = tuned;
  }
  if (a.checksum_cost > 0 && !results.empty()) {
    Result<json> cost = ChecksumCost(a, base, results[0].config, human);
    if (!cost.ok()) return ReportError("nvme-bench", cost.status());
    out["checksum_cost"] = *cost;
  }
  if (trace != nullptr) out["trace_file"] = a.trace_file;
  if (a.json_output) std::printf("%s\n", out.dump(2).c_str());
  // SIGPIPE is ignored (to clean up): a closed stdout shows up here instead.
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    return ReportError("nvme-bench", ErrnoToStatus(errno, "writing the results to stdout"));
  }
  return kExitOk;
}

}  // namespace

void RegisterNvmeBenchCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<NvmeBenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "nvme-bench",
      "Measure NVMe (or any storage) for offload: throughput, IOPS and latency with large aligned "
      "requests, as Strata issues them; sweep settings and write the best as a DeepSpeed \"aio\" "
      "section (--tune)");
  cmd->add_option("--path", args->paths,
                  "A directory (a bench file is created in it and removed afterwards) or an "
                  "existing file (written by write phases, and laid out first if it has holes "
                  "or unwritten extents). Several --path are striped into one logical file, one "
                  "stripe unit per path in turn (RAID-0 style)")
      ->required();
  cmd->add_option("--rw", args->rw, "What to measure: write, read, or both (write, then read)")
      ->check(CLI::IsMember({"read", "write", "both"}))
      ->capture_default_str();
  cmd->add_option("--pattern", args->pattern,
                  "Request order: seq (sequential) or rand (each block once, in random order)")
      ->check(CLI::IsMember({"seq", "rand"}))
      ->capture_default_str();
  cmd->add_option("--block", args->blocks,
                  "Bytes per request, a multiple of 4 KiB (e.g. 1M, 256K); a comma-separated "
                  "list with --sweep [default: 1M]")
      ->delimiter(',')
      ->transform(ByteSize());
  cmd->add_option("--qd", args->depths,
                  "Requests in flight per thread; a list with --sweep [default: 32]")
      ->delimiter(',');
  cmd->add_option("--threads", args->threads,
                  "I/O threads, each with its own io_uring ring; a list with --sweep [default: 1]")
      ->delimiter(',');
  cmd->add_option("--size", args->size,
                  "Size of the bench file (e.g. 4GiB); each phase moves it once [default: 1GiB]")
      ->transform(ByteSize());
  cmd->add_option("--runtime", args->runtime,
                  "Seconds per phase, repeating over the file (0: one pass) [default: 0]");
  cmd->add_option("--backend", args->backend,
                  "I/O backend: uring, posix (pread/pwrite threads) or auto (uring if usable)")
      ->check(CLI::IsMember({"auto", "uring", "posix"}))
      ->capture_default_str();
  cmd->add_option("--direct", args->direct,
                  "O_DIRECT: on (required), off (page cache), auto (on where the filesystem "
                  "allows it)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  cmd->add_option("--huge-pages", args->huge_pages,
                  "Back the I/O buffers with huge pages: auto, on (required) or off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  cmd->add_option("--stripe-unit", args->stripe_unit,
                  "Bytes per path before moving to the next, with several --path [default: 1M]")
      ->transform(ByteSize());
  cmd->add_flag("--sqpoll", args->sqpoll, "Ask io_uring for a kernel submission-polling thread");
  cmd->add_flag("--no-register", args->no_register,
                "Do not register buffers and files with io_uring (for comparison)");
  cmd->add_flag("--sweep", args->sweep,
                "Run every combination of --block x --qd x --threads (a dimension not listed "
                "uses 256K,1M,4M / 4,16,64 / 1,2)");
  cmd->add_flag("--tune", args->tune,
                "Sweep, then write the best settings to --tune-file as a DeepSpeed \"aio\" "
                "section plus Strata's \"strata.io\" settings");
  cmd->add_option("--tune-file", args->tune_file, "Where --tune writes its JSON")
      ->capture_default_str();
  cmd->add_flag("--verify", args->verify,
                "Write a pattern and check it in every block read back that this run wrote "
                "(slower: data is generated and compared). It writes the file even with --rw "
                "read, so an existing file given as --path is overwritten");
  cmd->add_option("--checksum-cost", args->checksum_cost,
                  "After the measurements, N interleaved rounds of the first configuration with "
                  "and without offload checksums (write then read): what checksums cost here")
      ->check(CLI::Range(0, 100));
  cmd->add_flag("--keep", args->keep, "Keep the bench file(s) instead of removing them");
  cmd->add_flag("--json", args->json_output,
                "Print the results as JSON on stdout (the table and progress go to stderr)");
  cmd->add_option("--seed", args->seed, "Seed for the random order and the verify pattern")
      ->capture_default_str();
  cmd->add_option("--trace", args->trace_file,
                  "Write a Chrome / Perfetto trace (JSON) of every measured request to this file: "
                  "one track per in-flight slot, plus one event per phase");
  cmd->callback([cmd, args, exit_code] {
    args->blocks_given = cmd->count("--block") > 0;
    args->depths_given = cmd->count("--qd") > 0;
    args->threads_given = cmd->count("--threads") > 0;
    *exit_code = Run(*args);
  });
}

}  // namespace strata::cli
