#pragma once
// cudaError_t / CUresult -> absl::Status, with the canonical codes of
// docs/errors.md. Messages read "<what>: <name> (<code>): <description>" and
// the numeric code rides along as a payload so callers can assert on it.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "src/backends/cuda/cuda_api.h"

namespace stepmesh::cuda {

inline constexpr absl::string_view kCudaErrorPayload = "stepmesh/cuda_error";
inline constexpr absl::string_view kCuResultPayload = "stepmesh/cu_result";

// The status code a runtime error maps to (OK for cudaSuccess).
absl::StatusCode CudaErrorCode(cudaError_t error);
absl::StatusCode CuResultCode(CUresult error);

// `what` names the failed operation, e.g. "cudaMalloc(4096 bytes) on device 3".
absl::Status CudaStatus(CudaApi& api, cudaError_t error, absl::string_view what);
absl::Status CuResultStatus(CudaApi& api, CUresult error, absl::string_view what);

// The numeric CUDA error carried by a status from CudaStatus, or -1.
int CudaErrorFromStatus(const absl::Status& status);

}  // namespace stepmesh::cuda
