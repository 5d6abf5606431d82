#include "src/core/mesh.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "stepmesh/scheduler.h"
#include "tests/support/child_process.h"
#include "tests/support/conformance_suite.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/node_flags.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using testing::ChildProcess;
using testing::Scenario;

MeshOptions TcpOptions() {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(10);
  return o;
}

std::string Describe(const Scenario& s) {
  return absl::StrCat(s.workers, "A", s.servers, "F x", s.micro_batches, " micro-batches x ",
                      s.iterations, " iterations");
}

TEST_CASE("in-process mesh works in every poll mode", "[mesh][tcp]") {
  for (PollMode mode : {PollMode::kSpin, PollMode::kAdaptive, PollMode::kBlocking}) {
    Scenario sc;
    sc.iterations = 20;
    sc.push_bytes = 4096;
    sc.pull_bytes = 8192;
    MeshOptions o = TcpOptions();
    o.threads.poll_mode = mode;
    INFO(PollModeName(mode));
    CHECK_OK(testing::RunInProcess(sc, o, compose::CreateTransport));
  }
}

// A transport that cannot reach any memory directly, as TCP cannot reach GPU
// memory: every tensor is staged through host memory the core registers.
class NoDirectAccessTransport final : public testing::ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  bool CanAccess(const Device&) const override { return false; }
};

TEST_CASE("tensors a transport cannot reach are staged, byte-exact both ways", "[mesh][staging]") {
  Scenario sc;
  sc.iterations = 10;
  sc.push_bytes = 64 * 1024;
  sc.pull_bytes = 128 * 1024;
  auto factory = [](const MeshOptions& o) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    auto inner = compose::CreateTransport(o);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<core::Transport>(new NoDirectAccessTransport(*std::move(inner)));
  };
  CHECK_OK(testing::RunInProcess(sc, TcpOptions(), factory));
}

// A scheduler, one worker and one server over TCP in this process.
std::unique_ptr<testing::LoopbackMesh> OneByOne() {
  return testing::StartPair(TcpOptions(), compose::CreateTransport);
}

// Push key 1 and pull key 2 (from server 0) on worker 0, their recv and reply
// tensors on server 0; 64 bytes each.
void RegisterKeys(testing::LoopbackMesh& mesh, std::vector<uint8_t>& push,
                  std::vector<uint8_t>& pull, std::vector<uint8_t>& recv,
                  std::vector<uint8_t>& reply) {
  REQUIRE_OK(mesh.worker(0).RegisterPushTensor(1, BytesView(push.data(), 64)));
  REQUIRE_OK(mesh.worker(0).RegisterPullTensor(2, 0, BytesView(pull.data(), 64)));
  REQUIRE_OK(mesh.server(0).RegisterRecvTensor(1, BytesView(recv.data(), 64)));
  REQUIRE_OK(mesh.server(0).RegisterReplyTensor(2, BytesView(reply.data(), 64)));
}

// Two workers and one server over TCP in this process.
std::unique_ptr<testing::LoopbackMesh> TwoByOne() {
  MeshOptions o = TcpOptions();
  o.num_workers = 2;
  o.num_servers = 1;
  absl::StatusOr<std::unique_ptr<testing::LoopbackMesh>> mesh =
      testing::LoopbackMesh::Start(o, compose::CreateTransport);
  REQUIRE_OK(mesh);
  return *std::move(mesh);
}

TEST_CASE("server regions must split into one equal slot per worker", "[mesh][bad-input]") {
  std::vector<uint8_t> region(4 * 64);
  auto mesh = TwoByOne();  // after the tensors: registered memory outlives the mesh
  CHECK(absl::IsInvalidArgument(
      mesh->server(0).RegisterRecvTensor(1, {region.data(), DType::kUInt8, Shape{3, 64}})));
  CHECK(mesh->server(0).RegisterRecvTensor(1, {region.data(), DType::kUInt8, Shape{4, 64}}).ok());
}

TEST_CASE("batch policies: all workers, or whoever arrived by the deadline", "[mesh][batch]") {
  std::vector<uint8_t> push0(64, 1), push1(64, 2), pull0(64), pull1(64);
  std::vector<uint8_t> recv(2 * 64), reply(2 * 64);
  auto mesh = TwoByOne();  // after the tensors: registered memory outlives the mesh
  REQUIRE(mesh->worker(0).RegisterPushTensor(1, BytesView(push0.data(), 64)).ok());
  REQUIRE(mesh->worker(1).RegisterPushTensor(1, BytesView(push1.data(), 64)).ok());
  REQUIRE(mesh->worker(0).RegisterPullTensor(2, 0, BytesView(pull0.data(), 64)).ok());
  REQUIRE(mesh->worker(1).RegisterPullTensor(2, 0, BytesView(pull1.data(), 64)).ok());
  REQUIRE(mesh->server(0).RegisterRecvTensor(1, {recv.data(), DType::kUInt8, Shape{2, 64}}).ok());
  REQUIRE(mesh->server(0).RegisterReplyTensor(2, {reply.data(), DType::kUInt8, Shape{2, 64}}).ok());
  const Push p{1, 48};  // a prefix: valid_bytes must say 48
  const Pull q{2, 0};

  // Only worker 0 sends: kAllWorkers waits for worker 1 and times out...
  auto h0 = mesh->worker(0).PushPull({&p, 1}, {&q, 1});
  REQUIRE(h0.ok());
  CHECK(absl::IsDeadlineExceeded(
      mesh->server(0).GetBatch(absl::Milliseconds(200), BatchPolicy::kAllWorkers).status()));
  // ...kReadyByDeadline hands out the partial batch.
  auto partial = mesh->server(0).GetBatch(absl::Milliseconds(200), BatchPolicy::kReadyByDeadline);
  REQUIRE(partial.ok());
  REQUIRE(partial->workers.size() == 1);
  CHECK(partial->workers[0] == 0);
  CHECK(partial->tensors[0].valid_bytes[0] == 48);
  CHECK(partial->tensors[0].valid_bytes[1] == 0);
  CHECK(recv[0] == 1);
  std::fill(reply.begin(), reply.begin() + 64, 0x5A);
  const Reply r0{0, 64};
  REQUIRE(mesh->server(0).Respond(*partial, {&r0, 1}).ok());
  REQUIRE(mesh->worker(0).Wait(*h0, absl::Seconds(5)).ok());
  CHECK(pull0[63] == 0x5A);

  // The latecomer forms a batch of its own; a full batch needs no deadline.
  auto h1 = mesh->worker(1).PushPull({&p, 1}, {&q, 1});
  REQUIRE(h1.ok());
  auto late = mesh->server(0).GetBatch(absl::Milliseconds(200), BatchPolicy::kReadyByDeadline);
  REQUIRE(late.ok());
  REQUIRE(late->workers.size() == 1);
  CHECK(late->workers[0] == 1);
  CHECK(recv[64] == 2);
  std::fill(reply.begin() + 64, reply.end(), 0xA5);
  const Reply r1{1, 64};
  REQUIRE(mesh->server(0).Respond(*late, {&r1, 1}).ok());
  REQUIRE(mesh->worker(1).Wait(*h1, absl::Seconds(5)).ok());
  CHECK(pull1[0] == 0xA5);

  auto a = mesh->worker(0).PushPull({&p, 1}, {&q, 1});
  auto b = mesh->worker(1).PushPull({&p, 1}, {&q, 1});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  auto full = mesh->server(0).GetBatch(absl::Seconds(5), BatchPolicy::kAllWorkers);
  REQUIRE(full.ok());
  CHECK(full->workers.size() == 2);
  const Reply both[] = {{0, 64}, {1, 64}};
  REQUIRE(mesh->server(0).Respond(*full, both).ok());
  CHECK(mesh->worker(0).Wait(*a, absl::Seconds(5)).ok());
  CHECK(mesh->worker(1).Wait(*b, absl::Seconds(5)).ok());
}

TEST_CASE("replies may start anywhere in the reply region: packed back to back", "[mesh][reply]") {
  std::vector<uint8_t> push(64, 1), pull0(64), pull1(64), recv(2 * 64), reply(2 * 64);
  auto mesh = TwoByOne();
  for (int w = 0; w < 2; ++w) {
    REQUIRE_OK(mesh->worker(w).RegisterPushTensor(1, BytesView(push.data(), 64)));
    REQUIRE_OK(mesh->worker(w).RegisterPullTensor(2, 0, BytesView((w ? pull1 : pull0).data(), 64)));
  }
  REQUIRE_OK(mesh->server(0).RegisterRecvTensor(1, {recv.data(), DType::kUInt8, Shape{2, 64}}));
  REQUIRE_OK(mesh->server(0).RegisterReplyTensor(2, {reply.data(), DType::kUInt8, Shape{2, 64}}));
  for (size_t i = 0; i < reply.size(); ++i) reply[i] = static_cast<uint8_t>(i);
  const Push p{1, 64};
  const Pull q{2, 0};
  auto a = mesh->worker(0).PushPull({&p, 1}, {&q, 1});
  auto b = mesh->worker(1).PushPull({&p, 1}, {&q, 1});
  REQUIRE_OK(a);
  REQUIRE_OK(b);
  auto batch = mesh->server(0).GetBatch(absl::Seconds(5));
  REQUIRE_OK(batch);
  // Out of the region: refused, naming the worker and the offset; nothing sent.
  const Reply bad[] = {{0, 48, 0}, {1, 64, 100}};
  const absl::Status refused = mesh->server(0).Respond(*batch, bad);
  CHECK(absl::IsOutOfRange(refused));
  CHECK(absl::StrContains(refused.message(), "reply to worker 1: offset 100 + 64 bytes"));
  // Worker 0's 48 bytes at 0, worker 1's 64 right after them (across the slot boundary).
  const Reply packed[] = {{0, 48, 0}, {1, 64, 48}};
  REQUIRE_OK(mesh->server(0).Respond(*batch, packed));
  REQUIRE_OK(mesh->worker(0).Wait(*a, absl::Seconds(5)));
  REQUIRE_OK(mesh->worker(1).Wait(*b, absl::Seconds(5)));
  for (size_t i = 0; i < 48; ++i) CHECK(pull0[i] == i);
  for (size_t i = 0; i < 64; ++i) CHECK(pull1[i] == 48 + i);
}

TEST_CASE("a stage batches workers whose push keys differ (without one the first key does)",
          "[mesh][batch][stage]") {
  std::vector<uint8_t> push0(64, 1), push1(64, 2), pull0(64), pull1(64);
  std::vector<uint8_t> recv10(2 * 64), recv20(2 * 64), reply(2 * 64);
  auto mesh = TwoByOne();  // after the tensors: registered memory outlives the mesh
  // Per-rank keys, as StepMesh's benchmark makes them: worker 0 pushes 10, worker 1 pushes 20.
  REQUIRE(mesh->worker(0).RegisterPushTensor(10, BytesView(push0.data(), 64)).ok());
  REQUIRE(mesh->worker(1).RegisterPushTensor(20, BytesView(push1.data(), 64)).ok());
  REQUIRE(mesh->worker(0).RegisterPullTensor(2, 0, BytesView(pull0.data(), 64)).ok());
  REQUIRE(mesh->worker(1).RegisterPullTensor(2, 0, BytesView(pull1.data(), 64)).ok());
  REQUIRE(
      mesh->server(0).RegisterRecvTensor(10, {recv10.data(), DType::kUInt8, Shape{2, 64}}).ok());
  REQUIRE(
      mesh->server(0).RegisterRecvTensor(20, {recv20.data(), DType::kUInt8, Shape{2, 64}}).ok());
  REQUIRE(mesh->server(0).RegisterReplyTensor(2, {reply.data(), DType::kUInt8, Shape{2, 64}}).ok());
  const Push p0{10}, p1{20};
  const Pull q{2, 0};
  for (uint32_t stage : {7u, 8u}) {
    INFO("stage " << stage);
    auto a =
        mesh->worker(0).PushPull({&p0, 1}, {&q, 1}, SendOptions{.ready = nullptr, .stage = stage});
    auto b =
        mesh->worker(1).PushPull({&p1, 1}, {&q, 1}, SendOptions{.ready = nullptr, .stage = stage});
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    auto batch = mesh->server(0).GetBatch(absl::Seconds(5), BatchPolicy::kAllWorkers);
    REQUIRE(batch.ok());
    CHECK(batch->group == stage);
    REQUIRE(batch->workers.size() == 2);
    REQUIRE(batch->tensors.size() == 2);  // key 10 from worker 0, key 20 from worker 1
    CHECK(recv10[0] == 1);
    CHECK(recv20[64] == 2);
    const Reply both[] = {{0, 64}, {1, 64}};
    REQUIRE(mesh->server(0).Respond(*batch, both).ok());
    CHECK(mesh->worker(0).Wait(*a, absl::Seconds(5)).ok());
    CHECK(mesh->worker(1).Wait(*b, absl::Seconds(5)).ok());
  }
  // Without a stage the first push key names the batch: different keys, no full batch.
  auto a = mesh->worker(0).PushPull({&p0, 1}, {&q, 1});
  auto b = mesh->worker(1).PushPull({&p1, 1}, {&q, 1});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(absl::IsDeadlineExceeded(
      mesh->server(0).GetBatch(absl::Milliseconds(200), BatchPolicy::kAllWorkers).status()));
  for (int i = 0; i < 2; ++i) {
    auto one = mesh->server(0).GetBatch(absl::Seconds(5), BatchPolicy::kReadyByDeadline);
    REQUIRE(one.ok());
    CHECK(one->workers.size() == 1);
    const Reply r{one->workers[0], 64};
    REQUIRE(mesh->server(0).Respond(*one, {&r, 1}).ok());
  }
  CHECK(mesh->worker(0).Wait(*a, absl::Seconds(5)).ok());
  CHECK(mesh->worker(1).Wait(*b, absl::Seconds(5)).ok());
}

TEST_CASE("WaitForParticipants waits past options.timeout while the participants live",
          "[mesh][scheduler]") {
  MeshOptions o = TcpOptions();
  o.timeout = absl::Milliseconds(400);
  o.heartbeat_interval = absl::Milliseconds(50);
  auto mesh = testing::StartPair(o, compose::CreateTransport);
  std::atomic<bool> returned{false};
  absl::Status waited;
  std::thread waiter([&] {
    waited = mesh->scheduler().WaitForParticipants();
    returned.store(true);
  });
  absl::SleepFor(absl::Milliseconds(1500));  // more than three timeouts of an idle mesh
  CHECK_FALSE(returned.load());
  CHECK(
      absl::IsDeadlineExceeded(mesh->scheduler().WaitUntilDone(absl::ZeroDuration())));  // not done
  mesh->ShutdownWorker(0);
  mesh->ShutdownServer(0);
  waiter.join();
  CHECK(returned.load());
  CHECK(waited.ok());
}

TEST_CASE("WaitForParticipants: a mesh that never forms is DEADLINE_EXCEEDED, counted",
          "[mesh][scheduler]") {
  MeshOptions o = TcpOptions();
  o.timeout = absl::Milliseconds(300);
  o.num_workers = 2;
  auto scheduler = testing::StartLoopbackScheduler(o);
  REQUIRE(scheduler.ok());
  const absl::Status s = (*scheduler)->WaitForParticipants();
  INFO(s.ToString());
  CHECK(absl::IsDeadlineExceeded(s));
  CHECK(absl::StrContains(s.message(), "0 of 3 participants joined"));
}

TEST_CASE("traces carry stamps in causal order", "[mesh][trace]") {
  std::vector<uint8_t> push(64, 1), pull(64), recv(64), reply(64);
  auto mesh = OneByOne();  // after the tensors: registered memory outlives the mesh
  RegisterKeys(*mesh, push, pull, recv, reply);
  const Push p{1};
  const Pull q{2, 0};
  auto h = mesh->worker(0).PushPull({&p, 1}, {&q, 1});
  REQUIRE(h.ok());
  auto batch = mesh->server(0).GetBatch(absl::Seconds(5));
  REQUIRE(batch.ok());
  const Reply r{0};
  REQUIRE(mesh->server(0).Respond(*batch, {&r, 1}).ok());
  REQUIRE(mesh->worker(0).Wait(*h, absl::Seconds(5)).ok());
  auto trace = mesh->worker(0).FetchTrace(*h);
  REQUIRE(trace.ok());
  REQUIRE(trace->servers.size() == 1);
  const TraceStamps& t = trace->servers[0].stamps;
  CHECK(t.enqueue_ns > 0);
  CHECK(t.enqueue_ns <= t.post_ns);
  CHECK(t.post_ns <= t.server_arrival_ns);  // same host: one monotonic clock
  CHECK(t.server_arrival_ns <= t.server_handler_ns);
  CHECK(t.server_handler_ns <= t.server_respond_ns);  // Respond() called
  CHECK(t.server_respond_ns <= t.server_reply_ns);
  CHECK(t.server_reply_ns <= t.reply_arrival_ns);
  CHECK(t.reply_arrival_ns <= trace->complete_ns);
}

TEST_CASE("a send gated on an event waits for it on the send thread", "[mesh][event]") {
  std::vector<uint8_t> push(64, 0), pull(64), recv(64), reply(64);
  auto mesh = OneByOne();  // after the tensors: registered memory outlives the mesh
  RegisterKeys(*mesh, push, pull, recv, reply);
  auto stream = *mesh->worker(0).backend().CreateStream();
  auto ready = *mesh->worker(0).backend().CreateEvent();
  auto flag = *mesh->worker(0).backend().CreateHostFlag();
  // The "kernel" that produces the push runs only after the flag is released.
  REQUIRE(stream->WaitHostFlag(*flag, 1).ok());
  REQUIRE(stream->LaunchHostFunc([&] { std::fill(push.begin(), push.end(), 0xAB); }).ok());
  REQUIRE(ready->Record(*stream).ok());
  const Push p{1};
  const Pull q{2, 0};
  SendOptions options;
  options.ready = ready.get();
  auto h = mesh->worker(0).PushPull({&p, 1}, {&q, 1}, options);  // returns at once
  REQUIRE(h.ok());
  CHECK(absl::IsDeadlineExceeded(mesh->server(0).GetBatch(absl::Milliseconds(100)).status()));
  flag->Store(1);
  auto batch = mesh->server(0).GetBatch(absl::Seconds(5));
  REQUIRE(batch.ok());
  CHECK(recv[0] == 0xAB);  // never the stale contents
  CHECK(recv[63] == 0xAB);
  const Reply r{0};
  REQUIRE(mesh->server(0).Respond(*batch, {&r, 1}).ok());
  REQUIRE(mesh->worker(0).Wait(*h, absl::Seconds(5)).ok());
}

TEST_CASE("a ready event that never completes fails its request after options.timeout",
          "[mesh][event]") {
  std::vector<uint8_t> push(64, 0), pull(64), recv(64), reply(64);
  MeshOptions o = TcpOptions();
  o.timeout = absl::Seconds(2);
  o.heartbeat_interval = absl::Milliseconds(200);
  // After the tensors: registered memory outlives the mesh.
  auto mesh = testing::StartPair(o, compose::CreateTransport);
  AFTensorWorker& worker = mesh->worker(0);
  RegisterKeys(*mesh, push, pull, recv, reply);
  auto stream = *worker.backend().CreateStream();
  auto ready = *worker.backend().CreateEvent();
  auto flag = *worker.backend().CreateHostFlag();
  REQUIRE(stream->WaitHostFlag(*flag, 1).ok());  // a stream that never gets there
  REQUIRE(ready->Record(*stream).ok());
  const Push p{1};
  const Pull q{2, 0};
  SendOptions options;
  options.ready = ready.get();
  auto h = worker.PushPull({&p, 1}, {&q, 1}, options);
  REQUIRE_OK(h);
  const absl::Status status = worker.Wait(*h, absl::Seconds(10));
  INFO(status.ToString());
  CHECK(absl::IsDeadlineExceeded(status));
  CHECK(absl::StrContains(status.message(), "ready event"));
  flag->Store(1);
  REQUIRE(stream->Synchronize(absl::Seconds(5)).ok());
}

TEST_CASE("streams wait for a reply and for the next batch on cpu_mock", "[mesh][arrival]") {
  std::vector<uint8_t> push(64, 0), pull(64, 0), recv(64), reply(64);
  auto mesh = OneByOne();  // after the tensors: registered memory outlives the mesh
  AFTensorWorker& worker = mesh->worker(0);
  AFTensorServer& server = mesh->server(0);
  RegisterKeys(*mesh, push, pull, recv, reply);
  auto worker_stream = *worker.backend().CreateStream();
  auto server_stream = *server.backend().CreateStream();
  std::atomic<int> seen_reply{-1}, seen_push{-1}, next_pull{-1};
  for (int step = 1; step <= 3; ++step) {
    seen_push = seen_reply = next_pull = -1;
    std::fill(push.begin(), push.end(), static_cast<uint8_t>(step));
    REQUIRE_OK(server.StreamWaitNextBatch(*server_stream));
    REQUIRE_OK(server_stream->LaunchHostFunc([&] { seen_push = recv[63]; }));
    absl::SleepFor(absl::Milliseconds(20));
    CHECK(seen_push.load() == -1);  // no batch yet: the server stream waits
    const Push p{1};
    const Pull q{2, 0};
    auto h = worker.PushPull({&p, 1}, {&q, 1});
    REQUIRE_OK(h);
    REQUIRE_OK(worker.StreamWaitReply(*h, *worker_stream));
    REQUIRE_OK(worker_stream->LaunchHostFunc([&] { seen_reply = pull[63]; }));
    REQUIRE_OK(worker.StreamWaitNextPull(2, 0, *worker_stream));
    REQUIRE_OK(worker_stream->LaunchHostFunc([&] { next_pull = pull[0]; }));
    auto batch = server.GetBatch(absl::Seconds(5));
    REQUIRE_OK(batch);
    REQUIRE_OK(server_stream->Synchronize(absl::Seconds(5)));
    CHECK(seen_push.load() == step);  // the stream went once the batch was in
    absl::SleepFor(absl::Milliseconds(20));
    CHECK(seen_reply.load() == -1);  // no reply yet: the worker stream waits
    std::fill(reply.begin(), reply.end(), static_cast<uint8_t>(step * 10));
    const Reply r{0};
    REQUIRE_OK(server.Respond(*batch, {&r, 1}));
    REQUIRE_OK(worker.Wait(*h, absl::Seconds(5)));
    REQUIRE_OK(worker_stream->Synchronize(absl::Seconds(5)));
    CHECK(seen_reply.load() == step * 10);
    CHECK(next_pull.load() == step * 10);
  }
}

// ---- separate processes on 127.0.0.1 ----

struct ProcessMesh {
  ProcessMesh(int workers, int servers) {
    MeshOptions o = TcpOptions();
    o.num_workers = workers;
    o.num_servers = servers;
    auto started = testing::StartLoopbackScheduler(o);
    REQUIRE_OK(started);
    scheduler = *std::move(started);
  }
  std::vector<std::string> Args(const std::string& role, int rank, const Scenario& sc) const {
    return testing::NodeArgv(STEPMESH_TEST_NODE_PATH,
                             {{"--role", role},
                              {"--rank", std::to_string(rank)},
                              {"--scheduler", scheduler->address()},
                              {"--workers", std::to_string(sc.workers)},
                              {"--servers", std::to_string(sc.servers)},
                              {"--iterations", std::to_string(sc.iterations)},
                              {"--micro-batches", std::to_string(sc.micro_batches)},
                              {"--push-bytes", std::to_string(sc.push_bytes)},
                              {"--pull-bytes", std::to_string(sc.pull_bytes)},
                              {"--timeout-ms", "30000"}});
  }
  // Every server, then every worker of `sc` as a child process; each must exit 0
  // within `timeout`, then the scheduler see the job end.
  void RunToTheEnd(const Scenario& sc, absl::Duration timeout) {
    std::vector<std::pair<std::string, ChildProcess>> children;
    for (const auto& [role, count] : {std::pair{"server", sc.servers}, {"worker", sc.workers}}) {
      for (int r = 0; r < count; ++r) {
        absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(Args(role, r, sc));
        REQUIRE(child.ok());
        children.emplace_back(absl::StrCat(role, " ", r), *std::move(child));
      }
    }
    for (auto& [name, child] : children) {
      auto code = child.Wait(timeout);
      INFO(name);
      REQUIRE(code.ok());
      CHECK(*code == 0);
    }
    CHECK(scheduler->WaitUntilDone(absl::Seconds(10)).ok());
  }
  std::unique_ptr<Scheduler> scheduler;
};

// The soak is the 2A2F run (200 iterations, 6.6 GB checked byte for byte); the
// smaller shapes check their own routing (one server; one worker fanning out
// to two), for which 50 iterations (every micro-batch's keys and slots reused
// 49 times, a new byte pattern each time) are as good as 200.
TEST_CASE("separate processes: 2A2F 200 iterations, 1A1F and 1A2F 50, 3 micro-batches",
          "[mesh][process]") {
  for (auto [w, s, iterations] :
       {std::tuple{2, 2, 200}, std::tuple{1, 1, 50}, std::tuple{1, 2, 50}}) {
    const Scenario sc{.workers = w, .servers = s, .iterations = iterations};
    INFO(Describe(sc));
    ProcessMesh mesh(w, s);
    mesh.RunToTheEnd(sc, absl::Seconds(240));
  }
}

// The sanitizer-sized multi-process run (scripts/run-sanitizers.sh runs this
// one under ASan+UBSan and TSan, the 200-iteration one above only in the
// normal suite): every child's exit status is checked, so a sanitizer report
// in any process (exit 1 or SIGABRT) fails it.
TEST_CASE("short separate-process run: 2A2F, 3 micro-batches, 20 iterations",
          "[mesh][process][sanitizer]") {
  const Scenario sc{.workers = 2, .servers = 2, .iterations = 20};
  INFO(Describe(sc));
  ProcessMesh mesh(2, 2);
  mesh.RunToTheEnd(sc, absl::Seconds(120));
}

TEST_CASE("separate processes: a server killed mid-run gives workers UNAVAILABLE",
          "[mesh][process][fault]") {
  const Scenario sc{.workers = 1,
                    .servers = 2,
                    .iterations = 1000000,  // runs until the kill
                    .push_bytes = 4096,
                    .pull_bytes = 8192};
  ProcessMesh mesh(1, 2);
  // Server 0 outlives the run: it must end with UNAVAILABLE (its only worker
  // left) and exit 0 for it, not crash or hang.
  std::vector<std::string> server0_args = mesh.Args("server", 0, sc);
  server0_args.push_back("--expect-unavailable");
  ChildProcess server0 = *ChildProcess::Spawn(server0_args);
  ChildProcess server1 = *ChildProcess::Spawn(mesh.Args("server", 1, sc));
  std::vector<std::string> args = mesh.Args("worker", 0, sc);
  args.push_back("--expect-unavailable");
  ChildProcess worker = *ChildProcess::Spawn(args);
  absl::SleepFor(absl::Seconds(1));
  server1.Kill();
  const absl::Time killed = absl::Now();
  auto code = worker.Wait(absl::Seconds(10));
  REQUIRE(code.ok());
  CHECK(*code == 0);                                // it saw UNAVAILABLE
  CHECK(absl::Now() - killed < absl::Seconds(10));  // well within its timeout
  auto killed_code = server1.Wait(absl::Seconds(5));
  REQUIRE(killed_code.ok());
  CHECK(*killed_code == 128 + SIGKILL);  // our kill, not an earlier crash
  auto server0_code = server0.Wait(absl::Seconds(30));
  REQUIRE(server0_code.ok());  // no hang
  CHECK(*server0_code == 0);   // it saw UNAVAILABLE, nothing else
}

}  // namespace
}  // namespace stepmesh
