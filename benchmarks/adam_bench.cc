// strata_adam_bench: how close Strata's CPU Adam comes to the machine's memory bandwidth.
//
// On --elements fp32 parameters (default 2^27) and for each --threads count it times, per step:
//   strata        CpuAdamStep at the chosen ISA (default BestIsa()), AdamW, no 16-bit copy;
//   strata+bf16   the same step also writing the bf16 copy (the fused path);
//   peer          a plain scalar AdamW loop compiled on its own with -O3 -march=native
//                 (adam_bench_kernels.cc), split over the threads exactly as Strata splits;
//   ceiling       the streaming ceiling: a pass that reads exactly what Adam reads (p, g, m, v)
//                 and writes exactly what it writes (p, m, v; + the bf16 copy for the fused
//                 ceiling) with no arithmetic, with ordinary stores ("ceiling"), with
//                 non-temporal stores ("/nt") and, with the copy, non-temporal stores for the
//                 copy only ("/nt16", what Strata's fused kernel does); the fastest variant is
//                 the ceiling.
// Each round runs every variant once (in a rotating order, so that none always runs first after
// another); the table reports the median over --reps rounds. All arrays are 2 MiB-aligned host
// regions (huge pages where the system allows), pre-faulted, so that page faults are not timed.
//
// Derived numbers: ratio = ceiling time / variant time (1.0 = at the bandwidth ceiling); GB/s
// counts the bytes Adam must move (28 per element, 30 with the bf16 copy); "70B s/step" is the
// time of one step over 70e9 parameters on 16 cores, assuming the bandwidth per core measured
// here scales linearly to 16 cores (a large assumption: a socket's memory bandwidth saturates
// well before that on most machines), i.e. s/step * (70e9 / elements) * (threads / 16).
//
// The target: ratio >= 0.95 with 1 and 2 threads. DeepSpeed's CPU Adam is measured beside it in
// the same run by benchmarks/adam_vs_deepspeed.py (no peer figure is kept here).
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "adam_bench_kernels.h"
#include "bench_stats.h"
#include "common/host_memory.h"
#include "optim/adam.h"
#include "strata/status.h"

namespace strata::bench {
namespace {

using nlohmann::json;

constexpr double kTargetRatio = 0.95;
constexpr size_t kDefaultElements = size_t{1} << 27;

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Busy CPU-seconds of the whole machine (/proc/stat) and of this process (getrusage): their
// difference over a measurement is what other processes used, which on a small shared machine is
// what moves memory-bound numbers most. -1 when /proc/stat cannot be read.
double MachineBusySeconds() {
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return -1;
  unsigned long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0,
                     steal = 0;
  const int got = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &user, &nice,
                              &system, &idle, &iowait, &irq, &softirq, &steal);
  std::fclose(f);
  if (got != 8) return -1;
  return static_cast<double>(user + nice + system + irq + softirq + steal) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

double OwnCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& tv) { return tv.tv_sec + tv.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

double LoadAverage() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double load = -1;
  if (std::fscanf(f, "%lf", &load) != 1) load = -1;
  std::fclose(f);
  return load;
}

// A fixed team of threads for the peer and ceiling kernels: Run(fn) calls fn(k) for every k in
// [0, size) at once, k = 0 on the calling thread, and returns when all are done.
class Team {
 public:
  explicit Team(int size) : size_(size) {
    for (int k = 1; k < size; ++k)
      threads_.emplace_back([this, k] { Loop(k); });
  }
  ~Team() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_)
      t.join();
  }
  int size() const { return size_; }

  void Run(const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      pending_ = size_ - 1;
      ++generation_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void Loop(int k) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      (*fn)(k);
      lock.lock();
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  int size_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Strata's split: `parts` contiguous chunks, boundaries on multiples of 1024 elements.
std::pair<size_t, size_t> ChunkOf(size_t n, int parts, int k) {
  const size_t per = (n + parts - 1) / parts;
  const size_t chunk = (per + optim::kAdamChunkAlignElements - 1) / optim::kAdamChunkAlignElements *
                       optim::kAdamChunkAlignElements;
  const size_t begin = std::min(n, chunk * k);
  return {begin, std::min(n, begin + chunk)};
}

struct Arrays {
  HostRegion p, g, m, v, out16;
  size_t n = 0;
  float* P() const { return reinterpret_cast<float*>(p.data()); }
  float* G() const { return reinterpret_cast<float*>(g.data()); }
  float* M() const { return reinterpret_cast<float*>(m.data()); }
  float* V() const { return reinterpret_cast<float*>(v.data()); }
  uint16_t* Out16() const { return reinterpret_cast<uint16_t*>(out16.data()); }
};

Result<Arrays> Allocate(size_t n, Team& team) {
  Arrays a;
  a.n = n;
  STRATA_ASSIGN_OR_RETURN(a.p, HostRegion::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.g, HostRegion::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.m, HostRegion::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.v, HostRegion::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.out16, HostRegion::Allocate(n * 2));
  // Values that keep every step in normal fp32 range: |g| in [1e-3, 1), p around 0.5.
  team.Run([&](int k) {
    const auto [begin, end] = ChunkOf(n, team.size(), k);
    uint32_t x = 0x9e3779b9u * static_cast<uint32_t>(k + 1);
    for (size_t i = begin; i < end; ++i) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      const float r = static_cast<float>(x >> 8) * (1.0f / 16777216.0f);  // [0, 1)
      a.P()[i] = 0.25f + 0.5f * r;
      a.G()[i] = (r < 0.5f ? -1.0f : 1.0f) * (1e-3f + r * 0.9f);
      a.M()[i] = 0.0f;
      a.V()[i] = 0.0f;
    }
  });
  return a;
}

struct Variant {
  std::string name;
  std::function<Status()> run;
};

struct Measured {
  std::string name;
  double median_s = 0;
  double min_s = 0;
  double bytes_per_element = 0;
};

struct Args {
  size_t elements = kDefaultElements;
  std::vector<int> threads = {1, 2};
  int reps = 11;
  std::string isa;
  bool json_output = false;
};

Status Main(const Args& args) {
  if (args.elements < 1024) return InvalidArgumentError("--elements must be at least 1024");
  if (args.reps < 1) return InvalidArgumentError("--reps must be >= 1");
  optim::Isa isa = optim::BestIsa();
  if (!args.isa.empty()) {
    bool found = false;
    for (optim::Isa candidate : optim::SupportedIsas()) {
      if (optim::IsaName(candidate) == args.isa) {
        isa = candidate;
        found = true;
      }
    }
    if (!found)
      return InvalidArgumentError(fmt::format("--isa {} is not supported here", args.isa));
  }
  const size_t n = args.elements;
  const int max_threads = *std::max_element(args.threads.begin(), args.threads.end());
  auto init_team = std::make_unique<Team>(std::max(1, max_threads));
  STRATA_ASSIGN_OR_RETURN(Arrays arrays, Allocate(n, *init_team));
  init_team.reset();

  optim::AdamHyper hyper;
  hyper.lr = 1e-4;
  hyper.weight_decay = 0.01;
  hyper.step = 10;
  const double bc1 = 1.0 - std::pow(hyper.beta1, 10.0);
  const double bc2 = 1.0 - std::pow(hyper.beta2, 10.0);
  const PeerAdamScalars peer{
      static_cast<float>(hyper.beta1),        static_cast<float>(hyper.beta2),
      static_cast<float>(hyper.eps),          static_cast<float>(hyper.lr),
      static_cast<float>(hyper.weight_decay), static_cast<float>(bc1),
      static_cast<float>(std::sqrt(bc2))};
  optim::AdamShard shard{arrays.P(), arrays.G(), arrays.M(),          arrays.V(),
                         n,          nullptr,    device::DType::kBF16};
  optim::AdamShard fused = shard;
  fused.out16 = arrays.Out16();

  json result;
  result["benchmark"] = "adam";
  result["elements"] = n;
  result["isa"] = optim::IsaName(isa);
  result["ceiling_isa"] = CeilingIsa();
  result["reps"] = args.reps;
  result["huge_pages"] = arrays.p.fully_huge();
  result["load_average_before"] = LoadAverage();
  result["runs"] = json::array();

  if (!args.json_output) {
    fmt::print(
        "strata_adam_bench: {} elements ({:.2f} GiB of fp32 state), ISA {}, ceiling built "
        "for {}, {} reps (median), arrays on {}, load average {:.2f}\n",
        n, 16.0 * n / (1 << 30), optim::IsaName(isa), CeilingIsa(), args.reps,
        arrays.p.fully_huge() ? "huge pages" : "(partly) small pages", LoadAverage());
  }

  for (const int threads : args.threads) {
    if (threads < 1) return InvalidArgumentError("--threads values must be >= 1");
    Team team(threads);
    const optim::CpuAdamOptions options{isa, threads};
    auto split = [&](auto&& body) {
      team.Run([&](int k) {
        const auto [begin, end] = ChunkOf(n, threads, k);
        body(begin, end);
      });
      return Status::Ok();
    };
    std::vector<Variant> variants = {
        {"strata", [&] { return optim::CpuAdamStep(hyper, shard, options); }},
        {"strata+bf16", [&] { return optim::CpuAdamStep(hyper, fused, options); }},
        {"peer",
         [&] {
           return split([&](size_t b, size_t e) {
             PeerAdamStep(peer, arrays.P() + b, arrays.G() + b, arrays.M() + b, arrays.V() + b,
                          e - b);
           });
         }},
    };
    // The ceiling's store variants: ordinary, all non-temporal, and (with the bf16 copy)
    // non-temporal for the copy only, which is what Strata's fused kernel does.
    const std::vector<std::pair<std::string, CeilingStores>> store_kinds = {
        {"", CeilingStores::kOrdinary},
        {"/nt", CeilingStores::kNonTemporal},
        {"/nt16", CeilingStores::kNonTemporalOut16}};
    for (const bool with_out16 : {false, true}) {
      for (const auto& [suffix, stores] : store_kinds) {
        if (!with_out16 && stores == CeilingStores::kNonTemporalOut16) continue;
        variants.push_back({fmt::format("ceiling{}{}", with_out16 ? "+bf16" : "", suffix),
                            [&, with_out16, stores = stores] {
                              return split([&](size_t b, size_t e) {
                                CeilingPass(
                                    arrays.P() + b, arrays.G() + b, arrays.M() + b, arrays.V() + b,
                                    with_out16 ? arrays.Out16() + b : nullptr, e - b, stores);
                              });
                            }});
      }
    }
    std::vector<std::vector<double>> times(variants.size());
    for (Variant& variant : variants)
      STRATA_RETURN_IF_ERROR(variant.run());  // warm-up
    const double wall0 = NowSeconds();
    const double busy0 = MachineBusySeconds();
    const double own0 = OwnCpuSeconds();
    for (int rep = 0; rep < args.reps; ++rep) {
      for (size_t j = 0; j < variants.size(); ++j) {
        const size_t k = (j + rep) % variants.size();
        const double t0 = NowSeconds();
        STRATA_RETURN_IF_ERROR(variants[k].run());
        times[k].push_back(NowSeconds() - t0);
      }
    }
    const double wall = NowSeconds() - wall0;
    const double foreign_cpus =
        busy0 < 0 ? -1
                  : std::max(0.0, (MachineBusySeconds() - busy0) - (OwnCpuSeconds() - own0)) / wall;
    std::map<std::string, double> median;
    for (size_t k = 0; k < variants.size(); ++k)
      median[variants[k].name] = Median(times[k]);
    // The ceiling is the fastest of the store variants.
    auto fastest = [&](std::string_view prefix) {
      std::string best;
      for (const auto& [name, s] : median) {
        const bool bf16 = name.find("bf16") != std::string::npos;
        if (name.starts_with("ceiling") && bf16 == (prefix == "ceiling+bf16") &&
            (best.empty() || s < median[best])) {
          best = name;
        }
      }
      return best;
    };
    const std::string ceiling_name = fastest("ceiling");
    const std::string ceiling_bf16_name = fastest("ceiling+bf16");
    const double ceiling = median[ceiling_name];
    const double ceiling_bf16 = median[ceiling_bf16_name];

    json run;
    run["threads"] = threads;
    run["foreign_cpus"] = foreign_cpus;
    run["ceiling"] = ceiling_name;
    run["ceiling_bf16"] = ceiling_bf16_name;
    json rows = json::array();
    if (!args.json_output) {
      fmt::print(
          "\nthreads {} (other processes used {:.2f} CPUs meanwhile)\n"
          "{:<18}{:>10}{:>11}{:>9}{:>10}{:>12}\n",
          threads, foreign_cpus, "variant", "s/step", "Gelem/s", "GB/s", "ratio", "70B s/step");
    }
    for (size_t k = 0; k < variants.size(); ++k) {
      const std::string& name = variants[k].name;
      const bool bf16 = name.find("bf16") != std::string::npos;
      const double s = median[name];
      const double bytes = bf16 ? 30.0 : 28.0;
      const double ratio = (bf16 ? ceiling_bf16 : ceiling) / s;
      const double s70 = s * (70e9 / static_cast<double>(n)) * (threads / 16.0);
      json row;
      row["variant"] = name;
      row["seconds_per_step"] = s;
      row["min_seconds"] = *std::min_element(times[k].begin(), times[k].end());
      row["elements_per_second"] = static_cast<double>(n) / s;
      row["gb_per_second"] = bytes * static_cast<double>(n) / s / 1e9;
      row["ratio_to_ceiling"] = ratio;
      row["seconds_per_step_70b_16_cores"] = s70;
      rows.push_back(row);
      if (!args.json_output) {
        fmt::print("{:<18}{:>10.4f}{:>11.3f}{:>9.2f}{:>10.3f}{:>12.2f}\n", name, s,
                   static_cast<double>(n) / s / 1e9, bytes * static_cast<double>(n) / s / 1e9,
                   ratio, s70);
      }
    }
    run["variants"] = rows;
    const double strata_ratio = ceiling / median["strata"];
    const double fused_ratio = ceiling_bf16 / median["strata+bf16"];
    run["strata_ratio"] = strata_ratio;
    run["strata_bf16_ratio"] = fused_ratio;
    run["target_ratio_met"] = strata_ratio >= kTargetRatio && fused_ratio >= kTargetRatio;
    if (!args.json_output) {
      fmt::print(
          "ceiling: {} (fused: {}); strata/ceiling {:.3f}, strata+bf16/ceiling {:.3f} "
          "(target >= {:.2f}: {}); strata/peer speed-up {:.2f}x\n",
          ceiling_name, ceiling_bf16_name, strata_ratio, fused_ratio, kTargetRatio,
          run["target_ratio_met"].get<bool>() ? "met" : "NOT met",
          median["peer"] / median["strata"]);
    }
    result["runs"].push_back(run);
  }
  result["load_average_after"] = LoadAverage();
  if (args.json_output) fmt::print("{}\n", result.dump());
  return Status::Ok();
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  strata::bench::Args args;
  CLI::App app{"CPU Adam against the streaming ceiling and a compiler-vectorised scalar peer"};
  app.add_option("--elements", args.elements, "fp32 parameters in the shard")
      ->capture_default_str();
  app.add_option("--threads", args.threads, "Thread counts to measure, e.g. 1,2")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--reps", args.reps, "Rounds per thread count (the median is reported)")
      ->capture_default_str();
  app.add_option("--isa", args.isa, "Strata's ISA: scalar, avx2 or avx512 (default: the best)");
  app.add_flag("--json", args.json_output, "Print one JSON object instead of the table");
  CLI11_PARSE(app, argc, argv);
  const strata::Status status = strata::bench::Main(args);
  if (!status.ok()) {
    std::fprintf(stderr, "strata_adam_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
