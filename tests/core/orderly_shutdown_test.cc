// An orderly shutdown is not a failure: after a round of traffic, workers then
// servers then the scheduler shut down, and nobody logs a warning or an error
// (peers log the departure at info).

#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"
#include "tests/support/stderr_capture.h"

namespace stepmesh {
namespace {

using testing::StderrCapture;

// Returns the warning and error lines logged from start-up through shutdown.
std::vector<std::string> RunAndShutDown(bool servers_first) {
  std::vector<std::vector<uint8_t>> wpush(2, std::vector<uint8_t>(64, 3));
  std::vector<std::vector<uint8_t>> wpull(2, std::vector<uint8_t>(2 * 64));
  std::vector<std::vector<uint8_t>> srecv(2, std::vector<uint8_t>(2 * 64));
  std::vector<std::vector<uint8_t>> sreply(2, std::vector<uint8_t>(2 * 64));
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(10);
  o.num_workers = 2;
  o.num_servers = 2;
  o.auth_token = std::string(64, 'a');
  StderrCapture capture("orderly");
  {
    absl::StatusOr<std::unique_ptr<testing::LoopbackMesh>> started =
        testing::LoopbackMesh::Start(o, compose::CreateTransport);
    REQUIRE_OK(started);
    testing::LoopbackMesh& mesh = **started;
    for (int s = 0; s < 2; ++s) {
      REQUIRE_OK(mesh.server(s).RegisterRecvTensor(1, BytesView(srecv[s].data(), 2 * 64)));
      REQUIRE_OK(mesh.server(s).RegisterReplyTensor(2, BytesView(sreply[s].data(), 2 * 64)));
    }
    std::vector<RequestHandle> handles;
    for (int w = 0; w < 2; ++w) {
      REQUIRE_OK(mesh.worker(w).RegisterPushTensor(1, BytesView(wpush[w].data(), 64)));
      for (int s = 0; s < 2; ++s) {
        REQUIRE_OK(
            mesh.worker(w).RegisterPullTensor(2, s, BytesView(wpull[w].data() + s * 64, 64)));
      }
      const Push p{1};
      const Pull q[2] = {{2, 0}, {2, 1}};
      absl::StatusOr<RequestHandle> h = mesh.worker(w).PushPull({&p, 1}, {q, 2});
      REQUIRE_OK(h);
      handles.push_back(*h);
    }
    for (int s = 0; s < 2; ++s) {
      absl::StatusOr<Batch> batch = mesh.server(s).GetBatch(absl::Seconds(10));
      REQUIRE_OK(batch);
      const Reply r[2] = {{0}, {1}};
      REQUIRE_OK(mesh.server(s).Respond(*batch, {r, 2}));
    }
    for (int w = 0; w < 2; ++w) REQUIRE_OK(mesh.worker(w).Wait(handles[w], absl::Seconds(10)));
    if (servers_first) {
      for (int s = 0; s < 2; ++s) mesh.ShutdownServer(s);
      absl::SleepFor(absl::Milliseconds(200));  // the workers see the servers leave while up
      for (int w = 0; w < 2; ++w) mesh.ShutdownWorker(w);
    } else {
      for (int w = 0; w < 2; ++w) mesh.ShutdownWorker(w);
      absl::SleepFor(absl::Milliseconds(200));
      for (int s = 0; s < 2; ++s) mesh.ShutdownServer(s);
    }
    // Peers notice a departure asynchronously: give them time to log it.
    absl::SleepFor(absl::Milliseconds(500));
  }
  const std::string log = capture.Finish();
  std::vector<std::string> bad;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StartsWith(line, "[stepmesh W") || absl::StartsWith(line, "[stepmesh E")) {
      bad.emplace_back(line);
    }
  }
  return bad;
}

TEST_CASE("an orderly shutdown logs no warning", "[mesh][shutdown]") {
  for (bool servers_first : {false, true}) {
    INFO((servers_first ? "servers first" : "workers first"));
    const std::vector<std::string> bad = RunAndShutDown(servers_first);
    for (const std::string& line : bad) UNSCOPED_INFO(line);
    CHECK(bad.empty());
  }
}

}  // namespace
}  // namespace stepmesh
