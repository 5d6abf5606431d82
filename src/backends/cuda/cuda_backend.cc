// The CUDA backend. Everything goes through CudaApi (cuda_api.h), so this file
// is exercised in CI against a fake, and on GPU machines against the runtime.
//
// Ownership: every object handed out (Memory, Stream, Event, HostFlag) holds a
// shared_ptr to what it needs (the device context, the event pool), so
// destruction order between them and the Backend does not matter.
//
// Rules this file keeps, each because breaking it hangs or corrupts a real
// process (docs/cuda.md, "What the backend never does"):
//  * No legacy default stream: its implicit synchronisation with every
//    blocking stream (PyTorch's default stream is one) would queue the
//    backend's copies behind an application's wait for the very reply those
//    copies produce. Copies go on the backend's own non-blocking streams.
//  * No device switch on a thread that has no current context: "restoring"
//    device 0 afterwards would create device 0's primary context.
//  * Nothing that waits for the whole device (allocation, kernel loading)
//    after creation, except in destructors, and a HostFlag releases the
//    stream waits on it before it goes.
//  * The backend's calls run in relaxed stream-capture mode, as NCCL's proxy
//    thread does, so they never break an application thread's graph capture.

#include "src/backends/cuda/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "src/backends/cuda/cuda_api.h"
#include "src/backends/cuda/cuda_status.h"
#include "src/base/logging.h"
#include "src/base/thread_util.h"
#include "stepmesh/options.h"
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
constexpr size_t kHostFlagBytes = 64;
// Pinned + mapped host memory, valid in every context (Portable) so a flag can
// be shared by backends on different devices.
constexpr unsigned int kMappedFlags = cudaHostAllocMapped | cudaHostAllocPortable;
// Spins before a waiting loop starts yielding its core.
constexpr int kSpinsBeforeYield = 1 << 12;
// The backend's own copy streams: one each for the send thread, the receive
// thread and an application thread, so their synchronous copies never queue
// behind one another.
constexpr size_t kCopyLanes = 3;
// CUDA's hardware queues per device when CUDA_DEVICE_MAX_CONNECTIONS is unset.
constexpr int kDefaultConnections = 8;
// A pending copy-engine event looks at the clock once every this many polls.
constexpr uint32_t kPollsPerClockRead = 64;

uint32_t LoadAcquire(const uint32_t* word) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_acquire);
}

// flag >= value, wrap-safe (CU_STREAM_WAIT_VALUE_GEQ).
bool Reached(uint32_t flag, uint32_t value) { return static_cast<int32_t>(flag - value) >= 0; }

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

// The calling thread in relaxed stream-capture mode for one scope (push/pop,
// as cudaThreadExchangeStreamCaptureMode's documentation suggests). A
// synchronous copy or a query in the default (global) mode, made while any
// application thread captures a graph in global mode (PyTorch's default), is
// refused and invalidates that capture.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(CudaApi& api) : api_(api) {
    ok_ = api_.ThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess;
  }
  ~RelaxedCapture() {
    if (ok_) (void)api_.ThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  CudaApi& api_;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

// Whether the calling thread has a current context. Unknown (the driver entry
// point is missing) counts as yes: then nothing is ever switched for it.
bool HasCurrentContext(CudaApi& api, CUcontext* current) {
  *current = nullptr;
  const CUresult result = api.CtxGetCurrent(current);
  return result != CUDA_SUCCESS || *current != nullptr;
}

absl::Status SetDevice(CudaApi& api, int device) {
  return CudaStatus(api, api.SetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

// Gives a thread with no current context the backend's device, once: CUDA
// runtime calls on such a thread would otherwise create device 0's primary
// context (about 0.5 GB on GPU 0 per process, and an error where GPU 0 is in
// exclusive-process mode). A thread that has a context keeps it.
absl::Status BindThread(CudaApi& api, int device) {
  CUcontext current = nullptr;
  if (HasCurrentContext(api, &current)) return absl::OkStatus();
  return SetDevice(api, device);
}

// The backend's device current for one scope, for the calls that act on the
// current device (allocation, stream and event creation, kernel launches).
//  * A thread with no context is bound to the device for good (BindThread):
//    there is nothing to restore, and "restoring" device 0 would create its
//    context.
//  * A thread on another context is switched and switched back, to the very
//    context it had (cuCtxSetCurrent), so applications keep their own.
class ScopedDevice {
 public:
  ScopedDevice(CudaApi& api, int device) : api_(api) {
    CUcontext saved = nullptr;
    const bool known = api.CtxGetCurrent(&saved) == CUDA_SUCCESS;
    if (known && saved == nullptr) {
      status_ = SetDevice(api, device);
      return;
    }
    int current = -1;
    if (api.GetDevice(&current) == cudaSuccess && current == device) return;
    status_ = SetDevice(api, device);
    if (!status_.ok()) return;
    if (known) {
      restore_context_ = true;
      saved_ = saved;
    } else {
      previous_device_ = current;
    }
  }
  ~ScopedDevice() {
    if (restore_context_) {
      (void)api_.CtxSetCurrent(saved_);
    } else if (previous_device_ >= 0) {
      (void)api_.SetDevice(previous_device_);
    }
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  CudaApi& api_;
  bool restore_context_ = false;
  CUcontext saved_ = nullptr;
  int previous_device_ = -1;
  absl::Status status_;
};

// A status for a device fault found while waiting: always INTERNAL (the
// context is unusable), with the CUDA error's name and payload.
absl::Status FaultStatus(CudaApi& api, cudaError_t error, absl::string_view what) {
  absl::Status status = CudaStatus(api, error, what);
  if (status.code() == absl::StatusCode::kInternal) return status;
  absl::Status internal = absl::InternalError(status.message());
  internal.SetPayload(kCudaErrorPayload, absl::Cord(absl::StrCat(static_cast<int>(error))));
  return internal;
}

class CudaHostFlag;

// State shared by the backend and everything it hands out.
class DeviceContext {
 public:
  static absl::StatusOr<std::shared_ptr<DeviceContext>> Create(std::shared_ptr<CudaApi> api,
                                                               int device,
                                                               const CudaBackendOptions& options) {
    auto context =
        std::shared_ptr<DeviceContext>(new DeviceContext(std::move(api), device, options));
    CudaApi& a = *context->api_;
    ScopedDevice scoped(a, device);
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    int least = 0, greatest = 0;
    STEPMESH_RETURN_IF_ERROR(CudaStatus(a, a.DeviceGetStreamPriorityRange(&least, &greatest),
                                        "cudaDeviceGetStreamPriorityRange"));
    context->greatest_priority_ = greatest;
    // Loaded now, while nothing of ours waits on the device: a lazy load at
    // the first wait or signal would wait for the whole device (see
    // CudaApi::LoadFlagKernels).
    STEPMESH_RETURN_IF_ERROR(
        CudaStatus(a, a.LoadFlagKernels(), "loading the flag kernels (cudaFuncGetAttributes)"));
    for (CopyLane& lane : context->lanes_) {
      STEPMESH_RETURN_IF_ERROR(
          CudaStatus(a, a.StreamCreateWithPriority(&lane.stream, cudaStreamNonBlocking, greatest),
                     "cudaStreamCreateWithPriority(copy stream)"));
    }
    return context;
  }

  ~DeviceContext() {
    // Frees handed to the reaper complete first: every flag (each holds this
    // context) is gone, so its waits were released and the device can idle.
    {
      std::lock_guard<std::mutex> lock(reaper_mu_);
      reaper_stop_ = true;
    }
    reaper_cv_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    ScopedDevice scoped(*api_, device_);
    for (CopyLane& lane : lanes_) {
      if (lane.stream != nullptr) (void)api_->StreamDestroy(lane.stream);
    }
  }

  CudaApi& api() const { return *api_; }
  int device() const { return device_; }
  const CudaBackendOptions& options() const { return options_; }
  int stream_priority() const { return options_.high_priority_streams ? greatest_priority_ : 0; }
  // Streams handed out (CreateStream, WrapCudaStream), besides the copy lanes.
  void NoteStream(int delta) { streams_.fetch_add(delta, std::memory_order_relaxed); }

  // The live host flags, so that a free can tell whether a stream may be
  // waiting on an arrival (below).
  void AddFlag(CudaHostFlag* flag) {
    std::lock_guard<std::mutex> lock(flags_mu_);
    flags_.push_back(flag);
  }
  void RemoveFlag(CudaHostFlag* flag) {
    std::lock_guard<std::mutex> lock(flags_mu_);
    flags_.erase(std::remove(flags_.begin(), flags_.end(), flag), flags_.end());
  }
  bool AnyWaitPending();  // after CudaHostFlag

  // cudaFree / cudaFreeHost of `ptr`. Both wait for the whole device: while a
  // stream waits on a flag that the freeing thread (the receive thread
  // unregistering a tensor, an application thread) is to raise, that wait
  // never ends. So while any flag of this context has a wait pending, the
  // free goes to a reaper thread, which the device may hold up instead; the
  // memory is gone for the caller either way.
  void Release(void* ptr, bool device) {
    if (ptr == nullptr) return;
    if (AnyWaitPending()) {
      std::lock_guard<std::mutex> lock(reaper_mu_);
      if (!reaper_.joinable()) {
        reaper_ =
            base::StartNamedThread(absl::StrCat("sm-cuda-free-", device_), {}, [this] { Reap(); });
      }
      reaper_queue_.emplace_back(ptr, device);
      reaper_cv_.notify_one();
      return;
    }
    FreeNow(ptr, device);
  }

  // A synchronous copy on one of the backend's own streams: non-blocking (no
  // implicit wait for the legacy default stream or the application's blocking
  // streams) and of the highest priority. cudaMemcpyAsync + stream sync rather
  // than cudaMemcpy: the latter returns before the data is in place for
  // device-to-device and pageable host-to-device copies.
  absl::Status Copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    RelaxedCapture relaxed(*api_);
    STEPMESH_RETURN_IF_ERROR(BindThread(*api_, device_));
    CopyLane& lane = AcquireLane();
    absl::Status status =
        CudaStatus(*api_, api_->MemcpyAsync(dst, src, bytes, cudaMemcpyDefault, lane.stream),
                   absl::StrCat("cudaMemcpyAsync of ", bytes, " bytes"));
    if (status.ok()) {
      status = CudaStatus(*api_, api_->StreamSynchronize(lane.stream),
                          "cudaStreamSynchronize(copy stream)");
    }
    lane.busy.store(false, std::memory_order_release);
    return status;
  }

  // OK unless the device faulted. A device fault is sticky for the whole
  // context, so any of its streams reports it; the backend's own copy stream
  // is the one that is certainly alive and never captured by the application
  // (querying a capturing stream would break that capture).
  absl::Status CheckForFault(absl::string_view what) {
    RelaxedCapture relaxed(*api_);
    STEPMESH_RETURN_IF_ERROR(BindThread(*api_, device_));
    const cudaError_t error = api_->StreamQuery(lanes_[0].stream);
    if (error == cudaSuccess || error == cudaErrorNotReady) return absl::OkStatus();
    return FaultStatus(*api_, error, what);
  }

  absl::StatusOr<bool> IsCapturing(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    STEPMESH_RETURN_IF_ERROR(
        CudaStatus(*api_, api_->StreamIsCapturing(stream, &capture), "cudaStreamIsCapturing"));
    return capture != cudaStreamCaptureStatusNone;
  }

  // Arrival -> GPU: later work on `stream` waits for the flag.
  absl::Status StreamWait(cudaStream_t stream, CudaHostFlag& flag, uint32_t value);
  // Arrival -> GPU, graph-replayable: waits for the counter's next increment.
  absl::Status StreamWaitNext(cudaStream_t stream, CudaHostFlag& counter, CudaHostFlag& cursor);
  // GPU -> host: the stream writes the flag when it gets there.
  absl::Status StreamSignal(cudaStream_t stream, CudaHostFlag& flag, uint32_t value);

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
  struct CopyLane {
    cudaStream_t stream = nullptr;
    std::atomic<bool> busy{false};
  };

  DeviceContext(std::shared_ptr<CudaApi> api, int device, const CudaBackendOptions& options)
      : api_(std::move(api)), device_(device), options_(options) {}

  void FreeNow(void* ptr, bool device) {
    ScopedDevice scoped(*api_, device_);
    const cudaError_t error = device ? api_->Free(ptr) : api_->FreeHost(ptr);
    if (error != cudaSuccess) {
      STEPMESH_LOG(kWarning,
                   CudaStatus(*api_, error, device ? "cudaFree" : "cudaFreeHost").ToString());
    }
  }
  void Reap() {
    std::unique_lock<std::mutex> lock(reaper_mu_);
    for (;;) {
      reaper_cv_.wait(lock, [this] { return reaper_stop_ || !reaper_queue_.empty(); });
      if (reaper_queue_.empty()) return;  // stopping, nothing left
      const auto [ptr, device] = reaper_queue_.front();
      reaper_queue_.erase(reaper_queue_.begin());
      lock.unlock();
      FreeNow(ptr, device);
      lock.lock();
    }
  }

  CopyLane& AcquireLane() {
    for (int spins = 0;; ++spins) {
      for (CopyLane& lane : lanes_) {
        if (!lane.busy.load(std::memory_order_relaxed) &&
            !lane.busy.exchange(true, std::memory_order_acquire)) {
          return lane;
        }
      }
      if (spins < kSpinsBeforeYield) {
        base::CpuRelax();
      } else {
        std::this_thread::yield();
      }
    }
  }

  // Whether a wait or signal uses the stream memory operations (else the
  // flag kernels).
  absl::StatusOr<bool> UseStreamMemOps(bool capturing) {
    switch (options_.stream_wait_mode) {
      case StreamWaitMode::kKernel:
        return false;
      case StreamWaitMode::kStreamMemOp:
        if (!api_->HasStreamMemOps()) {
          return absl::UnimplementedError(
              "StreamWaitMode::kStreamMemOp: the driver exposes no cuStreamWaitValue32/"
              "cuStreamWriteValue32; use kAuto or kKernel");
        }
        if (capturing) {
          return absl::FailedPreconditionError(
              "StreamWaitMode::kStreamMemOp: the stream is being captured into a CUDA graph, "
              "which takes the flag kernels only; use kAuto or kKernel");
        }
        return true;
      case StreamWaitMode::kAuto:
        break;
    }
    // A stream memory operation is not something every driver can capture
    // into a graph; the kernel always is. A memop wait at the head of a
    // hardware queue holds up every stream mapped to that queue: with more
    // streams than queues (CUDA_DEVICE_MAX_CONNECTIONS, default 8; CUDA maps
    // streams to queues round robin) a waiting stream may share one with a
    // copy lane the receive thread needs before it raises the flag: a
    // deadlock. A wait kernel occupies an SM slot but never the queue.
    if (capturing || memops_unsupported_.load(std::memory_order_relaxed) ||
        !api_->HasStreamMemOps()) {
      return false;
    }
    const int queues =
        options_.device_max_connections > 0 ? options_.device_max_connections : kDefaultConnections;
    const int streams = static_cast<int>(kCopyLanes) + streams_.load(std::memory_order_relaxed);
    if (streams <= queues) return true;
    if (!shared_queues_noted_.exchange(true)) {
      STEPMESH_LOG(kInfo, "cuda: ", streams, " streams on device ", device_, " share ", queues,
                   " hardware queues (CUDA_DEVICE_MAX_CONNECTIONS); GPU waits on host flags use "
                   "the wait kernel, which cannot block a queue");
    }
    return false;
  }

  // In kAuto mode a driver that resolves the entry point but refuses the call
  // (stream memory operations disabled) moves us to the kernels for good,
  // unless remote writes must be flushed, which only the memop can do.
  bool FallBackFromMemOps(CUresult result) {
    if (options_.stream_wait_mode != StreamWaitMode::kAuto || result != CUDA_ERROR_NOT_SUPPORTED ||
        options_.flush_remote_writes) {
      return false;
    }
    if (!memops_unsupported_.exchange(true)) {
      STEPMESH_LOG(kWarning, "cuda: stream memory operations not supported on device ", device_,
                   "; GPU waits on host flags use the wait kernel from now on");
    }
    return true;
  }

  absl::Status LaunchFlagKernel(cudaStream_t stream, uint32_t* device_word, uint32_t value,
                                bool wait) {
    ScopedDevice scoped(*api_, device_);  // kernel launches need the stream's device current
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    if (wait) {
      return CudaStatus(*api_, api_->LaunchWaitFlagKernel(stream, device_word, value),
                        "launching the flag-wait kernel");
    }
    return CudaStatus(*api_, api_->LaunchSignalFlagKernel(stream, device_word, value),
                      "launching the flag-signal kernel");
  }

  const std::shared_ptr<CudaApi> api_;
  const int device_;
  const CudaBackendOptions options_;
  int greatest_priority_ = 0;
  std::array<CopyLane, kCopyLanes> lanes_;
  std::atomic<int> streams_{0};
  std::atomic<bool> shared_queues_noted_{false};
  std::atomic<bool> memops_unsupported_{false};
  std::mutex topology_mu_;
  absl::flat_hash_map<int, std::pair<std::string, int>> topology_;
  std::mutex flags_mu_;
  std::vector<CudaHostFlag*> flags_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  std::vector<std::pair<void*, bool>> reaper_queue_;  // (pointer, device memory)
  bool reaper_stop_ = false;
  std::thread reaper_;
};

// ---------------------------------------------------------------------------
// Memory and host flags.

class CudaMemory final : public Memory {
 public:
  CudaMemory(std::shared_ptr<DeviceContext> context, void* data, size_t bytes, MemoryKind kind)
      : context_(std::move(context)), data_(data), bytes_(bytes), kind_(kind) {}
  ~CudaMemory() override { context_->Release(data_, kind_ == MemoryKind::kDevice); }
  void* data() const override { return data_; }
  size_t bytes() const override { return bytes_; }
  Device device() const override {
    return kind_ == MemoryKind::kDevice ? Device::Cuda(context_->device()) : Device::Cpu();
  }

 private:
  const std::shared_ptr<DeviceContext> context_;
  void* const data_;
  const size_t bytes_;
  const MemoryKind kind_;
};

// A 32-bit word of mapped pinned memory: the host stores/loads it directly,
// streams reach it through its device alias. It remembers the highest value
// any stream was told to wait for, so that it can release those waits (a
// stream waiting on freed memory waits forever, and so does everything that
// synchronises with it, cudaFree included).
class CudaHostFlag final : public HostFlag {
 public:
  CudaHostFlag(std::shared_ptr<DeviceContext> context, uint32_t* host, uint32_t* device)
      : context_(std::move(context)), host_(host), device_(device) {
    context_->AddFlag(this);
  }
  ~CudaHostFlag() override {
    ReleaseWaiters();
    context_->RemoveFlag(this);
    context_->Release(host_, /*device=*/false);  // other flags' waits may still be pending
  }
  // A stream may be waiting on this flag: a plain wait not yet reached, or
  // next-waits, whose targets live on the device (assumed pending).
  bool MayHaveWaiter() const {
    const uint64_t waited = waited_.load(std::memory_order_acquire);
    return ((waited & kHasWait) != 0 && !Reached(Load(), static_cast<uint32_t>(waited))) ||
           next_waits_.load(std::memory_order_acquire);
  }
  void Store(uint32_t value) override {
    std::atomic_ref<uint32_t>(*host_).store(value, std::memory_order_release);
  }
  uint32_t Load() const override { return LoadAcquire(host_); }

  // Moves the flag to the highest value waited for, if it is not there yet;
  // next-waits (WaitHostFlagNext) target the cursor plus one when they run,
  // which is within 2^30 of this counter.
  void ReleaseWaiters() override {
    const uint64_t waited = waited_.load(std::memory_order_acquire);
    if ((waited & kHasWait) != 0 && !Reached(Load(), static_cast<uint32_t>(waited))) {
      Store(static_cast<uint32_t>(waited));
    }
    if (next_waits_.load(std::memory_order_acquire)) Store(Load() + (1u << 30));
  }
  void NoteNextWait() { next_waits_.store(true, std::memory_order_release); }
  // Called before a wait for `value` is enqueued.
  void NoteWait(uint32_t value) {
    uint64_t seen = waited_.load(std::memory_order_relaxed);
    for (;;) {
      if ((seen & kHasWait) != 0 && Reached(static_cast<uint32_t>(seen), value)) return;
      if (waited_.compare_exchange_weak(seen, kHasWait | value, std::memory_order_acq_rel)) return;
    }
  }
  uint32_t* device_word() const { return device_; }

 private:
  static constexpr uint64_t kHasWait = uint64_t{1} << 32;

  const std::shared_ptr<DeviceContext> context_;
  uint32_t* const host_;
  uint32_t* const device_;
  std::atomic<uint64_t> waited_{0};
  std::atomic<bool> next_waits_{false};
};

bool DeviceContext::AnyWaitPending() {
  std::lock_guard<std::mutex> lock(flags_mu_);
  return std::any_of(flags_.begin(), flags_.end(),
                     [](const CudaHostFlag* flag) { return flag->MayHaveWaiter(); });
}

absl::Status DeviceContext::StreamWait(cudaStream_t stream, CudaHostFlag& flag, uint32_t value) {
  STEPMESH_RETURN_IF_ERROR(BindThread(*api_, device_));
  STEPMESH_ASSIGN_OR_RETURN(const bool capturing, IsCapturing(stream));
  STEPMESH_ASSIGN_OR_RETURN(const bool memop, UseStreamMemOps(capturing));
  if (options_.flush_remote_writes && !memop) {
    return absl::FailedPreconditionError(absl::StrCat(
        "WaitHostFlag: flush_remote_writes needs cuStreamWaitValue32's flush, but this wait "
        "would use the wait kernel (",
        capturing ? "the stream is being captured into a CUDA graph" : "stream memory operations",
        " unavailable), which cannot flush remote writes"));
  }
  flag.NoteWait(value);
  if (memop) {
    unsigned int flags = CU_STREAM_WAIT_VALUE_GEQ;
    if (options_.flush_remote_writes) flags |= CU_STREAM_WAIT_VALUE_FLUSH;
    const CUresult result =
        api_->StreamWaitValue32(reinterpret_cast<CUstream>(stream),
                                reinterpret_cast<CUdeviceptr>(flag.device_word()), value, flags);
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    if (!FallBackFromMemOps(result)) return CuResultStatus(*api_, result, "cuStreamWaitValue32");
  }
  return LaunchFlagKernel(stream, flag.device_word(), value, /*wait=*/true);
}

absl::Status DeviceContext::StreamWaitNext(cudaStream_t stream, CudaHostFlag& counter,
                                           CudaHostFlag& cursor) {
  if (options_.flush_remote_writes) {
    return absl::FailedPreconditionError(
        "WaitHostFlagNext: flush_remote_writes needs cuStreamWaitValue32's flush, and this wait "
        "is always the kernel");
  }
  if (options_.stream_wait_mode == StreamWaitMode::kStreamMemOp) {
    return absl::FailedPreconditionError(
        "WaitHostFlagNext is a kernel; StreamWaitMode::kStreamMemOp allows only memory-op waits");
  }
  counter.NoteNextWait();
  ScopedDevice scoped(*api_, device_);
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  return CudaStatus(
      *api_, api_->LaunchWaitNextFlagKernel(stream, counter.device_word(), cursor.device_word()),
      "launching the flag-wait-next kernel");
}

absl::Status DeviceContext::StreamSignal(cudaStream_t stream, CudaHostFlag& flag, uint32_t value) {
  STEPMESH_RETURN_IF_ERROR(BindThread(*api_, device_));
  STEPMESH_ASSIGN_OR_RETURN(const bool capturing, IsCapturing(stream));
  STEPMESH_ASSIGN_OR_RETURN(const bool memop, UseStreamMemOps(capturing));
  if (memop) {
    // The default flag orders the write after all earlier work (a system
    // fence), which is what makes the flag mean "data before it is there".
    const CUresult result = api_->StreamWriteValue32(
        reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(flag.device_word()),
        value, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (result == CUDA_SUCCESS) return absl::OkStatus();
    if (!FallBackFromMemOps(result)) return CuResultStatus(*api_, result, "cuStreamWriteValue32");
  }
  return LaunchFlagKernel(stream, flag.device_word(), value, /*wait=*/false);
}

// ---------------------------------------------------------------------------
// Event pool.

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
      STEPMESH_RETURN_IF_ERROR(CudaStatus(api, api.Malloc(&ramp, kRampSize * sizeof(uint32_t)),
                                          "cudaMalloc(event ramp)"));
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

  ~EventPool() {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    for (auto& slot : slots_) {
      if (slot->event != nullptr) (void)api.EventDestroy(slot->event);
    }
    if (words_ != nullptr) (void)api.FreeHost(words_);
    if (ramp_ != nullptr) (void)api.Free(ramp_);
  }

  absl::StatusOr<EventSlot*> Acquire() {
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

  // A slot whose flag copy is still in flight stays out of the pool until it
  // landed: its next owner must not see that copy land.
  void Release(EventSlot* slot) {
    std::lock_guard<std::mutex> lock(mu_);
    if (mode() == ReadyEventMode::kCopyEngineFlag && !slot->CopyLanded()) {
      draining_.push_back(slot);
      return;
    }
    Reset(*slot);
    free_.push_back(slot);
  }

  ReadyEventMode mode() const { return context_->options().ready_event_mode; }
  DeviceContext& context() const { return *context_; }
  const uint32_t* ramp() const { return ramp_; }

 private:
  explicit EventPool(std::shared_ptr<DeviceContext> context) : context_(std::move(context)) {}

  static void Reset(EventSlot& slot) {
    slot.expected.store(0, std::memory_order_relaxed);
    slot.recorded.store(false, std::memory_order_relaxed);
    slot.last_stream = nullptr;
  }

  const std::shared_ptr<DeviceContext> context_;
  uint32_t* ramp_ = nullptr;
  void* words_ = nullptr;
  std::mutex mu_;
  std::vector<std::unique_ptr<EventSlot>> slots_;
  std::vector<EventSlot*> free_;
  std::vector<EventSlot*> draining_;
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
      : context_(std::move(context)), stream_(stream), owned_(owned) {
    context_->NoteStream(+1);
  }
  ~CudaStream() override {
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

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes) override {
    CudaApi& api = context_->api();
    STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
    // cudaMemcpyDefault: unified addressing tells the direction from the pointers.
    return CudaStatus(api, api.MemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                      "cudaMemcpyAsync");
  }

  absl::Status LaunchHostFunc(std::function<void()> fn) override {
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

  absl::Status WaitHostFlag(HostFlag& flag, uint32_t value) override {
    auto* cuda_flag = dynamic_cast<CudaHostFlag*>(&flag);
    if (cuda_flag == nullptr) {
      return absl::InvalidArgumentError("WaitHostFlag: the flag was not made by a CUDA backend");
    }
    return context_->StreamWait(stream_, *cuda_flag, value);
  }

  absl::Status WaitHostFlagNext(HostFlag& counter, HostFlag& cursor) override {
    auto* cuda_counter = dynamic_cast<CudaHostFlag*>(&counter);
    auto* cuda_cursor = dynamic_cast<CudaHostFlag*>(&cursor);
    if (cuda_counter == nullptr || cuda_cursor == nullptr) {
      return absl::InvalidArgumentError(
          "WaitHostFlagNext: the flags were not made by a CUDA backend");
    }
    return context_->StreamWaitNext(stream_, *cuda_counter, *cuda_cursor);
  }

  absl::Status WaitCounterAtLeast(const int64_t* counter, const int64_t* target) override {
    if (counter == nullptr || target == nullptr) {
      return absl::InvalidArgumentError("WaitCounterAtLeast: a null counter or target");
    }
    CudaApi& api = context_->api();
    STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
    STEPMESH_ASSIGN_OR_RETURN(const int64_t* device_counter, DeviceWord(api, counter, "counter"));
    STEPMESH_ASSIGN_OR_RETURN(const int64_t* device_target, DeviceWord(api, target, "target"));
    return CudaStatus(api, api.LaunchWaitCounterKernel(stream_, device_counter, device_target),
                      "launching the counter-wait kernel");
  }

  absl::Status IncrementCounter(int64_t* counter) override {
    if (counter == nullptr) return absl::InvalidArgumentError("IncrementCounter: a null counter");
    CudaApi& api = context_->api();
    STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
    STEPMESH_ASSIGN_OR_RETURN(const int64_t* device_counter,
                              DeviceWord(api, counter, "counter", "IncrementCounter"));
    return CudaStatus(
        api, api.LaunchIncrementCounterKernel(stream_, const_cast<int64_t*>(device_counter)),
        "launching the counter-increment kernel");
  }

  // The address a kernel reads `word` at: itself in device memory, the
  // mapping of pinned host memory, an error for pageable memory.
  static absl::StatusOr<const int64_t*> DeviceWord(CudaApi& api, const int64_t* word,
                                                   absl::string_view name,
                                                   absl::string_view call = "WaitCounterAtLeast") {
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

  absl::Status SignalHostFlag(HostFlag& flag, uint32_t value) override {
    auto* cuda_flag = dynamic_cast<CudaHostFlag*>(&flag);
    if (cuda_flag == nullptr) {
      return absl::InvalidArgumentError("SignalHostFlag: the flag was not made by a CUDA backend");
    }
    return context_->StreamSignal(stream_, *cuda_flag, value);
  }

  absl::Status Synchronize(absl::Duration timeout) override {
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

  absl::Status Record(Stream& stream) override {
    auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
    if (cuda_stream == nullptr) {
      return absl::InvalidArgumentError("Event::Record: the stream was not made by a CUDA backend");
    }
    return RecordOn(cuda_stream->handle());
  }

  absl::Status RecordOn(cudaStream_t handle) {
    DeviceContext& context = pool_->context();
    CudaApi& api = context.api();
    STEPMESH_RETURN_IF_ERROR(BindThread(api, context.device()));
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

  absl::StatusOr<bool> Query() override {
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

  absl::Status Wait(absl::Duration timeout) override {
    return PollUntil([this] { return Query(); }, timeout, "event");
  }

 private:
  // A faulted device never runs the flag copy, and a host load cannot tell.
  // Once the event is pending for fault_check_interval (looking at the clock
  // only every kPollsPerClockRead polls), ask the device, at most once per
  // interval.
  absl::StatusOr<bool> CheckForFault() {
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
      // Whole host pages, so that ExportDmabuf's page-rounded range can stay
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
    return std::make_unique<CudaMemory>(context_, data, bytes, kind);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    CudaApi& api = context_->api();
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    cudaStream_t stream = nullptr;
    // Non-blocking: no implicit synchronisation with the legacy default stream,
    // which other libraries in the process may be using.
    STEPMESH_RETURN_IF_ERROR(CudaStatus(
        api,
        api.StreamCreateWithPriority(&stream, cudaStreamNonBlocking, context_->stream_priority()),
        "cudaStreamCreateWithPriority"));
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
    return std::make_unique<CudaHostFlag>(context_, static_cast<uint32_t*>(host),
                                          static_cast<uint32_t*>(device));
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    return context_->Copy(dst, src, bytes);
  }

  absl::StatusOr<MemoryLocation> Locate(const void* ptr) override {
    if (ptr == nullptr) {  // the backend's own device
      const int device = context_->device();
      STEPMESH_ASSIGN_OR_RETURN(auto topology, context_->DeviceTopology(device));
      return MemoryLocation{Device::Cuda(device), topology.second, std::move(topology.first)};
    }
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
    ScopedDevice scoped(api, attributes.device);
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
    // The driver exports whole host pages, whichever allocations they hold;
    // the NIC may then reach all of them through the fd. So the pages must
    // lie inside the one allocation that holds the tensor: a sub-allocation
    // (a caching allocator's block, a small cudaMalloc) that shares a page
    // with its neighbours is refused, and the caller registers it otherwise.
    CUdeviceptr allocation = 0;
    size_t allocation_bytes = 0;
    STEPMESH_RETURN_IF_ERROR(CuResultStatus(
        api,
        api.MemGetAddressRange(&allocation, &allocation_bytes, static_cast<CUdeviceptr>(address)),
        "ExportDmabuf: cuMemGetAddressRange"));
    const uintptr_t alloc_begin = static_cast<uintptr_t>(allocation);
    const uintptr_t alloc_end = alloc_begin + allocation_bytes;
    if (address + bytes > alloc_end) {
      return absl::InvalidArgumentError(
          absl::StrCat("ExportDmabuf: ", bytes, " bytes at 0x", absl::Hex(address),
                       " run past the end of their CUDA allocation [0x", absl::Hex(alloc_begin),
                       ", 0x", absl::Hex(alloc_end), ")"));
    }
    // The driver wants a host-page-aligned range; the NIC gets the offset of
    // `ptr` inside it (ibv_reg_dmabuf_mr's offset argument).
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t base = address & ~(page - 1);
    const uintptr_t end = (address + bytes + page - 1) & ~(page - 1);
    if (base < alloc_begin || end > alloc_end) {
      return absl::FailedPreconditionError(
          absl::StrCat("ExportDmabuf: the page-aligned range [0x", absl::Hex(base), ", 0x",
                       absl::Hex(end), ") a dma-buf needs reaches outside the CUDA allocation [0x",
                       absl::Hex(alloc_begin), ", 0x", absl::Hex(alloc_end),
                       ") that holds the tensor, into memory a NIC must not reach"));
    }
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
    switch (*remote_writes_) {
      case RemoteWrites::kOrdered:
        return absl::OkStatus();
      case RemoteWrites::kUnflushable:
        // Never a silent weaker path: the core would report an arrival whose
        // bytes the device may not see yet.
        return absl::FailedPreconditionError(absl::StrCat(
            "cuda:", context_->device(),
            " neither orders GPUDirect RDMA writes (cudaDevAttrGPUDirectRDMAWritesOrdering) nor "
            "can flush them from the host (cudaDevAttrGPUDirectRDMAFlushWritesOptions), so data "
            "a NIC writes into its memory may be read stale; stage device tensors through host "
            "memory instead (STEPMESH_RDMA_GPUDIRECT=off)"));
      case RemoteWrites::kFlushFromHost:
        break;
    }
    CudaApi& api = context_->api();
    RelaxedCapture relaxed(api);
    ScopedDevice scoped(api, context_->device());
    STEPMESH_RETURN_IF_ERROR(scoped.status());
    return CudaStatus(
        api,
        api.DeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
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
    return RemoteWrites::kUnflushable;
  }

  absl::StatusOr<cudaPointerAttributes> Attributes(const void* ptr) {
    CudaApi& api = context_->api();
    STEPMESH_RETURN_IF_ERROR(BindThread(api, context_->device()));
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

// Options the device cannot honour fail creation rather than weaken later.
absl::Status CheckOptions(CudaApi& api, int device, const CudaBackendOptions& options) {
  if (options.event_pool_size < 0) {
    return absl::InvalidArgumentError("CudaBackendOptions::event_pool_size is negative");
  }
  if (options.fault_check_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("CudaBackendOptions::fault_check_interval must be positive");
  }
  if (options.stream_wait_mode == StreamWaitMode::kStreamMemOp &&
      options.device_max_connections == 1) {
    return absl::FailedPreconditionError(
        "StreamWaitMode::kStreamMemOp with CUDA_DEVICE_MAX_CONNECTIONS=1: a stream memory-op "
        "wait would block the device's only hardware queue, the backend's own copies included; "
        "use kAuto or kKernel");
  }
  if (!options.flush_remote_writes) return absl::OkStatus();
  if (options.stream_wait_mode == StreamWaitMode::kKernel || options.device_max_connections == 1) {
    return absl::FailedPreconditionError(
        "CudaBackendOptions::flush_remote_writes needs stream memory-op waits "
        "(CU_STREAM_WAIT_VALUE_FLUSH); the wait kernel cannot flush remote writes");
  }
  if (!api.HasStreamMemOps()) {
    return absl::FailedPreconditionError(
        "CudaBackendOptions::flush_remote_writes: the driver exposes no cuStreamWaitValue32");
  }
  int can_flush = 0;
  STEPMESH_RETURN_IF_ERROR(
      CudaStatus(api, api.DeviceGetAttribute(&can_flush, cudaDevAttrCanFlushRemoteWrites, device),
                 "cudaDeviceGetAttribute(CanFlushRemoteWrites)"));
  if (can_flush == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CudaBackendOptions::flush_remote_writes: device ", device,
        " cannot flush remote writes (cudaDevAttrCanFlushRemoteWrites is 0, as on most x86 "
        "hosts); leave it off: the core flushes arrivals with FlushRemoteWrites()"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace cuda

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<cuda::CudaApi> api,
                                                           int device,
                                                           const CudaBackendOptions& options) {
  if (api == nullptr) return absl::InvalidArgumentError("CreateCudaBackend: no CudaApi");
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device index ", device, " is negative"));
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
  // CUDA itself reads CUDA_DEVICE_MAX_CONNECTIONS; so must we, also for
  // direct users (Megatron sets it to 1) who never went through MeshOptions.
  CudaBackendOptions effective = options;
  if (effective.device_max_connections == 0) {
    STEPMESH_ASSIGN_OR_RETURN(effective.device_max_connections, CudaDeviceMaxConnectionsFromEnv());
  }
  STEPMESH_RETURN_IF_ERROR(cuda::CheckOptions(*api, device, effective));
  STEPMESH_ASSIGN_OR_RETURN(auto context,
                            cuda::DeviceContext::Create(std::move(api), device, effective));
  STEPMESH_ASSIGN_OR_RETURN(auto pool, cuda::EventPool::Create(context, options.event_pool_size));
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

absl::Status RecordOnCudaStream(Event& event, void* cuda_stream) {
  auto* cuda_event = dynamic_cast<cuda::CudaEvent*>(&event);
  if (cuda_event == nullptr) {
    return absl::InvalidArgumentError(
        "RecordOnCudaStream: the event was not made by a CUDA backend");
  }
  return cuda_event->RecordOn(static_cast<cudaStream_t>(cuda_stream));
}

absl::Status PreloadCudaKernels(Backend& backend, absl::Span<const void* const> kernels) {
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) {
    return absl::InvalidArgumentError("PreloadCudaKernels: not a CUDA backend");
  }
  cuda::DeviceContext& context = *cuda_backend->context();
  cuda::ScopedDevice scoped(context.api(), context.device());
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  for (size_t i = 0; i < kernels.size(); ++i) {
    STEPMESH_RETURN_IF_ERROR(cuda::CudaStatus(context.api(), context.api().LoadKernel(kernels[i]),
                                              absl::StrCat("PreloadCudaKernels: kernel ", i)));
  }
  return absl::OkStatus();
}

}  // namespace stepmesh
