#include "tests/support/transport_table.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/transport/tcp_fallback/tcp_transport.h"

#ifdef STEPMESH_HAVE_LIBFABRIC
#include "src/transport/libfabric/libfabric_transport.h"
#endif
#ifdef STEPMESH_HAVE_RDMA
#include "src/transport/rdma/rdma_transport.h"
#include "tests/support/fake_fabric.h"
#endif

namespace stepmesh::testing {

namespace {

#ifdef STEPMESH_HAVE_RDMA
// The fake fabric saw no fault nobody reported (RNR retries, access errors).
std::function<absl::Status()> CleanFabric(std::shared_ptr<FakeFabric> fabric) {
  return [fabric] {
    const FakeFabricStats stats = fabric->stats();
    if (stats.rnr_errors == 0 && stats.access_errors == 0) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("fake fabric: ", stats.rnr_errors, " RNR errors, ",
                                            stats.access_errors, " access errors"));
  };
}

TransportCase FakeRdmaRow(std::string name, bool asynchronous) {
  return {.name = std::move(name),
          .transport = "rdma",
          .make =
              [asynchronous] {
                auto fabric =
                    std::make_shared<FakeFabric>(FakeFabricOptions{.asynchronous = asynchronous});
                return TransportInstance{FakeRdmaFactory(fabric), fabric, CleanFabric(fabric)};
              },
          .payload_lands_first = true};
}

// Real verbs, with the device, GID index, timeouts, ... of the STEPMESH_RDMA_*
// variables (the suites build their own options; the NIC is the operator's).
TransportCase HardwareRdmaRow() {
  return {
      .name = "rdma-hw",
      .transport = "rdma",
      .make =
          [] {
            core::TransportFactory factory =
                [](const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
              absl::StatusOr<MeshOptions> env = MeshOptions::FromEnv(options);
              if (!env.ok()) return env.status();
              MeshOptions merged = options;
              merged.rdma = env->rdma;
              return rdma::CreateRdmaTransport(merged);
            };
            return TransportInstance{std::move(factory), nullptr, nullptr};
          },
      .payload_lands_first = true,
      .hardware = true};
}
#endif

#ifdef STEPMESH_HAVE_LIBFABRIC
// The libfabric transport over one of libfabric's own software providers
// ("tcp": tcp;ofi_rxm over loopback; "shm": same-host shared memory), with
// its TCP control connection.
TransportCase LibfabricRow(std::string name, std::string provider) {
  return {.name = std::move(name),
          .transport = "libfabric",
          .make =
              [provider] {
                core::TransportFactory factory = [provider](const MeshOptions& options) {
                  MeshOptions o = options;
                  o.fi_provider = provider;
                  return libfabric::CreateLibfabricTransport(o, tcp::CreateTcpTransport);
                };
                return TransportInstance{std::move(factory), nullptr, nullptr};
              },
          .payload_lands_first = true};
}
#endif

}  // namespace

std::vector<TransportCase> AllTransportRows() {
  std::vector<TransportCase> rows;
  rows.push_back({.name = "tcp",
                  .transport = "tcp",
                  .make =
                      [] {
                        return TransportInstance{tcp::CreateTcpTransport, nullptr, nullptr};
                      },
                  .wire_faults = true});
#ifdef STEPMESH_HAVE_LIBFABRIC
  rows.push_back(LibfabricRow("libfabric-tcp", "tcp"));
  rows.push_back(LibfabricRow("libfabric-shm", "shm"));
#endif
#ifdef STEPMESH_HAVE_RDMA
  rows.push_back(FakeRdmaRow("rdma-fake-sync", /*asynchronous=*/false));
  rows.push_back(FakeRdmaRow("rdma-fake-async", /*asynchronous=*/true));
  rows.push_back(HardwareRdmaRow());
#endif
  return rows;
}

MeshOptions OptionsFor(const TransportCase& row, MeshOptions base) {
  base.transport = row.transport;
  return base;
}

}  // namespace stepmesh::testing
