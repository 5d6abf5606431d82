// A caller blocked in Wait or GetBatch polls the transport itself where the
// transport allows it (Transport::PollFromAnyThread: TCP), so the frame that
// ends its wait is read and delivered on its own thread, not handed over by
// the receive thread (MeshNode::AwaitDriving; docs/benchmarks.md, "The
// hand-offs"). Several waiters share the poll, and a shutdown ends a driven wait.

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/status.h"
#include "stepmesh/worker.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

// Counts the frames of one type a participant's transport delivers, and those
// delivered on `waiter` (the thread that waits for them).
struct Deliveries {
  core::FrameType type = core::FrameType::kReply;
  std::atomic<std::thread::id> waiter{};
  std::atomic<int> frames{0};
  std::atomic<int> on_waiter{0};
};

class DeliverySink final : public testing::ForwardingSink {
 public:
  DeliverySink(core::TransportSink& inner, Deliveries& seen) : ForwardingSink(inner), seen_(seen) {}
  void OnFrame(core::NodeId peer, const core::FrameHeader& header, core::FrameContext context,
               absl::Status status) override {
    if (header.type == seen_.type) {
      seen_.frames.fetch_add(1);
      if (std::this_thread::get_id() == seen_.waiter.load()) seen_.on_waiter.fetch_add(1);
    }
    ForwardingSink::OnFrame(peer, header, context, std::move(status));
  }

 private:
  Deliveries& seen_;
};

// Watches deliveries; reports the inner transport's PollFromAnyThread, or
// false (a transport only its receive thread may poll).
class DeliveryTransport final : public testing::ForwardingTransport {
 public:
  DeliveryTransport(std::unique_ptr<core::Transport> inner, bool any_thread, Deliveries& seen)
      : ForwardingTransport(std::move(inner)), any_thread_(any_thread), seen_(seen) {}
  bool SendNeverWaits() const override { return true; }  // as the TCP transport under it
  bool PollFromAnyThread() const override { return any_thread_; }
  absl::Status Poll(core::TransportSink& sink, absl::Duration max_wait) override {
    DeliverySink watching(sink, seen_);
    return ForwardingTransport::Poll(watching, max_wait);
  }

 private:
  const bool any_thread_;
  Deliveries& seen_;
};

MeshOptions TcpOptions(int workers, int servers) {
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = workers;
  base.num_servers = servers;
  base.timeout = absl::Seconds(60);
  return base;
}

// TCP transports watched by `replies` (workers) and `pushes` (servers).
core::TransportFactory Watched(bool pass_any_thread, Deliveries& replies, Deliveries& pushes) {
  return [&replies, &pushes, pass_any_thread](
             const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> inner,
                              compose::CreateTransport(options));
    const bool any_thread = pass_any_thread && inner->PollFromAnyThread();
    Deliveries& seen = options.role == Role::kWorker ? replies : pushes;
    return std::make_unique<DeliveryTransport>(std::move(inner), any_thread, seen);
  };
}

constexpr size_t kBytes = 64 * 1024;
// Long enough that the other side is in its Wait/GetBatch (and holds the
// poll) before the frame it waits for leaves, even on a loaded machine.
constexpr absl::Duration kLag = absl::Milliseconds(50);

// 1 worker x 1 server, `rounds` round trips. The worker posts each request
// kLag after the previous one completed and the server responds kLag after
// GetBatch returned, so each side is blocked waiting when its frame arrives.
void RunLaggedRounds(int rounds, bool pass_any_thread, Deliveries& replies, Deliveries& pushes) {
  replies.type = core::FrameType::kReply;
  pushes.type = core::FrameType::kPush;
  testing::MeshBuffers buffers(1, 1, kBytes);
  auto mesh =
      testing::LoopbackMesh::Start(TcpOptions(1, 1), Watched(pass_any_thread, replies, pushes));
  REQUIRE_OK(mesh);
  std::atomic<int> failures{0};
  auto serve = [&](AFTensorServer& server) -> absl::Status {
    pushes.waiter.store(std::this_thread::get_id());
    STEPMESH_RETURN_IF_ERROR(testing::RegisterKeyPair(server, buffers, kBytes));
    const Reply answer[1] = {{0}};
    for (;;) {  // ends when the worker has left
      absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(30));
      if (!batch.ok()) break;
      absl::SleepFor(kLag);
      for (size_t i = 0; i < kBytes; ++i) buffers.reply[0][i] = buffers.recv[0][i] ^ 0x5A;
      if (!server.Respond(*batch, answer).ok()) failures.fetch_add(1);
    }
    return server.Shutdown();
  };
  auto work = [&](AFTensorWorker& worker) -> absl::Status {
    replies.waiter.store(std::this_thread::get_id());
    STEPMESH_ASSIGN_OR_RETURN(const PreparedRequest plan,
                              testing::RegisterKeyPair(worker, buffers, kBytes));
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < kBytes; ++i) buffers.push[0][i] = static_cast<uint8_t>(i * 7 + r);
      absl::SleepFor(kLag);
      STEPMESH_ASSIGN_OR_RETURN(const RequestHandle h, worker.Post(plan));
      STEPMESH_RETURN_IF_ERROR(worker.Wait(h, absl::Seconds(30)));
      for (size_t i = 0; i < kBytes; ++i) {
        if (buffers.pull[0][i] != (static_cast<uint8_t>(i * 7 + r) ^ 0x5A)) {
          failures.fetch_add(1);
          break;
        }
      }
    }
    return worker.Shutdown();
  };
  CHECK_OK(testing::RunParticipants(**mesh, work, serve));
  CHECK(failures.load() == 0);
  CHECK(replies.frames.load() == rounds);
  CHECK(pushes.frames.load() == rounds);
}

TEST_CASE("driven wait: Wait and GetBatch read their own frames (tcp)", "[mesh][tcp][drive]") {
  // Before AwaitDriving the receive thread delivered every frame and woke
  // the waiter: 0 of these on the waiting threads. Two rounds may miss (a
  // waiter descheduled for the whole lag on a loaded machine).
  constexpr int kRounds = 8;
  Deliveries replies, pushes;
  RunLaggedRounds(kRounds, /*pass_any_thread=*/true, replies, pushes);
  CHECK(replies.on_waiter.load() >= kRounds - 2);
  CHECK(pushes.on_waiter.load() >= kRounds - 2);
}

TEST_CASE("driven wait: a transport only the receive thread may poll keeps deliveries there",
          "[mesh][tcp][drive]") {
  constexpr int kRounds = 4;
  Deliveries replies, pushes;
  RunLaggedRounds(kRounds, /*pass_any_thread=*/false, replies, pushes);
  CHECK(replies.on_waiter.load() == 0);
  CHECK(pushes.on_waiter.load() == 0);
}

TEST_CASE("driven wait: two threads of one worker wait at once, each its own server's reply",
          "[mesh][tcp][drive]") {
  // The poll passes between the two waiters and the receive thread; each
  // reply completes its own request, whoever reads it, and none waits for
  // the other's deadline.
  constexpr int kRounds = 60;
  auto mesh = testing::LoopbackMesh::Start(TcpOptions(1, 2), compose::CreateTransport);
  REQUIRE_OK(mesh);
  std::vector<std::vector<uint8_t>> push(2, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> pull(2, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> recv(2, std::vector<uint8_t>(kBytes));
  std::vector<std::vector<uint8_t>> reply(2, std::vector<uint8_t>(kBytes));
  std::atomic<int> failures{0};
  std::atomic<int64_t> slowest_wait_ms{0};
  auto serve = [&](AFTensorServer& server) -> absl::Status {
    const int s = server.rank();
    const Shape shape{1, kBytes};
    STEPMESH_RETURN_IF_ERROR(
        server.RegisterRecvTensor(10 + s, {recv[s].data(), DType::kUInt8, shape}));
    STEPMESH_RETURN_IF_ERROR(
        server.RegisterReplyTensor(20 + s, {reply[s].data(), DType::kUInt8, shape}));
    STEPMESH_RETURN_IF_ERROR(server.Barrier());
    const Reply answer[1] = {{0}};
    for (int r = 0;; ++r) {
      absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(30));
      if (!batch.ok()) break;
      // Staggered, so the replies of the two servers arrive in either order.
      if ((r + s) % 3 == 0) absl::SleepFor(absl::Milliseconds(2));
      for (size_t i = 0; i < kBytes; ++i) reply[s][i] = recv[s][i] ^ static_cast<uint8_t>(0x30 + s);
      if (!server.Respond(*batch, answer).ok()) failures.fetch_add(1);
    }
    return server.Shutdown();
  };
  auto work = [&](AFTensorWorker& worker) -> absl::Status {
    for (int s = 0; s < 2; ++s) {
      STEPMESH_RETURN_IF_ERROR(
          worker.RegisterPushTensor(10 + s, BytesView(push[s].data(), kBytes)));
      STEPMESH_RETURN_IF_ERROR(
          worker.RegisterPullTensor(20 + s, s, BytesView(pull[s].data(), kBytes)));
    }
    STEPMESH_RETURN_IF_ERROR(worker.Barrier());
    auto one_server = [&](int s) {
      const int servers[1] = {s};
      const Push p{static_cast<Key>(10 + s), kWholeTensor, servers};
      const Pull q{static_cast<Key>(20 + s), s};
      absl::StatusOr<PreparedRequest> plan = worker.Prepare({&p, 1}, {&q, 1});
      if (!plan.ok()) {
        failures.fetch_add(1);
        return;
      }
      for (int r = 0; r < kRounds; ++r) {
        for (size_t i = 0; i < kBytes; ++i) push[s][i] = static_cast<uint8_t>(i + 13 * r + s);
        absl::StatusOr<RequestHandle> h = worker.Post(*plan);
        const auto start = std::chrono::steady_clock::now();
        if (!h.ok() || !worker.Wait(*h, absl::Seconds(20)).ok()) {
          failures.fetch_add(1);
          return;
        }
        const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - start)
                               .count();
        int64_t prev = slowest_wait_ms.load();
        while (ms > prev && !slowest_wait_ms.compare_exchange_weak(prev, ms)) {
        }
        for (size_t i = 0; i < kBytes; ++i) {
          const uint8_t want =
              static_cast<uint8_t>(i + 13 * r + s) ^ static_cast<uint8_t>(0x30 + s);
          if (pull[s][i] != want) {
            failures.fetch_add(1);
            return;
          }
        }
      }
    };
    std::thread other(one_server, 1);
    one_server(0);
    other.join();
    return worker.Shutdown();
  };
  CHECK_OK(testing::RunParticipants(**mesh, work, serve));
  CHECK(failures.load() == 0);
  // A wait stuck behind the other waiter's poll until a timeout would show
  // here (each round trip takes milliseconds).
  CHECK(slowest_wait_ms.load() < 5000);
}

TEST_CASE("driven wait: Shutdown ends a Wait that is polling, with CANCELLED",
          "[mesh][tcp][drive]") {
  testing::MeshBuffers buffers(1, 1, kBytes);
  auto mesh = testing::LoopbackMesh::Start(TcpOptions(1, 1), compose::CreateTransport);
  REQUIRE_OK(mesh);
  absl::Status waited;
  absl::Duration took;
  auto serve = [&](AFTensorServer& server) -> absl::Status {
    STEPMESH_RETURN_IF_ERROR(testing::RegisterKeyPair(server, buffers, kBytes));
    // Takes the request and never answers it; ends when the worker is gone.
    for (int i = 0; i < 100; ++i) {
      absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(30));
      if (!batch.ok()) break;
    }
    return server.Shutdown();
  };
  auto work = [&](AFTensorWorker& worker) -> absl::Status {
    STEPMESH_ASSIGN_OR_RETURN(const PreparedRequest plan,
                              testing::RegisterKeyPair(worker, buffers, kBytes));
    STEPMESH_ASSIGN_OR_RETURN(const RequestHandle h, worker.Post(plan));
    std::thread stopper([&worker] {
      absl::SleepFor(absl::Milliseconds(200));
      (void)worker.Shutdown();
    });
    const absl::Time start = absl::Now();
    waited = worker.Wait(h, absl::Seconds(30));
    took = absl::Now() - start;
    stopper.join();
    return absl::OkStatus();
  };
  CHECK_OK(testing::RunParticipants(**mesh, work, serve));
  CHECK_STATUS(waited, kCancelled);
  CHECK(took < absl::Seconds(10));
}

}  // namespace
}  // namespace stepmesh
