// Elastic membership (docs/elastic.md): participants join and leave a running
// mesh. The traffic tests run every participant as its own process
// (tests/core/elastic_node_main.cc: workers check every reply byte); the
// tests of one precise interleaving run the participants in this process
// over TCP and a real scheduler.

#include <signal.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/stats.h"
#include "stepmesh/worker.h"
#include "tests/support/child_process.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh::testing {
namespace {

MeshOptions ElasticOptions(int workers, int servers, int max_workers, int max_servers) {
  MeshOptions o;
  o.num_workers = workers;
  o.num_servers = servers;
  o.max_workers = max_workers;
  o.max_servers = max_servers;
  o.transport = "tcp";
  o.timeout = absl::Seconds(5);
  o.heartbeat_interval = absl::Milliseconds(200);
  return o;
}

// --- the multi-process mesh ---

class ProcessMesh {
 public:
  ProcessMesh(int workers, int servers, int max_workers, int max_servers)
      : options_(ElasticOptions(workers, servers, max_workers, max_servers)) {
    MeshOptions s = options_;
    s.role = Role::kScheduler;
    absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = StartLoopbackScheduler(s);
    if (scheduler.ok()) {
      scheduler_ = *std::move(scheduler);
      options_.scheduler = s.scheduler;
    }
    char dir[] = "/tmp/stepmesh_elastic_XXXXXX";
    if (mkdtemp(dir) != nullptr) dir_ = dir;
  }
  ~ProcessMesh() {
    nodes_.clear();  // kills what still runs, by PID
    if (!dir_.empty()) std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }
  bool ok() const { return scheduler_ != nullptr && !dir_.empty(); }

  // Starts a participant; its index for the calls below.
  int Spawn(const std::string& role, int rank = -1, std::vector<std::string> extra = {}) {
    const std::string status = absl::StrCat(dir_, "/", nodes_.size(), ".status");
    std::vector<std::string> argv = {STEPMESH_ELASTIC_NODE_PATH,
                                     "--role",
                                     role,
                                     "--scheduler",
                                     options_.scheduler,
                                     "--workers",
                                     absl::StrCat(options_.num_workers),
                                     "--servers",
                                     absl::StrCat(options_.num_servers),
                                     "--max-workers",
                                     absl::StrCat(options_.max_workers),
                                     "--max-servers",
                                     absl::StrCat(options_.max_servers),
                                     "--rank",
                                     absl::StrCat(rank),
                                     "--status",
                                     status};
    argv.insert(argv.end(), extra.begin(), extra.end());
    absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv);
    REQUIRE_OK(child);
    nodes_.push_back(std::make_unique<Node>(Node{*std::move(child), status}));
    return static_cast<int>(nodes_.size()) - 1;
  }

  // The node's last status line as key=value pairs (empty before its first).
  std::map<std::string, std::string> Status(int node) {
    std::ifstream in(nodes_[node]->status);
    std::string line;
    std::getline(in, line);
    std::map<std::string, std::string> out;
    for (absl::string_view pair : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(pair, absl::MaxSplits('=', 1));
      out[kv.first] = kv.second;
    }
    return out;
  }
  int64_t Count(int node, const std::string& key) {
    int64_t n = -1;
    auto status = Status(node);
    if (status.count(key) == 0 || !absl::SimpleAtoi(status[key], &n)) return -1;
    return n;
  }
  // Waits until `node`'s counter `key` passed `beyond` (and `also` holds).
  bool WaitCount(int node, const std::string& key, int64_t beyond,
                 absl::Duration timeout = absl::Seconds(8),
                 const std::function<bool(std::map<std::string, std::string>&)>& also = nullptr) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      auto status = Status(node);
      int64_t n = -1;
      if (status.count(key) && absl::SimpleAtoi(status[key], &n) && n > beyond &&
          (also == nullptr || also(status))) {
        return true;
      }
      if (auto exit = nodes_[node]->proc.TryWait()) {
        exits_[node] = *exit;
        return false;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }
  // Every worker node in `nodes` makes `more` iterations from now.
  void RequireProgress(const std::vector<int>& nodes, int64_t more = 20) {
    for (int n : nodes) {
      const int64_t now = std::max<int64_t>(Count(n, "iterations"), 0);
      INFO("node " << n << " at " << now << " iterations");
      REQUIRE(WaitCount(n, "iterations", now + more));
    }
  }
  void Term(int node) { ::kill(nodes_[node]->proc.pid(), SIGTERM); }
  void KillNow(int node) { nodes_[node]->proc.Kill(); }
  int Exit(int node, absl::Duration timeout = absl::Seconds(10)) {
    if (exits_.count(node)) return exits_[node];
    absl::StatusOr<int> code = nodes_[node]->proc.Wait(timeout);
    return code.ok() ? *code : -1;
  }

 private:
  struct Node {
    ChildProcess proc;
    std::string status;
  };
  MeshOptions options_;
  std::unique_ptr<Scheduler> scheduler_;
  std::string dir_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::map<int, int> exits_;
};

bool HasServers(std::map<std::string, std::string>& status, const std::string& servers) {
  return status["servers"] == servers;
}

TEST_CASE("elastic: grow 2A2F -> 3A2F -> 3A3F and shrink back under steady traffic",
          "[elastic][membership]") {
  ProcessMesh mesh(2, 2, 3, 3);
  REQUIRE(mesh.ok());
  const int s0 = mesh.Spawn("server", 0), s1 = mesh.Spawn("server", 1);
  const int w0 = mesh.Spawn("worker", 0), w1 = mesh.Spawn("worker", 1);
  mesh.RequireProgress({w0, w1});

  // 3A2F: a worker without a rank gets rank 2 and is served with the others.
  const int w2 = mesh.Spawn("worker");
  mesh.RequireProgress({w2, w0, w1});
  // 3A3F: a new server; every worker addresses it from its next request on.
  const int s2 = mesh.Spawn("server");
  for (int w : {w0, w1, w2}) {
    INFO("worker node " << w);
    REQUIRE(mesh.WaitCount(w, "iterations", mesh.Count(w, "iterations") + 10, absl::Seconds(8),
                           [](auto& s) { return HasServers(s, "0,1,2"); }));
  }
  REQUIRE(mesh.WaitCount(s2, "batches", 10));
  CHECK(mesh.Count(w0, "epoch") == 2);  // two joins since the mesh formed
  mesh.RequireProgress({w0, w1, w2});

  // Back to 3A2F: server 2 drains (requests it holds complete) and leaves.
  mesh.Term(s2);
  CHECK(mesh.Exit(s2) == 0);
  for (int w : {w0, w1, w2}) {
    REQUIRE(mesh.WaitCount(w, "iterations", mesh.Count(w, "iterations") + 10, absl::Seconds(8),
                           [](auto& s) { return HasServers(s, "0,1"); }));
  }
  mesh.RequireProgress({w0, w1, w2});
  // Back to 2A2F: worker 2 leaves in order.
  mesh.Term(w2);
  CHECK(mesh.Exit(w2) == 0);
  mesh.RequireProgress({w0, w1});
  CHECK(mesh.Count(w0, "epoch") == 4);
  // Nothing failed as lost on the way: every change was orderly.
  CHECK(mesh.Count(w0, "lost") == 0);
  CHECK(mesh.Count(w1, "lost") == 0);

  for (int n : {w0, w1}) mesh.Term(n);
  CHECK(mesh.Exit(w0) == 0);
  CHECK(mesh.Exit(w1) == 0);
  for (int n : {s0, s1}) mesh.Term(n);
  CHECK(mesh.Exit(s0) == 0);
  CHECK(mesh.Exit(s1) == 0);
}

TEST_CASE("elastic: a join while a server is lost connects to the live servers only",
          "[elastic][membership]") {
  ProcessMesh mesh(1, 2, 2, 2);
  REQUIRE(mesh.ok());
  const int s0 = mesh.Spawn("server", 0), s1 = mesh.Spawn("server", 1);
  const int w0 = mesh.Spawn("worker", 0);
  mesh.RequireProgress({w0});
  mesh.KillNow(s1);
  REQUIRE(mesh.WaitCount(w0, "iterations", mesh.Count(w0, "iterations") + 10, absl::Seconds(8),
                         [](auto& s) { return HasServers(s, "0"); }));
  const int w1 = mesh.Spawn("worker");
  mesh.RequireProgress({w1, w0});
  CHECK(mesh.Status(w1)["servers"] == "0");
  CHECK(mesh.Count(w1, "lost") == 0);
  for (int n : {w0, w1}) mesh.Term(n);
  CHECK(mesh.Exit(w0) == 0);
  CHECK(mesh.Exit(w1) == 0);
  mesh.Term(s0);
  CHECK(mesh.Exit(s0) == 0);
}

TEST_CASE("elastic: a joiner that dies before its first request stalls nobody",
          "[elastic][membership]") {
  ProcessMesh mesh(2, 1, 3, 1);
  REQUIRE(mesh.ok());
  const int s0 = mesh.Spawn("server", 0);
  const int w0 = mesh.Spawn("worker", 0), w1 = mesh.Spawn("worker", 1);
  mesh.RequireProgress({w0, w1});
  const int dead = mesh.Spawn("worker", -1, {"--die-after-create"});
  CHECK(mesh.Exit(dead) == 128 + SIGKILL);
  // The batches never waited for it: the two others keep going at once.
  const absl::Time since = absl::Now();
  mesh.RequireProgress({w0, w1}, 50);
  CHECK(absl::Now() - since < absl::Seconds(4));
  // Its rank is free again: the next joiner takes it.
  const int w2 = mesh.Spawn("worker");
  mesh.RequireProgress({w2, w0, w1});
  for (int n : {w0, w1, w2}) mesh.Term(n);
  for (int n : {w0, w1, w2}) CHECK(mesh.Exit(n) == 0);
  mesh.Term(s0);
  CHECK(mesh.Exit(s0) == 0);
}

// --- participants in this process ---

struct InProcessMesh {
  explicit InProcessMesh(MeshOptions o) : options(std::move(o)) {
    MeshOptions s = options;
    s.role = Role::kScheduler;
    absl::StatusOr<std::unique_ptr<Scheduler>> started = StartLoopbackScheduler(s);
    REQUIRE_OK(started);
    scheduler = *std::move(started);
    options.scheduler = s.scheduler;
  }
  MeshOptions As(Role role, int rank) const {
    MeshOptions o = options;
    o.role = role;
    o.rank = rank;
    return o;
  }
  MeshOptions options;
  std::unique_ptr<Scheduler> scheduler;
};

// Creates `workers` (ranks 0, 1, ...) and `servers` (ranks 0, 1, ...) of
// `mesh` at once, each on its own thread (the mesh forms when all joined); one
// whose creation failed stays null.
void CreateTogether(InProcessMesh& mesh,
                    std::initializer_list<std::unique_ptr<AFTensorWorker>*> workers,
                    std::initializer_list<std::unique_ptr<AFTensorServer>*> servers) {
  std::vector<std::thread> threads;
  int rank = 0;
  for (std::unique_ptr<AFTensorWorker>* w : workers) {
    threads.emplace_back([&mesh, w, r = rank++] {
      absl::StatusOr<std::unique_ptr<AFTensorWorker>> made =
          AFTensorWorker::Create(mesh.As(Role::kWorker, r));
      if (made.ok()) *w = *std::move(made);
    });
  }
  rank = 0;
  for (std::unique_ptr<AFTensorServer>* s : servers) {
    threads.emplace_back([&mesh, s, r = rank++] {
      absl::StatusOr<std::unique_ptr<AFTensorServer>> made =
          AFTensorServer::Create(mesh.As(Role::kServer, r));
      if (made.ok()) *s = *std::move(made);
    });
  }
  for (auto& t : threads) t.join();
}

TensorView Bytes(std::vector<uint8_t>& v, int64_t rows = 1) {
  return TensorView{v.data(), DType::kUInt8, Shape{rows, static_cast<int64_t>(v.size()) / rows},
                    Device::Cpu()};
}

TEST_CASE("membership: a join beyond the capacity is refused, naming the option and numbers",
          "[membership]") {
  InProcessMesh mesh(ElasticOptions(1, 1, 2, 1));
  std::unique_ptr<AFTensorWorker> w0;
  std::unique_ptr<AFTensorServer> s0;
  CreateTogether(mesh, {&w0}, {&s0});
  REQUIRE(w0 != nullptr);
  REQUIRE(s0 != nullptr);
  // Within the capacity: rank 1 is assigned, and everyone hears of it.
  absl::StatusOr<std::unique_ptr<AFTensorWorker>> w1 =
      AFTensorWorker::Create(mesh.As(Role::kWorker, -1));
  REQUIRE_OK(w1);
  CHECK((*w1)->rank() == 1);
  CHECK((*w1)->CurrentMembership().epoch == 1);
  absl::StatusOr<Membership> seen = s0->WaitMembershipChange(0, absl::Seconds(5));
  REQUIRE_OK(seen);
  CHECK(seen->workers == std::vector<int>{0, 1});
  CHECK(seen->servers == std::vector<int>{0});
  // Beyond it: refused, naming the capacity option and the numbers.
  absl::StatusOr<std::unique_ptr<AFTensorWorker>> w2 =
      AFTensorWorker::Create(mesh.As(Role::kWorker, -1));
  REQUIRE_FALSE(w2.ok());
  INFO(w2.status().ToString());
  CHECK(absl::StrContains(w2.status().message(), "max_workers"));
  CHECK(absl::StrContains(w2.status().message(), "STEPMESH_MAX_WORKERS"));
  CHECK(absl::StrContains(w2.status().message(), "all 2"));
  absl::StatusOr<std::unique_ptr<AFTensorServer>> s1 =
      AFTensorServer::Create(mesh.As(Role::kServer, -1));
  REQUIRE_FALSE(s1.ok());
  CHECK(absl::StrContains(s1.status().message(), "max_servers"));
  // A rank asked for outside the capacity is refused before it dials.
  absl::StatusOr<std::unique_ptr<AFTensorWorker>> w5 =
      AFTensorWorker::Create(mesh.As(Role::kWorker, 5));
  CHECK_STATUS(w5, kInvalidArgument);
  // The refusals changed nothing.
  CHECK(s0->CurrentMembership().workers == std::vector<int>{0, 1});
  CHECK(s0->CurrentMembership().epoch == 1);
}

TEST_CASE("membership: a participant of another mesh is still refused", "[membership]") {
  InProcessMesh mesh(ElasticOptions(1, 1, 2, 2));
  std::unique_ptr<AFTensorWorker> w0;
  std::unique_ptr<AFTensorServer> s0;
  CreateTogether(mesh, {&w0}, {&s0});
  REQUIRE(w0 != nullptr);
  MeshOptions capacity = mesh.As(Role::kWorker, -1);
  capacity.max_workers = 3;
  absl::StatusOr<std::unique_ptr<AFTensorWorker>> refused = AFTensorWorker::Create(capacity);
  REQUIRE_FALSE(refused.ok());
  CHECK(absl::StrContains(refused.status().message(), "capacity of 3 workers"));
  CHECK(absl::StrContains(refused.status().message(), "STEPMESH_MAX_WORKERS"));
  MeshOptions shape = mesh.As(Role::kWorker, -1);
  shape.num_workers = 2;
  refused = AFTensorWorker::Create(shape);
  REQUIRE_FALSE(refused.ok());
  CHECK(absl::StrContains(refused.status().message(), "configured for 2 workers"));
  MeshOptions other = mesh.As(Role::kServer, -1);
  other.mesh_id = "another";
  absl::StatusOr<std::unique_ptr<AFTensorServer>> server = AFTensorServer::Create(other);
  REQUIRE_FALSE(server.ok());
  CHECK(absl::StrContains(server.status().message(), "names mesh 'another'"));
  CHECK(w0->CurrentMembership().epoch == 0);
}

TEST_CASE("membership: a join during a barrier lets it pass and takes part in the next",
          "[membership]") {
  InProcessMesh mesh(ElasticOptions(2, 1, 3, 1));
  std::unique_ptr<AFTensorWorker> w0, w1;
  std::unique_ptr<AFTensorServer> s0;
  CreateTogether(mesh, {&w0, &w1}, {&s0});
  REQUIRE(w1 != nullptr);
  absl::Status b0, bs;
  std::thread t0([&] { b0 = w0->Barrier(); });
  std::thread ts([&] { bs = s0->Barrier(); });
  absl::SleepFor(absl::Milliseconds(100));  // both inside barrier 1
  absl::StatusOr<std::unique_ptr<AFTensorWorker>> w2 =
      AFTensorWorker::Create(mesh.As(Role::kWorker, -1));
  REQUIRE_OK(w2);
  CHECK((*w2)->rank() == 2);
  // The last start member enters: barrier 1 passes without the joiner.
  CHECK_OK(w1->Barrier());
  t0.join();
  ts.join();
  CHECK_OK(b0);
  CHECK_OK(bs);
  // Barrier 2 waits for the joiner too.
  std::vector<absl::Status> results(4);
  std::vector<Participant*> all = {w0.get(), w1.get(), w2->get(), s0.get()};
  std::vector<std::thread> threads;
  std::atomic<int> passed{0};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      results[i] = all[i]->Barrier();
      ++passed;
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  CHECK(passed.load() == 0);  // the server has not entered yet
  threads.emplace_back([&] {
    results[3] = all[3]->Barrier();
    ++passed;
  });
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) CHECK_OK(s);
}

TEST_CASE("membership: a server leaving with requests in flight answers them first",
          "[membership]") {
  InProcessMesh mesh(ElasticOptions(1, 2, 1, 2));
  std::unique_ptr<AFTensorWorker> w;
  std::unique_ptr<AFTensorServer> s0, s1;
  CreateTogether(mesh, {&w}, {&s0, &s1});
  REQUIRE(w != nullptr);
  REQUIRE(s1 != nullptr);
  constexpr size_t kBytes = 1024;
  std::vector<uint8_t> push(kBytes), pull0(kBytes), pull1(kBytes);
  std::vector<std::vector<uint8_t>> recv(2, std::vector<uint8_t>(kBytes)),
      reply(2, std::vector<uint8_t>(kBytes));
  REQUIRE_OK(w->RegisterPushTensor(1, Bytes(push)));
  REQUIRE_OK(w->RegisterPullTensor(2, 0, Bytes(pull0)));
  REQUIRE_OK(w->RegisterPullTensor(2, 1, Bytes(pull1)));
  std::vector<uint8_t> other(kBytes), other0(kBytes), other1(kBytes);
  REQUIRE_OK(w->RegisterPushTensor(3, Bytes(other)));
  REQUIRE_OK(w->RegisterPullTensor(4, 0, Bytes(other0)));
  REQUIRE_OK(w->RegisterPullTensor(4, 1, Bytes(other1)));
  AFTensorServer* servers[2] = {s0.get(), s1.get()};
  for (int s = 0; s < 2; ++s) {
    REQUIRE_OK(servers[s]->RegisterRecvTensor(1, Bytes(recv[s])));
    REQUIRE_OK(servers[s]->RegisterReplyTensor(2, Bytes(reply[s])));
  }
  // Server s answers push XOR (s + 1).
  auto answer = [&](int s, const Batch& batch) {
    for (size_t i = 0; i < kBytes; ++i) reply[s][i] = recv[s][i] ^ static_cast<uint8_t>(s + 1);
    return servers[s]->Respond(batch, {Reply{0, kBytes}});
  };
  auto fill = [&](uint8_t seed) {
    for (size_t i = 0; i < kBytes; ++i) push[i] = static_cast<uint8_t>(seed + i);
  };
  auto check = [&](const std::vector<uint8_t>& pull, int s, uint8_t seed) {
    for (size_t i = 0; i < kBytes; ++i) {
      if (pull[i] != (static_cast<uint8_t>(seed + i) ^ static_cast<uint8_t>(s + 1))) return false;
    }
    return true;
  };
  // Request A reaches both servers; server 1 holds its batch.
  fill(7);
  const Push to_all{1};  // every server of the membership
  const Pull pulls_both[] = {{2, 0}, {2, 1}};
  absl::StatusOr<RequestHandle> a = w->PushPull({&to_all, 1}, pulls_both);
  REQUIRE_OK(a);
  absl::StatusOr<Batch> b0 = s0->GetBatch(absl::Seconds(5));
  REQUIRE_OK(b0);
  REQUIRE_OK(answer(0, *b0));
  absl::StatusOr<Batch> held = s1->GetBatch(absl::Seconds(5));
  REQUIRE_OK(held);
  // Server 1 leaves (drains) on another thread.
  absl::Status left = absl::UnknownError("not yet");
  std::thread leaver([&] { left = s1->Leave(absl::Seconds(5)); });
  absl::StatusOr<Membership> now = w->WaitMembershipChange(0, absl::Seconds(5));
  REQUIRE_OK(now);
  CHECK(now->epoch == 1);
  CHECK(now->servers == std::vector<int>{0});
  // A post naming the server that left fails at once, naming it.
  const int both_ranks[] = {0, 1};
  const Push to_both{3, kWholeTensor, both_ranks};
  const Pull pull_both_other[] = {{4, 0}, {4, 1}};
  absl::StatusOr<RequestHandle> named = w->PushPull({&to_both, 1}, pull_both_other);
  CHECK_STATUS(named, kUnavailable);
  CHECK(absl::StrContains(named.status().message(), "server 1 left the mesh"));
  // A (still in flight at server 1) is not failed by the drain.
  absl::StatusOr<bool> done = w->Test(*a);
  REQUIRE_OK(done);
  CHECK_FALSE(*done);
  // Server 1 answers what it holds; A completes with every byte.
  REQUIRE_OK(answer(1, *held));
  REQUIRE_OK(w->Wait(*a, absl::Seconds(5)));
  CHECK(check(pull0, 0, 7));
  CHECK(check(pull1, 1, 7));
  // Server 1 has nothing more to hand out: "drained", and its Leave succeeds.
  // (Or, when the leaver's Leave already finished, the server is shut down.)
  absl::StatusOr<Batch> after = s1->GetBatch(absl::Seconds(5));
  REQUIRE_FALSE(after.ok());
  if (absl::IsFailedPrecondition(after.status())) {
    CHECK(absl::StrContains(after.status().message(), "shut down"));
  } else {
    CHECK_STATUS(after, kUnavailable);
    CHECK(absl::StrContains(after.status().message(), "drained"));
  }
  leaver.join();
  CHECK_OK(left);
  // "Every server" is now server 0 alone: the next request goes there only.
  fill(9);
  const Pull pull_zero[] = {{2, 0}};
  absl::StatusOr<RequestHandle> c = w->PushPull({&to_all, 1}, pull_zero);
  REQUIRE_OK(c);
  absl::StatusOr<Batch> bc = s0->GetBatch(absl::Seconds(5));
  REQUIRE_OK(bc);
  REQUIRE_OK(answer(0, *bc));
  REQUIRE_OK(w->Wait(*c, absl::Seconds(5)));
  CHECK(check(pull0, 0, 9));
  // The epoch shows in the stats and the metrics.
  const MeshStats stats = w->Stats();
  CHECK(stats.membership_epoch == 1);
  CHECK(stats.member_servers == 1);
  CHECK(absl::StrContains(PrometheusText(stats), "stepmesh_membership_epoch{"));
  CHECK(s0->CurrentMembership().servers == std::vector<int>{0});
}

TEST_CASE("membership: a worker's Leave drains its requests and refuses new ones", "[membership]") {
  InProcessMesh mesh(ElasticOptions(2, 1, 2, 1));
  std::unique_ptr<AFTensorWorker> w0, w1;
  std::unique_ptr<AFTensorServer> s;
  CreateTogether(mesh, {&w0, &w1}, {&s});
  REQUIRE(w1 != nullptr);
  REQUIRE(s != nullptr);
  constexpr size_t kBytes = 256;
  std::vector<uint8_t> p0(kBytes, 3), p1(kBytes, 5), q0(kBytes), q1(kBytes);
  std::vector<uint8_t> recv(2 * kBytes), reply(2 * kBytes);
  REQUIRE_OK(w0->RegisterPushTensor(1, Bytes(p0)));
  REQUIRE_OK(w0->RegisterPullTensor(2, 0, Bytes(q0)));
  REQUIRE_OK(w1->RegisterPushTensor(1, Bytes(p1)));
  REQUIRE_OK(w1->RegisterPullTensor(2, 0, Bytes(q1)));
  REQUIRE_OK(s->RegisterRecvTensor(1, Bytes(recv, 2)));
  REQUIRE_OK(s->RegisterReplyTensor(2, Bytes(reply, 2)));
  const Push push{1};
  const Pull pull{2, 0};
  absl::StatusOr<RequestHandle> h0 = w0->PushPull({&push, 1}, {&pull, 1});
  absl::StatusOr<RequestHandle> h1 = w1->PushPull({&push, 1}, {&pull, 1});
  REQUIRE_OK(h0);
  REQUIRE_OK(h1);
  absl::Status left = absl::UnknownError("not yet");
  std::thread leaver([&] { left = w1->Leave(absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(50));
  // Leaving: no new request; the pending one is waited for.
  CHECK_STATUS(w1->PushPull({&push, 1}, {&pull, 1}), kFailedPrecondition);
  absl::StatusOr<Batch> batch = s->GetBatch(absl::Seconds(5));
  REQUIRE_OK(batch);
  CHECK(batch->workers.size() == 2);
  for (size_t i = 0; i < reply.size(); ++i) reply[i] = recv[i] ^ 0x55;
  REQUIRE_OK(s->Respond(*batch, {Reply{0, kBytes}, Reply{1, kBytes}}));
  leaver.join();
  CHECK_OK(left);
  REQUIRE_OK(w0->Wait(*h0, absl::Seconds(5)));
  CHECK(q0 == std::vector<uint8_t>(kBytes, 3 ^ 0x55));
  CHECK(q1 == std::vector<uint8_t>(kBytes, 5 ^ 0x55));
  // The server hears "left" (a new epoch) and batches without worker 1.
  absl::StatusOr<Membership> m = s->WaitMembershipChange(0, absl::Seconds(5));
  REQUIRE_OK(m);
  CHECK(m->workers == std::vector<int>{0});
  h0 = w0->PushPull({&push, 1}, {&pull, 1});
  REQUIRE_OK(h0);
  batch = s->GetBatch(absl::Seconds(5));
  REQUIRE_OK(batch);
  CHECK(batch->workers.size() == 1);
  REQUIRE_OK(s->Respond(*batch, {Reply{0, kBytes}}));
  REQUIRE_OK(w0->Wait(*h0, absl::Seconds(5)));
}

}  // namespace
}  // namespace stepmesh::testing
