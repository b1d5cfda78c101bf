// Micro-benchmarks of the BlockStore's per-request cost: how many small requests per second each
// backend sustains when the data is already in the page cache (so the device does not limit it),
// with a fixed number in flight kept up by completion callbacks, as the offload engine does.
// This is the overhead a tier manager pays per shard transfer on top of the device time.
//
//   build/default/benchmarks/strata_block_store_bench --benchmark_format=json
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "io/stripe.h"
#include "strata/block_store.h"

namespace strata::io {
namespace {

std::string BenchFile() {
  const char* dir = std::getenv("STRATA_BENCH_DIR");
  return std::string(dir != nullptr ? dir : ".") + "/strata-micro-bench-" +
         std::to_string(::getpid()) + ".dat";
}

// Keeps `depth` buffered 4 KiB reads in flight over a cached 16 MiB file for the benchmark's
// iterations; each iteration is one completed request.
void PipelinedReads(benchmark::State& state, Backend backend) {
  const int depth = static_cast<int>(state.range(0));
  StoreOptions options;
  options.backend = backend;
  options.queue_depth = depth;
  auto store_or = CreateBlockStore(options);
  if (!store_or.ok()) {
    state.SkipWithError(store_or.status().ToString().c_str());
    return;
  }
  std::unique_ptr<BlockStore> store = std::move(store_or).value();
  const std::string path = BenchFile();
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() { std::filesystem::remove(path); }
  } remove_on_exit{path};
  FileSpec spec;
  spec.paths = {path};
  spec.direct = DirectMode::kOff;  // page cache: measure the engine, not the drive
  auto file = store->Open(spec);
  if (!file.ok()) {
    state.SkipWithError(file.status().ToString().c_str());
    return;
  }
  constexpr uint64_t kFile = 16 << 20;
  std::vector<char> fill(kFile, 1);
  if (!store->Write(*file, 0, kFile, fill.data()).ok()) {
    state.SkipWithError("cannot write the bench file");
    return;
  }
  std::vector<char> buffers(static_cast<size_t>(depth) * 4096);

  for (auto _ : state) {
    state.PauseTiming();
    const int64_t total = 20000;
    std::atomic<int64_t> issued{0};
    int retired = 0;  // slots with nothing left to issue; guarded by mu
    std::mutex mu;
    std::condition_variable cv;
    // Each slot issues its next read from the previous one's completion; when none is left the
    // slot retires, and the iteration ends once every slot has retired (so no callback still
    // touches these locals).
    std::function<void(int)> issue = [&](int slot) {
      const int64_t i = issued.fetch_add(1);
      if (i >= total) {
        std::lock_guard lock(mu);
        if (++retired == depth) cv.notify_all();
        return;
      }
      IoRequest r{IoOp::kRead,
                  *file,
                  static_cast<uint64_t>(i * 4096) % kFile,
                  4096,
                  buffers.data() + slot * 4096,
                  [&issue, slot](const Status&) { issue(slot); }};
      (void)store->Submit(r);
    };
    state.ResumeTiming();
    for (int s = 0; s < depth; ++s)
      issue(s);
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return retired == depth; });
    state.SetItemsProcessed(state.items_processed() + total);
  }
  (void)store->Close(*file);
}

void BM_UringPipelined4KiBReads(benchmark::State& state) {
  PipelinedReads(state, Backend::kUring);
}
void BM_PosixPipelined4KiBReads(benchmark::State& state) {
  PipelinedReads(state, Backend::kPosix);
}
BENCHMARK(BM_UringPipelined4KiBReads)
    ->Arg(1)
    ->Arg(32)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PosixPipelined4KiBReads)
    ->Arg(1)
    ->Arg(32)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// A blocking write + read of one block through the memory store: the cost of a round trip
// through an I/O thread.
void BM_MemoryStoreRoundTrip(benchmark::State& state) {
  StoreOptions options;
  options.backend = Backend::kMemory;
  auto store = CreateBlockStore(options);
  FileSpec spec;
  spec.paths = {"/bench/mem"};
  spec.direct = DirectMode::kOff;
  auto file = (*store)->Open(spec);
  std::vector<char> buf(static_cast<size_t>(state.range(0)), 7);
  for (auto _ : state) {
    benchmark::DoNotOptimize((*store)->Write(*file, 0, buf.size(), buf.data()));
    benchmark::DoNotOptimize((*store)->Read(*file, 0, buf.size(), buf.data()));
  }
  state.SetBytesProcessed(state.iterations() * 2 * state.range(0));
}
BENCHMARK(BM_MemoryStoreRoundTrip)->Arg(4096)->Arg(1 << 20)->UseRealTime();

// Mapping a 1 MiB request onto 4 striped paths with 64 KiB units.
void BM_StripeMap(benchmark::State& state) {
  StripeLayout layout(4, 64 << 10);
  std::vector<StripeSegment> segments;
  uint64_t offset = 0;
  for (auto _ : state) {
    segments.clear();
    layout.Map(offset, 1 << 20, &segments);
    benchmark::DoNotOptimize(segments.data());
    offset += 1 << 20;
  }
}
BENCHMARK(BM_StripeMap);

}  // namespace
}  // namespace strata::io

BENCHMARK_MAIN();
