// strata_collectives_bench: Strata's MPI backend (the CPU device's collectives) against Open MPI's
// own blocking collectives on the same buffers, in the same run, interleaved.
//
//   mpirun -np 2 strata_collectives_bench [--sizes 1MiB,16MiB,64MiB]
//          [--ops reduce-scatter,all-reduce,all-gather] [--dtype fp32|bf16] [--reps 7]
//          [--warmup 2] [--json]
//
// A size is the whole buffer: the reduce-scatter's input, the all-reduce's buffer, the
// all-gather's output (as nccl-tests counts it); each rank's part is size / ranks. Each repetition
// runs both implementations back to back (the order alternates), each after a barrier, and takes
// the slowest rank's time. Reported: the median time and the bus bandwidth (nccl-tests'
// convention: algorithm bandwidth times (n - 1) / n for reduce-scatter and all-gather, 2 (n - 1) /
// n for all-reduce), and MPI's time over Strata's. Every result is checked against the exact
// expected values once (inputs are small integers, so every order of additions gives the same
// sums). bf16 has no MPI reduction, so its reductions are Strata's only.
//
// Strata's reductions are point-to-point exchanges added in rank order (docs/comm.md says why);
// this program is the evidence for that choice and lets a user see what their transport gives.
#include <fmt/format.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_stats.h"
#include "common/units.h"
#include "strata/collective.h"
#include "strata/device.h"

namespace {

using namespace strata;
using bench::Median;
using device::DType;

enum class Op { kReduceScatter, kAllReduce, kAllGather };

const char* OpName(Op op) {
  switch (op) {
    case Op::kReduceScatter:
      return "reduce-scatter";
    case Op::kAllReduce:
      return "all-reduce";
    case Op::kAllGather:
      return "all-gather";
  }
  return "?";
}

// nccl-tests' bus bandwidth factor: what each rank moves per byte of the whole buffer.
double BusFactor(Op op, int world) {
  const double n = world;
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

[[noreturn]] void Die(int rank, const std::string& what) {
  std::fprintf(stderr, "strata_collectives_bench: rank %d: %s\n", rank, what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::abort();
}

// The value rank r contributes at index i (small integers: every sum is exact in fp32 and bf16
// for up to 16 ranks).
float Input(int r, size_t i) {
  return static_cast<float>(r + 1 + static_cast<int>(i % 7));
}

void Store(void* buffer, DType dtype, size_t i, float v) {
  if (dtype == DType::kF32) {
    static_cast<float*>(buffer)[i] = v;
  } else {
    static_cast<uint16_t*>(buffer)[i] = device::FloatToBf16(v);
  }
}

float Load(const void* buffer, DType dtype, size_t i) {
  if (dtype == DType::kF32) return static_cast<const float*>(buffer)[i];
  return device::Bf16ToFloat(static_cast<const uint16_t*>(buffer)[i]);
}

struct Case {
  Op op;
  uint64_t bytes;  // the whole buffer, rounded down to whole elements per rank
  size_t count;    // elements per rank
};

class Bench {
 public:
  Bench(int rank, int world, DType dtype, device::Device& dev, device::Stream& stream,
        comm::Collective& collective, void* send, void* recv)
      : rank_(rank),
        world_(world),
        dtype_(dtype),
        dev_(dev),
        stream_(stream),
        collective_(collective),
        send_(send),
        recv_(recv) {}

  bool HasPeer(Op op) const { return dtype_ == DType::kF32 || op == Op::kAllGather; }

  // Fills send with this rank's inputs for `c`.
  void Fill(const Case& c) {
    const size_t n = c.op == Op::kAllGather ? c.count : c.count * static_cast<size_t>(world_);
    for (size_t i = 0; i < n; ++i)
      Store(send_, dtype_, i, Input(rank_, i));
  }

  void RunStrata(const Case& c) {
    Status s;
    switch (c.op) {
      case Op::kReduceScatter:
        s = collective_.ReduceScatter(send_, recv_, c.count, dtype_, comm::ReduceOp::kSum, stream_);
        break;
      case Op::kAllReduce:
        s = collective_.AllReduce(send_, recv_, c.count * static_cast<size_t>(world_), dtype_,
                                  comm::ReduceOp::kSum, stream_);
        break;
      case Op::kAllGather:
        s = collective_.AllGather(send_, recv_, c.count, dtype_, stream_);
        break;
    }
    if (s.ok()) s = dev_.Synchronize(stream_);
    if (!s.ok()) Die(rank_, fmt::format("Strata's {} failed: {}", OpName(c.op), s.ToString()));
  }

  void RunMpi(const Case& c) {
    const MPI_Datatype type = dtype_ == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T;
    const int n = static_cast<int>(c.count);
    int rc = MPI_SUCCESS;
    switch (c.op) {
      case Op::kReduceScatter:
        rc = MPI_Reduce_scatter_block(send_, recv_, n, type, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Op::kAllReduce:
        rc = MPI_Allreduce(send_, recv_, n * world_, type, MPI_SUM, MPI_COMM_WORLD);
        break;
      case Op::kAllGather:
        rc = MPI_Allgather(send_, n, type, recv_, n, type, MPI_COMM_WORLD);
        break;
    }
    if (rc != MPI_SUCCESS) Die(rank_, fmt::format("MPI's {} failed (error {})", OpName(c.op), rc));
  }

  // Empty when recv holds the exact result of `c`, else the first wrong element.
  std::optional<std::string> Check(const Case& c) const {
    const size_t n = c.count;
    const auto world = static_cast<size_t>(world_);
    const float ranks_sum = static_cast<float>(world_ * (world_ + 1) / 2);
    const size_t out = c.op == Op::kReduceScatter ? n : n * world;
    for (size_t i = 0; i < out; ++i) {
      float expected = 0;
      if (c.op == Op::kAllGather) {
        expected = Input(static_cast<int>(i / n), i % n);
      } else {
        const size_t index = c.op == Op::kReduceScatter ? static_cast<size_t>(rank_) * n + i : i;
        expected = ranks_sum + static_cast<float>(world * (index % 7));
      }
      const float got = Load(recv_, dtype_, i);
      if (got != expected) {
        return fmt::format("element {} is {}, expected {}", i, got, expected);
      }
    }
    return std::nullopt;
  }

  // Seconds of one run on the slowest rank, from a barrier.
  template <typename Run>
  double Timed(Run&& run) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    run();
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double slowest = 0;
    MPI_Allreduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
  }

 private:
  int rank_;
  int world_;
  DType dtype_;
  device::Device& dev_;
  device::Stream& stream_;
  comm::Collective& collective_;
  void* send_;
  void* recv_;
};

}  // namespace

int main(int argc, char** argv) {
  // The application owns MPI (MPI_THREAD_MULTIPLE), so that its own calls and those of Strata's
  // MPI thread may share the process. MPI_Finalize runs at exit after Strata's runtime has shut
  // down: atexit handlers run in reverse order, and Strata registers its own later.
  int provided = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  int world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (provided != MPI_THREAD_MULTIPLE) {
    Die(rank, fmt::format("MPI provides thread level {}, not MPI_THREAD_MULTIPLE", provided));
  }
  std::atexit([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized == 0) MPI_Finalize();
  });

  CLI::App app{"Strata's MPI collectives against Open MPI's own, in the same run"};
  std::string sizes_text = "1MiB,16MiB,64MiB";
  std::string ops_text = "reduce-scatter,all-reduce,all-gather";
  std::string dtype_text = "fp32";
  int reps = 7;
  int warmup = 2;
  bool json = false;
  app.add_option("--sizes", sizes_text, "whole-buffer sizes, comma-separated (e.g. 1MiB,64MiB)");
  app.add_option("--ops", ops_text, "reduce-scatter, all-reduce, all-gather (comma-separated)");
  app.add_option("--dtype", dtype_text, "fp32 or bf16");
  app.add_option("--reps", reps, "timed repetitions of each implementation")
      ->check(CLI::Range(1, 1000));
  app.add_option("--warmup", warmup, "untimed runs first")->check(CLI::Range(0, 100));
  app.add_flag("--json", json, "print one JSON object instead of the table");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (rank == 0) app.exit(e);
    MPI_Finalize();
    return e.get_exit_code();
  }
  auto usage = [&](const std::string& what) {
    if (rank == 0) std::fprintf(stderr, "strata_collectives_bench: %s\n", what.c_str());
    MPI_Finalize();
    std::exit(2);
  };
  if (dtype_text != "fp32" && dtype_text != "bf16") {
    usage(fmt::format("--dtype '{}': expected fp32 or bf16", dtype_text));
  }
  const DType dtype = dtype_text == "fp32" ? DType::kF32 : DType::kBF16;
  const size_t elem = device::DTypeSize(dtype);
  auto sizes = ParseByteSizeList(sizes_text);
  if (!sizes.ok()) usage(fmt::format("--sizes '{}': {}", sizes_text, sizes.status().message()));
  std::vector<Op> ops;
  for (const auto& name : CLI::detail::split(ops_text, ',')) {
    if (name == "reduce-scatter") {
      ops.push_back(Op::kReduceScatter);
    } else if (name == "all-reduce") {
      ops.push_back(Op::kAllReduce);
    } else if (name == "all-gather") {
      ops.push_back(Op::kAllGather);
    } else {
      usage(fmt::format("--ops: '{}' is not reduce-scatter, all-reduce or all-gather", name));
    }
  }
  std::vector<Case> cases;
  uint64_t largest = 0;
  for (Op op : ops) {
    for (uint64_t bytes : *sizes) {
      const size_t count = bytes / (static_cast<uint64_t>(world) * elem);
      if (count == 0 || count > static_cast<size_t>(INT32_MAX) / static_cast<size_t>(world)) {
        usage(fmt::format("--sizes: {} is not 1 to 2^31 - 1 elements of {} for {} ranks",
                          FormatBytes(bytes), dtype_text, world));
      }
      cases.push_back({op, count * static_cast<uint64_t>(world) * elem, count});
      largest = std::max(largest, cases.back().bytes);
    }
  }

  device::DeviceOptions device_options;
  device_options.memory_budget = 2 * largest + (uint64_t{16} << 20);
  auto dev = device::CreateDevice(device_options);
  if (!dev.ok()) Die(rank, dev.status().ToString());
  auto stream = (*dev)->CreateStream("comm");
  if (!stream.ok()) Die(rank, stream.status().ToString());
  comm::CollectiveOptions collective_options;
  collective_options.backend = comm::Backend::kMpi;
  auto collective = comm::CreateCollective(**dev, collective_options);
  if (!collective.ok()) Die(rank, collective.status().ToString());
  auto send = (*dev)->Alloc(largest);
  auto recv = (*dev)->Alloc(largest);
  if (!send.ok() || !recv.ok()) Die(rank, "cannot allocate the buffers");
  Bench bench(rank, world, dtype, **dev, **stream, **collective, *send, *recv);

  nlohmann::json results = nlohmann::json::array();
  for (const Case& c : cases) {
    bench.Fill(c);
    const bool peer = bench.HasPeer(c.op);
    // The check first (the timed runs reuse the same buffers).
    bench.RunStrata(c);
    if (auto wrong = bench.Check(c))
      Die(rank, fmt::format("Strata's {}: {}", OpName(c.op), *wrong));
    if (peer) {
      bench.RunMpi(c);
      if (auto wrong = bench.Check(c)) Die(rank, fmt::format("MPI's {}: {}", OpName(c.op), *wrong));
    }
    for (int w = 0; w < warmup; ++w) {
      bench.RunStrata(c);
      if (peer) bench.RunMpi(c);
    }
    std::vector<double> strata_s, mpi_s;
    for (int r = 0; r < reps; ++r) {
      const bool strata_first = r % 2 == 0;
      if (strata_first) strata_s.push_back(bench.Timed([&] { bench.RunStrata(c); }));
      if (peer) mpi_s.push_back(bench.Timed([&] { bench.RunMpi(c); }));
      if (!strata_first) strata_s.push_back(bench.Timed([&] { bench.RunStrata(c); }));
    }
    const double bus = BusFactor(c.op, world) * static_cast<double>(c.bytes) / 1e9;
    nlohmann::json row = {
        {"op", OpName(c.op)},
        {"bytes", c.bytes},
        {"strata",
         {{"median_ms", Median(strata_s) * 1e3}, {"busbw_gb_per_s", bus / Median(strata_s)}}}};
    if (peer) {
      row["mpi"] = {{"median_ms", Median(mpi_s) * 1e3}, {"busbw_gb_per_s", bus / Median(mpi_s)}};
      row["mpi_over_strata"] = Median(mpi_s) / Median(strata_s);
    }
    results.push_back(row);
  }

  if (rank == 0) {
    char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string library(version, static_cast<size_t>(length));
    library = library.substr(0, library.find_first_of(",\n"));
    if (json) {
      nlohmann::json out = {
          {"bench", "collectives"}, {"ranks", world},   {"dtype", dtype_text}, {"reps", reps},
          {"mpi_library", library}, {"check", "exact"}, {"results", results}};
      std::printf("%s\n", out.dump().c_str());
    } else {
      std::printf("%d ranks, %s, %s; median of %d, the slowest rank; bus bandwidth as nccl-tests\n",
                  world, dtype_text.c_str(), library.c_str(), reps);
      std::printf("%-15s %10s %12s %12s %12s %12s %9s\n", "operation", "size", "Strata ms",
                  "Strata GB/s", "MPI ms", "MPI GB/s", "MPI/Strata");
      for (const auto& row : results) {
        const bool peer = row.contains("mpi");
        std::printf(
            "%-15s %10s %12.2f %12.2f %12s %12s %9s\n", row["op"].get<std::string>().c_str(),
            FormatBytesExact(row["bytes"].get<uint64_t>()).c_str(),
            row["strata"]["median_ms"].get<double>(), row["strata"]["busbw_gb_per_s"].get<double>(),
            peer ? fmt::format("{:.2f}", row["mpi"]["median_ms"].get<double>()).c_str() : "-",
            peer ? fmt::format("{:.2f}", row["mpi"]["busbw_gb_per_s"].get<double>()).c_str() : "-",
            peer ? fmt::format("{:.2f}", row["mpi_over_strata"].get<double>()).c_str() : "-");
      }
      std::printf("every result checked exactly: yes\n");
    }
  }
  (*dev)->Free(*send);
  (*dev)->Free(*recv);
  collective->reset();
  stream->reset();
  return 0;
}
