#include "io/numa.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "test_support.h"

namespace strata::io {
namespace {

using ::testing::HasSubstr;

// Parses a CPU list such as "0-3,8,10-11".
std::set<int> ParseCpuList(const std::string& list) {
  std::set<int> cpus;
  size_t pos = 0;
  while (pos < list.size()) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    std::string part = list.substr(pos, comma - pos);
    size_t dash = part.find('-');
    int lo = std::stoi(part.substr(0, dash));
    int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c)
      cpus.insert(c);
    pos = comma + 1;
  }
  return cpus;
}

TEST(CpuListTest, Parses) {
  EXPECT_EQ(ParseCpuList("0-2,5"), (std::set<int>{0, 1, 2, 5}));
  EXPECT_EQ(ParseCpuList("7"), (std::set<int>{7}));
}

TEST(NumaTest, TopologyIsPlausible) {
  Result<NumaTopology> t = QueryNumaTopology();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_GE(t->packages, 1);
  EXPECT_GE(t->cores, 1);
  EXPECT_GE(t->pus, t->cores);
  ASSERT_FALSE(t->nodes.empty());
  std::set<int> indexes;
  std::set<int> all_cpus;
  uint64_t memory = 0;
  for (const NumaNode& n : t->nodes) {
    EXPECT_TRUE(indexes.insert(n.index).second) << "duplicate node " << n.index;
    memory += n.memory_bytes;
    if (n.cpus.empty()) continue;  // a memory-only node
    for (int c : ParseCpuList(n.cpus))
      all_cpus.insert(c);
  }
  EXPECT_GT(memory, 0u);
  EXPECT_EQ(static_cast<int>(all_cpus.size()), t->pus);
}

TEST(NumaTest, TopologyIsLoadedOnceAndSafeToShare) {
  Result<NumaTopology> first = QueryNumaTopology();
  ASSERT_TRUE(first.ok());
  std::vector<std::thread> threads;
  std::vector<int> pus(4, -1);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&pus, i] {
      Result<NumaTopology> t = QueryNumaTopology();
      pus[i] = t.ok() ? t->pus : -2;
    });
  }
  for (auto& th : threads)
    th.join();
  for (int p : pus)
    EXPECT_EQ(p, first->pus);
}

TEST(NumaTest, BindThreadToANode) {
  Result<NumaTopology> t = QueryNumaTopology();
  ASSERT_TRUE(t.ok());
  const NumaNode* node = nullptr;
  for (const NumaNode& n : t->nodes) {
    if (!n.cpus.empty()) {
      node = &n;
      break;
    }
  }
  ASSERT_NE(node, nullptr);
  // On a thread of its own, so the test runner's affinity is untouched.
  Status bound;
  std::set<int> allowed;
  std::thread th([&] {
    bound = BindCurrentThreadToNumaNode(node->index);
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &set)) allowed.insert(c);
      }
    }
  });
  th.join();
  ASSERT_TRUE(bound.ok()) << bound.ToString();
  std::set<int> node_cpus = ParseCpuList(node->cpus);
  ASSERT_FALSE(allowed.empty());
  for (int c : allowed)
    EXPECT_TRUE(node_cpus.count(c)) << "cpu " << c << " is outside node";
}

TEST(NumaTest, BindToUnknownNodeIsInvalid) {
  Status st = BindCurrentThreadToNumaNode(9999);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("9999"));
  EXPECT_EQ(BindCurrentThreadToNumaNode(-1).code(), StatusCode::kInvalidArgument);
}

TEST(NumaTest, NodeOfPath) {
  Result<NumaTopology> t = QueryNumaTopology();
  ASSERT_TRUE(t.ok());
  testing::TempDir dir;
  int node = NumaNodeOfPath(dir.path().string());
  if (t->nodes.size() <= 1) {
    EXPECT_EQ(node, -1);  // single node: no placement to make
  } else if (node >= 0) {
    bool known = false;
    for (const NumaNode& n : t->nodes)
      known |= n.index == node;
    EXPECT_TRUE(known) << "node " << node;
  }
  EXPECT_EQ(NumaNodeOfPath("/nonexistent-strata-dir/x/y"), -1);
}

}  // namespace
}  // namespace strata::io
