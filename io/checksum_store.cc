#include "io/checksum_store.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>
#include <chrono>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "io/io_internal.h"
#include "io/store_wrapper.h"

namespace strata::io {

uint64_t Checksum64(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

Checksum64Stream::Checksum64Stream() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
Checksum64Stream::~Checksum64Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Checksum64Stream::Update(const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
uint64_t Checksum64Stream::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

std::string ChecksumHex(uint64_t checksum) { return fmt::format("{:016x}", checksum); }

namespace {

class ChecksummingStore final : public internal::StoreWrapper {
 public:
  ChecksummingStore(std::unique_ptr<BlockStore> inner, int hash_threads)
      : StoreWrapper(std::move(inner), "checksummed", "", "request(s) being checked") {
    for (int i = 0; i < hash_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  ~ChecksummingStore() override {
    {
      // Every request submitted through us has been called back, including those its callbacks
      // submitted in turn (each counts before its submitter's callback returns).
      std::unique_lock lock(pool_mu_);
      idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
      stop_ = true;
    }
    pool_cv_.notify_all();
    for (std::thread& t : workers_) t.join();
    inner_.reset();
  }

  Status Close(FileId file) override {
    STRATA_RETURN_IF_ERROR(StoreWrapper::Close(file));
    std::lock_guard lock(mu_);
    ranges_.erase(file);  // a later Open may reuse the id
    return Status::Ok();
  }

  Status Submit(std::span<IoRequest> requests) override {
    std::vector<IoRequest> forwarded(requests.begin(), requests.end());
    for (IoRequest& r : forwarded) {
      const IoOp op = r.op;
      const FileId file = r.file;
      const uint64_t offset = r.offset, length = r.length;
      const std::byte* buffer = static_cast<const std::byte*>(r.buffer);
      // The inner store's callback hands the hashing to a hash thread and returns, so the I/O
      // thread goes back to its ring at once; the caller's callback runs on the hash thread.
      r.done = [this, op, file, offset, length, buffer,
                user = std::move(r.done)](const Status& st) mutable {
        Post([this, op, file, offset, length, buffer, user = std::move(user), st] {
          Status result = st;
          if (op == IoOp::kWrite) {
            if (st.ok()) {
              Record(file, offset, length, Hash(buffer, length));
            } else {
              Forget(file, offset, length);  // the range's bytes are unknown now
            }
          } else if (st.ok()) {
            result = Verify(file, offset, length, buffer);
          }
          LetGo(file);
          user(result);
          Finished();
        });
      };
    }
    for (const IoRequest& r : forwarded) Hold(r.file);
    {
      std::lock_guard lock(pool_mu_);
      outstanding_ += forwarded.size();
    }
    Status st = inner_->Submit(forwarded);  // copies: the caller's requests stay intact
    if (!st.ok()) {
      for (const IoRequest& r : forwarded) LetGo(r.file);
      std::lock_guard lock(pool_mu_);
      outstanding_ -= forwarded.size();
      if (outstanding_ == 0) idle_cv_.notify_all();
    }
    return st;
  }

  StoreStats stats() const override {
    StoreStats s = inner_->stats();
    s.checksum_verified_reads = verified_.load(std::memory_order_relaxed);
    s.checksum_unverified_reads = unverified_.load(std::memory_order_relaxed);
    s.checksum_mismatches = mismatches_.load(std::memory_order_relaxed);
    s.checksum_bytes = hashed_bytes_.load(std::memory_order_relaxed);
    s.checksum_ns = hash_ns_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  struct Range {
    uint64_t length = 0;
    uint64_t hash = 0;
  };
  using Ranges = std::map<uint64_t, Range>;  // by offset; never overlapping

  uint64_t Hash(const std::byte* data, uint64_t length) {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t h = Checksum64({data, static_cast<size_t>(length)});
    hash_ns_.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                 std::chrono::steady_clock::now() - t0)
                                                 .count()),
                       std::memory_order_relaxed);
    hashed_bytes_.fetch_add(length, std::memory_order_relaxed);
    return h;
  }

  // Removes every range overlapping [offset, offset + length). Caller holds mu_.
  static void EraseOverlapping(Ranges& ranges, uint64_t offset, uint64_t length) {
    auto it = ranges.lower_bound(offset);
    if (it != ranges.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second.length > offset) it = prev;
    }
    while (it != ranges.end() && it->first < offset + length) it = ranges.erase(it);
  }

  void Record(FileId file, uint64_t offset, uint64_t length, uint64_t hash) {
    std::lock_guard lock(mu_);
    Ranges& ranges = ranges_[file];
    EraseOverlapping(ranges, offset, length);
    ranges.emplace(offset, Range{length, hash});
  }

  void Forget(FileId file, uint64_t offset, uint64_t length) {
    std::lock_guard lock(mu_);
    auto it = ranges_.find(file);
    if (it != ranges_.end()) EraseOverlapping(it->second, offset, length);
  }

  Status Verify(FileId file, uint64_t offset, uint64_t length, const std::byte* buffer) {
    uint64_t expected = 0;
    {
      std::lock_guard lock(mu_);
      auto f = ranges_.find(file);
      auto it = f == ranges_.end() ? Ranges::iterator() : f->second.find(offset);
      if (f == ranges_.end() || it == f->second.end() || it->second.length != length) {
        unverified_.fetch_add(1, std::memory_order_relaxed);
        return Status::Ok();
      }
      expected = it->second.hash;
    }
    const uint64_t got = Hash(buffer, length);
    if (got == expected) {
      verified_.fetch_add(1, std::memory_order_relaxed);
      return Status::Ok();
    }
    mismatches_.fetch_add(1, std::memory_order_relaxed);
    std::string where = fmt::format("file {}", file);
    if (Result<FileInfo> info = inner_->Info(file); info.ok()) where = internal::DescribePaths(*info);
    return DataLossError(fmt::format(
        "checksum mismatch reading {} at offset {} ({} bytes): the bytes read back are not the "
        "bytes written there (XXH3 {:016x} written, {:016x} read); the file was changed or the "
        "drive returned corrupted data",
        where, offset, length, expected, got));
  }

  void Post(std::function<void()> job) {
    if (workers_.empty()) {
      job();
      return;
    }
    {
      std::lock_guard lock(pool_mu_);
      jobs_.push_back(std::move(job));
    }
    pool_cv_.notify_one();
  }

  void Finished() {
    std::lock_guard lock(pool_mu_);
    if (--outstanding_ == 0) idle_cv_.notify_all();
  }

  void WorkerLoop() {
    std::unique_lock lock(pool_mu_);
    while (true) {
      pool_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_, and nothing left
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::unordered_map<FileId, Ranges> ranges_;
  // The hash threads and the requests not yet called back.
  std::mutex pool_mu_;
  std::condition_variable pool_cv_, idle_cv_;
  std::deque<std::function<void()>> jobs_;
  uint64_t outstanding_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;  // last: started after everything above exists
  std::atomic<uint64_t> verified_{0}, unverified_{0}, mismatches_{0}, hashed_bytes_{0}, hash_ns_{0};
};

}  // namespace

std::unique_ptr<BlockStore> CreateChecksummingStore(std::unique_ptr<BlockStore> inner) {
  // Two hash threads: with io_uring one I/O thread's completions arrive faster than one core
  // hashes them from memory (docs/io.md, "Checksums").
  return std::make_unique<ChecksummingStore>(std::move(inner), 2);
}

}  // namespace strata::io
