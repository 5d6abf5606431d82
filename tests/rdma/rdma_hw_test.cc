// The RDMA conformance scenarios on real verbs: every participant is a thread
// of this process and all of them share the selected NIC (loopback through the
// adapter). Exits 77 (ctest: skipped) when no RDMA device with an active port
// exists. The device comes from STEPMESH_RDMA_DEVICE / STEPMESH_RDMA_GID_INDEX
// etc. (MeshOptions::FromEnv), or is chosen automatically.

#include <catch2/catch.hpp>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "src/core/mesh.h"
#include "src/transport/rdma/rdma_transport.h"
#include "src/transport/rdma/verbs_resources.h"
#include "tests/support/catch_session.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

MeshOptions HwOptions(int qps) {
  absl::StatusOr<MeshOptions> env = MeshOptions::FromEnv();
  MeshOptions o = env.ok() ? *env : MeshOptions();
  o.transport = "rdma";
  o.timeout = absl::Seconds(20);
  o.rdma.qps_per_peer = qps;
  return o;
}

core::TransportFactory RealRdma() {
  return [](const MeshOptions& options) { return rdma::CreateRdmaTransport(options); };
}

TEST_CASE("hw conformance: 1A1F, 1A2F, 2A2F, 3 micro-batches", "[rdma][hw]") {
  for (auto [w, s] : {std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 2}}) {
    testing::Scenario sc;
    sc.workers = w;
    sc.servers = s;
    sc.iterations = 200;
    INFO(w << "A" << s << "F");
    CHECK_OK(testing::RunInProcess(sc, HwOptions(1), RealRdma()));
  }
}

TEST_CASE("hw conformance: two QPs per peer (striped payloads)", "[rdma][hw]") {
  testing::Scenario sc;
  sc.iterations = 200;
  CHECK_OK(testing::RunInProcess(sc, HwOptions(2), RealRdma()));
}

}  // namespace
}  // namespace stepmesh

int main(int argc, char** argv) {
  if (!stepmesh::rdma::RdmaDeviceAvailable()) {
    std::fprintf(stderr, "rdma_hw_tests: no RDMA device with an active port; skipping\n");
    return 77;
  }
  absl::StatusOr<stepmesh::MeshOptions> env = stepmesh::MeshOptions::FromEnv();
  if (env.ok() && !env->rdma.device.empty()) {
    auto verbs = stepmesh::rdma::MakeRealVerbsApi();
    if (!stepmesh::rdma::OpenPort(*verbs, *env).ok()) {
      std::fprintf(stderr, "rdma_hw_tests: device %s unusable; skipping\n",
                   env->rdma.device.c_str());
      return 77;
    }
  }
  return stepmesh::testing::RunCatchSession(argc, argv);
}
