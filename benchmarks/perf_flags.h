#pragma once
// The options of stepmesh_perf: the Flags every participant is given, their
// parsing and checks (completed from STEPMESH_* / DMLC_* where unset), and the
// MeshOptions they make. The roles are perf_roles.h, the launcher
// stepmesh_perf.cc.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "stepmesh/options.h"

namespace stepmesh::bench {

struct Flags {
  std::string role = "launch";  // launch | worker | server | scheduler
  std::string scheduler = "127.0.0.1:0";
  int rank = -1;
  std::string transport = "tcp";
  std::string backend = "cpu_mock";
  int device = 0;
  std::string pattern = "1A1F";
  int workers = 1;
  int servers = 1;
  std::vector<std::pair<size_t, size_t>> sizes;  // (push, pull) per server
  int micro_batches = 1;
  int warmup = 100;
  int iters = 1000;
  int reps = 3;
  std::string poll_mode = "adaptive";
  std::vector<int> send_cores;
  std::vector<int> recv_cores;
  std::vector<std::string> baselines;
  std::string json;
  std::string host = "127.0.0.1";         // this node's data / baseline listeners
  std::vector<std::string> server_hosts;  // worker: server s's host (default: host)
  int baseline_port = 0;                  // server s: raw base+2s, zmq base+2s+1
  int deadline_s = 900;                   // the whole run, then every process is killed
  int timeout_ms = 30000;                 // one wait, connect or barrier
  int sockbuf = 8 << 20;                  // raw-tcp SO_SNDBUF/SO_RCVBUF, as the TCP transport
  bool threads = false;
  int metrics_port = 0;      // > 0: worker w serves GET /metrics on it + w, server s on it + X + s
  std::string metrics_file;  // each participant writes <file>.<role><rank> before leaving
  std::string chrome_trace;  // each participant writes <file>.<role><rank>.json (docs/tracing.md)
  int parent_pid = 0;        // internal: set on children
  std::string command_line;
};

// The launcher's child processes (--workers + --servers - 1) at most. The
// watchdog's table of them was 64 long while nothing checked the count, so
// 64A16F wrote past its end into the globals after it (seen as a SIGSEGV in
// getenv in a later MeshOptions::FromEnv).
inline constexpr int kMaxChildren = 1024;

// Prints the usage (after `why`, when not null) to stderr; returns 2.
int Usage(const char* why);

absl::StatusOr<Flags> ParseFlags(int argc, char** argv);

// Whether --baseline names `baseline`.
bool Wants(const Flags& f, absl::string_view baseline);

// The MeshOptions of a participant in `role`: STEPMESH_* from the environment,
// the mesh flags over them.
MeshOptions MakeOptions(const Flags& f, Role role);

}  // namespace stepmesh::bench
