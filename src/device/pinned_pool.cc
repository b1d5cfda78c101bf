#include "device/pinned_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/units.h"

namespace strata::device {

namespace {

constexpr size_t kGranule = 4096;              // block alignment and size granularity
constexpr size_t kSmallClassLimit = 64 << 10;  // powers of two up to here
constexpr int kStepsPerDoublingLog2 = 3;       // then 8 classes per power of two: waste < 1/8

}  // namespace

// Free space is kept in two forms:
//   - coalesced extents, indexed by offset (to find neighbours when a block comes back) and by
//     (length, offset) (best fit: the smallest extent that fits, the lowest address among equal
//     lengths). A set of pairs rather than a multimap so that removing one extent is O(log n)
//     even when many extents have the same length.
//   - a cache of freed blocks per size class, not merged with anything, so that the common case
//     (a shard of the same size freed and allocated again) is a vector pop. A request that finds
//     no cached block of its class first returns every cached block to the extents, which merges
//     them with their free neighbours, then takes a best fit. So the cache never makes a request
//     fail that the fully coalesced pool could serve, and each cached block is merged once: both
//     calls are O(log n) amortized.
// `live` maps the offset of every block handed out to its capacity; it is what makes a foreign or
// double Free detectable.
struct PinnedPool::State {
  mutable std::mutex mu;
  std::map<uint64_t, uint64_t> free_by_offset;                 // offset -> length
  std::set<std::pair<uint64_t, uint64_t>> free_by_length;      // (length, offset)
  std::unordered_map<uint64_t, std::vector<uint64_t>> cached;  // class -> offsets
  uint64_t cached_bytes = 0;
  std::unordered_map<uint64_t, uint64_t> live;  // offset -> capacity
  uint64_t in_use = 0;
  uint64_t peak = 0;
  uint64_t allocs = 0;
  uint64_t failed_allocs = 0;

  void AddExtent(uint64_t offset, uint64_t length) {
    free_by_offset.emplace(offset, length);
    free_by_length.emplace(length, offset);
  }
  void RemoveExtent(std::map<uint64_t, uint64_t>::iterator it) {
    free_by_length.erase({it->second, it->first});
    free_by_offset.erase(it);
  }

  // Returns [offset, offset + length) to the extents, merged with the free extents it touches.
  void Release(uint64_t offset, uint64_t length) {
    auto next = free_by_offset.lower_bound(offset);
    assert(next == free_by_offset.end() || offset + length <= next->first);
    if (next != free_by_offset.end() && next->first == offset + length) {
      length += next->second;
      auto after = std::next(next);
      RemoveExtent(next);
      next = after;
    }
    if (next != free_by_offset.begin()) {
      auto prev = std::prev(next);
      assert(prev->first + prev->second <= offset);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        length += prev->second;
        RemoveExtent(prev);
      }
    }
    AddExtent(offset, length);
  }

  void FlushCache() {
    for (auto& [capacity, offsets] : cached) {
      for (uint64_t offset : offsets)
        Release(offset, capacity);
    }
    cached.clear();
    cached_bytes = 0;
  }

  // Where a block of `capacity` bytes can start inside the extent [offset, offset + length), or
  // nullopt. A block of at most one registration chunk must not cross a chunk boundary, so that
  // it lies inside one registered buffer range; larger blocks span chunks anyway.
  static std::optional<uint64_t> PlaceIn(uint64_t offset, uint64_t length, uint64_t capacity) {
    if (capacity > length) return std::nullopt;
    if (capacity > kRegisterChunk) return offset;
    if (offset / kRegisterChunk == (offset + capacity - 1) / kRegisterChunk) return offset;
    const uint64_t start = RoundUp(offset, kRegisterChunk);
    if (start + capacity <= offset + length) return start;
    return std::nullopt;
  }

  // Carves a block of `capacity` bytes from the best-fitting extent: its offset, or nullopt.
  // An extent that fits only across a chunk boundary is skipped; each such extent holds a
  // boundary, so at most size / kRegisterChunk of them are looked at.
  std::optional<uint64_t> Carve(uint64_t capacity) {
    for (auto it = free_by_length.lower_bound({capacity, 0}); it != free_by_length.end(); ++it) {
      const auto [length, offset] = *it;
      const std::optional<uint64_t> start = PlaceIn(offset, length, capacity);
      if (!start) continue;
      RemoveExtent(free_by_offset.find(offset));
      if (*start > offset) AddExtent(offset, *start - offset);
      const uint64_t end = *start + capacity;
      if (end < offset + length) AddExtent(end, offset + length - end);
      return start;
    }
    return std::nullopt;
  }

  // The largest extent the free space would form if the cache were merged, without merging it.
  uint64_t LargestFree() const {
    if (cached_bytes == 0) {
      return free_by_length.empty() ? 0 : free_by_length.rbegin()->first;
    }
    std::vector<std::pair<uint64_t, uint64_t>> pieces(free_by_offset.begin(), free_by_offset.end());
    for (const auto& [capacity, offsets] : cached) {
      for (uint64_t offset : offsets)
        pieces.emplace_back(offset, capacity);
    }
    std::sort(pieces.begin(), pieces.end());
    uint64_t largest = 0;
    uint64_t run_start = 0, run_end = 0;
    for (const auto& [offset, length] : pieces) {
      if (offset != run_end) run_start = offset;
      run_end = offset + length;
      largest = std::max(largest, run_end - run_start);
    }
    return largest;
  }
};

size_t PinnedPool::SizeClass(size_t bytes) {
  if (bytes <= kGranule) return kGranule;
  if (bytes <= kSmallClassLimit) return std::bit_ceil(bytes);
  // bytes in (2^k, 2^(k+1)], k >= 16: classes 2^k + i * 2^(k-3), i = 1..8. The step is at least
  // 8 KiB, so every class is a multiple of 4 KiB, and the waste is below one step < bytes / 8.
  const int k = static_cast<int>(std::bit_width(bytes - 1)) - 1;
  const size_t step = size_t{1} << (k - kStepsPerDoublingLog2);
  return RoundUp(bytes, step);
}

Result<std::unique_ptr<PinnedPool>> PinnedPool::Create(const PinnedPoolOptions& options) {
  if (options.bytes == 0) {
    return InvalidArgumentError(
        "pinned pool: the size must be positive (strata.memory.pinned_pool)");
  }
  Result<HostRegion> region = HostRegion::Allocate(options.bytes, options.huge_pages);
  if (!region.ok()) return region.status().WithContext("pinned pool");

  std::unique_ptr<PinnedPool> pool(new PinnedPool());
  pool->region_ = std::move(region).value();
  pool->state_ = std::make_unique<State>();
  pool->state_->AddExtent(0, pool->region_.size());
  char* base = pool->region_.data();
  const size_t size = pool->region_.size();

  // On an error below, the destructor undoes whatever registration succeeded.
  if (options.device != nullptr) {
    Status st = options.device->RegisterHost(base, size);
    if (!st.ok()) {
      return st.WithContext(fmt::format("pinned pool: registering {} with device {}",
                                        FormatBytes(size), options.device->name()));
    }
    pool->device_ = options.device;
    pool->device_registered_ = true;
  }
  if (options.store != nullptr) {
    std::vector<io::BufferRange> ranges;
    for (size_t offset = 0; offset < size; offset += kRegisterChunk) {
      ranges.push_back(io::BufferRange{base + offset, std::min(kRegisterChunk, size - offset),
                                       pool->region_.fully_huge()});
    }
    pool->store_ = options.store;
    Status st = options.store->RegisterBuffers(ranges);
    if (!st.ok()) {
      // The store may have taken some of the ranges before refusing one.
      for (const io::BufferRange& r : ranges)
        options.store->UnregisterBuffers(r.base).IgnoreError();
      return st.WithContext(fmt::format("pinned pool: registering {} with the {} store",
                                        FormatBytes(size), options.store->name()));
    }
    pool->store_registered_ = true;
  }
  STRATA_LOG(info, device, "pinned pool: {} at {} ({}, {} on huge pages){}{}", FormatBytes(size),
             static_cast<void*>(base), HostBackingName(pool->region_.backing()),
             FormatBytes(pool->region_.huge_page_bytes()),
             pool->device_registered_ ? ", registered with the device" : "",
             pool->store_registered_ ? ", registered with the store" : "");
  return pool;
}

PinnedPool::~PinnedPool() {
  if (state_ != nullptr) {
    std::lock_guard lock(state_->mu);
    if (!state_->live.empty()) {
      STRATA_LOG(error, device,
                 "pinned pool destroyed with {} block(s) ({}) still allocated; their memory is "
                 "unmapped now",
                 state_->live.size(), FormatBytes(state_->in_use));
    }
  }
  if (store_registered_) {
    for (size_t offset = 0; offset < region_.size(); offset += kRegisterChunk) {
      Status st = store_->UnregisterBuffers(region_.data() + offset);
      if (!st.ok()) {
        STRATA_LOG(error, device, "pinned pool: unregistering from the store: {}", st.ToString());
      }
    }
  }
  if (device_registered_) {
    Status st = device_->UnregisterHost(region_.data());
    if (!st.ok()) {
      STRATA_LOG(error, device, "pinned pool: unregistering from the device: {}", st.ToString());
    }
  }
}

Result<PinnedBlock> PinnedPool::Allocate(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError("pinned pool: cannot allocate 0 bytes");
  State& s = *state_;
  std::lock_guard lock(s.mu);
  const uint64_t size = region_.size();
  uint64_t capacity = 0;
  std::optional<uint64_t> offset;
  if (bytes <= size) {
    capacity = SizeClass(bytes);
    if (auto it = s.cached.find(capacity); it != s.cached.end() && !it->second.empty()) {
      offset = it->second.back();
      it->second.pop_back();
      s.cached_bytes -= capacity;
    } else {
      if (s.cached_bytes > 0) s.FlushCache();
      offset = s.Carve(capacity);
      // The class does not fit but the request itself might (e.g. the whole pool): serve it
      // with its size rounded to the granule only.
      const uint64_t exact = RoundUp(bytes, kGranule);
      if (!offset && exact < capacity) {
        offset = s.Carve(exact);
        if (offset) capacity = exact;
      }
    }
  }
  if (!offset) {
    ++s.failed_allocs;
    return ResourceExhaustedError(fmt::format(
        "pinned pool exhausted: cannot allocate {} ({} bytes, size class {}); pool {}, in use {}, "
        "largest free extent {} (strata.memory.pinned_pool sets the pool size)",
        FormatBytes(bytes), bytes, FormatBytes(bytes <= size ? SizeClass(bytes) : bytes),
        FormatBytes(size), FormatBytes(s.in_use), FormatBytes(s.LargestFree())));
  }
  s.live.emplace(*offset, capacity);
  s.in_use += capacity;
  s.peak = std::max(s.peak, s.in_use);
  ++s.allocs;
  return PinnedBlock{region_.data() + *offset, bytes, capacity};
}

void PinnedPool::Free(const PinnedBlock& block) {
  if (block.data == nullptr) return;
  State& s = *state_;
  std::lock_guard lock(s.mu);
  const char* p = static_cast<const char*>(block.data);
  auto live = Contains(p) ? s.live.find(static_cast<uint64_t>(p - region_.data())) : s.live.end();
  if (live == s.live.end() || live->second != block.capacity) {
    // A pointer from elsewhere, a block freed twice, or a block whose fields were altered:
    // putting it back would let two owners share memory, so it is refused.
    STRATA_LOG(error, device,
               "pinned pool: Free of {} (capacity {}) that is not a live block of this pool "
               "({}); ignored",
               block.data, block.capacity,
               !Contains(p) ? "outside the pool"
               : live == s.live.end()
                   ? "not allocated: freed twice or never handed out"
                   : fmt::format("it was allocated with capacity {}", live->second));
    assert(false && "PinnedPool::Free of a block that is not live");
    return;
  }
  const uint64_t offset = live->first;
  const uint64_t capacity = live->second;
  s.live.erase(live);
  s.in_use -= capacity;
  if (SizeClass(capacity) == capacity) {
    s.cached[capacity].push_back(offset);
    s.cached_bytes += capacity;
  } else {
    s.Release(offset, capacity);  // an odd size (see Allocate): no class to reuse it
  }
}

bool PinnedPool::Contains(const void* p) const {
  const char* c = static_cast<const char*>(p);
  return c >= region_.data() && c < region_.data() + region_.size();
}

PinnedPoolStats PinnedPool::stats() const {
  PinnedPoolStats out;
  out.size = region_.size();
  out.huge_page_bytes = region_.huge_page_bytes();
  out.device_registered = device_registered_;
  out.store_registered = store_registered_;
  std::lock_guard lock(state_->mu);
  out.in_use = state_->in_use;
  out.peak = state_->peak;
  out.largest_free = state_->LargestFree();
  out.allocs = state_->allocs;
  out.failed_allocs = state_->failed_allocs;
  return out;
}

}  // namespace strata::device
