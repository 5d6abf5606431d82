#include "src/transport/rdma/peer_setup.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/core/protocol.h"
#include "stepmesh/status.h"

namespace stepmesh::rdma {
namespace {

using base::ErrnoMessage;
using core::PeerName;

using rdma::kMailboxStride;
using rdma::kRingStride;

constexpr size_t kPageBytes = 4096;
constexpr uint32_t kInlineTries[] = {256, 128, 64, 0};

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

ibv_mtu MtuFromBytes(int bytes) {
  switch (bytes) {
    case 256:
      return IBV_MTU_256;
    case 512:
      return IBV_MTU_512;
    case 1024:
      return IBV_MTU_1024;
    case 2048:
      return IBV_MTU_2048;
    default:
      return IBV_MTU_4096;
  }
}

absl::Status Modify(VerbsApi& verbs, QueuePair& qp, ibv_qp_attr& attr, int mask,
                    const char* state) {
  if (const int rc = verbs.ModifyQp(qp.qp.get(), &attr, mask); rc != 0) {
    return absl::InternalError(ErrnoMessage(absl::StrCat("rdma: QP to ", state), rc));
  }
  return absl::OkStatus();
}

absl::Status PostReceive(VerbsApi& verbs, QueuePair& qp, uint32_t q) {
  ibv_recv_wr wr{};
  wr.wr_id = q;
  ibv_recv_wr* bad = nullptr;
  if (const int rc = verbs.PostRecv(qp.qp.get(), &wr, &bad); rc != 0) {
    return absl::InternalError(ErrnoMessage("rdma: ibv_post_recv", rc));
  }
  return absl::OkStatus();
}

// The send CQ must hold every request the QP may have outstanding: a failing
// QP flushes each one, signalled or not, into it. Providers grant more send
// WRs than asked (mlx5 rounds the queue up), so the CQ is sized from the
// grant: a first QP tells the grant, and when it exceeds the CQ both are made
// again at the granted size (clamped to the device's max_cqe; the send queue
// never uses more than the CQ holds).
absl::Status CreateQp(const SetupContext& ctx, Peer& peer, QueuePair& qp) {
  VerbsApi& verbs = *ctx.verbs;
  const uint32_t wanted = std::min(4 * peer.depth, ctx.max_qp_wr);
  if (peer.depth > ctx.max_qp_wr) {
    return absl::InvalidArgumentError(
        absl::StrCat("rdma.recv_depth=", peer.depth, " (STEPMESH_RDMA_RECV_DEPTH) exceeds ",
                     ctx.port->device_name, "'s max_qp_wr of ", ctx.max_qp_wr));
  }
  for (uint32_t inline_bytes : kInlineTries) {
    uint32_t request = wanted;
    uint32_t cq_entries = std::min(request, ctx.max_cqe);
    for (int attempt = 0; attempt < 2; ++attempt) {
      qp.qp.Reset();
      qp.send_cq = CqHandle(
          &verbs,
          verbs.CreateCq(ctx.port->context.get(), static_cast<int>(cq_entries), &peer, nullptr, 0));
      if (!qp.send_cq) return absl::InternalError(ErrnoMessage("rdma: ibv_create_cq", errno));
      ibv_qp_init_attr attr{};
      attr.qp_context = &peer;
      attr.send_cq = qp.send_cq.get();
      attr.recv_cq = peer.recv_cq.get();
      attr.qp_type = IBV_QPT_RC;
      attr.cap.max_send_wr = request;
      attr.cap.max_recv_wr = peer.depth;
      attr.cap.max_send_sge = 1;
      attr.cap.max_recv_sge = 1;
      attr.cap.max_inline_data = inline_bytes;
      qp.qp = QpHandle(&verbs, verbs.CreateQp(ctx.pd, &attr));
      if (!qp.qp) break;  // try a smaller inline cap
      // What the provider granted (written back into attr.cap) is what the
      // send path trusts.
      const uint32_t granted = attr.cap.max_send_wr;
      qp.max_inline = attr.cap.max_inline_data;
      if (granted <= cq_entries || cq_entries >= ctx.max_cqe || attempt == 1) {
        qp.sq.Init(&verbs, qp.qp.get(), qp.send_cq.get(), granted, cq_entries);
        return absl::OkStatus();
      }
      request = std::min(granted, ctx.max_qp_wr);
      cq_entries = std::min(granted, ctx.max_cqe);
    }
    qp.qp.Reset();
    qp.send_cq.Reset();
  }
  return absl::InternalError(ErrnoMessage("rdma: ibv_create_qp", errno));
}

absl::Status ToInit(const SetupContext& ctx, QueuePair& qp) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = ctx.port->pkey_index;  // STEPMESH_RDMA_PKEY's entry, else 0
  attr.port_num = ctx.port->port;
  attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  return Modify(*ctx.verbs, qp, attr,
                IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
}

// Best effort: a QP left to the bond's hash still works, only less evenly.
void PinLagPort(const SetupContext& ctx, Peer& peer, uint32_t q) {
  ibv_qp* qp = peer.qps[q].qp.get();
  const uint8_t want = static_cast<uint8_t>(1 + q % ctx.lag_ports);
  uint8_t configured = 0, active = 0;
  if (const int rc = ctx.verbs->ModifyQpLagPort(qp, want); rc != 0) {
    STEPMESH_LOG(kWarning, "rdma: ", PeerName(peer.id), " QP ", q,
                 " stays on the bond's hash: ", ErrnoMessage("mlx5dv_modify_qp_lag_port", rc));
  } else if (ctx.verbs->QueryQpLagPort(qp, &configured, &active) == 0 && active != want) {
    STEPMESH_LOG(kInfo, "rdma: ", PeerName(peer.id), " QP ", q, " pinned to LAG port ", int{want},
                 " but sends on port ", int{active}, " (a link of the bond is down?)");
  }
}

}  // namespace

size_t ControlBlockBytes(uint32_t num_qps, uint32_t depth) {
  return 2 * RoundUp(num_qps * (size_t{depth} * kRingStride + kMailboxStride), kPageBytes);
}

absl::Status BuildPeer(const SetupContext& ctx, std::mt19937& rng, Peer& peer, rdma::Hello& hello) {
  VerbsApi& verbs = *ctx.verbs;
  const uint32_t q_count = peer.num_qps;
  const size_t ring_bytes = size_t{peer.depth} * kRingStride;
  peer.remote_bytes = RoundUp(q_count * (ring_bytes + kMailboxStride), kPageBytes);
  const size_t local_bytes = RoundUp(q_count * (ring_bytes + kMailboxStride), kPageBytes);
  peer.memory.reset(
      static_cast<std::byte*>(std::aligned_alloc(kPageBytes, peer.remote_bytes + local_bytes)));
  if (peer.memory == nullptr) return absl::ResourceExhaustedError("rdma: control block");
  std::byte* base = peer.memory.get();
  std::memset(base, 0, peer.remote_bytes + local_bytes);
  // Relaxed ordering only when asked for everywhere: the rings are small,
  // and their CQEs are ordered after the data anyway.
  const int ordering = ctx.options->relaxed_ordering == "on" ? IBV_ACCESS_RELAXED_ORDERING : 0;
  peer.remote_mr =
      MrHandle(&verbs, verbs.RegMr(ctx.pd, base, peer.remote_bytes,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | ordering));
  if (peer.remote_mr) {
    peer.local_mr = MrHandle(&verbs, verbs.RegMr(ctx.pd, base + peer.remote_bytes, local_bytes,
                                                 IBV_ACCESS_LOCAL_WRITE | ordering));
  }
  if (!peer.remote_mr || !peer.local_mr) {
    const int error = errno;
    std::string message =
        ErrnoMessage(absl::StrCat("rdma: registering the ", (peer.remote_bytes + local_bytes) >> 10,
                                  " KiB control block for ", PeerName(peer.id)),
                     error);
    if (error == ENOMEM) absl::StrAppend(&message, MemlockAdvice(verbs));
    return absl::ResourceExhaustedError(message);
  }
  // Every receive of every QP, flushed at once if the connection fails.
  const uint32_t recv_entries = q_count * peer.depth + 16;
  if (recv_entries > ctx.max_cqe) {
    return absl::InvalidArgumentError(
        absl::StrCat("rdma.recv_depth=", peer.depth, " (STEPMESH_RDMA_RECV_DEPTH) x ", q_count,
                     " QPs exceeds ", ctx.port->device_name, "'s max_cqe of ", ctx.max_cqe));
  }
  peer.recv_cq =
      CqHandle(&verbs, verbs.CreateCq(ctx.port->context.get(), static_cast<int>(recv_entries),
                                      &peer, ctx.channel, 0));
  if (!peer.recv_cq) return absl::InternalError(ErrnoMessage("rdma: ibv_create_cq", errno));
  std::uniform_int_distribution<uint32_t> psn(0, 0xFFFFFF);
  hello.node = ctx.self;
  hello.num_qps = q_count;
  hello.recv_depth = peer.depth;
  hello.mtu = static_cast<uint8_t>(ctx.port->active_mtu);
  hello.link_layer = ctx.port->link_layer;
  hello.gid_type = static_cast<uint8_t>(ctx.port->gid_type);
  hello.ring_addr = reinterpret_cast<uintptr_t>(base);
  hello.ring_rkey = peer.remote_mr->rkey;
  for (uint32_t q = 0; q < q_count; ++q) {
    QueuePair& qp = peer.qps[q];
    qp.recv_ring = base + q * ring_bytes;
    qp.mailbox = reinterpret_cast<uint64_t*>(base + q_count * ring_bytes + q * kMailboxStride);
    std::byte* local = base + peer.remote_bytes;
    qp.send_ring = local + q * ring_bytes;
    qp.credit_word = reinterpret_cast<uint64_t*>(local + q_count * ring_bytes + q * kMailboxStride);
    STEPMESH_RETURN_IF_ERROR(CreateQp(ctx, peer, qp));
    STEPMESH_RETURN_IF_ERROR(ToInit(ctx, qp));
    for (uint32_t r = 0; r < peer.depth; ++r) STEPMESH_RETURN_IF_ERROR(PostReceive(verbs, qp, q));
    hello.qps[q].qpn = qp.qp->qp_num;
    qp.local_psn = psn(rng);
    hello.qps[q].psn = qp.local_psn;
    std::memcpy(hello.qps[q].gid.data(), ctx.port->gid.raw, 16);
    hello.qps[q].lid = ctx.port->lid;
  }
  peer.arrivals.assign(peer.depth, Arrival{});
  return absl::OkStatus();
}

absl::Status BringUp(const SetupContext& ctx, Peer& peer, const rdma::Hello& theirs) {
  const PortChoice& port = *ctx.port;
  const RdmaOptions& options = *ctx.options;
  if (theirs.link_layer != port.link_layer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rdma: ", PeerName(peer.id), " is on ",
        theirs.link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "Ethernet (RoCE)",
        ", this node on ", port.roce() ? "Ethernet (RoCE)" : "InfiniBand",
        ": both ends need the same link layer"));
  }
  // RoCE v1 and v2 are different packets: a pair that disagrees would only
  // time out after every retry (~8.6 s with the defaults). Say so now.
  if (port.roce() && theirs.gid_type != static_cast<uint8_t>(port.gid_type)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rdma: GID type mismatch: ", PeerName(peer.id), " uses a ",
        GidTypeName(static_cast<ibv_gid_type>(theirs.gid_type)), " GID, this node ",
        port.device_name, " port ", int{port.port}, " GID index ", port.gid_index, " (",
        GidTypeName(port.gid_type),
        "); both ends need the same RoCE version: set STEPMESH_RDMA_GID_INDEX to GIDs of one "
        "type (show_gids) or leave it unset on both"));
  }
  peer.remote_rkey = theirs.ring_rkey;
  const size_t ring_bytes = size_t{peer.depth} * kRingStride;
  ibv_mtu mtu = std::min(port.active_mtu, static_cast<ibv_mtu>(theirs.mtu));
  if (options.path_mtu > 0) mtu = std::min(mtu, MtuFromBytes(options.path_mtu));
  for (uint32_t q = 0; q < peer.num_qps; ++q) {
    QueuePair& qp = peer.qps[q];
    const rdma::QpAddress& them = theirs.qps[q];
    qp.remote_ring = theirs.ring_addr + q * ring_bytes;
    qp.remote_mailbox = theirs.ring_addr + peer.num_qps * ring_bytes + q * kMailboxStride;
    // Fences are zero-length writes to the peer's mailbox: a valid address,
    // and no bytes change.
    qp.sq.SetFenceTarget(qp.remote_mailbox, peer.remote_rkey);
    ibv_qp_attr rtr{};
    rtr.qp_state = IBV_QPS_RTR;
    rtr.path_mtu = mtu;
    rtr.dest_qp_num = them.qpn;
    rtr.rq_psn = them.psn;
    rtr.max_dest_rd_atomic = 1;
    rtr.min_rnr_timer = static_cast<uint8_t>(options.min_rnr_timer);
    ibv_ah_attr& ah = rtr.ah_attr;
    ah.sl = static_cast<uint8_t>(options.service_level);
    ah.port_num = port.port;
    // RoCE routes by IP: always a GRH. InfiniBand routes by LID inside a
    // subnet; a GRH is needed only to cross into another subnet (another
    // 64-bit GID prefix), through a router.
    bool global = port.roce();
    if (!port.roce()) {
      if (them.lid == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "rdma: ", PeerName(peer.id), "'s InfiniBand port has LID 0 (no subnet manager?)"));
      }
      ah.dlid = them.lid;
      global = std::memcmp(them.gid.data(), port.gid.raw, 8) != 0;
    }
    if (global) {
      ah.is_global = 1;
      std::memcpy(ah.grh.dgid.raw, them.gid.data(), 16);
      ah.grh.sgid_index = static_cast<uint8_t>(port.gid_index);
      ah.grh.hop_limit = 64;
      ah.grh.traffic_class = static_cast<uint8_t>(options.traffic_class);
    }
    STEPMESH_RETURN_IF_ERROR(Modify(*ctx.verbs, qp, rtr,
                                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                        IBV_QP_MIN_RNR_TIMER,
                                    "RTR"));
    ibv_qp_attr rts{};
    rts.qp_state = IBV_QPS_RTS;
    rts.timeout = static_cast<uint8_t>(options.ack_timeout);
    rts.retry_cnt = static_cast<uint8_t>(options.retry_count);
    rts.rnr_retry = static_cast<uint8_t>(options.rnr_retry);
    rts.sq_psn = qp.local_psn;
    rts.max_rd_atomic = 1;
    STEPMESH_RETURN_IF_ERROR(Modify(*ctx.verbs, qp, rts,
                                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                        IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
                                    "RTS"));
    if (ctx.lag_ports > 1) PinLagPort(ctx, peer, q);
  }
  return absl::OkStatus();
}

}  // namespace stepmesh::rdma
