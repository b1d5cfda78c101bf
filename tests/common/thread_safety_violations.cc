// Code that breaks the lock annotations of common/mutex.h, one way per function. Not built into
// any target: the `thread-safety` preset's test thread_safety_analysis_finds_violations compiles
// it with clang's -Wthread-safety and expects each marked line to be reported, which shows that
// the analysis is on and sees through Mutex, MutexLock and CondVar.
#include "common/mutex.h"

namespace strata {

class Account {
 public:
  int ReadWithoutLock() { return balance_; }  // expect: reading variable 'balance_' requires holding mutex 'mu_'
  void WriteWithoutLock() { balance_ = 1; }   // expect: writing variable 'balance_' requires holding mutex 'mu_'
  void CallWithoutLock() { AddLocked(1); }    // expect: calling function 'AddLocked' requires holding mutex 'mu_'
  void WaitWithoutLock() { changed_.Wait(mu_); }  // expect: calling function 'Wait' requires holding mutex 'mu_'
  void LockTwice() EXCLUDES(mu_) {
    MutexLock first(mu_);
    MutexLock second(mu_);  // expect: acquiring mutex 'mu_' that is already held
  }
  void CallWhileHeld() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    Deposit(1);  // expect: cannot call function 'Deposit' while mutex 'mu_' is held
  }
  void Deposit(int amount) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    AddLocked(amount);
  }

 private:
  void AddLocked(int amount) REQUIRES(mu_) { balance_ += amount; }

  Mutex mu_;
  CondVar changed_;
  int balance_ GUARDED_BY(mu_) = 0;
};

}  // namespace strata
