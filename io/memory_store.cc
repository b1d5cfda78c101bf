#include "io/memory_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/errno.h"
#include "io/io_internal.h"

namespace strata::io {
namespace {

class MemoryStore final : public BlockStore {
 public:
  explicit MemoryStore(std::shared_ptr<FaultInjector> faults) : faults_(std::move(faults)) {}

  Status Init(int threads) {
    for (int i = 0; i < threads; ++i) {
      try {
        threads_.emplace_back([this] { Run(); });
      } catch (const std::system_error& e) {
        return ResourceExhaustedError(
            fmt::format("cannot start memory-store thread: {}", e.what()));
      }
    }
    return Status::Ok();
  }

  ~MemoryStore() override {
    {
      std::unique_lock lock(queue_mu_);
      idle_cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
      stop_ = true;
    }
    queue_cv_.notify_all();
    for (auto& t : threads_)
      t.join();
  }

  std::string_view name() const override { return "memory"; }

  Result<FileId> Open(const FileSpec& spec) override {
    STRATA_RETURN_IF_ERROR(internal::ValidateFileSpec(spec));
    std::string key;
    for (const auto& p : spec.paths)
      key += p + '\n';
    std::unique_lock lock(table_mu_);
    auto it = contents_.find(key);
    if (it == contents_.end()) {
      if (!spec.create || spec.read_only) {
        return NotFoundError(
            fmt::format("cannot open {}: no such file in the memory store", spec.paths.front()));
      }
      it = contents_.emplace(key, std::make_shared<Content>()).first;
    }
    std::shared_ptr<Content> content = it->second;
    {
      std::lock_guard data_lock(content->mu);
      if (spec.truncate && !spec.read_only) content->bytes.clear();
      if (spec.preallocate > content->bytes.size() && !spec.read_only) {
        content->bytes.resize(spec.preallocate, 0);
      }
    }
    auto file = std::make_unique<OpenFile>();
    file->info.paths = spec.paths;
    file->info.stripe_unit = spec.paths.size() > 1 ? spec.stripe_unit : 0;
    // Like an NVMe file under O_DIRECT unless direct I/O is off, so alignment bugs show up here.
    file->info.direct = spec.direct != DirectMode::kOff;
    file->info.alignment = file->info.direct ? kDirectIoAlignment : 1;
    file->info.read_only = spec.read_only;
    file->where = internal::DescribePaths(file->info);
    file->content = std::move(content);
    const FileId id = next_id_++;
    files_.emplace(id, std::move(file));
    return id;
  }

  Status Close(FileId id) override {
    std::unique_lock lock(table_mu_);
    auto it = files_.find(id);
    if (it == files_.end())
      return NotFoundError(fmt::format("cannot close file id {}: it is not open", id));
    const int64_t outstanding = it->second->outstanding.load();
    if (outstanding != 0) {
      return FailedPreconditionError(
          fmt::format("cannot close {}: {} request(s) on it have not completed", it->second->where,
                      outstanding));
    }
    files_.erase(it);
    return Status::Ok();
  }

  Result<FileInfo> Info(FileId id) const override {
    std::shared_lock lock(table_mu_);
    auto it = files_.find(id);
    if (it == files_.end()) return NotFoundError(fmt::format("file id {} is not open", id));
    return it->second->info;
  }

  Status Submit(std::span<IoRequest> requests) override {
    std::vector<Job> jobs;
    {
      std::shared_lock lock(table_mu_);
      std::vector<OpenFile*> targets;
      for (const IoRequest& r : requests) {
        auto it = files_.find(r.file);
        if (it == files_.end()) {
          return NotFoundError(fmt::format("{} at offset {}: file id {} is not open",
                                           IoOpName(r.op), r.offset, r.file));
        }
        STRATA_RETURN_IF_ERROR(internal::ValidateRequest(r, it->second->info, it->second->where));
        targets.push_back(it->second.get());
      }
      for (size_t i = 0; i < requests.size(); ++i) {
        targets[i]->outstanding.fetch_add(1);
        busy_.Enter();
        jobs.push_back({std::move(requests[i]), targets[i]});
      }
    }
    {
      std::lock_guard stats_lock(stats_mu_);
      stats_.device_requests += jobs.size();
    }
    {
      std::lock_guard lock(queue_mu_);
      for (Job& j : jobs)
        queue_.push_back(std::move(j));
    }
    queue_cv_.notify_all();
    return Status::Ok();
  }

  Status Sync(FileId id) override { return Info(id).status(); }
  // Nothing to register in memory; the ranges are remembered only to honour the contract.
  Status RegisterBuffers(std::span<const BufferRange> ranges) override {
    std::lock_guard lock(stats_mu_);
    for (const BufferRange& r : ranges) {
      if (r.base == nullptr || r.length == 0) {
        return InvalidArgumentError("cannot register an empty buffer range");
      }
      const char* b = static_cast<const char*>(r.base);
      for (const auto& [base, length] : registered_) {
        const char* e = static_cast<const char*>(base);
        if (b < e + length && e < b + r.length) {
          return InvalidArgumentError(
              fmt::format("buffer range {} (+{} bytes) overlaps a registered range at {}", r.base,
                          r.length, base));
        }
      }
      registered_.emplace(r.base, r.length);
    }
    return Status::Ok();
  }
  Status UnregisterBuffers(const void* base) override {
    std::lock_guard lock(stats_mu_);
    if (registered_.erase(base) == 0) {
      return NotFoundError(fmt::format("no registered buffer range starts at {}", base));
    }
    return Status::Ok();
  }

  StoreStats stats() const override {
    StoreStats s;
    {
      std::lock_guard lock(stats_mu_);
      s = stats_;
    }
    s.busy_ns = busy_.TotalNs();
    return s;
  }

 private:
  struct Content {
    std::mutex mu;
    std::vector<char> bytes;
  };
  struct OpenFile {
    FileInfo info;
    std::string where;
    std::shared_ptr<Content> content;
    std::atomic<int64_t> outstanding{0};
  };
  struct Job {
    IoRequest request;
    OpenFile* file;
  };

  void Run() {
    while (true) {
      Job job;
      {
        std::unique_lock lock(queue_mu_);
        queue_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
        ++running_;
      }
      Status st = Perform(job);
      {
        std::lock_guard lock(stats_mu_);
        if (!st.ok()) {
          ++stats_.errors;
        } else if (job.request.op == IoOp::kRead) {
          ++stats_.reads;
          stats_.bytes_read += job.request.length;
        } else {
          ++stats_.writes;
          stats_.bytes_written += job.request.length;
        }
      }
      job.file->outstanding.fetch_sub(1);
      job.request.done(st);
      busy_.Leave();
      {
        std::lock_guard lock(queue_mu_);
        --running_;
        if (queue_.empty() && running_ == 0) idle_cv_.notify_all();
      }
    }
  }

  // Moves the bytes, in "transfers" that the fault injector may fail or shorten, exactly like the
  // file backends do.
  Status Perform(const Job& job) {
    const IoRequest& r = job.request;
    const std::string& path = job.file->info.paths.front();
    auto describe = [&] {
      return internal::DescribeTransfer(r.op, job.file->where, r.offset, r.length);
    };
    uint64_t done = 0;
    uint32_t retries = 0;
    char* buf = static_cast<char*>(r.buffer);
    while (done < r.length) {
      uint64_t n = r.length - done;
      if (faults_) {
        FaultDecision d = faults_->Decide(r.op, path, r.offset + done, n, job.file->info.alignment);
        if (d.error == EAGAIN || d.error == EINTR) {
          if (++retries > 10000) return UnavailableError(describe() + ": retries exhausted");
          std::lock_guard lock(stats_mu_);
          ++stats_.retries;
          continue;
        }
        if (d.error != 0) return ErrnoToStatus(d.error, describe());
        if (d.length < n) {
          n = d.length;
          std::lock_guard lock(stats_mu_);
          ++stats_.short_transfers;
        }
      }
      Content& c = *job.file->content;
      std::lock_guard lock(c.mu);
      const uint64_t at = r.offset + done;
      if (r.op == IoOp::kRead) {
        if (at + n > c.bytes.size()) {
          return OutOfRangeError(
              fmt::format("{}: end of file at offset {} (the file is shorter than the range)",
                          describe(), std::max<uint64_t>(c.bytes.size(), r.offset)));
        }
        std::memcpy(buf + done, c.bytes.data() + at, n);
      } else {
        if (at + n > c.bytes.size()) c.bytes.resize(at + n, 0);
        std::memcpy(c.bytes.data() + at, buf + done, n);
      }
      done += n;
    }
    return Status::Ok();
  }

  std::shared_ptr<FaultInjector> faults_;

  mutable std::shared_mutex table_mu_;
  std::map<std::string, std::shared_ptr<Content>> contents_;
  std::unordered_map<FileId, std::unique_ptr<OpenFile>> files_;
  FileId next_id_ = 1;

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::condition_variable idle_cv_;
  std::deque<Job> queue_;
  int running_ = 0;
  bool stop_ = false;

  mutable std::mutex stats_mu_;  // guards stats_ and registered_
  StoreStats stats_;
  internal::BusyClock busy_;  // StoreStats::busy_ns
  std::map<const void*, size_t> registered_;  // base -> length

  std::vector<std::thread> threads_;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> CreateMemoryStore(const StoreOptions& options,
                                                      std::shared_ptr<FaultInjector> faults) {
  if (options.threads < 1) return InvalidArgumentError("I/O threads must be at least 1");
  auto store = std::make_unique<MemoryStore>(std::move(faults));
  STRATA_RETURN_IF_ERROR(store->Init(options.threads));
  return std::unique_ptr<BlockStore>(std::move(store));
}

}  // namespace strata::io
