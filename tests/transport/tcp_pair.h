#pragma once
// Two TCP transports in one process, a worker and a server, connected to each
// other over loopback; a sink that lands frame i (its request_id) in buffer i
// and records deliveries and losses; a reproducible byte pattern. Shared by the
// transport's rails and shutdown tests.

#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/options.h"
#include "tests/support/status.h"

namespace stepmesh::testing {

class BufferSink final : public core::TransportSink {
 public:
  explicit BufferSink(std::vector<std::vector<std::byte>>* buffers) : buffers_(buffers) {}
  absl::Status Resolve(core::NodeId, const core::FrameHeader& header, core::Destination& out,
                       core::FrameContext*) override {
    if (header.request_id >= buffers_->size()) return absl::OutOfRangeError("no buffer");
    auto& b = (*buffers_)[header.request_id];
    out.data = b.data();
    out.capacity = b.size();
    return absl::OkStatus();
  }
  void OnFrame(core::NodeId, const core::FrameHeader& header, core::FrameContext,
               absl::Status status) override {
    delivered.push_back(header.request_id);
    statuses.push_back(std::move(status));
  }
  void OnPeerLost(core::NodeId peer, absl::Status why) override {
    lost.push_back(peer);
    reasons.push_back(std::move(why));
  }
  std::vector<uint64_t> delivered;
  std::vector<absl::Status> statuses;
  std::vector<core::NodeId> lost;
  std::vector<absl::Status> reasons;

 private:
  std::vector<std::vector<std::byte>>* buffers_;
};

// Shuts both ends down side by side when it goes: an orderly TCP Shutdown
// reads until the peer's FIN, and a transport nobody polls never sends one, so
// shutting these down one after the other would wait out the bound.
struct TcpPair {
  TcpPair() = default;
  TcpPair(TcpPair&&) = default;
  TcpPair& operator=(TcpPair&&) = default;
  ~TcpPair() {
    if (server == nullptr || worker == nullptr) return;
    auto server_done = std::async(std::launch::async, [this] { server->Shutdown(); });
    worker->Shutdown();
    server_done.get();
  }

  std::unique_ptr<core::Transport> server;
  std::unique_ptr<core::Transport> worker;
  core::NodeId s = core::ServerId(0);
  core::NodeId w = core::WorkerId(0);
};

// Creates both transports and connects them (each side within 5 s).
inline absl::StatusOr<TcpPair> ConnectTcpPair(const MeshOptions& server_options,
                                              const MeshOptions& worker_options) {
  TcpPair p;
  STEPMESH_ASSIGN_OR_RETURN(p.server, tcp::CreateTcpTransport(server_options));
  STEPMESH_ASSIGN_OR_RETURN(p.worker, tcp::CreateTcpTransport(worker_options));
  STEPMESH_ASSIGN_OR_RETURN(std::string server_at, p.server->LocalEndpoint());
  STEPMESH_ASSIGN_OR_RETURN(std::string worker_at, p.worker->LocalEndpoint());
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{p.w, worker_at};
    return p.server->Connect(p.s, {&peer, 1}, absl::Now() + absl::Seconds(5));
  });
  const core::PeerInfo peer{p.s, server_at};
  absl::Status dialled = p.worker->Connect(p.w, {&peer, 1}, absl::Now() + absl::Seconds(5));
  absl::Status accepted_status = accepted.get();
  STEPMESH_RETURN_IF_ERROR(dialled);
  STEPMESH_RETURN_IF_ERROR(accepted_status);
  return p;
}

// `bytes` of xorshift output from `seed`: every frame of a test different.
inline std::vector<std::byte> Pattern(size_t bytes, uint64_t seed) {
  std::vector<std::byte> out(bytes);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < bytes; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out[i] = static_cast<std::byte>(x);
  }
  return out;
}

}  // namespace stepmesh::testing
