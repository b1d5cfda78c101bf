// HostRegion: one large, page-aligned host allocation, backed by huge pages where the system
// allows. The pinned pool and the I/O engine's buffers come from here.
//
// Why huge pages: a block device accepts a bounded number of memory segments per request
// (/sys/block/<dev>/queue/max_segments; often 128-254). A 1 MiB request made of scattered 4 KiB
// pages needs 256 segments and is split by the kernel; from 2 MiB pages it is one segment, and
// adjacent requests can even be merged. Measured on a virtio disk: 0.75 GB/s vs 1.8-2.0 GB/s.
//
// Allocation order under HugePages::kAuto:
//   1. hugetlbfs pages (MAP_HUGETLB, 2 MiB) if enough are reserved and free
//      (/proc/sys/vm/nr_hugepages);
//   2. anonymous memory aligned to 2 MiB with madvise(MADV_HUGEPAGE) (transparent huge pages, when
//      /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise");
//   3. plain 4 KiB pages.
// The region is pre-faulted (MADV_POPULATE_WRITE, or every page touched on kernels before 5.14)
// so its backing is settled before I/O starts, and huge_page_bytes() reports how much of it
// really is on huge pages (from /proc/self/smaps). When THP left part of the region on small
// pages, MADV_COLLAPSE (Linux 6.1+) is tried once before measuring. HugePages::kOff asks for
// MADV_NOHUGEPAGE so that THP "always" does not apply either.
// The memory is private to the process, zero-filled, and unmapped by the destructor.
//
// Thread safety: a HostRegion is not shared-mutable; its memory may be used from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata {

enum class HugePages : uint8_t {
  kAuto,  // best available, never an error
  kOn,    // huge pages (hugetlbfs or THP) for the whole region, or ResourceExhausted
  kOff,   // plain pages
};
std::string_view HugePagesName(HugePages mode);  // "auto" / "on" / "off"

enum class HostBacking : uint8_t { kHugetlbfs, kTransparentHuge, kSmallPages };
std::string_view HostBackingName(HostBacking backing);  // "hugetlbfs" / "thp" / "4k"

inline constexpr size_t kHugePageSize = size_t{2} << 20;

class HostRegion {
 public:
  HostRegion() = default;
  ~HostRegion();
  HostRegion(HostRegion&& other) noexcept;
  HostRegion& operator=(HostRegion&& other) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  // Allocates at least `bytes` (rounded up to 2 MiB when huge pages are used, to 4 KiB otherwise).
  // Errors: InvalidArgument for 0 bytes, ResourceExhausted (naming the size) when the memory
  // cannot be had, or when kOn was asked and huge pages were not obtained.
  static Result<HostRegion> Allocate(size_t bytes, HugePages mode = HugePages::kAuto);

  char* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  HostBacking backing() const { return backing_; }
  // Bytes of the region that the kernel reports as huge-page backed.
  size_t huge_page_bytes() const { return huge_bytes_; }
  // True when every byte is on huge pages.
  bool fully_huge() const { return size_ != 0 && huge_bytes_ >= size_; }

 private:
  void Release();

  char* data_ = nullptr;
  size_t size_ = 0;      // usable bytes
  void* map_ = nullptr;  // what to munmap
  size_t map_size_ = 0;
  HostBacking backing_ = HostBacking::kSmallPages;
  size_t huge_bytes_ = 0;
};

// Facts about huge pages on this machine, for `strata env` and the logs. The hugetlb counts are
// those of the 2 MiB pool (/sys/kernel/mm/hugepages/hugepages-2048kB, else /proc/meminfo when the
// default huge page size is 2 MiB).
struct HugePageInfo {
  std::string thp_mode = "unknown";  // "always", "madvise", "never" or "unknown"
  uint64_t hugetlb_total = 0;        // 2 MiB pages in the pool (vm.nr_hugepages)
  uint64_t hugetlb_free = 0;         // of those, not yet faulted in by any mapping
  uint64_t hugetlb_reserved = 0;     // of the free ones, promised to existing mappings
  // Pages a new mapping can still get.
  uint64_t hugetlb_available() const {
    return hugetlb_free > hugetlb_reserved ? hugetlb_free - hugetlb_reserved : 0;
  }
};
HugePageInfo QueryHugePages();

// Bytes of [addr, addr+len) backed by huge pages according to /proc/self/smaps (AnonHugePages
// for THP; the whole overlap for hugetlbfs mappings). 0 when it cannot be told. smaps reports
// AnonHugePages per mapping (VMA), not per byte: when a VMA extends beyond the range (the kernel
// merged it with a neighbour), its count is capped at the overlap, so the result can overstate.
size_t HugePageBytesInRange(const void* addr, size_t len);

}  // namespace strata
