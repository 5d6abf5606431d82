#include "stepmesh/trigger.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/thread_util.h"

namespace stepmesh {
namespace {

// go and done of one slot sit on cache lines of their own: the device (or a
// stream thread) writes go, the trigger's thread writes done.
constexpr size_t kWordsPerSlot = 16;  // 128 bytes: go at 0, done at 8

int64_t LoadWord(const int64_t* word) {
  return std::atomic_ref<const int64_t>(*word).load(std::memory_order_acquire);
}
void StoreWord(int64_t* word, int64_t value) {
  std::atomic_ref<int64_t>(*word).store(value, std::memory_order_release);
}

enum SlotState : int { kFree = 0, kArmed = 1, kDisarming = 2 };

}  // namespace

struct Trigger::Slot {
  std::atomic<int> state{kFree};  // written under mu_, read by the thread without it
  TriggerTarget target;           // written under mu_ while kFree
  // The thread's own (and Shutdown's once the thread stopped):
  int64_t posted = 0;
  int64_t completed = 0;
  bool inflight = false;
  bool failed = false;
  RequestHandle handle;
  int64_t deadline_ns = 0;
};

absl::StatusOr<std::unique_ptr<Trigger>> Trigger::Create(Backend& backend,
                                                         const TriggerOptions& options) {
  if (options.capacity < 1 || options.capacity > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("TriggerOptions.capacity = ", options.capacity, " is not in [1, 2^20]"));
  }
  if (options.max_queued < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TriggerOptions.max_queued = ", options.max_queued, " must be >= 1"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("TriggerOptions.timeout must be > 0");
  }
  const size_t bytes = static_cast<size_t>(options.capacity) * kWordsPerSlot * sizeof(int64_t);
  absl::StatusOr<std::unique_ptr<Memory>> words = backend.Allocate(bytes, MemoryKind::kHostMapped);
  if (!words.ok()) {
    return absl::Status(words.status().code(),
                        absl::StrCat("trigger counters (", bytes,
                                     " bytes of host-mapped memory): ", words.status().message()));
  }
  return std::unique_ptr<Trigger>(new Trigger(*std::move(words), options));
}

Trigger::Trigger(std::unique_ptr<Memory> words, const TriggerOptions& options)
    : options_(options), words_(std::move(words)), slots_(options.capacity) {
  std::fill_n(static_cast<int64_t*>(words_->data()),
              static_cast<size_t>(options.capacity) * kWordsPerSlot, 0);
  thread_ = base::StartNamedThread("sm-trigger", {}, [this] { Run(); });
}

Trigger::~Trigger() { Shutdown(); }

int64_t* Trigger::Go(int slot) const {
  return static_cast<int64_t*>(words_->data()) + static_cast<size_t>(slot) * kWordsPerSlot;
}
int64_t* Trigger::Done(int slot) const { return Go(slot) + 8; }

absl::StatusOr<Trigger::Armed> Trigger::Arm(TriggerTarget target) {
  if (!target.post || !target.poll) {
    return absl::InvalidArgumentError(
        absl::StrCat("Trigger::Arm(", target.name, "): post and poll callbacks are required"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) {
    return absl::FailedPreconditionError(
        absl::StrCat("Trigger::Arm(", target.name, "): the trigger was shut down"));
  }
  for (int i = 0; i < options_.capacity; ++i) {
    Slot& slot = slots_[i];
    if (slot.state.load(std::memory_order_relaxed) != kFree) continue;
    slot.target = std::move(target);
    slot.posted = slot.completed = 0;
    slot.inflight = slot.failed = false;
    StoreWord(Go(i), 0);
    StoreWord(Done(i), 0);
    slot.state.store(kArmed, std::memory_order_release);
    ++armed_;
    published_generation_.store(++generation_, std::memory_order_release);
    cv_.notify_all();
    return Armed{i, Go(i), Done(i)};
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("Trigger::Arm(", target.name, "): all ", options_.capacity, " slots are armed"));
}

absl::Status Trigger::Disarm(int slot, absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (slot < 0 || slot >= options_.capacity ||
      slots_[slot].state.load(std::memory_order_relaxed) == kFree) {
    return absl::NotFoundError(absl::StrCat("Trigger::Disarm: slot ", slot, " is not armed"));
  }
  Slot& s = slots_[slot];
  if (stopping_) return absl::OkStatus();  // Shutdown disarms it
  s.state.store(kDisarming, std::memory_order_release);
  published_generation_.store(++generation_, std::memory_order_release);
  cv_.notify_all();
  if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                    [&] { return s.state.load(std::memory_order_relaxed) == kFree; })) {
    return absl::DeadlineExceededError(
        absl::StrCat("Trigger::Disarm: slot ", slot,
                     " still has a request in flight (freed when it completes or times out)"));
  }
  return absl::OkStatus();
}

absl::Status Trigger::TakeError() {
  if (!has_error_.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(error_mu_);
  absl::Status e = std::move(error_);
  error_ = absl::OkStatus();
  has_error_.store(false, std::memory_order_release);
  return e;
}

int Trigger::armed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return armed_;
}

void Trigger::Fail(Slot& slot, const absl::Status& status) {
  slot.failed = true;
  const int index = static_cast<int>(&slot - slots_.data());
  std::lock_guard<std::mutex> lock(error_mu_);
  if (!error_.ok()) return;  // the first failure is the one reported
  error_ = absl::Status(
      status.code(), absl::StrCat("device-triggered post of ", slot.target.name, " (trigger slot ",
                                  index, ", post ", slot.posted, "): ", status.message()));
  has_error_.store(true, std::memory_order_release);
}

void Trigger::Release(Slot& slot) {
  const int index = static_cast<int>(&slot - slots_.data());
  const int64_t go = LoadWord(Go(index));
  if (LoadWord(Done(index)) < go) StoreWord(Done(index), go);
}

bool Trigger::Sweep(Slot& slot, int64_t now_ns) {
  const int index = static_cast<int>(&slot - slots_.data());
  bool work = false;
  if (slot.inflight) {
    absl::StatusOr<bool> r = slot.target.poll(slot.handle);
    if (!r.ok() || *r) {
      slot.inflight = false;
      ++slot.completed;
      completions_.fetch_add(1, std::memory_order_relaxed);
      work = true;
      if (!r.ok() && !slot.failed) Fail(slot, r.status());
      if (!slot.failed) StoreWord(Done(index), slot.completed);
    } else if (now_ns > slot.deadline_ns && !slot.failed) {
      Fail(slot, absl::DeadlineExceededError(
                     absl::StrCat("not complete within ", absl::FormatDuration(options_.timeout))));
    }
  }
  const int state = slot.state.load(std::memory_order_acquire);
  if (!slot.failed && !slot.inflight && state == kArmed) {
    const int64_t go = LoadWord(Go(index));
    if (go > slot.posted) {
      work = true;
      if (go - slot.completed > options_.max_queued) {
        Fail(slot, absl::ResourceExhaustedError(
                       absl::StrCat(go - slot.completed, " increments of go queued, more than ",
                                    options_.max_queued, " (TriggerOptions.max_queued)")));
      } else {
        for (const auto& [word, value] : slot.target.writes) *word = value;
        absl::StatusOr<RequestHandle> h = slot.target.post();
        ++slot.posted;
        if (h.ok()) {
          slot.inflight = true;
          slot.handle = *h;
          slot.deadline_ns = now_ns + absl::ToInt64Nanoseconds(options_.timeout);
          posts_.fetch_add(1, std::memory_order_relaxed);
        } else {
          Fail(slot, h.status());
        }
      }
    }
  }
  if (slot.failed) Release(slot);  // waiters never wait for a post that will not come
  if (state == kDisarming && !slot.inflight) {
    Release(slot);
    std::lock_guard<std::mutex> lock(mu_);
    slot.target = TriggerTarget{};
    slot.state.store(kFree, std::memory_order_release);
    --armed_;
    published_generation_.store(++generation_, std::memory_order_release);
    cv_.notify_all();
    work = true;
  }
  return work;
}

void Trigger::Run() {
  std::vector<int> active;
  active.reserve(static_cast<size_t>(options_.capacity));
  uint64_t seen = ~uint64_t{0};
  int64_t last_work_ns = absl::GetCurrentTimeNanos();
  const int64_t spin_ns = absl::ToInt64Nanoseconds(options_.spin);
  for (;;) {
    if (published_generation_.load(std::memory_order_acquire) != seen) {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) return;
      seen = generation_;
      active.clear();
      for (int i = 0; i < options_.capacity; ++i) {
        if (slots_[i].state.load(std::memory_order_relaxed) != kFree) active.push_back(i);
      }
      if (active.empty()) {  // nothing armed: sleep until something is
        cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        continue;
      }
    }
    const int64_t now_ns = absl::GetCurrentTimeNanos();
    bool work = false;
    for (int i : active) work |= Sweep(slots_[i], now_ns);
    if (work) {
      last_work_ns = now_ns;
    } else if (now_ns - last_work_ns > spin_ns) {
      absl::SleepFor(options_.idle_sleep);
    } else {
      std::this_thread::yield();
    }
  }
}

void Trigger::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    published_generation_.store(++generation_, std::memory_order_release);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The thread is gone: finish what is in flight (bounded), release every waiter.
  const int64_t deadline = absl::GetCurrentTimeNanos() + absl::ToInt64Nanoseconds(options_.timeout);
  std::lock_guard<std::mutex> lock(mu_);
  for (Slot& slot : slots_) {
    if (slot.state.load(std::memory_order_relaxed) == kFree) continue;
    while (slot.inflight && absl::GetCurrentTimeNanos() < deadline) {
      absl::StatusOr<bool> r = slot.target.poll(slot.handle);
      if (!r.ok() || *r) {
        slot.inflight = false;
        break;
      }
      absl::SleepFor(options_.idle_sleep);
    }
    Release(slot);
    slot.target = TriggerTarget{};
    slot.state.store(kFree, std::memory_order_release);
  }
  armed_ = 0;
  cv_.notify_all();
}

}  // namespace stepmesh
