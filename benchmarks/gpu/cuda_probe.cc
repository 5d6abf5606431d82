// cuda_probe: what a GPU host offers the CUDA backend and GPUDirect RDMA
// (issue 31, item 10), printed one fact per line for the device checks:
//   - GPUDirect RDMA support, write ordering, flush options, CanFlushRemoteWrites;
//   - dma-buf support, stream memory operations (wait, NOR), VMM + GPUDirect;
//   - cuMemGetHandleForAddressRange(dma-buf) on a cudaMalloc allocation, on a
//     cuMemCreate mapping (what PyTorch's expandable_segments makes), and on
//     one made with gpuDirectRDMACapable.
// Driver calls are resolved through the runtime (no libcuda link), as the
// backend does. Exits 77 without a GPU, 1 when a cudaMalloc allocation cannot
// be exported as a dma-buf (the basic GPUDirect path), 0 otherwise.
//   cuda_probe [device]

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "src/backends/cuda/driver_entry_point.h"

namespace {

using stepmesh::cuda::driver::Resolve;

struct Driver {
  decltype(&cuDeviceGetAttribute) get_attribute =
      Resolve<decltype(&cuDeviceGetAttribute)>("cuDeviceGetAttribute", 2000);
  decltype(&cuMemGetHandleForAddressRange) get_handle =
      Resolve<decltype(&cuMemGetHandleForAddressRange)>("cuMemGetHandleForAddressRange", 11070);
  decltype(&cuMemGetAllocationGranularity) granularity =
      Resolve<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity", 10020);
  decltype(&cuMemCreate) create = Resolve<decltype(&cuMemCreate)>("cuMemCreate", 10020);
  decltype(&cuMemAddressReserve) reserve =
      Resolve<decltype(&cuMemAddressReserve)>("cuMemAddressReserve", 10020);
  decltype(&cuMemMap) map = Resolve<decltype(&cuMemMap)>("cuMemMap", 10020);
  decltype(&cuMemSetAccess) set_access =
      Resolve<decltype(&cuMemSetAccess)>("cuMemSetAccess", 10020);
  decltype(&cuMemUnmap) unmap = Resolve<decltype(&cuMemUnmap)>("cuMemUnmap", 10020);
  decltype(&cuMemAddressFree) address_free =
      Resolve<decltype(&cuMemAddressFree)>("cuMemAddressFree", 10020);
  decltype(&cuMemRelease) release = Resolve<decltype(&cuMemRelease)>("cuMemRelease", 10020);
  decltype(&cuGetErrorName) error_name = Resolve<decltype(&cuGetErrorName)>("cuGetErrorName", 6000);

  const char* Name(CUresult r) const {
    const char* name = "?";
    if (error_name != nullptr) (void)error_name(r, &name);
    return name;
  }
};

void RuntimeAttribute(const char* name, cudaDeviceAttr attr, int device) {
  int value = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&value, attr, device);
  if (e == cudaSuccess) {
    std::printf("attr %s = %d\n", name, value);
  } else {
    std::printf("attr %s: %s\n", name, cudaGetErrorName(e));
  }
}

void DriverAttribute(const Driver& d, const char* name, CUdevice_attribute attr, int device) {
  if (d.get_attribute == nullptr) {
    std::printf("attr %s: cuDeviceGetAttribute unresolved\n", name);
    return;
  }
  int value = 0;
  const CUresult r = d.get_attribute(&value, attr, device);
  if (r == CUDA_SUCCESS) {
    std::printf("attr %s = %d\n", name, value);
  } else {
    std::printf("attr %s: %s\n", name, d.Name(r));
  }
}

// Exports [ptr, ptr + bytes) as a dma-buf; prints the outcome; true when it worked.
bool Export(const Driver& d, const char* what, CUdeviceptr ptr, size_t bytes) {
  if (d.get_handle == nullptr) {
    std::printf("export %s: cuMemGetHandleForAddressRange unresolved (driver < 11.7)\n", what);
    return false;
  }
  int fd = -1;
  const CUresult r = d.get_handle(&fd, ptr, bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) {
    std::printf("export %s: %s\n", what, d.Name(r));
    return false;
  }
  std::printf("export %s: ok, dma-buf fd %d\n", what, fd);
  ::close(fd);
  return true;
}

// A cuMemCreate allocation mapped at a reserved range, as PyTorch's
// expandable_segments allocator makes them; `rdma_capable` sets
// allocFlags.gpuDirectRDMACapable.
void ProbeVmm(const Driver& d, int device, bool rdma_capable) {
  const char* what = rdma_capable ? "cuMemCreate(gpuDirectRDMACapable)" : "cuMemCreate";
  if (d.create == nullptr || d.reserve == nullptr || d.map == nullptr) {
    std::printf("export %s: VMM calls unresolved\n", what);
    return;
  }
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.allocFlags.gpuDirectRDMACapable = rdma_capable ? 1 : 0;
  size_t granularity = 0;
  CUresult r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) {
    std::printf("export %s: cuMemGetAllocationGranularity %s\n", what, d.Name(r));
    return;
  }
  const size_t bytes = granularity * 2;
  CUmemGenericAllocationHandle handle = 0;
  r = d.create(&handle, bytes, &prop, 0);
  if (r != CUDA_SUCCESS) {
    std::printf("export %s: cuMemCreate %s\n", what, d.Name(r));
    return;
  }
  CUdeviceptr ptr = 0;
  r = d.reserve(&ptr, bytes, granularity, 0, 0);
  if (r == CUDA_SUCCESS) r = d.map(ptr, bytes, 0, handle, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d.set_access(ptr, bytes, &access, 1);
  }
  if (r != CUDA_SUCCESS) {
    std::printf("export %s: mapping %s\n", what, d.Name(r));
  } else {
    (void)Export(d, what, ptr, bytes);
    (void)d.unmap(ptr, bytes);
  }
  if (ptr != 0) (void)d.address_free(ptr, bytes);
  (void)d.release(handle);
}

}  // namespace

int main(int argc, char** argv) {
  const int device = argc > 1 ? std::atoi(argv[1]) : 0;
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    std::fprintf(stderr, "cuda_probe: no GPU (%s)\n",
                 e != cudaSuccess ? cudaGetErrorName(e) : "0 devices");
    return 77;
  }
  if (device < 0 || device >= count || cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "cuda_probe: no device %d (%d visible)\n", device, count);
    return 1;
  }
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, device);
  char bus[32] = {};
  (void)cudaDeviceGetPCIBusId(bus, sizeof(bus), device);
  int driver = 0, runtime = 0;
  (void)cudaDriverGetVersion(&driver);
  (void)cudaRuntimeGetVersion(&runtime);
  std::printf("device %d: %s, sm_%d%d, PCI %s, driver %d, runtime %d\n", device, prop.name,
              prop.major, prop.minor, bus, driver, runtime);
  RuntimeAttribute("GPUDirectRDMASupported", cudaDevAttrGPUDirectRDMASupported, device);
  RuntimeAttribute("GPUDirectRDMAWritesOrdering (0 none, 100 owner, 200 all)",
                   cudaDevAttrGPUDirectRDMAWritesOrdering, device);
  RuntimeAttribute("GPUDirectRDMAFlushWritesOptions (bit 0 host, bit 1 memops)",
                   cudaDevAttrGPUDirectRDMAFlushWritesOptions, device);
  RuntimeAttribute("CanFlushRemoteWrites", cudaDevAttrCanFlushRemoteWrites, device);
  RuntimeAttribute("MemoryPoolsSupported", cudaDevAttrMemoryPoolsSupported, device);
  const Driver d;
  DriverAttribute(d, "DMA_BUF_SUPPORTED", CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device);
  DriverAttribute(d, "CAN_USE_STREAM_WAIT_VALUE_NOR",
                  CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, device);
  DriverAttribute(d, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
                  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device);
  std::printf("memops: cuStreamWaitValue32 %s\n",
              Resolve<decltype(&cuStreamWaitValue32)>("cuStreamWaitValue32", 12000) != nullptr
                  ? "resolved"
                  : "unresolved");
  constexpr size_t kBytes = 4 << 20;
  void* memory = nullptr;
  bool malloc_ok = false;
  if (const cudaError_t e = cudaMalloc(&memory, kBytes); e != cudaSuccess) {
    std::printf("export cudaMalloc: cudaMalloc %s\n", cudaGetErrorName(e));
  } else {
    malloc_ok = Export(d, "cudaMalloc", reinterpret_cast<CUdeviceptr>(memory), kBytes);
    (void)cudaFree(memory);
  }
  ProbeVmm(d, device, /*rdma_capable=*/false);
  ProbeVmm(d, device, /*rdma_capable=*/true);
  return malloc_ok ? 0 : 1;
}
