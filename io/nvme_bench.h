// The nvme-bench engine: measures what a BlockStore configuration gets out of the storage behind
// one or more paths, the way the offload engine uses it (large aligned requests from a registered,
// huge-page-backed buffer region, a fixed number in flight per I/O thread).
//
// One run of RunBench() measures one configuration (block size x queue depth x threads) for the
// phases asked (write, read, or both: write then read), over one logical file striped over the
// given paths. Each phase moves the whole file once (or repeats it until `runtime` has passed),
// sequentially or in a random permutation of its blocks, keeping threads x queue_depth requests
// in flight: a completion callback immediately submits the next block from the I/O thread, so
// requests stay batched and in order. Unless the file is already fully written, an untimed pass
// lays it out first, because preallocated extents read as zeros without touching the device and
// first writes into them pay for extent conversion. With `verify`, reads check every block this
// run wrote the pattern to; in buffered mode (direct I/O off) a write phase ends with an
// fdatasync that is part of its time.
//
// The engine never prints; it reports progress through a callback and returns results. The CLI
// (`strata nvme-bench`) builds sweeps, tables, JSON and the --tune file on top of it.
//
// Thread safety: RunBench may run concurrently with itself on different files; the progress
// callback is called on the calling thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/host_memory.h"
#include "strata/block_store.h"

namespace strata {
class TraceRecorder;
}

namespace strata::io {

enum class BenchPattern : uint8_t { kSequential, kRandom };
std::string_view BenchPatternName(BenchPattern pattern);  // "seq" / "rand"

struct BenchConfig {
  // Where to benchmark: each entry is a directory (a file named `file_name` is created in it and
  // removed afterwards unless `keep`) or an existing regular file (used as it is, never removed).
  // Several entries are striped together into one logical file.
  std::vector<std::string> paths;
  std::string file_name = "strata-nvme-bench.dat";
  uint64_t size = uint64_t{1} << 30;  // logical bytes; rounded down to a multiple of `block`
  uint64_t block = 1 << 20;           // bytes per request; a multiple of 4096
  int queue_depth = 32;               // requests in flight per thread
  int threads = 1;                    // I/O threads (rings)
  bool write = true;                  // run a write phase
  bool read = true;                   // run a read phase (after the write phase if both)
  BenchPattern pattern = BenchPattern::kSequential;
  Backend backend = Backend::kAuto;
  DirectMode direct = DirectMode::kAuto;
  HugePages huge_pages = HugePages::kAuto;
  uint64_t stripe_unit = 1 << 20;
  bool register_buffers = true;  // io_uring: register the buffer region (fixed buffers)
  bool register_files = true;    // io_uring: register the file descriptors
  bool sqpoll = false;
  bool verify = false;  // write a pattern and check every byte read back
  // Through the checksumming store, as `strata train` uses it (io/checksum_store.h): writes are
  // hashed and reads checked against them. For measuring what checksums cost.
  bool checksums = false;
  bool keep = false;    // keep created files
  double runtime = 0;   // seconds per phase; 0 = one pass over the file
  uint64_t seed = 1;    // for the random order and the verify pattern
  // When set, every request of the measured phases (not of the untimed lay-out pass) is recorded
  // as a complete event (name "read"/"write", category "io", args bytes and offset) from its
  // submission to its callback, on a track per in-flight slot ("io slot <i>", i < threads x
  // queue_depth): a slot's requests run back to back, so a track never has overlapping events.
  // Each measured phase is also one event on the track "nvme-bench" (category "bench"). Not
  // owned; must outlive RunBench. Null: nothing is recorded and nothing is paid.
  TraceRecorder* trace = nullptr;
};

struct BenchProgress {
  std::string phase;  // "prepare", "write", "read"
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;  // 0 when time-limited
  double elapsed = 0;        // seconds in this phase
  double rate = 0;           // bytes/s since the phase started
};
using BenchProgressFn = std::function<void(const BenchProgress&)>;

struct LatencySummary {
  double mean_us = 0, p50_us = 0, p99_us = 0, max_us = 0;
};

struct BenchPhaseResult {
  IoOp op = IoOp::kRead;
  uint64_t bytes = 0;
  uint64_t requests = 0;
  double seconds = 0;
  LatencySummary latency;
  uint64_t device_requests = 0;    // physical requests after striping and queue-limit splitting
  uint64_t verify_mismatches = 0;  // blocks that read back different from what was written
  uint64_t verified_blocks = 0;    // blocks checked against the verify pattern

  double bytes_per_second() const { return seconds > 0 ? static_cast<double>(bytes) / seconds : 0; }
  double gb_per_second() const { return bytes_per_second() / 1e9; }            // 10^9
  double gib_per_second() const { return bytes_per_second() / 1073741824.0; }  // 2^30
  double iops() const { return seconds > 0 ? static_cast<double>(requests) / seconds : 0; }
};

struct BenchResult {
  BenchConfig config;          // as run (size rounded to the block)
  std::string backend;         // the backend actually used ("uring", "posix")
  bool direct = false;         // O_DIRECT was in effect
  std::string buffer_backing;  // "hugetlbfs", "thp", "4k"
  uint64_t buffer_huge_bytes = 0;
  uint64_t registered_buffer_bytes = 0;  // registered with every ring (io_uring fixed buffers)
  uint64_t fixed_buffer_transfers = 0;   // transfers that used them
  uint64_t transfers = 0;                // all device transfers of the run (prepare included)
  // With `checksums`: bytes hashed, the nanoseconds it took (summed over I/O threads), and reads
  // whose checksum differed (must be 0).
  uint64_t checksum_bytes = 0, checksum_ns = 0, checksum_mismatches = 0, checksum_verified = 0;
  std::vector<BenchPhaseResult> phases;
};

// Runs one configuration. Errors: InvalidArgument for a bad configuration (block not a multiple
// of 4096, size smaller than a block, no path), NotFound for a missing path, PermissionDenied for
// a read-only directory, DataLoss/ResourceExhausted/... from the I/O itself (with path and
// offset). Created files are removed on error too (unless `keep`). `cancel`, when set to true
// from another thread (e.g. a signal handler's flag), stops the run early with Cancelled.
// The file benchmarked for one entry of BenchConfig::paths: `file_name` inside it when the entry
// is a directory (then `bench_owned`: the bench created it and removes it unless `keep`), or the
// entry itself when it is a regular file. Errors: stat's errno naming the path, InvalidArgument
// for anything that is neither.
struct BenchFile {
  std::string path;
  bool bench_owned = false;
};
Result<BenchFile> ResolveBenchFile(const std::string& path, const std::string& file_name);

Result<BenchResult> RunBench(const BenchConfig& config, const BenchProgressFn& progress = nullptr,
                             const std::atomic<bool>* cancel = nullptr);

}  // namespace strata::io
