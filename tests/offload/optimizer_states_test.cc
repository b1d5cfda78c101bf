// OptimizerStates: sub-groups, the visit order, the host budget and the read-ahead pipeline over
// the tier manager (CPU device, in-memory store).
#include "offload/optimizer_states.h"

#include <gtest/gtest.h>

#include "offload_test_util.h"

namespace strata::offload::testing {
namespace {

struct StatesRig {
  std::unique_ptr<Rig> rig;
  std::unique_ptr<OptimizerStates> states;

  static Result<StatesRig> Make(Tier home, int depth, int64_t sub_group,
                                std::vector<int64_t> unit_elems) {
    StatesRig r;
    Rig::Options ro;
    ro.pool_bytes = 4 << 20;
    r.rig = std::make_unique<Rig>(Rig::Make(ro));
    OptimizerStatesOptions o;
    o.tiers.device = r.rig->device.get();
    o.tiers.pool = r.rig->pool.get();
    o.tiers.store = r.rig->store.get();
    o.tiers.nvme.paths = {r.rig->dir->path().string()};
    o.tiers.nvme.stripe_unit = 8192;
    o.home = home;
    o.pipeline_depth = depth;
    o.sub_group_elems = sub_group;
    o.unit_elems = std::move(unit_elems);
    for (size_t u = 0; u < o.unit_elems.size(); ++u) o.unit_names.push_back("u" + std::to_string(u));
    STRATA_ASSIGN_OR_RETURN(r.states, OptimizerStates::Create(o));
    return r;
  }
};

TEST(OptimizerStatesTest, CutsUnitsIntoSubGroups) {
  auto r = StatesRig::Make(Tier::kHost, 3, 1024, {2500, 1024, 10});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& s = *r->states;
  ASSERT_EQ(s.groups(0).size(), 3u);
  EXPECT_EQ(s.groups(0)[2].offset, 2048);
  EXPECT_EQ(s.groups(0)[2].numel, 452);
  ASSERT_EQ(s.groups(1).size(), 1u);
  ASSERT_EQ(s.groups(2).size(), 1u);
  EXPECT_EQ(s.groups(2)[0].numel, 10);
  EXPECT_EQ(s.total_groups(), 5);
  // Host home: every state fits in the host budget, and round-trips.
  for (int u = 0; u < 3; ++u) {
    for (const auto& g : s.groups(u)) {
      auto lease = r->states->Acquire(g, Access::kOverwrite, "test");
      ASSERT_TRUE(lease.ok()) << lease.status().ToString();
      EXPECT_EQ(lease->bytes(), 12u * static_cast<uint64_t>(g.numel));
      std::memset(lease->data(), static_cast<int>(g.id + 1), lease->bytes());
      lease->Release(true);
    }
  }
  for (int u = 0; u < 3; ++u) {
    for (const auto& g : s.groups(u)) {
      auto lease = r->states->Acquire(g, Access::kRead, "test");
      ASSERT_TRUE(lease.ok());
      EXPECT_EQ(static_cast<const unsigned char*>(lease->data())[lease->bytes() - 1], g.id + 1);
    }
  }
  EXPECT_EQ(s.stats(Tier::kNvme).writeback_bytes, 0u);
}

// NVMe home: at most `depth` sub-groups in host memory; a visit in order (units last to first)
// reads ahead, so after the first step every acquire but the first finds its sub-group already
// there (or on its way) and the data survives the round trips through NVMe.
TEST(OptimizerStatesTest, NvmeHomeStreamsThroughDepthSubGroupsInVisitOrder) {
  const int depth = 4;
  auto r = StatesRig::Make(Tier::kNvme, depth, 2048, {8192, 8192, 4096});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  OptimizerStates& s = *r->states;
  ASSERT_EQ(s.total_groups(), 10);
  const uint64_t group_bytes = device::PinnedPool::SizeClass(12 * 2048);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    for (int u = 2; u >= 0; --u) {
      for (const auto& g : s.groups(u)) {
        ASSERT_TRUE(s.Visit(g).ok());
        auto lease = s.Acquire(g, step == 0 ? Access::kOverwrite : Access::kReadWrite, "opt");
        ASSERT_TRUE(lease.ok()) << lease.status().ToString();
        auto* f = static_cast<uint32_t*>(lease->data());
        if (step > 0) {
          ASSERT_EQ(f[0], static_cast<uint32_t>(g.id * 100 + step - 1)) << "sub-group " << g.id;
        }
        f[0] = static_cast<uint32_t>(g.id * 100 + step);
        lease->Release(true);
        s.Visited(g);
      }
    }
    ASSERT_TRUE(s.TakeWritebackError().ok());
    EXPECT_LE(s.stats(Tier::kHost).peak, depth * group_bytes);
  }
  EXPECT_GT(s.stats(Tier::kNvme).writeback_bytes, 0u);
  EXPECT_GT(s.stats(Tier::kHost).fill_bytes, 0u);
  ASSERT_TRUE(s.ReadAheadFirst().ok());
}

TEST(OptimizerStatesTest, BadOptionsAreInvalidArgument) {
  EXPECT_EQ(StatesRig::Make(Tier::kDevice, 3, 1024, {10}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StatesRig::Make(Tier::kHost, 2, 1024, {10}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StatesRig::Make(Tier::kHost, 3, 0, {10}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::offload::testing
