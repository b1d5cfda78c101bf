// BlockStore: Strata's seam to block storage (NVMe, or anything that looks like files).
//
// A BlockStore reads and writes byte ranges of files asynchronously. Each request completes on its
// own: its callback runs exactly once, with OK or with an error that names the path, the offset,
// the length and the cause. Nothing waits for "everything outstanding".
//
// Backends (see CreateBlockStore):
//   uring   io_uring with O_DIRECT, registered buffers and files, one ring per I/O thread (default)
//   posix   a thread pool issuing pread/pwrite; chosen automatically when io_uring is unavailable
//   memory  files kept in RAM; for tests and for machines without a disk to spare
// and a fault-injecting wrapper (io/fault_injection.h) for tests.
//
// A logical file may be striped over several paths (one per drive): FileSpec.paths lists them and
// FileSpec.stripe_unit says how many bytes go to one path before moving to the next, RAID-0 style.
// Bytes [k*unit, (k+1)*unit) of the logical file live in paths[k % n] at offset (k / n) * unit.
//
// Direct I/O: when a file is opened with O_DIRECT (the default where the filesystem allows it),
// every request's offset, length and buffer address must be multiples of FileInfo::alignment
// (4096). A misaligned request is rejected by Submit with InvalidArgument before anything is
// issued.
//
// Threading: all methods may be called from any thread, and none of them waits for an I/O thread
// to reach a particular point, so they may be called while holding a lock that callbacks also
// take. Callbacks run on the store's I/O threads. A callback may call Submit (the fast path: a
// request submitted from a completion callback joins the next batch of that I/O thread without a
// wake-up), Open, Info, RegisterBuffers and UnregisterBuffers. It must not block for long, and
// must not call the blocking conveniences (Read, Write, SubmitAsync(...).get()) or Sync: with one
// I/O thread, the request they wait for would queue behind the callback itself.
//
// Flow control: Submit never blocks and never refuses for lack of room; requests beyond the
// queue depth wait in the store's queue. Callers that can produce unbounded work must bound what
// they have outstanding themselves.
//
// With io_uring, one request is served by one I/O thread (all of its pieces, on every path of a
// stripe); parallelism comes from several requests in flight. The posix backend hands each piece
// to whichever worker is free.
//
// Destruction waits for every submitted request to complete and its callback to return,
// including requests those callbacks submit in turn.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata::io {

enum class IoOp : uint8_t { kRead, kWrite };
std::string_view IoOpName(IoOp op);  // "read" / "write"

// Whether files are opened with O_DIRECT.
enum class DirectMode : uint8_t {
  kAuto,  // O_DIRECT if the filesystem accepts it, else buffered I/O with a warning
  kOn,    // O_DIRECT or an error at Open
  kOff,   // buffered I/O through the page cache
};
std::string_view DirectModeName(DirectMode mode);  // "auto" / "on" / "off"

// The required alignment of offset, length and buffer for direct I/O.
inline constexpr uint32_t kDirectIoAlignment = 4096;

// A logical file: one path, or several paths striped together.
struct FileSpec {
  std::vector<std::string> paths;  // at least one
  uint64_t stripe_unit = 1 << 20;  // bytes per stripe; a multiple of 4096; unused for one path
  DirectMode direct = DirectMode::kAuto;
  bool create = true;      // create missing files (mode 0644)
  bool truncate = false;   // truncate existing files to zero length first
  bool read_only = false;  // open read-only; writes are rejected by Submit
  // Logical bytes to preallocate with fallocate at Open (0 = none). Free space is checked first:
  // a shortage is ResourceExhausted naming the path, the bytes needed and the bytes free.
  uint64_t preallocate = 0;
  // Every write is durable when it completes (RWF_DSYNC); otherwise use BlockStore::Sync.
  bool durable_writes = false;
};

using FileId = uint32_t;

// What Open made of a FileSpec.
struct FileInfo {
  std::vector<std::string> paths;
  uint64_t stripe_unit = 0;
  bool direct = false;     // O_DIRECT is in effect
  uint32_t alignment = 1;  // kDirectIoAlignment when direct, else 1
  bool read_only = false;
};

// Runs exactly once per submitted request, on an I/O thread.
using IoCallback = std::function<void(const Status&)>;

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file = 0;
  uint64_t offset = 0;     // logical byte offset in the file
  uint64_t length = 0;     // bytes; > 0
  void* buffer = nullptr;  // `length` bytes; owned by the caller until the callback runs
  IoCallback done;         // required
};

// A memory range to register with the store for faster I/O (io_uring fixed buffers). Requests
// whose buffer lies inside a registered range avoid per-request page pinning; if `huge_pages` is
// true the range is backed by 2 MiB pages and requests can be larger without being split by the
// device's segment limit.
struct BufferRange {
  void* base = nullptr;
  size_t length = 0;
  bool huge_pages = false;
};

// Counters since the store was created.
struct StoreStats {
  uint64_t reads = 0, writes = 0;              // logical requests completed
  uint64_t bytes_read = 0, bytes_written = 0;  // logical bytes completed successfully
  uint64_t errors = 0;                         // logical requests completed with an error
  // Physical transfers a request was split into (after striping and queue-limit splitting),
  // counted once each; resubmissions of the remainder are counted in short_transfers / retries.
  uint64_t device_requests = 0;
  uint64_t short_transfers = 0;  // completions that moved fewer bytes than asked (resubmitted)
  uint64_t retries = 0;          // EAGAIN / EINTR resubmissions
  // io_uring only: issues that used a registered buffer / a registered file.
  uint64_t fixed_buffer_transfers = 0;
  uint64_t fixed_file_transfers = 0;
  uint64_t registered_buffer_bytes = 0;  // bytes registered with every ring (0: none)
  // Nanoseconds during which at least one request was outstanding (accepted by Submit, callback
  // not yet returned), since the store was created: the store's busy time. Its difference over an
  // interval, divided by the interval, is how busy the store kept the disk (iostat's %util).
  uint64_t busy_ns = 0;
  // With checksums (CreateChecksummingStore): reads checked against the checksum of the bytes
  // last written to the same range, reads of ranges this store never wrote (not checked), reads
  // whose bytes differed (each completed with DataLoss), and the bytes hashed and the time it took.
  uint64_t checksum_verified_reads = 0;
  uint64_t checksum_unverified_reads = 0;
  uint64_t checksum_mismatches = 0;
  uint64_t checksum_bytes = 0;
  uint64_t checksum_ns = 0;
};

class BlockStore {
 public:
  virtual ~BlockStore() = default;

  BlockStore() = default;
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  // "uring", "posix", "memory", "faulty(<inner>)".
  virtual std::string_view name() const = 0;

  // Opens (and by default creates) a logical file. Errors name the path: NotFound for a missing
  // directory, PermissionDenied for a read-only one, InvalidArgument for a filesystem that refuses
  // O_DIRECT when DirectMode::kOn was asked, ResourceExhausted when preallocation does not fit.
  virtual Result<FileId> Open(const FileSpec& spec) = 0;

  // Closes a file. FailedPrecondition if requests on it are still outstanding.
  virtual Status Close(FileId file) = 0;

  virtual Result<FileInfo> Info(FileId file) const = 0;

  // Submits requests as one batch. Either every request is accepted (OK; each callback will run
  // exactly once) or none is (an error naming the first bad request; no callback will run).
  // Requests are rejected for: an unknown file, zero length, a null buffer or callback, a write to
  // a read-only file, misalignment under direct I/O, or a store that failed permanently.
  virtual Status Submit(std::span<IoRequest> requests) = 0;

  // Makes completed writes to `file` durable (fdatasync on each of its paths).
  virtual Status Sync(FileId file) = 0;

  // Registers memory for faster I/O. Call before submitting requests that use it. A range stays
  // registered until UnregisterBuffers or the end of the store, and its memory must stay mapped
  // until then: freeing it and mapping new memory at the same address while it is registered
  // would make I/O use the old pages. Registration that the backend cannot do (e.g. the memlock
  // limit is too low; with io_uring it is charged once per I/O thread) is not an error: the store
  // logs it once and uses the memory as plain buffers (see StoreStats::registered_buffer_bytes).
  virtual Status RegisterBuffers(std::span<const BufferRange> ranges) = 0;

  // Forgets the range registered with base address `base`. No request using it may be
  // outstanding. NotFound if no registered range starts at `base`.
  virtual Status UnregisterBuffers(const void* base) = 0;

  virtual StoreStats stats() const = 0;

  // Conveniences built on Submit.
  Status Submit(IoRequest request) { return Submit(std::span<IoRequest>(&request, 1)); }
  // A future that becomes ready with the request's Status.
  std::future<Status> SubmitAsync(IoOp op, FileId file, uint64_t offset, uint64_t length,
                                  void* buffer);
  // Blocking read / write of one range.
  Status Read(FileId file, uint64_t offset, uint64_t length, void* buffer);
  Status Write(FileId file, uint64_t offset, uint64_t length, const void* buffer);
};

enum class Backend : uint8_t {
  kAuto,   // io_uring if it can be set up, else posix (logged once)
  kUring,  // io_uring or an error
  kPosix,
  kMemory,
};
std::string_view BackendName(Backend backend);  // "auto", "uring", "posix", "memory"

struct StoreOptions {
  Backend backend = Backend::kAuto;
  // I/O threads (uring: one ring each; posix: see queue_depth).
  int threads = 1;
  // Requests in flight per I/O thread. With io_uring a request split into several device
  // transfers (striping, queue limits) counts once. The posix backend runs threads x queue_depth
  // blocking workers (at most 1024), each moving one piece at a time.
  int queue_depth = 32;
  // io_uring: ask for a kernel submission-polling thread (falls back without it).
  bool sqpoll = false;
  // io_uring: use registered (fixed) files and buffers when possible.
  bool register_files = true;
  bool register_buffers = true;
  // Bind I/O thread i to NUMA node numa_nodes[i % size] (empty: no binding). See io/numa.h for
  // finding the node of a path's block device.
  std::vector<int> numa_nodes;
  // Split requests so that none exceeds what the device takes in one command (from sysfs:
  // max_sectors_kb, and max_segments x page size for buffers not on huge pages).
  bool respect_queue_limits = true;
};

class FaultInjector;  // io/fault_injection.h

// Creates a store. With Backend::kAuto, io_uring is probed and the posix backend is used if it
// cannot be set up (EPERM, ENOSYS, a disabled io_uring); the choice is logged once. `faults`
// (tests, STRATA_FAULT_INJECT): injected into the backend's own transfers.
Result<std::unique_ptr<BlockStore>> CreateBlockStore(const StoreOptions& options,
                                                     std::shared_ptr<FaultInjector> faults = nullptr);

}  // namespace strata::io
