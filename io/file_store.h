// FileStore: what the file-backed BlockStores (io_uring, pread/pwrite) share.
//
// It owns everything that does not depend on how a transfer is issued: opening files (O_DIRECT
// detection, preallocation with a free-space check, device queue limits), striping, splitting a
// request into physical transfers no larger than the device takes, request validation, buffer
// registration bookkeeping, fault-injection decisions, the interpretation of every result (short
// transfers, EAGAIN/EINTR, end of file, errors with context) and completion of the logical request
// once all its transfers are done.
//
// A backend implements Execute() (issue transfers) and reports each result through OnResult(),
// which says whether to resubmit the (adjusted) transfer or that it is finished. That keeps the
// result handling identical across backends, and tested once through the fault injector.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "io/fault_injection.h"
#include "io/io_internal.h"
#include "io/stripe.h"
#include "strata/block_store.h"

namespace strata::io::internal {

// One opened path of a logical file.
struct PhysicalFile {
  std::string path;
  int fd = -1;
  int slot = -1;        // registered-file index in the backend; -1 when not registered
  bool direct = false;  // opened with O_DIRECT
  // Largest bytes per device request (0 = no limit), for buffers on 4 KiB and on 2 MiB pages.
  uint64_t max_request_small = 0;
  uint64_t max_request_huge = 0;
};

struct OpenFile {
  FileId id = 0;
  FileInfo info;
  std::string where;  // the paths, for messages
  StripeLayout layout{1, 1};
  bool durable = false;
  std::vector<PhysicalFile> parts;
  std::atomic<int64_t> outstanding{0};  // logical requests (and Syncs) not yet completed
};

struct RequestState;

// One physical transfer: a contiguous byte range of one path. Owned by its RequestState.
struct Transfer {
  IoOp op = IoOp::kRead;
  const PhysicalFile* file = nullptr;
  uint64_t offset = 0;     // where the remaining bytes go in the path's file
  uint64_t remaining = 0;  // bytes still to move
  char* buffer = nullptr;  // where the remaining bytes come from / go to
  int buf_index = -1;      // registered buffer holding `buffer`, or -1
  bool durable = false;    // write with RWF_DSYNC
  uint32_t alignment = 1;
  uint32_t retries = 0;
  int backend_slot = -1;      // for the backend's own bookkeeping while issued
  uint64_t first_offset = 0;  // as issued originally, for messages
  uint64_t total_length = 0;
  RequestState* request = nullptr;
};

struct RequestState {
  std::atomic<uint32_t> pending{0};  // transfers not finished
  std::atomic<bool> failed{false};
  Status error;  // written once, by whoever sets `failed`
  IoCallback done;
  OpenFile* file = nullptr;
  IoOp op = IoOp::kRead;
  uint64_t offset = 0;
  uint64_t length = 0;
  bool admitted = false;  // backend bookkeeping: counted against the queue depth
  std::vector<Transfer> transfers;
};

// A registered buffer range, split into chunks the backend registered one index each.
struct RegisteredRange {
  char* base = nullptr;
  size_t length = 0;
  bool huge_pages = false;
  std::vector<int> indices;  // backend index of each kBufferChunk-sized chunk; empty: none
};

class FileStore : public BlockStore {
 public:
  ~FileStore() override;

  Result<FileId> Open(const FileSpec& spec) override;
  Status Close(FileId file) override;
  Result<FileInfo> Info(FileId file) const override;
  Status Submit(std::span<IoRequest> requests) override;
  Status Sync(FileId file) override;
  Status RegisterBuffers(std::span<const BufferRange> ranges) override;
  Status UnregisterBuffers(const void* base) override;
  StoreStats stats() const override;

  // Registered buffers are split into chunks of at most this size (io_uring's limit is 1 GiB).
  static constexpr size_t kBufferChunk = size_t{1} << 30;
  // The backend's registered buffer table has this many slots.
  static constexpr int kMaxBufferSlots = 1024;
  // EAGAIN / EINTR resubmissions of one transfer before giving up with Unavailable.
  static constexpr uint32_t kMaxRetries = 10000;

  enum class Next { kFinished, kResubmit };

 protected:
  FileStore(const StoreOptions& options, std::shared_ptr<FaultInjector> faults);

  // Issues transfers. Each must eventually be passed to OnResult until it returns kFinished.
  // Called without any FileStore lock held, from Submit's caller or from an I/O thread. All
  // transfers of one request are consecutive in `transfers`.
  virtual void Execute(std::span<Transfer*> transfers) = 0;

  // Hooks around a path's life (e.g. registering its descriptor). Called without FileStore locks
  // held; they must not wait for the I/O threads (callbacks may be calling Open or Close).
  virtual void OnFileOpened(PhysicalFile& /*file*/) {}
  virtual void OnFileClosing(PhysicalFile& /*file*/) {}

  // Registers one buffer chunk (at most kBufferChunk bytes) at table index `index`, or clears the
  // index (base == nullptr). Must not wait for the I/O threads; the backend applies it before it
  // issues any transfer submitted afterwards, and uses a chunk as a fixed buffer only where its
  // registration succeeded. Returns false when the backend does not register buffers at all.
  virtual bool RegisterBufferChunk(void* /*base*/, size_t /*length*/, int /*index*/) {
    return false;
  }

  // Called on the completing thread just before a request's callback runs (and before its state
  // is deleted).
  virtual void OnRequestComplete(RequestState* /*state*/) {}

  // Adds backend-specific counters.
  virtual void AddBackendStats(StoreStats* /*stats*/) const {}

  // Interprets the result of one issue of `t`: `res` is the bytes moved (>= 0) or -errno.
  // kResubmit: `t` was adjusted (short transfer, EAGAIN, EINTR) and must be issued again.
  // kFinished: `t` is done (success or error); the request may have completed and `t` must not be
  // touched again.
  Next OnResult(Transfer* t, int64_t res);

  // Asks the fault injector about issuing `t` now. Returns 0 and the bytes to issue (normally
  // t->remaining), or a negative errno to report as the result without issuing anything.
  int64_t ConsultFaults(const Transfer& t, uint64_t* issue_length);

  // Marks the store permanently failed: Submit returns `status` from now on.
  void SetFatal(const Status& status);

  // Blocks until every submitted request has completed and its callback has returned.
  void WaitIdle();

  const StoreOptions& options() const { return options_; }

 private:
  void FinishTransfer(Transfer* t, Status status);
  void CompleteRequest(RequestState* state);
  // Appends the transfers of `request` on `file` to `state`.
  void BuildTransfers(const IoRequest& request, OpenFile* file, RequestState* state) const;
  const RegisteredRange* FindRange(const char* p, size_t n) const;
  // Opens one path of a FileSpec (O_DIRECT detection included); records whether it was created.
  Status OpenPart(const FileSpec& spec, PhysicalFile* part, bool* created) const;
  void CloseParts(std::vector<PhysicalFile>& parts, const std::vector<bool>& created);

  StoreOptions options_;
  std::shared_ptr<FaultInjector> faults_;

  mutable std::shared_mutex table_mu_;  // guards files_, ranges_, next_id_, fatal_
  std::unordered_map<FileId, std::unique_ptr<OpenFile>> files_;
  std::vector<RegisteredRange> ranges_;
  std::mutex register_mu_;              // serialises (Un)RegisterBuffers; guards free_buffer_slots_
  std::vector<int> free_buffer_slots_;  // free backend buffer indices (lowest at the back)
  FileId next_id_ = 1;
  Status fatal_;
  std::atomic<bool> has_fatal_{false};

  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  std::atomic<int64_t> in_flight_{0};  // logical requests whose callback has not returned
  BusyClock busy_;                     // StoreStats::busy_ns

  std::atomic<uint64_t> reads_{0}, writes_{0}, bytes_read_{0}, bytes_written_{0}, errors_{0};
  std::atomic<uint64_t> device_requests_{0}, short_transfers_{0}, retries_{0};
};

}  // namespace strata::io::internal
