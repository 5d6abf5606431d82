// Control messages on a peer's bootstrap socket: adverts, withdrawals and
// their acknowledgements, goodbye.

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

void RdmaTransport::SendAdvert(Peer& peer, const LocalRegion& region, uint32_t slot) {
  rdma::Advert advert;
  advert.key = region.info.key;
  advert.addr = reinterpret_cast<uintptr_t>(region.info.base) + slot * region.info.slot_bytes;
  advert.bytes = region.info.slot_bytes;
  advert.rkey = region.slot_mrs[slot]->rkey;
  std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
  WriteControl(peer, msg, rdma::EncodeAdvert(advert, msg));
}

void RdmaTransport::WriteControl(Peer& peer, const std::byte* msg, size_t n) {
  absl::Status st;
  {
    MutexLock lock(&peer.write_mu);
    st = WriteFully(peer.socket.get(), msg, n, absl::Now() + options_.timeout);
  }
  if (st.ok()) return;
  peer.failure.Record(
      absl::UnavailableError(absl::StrCat("rdma: bootstrap connection to ", PeerName(peer.id),
                                          " failed: ", st.message())),
      FailureRecord::kCause);
  Wake();
}

void RdmaTransport::ReadControl(Peer& peer, TransportSink& sink) {
  for (;;) {
    const size_t want = peer.rx_got < rdma::kBootHeaderBytes
                            ? rdma::kBootHeaderBytes - peer.rx_got
                            : rdma::kBootHeaderBytes + BodyBytes(peer) - peer.rx_got;
    if (want == 0) {
      HandleControl(peer, sink);
      peer.rx_got = 0;
      if (peer.lost) return;
      continue;
    }
    const ssize_t n = ::recv(peer.socket.get(), peer.rx.data() + peer.rx_got, want, MSG_DONTWAIT);
    if (n == 0) {
      // What the peer posted before closing has been placed (it drained
      // before its goodbye): deliver it before reporting the loss.
      while (!peer.failure.failed() && DrainPeer(peer, sink) > 0) {
      }
      // CANCELLED: an orderly departure (see TransportSink::OnPeerLost).
      Lose(peer, sink,
           peer.failure.failed() ? peer.failure.status()
           : peer.said_goodbye
               ? absl::CancelledError(absl::StrCat(PeerName(peer.id), " left"))
               : absl::UnavailableError(absl::StrCat(PeerName(peer.id), " closed its connection")));
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        Lose(peer, sink, absl::UnavailableError(ErrnoMessage("rdma: bootstrap recv", errno)));
      }
      return;
    }
    peer.rx_got += static_cast<size_t>(n);
    if (peer.rx_got == rdma::kBootHeaderBytes) {
      absl::StatusOr<rdma::BootHeader> h = rdma::DecodeBootHeader(peer.rx.data());
      if (!h.ok()) {
        Lose(peer, sink, h.status());
        return;
      }
    }
  }
}

void RdmaTransport::HandleControl(Peer& peer, TransportSink& sink) {
  const rdma::BootHeader h = *rdma::DecodeBootHeader(peer.rx.data());
  const std::byte* body = peer.rx.data() + rdma::kBootHeaderBytes;
  switch (h.type) {
    case rdma::BootType::kAdvert: {
      absl::StatusOr<rdma::Advert> a = rdma::DecodeAdvert(body, h.body_bytes);
      if (!a.ok()) return Lose(peer, sink, a.status());
      MutexLock lock(&peer.route_mu);
      std::unique_ptr<Route>& route = peer.routes[a->key];
      if (route == nullptr) route = std::make_unique<Route>();
      ChangeRoute(peer, *route, a->addr, a->bytes, a->rkey, true);
      return;
    }
    case rdma::BootType::kWithdraw: {
      absl::StatusOr<uint64_t> key = rdma::DecodeWithdraw(body, h.body_bytes);
      if (!key.ok()) return Lose(peer, sink, key.status());
      {
        MutexLock lock(&peer.route_mu);
        if (auto it = peer.routes.find(*key); it != peer.routes.end()) {
          ChangeRoute(peer, *it->second, 0, 0, 0, false);
        }
      }
      // No post uses the slot from here on; a fence behind those already
      // posted tells when the slot's owner may release it (ServiceAcks).
      peer.pending_acks.push_back({*key, FencePeer(peer, absl::Now() + options_.timeout)});
      pending_acks_.fetch_add(1, std::memory_order_relaxed);
      ServiceAcks(peer);
      return;
    }
    case rdma::BootType::kWithdrawAck: {
      absl::StatusOr<uint64_t> key = rdma::DecodeWithdraw(body, h.body_bytes);
      if (!key.ok()) return Lose(peer, sink, key.status());
      MutexLock lock(&acks_mu_);
      if (auto it = awaited_acks_.find({peer.token, *key});
          it != awaited_acks_.end() && --it->second == 0) {
        awaited_acks_.erase(it);
      }
      return;
    }
    case rdma::BootType::kGoodbye:
      peer.said_goodbye = true;
      return;
    default:
      return Lose(peer, sink, absl::DataLossError("rdma: unexpected bootstrap message"));
  }
}

}  // namespace stepmesh::rdma::impl
