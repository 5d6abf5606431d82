// A server's Respond sends its replies on the calling thread when its send
// thread is idle and the transport's Send never waits (TCP): no hand-off to
// the send thread on the round trip's critical path (docs/benchmarks.md,
// "The hand-offs"). With a send already queued, the replies wait behind it.

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "src/compose/transports.h"
#include "stepmesh/server.h"
#include "stepmesh/status.h"
#include "stepmesh/worker.h"
#include "tests/support/forwarding_transport.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

// Counts the reply frames a server sends, and those sent on `responder`.
struct ReplyThreads {
  std::atomic<std::thread::id> responder{};
  std::atomic<int> replies{0};
  std::atomic<int> on_responder{0};
};

class ReplyThreadTransport final : public testing::ForwardingTransport {
 public:
  ReplyThreadTransport(std::unique_ptr<core::Transport> inner, bool never_waits, ReplyThreads& seen)
      : ForwardingTransport(std::move(inner)), never_waits_(never_waits), seen_(seen) {}
  bool SendNeverWaits() const override { return never_waits_; }
  absl::Status Send(core::NodeId peer, const core::FrameHeader& header, const void* src,
                    core::RegionId src_region, size_t bytes) override {
    if (header.type == core::FrameType::kReply) {
      seen_.replies.fetch_add(1);
      if (std::this_thread::get_id() == seen_.responder.load()) seen_.on_responder.fetch_add(1);
    }
    return ForwardingTransport::Send(peer, header, src, src_region, bytes);
  }

 private:
  const bool never_waits_;
  ReplyThreads& seen_;
};

// 1 worker x 1 server over TCP, `rounds` round trips; the server's transport
// reports the TCP transport's SendNeverWaits when `pass_never_waits`, false
// (a transport whose Send may wait) otherwise.
void RunRounds(int rounds, bool pass_never_waits, ReplyThreads& seen) {
  constexpr size_t kBytes = 4096;
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = 1;
  base.num_servers = 1;
  base.timeout = absl::Seconds(60);
  testing::MeshBuffers buffers(1, 1, kBytes);
  core::TransportFactory factory =
      [&seen, pass_never_waits](
          const MeshOptions& options) -> absl::StatusOr<std::unique_ptr<core::Transport>> {
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<core::Transport> inner,
                              compose::CreateTransport(options));
    if (options.role != Role::kServer) return inner;
    const bool never_waits = pass_never_waits && inner->SendNeverWaits();
    return std::make_unique<ReplyThreadTransport>(std::move(inner), never_waits, seen);
  };
  auto mesh = testing::LoopbackMesh::Start(base, factory);
  REQUIRE_OK(mesh);
  std::atomic<int> failures{0};
  auto serve = [&](AFTensorServer& server) -> absl::Status {
    seen.responder.store(std::this_thread::get_id());
    STEPMESH_RETURN_IF_ERROR(testing::RegisterKeyPair(server, buffers, kBytes));
    const Reply answer[1] = {{0}};
    for (;;) {  // ends when the worker has left
      absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(30));
      if (!batch.ok()) break;
      buffers.reply[0][0] = buffers.recv[0][0] ^ 0x5A;
      if (!server.Respond(*batch, answer).ok()) failures.fetch_add(1);
    }
    return server.Shutdown();
  };
  auto work = [&](AFTensorWorker& worker) -> absl::Status {
    STEPMESH_ASSIGN_OR_RETURN(const PreparedRequest plan,
                              testing::RegisterKeyPair(worker, buffers, kBytes));
    for (int i = 0; i < rounds; ++i) {
      buffers.push[0][0] = static_cast<uint8_t>(i);
      STEPMESH_ASSIGN_OR_RETURN(const RequestHandle h, worker.Post(plan));
      STEPMESH_RETURN_IF_ERROR(worker.Wait(h, absl::Seconds(30)));
      if (buffers.pull[0][0] != (static_cast<uint8_t>(i) ^ 0x5A)) failures.fetch_add(1);
    }
    return worker.Shutdown();
  };
  CHECK_OK(testing::RunParticipants(**mesh, work, serve));
  CHECK(failures.load() == 0);
}

// Runs `rounds` round trips of one worker; every reply must arrive. Returns
// how many of them the responder's own thread sent.
int RepliesSentByResponder(int rounds, bool pass_never_waits) {
  ReplyThreads seen;
  RunRounds(rounds, pass_never_waits, seen);
  CHECK(seen.replies.load() == rounds);
  return seen.on_responder.load();
}

TEST_CASE("inline reply: an idle server's Respond sends the replies on its own thread (tcp)",
          "[mesh][tcp][inline]") {
  // The send thread is idle between round trips of one worker: every reply
  // goes out inline (the old path handed each to the send thread).
  CHECK(RepliesSentByResponder(50, /*pass_never_waits=*/true) == 50);
}

TEST_CASE("inline reply: a transport whose Send may wait keeps the replies on the send thread",
          "[mesh][tcp][inline]") {
  CHECK(RepliesSentByResponder(20, /*pass_never_waits=*/false) == 0);
}

}  // namespace
}  // namespace stepmesh
