// The CUDA backend's event pool, streams and events (cuda_stream.h).

#include "src/backends/cuda/cuda_stream.h"

#include <algorithm>
#include <utility>

#include "src/backends/cuda/cuda_host_flag.h"
#include "src/backends/cuda/cuda_status.h"
#include "src/base/logging.h"
#include "stepmesh/status.h"

namespace stepmesh::cuda {
namespace {

void RunHostFunc(void* arg) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
  (*fn)();
}
}  // namespace

absl::StatusOr<std::shared_ptr<EventPool>> EventPool::Create(std::shared_ptr<DeviceContext> context,
                                                             int size) {
  auto pool = std::shared_ptr<EventPool>(new EventPool(std::move(context)));
  CudaApi& api = pool->context_->api();
  ScopedDevice scoped(api, pool->context_->device());
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  pool->slots_.reserve(static_cast<size_t>(size));
  pool->free_.reserve(static_cast<size_t>(size));
  pool->draining_.reserve(static_cast<size_t>(size));
  if (pool->mode() == ReadyEventMode::kCopyEngineFlag) {
    void* ramp = nullptr;
    STEPMESH_RETURN_IF_ERROR(
        CudaStatus(api, api.Malloc(&ramp, kRampSize * sizeof(uint32_t)), "cudaMalloc(event ramp)"));
    pool->ramp_ = static_cast<uint32_t*>(ramp);
    std::vector<uint32_t> values(kRampSize);
    for (uint32_t i = 0; i < kRampSize; ++i) values[i] = i + 1;
    STEPMESH_RETURN_IF_ERROR(
        pool->context_->Copy(ramp, values.data(), kRampSize * sizeof(uint32_t)));
    if (size > 0) {
      void* words = nullptr;
      STEPMESH_RETURN_IF_ERROR(CudaStatus(
          api,
          api.HostAlloc(&words, static_cast<size_t>(size) * kWordStride, cudaHostAllocPortable),
          absl::StrCat("cudaHostAlloc(", size, " event words)")));
      std::memset(words, 0, static_cast<size_t>(size) * kWordStride);
      pool->words_ = words;
    }
  }
  for (int i = 0; i < size; ++i) {
    auto slot = std::make_unique<EventSlot>();
    if (pool->mode() == ReadyEventMode::kCudaEvent) {
      // No timing: timing events make cudaEventRecord/Query slower.
      STEPMESH_RETURN_IF_ERROR(
          CudaStatus(api, api.EventCreateWithFlags(&slot->event, cudaEventDisableTiming),
                     "cudaEventCreateWithFlags"));
    } else {
      slot->host_word = reinterpret_cast<uint32_t*>(static_cast<char*>(pool->words_) +
                                                    static_cast<size_t>(i) * kWordStride);
    }
    pool->free_.push_back(slot.get());
    pool->slots_.push_back(std::move(slot));
  }
  return pool;
}

EventPool::~EventPool() {
  CudaApi& api = context_->api();
  ScopedDevice scoped(api, context_->device());
  for (auto& slot : slots_) {
    if (slot->event != nullptr) (void)api.EventDestroy(slot->event);
  }
  if (words_ != nullptr) (void)api.FreeHost(words_);
  if (ramp_ != nullptr) (void)api.Free(ramp_);
}

absl::StatusOr<EventSlot*> EventPool::Acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    // Slots whose last copy has landed since they were released.
    size_t kept = 0;
    for (EventSlot* slot : draining_) {
      if (slot->CopyLanded()) {
        Reset(*slot);
        free_.push_back(slot);
      } else {
        draining_[kept++] = slot;
      }
    }
    draining_.resize(kept);
  }
  if (free_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("CreateEvent: all ", slots_.size(),
                     " pooled events are in use or still have a record in flight; raise "
                     "CudaBackendOptions::event_pool_size"));
  }
  EventSlot* slot = free_.back();
  free_.pop_back();
  return slot;
}

void EventPool::Release(EventSlot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mode() == ReadyEventMode::kCopyEngineFlag && !slot->CopyLanded()) {
    draining_.push_back(slot);
    return;
  }
  Reset(*slot);
  free_.push_back(slot);
}

void EventPool::Reset(EventSlot& slot) {
  slot.expected.store(0, std::memory_order_relaxed);
  slot.recorded.store(false, std::memory_order_relaxed);
  slot.last_stream = nullptr;
}

CudaStream::~CudaStream() {
  context_->NoteStream(-1);
  if (!owned_) return;
  CudaApi& api = context_->api();
  ScopedDevice scoped(api, context_->device());
  // cudaStreamDestroy does not wait: queued work still runs to completion.
  const cudaError_t error = api.StreamDestroy(stream_);
  if (error != cudaSuccess) {
    STEPMESH_LOG(kWarning, CudaStatus(api, error, "cudaStreamDestroy").ToString());
  }
}

absl::Status CudaStream::CopyAsync(void* dst, const void* src, size_t bytes) {
  CudaApi& api = context_->api();
  STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
  // cudaMemcpyDefault: unified addressing tells the direction from the pointers.
  return CudaStatus(api, api.MemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                    "cudaMemcpyAsync");
}

absl::Status CudaStream::LaunchHostFunc(std::function<void()> fn) {
  CudaApi& api = context_->api();
  STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
  // The closure is freed after it runs once; a graph replays its host nodes,
  // so a captured one would run a freed closure on the second launch.
  STEPMESH_ASSIGN_OR_RETURN(const bool capturing, context_->IsCapturing(stream_));
  if (capturing) {
    return absl::FailedPreconditionError(
        "LaunchHostFunc on a stream being captured into a CUDA graph is not supported");
  }
  auto heap = std::make_unique<std::function<void()>>(std::move(fn));
  const cudaError_t error = api.LaunchHostFunc(stream_, &RunHostFunc, heap.get());
  if (error == cudaSuccess) heap.release();  // RunHostFunc owns it now
  return CudaStatus(api, error, "cudaLaunchHostFunc");
}

absl::Status CudaStream::WaitHostFlag(HostFlag& flag, uint32_t value) {
  auto* cuda_flag = dynamic_cast<CudaHostFlag*>(&flag);
  if (cuda_flag == nullptr) {
    return absl::InvalidArgumentError("WaitHostFlag: the flag was not made by a CUDA backend");
  }
  return context_->StreamWait(stream_, *cuda_flag, value);
}

absl::Status CudaStream::WaitHostFlagNext(HostFlag& counter, HostFlag& cursor) {
  auto* cuda_counter = dynamic_cast<CudaHostFlag*>(&counter);
  auto* cuda_cursor = dynamic_cast<CudaHostFlag*>(&cursor);
  if (cuda_counter == nullptr || cuda_cursor == nullptr) {
    return absl::InvalidArgumentError(
        "WaitHostFlagNext: the flags were not made by a CUDA backend");
  }
  return context_->StreamWaitNext(stream_, *cuda_counter, *cuda_cursor);
}

absl::Status CudaStream::WaitCounterAtLeast(const int64_t* counter, const int64_t* target) {
  if (counter == nullptr || target == nullptr) {
    return absl::InvalidArgumentError("WaitCounterAtLeast: a null counter or target");
  }
  CudaApi& api = context_->api();
  // A kernel launch into a stream of another device than the current one
  // fails (and handle 0 means the current device's legacy stream), so the
  // backend's device is made current, and the caller's restored after.
  ScopedDevice scoped(api, context_->device());
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  STEPMESH_ASSIGN_OR_RETURN(const int64_t* device_counter, DeviceWord(api, counter, "counter"));
  STEPMESH_ASSIGN_OR_RETURN(const int64_t* device_target, DeviceWord(api, target, "target"));
  return CudaStatus(api, api.LaunchWaitCounterKernel(stream_, device_counter, device_target),
                    "launching the counter-wait kernel");
}

absl::Status CudaStream::IncrementCounter(int64_t* counter) {
  if (counter == nullptr) return absl::InvalidArgumentError("IncrementCounter: a null counter");
  CudaApi& api = context_->api();
  ScopedDevice scoped(api, context_->device());  // a kernel launch, as in WaitCounterAtLeast
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  STEPMESH_ASSIGN_OR_RETURN(const int64_t* device_counter,
                            DeviceWord(api, counter, "counter", "IncrementCounter"));
  return CudaStatus(api,
                    api.LaunchIncrementCounterKernel(stream_, const_cast<int64_t*>(device_counter)),
                    "launching the counter-increment kernel");
}

absl::StatusOr<const int64_t*> CudaStream::DeviceWord(CudaApi& api, const int64_t* word,
                                                      absl::string_view name,
                                                      absl::string_view call) {
  cudaPointerAttributes attributes{};
  STEPMESH_RETURN_IF_ERROR(CudaStatus(api, api.PointerGetAttributes(&attributes, word),
                                      absl::StrCat("cudaPointerGetAttributes of the ", name)));
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return word;
  }
  if (attributes.type != cudaMemoryTypeHost) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": the ", name,
        " is pageable host memory, which the device cannot read (pin it: pin_memory=True)"));
  }
  if (attributes.devicePointer != nullptr) {
    return static_cast<const int64_t*>(attributes.devicePointer);
  }
  void* mapped = nullptr;
  STEPMESH_RETURN_IF_ERROR(
      CudaStatus(api, api.HostGetDevicePointer(&mapped, const_cast<int64_t*>(word), 0),
                 absl::StrCat("cudaHostGetDevicePointer of the ", name)));
  return static_cast<const int64_t*>(mapped);
}

absl::Status CudaStream::SignalHostFlag(HostFlag& flag, uint32_t value) {
  auto* cuda_flag = dynamic_cast<CudaHostFlag*>(&flag);
  if (cuda_flag == nullptr) {
    return absl::InvalidArgumentError("SignalHostFlag: the flag was not made by a CUDA backend");
  }
  return context_->StreamSignal(stream_, *cuda_flag, value);
}

absl::Status CudaStream::Synchronize(absl::Duration timeout) {
  CudaApi& api = context_->api();
  STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
  return PollUntil(
      [&]() -> absl::StatusOr<bool> {
        const cudaError_t error = api.StreamQuery(stream_);
        if (error == cudaErrorNotReady) return false;
        STEPMESH_RETURN_IF_ERROR(CudaStatus(api, error, "cudaStreamQuery"));
        return true;
      },
      timeout, "stream synchronize");
}

absl::Status CudaEvent::Record(Stream& stream) {
  auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
  if (cuda_stream == nullptr) {
    return absl::InvalidArgumentError("Event::Record: the stream was not made by a CUDA backend");
  }
  return RecordOn(cuda_stream->handle());
}

absl::Status CudaEvent::RecordOn(cudaStream_t handle) {
  DeviceContext& context = pool_->context();
  CudaApi& api = context.api();
  // cudaEventRecord fails when the event and the stream belong to different
  // devices, and handle 0 (RecordOnCudaStream's legacy stream) means the
  // current device's: with another device current the record would fail
  // (kCudaEvent) or land on the wrong device's stream (the flag copy).
  ScopedDevice scoped(api, context.device());
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  // Captured, the record would happen once per graph replay at best (the
  // flag copy) or not at all: the event would mean nothing.
  STEPMESH_ASSIGN_OR_RETURN(const bool capturing, context.IsCapturing(handle));
  if (capturing) {
    return absl::FailedPreconditionError(
        "Event::Record: the stream is being captured into a CUDA graph; record ready events "
        "outside the capture, after cudaGraphLaunch");
  }
  if (pool_->mode() == ReadyEventMode::kCudaEvent) {
    STEPMESH_RETURN_IF_ERROR(
        CudaStatus(api, api.EventRecord(slot_->event, handle), "cudaEventRecord"));
    slot_->recorded.store(true, std::memory_order_release);
    slot_->last_stream = handle;
    return absl::OkStatus();
  }
  // Copies complete in order on one stream only. Moving a pending event to
  // another stream could let the older copy land last and the event never
  // complete, so refuse instead of hanging.
  if (slot_->last_stream != handle && !slot_->CopyLanded()) {
    return absl::FailedPreconditionError(
        "Event::Record: a copy-engine event is still pending on another stream; wait for it "
        "or use another event");
  }
  const uint32_t sequence = slot_->sequence + 1;
  const uint32_t index = sequence % kRampSize;
  STEPMESH_RETURN_IF_ERROR(
      CudaStatus(api,
                 api.MemcpyAsync(slot_->host_word, pool_->ramp() + index, sizeof(uint32_t),
                                 cudaMemcpyDeviceToHost, handle),
                 "cudaMemcpyAsync(ready flag)"));
  slot_->sequence = sequence;
  slot_->last_stream = handle;
  const int64_t now = absl::GetCurrentTimeNanos();
  slot_->recorded_at_ns.store(now, std::memory_order_relaxed);
  slot_->next_check_ns.store(now, std::memory_order_relaxed);
  slot_->expected.store(index + 1, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaEvent::Query() {
  if (pool_->mode() == ReadyEventMode::kCopyEngineFlag) {
    if (slot_->CopyLanded()) return true;
    return CheckForFault();
  }
  if (!slot_->recorded.load(std::memory_order_acquire)) return true;
  DeviceContext& context = pool_->context();
  CudaApi& api = context.api();
  RelaxedCapture relaxed(api);
  STEPMESH_RETURN_IF_ERROR(BindThread(api, context.device()));
  const cudaError_t error = api.EventQuery(slot_->event);
  if (error == cudaErrorNotReady) return false;
  STEPMESH_RETURN_IF_ERROR(CudaStatus(api, error, "cudaEventQuery"));
  return true;
}

absl::StatusOr<bool> CudaEvent::CheckForFault() {
  if (slot_->polls.fetch_add(1, std::memory_order_relaxed) % kPollsPerClockRead != 0) {
    return false;
  }
  const int64_t interval =
      absl::ToInt64Nanoseconds(pool_->context().options().fault_check_interval);
  const int64_t now = absl::GetCurrentTimeNanos();
  int64_t due = slot_->next_check_ns.load(std::memory_order_relaxed);
  if (now - slot_->recorded_at_ns.load(std::memory_order_relaxed) < interval || now < due ||
      !slot_->next_check_ns.compare_exchange_strong(due, now + interval,
                                                    std::memory_order_relaxed)) {
    return false;
  }
  STEPMESH_RETURN_IF_ERROR(pool_->context().CheckForFault(
      absl::StrCat("ready event pending for ",
                   absl::FormatDuration(absl::Nanoseconds(now - slot_->recorded_at_ns.load())),
                   ": the device reports a fault")));
  return slot_->CopyLanded();
}

}  // namespace stepmesh::cuda
