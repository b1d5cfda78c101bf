// Mutex, MutexLock and CondVar (common/mutex.h): mutual exclusion, a producer and a consumer
// handing items over through a condition, and a notify that reaches every waiter. That the
// annotations are checked is the `thread-safety` preset's test (thread_safety_violations.cc).
#include "common/mutex.h"

#include <gtest/gtest.h>

#include <deque>
#include <thread>
#include <vector>

namespace strata {
namespace {

class Counter {
 public:
  void Add() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    ++value_;
  }
  int value() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return value_;
  }

 private:
  Mutex mu_;
  int value_ GUARDED_BY(mu_) = 0;
};

TEST(MutexTest, ExcludesConcurrentWriters) {
  Counter counter;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&counter] {
      for (int i = 0; i < 10000; ++i) counter.Add();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter.value(), 40000);
}

class Queue {
 public:
  void Push(int v) EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      items_.push_back(v);
    }
    grown_.NotifyOne();
  }
  int Pop() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    while (items_.empty()) grown_.Wait(mu_);
    const int v = items_.front();
    items_.pop_front();
    return v;
  }

 private:
  Mutex mu_;
  CondVar grown_;
  std::deque<int> items_ GUARDED_BY(mu_);
};

TEST(MutexTest, CondVarHandsItemsOverInOrder) {
  Queue queue;
  std::vector<int> got;
  std::thread consumer([&] {
    for (int i = 0; i < 1000; ++i) got.push_back(queue.Pop());
  });
  for (int i = 0; i < 1000; ++i) queue.Push(i);
  consumer.join();
  ASSERT_EQ(got.size(), 1000u);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], i);
}

class Gate {
 public:
  void Open() EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      open_ = true;
    }
    opened_.NotifyAll();
  }
  void Pass() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    while (!open_) opened_.Wait(mu_);
    ++passed_;
  }
  int passed() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return passed_;
  }

 private:
  Mutex mu_;
  CondVar opened_;
  bool open_ GUARDED_BY(mu_) = false;
  int passed_ GUARDED_BY(mu_) = 0;
};

TEST(MutexTest, NotifyAllWakesEveryWaiter) {
  Gate gate;
  std::vector<std::thread> waiters;
  for (int t = 0; t < 3; ++t) waiters.emplace_back([&gate] { gate.Pass(); });
  gate.Open();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(gate.passed(), 3);
}

}  // namespace
}  // namespace strata
