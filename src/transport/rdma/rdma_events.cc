// Asynchronous events (QP, CQ, port, device) and losing a peer.

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

void RdmaTransport::HandleAsyncEvents(TransportSink& sink) {
  ibv_async_event event;
  while (verbs_->GetAsyncEvent(port_.context.get(), &event) == 0) {
    const ibv_event_type type = event.event_type;
    Peer* peer = nullptr;
    absl::Status everyone;  // not OK: every peer is lost, for this reason
    switch (type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        peer = static_cast<Peer*>(event.element.qp->qp_context);
        break;
      case IBV_EVENT_CQ_ERR:
        peer = static_cast<Peer*>(event.element.cq->cq_context);
        break;
      case IBV_EVENT_DEVICE_FATAL:
        everyone = absl::UnavailableError(
            absl::StrCat("rdma: ", port_.device_name, " reported a fatal device error"));
        break;
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_PORT_ACTIVE:
      case IBV_EVENT_LID_CHANGE:
      case IBV_EVENT_GID_CHANGE:
      case IBV_EVENT_PKEY_CHANGE:
      case IBV_EVENT_SM_CHANGE:
      case IBV_EVENT_CLIENT_REREGISTER:
        // Port events name their port: the other port of a dual-port HCA is
        // none of this transport's business.
        if (event.element.port_num != port_.port) {
          STEPMESH_LOG(kInfo, "rdma: ", port_.device_name, " port ", int{event.element.port_num},
                       " event ", static_cast<int>(type), " ignored (this transport uses port ",
                       int{port_.port}, ")");
          break;
        }
        everyone = PortEvent(type);
        break;
      default:
        STEPMESH_LOG(kInfo, "rdma: async event ", static_cast<int>(type));
        break;
    }
    verbs_->AckAsyncEvent(&event);
    if (peer != nullptr) {
      peer->failure.Record(
          absl::UnavailableError(absl::StrCat("rdma: asynchronous error event ",
                                              static_cast<int>(type), " on ", port_.device_name)),
          FailureRecord::kEvent);
    }
    if (!everyone.ok()) {
      const size_t count = peer_count_.load(std::memory_order_acquire);
      for (size_t i = 0; i < count; ++i) peers_[i]->failure.Record(everyone, FailureRecord::kCause);
    }
  }
  ReportFailures(sink);
}

absl::Status RdmaTransport::PortEvent(ibv_event_type type) {
  const std::string where = absl::StrCat(port_.device_name, " port ", int{port_.port});
  switch (type) {
    case IBV_EVENT_PORT_ERR:
      return absl::UnavailableError(absl::StrCat("rdma: ", where, " went down"));
    case IBV_EVENT_GID_CHANGE: {
      // Peers address this node by the GID it sent them.
      ibv_gid_entry entry{};
      const int rc = verbs_->QueryGidEx(port_.context.get(), port_.port,
                                        static_cast<uint32_t>(port_.gid_index), &entry);
      if (rc == 0 && std::memcmp(&entry.gid, &port_.gid, sizeof(ibv_gid)) == 0) {
        return absl::OkStatus();
      }
      return absl::UnavailableError(
          absl::StrCat("rdma: GID index ", port_.gid_index, " of ", where, " changed (was ",
                       GidToString(port_.gid), ", now ", rc == 0 ? GidToString(entry.gid) : "gone",
                       "): peers can no longer reach this node's address"));
    }
    case IBV_EVENT_LID_CHANGE: {
      if (port_.roce()) return absl::OkStatus();
      ibv_port_attr attr{};
      if (verbs_->QueryPort(port_.context.get(), port_.port, &attr) == 0 && attr.lid == port_.lid) {
        return absl::OkStatus();
      }
      return absl::UnavailableError(absl::StrCat("rdma: the LID of ", where, " changed"));
    }
    default:
      STEPMESH_LOG(kInfo, "rdma: ", where, " event ", static_cast<int>(type));
      return absl::OkStatus();
  }
}

void RdmaTransport::ErrorQps(Peer& peer) {
  for (uint32_t q = 0; q < peer.num_qps; ++q) {
    if (!peer.qps[q].qp) continue;
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    verbs_->ModifyQp(peer.qps[q].qp.get(), &attr, IBV_QP_STATE);  // flushes what is posted
  }
}

void RdmaTransport::Lose(Peer& peer, TransportSink& sink, absl::Status why) {
  if (peer.lost.exchange(true)) return;
  ErrorQps(peer);
  loop_.Unwatch(peer.socket.get());
  ::shutdown(peer.socket.get(), SHUT_RDWR);
  pending_acks_.fetch_sub(peer.pending_acks.size(), std::memory_order_relaxed);
  peer.pending_acks.clear();
  ClearOutbox(peer);
  WakeRouteWaiters(peer);
  WakeAckWaiters();
  sink.OnPeerLost(peer.id, std::move(why));
  peer.loss_reported.store(true);
}

}  // namespace stepmesh::rdma::impl
