// include/stepmesh/cuda.h in a libstepmesh built without CUDA (no nvcc): the
// calls exist, so applications link either way, and say why they cannot work.

#include "absl/status/status.h"
#include "stepmesh/cuda.h"

namespace stepmesh {
namespace {

absl::Status NoCuda() {
  return absl::UnimplementedError(
      "this build of stepmesh has no CUDA backend (configured without the CUDA toolkit)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int, const CudaBackendOptions&) {
  return NoCuda();
}
absl::StatusOr<void*> NativeCudaStream(Stream&) { return NoCuda(); }
absl::StatusOr<std::unique_ptr<Stream>> WrapCudaStream(Backend&, void*) { return NoCuda(); }
absl::Status RecordOnCudaStream(Event&, void*) { return NoCuda(); }
absl::Status PreloadCudaKernels(Backend&, absl::Span<const void* const>) { return NoCuda(); }

}  // namespace stepmesh
