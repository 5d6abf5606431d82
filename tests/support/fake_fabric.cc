#include "tests/support/fake_fabric.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"

namespace stepmesh::testing {

core::TransportFactory FakeRdmaFactory(std::shared_ptr<FakeFabric> fabric) {
  auto next_host = std::make_shared<std::atomic<uint32_t>>(1);
  return [fabric = std::move(fabric), next_host](
             const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    const uint32_t n = next_host->fetch_add(1);
    FakeNicSpec spec;
    spec.name = absl::StrCat("fake_mlx5_", n);
    spec.ipv4 = 0x0A000000 + n;
    return rdma::CreateRdmaTransport(options, fabric->AddHost(spec));
  };
}

}  // namespace stepmesh::testing
