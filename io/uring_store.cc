#include "io/uring_store.h"

#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "common/errno.h"
#include "common/log.h"
#include "io/file_store.h"
#include "io/numa.h"

namespace strata::io {
namespace {

using internal::FileStore;
using internal::PhysicalFile;
using internal::Transfer;

constexpr int kMaxRegisteredFiles = 1024;

struct RingFlags {
  unsigned flags;
  const char* name;
};

// Tried in order; the first one the kernel accepts wins (each is a fallback for the previous).
std::vector<RingFlags> FlagCandidates(bool sqpoll) {
  std::vector<RingFlags> out;
  if (sqpoll) {
    out.push_back({IORING_SETUP_SQPOLL | IORING_SETUP_SINGLE_ISSUER, "SQPOLL|SINGLE_ISSUER"});
    out.push_back({IORING_SETUP_SQPOLL, "SQPOLL"});
  }
  out.push_back(
      {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, "SINGLE_ISSUER|DEFER_TASKRUN"});
  out.push_back({IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
                 "SINGLE_ISSUER|COOP_TASKRUN"});
  out.push_back({IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG, "COOP_TASKRUN"});
  out.push_back({0, "none"});
  return out;
}

unsigned NextPow2(unsigned v) {
  unsigned p = 1;
  while (p < v)
    p <<= 1;
  return p;
}

class UringStore;

// One I/O thread and its ring. Every ring operation, registration included, happens on the
// thread itself (SINGLE_ISSUER and DEFER_TASKRUN require it).
class UringWorker {
 public:
  UringWorker(UringStore* store, int index, int numa_node, unsigned depth, bool sqpoll)
      : store_(store), index_(index), numa_node_(numa_node), depth_(depth), sqpoll_(sqpoll) {}
  ~UringWorker() { Stop(); }

  // Starts the thread and waits for its ring. On error the thread has exited.
  Status Start();
  void Stop();

  // Queues transfers from any thread.
  void Post(std::span<Transfer*> transfers);
  // Queues transfers from this worker's own thread (a completion callback): no lock, no wake-up;
  // they go out with the next batch.
  void PostLocal(std::span<Transfer*> transfers) {
    pending_.insert(pending_.end(), transfers.begin(), transfers.end());
  }
  // Runs `fn(ring)` on the worker thread and returns its result.
  int RunOnRing(const std::function<int(io_uring*)>& fn);

  UringStore* store() const { return store_; }
  const char* flags_name() const { return flags_name_; }
  bool files_ok() const { return files_ok_; }
  bool buffers_ok() const { return buffers_ok_; }

 private:
  void ThreadMain(std::promise<Status>* ready);
  Status SetupRing();
  void Loop();
  void Wake();
  void DrainIncoming();
  void FillSubmissionQueue();
  bool ArmEventRead();
  void Reap();
  void Prep(io_uring_sqe* sqe, Transfer* t, uint64_t length);

  UringStore* const store_;
  const int index_;
  const int numa_node_;
  const unsigned depth_;
  const bool sqpoll_;

  std::thread thread_;
  io_uring ring_{};
  bool ring_ready_ = false;
  int event_fd_ = -1;
  uint64_t event_value_ = 0;
  bool event_armed_ = false;
  const char* flags_name_ = "none";
  bool files_ok_ = false;
  bool buffers_ok_ = false;

  // Shared with posting threads.
  std::mutex mu_;
  std::vector<Transfer*> incoming_;
  std::deque<std::function<void()>> controls_;
  bool wake_pending_ = false;
  bool stop_ = false;

  // Owned by the worker thread.
  std::deque<Transfer*> pending_;
  unsigned in_flight_ = 0;
  int consecutive_enter_errors_ = 0;
};

thread_local UringWorker* tls_worker = nullptr;

class UringStore final : public FileStore {
 public:
  UringStore(const StoreOptions& options, std::shared_ptr<FaultInjector> faults)
      : FileStore(options, std::move(faults)) {}

  ~UringStore() override {
    WaitIdle();
    for (auto& w : workers_)
      w->Stop();
  }

  Status Init() {
    const auto depth = static_cast<unsigned>(options().queue_depth);
    for (int i = 0; i < options().threads; ++i) {
      const int node =
          options().numa_nodes.empty()
              ? -1
              : options().numa_nodes[static_cast<size_t>(i) % options().numa_nodes.size()];
      workers_.push_back(std::make_unique<UringWorker>(this, i, node, depth, options().sqpoll));
      STRATA_RETURN_IF_ERROR(workers_.back()->Start());
    }
    files_ok_ = options().register_files;
    buffers_ok_ = options().register_buffers;
    for (auto& w : workers_) {
      files_ok_ = files_ok_ && w->files_ok();
      buffers_ok_ = buffers_ok_ && w->buffers_ok();
    }
    STRATA_LOG_ONCE(debug, io,
                    "io_uring: {} ring(s) of depth {}, setup flags {}, registered files {}, "
                    "registered buffers {}",
                    workers_.size(), depth, workers_[0]->flags_name(), files_ok_ ? "yes" : "no",
                    buffers_ok_ ? "yes" : "no");
    return Status::Ok();
  }

  std::string_view name() const override { return "uring"; }

  bool use_fixed_files() const { return files_ok_; }
  bool use_fixed_buffers() const { return buffers_ok_; }

  // Exposed to the worker: the FileStore hooks it needs.
  Next Result(Transfer* t, int64_t res) { return OnResult(t, res); }
  int64_t Faults(const Transfer& t, uint64_t* length) { return ConsultFaults(t, length); }
  void Fatal(const Status& s) { SetFatal(s); }

 protected:
  void Execute(std::span<Transfer*> transfers) override {
    if (tls_worker != nullptr && tls_worker->store() == this) {
      tls_worker->PostLocal(transfers);
      return;
    }
    if (workers_.size() == 1) {
      workers_[0]->Post(transfers);
      return;
    }
    // Round-robin by logical request: all transfers of one request go to the same ring.
    std::vector<std::vector<Transfer*>> buckets(workers_.size());
    size_t i = 0;
    while (i < transfers.size()) {
      size_t j = i + 1;
      while (j < transfers.size() && transfers[j]->request == transfers[i]->request)
        ++j;
      const size_t w = next_worker_.fetch_add(1, std::memory_order_relaxed) % workers_.size();
      buckets[w].insert(buckets[w].end(), transfers.begin() + static_cast<std::ptrdiff_t>(i),
                        transfers.begin() + static_cast<std::ptrdiff_t>(j));
      i = j;
    }
    for (size_t w = 0; w < buckets.size(); ++w) {
      if (!buckets[w].empty()) workers_[w]->Post(buckets[w]);
    }
  }

  Status OnFileOpened(PhysicalFile& file) override {
    if (!files_ok_) return Status::Ok();
    int slot = -1;
    {
      std::lock_guard lock(slot_mu_);
      if (free_slots_.empty() && next_slot_ < kMaxRegisteredFiles)
        free_slots_.push_back(next_slot_++);
      if (!free_slots_.empty()) {
        slot = free_slots_.back();
        free_slots_.pop_back();
      }
    }
    if (slot < 0) return Status::Ok();  // table full: use the plain descriptor
    const int fd = file.fd;
    bool ok = true;
    for (auto& w : workers_) {
      int r = w->RunOnRing([&](io_uring* ring) {
        return io_uring_register_files_update(ring, static_cast<unsigned>(slot), &fd, 1);
      });
      if (r < 0) {
        ok = false;
        STRATA_LOG_ONCE(warn, io, "io_uring: registering {} failed ({}); using plain descriptors",
                        file.path, ErrnoText(-r));
        break;
      }
    }
    if (ok) {
      file.slot = slot;
    } else {
      ReleaseSlot(slot);
    }
    return Status::Ok();
  }

  void OnFileClosing(PhysicalFile& file) override {
    if (file.slot < 0) return;
    ReleaseSlot(file.slot);
    file.slot = -1;
  }

  bool RegisterBufferChunks(std::span<const struct iovec> chunks, int first_index) override {
    if (!buffers_ok_) return false;
    for (size_t k = 0; k < workers_.size(); ++k) {
      int r = workers_[k]->RunOnRing([&](io_uring* ring) {
        return io_uring_register_buffers_update_tag(ring, static_cast<unsigned>(first_index),
                                                    chunks.data(), nullptr,
                                                    static_cast<unsigned>(chunks.size()));
      });
      if (r < 0) {
        STRATA_LOG(warn, io,
                   "io_uring: registering {} buffer chunk(s) failed ({}); those buffers are used "
                   "unregistered (raise RLIMIT_MEMLOCK, e.g. `ulimit -l unlimited`, to register)",
                   chunks.size(), ErrnoText(-r));
        // Clear what the earlier rings registered, so every ring agrees.
        std::vector<struct iovec> empty(chunks.size(), iovec{nullptr, 0});
        for (size_t j = 0; j < k; ++j) {
          workers_[j]->RunOnRing([&](io_uring* ring) {
            return io_uring_register_buffers_update_tag(ring, static_cast<unsigned>(first_index),
                                                        empty.data(), nullptr,
                                                        static_cast<unsigned>(empty.size()));
          });
        }
        return false;
      }
    }
    return true;
  }

 private:
  void ReleaseSlot(int slot) {
    const int minus_one = -1;
    for (auto& w : workers_) {
      w->RunOnRing([&](io_uring* ring) {
        return io_uring_register_files_update(ring, static_cast<unsigned>(slot), &minus_one, 1);
      });
    }
    std::lock_guard lock(slot_mu_);
    free_slots_.push_back(slot);
  }

  std::vector<std::unique_ptr<UringWorker>> workers_;
  std::atomic<size_t> next_worker_{0};
  bool files_ok_ = false;
  bool buffers_ok_ = false;
  std::mutex slot_mu_;
  std::vector<int> free_slots_;
  int next_slot_ = 0;
};

// --- UringWorker ---------------------------------------------------------------------------

Status UringWorker::Start() {
  std::promise<Status> ready;
  std::future<Status> result = ready.get_future();
  thread_ = std::thread([this, &ready] { ThreadMain(&ready); });
  Status st = result.get();
  if (!st.ok()) {
    thread_.join();
    return st;
  }
  return Status::Ok();
}

void UringWorker::Stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
}

void UringWorker::Wake() {
  uint64_t one = 1;
  // Cannot fail short of a broken descriptor; the worker would then notice nothing, so log it.
  if (::write(event_fd_, &one, sizeof(one)) != static_cast<ssize_t>(sizeof(one))) {
    STRATA_LOG(error, io, "io_uring worker {}: eventfd write failed: {}", index_, ErrnoText(errno));
  }
}

void UringWorker::Post(std::span<Transfer*> transfers) {
  bool wake;
  {
    std::lock_guard lock(mu_);
    incoming_.insert(incoming_.end(), transfers.begin(), transfers.end());
    wake = !wake_pending_;
    wake_pending_ = true;
  }
  if (wake) Wake();
}

int UringWorker::RunOnRing(const std::function<int(io_uring*)>& fn) {
  if (tls_worker == this) return fn(&ring_);
  std::promise<int> done;
  std::future<int> result = done.get_future();
  bool wake;
  {
    std::lock_guard lock(mu_);
    controls_.push_back([&] { done.set_value(fn(&ring_)); });
    wake = !wake_pending_;
    wake_pending_ = true;
  }
  if (wake) Wake();
  return result.get();
}

Status UringWorker::SetupRing() {
  const unsigned entries = NextPow2(depth_ + 1);  // + the eventfd read
  int last_error = 0;
  for (const RingFlags& candidate : FlagCandidates(sqpoll_)) {
    io_uring_params params{};
    params.flags = candidate.flags | IORING_SETUP_CQSIZE | IORING_SETUP_CLAMP;
    params.cq_entries = entries * 2;
    if (candidate.flags & IORING_SETUP_SQPOLL) params.sq_thread_idle = 2000;
    int r = io_uring_queue_init_params(entries, &ring_, &params);
    if (r == -EINVAL) {
      last_error = -r;
      continue;  // an unknown flag on this kernel: try the next combination
    }
    if (r < 0) {
      return ErrnoToStatus(-r, "io_uring_setup");
    }
    flags_name_ = candidate.name;
    ring_ready_ = true;
    break;
  }
  if (!ring_ready_) return ErrnoToStatus(last_error, "io_uring_setup (every flag combination)");

  event_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (event_fd_ < 0) return ErrnoToStatus(errno, "eventfd");

  files_ok_ = io_uring_register_files_sparse(&ring_, kMaxRegisteredFiles) == 0;
  buffers_ok_ = io_uring_register_buffers_sparse(
                    &ring_, static_cast<unsigned>(FileStore::kMaxBufferSlots)) == 0;
  return Status::Ok();
}

void UringWorker::ThreadMain(std::promise<Status>* ready) {
  if (numa_node_ >= 0) {
    Status bound = BindCurrentThreadToNumaNode(numa_node_);
    if (!bound.ok()) {
      STRATA_LOG(warn, io, "I/O thread {}: cannot bind to NUMA node {}: {}", index_, numa_node_,
                 bound.message());
    }
  }
  Status st = SetupRing();
  if (!st.ok()) {
    if (ring_ready_) io_uring_queue_exit(&ring_);
    if (event_fd_ >= 0) ::close(event_fd_);
    ring_ready_ = false;
    event_fd_ = -1;
    ready->set_value(std::move(st));
    return;
  }
  tls_worker = this;
  ready->set_value(Status::Ok());
  Loop();
  tls_worker = nullptr;
  io_uring_queue_exit(&ring_);
  ::close(event_fd_);
}

void UringWorker::DrainIncoming() {
  std::deque<std::function<void()>> controls;
  {
    std::lock_guard lock(mu_);
    pending_.insert(pending_.end(), incoming_.begin(), incoming_.end());
    incoming_.clear();
    controls.swap(controls_);
  }
  for (auto& c : controls)
    c();
}

bool UringWorker::ArmEventRead() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) return false;
  io_uring_prep_read(sqe, event_fd_, &event_value_, sizeof(event_value_), 0);
  io_uring_sqe_set_data(sqe, &event_value_);
  event_armed_ = true;
  return true;
}

void UringWorker::Prep(io_uring_sqe* sqe, Transfer* t, uint64_t length) {
  auto* s = static_cast<UringStore*>(store_);
  const bool fixed_file = t->file->slot >= 0 && s->use_fixed_files();
  const int fd = fixed_file ? t->file->slot : t->file->fd;
  const auto len = static_cast<unsigned>(length);
  if (t->buf_index >= 0 && s->use_fixed_buffers()) {
    if (t->op == IoOp::kRead) {
      io_uring_prep_read_fixed(sqe, fd, t->buffer, len, t->offset, t->buf_index);
    } else {
      io_uring_prep_write_fixed(sqe, fd, t->buffer, len, t->offset, t->buf_index);
    }
  } else if (t->op == IoOp::kRead) {
    io_uring_prep_read(sqe, fd, t->buffer, len, t->offset);
  } else {
    io_uring_prep_write(sqe, fd, t->buffer, len, t->offset);
  }
  if (t->durable) sqe->rw_flags = RWF_DSYNC;
  if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, t);
}

void UringWorker::FillSubmissionQueue() {
  auto* s = static_cast<UringStore*>(store_);
  if (!event_armed_ && !ArmEventRead()) return;
  // Transfers whose injected fault asked for a retry go to the back, so a persistent EAGAIN
  // does not spin on the front of the queue.
  size_t budget = pending_.size();
  while (!pending_.empty() && in_flight_ < depth_ && budget-- > 0) {
    Transfer* t = pending_.front();
    uint64_t length = 0;
    const int64_t injected = s->Faults(*t, &length);
    if (injected < 0) {
      pending_.pop_front();
      if (s->Result(t, injected) == FileStore::Next::kResubmit) pending_.push_back(t);
      continue;
    }
    // Requests larger than 4 GiB - 1 cannot go in one SQE; issue the first part, the remainder
    // follows as a short transfer.
    length = std::min<uint64_t>(length, 0xFFFFF000u);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) break;  // the ring is full until the next submit
    pending_.pop_front();
    Prep(sqe, t, length);
    ++in_flight_;
  }
}

void UringWorker::Reap() {
  auto* s = static_cast<UringStore*>(store_);
  struct Done {
    Transfer* t;
    int res;
  };
  std::vector<Done> done;
  unsigned head;
  io_uring_cqe* cqe;
  unsigned count = 0;
  bool woken = false;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++count;
    void* data = io_uring_cqe_get_data(cqe);
    if (data == &event_value_) {
      event_armed_ = false;
      woken = true;
      continue;
    }
    done.push_back({static_cast<Transfer*>(data), cqe->res});
  }
  io_uring_cq_advance(&ring_, count);
  if (woken) {
    std::lock_guard lock(mu_);
    wake_pending_ = false;
  }
  // Results are handled after the ring's queue is advanced: callbacks may submit more work.
  for (const Done& d : done) {
    --in_flight_;
    if (s->Result(d.t, d.res) == FileStore::Next::kResubmit) pending_.push_front(d.t);
  }
}

void UringWorker::Loop() {
  while (true) {
    DrainIncoming();
    {
      std::lock_guard lock(mu_);
      if (stop_ && pending_.empty() && in_flight_ == 0 && incoming_.empty()) break;
    }
    FillSubmissionQueue();
    // Wait for a completion only when nothing else can be done: work left in pending_ that could
    // be issued (a transfer deferred by an injected EAGAIN) must not wait for an unrelated event.
    const bool can_issue_more = !pending_.empty() && in_flight_ < depth_;
    int r = can_issue_more ? io_uring_submit(&ring_) : io_uring_submit_and_wait(&ring_, 1);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
      // The ring itself failed. Fail what has not been issued; keep reaping what has.
      Status st = ErrnoToStatus(-r, fmt::format("io_uring_enter on I/O thread {}", index_));
      static_cast<UringStore*>(store_)->Fatal(st);
      while (!pending_.empty()) {
        Transfer* t = pending_.front();
        pending_.pop_front();
        static_cast<UringStore*>(store_)->Result(t, r);
      }
      if (++consecutive_enter_errors_ > 3)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      consecutive_enter_errors_ = 0;
    }
    Reap();
  }
}

}  // namespace

Result<std::unique_ptr<BlockStore>> CreateUringStore(const StoreOptions& options,
                                                     std::shared_ptr<FaultInjector> faults) {
  if (options.threads < 1) return InvalidArgumentError("I/O threads must be at least 1");
  if (options.queue_depth < 1) return InvalidArgumentError("queue depth must be at least 1");
  auto store = std::make_unique<UringStore>(options, std::move(faults));
  STRATA_RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<BlockStore>(std::move(store));
}

}  // namespace strata::io
