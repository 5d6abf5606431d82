#include "tests/libfabric/fabric_pair.h"

#include <cstring>
#include <utility>

#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/status.h"

namespace stepmesh::testing {

namespace {
constexpr uint64_t kKey = 7;
const core::NodeId kWorker = core::WorkerId(0);
const core::NodeId kServer = core::ServerId(0);
}  // namespace

absl::StatusOr<std::unique_ptr<FabricPair>> FabricPair::Make(
    const MeshOptions& options, libfabric::LibfabricHooks worker_hooks, size_t bytes, Device device,
    core::TransportFactory server_control) {
  std::unique_ptr<FabricPair> p(new FabricPair(bytes));
  p->options_ = options;
  libfabric::LibfabricHooks server_hooks;
  server_hooks.api = worker_hooks.api;
  STEPMESH_ASSIGN_OR_RETURN(p->worker_,
                            libfabric::CreateLibfabricTransport(options, tcp::CreateTcpTransport,
                                                                std::move(worker_hooks)));
  STEPMESH_ASSIGN_OR_RETURN(
      p->server_, libfabric::CreateLibfabricTransport(
                      options, server_control ? std::move(server_control) : tcp::CreateTcpTransport,
                      server_hooks));
  STEPMESH_RETURN_IF_ERROR(p->ConnectBoth());
  for (size_t i = 0; i < bytes; ++i) p->src_[i] = static_cast<std::byte>(i * 7 + 3);
  core::RegionInfo recv{.id = 1, .key = kKey, .base = p->slot_.data(), .slot_bytes = bytes};
  recv.device = device;
  recv.remote_writable = true;
  recv.slot_peers = {kWorker};
  core::RegionInfo send{.id = 1, .key = kKey, .base = p->src_.data(), .slot_bytes = bytes};
  send.device = device;
  STEPMESH_RETURN_IF_ERROR(p->server_->RegisterRegion(recv));
  STEPMESH_RETURN_IF_ERROR(p->worker_->RegisterRegion(send));
  return p;
}

absl::Status FabricPair::ConnectBoth() {
  STEPMESH_ASSIGN_OR_RETURN(std::string wep, worker_->LocalEndpoint());
  STEPMESH_ASSIGN_OR_RETURN(std::string sep, server_->LocalEndpoint());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  absl::Status server_connect;
  std::thread accept([&] {
    const core::PeerInfo peer{kWorker, wep};
    server_connect = server_->Connect(kServer, absl::MakeConstSpan(&peer, 1), deadline);
  });
  const core::PeerInfo to_server{kServer, sep};
  absl::Status worker_connect =
      worker_->Connect(kWorker, absl::MakeConstSpan(&to_server, 1), deadline);
  accept.join();
  STEPMESH_RETURN_IF_ERROR(worker_connect);
  return server_connect;
}

absl::Status FabricPair::RestartWorker(libfabric::LibfabricHooks hooks, absl::Duration wait) {
  // The server's receive side runs while the old worker leaves (it reads the
  // goodbye) and while the two connect (its hello handling is what a rejoin
  // races with); the new worker's starts after.
  if (!pollers_.empty()) return absl::FailedPreconditionError("RestartWorker: polling still runs");
  RetireWorker(wait);
  absl::StatusOr<std::unique_ptr<core::Transport>> made =
      libfabric::CreateLibfabricTransport(options_, tcp::CreateTcpTransport, std::move(hooks));
  if (!made.ok()) return made.status();
  worker_ = *std::move(made);
  absl::Status connected = ConnectBoth();
  PollWorker(wait);
  STEPMESH_RETURN_IF_ERROR(connected);
  core::RegionInfo send{.id = 1, .key = kKey, .base = src_.data(), .slot_bytes = src_.size()};
  return worker_->RegisterRegion(send);
}

FabricPair::~FabricPair() {
  StopPolling();
  if (worker_ != nullptr && server_ != nullptr) {
    RetireWorker(absl::Milliseconds(1));
    StopPolling();
  }
  if (worker_ != nullptr) worker_->Shutdown();  // Make failed before the server existed
  if (server_ != nullptr) server_->Shutdown();
}

void FabricPair::RetireWorker(absl::Duration wait) {
  // The server reads the worker's goodbye and closes its end while the
  // worker leaves; unpolled, it would make the worker wait out its drain
  // deadline and log that the server never closed.
  stop_.store(false);
  PollServer(wait);
  worker_->Shutdown();
  worker_.reset();
}

void FabricPair::StartPolling(absl::Duration wait) {
  stop_.store(false);
  PollServer(wait);
  PollWorker(wait);
}

void FabricPair::PollServer(absl::Duration wait) {
  pollers_.emplace_back([this, wait] {
    while (!stop_.load()) (void)server_->Poll(server_sink_, wait);
  });
}

void FabricPair::PollWorker(absl::Duration wait) {
  pollers_.emplace_back([this, wait] {
    while (!stop_.load()) (void)worker_->Poll(worker_sink_, wait);
  });
}

void FabricPair::StopPolling() {
  stop_.store(true);
  if (server_ != nullptr) server_->Wake();
  if (worker_ != nullptr) worker_->Wake();
  for (std::thread& t : pollers_) t.join();
  pollers_.clear();
}

absl::Status FabricPair::Push(uint64_t id) {
  core::FrameHeader h;
  h.type = core::FrameType::kPush;
  h.src = kWorker;
  h.dst = kServer;
  h.key = kKey;
  h.request_id = id;
  h.payload_bytes = src_.size();
  h.part_count = 1;
  return worker_->Send(kServer, h, src_.data(), 1, src_.size());
}

bool FabricPair::AwaitFrames(int n, absl::Duration within) {
  const absl::Time until = absl::Now() + within;
  while (server_sink_.delivered.load() + server_sink_.failed.load() < n) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

bool FabricPair::SlotMatchesSource() const {
  return std::memcmp(slot_.data(), src_.data(), src_.size()) == 0;
}

}  // namespace stepmesh::testing
