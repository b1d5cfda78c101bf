#include "strata/block_store.h"

#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <set>
#include <utility>

#include "common/log.h"
#include "io/io_internal.h"
#include "io/memory_store.h"
#include "io/posix_store.h"
#include "io/uring_store.h"

namespace strata::io {

std::string_view IoOpName(IoOp op) {
  return op == IoOp::kRead ? "read" : "write";
}

std::string_view DirectModeName(DirectMode mode) {
  switch (mode) {
    case DirectMode::kAuto:
      return "auto";
    case DirectMode::kOn:
      return "on";
    case DirectMode::kOff:
      return "off";
  }
  return "?";
}

std::string_view BackendName(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kUring:
      return "uring";
    case Backend::kPosix:
      return "posix";
    case Backend::kMemory:
      return "memory";
  }
  return "?";
}

std::future<Status> BlockStore::SubmitAsync(IoOp op, FileId file, uint64_t offset, uint64_t length,
                                            void* buffer) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  IoRequest request{op,     file,   offset,
                    length, buffer, [promise](const Status& s) { promise->set_value(s); }};
  Status st = Submit(request);
  if (!st.ok()) promise->set_value(std::move(st));
  return future;
}

Status BlockStore::Read(FileId file, uint64_t offset, uint64_t length, void* buffer) {
  return SubmitAsync(IoOp::kRead, file, offset, length, buffer).get();
}

Status BlockStore::Write(FileId file, uint64_t offset, uint64_t length, const void* buffer) {
  // The store never writes into a write request's buffer.
  return SubmitAsync(IoOp::kWrite, file, offset, length, const_cast<void*>(buffer)).get();
}

Result<std::unique_ptr<BlockStore>> CreateBlockStore(const StoreOptions& options,
                                                     std::shared_ptr<FaultInjector> faults) {
  if (options.threads < 1) {
    return InvalidArgumentError(
        fmt::format("I/O threads must be at least 1, got {}", options.threads));
  }
  if (options.queue_depth < 1) {
    return InvalidArgumentError(
        fmt::format("queue depth must be at least 1, got {}", options.queue_depth));
  }
  switch (options.backend) {
    case Backend::kMemory:
      return CreateMemoryStore(options, faults);
    case Backend::kPosix:
      return CreatePosixStore(options, faults);
    case Backend::kUring:
      return CreateUringStore(options, faults);
    case Backend::kAuto: {
      Result<std::unique_ptr<BlockStore>> uring = CreateUringStore(options, faults);
      if (uring.ok()) {
        STRATA_LOG_ONCE(debug, io, "I/O backend: io_uring ({} thread(s), queue depth {})",
                        options.threads, options.queue_depth);
        return uring;
      }
      STRATA_LOG_ONCE(warn, io, "io_uring is not usable here ({}); using the pread/pwrite backend",
                      uring.status().message());
      return CreatePosixStore(options, faults);
    }
  }
  return InvalidArgumentError("unknown I/O backend");
}

namespace internal {

std::string DescribeTransfer(IoOp op, std::string_view path, uint64_t offset, uint64_t length) {
  return fmt::format("{} of {} bytes at offset {} in {}", IoOpName(op), length, offset, path);
}

std::string DescribePaths(const FileInfo& info) {
  if (info.paths.empty()) return "<no path>";
  if (info.paths.size() == 1) return info.paths[0];
  std::string out = info.paths[0] + " (striped with ";
  for (size_t i = 1; i < info.paths.size(); ++i) {
    if (i > 1) out += ", ";
    out += info.paths[i];
  }
  return out + ")";
}

Status ValidateRequest(const IoRequest& r, const FileInfo& info, std::string_view where) {
  if (r.length == 0) {
    return InvalidArgumentError(
        fmt::format("{} at offset {} in {}: length is 0", IoOpName(r.op), r.offset, where));
  }
  if (r.buffer == nullptr) {
    return InvalidArgumentError(
        fmt::format("{}: buffer is null", DescribeTransfer(r.op, where, r.offset, r.length)));
  }
  if (!r.done) {
    return InvalidArgumentError(fmt::format("{}: no completion callback",
                                            DescribeTransfer(r.op, where, r.offset, r.length)));
  }
  if (r.op == IoOp::kWrite && info.read_only) {
    return PermissionDeniedError(fmt::format("{}: the file was opened read-only",
                                             DescribeTransfer(r.op, where, r.offset, r.length)));
  }
  if (r.offset + r.length < r.offset) {
    return InvalidArgumentError(fmt::format("{}: offset + length overflows",
                                            DescribeTransfer(r.op, where, r.offset, r.length)));
  }
  const uint64_t a = info.alignment;
  if (a > 1) {
    const auto addr = reinterpret_cast<uintptr_t>(r.buffer);
    const char* what = nullptr;
    uint64_t value = 0;
    if (r.offset % a != 0) {
      what = "offset";
      value = r.offset;
    } else if (r.length % a != 0) {
      what = "length";
      value = r.length;
    } else if (addr % a != 0) {
      what = "buffer address";
      value = addr;
    }
    if (what != nullptr) {
      return InvalidArgumentError(fmt::format(
          "{}: {} {:#x} ({}) is not a multiple of {} bytes, which direct I/O requires (use "
          "aligned buffers and sizes, or open the file with direct I/O off)",
          DescribeTransfer(r.op, where, r.offset, r.length), what, value, value, a));
    }
  }
  return Status::Ok();
}

Status ValidateFileSpec(const FileSpec& spec) {
  if (spec.paths.empty()) return InvalidArgumentError("a file needs at least one path");
  std::set<std::string> seen;
  for (const auto& p : spec.paths) {
    if (p.empty()) return InvalidArgumentError("a file path is empty");
    if (!seen.insert(p).second) {
      return InvalidArgumentError(fmt::format("path {} is given twice for one striped file", p));
    }
  }
  if (spec.paths.size() > 1) {
    if (spec.stripe_unit == 0 || spec.stripe_unit % kDirectIoAlignment != 0) {
      return InvalidArgumentError(
          fmt::format("stripe unit {} is not a positive multiple of {} bytes", spec.stripe_unit,
                      kDirectIoAlignment));
    }
  }
  return Status::Ok();
}

void BusyClock::Enter() {
  std::lock_guard lock(mu_);
  if (active_++ == 0) since_ns_ = clock_->NowNs();
}

void BusyClock::Leave() {
  std::lock_guard lock(mu_);
  if (--active_ == 0) busy_ns_ += static_cast<uint64_t>(clock_->NowNs() - since_ns_);
}

uint64_t BusyClock::TotalNs() const {
  std::lock_guard lock(mu_);
  return busy_ns_ + (active_ > 0 ? static_cast<uint64_t>(clock_->NowNs() - since_ns_) : 0);
}

}  // namespace internal
}  // namespace strata::io
