#include "io/file_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <set>
#include <utility>

#include "common/errno.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/units.h"
#include "io/io_internal.h"
#include "io/path_info.h"

namespace strata::io::internal {

namespace {

// The filesystem type of a path, for messages.
std::string FilesystemOf(const std::string& path) {
  Result<PathInfo> info = DescribePath(path, /*probe_direct=*/false);
  return info.ok() ? info->filesystem : "unknown";
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

FileStore::FileStore(const StoreOptions& options, std::shared_ptr<FaultInjector> faults)
    : options_(options), faults_(std::move(faults)) {
  for (int i = kMaxBufferSlots - 1; i >= 0; --i)
    free_buffer_slots_.push_back(i);
}

FileStore::~FileStore() {
  // The backend has stopped its threads (after draining) before this runs.
  for (auto& [id, file] : files_) {
    for (auto& part : file->parts) {
      if (part.fd >= 0) ::close(part.fd);
    }
  }
}

Status FileStore::OpenPart(const FileSpec& spec, PhysicalFile* part, bool* created) const {
  *created = false;
  const std::string& path = part->path;
  const bool existed = Exists(path);
  int flags = O_CLOEXEC | (spec.read_only ? O_RDONLY : O_RDWR);
  // O_EXCL tells for certain whether this Open created the file (and may remove it on failure).
  const bool may_create = spec.create && !spec.read_only && !existed;
  const bool want_direct = spec.direct != DirectMode::kOff;
  part->direct = want_direct;
  int fd = ::open(path.c_str(),
                  flags | (may_create ? O_CREAT | O_EXCL : 0) | (want_direct ? O_DIRECT : 0), 0644);
  if (fd >= 0) {
    *created = may_create;
  } else if (may_create && errno == EEXIST) {
    // Created by someone else in between: open it as it is.
    fd = ::open(path.c_str(), flags | (want_direct ? O_DIRECT : 0));
  }
  if (fd < 0 && errno == EINVAL && want_direct) {
    // The filesystem refuses O_DIRECT. Linux creates the file before it checks O_DIRECT, so a
    // file that did not exist may exist now: it is ours.
    *created = may_create && Exists(path);
    const std::string fs = FilesystemOf(path);
    if (spec.direct == DirectMode::kOn) {
      return InvalidArgumentError(fmt::format(
          "cannot open {} with O_DIRECT: its filesystem ({}) does not support direct I/O, and "
          "direct I/O was required (direct: on); use direct: auto to fall back to buffered I/O, "
          "or put the file on a filesystem that supports O_DIRECT (ext4, xfs)",
          path, fs));
    }
    fd = ::open(path.c_str(), flags | (may_create && !*created ? O_CREAT : 0), 0644);
    part->direct = false;
    if (fd >= 0) {
      if (may_create) *created = true;
      STRATA_LOG(warn, io,
                 "{}: the filesystem ({}) does not support O_DIRECT; using buffered I/O through "
                 "the page cache (slower, and it competes with the model for host memory)",
                 path, fs);
    }
  }
  if (fd < 0) return ErrnoToStatus(errno, fmt::format("cannot open {}", path));
  part->fd = fd;
  return Status::Ok();
}

void FileStore::CloseParts(std::vector<PhysicalFile>& parts, const std::vector<bool>& created) {
  for (size_t i = 0; i < parts.size(); ++i) {
    struct stat by_fd {};
    const bool have_fd = parts[i].fd >= 0 && ::fstat(parts[i].fd, &by_fd) == 0;
    if (parts[i].fd >= 0) {
      OnFileClosing(parts[i]);
      ::close(parts[i].fd);
      parts[i].fd = -1;
    }
    // A file this Open created is removed again when the Open fails; files that existed before
    // are never removed. With a descriptor, only if the path still names the same file.
    if (i < created.size() && created[i]) {
      struct stat by_path {};
      if (::stat(parts[i].path.c_str(), &by_path) != 0) continue;
      if (have_fd && (by_path.st_dev != by_fd.st_dev || by_path.st_ino != by_fd.st_ino)) continue;
      ::unlink(parts[i].path.c_str());
    }
  }
}

Result<FileId> FileStore::Open(const FileSpec& spec) {
  STRATA_RETURN_IF_ERROR(ValidateFileSpec(spec));
  auto file = std::make_unique<OpenFile>();
  const auto num_paths = static_cast<uint32_t>(spec.paths.size());
  file->layout = StripeLayout(num_paths, spec.stripe_unit);
  file->durable = spec.durable_writes;
  file->info.paths = spec.paths;
  file->info.stripe_unit = num_paths > 1 ? spec.stripe_unit : 0;
  file->info.read_only = spec.read_only;

  std::vector<bool> created;
  auto fail = [&](Status status) -> Result<FileId> {
    CloseParts(file->parts, created);
    return status;
  };

  // 1. Open every path (nothing is truncated or allocated yet, so a failure loses nothing).
  std::set<std::pair<dev_t, ino_t>> inodes;
  for (uint32_t i = 0; i < num_paths; ++i) {
    PhysicalFile part;
    part.path = spec.paths[i];
    bool was_created = false;
    Status opened = OpenPart(spec, &part, &was_created);
    file->parts.push_back(part);
    created.push_back(was_created);
    if (!opened.ok()) return fail(opened);
    struct stat st {};
    if (::fstat(part.fd, &st) != 0) {
      return fail(ErrnoToStatus(errno, fmt::format("cannot stat {}", part.path)));
    }
    if (!S_ISREG(st.st_mode)) {
      return fail(InvalidArgumentError(fmt::format("{} is not a regular file", part.path)));
    }
    if (!inodes.insert({st.st_dev, st.st_ino}).second) {
      return fail(InvalidArgumentError(
          fmt::format("{} is the same file as another path of this striped file", part.path)));
    }
  }

  // 2. Check that the preallocation fits on every path before changing anything.
  std::vector<uint64_t> wants(num_paths, 0);
  if (!spec.read_only) {
    for (uint32_t i = 0; i < num_paths; ++i) {
      PhysicalFile& part = file->parts[i];
      wants[i] = file->layout.PathBytes(i, spec.preallocate);
      if (wants[i] == 0) continue;
      struct stat st {};
      struct statvfs vfs {};
      if (::fstat(part.fd, &st) != 0 || ::fstatvfs(part.fd, &vfs) != 0) {
        return fail(ErrnoToStatus(errno, fmt::format("cannot stat {}", part.path)));
      }
      // Filesystems without block accounting (ramfs) report no blocks at all: nothing to check.
      if (vfs.f_blocks == 0) continue;
      const uint64_t allocated = static_cast<uint64_t>(st.st_blocks) * 512;
      const uint64_t kept = spec.truncate ? 0 : std::min(allocated, wants[i]);
      const uint64_t need = wants[i] - kept;
      const uint64_t free_bytes =
          uint64_t{vfs.f_bavail} * vfs.f_frsize + (spec.truncate ? allocated : 0);
      if (free_bytes < need) {
        return fail(ResourceExhaustedError(fmt::format(
            "not enough space to preallocate {} ({} bytes) for {}: {} more bytes are needed but "
            "only {} bytes are free on its filesystem ({})",
            FormatBytes(wants[i]), wants[i], part.path, need, free_bytes,
            FormatBytes(free_bytes))));
      }
    }
  }

  // 3. Preallocate, then truncate. Allocation comes first because it changes no content: if it
  // fails on one path, no path has lost anything yet. Truncating then frees at least as much as
  // the second allocation needs.
  auto preallocate = [&](PhysicalFile& part, uint64_t want) -> Status {
    if (::fallocate(part.fd, 0, 0, static_cast<off_t>(want)) == 0) return Status::Ok();
    const int err = errno;
    if (err == EOPNOTSUPP || err == ENOSYS) {
      // No fallocate here (ramfs, some network filesystems): extend the file instead.
      struct stat st {};
      if (::fstat(part.fd, &st) == 0 && static_cast<uint64_t>(st.st_size) < want &&
          ::ftruncate(part.fd, static_cast<off_t>(want)) != 0) {
        return ErrnoToStatus(errno, fmt::format("cannot extend {} to {} bytes", part.path, want));
      }
      return Status::Ok();
    }
    if (err == ENOSPC || err == EDQUOT) {
      struct statvfs vfs {};
      const uint64_t free_now =
          ::fstatvfs(part.fd, &vfs) == 0 ? uint64_t{vfs.f_bavail} * vfs.f_frsize : 0;
      return ResourceExhaustedError(fmt::format(
          "not enough space to preallocate {} ({} bytes) for {}: the filesystem ran out with "
          "{} bytes free ({})",
          FormatBytes(want), want, part.path, free_now, FormatBytes(free_now)));
    }
    return ErrnoToStatus(err, fmt::format("cannot preallocate {} bytes for {}", want, part.path));
  };
  for (uint32_t i = 0; i < num_paths && !spec.read_only; ++i) {
    if (wants[i] == 0) continue;
    Status st = preallocate(file->parts[i], wants[i]);
    if (!st.ok()) return fail(st);
  }
  for (uint32_t i = 0; i < num_paths && spec.truncate && !spec.read_only; ++i) {
    PhysicalFile& part = file->parts[i];
    if (::ftruncate(part.fd, 0) != 0) {
      return fail(ErrnoToStatus(errno, fmt::format("cannot truncate {}", part.path)));
    }
    if (wants[i] == 0) continue;
    Status st = preallocate(part, wants[i]);
    if (!st.ok()) return fail(st);
  }

  // 4. Device limits and backend registration.
  bool all_direct = true;
  bool any_direct = false;
  for (PhysicalFile& part : file->parts) {
    all_direct = all_direct && part.direct;
    any_direct = any_direct || part.direct;
    if (options_.respect_queue_limits && part.direct) {
      if (std::optional<QueueLimits> q = QueueLimitsForPath(part.path)) {
        part.max_request_small = q->MaxRequestBytes(4096);
        part.max_request_huge = q->MaxRequestBytes(kHugePageSize);
      }
    }
    OnFileOpened(part);
  }
  file->info.direct = all_direct;
  file->info.alignment = any_direct ? kDirectIoAlignment : 1;
  file->where = DescribePaths(file->info);

  std::unique_lock lock(table_mu_);
  const FileId id = next_id_++;
  file->id = id;
  files_.emplace(id, std::move(file));
  return id;
}

Status FileStore::Close(FileId id) {
  std::unique_ptr<OpenFile> file;
  {
    std::unique_lock lock(table_mu_);
    auto it = files_.find(id);
    if (it == files_.end()) {
      return NotFoundError(fmt::format("cannot close file id {}: it is not open", id));
    }
    const int64_t outstanding = it->second->outstanding.load(std::memory_order_acquire);
    if (outstanding != 0) {
      return FailedPreconditionError(
          fmt::format("cannot close {}: {} request(s) or sync(s) on it have not completed",
                      it->second->where, outstanding));
    }
    file = std::move(it->second);
    files_.erase(it);
  }
  Status result;
  for (auto& part : file->parts) {
    OnFileClosing(part);
    if (::close(part.fd) != 0 && result.ok()) {
      // close() can report a deferred write error (e.g. on network filesystems).
      result = ErrnoToStatus(errno, fmt::format("closing {}", part.path));
    }
    part.fd = -1;
  }
  return result;
}

Result<FileInfo> FileStore::Info(FileId id) const {
  std::shared_lock lock(table_mu_);
  auto it = files_.find(id);
  if (it == files_.end()) return NotFoundError(fmt::format("file id {} is not open", id));
  return it->second->info;
}

const RegisteredRange* FileStore::FindRange(const char* p, size_t n) const {
  for (const RegisteredRange& r : ranges_) {
    if (p >= r.base && p + n <= r.base + r.length) return &r;
  }
  return nullptr;
}

void FileStore::BuildTransfers(const IoRequest& request, OpenFile* file,
                               RequestState* state) const {
  std::vector<StripeSegment> segments;
  file->layout.Map(request.offset, request.length, &segments);
  char* base = static_cast<char*>(request.buffer);
  const RegisteredRange* range = FindRange(base, request.length);
  for (const StripeSegment& seg : segments) {
    const PhysicalFile& part = file->parts[seg.path_index];
    const uint64_t limit =
        range != nullptr && range->huge_pages ? part.max_request_huge : part.max_request_small;
    uint64_t done = 0;
    while (done < seg.length) {
      const uint64_t n = limit > 0 ? std::min(limit, seg.length - done) : seg.length - done;
      Transfer t;
      t.op = request.op;
      t.file = &part;
      t.offset = seg.path_offset + done;
      t.remaining = n;
      t.buffer = base + seg.buffer_offset + done;
      t.durable = file->durable && request.op == IoOp::kWrite;
      t.alignment = part.direct ? kDirectIoAlignment : 1;
      t.first_offset = t.offset;
      t.total_length = n;
      t.request = state;
      if (range != nullptr && !range->indices.empty()) {
        const size_t first_chunk = static_cast<size_t>(t.buffer - range->base) / kBufferChunk;
        const size_t last_chunk =
            static_cast<size_t>(t.buffer + n - 1 - range->base) / kBufferChunk;
        if (first_chunk == last_chunk) t.buf_index = range->indices[first_chunk];
      }
      state->transfers.push_back(t);
      done += n;
    }
  }
}

Status FileStore::Submit(std::span<IoRequest> requests) {
  std::vector<Transfer*> batch;
  {
    std::shared_lock lock(table_mu_);
    if (has_fatal_.load(std::memory_order_acquire)) return fatal_;
    std::vector<OpenFile*> targets(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      auto it = files_.find(requests[i].file);
      if (it == files_.end()) {
        return NotFoundError(fmt::format("{} at offset {}: file id {} is not open",
                                         IoOpName(requests[i].op), requests[i].offset,
                                         requests[i].file));
      }
      targets[i] = it->second.get();
      STRATA_RETURN_IF_ERROR(ValidateRequest(requests[i], targets[i]->info, targets[i]->where));
    }
    batch.reserve(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      auto* state = new RequestState;
      state->done = std::move(requests[i].done);
      state->file = targets[i];
      state->op = requests[i].op;
      state->offset = requests[i].offset;
      state->length = requests[i].length;
      BuildTransfers(requests[i], targets[i], state);
      state->pending.store(static_cast<uint32_t>(state->transfers.size()),
                           std::memory_order_relaxed);
      targets[i]->outstanding.fetch_add(1, std::memory_order_relaxed);
      in_flight_.fetch_add(1, std::memory_order_relaxed);
      busy_.Enter();
      for (Transfer& t : state->transfers)
        batch.push_back(&t);
    }
  }
  device_requests_.fetch_add(batch.size(), std::memory_order_relaxed);
  Execute(batch);
  return Status::Ok();
}

int64_t FileStore::ConsultFaults(const Transfer& t, uint64_t* issue_length) {
  *issue_length = t.remaining;
  if (!faults_) return 0;
  FaultDecision d = faults_->Decide(t.op, t.file->path, t.offset, t.remaining, t.alignment);
  if (d.error != 0) return -static_cast<int64_t>(d.error);
  if (d.length > 0 && d.length < t.remaining) *issue_length = d.length;
  return 0;
}

FileStore::Next FileStore::OnResult(Transfer* t, int64_t res) {
  const std::string_view path = t->file->path;
  auto describe = [&] { return DescribeTransfer(t->op, path, t->first_offset, t->total_length); };
  auto end_of_file = [&] {
    return OutOfRangeError(
        fmt::format("{}: end of file at offset {} (the file is shorter than the range)", describe(),
                    t->offset));
  };
  if (res < 0) {
    const int err = static_cast<int>(-res);
    if (err == EAGAIN || err == EINTR) {
      if (++t->retries <= kMaxRetries) {
        retries_.fetch_add(1, std::memory_order_relaxed);
        return Next::kResubmit;
      }
      FinishTransfer(t, UnavailableError(fmt::format("{}: still {} after {} retries", describe(),
                                                     ErrnoName(err), kMaxRetries)));
      return Next::kFinished;
    }
    std::string context = describe();
    if (t->remaining != t->total_length) {
      context += fmt::format(" (failed at offset {} after {} bytes)", t->offset,
                             t->total_length - t->remaining);
    }
    Status st = ErrnoToStatus(err, context);
    if (err == EINVAL && t->alignment > 1) {
      // The request was aligned (Submit checked), so the filesystem refused direct I/O itself.
      st = Status(st.code(), std::string(st.message()) +
                                 "; the filesystem may not support O_DIRECT for this file (open "
                                 "it with direct I/O off)");
    }
    FinishTransfer(t, std::move(st));
    return Next::kFinished;
  }
  const auto moved = static_cast<uint64_t>(res);
  if (moved > t->remaining) {
    FinishTransfer(t, InternalError(fmt::format(
                          "{}: the kernel reported {} bytes moved, more than the {} asked",
                          describe(), moved, t->remaining)));
    return Next::kFinished;
  }
  if (moved == 0) {
    if (t->op == IoOp::kRead) {
      FinishTransfer(t, end_of_file());
    } else {
      FinishTransfer(t, DataLossError(fmt::format("{}: the write made no progress at offset {}",
                                                  describe(), t->offset)));
    }
    return Next::kFinished;
  }
  t->offset += moved;
  t->buffer += moved;
  t->remaining -= moved;
  if (t->remaining == 0) {
    FinishTransfer(t, Status::Ok());
    return Next::kFinished;
  }
  short_transfers_.fetch_add(1, std::memory_order_relaxed);
  if (t->alignment > 1 && t->offset % t->alignment != 0) {
    // A direct transfer that stopped mid-block can only mean the end of the file.
    if (t->op == IoOp::kRead) {
      FinishTransfer(t, end_of_file());
    } else {
      FinishTransfer(
          t, DataLossError(fmt::format("{}: the device accepted only part of a block at offset {}",
                                       describe(), t->offset)));
    }
    return Next::kFinished;
  }
  return Next::kResubmit;
}

void FileStore::FinishTransfer(Transfer* t, Status status) {
  RequestState* state = t->request;
  if (!status.ok()) {
    bool expected = false;
    if (state->failed.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) {
      state->error = std::move(status);
    }
  }
  if (state->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) CompleteRequest(state);
}

void FileStore::CompleteRequest(RequestState* state) {
  const bool failed = state->failed.load(std::memory_order_acquire);
  Status status = failed ? std::move(state->error) : Status::Ok();
  if (failed) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    // A piece of a larger request (striped or split) failed: say which request it was part of.
    const bool whole = state->transfers.size() == 1 && state->file->parts.size() == 1 &&
                       state->transfers[0].total_length == state->length;
    if (!whole) {
      status = status.WithContext(
          DescribeTransfer(state->op, state->file->where, state->offset, state->length));
    }
  } else if (state->op == IoOp::kRead) {
    reads_.fetch_add(1, std::memory_order_relaxed);
    bytes_read_.fetch_add(state->length, std::memory_order_relaxed);
  } else {
    writes_.fetch_add(1, std::memory_order_relaxed);
    bytes_written_.fetch_add(state->length, std::memory_order_relaxed);
  }
  OnRequestComplete(state);
  state->file->outstanding.fetch_sub(1, std::memory_order_acq_rel);
  IoCallback done = std::move(state->done);
  delete state;
  done(status);
  busy_.Leave();
  if (in_flight_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    std::lock_guard lock(idle_mu_);
    idle_cv_.notify_all();
  }
}

void FileStore::WaitIdle() {
  std::unique_lock lock(idle_mu_);
  idle_cv_.wait(lock, [&] { return in_flight_.load(std::memory_order_acquire) == 0; });
}

void FileStore::SetFatal(const Status& status) {
  std::unique_lock lock(table_mu_);
  if (has_fatal_.load(std::memory_order_relaxed)) return;
  fatal_ = status;
  has_fatal_.store(true, std::memory_order_release);
  STRATA_LOG(error, io, "{} backend failed permanently: {}", name(), status.message());
}

Status FileStore::Sync(FileId id) {
  // The descriptors are used outside the lock; counting the sync as outstanding keeps Close from
  // closing them underneath it.
  OpenFile* file = nullptr;
  std::vector<std::pair<int, std::string>> fds;
  {
    std::shared_lock lock(table_mu_);
    auto it = files_.find(id);
    if (it == files_.end()) {
      return NotFoundError(fmt::format("cannot sync file id {}: it is not open", id));
    }
    file = it->second.get();
    file->outstanding.fetch_add(1, std::memory_order_acq_rel);
    for (const PhysicalFile& part : file->parts)
      fds.emplace_back(part.fd, part.path);
  }
  Status result;
  for (const auto& [fd, path] : fds) {
    if (::fdatasync(fd) != 0) {
      result = ErrnoToStatus(errno, fmt::format("fdatasync {}", path));
      break;
    }
  }
  file->outstanding.fetch_sub(1, std::memory_order_acq_rel);
  return result;
}

Status FileStore::RegisterBuffers(std::span<const BufferRange> ranges) {
  std::lock_guard reg(register_mu_);
  for (const BufferRange& r : ranges) {
    if (r.base == nullptr || r.length == 0) {
      return InvalidArgumentError("cannot register an empty buffer range");
    }
    {
      std::shared_lock lock(table_mu_);
      for (const RegisteredRange& existing : ranges_) {
        const char* b = static_cast<const char*>(r.base);
        if (b < existing.base + existing.length && existing.base < b + r.length) {
          return InvalidArgumentError(
              fmt::format("buffer range {} (+{} bytes) overlaps a registered range at {}", r.base,
                          r.length, static_cast<const void*>(existing.base)));
        }
      }
    }
    RegisteredRange range{static_cast<char*>(r.base), r.length, r.huge_pages, {}};
    const size_t chunks = (r.length + kBufferChunk - 1) / kBufferChunk;
    if (options_.register_buffers && chunks <= free_buffer_slots_.size()) {
      std::vector<int> indices;
      bool ok = true;
      for (size_t c = 0; c < chunks && ok; ++c) {
        const int index = free_buffer_slots_.back();
        const size_t off = c * kBufferChunk;
        ok = RegisterBufferChunk(range.base + off, std::min(kBufferChunk, r.length - off), index);
        if (ok) {
          free_buffer_slots_.pop_back();
          indices.push_back(index);
        }
      }
      if (ok) {
        range.indices = std::move(indices);
      } else {
        for (int index : indices) {
          RegisterBufferChunk(nullptr, 0, index);
          free_buffer_slots_.push_back(index);
        }
      }
    } else if (options_.register_buffers) {
      STRATA_LOG(warn, io,
                 "the registered-buffer table is full ({} slots); {} bytes at {} are used as "
                 "plain buffers",
                 kMaxBufferSlots, r.length, r.base);
    }
    std::unique_lock lock(table_mu_);
    ranges_.push_back(std::move(range));
  }
  return Status::Ok();
}

Status FileStore::UnregisterBuffers(const void* base) {
  std::lock_guard reg(register_mu_);
  RegisteredRange range;
  {
    std::unique_lock lock(table_mu_);
    auto it = std::find_if(ranges_.begin(), ranges_.end(),
                           [&](const RegisteredRange& r) { return r.base == base; });
    if (it == ranges_.end()) {
      return NotFoundError(fmt::format("no registered buffer range starts at {}", base));
    }
    range = std::move(*it);
    ranges_.erase(it);
  }
  for (int index : range.indices) {
    RegisterBufferChunk(nullptr, 0, index);
    free_buffer_slots_.push_back(index);
  }
  return Status::Ok();
}

StoreStats FileStore::stats() const {
  StoreStats s;
  s.reads = reads_.load(std::memory_order_relaxed);
  s.writes = writes_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  s.errors = errors_.load(std::memory_order_relaxed);
  s.device_requests = device_requests_.load(std::memory_order_relaxed);
  s.short_transfers = short_transfers_.load(std::memory_order_relaxed);
  s.retries = retries_.load(std::memory_order_relaxed);
  s.busy_ns = busy_.TotalNs();
  AddBackendStats(&s);
  return s;
}

}  // namespace strata::io::internal
