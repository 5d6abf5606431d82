#pragma once
// What the test node programs (stepmesh_test_node, stepmesh_elastic_node,
// stepmesh_reliability_node) read the same way: the STEPMESH_* / DMLC_*
// environment, then the flags that shape the mesh. Header-only: the programs
// link the library alone.

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "stepmesh/options.h"

namespace stepmesh::testing {

// The environment's options (the flags read after this win). A bad
// environment is printed and gives nullopt.
inline std::optional<MeshOptions> NodeOptionsFromEnv() {
  absl::StatusOr<MeshOptions> from_env = MeshOptions::FromEnv();
  if (!from_env.ok()) {
    std::fprintf(stderr, "%s\n", from_env.status().ToString().c_str());
    return std::nullopt;
  }
  return *std::move(from_env);
}

// NodeOptionsFromEnv() over TCP (auth token, log level apply).
inline std::optional<MeshOptions> TcpNodeOptionsFromEnv() {
  std::optional<MeshOptions> options = NodeOptionsFromEnv();
  if (options.has_value()) options->transport = "tcp";
  return options;
}

// The command line of a node program: `program`, then each flag and its value.
inline std::vector<std::string> NodeArgv(
    std::string program, std::initializer_list<std::pair<const char*, std::string>> flags) {
  std::vector<std::string> argv = {std::move(program)};
  for (const auto& [flag, value] : flags) {
    argv.emplace_back(flag);
    argv.push_back(value);
  }
  return argv;
}

// Applies one of the flags every node program takes: --scheduler H:P,
// --rank R, --workers W, --servers S, --timeout-ms T. False (and `options`
// unchanged) when `flag` is none of them or its number does not parse.
inline bool ApplyMeshFlag(std::string_view flag, const std::string& value, MeshOptions* options) {
  if (flag == "--scheduler") {
    options->scheduler = value;
    return true;
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(value, &n)) return false;
  if (flag == "--rank") {
    options->rank = static_cast<int>(n);
  } else if (flag == "--workers") {
    options->num_workers = static_cast<int>(n);
  } else if (flag == "--servers") {
    options->num_servers = static_cast<int>(n);
  } else if (flag == "--timeout-ms") {
    options->timeout = absl::Milliseconds(n);
  } else {
    return false;
  }
  return true;
}

// Node::Create(options) for Node = AFTensorWorker or AFTensorServer; a
// failure is said on stderr as "<what> <rank>: <status>".
template <typename Node>
auto CreateOrSay(const MeshOptions& options, const char* what) -> decltype(Node::Create(options)) {
  auto created = Node::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "%s %d: %s\n", what, options.rank, created.status().ToString().c_str());
  }
  return created;
}

// A flag no parser took: said on stderr; the program's exit status.
inline int BadFlag(const std::string& flag, const std::string& value) {
  std::fprintf(stderr, "bad flag %s %s\n", flag.c_str(), value.c_str());
  return 2;
}

}  // namespace stepmesh::testing
