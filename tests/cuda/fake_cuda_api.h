#pragma once
// FakeCudaApi: a CudaApi with no GPU behind it, strict enough that backend
// mistakes show up as failed tests rather than as hangs on a real device.
//
//  * "Device" memory is host memory tagged with the device that was current
//    when it was allocated; mapped host memory gets a *different* device alias
//    address, so passing a host pointer where the device needs its alias fails.
//  * Streams are queues that run only when the test says so (RunStream /
//    RunAll); a wait (memop or kernel) blocks its queue until the flag allows.
//  * Everything the real driver would reject (kernel launch with the wrong
//    current device, event recorded on another device's stream, a stream memory
//    operation on a capturing stream, unaligned dma-buf ranges, frees of
//    unknown pointers, ...) is refused with a CUDA error *and* recorded in
//    violations(), which every test checks is empty.

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "src/backends/cuda/cuda_api.h"

namespace stepmesh::cuda::testing {

class FakeCudaApi final : public CudaApi {
 public:
  // Where mapped host memory appears to the device: host + kAliasOffset.
  static constexpr uintptr_t kAliasOffset = uintptr_t{1} << 52;
  static constexpr size_t kPage = 4096;

  struct Op {
    std::string name;
    std::function<bool()> run;  // false: blocked, retry later
  };
  struct FakeStream {
    int device = 0;
    unsigned int flags = 0;
    bool capturing = false;
    bool destroyed = false;
    std::deque<Op> ops;
  };
  struct FakeEvent {
    int device = 0;
    unsigned int flags = 0;
    uint64_t recorded = 0;
    uint64_t completed = 0;
  };
  struct Allocation {
    size_t bytes = 0;
    int device = -1;  // -1: host memory
    unsigned int host_flags = 0;
  };
  struct MemOp {
    std::string name;
    uintptr_t address;
    uint32_t value;
    unsigned int flags;
  };

  explicit FakeCudaApi(int device_count = 1) : device_count_(device_count) {}
  ~FakeCudaApi() override {
    for (auto& [address, allocation] : allocations_) std::free(reinterpret_cast<void*>(address));
  }

  // --- Test controls ----------------------------------------------------------
  void set_device_count_error(cudaError_t error) { device_count_error_ = error; }
  void set_has_stream_memops(bool has) { has_memops_ = has; }
  void set_has_dmabuf(bool has) { has_dmabuf_ = has; }
  // cudaDeviceGetAttribute answers (every device alike); unset ones read 0.
  void set_attribute(cudaDeviceAttr attr, int value) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    attributes_[attr] = value;
  }
  // The next call named `call` (the CUDA name, e.g. "cudaMalloc") fails.
  void FailNext(const std::string& call, cudaError_t error) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    injected_[call].push_back(error);
  }
  void FailNextDriver(const std::string& call, CUresult error) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    injected_driver_[call].push_back(error);
  }
  void SetCapturing(cudaStream_t stream, bool capturing) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    Stream(stream)->capturing = capturing;
  }

  // Runs `stream`'s queued work in order until it is empty or blocked.
  int RunStream(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    FakeStream* s = Stream(stream);
    if (s == nullptr) return 0;
    int ran = 0;
    while (!s->ops.empty() && s->ops.front().run()) {
      s->ops.pop_front();
      ++ran;
    }
    return ran;
  }
  int RunAll() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    int ran = 0;
    for (auto& [handle, stream] : streams_)
      ran += RunStream(reinterpret_cast<cudaStream_t>(handle));
    return ran;
  }
  size_t Pending(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Stream(stream)->ops.size();
  }
  std::vector<std::string> PendingNames(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    std::vector<std::string> names;
    for (const Op& op : Stream(stream)->ops) names.push_back(op.name);
    return names;
  }

  // --- Inspection -------------------------------------------------------------
  int Calls(const std::string& name) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return calls_[name];
  }
  std::vector<std::string> violations() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return violations_;
  }
  int CurrentDeviceOfThisThread() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return current_[std::this_thread::get_id()];
  }
  // Device of the allocation containing `ptr`; -1 host, -2 unknown.
  int DeviceOf(const void* ptr) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(ptr));
    return a == nullptr ? -2 : a->device;
  }
  unsigned int HostFlagsOf(const void* ptr) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(ptr));
    return a == nullptr ? 0 : a->host_flags;
  }
  int DeviceOfStream(void* stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Stream(static_cast<cudaStream_t>(stream))->device;
  }
  unsigned int FlagsOfStream(void* stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Stream(static_cast<cudaStream_t>(stream))->flags;
  }
  size_t LiveAllocations() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return allocations_.size();
  }
  size_t LiveStreams() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    size_t live = 0;
    for (auto& [handle, stream] : streams_) live += stream->destroyed ? 0 : 1;
    return live;
  }
  size_t LiveEvents() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return events_.size();
  }
  std::vector<MemOp> memops() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return memops_;
  }
  std::vector<std::pair<uintptr_t, size_t>> exported_ranges() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return exported_;
  }

  // --- Runtime: devices -------------------------------------------------------
  cudaError_t GetDeviceCount(int* count) override {
    Lock lock(this, "cudaGetDeviceCount");
    if (cudaError_t e = lock.injected()) return e;
    if (device_count_error_ != cudaSuccess) return device_count_error_;
    *count = device_count_;
    return cudaSuccess;
  }
  cudaError_t GetDevice(int* device) override {
    Lock lock(this, "cudaGetDevice");
    if (cudaError_t e = lock.injected()) return e;
    *device = current_[std::this_thread::get_id()];
    return cudaSuccess;
  }
  cudaError_t SetDevice(int device) override {
    Lock lock(this, "cudaSetDevice");
    if (cudaError_t e = lock.injected()) return e;
    if (device < 0 || device >= device_count_)
      return Violation(cudaErrorInvalidDevice, "SetDevice");
    current_[std::this_thread::get_id()] = device;
    return cudaSuccess;
  }
  cudaError_t DeviceGetPCIBusId(char* bus_id, int len, int device) override {
    Lock lock(this, "cudaDeviceGetPCIBusId");
    if (cudaError_t e = lock.injected()) return e;
    if (device < 0 || device >= device_count_) return cudaErrorInvalidDevice;
    // Upper-case hex, as the real call returns it.
    std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02X:00.0", 0x10 + device);
    return cudaSuccess;
  }

  cudaError_t DeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) override {
    Lock lock(this, "cudaDeviceGetAttribute");
    if (cudaError_t e = lock.injected()) return e;
    if (device < 0 || device >= device_count_) return cudaErrorInvalidDevice;
    auto it = attributes_.find(attr);
    *value = it == attributes_.end() ? 0 : it->second;
    return cudaSuccess;
  }
  cudaError_t DeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTarget target,
                                             cudaFlushGPUDirectRDMAWritesScope scope) override {
    Lock lock(this, "cudaDeviceFlushGPUDirectRDMAWrites");
    if (cudaError_t e = lock.injected()) return e;
    auto it = attributes_.find(cudaDevAttrGPUDirectRDMAFlushWritesOptions);
    if (it == attributes_.end() || (it->second & cudaFlushGPUDirectRDMAWritesOptionHost) == 0) {
      return Violation(cudaErrorNotSupported, "GPUDirect RDMA flush on a device without it");
    }
    if (target != cudaFlushGPUDirectRDMAWritesTargetCurrentDevice ||
        scope < cudaFlushGPUDirectRDMAWritesToOwner) {
      return Violation(cudaErrorInvalidValue, "GPUDirect RDMA flush: bad target or scope");
    }
    return cudaSuccess;
  }

  // --- Runtime: memory --------------------------------------------------------
  cudaError_t Malloc(void** ptr, size_t bytes) override {
    Lock lock(this, "cudaMalloc");
    if (cudaError_t e = lock.injected()) return e;
    if (bytes == 0) return Violation(cudaErrorInvalidValue, "cudaMalloc(0) hands back null");
    void* p = std::aligned_alloc(kPage, RoundUp(bytes));
    std::memset(p, 0xAB, RoundUp(bytes));  // device memory is not zeroed
    allocations_[reinterpret_cast<uintptr_t>(p)] = {bytes, current_[std::this_thread::get_id()], 0};
    *ptr = p;
    return cudaSuccess;
  }
  cudaError_t Free(void* ptr) override {
    Lock lock(this, "cudaFree");
    if (cudaError_t e = lock.injected()) return e;
    return Release(ptr, /*device=*/true);
  }
  cudaError_t HostAlloc(void** ptr, size_t bytes, unsigned int flags) override {
    Lock lock(this, "cudaHostAlloc");
    if (cudaError_t e = lock.injected()) return e;
    if (bytes == 0) return Violation(cudaErrorInvalidValue, "cudaHostAlloc(0)");
    void* p = std::aligned_alloc(kPage, RoundUp(bytes));
    std::memset(p, 0xCD, RoundUp(bytes));
    allocations_[reinterpret_cast<uintptr_t>(p)] = {bytes, -1, flags};
    *ptr = p;
    return cudaSuccess;
  }
  cudaError_t FreeHost(void* ptr) override {
    Lock lock(this, "cudaFreeHost");
    if (cudaError_t e = lock.injected()) return e;
    return Release(ptr, /*device=*/false);
  }
  cudaError_t HostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned int flags) override {
    Lock lock(this, "cudaHostGetDevicePointer");
    if (cudaError_t e = lock.injected()) return e;
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(host_ptr));
    if (flags != 0 || a == nullptr || a->device != -1 || !(a->host_flags & cudaHostAllocMapped)) {
      return Violation(cudaErrorInvalidValue, "HostGetDevicePointer on non-mapped memory");
    }
    *device_ptr = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(host_ptr) + kAliasOffset);
    return cudaSuccess;
  }
  cudaError_t PointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) override {
    Lock lock(this, "cudaPointerGetAttributes");
    if (cudaError_t e = lock.injected()) return e;
    *attributes = {};
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(ptr));
    if (a == nullptr) {
      attributes->type = cudaMemoryTypeUnregistered;
      attributes->device = -2;
    } else if (a->device >= 0) {
      attributes->type = cudaMemoryTypeDevice;
      attributes->device = a->device;
      attributes->devicePointer = const_cast<void*>(ptr);
    } else {
      attributes->type = cudaMemoryTypeHost;
      attributes->device = -2;
      attributes->hostPointer = const_cast<void*>(ptr);
    }
    return cudaSuccess;
  }
  cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) override {
    Lock lock(this, "cudaMemcpy");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = CheckCopy(dst, src, bytes, kind, "cudaMemcpy")) return e;
    std::memcpy(Resolve(dst), Resolve(src), bytes);
    return cudaSuccess;
  }
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                          cudaStream_t stream) override {
    Lock lock(this, "cudaMemcpyAsync");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = LiveStream(stream);
    if (s == nullptr) return cudaErrorInvalidResourceHandle;
    if (cudaError_t e = CheckCopy(dst, src, bytes, kind, "cudaMemcpyAsync")) return e;
    void* d = Resolve(dst);
    const void* from = Resolve(src);
    s->ops.push_back({"memcpy", [d, from, bytes] {
                        std::memcpy(d, from, bytes);
                        return true;
                      }});
    return cudaSuccess;
  }

  // --- Runtime: streams and events -------------------------------------------
  cudaError_t StreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) override {
    Lock lock(this, "cudaStreamCreate");
    if (cudaError_t e = lock.injected()) return e;
    auto s = std::make_unique<FakeStream>();
    s->device = current_[std::this_thread::get_id()];
    s->flags = flags;
    *stream = reinterpret_cast<cudaStream_t>(s.get());
    streams_[s.get()] = std::move(s);
    return cudaSuccess;
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override {
    Lock lock(this, "cudaStreamDestroy");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = LiveStream(stream);
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "StreamDestroy twice");
    s->destroyed = true;  // like CUDA, queued work still runs (RunAll)
    return cudaSuccess;
  }
  cudaError_t StreamQuery(cudaStream_t stream) override {
    Lock lock(this, "cudaStreamQuery");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = LiveStream(stream);
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "StreamQuery");
    return s->ops.empty() ? cudaSuccess : cudaErrorNotReady;
  }
  cudaError_t StreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) override {
    Lock lock(this, "cudaStreamIsCapturing");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = LiveStream(stream);
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "StreamIsCapturing");
    *status = s->capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  cudaError_t LaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) override {
    Lock lock(this, "cudaLaunchHostFunc");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = LiveStream(stream);
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "LaunchHostFunc");
    s->ops.push_back({"host_func", [fn, user_data] {
                        fn(user_data);
                        return true;
                      }});
    return cudaSuccess;
  }
  cudaError_t EventCreateWithFlags(cudaEvent_t* event, unsigned int flags) override {
    Lock lock(this, "cudaEventCreate");
    if (cudaError_t e = lock.injected()) return e;
    auto ev = std::make_unique<FakeEvent>();
    ev->device = current_[std::this_thread::get_id()];
    ev->flags = flags;
    *event = reinterpret_cast<cudaEvent_t>(ev.get());
    events_[ev.get()] = std::move(ev);
    return cudaSuccess;
  }
  cudaError_t EventDestroy(cudaEvent_t event) override {
    Lock lock(this, "cudaEventDestroy");
    if (cudaError_t e = lock.injected()) return e;
    if (events_.erase(event) == 0) {
      return Violation(cudaErrorInvalidResourceHandle, "EventDestroy unknown");
    }
    return cudaSuccess;
  }
  cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) override {
    Lock lock(this, "cudaEventRecord");
    if (cudaError_t e = lock.injected()) return e;
    FakeEvent* ev = Event(event);
    FakeStream* s = LiveStream(stream);
    if (ev == nullptr || s == nullptr) {
      return Violation(cudaErrorInvalidResourceHandle, "EventRecord handle");
    }
    if (ev->device != s->device) {
      return Violation(cudaErrorInvalidResourceHandle, "EventRecord across devices");
    }
    const uint64_t generation = ++ev->recorded;
    s->ops.push_back({"event_record", [ev, generation] {
                        ev->completed = std::max(ev->completed, generation);
                        return true;
                      }});
    return cudaSuccess;
  }
  cudaError_t EventQuery(cudaEvent_t event) override {
    Lock lock(this, "cudaEventQuery");
    if (cudaError_t e = lock.injected()) return e;
    FakeEvent* ev = Event(event);
    if (ev == nullptr) return Violation(cudaErrorInvalidResourceHandle, "EventQuery handle");
    return ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
  }
  // The real runtime's tables: they need no driver.
  const char* GetErrorName(cudaError_t error) override { return cudaGetErrorName(error); }
  const char* GetErrorString(cudaError_t error) override { return cudaGetErrorString(error); }

  // --- Kernels ----------------------------------------------------------------
  cudaError_t LaunchWaitFlagKernel(cudaStream_t stream, const uint32_t* flag,
                                   uint32_t value) override {
    Lock lock(this, "wait_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = CheckLaunch(stream, flag, "wait kernel")) return e;
    auto* word = static_cast<uint32_t*>(Resolve(const_cast<uint32_t*>(flag)));
    LiveStream(stream)->ops.push_back(
        {"wait_kernel", [word, value] { return static_cast<int32_t>(Load(word) - value) >= 0; }});
    return cudaSuccess;
  }
  cudaError_t LaunchSignalFlagKernel(cudaStream_t stream, uint32_t* flag, uint32_t value) override {
    Lock lock(this, "signal_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = CheckLaunch(stream, flag, "signal kernel")) return e;
    auto* word = static_cast<uint32_t*>(Resolve(flag));
    LiveStream(stream)->ops.push_back({"signal_kernel", [word, value] {
                                         Store(word, value);
                                         return true;
                                       }});
    return cudaSuccess;
  }

  // --- Driver entry points ----------------------------------------------------
  bool HasStreamMemOps() override { return has_memops_; }
  CUresult StreamWaitValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                             unsigned int flags) override {
    Lock lock(this, "cuStreamWaitValue32");
    if (CUresult r = lock.injected_driver()) return r;
    if (CUresult r = CheckMemOp(stream, addr, flags & ~CU_STREAM_WAIT_VALUE_FLUSH, "wait")) {
      return r;
    }
    memops_.push_back({"wait", static_cast<uintptr_t>(addr), value, flags});
    auto* word = static_cast<uint32_t*>(Resolve(reinterpret_cast<void*>(addr)));
    LiveStream(reinterpret_cast<cudaStream_t>(stream))
        ->ops.push_back({"wait_value",
                         [word, value] { return static_cast<int32_t>(Load(word) - value) >= 0; }});
    return CUDA_SUCCESS;
  }
  CUresult StreamWriteValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                              unsigned int flags) override {
    Lock lock(this, "cuStreamWriteValue32");
    if (CUresult r = lock.injected_driver()) return r;
    if (CUresult r = CheckMemOp(stream, addr, flags, "write")) return r;
    memops_.push_back({"write", static_cast<uintptr_t>(addr), value, flags});
    auto* word = static_cast<uint32_t*>(Resolve(reinterpret_cast<void*>(addr)));
    LiveStream(reinterpret_cast<cudaStream_t>(stream))
        ->ops.push_back({"write_value", [word, value] {
                           Store(word, value);
                           return true;
                         }});
    return CUDA_SUCCESS;
  }
  bool HasDmabufExport() override { return has_dmabuf_; }
  CUresult MemGetHandleForAddressRange(void* handle, CUdeviceptr ptr, size_t bytes,
                                       CUmemRangeHandleType type,
                                       unsigned long long flags) override {
    Lock lock(this, "cuMemGetHandleForAddressRange");
    if (CUresult r = lock.injected_driver()) return r;
    if (!has_dmabuf_) return CUDA_ERROR_NOT_FOUND;
    const uintptr_t address = static_cast<uintptr_t>(ptr);
    const Allocation* a = Find(address);
    if (type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD || flags != 0 || address % kPage != 0 ||
        bytes % kPage != 0 || bytes == 0 || a == nullptr || a->device < 0 ||
        Find(address + bytes - 1) != a) {
      Violation(cudaErrorInvalidValue,
                "dma-buf range not page aligned / not one device allocation");
      return CUDA_ERROR_INVALID_VALUE;
    }
    exported_.push_back({address, bytes});
    *static_cast<int*>(handle) = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return CUDA_SUCCESS;
  }
  const char* GetDriverErrorName(CUresult error) override {
    switch (error) {
      case CUDA_ERROR_NOT_SUPPORTED:
        return "CUDA_ERROR_NOT_SUPPORTED";
      case CUDA_ERROR_INVALID_VALUE:
        return "CUDA_ERROR_INVALID_VALUE";
      case CUDA_ERROR_NOT_FOUND:
        return "CUDA_ERROR_NOT_FOUND";
      default:
        return "CUDA_ERROR_OTHER";
    }
  }

 private:
  // Locks the fake, counts the call and pops an injected failure.
  class Lock {
   public:
    Lock(FakeCudaApi* api, const char* name) : api_(api), guard_(api->mu_), name_(name) {
      ++api_->calls_[name_];
    }
    cudaError_t injected() {
      auto& queue = api_->injected_[name_];
      if (queue.empty()) return cudaSuccess;
      cudaError_t e = queue.front();
      queue.erase(queue.begin());
      return e;
    }
    CUresult injected_driver() {
      auto& queue = api_->injected_driver_[name_];
      if (queue.empty()) return CUDA_SUCCESS;
      CUresult r = queue.front();
      queue.erase(queue.begin());
      return r;
    }

   private:
    FakeCudaApi* api_;
    std::lock_guard<std::recursive_mutex> guard_;
    std::string name_;
  };

  static size_t RoundUp(size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
  static uint32_t Load(uint32_t* word) {
    return std::atomic_ref<uint32_t>(*word).load(std::memory_order_acquire);
  }
  static void Store(uint32_t* word, uint32_t value) {
    std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
  }

  cudaError_t Violation(cudaError_t error, const std::string& what) {
    violations_.push_back(what);
    return error;
  }
  const Allocation* Find(uintptr_t address) {
    auto it = allocations_.upper_bound(address);
    if (it == allocations_.begin()) return nullptr;
    --it;
    return address < it->first + it->second.bytes ? &it->second : nullptr;
  }
  // Device aliases of mapped memory back to the host address.
  void* Resolve(void* ptr) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
    if (Find(address) == nullptr && address >= kAliasOffset) {
      const Allocation* a = Find(address - kAliasOffset);
      if (a != nullptr && a->device == -1 && (a->host_flags & cudaHostAllocMapped)) {
        return reinterpret_cast<void*>(address - kAliasOffset);
      }
    }
    return ptr;
  }
  const void* Resolve(const void* ptr) { return Resolve(const_cast<void*>(ptr)); }
  bool IsDeviceAlias(const void* ptr) { return Resolve(ptr) != ptr; }

  cudaError_t Release(void* ptr, bool device) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end() || (it->second.device >= 0) != device) {
      return Violation(cudaErrorInvalidValue, device ? "cudaFree of a non-device pointer"
                                                     : "cudaFreeHost of a non-host pointer");
    }
    std::free(ptr);
    allocations_.erase(it);
    return cudaSuccess;
  }

  cudaError_t CheckCopy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                        const char* what) {
    const Allocation* d = Find(reinterpret_cast<uintptr_t>(Resolve(dst)));
    const Allocation* s = Find(reinterpret_cast<uintptr_t>(Resolve(src)));
    auto on_device = [](const Allocation* a) { return a != nullptr && a->device >= 0; };
    if (kind == cudaMemcpyDeviceToHost && (!on_device(s) || on_device(d))) {
      return Violation(cudaErrorInvalidMemcpyDirection, std::string(what) + " D2H direction");
    }
    if (kind == cudaMemcpyHostToDevice && (on_device(s) || !on_device(d))) {
      return Violation(cudaErrorInvalidMemcpyDirection, std::string(what) + " H2D direction");
    }
    // An async copy into pageable memory would be synchronous on a real GPU.
    if (kind == cudaMemcpyDeviceToHost && std::string(what) == "cudaMemcpyAsync" && d == nullptr) {
      return Violation(cudaErrorInvalidValue, "async D2H copy into pageable memory");
    }
    (void)bytes;
    return cudaSuccess;
  }

  cudaError_t CheckLaunch(cudaStream_t stream, const void* flag, const char* what) {
    FakeStream* s = LiveStream(stream);
    if (s == nullptr)
      return Violation(cudaErrorInvalidResourceHandle, std::string(what) + " stream");
    if (current_[std::this_thread::get_id()] != s->device) {
      return Violation(cudaErrorInvalidResourceHandle,
                       std::string(what) + " launched with another device current");
    }
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(flag));
    if (!IsDeviceAlias(flag) && (a == nullptr || a->device < 0)) {
      return Violation(cudaErrorIllegalAddress,
                       std::string(what) + " given a host pointer instead of a device alias");
    }
    return cudaSuccess;
  }

  CUresult CheckMemOp(CUstream stream, CUdeviceptr addr, unsigned int flags, const char* what) {
    FakeStream* s = LiveStream(reinterpret_cast<cudaStream_t>(stream));
    if (s == nullptr) {
      Violation(cudaErrorInvalidResourceHandle, "memop stream");
      return CUDA_ERROR_INVALID_HANDLE;
    }
    if (s->capturing) {
      Violation(cudaErrorStreamCaptureUnsupported,
                std::string("memop ") + what + " while capturing");
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (flags != 0) {  // GEQ for waits, DEFAULT for writes
      Violation(cudaErrorInvalidValue, std::string("memop ") + what + " flags");
      return CUDA_ERROR_INVALID_VALUE;
    }
    const void* p = reinterpret_cast<const void*>(addr);
    const Allocation* a = Find(static_cast<uintptr_t>(addr));
    if (!IsDeviceAlias(p) && (a == nullptr || a->device < 0)) {
      Violation(cudaErrorIllegalAddress, std::string("memop ") + what + " on a host pointer");
      return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
  }

  FakeStream* Stream(cudaStream_t stream) {
    auto it = streams_.find(reinterpret_cast<FakeStream*>(stream));
    return it == streams_.end() ? nullptr : it->second.get();
  }
  FakeStream* LiveStream(cudaStream_t stream) {
    FakeStream* s = Stream(stream);
    return s == nullptr || s->destroyed ? nullptr : s;
  }
  FakeEvent* Event(cudaEvent_t event) {
    auto it = events_.find(reinterpret_cast<FakeEvent*>(event));
    return it == events_.end() ? nullptr : it->second.get();
  }

  std::recursive_mutex mu_;
  int device_count_;
  cudaError_t device_count_error_ = cudaSuccess;
  bool has_memops_ = true;
  bool has_dmabuf_ = true;
  std::map<cudaDeviceAttr, int> attributes_;
  std::map<std::thread::id, int> current_;
  std::map<uintptr_t, Allocation> allocations_;
  std::map<void*, std::unique_ptr<FakeStream>> streams_;
  std::map<void*, std::unique_ptr<FakeEvent>> events_;
  std::map<std::string, int> calls_;
  std::map<std::string, std::vector<cudaError_t>> injected_;
  std::map<std::string, std::vector<CUresult>> injected_driver_;
  std::vector<std::string> violations_;
  std::vector<MemOp> memops_;
  std::vector<std::pair<uintptr_t, size_t>> exported_;
};

}  // namespace stepmesh::cuda::testing
