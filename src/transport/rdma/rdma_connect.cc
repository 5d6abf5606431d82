// Connecting to peers: workers dial, servers accept (BootstrapListener);
// the hello/ready handshake builds the QPs, then the peer is published.

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

absl::Status RdmaTransport::Connect(NodeId self, absl::Span<const PeerInfo> peers,
                                    absl::Time deadline) {
  self_ = self;
  setup_.self = self;
  std::vector<NodeId> expected;
  for (const PeerInfo& info : peers) {
    if (!core::IsWorker(self_)) {
      expected.push_back(info.id);
      continue;
    }
    STEPMESH_ASSIGN_OR_RETURN(HostPort where,
                              ParseHostPort(info.endpoint.substr(0, info.endpoint.find('|'))));
    absl::StatusOr<UniqueFd> fd = ConnectTcp(where, deadline);
    if (!fd.ok()) {
      return absl::UnavailableError(absl::StrCat("rdma: connecting to ", PeerName(info.id), " at ",
                                                 info.endpoint, ": ", fd.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(
        DialHandshake(fd->get(), self_, info.id, options_.auth_token, deadline));
    STEPMESH_RETURN_IF_ERROR(Handshake(info.id, *std::move(fd), deadline));
  }
  while (!expected.empty()) {
    // Who dials, and (with a secret) proof of it, before any verbs resource
    // is built; every accepted socket's handshake runs at once, capped, so
    // silent or hostile clients cannot keep a real peer waiting.
    absl::StatusOr<std::pair<NodeId, UniqueFd>> accepted =
        listener_.AcceptOne(self_, expected, options_.auth_token, deadline);
    if (!accepted.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rdma: ", expected.size(), " peer(s) never connected: ", accepted.status().message()));
    }
    auto& [from, fd] = *accepted;
    expected.erase(std::find(expected.begin(), expected.end(), from));
    STEPMESH_RETURN_IF_ERROR(Handshake(from, std::move(fd), deadline));
  }
  return absl::OkStatus();
}

absl::StatusOr<rdma::Hello> RdmaTransport::ReadHello(int fd, absl::Time deadline) {
  std::byte head[rdma::kBootHeaderBytes];
  STEPMESH_RETURN_IF_ERROR(ReadFully(fd, head, sizeof(head), deadline));
  STEPMESH_ASSIGN_OR_RETURN(rdma::BootHeader h, rdma::DecodeBootHeader(head));
  if (h.type != rdma::BootType::kHello) return absl::DataLossError("rdma: expected a hello");
  std::byte body[rdma::kMaxBootBody];
  STEPMESH_RETURN_IF_ERROR(ReadFully(fd, body, h.body_bytes, deadline));
  return rdma::DecodeHello(body, h.body_bytes);
}

absl::Status RdmaTransport::Handshake(NodeId peer_id, UniqueFd fd, absl::Time deadline) {
  auto peer = std::make_unique<Peer>();
  peer->id = peer_id;
  peer->num_qps = static_cast<uint32_t>(rdma_.qps_per_peer);
  peer->depth = static_cast<uint32_t>(rdma_.recv_depth);
  rdma::Hello mine;
  STEPMESH_RETURN_IF_ERROR(BuildPeer(setup_, rng_, *peer, mine));
  std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
  const size_t len = rdma::EncodeHello(mine, msg);
  // Both ends write, then read: the hellos are small enough for the socket buffers.
  STEPMESH_RETURN_IF_ERROR(WriteFully(fd.get(), msg, len, deadline));
  STEPMESH_ASSIGN_OR_RETURN(rdma::Hello theirs, ReadHello(fd.get(), deadline));
  if (theirs.node != peer_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("rdma: expected ", PeerName(peer_id), ", reached ", PeerName(theirs.node)));
  }
  if (theirs.num_qps != peer->num_qps || theirs.recv_depth != peer->depth) {
    return absl::FailedPreconditionError(
        absl::StrCat("rdma: ", PeerName(peer_id), " uses ", theirs.num_qps, " QPs x ",
                     theirs.recv_depth, " receives, this node ", peer->num_qps, " x ", peer->depth,
                     " (rdma.qps_per_peer and rdma.recv_depth must match across the mesh)"));
  }
  STEPMESH_RETURN_IF_ERROR(BringUp(setup_, *peer, theirs));
  const size_t ready = rdma::EncodeEmpty(rdma::BootType::kReady, msg);
  STEPMESH_RETURN_IF_ERROR(WriteFully(fd.get(), msg, ready, deadline));
  std::byte head[rdma::kBootHeaderBytes];
  STEPMESH_RETURN_IF_ERROR(ReadFully(fd.get(), head, sizeof(head), deadline));
  STEPMESH_ASSIGN_OR_RETURN(rdma::BootHeader h, rdma::DecodeBootHeader(head));
  if (h.type != rdma::BootType::kReady || h.body_bytes != 0) {
    return absl::DataLossError("rdma: expected ready");
  }
  STEPMESH_RETURN_IF_ERROR(SetNoDelay(fd.get()));
  STEPMESH_RETURN_IF_ERROR(SetNonBlocking(fd.get(), true));
  peer->socket = std::move(fd);
  Peer* reporting = nullptr;
  STEPMESH_RETURN_IF_ERROR(Publish(std::move(peer), &reporting));
  // The connection this one replaces was being reported lost as it was
  // superseded: let that report reach the core before Connect returns, so
  // the core never takes the old connection's end for the new one's.
  if (reporting != nullptr) {
    const absl::Time until = std::min(deadline, absl::Now() + options_.timeout);
    while (!reporting->loss_reported.load() && !shut_down_.load() && absl::Now() < until) {
      absl::SleepFor(absl::Microseconds(100));
    }
  }
  return absl::OkStatus();
}

absl::Status RdmaTransport::Publish(std::unique_ptr<Peer> peer, Peer** reporting) {
  MutexLock regions_lock(&regions_mu_);
  Peer* raw = peer.get();
  {
    MutexLock lock(&peers_mu_);
    const size_t slot = peer_count_.load(std::memory_order_relaxed);
    if (slot >= kMaxPeers) return absl::ResourceExhaustedError("rdma: too many connections");
    raw->token = slot;
    if (auto it = by_id_.find(raw->id); it != by_id_.end() && it->second->lost.load()) {
      *reporting = it->second;
    } else if (it != by_id_.end() && !it->second->lost.exchange(true)) {
      // A rejoin replaces a connection never reported lost (the core learns
      // of the new process from the scheduler). Its socket leaves the epoll
      // set too: a closed socket would keep it readable forever.
      Peer& old = *it->second;
      ErrorQps(old);
      ClearOutbox(old);
      loop_.Unwatch(old.socket.get());
      ::shutdown(old.socket.get(), SHUT_RDWR);
      WakeRouteWaiters(old);
    }
    by_id_[raw->id] = raw;
    peers_[slot] = std::move(peer);
    peer_count_.store(slot + 1, std::memory_order_release);
    peers_version_.fetch_add(1, std::memory_order_acq_rel);  // send-thread caches look again
  }
  WakeAckWaiters();
  STEPMESH_RETURN_IF_ERROR(Watch(raw->socket.get(), raw->token));
  for (const auto& [id, region] : regions_) {
    const RegionInfo& info = region->info;
    if (!info.remote_writable) continue;
    for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
      if (info.slot_peers[slot] == raw->id) SendAdvert(*raw, *region, slot);
    }
  }
  return absl::OkStatus();
}

}  // namespace stepmesh::rdma::impl
