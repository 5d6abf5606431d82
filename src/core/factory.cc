// Picks the backend and transport named in the options. The only file that
// knows every implementation; each is compiled in when its dependency exists.

#include "absl/strings/string_view.h"
#include "absl/strings/str_cat.h"
#include "src/core/logging.h"
#include "src/core/mesh.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/status.h"

#ifdef STEPMESH_HAVE_RDMA
#include "src/transport/rdma/rdma_transport.h"
#endif
#ifdef STEPMESH_HAVE_CUDA
#include "src/backends/cuda/cuda_backend.h"
#endif

namespace stepmesh {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name, int device) {
  if (name == "cpu_mock") return CreateCpuMockBackend();
  if (name == "cuda") {
#ifdef STEPMESH_HAVE_CUDA
    return CreateCudaBackend(device);
#else
    return absl::UnimplementedError("this build of stepmesh has no CUDA backend");
#endif
  }
  return absl::NotFoundError(absl::StrCat("unknown backend '", name, "' (cpu_mock or cuda)"));
}

absl::StatusOr<void*> NativeStreamHandle(Stream& stream) {
#ifdef STEPMESH_HAVE_CUDA
  if (absl::StatusOr<void*> handle = NativeCudaStream(stream); handle.ok()) return handle;
#endif
  (void)stream;
  return absl::UnimplementedError("this stream has no native accelerator stream (cpu_mock?)");
}

namespace core {

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const MeshOptions& options) {
  if (options.transport == "tcp") return CreateTcpTransport(options);
#ifdef STEPMESH_HAVE_RDMA
  if (options.transport == "rdma") return CreateRdmaTransport(options);
  if (options.transport == "auto" && RdmaDeviceAvailable()) return CreateRdmaTransport(options);
#else
  if (options.transport == "rdma") {
    return absl::UnimplementedError("this build of stepmesh has no RDMA transport");
  }
#endif
  if (options.transport == "auto") {
    STEPMESH_LOG(kInfo, "no RDMA device: using the TCP fallback");
    return CreateTcpTransport(options);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown transport '", options.transport, "'"));
}

}  // namespace core
}  // namespace stepmesh
