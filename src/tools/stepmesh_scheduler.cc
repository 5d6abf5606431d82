// The rendezvous service as its own process. Configured like every
// participant: flags here, or STEPMESH_* / DMLC_* variables.
//   stepmesh_scheduler --address 0.0.0.0:9000 --workers 2 --servers 2

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "stepmesh/scheduler.h"

namespace {

volatile std::sig_atomic_t interrupted = 0;

int Usage() {
  std::fprintf(stderr,
               "usage: stepmesh_scheduler [--address host:port] [--workers N] [--servers N]\n"
               "                          [--timeout-s S]\n"
               "Unset flags come from STEPMESH_* / DMLC_* (docs/configuration.md).\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<stepmesh::MeshOptions> from_env = stepmesh::MeshOptions::FromEnv();
  if (!from_env.ok()) {
    std::fprintf(stderr, "stepmesh_scheduler: %s\n", from_env.status().ToString().c_str());
    return 2;
  }
  stepmesh::MeshOptions options = *from_env;
  options.role = stepmesh::Role::kScheduler;
  int timeout_s = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return Usage();
    const std::string value = argv[++i];
    bool ok = true;
    if (flag == "--address") {
      options.scheduler = value;
    } else if (flag == "--workers") {
      ok = absl::SimpleAtoi(value, &options.num_workers);
    } else if (flag == "--servers") {
      ok = absl::SimpleAtoi(value, &options.num_servers);
    } else if (flag == "--timeout-s") {
      ok = absl::SimpleAtoi(value, &timeout_s);
    } else {
      return Usage();
    }
    if (!ok) return Usage();
  }
  auto scheduler = stepmesh::Scheduler::Start(options);
  if (!scheduler.ok()) {
    std::fprintf(stderr, "stepmesh_scheduler: %s\n", scheduler.status().ToString().c_str());
    return 1;
  }
  std::printf("stepmesh_scheduler listening on %s for %d workers and %d servers\n",
              (*scheduler)->address().c_str(), options.num_workers, options.num_servers);
  std::fflush(stdout);
  std::signal(SIGINT, [](int) { interrupted = 1; });
  std::signal(SIGTERM, [](int) { interrupted = 1; });
  const absl::Time give_up =
      timeout_s > 0 ? absl::Now() + absl::Seconds(timeout_s) : absl::InfiniteFuture();
  while (!interrupted && absl::Now() < give_up) {
    if ((*scheduler)->WaitUntilDone(absl::Milliseconds(200)).ok()) return 0;
  }
  std::fprintf(stderr, "stepmesh_scheduler: %s\n",
               interrupted ? "interrupted" : "timed out before every participant left");
  return 1;
}
