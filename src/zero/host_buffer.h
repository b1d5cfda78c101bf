// HostBuffer: a zeroed host buffer from the pinned pool when there is one (registered, fast
// copies), else from the heap (the CPU device takes any host memory). Move-only; returns its
// block to the pool when destroyed or reset. Private to src/zero.
//
// Threading: one owner at a time. The pool is thread-safe, so buffers may be made and freed on
// different threads (the CPU optimizer's thread frees streamed gradient shards).
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <new>
#include <string_view>

#include "device/pinned_pool.h"
#include "strata/status.h"

namespace strata::zero::engine_internal {

class HostBuffer {
 public:
  HostBuffer() = default;
  ~HostBuffer() { Reset(); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = o.pool_;
      block_ = o.block_;
      heap_ = std::move(o.heap_);
      o.pool_ = nullptr;
      o.block_ = {};
    }
    return *this;
  }

  static Result<HostBuffer> Make(device::PinnedPool* pool, size_t bytes, std::string_view what) {
    HostBuffer b;
    if (pool != nullptr) {
      auto block = pool->Allocate(bytes);
      if (!block.ok()) {
        return Status(block.status().code(),
                      fmt::format("{}: {}", what, block.status().message()));
      }
      b.pool_ = pool;
      b.block_ = *block;
    } else {
      b.heap_.reset(new (std::align_val_t{4096}) char[bytes]);
    }
    std::memset(b.data(), 0, bytes);
    return b;
  }

  char* data() const { return pool_ != nullptr ? static_cast<char*>(block_.data) : heap_.get(); }

 private:
  struct AlignedDelete {
    void operator()(char* p) const { ::operator delete[](p, std::align_val_t{4096}); }
  };
  void Reset() {
    if (pool_ != nullptr && block_) pool_->Free(block_);
    pool_ = nullptr;
    block_ = {};
    heap_.reset();
  }
  device::PinnedPool* pool_ = nullptr;
  device::PinnedBlock block_;
  std::unique_ptr<char[], AlignedDelete> heap_;
};

}  // namespace strata::zero::engine_internal
