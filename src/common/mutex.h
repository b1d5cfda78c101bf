// Mutex, MutexLock and CondVar: a lock, a scoped holder of it and a condition variable that
// clang's thread-safety analysis understands (common/thread_annotations.h).
//
// They are std::mutex and std::condition_variable underneath, with the same semantics and cost;
// what they add is the annotations libstdc++ lacks, so that a field declared
// `int pending_ GUARDED_BY(mu_);` is checked at every access by the `thread-safety` build.
//
//   class Queue {
//    public:
//     void Push(int v) EXCLUDES(mu_) {
//       {
//         MutexLock lock(mu_);
//         items_.push_back(v);
//       }
//       cv_.NotifyAll();
//     }
//     int Pop() EXCLUDES(mu_) {
//       MutexLock lock(mu_);
//       while (items_.empty()) cv_.Wait(mu_);
//       ...
//     }
//    private:
//     Mutex mu_;
//     CondVar cv_;  // signalled when items_ grows
//     std::deque<int> items_ GUARDED_BY(mu_);
//   };
//
// Waits are written as loops over CondVar::Wait, as above, rather than with a predicate: the
// analysis checks the loop's condition against the lock held around it, which it cannot do for
// a lambda called from inside Wait.
//
// Threading: a Mutex is not recursive; Lock on a thread that holds it deadlocks (as std::mutex).
// Unlock only on the thread that locked it. A CondVar may be used with one Mutex at a time.
#pragma once

#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace strata {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex from construction to destruction.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() RELEASE() { mu_.Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu`, blocks until notified (or woken spuriously: callers wait in a loop over their
  // condition), and takes `mu` again before returning.
  void Wait(Mutex& mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's MutexLock releases it
  }

  // Safe with or without the mutex held.
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace strata
