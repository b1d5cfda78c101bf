// PinnedPool: Strata's one pinned host buffer. Every host-side copy of a shard lives in it.
//
// The pool is a single HostRegion (huge pages where the system allows), allocated once at start
// with the size from the configuration (strata.memory.pinned_pool), registered with the Device
// (cudaHostRegister on CUDA, so host<->device copies are truly asynchronous) and with the
// BlockStore as fixed buffers (io_uring: no per-request page pinning). It is then carved by a
// size-class allocator:
//   - a request is rounded up to its size class (4 KiB granularity, classes spaced so that
//     rounding wastes at most 1/8 of the request above 64 KiB);
//   - freed blocks are kept on per-class free lists for immediate reuse, and coalesced with free
//     neighbours when a request finds no block of its class, so a request larger than any block
//     handed out so far is still served as one contiguous extent if the pool has room — there is
//     no "tensor larger than the swap buffer" failure;
//   - every block is 4 KiB aligned (one O_DIRECT I/O) and lies inside one registered range:
//     the pool is registered with the store in ranges of kRegisterChunk (1 GiB, io_uring's limit
//     per fixed buffer) and a block of at most that size never crosses a range boundary (a larger
//     block necessarily spans several ranges);
//   - a request whose size class does not fit anywhere but whose size rounded up to 4 KiB does
//     (e.g. one block of the whole pool) gets that smaller capacity.
// Allocation beyond the pool is ResourceExhausted naming the pool size, the bytes in use, the
// largest free extent and the request.
//
// Threading: Allocate and Free may be called from any thread (one mutex; both are O(log n)
// amortized: a freed block is merged into the free extents at most once).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common/host_memory.h"
#include "strata/block_store.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::device {

struct PinnedPoolOptions {
  uint64_t bytes = 0;  // pool size; > 0; rounded up to 4 KiB (2 MiB with huge pages)
  HugePages huge_pages = HugePages::kAuto;
  Device* device = nullptr;         // registers the pool with it when set
  io::BlockStore* store = nullptr;  // registers the pool as fixed buffers when set
};

// One allocation. `data` is 4 KiB aligned; `capacity` >= `bytes` is what was reserved.
struct PinnedBlock {
  void* data = nullptr;
  size_t bytes = 0;
  size_t capacity = 0;
  explicit operator bool() const { return data != nullptr; }
};

struct PinnedPoolStats {
  uint64_t size = 0;          // pool bytes
  uint64_t in_use = 0;        // capacity of live blocks
  uint64_t peak = 0;          // highest in_use
  uint64_t largest_free = 0;  // largest contiguous free extent (after coalescing)
  uint64_t allocs = 0;
  uint64_t failed_allocs = 0;
  uint64_t huge_page_bytes = 0;  // bytes of the pool on huge pages
  bool device_registered = false;
  bool store_registered = false;
};

class PinnedPool {
 public:
  static Result<std::unique_ptr<PinnedPool>> Create(const PinnedPoolOptions& options);
  // Unregisters from the device and the store. Every block must have been freed and no I/O or
  // copy may still use the pool.
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Ranges of at most this many bytes are what the pool registers with the store.
  static constexpr size_t kRegisterChunk = size_t{1} << 30;

  // A block of at least `bytes`: InvalidArgument for 0, ResourceExhausted when no free extent
  // (after coalescing) is large enough.
  Result<PinnedBlock> Allocate(size_t bytes);
  // Returns a block from Allocate (an empty block is ignored); no I/O or copy may still use it.
  // Freeing anything else (a foreign pointer, a block freed twice, a block whose capacity was
  // altered) is a programming error: it is logged and ignored, and asserts in debug builds.
  void Free(const PinnedBlock& block);

  // Size class (reserved bytes) for a request of `bytes` (<= 2^63): 4 KiB, 8 KiB, ... 64 KiB,
  // then 8 classes per power of two. Monotone, >= bytes, a multiple of 4 KiB, and above 64 KiB
  // less than bytes / 8 larger than bytes.
  static size_t SizeClass(size_t bytes);

  bool Contains(const void* p) const;
  char* base() const { return region_.data(); }
  size_t size() const { return region_.size(); }
  PinnedPoolStats stats() const;

 private:
  PinnedPool() = default;
  struct State;
  HostRegion region_;
  Device* device_ = nullptr;
  io::BlockStore* store_ = nullptr;
  bool device_registered_ = false;
  bool store_registered_ = false;
  std::unique_ptr<State> state_;
};

}  // namespace strata::device
