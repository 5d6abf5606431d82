// DeviceContext and the per-scope thread state (cuda_device_context.h).

#include "src/backends/cuda/cuda_device_context.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "src/backends/cuda/cuda_host_flag.h"
#include "src/backends/cuda/cuda_status.h"
#include "src/base/logging.h"
#include "stepmesh/status.h"

namespace stepmesh::cuda {

bool HasCurrentContext(CudaApi& api, CUcontext* current) {
  *current = nullptr;
  const CUresult result = api.CtxGetCurrent(current);
  return result != CUDA_SUCCESS || *current != nullptr;
}

absl::Status SetDevice(CudaApi& api, int device) {
  return CudaStatus(api, api.SetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

absl::Status BindThread(CudaApi& api, int device) {
  CUcontext current = nullptr;
  if (HasCurrentContext(api, &current)) return absl::OkStatus();
  return SetDevice(api, device);
}

absl::Status FaultStatus(CudaApi& api, cudaError_t error, absl::string_view what) {
  absl::Status status = CudaStatus(api, error, what);
  if (status.code() == absl::StatusCode::kInternal) return status;
  absl::Status internal = absl::InternalError(status.message());
  internal.SetPayload(kCudaErrorPayload, absl::Cord(absl::StrCat(static_cast<int>(error))));
  return internal;
}

ScopedDevice::ScopedDevice(CudaApi& api, int device) : api_(api) {
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

ScopedDevice::~ScopedDevice() {
  if (restore_context_) {
    (void)api_.CtxSetCurrent(saved_);
  } else if (previous_device_ >= 0) {
    (void)api_.SetDevice(previous_device_);
  }
}

absl::StatusOr<std::shared_ptr<DeviceContext>> DeviceContext::Create(
    std::shared_ptr<CudaApi> api, int device, const CudaBackendOptions& options) {
  auto context = std::shared_ptr<DeviceContext>(new DeviceContext(std::move(api), device, options));
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

DeviceContext::~DeviceContext() {
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

void DeviceContext::Release(void* ptr, bool device) {
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

absl::Status DeviceContext::Copy(void* dst, const void* src, size_t bytes) {
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

absl::Status DeviceContext::CheckForFault(absl::string_view what) {
  RelaxedCapture relaxed(*api_);
  STEPMESH_RETURN_IF_ERROR(BindThread(*api_, device_));
  const cudaError_t error = api_->StreamQuery(lanes_[0].stream);
  if (error == cudaSuccess || error == cudaErrorNotReady) return absl::OkStatus();
  return FaultStatus(*api_, error, what);
}

absl::StatusOr<bool> DeviceContext::IsCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  STEPMESH_RETURN_IF_ERROR(
      CudaStatus(*api_, api_->StreamIsCapturing(stream, &capture), "cudaStreamIsCapturing"));
  return capture != cudaStreamCaptureStatusNone;
}

absl::StatusOr<std::pair<std::string, int>> DeviceContext::DeviceTopology(int device) {
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

void DeviceContext::FreeNow(void* ptr, bool device) {
  ScopedDevice scoped(*api_, device_);
  const cudaError_t error = device ? api_->Free(ptr) : api_->FreeHost(ptr);
  if (error != cudaSuccess) {
    STEPMESH_LOG(kWarning,
                 CudaStatus(*api_, error, device ? "cudaFree" : "cudaFreeHost").ToString());
  }
}

void DeviceContext::Reap() {
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

DeviceContext::CopyLane& DeviceContext::AcquireLane() {
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

absl::StatusOr<bool> DeviceContext::UseStreamMemOps(bool capturing) {
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

bool DeviceContext::FallBackFromMemOps(CUresult result) {
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

absl::Status DeviceContext::LaunchFlagKernel(cudaStream_t stream, uint32_t* device_word,
                                             uint32_t value, bool wait) {
  ScopedDevice scoped(*api_, device_);  // kernel launches need the stream's device current
  STEPMESH_RETURN_IF_ERROR(scoped.status());
  if (wait) {
    return CudaStatus(*api_, api_->LaunchWaitFlagKernel(stream, device_word, value),
                      "launching the flag-wait kernel");
  }
  return CudaStatus(*api_, api_->LaunchSignalFlagKernel(stream, device_word, value),
                    "launching the flag-signal kernel");
}

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

}  // namespace stepmesh::cuda
