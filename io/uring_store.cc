#include "io/uring_store.h"

#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <system_error>
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
using internal::RequestState;
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
// thread itself (SINGLE_ISSUER and DEFER_TASKRUN require it). Other threads talk to it through
// two queues: transfers (Post) and control operations (PostControl), both applied at the top of
// the worker's loop, controls first, so a registration posted before a transfer is in place when
// that transfer is issued. Nothing ever waits for the worker except Stop.
class UringWorker {
 public:
  UringWorker(UringStore* store, int index, int numa_node, unsigned depth, bool sqpoll)
      : store_(store), index_(index), numa_node_(numa_node), depth_(depth), sqpoll_(sqpoll) {}
  ~UringWorker() { Stop(); }

  // Starts the thread and waits for its ring. On error the thread has exited.
  Status Start();
  // Finishes what is queued and in flight, then ends the thread.
  void Stop();

  // Queues transfers from any thread.
  void Post(std::span<Transfer*> transfers);
  // Queues transfers from this worker's own thread (a completion callback): no lock, no wake-up;
  // they go out with the next batch.
  void PostLocal(std::span<Transfer*> transfers) {
    pending_.insert(pending_.end(), transfers.begin(), transfers.end());
  }
  // Queues an operation on the ring, run on the worker thread before any later transfer.
  void PostControl(std::function<void(UringWorker*)> fn);

  // Control operations (worker thread only).
  void RegisterFile(int slot, int fd);
  void RegisterBuffer(int index, void* base, size_t length);

  // The worker finished a request it had admitted (called on the worker thread).
  void RequestDone() { --requests_in_flight_; }

  UringStore* store() const { return store_; }
  const char* flags_name() const { return flags_name_; }
  bool files_supported() const { return files_supported_; }
  bool buffers_supported() const { return buffers_supported_; }
  uint64_t registered_bytes() const { return registered_bytes_.load(std::memory_order_relaxed); }

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
  void Track(Transfer* t);
  void Untrack(Transfer* t);
  void FailEverything(int err);

  UringStore* const store_;
  const int index_;
  const int numa_node_;
  const unsigned depth_;  // requests in flight
  const bool sqpoll_;

  std::thread thread_;
  io_uring ring_{};
  bool ring_ready_ = false;
  int event_fd_ = -1;
  uint64_t event_value_ = 0;
  bool event_armed_ = false;
  const char* flags_name_ = "none";
  bool files_supported_ = false;
  bool buffers_supported_ = false;
  unsigned max_sqes_ = 0;  // transfers in flight at most (ring capacity minus the eventfd read)

  // Shared with posting threads.
  std::mutex mu_;
  std::vector<Transfer*> incoming_;
  std::deque<std::function<void(UringWorker*)>> controls_;
  bool wake_pending_ = false;
  bool stop_ = false;

  // Owned by the worker thread.
  std::deque<Transfer*> pending_;
  unsigned requests_in_flight_ = 0;
  unsigned sqes_in_flight_ = 0;
  std::vector<Transfer*> issued_;  // in flight, indexed by Transfer::backend_slot
  std::vector<int> free_issue_slots_;
  std::vector<int> slot_fd_;     // registered-file slot -> fd registered there (-1: none)
  std::vector<char> buffer_ok_;  // registered-buffer index -> registered here
  std::vector<size_t> buffer_len_;
  bool dead_ = false;  // the ring failed; everything fails from now on
  int dead_errno_ = 0;
  std::atomic<uint64_t> registered_bytes_{0};
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
      files_ok_ = files_ok_ && w->files_supported();
      buffers_ok_ = buffers_ok_ && w->buffers_supported();
    }
    STRATA_LOG_ONCE(debug, io,
                    "io_uring: {} ring(s) of depth {}, setup flags {}, registered files {}, "
                    "registered buffers {}",
                    workers_.size(), depth, workers_[0]->flags_name(), files_ok_ ? "yes" : "no",
                    buffers_ok_ ? "yes" : "no");
    return Status::Ok();
  }

  std::string_view name() const override { return "uring"; }

  // Exposed to the workers: the FileStore hooks they need.
  Next Result(Transfer* t, int64_t res) { return OnResult(t, res); }
  int64_t Faults(const Transfer& t, uint64_t* length) { return ConsultFaults(t, length); }
  void Fatal(const Status& s) { SetFatal(s); }
  void CountFixed(bool buffer, bool file) {
    if (buffer) fixed_buffers_.fetch_add(1, std::memory_order_relaxed);
    if (file) fixed_files_.fetch_add(1, std::memory_order_relaxed);
  }
  void RegistrationFailed(int err, size_t bytes) {
    bool expected = false;
    if (warned_registration_.compare_exchange_strong(expected, true)) {
      const bool memlock = err == ENOMEM || err == EPERM;
      STRATA_LOG(warn, io,
                 "io_uring: registering {} bytes of buffers failed ({}); they are used as "
                 "plain buffers{}",
                 bytes, ErrnoText(err),
                 memlock ? ". Registered memory counts against RLIMIT_MEMLOCK once per I/O "
                           "thread: raise it (e.g. `ulimit -l unlimited`) to register"
                         : "");
    }
  }

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

  void OnRequestComplete(RequestState* state) override {
    // Requests complete on the worker that issued them.
    if (state->admitted && tls_worker != nullptr) tls_worker->RequestDone();
  }

  void OnFileOpened(PhysicalFile& file) override {
    if (!files_ok_) return;
    {
      std::lock_guard lock(slot_mu_);
      if (free_slots_.empty() && next_slot_ < kMaxRegisteredFiles)
        free_slots_.push_back(next_slot_++);
      if (free_slots_.empty()) return;  // table full: this file uses its plain descriptor
      file.slot = free_slots_.back();
      free_slots_.pop_back();
    }
    const int slot = file.slot;
    const int fd = file.fd;
    for (auto& w : workers_)
      w->PostControl([slot, fd](UringWorker* me) { me->RegisterFile(slot, fd); });
  }

  void OnFileClosing(PhysicalFile& file) override {
    if (file.slot < 0) return;
    const int slot = file.slot;
    // FIFO per worker: the slot is cleared before any later registration of the same slot.
    for (auto& w : workers_)
      w->PostControl([slot](UringWorker* me) { me->RegisterFile(slot, -1); });
    std::lock_guard lock(slot_mu_);
    free_slots_.push_back(slot);
    file.slot = -1;
  }

  bool RegisterBufferChunk(void* base, size_t length, int index) override {
    if (!buffers_ok_) return false;
    for (auto& w : workers_) {
      w->PostControl(
          [index, base, length](UringWorker* me) { me->RegisterBuffer(index, base, length); });
    }
    return true;
  }

  void AddBackendStats(StoreStats* s) const override {
    s->fixed_buffer_transfers = fixed_buffers_.load(std::memory_order_relaxed);
    s->fixed_file_transfers = fixed_files_.load(std::memory_order_relaxed);
    uint64_t registered = UINT64_MAX;
    for (const auto& w : workers_)
      registered = std::min(registered, w->registered_bytes());
    s->registered_buffer_bytes = workers_.empty() ? 0 : registered;
  }

 private:
  std::vector<std::unique_ptr<UringWorker>> workers_;
  std::atomic<size_t> next_worker_{0};
  bool files_ok_ = false;
  bool buffers_ok_ = false;
  std::mutex slot_mu_;
  std::vector<int> free_slots_;
  int next_slot_ = 0;
  std::atomic<uint64_t> fixed_buffers_{0}, fixed_files_{0};
  std::atomic<bool> warned_registration_{false};
};

// --- UringWorker ---------------------------------------------------------------------------

Status UringWorker::Start() {
  std::promise<Status> ready;
  std::future<Status> result = ready.get_future();
  try {
    thread_ = std::thread([this, &ready] { ThreadMain(&ready); });
  } catch (const std::system_error& e) {
    return ResourceExhaustedError(fmt::format("cannot start I/O thread {}: {}", index_, e.what()));
  }
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
    // Waking under the lock: the worker cannot see stop_, leave, and close the eventfd between
    // our setting stop_ and writing to it.
    std::lock_guard lock(mu_);
    stop_ = true;
    Wake();
  }
  thread_.join();
  if (event_fd_ >= 0) {
    ::close(event_fd_);
    event_fd_ = -1;
  }
}

void UringWorker::Wake() {
  uint64_t one = 1;
  if (::write(event_fd_, &one, sizeof(one)) != static_cast<ssize_t>(sizeof(one))) {
    STRATA_LOG(error, io, "io_uring worker {}: eventfd write failed: {}", index_, ErrnoText(errno));
  }
}

void UringWorker::Post(std::span<Transfer*> transfers) {
  std::lock_guard lock(mu_);
  incoming_.insert(incoming_.end(), transfers.begin(), transfers.end());
  if (!wake_pending_) {
    wake_pending_ = true;
    Wake();
  }
}

void UringWorker::PostControl(std::function<void(UringWorker*)> fn) {
  std::lock_guard lock(mu_);
  controls_.push_back(std::move(fn));
  if (!wake_pending_ && tls_worker != this) {
    wake_pending_ = true;
    Wake();
  }
}

void UringWorker::RegisterFile(int slot, int fd) {
  if (!files_supported_ || dead_) return;
  const int r = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
  slot_fd_[static_cast<size_t>(slot)] = (r >= 1 && fd >= 0) ? fd : -1;
  if (r < 0 && fd >= 0) {
    STRATA_LOG_ONCE(warn, io, "io_uring: registering a file failed ({}); using plain descriptors",
                    ErrnoText(-r));
  }
}

void UringWorker::RegisterBuffer(int index, void* base, size_t length) {
  if (!buffers_supported_ || dead_) return;
  struct iovec iov = {base, length};
  const int r =
      io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(index), &iov, nullptr, 1);
  const auto i = static_cast<size_t>(index);
  if (buffer_ok_[i]) registered_bytes_.fetch_sub(buffer_len_[i], std::memory_order_relaxed);
  buffer_ok_[i] = r >= 1 && base != nullptr;
  buffer_len_[i] = buffer_ok_[i] ? length : 0;
  if (buffer_ok_[i]) registered_bytes_.fetch_add(length, std::memory_order_relaxed);
  if (r < 0 && base != nullptr) store_->RegistrationFailed(-r, length);
}

Status UringWorker::SetupRing() {
  const unsigned entries = std::min(32768u, NextPow2(2 * depth_ + 1));
  int last_error = 0;
  for (const RingFlags& candidate : FlagCandidates(sqpoll_)) {
    io_uring_params params{};
    params.flags = candidate.flags | IORING_SETUP_CQSIZE | IORING_SETUP_CLAMP;
    params.cq_entries = entries * 2;
    if (candidate.flags & IORING_SETUP_SQPOLL) params.sq_thread_idle = 2000;
    int r = io_uring_queue_init_params(entries, &ring_, &params);
    // EINVAL: a flag this kernel does not know; EPERM with SQPOLL: older kernels want
    // CAP_SYS_ADMIN for it. Either way, try the next combination.
    if (r == -EINVAL || (r == -EPERM && (candidate.flags & IORING_SETUP_SQPOLL))) {
      last_error = -r;
      continue;
    }
    if (r < 0) {
      Status st = ErrnoToStatus(-r, "io_uring_setup");
      if (r == -EPERM || r == -ENOSYS) {
        st = Status(st.code(),
                    std::string(st.message()) +
                        "; io_uring may be disabled (sysctl kernel.io_uring_disabled) or blocked "
                        "by a seccomp profile, as in many containers: use the posix backend "
                        "(backend auto picks it by itself)");
      }
      return st;
    }
    flags_name_ = candidate.name;
    ring_ready_ = true;
    max_sqes_ = params.sq_entries - 1;  // one entry stays free for the eventfd read
    break;
  }
  if (!ring_ready_) return ErrnoToStatus(last_error, "io_uring_setup (every flag combination)");

  event_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (event_fd_ < 0) return ErrnoToStatus(errno, "eventfd");

  files_supported_ = io_uring_register_files_sparse(&ring_, kMaxRegisteredFiles) == 0;
  buffers_supported_ = io_uring_register_buffers_sparse(
                           &ring_, static_cast<unsigned>(FileStore::kMaxBufferSlots)) == 0;
  slot_fd_.assign(kMaxRegisteredFiles, -1);
  buffer_ok_.assign(FileStore::kMaxBufferSlots, 0);
  buffer_len_.assign(FileStore::kMaxBufferSlots, 0);
  issued_.assign(max_sqes_, nullptr);
  for (int i = static_cast<int>(max_sqes_) - 1; i >= 0; --i)
    free_issue_slots_.push_back(i);
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
  // The eventfd is closed by Stop, after the join, so that a late Wake never writes to a
  // closed (or reused) descriptor.
}

void UringWorker::DrainIncoming() {
  std::deque<std::function<void(UringWorker*)>> controls;
  {
    std::lock_guard lock(mu_);
    pending_.insert(pending_.end(), incoming_.begin(), incoming_.end());
    incoming_.clear();
    controls.swap(controls_);
  }
  for (auto& c : controls)
    c(this);
}

bool UringWorker::ArmEventRead() {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (sqe == nullptr) return false;
  io_uring_prep_read(sqe, event_fd_, &event_value_, sizeof(event_value_), 0);
  io_uring_sqe_set_data(sqe, &event_value_);
  event_armed_ = true;
  return true;
}

void UringWorker::Track(Transfer* t) {
  const int slot = free_issue_slots_.back();
  free_issue_slots_.pop_back();
  issued_[static_cast<size_t>(slot)] = t;
  t->backend_slot = slot;
  ++sqes_in_flight_;
}

void UringWorker::Untrack(Transfer* t) {
  issued_[static_cast<size_t>(t->backend_slot)] = nullptr;
  free_issue_slots_.push_back(t->backend_slot);
  t->backend_slot = -1;
  --sqes_in_flight_;
}

void UringWorker::Prep(io_uring_sqe* sqe, Transfer* t, uint64_t length) {
  const int slot = t->file->slot;
  const bool fixed_file = slot >= 0 && slot_fd_[static_cast<size_t>(slot)] == t->file->fd;
  const bool fixed_buffer = t->buf_index >= 0 && buffer_ok_[static_cast<size_t>(t->buf_index)];
  const int fd = fixed_file ? slot : t->file->fd;
  const auto len = static_cast<unsigned>(length);
  if (fixed_buffer) {
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
  store_->CountFixed(fixed_buffer, fixed_file);
}

void UringWorker::FillSubmissionQueue() {
  if (!event_armed_ && !ArmEventRead()) return;
  // A transfer whose injected fault asks for a retry goes to the back, so a persistent EAGAIN
  // does not spin on the front of the queue; `budget` bounds one pass.
  size_t budget = pending_.size();
  while (!pending_.empty() && budget-- > 0 && sqes_in_flight_ < max_sqes_) {
    Transfer* t = pending_.front();
    RequestState* request = t->request;
    // The queue depth counts requests, however many transfers each was split into.
    if (!request->admitted && requests_in_flight_ >= depth_) break;
    uint64_t length = 0;
    const int64_t injected = store_->Faults(*t, &length);
    io_uring_sqe* sqe = nullptr;
    if (injected == 0) {
      sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;  // the ring is full until the next submit
    }
    pending_.pop_front();
    if (!request->admitted) {
      request->admitted = true;
      ++requests_in_flight_;
    }
    if (injected < 0) {
      if (store_->Result(t, injected) == FileStore::Next::kResubmit) pending_.push_back(t);
      continue;
    }
    // Requests larger than 4 GiB - 4 KiB cannot go in one SQE; the first part goes now, the
    // remainder follows as a short transfer.
    Prep(sqe, t, std::min<uint64_t>(length, 0xFFFFF000u));
    Track(t);
  }
}

void UringWorker::Reap() {
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
    Untrack(d.t);
    if (store_->Result(d.t, d.res) == FileStore::Next::kResubmit) pending_.push_front(d.t);
  }
}

// The ring is broken: fail what is queued and what the kernel will never complete.
void UringWorker::FailEverything(int err) {
  while (!pending_.empty()) {
    Transfer* t = pending_.front();
    pending_.pop_front();
    if (!t->request->admitted) {
      t->request->admitted = true;
      ++requests_in_flight_;
    }
    store_->Result(t, -err);
  }
  for (Transfer*& t : issued_) {
    if (t == nullptr) continue;
    Transfer* failed = t;
    Untrack(failed);
    store_->Result(failed, -err);
  }
}

void UringWorker::Loop() {
  while (true) {
    DrainIncoming();
    {
      std::lock_guard lock(mu_);
      if (stop_ && pending_.empty() && sqes_in_flight_ == 0 && incoming_.empty() &&
          controls_.empty()) {
        break;
      }
    }
    if (dead_) {
      FailEverything(dead_errno_);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    FillSubmissionQueue();
    // Wait for a completion only when nothing else can be done now: transfers that could still
    // be issued (e.g. one deferred by an injected EAGAIN) must not wait on an unrelated event.
    const bool can_issue_more =
        !pending_.empty() && sqes_in_flight_ < max_sqes_ &&
        (pending_.front()->request->admitted || requests_in_flight_ < depth_);
    int r = can_issue_more ? io_uring_submit(&ring_) : io_uring_submit_and_wait(&ring_, 1);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
      // The ring itself failed (e.g. its SQPOLL thread died). What was queued or prepared cannot
      // complete: fail all of it, and everything that comes later, with this error.
      Status st = ErrnoToStatus(-r, fmt::format("io_uring_enter on I/O thread {}", index_));
      store_->Fatal(st);
      Reap();  // whatever did complete
      dead_ = true;
      dead_errno_ = -r;
      FailEverything(dead_errno_);
      continue;
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
