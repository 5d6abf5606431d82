#pragma once
// FakeCudaApi: a CudaApi with no GPU behind it, strict enough that backend
// mistakes show up as failed tests rather than as hangs on a real device. It
// models what CUDA documents, including the parts that hang or corrupt:
//
//  * Device memory is not host memory: it is mapped PROT_NONE and opened only
//    while a fake operation (a copy, a kernel) touches it, so host code that
//    dereferences a device pointer crashes. Copies are bounds-checked against
//    the allocation. Mapped host memory has a *different* device alias, so a
//    host pointer passed where the device needs its alias is refused.
//    (set_device_memory_host_accessible(true) opens it for good: for tests
//    whose fake NIC and "kernels" touch device memory directly.)
//  * Streams run only when the test says so (RunStream / RunAll), or when a
//    synchronous call needs them: cudaMemcpy, cudaStreamSynchronize and the
//    device-wide waits drive exactly the work they wait for. A wait (memop or
//    kernel) blocks its stream until the flag allows it. A synchronous call
//    that stays blocked for hang_timeout is recorded as a would-be hang.
//  * The legacy default stream (0 / cudaStreamLegacy) follows CUDA's rules:
//    its work waits for all earlier work of the device's blocking streams,
//    and their later work waits for it. cudaMemcpy is legacy-stream work and
//    returns per the documented synchronisation rules (device-to-device and
//    pageable host-to-device copies return before the data is there).
//  * Hardware queues (set_hardware_queues, CUDA_DEVICE_MAX_CONNECTIONS):
//    streams map to a device's queues round robin in creation order, and a
//    cuStreamWaitValue32 that is not yet satisfied at the head of its stream
//    holds up the work of every stream on that queue enqueued after it (a
//    wait kernel does not: it is dispatched and spins on an SM).
//  * cudaFree, cudaFreeHost, cudaHostAlloc and loading a kernel (lazily, at
//    its first launch, or on request) wait for the whole device.
//  * Stream capture: captured work is recorded, not run, and can be replayed
//    as a graph; "potentially unsafe" calls follow each thread's capture mode
//    (cudaThreadExchangeStreamCaptureMode) and invalidate the capture.
//  * Each thread has its own current context; the runtime calls that need one
//    create device 0's primary context on a thread that has none, and
//    primary_contexts_created() counts the contexts made.
//  * A device fault (InjectDeviceFault) is sticky: the device stops, and every
//    later call on it returns the error.
//
// Everything the real driver would reject is refused with a CUDA error *and*
// recorded in violations(), which every test checks is empty.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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
  // cudaDeviceGetStreamPriorityRange of the fake (a Hopper's range).
  static constexpr int kLeastPriority = 0;
  static constexpr int kGreatestPriority = -5;

  struct FakeStream;
  struct Dep {
    FakeStream* stream;
    uint64_t seq;
  };
  struct Op {
    std::string name;
    std::function<bool()> run;  // false: blocked, retry later
    std::vector<Dep> deps;      // other streams' work that must finish first
    uint64_t seq = 0;
    uint64_t tick = 0;         // device-wide enqueue order (hardware queues are FIFOs)
    bool holds_queue = false;  // a memop wait: blocks its hardware queue until satisfied
  };
  struct FakeStream {
    int id = 0;
    int device = 0;
    unsigned int flags = 0;
    int priority = 0;
    bool legacy = false;
    int queue = -1;  // hardware queue (set_hardware_queues); -1: one of its own
    bool destroyed = false;
    uint64_t enqueued = 0;   // sequence number of the last op enqueued
    uint64_t completed = 0;  // ... and of the last one that ran
    std::deque<Op> ops;
    bool capturing = false;
    bool capture_invalidated = false;
    cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
    std::thread::id capture_thread;
    std::vector<Op> captured;
  };
  struct FakeEvent {
    int device = 0;
    unsigned int flags = 0;
    uint64_t recorded = 0;
    uint64_t completed = 0;
  };
  // Pages of fake device memory; PROT_NONE unless an operation has them open.
  struct Mapping {
    void* base = nullptr;
    size_t bytes = 0;
    int open = 0;
    bool always_open = false;
    ~Mapping() {
      if (base != nullptr) ::munmap(base, bytes);
    }
  };
  struct Allocation {
    size_t bytes = 0;
    int device = -1;  // -1: host memory
    unsigned int host_flags = 0;
    std::shared_ptr<Mapping> mapping;  // device memory only
  };
  struct MemOp {
    std::string name;
    uintptr_t address;
    uint32_t value;
    unsigned int flags;
  };
  using Graph = std::vector<Op>;

  explicit FakeCudaApi(int device_count = 1)
      : device_count_(device_count), devices_(static_cast<size_t>(std::max(device_count, 0))) {
    for (int d = 0; d < device_count; ++d) {
      auto legacy = std::make_unique<FakeStream>();
      legacy->id = next_stream_id_++;
      legacy->device = d;
      legacy->legacy = true;
      devices_[static_cast<size_t>(d)].legacy = legacy.get();
      streams_[legacy.get()] = std::move(legacy);
    }
  }
  ~FakeCudaApi() override {
    for (auto& [address, allocation] : allocations_) {
      if (allocation.device < 0) std::free(reinterpret_cast<void*>(address));
    }
  }

  // --- Test controls ----------------------------------------------------------
  void set_device_count_error(cudaError_t error) { device_count_error_ = error; }
  void set_has_stream_memops(bool has) { has_memops_ = has; }
  void set_has_dmabuf(bool has) { has_dmabuf_ = has; }
  // The PCI bus ids cudaDeviceGetPCIBusId reports, by CUDA index (default
  // 0000:1<index>:00.0). WithVisibleDevices makes a fake as the runtime sees
  // a host under CUDA_VISIBLE_DEVICES: `physical` lists every GPU's bus id,
  // `visible` ("5,2") the physical indices that become CUDA 0, 1, ...
  void set_pci_bus_ids(std::vector<std::string> ids) { pci_bus_ids_ = std::move(ids); }
  static std::shared_ptr<FakeCudaApi> WithVisibleDevices(const std::vector<std::string>& physical,
                                                         const std::string& visible) {
    std::vector<std::string> ids;
    size_t start = 0;
    while (start <= visible.size()) {
      const size_t comma = std::min(visible.find(',', start), visible.size());
      const std::string part = visible.substr(start, comma - start);
      if (!part.empty()) ids.push_back(physical.at(static_cast<size_t>(std::stoi(part))));
      start = comma + 1;
    }
    auto api = std::make_shared<FakeCudaApi>(static_cast<int>(ids.size()));
    api->set_pci_bus_ids(std::move(ids));
    return api;
  }
  void set_has_context_queries(bool has) { has_ctx_queries_ = has; }
  // Device memory allocated from now on stays readable by host code.
  void set_device_memory_host_accessible(bool open) { host_accessible_ = open; }
  // Small device allocations are packed 256-byte aligned into shared pages, as
  // a driver's (or a caching allocator's) sub-allocator does.
  void set_suballocate(bool packed) { suballocate_ = packed; }
  // How long a synchronous call may stay blocked before it counts as a hang.
  void set_hang_timeout(std::chrono::milliseconds timeout) { hang_timeout_ = timeout; }
  // Whether [ptr, ptr + bytes) is fake device memory (for a fake NIC).
  bool IsDeviceMemory(const void* ptr, size_t bytes) {
    std::lock_guard<std::recursive_mutex> guard(mu_);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr) & ~uintptr_t{kPage - 1};
    const uintptr_t end = reinterpret_cast<uintptr_t>(ptr) + std::max<size_t>(bytes, 1);
    for (uintptr_t page = begin; page < end; page += kPage) {
      if (!MappedDevicePage(page)) return false;
    }
    return true;
  }
  // `n` hardware queues per device for the streams created from now on (as
  // CUDA_DEVICE_MAX_CONNECTIONS=n); 0: every stream has its own.
  void set_hardware_queues(int n) { hardware_queues_ = n; }
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
  // A fault on `device` (an illegal address in some kernel): sticky, as on a
  // GPU. Its streams stop and every later call on it returns `error`.
  void InjectDeviceFault(int device, cudaError_t error) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    devices_.at(static_cast<size_t>(device)).sticky = error;
  }

  // Stream capture, as cudaStreamBeginCapture / cudaStreamEndCapture on the
  // calling thread. Captured work is kept, not run.
  cudaError_t BeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    FakeStream* s = LiveStream(stream);
    if (s == nullptr || s->legacy || s->capturing) {
      return Violation(cudaErrorIllegalState, "BeginCapture on a legacy/capturing/unknown stream");
    }
    s->capturing = true;
    s->capture_invalidated = false;
    s->capture_mode = mode;
    s->capture_thread = std::this_thread::get_id();
    s->captured.clear();
    return cudaSuccess;
  }
  // The graph, or cudaErrorStreamCaptureInvalidated when something broke it.
  cudaError_t EndCapture(cudaStream_t stream, Graph* graph) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    FakeStream* s = LiveStream(stream);
    if (s == nullptr || !s->capturing) return cudaErrorIllegalState;
    s->capturing = false;
    *graph = std::move(s->captured);
    s->captured.clear();
    return s->capture_invalidated ? cudaErrorStreamCaptureInvalidated : cudaSuccess;
  }
  // Replays a captured graph on `stream` (cudaGraphLaunch).
  cudaError_t LaunchGraph(const Graph& graph, cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    FakeStream* s = LiveStream(stream);
    if (s == nullptr) return cudaErrorInvalidResourceHandle;
    for (const Op& op : graph) Enqueue(s, {op.name, op.run, {}, 0});
    return cudaSuccess;
  }
  // The old switch: capture with the thread-local mode, or drop the capture.
  void SetCapturing(cudaStream_t stream, bool capturing) {
    if (capturing) {
      (void)BeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    } else {
      Graph dropped;
      (void)EndCapture(stream, &dropped);
    }
  }

  // Runs `stream`'s queued work in order (and the work of other streams it
  // depends on) until it is empty or blocked. Returns the ops run.
  int RunStream(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    FakeStream* s = Stream(stream == nullptr ? cudaStreamLegacy : stream);
    if (s == nullptr) return 0;
    const uint64_t before = ops_run_;
    (void)Advance(s, s->enqueued);
    return static_cast<int>(ops_run_ - before);
  }
  int RunAll() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const uint64_t before = ops_run_;
    for (uint64_t last = ~uint64_t{0}; last != ops_run_;) {
      last = ops_run_;
      for (auto& [handle, stream] : streams_) (void)Advance(stream.get(), stream->enqueued);
    }
    return static_cast<int>(ops_run_ - before);
  }
  size_t Pending(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Stream(stream == nullptr ? cudaStreamLegacy : stream)->ops.size();
  }
  std::vector<std::string> PendingNames(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    std::vector<std::string> names;
    for (const Op& op : Stream(stream == nullptr ? cudaStreamLegacy : stream)->ops) {
      names.push_back(op.name);
    }
    return names;
  }
  std::vector<std::string> CapturedNames(cudaStream_t stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    std::vector<std::string> names;
    for (const Op& op : Stream(stream)->captured) names.push_back(op.name);
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
  // The calling thread's current device; -1 when it has no context.
  int CurrentDeviceOfThisThread() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Thread().current;
  }
  cudaStreamCaptureMode CaptureModeOfThisThread() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Thread().capture_mode;
  }
  // Primary contexts created so far on `device` (0 or 1), or on all devices.
  int primary_contexts_created(int device) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return devices_.at(static_cast<size_t>(device)).context ? 1 : 0;
  }
  int primary_contexts_created() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    int n = 0;
    for (const Device& d : devices_) n += d.context ? 1 : 0;
    return n;
  }
  bool KernelLoaded(int device, const std::string& kernel) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return devices_.at(static_cast<size_t>(device)).loaded.count(kernel) != 0;
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
  int PriorityOfStream(void* stream) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return Stream(static_cast<cudaStream_t>(stream))->priority;
  }
  // Streams the code under test created (not the legacy ones), live ones.
  std::vector<cudaStream_t> CreatedStreams() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    std::vector<cudaStream_t> out;
    for (auto& [handle, stream] : streams_) {
      if (!stream->legacy && !stream->destroyed)
        out.push_back(reinterpret_cast<cudaStream_t>(handle));
    }
    return out;
  }
  size_t LiveAllocations() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return allocations_.size();
  }
  size_t LiveStreams() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    size_t live = 0;
    for (auto& [handle, stream] : streams_) live += stream->destroyed || stream->legacy ? 0 : 1;
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
  // Reads fake device memory the way a test's "kernel" would: inside the fake.
  void ReadDevice(void* dst, const void* device_src, size_t bytes) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(device_src));
    Window window(this, a != nullptr ? a->mapping.get() : nullptr);
    std::memcpy(dst, device_src, bytes);
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
    // No context is made: a thread without one reads device 0.
    *device = std::max(Thread().current, 0);
    return cudaSuccess;
  }
  cudaError_t SetDevice(int device) override {
    Lock lock(this, "cudaSetDevice");
    if (cudaError_t e = lock.injected()) return e;
    if (device < 0 || device >= device_count_) {
      return Violation(cudaErrorInvalidDevice, "SetDevice out of range");
    }
    MakeCurrent(device);  // CUDA 12+: creates the primary context now
    return cudaSuccess;
  }
  cudaError_t DeviceGetPCIBusId(char* bus_id, int len, int device) override {
    Lock lock(this, "cudaDeviceGetPCIBusId");
    if (cudaError_t e = lock.injected()) return e;
    if (device < 0 || device >= device_count_) return cudaErrorInvalidDevice;
    // Upper-case hex, as the real call returns it.
    if (static_cast<size_t>(device) < pci_bus_ids_.size()) {
      std::snprintf(bus_id, static_cast<size_t>(len), "%s",
                    pci_bus_ids_[static_cast<size_t>(device)].c_str());
      return cudaSuccess;
    }
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
    if (cudaError_t e = lock.context()) return e;
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
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaMalloc")) return e;
    if (bytes == 0) return Violation(cudaErrorInvalidValue, "cudaMalloc(0) hands back null");
    const int device = Thread().current;
    std::shared_ptr<Mapping> mapping;
    uintptr_t address = 0;
    if (suballocate_ && bytes <= kArenaBytes / 4) {
      Device& d = devices_[static_cast<size_t>(device)];
      const size_t rounded = (bytes + 255) / 256 * 256;
      if (d.arena == nullptr || d.arena_used + rounded > kArenaBytes) {
        d.arena = NewMapping(kArenaBytes);
        d.arena_used = 256;  // not page-aligned from the first one on
      }
      mapping = d.arena;
      address = reinterpret_cast<uintptr_t>(mapping->base) + d.arena_used;
      d.arena_used += rounded;
    } else {
      mapping = NewMapping(RoundUp(bytes));
      address = reinterpret_cast<uintptr_t>(mapping->base);
    }
    {
      Window window(this, mapping.get());
      std::memset(reinterpret_cast<void*>(address), 0xAB, bytes);  // not zeroed
    }
    allocations_[address] = {bytes, device, 0, std::move(mapping)};
    *ptr = reinterpret_cast<void*>(address);
    return cudaSuccess;
  }
  cudaError_t Free(void* ptr) override {
    Lock lock(this, "cudaFree");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaFree")) return e;
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(ptr));
    // cudaFree waits for the whole device first.
    if (cudaError_t e =
            DeviceSync(a != nullptr && a->device >= 0 ? a->device : Thread().current, "cudaFree")) {
      return e;
    }
    return Release(ptr, /*device=*/true);
  }
  cudaError_t HostAlloc(void** ptr, size_t bytes, unsigned int flags) override {
    Lock lock(this, "cudaHostAlloc");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaHostAlloc")) return e;
    if (bytes == 0) return Violation(cudaErrorInvalidValue, "cudaHostAlloc(0)");
    // Pinning pages changes every context's mappings: it waits for the device.
    if (cudaError_t e = DeviceSync(Thread().current, "cudaHostAlloc")) return e;
    void* p = std::aligned_alloc(kPage, RoundUp(bytes));
    std::memset(p, 0xCD, RoundUp(bytes));
    allocations_[reinterpret_cast<uintptr_t>(p)] = {bytes, -1, flags, nullptr};
    *ptr = p;
    return cudaSuccess;
  }
  cudaError_t FreeHost(void* ptr) override {
    Lock lock(this, "cudaFreeHost");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaFreeHost")) return e;
    if (cudaError_t e = DeviceSync(Thread().current, "cudaFreeHost")) return e;
    return Release(ptr, /*device=*/false);
  }
  cudaError_t HostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned int flags) override {
    Lock lock(this, "cudaHostGetDevicePointer");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
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
    if (cudaError_t e = lock.context()) return e;
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
  // cudaMemcpy: work on the legacy default stream of the current device. When
  // it returns follows the CUDA runtime's "API synchronization behavior".
  cudaError_t Memcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) override {
    Lock lock(this, "cudaMemcpy");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaMemcpy")) return e;
    if (cudaError_t e = Sticky(Thread().current)) return e;
    if (cudaError_t e = CheckCopy(dst, src, bytes, kind, "cudaMemcpy")) return e;
    FakeStream* legacy = devices_[static_cast<size_t>(Thread().current)].legacy;
    if (cudaError_t e = CheckLegacyCapture(legacy->device, "cudaMemcpy")) return e;
    const Where from = Classify(src), to = Classify(dst);
    Op op = CopyOp(dst, src, bytes, from == Where::kPageable);
    Enqueue(legacy, std::move(op));
    const uint64_t seq = legacy->enqueued;
    if (from == Where::kDevice && to == Where::kDevice) return cudaSuccess;  // no host sync
    if (to == Where::kDevice && from == Where::kPageable) {
      // Staged, after a sync with the stream; the DMA may not have landed.
      return WaitFor([&] { return AdvanceDeps(legacy, seq); }, "cudaMemcpy (pageable to device)",
                     legacy);
    }
    return WaitFor([&] { return Advance(legacy, seq); }, "cudaMemcpy", legacy);
  }
  cudaError_t MemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                          cudaStream_t stream) override {
    Lock lock(this, "cudaMemcpyAsync");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    FakeStream* s = StreamForCall(stream, "cudaMemcpyAsync");
    if (s == nullptr) return cudaErrorInvalidResourceHandle;
    if (cudaError_t e = Sticky(s->device)) return e;
    if (cudaError_t e = CheckCopy(dst, src, bytes, kind, "cudaMemcpyAsync")) return e;
    if (s->legacy) {
      if (cudaError_t e = CheckLegacyCapture(s->device, "cudaMemcpyAsync")) return e;
    }
    const Where from = Classify(src), to = Classify(dst);
    if (s->capturing && (from == Where::kPageable || to == Where::kPageable)) {
      s->capture_invalidated = true;
      return Violation(cudaErrorStreamCaptureUnsupported, "captured copy with pageable memory");
    }
    // Into pageable memory the call returns only once the copy is done.
    const bool synchronous = to == Where::kPageable && !s->capturing;
    if (synchronous) {
      if (cudaError_t e = Unsafe("cudaMemcpyAsync into pageable memory")) return e;
    }
    Enqueue(s, CopyOp(dst, src, bytes, from == Where::kPageable));
    if (synchronous) {
      const uint64_t seq = s->enqueued;
      return WaitFor([&] { return Advance(s, seq); }, "cudaMemcpyAsync into pageable memory", s);
    }
    return cudaSuccess;
  }

  // --- Runtime: streams and events -------------------------------------------
  cudaError_t StreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) override {
    Lock lock(this, "cudaStreamCreate");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    *stream = NewStream(flags, 0);
    return cudaSuccess;
  }
  cudaError_t DeviceGetStreamPriorityRange(int* least, int* greatest) override {
    Lock lock(this, "cudaDeviceGetStreamPriorityRange");
    if (cudaError_t e = lock.injected()) return e;
    *least = kLeastPriority;
    *greatest = kGreatestPriority;
    return cudaSuccess;
  }
  cudaError_t StreamCreateWithPriority(cudaStream_t* stream, unsigned int flags,
                                       int priority) override {
    Lock lock(this, "cudaStreamCreate");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    // CUDA clamps out-of-range priorities.
    *stream = NewStream(flags, std::clamp(priority, kGreatestPriority, kLeastPriority));
    return cudaSuccess;
  }
  cudaError_t StreamSynchronize(cudaStream_t stream) override {
    Lock lock(this, "cudaStreamSynchronize");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaStreamSynchronize")) return e;
    FakeStream* s = StreamForCall(stream, "cudaStreamSynchronize");
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "StreamSynchronize handle");
    if (s->capturing) {
      s->capture_invalidated = true;
      return Violation(cudaErrorStreamCaptureUnsupported,
                       "StreamSynchronize on a capturing stream");
    }
    const uint64_t seq = s->enqueued;
    return WaitFor([&] { return Advance(s, seq); }, "cudaStreamSynchronize", s);
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override {
    Lock lock(this, "cudaStreamDestroy");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = LiveStream(stream);
    if (s == nullptr || s->legacy) {
      return Violation(cudaErrorInvalidResourceHandle, "StreamDestroy twice / of a legacy stream");
    }
    s->destroyed = true;  // like CUDA, queued work still runs (RunAll)
    return cudaSuccess;
  }
  cudaError_t StreamQuery(cudaStream_t stream) override {
    Lock lock(this, "cudaStreamQuery");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaStreamQuery")) return e;
    FakeStream* s = StreamForCall(stream, "cudaStreamQuery");
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "StreamQuery handle");
    if (s->capturing) {
      s->capture_invalidated = true;
      return Violation(cudaErrorStreamCaptureUnsupported, "StreamQuery on a capturing stream");
    }
    if (cudaError_t e = Sticky(s->device)) return e;
    return s->completed >= s->enqueued ? cudaSuccess : cudaErrorNotReady;
  }
  cudaError_t StreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) override {
    Lock lock(this, "cudaStreamIsCapturing");
    if (cudaError_t e = lock.injected()) return e;
    FakeStream* s = StreamForCall(stream, "cudaStreamIsCapturing");
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "StreamIsCapturing");
    *status = !s->capturing            ? cudaStreamCaptureStatusNone
              : s->capture_invalidated ? cudaStreamCaptureStatusInvalidated
                                       : cudaStreamCaptureStatusActive;
    return cudaSuccess;
  }
  cudaError_t LaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) override {
    Lock lock(this, "cudaLaunchHostFunc");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    FakeStream* s = StreamForCall(stream, "cudaLaunchHostFunc");
    if (s == nullptr) return Violation(cudaErrorInvalidResourceHandle, "LaunchHostFunc");
    if (cudaError_t e = Sticky(s->device)) return e;
    Enqueue(s, {"host_func", [this, fn, user_data] {
                  // CUDA forbids CUDA calls from a host function.
                  in_host_func_ = std::this_thread::get_id();
                  fn(user_data);
                  in_host_func_ = std::thread::id();
                  return true;
                }});
    return cudaSuccess;
  }
  cudaError_t EventCreateWithFlags(cudaEvent_t* event, unsigned int flags) override {
    Lock lock(this, "cudaEventCreate");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    auto ev = std::make_unique<FakeEvent>();
    ev->device = Thread().current;
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
    if (cudaError_t e = lock.context()) return e;
    FakeEvent* ev = Event(event);
    FakeStream* s = StreamForCall(stream, "cudaEventRecord");
    if (ev == nullptr || s == nullptr) {
      return Violation(cudaErrorInvalidResourceHandle, "EventRecord handle");
    }
    if (ev->device != s->device) {
      return Violation(cudaErrorInvalidResourceHandle, "EventRecord across devices");
    }
    if (cudaError_t e = Sticky(s->device)) return e;
    if (s->legacy) {
      if (cudaError_t e = CheckLegacyCapture(s->device, "cudaEventRecord")) return e;
    }
    const uint64_t generation = ++ev->recorded;
    Enqueue(s, {"event_record", [ev, generation] {
                  ev->completed = std::max(ev->completed, generation);
                  return true;
                }});
    return cudaSuccess;
  }
  cudaError_t EventQuery(cudaEvent_t event) override {
    Lock lock(this, "cudaEventQuery");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("cudaEventQuery")) return e;
    FakeEvent* ev = Event(event);
    if (ev == nullptr) return Violation(cudaErrorInvalidResourceHandle, "EventQuery handle");
    if (cudaError_t e = Sticky(ev->device)) return e;
    return ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
  }
  cudaError_t ThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) override {
    Lock lock(this, "cudaThreadExchangeStreamCaptureMode");
    if (cudaError_t e = lock.injected()) return e;
    std::swap(Thread().capture_mode, *mode);
    return cudaSuccess;
  }
  // The real runtime's tables: they need no driver.
  const char* GetErrorName(cudaError_t error) override { return cudaGetErrorName(error); }
  const char* GetErrorString(cudaError_t error) override { return cudaGetErrorString(error); }

  // --- Kernels ----------------------------------------------------------------
  cudaError_t LaunchWaitFlagKernel(cudaStream_t stream, const uint32_t* flag,
                                   uint32_t value) override {
    Lock lock(this, "wait_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = CheckLaunch(stream, flag, "wait_kernel")) return e;
    FakeStream* s = StreamForCall(stream, "wait kernel");
    const uint32_t* word = static_cast<const uint32_t*>(Resolve(flag));
    std::shared_ptr<Mapping> mapping = MappingOf(word);
    Enqueue(s, {"wait_kernel", [this, word, value, mapping] {
                  Window window(this, mapping.get());
                  return static_cast<int32_t>(Load(word) - value) >= 0;
                }});
    return cudaSuccess;
  }
  cudaError_t LaunchSignalFlagKernel(cudaStream_t stream, uint32_t* flag, uint32_t value) override {
    Lock lock(this, "signal_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = CheckLaunch(stream, flag, "signal_kernel")) return e;
    FakeStream* s = StreamForCall(stream, "signal kernel");
    auto* word = static_cast<uint32_t*>(Resolve(flag));
    std::shared_ptr<Mapping> mapping = MappingOf(word);
    Enqueue(s, {"signal_kernel", [this, word, value, mapping] {
                  Window window(this, mapping.get());
                  Store(word, value);
                  return true;
                }});
    return cudaSuccess;
  }
  cudaError_t LaunchWaitNextFlagKernel(cudaStream_t stream, const uint32_t* counter,
                                       uint32_t* cursor) override {
    Lock lock(this, "wait_next_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = CheckLaunch(stream, counter, "wait_next_kernel")) return e;
    if (cudaError_t e = CheckLaunch(stream, cursor, "wait_next_kernel")) return e;
    FakeStream* s = StreamForCall(stream, "wait next kernel");
    const uint32_t* count = static_cast<const uint32_t*>(Resolve(counter));
    auto* at = static_cast<uint32_t*>(Resolve(cursor));
    std::shared_ptr<Mapping> count_mapping = MappingOf(count), at_mapping = MappingOf(at);
    Enqueue(s, {"wait_next_kernel", [this, count, at, count_mapping, at_mapping] {
                  Window a(this, count_mapping.get());
                  Window b(this, at_mapping.get());
                  const uint32_t target = Load(at) + 1;
                  if (static_cast<int32_t>(Load(count) - target) < 0) return false;
                  Store(at, target);
                  return true;
                }});
    return cudaSuccess;
  }
  cudaError_t LaunchWaitCounterKernel(cudaStream_t stream, const int64_t* counter,
                                      const int64_t* target) override {
    Lock lock(this, "wait_counter_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = CheckLaunch(stream, counter, "wait_counter_kernel")) return e;
    if (cudaError_t e = CheckLaunch(stream, target, "wait_counter_kernel")) return e;
    FakeStream* s = StreamForCall(stream, "wait counter kernel");
    const auto* count = static_cast<const int64_t*>(Resolve(counter));
    const auto* want = static_cast<const int64_t*>(Resolve(target));
    std::shared_ptr<Mapping> count_mapping = MappingOf(count), want_mapping = MappingOf(want);
    Enqueue(s, {"wait_counter_kernel", [this, count, want, count_mapping, want_mapping] {
                  Window a(this, count_mapping.get());
                  Window b(this, want_mapping.get());
                  return std::atomic_ref<const int64_t>(*count).load(std::memory_order_acquire) >=
                         std::atomic_ref<const int64_t>(*want).load(std::memory_order_acquire);
                }});
    return cudaSuccess;
  }
  cudaError_t LaunchIncrementCounterKernel(cudaStream_t stream, int64_t* counter) override {
    Lock lock(this, "increment_counter_kernel");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = CheckLaunch(stream, counter, "increment_counter_kernel")) return e;
    FakeStream* s = StreamForCall(stream, "increment counter kernel");
    auto* word = static_cast<int64_t*>(Resolve(counter));
    std::shared_ptr<Mapping> mapping = MappingOf(word);
    Enqueue(s, {"increment_counter_kernel", [this, word, mapping] {
                  Window window(this, mapping.get());
                  std::atomic_ref<int64_t>(*word).fetch_add(1, std::memory_order_acq_rel);
                  return true;
                }});
    return cudaSuccess;
  }
  cudaError_t LoadFlagKernels() override {
    Lock lock(this, "LoadFlagKernels");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (cudaError_t e = Unsafe("loading the flag kernels")) return e;
    const int device = Thread().current;
    for (const char* kernel : {"wait_kernel", "wait_next_kernel", "wait_counter_kernel",
                               "increment_counter_kernel", "signal_kernel"}) {
      if (cudaError_t e = Load(device, kernel)) return e;
    }
    return cudaSuccess;
  }
  cudaError_t LoadKernel(const void* kernel) override {
    Lock lock(this, "cudaFuncGetAttributes");
    if (cudaError_t e = lock.injected()) return e;
    if (cudaError_t e = lock.context()) return e;
    if (kernel == nullptr) return cudaErrorInvalidDeviceFunction;
    if (cudaError_t e = Unsafe("loading a kernel")) return e;
    return Load(Thread().current, KernelName(kernel));
  }
  static std::string KernelName(const void* kernel) {
    char name[32];
    std::snprintf(name, sizeof(name), "kernel@%p", kernel);
    return name;
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
    if ((flags & CU_STREAM_WAIT_VALUE_FLUSH) && Attribute(cudaDevAttrCanFlushRemoteWrites) == 0) {
      Violation(cudaErrorInvalidValue, "CU_STREAM_WAIT_VALUE_FLUSH on a device that cannot flush");
      return CUDA_ERROR_INVALID_VALUE;
    }
    memops_.push_back({"wait", static_cast<uintptr_t>(addr), value, flags});
    auto* word = static_cast<const uint32_t*>(Resolve(reinterpret_cast<void*>(addr)));
    std::shared_ptr<Mapping> mapping = MappingOf(word);
    Enqueue(LiveStream(reinterpret_cast<cudaStream_t>(stream)),
            {"wait_value", [this, word, value, mapping] {
               Window window(this, mapping.get());
               return static_cast<int32_t>(Load(word) - value) >= 0;
             }});
    return CUDA_SUCCESS;
  }
  CUresult StreamWriteValue32(CUstream stream, CUdeviceptr addr, uint32_t value,
                              unsigned int flags) override {
    Lock lock(this, "cuStreamWriteValue32");
    if (CUresult r = lock.injected_driver()) return r;
    if (CUresult r = CheckMemOp(stream, addr, flags, "write")) return r;
    memops_.push_back({"write", static_cast<uintptr_t>(addr), value, flags});
    auto* word = static_cast<uint32_t*>(Resolve(reinterpret_cast<void*>(addr)));
    std::shared_ptr<Mapping> mapping = MappingOf(word);
    Enqueue(LiveStream(reinterpret_cast<cudaStream_t>(stream)),
            {"write_value", [this, word, value, mapping] {
               Window window(this, mapping.get());
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
    // The driver exports whole pages of device memory; it does not care which
    // allocations they hold, so every page must be device memory but may
    // span more than one allocation (the danger the caller must avoid).
    bool device_pages = bytes != 0;
    for (uintptr_t page = address; device_pages && page < address + bytes; page += kPage) {
      device_pages = MappedDevicePage(page);
    }
    if (type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD || flags != 0 || address % kPage != 0 ||
        bytes % kPage != 0 || !device_pages) {
      Violation(cudaErrorInvalidValue, "dma-buf range not page aligned / not device memory");
      return CUDA_ERROR_INVALID_VALUE;
    }
    exported_.push_back({address, bytes});
    *static_cast<int*>(handle) = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return CUDA_SUCCESS;
  }
  CUresult CtxGetCurrent(CUcontext* context) override {
    Lock lock(this, "cuCtxGetCurrent");
    if (CUresult r = lock.injected_driver()) return r;
    if (!has_ctx_queries_) return CUDA_ERROR_NOT_FOUND;
    const int current = Thread().current;
    *context = current < 0 ? nullptr : ContextHandle(current);
    return CUDA_SUCCESS;
  }
  CUresult CtxSetCurrent(CUcontext context) override {
    Lock lock(this, "cuCtxSetCurrent");
    if (CUresult r = lock.injected_driver()) return r;
    if (!has_ctx_queries_) return CUDA_ERROR_NOT_FOUND;
    if (context == nullptr) {
      Thread().current = -1;
      return CUDA_SUCCESS;
    }
    const intptr_t device = reinterpret_cast<intptr_t>(context) - kContextBase;
    if (device < 0 || device >= device_count_ || !devices_[static_cast<size_t>(device)].context) {
      Violation(cudaErrorInvalidValue, "cuCtxSetCurrent with an unknown context");
      return CUDA_ERROR_INVALID_CONTEXT;
    }
    Thread().current = static_cast<int>(device);
    return CUDA_SUCCESS;
  }
  CUresult MemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) override {
    Lock lock(this, "cuMemGetAddressRange");
    if (CUresult r = lock.injected_driver()) return r;
    auto it = allocations_.upper_bound(static_cast<uintptr_t>(ptr));
    if (it == allocations_.begin()) return CUDA_ERROR_NOT_FOUND;
    --it;
    if (it->second.device < 0 || static_cast<uintptr_t>(ptr) >= it->first + it->second.bytes) {
      return CUDA_ERROR_NOT_FOUND;
    }
    *base = static_cast<CUdeviceptr>(it->first);
    *size = it->second.bytes;
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
  static constexpr size_t kArenaBytes = size_t{1} << 20;
  static constexpr intptr_t kContextBase = 0x1000;

  struct ThreadState {
    int current = -1;  // no context
    cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
  };
  struct Device {
    bool context = false;  // primary context created
    cudaError_t sticky = cudaSuccess;
    FakeStream* legacy = nullptr;
    std::set<std::string> loaded;
    std::shared_ptr<Mapping> arena;
    size_t arena_used = 0;
  };
  enum class Where : uint8_t { kDevice, kPinned, kPageable };

  // Locks the fake, counts the call and pops an injected failure.
  class Lock {
   public:
    Lock(FakeCudaApi* api, const char* name) : api_(api), guard_(api->mu_), name_(name) {
      ++api_->depth_;
      ++api_->calls_[name_];
      if (api_->in_host_func_ == std::this_thread::get_id()) {
        api_->Violation(cudaErrorNotPermitted, name_ + " called from a host function");
      }
    }
    ~Lock() { --api_->depth_; }
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
    // The runtime needs a context: a thread without one gets device 0's.
    cudaError_t context() {
      if (api_->Thread().current < 0) {
        if (api_->device_count_ == 0) return cudaErrorNoDevice;
        api_->MakeCurrent(0);
      }
      return cudaSuccess;
    }

   private:
    FakeCudaApi* api_;
    std::lock_guard<std::recursive_mutex> guard_;
    std::string name_;
  };

  // Opens the pages of fake device memory while an operation touches them.
  class Window {
   public:
    Window(FakeCudaApi* api, Mapping* mapping) : mapping_(mapping) {
      (void)api;
      if (mapping_ != nullptr && !mapping_->always_open && mapping_->open++ == 0) {
        ::mprotect(mapping_->base, mapping_->bytes, PROT_READ | PROT_WRITE);
      }
    }
    ~Window() {
      if (mapping_ != nullptr && !mapping_->always_open && --mapping_->open == 0) {
        ::mprotect(mapping_->base, mapping_->bytes, PROT_NONE);
      }
    }
    Window(const Window&) = delete;
    Window& operator=(const Window&) = delete;

   private:
    Mapping* mapping_;
  };

  static size_t RoundUp(size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
  static uint32_t Load(const uint32_t* word) {
    return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_acquire);
  }
  static void Store(uint32_t* word, uint32_t value) {
    std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
  }
  static CUcontext ContextHandle(int device) {
    return reinterpret_cast<CUcontext>(kContextBase + device);
  }

  ThreadState& Thread() { return threads_[std::this_thread::get_id()]; }
  void MakeCurrent(int device) {
    devices_[static_cast<size_t>(device)].context = true;
    Thread().current = device;
  }
  int Attribute(cudaDeviceAttr attr) {
    auto it = attributes_.find(attr);
    return it == attributes_.end() ? 0 : it->second;
  }
  cudaError_t Sticky(int device) {
    return device < 0 ? cudaSuccess : devices_[static_cast<size_t>(device)].sticky;
  }

  cudaError_t Violation(cudaError_t error, const std::string& what) {
    violations_.push_back(what);
    return error;
  }

  std::shared_ptr<Mapping> NewMapping(size_t bytes) {
    auto mapping = std::make_shared<Mapping>();
    mapping->bytes = bytes;
    mapping->always_open = host_accessible_;
    mapping->base = ::mmap(nullptr, bytes, host_accessible_ ? PROT_READ | PROT_WRITE : PROT_NONE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping->base == MAP_FAILED) std::abort();
    return mapping;
  }
  const Allocation* Find(uintptr_t address) {
    auto it = allocations_.upper_bound(address);
    if (it == allocations_.begin()) return nullptr;
    --it;
    return address < it->first + it->second.bytes ? &it->second : nullptr;
  }
  bool MappedDevicePage(uintptr_t page) {
    for (auto& [address, a] : allocations_) {
      if (a.device < 0) continue;
      const auto base = reinterpret_cast<uintptr_t>(a.mapping->base);
      if (page >= base && page < base + a.mapping->bytes) return true;
    }
    return false;
  }
  std::shared_ptr<Mapping> MappingOf(const void* ptr) {
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(ptr));
    return a == nullptr ? nullptr : a->mapping;
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
  Where Classify(const void* ptr) {
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(Resolve(ptr)));
    if (a == nullptr) return Where::kPageable;
    return a->device >= 0 ? Where::kDevice : Where::kPinned;
  }

  cudaError_t Release(void* ptr, bool device) {
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocations_.end() || (it->second.device >= 0) != device) {
      return Violation(cudaErrorInvalidValue, device ? "cudaFree of a non-device pointer"
                                                     : "cudaFreeHost of a non-host pointer");
    }
    if (!device) std::free(ptr);
    allocations_.erase(it);  // the mapping goes with its last user
    return cudaSuccess;
  }

  // A copy as a stream operation. A pageable source is staged at the call,
  // as the runtime does; device pages are opened only while it runs.
  Op CopyOp(void* dst, const void* src, size_t bytes, bool stage_source) {
    void* to = Resolve(dst);
    const void* from = Resolve(src);
    std::shared_ptr<Mapping> to_mapping = MappingOf(to), from_mapping = MappingOf(from);
    std::shared_ptr<std::vector<char>> staged;
    if (stage_source) {
      staged = std::make_shared<std::vector<char>>(static_cast<const char*>(from),
                                                   static_cast<const char*>(from) + bytes);
    }
    return {"memcpy", [this, to, from, bytes, to_mapping, from_mapping, staged] {
              Window a(this, to_mapping.get());
              Window b(this, from_mapping.get());
              const void* source = staged ? staged->data() : from;
              if (bytes == sizeof(uint32_t) && reinterpret_cast<uintptr_t>(to) % 4 == 0) {
                // A 4-byte aligned DMA write lands whole: a host polling the
                // word (a copy-engine ready event) sees old or new, never torn.
                uint32_t word;
                std::memcpy(&word, source, sizeof(word));
                Store(static_cast<uint32_t*>(to), word);
              } else {
                std::memcpy(to, source, bytes);
              }
              return true;
            }};
  }

  cudaError_t CheckCopy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                        const char* what) {
    const void* to = Resolve(dst);
    const void* from = Resolve(src);
    const Allocation* d = Find(reinterpret_cast<uintptr_t>(to));
    const Allocation* s = Find(reinterpret_cast<uintptr_t>(from));
    auto on_device = [](const Allocation* a) { return a != nullptr && a->device >= 0; };
    if (kind == cudaMemcpyDeviceToHost && (!on_device(s) || on_device(d))) {
      return Violation(cudaErrorInvalidMemcpyDirection, std::string(what) + " D2H direction");
    }
    if (kind == cudaMemcpyHostToDevice && (on_device(s) || !on_device(d))) {
      return Violation(cudaErrorInvalidMemcpyDirection, std::string(what) + " H2D direction");
    }
    // Bounds: a copy stays inside the allocations it touches.
    for (auto [ptr, a] : {std::pair{to, d}, std::pair{from, s}}) {
      if (a == nullptr) continue;
      auto it = allocations_.upper_bound(reinterpret_cast<uintptr_t>(ptr));
      --it;
      if (reinterpret_cast<uintptr_t>(ptr) + bytes > it->first + a->bytes) {
        return Violation(cudaErrorInvalidValue, std::string(what) + " of " + std::to_string(bytes) +
                                                    " bytes runs past the end of a " +
                                                    std::to_string(a->bytes) + "-byte allocation");
      }
    }
    return cudaSuccess;
  }

  cudaError_t CheckLaunch(cudaStream_t stream, const void* flag, const char* what) {
    FakeStream* s = StreamForCall(stream, what);
    if (s == nullptr) {
      return Violation(cudaErrorInvalidResourceHandle, std::string(what) + " stream");
    }
    if (Thread().current != s->device) {
      return Violation(cudaErrorInvalidResourceHandle,
                       std::string(what) + " launched with another device current");
    }
    if (cudaError_t e = Sticky(s->device)) return e;
    const Allocation* a = Find(reinterpret_cast<uintptr_t>(flag));
    if (!IsDeviceAlias(flag) && (a == nullptr || a->device < 0)) {
      return Violation(cudaErrorIllegalAddress,
                       std::string(what) + " given a host pointer instead of a device alias");
    }
    if (s->legacy) {
      if (cudaError_t e = CheckLegacyCapture(s->device, what)) return e;
    }
    // Lazy loading: a kernel's first launch loads it, waiting for the device.
    return Load(s->device, what);
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
    if (Sticky(s->device) != cudaSuccess) return CUDA_ERROR_ILLEGAL_ADDRESS;
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

  // Loads `kernel` into `device`'s context if it is not yet: waits for the
  // whole device first, as a module load does.
  cudaError_t Load(int device, const std::string& kernel) {
    Device& d = devices_[static_cast<size_t>(device)];
    if (d.loaded.count(kernel) != 0) return cudaSuccess;
    if (cudaError_t e = DeviceSync(device, "loading " + kernel)) return e;
    d.loaded.insert(kernel);
    return cudaSuccess;
  }

  // "Potentially unsafe" calls under stream capture (see
  // cudaThreadExchangeStreamCaptureMode): refused, and the capture is broken.
  cudaError_t Unsafe(const std::string& call) {
    const ThreadState& thread = Thread();
    if (thread.capture_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
    const std::thread::id self = std::this_thread::get_id();
    bool refused = false;
    for (auto& [handle, s] : streams_) {
      if (!s->capturing || s->capture_mode == cudaStreamCaptureModeRelaxed) continue;
      const bool own = s->capture_thread == self;
      const bool global_elsewhere = thread.capture_mode == cudaStreamCaptureModeGlobal &&
                                    s->capture_mode == cudaStreamCaptureModeGlobal;
      if (own || global_elsewhere) {
        s->capture_invalidated = true;
        refused = true;
      }
    }
    if (!refused) return cudaSuccess;
    return Violation(cudaErrorStreamCaptureUnsupported,
                     call + " while a stream is being captured: invalidates the capture");
  }
  // Legacy-stream work while one of the device's blocking streams is being
  // captured would join the capture implicitly: refused, capture broken.
  cudaError_t CheckLegacyCapture(int device, const std::string& call) {
    for (auto& [handle, s] : streams_) {
      if (s->device == device && s->capturing && !(s->flags & cudaStreamNonBlocking)) {
        s->capture_invalidated = true;
        return Violation(cudaErrorStreamCaptureImplicit,
                         call + " on the legacy stream while a blocking stream is captured");
      }
    }
    return cudaSuccess;
  }

  cudaStream_t NewStream(unsigned int flags, int priority) {
    auto s = std::make_unique<FakeStream>();
    s->id = next_stream_id_++;
    s->device = Thread().current;
    s->flags = flags;
    s->priority = priority;
    if (hardware_queues_ > 0 && s->device >= 0) {
      s->queue = queue_cursor_[s->device]++ % hardware_queues_;
    }
    auto* handle = reinterpret_cast<cudaStream_t>(s.get());
    streams_[s.get()] = std::move(s);
    return handle;
  }
  FakeStream* Stream(cudaStream_t stream) {
    if (stream == nullptr || stream == cudaStreamLegacy) {
      const int current = std::max(Thread().current, 0);
      return current < device_count_ ? devices_[static_cast<size_t>(current)].legacy : nullptr;
    }
    auto it = streams_.find(reinterpret_cast<FakeStream*>(stream));
    return it == streams_.end() ? nullptr : it->second.get();
  }
  FakeStream* LiveStream(cudaStream_t stream) {
    FakeStream* s = Stream(stream);
    return s == nullptr || s->destroyed ? nullptr : s;
  }
  FakeStream* StreamForCall(cudaStream_t stream, const std::string& call) {
    if (stream == cudaStreamPerThread) {
      Violation(cudaErrorNotSupported, call + ": the per-thread default stream is not modelled");
      return nullptr;
    }
    return LiveStream(stream);
  }
  FakeEvent* Event(cudaEvent_t event) {
    auto it = events_.find(reinterpret_cast<FakeEvent*>(event));
    return it == events_.end() ? nullptr : it->second.get();
  }

  // Appends `op` to `s` with the implicit dependencies of the legacy stream:
  // legacy work waits for every blocking stream of the device, and blocking
  // streams' work waits for the legacy stream.
  void Enqueue(FakeStream* s, Op op) {
    if (s->capturing) {
      s->captured.push_back(std::move(op));
      return;
    }
    op.seq = ++s->enqueued;
    op.tick = ++tick_;
    op.holds_queue = op.name == "wait_value";
    const bool blocking = !(s->flags & cudaStreamNonBlocking);
    for (auto& [handle, other] : streams_) {
      FakeStream* t = other.get();
      if (t == s || t->device != s->device || t->completed >= t->enqueued) continue;
      const bool t_blocking = !(t->flags & cudaStreamNonBlocking);
      if ((s->legacy && t_blocking && !t->legacy) || (blocking && !s->legacy && t->legacy)) {
        op.deps.push_back({t, t->enqueued});
      }
    }
    s->ops.push_back(std::move(op));
  }

  // Runs `s` up to op `upto`, and first whatever that depends on. False when
  // something is blocked (a wait not yet satisfied, or a faulted device).
  bool Advance(FakeStream* s, uint64_t upto) {
    while (s->completed < upto) {
      if (s->ops.empty() || Sticky(s->device) != cudaSuccess) return false;
      Op& op = s->ops.front();
      if (!AdvanceDeps(s, op.seq)) return false;
      if (QueueBlocker(s, op) != nullptr) return false;
      if (!op.run()) return false;
      s->completed = op.seq;
      s->ops.pop_front();
      ++ops_run_;
    }
    return true;
  }
  // The stream whose unsatisfied memop wait, enqueued before `op`, sits at
  // the head of the hardware queue `s` shares with it; null when none.
  FakeStream* QueueBlocker(FakeStream* s, const Op& op) {
    if (s->queue < 0) return nullptr;
    for (auto& [handle, other] : streams_) {
      FakeStream* t = other.get();
      if (t == s || t->device != s->device || t->queue != s->queue || t->ops.empty()) continue;
      const Op& head = t->ops.front();
      if (!head.holds_queue || head.tick > op.tick) continue;
      if (!Advance(t, head.seq)) return t;  // still waiting: the queue is stuck behind it
    }
    return nullptr;
  }
  // Runs what op `seq` of `s` waits for, but not the op itself (nor the ops
  // before it on `s`, which must be done already for it to count).
  bool AdvanceDeps(FakeStream* s, uint64_t seq) {
    if (s->completed + 1 < seq && !Advance(s, seq - 1)) return false;
    for (const Op& op : s->ops) {
      if (op.seq != seq) continue;
      for (const Dep& dep : op.deps) {
        if (!Advance(dep.stream, dep.seq)) return false;
      }
    }
    return true;
  }
  // Every stream of `device` up to its latest work (cudaDeviceSynchronize).
  cudaError_t DeviceSync(int device, const std::string& why) {
    if (device < 0) return cudaSuccess;
    return WaitFor(
        [&] {
          bool done = true;
          for (auto& [handle, s] : streams_) {
            if (s->device == device && !Advance(s.get(), s->enqueued)) done = false;
          }
          return done;
        },
        why + " (waits for the whole device)", nullptr, device);
  }

  // Drives `progress` until it reports done. A synchronous call blocked for
  // hang_timeout_ would block forever on a GPU: recorded, and it fails.
  template <typename Progress>
  cudaError_t WaitFor(Progress progress, const std::string& what, FakeStream* stream,
                      int device = -1) {
    if (device < 0 && stream != nullptr) device = stream->device;
    const auto deadline = std::chrono::steady_clock::now() + hang_timeout_;
    for (;;) {
      if (cudaError_t e = Sticky(device)) return e;
      if (progress()) return cudaSuccess;
      if (depth_ > 1 || std::chrono::steady_clock::now() >= deadline) {
        return Violation(cudaErrorLaunchTimeout,
                         what + " would hang: blocked behind " + Blocker(stream, device));
      }
      // Let other threads (the test, another thread raising a flag) move.
      mu_.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      mu_.lock();
    }
  }
  // What a blocked stream ultimately waits for: its first op, or the op of
  // another stream that op depends on (the legacy stream's implicit waits).
  std::string Blocker(FakeStream* s, int device) {
    if (s == nullptr) {
      for (auto& [handle, t] : streams_) {
        if (t->device == device && t->completed < t->enqueued) return Blocker(t.get(), device);
      }
      return "nothing visible";
    }
    for (int hops = 0; hops < 16 && !s->ops.empty(); ++hops) {
      const Op& op = s->ops.front();
      FakeStream* next = nullptr;
      for (const Dep& dep : op.deps) {
        if (dep.stream->completed < dep.seq) next = dep.stream;
      }
      if (next == nullptr) next = QueueBlocker(s, op);
      if (next == nullptr) break;
      s = next;
    }
    const std::string queue =
        s->queue >= 0 ? " on hardware queue " + std::to_string(s->queue) : std::string();
    return "'" + (s->ops.empty() ? std::string("?") : s->ops.front().name) + "'" + queue + " on " +
           (s->legacy
                ? std::string("the legacy default stream")
                : "stream " + std::to_string(s->id) +
                      ((s->flags & cudaStreamNonBlocking) ? " (non-blocking)" : " (blocking)"));
  }

  std::recursive_mutex mu_;
  int depth_ = 0;  // nesting of Lock on the owning thread
  std::thread::id in_host_func_;
  int device_count_;
  cudaError_t device_count_error_ = cudaSuccess;
  bool has_memops_ = true;
  bool has_dmabuf_ = true;
  bool has_ctx_queries_ = true;
  bool host_accessible_ = false;
  bool suballocate_ = false;
  std::chrono::milliseconds hang_timeout_{1000};
  int next_stream_id_ = 1;
  int hardware_queues_ = 0;
  std::map<int, int> queue_cursor_;  // per device: streams given a queue so far
  uint64_t tick_ = 0;
  uint64_t ops_run_ = 0;
  std::vector<Device> devices_;
  std::map<cudaDeviceAttr, int> attributes_;
  std::vector<std::string> pci_bus_ids_;
  std::map<std::thread::id, ThreadState> threads_;
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
