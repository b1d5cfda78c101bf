// qgZ's two-level quantized reduce-scatter (zero/quantized_reduce.h) on in-process worlds of
// several shapes: the error against the exact sum stays within the bound two quantizations allow,
// every rank's part comes out, the result repeats bit for bit, and the bytes sent across nodes are
// the int8 parts of the partial sums only.
#include "zero/quantized_reduce.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "comm/in_process_collective.h"
#include "comm/topology.h"
#include "strata/device.h"
#include "device/device_test_util.h"
#include "zero/partition.h"

namespace strata::zero::engine_internal {
namespace {

using device::DType;

// Rank q's gradient element: a deterministic value of mixed magnitude, one large outlier per
// block of the first part.
float Input(int q, size_t k) {
  std::mt19937 gen(static_cast<uint32_t>(q * 1000003 + static_cast<int>(k)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float x = normal(gen) * (1.0f + static_cast<float>(k % 7));
  if (k % 2048 == 5) x *= 40.0f;
  return x;
}

struct Outcome {
  std::vector<float> got;   // this rank's reduced part
  comm::Traffic traffic;    // bytes sent
};

// Every rank of `nodes` x `per_node` reduces `parts` (count elements each, at `stride`) twice.
std::vector<Outcome> Reduce(int nodes, int per_node, size_t count, size_t stride) {
  const int world = nodes * per_node;
  std::vector<Outcome> out(static_cast<size_t>(world));
  auto made = comm::InProcessWorld::Create({.world_size = world});
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  if (!made.ok()) return out;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r, w = *made] {
      device::DeviceOptions o;
      o.memory_budget = uint64_t{1} << 28;
      o.name = fmt::format("cpu:rank{}", r);
      ASSERT_OK_AND_ASSIGN(auto device, device::CreateDevice(o));
      ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("comm"));
      ASSERT_OK_AND_ASSIGN(auto joined, w->Join(r, *device));
      ASSERT_OK_AND_ASSIGN(const comm::Topology t, comm::Topology::Uniform(r, world, per_node));
      comm::TrafficCounters counters;
      auto world_comm = comm::CountTraffic(std::move(joined), t, &counters, *device);
      ASSERT_OK_AND_ASSIGN(comm::NodeGroups groups, comm::SplitNodeGroups(*world_comm, t));
      // Device memory (the CPU device's is host memory, written and read directly here).
      const size_t whole = stride * static_cast<size_t>(world);
      ASSERT_OK_AND_ASSIGN(void* send_mem, device->Alloc(whole * sizeof(float)));
      ASSERT_OK_AND_ASSIGN(void* first_mem, device->Alloc(count * sizeof(float)));
      ASSERT_OK_AND_ASSIGN(void* staging,
                           device->Alloc(QuantizedReduceScatter::StagingBytes(t, count)));
      auto* send = static_cast<float*>(send_mem);
      auto* first = static_cast<float*>(first_mem);
      std::fill(send, send + whole, 0.0f);
      for (int p = 0; p < world; ++p) {
        for (size_t i = 0; i < count; ++i) {
          send[static_cast<size_t>(p) * stride + i] = Input(r, static_cast<size_t>(p) * count + i);
        }
      }
      QuantizedReduceScatter reduce(*device, t, groups, staging, count);
      ASSERT_OK(reduce.Run(send, stride, count, first, *stream));
      ASSERT_OK(device->Synchronize(*stream));
      out[static_cast<size_t>(r)].traffic = counters.total();
      // In place, into this rank's own part of the input: the same bits.
      float* own = send + static_cast<size_t>(r) * stride;
      ASSERT_OK(reduce.Run(send, stride, count, own, *stream));
      ASSERT_OK(device->Synchronize(*stream));
      EXPECT_EQ(std::memcmp(first, own, count * sizeof(float)), 0)
          << "rank " << r << ": a second reduction of the same input gave other bits";
      // Refused: a part that is not whole blocks.
      EXPECT_EQ(reduce.Run(send, stride, count - 1, first, *stream).code(), StatusCode::kInternal);
      out[static_cast<size_t>(r)].got.assign(first, first + count);
      groups = {};
      for (void* p : {send_mem, first_mem, staging}) device->Free(p);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

struct Shape {
  int nodes;
  int per_node;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  return fmt::format("{}nodes_x{}", info.param.nodes, info.param.per_node);
}

class QuantizedReduceTest : public ::testing::TestWithParam<Shape> {};

TEST_P(QuantizedReduceTest, StaysWithinTwoQuantizationsOfTheExactSum) {
  const auto [nodes, per_node] = GetParam();
  const int world = nodes * per_node;
  const size_t count = 2 * 2048;
  const size_t stride = count + 2048;  // a bucket: each rank's block larger than what is reduced
  const std::vector<Outcome> out = Reduce(nodes, per_node, count, stride);
  double worst_ratio = 0.0;
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE(fmt::format("rank {} of {} x {}", r, nodes, per_node));
    const std::vector<float>& got = out[static_cast<size_t>(r)].got;
    ASSERT_EQ(got.size(), count);
    for (size_t b = 0; b < count / 2048; ++b) {
      // The bound: every input quantized once (scale max|x| / 127 over its block, error at most
      // half a step), then, with several ranks per node and several nodes, every node's partial
      // sum once more (its block's max at most per_node times the inputs' max, plus their error).
      double max_in = 0.0;
      for (int q = 0; q < world; ++q) {
        for (size_t i = b * 2048; i < (b + 1) * 2048; ++i) {
          max_in = std::max<double>(
              max_in, std::abs(Input(q, static_cast<size_t>(r) * count + i)));
        }
      }
      const double step = max_in / 127.0;
      double bound = (per_node > 1 ? world : 0) * step / 2;
      if (nodes > 1) bound += nodes * (per_node * max_in + bound) / 127.0 / 2;
      bound = bound * 1.001 + 1e-4;
      for (size_t i = b * 2048; i < (b + 1) * 2048; ++i) {
        double exact = 0.0;
        for (int q = 0; q < world; ++q) exact += Input(q, static_cast<size_t>(r) * count + i);
        const double err = std::abs(static_cast<double>(got[i]) - exact);
        ASSERT_LE(err, bound) << "element " << i << ": " << got[i] << " against " << exact;
        worst_ratio = std::max(worst_ratio, err / bound);
      }
    }
    // What crossed nodes: one int8 part (and its scales) per other node; within the node, the
    // int8 parts every other local rank owns.
    const uint64_t q = QuantizedShardBytes(static_cast<int64_t>(count));
    const comm::Traffic& t = out[static_cast<size_t>(r)].traffic;
    EXPECT_EQ(t.inter_bytes, nodes > 1 ? static_cast<uint64_t>(nodes - 1) * q : 0u);
    EXPECT_EQ(t.intra_bytes,
              per_node > 1 ? static_cast<uint64_t>(per_node - 1) * nodes * q : 0u);
  }
  std::printf("[ qgZ %d x %d ] worst error: %.3g of the two-quantization bound\n", nodes, per_node,
              worst_ratio);
  EXPECT_GT(worst_ratio, 0.0) << "no quantization error at all: was anything quantized?";
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizedReduceTest,
                         ::testing::Values(Shape{2, 2}, Shape{3, 2}, Shape{2, 3}, Shape{1, 4},
                                           Shape{4, 1}),
                         ShapeName);

}  // namespace
}  // namespace strata::zero::engine_internal
