#include "io/file_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "common/errno.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/units.h"
#include "io/io_internal.h"
#include "io/path_info.h"

namespace strata::io::internal {

namespace {

// The filesystem type of an open descriptor, for messages.
std::string FilesystemOf(const std::string& path) {
  Result<PathInfo> info = DescribePath(path, /*probe_direct=*/false);
  return info.ok() ? info->filesystem : "unknown";
}

}  // namespace

FileStore::FileStore(const StoreOptions& options, std::shared_ptr<FaultInjector> faults)
    : options_(options), faults_(std::move(faults)) {}

FileStore::~FileStore() {
  // The backend has stopped its threads (after draining) before this runs.
  for (auto& [id, file] : files_) {
    for (auto& part : file->parts) {
      if (part.fd >= 0) ::close(part.fd);
    }
  }
}

void FileStore::CloseParts(std::vector<PhysicalFile>& parts, const std::vector<bool>& created) {
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].fd < 0) continue;
    OnFileClosing(parts[i]);
    ::close(parts[i].fd);
    parts[i].fd = -1;
    // A file this Open created is removed again when the Open fails; existing files are kept.
    if (i < created.size() && created[i]) ::unlink(parts[i].path.c_str());
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

  bool all_direct = true;
  bool any_direct = false;
  for (uint32_t i = 0; i < num_paths; ++i) {
    PhysicalFile part;
    part.path = spec.paths[i];
    struct stat st {};
    const bool existed = ::stat(part.path.c_str(), &st) == 0;
    if (existed && S_ISDIR(st.st_mode)) {
      return fail(InvalidArgumentError(
          fmt::format("cannot open {}: it is a directory, not a file", part.path)));
    }
    int flags = O_CLOEXEC | (spec.read_only ? O_RDONLY : O_RDWR);
    if (spec.create && !spec.read_only) flags |= O_CREAT;
    if (spec.truncate && !spec.read_only) flags |= O_TRUNC;
    const bool want_direct = spec.direct != DirectMode::kOff;
    int fd = ::open(part.path.c_str(), flags | (want_direct ? O_DIRECT : 0), 0644);
    part.direct = want_direct;
    if (fd < 0 && errno == EINVAL && want_direct) {
      const std::string fs = FilesystemOf(part.path);
      if (spec.direct == DirectMode::kOn) {
        return fail(InvalidArgumentError(fmt::format(
            "cannot open {} with O_DIRECT: its filesystem ({}) does not support direct I/O, and "
            "direct I/O was required (direct: on); use direct: auto to fall back to buffered I/O, "
            "or put the file on a filesystem that supports O_DIRECT (ext4, xfs)",
            part.path, fs)));
      }
      fd = ::open(part.path.c_str(), flags, 0644);
      part.direct = false;
      if (fd >= 0) {
        STRATA_LOG(warn, io,
                   "{}: the filesystem ({}) does not support O_DIRECT; using buffered I/O through "
                   "the page cache (slower, and it competes with the model for host memory)",
                   part.path, fs);
      }
    }
    if (fd < 0) {
      return fail(ErrnoToStatus(errno, fmt::format("cannot open {}", part.path)));
    }
    part.fd = fd;
    created.push_back(!existed && spec.create);
    all_direct = all_direct && part.direct;
    any_direct = any_direct || part.direct;

    const uint64_t want = file->layout.PathBytes(i, spec.preallocate);
    if (want > 0 && !spec.read_only) {
      struct stat fst {};
      if (::fstat(fd, &fst) != 0) {
        file->parts.push_back(part);
        return fail(ErrnoToStatus(errno, fmt::format("cannot stat {}", part.path)));
      }
      const uint64_t allocated = static_cast<uint64_t>(fst.st_blocks) * 512;
      if (allocated < want) {
        const uint64_t need = want - allocated;
        struct statvfs vfs {};
        uint64_t free_bytes = UINT64_MAX;
        if (::fstatvfs(fd, &vfs) == 0) free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
        auto shortage = [&](uint64_t free_now) {
          return ResourceExhaustedError(fmt::format(
              "not enough space to preallocate {} ({} bytes) for {}: {} more bytes are needed but "
              "only {} bytes are free on its filesystem ({})",
              FormatBytes(want), want, part.path, need, free_now, FormatBytes(free_now)));
        };
        if (free_bytes < need) {
          file->parts.push_back(part);
          return fail(shortage(free_bytes));
        }
        if (::fallocate(fd, 0, 0, static_cast<off_t>(want)) != 0) {
          const int err = errno;
          if (err == EOPNOTSUPP || err == ENOSYS) {
            // No fallocate here (some network filesystems): extend the file instead.
            if (static_cast<uint64_t>(fst.st_size) < want &&
                ::ftruncate(fd, static_cast<off_t>(want)) != 0) {
              file->parts.push_back(part);
              return fail(ErrnoToStatus(
                  errno, fmt::format("cannot extend {} to {} bytes", part.path, want)));
            }
          } else if (err == ENOSPC || err == EDQUOT) {
            if (::fstatvfs(fd, &vfs) == 0) free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
            file->parts.push_back(part);
            return fail(shortage(free_bytes));
          } else {
            file->parts.push_back(part);
            return fail(ErrnoToStatus(
                err, fmt::format("cannot preallocate {} bytes for {}", want, part.path)));
          }
        }
      }
    }

    if (options_.respect_queue_limits && part.direct) {
      if (std::optional<QueueLimits> q = QueueLimitsForPath(part.path)) {
        part.max_request_small = q->MaxRequestBytes(4096);
        part.max_request_huge = q->MaxRequestBytes(kHugePageSize);
      }
    }
    Status hooked = OnFileOpened(part);
    file->parts.push_back(part);
    if (!hooked.ok()) return fail(hooked.WithContext(fmt::format("cannot open {}", part.path)));
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
          fmt::format("cannot close {}: {} request(s) on it have not completed", it->second->where,
                      outstanding));
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
      if (range != nullptr && range->first_index >= 0) {
        const size_t first_chunk = static_cast<size_t>(t.buffer - range->base) / kBufferChunk;
        const size_t last_chunk =
            static_cast<size_t>(t.buffer + n - 1 - range->base) / kBufferChunk;
        if (first_chunk == last_chunk)
          t.buf_index = range->first_index + static_cast<int>(first_chunk);
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
  if (res < 0) {
    const int err = static_cast<int>(-res);
    if (err == EAGAIN || err == EINTR) {
      if (++t->retries <= kMaxRetries) {
        retries_.fetch_add(1, std::memory_order_relaxed);
        return Next::kResubmit;
      }
      FinishTransfer(t, UnavailableError(fmt::format(
                            "{}: still {} after {} retries",
                            DescribeTransfer(t->op, path, t->first_offset, t->total_length),
                            ErrnoName(err), kMaxRetries)));
      return Next::kFinished;
    }
    std::string context = DescribeTransfer(t->op, path, t->first_offset, t->total_length);
    if (t->remaining != t->total_length) {
      context += fmt::format(" (failed at offset {} after {} bytes)", t->offset,
                             t->total_length - t->remaining);
    }
    FinishTransfer(t, ErrnoToStatus(err, context));
    return Next::kFinished;
  }
  const auto moved = static_cast<uint64_t>(res);
  if (moved > t->remaining) {
    FinishTransfer(t, InternalError(fmt::format(
                          "{}: the kernel reported {} bytes moved, more than the {} asked",
                          DescribeTransfer(t->op, path, t->first_offset, t->total_length), moved,
                          t->remaining)));
    return Next::kFinished;
  }
  if (moved == 0) {
    if (t->op == IoOp::kRead) {
      FinishTransfer(
          t, OutOfRangeError(fmt::format(
                 "{}: end of file at offset {} (the file is shorter than the range)",
                 DescribeTransfer(t->op, path, t->first_offset, t->total_length), t->offset)));
    } else {
      FinishTransfer(
          t, DataLossError(fmt::format(
                 "{}: the write made no progress at offset {}",
                 DescribeTransfer(t->op, path, t->first_offset, t->total_length), t->offset)));
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
      FinishTransfer(
          t, OutOfRangeError(fmt::format(
                 "{}: end of file at offset {} (the file is shorter than the range)",
                 DescribeTransfer(t->op, path, t->first_offset, t->total_length), t->offset)));
    } else {
      FinishTransfer(
          t, DataLossError(fmt::format(
                 "{}: the device accepted only part of a block at offset {}",
                 DescribeTransfer(t->op, path, t->first_offset, t->total_length), t->offset)));
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
  } else if (state->op == IoOp::kRead) {
    reads_.fetch_add(1, std::memory_order_relaxed);
    bytes_read_.fetch_add(state->length, std::memory_order_relaxed);
  } else {
    writes_.fetch_add(1, std::memory_order_relaxed);
    bytes_written_.fetch_add(state->length, std::memory_order_relaxed);
  }
  state->file->outstanding.fetch_sub(1, std::memory_order_acq_rel);
  IoCallback done = std::move(state->done);
  delete state;
  done(status);
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
  std::shared_lock lock(table_mu_);
  auto it = files_.find(id);
  if (it == files_.end())
    return NotFoundError(fmt::format("cannot sync file id {}: it is not open", id));
  for (const PhysicalFile& part : it->second->parts) {
    if (::fdatasync(part.fd) != 0) {
      return ErrnoToStatus(errno, fmt::format("fdatasync {}", part.path));
    }
  }
  return Status::Ok();
}

Status FileStore::RegisterBuffers(std::span<const BufferRange> ranges) {
  std::lock_guard reg(register_mu_);
  for (const BufferRange& r : ranges) {
    if (r.base == nullptr || r.length == 0) {
      return InvalidArgumentError("cannot register an empty buffer range");
    }
    std::vector<struct iovec> chunks;
    for (size_t off = 0; off < r.length; off += kBufferChunk) {
      chunks.push_back({static_cast<char*>(r.base) + off, std::min(kBufferChunk, r.length - off)});
    }
    int first = -1;
    if (options_.register_buffers &&
        next_buffer_index_ + static_cast<int>(chunks.size()) <= kMaxBufferSlots &&
        RegisterBufferChunks(chunks, next_buffer_index_)) {
      first = next_buffer_index_;
      next_buffer_index_ += static_cast<int>(chunks.size());
    }
    std::unique_lock lock(table_mu_);
    ranges_.push_back({static_cast<char*>(r.base), r.length, r.huge_pages, first});
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
  return s;
}

}  // namespace strata::io::internal
