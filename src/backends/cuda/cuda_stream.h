#pragma once
// The CUDA backend's events (a pool made at creation) and streams.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/backends/cuda/cuda_device_context.h"
#include "stepmesh/backend.h"

namespace stepmesh::cuda {

// Fields read by a polling thread while the owner records are atomic.
struct EventSlot {
  cudaEvent_t event = nullptr;         // kCudaEvent
  uint32_t* host_word = nullptr;       // kCopyEngineFlag: written by the copy engine
  uint32_t sequence = 0;               // records so far (copy-engine mode; owner only)
  cudaStream_t last_stream = nullptr;  // owner only
  // Copy-engine mode: the value the last record's copy writes; 0 = none.
  std::atomic<uint32_t> expected{0};
  std::atomic<bool> recorded{false};  // CUDA-event mode
  std::atomic<int64_t> recorded_at_ns{0};
  std::atomic<int64_t> next_check_ns{0};
  std::atomic<uint32_t> polls{0};

  bool CopyLanded() const {
    const uint32_t want = expected.load(std::memory_order_acquire);
    return want == 0 || LoadAcquire(host_word) == want;
  }
};

// Events are made once, when the backend is created, and recycled: creating
// and destroying CUDA events per step costs driver calls (and locks), and
// pinning more host memory later waits for the whole device.
class EventPool {
 public:
  static absl::StatusOr<std::shared_ptr<EventPool>> Create(std::shared_ptr<DeviceContext> context,
                                                           int size);

  ~EventPool();

  absl::StatusOr<EventSlot*> Acquire();

  // A slot whose flag copy is still in flight stays out of the pool until it
  // landed: its next owner must not see that copy land.
  void Release(EventSlot* slot);

  ReadyEventMode mode() const { return context_->options().ready_event_mode; }
  DeviceContext& context() const { return *context_; }
  const uint32_t* ramp() const { return ramp_; }

 private:
  explicit EventPool(std::shared_ptr<DeviceContext> context) : context_(std::move(context)) {}

  static void Reset(EventSlot& slot);

  const std::shared_ptr<DeviceContext> context_;
  uint32_t* ramp_ = nullptr;
  void* words_ = nullptr;
  std::mutex mu_;
  std::vector<std::unique_ptr<EventSlot>> slots_;
  std::vector<EventSlot*> free_;
  std::vector<EventSlot*> draining_;
};

class CudaStream final : public Stream {
 public:
  CudaStream(std::shared_ptr<DeviceContext> context, cudaStream_t stream, bool owned)
      : context_(std::move(context)), stream_(stream), owned_(owned) {
    context_->NoteStream(+1);
  }
  ~CudaStream() override;

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes) override;

  absl::Status LaunchHostFunc(std::function<void()> fn) override;

  absl::Status WaitHostFlag(HostFlag& flag, uint32_t value) override;

  absl::Status WaitHostFlagNext(HostFlag& counter, HostFlag& cursor) override;

  absl::Status WaitCounterAtLeast(const int64_t* counter, const int64_t* target) override;

  absl::Status IncrementCounter(int64_t* counter) override;

  // The address a kernel reads `word` at: itself in device memory, the
  // mapping of pinned host memory, an error for pageable memory.
  static absl::StatusOr<const int64_t*> DeviceWord(CudaApi& api, const int64_t* word,
                                                   absl::string_view name,
                                                   absl::string_view call = "WaitCounterAtLeast");

  absl::Status SignalHostFlag(HostFlag& flag, uint32_t value) override;

  absl::Status Synchronize(absl::Duration timeout) override;

  cudaStream_t handle() const { return stream_; }
  const std::shared_ptr<DeviceContext>& context() const { return context_; }

 private:
  const std::shared_ptr<DeviceContext> context_;
  const cudaStream_t stream_;
  const bool owned_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<EventPool> pool, EventSlot* slot)
      : pool_(std::move(pool)), slot_(slot) {}
  ~CudaEvent() override { pool_->Release(slot_); }

  absl::Status Record(Stream& stream) override;

  absl::Status RecordOn(cudaStream_t handle);

  absl::StatusOr<bool> Query() override;

  absl::Status Wait(absl::Duration timeout) override {
    return PollUntil([this] { return Query(); }, timeout, "event");
  }

 private:
  // A faulted device never runs the flag copy, and a host load cannot tell.
  // Once the event is pending for fault_check_interval (looking at the clock
  // only every kPollsPerClockRead polls), ask the device, at most once per
  // interval.
  absl::StatusOr<bool> CheckForFault();

  const std::shared_ptr<EventPool> pool_;
  EventSlot* const slot_;
};

}  // namespace stepmesh::cuda
