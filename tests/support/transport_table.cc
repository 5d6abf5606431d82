#include "tests/support/transport_table.h"

#include "absl/strings/str_cat.h"
#include "src/transport/tcp_fallback/tcp_transport.h"

#ifdef STEPMESH_HAVE_RDMA
#include "tests/support/fake_fabric.h"
#endif

namespace stepmesh::testing {

std::vector<TransportCase> TransportTable() {
  return {
      {.name = "tcp",
       .transport = "tcp",
       .make =
           [] {
             return TransportInstance{tcp::CreateTcpTransport, nullptr, nullptr};
           },
       .wire_faults = true},
#ifdef STEPMESH_HAVE_RDMA
      {.name = "rdma-fake",
       .transport = "rdma",
       .make =
           [] {
             auto fabric = std::make_shared<FakeFabric>();
             return TransportInstance{FakeRdmaFactory(fabric), fabric, [fabric] {
                                        const FakeFabricStats stats = fabric->stats();
                                        if (stats.rnr_errors == 0 && stats.access_errors == 0) {
                                          return absl::OkStatus();
                                        }
                                        return absl::InternalError(absl::StrCat(
                                            "fake fabric: ", stats.rnr_errors, " RNR errors, ",
                                            stats.access_errors, " access errors"));
                                      }};
           },
       .payload_lands_first = true},
#endif
  };
}

MeshOptions OptionsFor(const TransportCase& row, MeshOptions base) {
  base.transport = row.transport;
  return base;
}

}  // namespace stepmesh::testing
