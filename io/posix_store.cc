#include "io/posix_store.h"

#include <fmt/format.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "common/log.h"
#include "io/file_store.h"
#include "io/numa.h"

namespace strata::io {
namespace {

using internal::FileStore;
using internal::Transfer;

// A pool of threads, each running one blocking transfer at a time from a shared queue.
class PosixStore final : public FileStore {
 public:
  // Workers block in one pread/pwrite each, so `threads` x `queue_depth` of them give the same
  // number of requests in flight as the io_uring backend (capped at kMaxWorkers).
  static constexpr int kMaxWorkers = 1024;

  PosixStore(const StoreOptions& options, std::shared_ptr<FaultInjector> faults)
      : FileStore(options, std::move(faults)) {}

  Status Init() {
    const int workers = static_cast<int>(std::min<int64_t>(
        kMaxWorkers, int64_t{options().threads} * int64_t{options().queue_depth}));
    for (int i = 0; i < workers; ++i) {
      // Worker i belongs to I/O "thread" i % threads, and is bound like it.
      const int group = i % options().threads;
      const int node =
          options().numa_nodes.empty()
              ? -1
              : options().numa_nodes[static_cast<size_t>(group) % options().numa_nodes.size()];
      try {
        threads_.emplace_back([this, node] { Run(node); });
      } catch (const std::system_error& e) {
        return ResourceExhaustedError(
            fmt::format("cannot start I/O worker {} of {}: {}", i + 1, workers, e.what()));
      }
    }
    return Status::Ok();
  }

  ~PosixStore() override {
    WaitIdle();
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      t.join();
  }

  std::string_view name() const override { return "posix"; }

 protected:
  void Execute(std::span<Transfer*> transfers) override {
    {
      std::lock_guard lock(mu_);
      queue_.insert(queue_.end(), transfers.begin(), transfers.end());
    }
    if (transfers.size() == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
  }

 private:
  void Run(int numa_node) {
    if (numa_node >= 0) {
      Status bound = BindCurrentThreadToNumaNode(numa_node);
      if (!bound.ok()) {
        STRATA_LOG_ONCE(warn, io, "I/O workers: cannot bind to NUMA node {}: {}", numa_node,
                        bound.message());
      }
    }
    while (true) {
      Transfer* t = nullptr;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        t = queue_.front();
        queue_.pop_front();
      }
      Perform(t);
    }
  }

  // Runs `t` to completion: issue, interpret, resubmit the remainder until finished.
  void Perform(Transfer* t) {
    while (true) {
      uint64_t length = 0;
      int64_t res = ConsultFaults(*t, &length);
      if (res == 0) {
        const int fd = t->file->fd;
        const auto offset = static_cast<off_t>(t->offset);
        ssize_t n;
        if (t->op == IoOp::kRead) {
          n = ::pread(fd, t->buffer, length, offset);
        } else if (t->durable) {
          struct iovec iov = {t->buffer, length};
          n = ::pwritev2(fd, &iov, 1, offset, RWF_DSYNC);
        } else {
          n = ::pwrite(fd, t->buffer, length, offset);
        }
        res = n >= 0 ? static_cast<int64_t>(n) : -static_cast<int64_t>(errno);
      }
      if (OnResult(t, res) == Next::kFinished) return;
      // Back off a little when the kernel keeps saying "try again".
      if (t->retries > 16) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Transfer*> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

Result<std::unique_ptr<BlockStore>> CreatePosixStore(const StoreOptions& options,
                                                     std::shared_ptr<FaultInjector> faults) {
  if (options.threads < 1) return InvalidArgumentError("I/O threads must be at least 1");
  if (options.queue_depth < 1) return InvalidArgumentError("queue depth must be at least 1");
  auto store = std::make_unique<PosixStore>(options, std::move(faults));
  STRATA_RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<BlockStore>(std::move(store));
}

}  // namespace strata::io
