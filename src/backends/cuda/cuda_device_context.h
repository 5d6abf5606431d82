#pragma once
// The CUDA backend's shared state (cuda_backend.cc says what it keeps to):
// the device context every object it hands out holds, the calling thread's
// device and capture mode for one scope, and the polling waits.

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "src/backends/cuda/cuda_api.h"
#include "src/base/thread_util.h"
#include "stepmesh/cuda.h"

namespace stepmesh::cuda {

// Copy-engine events copy ramp[seq % kRampSize] (= seq % kRampSize + 1, never
// 0) into their host word. Consecutive records of one event thus write
// different values, and a copy from an older record still in flight cannot be
// mistaken for the latest one unless kRampSize records are pending at once.
inline constexpr uint32_t kRampSize = 1024;
// One host word per cache line: events are polled by different threads.
inline constexpr size_t kWordStride = 64;
inline constexpr size_t kHostFlagBytes = 64;
// Pinned + mapped host memory, valid in every context (Portable) so a flag can
// be shared by backends on different devices.
inline constexpr unsigned int kMappedFlags = cudaHostAllocMapped | cudaHostAllocPortable;
// Spins before a waiting loop starts yielding its core.
inline constexpr int kSpinsBeforeYield = 1 << 12;
// The backend's own copy streams: one each for the send thread, the receive
// thread and an application thread, so their synchronous copies never queue
// behind one another.
inline constexpr size_t kCopyLanes = 3;
// CUDA's hardware queues per device when CUDA_DEVICE_MAX_CONNECTIONS is unset.
inline constexpr int kDefaultConnections = 8;
// A pending copy-engine event looks at the clock once every this many polls.
inline constexpr uint32_t kPollsPerClockRead = 64;

inline uint32_t LoadAcquire(const uint32_t* word) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_acquire);
}

// flag >= value, wrap-safe (CU_STREAM_WAIT_VALUE_GEQ).
inline bool Reached(uint32_t flag, uint32_t value) {
  return static_cast<int32_t>(flag - value) >= 0;
}

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
bool HasCurrentContext(CudaApi& api, CUcontext* current);

absl::Status SetDevice(CudaApi& api, int device);

// Gives a thread with no current context the backend's device, once: CUDA
// runtime calls on such a thread would otherwise create device 0's primary
// context (about 0.5 GB on GPU 0 per process, and an error where GPU 0 is in
// exclusive-process mode). A thread that has a context keeps it.
absl::Status BindThread(CudaApi& api, int device);

// The backend's device current for one scope, for the calls that act on the
// current device (allocation, stream and event creation, kernel launches).
//  * A thread with no context is bound to the device for good (BindThread):
//    there is nothing to restore, and "restoring" device 0 would create its
//    context.
//  * A thread on another context is switched and switched back, to the very
//    context it had (cuCtxSetCurrent), so applications keep their own.
class ScopedDevice {
 public:
  ScopedDevice(CudaApi& api, int device);
  ~ScopedDevice();
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
absl::Status FaultStatus(CudaApi& api, cudaError_t error, absl::string_view what);

class CudaHostFlag;  // cuda_host_flag.h

// State shared by the backend and everything it hands out.
class DeviceContext {
 public:
  static absl::StatusOr<std::shared_ptr<DeviceContext>> Create(std::shared_ptr<CudaApi> api,
                                                               int device,
                                                               const CudaBackendOptions& options);

  ~DeviceContext();

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
  void Release(void* ptr, bool device);

  // A synchronous copy on one of the backend's own streams: non-blocking (no
  // implicit wait for the legacy default stream or the application's blocking
  // streams) and of the highest priority. cudaMemcpyAsync + stream sync rather
  // than cudaMemcpy: the latter returns before the data is in place for
  // device-to-device and pageable host-to-device copies.
  absl::Status Copy(void* dst, const void* src, size_t bytes);

  // OK unless the device faulted. A device fault is sticky for the whole
  // context, so any of its streams reports it; the backend's own copy stream
  // is the one that is certainly alive and never captured by the application
  // (querying a capturing stream would break that capture).
  absl::Status CheckForFault(absl::string_view what);

  absl::StatusOr<bool> IsCapturing(cudaStream_t stream);

  // Arrival -> GPU: later work on `stream` waits for the flag.
  absl::Status StreamWait(cudaStream_t stream, CudaHostFlag& flag, uint32_t value);
  // Arrival -> GPU, graph-replayable: waits for the counter's next increment.
  absl::Status StreamWaitNext(cudaStream_t stream, CudaHostFlag& counter, CudaHostFlag& cursor);
  // GPU -> host: the stream writes the flag when it gets there.
  absl::Status StreamSignal(cudaStream_t stream, CudaHostFlag& flag, uint32_t value);

  // PCI bus id (lower case, as sysfs spells it) and NUMA node of a device,
  // looked up once per device.
  absl::StatusOr<std::pair<std::string, int>> DeviceTopology(int device);

 private:
  struct CopyLane {
    cudaStream_t stream = nullptr;
    std::atomic<bool> busy{false};
  };

  DeviceContext(std::shared_ptr<CudaApi> api, int device, const CudaBackendOptions& options)
      : api_(std::move(api)), device_(device), options_(options) {}

  void FreeNow(void* ptr, bool device);
  void Reap();

  CopyLane& AcquireLane();

  // Whether a wait or signal uses the stream memory operations (else the
  // flag kernels).
  absl::StatusOr<bool> UseStreamMemOps(bool capturing);

  // In kAuto mode a driver that resolves the entry point but refuses the call
  // (stream memory operations disabled) moves us to the kernels for good,
  // unless remote writes must be flushed, which only the memop can do.
  bool FallBackFromMemOps(CUresult result);

  absl::Status LaunchFlagKernel(cudaStream_t stream, uint32_t* device_word, uint32_t value,
                                bool wait);

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

}  // namespace stepmesh::cuda
