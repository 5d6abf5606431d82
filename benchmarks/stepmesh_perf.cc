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

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "benchmarks/perf_baselines.h"
#include "benchmarks/perf_report.h"
#include "src/base/net.h"
#include "src/tools/metrics/metrics_http.h"
#include "stepmesh/stepmesh.h"
#include "tests/support/child_process.h"

namespace stepmesh::bench {
namespace {

constexpr size_t kDefaultSweep[] = {8, 4096, 917504, 1835008, 3670016};

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

int Usage(const char* why) {
  if (why != nullptr) std::fprintf(stderr, "stepmesh_perf: %s\n\n", why);
  std::fprintf(
      stderr,
      "usage: stepmesh_perf [--role launch|worker|server|scheduler] [--scheduler H:P] [--rank R]\n"
      "  [--transport tcp|rdma|libfabric] [--backend cpu_mock|cuda] [--device N]\n"
      "  [--pattern 1A1F|1A2F|2A1F|2A2F|xAyF] [--workers X --servers Y (with xAyF)]\n"
      "  [--push-bytes B] [--pull-bytes B] | [--sizes P:Q,P:Q,...]   (default sweep 8 B..3.5 MiB)\n"
      "  [--micro-batches M] [--warmup N] [--iters N] [--reps R]\n"
      "  [--poll-mode spin|adaptive|blocking] [--send-cores C,..] [--recv-cores C,..]\n"
      "  [--baseline raw-tcp,raw-naive,zmq,memcpy] [--json FILE]\n"
      "  [--host IP] [--server-hosts IP,..] [--baseline-port P] [--threads]\n"
      "  [--deadline-s S] [--timeout-ms T] [--sockbuf BYTES]\n"
      "  [--metrics-port P] [--metrics-file PATH]   (docs/metrics.md)\n"
      "  [--chrome-trace PATH]   each participant's trace as PATH.<role><rank>.json; merge\n"
      "                          them with stepmesh_trace_merge (docs/tracing.md)\n"
      "Unset mesh flags (role, rank, pattern, scheduler, host, transport, backend, device,\n"
      "poll mode, cores, timeout) come from STEPMESH_* / DMLC_* (docs/configuration.md).\n");
  return 2;
}

bool ParseInts(absl::string_view text, std::vector<int>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v)) return false;
    out->push_back(v);
  }
  return true;
}

// Where a flag's value goes; the kind of the target says how the value is read
// (a comma list for the vectors).
using FlagTarget =
    std::variant<std::string*, int*, size_t*, std::vector<int>*, std::vector<std::string>*>;

bool ReadFlagValue(absl::string_view value, const FlagTarget& target) {
  struct Reader {
    absl::string_view value;
    bool operator()(std::string* out) const {
      *out = std::string(value);
      return true;
    }
    bool operator()(int* out) const { return absl::SimpleAtoi(value, out); }
    bool operator()(size_t* out) const { return absl::SimpleAtoi(value, out); }
    bool operator()(std::vector<int>* out) const { return ParseInts(value, out); }
    bool operator()(std::vector<std::string>* out) const {
      *out = absl::StrSplit(value, ',', absl::SkipEmpty());
      return true;
    }
  };
  return std::visit(Reader{value}, target);
}

// The launcher's child processes (--workers + --servers - 1) at most. The
// watchdog's table of them was 64 long while nothing checked the count, so
// 64A16F wrote past its end into the globals after it (seen as a SIGSEGV in
// getenv in a later MeshOptions::FromEnv).
constexpr int kMaxChildren = 1024;

// "2A2F" -> (2, 2); "xAyF" keeps --workers/--servers.
bool ParsePattern(const std::string& p, int* workers, int* servers) {
  if (p == "xAyF") return true;
  const size_t a = p.find('A');
  if (a == std::string::npos || p.empty() || p.back() != 'F') return false;
  return absl::SimpleAtoi(p.substr(0, a), workers) &&
         absl::SimpleAtoi(p.substr(a + 1, p.size() - a - 2), servers) && *workers > 0 &&
         *servers > 0;
}

// The mesh flags over `o` (its other fields stay). ParseFlags has checked
// --poll-mode before this is called.
void SetMeshFlags(const Flags& f, MeshOptions& o) {
  o.rank = f.rank;
  o.num_workers = f.workers;
  o.num_servers = f.servers;
  o.scheduler = f.scheduler;
  o.bind_host = f.host;
  o.transport = f.transport;
  o.backend = f.backend;
  o.device = f.device;
  o.timeout = absl::Milliseconds(f.timeout_ms);
  o.threads.poll_mode = *ParsePollMode(f.poll_mode);
  o.threads.send_cores = f.send_cores;
  o.threads.recv_cores = f.recv_cores;
}

// The mesh a flag leaves unset comes from the environment (STEPMESH_* /
// DMLC_*, docs/configuration.md), as in every stepmesh program: a launcher's
// DMLC_ROLE, DMLC_NUM_WORKER, DMLC_PS_ROOT_URI, ... are not overridden by flag
// defaults. A flag that is given wins over the environment.
absl::Status TakeMeshFromEnvironment(Flags& f, const std::set<std::string>& given) {
  auto unset = [&given](const char* flag) { return given.count(flag) == 0; };
  STEPMESH_ASSIGN_OR_RETURN(std::optional<Role> role, RoleFromEnv());
  if (unset("--role") && role.has_value()) f.role = std::string(RoleName(*role));
  // The flag defaults as the base: a variable that is not set leaves them.
  MeshOptions base;
  SetMeshFlags(f, base);
  STEPMESH_ASSIGN_OR_RETURN(const MeshOptions env, MeshOptions::FromEnv(base));
  if (unset("--rank")) f.rank = env.rank;
  const bool shape_from_flags = !unset("--pattern") && f.pattern != "xAyF";
  if (!shape_from_flags) {
    if (unset("--workers")) f.workers = env.num_workers;
    if (unset("--servers")) f.servers = env.num_servers;
    f.pattern = absl::StrCat(f.workers, "A", f.servers, "F");
  }
  if (unset("--scheduler")) f.scheduler = env.scheduler;
  if (unset("--host")) f.host = env.bind_host;
  if (unset("--transport")) f.transport = env.transport;
  if (unset("--backend")) f.backend = env.backend;
  if (unset("--device")) f.device = env.device;
  if (unset("--timeout-ms")) f.timeout_ms = static_cast<int>(env.timeout / absl::Milliseconds(1));
  if (unset("--poll-mode")) f.poll_mode = std::string(PollModeName(env.threads.poll_mode));
  if (unset("--send-cores")) f.send_cores = env.threads.send_cores;
  if (unset("--recv-cores")) f.recv_cores = env.threads.recv_cores;
  return absl::OkStatus();
}

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  std::set<std::string> given;
  f.command_line = absl::StrJoin(argv, argv + argc, " ");
  size_t push = 0, pull = 0;
  std::string sizes_text;
  // Every flag that takes a value, and where the value goes (--threads takes none).
  const std::pair<absl::string_view, FlagTarget> targets[] = {{"--role", &f.role},
                                                              {"--scheduler", &f.scheduler},
                                                              {"--rank", &f.rank},
                                                              {"--transport", &f.transport},
                                                              {"--backend", &f.backend},
                                                              {"--device", &f.device},
                                                              {"--pattern", &f.pattern},
                                                              {"--workers", &f.workers},
                                                              {"--servers", &f.servers},
                                                              {"--push-bytes", &push},
                                                              {"--pull-bytes", &pull},
                                                              {"--sizes", &sizes_text},
                                                              {"--micro-batches", &f.micro_batches},
                                                              {"--warmup", &f.warmup},
                                                              {"--iters", &f.iters},
                                                              {"--reps", &f.reps},
                                                              {"--poll-mode", &f.poll_mode},
                                                              {"--send-cores", &f.send_cores},
                                                              {"--recv-cores", &f.recv_cores},
                                                              {"--baseline", &f.baselines},
                                                              {"--json", &f.json},
                                                              {"--host", &f.host},
                                                              {"--server-hosts", &f.server_hosts},
                                                              {"--baseline-port", &f.baseline_port},
                                                              {"--deadline-s", &f.deadline_s},
                                                              {"--timeout-ms", &f.timeout_ms},
                                                              {"--sockbuf", &f.sockbuf},
                                                              {"--metrics-port", &f.metrics_port},
                                                              {"--metrics-file", &f.metrics_file},
                                                              {"--chrome-trace", &f.chrome_trace},
                                                              {"--parent-pid", &f.parent_pid}};
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (flag == "--threads") {
      f.threads = true;
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("missing value for ", flag));
    }
    const auto target = std::find_if(std::begin(targets), std::end(targets),
                                     [&](const auto& t) { return t.first == flag; });
    if (target == std::end(targets)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
    if (!ReadFlagValue(value, target->second)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value for ", flag, ": ", value));
    }
    given.insert(flag);
  }
  if (!ParsePattern(f.pattern, &f.workers, &f.servers) || f.workers < 1 || f.servers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad pattern ", f.pattern));
  }
  if (!ParsePollMode(f.poll_mode).ok()) return absl::InvalidArgumentError("bad --poll-mode");
  STEPMESH_RETURN_IF_ERROR(TakeMeshFromEnvironment(f, given));
  if (f.workers + f.servers - 1 > kMaxChildren) {
    return absl::InvalidArgumentError(absl::StrCat("--workers ", f.workers, " + --servers ",
                                                   f.servers, " - 1 = ", f.workers + f.servers - 1,
                                                   " child processes, more than ", kMaxChildren));
  }
  if (!sizes_text.empty()) {
    for (absl::string_view pair : absl::StrSplit(sizes_text, ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> pq = absl::StrSplit(pair, absl::MaxSplits(':', 1));
      size_t p = 0, q = 0;
      if (!absl::SimpleAtoi(pq.first, &p)) return absl::InvalidArgumentError("bad --sizes");
      if (pq.second.empty())
        q = p;
      else if (!absl::SimpleAtoi(pq.second, &q))
        return absl::InvalidArgumentError("bad --sizes");
      f.sizes.push_back({p, q});
    }
  } else if (push > 0 || pull > 0) {
    f.sizes.push_back({push > 0 ? push : pull, pull > 0 ? pull : push});
  } else {
    for (size_t s : kDefaultSweep) f.sizes.push_back({s, s});
  }
  for (const auto& [p, q] : f.sizes) {
    if (p == 0 || q == 0) return absl::InvalidArgumentError("sizes must be at least 1 byte");
  }
  for (const std::string& b : f.baselines) {
    if (b != "raw-tcp" && b != "raw-naive" && b != "zmq" && b != "memcpy") {
      return absl::InvalidArgumentError(absl::StrCat("unknown baseline ", b));
    }
  }
  if (f.micro_batches < 1 || f.micro_batches > 32 || f.iters < 1 || f.warmup < 0 || f.reps < 1 ||
      f.reps > f.iters) {
    return absl::InvalidArgumentError("bad --micro-batches/--iters/--warmup/--reps");
  }
  if (!ParsePollMode(f.poll_mode).ok()) return absl::InvalidArgumentError("bad --poll-mode");
  return f;
}

bool Wants(const Flags& f, absl::string_view baseline) {
  return std::find(f.baselines.begin(), f.baselines.end(), baseline) != f.baselines.end();
}

// The lock-stepped plan every participant derives from the same flags. The
// raw-tcp baseline is measured in five disciplines (kRawFloorDisciplines in
// perf_baselines.h); the report's "raw-tcp" floor row is the best of them
// (DeriveRatios).
std::vector<std::string> Methods(const Flags& f) {
  std::vector<std::string> m = {"stepmesh"};
  if (Wants(f, "raw-tcp")) {
    for (const RawDiscipline& d : kRawFloorDisciplines) m.push_back(d.method);
  }
  for (const char* b : {"raw-naive", "zmq", "memcpy"}) {
    if (Wants(f, b)) m.push_back(b);
  }
  return m;
}
// Indices into Methods(f) in the order repetition `rep` runs them: rotated by
// one each repetition, so no method always runs first (on a warm cache, after
// the same neighbour) and drift in the machine's load spreads over all of them.
std::vector<size_t> MethodOrder(const Flags& f, int rep) {
  const size_t n = Methods(f).size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = (i + static_cast<size_t>(rep)) % n;
  return order;
}
// Measured iterations of repetition `rep`: the total split as evenly as possible.
int ItersInRep(const Flags& f, int rep) {
  return f.iters / f.reps + (rep < f.iters % f.reps ? 1 : 0);
}

Key PushKey(size_t size_index, int m) { return 1000 + size_index * 64 + m; }
Key PullKey(size_t size_index, int m) { return 100000 + size_index * 64 + m; }

MeshOptions MakeOptions(const Flags& f, Role role) {
  // STEPMESH_* variables (spin budget, RDMA knobs, ...) apply; the flags below win.
  absl::StatusOr<MeshOptions> from_env = MeshOptions::FromEnv();
  if (!from_env.ok()) {
    std::fprintf(stderr, "stepmesh_perf: ignoring the environment: %s\n",
                 from_env.status().ToString().c_str());
  }
  MeshOptions o = from_env.ok() ? *from_env : MeshOptions();
  // The flags, completed from the environment where unset (TakeMeshFromEnvironment).
  o.role = role;
  SetMeshFlags(f, o);
  o.max_inflight_requests = std::max(64, 2 * f.micro_batches);
  // --chrome-trace without STEPMESH_TRACE_EVENTS: the newest 64 Ki requests.
  if (!f.chrome_trace.empty() && o.trace.events == 0) o.trace.events = 1 << 16;
  return o;
}

// Registered memory of one participant, owned for the whole run.
struct Buffers {
  std::vector<std::unique_ptr<Memory>> owned;
  absl::StatusOr<void*> Allocate(Backend& backend, size_t bytes) {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Memory> m,
                              backend.Allocate(bytes, MemoryKind::kDevice));
    void* p = m->data();
    owned.push_back(std::move(m));
    return p;
  }
};

TensorView View2d(void* data, int64_t rows, size_t cols, Device device) {
  return TensorView{data, DType::kUInt8, Shape{rows, static_cast<int64_t>(cols)}, device};
}

// ---------------------------------------------------------------- metrics

// --metrics-port: this participant's Stats() over HTTP on port + `offset`
// while it runs (null without the flag). `stats` must outlive the server.
absl::StatusOr<std::unique_ptr<tools::MetricsHttpServer>> ServeMetrics(
    const Flags& f, int offset, std::function<MeshStats()> stats) {
  if (f.metrics_port <= 0) return nullptr;
  const int port = f.metrics_port + offset;
  if (port > 65535) return absl::InvalidArgumentError(absl::StrCat("metrics port ", port));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<tools::MetricsHttpServer> server,
                            tools::MetricsHttpServer::Start(static_cast<uint16_t>(port), [stats] {
                              return PrometheusText(stats());
                            }));
  std::printf("metrics: http://127.0.0.1:%u/metrics\n", server->port());
  std::fflush(stdout);
  return server;
}

// --metrics-file: the final counters, as <file>.<role><rank>.
// --chrome-trace: the participant's trace, as <file>.<role><rank>.json.
template <typename Participant>
absl::Status WriteTrace(const Flags& f, Role role, Participant& p) {
  if (f.chrome_trace.empty()) return absl::OkStatus();
  return p.WriteChromeTrace(absl::StrCat(f.chrome_trace, ".", RoleName(role), p.rank(), ".json"));
}

absl::Status WriteMetrics(const Flags& f, const MeshStats& stats) {
  if (f.metrics_file.empty()) return absl::OkStatus();
  return tools::WriteMetricsFile(
      absl::StrCat(f.metrics_file, ".", RoleName(stats.role), stats.rank), PrometheusText(stats));
}

// ---------------------------------------------------------------- server

absl::Status RunServerRole(const Flags& f) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Backend> made, CreateBackend(f.backend, f.device));
  std::shared_ptr<Backend> backend = std::move(made);
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<AFTensorServer> server,
                            AFTensorServer::Create(MakeOptions(f, Role::kServer), backend));
  const int s = server->rank();
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<tools::MetricsHttpServer> metrics,
                            ServeMetrics(f, f.workers + s, [&] { return server->Stats(); }));
  std::unique_ptr<BaselineServers> baselines;
  if (Wants(f, "raw-tcp") || Wants(f, "raw-naive") || Wants(f, "zmq")) {
    if (f.baseline_port <= 0) return absl::InvalidArgumentError("baselines need --baseline-port");
    STEPMESH_ASSIGN_OR_RETURN(
        baselines,
        BaselineServers::Start(f.host, static_cast<uint16_t>(f.baseline_port + 2 * s),
                               Wants(f, "zmq") ? f.baseline_port + 2 * s + 1 : 0, f.sockbuf));
  }
  Buffers buffers;
  const int64_t workers = f.workers;
  for (size_t z = 0; z < f.sizes.size(); ++z) {
    const auto [push, pull] = f.sizes[z];
    for (int m = 0; m < f.micro_batches; ++m) {
      STEPMESH_ASSIGN_OR_RETURN(void* recv, buffers.Allocate(*backend, workers * push));
      STEPMESH_ASSIGN_OR_RETURN(void* reply, buffers.Allocate(*backend, workers * pull));
      // A recognisable reply: worker 0 checks one byte per phase.
      STEPMESH_RETURN_IF_ERROR(backend->Copy(
          reply, std::vector<uint8_t>(workers * pull, static_cast<uint8_t>(s + 1)).data(),
          workers * pull));
      STEPMESH_RETURN_IF_ERROR(server->RegisterRecvTensor(
          PushKey(z, m), View2d(recv, workers, push, backend->device())));
      STEPMESH_RETURN_IF_ERROR(server->RegisterReplyTensor(
          PullKey(z, m), View2d(reply, workers, pull, backend->device())));
    }
  }
  STEPMESH_RETURN_IF_ERROR(server->Barrier());  // registered; baseline listeners up
  const absl::Duration timeout = absl::Milliseconds(f.timeout_ms);
  std::vector<Reply> replies;
  for (size_t z = 0; z < f.sizes.size(); ++z) {
    for (int rep = 0; rep < f.reps; ++rep) {
      for (size_t k : MethodOrder(f, rep)) {
        const std::string method = Methods(f)[k];
        STEPMESH_RETURN_IF_ERROR(server->Barrier());
        if (method != "stepmesh") continue;  // baselines are served by their own threads
        const int batches = f.warmup + ItersInRep(f, rep);
        for (int b = 0; b < batches; ++b) {
          STEPMESH_ASSIGN_OR_RETURN(Batch batch, server->GetBatch(timeout));
          replies.clear();
          for (int w : batch.workers) replies.push_back({w, f.sizes[z].second});
          STEPMESH_RETURN_IF_ERROR(server->Respond(batch, replies));
        }
      }
    }
  }
  STEPMESH_RETURN_IF_ERROR(server->Barrier());  // every worker is done with the baselines
  STEPMESH_RETURN_IF_ERROR(WriteMetrics(f, server->Stats()));
  STEPMESH_RETURN_IF_ERROR(WriteTrace(f, Role::kServer, *server));
  metrics.reset();
  return server->Shutdown();
}

// ---------------------------------------------------------------- worker

struct Accumulated {
  std::vector<uint64_t> samples_ns;
  uint64_t process_cpu_ns = 0;
  uint64_t thread_cpu_ns = 0;
  uint64_t measured = 0;
  std::string error;
  // stepmesh only: per-stage samples from the request's trace stamps (kStages).
  std::vector<std::vector<uint64_t>> stages;
  std::vector<double> rep_p50_us;  // p50 of each repetition alone
};

// Where one request's time goes, from its trace stamps (include/stepmesh/trace.h).
// Differences of stamps from two hosts are only meaningful on one host (the
// launcher's default); the two-host tables omit them.
constexpr const char* kStageNames[] = {
    "submit",    // PushPull() -> the push posted (inline, or the send-queue hand-off)
    "push",      // posted -> last push byte at the server (write, wire, read)
    "dispatch",  // arrival -> GetBatch() returns it (server receive -> application)
    "handle",    // GetBatch() returned -> Respond() called (the server application)
    "respond",   // Respond() called -> the reply posted (inline, or the send-thread hand-off)
    "reply",     // reply posted -> landed at the worker
    "complete",  // reply landed -> request complete (all servers)
    "wake",      // complete -> Wait() returned to the caller
};
constexpr size_t kStages = sizeof(kStageNames) / sizeof(kStageNames[0]);

void AddStages(const TraceRecord& t, uint64_t returned_ns,
               std::vector<std::vector<uint64_t>>& out) {
  // The server whose reply landed last decides the request's latency.
  const TraceRecord::PerServer* last = nullptr;
  for (const TraceRecord::PerServer& s : t.servers) {
    if (last == nullptr || s.stamps.reply_arrival_ns > last->stamps.reply_arrival_ns) last = &s;
  }
  if (last == nullptr) return;
  const TraceStamps& x = last->stamps;
  const uint64_t points[] = {x.enqueue_ns,        x.post_ns,           x.server_arrival_ns,
                             x.server_handler_ns, x.server_respond_ns, x.server_reply_ns,
                             x.reply_arrival_ns,  t.complete_ns,       returned_ns};
  for (uint64_t p : points) {
    if (p == 0) return;  // tracing off
  }
  out.resize(kStages);
  for (size_t i = 0; i < kStages; ++i) {
    out[i].push_back(points[i + 1] >= points[i] ? points[i + 1] - points[i] : 0);
  }
}

// Worker 0 keeps samples; the others run the same lock-stepped loops so that
// the servers see every worker, and discard theirs.
absl::StatusOr<std::vector<SizeResult>> RunWorkerRole(const Flags& f) {
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Backend> made, CreateBackend(f.backend, f.device));
  std::shared_ptr<Backend> backend = std::move(made);
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<AFTensorWorker> worker,
                            AFTensorWorker::Create(MakeOptions(f, Role::kWorker), backend));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<tools::MetricsHttpServer> metrics,
                            ServeMetrics(f, worker->rank(), [&] { return worker->Stats(); }));
  const int y = worker->num_servers();
  const int M = f.micro_batches;
  Buffers buffers;
  size_t max_push = 0, max_pull = 0;
  // push_mem[z][m], pull_mem[z][m][s]
  std::vector<std::vector<void*>> push_mem(f.sizes.size());
  std::vector<std::vector<std::vector<void*>>> pull_mem(f.sizes.size());
  for (size_t z = 0; z < f.sizes.size(); ++z) {
    const auto [push, pull] = f.sizes[z];
    max_push = std::max(max_push, push);
    max_pull = std::max(max_pull, pull);
    for (int m = 0; m < M; ++m) {
      STEPMESH_ASSIGN_OR_RETURN(void* p, buffers.Allocate(*backend, push));
      STEPMESH_RETURN_IF_ERROR(backend->Copy(p, std::vector<uint8_t>(push, 0x5A).data(), push));
      STEPMESH_RETURN_IF_ERROR(
          worker->RegisterPushTensor(PushKey(z, m), BytesView(p, push, backend->device())));
      push_mem[z].push_back(p);
      pull_mem[z].emplace_back();
      for (int s = 0; s < y; ++s) {
        STEPMESH_ASSIGN_OR_RETURN(void* q, buffers.Allocate(*backend, pull));
        STEPMESH_RETURN_IF_ERROR(
            worker->RegisterPullTensor(PullKey(z, m), s, BytesView(q, pull, backend->device())));
        pull_mem[z][m].push_back(q);
      }
    }
  }
  // Baselines move host memory (the same bytes; on cuda the mesh moves device memory).
  std::vector<uint8_t> host_push(max_push, 0x5A), host_scratch(std::max(max_push, max_pull), 0);
  std::vector<std::vector<uint8_t>> host_pull(y, std::vector<uint8_t>(max_pull, 0));
  std::vector<void*> host_pull_ptrs;
  for (auto& v : host_pull) host_pull_ptrs.push_back(v.data());

  STEPMESH_RETURN_IF_ERROR(worker->Barrier());  // servers registered, baseline listeners up
  const absl::Duration timeout = absl::Milliseconds(f.timeout_ms);
  std::vector<base::HostPort> raw_addrs, zmq_addrs;
  for (int s = 0; s < y; ++s) {
    const std::string host = f.server_hosts.empty()
                                 ? f.host
                                 : f.server_hosts[std::min<size_t>(s, f.server_hosts.size() - 1)];
    raw_addrs.push_back({host, static_cast<uint16_t>(f.baseline_port + 2 * s)});
    zmq_addrs.push_back({host, static_cast<uint16_t>(f.baseline_port + 2 * s + 1)});
  }
  // One client per baseline method, its own connections (a method's state
  // never leaks into another's).
  struct Client {
    std::unique_ptr<BaselineClient> client;
    std::string error;
  };
  std::map<std::string, Client> clients;
  auto connect = [&](const std::string& method, absl::StatusOr<std::unique_ptr<BaselineClient>> c) {
    if (c.ok())
      clients[method].client = *std::move(c);
    else
      clients[method].error = c.status().ToString();
  };
  if (Wants(f, "raw-tcp")) {
    for (const RawDiscipline& d : kRawFloorDisciplines) {
      connect(d.method, ConnectRawTcp(raw_addrs, f.sockbuf, timeout, f.workers, d));
    }
  }
  if (Wants(f, "raw-naive")) {
    connect(kRawNaive.method, ConnectRawTcp(raw_addrs, f.sockbuf, timeout, f.workers, kRawNaive));
  }
  if (Wants(f, "zmq")) connect("zmq", ConnectZmq(zmq_addrs, timeout, f.workers));

  const std::vector<std::string> methods = Methods(f);
  // Every node on this host (the launcher, or a worker role whose servers are
  // on its own loopback address, e.g. benchmarks/python_overhead.py's C++
  // row): stamps compare.
  const bool same_host =
      f.server_hosts.empty() && (f.role == "launch" || absl::StartsWith(f.host, "127."));
  std::vector<SizeResult> results;
  std::vector<Pull> pulls(y);
  for (size_t z = 0; z < f.sizes.size(); ++z) {
    const auto [push_bytes, pull_bytes] = f.sizes[z];
    std::vector<Accumulated> acc(methods.size());
    for (int rep = 0; rep < f.reps; ++rep) {
      const int measured = ItersInRep(f, rep);
      const int total = f.warmup + measured;
      for (size_t k : MethodOrder(f, rep)) {
        STEPMESH_RETURN_IF_ERROR(worker->Barrier());
        const std::string& method = methods[k];
        Accumulated& a = acc[k];
        // CPU is read when the first measured iteration starts and after the last.
        CpuClock cpu_start = CpuNow();
        auto record = [&](int i, uint64_t ns) {
          if (i >= f.warmup) a.samples_ns.push_back(ns);
        };
        if (method == "stepmesh") {
          // M requests in flight, one key each; request i reuses key i % M once
          // request i - M completed. Latency: PushPull() to Wait() returning.
          std::vector<RequestHandle> handles(M);
          std::vector<uint64_t> issued(M);
          for (int i = 0; i < total + M; ++i) {
            const int m = i % M;
            if (i >= M) {
              STEPMESH_RETURN_IF_ERROR(worker->Wait(handles[m], timeout));
              const uint64_t returned = MonotonicNowNs();
              record(i - M, returned - issued[m]);
              if (same_host && i - M >= f.warmup) {
                absl::StatusOr<TraceRecord> t = worker->FetchTrace(handles[m]);
                if (t.ok()) AddStages(*t, returned, a.stages);
              }
            }
            if (i >= total) continue;
            if (i == f.warmup) cpu_start = CpuNow();
            for (int s = 0; s < y; ++s) pulls[s] = {PullKey(z, m), s};
            const Push p{PushKey(z, m), push_bytes};
            issued[m] = MonotonicNowNs();
            STEPMESH_ASSIGN_OR_RETURN(handles[m], worker->PushPull({&p, 1}, pulls));
          }
          // Sanity: the reply really arrived (server s fills its reply with s + 1).
          uint8_t got = 0;
          STEPMESH_RETURN_IF_ERROR(backend->Copy(&got, pull_mem[z][0][y - 1], 1));
          if (got != static_cast<uint8_t>(y)) {
            return absl::DataLossError(absl::StrCat("reply byte ", int{got}, ", expected ", y));
          }
        } else if (method == "memcpy") {
          // The same bytes through one thread's memcpy: push out to every
          // server's slot, every reply back.
          for (int i = 0; i < total; ++i) {
            if (i == f.warmup) cpu_start = CpuNow();
            const uint64_t t0 = MonotonicNowNs();
            for (int s = 0; s < y; ++s)
              std::memcpy(host_scratch.data(), host_push.data(), push_bytes);
            for (int s = 0; s < y; ++s)
              std::memcpy(host_pull[s].data(), host_scratch.data(), pull_bytes);
            record(i, MonotonicNowNs() - t0);
          }
        } else {
          BaselineClient* client = clients[method].client.get();
          if (client == nullptr) {
            a.error = clients[method].error;
            continue;
          }
          for (int i = 0; i < total; ++i) {
            if (i == f.warmup) cpu_start = CpuNow();
            const uint64_t t0 = MonotonicNowNs();
            absl::Status st =
                client->Exchange(host_push.data(), push_bytes, host_pull_ptrs, pull_bytes);
            if (!st.ok()) return absl::Status(st.code(), absl::StrCat(method, ": ", st.message()));
            record(i, MonotonicNowNs() - t0);
          }
        }
        const CpuClock cpu_end = CpuNow();
        if (measured > 0 && a.samples_ns.size() >= static_cast<size_t>(measured)) {
          a.rep_p50_us.push_back(
              ComputeStats(std::vector<uint64_t>(a.samples_ns.end() - measured, a.samples_ns.end()))
                  .p50_us);
        }
        if (measured > 0) {
          a.process_cpu_ns += cpu_end.process_ns - cpu_start.process_ns;
          a.thread_cpu_ns += cpu_end.thread_ns - cpu_start.thread_ns;
          a.measured += measured;
        }
      }
    }
    SizeResult r;
    r.push_bytes = push_bytes;
    r.pull_bytes = pull_bytes;
    for (size_t k = 0; k < methods.size(); ++k) {
      MethodResult mr;
      mr.method = methods[k];
      if (!acc[k].error.empty() || acc[k].samples_ns.empty()) {
        mr.available = false;
        mr.note = acc[k].error.empty() ? "no samples" : acc[k].error;
      } else {
        mr.stats = ComputeStats(std::move(acc[k].samples_ns));
        const double bytes = static_cast<double>(push_bytes + pull_bytes) * y;
        mr.goodput_gbps = mr.stats.mean_us > 0 ? bytes * 8 / (mr.stats.mean_us * 1e3) : 0;
        mr.cpu_us_per_iter = acc[k].process_cpu_ns / 1e3 / static_cast<double>(acc[k].measured);
        mr.thread_cpu_us_per_iter =
            acc[k].thread_cpu_ns / 1e3 / static_cast<double>(acc[k].measured);
        if (mr.method != "stepmesh" && M > 1) mr.note = "baselines run one request at a time";
        if (mr.method == "raw-naive") {
          mr.note = "old row: servers in turn, blocking (a floor candidate too)";
        }
        for (size_t st = 0; st < acc[k].stages.size(); ++st) {
          const LatencyStats ss = ComputeStats(std::move(acc[k].stages[st]));
          r.stages.push_back({kStageNames[st], ss.p50_us, ss.p99_us, ss.mean_us});
        }
      }
      mr.rep_p50_us = acc[k].rep_p50_us;
      r.methods.push_back(std::move(mr));
    }
    DeriveRatios(r);
    if (worker->rank() == 0) {
      PrintSizeTable(r);
      std::fflush(stdout);
    }
    results.push_back(std::move(r));
  }
  clients.clear();  // close the baseline connections before the servers stop serving
  STEPMESH_RETURN_IF_ERROR(worker->Barrier());
  STEPMESH_RETURN_IF_ERROR(WriteMetrics(f, worker->Stats()));
  STEPMESH_RETURN_IF_ERROR(WriteTrace(f, Role::kWorker, *worker));
  metrics.reset();
  STEPMESH_RETURN_IF_ERROR(worker->Shutdown());
  return results;
}

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
