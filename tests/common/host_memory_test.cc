#include "common/host_memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>

namespace strata {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;

bool IsAlignedPtr(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// Writes a pattern over the whole region and reads it back: the memory is really there.
void CheckUsable(const HostRegion& r) {
  for (size_t off = 0; off < r.size(); off += 4096)
    r.data()[off] = static_cast<char>(off >> 12);
  r.data()[r.size() - 1] = 0x5a;
  for (size_t off = 0; off < r.size(); off += 4096) {
    ASSERT_EQ(r.data()[off], static_cast<char>(off >> 12)) << "offset " << off;
  }
  EXPECT_EQ(r.data()[r.size() - 1], 0x5a);
}

TEST(HostMemoryTest, Names) {
  EXPECT_EQ(HugePagesName(HugePages::kAuto), "auto");
  EXPECT_EQ(HugePagesName(HugePages::kOn), "on");
  EXPECT_EQ(HugePagesName(HugePages::kOff), "off");
  EXPECT_EQ(HostBackingName(HostBacking::kHugetlbfs), "hugetlbfs");
  EXPECT_EQ(HostBackingName(HostBacking::kTransparentHuge), "thp");
  EXPECT_EQ(HostBackingName(HostBacking::kSmallPages), "4k");
}

TEST(HostMemoryTest, ZeroBytesIsInvalid) {
  for (HugePages mode : {HugePages::kAuto, HugePages::kOn, HugePages::kOff}) {
    Result<HostRegion> r = HostRegion::Allocate(0, mode);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(HostMemoryTest, AbsurdSizeIsResourceExhausted) {
  Result<HostRegion> r = HostRegion::Allocate(SIZE_MAX - 4096, HugePages::kOff);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
}

TEST(HostMemoryTest, SmallPagesRoundToPageAndAreZeroed) {
  Result<HostRegion> r = HostRegion::Allocate(4097, HugePages::kOff);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->size(), 8192u);
  EXPECT_TRUE(IsAlignedPtr(r->data(), 4096));
  EXPECT_EQ(r->backing(), HostBacking::kSmallPages);
  EXPECT_EQ(r->huge_page_bytes(), 0u);
  EXPECT_FALSE(r->fully_huge());
  for (size_t i = 0; i < r->size(); ++i)
    ASSERT_EQ(r->data()[i], 0) << i;
  CheckUsable(*r);
}

TEST(HostMemoryTest, OffStaysOffHugePagesEvenForLargeRegions) {
  // MADV_NOHUGEPAGE keeps THP "always" away from a region that asked for small pages.
  Result<HostRegion> r = HostRegion::Allocate(8 * kMiB, HugePages::kOff);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->huge_page_bytes(), 0u);
  EXPECT_EQ(HugePageBytesInRange(r->data(), r->size()), 0u);
}

TEST(HostMemoryTest, AutoGivesUsableAlignedMemory) {
  Result<HostRegion> r = HostRegion::Allocate(2 * kMiB + 1, HugePages::kAuto);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(r->size(), 2 * kMiB + 1);
  EXPECT_LE(r->huge_page_bytes(), r->size());
  if (r->backing() != HostBacking::kSmallPages) {
    EXPECT_EQ(r->size(), 4 * kMiB);
    EXPECT_TRUE(IsAlignedPtr(r->data(), kHugePageSize));
    EXPECT_GT(r->huge_page_bytes(), 0u);
  } else {
    EXPECT_TRUE(IsAlignedPtr(r->data(), 4096));
  }
  CheckUsable(*r);
}

TEST(HostMemoryTest, AutoUsesHugePagesWhereTheSystemOffersThem) {
  HugePageInfo info = QueryHugePages();
  if (info.hugetlb_available() < 2 && info.thp_mode != "always" && info.thp_mode != "madvise") {
    GTEST_SKIP() << "no hugetlbfs pages and THP is '" << info.thp_mode << "'";
  }
  Result<HostRegion> r = HostRegion::Allocate(4 * kMiB, HugePages::kAuto);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // THP can still be refused under memory fragmentation; then the region is honest about it.
  if (r->backing() == HostBacking::kSmallPages) {
    EXPECT_EQ(r->huge_page_bytes(), 0u);
    GTEST_SKIP() << "the kernel gave no huge pages (fragmented memory?)";
  }
  EXPECT_GT(r->huge_page_bytes(), 0u);
  EXPECT_EQ(HugePageBytesInRange(r->data(), r->size()), r->huge_page_bytes());
  if (info.hugetlb_available() >= 2) {
    EXPECT_EQ(r->backing(), HostBacking::kHugetlbfs);
  }
}

TEST(HostMemoryTest, OnIsAllHugeOrResourceExhausted) {
  HugePageInfo info = QueryHugePages();
  Result<HostRegion> r = HostRegion::Allocate(4 * kMiB, HugePages::kOn);
  const bool possible =
      info.hugetlb_available() >= 2 || info.thp_mode == "always" || info.thp_mode == "madvise";
  if (!possible) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    EXPECT_THAT(r.status().message(), HasSubstr("huge pages"));
    EXPECT_THAT(r.status().message(), HasSubstr("4.00 MiB"));
    return;
  }
  if (!r.ok()) {
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
    EXPECT_THAT(r.status().message(), HasSubstr("huge pages"));
    return;
  }
  EXPECT_TRUE(r->fully_huge());
  EXPECT_EQ(r->size(), 4 * kMiB);
  EXPECT_THAT(r->backing(), AnyOf(HostBacking::kHugetlbfs, HostBacking::kTransparentHuge));
  CheckUsable(*r);
}

TEST(HostMemoryTest, MoveTransfersOwnership) {
  Result<HostRegion> r = HostRegion::Allocate(64 * 1024, HugePages::kOff);
  ASSERT_TRUE(r.ok());
  char* data = r->data();
  HostRegion a = std::move(r).value();
  EXPECT_EQ(a.data(), data);
  HostRegion b(std::move(a));
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), 64u * 1024);

  Result<HostRegion> other = HostRegion::Allocate(4096, HugePages::kOff);
  ASSERT_TRUE(other.ok());
  b = std::move(other).value();  // releases the first region
  EXPECT_EQ(b.size(), 4096u);
  b = HostRegion();
  EXPECT_TRUE(b.empty());
}

TEST(HostMemoryTest, HugePageBytesInRangeEdgeCases) {
  EXPECT_EQ(HugePageBytesInRange(nullptr, 4096), 0u);
  int on_stack = 0;
  EXPECT_EQ(HugePageBytesInRange(&on_stack, 0), 0u);
  // A range that no mapping covers.
  EXPECT_EQ(HugePageBytesInRange(reinterpret_cast<void*>(uintptr_t{4096}), 4096), 0u);
}

TEST(HostMemoryTest, QueryHugePagesIsConsistent) {
  HugePageInfo info = QueryHugePages();
  EXPECT_THAT(info.thp_mode, AnyOf("always", "madvise", "never", "unknown"));
  EXPECT_LE(info.hugetlb_free, info.hugetlb_total);
  EXPECT_LE(info.hugetlb_available(), info.hugetlb_free);
}

}  // namespace
}  // namespace strata
