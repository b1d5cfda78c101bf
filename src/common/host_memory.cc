#include "common/host_memory.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "common/errno.h"
#include "common/log.h"
#include "common/proc_files.h"
#include "common/units.h"

// Older headers lack the newer madvise advice and mmap size flags; the values are kernel ABI.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
#ifndef MAP_HUGE_SHIFT
#define MAP_HUGE_SHIFT 26
#endif
#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << MAP_HUGE_SHIFT)
#endif

namespace strata {

namespace {

constexpr size_t kSmallPageSize = 4096;

// A mapping that is unmapped unless released to a HostRegion.
struct Mapping {
  void* addr = nullptr;
  size_t size = 0;

  Mapping() = default;
  Mapping(void* a, size_t s) : addr(a), size(s) {}
  Mapping(Mapping&& other) noexcept
      : addr(std::exchange(other.addr, nullptr)), size(std::exchange(other.size, 0)) {}
  Mapping& operator=(Mapping&&) = delete;
  ~Mapping() {
    if (addr != nullptr) munmap(addr, size);
  }
};

Result<Mapping> MapAnonymous(size_t size, int extra_flags, std::string_view what) {
  void* p =
      mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    Status st = ErrnoToStatus(
        err, fmt::format("mmap of {} for a host region ({})", FormatBytes(size), what));
    // ENOMEM is ResourceExhausted already; EINVAL (e.g. no huge pages of that size) and EAGAIN
    // (locked-memory limits) also mean the memory cannot be had, so they are reported the same way.
    if (err == EINVAL || err == EAGAIN) st = ResourceExhaustedError(st.message());
    return st;
  }
  return Mapping(p, size);
}

// Maps `size` bytes (a multiple of 2 MiB) of anonymous memory starting on a 2 MiB boundary, so
// that THP can back it with whole huge pages. Over-maps by 2 MiB and trims both ends.
Result<Mapping> MapAligned(size_t size) {
  STRATA_ASSIGN_OR_RETURN(Mapping raw, MapAnonymous(size + kHugePageSize, 0, "2 MiB aligned"));
  auto base = reinterpret_cast<uintptr_t>(raw.addr);
  uintptr_t aligned = RoundUp(base, kHugePageSize);
  size_t head = aligned - base;
  size_t tail = raw.size - head - size;
  void* start = reinterpret_cast<void*>(aligned);
  raw.addr = nullptr;  // from here on the pieces are owned separately
  if (head > 0) munmap(reinterpret_cast<void*>(base), head);
  if (tail > 0) munmap(reinterpret_cast<char*>(start) + size, tail);
  return Mapping(start, size);
}

// Faults every page in, writable, so that the backing is decided now and not during I/O.
Status Prefault(void* addr, size_t size) {
  if (madvise(addr, size, MADV_POPULATE_WRITE) == 0) return Status::Ok();
  int err = errno;
  if (err != EINVAL) {
    Status st = ErrnoToStatus(err, fmt::format("prefaulting a {} host region", FormatBytes(size)));
    if (err == ENOMEM || err == EFAULT) st = ResourceExhaustedError(st.message());
    return st;
  }
  // EINVAL: a kernel before 5.14 without MADV_POPULATE_WRITE. Touch one byte per small page.
  auto* p = static_cast<volatile char*>(addr);
  for (size_t off = 0; off < size; off += kSmallPageSize)
    p[off] = 0;
  return Status::Ok();
}

// "always [madvise] never" -> "madvise".
std::string ThpMode() {
  auto text = procfs::ReadSmallFile("/sys/kernel/mm/transparent_hugepage/enabled", 4096);
  if (!text) return "unknown";
  auto mode = procfs::ActiveChoice(*text);
  return mode ? *mode : "unknown";
}

}  // namespace

std::string_view HugePagesName(HugePages mode) {
  switch (mode) {
    case HugePages::kAuto:
      return "auto";
    case HugePages::kOn:
      return "on";
    case HugePages::kOff:
      return "off";
  }
  return "?";
}

std::string_view HostBackingName(HostBacking backing) {
  switch (backing) {
    case HostBacking::kHugetlbfs:
      return "hugetlbfs";
    case HostBacking::kTransparentHuge:
      return "thp";
    case HostBacking::kSmallPages:
      return "4k";
  }
  return "?";
}

HugePageInfo QueryHugePages() {
  HugePageInfo info;
  info.thp_mode = ThpMode();
  const std::string pool = "/sys/kernel/mm/hugepages/hugepages-2048kB/";
  if (auto total = procfs::ReadUintFile(pool + "nr_hugepages")) {
    info.hugetlb_total = *total;
    info.hugetlb_free = procfs::ReadUintFile(pool + "free_hugepages").value_or(0);
    info.hugetlb_reserved = procfs::ReadUintFile(pool + "resv_hugepages").value_or(0);
    return info;
  }
  // No per-size directory (very old kernels): /proc/meminfo describes the default size only.
  auto meminfo = procfs::ReadSmallFile("/proc/meminfo");
  if (!meminfo || procfs::MeminfoField(*meminfo, "Hugepagesize").value_or(0) != 2048) return info;
  info.hugetlb_total = procfs::MeminfoField(*meminfo, "HugePages_Total").value_or(0);
  info.hugetlb_free = procfs::MeminfoField(*meminfo, "HugePages_Free").value_or(0);
  info.hugetlb_reserved = procfs::MeminfoField(*meminfo, "HugePages_Rsvd").value_or(0);
  return info;
}

size_t HugePageBytesInRange(const void* addr, size_t len) {
  if (addr == nullptr || len == 0) return 0;
  auto smaps = procfs::ReadSmallFile("/proc/self/smaps", size_t{256} << 20);
  if (!smaps) return 0;
  const auto lo = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t hi = lo + len;

  // The VMA being read: its bounds and the fields that matter.
  struct Vma {
    uintptr_t start = 0, end = 0;
    uint64_t anon_huge_kb = 0;
    uint64_t kernel_page_kb = 0;
    bool hugetlb = false;  // VmFlags has "ht"
  };
  size_t total = 0;
  auto account = [&](const Vma& v) {
    uintptr_t a = std::max(v.start, lo);
    uintptr_t b = std::min(v.end, hi);
    if (b <= a) return;
    size_t overlap = b - a;
    if (v.hugetlb || v.kernel_page_kb >= kHugePageSize / 1024) {
      total += overlap;
    } else {
      total += std::min<size_t>(v.anon_huge_kb * 1024, overlap);
    }
  };

  std::string_view text = *smaps;
  Vma vma;
  bool in_vma = false;
  for (std::string_view line : procfs::Lines(text)) {
    size_t space = line.find(' ');
    std::string_view first = line.substr(0, space);
    if (first.empty()) continue;
    if (first.back() != ':') {
      // A VMA header: "7f12a0000000-7f12a0400000 rw-p 00000000 00:00 0".
      if (in_vma) account(vma);
      vma = Vma();
      in_vma = false;
      size_t dash = first.find('-');
      if (dash == std::string_view::npos) continue;
      uint64_t start = 0, end = 0;
      std::string_view s = first.substr(0, dash), e = first.substr(dash + 1);
      if (std::from_chars(s.data(), s.data() + s.size(), start, 16).ec != std::errc() ||
          std::from_chars(e.data(), e.data() + e.size(), end, 16).ec != std::errc()) {
        continue;
      }
      vma.start = start;
      vma.end = end;
      in_vma = true;
      continue;
    }
    if (!in_vma) continue;
    std::string_view value = space == std::string_view::npos ? "" : line.substr(space);
    if (first == "AnonHugePages:") {
      vma.anon_huge_kb = procfs::MeminfoField(line, "AnonHugePages").value_or(0);
    } else if (first == "KernelPageSize:") {
      vma.kernel_page_kb = procfs::MeminfoField(line, "KernelPageSize").value_or(0);
    } else if (first == "VmFlags:") {
      // Two-letter flags separated by spaces; "ht" marks a hugetlb mapping.
      std::string padded = " " + std::string(procfs::Trim(value)) + " ";
      vma.hugetlb = padded.find(" ht ") != std::string::npos;
    }
  }
  if (in_vma) account(vma);
  return std::min(total, len);
}

HostRegion::~HostRegion() {
  Release();
}

HostRegion::HostRegion(HostRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      backing_(std::exchange(other.backing_, HostBacking::kSmallPages)),
      huge_bytes_(std::exchange(other.huge_bytes_, 0)) {}

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    backing_ = std::exchange(other.backing_, HostBacking::kSmallPages);
    huge_bytes_ = std::exchange(other.huge_bytes_, 0);
  }
  return *this;
}

void HostRegion::Release() {
  if (map_ != nullptr) munmap(map_, map_size_);
  data_ = nullptr;
  size_ = 0;
  map_ = nullptr;
  map_size_ = 0;
  backing_ = HostBacking::kSmallPages;
  huge_bytes_ = 0;
}

Result<HostRegion> HostRegion::Allocate(size_t bytes, HugePages mode) {
  if (bytes == 0) return InvalidArgumentError("a host region of 0 bytes was requested");
  if (bytes > std::numeric_limits<size_t>::max() / 2) {
    return ResourceExhaustedError(
        fmt::format("a host region of {} bytes cannot be allocated", bytes));
  }

  auto adopt = [](Mapping m, HostBacking backing, size_t huge_bytes) {
    HostRegion region;
    region.data_ = static_cast<char*>(m.addr);
    region.size_ = m.size;
    region.map_ = m.addr;
    region.map_size_ = m.size;
    region.backing_ = backing;
    region.huge_bytes_ = huge_bytes;
    m.addr = nullptr;  // now owned by the region
    return region;
  };

  if (mode == HugePages::kOff) {
    size_t size = RoundUp(bytes, kSmallPageSize);
    STRATA_ASSIGN_OR_RETURN(Mapping m, MapAnonymous(size, 0, "small pages"));
    // Best effort: keep THP "always" from backing a region that asked for small pages.
    madvise(m.addr, m.size, MADV_NOHUGEPAGE);
    STRATA_RETURN_IF_ERROR(Prefault(m.addr, m.size));
    size_t huge = HugePageBytesInRange(m.addr, m.size);
    return adopt(std::move(m), HostBacking::kSmallPages, huge);
  }

  const size_t huge_size = RoundUp(bytes, kHugePageSize);
  const uint64_t pages_needed = huge_size / kHugePageSize;
  const HugePageInfo info = QueryHugePages();

  // 1. hugetlbfs: the pool's pages are guaranteed huge. A private mapping reserves its pages at
  //    mmap time, so a pool that empties concurrently fails here (ENOMEM), not with a SIGBUS later.
  if (info.hugetlb_available() >= pages_needed) {
    Result<Mapping> m = MapAnonymous(huge_size, MAP_HUGETLB | MAP_HUGE_2MB, "hugetlbfs");
    if (m.ok()) {
      Status st = Prefault(m->addr, m->size);
      if (st.ok()) {
        size_t huge = HugePageBytesInRange(m->addr, m->size);
        return adopt(std::move(m).value(), HostBacking::kHugetlbfs, huge);
      }
      STRATA_LOG(debug, core, "hugetlbfs region of {} could not be prefaulted: {}",
                 FormatBytes(huge_size), st.message());
    } else {
      STRATA_LOG(debug, core, "hugetlbfs region of {} not available: {}", FormatBytes(huge_size),
                 m.status().message());
    }
  }

  // 2. Transparent huge pages on a 2 MiB-aligned mapping.
  size_t thp_bytes = 0;
  if (info.thp_mode == "always" || info.thp_mode == "madvise") {
    STRATA_ASSIGN_OR_RETURN(Mapping m, MapAligned(huge_size));
    bool advised = madvise(m.addr, m.size, MADV_HUGEPAGE) == 0;
    STRATA_RETURN_IF_ERROR(Prefault(m.addr, m.size));
    size_t huge = HugePageBytesInRange(m.addr, m.size);
    if (advised && huge < m.size && madvise(m.addr, m.size, MADV_COLLAPSE) == 0) {
      // Fragmented memory had left some 2 MiB ranges on small pages; the kernel has now
      // compacted and collapsed them (Linux 6.1+; an error just means it could not).
      huge = HugePageBytesInRange(m.addr, m.size);
    }
    if (huge >= m.size || (mode == HugePages::kAuto && huge > 0)) {
      return adopt(std::move(m), HostBacking::kTransparentHuge, huge);
    }
    thp_bytes = huge;
    if (mode == HugePages::kAuto) {
      // THP gave nothing: keep the (already faulted) mapping as a small-page region.
      return adopt(std::move(m), HostBacking::kSmallPages, 0);
    }
  }

  if (mode == HugePages::kOn) {
    return ResourceExhaustedError(fmt::format(
        "huge pages for a {} host region were requested but not obtained: hugetlbfs has {} free "
        "2 MiB pages of {} reserved ({} needed), transparent huge pages are '{}' and gave {} "
        "(reserve pages with `sysctl vm.nr_hugepages={}` or use huge pages 'auto')",
        FormatBytes(huge_size), info.hugetlb_available(), info.hugetlb_total, pages_needed,
        info.thp_mode, FormatBytes(thp_bytes), info.hugetlb_total + pages_needed));
  }

  // 3. Plain pages.
  size_t size = RoundUp(bytes, kSmallPageSize);
  STRATA_ASSIGN_OR_RETURN(Mapping m, MapAnonymous(size, 0, "small pages"));
  STRATA_RETURN_IF_ERROR(Prefault(m.addr, m.size));
  size_t huge = HugePageBytesInRange(m.addr, m.size);
  return adopt(std::move(m), HostBacking::kSmallPages, huge);
}

}  // namespace strata
