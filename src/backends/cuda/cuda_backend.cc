// The CUDA backend. Everything goes through CudaApi (cuda_api.h), so this file
// is exercised in CI against a fake, and on GPU machines against the runtime.
//
// Ownership: every object handed out (Memory, Stream, Event, HostFlag) holds a
// shared_ptr to what it needs (the API, the event pool), so destruction order
// between them and the Backend does not matter.

#include "src/backends/cuda/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "src/backends/cuda/cuda_api.h"
#include "src/backends/cuda/cuda_status.h"
#include "src/base/logging.h"
#include "src/base/thread_util.h"
#include "stepmesh/status.h"

namespace stepmesh {
namespace cuda {
namespace {

// Copy-engine events copy ramp[seq % kRampSize] (= seq % kRampSize + 1, never
// 0) into their host word. Consecutive records of one event thus write
// different values, and a copy from an older record still in flight cannot be
// mistaken for the latest one unless kRampSize records are pending at once.
constexpr uint32_t kRampSize = 1024;
// One host word per cache line: events are polled by different threads.
constexpr size_t kWordStride = 64;
constexpr size_t kWordsPerChunk = 64;  // 4 KiB of pinned memory per pool growth
constexpr size_t kHostFlagBytes = 64;
// Pinned + mapped host memory, valid in every context (Portable) so a flag can
// be shared by backends on different devices.
constexpr unsigned int kMappedFlags = cudaHostAllocMapped | cudaHostAllocPortable;
// Spins before a waiting loop starts yielding its core.
constexpr int kSpinsBeforeYield = 1 << 12;

// Sets the calling thread's current device for one scope and restores the
// caller's afterwards: application threads (PyTorch's, say) keep their own
// current device, and kernel launches/allocations need ours.
class ScopedDevice {
 public:
  ScopedDevice(CudaApi& api, int device) : api_(api) {
    int current = -1;
    if (api.GetDevice(&current) == cudaSuccess) {
      if (current == device) return;
      previous_ = current;
    }
    status_ = CudaStatus(api, api.SetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  ~ScopedDevice() {
    if (previous_ >= 0) (void)api_.SetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  CudaApi& api_;
  int previous_ = -1;
  absl::Status status_;
};

// Polls `ready` until it says true, spinning first and then yielding; used by
// the blocking waits, which must honour a timeout and so cannot use
// cudaEventSynchronize/cudaStreamSynchronize.
template <typename Ready>
absl::Status PollUntil(Ready ready, absl::Duration timeout, absl::string_view what) {
  const absl::Time deadline = absl::Now() + timeout;
  for (int spins = 0;; ++spins) {
    absl::StatusOr<bool> done = ready();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    if ((spins & 255) == 0 && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, " not reached within ", absl::FormatDuration(timeout)));
    }
    if (spins < kSpinsBeforeYield) {
      base::CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
}

uint32_t LoadAcquire(uint32_t* word) {
  return std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire);
}

// State shared by the backend and everything it hands out.
class DeviceContext {
 public:
  DeviceContext(std::shared_ptr<CudaApi> api, int device, const CudaBackendOptions& options)
      : api_(std::move(api)), device_(device), options_(options) {}

  CudaApi& api() const { return *api_; }
  const std::shared_ptr<CudaApi>& shared_api() const { return api_; }
  int device() const { return device_; }
  const CudaBackendOptions& options() const { return options_; }

  // Arrival -> GPU: later work on `stream` waits for the flag.
  absl::Status StreamWait(cudaStream_t stream, uint32_t* device_flag, uint32_t value) {
    STEPMESH_ASSIGN_OR_RETURN(const bool memop, UseStreamMemOps(stream));
    if (memop) {
      unsigned int flags = CU_STREAM_WAIT_VALUE_GEQ;
      if (options_.flush_remote_writes) flags |= CU_STREAM_WAIT_VALUE_FLUSH;
      const CUresult result =
          api_->StreamWaitValue32(reinterpret_cast<CUstream>(stream),
                                  reinterpret_cast<CUdeviceptr>(device_flag), value, flags);
      if (result == CUDA_SUCCESS) return absl::OkStatus();
      if (!FallBackFromMemOps(result)) {
        return CuResultStatus(*api_, result, "cuStreamWaitValue32");
      }
    }
    ScopedDevice scoped(*api_, device_);  // kernel launches need the stream's device current
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    return CudaStatus(*api_, api_->LaunchWaitFlagKernel(stream, device_flag, value),
                      "launching the flag-wait kernel");
  }

  // GPU -> host: the stream writes the flag when it gets there.
  absl::Status StreamSignal(cudaStream_t stream, uint32_t* device_flag, uint32_t value) {
    STEPMESH_ASSIGN_OR_RETURN(const bool memop, UseStreamMemOps(stream));
    if (memop) {
      // The default flag orders the write after all earlier work (a system
      // fence), which is what makes the flag mean "data before it is there".
      const CUresult result = api_->StreamWriteValue32(reinterpret_cast<CUstream>(stream),
                                                       reinterpret_cast<CUdeviceptr>(device_flag),
                                                       value, CU_STREAM_WRITE_VALUE_DEFAULT);
      if (result == CUDA_SUCCESS) return absl::OkStatus();
      if (!FallBackFromMemOps(result)) {
        return CuResultStatus(*api_, result, "cuStreamWriteValue32");
      }
    }
    ScopedDevice scoped(*api_, device_);
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    return CudaStatus(*api_, api_->LaunchSignalFlagKernel(stream, device_flag, value),
                      "launching the flag-signal kernel");
  }

  absl::StatusOr<bool> IsCapturing(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    STEPMESH_RETURN_IF_ERROR(
        CudaStatus(*api_, api_->StreamIsCapturing(stream, &capture), "cudaStreamIsCapturing"));
    return capture != cudaStreamCaptureStatusNone;
  }

  // PCI bus id (lower case, as sysfs spells it) and NUMA node of a device,
  // looked up once per device.
  absl::StatusOr<std::pair<std::string, int>> DeviceTopology(int device) {
    std::lock_guard<std::mutex> lock(topology_mu_);
    auto it = topology_.find(device);
    if (it != topology_.end()) return it->second;
    char bus_id[32] = {};
    STEPMESH_RETURN_IF_ERROR(CudaStatus(*api_,
                                        api_->DeviceGetPCIBusId(bus_id, sizeof(bus_id), device),
                                        absl::StrCat("cudaDeviceGetPCIBusId(", device, ")")));
    std::string pci(bus_id);
    for (char& c : pci) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    int numa = -1;
    std::ifstream file(absl::StrCat(options_.sysfs_root, "/bus/pci/devices/", pci, "/numa_node"));
    std::string line;
    if (file && std::getline(file, line)) {
      // Missing or unparsable means unknown, which callers already handle.
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &numa)) numa = -1;
    }
    auto& entry = topology_[device];
    entry = {pci, numa};
    return entry;
  }

 private:
  absl::StatusOr<bool> UseStreamMemOps(cudaStream_t stream) {
    switch (options_.stream_wait_mode) {
      case StreamWaitMode::kKernel:
        return false;
      case StreamWaitMode::kStreamMemOp:
        if (!api_->HasStreamMemOps()) {
          return absl::UnimplementedError(
              "StreamWaitMode::kStreamMemOp: the driver exposes no cuStreamWaitValue32/"
              "cuStreamWriteValue32; use kAuto or kKernel");
        }
        return true;
      case StreamWaitMode::kAuto:
        break;
    }
    if (memops_unsupported_.load(std::memory_order_relaxed) || !api_->HasStreamMemOps()) {
      return false;
    }
    // A stream memory operation is not something every driver can capture into
    // a graph; the kernel always is, so capture takes the kernel path.
    STEPMESH_ASSIGN_OR_RETURN(const bool capturing, IsCapturing(stream));
    return !capturing;
  }

  // In kAuto mode a driver that resolves the entry point but refuses the call
  // (stream memory operations disabled) moves us to the kernels for good.
  bool FallBackFromMemOps(CUresult result) {
    if (options_.stream_wait_mode != StreamWaitMode::kAuto || result != CUDA_ERROR_NOT_SUPPORTED) {
      return false;
    }
    if (!memops_unsupported_.exchange(true)) {
      STEPMESH_LOG(kWarning, "cuda: stream memory operations not supported on device ", device_,
                   "; GPU waits on host flags use the wait kernel from now on");
    }
    return true;
  }

  const std::shared_ptr<CudaApi> api_;
  const int device_;
  const CudaBackendOptions options_;
  std::atomic<bool> memops_unsupported_{false};
  std::mutex topology_mu_;
  absl::flat_hash_map<int, std::pair<std::string, int>> topology_;
};

// ---------------------------------------------------------------------------
// Memory and host flags.

class CudaMemory final : public Memory {
 public:
  CudaMemory(std::shared_ptr<CudaApi> api, void* data, size_t bytes, MemoryKind kind, int device)
      : api_(std::move(api)), data_(data), bytes_(bytes), kind_(kind), device_(device) {}
  ~CudaMemory() override {
    const bool on_device = kind_ == MemoryKind::kDevice;
    const cudaError_t error = on_device ? api_->Free(data_) : api_->FreeHost(data_);
    if (error != cudaSuccess) {
      STEPMESH_LOG(kWarning,
                   CudaStatus(*api_, error, on_device ? "cudaFree" : "cudaFreeHost").ToString());
    }
  }
  void* data() const override { return data_; }
  size_t bytes() const override { return bytes_; }
  Device device() const override {
    return kind_ == MemoryKind::kDevice ? Device::Cuda(device_) : Device::Cpu();
  }

 private:
  const std::shared_ptr<CudaApi> api_;
  void* const data_;
  const size_t bytes_;
  const MemoryKind kind_;
  const int device_;
};

// A 32-bit word of mapped pinned memory: the host stores/loads it directly,
// streams reach it through its device alias.
class CudaHostFlag final : public HostFlag {
 public:
  CudaHostFlag(std::shared_ptr<CudaApi> api, uint32_t* host, uint32_t* device)
      : api_(std::move(api)), host_(host), device_(device) {}
  ~CudaHostFlag() override {
    const cudaError_t error = api_->FreeHost(host_);
    if (error != cudaSuccess) {
      STEPMESH_LOG(kWarning, CudaStatus(*api_, error, "cudaFreeHost(host flag)").ToString());
    }
  }
  void Store(uint32_t value) override {
    std::atomic_ref<uint32_t>(*host_).store(value, std::memory_order_release);
  }
  uint32_t Load() const override { return LoadAcquire(host_); }
  uint32_t* device_word() const { return device_; }

 private:
  const std::shared_ptr<CudaApi> api_;
  uint32_t* const host_;
  uint32_t* const device_;
};

// ---------------------------------------------------------------------------
// Event pool.

struct EventSlot {
  cudaEvent_t event = nullptr;    // kCudaEvent
  uint32_t* host_word = nullptr;  // kCopyEngineFlag: written by the copy engine
  uint32_t sequence = 0;          // records so far (copy-engine mode)
  uint32_t expected = 0;          // value the last record's copy writes
  cudaStream_t last_stream = nullptr;
  bool recorded = false;
};

// Events are made once and recycled: creating and destroying CUDA events per
// step costs driver calls (and locks) on the hot path.
class EventPool {
 public:
  static absl::StatusOr<std::shared_ptr<EventPool>> Create(std::shared_ptr<DeviceContext> context,
                                                           int initial) {
    auto pool = std::shared_ptr<EventPool>(new EventPool(std::move(context)));
    CudaApi& api = pool->context_->api();
    ScopedDevice scoped(api, pool->context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    if (pool->mode() == ReadyEventMode::kCopyEngineFlag) {
      void* ramp = nullptr;
      STEPMESH_RETURN_IF_ERROR(CudaStatus(api, api.Malloc(&ramp, kRampSize * sizeof(uint32_t)),
                                          "cudaMalloc(event ramp)"));
      pool->ramp_ = static_cast<uint32_t*>(ramp);
      std::vector<uint32_t> values(kRampSize);
      for (uint32_t i = 0; i < kRampSize; ++i) values[i] = i + 1;
      STEPMESH_RETURN_IF_ERROR(CudaStatus(
          api,
          api.Memcpy(ramp, values.data(), kRampSize * sizeof(uint32_t), cudaMemcpyHostToDevice),
          "cudaMemcpy(event ramp)"));
    }
    std::lock_guard<std::mutex> lock(pool->mu_);
    for (int i = 0; i < initial; ++i) STEPMESH_RETURN_IF_ERROR(pool->GrowLocked());
    return pool;
  }

  ~EventPool() {
    CudaApi& api = context_->api();
    for (auto& slot : slots_) {
      if (slot->event != nullptr) (void)api.EventDestroy(slot->event);
    }
    for (void* chunk : chunks_) (void)api.FreeHost(chunk);
    if (ramp_ != nullptr) (void)api.Free(ramp_);
  }

  absl::StatusOr<EventSlot*> Acquire() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) {
      ScopedDevice scoped(context_->api(), context_->device());  // events belong to a device
      STEPMESH_RETURN_IF_ERROR(scoped.status());
      STEPMESH_RETURN_IF_ERROR(GrowLocked());
    }
    EventSlot* slot = free_.back();
    free_.pop_back();
    return slot;
  }

  void Release(EventSlot* slot) {
    // A pending record may still land in host_word later; the next owner's
    // records use new sequence values, so it cannot be mistaken for theirs.
    slot->recorded = false;
    slot->last_stream = nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(slot);
  }

  ReadyEventMode mode() const { return context_->options().ready_event_mode; }
  CudaApi& api() const { return context_->api(); }
  const uint32_t* ramp() const { return ramp_; }

 private:
  explicit EventPool(std::shared_ptr<DeviceContext> context) : context_(std::move(context)) {}

  absl::Status GrowLocked() {
    CudaApi& api = context_->api();
    auto slot = std::make_unique<EventSlot>();
    if (mode() == ReadyEventMode::kCudaEvent) {
      // No timing: timing events make cudaEventRecord/Query slower.
      STEPMESH_RETURN_IF_ERROR(
          CudaStatus(api, api.EventCreateWithFlags(&slot->event, cudaEventDisableTiming),
                     "cudaEventCreateWithFlags"));
    } else {
      if (next_word_ == kWordsPerChunk || chunks_.empty()) {
        void* chunk = nullptr;
        STEPMESH_RETURN_IF_ERROR(
            CudaStatus(api, api.HostAlloc(&chunk, kWordsPerChunk * kWordStride, kMappedFlags),
                       "cudaHostAlloc(event words)"));
        std::memset(chunk, 0, kWordsPerChunk * kWordStride);
        chunks_.push_back(chunk);
        next_word_ = 0;
      }
      slot->host_word = reinterpret_cast<uint32_t*>(static_cast<char*>(chunks_.back()) +
                                                    next_word_ * kWordStride);
      ++next_word_;
    }
    free_.push_back(slot.get());
    slots_.push_back(std::move(slot));
    return absl::OkStatus();
  }

  const std::shared_ptr<DeviceContext> context_;
  uint32_t* ramp_ = nullptr;
  std::mutex mu_;
  std::vector<std::unique_ptr<EventSlot>> slots_;
  std::vector<EventSlot*> free_;
  std::vector<void*> chunks_;
  size_t next_word_ = 0;
};

// ---------------------------------------------------------------------------
// Streams and events.

void RunHostFunc(void* arg) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
  (*fn)();
}

class CudaStream final : public Stream {
 public:
  CudaStream(std::shared_ptr<DeviceContext> context, cudaStream_t stream, bool owned)
      : context_(std::move(context)), stream_(stream), owned_(owned) {}
  ~CudaStream() override {
    if (!owned_) return;
    // cudaStreamDestroy does not wait: queued work still runs to completion.
    const cudaError_t error = context_->api().StreamDestroy(stream_);
    if (error != cudaSuccess) {
      STEPMESH_LOG(kWarning, CudaStatus(context_->api(), error, "cudaStreamDestroy").ToString());
    }
  }

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes) override {
    // cudaMemcpyDefault: unified addressing tells the direction from the pointers.
    return CudaStatus(context_->api(),
                      context_->api().MemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                      "cudaMemcpyAsync");
  }

  absl::Status LaunchHostFunc(std::function<void()> fn) override {
    // The closure is freed after it runs once; a graph replays its host nodes,
    // so a captured one would run a freed closure on the second launch.
    STEPMESH_ASSIGN_OR_RETURN(const bool capturing, context_->IsCapturing(stream_));
    if (capturing) {
      return absl::FailedPreconditionError(
          "LaunchHostFunc on a stream being captured into a CUDA graph is not supported");
    }
    auto heap = std::make_unique<std::function<void()>>(std::move(fn));
    const cudaError_t error = context_->api().LaunchHostFunc(stream_, &RunHostFunc, heap.get());
    if (error == cudaSuccess) heap.release();  // RunHostFunc owns it now
    return CudaStatus(context_->api(), error, "cudaLaunchHostFunc");
  }

  absl::Status WaitHostFlag(HostFlag& flag, uint32_t value) override {
    auto* cuda_flag = dynamic_cast<CudaHostFlag*>(&flag);
    if (cuda_flag == nullptr) {
      return absl::InvalidArgumentError("WaitHostFlag: the flag was not made by a CUDA backend");
    }
    return context_->StreamWait(stream_, cuda_flag->device_word(), value);
  }

  absl::Status SignalHostFlag(HostFlag& flag, uint32_t value) override {
    auto* cuda_flag = dynamic_cast<CudaHostFlag*>(&flag);
    if (cuda_flag == nullptr) {
      return absl::InvalidArgumentError("SignalHostFlag: the flag was not made by a CUDA backend");
    }
    return context_->StreamSignal(stream_, cuda_flag->device_word(), value);
  }

  absl::Status Synchronize(absl::Duration timeout) override {
    CudaApi& api = context_->api();
    return PollUntil(
        [&]() -> absl::StatusOr<bool> {
          const cudaError_t error = api.StreamQuery(stream_);
          if (error == cudaErrorNotReady) return false;
          STEPMESH_RETURN_IF_ERROR(CudaStatus(api, error, "cudaStreamQuery"));
          return true;
        },
        timeout, "stream synchronize");
  }

  cudaStream_t handle() const { return stream_; }

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

  absl::Status Record(Stream& stream) override {
    auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
    if (cuda_stream == nullptr) {
      return absl::InvalidArgumentError("Event::Record: the stream was not made by a CUDA backend");
    }
    const cudaStream_t handle = cuda_stream->handle();
    CudaApi& api = pool_->api();
    if (pool_->mode() == ReadyEventMode::kCudaEvent) {
      STEPMESH_RETURN_IF_ERROR(
          CudaStatus(api, api.EventRecord(slot_->event, handle), "cudaEventRecord"));
    } else {
      // Copies complete in order on one stream only. Moving a pending event to
      // another stream could let the older copy land last and the event never
      // complete, so refuse instead of hanging.
      if (slot_->recorded && slot_->last_stream != handle && !CopyLanded()) {
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
      slot_->expected = index + 1;
    }
    slot_->recorded = true;
    slot_->last_stream = handle;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Query() override {
    if (!slot_->recorded) return true;
    if (pool_->mode() == ReadyEventMode::kCopyEngineFlag) return CopyLanded();
    CudaApi& api = pool_->api();
    const cudaError_t error = api.EventQuery(slot_->event);
    if (error == cudaErrorNotReady) return false;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(api, error, "cudaEventQuery"));
    return true;
  }

  absl::Status Wait(absl::Duration timeout) override {
    return PollUntil([this] { return Query(); }, timeout, "event");
  }

 private:
  bool CopyLanded() const { return LoadAcquire(slot_->host_word) == slot_->expected; }

  const std::shared_ptr<EventPool> pool_;
  EventSlot* const slot_;
};

// ---------------------------------------------------------------------------
// The backend.

class CudaBackend final : public Backend {
 public:
  CudaBackend(std::shared_ptr<DeviceContext> context, std::shared_ptr<EventPool> pool)
      : context_(std::move(context)), pool_(std::move(pool)) {}

  absl::string_view name() const override { return "cuda"; }
  Device device() const override { return Device::Cuda(context_->device()); }

  absl::StatusOr<std::unique_ptr<Memory>> Allocate(size_t bytes, MemoryKind kind) override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    // cudaMalloc(0) succeeds with a null pointer; hand out a real one instead.
    size_t request = std::max<size_t>(bytes, 1);
    if (kind == MemoryKind::kDevice) {
      // Whole host pages, so that ExportDmabuf's page-rounded range stays
      // inside this one allocation (GPUDirect registration).
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      request = (request + page - 1) / page * page;
    }
    void* data = nullptr;
    cudaError_t error = cudaSuccess;
    const char* call = "cudaMalloc";
    switch (kind) {
      case MemoryKind::kDevice:
        error = api.Malloc(&data, request);
        break;
      case MemoryKind::kHostPinned:
        call = "cudaHostAlloc(pinned)";
        error = api.HostAlloc(&data, request, cudaHostAllocPortable);
        break;
      case MemoryKind::kHostMapped:
        call = "cudaHostAlloc(mapped)";
        error = api.HostAlloc(&data, request, kMappedFlags);
        break;
    }
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api, error, absl::StrCat(call, " of ", bytes, " bytes on device ", context_->device())));
    return std::make_unique<CudaMemory>(context_->shared_api(), data, bytes, kind,
                                        context_->device());
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    cudaStream_t stream = nullptr;
    // Non-blocking: no implicit synchronisation with the legacy default stream,
    // which other libraries in the process may be using.
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api, api.StreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
    return std::make_unique<CudaStream>(context_, stream, /*owned=*/true);
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    STEPMESH_ASSIGN_OR_RETURN(EventSlot * slot, pool_->Acquire());
    return std::make_unique<CudaEvent>(pool_, slot);
  }

  absl::StatusOr<std::unique_ptr<HostFlag>> CreateHostFlag() override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    void* host = nullptr;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(api, api.HostAlloc(&host, kHostFlagBytes, kMappedFlags),
                                        "cudaHostAlloc(host flag)"));
    std::memset(host, 0, kHostFlagBytes);
    void* device = nullptr;
    const cudaError_t error = api.HostGetDevicePointer(&device, host, 0);
    if (error != cudaSuccess) {
      (void)api.FreeHost(host);
      return CudaStatus(api, error, "cudaHostGetDevicePointer(host flag)");
    }
    return std::make_unique<CudaHostFlag>(context_->shared_api(), static_cast<uint32_t*>(host),
                                          static_cast<uint32_t*>(device));
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    return CudaStatus(api, api.Memcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
  }

  absl::StatusOr<MemoryLocation> Locate(const void* ptr) override {
    STEPMESH_ASSIGN_OR_RETURN(const cudaPointerAttributes attributes, Attributes(ptr));
    if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
      return MemoryLocation{Device::Cpu(), -1, ""};
    }
    STEPMESH_ASSIGN_OR_RETURN(auto topology, context_->DeviceTopology(attributes.device));
    return MemoryLocation{Device::Cuda(attributes.device), topology.second,
                          std::move(topology.first)};
  }

  absl::StatusOr<int> ExportDmabuf(const void* ptr, size_t bytes, uint64_t* offset) override {
    if (offset == nullptr || bytes == 0) {
      return absl::InvalidArgumentError("ExportDmabuf: needs a non-empty range and an offset");
    }
    CudaApi& api = context_->api();
    if (!api.HasDmabufExport()) {
      return absl::UnimplementedError(
          "ExportDmabuf: the driver has no cuMemGetHandleForAddressRange (needs CUDA 11.7+)");
    }
    STEPMESH_ASSIGN_OR_RETURN(const cudaPointerAttributes attributes, Attributes(ptr));
    if (attributes.type != cudaMemoryTypeDevice) {
      return absl::InvalidArgumentError("ExportDmabuf: not CUDA device memory");
    }
    // The driver wants a host-page-aligned range; the NIC gets the offset of
    // `ptr` inside it (ibv_reg_dmabuf_mr's offset argument).
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
    const uintptr_t base = address & ~(page - 1);
    const uintptr_t end = (address + bytes + page - 1) & ~(page - 1);
    ScopedDevice scoped(api, attributes.device);
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    int fd = -1;
    STEPMESH_RETURN_IF_ERROR(CuResultStatus(
        api,
        api.MemGetHandleForAddressRange(&fd, static_cast<CUdeviceptr>(base), end - base,
                                        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
        "cuMemGetHandleForAddressRange(dma-buf)"));
    *offset = address - base;
    return fd;
  }

  absl::Status FlushRemoteWrites() override {
    std::call_once(remote_writes_once_, [this] { remote_writes_ = ProbeRemoteWrites(); });
    if (!remote_writes_.ok()) return remote_writes_.status();
    if (*remote_writes_ != RemoteWrites::kFlushFromHost) return absl::OkStatus();
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    return CudaStatus(api,
                      api.DeviceFlushGPUDirectRDMAWrites(
                          cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                          cudaFlushGPUDirectRDMAWritesToOwner),
                      "cudaDeviceFlushGPUDirectRDMAWrites");
  }

  const std::shared_ptr<DeviceContext>& context() const { return context_; }

 private:
  enum class RemoteWrites : uint8_t { kOrdered, kFlushFromHost, kUnflushable };

  // What this device needs before its streams may read what a NIC wrote.
  absl::StatusOr<RemoteWrites> ProbeRemoteWrites() {
    CudaApi& api = context_->api();
    const int device = context_->device();
    int ordering = 0;
    int flush_options = 0;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api, api.DeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, device),
        "cudaDeviceGetAttribute(GPUDirectRDMAWritesOrdering)"));
    if (ordering >= cudaGPUDirectRDMAWritesOrderingOwner) return RemoteWrites::kOrdered;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api,
        api.DeviceGetAttribute(&flush_options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device),
        "cudaDeviceGetAttribute(GPUDirectRDMAFlushWritesOptions)"));
    if (flush_options & cudaFlushGPUDirectRDMAWritesOptionHost) return RemoteWrites::kFlushFromHost;
    STEPMESH_LOG(kWarning, "cuda:", device,
                 " neither orders GPUDirect RDMA writes nor can flush them from the host; "
                 "wait on arrivals with StreamWaitHostFlag and flush_remote_writes");
    return RemoteWrites::kUnflushable;
  }

  absl::StatusOr<cudaPointerAttributes> Attributes(const void* ptr) {
    CudaApi& api = context_->api();
    cudaPointerAttributes attributes{};
    const cudaError_t error = api.PointerGetAttributes(&attributes, ptr);
    if (error == cudaErrorInvalidValue) {
      // Plain host memory the driver never saw (older drivers say so this way).
      attributes.type = cudaMemoryTypeUnregistered;
      return attributes;
    }
    STEPMESH_RETURN_IF_ERROR(CudaStatus(api, error, "cudaPointerGetAttributes"));
    return attributes;
  }

  const std::shared_ptr<DeviceContext> context_;
  const std::shared_ptr<EventPool> pool_;
  std::once_flag remote_writes_once_;
  absl::StatusOr<RemoteWrites> remote_writes_ = absl::UnknownError("not probed");
};

}  // namespace
}  // namespace cuda

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<cuda::CudaApi> api,
                                                           int device,
                                                           const CudaBackendOptions& options) {
  if (api == nullptr) return absl::InvalidArgumentError("CreateCudaBackend: no CudaApi");
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device index ", device, " is negative"));
  }
  if (options.initial_events < 0) {
    return absl::InvalidArgumentError("CudaBackendOptions::initial_events is negative");
  }
  int count = 0;
  const cudaError_t error = api->GetDeviceCount(&count);
  if (error != cudaSuccess) {
    return cuda::CudaStatus(*api, error,
                            "cuda backend: cudaGetDeviceCount failed (no NVIDIA driver or GPU?)");
  }
  if (count == 0) return absl::UnavailableError("cuda backend: no CUDA device is visible");
  if (device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda backend: device ", device, " does not exist (", count, " visible)"));
  }
  auto context = std::make_shared<cuda::DeviceContext>(std::move(api), device, options);
  STEPMESH_ASSIGN_OR_RETURN(auto pool, cuda::EventPool::Create(context, options.initial_events));
  return std::unique_ptr<Backend>(new cuda::CudaBackend(std::move(context), std::move(pool)));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
  return CreateCudaBackend(cuda::CreateRuntimeCudaApi(), device, options);
}

absl::StatusOr<void*> NativeCudaStream(Stream& stream) {
  auto* cuda_stream = dynamic_cast<cuda::CudaStream*>(&stream);
  if (cuda_stream == nullptr) {
    return absl::InvalidArgumentError("NativeCudaStream: not a CUDA backend stream");
  }
  return static_cast<void*>(cuda_stream->handle());
}

absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(Backend& backend, void* cuda_stream) {
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) {
    return absl::InvalidArgumentError("WrapCudaStream: not a CUDA backend");
  }
  return std::unique_ptr<Stream>(new cuda::CudaStream(
      cuda_backend->context(), static_cast<cudaStream_t>(cuda_stream), /*owned=*/false));
}

}  // namespace stepmesh
