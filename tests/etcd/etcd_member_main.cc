// One rendezvous participant and nothing else, for the etcd tests: joins
// through the composition root (STEPMESH_RENDEZVOUS picks the implementation)
// advertising a made-up endpoint, prints what it learns, and obeys commands:
//   stepmesh_etcd_member --role worker|server [--rank R] --workers W --servers S
//       [--max-workers MW --max-servers MS] [--timeout-ms T]
//       (STEPMESH_RENDEZVOUS and the rest from the environment)
// stdout, one line each, flushed:
//   joined <role> <rank> roster <n> epoch <e> ms <join time> running <0|1>
//                                                             | join failed: <status>
//   event lost|left|joined <role> <rank> epoch <e>
//   barrier ok <ms>                                           | barrier failed: <status>
//   drain announced                                           | drain failed: <status>
// stdin commands: "barrier", "drain" (AnnounceLeaving: counted out, still
// connected), "leave" (orderly, then exit 0). EOF = leave.

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "src/core/protocol.h"
#include "stepmesh/options.h"
#include "tests/support/node_flags.h"

namespace {

std::mutex print_mu;

void Print(const std::string& line) {
  std::lock_guard<std::mutex> lock(print_mu);
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

std::string Node(stepmesh::core::NodeId node) {
  return absl::StrCat(
      stepmesh::core::NodeRole(node) == stepmesh::Role::kWorker ? "worker" : "server", " ",
      stepmesh::core::NodeRank(node));
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<stepmesh::MeshOptions> from_env = stepmesh::testing::NodeOptionsFromEnv();
  if (!from_env.has_value()) return 2;
  stepmesh::MeshOptions options = *std::move(from_env);
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    int n = 0;
    const bool numeric = absl::SimpleAtoi(value, &n);
    if (flag == "--role" && (value == "worker" || value == "server")) {
      options.role = value == "worker" ? stepmesh::Role::kWorker : stepmesh::Role::kServer;
    } else if (flag == "--max-workers" && numeric) {
      options.max_workers = n;
    } else if (flag == "--max-servers" && numeric) {
      options.max_servers = n;
    } else if (flag == "--scheduler" ||  // from the environment (STEPMESH_RENDEZVOUS)
               !stepmesh::testing::ApplyMeshFlag(flag, value, &options)) {
      std::fprintf(stderr, "bad flag %s %s\n", flag.c_str(), value.c_str());
      return 2;
    }
  }
  if (absl::Status valid = options.Validate(); !valid.ok()) {
    std::fprintf(stderr, "%s\n", valid.ToString().c_str());
    return 2;
  }
  const absl::Time start = absl::Now();
  const std::string endpoint = absl::StrCat("tcp://127.0.0.1:", 40000 + getpid() % 20000);
  auto joined = stepmesh::compose::JoinRendezvous(options, endpoint);
  if (!joined.ok()) {
    Print(absl::StrCat("join failed: ", joined.status().ToString()));
    return 1;
  }
  stepmesh::core::Rendezvous& r = **joined;
  Print(absl::StrCat("joined ", Node(r.self()), " roster ", r.roster().size(), " epoch ",
                     r.roster_epoch(), " ms ", absl::ToInt64Milliseconds(absl::Now() - start),
                     " running ", r.joined_running() ? 1 : 0));
  r.StartMonitor({.on_membership = [](const stepmesh::core::MembershipEvent& e) {
    using Kind = stepmesh::core::MembershipEvent::Kind;
    const char* kind = e.kind == Kind::kLost ? "lost" : e.kind == Kind::kLeft ? "left" : "joined";
    Print(absl::StrCat("event ", kind, " ", Node(e.node), " epoch ", e.epoch));
  }});
  std::string command;
  while (std::getline(std::cin, command)) {
    if (command == "barrier") {
      const absl::Time t = absl::Now();
      absl::Status s = r.Barrier(options.timeout);
      Print(s.ok() ? absl::StrCat("barrier ok ", absl::ToInt64Milliseconds(absl::Now() - t))
                   : absl::StrCat("barrier failed: ", s.ToString()));
    } else if (command == "drain") {
      absl::Status s = r.AnnounceLeaving();
      Print(s.ok() ? std::string("drain announced") : absl::StrCat("drain failed: ", s.ToString()));
    } else if (command == "leave") {
      break;
    }
  }
  r.Leave();
  joined->reset();
  Print("left");
  return 0;
}
