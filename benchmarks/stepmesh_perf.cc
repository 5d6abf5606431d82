// stepmesh_perf: end-to-end latency of the AF exchange (push to every server,
// every server's reply back) with baselines measured in the same run,
// interleaved, over the same bytes and processes (ARCHITECTURE.md §9: only
// ratios against a same-run baseline mean anything on a shared machine).
//
// One machine (default): launches an xAyF mesh on 127.0.0.1 as child
// processes of itself (--threads: threads of this process), measures on
// worker 0 (this process) and prints an ib_write_lat-like table per size:
//   stepmesh_perf --transport tcp --pattern 1A1F --push-bytes 917504
//       (cont.) --pull-bytes 1835008 --iters 2000 --baseline raw-tcp,zmq --json out.json
// Two hosts: run the roles yourself (docs/benchmarks.md):
//   host A: stepmesh_perf --role scheduler --scheduler A:9000 --pattern 1A1F
//   host A: stepmesh_perf --role server --rank 0 --scheduler A:9000 --host A ...
//   host B: stepmesh_perf --role worker --rank 0 --scheduler A:9000 --host B --server-hosts A ...
// Or configured like a StepMesh process: unset mesh flags come from the environment
//   DMLC_ROLE=server DMLC_PS_ROOT_URI=A DMLC_PS_ROOT_PORT=9000 DMLC_NUM_WORKER=1
//       (cont.) DMLC_NUM_SERVER=1 stepmesh_perf --sizes 4096 --iters 100
// Every participant must get the same plan flags (pattern, sizes, iters, warmup,
// reps, micro-batches, baselines): the phases are lock-stepped by mesh barriers.
//
// This file: the launcher and main(); the flags are perf_flags.h, the server
// and worker roles perf_roles.h.

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "benchmarks/perf_flags.h"
#include "benchmarks/perf_report.h"
#include "benchmarks/perf_roles.h"
#include "src/base/net.h"
#include "stepmesh/stepmesh.h"
#include "tests/support/child_process.h"

namespace stepmesh::bench {
namespace {

// ---------------------------------------------------------------- launcher

// PIDs the watchdog kills when the deadline passes (async-signal-safe reads):
// one per child process, which ParseFlags bounds (kMaxChildren).
std::atomic<pid_t> g_children[kMaxChildren];

void StartWatchdog(int deadline_s) {
  std::thread([deadline_s] {
    absl::SleepFor(absl::Seconds(deadline_s));
    std::fprintf(stderr, "stepmesh_perf: deadline of %d s passed, killing the run\n", deadline_s);
    for (auto& pid : g_children) {
      const pid_t p = pid.load();
      if (p > 0) ::kill(p, SIGKILL);
    }
    std::_Exit(124);
  }).detach();
}

// Free TCP ports for the baseline listeners, probed here and bound later by
// the child processes. Taken below the kernel's ephemeral range, where no
// port-0 listener or outgoing connection of the mesh can grab one in between
// (ephemeral probes lost that race about once in 70 runs).
absl::StatusOr<int> PickBaselinePort(int servers) {
  int ephemeral_low = 32768;
  if (std::FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &ephemeral_low) != 1) ephemeral_low = 32768;
    std::fclose(f);
  }
  const int low = 10000;
  const int high = ephemeral_low - 2 * servers;  // exclusive
  if (high <= low) return absl::UnavailableError("no port range below the ephemeral ports");
  std::mt19937 rng{std::random_device{}()};
  std::uniform_int_distribution<int> pick(low, high - 1);
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int base = pick(rng);
    bool all_free = true;
    for (int p = base; p < base + 2 * servers && all_free; ++p) {
      all_free = base::ListenTcp("127.0.0.1", static_cast<uint16_t>(p)).ok();
    }
    if (all_free) return base;
  }
  return absl::UnavailableError("no free port range for the baselines");
}

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::vector<std::string> PlanArgs(const Flags& f) {
  std::vector<std::string> sizes;
  for (const auto& [p, q] : f.sizes) sizes.push_back(absl::StrCat(p, ":", q));
  std::vector<std::string> a = {"--scheduler",     f.scheduler,
                                "--transport",     f.transport,
                                "--backend",       f.backend,
                                "--device",        absl::StrCat(f.device),
                                "--pattern",       absl::StrCat(f.workers, "A", f.servers, "F"),
                                "--sizes",         absl::StrJoin(sizes, ","),
                                "--micro-batches", absl::StrCat(f.micro_batches),
                                "--warmup",        absl::StrCat(f.warmup),
                                "--iters",         absl::StrCat(f.iters),
                                "--reps",          absl::StrCat(f.reps),
                                "--poll-mode",     f.poll_mode,
                                "--host",          f.host,
                                "--baseline-port", absl::StrCat(f.baseline_port),
                                "--deadline-s",    absl::StrCat(f.deadline_s),
                                "--timeout-ms",    absl::StrCat(f.timeout_ms),
                                "--sockbuf",       absl::StrCat(f.sockbuf)};
  if (!f.baselines.empty()) {
    a.push_back("--baseline");
    a.push_back(absl::StrJoin(f.baselines, ","));
  }
  if (!f.send_cores.empty()) {
    a.push_back("--send-cores");
    a.push_back(absl::StrJoin(f.send_cores, ","));
  }
  if (!f.recv_cores.empty()) {
    a.push_back("--recv-cores");
    a.push_back(absl::StrJoin(f.recv_cores, ","));
  }
  if (f.metrics_port > 0) {
    a.push_back("--metrics-port");
    a.push_back(absl::StrCat(f.metrics_port));
  }
  if (!f.metrics_file.empty()) {
    a.push_back("--metrics-file");
    a.push_back(f.metrics_file);
  }
  if (!f.chrome_trace.empty()) {
    a.push_back("--chrome-trace");
    a.push_back(f.chrome_trace);
  }
  return a;
}

int RunLaunch(Flags f) {
  MeshOptions sched_options = MakeOptions(f, Role::kScheduler);
  sched_options.scheduler = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Start(sched_options);
  if (!scheduler.ok()) {
    std::fprintf(stderr, "stepmesh_perf: scheduler: %s\n", scheduler.status().ToString().c_str());
    return 1;
  }
  f.scheduler = (*scheduler)->address();
  if (f.baseline_port == 0 && (Wants(f, "raw-tcp") || Wants(f, "raw-naive") || Wants(f, "zmq"))) {
    absl::StatusOr<int> port = PickBaselinePort(f.servers);
    if (!port.ok()) {
      std::fprintf(stderr, "stepmesh_perf: %s\n", port.status().ToString().c_str());
      return 1;
    }
    f.baseline_port = *port;
  }
  PrintHeader({f.command_line, f.pattern, f.workers, f.servers, f.transport, f.backend, f.poll_mode,
               f.micro_batches, f.warmup, f.iters, f.reps, !f.threads},
              GetMachineInfo());
  std::fflush(stdout);

  // Other participants: child processes of this binary, or threads.
  std::vector<testing::ChildProcess> children;
  std::vector<std::thread> threads;
  absl::Mutex error_mu;
  std::string thread_error;
  auto spawn = [&](const std::string& role, int rank) -> absl::Status {
    Flags g = f;
    g.rank = rank;
    if (f.threads) {
      threads.emplace_back([g, role, &error_mu, &thread_error] {
        absl::Status s = role == "server" ? RunServerRole(g) : RunWorkerRole(g).status();
        if (!s.ok()) {
          absl::MutexLock lock(&error_mu);
          absl::StrAppend(&thread_error, role, " ", g.rank, ": ", s.ToString(), "; ");
        }
      });
      return absl::OkStatus();
    }
    std::vector<std::string> argv = {SelfPath(),
                                     "--role",
                                     role,
                                     "--rank",
                                     absl::StrCat(rank),
                                     "--parent-pid",
                                     absl::StrCat(::getpid())};
    for (std::string& a : PlanArgs(g)) argv.push_back(std::move(a));
    STEPMESH_ASSIGN_OR_RETURN(testing::ChildProcess child, testing::ChildProcess::Spawn(argv));
    g_children[children.size()].store(child.pid());
    children.push_back(std::move(child));
    return absl::OkStatus();
  };
  absl::Status spawned;
  for (int s = 0; s < f.servers && spawned.ok(); ++s) spawned = spawn("server", s);
  for (int w = 1; w < f.workers && spawned.ok(); ++w) spawned = spawn("worker", w);
  int rc = 0;
  if (!spawned.ok()) {
    std::fprintf(stderr, "stepmesh_perf: %s\n", spawned.ToString().c_str());
    rc = 1;
  }
  absl::StatusOr<std::vector<SizeResult>> results = absl::CancelledError("not run");
  if (rc == 0) {
    Flags me = f;
    me.rank = 0;
    results = RunWorkerRole(me);
    if (!results.ok()) {
      std::fprintf(stderr, "stepmesh_perf: worker 0: %s\n", results.status().ToString().c_str());
      rc = 1;
    }
  }
  for (size_t i = 0; i < children.size(); ++i) {
    // After a failure here the children would only wait for their timeouts: end them now.
    if (rc != 0) children[i].Kill();
    absl::StatusOr<int> code =
        children[i].Wait(absl::Milliseconds(f.timeout_ms) + absl::Seconds(5));
    g_children[i].store(0);
    if (rc == 0 && (!code.ok() || *code != 0)) {
      std::fprintf(
          stderr, "stepmesh_perf: child %zu ended with %s\n", i,
          code.ok() ? absl::StrCat("exit code ", *code).c_str() : code.status().ToString().c_str());
      rc = 1;
    }
  }
  for (std::thread& t : threads) t.join();
  if (!thread_error.empty()) {
    std::fprintf(stderr, "stepmesh_perf: %s\n", thread_error.c_str());
    rc = 1;
  }
  (*scheduler)->Stop();
  if (rc == 0 && !f.json.empty()) {
    absl::Status written =
        WriteJson(f.json,
                  {f.command_line, f.pattern, f.workers, f.servers, f.transport, f.backend,
                   f.poll_mode, f.micro_batches, f.warmup, f.iters, f.reps, !f.threads},
                  GetMachineInfo(), *results);
    if (!written.ok()) {
      std::fprintf(stderr, "stepmesh_perf: %s\n", written.ToString().c_str());
      rc = 1;
    } else {
      std::printf("\n wrote %s\n", f.json.c_str());
    }
  }
  return rc;
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> parsed = ParseFlags(argc, argv);
  if (!parsed.ok()) return Usage(std::string(parsed.status().message()).c_str());
  Flags f = *std::move(parsed);
  if (f.parent_pid > 0) {
    // A child of the launcher dies with it, even when the launcher is SIGKILLed.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != f.parent_pid) return 1;
  }
  StartWatchdog(f.deadline_s);
  if (f.role == "launch") return RunLaunch(std::move(f));
  if (f.role == "scheduler") {
    MeshOptions o = MakeOptions(f, Role::kScheduler);
    absl::StatusOr<std::unique_ptr<Scheduler>> s = Scheduler::Start(o);
    if (!s.ok()) {
      std::fprintf(stderr, "stepmesh_perf: %s\n", s.status().ToString().c_str());
      return 1;
    }
    std::printf("scheduler at %s for %d worker(s) and %d server(s)\n", (*s)->address().c_str(),
                f.workers, f.servers);
    std::fflush(stdout);
    absl::Status done = (*s)->WaitUntilDone(absl::Seconds(f.deadline_s));
    (*s)->Stop();
    return done.ok() ? 0 : 1;
  }
  if (f.role == "server") {
    absl::Status s = RunServerRole(f);
    if (!s.ok())
      std::fprintf(stderr, "stepmesh_perf: server %d: %s\n", f.rank, s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  if (f.role == "worker") {
    const bool reporter = f.rank <= 0 && f.parent_pid == 0;
    if (reporter) {
      PrintHeader({f.command_line, f.pattern, f.workers, f.servers, f.transport, f.backend,
                   f.poll_mode, f.micro_batches, f.warmup, f.iters, f.reps, true},
                  GetMachineInfo());
    }
    absl::StatusOr<std::vector<SizeResult>> r = RunWorkerRole(f);
    if (!r.ok()) {
      std::fprintf(stderr, "stepmesh_perf: worker %d: %s\n", f.rank, r.status().ToString().c_str());
      return 1;
    }
    if (reporter && !f.json.empty()) {
      absl::Status w =
          WriteJson(f.json,
                    {f.command_line, f.pattern, f.workers, f.servers, f.transport, f.backend,
                     f.poll_mode, f.micro_batches, f.warmup, f.iters, f.reps, true},
                    GetMachineInfo(), *r);
      if (!w.ok()) std::fprintf(stderr, "stepmesh_perf: %s\n", w.ToString().c_str());
      return w.ok() ? 0 : 1;
    }
    return 0;
  }
  return Usage("unknown --role");
}

}  // namespace
}  // namespace stepmesh::bench

int main(int argc, char** argv) { return stepmesh::bench::Main(argc, argv); }
