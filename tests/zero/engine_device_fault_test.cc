// The ZeRO engine on a device that fails (device/fault_device.h), driven through its public
// interface (zero/engine.h) as built by the composition root (train/runtime.h, with the device
// wrapped before anything uses it): every allocation made by a run in turn, a copy of each
// direction, a compute task and an element-wise operation in the middle of a step. Each must end
// in a Status that names what failed ("injected fault: h2d copy ..."), returned by Create or by
// the step, and nothing may hang — the run, its later steps and its destruction all finish (each
// run is watched: a hang is reported as a failure, not waited for). Slow copies change no bit of
// the result, and a device failure on one rank of an in-process world fails every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>

#include "comm/in_process_collective.h"
#include "device/fault_device.h"
#include "toy_model.h"

namespace strata::zero {
namespace {

using device::DeviceFaultInjector;
using device::DeviceFaultKind;
using device::DeviceFaultRule;
using device::DeviceOp;
using testing::FinishesWithin;
using testing::MaxRelDiff;
using testing::ToyRun;
using Masters = std::vector<std::vector<float>>;

constexpr int kWatchSeconds = 60;

std::string Config(int stage, const std::string& param_dev, const std::string& optim_dev) {
  return testing::ToyConfigJson(
      stage, param_dev, optim_dev,
      R"(, "sub_group_size": 4096, "stage3_param_persistence_threshold": 0)");
}

// The configurations the tests go through: where a step's copies, gathers and optimizer run
// differ between them.
const std::vector<std::string>& Configs() {
  static const auto* configs = new std::vector<std::string>{
      Config(3, "nvme", "nvme"), Config(2, "none", "cpu"), Config(1, "none", "none")};
  return *configs;
}

ToyRun::Options Options(const std::string& json, std::shared_ptr<DeviceFaultInjector> faults) {
  ToyRun::Options o;
  o.config_json = json;
  o.steps = 3;
  o.wrap_device = [faults](std::unique_ptr<device::Device> inner) {
    return device::CreateFaultInjectingDevice(std::move(inner), faults);
  };
  return o;
}

// What a watched run did: the first error (of Create, a step, or the gather at the end) and
// how many steps succeeded before it; `finished` is false when it did not end (destruction
// included) within kWatchSeconds.
struct Outcome {
  bool finished = false;
  Status status;
  int steps_done = 0;
  Status later;  // one more step after the first error
  Masters masters;
};

// Set-up, o.steps steps (`before_step(s)` runs before step s), the master weights, then the
// run's destruction, on a watched thread.
Outcome RunWatched(
    const ToyRun::Options& o, std::function<void(int step)> before_step = [](int) {}) {
  auto out = std::make_shared<Outcome>();
  const bool finished = FinishesWithin(
      [o, out, before_step] {
        ToyRun run;
        Status st = run.Setup(o);
        for (int s = 0; s < o.steps && st.ok(); ++s) {
          before_step(s);
          st = run.Step(s);
          if (st.ok()) ++out->steps_done;
        }
        if (st.ok()) {
          auto m = run.Masters();
          st = m.status();
          if (m.ok()) out->masters = std::move(*m);
        }
        out->status = st;
        if (!st.ok() && run.engine != nullptr) out->later = run.Step(o.steps);
      },
      kWatchSeconds);
  Outcome result = *out;
  result.finished = finished;
  return result;
}

bool Contains(const Status& st, std::string_view text) {
  return st.message().find(text) != std::string_view::npos;
}

TEST(EngineDeviceFaultTest, EveryFailedAllocationEndsInAStatusNamingIt) {
  for (const std::string& json : Configs()) {
    SCOPED_TRACE(json);
    // How many allocations a clean run makes.
    auto counting = std::make_shared<DeviceFaultInjector>();
    const Outcome clean = RunWatched(Options(json, counting));
    ASSERT_TRUE(clean.finished);
    ASSERT_TRUE(clean.status.ok()) << clean.status.ToString();
    const uint64_t allocations = counting->seen(DeviceOp::kAlloc);
    ASSERT_GT(allocations, 0u);
    int failed = 0;
    for (uint64_t n = 0; n < allocations; ++n) {
      SCOPED_TRACE(fmt::format("allocation #{} of {}", n, allocations));
      auto faults = std::make_shared<DeviceFaultInjector>();
      faults->AddRule({.op = DeviceOp::kAlloc, .ordinals = {n}});
      const Outcome got = RunWatched(Options(json, faults));
      ASSERT_TRUE(got.finished) << "the run hung after allocation #" << n << " failed";
      if (got.status.ok()) continue;  // the failure was absorbed (room made elsewhere)
      ++failed;
      EXPECT_EQ(got.status.code(), StatusCode::kResourceExhausted) << got.status.ToString();
      EXPECT_TRUE(Contains(got.status, fmt::format("injected fault (allocation #{})", n)))
          << got.status.ToString();
    }
    EXPECT_GT(failed, 0) << "no allocation failure reached the caller";
    std::printf("[ %s ] %d of %llu failed allocations reached the caller\n", json.c_str(), failed,
                static_cast<unsigned long long>(allocations));
  }
}

// A copy fails as it runs (the device's sticky error). The engine's next call that waits for the
// device returns it — the step that made the copy, or, for a copy the step leaves running (the
// last write-back of a step), the next call — and every later step fails too.
TEST(EngineDeviceFaultTest, AFailedCopyIsReturnedByTheNextCallNamingIt) {
  int reached = 0;
  for (const std::string& json : Configs()) {
    for (device::CopyKind kind : {device::CopyKind::kHostToDevice, device::CopyKind::kDeviceToHost,
                                  device::CopyKind::kDeviceToDevice}) {
      const std::string copy = fmt::format("{} copy", device::CopyKindName(kind));
      SCOPED_TRACE(fmt::format("{}: {}", json, copy));
      auto faults = std::make_shared<DeviceFaultInjector>();
      // The first copy of that kind in the second step fails as it runs.
      const Outcome got = RunWatched(Options(json, faults), [&](int step) {
        if (step == 1) faults->AddRule({.op = DeviceOp::kCopy, .copy_kind = kind, .ordinals = {0}});
      });
      ASSERT_TRUE(got.finished) << "the run hung after a failed " << copy;
      if (faults->total_hits() == 0) {  // this configuration's steps make no such copy
        EXPECT_TRUE(got.status.ok()) << got.status.ToString();
        continue;
      }
      ++reached;
      ASSERT_FALSE(got.status.ok()) << "the failed " << copy << " went unnoticed";
      EXPECT_GE(got.steps_done, 1);
      EXPECT_TRUE(Contains(got.status, "injected fault: " + copy)) << got.status.ToString();
      std::printf("[ %s ] failed %s reported after %d good steps: %s\n", json.c_str(), copy.c_str(),
                  got.steps_done, got.status.ToString().c_str());
      // The device's error is sticky: the next step fails as well, and says so.
      EXPECT_FALSE(got.later.ok());
      EXPECT_TRUE(Contains(got.later, "injected fault")) << got.later.ToString();
    }
  }
  EXPECT_GE(reached, 4) << "too few copy failures were exercised";
}

TEST(EngineDeviceFaultTest, AFailedComputeTaskIsReturnedByTheStepNamingIt) {
  for (const std::string& json : Configs()) {
    SCOPED_TRACE(json);
    auto faults = std::make_shared<DeviceFaultInjector>();
    const Outcome got = RunWatched(Options(json, faults), [&](int step) {
      if (step == 1) {
        faults->AddRule(
            {.op = DeviceOp::kHostTask, .label_contains = "toy backward", .ordinals = {2}});
      }
    });
    ASSERT_TRUE(got.finished) << "the run hung after a failed backward";
    ASSERT_FALSE(got.status.ok());
    EXPECT_EQ(got.steps_done, 1);
    EXPECT_EQ(got.status.code(), StatusCode::kInternal) << got.status.ToString();
    EXPECT_TRUE(Contains(got.status, "host task 'toy backward' failed: injected fault"))
        << got.status.ToString();
  }
}

TEST(EngineDeviceFaultTest, AFailedElementwiseOperationIsReturnedByTheStepNamingIt) {
  for (const std::string& json : Configs()) {
    SCOPED_TRACE(json);
    auto faults = std::make_shared<DeviceFaultInjector>();
    const Outcome got = RunWatched(Options(json, faults), [&](int step) {
      if (step == 1) faults->AddRule({.op = DeviceOp::kElementwise, .ordinals = {0}});
    });
    ASSERT_TRUE(got.finished) << "the run hung after a failed element-wise operation";
    if (faults->total_hits() == 0) continue;
    ASSERT_FALSE(got.status.ok());
    EXPECT_TRUE(Contains(got.status, "(element-wise #")) << got.status.ToString();
  }
}

TEST(EngineDeviceFaultTest, DelayedCopiesChangeNoBitOfTheResult) {
  // Every copy waits 1 ms on its stream first: the streams reach each other's events at other
  // times than usual, and a missing wait would show as other bits (or a TSan report).
  for (const std::string& json : Configs()) {
    SCOPED_TRACE(json);
    const Outcome clean = RunWatched(Options(json, std::make_shared<DeviceFaultInjector>()));
    ASSERT_TRUE(clean.finished && clean.status.ok()) << clean.status.ToString();
    auto faults = std::make_shared<DeviceFaultInjector>();
    const size_t rule = faults->AddRule({.op = DeviceOp::kCopy,
                                         .kind = DeviceFaultKind::kSlow,
                                         .delay = std::chrono::milliseconds(1)});
    const Outcome slow = RunWatched(Options(json, faults));
    ASSERT_TRUE(slow.finished);
    ASSERT_TRUE(slow.status.ok()) << slow.status.ToString();
    EXPECT_GT(faults->hits(rule), 0u);
    EXPECT_EQ(MaxRelDiff(slow.masters, clean.masters), 0.0);
  }
}

TEST(EngineDeviceFaultTest, ADeviceFailureOnOneRankFailsEveryRankOfTheWorld) {
  // Two ranks as threads (in-process world); rank 1's backward fails in the second step. Rank 0
  // must not wait for it: its step fails too, naming rank 1, long before the collective timeout.
  constexpr int kWorld = 2;
  auto world = comm::InProcessWorld::Create({.world_size = kWorld});
  ASSERT_TRUE(world.ok()) << world.status().ToString();
  std::vector<std::shared_ptr<Outcome>> outcomes;
  std::vector<std::thread> threads;
  auto faults = std::make_shared<DeviceFaultInjector>();
  for (int r = 0; r < kWorld; ++r) {
    outcomes.push_back(std::make_shared<Outcome>());
    threads.emplace_back([r, w = *world, faults, out = outcomes.back()] {
      ToyRun::Options o = Options(Config(3, "nvme", "nvme"),
                                  r == 1 ? faults : std::make_shared<DeviceFaultInjector>());
      o.world = w;
      o.rank = r;
      o.comm_timeout = std::chrono::minutes(5);  // only the abort can end rank 0's wait soon
      out->finished = FinishesWithin(
          [o, out, faults, r] {
            ToyRun run;
            Status st = run.Setup(o);
            for (int s = 0; s < 3 && st.ok(); ++s) {
              if (r == 1 && s == 1) {
                faults->AddRule({.op = DeviceOp::kHostTask, .label_contains = "toy backward"});
              }
              st = run.Step(s);
              if (st.ok()) ++out->steps_done;
            }
            out->status = st;
          },
          kWatchSeconds);
    });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < kWorld; ++r) {
    const Outcome& got = *outcomes[static_cast<size_t>(r)];
    SCOPED_TRACE(fmt::format("rank {}", r));
    ASSERT_TRUE(got.finished) << "rank " << r << " hung";
    EXPECT_FALSE(got.status.ok());
    EXPECT_EQ(got.steps_done, 1);
  }
  const Status& rank0 = outcomes[0]->status;
  EXPECT_TRUE(Contains(rank0, "rank 1 failed")) << rank0.ToString();
  EXPECT_TRUE(Contains(outcomes[1]->status, "injected fault")) << outcomes[1]->status.ToString();
}

}  // namespace
}  // namespace strata::zero
