// mesh_scale: how a mesh grows with its participants. Launches an xAyF mesh
// of processes (workers and servers, tiny tensors), and every participant
// measures itself:
//   create    Create(): joining the scheduler, the roster, every data
//             connection (rendezvous + connect)
//   barrier   a Barrier() once everyone is connected and registered (the
//             first barrier, which absorbs start-up skew, is reported apart)
//   round     one PushPull to every server and all replies back (workers)
//   rss, fds  VmRSS / VmHWM and open descriptors after the rounds
// Every reply byte is checked: server s fills worker w's slot with a byte
// derived from (s, w, round) and the worker compares its whole pull tensor.
//
//   mesh_scale --workers X --servers Y [--rounds R] [--bytes B]
//              [--poll-mode blocking|adaptive|spin] [--timeout-ms T]
//              [--deadline-s S] [--hosts NS,... --host-addrs A,...]
//              [--spawn-gap-us G]
//
// --spawn-gap-us starts the participants G us apart instead of all at once
// (the scheduler's cap on unfinished join handshakes grows with the mesh, so
// 128 started together form too). docs/benchmarks.md ("Scale") gives both.
//
// Besides the wall times, every participant reports the CPU it used before
// main (exec, dynamic loading, constructors) and in Create(); the launcher
// prints their sums, which do not depend on the machine's load, and its own
// CPU (the scheduler's thread and the launcher).
//
// Prints one table row per run (and the per-role breakdown). The launcher
// runs the scheduler in process on 127.0.0.1; the processes are its children
// (PR_SET_PDEATHSIG, killed by PID on any failure) and get their environment
// at exec. With --hosts (emulated hosts: network namespaces made by
// scripts/cluster.sh) participant i runs on host i mod H and binds that
// host's address; the scheduler runs on host 0.

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "stepmesh/stepmesh.h"

extern char** environ;

namespace stepmesh::scale {
namespace {

struct Flags {
  std::string role = "launch";
  int rank = -1;
  int workers = 4;
  int servers = 2;
  int rounds = 50;
  size_t bytes = 64;
  std::string poll_mode = "blocking";
  int timeout_ms = 60000;
  int deadline_s = 300;
  int spawn_gap_us = 0;
  std::string scheduler;
  std::string out;                             // a participant's result line goes here
  std::vector<std::string> hosts, host_addrs;  // --hosts / --host-addrs
};

int64_t MonoNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // one clock for every process of the host
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// CPU time of this process so far (every thread; at main, what exec, the
// dynamic loader and the static constructors took).
int64_t CpuNs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

absl::StatusOr<Flags> Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, " needs a value"));
    const std::string v = argv[++i];
    bool ok = true;
    if (flag == "--role") {
      f.role = v;
    } else if (flag == "--rank") {
      ok = absl::SimpleAtoi(v, &f.rank);
    } else if (flag == "--workers") {
      ok = absl::SimpleAtoi(v, &f.workers) && f.workers >= 1;
    } else if (flag == "--servers") {
      ok = absl::SimpleAtoi(v, &f.servers) && f.servers >= 1;
    } else if (flag == "--rounds") {
      ok = absl::SimpleAtoi(v, &f.rounds) && f.rounds >= 1;
    } else if (flag == "--bytes") {
      ok = absl::SimpleAtoi(v, &f.bytes) && f.bytes >= 1;
    } else if (flag == "--poll-mode") {
      f.poll_mode = v;
    } else if (flag == "--timeout-ms") {
      ok = absl::SimpleAtoi(v, &f.timeout_ms) && f.timeout_ms > 0;
    } else if (flag == "--deadline-s") {
      ok = absl::SimpleAtoi(v, &f.deadline_s) && f.deadline_s > 0;
    } else if (flag == "--spawn-gap-us") {
      ok = absl::SimpleAtoi(v, &f.spawn_gap_us) && f.spawn_gap_us >= 0;
    } else if (flag == "--scheduler") {
      f.scheduler = v;
    } else if (flag == "--out") {
      f.out = v;
    } else if (flag == "--hosts") {
      f.hosts = absl::StrSplit(v, ',');
    } else if (flag == "--host-addrs") {
      f.host_addrs = absl::StrSplit(v, ',');
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag));
    }
    if (!ok) return absl::InvalidArgumentError(absl::StrCat(flag, " ", v, ": bad value"));
  }
  if (f.hosts.size() != f.host_addrs.size()) {
    return absl::InvalidArgumentError("--hosts and --host-addrs must name as many hosts");
  }
  if (f.workers + f.servers > 1024) {
    return absl::InvalidArgumentError("at most 1024 participants");
  }
  return f;
}

absl::StatusOr<MeshOptions> Options(const Flags& f, Role role) {
  STEPMESH_ASSIGN_OR_RETURN(MeshOptions o, MeshOptions::FromEnv());
  o.role = role;
  o.rank = f.rank;
  o.num_workers = f.workers;
  o.num_servers = f.servers;
  o.scheduler = f.scheduler;
  o.transport = "tcp";
  o.timeout = absl::Milliseconds(f.timeout_ms);
  o.max_inflight_requests = 8;
  o.max_registrations = f.servers + 8;  // a worker: one push and a pull per server
  STEPMESH_ASSIGN_OR_RETURN(o.threads.poll_mode, ParsePollMode(f.poll_mode));
  STEPMESH_RETURN_IF_ERROR(o.Validate());
  return o;
}

// VmRSS and VmHWM in KiB, threads.
void ReadStatus(int64_t* rss_kb, int64_t* hwm_kb, int64_t* threads) {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    int64_t v = 0;
    if (key == "VmRSS:" && in >> v) *rss_kb = v;
    if (key == "VmHWM:" && in >> v) *hwm_kb = v;
    if (key == "Threads:" && in >> v) *threads = v;
    std::string rest;
    std::getline(in, rest);
  }
}

int64_t OpenFds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

uint8_t ReplyByte(int server, int worker, int round) {
  return static_cast<uint8_t>(1 + (server * 131 + worker * 29 + round * 7) % 251);
}

struct Measured {
  int64_t start_ns = 0, created_ns = 0;
  int64_t cpu_start_ns = 0, cpu_create_ns = 0;  // CPU before Create(), in Create()
  int64_t barrier1_ns = 0, barrier2_ns = 0;
  std::vector<int64_t> rounds_ns;
  int64_t rss = -1, hwm = -1, threads = -1, fds = -1;
  // After the rounds, before the last barrier: every peer still connected.
  void Snapshot() {
    ReadStatus(&rss, &hwm, &threads);
    fds = OpenFds();
  }
};

absl::Status WriteResult(const Flags& f, const Measured& m) {
  std::vector<int64_t> r = m.rounds_ns;
  std::sort(r.begin(), r.end());
  const int64_t p50 = r.empty() ? 0 : r[r.size() / 2];
  const int64_t p99 = r.empty() ? 0 : r[std::min(r.size() - 1, r.size() * 99 / 100)];
  std::ofstream out(f.out, std::ios::trunc);
  out << f.role << ' ' << f.rank << ' ' << m.start_ns << ' ' << m.created_ns << ' ' << m.barrier1_ns
      << ' ' << m.barrier2_ns << ' ' << p50 << ' ' << p99 << ' ' << m.rss << ' ' << m.hwm << ' '
      << m.fds << ' ' << m.threads << ' ' << m.cpu_start_ns << ' ' << m.cpu_create_ns << '\n';
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", f.out));
  return absl::OkStatus();
}

absl::Status RunServer(const Flags& f) {
  Measured m;
  m.start_ns = MonoNs();
  m.cpu_start_ns = CpuNs();
  STEPMESH_ASSIGN_OR_RETURN(MeshOptions o, Options(f, Role::kServer));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<AFTensorServer> server, AFTensorServer::Create(o));
  m.created_ns = MonoNs() - m.start_ns;
  m.cpu_create_ns = CpuNs() - m.cpu_start_ns;
  const int s = server->rank();
  std::vector<uint8_t> recv(f.workers * f.bytes), reply(f.workers * f.bytes);
  const Shape shape{f.workers, static_cast<int64_t>(f.bytes)};
  STEPMESH_RETURN_IF_ERROR(
      server->RegisterRecvTensor(1, TensorView{recv.data(), DType::kUInt8, shape}));
  STEPMESH_RETURN_IF_ERROR(
      server->RegisterReplyTensor(2, TensorView{reply.data(), DType::kUInt8, shape}));
  int64_t t = MonoNs();
  STEPMESH_RETURN_IF_ERROR(server->Barrier());
  m.barrier1_ns = MonoNs() - t;
  t = MonoNs();
  STEPMESH_RETURN_IF_ERROR(server->Barrier());
  m.barrier2_ns = MonoNs() - t;
  const absl::Duration timeout = absl::Milliseconds(f.timeout_ms);
  std::vector<Reply> replies;
  for (int round = 0; round < f.rounds; ++round) {
    STEPMESH_ASSIGN_OR_RETURN(Batch batch, server->GetBatch(timeout));
    if (static_cast<int>(batch.workers.size()) != f.workers) {
      return absl::DataLossError(absl::StrCat("server ", s, " round ", round, ": a batch of ",
                                              batch.workers.size(), " workers, want ", f.workers));
    }
    replies.clear();
    for (int w : batch.workers) {
      // The worker's push says which round it is in: its first byte.
      if (recv[size_t(w) * f.bytes] != static_cast<uint8_t>(round)) {
        return absl::DataLossError(absl::StrCat("server ", s, ": worker ", w, "'s push of round ",
                                                round, " starts with ",
                                                int{recv[size_t(w) * f.bytes]}));
      }
      std::memset(reply.data() + size_t(w) * f.bytes, ReplyByte(s, w, round), f.bytes);
      replies.push_back({w, f.bytes});
    }
    STEPMESH_RETURN_IF_ERROR(server->Respond(batch, replies));
  }
  m.Snapshot();
  STEPMESH_RETURN_IF_ERROR(server->Barrier());
  STEPMESH_RETURN_IF_ERROR(WriteResult(f, m));
  return server->Shutdown();
}

absl::Status RunWorker(const Flags& f) {
  Measured m;
  m.start_ns = MonoNs();
  m.cpu_start_ns = CpuNs();
  STEPMESH_ASSIGN_OR_RETURN(MeshOptions o, Options(f, Role::kWorker));
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<AFTensorWorker> worker, AFTensorWorker::Create(o));
  m.created_ns = MonoNs() - m.start_ns;
  m.cpu_create_ns = CpuNs() - m.cpu_start_ns;
  const int w = worker->rank();
  std::vector<uint8_t> push(f.bytes);
  std::vector<std::vector<uint8_t>> pulls(f.servers, std::vector<uint8_t>(f.bytes));
  STEPMESH_RETURN_IF_ERROR(worker->RegisterPushTensor(1, BytesView(push.data(), f.bytes)));
  std::vector<Pull> pull_list;
  for (int s = 0; s < f.servers; ++s) {
    STEPMESH_RETURN_IF_ERROR(worker->RegisterPullTensor(2, s, BytesView(pulls[s].data(), f.bytes)));
    pull_list.push_back({2, s});
  }
  int64_t t = MonoNs();
  STEPMESH_RETURN_IF_ERROR(worker->Barrier());
  m.barrier1_ns = MonoNs() - t;
  t = MonoNs();
  STEPMESH_RETURN_IF_ERROR(worker->Barrier());
  m.barrier2_ns = MonoNs() - t;
  const absl::Duration timeout = absl::Milliseconds(f.timeout_ms);
  for (int round = 0; round < f.rounds; ++round) {
    std::memset(push.data(), round, f.bytes);
    for (auto& p : pulls) std::fill(p.begin(), p.end(), 0);
    const Push p{1, f.bytes};
    t = MonoNs();
    STEPMESH_ASSIGN_OR_RETURN(RequestHandle h, worker->PushPull({&p, 1}, pull_list));
    STEPMESH_RETURN_IF_ERROR(worker->Wait(h, timeout));
    m.rounds_ns.push_back(MonoNs() - t);
    for (int s = 0; s < f.servers; ++s) {
      const uint8_t want = ReplyByte(s, w, round);
      for (size_t i = 0; i < f.bytes; ++i) {
        if (pulls[s][i] != want) {
          return absl::DataLossError(absl::StrCat("worker ", w, " round ", round, ": byte ", i,
                                                  " from server ", s, " is ", int{pulls[s][i]},
                                                  ", want ", int{want}));
        }
      }
    }
  }
  m.Snapshot();
  STEPMESH_RETURN_IF_ERROR(worker->Barrier());
  STEPMESH_RETURN_IF_ERROR(WriteResult(f, m));
  return worker->Shutdown();
}

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string("/proc/self/exe");
}

struct Row {
  std::string role;
  int rank = 0;
  int64_t start_ns = 0, created_ns = 0, b1 = 0, b2 = 0, p50 = 0, p99 = 0;
  int64_t cpu_start_ns = 0, cpu_create_ns = 0;
  int64_t rss = 0, hwm = 0, fds = 0, threads = 0;
};

double Ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }

int Launch(const Flags& f) {
  // --hosts: every host's namespace, opened before anything starts; this
  // thread (and the scheduler's, created later) moves to host 0.
  std::vector<int> netns;
  for (const std::string& h : f.hosts) {
    const std::string path = "/run/netns/" + h;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      std::fprintf(stderr, "mesh_scale: --hosts: %s: %s\n", path.c_str(), std::strerror(errno));
      return 2;
    }
    netns.push_back(fd);
  }
  if (!netns.empty() && ::setns(netns[0], CLONE_NEWNET) != 0) {
    std::fprintf(stderr, "mesh_scale: setns %s: %s\n", f.hosts[0].c_str(), std::strerror(errno));
    return 1;
  }
  absl::StatusOr<MeshOptions> env = MeshOptions::FromEnv();
  if (!env.ok()) {
    std::fprintf(stderr, "mesh_scale: %s\n", env.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::string> token = GenerateAuthToken();
  if (!token.ok()) return 1;
  MeshOptions so = *env;
  so.role = Role::kScheduler;
  so.num_workers = f.workers;
  so.num_servers = f.servers;
  so.scheduler = absl::StrCat(f.hosts.empty() ? "127.0.0.1" : f.host_addrs[0], ":0");
  so.timeout = absl::Milliseconds(f.timeout_ms);
  so.auth_token = *token;
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Start(so);
  if (!scheduler.ok()) {
    std::fprintf(stderr, "mesh_scale: scheduler: %s\n", scheduler.status().ToString().c_str());
    return 1;
  }
  char tmpl[] = "/tmp/mesh_scale.XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return 1;
  const std::string dir = tmpl;
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "STEPMESH_AUTH_TOKEN=", 20) != 0 &&
        std::strncmp(*e, "STEPMESH_BIND_HOST=", 19) != 0) {
      envs.push_back(*e);
    }
  }
  envs.push_back("STEPMESH_AUTH_TOKEN=" + *token);
  // One environment per host: its address is what the participant binds.
  const size_t host_count = std::max<size_t>(1, f.hosts.size());
  std::vector<std::vector<std::string>> host_envs(host_count, envs);
  std::vector<std::vector<char*>> host_envp(host_count);
  for (size_t h = 0; h < host_count; ++h) {
    if (!f.hosts.empty()) host_envs[h].push_back("STEPMESH_BIND_HOST=" + f.host_addrs[h]);
    for (auto& e : host_envs[h]) host_envp[h].push_back(e.data());
    host_envp[h].push_back(nullptr);
  }
  const std::string self = SelfPath();
  const int n = f.workers + f.servers;
  std::vector<std::string> outs;
  std::vector<std::vector<std::string>> argvs;
  std::vector<std::vector<char*>> argps;
  for (int i = 0; i < n; ++i) {
    const bool is_worker = i < f.workers;
    const int rank = is_worker ? i : i - f.workers;
    outs.push_back(absl::StrCat(dir, "/", is_worker ? "worker" : "server", rank));
    argvs.push_back({self,
                     "--role",
                     is_worker ? "worker" : "server",
                     "--rank",
                     absl::StrCat(rank),
                     "--workers",
                     absl::StrCat(f.workers),
                     "--servers",
                     absl::StrCat(f.servers),
                     "--rounds",
                     absl::StrCat(f.rounds),
                     "--bytes",
                     absl::StrCat(f.bytes),
                     "--poll-mode",
                     f.poll_mode,
                     "--timeout-ms",
                     absl::StrCat(f.timeout_ms),
                     "--scheduler",
                     (*scheduler)->address(),
                     "--out",
                     outs.back()});
  }
  for (auto& argv : argvs) {
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    argps.push_back(std::move(args));
  }
  // Each emulated host starts its own participants, as real hosts would: one
  // spawning thread per host, participant i forked at i * gap after the first
  // (a single thread forking all 128 in turn waits for the CPU 128 times on a
  // loaded machine: 1.7-2.7 s for the loop alone at load 20). vfork: the
  // child only makes system calls before execve, and the launcher's page
  // tables are not copied 128 times. The threads stay until every child has
  // exited: PR_SET_PDEATHSIG fires when the thread that forked a child ends,
  // not only the process.
  std::vector<pid_t> spawned(n, -1);
  const int64_t launch_ns = MonoNs();
  const pid_t parent = ::getpid();
  std::atomic<int> forks_left{n};
  std::atomic<int64_t> spawned_ns{launch_ns};  // when the last fork returned
  std::mutex release_mu;
  std::condition_variable release_cv;
  bool released = false;
  std::vector<std::thread> spawners;
  for (size_t host = 0; host < host_count; ++host) {
    spawners.emplace_back([&, host] {
      char** envp = host_envp[host].data();
      const int ns_fd = netns.empty() ? -1 : netns[host];
      for (int i = static_cast<int>(host); i < n; i += static_cast<int>(host_count)) {
        const int64_t at = launch_ns + int64_t{i} * f.spawn_gap_us * 1000;
        if (const int64_t wait = at - MonoNs(); wait > 0) absl::SleepFor(absl::Nanoseconds(wait));
        char** args = argps[i].data();
        const pid_t pid = ::vfork();
        if (pid == 0) {
          ::prctl(PR_SET_PDEATHSIG, SIGKILL);
          if (::getppid() != parent) ::_exit(127);
          if (ns_fd >= 0 && ::setns(ns_fd, CLONE_NEWNET) != 0) ::_exit(126);
          ::execve(args[0], args, envp);
          ::_exit(127);
        }
        spawned[i] = pid;  // -1: the fork failed (counted below)
        if (forks_left.fetch_sub(1) == 1) spawned_ns.store(MonoNs());
      }
      std::unique_lock<std::mutex> lock(release_mu);
      release_cv.wait(lock, [&] { return released; });
    });
  }
  // The spawners are done forking when every slot is written.
  while (forks_left.load() > 0) absl::SleepFor(absl::Milliseconds(1));
  std::vector<pid_t> pids;
  for (pid_t pid : spawned) {
    if (pid > 0) pids.push_back(pid);
  }
  // Wait for all, under the deadline; on any failure kill the rest by PID.
  const absl::Time deadline = absl::Now() + absl::Seconds(f.deadline_s);
  int failed = static_cast<int>(pids.size()) == n ? 0 : 1;
  std::vector<bool> done(pids.size(), false);
  size_t remaining = pids.size();
  while (remaining > 0) {
    // Whichever children exited since the last look (one call each, not one
    // per participant: 128 waitpid calls every 5 ms are CPU the mesh competes
    // with); every child of this process is a participant.
    for (size_t reaped = 0; reaped < pids.size(); ++reaped) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      const size_t i = static_cast<size_t>(std::find(pids.begin(), pids.end(), pid) - pids.begin());
      if (i == pids.size() || done[i]) continue;
      done[i] = true;
      --remaining;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "mesh_scale: participant %zu exited %d\n", i,
                     WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        failed = 1;
      }
    }
    if (remaining == 0) break;
    if (failed || absl::Now() > deadline) {
      if (!failed) std::fprintf(stderr, "mesh_scale: deadline of %d s exceeded\n", f.deadline_s);
      failed = 1;
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) ::kill(pids[i], SIGKILL);
      }
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) ::waitpid(pids[i], nullptr, 0);
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lock(release_mu);
    released = true;
  }
  release_cv.notify_all();
  for (std::thread& t : spawners) t.join();
  (*scheduler)->Stop();
  for (int fd : netns) ::close(fd);
  std::vector<Row> rows;
  for (const std::string& path : outs) {
    std::ifstream in(path);
    Row r;
    if (!(in >> r.role >> r.rank >> r.start_ns >> r.created_ns >> r.b1 >> r.b2 >> r.p50 >> r.p99 >>
          r.rss >> r.hwm >> r.fds >> r.threads >> r.cpu_start_ns >> r.cpu_create_ns)) {
      if (!failed) std::fprintf(stderr, "mesh_scale: no result in %s\n", path.c_str());
      failed = 1;
      continue;
    }
    rows.push_back(r);
    ::unlink(path.c_str());
  }
  ::rmdir(dir.c_str());
  if (failed) {
    std::printf("mesh_scale %dA%dF: FAIL\n", f.workers, f.servers);
    return 1;
  }
  // Rendezvous: from the first spawn to the last participant out of Create().
  int64_t last_created = 0, max_create = 0, max_b2 = 0, max_b1 = 0;
  int64_t max_hwm = 0, sum_hwm = 0, max_fds = 0, max_worker_fds = 0, max_server_fds = 0;
  int64_t max_threads = 0;
  // Where the rendezvous goes: the last process to reach main, and the CPU
  // each phase took, summed over the processes (independent of the load).
  int64_t last_main = 0;
  int64_t cpu_start_sum = 0, cpu_create_workers = 0, cpu_create_servers = 0;
  std::vector<int64_t> p50s, p99s, creates;
  for (const Row& r : rows) {
    last_main = std::max(last_main, r.start_ns);
    cpu_start_sum += r.cpu_start_ns;
    (r.role == "worker" ? cpu_create_workers : cpu_create_servers) += r.cpu_create_ns;
    creates.push_back(r.created_ns);
    last_created = std::max(last_created, r.start_ns + r.created_ns);
    max_create = std::max(max_create, r.created_ns);
    max_b1 = std::max(max_b1, r.b1);
    max_b2 = std::max(max_b2, r.b2);
    max_hwm = std::max(max_hwm, r.hwm);
    sum_hwm += r.hwm;
    max_fds = std::max(max_fds, r.fds);
    max_threads = std::max(max_threads, r.threads);
    if (r.role == "worker") {
      p50s.push_back(r.p50);
      p99s.push_back(r.p99);
      max_worker_fds = std::max(max_worker_fds, r.fds);
    } else {
      max_server_fds = std::max(max_server_fds, r.fds);
    }
  }
  std::sort(p50s.begin(), p50s.end());
  std::sort(p99s.begin(), p99s.end());
  std::sort(creates.begin(), creates.end());
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);  // the scheduler's thread and this launcher, whole run
  const double launcher_cpu_s =
      static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
      static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
  std::printf(
      "mesh_scale %dA%dF (%d participants, processes on %zu host(s), %zu-byte tensors, %d rounds, "
      "poll %s, spawned %d us apart)\n"
      "  rendezvous %.1f ms (first spawn to last Create() returned; longest Create() %.1f ms)\n"
      "  barrier %.2f ms (slowest, everyone connected; the first barrier, with start-up skew: "
      "%.1f ms)\n"
      "  round p50 %.3f ms, p99 %.3f ms (median over workers)\n"
      "  RSS peak %.1f MiB max, %.1f MiB mean per participant; fds max %lld (worker %lld, "
      "server %lld); threads max %lld\n",
      f.workers, f.servers, n, host_count, f.bytes, f.rounds, f.poll_mode.c_str(), f.spawn_gap_us,
      Ms(last_created - launch_ns), Ms(max_create), Ms(max_b2), Ms(max_b1),
      Ms(p50s[p50s.size() / 2]), Ms(p99s[p99s.size() / 2]), static_cast<double>(max_hwm) / 1024,
      static_cast<double>(sum_hwm) / 1024 / rows.size(), static_cast<long long>(max_fds),
      static_cast<long long>(max_worker_fds), static_cast<long long>(max_server_fds),
      static_cast<long long>(max_threads));
  std::printf(
      "  phases: last fork %.1f ms, last process at main %.1f ms after the first spawn; "
      "Create() p50 %.1f ms\n"
      "  CPU summed over the %zu processes: before main (exec, loader, constructors) %.3f s "
      "(%.2f ms each); Create() %.3f s (workers %.2f ms each, servers %.2f ms each); "
      "scheduler + launcher %.3f s (whole run)\n",
      Ms(spawned_ns.load() - launch_ns), Ms(last_main - launch_ns), Ms(creates[creates.size() / 2]),
      rows.size(), static_cast<double>(cpu_start_sum) / 1e9, Ms(cpu_start_sum) / rows.size(),
      static_cast<double>(cpu_create_workers + cpu_create_servers) / 1e9,
      Ms(cpu_create_workers) / f.workers, Ms(cpu_create_servers) / f.servers, launcher_cpu_s);
  std::printf("| %d | %dA%dF | %.0f | %.0f | %.2f | %.3f | %.3f | %.1f | %lld | %lld |\n", n,
              f.workers, f.servers, Ms(last_created - launch_ns), Ms(max_create), Ms(max_b2),
              Ms(p50s[p50s.size() / 2]), Ms(p99s[p99s.size() / 2]),
              static_cast<double>(max_hwm) / 1024, static_cast<long long>(max_worker_fds),
              static_cast<long long>(max_server_fds));
  return 0;
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> f = Parse(argc, argv);
  if (!f.ok()) {
    std::fprintf(stderr, "mesh_scale: %s\n", f.status().ToString().c_str());
    return 2;
  }
  if (f->role == "launch") return Launch(*f);
  absl::Status s = f->role == "worker"   ? RunWorker(*f)
                   : f->role == "server" ? RunServer(*f)
                                         : absl::InvalidArgumentError("--role worker|server");
  if (!s.ok()) {
    std::fprintf(stderr, "mesh_scale %s %d: %s\n", f->role.c_str(), f->rank, s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace stepmesh::scale

int main(int argc, char** argv) { return stepmesh::scale::Main(argc, argv); }
