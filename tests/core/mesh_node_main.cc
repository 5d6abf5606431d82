// One participant of the scenario as its own process, for the multi-process
// tests and the README's demo exchange:
//   stepmesh_test_node --role worker|server --rank R --scheduler H:P
//       --workers W --servers S [--iterations N] [--micro-batches M]
//       [--push-bytes B] [--pull-bytes B] [--expect-unavailable] [--timeout-ms T]
// Exit 0 on success; with --expect-unavailable, 0 only if the run ended in
// UNAVAILABLE (a peer vanished) within the timeout.

#include <cstdio>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/node_flags.h"

int main(int argc, char** argv) {
  std::optional<stepmesh::MeshOptions> from_env = stepmesh::testing::TcpNodeOptionsFromEnv();
  if (!from_env) return 2;
  stepmesh::MeshOptions options = *from_env;
  stepmesh::testing::Scenario scenario;
  bool expect_unavailable = false;
  std::string role = "worker";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--expect-unavailable") {
      expect_unavailable = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "missing value for %s\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[++i];
    if (stepmesh::testing::ApplyMeshFlag(flag, value, &options)) {
      // The scenario follows the mesh's shape and timeout.
      if (flag == "--workers") scenario.workers = options.num_workers;
      if (flag == "--servers") scenario.servers = options.num_servers;
      if (flag == "--timeout-ms") scenario.step_timeout = options.timeout;
      continue;
    }
    int64_t n = 0;
    const bool numeric = absl::SimpleAtoi(value, &n);
    if (flag == "--role")
      role = value;
    else if (flag == "--iterations" && numeric)
      scenario.iterations = static_cast<int>(n);
    else if (flag == "--micro-batches" && numeric)
      scenario.micro_batches = static_cast<int>(n);
    else if (flag == "--push-bytes" && numeric)
      scenario.push_bytes = static_cast<size_t>(n);
    else if (flag == "--pull-bytes" && numeric)
      scenario.pull_bytes = static_cast<size_t>(n);
    else
      return stepmesh::testing::BadFlag(flag, value);
  }
  absl::Status result;
  if (role == "worker") {
    options.role = stepmesh::Role::kWorker;
    auto worker = stepmesh::AFTensorWorker::Create(options);
    result = worker.ok() ? stepmesh::testing::RunWorker(**worker, scenario) : worker.status();
  } else if (role == "server") {
    options.role = stepmesh::Role::kServer;
    auto server = stepmesh::AFTensorServer::Create(options);
    result = server.ok() ? stepmesh::testing::RunServer(**server, scenario) : server.status();
  } else {
    std::fprintf(stderr, "unknown role %s\n", role.c_str());
    return 2;
  }
  std::fprintf(stderr, "%s %d: %s\n", role.c_str(), options.rank, result.ToString().c_str());
  if (expect_unavailable) return absl::IsUnavailable(result) ? 0 : 1;
  return result.ok() ? 0 : 1;
}
