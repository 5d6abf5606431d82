// RDMA-only variants of the end-to-end scenarios (tests/support/mesh_scenarios.h;
// the plain ones run over every transport in tests/core/conformance_test.cc),
// with every participant on the RDMA transport over one in-process fake fabric.

#include <atomic>
#include <catch2/catch.hpp>
#include <future>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/core/mesh.h"
#include "src/transport/rdma/rdma_transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/scheduler.h"
#include "tests/rdma/fake_verbs.h"
#include "tests/support/fake_fabric.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/sanitizer.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using testing::FakeFabric;
using testing::FakeNicSpec;
using testing::FakeRdmaFactory;
using testing::Scenario;

MeshOptions RdmaOptions(int qps = 1) {
  MeshOptions o;
  o.transport = "rdma";
  o.timeout = absl::Seconds(10);
  o.rdma.qps_per_peer = qps;
  return o;
}

TEST_CASE("conformance over rdma (fake verbs): two QPs per peer, small credit window",
          "[rdma][conformance]") {
  auto fabric = std::make_shared<FakeFabric>();
  MeshOptions o = RdmaOptions(2);
  o.rdma.recv_depth = 8;  // forces credit returns every other frame
  o.rdma.stripe_min_bytes = 8192;
  Scenario sc;
  // 30 x 3 micro-batches: 90 frames each way per worker-server pair through
  // 8 receive slots, the slots and credits wrapping again and again; under
  // TSan 8 iterations (24 frames, still wrapping), 20 s of CI less.
  sc.iterations = testing::SteadyStateRepetitions(30, 8);
  CHECK_OK(testing::RunInProcess(sc, o, FakeRdmaFactory(fabric)));
  CHECK(fabric->stats().rnr_errors == 0);
}

}  // namespace
}  // namespace stepmesh

namespace stepmesh {
namespace {

// Bootstrap sockets run the same challenge-response as TCP data connections.
absl::Status ConnectPair(const std::string& worker_secret, const std::string& server_secret,
                         absl::Status* server_result) {
  auto fabric = std::make_shared<testing::FakeFabric>();
  auto factory = FakeRdmaFactory(fabric);
  MeshOptions wo = RdmaOptions();
  wo.auth_token = worker_secret;
  MeshOptions so = RdmaOptions();
  so.auth_token = server_secret;
  auto worker = factory(wo);
  auto server = factory(so);
  if (!worker.ok()) return worker.status();
  if (!server.ok()) return server.status();
  auto worker_endpoint = (*worker)->LocalEndpoint();
  auto server_endpoint = (*server)->LocalEndpoint();
  if (!worker_endpoint.ok() || !server_endpoint.ok()) return absl::InternalError("endpoints");
  const core::NodeId w = core::WorkerId(0), s = core::ServerId(0);
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{w, *worker_endpoint};
    return (*server)->Connect(s, {&peer, 1}, deadline);
  });
  const core::PeerInfo peer{s, *server_endpoint};
  absl::Status dialled = (*worker)->Connect(w, {&peer, 1}, deadline);
  *server_result = accepted.get();
  (*worker)->Shutdown();
  (*server)->Shutdown();
  return dialled;
}

TEST_CASE("rdma bootstrap connections need the shared secret on both ends", "[rdma][auth]") {
  absl::Status server;
  CHECK(ConnectPair("alpha", "alpha", &server).ok());
  CHECK(server.ok());
  CHECK(absl::IsPermissionDenied(ConnectPair("alpha", "beta", &server)));
  CHECK_FALSE(server.ok());  // the impostor never became a peer
  CHECK(absl::IsPermissionDenied(ConnectPair("", "beta", &server)));
  CHECK_FALSE(server.ok());
}

}  // namespace
}  // namespace stepmesh
