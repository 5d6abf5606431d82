#pragma once
// Device-triggered posting: a captured graph cannot run host code, so a send
// it contains is posted by a host thread that watches a counter the graph
// bumps. Per armed slot there are two int64 words in memory both the host and
// the device address (mapped pinned host memory on CUDA):
//
//   go    the stream increments it (Stream::IncrementCounter) when the data
//         to send is ready: the graph's "post now";
//   done  the trigger sets it to the number of posts that completed.
//
// The graph then waits with Stream::WaitCounterAtLeast(done, go): both words
// are read when the stream gets there, so the threshold is relative and a
// replay (whose kernel arguments are frozen) waits for its own post.
//
// The trigger's thread posts a slot's target once per increment of go, in
// order, one request in flight per slot (a prepared request's keys carry one
// request at a time); completes it, then bumps done. A failure (the post
// refused, the request failed, no completion within the timeout, more
// increments queued than allowed) is recorded, the slot stops posting and
// from then on releases its waiters at once (done = go: a stream must never
// wait forever on a send that will not come); TakeError() hands the first
// failure, naming the slot's target, to the next host call. Nothing is
// allocated per trigger; with nothing armed the thread sleeps on a condition
// variable. Shutdown() (and the destructor) disarm every slot: requests in
// flight are waited for (bounded by the timeout) and every waiter released.
//
// A thread of its own rather than the worker's send thread: the send thread
// serves every request and its loop is the latency-critical path, which a
// sweep over armed slots would lengthen for everyone; the trigger only
// costs while something is armed, and posts through the same public
// PushPull the host path uses (docs/cuda.md, "Device-triggered sends").

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "stepmesh/backend.h"
#include "stepmesh/export.h"
#include "stepmesh/handle.h"

namespace stepmesh {

// What a slot posts, as callbacks, so that the trigger knows nothing of
// workers or plans. Both are called on the trigger's thread only.
struct TriggerTarget {
  // Posts the request once.
  std::function<absl::StatusOr<RequestHandle>()> post;
  // Non-blocking: true once the request is done and released, false while
  // pending; an error when it failed (released too).
  std::function<absl::StatusOr<bool>(RequestHandle)> poll;
  // Int64 words written before every post (e.g. the layer index a prepared
  // request's metadata carries, which differs per armed call).
  std::vector<std::pair<int64_t*, int64_t>> writes;
  // Names the target in errors: "key 9 to server 1".
  std::string name;
};

struct TriggerOptions {
  int capacity = 4096;                         // slots armed at once, at most
  absl::Duration timeout = absl::Seconds(30);  // a post must complete within this
  int max_queued = 64;                         // increments of go not yet completed, at most
  // After this long without work the thread sleeps between sweeps
  // (idle_sleep); before, it yields.
  absl::Duration spin = absl::Microseconds(50);
  absl::Duration idle_sleep = absl::Microseconds(20);
};

class STEPMESH_EXPORT Trigger {
 public:
  // Allocates the slots' words once (kHostMapped memory of `backend`).
  static absl::StatusOr<std::unique_ptr<Trigger>> Create(Backend& backend,
                                                         const TriggerOptions& options = {});
  ~Trigger();
  Trigger(const Trigger&) = delete;
  Trigger& operator=(const Trigger&) = delete;

  struct Armed {
    int slot = -1;
    int64_t* go = nullptr;    // the stream increments it
    int64_t* done = nullptr;  // the stream waits until done >= go
  };
  // RESOURCE_EXHAUSTED when `capacity` slots are armed, FAILED_PRECONDITION
  // after Shutdown, INVALID_ARGUMENT without callbacks. The words start equal.
  absl::StatusOr<Armed> Arm(TriggerTarget target);
  // Waits (up to `timeout`) for the slot's request in flight, releases its
  // waiters and frees the slot. NOT_FOUND for a slot not armed.
  absl::Status Disarm(int slot, absl::Duration timeout);
  // The first failure since the last call, cleared; OK when none. One
  // relaxed load when there is none.
  absl::Status TakeError();
  // Disarms everything and stops the thread; idempotent.
  void Shutdown();

  int armed() const;
  // Requests posted and completed, over all slots (tests, metrics).
  int64_t posts() const { return posts_.load(std::memory_order_relaxed); }
  int64_t completions() const { return completions_.load(std::memory_order_relaxed); }

 private:
  struct Slot;
  Trigger(std::unique_ptr<Memory> words, const TriggerOptions& options);
  void Run();
  bool Sweep(Slot& slot, int64_t now_ns);
  void Fail(Slot& slot, const absl::Status& status);
  void Release(Slot& slot);
  int64_t* Go(int slot) const;
  int64_t* Done(int slot) const;

  const TriggerOptions options_;
  const std::unique_ptr<Memory> words_;
  std::vector<Slot> slots_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  uint64_t generation_ = 0;  // bumped by Arm/Disarm: the thread re-reads the slot list
  std::atomic<uint64_t> published_generation_{0};
  int armed_ = 0;

  std::mutex error_mu_;
  absl::Status error_;
  std::atomic<bool> has_error_{false};
  std::atomic<int64_t> posts_{0};
  std::atomic<int64_t> completions_{0};
  std::thread thread_;
};

}  // namespace stepmesh
