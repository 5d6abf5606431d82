// Uses the installed library the way an application would.
#include <cstdio>

#include "stepmesh/stepmesh.h"

int main() {
  auto backend = stepmesh::CreateBackend("cpu_mock", 0);
  if (!backend.ok()) return 1;
  auto memory = (*backend)->Allocate(4096, stepmesh::MemoryKind::kDevice);
  stepmesh::MeshOptions options;
  options.num_workers = 2;
  if (!memory.ok() || !options.Validate().ok()) return 1;
  std::printf("stepmesh consumer: %s backend, %zu bytes\n",
              std::string((*backend)->name()).c_str(), (*memory)->bytes());
  // The CUDA interop header links with or without CUDA and a GPU: a backend,
  // or UNAVAILABLE (no GPU/driver), or UNIMPLEMENTED (built without CUDA).
  stepmesh::CudaBackendOptions cuda_options;
  cuda_options.event_pool_size = 64;
  auto cuda = stepmesh::CreateCudaBackend(0, cuda_options);
  if (!cuda.ok() && !absl::IsUnavailable(cuda.status()) &&
      !absl::IsUnimplemented(cuda.status())) {
    return 1;
  }
  if (stepmesh::WrapCudaStream(**backend, nullptr).ok()) return 1;  // cpu_mock is not CUDA
  std::printf("stepmesh consumer: cuda backend: %s\n",
              cuda.ok() ? "available" : cuda.status().ToString().c_str());
  return 0;
}
