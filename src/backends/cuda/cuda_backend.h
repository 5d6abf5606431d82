#pragma once
// The "cuda" Backend: its public face is include/stepmesh/cuda.h. This header
// adds what only stepmesh and its tests use: creating the backend over an
// explicit CudaApi (a fake in tests). No CUDA header is included here, so
// the core's factory can include this file from any translation unit.

#include <memory>

#include "absl/status/statusor.h"
#include "stepmesh/backend.h"
#include "stepmesh/cuda.h"

namespace stepmesh {

namespace cuda {
class CudaApi;
}  // namespace cuda

// As CreateCudaBackend(device, options), over an explicit CudaApi.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(std::shared_ptr<cuda::CudaApi> api,
                                                           int device,
                                                           const CudaBackendOptions& options = {});

}  // namespace stepmesh
