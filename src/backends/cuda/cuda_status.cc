#include "src/backends/cuda/cuda_status.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace stepmesh::cuda {

absl::StatusCode CudaErrorCode(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return absl::StatusCode::kOk;
    // No usable GPU or driver on this machine: the caller may pick another
    // backend, so these are UNAVAILABLE rather than INTERNAL.
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorInitializationError:
      return absl::StatusCode::kUnavailable;
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorNotSupported:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return absl::StatusCode::kUnimplemented;
    // Misuse of stream capture is a caller-state problem, not a CUDA fault.
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorStreamCaptureWrongThread:
      return absl::StatusCode::kFailedPrecondition;
    // Sticky errors (illegal address, launch failure, ...) and everything else:
    // the context is likely unusable, nothing the caller can fix by retrying.
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CuResultCode(CUresult error) {
  switch (error) {
    case CUDA_SUCCESS:
      return absl::StatusCode::kOk;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
      return absl::StatusCode::kUnavailable;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_INVALID_VALUE:
      return absl::StatusCode::kInvalidArgument;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_FOUND:  // an entry point the driver does not have
      return absl::StatusCode::kUnimplemented;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status CudaStatus(CudaApi& api, cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const char* name = api.GetErrorName(error);
  const char* text = api.GetErrorString(error);
  absl::Status status(CudaErrorCode(error),
                      absl::StrCat(what, ": ", name != nullptr ? name : "cudaError?", " (",
                                   static_cast<int>(error), "): ", text != nullptr ? text : ""));
  status.SetPayload(kCudaErrorPayload, absl::Cord(absl::StrCat(static_cast<int>(error))));
  return status;
}

absl::Status CuResultStatus(CudaApi& api, CUresult error, absl::string_view what) {
  if (error == CUDA_SUCCESS) return absl::OkStatus();
  absl::Status status(CuResultCode(error), absl::StrCat(what, ": ", api.GetDriverErrorName(error),
                                                        " (", static_cast<int>(error), ")"));
  status.SetPayload(kCuResultPayload, absl::Cord(absl::StrCat(static_cast<int>(error))));
  return status;
}

int CudaErrorFromStatus(const absl::Status& status) {
  auto payload = status.GetPayload(kCudaErrorPayload);
  int code = -1;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &code)) return -1;
  return code;
}

}  // namespace stepmesh::cuda
