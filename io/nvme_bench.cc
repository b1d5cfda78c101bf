#include "io/nvme_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>

#include "common/errno.h"
#include "common/log.h"
#include "common/units.h"
#include "io/checksum_store.h"
#include "io/numa.h"
#include "io/stripe.h"
#include "strata/trace.h"

namespace strata::io {

std::string_view BenchPatternName(BenchPattern pattern) {
  return pattern == BenchPattern::kSequential ? "seq" : "rand";
}

namespace {

using Clock = std::chrono::steady_clock;

// TraceRecorder::NowNs() reads the same steady clock.
int64_t TraceNs(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Latencies in nanoseconds, 16 buckets per power of two (about 6% resolution), lock-free.
class LatencyHistogram {
 public:
  void Record(uint64_t ns) {
    counts_[Bucket(ns)].fetch_add(1, std::memory_order_relaxed);
    total_ns_.fetch_add(ns, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
    uint64_t seen = max_ns_.load(std::memory_order_relaxed);
    while (ns > seen && !max_ns_.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
    }
  }

  LatencySummary Summarize() const {
    LatencySummary s;
    const uint64_t n = count_.load();
    if (n == 0) return s;
    s.mean_us = static_cast<double>(total_ns_.load()) / static_cast<double>(n) / 1e3;
    s.max_us = static_cast<double>(max_ns_.load()) / 1e3;
    s.p50_us = Percentile(0.50, n) / 1e3;
    s.p99_us = Percentile(0.99, n) / 1e3;
    return s;
  }

 private:
  static constexpr int kSub = 16;
  static constexpr int kBuckets = kSub + 40 * kSub;

  static int Bucket(uint64_t ns) {
    if (ns < kSub) return static_cast<int>(ns);
    const int p = 63 - std::countl_zero(ns);  // >= 4
    const int sub = static_cast<int>(ns >> (p - 4)) - kSub;
    return std::min(kBuckets - 1, kSub + (p - 4) * kSub + sub);
  }
  // The middle of bucket b, in ns.
  static double Middle(int b) {
    if (b < kSub) return b;
    const int p = (b - kSub) / kSub + 4;
    const int sub = (b - kSub) % kSub;
    const double lo = static_cast<double>(uint64_t{static_cast<uint64_t>(kSub + sub)} << (p - 4));
    const double width = static_cast<double>(uint64_t{1} << (p - 4));
    return lo + width / 2;
  }
  double Percentile(double q, uint64_t n) const {
    const auto target = static_cast<uint64_t>(std::ceil(q * static_cast<double>(n)));
    uint64_t seen = 0;
    for (int b = 0; b < kBuckets; ++b) {
      seen += counts_[b].load(std::memory_order_relaxed);
      if (seen >= target) return Middle(b);
    }
    return static_cast<double>(max_ns_.load());
  }

  std::array<std::atomic<uint64_t>, kBuckets> counts_{};
  std::atomic<uint64_t> total_ns_{0}, count_{0}, max_ns_{0};
};

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The verify pattern of one block: a function of the seed and the block's byte offset.
void FillBlock(char* buf, uint64_t block_bytes, uint64_t block_index, uint64_t seed) {
  const uint64_t base = seed * 0x2545F4914F6CDD1DULL + block_index * block_bytes;
  for (uint64_t i = 0; i < block_bytes / 8; ++i) {
    const uint64_t word = SplitMix(base + i * 8);
    std::memcpy(buf + i * 8, &word, 8);
  }
}

bool CheckBlock(const char* buf, uint64_t block_bytes, uint64_t block_index, uint64_t seed) {
  const uint64_t base = seed * 0x2545F4914F6CDD1DULL + block_index * block_bytes;
  for (uint64_t i = 0; i < block_bytes / 8; ++i) {
    uint64_t word;
    std::memcpy(&word, buf + i * 8, 8);
    if (word != SplitMix(base + i * 8)) return false;
  }
  return true;
}

// Whether [0, size) of `path` is backed by written data: no holes and no unwritten
// (preallocated) extents, which read back as zeros without touching the device. nullopt when the
// filesystem cannot tell (no FIEMAP).
std::optional<bool> FullyWritten(const std::string& path, uint64_t size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < size) {
    ::close(fd);
    return false;
  }
  constexpr unsigned kExtents = 256;
  std::vector<char> storage(sizeof(fiemap) + kExtents * sizeof(fiemap_extent));
  auto* fm = reinterpret_cast<fiemap*>(storage.data());
  uint64_t covered = 0;  // bytes from 0 known to be written
  std::optional<bool> answer;
  while (!answer) {
    if (covered >= size) {
      answer = true;
      break;
    }
    std::memset(storage.data(), 0, storage.size());
    fm->fm_start = covered;
    fm->fm_length = size - covered;
    fm->fm_extent_count = kExtents;
    if (::ioctl(fd, FS_IOC_FIEMAP, fm) != 0) {
      answer = std::nullopt;  // cannot tell
      break;
    }
    if (fm->fm_mapped_extents == 0) {
      answer = false;  // a hole up to the end
      break;
    }
    bool last = false;
    for (unsigned i = 0; i < fm->fm_mapped_extents; ++i) {
      const fiemap_extent& e = fm->fm_extents[i];
      if (e.fe_logical > covered || (e.fe_flags & FIEMAP_EXTENT_UNWRITTEN)) {
        answer = false;  // a hole before this extent, or a preallocated one
        break;
      }
      covered = std::max<uint64_t>(covered, e.fe_logical + e.fe_length);
      last = last || (e.fe_flags & FIEMAP_EXTENT_LAST);
    }
    if (!answer && covered < size && last) answer = false;  // the extents end before `size`
  }
  ::close(fd);
  return answer;
}

// Drops the page cache of the files (buffered mode), as fio does before each job.
void InvalidateCache(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// Runs one phase: every block of the file once (or repeatedly until the deadline), with
// `slots` requests in flight, each completion submitting the next block.
class Phase {
 public:
  // `written`: one flag per block, set when a write phase with `check` wrote the verify
  // pattern to it; a read phase with `check` verifies exactly the blocks flagged.
  // `sync_at_end`: the phase ends with an fdatasync that is part of its time (buffered writes,
  // which otherwise only reach the page cache). With config.trace set, every request is
  // recorded on the track of its slot.
  Phase(BlockStore* store, FileId file, IoOp op, const BenchConfig& config, char* region,
        uint64_t nblocks, std::vector<uint64_t> order, bool check,
        std::vector<std::atomic<uint8_t>>* written, bool sync_at_end)
      : store_(store),
        file_(file),
        op_(op),
        config_(config),
        region_(region),
        nblocks_(nblocks),
        order_(std::move(order)),
        check_(check),
        written_(written),
        sync_at_end_(sync_at_end) {}

  Status Run(const std::string& name, const BenchProgressFn& progress,
             const std::atomic<bool>* cancel, BenchPhaseResult* result) {
    const uint64_t slots = std::min<uint64_t>(
        static_cast<uint64_t>(config_.threads) * static_cast<uint64_t>(config_.queue_depth),
        config_.runtime > 0 ? UINT64_MAX : nblocks_);
    const uint64_t before = store_->stats().device_requests;
    start_ = Clock::now();
    if (config_.runtime > 0) {
      deadline_ = start_ + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(config_.runtime));
    }
    cancel_ = cancel;
    std::vector<IoRequest> batch;
    batch.reserve(slots);
    for (uint64_t s = 0; s < slots; ++s) {
      uint64_t block = 0;
      if (!Next(&block)) break;
      batch.push_back(Prepare(s, block));
    }
    active_.store(batch.size());
    if (batch.empty()) return Status::Ok();
    if (config_.trace != nullptr) {
      // Created before the first submission, so completion callbacks only read it.
      slot_tracks_.reserve(batch.size());
      for (size_t s = 0; s < batch.size(); ++s)
        slot_tracks_.push_back(config_.trace->Track(fmt::format("io slot {}", s)));
    }
    Status submitted = store_->Submit(batch);
    if (!submitted.ok()) return submitted;

    // Wait, reporting progress.
    std::unique_lock lock(mu_);
    while (active_.load() != 0) {
      cv_.wait_for(lock, std::chrono::milliseconds(250));
      if (progress) {
        lock.unlock();
        BenchProgress p;
        p.phase = name;
        p.bytes_done = bytes_done_.load(std::memory_order_relaxed);
        p.bytes_total = config_.runtime > 0 ? 0 : nblocks_ * config_.block;
        p.elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
        p.rate = p.elapsed > 0 ? static_cast<double>(p.bytes_done) / p.elapsed : 0;
        progress(p);
        lock.lock();
      }
    }
    lock.unlock();
    if (sync_at_end_ && error_.ok()) {
      Status synced = store_->Sync(file_);
      end_ = Clock::now();
      if (!synced.ok()) return synced;
    }
    result->op = op_;
    result->bytes = bytes_done_.load();
    result->requests = completed_.load();
    result->seconds = std::chrono::duration<double>(end_ - start_).count();
    result->latency = latency_.Summarize();
    result->device_requests = store_->stats().device_requests - before;
    result->verify_mismatches = mismatches_.load();
    result->verified_blocks = verified_.load();
    if (config_.trace != nullptr) {
      config_.trace->Complete(
          config_.trace->Track("nvme-bench"),
          fmt::format("{} block {} qd {} threads {}", name, FormatBytesExact(config_.block),
                      config_.queue_depth, config_.threads),
          "bench", TraceNs(start_), TraceNs(std::max(start_, end_)),
          {{"bytes", static_cast<double>(result->bytes)},
           {"requests", static_cast<double>(result->requests)}});
    }
    if (cancel_ != nullptr && cancel_->load()) return CancelledError("interrupted");
    return error_;
  }

 private:
  // The next block to transfer, or false when the phase is over.
  bool Next(uint64_t* block) {
    if (stop_.load(std::memory_order_relaxed)) return false;
    if (cancel_ != nullptr && cancel_->load(std::memory_order_relaxed)) return false;
    const uint64_t i = cursor_.fetch_add(1, std::memory_order_relaxed);
    if (config_.runtime > 0) {
      if (Clock::now() >= deadline_) return false;
    } else if (i >= nblocks_) {
      return false;
    }
    const uint64_t k = i % nblocks_;
    *block = order_.empty() ? k : order_[k];
    return true;
  }

  IoRequest Prepare(uint64_t slot, uint64_t block) {
    char* buf = region_ + slot * config_.block;
    if (op_ == IoOp::kWrite && check_) FillBlock(buf, config_.block, block, config_.seed);
    IoRequest r;
    r.op = op_;
    r.file = file_;
    r.offset = block * config_.block;
    r.length = config_.block;
    r.buffer = buf;
    const Clock::time_point issued = Clock::now();
    r.done = [this, slot, block, issued](const Status& s) { Done(slot, block, issued, s); };
    return r;
  }

  void Done(uint64_t slot, uint64_t block, Clock::time_point issued, const Status& s) {
    const Clock::time_point now = Clock::now();
    latency_.Record(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - issued).count()));
    if (config_.trace != nullptr) {
      config_.trace->Complete(slot_tracks_[slot], IoOpName(op_), "io", TraceNs(issued),
                              TraceNs(now),
                              {{"bytes", static_cast<double>(config_.block)},
                               {"offset", static_cast<double>(block * config_.block)}});
    }
    if (!s.ok()) {
      Fail(s);
    } else {
      if (check_ && op_ == IoOp::kWrite) {
        (*written_)[block].store(1, std::memory_order_relaxed);
      } else if (check_ && (*written_)[block].load(std::memory_order_relaxed) != 0) {
        verified_.fetch_add(1, std::memory_order_relaxed);
        if (!CheckBlock(region_ + slot * config_.block, config_.block, block, config_.seed)) {
          mismatches_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      bytes_done_.fetch_add(config_.block, std::memory_order_relaxed);
      completed_.fetch_add(1, std::memory_order_relaxed);
    }
    uint64_t next = 0;
    if (Next(&next)) {
      IoRequest r = Prepare(slot, next);
      Status st = store_->Submit(r);
      if (st.ok()) return;
      Fail(st);
    }
    // This slot retires.
    std::lock_guard lock(mu_);
    end_ = std::max(end_, now);
    if (active_.fetch_sub(1) == 1) cv_.notify_all();
  }

  void Fail(const Status& s) {
    std::lock_guard lock(mu_);
    if (error_.ok()) error_ = s;
    stop_.store(true);
  }

  BlockStore* store_;
  FileId file_;
  IoOp op_;
  const BenchConfig& config_;
  char* region_;
  uint64_t nblocks_;
  std::vector<uint64_t> order_;
  bool check_;
  std::vector<std::atomic<uint8_t>>* written_;
  bool sync_at_end_;
  const std::atomic<bool>* cancel_ = nullptr;
  std::vector<uint32_t> slot_tracks_;  // trace track of each slot; empty without a trace

  Clock::time_point start_, deadline_;
  Clock::time_point end_{};  // guarded by mu_
  std::atomic<uint64_t> cursor_{0}, bytes_done_{0}, completed_{0}, mismatches_{0}, verified_{0},
      active_{0};
  std::atomic<bool> stop_{false};
  LatencyHistogram latency_;
  std::mutex mu_;
  std::condition_variable cv_;
  Status error_;  // guarded by mu_
};

Status ValidateConfig(const BenchConfig& c) {
  if (c.paths.empty())
    return InvalidArgumentError("no path to benchmark (give at least one --path)");
  if (c.block == 0 || c.block % kDirectIoAlignment != 0) {
    return InvalidArgumentError(
        fmt::format("block size {} is not a multiple of 4 KiB (4096 bytes)", c.block));
  }
  if (c.size < c.block) {
    return InvalidArgumentError(fmt::format("size {} ({}) is smaller than one block of {}", c.size,
                                            FormatBytes(c.size), FormatBytesExact(c.block)));
  }
  if (c.queue_depth < 1) {
    return InvalidArgumentError(
        fmt::format("queue depth must be at least 1, got {}", c.queue_depth));
  }
  if (c.threads < 1) {
    return InvalidArgumentError(fmt::format("threads must be at least 1, got {}", c.threads));
  }
  if (!c.read && !c.write) return InvalidArgumentError("nothing to do: neither read nor write");
  if (c.runtime < 0) return InvalidArgumentError("runtime must not be negative");
  if (c.paths.size() > 1 && (c.stripe_unit == 0 || c.stripe_unit % kDirectIoAlignment != 0)) {
    return InvalidArgumentError(
        fmt::format("stripe unit {} is not a multiple of 4 KiB (4096 bytes)", c.stripe_unit));
  }
  return Status::Ok();
}

}  // namespace

Result<BenchFile> ResolveBenchFile(const std::string& path, const std::string& file_name) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return ErrnoToStatus(errno, path);
  if (S_ISDIR(st.st_mode)) {
    return BenchFile{path + (path.back() == '/' ? "" : "/") + file_name, true};
  }
  if (S_ISREG(st.st_mode)) return BenchFile{path, false};
  return InvalidArgumentError(fmt::format("{} is neither a directory nor a regular file", path));
}

Result<BenchResult> RunBench(const BenchConfig& config_in, const BenchProgressFn& progress,
                             const std::atomic<bool>* cancel) {
  STRATA_RETURN_IF_ERROR(ValidateConfig(config_in));
  BenchResult result;
  result.config = config_in;
  BenchConfig& config = result.config;
  config.size = config.size / config.block * config.block;
  const uint64_t nblocks = config.size / config.block;

  // Resolve each path to a file: a directory gets `file_name` inside it.
  std::vector<std::string> files;
  std::vector<std::string> created;  // files this run may remove
  for (const std::string& p : config.paths) {
    STRATA_ASSIGN_OR_RETURN(BenchFile f, ResolveBenchFile(p, config.file_name));
    files.push_back(f.path);
    if (f.bench_owned) created.push_back(f.path);
  }
  auto cleanup = [&] {
    if (config.keep) return;
    for (const auto& f : created)
      ::unlink(f.c_str());
  };

  // The buffers are allocated before the store so that they outlive it: registered memory must
  // stay mapped until the store is gone.
  const uint64_t slots =
      static_cast<uint64_t>(config.threads) * static_cast<uint64_t>(config.queue_depth);
  Result<HostRegion> region_or = HostRegion::Allocate(slots * config.block, config.huge_pages);
  if (!region_or.ok()) return region_or.status();
  HostRegion region = std::move(region_or).value();
  result.buffer_backing = std::string(HostBackingName(region.backing()));
  result.buffer_huge_bytes = region.huge_page_bytes();
  // Incompressible contents for writes that are not verified.
  {
    std::mt19937_64 rng(config.seed);
    for (size_t i = 0; i + 8 <= region.size(); i += 8) {
      const uint64_t word = rng();
      std::memcpy(region.data() + i, &word, 8);
    }
  }
  StoreOptions options;
  options.backend = config.backend;
  options.threads = config.threads;
  options.queue_depth = config.queue_depth;
  options.sqpoll = config.sqpoll;
  options.register_buffers = config.register_buffers;
  options.register_files = config.register_files;
  // Bind the I/O threads near the drives: thread i to the NUMA node of path i (round-robin).
  for (const std::string& p : config.paths) {
    const int node = NumaNodeOfPath(p);
    if (node >= 0) options.numa_nodes.push_back(node);
  }
  if (options.numa_nodes.size() != config.paths.size()) options.numa_nodes.clear();
  Result<std::unique_ptr<BlockStore>> store_or = CreateBlockStore(options);
  if (!store_or.ok()) return store_or.status();
  std::unique_ptr<BlockStore> store = std::move(store_or).value();
  result.backend = std::string(store->name());
  if (config.checksums) store = CreateChecksummingStore(std::move(store));

  BufferRange range{region.data(), region.size(), region.fully_huge()};
  STRATA_RETURN_IF_ERROR(store->RegisterBuffers({&range, 1}));

  FileSpec spec;
  spec.paths = files;
  spec.stripe_unit = config.stripe_unit;
  spec.direct = config.direct;
  spec.preallocate = config.size;
  Result<FileId> file_or = store->Open(spec);
  if (!file_or.ok()) {
    cleanup();
    return file_or.status();
  }
  const FileId file = *file_or;
  result.direct = store->Info(file)->direct;

  std::vector<uint64_t> order;
  if (config.pattern == BenchPattern::kRandom) {
    order.resize(nblocks);
    std::iota(order.begin(), order.end(), uint64_t{0});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(config.seed));
  }

  // Which blocks hold the verify pattern written by this run (the read phase checks those).
  std::vector<std::atomic<uint8_t>> written(config.verify ? nblocks : 0);
  auto run_phase = [&](const BenchConfig& phase_config, IoOp op, const std::string& name,
                       bool record, const std::vector<uint64_t>& phase_order) -> Status {
    if (!result.direct) InvalidateCache(files);
    const bool sync_at_end = !result.direct && op == IoOp::kWrite;
    Phase phase(store.get(), file, op, phase_config, region.data(), nblocks, phase_order,
                config.verify, &written, sync_at_end);
    BenchPhaseResult r;
    STRATA_RETURN_IF_ERROR(phase.Run(name, progress, cancel, &r));
    if (record) result.phases.push_back(r);
    return Status::Ok();
  };

  // Every measured phase works on a laid-out file: reads of unwritten (preallocated) extents
  // never touch the device, and first writes into them cost extent conversions that later
  // writes do not pay. So unless every byte is already written, one untimed pass writes the
  // file first. A file given by the user is only rewritten when it is known to have holes or
  // unwritten extents (which read as zeros anyway), or to hold the verify pattern.
  const StripeLayout layout(static_cast<uint32_t>(files.size()), config.stripe_unit);
  bool laid_out = true;
  for (size_t i = 0; i < files.size() && laid_out; ++i) {
    const bool ours = std::find(created.begin(), created.end(), files[i]) != created.end();
    std::optional<bool> full =
        FullyWritten(files[i], layout.PathBytes(static_cast<uint32_t>(i), config.size));
    laid_out = full.value_or(!ours);
  }
  Status st;
  if (!laid_out || (config.verify && !config.write)) {
    BenchConfig prep = config;
    prep.runtime = 0;      // one whole pass, however long
    prep.trace = nullptr;  // untimed: not part of the measurement
    st = run_phase(prep, IoOp::kWrite, "prepare", false, {});
  }
  if (st.ok() && config.write) st = run_phase(config, IoOp::kWrite, "write", true, order);
  if (st.ok() && config.read) st = run_phase(config, IoOp::kRead, "read", true, order);
  {
    const StoreStats stats = store->stats();
    result.registered_buffer_bytes = stats.registered_buffer_bytes;
    result.fixed_buffer_transfers = stats.fixed_buffer_transfers;
    result.transfers = stats.device_requests;
    result.checksum_bytes = stats.checksum_bytes;
    result.checksum_ns = stats.checksum_ns;
    result.checksum_mismatches = stats.checksum_mismatches;
    result.checksum_verified = stats.checksum_verified_reads;
  }
  Status closed = store->Close(file);
  if (st.ok()) st = closed;
  store.reset();
  if (!st.ok()) {
    cleanup();
    return st;
  }
  cleanup();
  for (const BenchPhaseResult& p : result.phases) {
    if (p.verify_mismatches > 0) {
      return DataLossError(
          fmt::format("verify: {} of {} checked blocks read back differently from what was "
                      "written to {}",
                      p.verify_mismatches, p.verified_blocks, fmt::join(files, ", ")));
    }
  }
  return result;
}

}  // namespace strata::io
