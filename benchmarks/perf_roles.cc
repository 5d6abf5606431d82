// stepmesh_perf's server and worker roles: the lock-stepped plan both derive
// from the flags, the registered buffers, --metrics-port/--metrics-file/
// --chrome-trace, and the measuring loops of worker 0.

#include "benchmarks/perf_roles.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "benchmarks/perf_baselines.h"
#include "benchmarks/perf_report.h"
#include "src/base/net.h"
#include "src/tools/metrics/metrics_http.h"
#include "stepmesh/stepmesh.h"

namespace stepmesh::bench {
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace stepmesh::bench
