// The composition root: builds the backend and transport named in the options
// and hands them to the core. The only file that knows every implementation;
// each is compiled in when its dependency exists.

#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "src/base/logging.h"
#include "src/compose/transports.h"
#include "src/core/mesh.h"
#include "src/core/store_rendezvous.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/rendezvous_store.h"
#include "stepmesh/server.h"
#include "stepmesh/status.h"
#include "stepmesh/worker.h"

#ifdef STEPMESH_HAVE_RDMA
#include "src/transport/rdma/rdma_transport.h"
#endif
#ifdef STEPMESH_HAVE_LIBFABRIC
#include "src/transport/libfabric/libfabric_transport.h"
#endif
#ifdef STEPMESH_HAVE_CUDA
#include "src/backends/cuda/cuda_backend.h"
#endif
#ifdef STEPMESH_HAVE_ETCD
#include "src/rendezvous/etcd/etcd_rendezvous.h"
#endif

namespace stepmesh {
namespace compose {

absl::StatusOr<std::unique_ptr<core::Transport>> CreateTransport(const MeshOptions& options) {
  if (options.transport == "tcp") return tcp::CreateTcpTransport(options);
  if (options.transport == "libfabric") {
#ifdef STEPMESH_HAVE_LIBFABRIC
    // Descriptors, adverts and goodbyes ride an ordered TCP control connection.
    return libfabric::CreateLibfabricTransport(options, tcp::CreateTcpTransport);
#else
    return absl::UnimplementedError(
        "transport 'libfabric' (STEPMESH_TRANSPORT=libfabric, DMLC_ENABLE_RDMA=fabric): the "
        "libfabric transport is not built into this stepmesh (no libfabric-dev at configure "
        "time); use tcp (DMLC_ENABLE_RDMA=zmq) or rdma (ibverbs)");
#endif
  }
#ifdef STEPMESH_HAVE_RDMA
  if (options.transport == "rdma") return rdma::CreateRdmaTransport(options);
  if (options.transport == "auto" && rdma::RdmaDeviceAvailable()) {
    return rdma::CreateRdmaTransport(options);
  }
#else
  if (options.transport == "rdma") {
    return absl::UnimplementedError("this build of stepmesh has no RDMA transport");
  }
#endif
  if (options.transport == "auto") {
    STEPMESH_LOG(kInfo, "no RDMA device: using the TCP fallback");
    return tcp::CreateTcpTransport(options);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown transport '", options.transport, "'"));
}

// The one way a backend is made, from the mesh's options or from a name.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const MeshOptions& options) {
  if (options.backend == "cpu_mock") return CreateCpuMockBackend();
  if (options.backend == "cuda") {
#ifdef STEPMESH_HAVE_CUDA
    CudaBackendOptions cuda;
    cuda.device_max_connections = options.cuda_device_max_connections;
    return CreateCudaBackend(options.device, cuda);
#else
    return absl::UnimplementedError("this build of stepmesh has no CUDA backend");
#endif
  }
  return absl::NotFoundError(
      absl::StrCat("unknown backend '", options.backend, "' (cpu_mock or cuda)"));
}

absl::StatusOr<std::unique_ptr<core::Rendezvous>> JoinRendezvous(const MeshOptions& options,
                                                                 const std::string& endpoint) {
  STEPMESH_ASSIGN_OR_RETURN(core::RendezvousUrl url, core::ParseRendezvousUrl(options));
  if (url.scheme == "etcd") {
#ifdef STEPMESH_HAVE_ETCD
    return etcd::JoinEtcd(options, endpoint);
#else
    return absl::UnimplementedError(absl::StrCat(
        "rendezvous '", core::RedactedRendezvous(options.rendezvous),
        "' (STEPMESH_RENDEZVOUS): the etcd rendezvous is not built into this stepmesh (no "
        "libcurl4-openssl-dev / libjsoncpp-dev at configure time)"));
#endif
  }
  return core::JoinScheduler(options, endpoint);
}

namespace {

// The caller's backend, or the one the options name. The options are checked
// first, so bad options fail the same way with or without a backend.
absl::StatusOr<std::shared_ptr<Backend>> BackendFor(const MeshOptions& options, Role role,
                                                    std::shared_ptr<Backend> backend) {
  STEPMESH_RETURN_IF_ERROR(core::OptionsForRole(options, role).status());
  if (backend != nullptr) return backend;
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Backend> created, CreateBackend(options));
  return std::shared_ptr<Backend>(std::move(created));
}

// A worker or a server (`Facade`) over the backend BackendFor picks, the
// transport the options name and `rendezvous`.
template <typename Facade>
absl::StatusOr<std::unique_ptr<Facade>> CreateFacade(const MeshOptions& options,
                                                     std::shared_ptr<Backend> backend,
                                                     core::RendezvousFactory rendezvous) {
  constexpr bool kWorker = std::is_same_v<Facade, AFTensorWorker>;
  STEPMESH_ASSIGN_OR_RETURN(
      backend, BackendFor(options, kWorker ? Role::kWorker : Role::kServer, std::move(backend)));
  if constexpr (kWorker) {
    return core::CreateWorker(options, std::move(backend), CreateTransport, std::move(rendezvous));
  } else {
    return core::CreateServer(options, std::move(backend), CreateTransport, std::move(rendezvous));
  }
}

core::RendezvousFactory StoreFactory(std::shared_ptr<RendezvousStore> store) {
  return [store = std::move(store)](const MeshOptions& options, const std::string& endpoint) {
    return core::JoinStore(store, options, endpoint);
  };
}

// `caller` names the public function in the error.
template <typename Facade>
absl::StatusOr<std::unique_ptr<Facade>> CreateWithStore(const MeshOptions& options,
                                                        std::shared_ptr<RendezvousStore> store,
                                                        std::shared_ptr<Backend> backend,
                                                        absl::string_view caller) {
  if (store == nullptr) return absl::InvalidArgumentError(absl::StrCat(caller, ": no store"));
  return CreateFacade<Facade>(options, std::move(backend), StoreFactory(std::move(store)));
}

}  // namespace
}  // namespace compose

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name, int device) {
  MeshOptions options;
  options.backend = std::string(name);
  options.device = device;
  return compose::CreateBackend(options);
}

absl::StatusOr<std::unique_ptr<AFTensorWorker>> AFTensorWorker::Create(
    const MeshOptions& options, std::shared_ptr<Backend> backend) {
  return compose::CreateFacade<AFTensorWorker>(options, std::move(backend),
                                               compose::JoinRendezvous);
}

absl::StatusOr<std::unique_ptr<AFTensorServer>> AFTensorServer::Create(
    const MeshOptions& options, std::shared_ptr<Backend> backend) {
  return compose::CreateFacade<AFTensorServer>(options, std::move(backend),
                                               compose::JoinRendezvous);
}

absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorkerWithStore(
    const MeshOptions& options, std::shared_ptr<RendezvousStore> store,
    std::shared_ptr<Backend> backend) {
  return compose::CreateWithStore<AFTensorWorker>(options, std::move(store), std::move(backend),
                                                  "CreateWorkerWithStore");
}

absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServerWithStore(
    const MeshOptions& options, std::shared_ptr<RendezvousStore> store,
    std::shared_ptr<Backend> backend) {
  return compose::CreateWithStore<AFTensorServer>(options, std::move(store), std::move(backend),
                                                  "CreateServerWithStore");
}

}  // namespace stepmesh
