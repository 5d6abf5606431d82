#pragma once
// Locks over the C++ standard library, with Abseil's API shape and
// thread-safety annotations, and a futex wake word. Why not absl::Mutex:
// Debian's Abseil is not built with ThreadSanitizer, which then cannot see
// absl::Mutex and reports every field it guards as racy; std::mutex is
// intercepted by TSan, so the TSan CI run checks our real synchronisation.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace stepmesh::base {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_.unlock();
    // Await() conditions are re-evaluated whenever the lock is released.
    if (awaiters_.load(std::memory_order_acquire) > 0) changed_.notify_all();
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { Lock(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { Unlock(); }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

  // With the lock held: waits (releasing it) until `condition()` is true or the
  // deadline passes; returns condition().
  template <typename Condition>
  bool AwaitWithDeadline(Condition condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    ++awaiters_;
    while (!condition()) {
      const absl::Time now = absl::Now();
      if (now >= deadline) break;
      // Bounded slices: an unlock between the check and the wait costs one slice.
      changed_.wait_for(lock,
                        absl::ToChronoNanoseconds(std::min(deadline - now, absl::Milliseconds(5))));
    }
    --awaiters_;
    lock.release();
    return condition();
  }
  // With the lock held: waits (releasing it) until `condition()` is true, in
  // one sleep rather than 5 ms slices. Only for conditions on state this
  // mutex guards: every change of it then ends in Unlock(), which wakes the
  // waiter (it counted itself in awaiters_ under the lock, before it slept).
  // A thread parked here costs no wake-ups; with slices, 128 idle processes
  // woke 200 times a second per waiting thread (docs/benchmarks.md, "Scale").
  template <typename Condition>
  void Await(Condition condition) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    ++awaiters_;
    changed_.wait(lock, condition);
    --awaiters_;
    lock.release();
  }
  template <typename Condition>
  bool AwaitWithTimeout(Condition condition, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    return AwaitWithDeadline(condition, absl::Now() + timeout);
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::atomic<int> awaiters_{0};  // read after unlocking, so atomic
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// Shared in name (for the annotations); exclusive in fact: our readers are few.
class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A word threads sleep on until another thread bumps it (a Linux futex). A
// hand-off through it costs the waker one system call, and only when someone
// sleeps: no mutex changes hands, so the woken thread cannot block again on a
// lock its waker still holds, as it can behind a condition variable. The
// condition itself lives in the caller's atomics (which is what ThreadSanitizer
// sees); the protocol, for a waker that made the condition true:
//   waiter: announce (seq_cst) -> seen = Load() -> re-check condition -> WaitWhile(seen)
//   waker:  make condition true (seq_cst) -> if someone announced: Bump()
class WakeWord {
 public:
  uint32_t Load() const { return word_.load(std::memory_order_seq_cst); }
  // Sleeps while the word still equals `seen`, at most `timeout`. May return
  // early (a bump, a signal, a spurious wake): callers re-check.
  void WaitWhile(uint32_t seen, absl::Duration timeout);
  // Changes the word and wakes every sleeper.
  void Bump();

 private:
  std::atomic<uint32_t> word_{0};
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
};

class Notification {
 public:
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
  }
  bool HasBeenNotified() {
    MutexLock lock(&mu_);
    return notified_;
  }
  void WaitForNotification() {
    MutexLock lock(&mu_);
    mu_.Await([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return notified_; });
  }
  bool WaitForNotificationWithTimeout(absl::Duration timeout) {
    MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout([this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return notified_; },
                                timeout);
  }

 private:
  Mutex mu_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace stepmesh::base
