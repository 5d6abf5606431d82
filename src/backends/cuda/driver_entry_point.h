#pragma once
// A CUDA driver function resolved through the runtime
// (cudaGetDriverEntryPointByVersion), so nothing links libcuda. Resolving by
// version pins the ABI the caller was compiled against; a newer driver still
// hands back that version of the function. Header-only: cuda_api.cc and the
// GPU probe (benchmarks/gpu/cuda_probe.cc) use it.

#include <cuda_runtime_api.h>

namespace stepmesh::cuda::driver {

// `symbol` at ABI `version`, or nullptr where the driver does not have it.
template <typename Fn>
Fn Resolve(const char* symbol, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    // Resolution failing is not an error for the caller: the backend falls back
    // (wait kernel) or reports UNIMPLEMENTED (dma-buf). Clear the sticky "last
    // error" so it is not misattributed to the next kernel launch.
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace stepmesh::cuda::driver
