#include "io/stripe.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::io {
namespace {

TEST(StripeLayoutTest, OnePathIsIdentity) {
  StripeLayout layout(1, 4096);
  std::vector<StripeSegment> segs;
  layout.Map(12345, 1 << 20, &segs);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].path_index, 0u);
  EXPECT_EQ(segs[0].path_offset, 12345u);
  EXPECT_EQ(segs[0].length, 1u << 20);
  EXPECT_EQ(layout.PathBytes(0, 777), 777u);
}

TEST(StripeLayoutTest, RoundRobinOverPaths) {
  StripeLayout layout(3, 4096);
  std::vector<StripeSegment> segs;
  // Starts 100 bytes into stripe 1 (path 1), runs over stripes 2, 3 (path 0, second round), 4.
  layout.Map(4096 + 100, 3 * 4096 + 50, &segs);
  ASSERT_EQ(segs.size(), 4u);
  EXPECT_EQ(segs[0].path_index, 1u);
  EXPECT_EQ(segs[0].path_offset, 100u);
  EXPECT_EQ(segs[0].length, 4096u - 100);
  EXPECT_EQ(segs[0].buffer_offset, 0u);
  EXPECT_EQ(segs[1].path_index, 2u);
  EXPECT_EQ(segs[1].path_offset, 0u);
  EXPECT_EQ(segs[2].path_index, 0u);
  EXPECT_EQ(segs[2].path_offset, 4096u);
  EXPECT_EQ(segs[3].path_index, 1u);
  EXPECT_EQ(segs[3].path_offset, 4096u);
  EXPECT_EQ(segs[3].length, 150u);
  uint64_t total = 0;
  for (const auto& s : segs) {
    EXPECT_EQ(s.buffer_offset, total);
    total += s.length;
  }
  EXPECT_EQ(total, 3u * 4096 + 50);
}

// Every logical byte maps to exactly one (path, offset), and PathBytes agrees with a byte count.
TEST(StripeLayoutTest, MatchesBruteForce) {
  for (uint32_t paths : {1u, 2u, 3u, 5u}) {
    const uint64_t unit = 16;
    StripeLayout layout(paths, unit);
    for (uint64_t size : {0ull, 1ull, 15ull, 16ull, 17ull, 47ull, 48ull, 160ull, 333ull}) {
      std::vector<uint64_t> per_path(paths, 0);
      for (uint64_t b = 0; b < size; ++b) {
        std::vector<StripeSegment> segs;
        layout.Map(b, 1, &segs);
        ASSERT_EQ(segs.size(), 1u);
        const uint64_t stripe = b / unit;
        EXPECT_EQ(segs[0].path_index, paths == 1 ? 0 : stripe % paths);
        EXPECT_EQ(segs[0].path_offset, paths == 1 ? b : (stripe / paths) * unit + b % unit);
        per_path[segs[0].path_index] =
            std::max(per_path[segs[0].path_index], segs[0].path_offset + 1);
      }
      for (uint32_t p = 0; p < paths; ++p) {
        EXPECT_EQ(layout.PathBytes(p, size), per_path[p]) << "paths=" << paths << " size=" << size;
      }
    }
  }
}

}  // namespace
}  // namespace strata::io
