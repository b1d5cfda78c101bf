#include "io/posix_store.h"

#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/file_store.h"
#include "io/numa.h"

namespace strata::io {
namespace {

using internal::FileStore;
using internal::Transfer;

// A pool of threads, each running one blocking transfer at a time from a shared queue.
class PosixStore final : public FileStore {
 public:
  PosixStore(const StoreOptions& options, std::shared_ptr<FaultInjector> faults)
      : FileStore(options, std::move(faults)) {
    for (int i = 0; i < options.threads; ++i) {
      int node = options.numa_nodes.empty()
                     ? -1
                     : options.numa_nodes[static_cast<size_t>(i) % options.numa_nodes.size()];
      threads_.emplace_back([this, node] { Run(node); });
    }
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
    if (numa_node >= 0) BindCurrentThreadToNumaNode(numa_node).IgnoreError();
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
  return std::unique_ptr<BlockStore>(new PosixStore(options, std::move(faults)));
}

}  // namespace strata::io
