// Rails, the receiving side: each rail's messages read straight into the
// frame's destination (a piece at its offset), frames delivered in their
// order whatever rail their pieces came on, re-sent copies dropped, and a
// rail whose message is not the next one's waiting (unread) until its turn
// -- or reading ahead into memory once it waited kParkAfter (docs/tcp.md).

#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/transport/tcp_fallback/tcp_transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {
namespace {

void ResetReceive(PeerSlot& slot, uint32_t generation) {
  slot.rx_generation = generation;
  slot.next_deliver = 1;
  slot.resolved = false;
  slot.dest = nullptr;
  slot.context = nullptr;
  slot.pieces = 1;
  slot.pieces_got = 0;
  slot.parked.clear();
  slot.parked_bytes = 0;
}

}  // namespace

void TcpTransport::ReadRails(Connection& conn, TransportSink& sink) {
  PeerSlot& slot = *conn.slot;
  if (conn.generation != slot.rx_generation) ResetReceive(slot, conn.generation);
  for (int rounds = 0; rounds < 64 && conn.alive && !conn.blocked; ++rounds) {
    if (conn.rail_stage == Connection::RailStage::kRoute) {
      if (!RouteBody(conn, sink)) return;
      continue;
    }
    void* into = nullptr;
    size_t want = 0;
    std::byte scratch[64 * 1024];
    switch (conn.rail_stage) {
      case Connection::RailStage::kRailHeader:
        into = conn.rail_bytes.data() + conn.rail_got;
        want = kRailHeaderBytes - conn.rail_got;
        break;
      case Connection::RailStage::kFrameHeader:
        into = conn.header_bytes.data() + conn.header_got;
        want = kFrameBytes - conn.header_got;
        break;
      case Connection::RailStage::kBody:
        want = conn.msg.length - conn.body_got;
        if (conn.body == Connection::Body::kPlace) {
          into = conn.into + conn.body_got;
        } else if (conn.body == Connection::Body::kPark) {
          into = conn.parking.body.data() + conn.body_got;
        } else {
          into = scratch;
          want = std::min(want, sizeof(scratch));
        }
        break;
      case Connection::RailStage::kRoute:
        break;
    }
    const ssize_t n = ::recv(conn.fd.get(), into, want, MSG_DONTWAIT);
    if (n >= 0) conn.causality.Acquire();  // as in ReadFrom
    if (n == 0) {
      Lose(conn, sink,
           conn.said_goodbye ? absl::CancelledError("left")
                             : absl::UnavailableError(
                                   absl::StrCat("closed its connection (rail ", conn.rail, ")")));
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        SetRailLowWater(conn);
        return;
      }
      Lose(conn, sink,
           absl::UnavailableError(
               absl::StrCat(base::ErrnoMessage("recv", errno), " (rail ", conn.rail, ")")));
      return;
    }
    const auto got = static_cast<size_t>(n);
    switch (conn.rail_stage) {
      case Connection::RailStage::kRailHeader: {
        conn.rail_got += got;
        if (conn.rail_got < kRailHeaderBytes) break;
        conn.rail_got = 0;
        absl::StatusOr<RailHeader> msg = DecodeRailHeader(conn.rail_bytes);
        if (!msg.ok()) return RailViolation(conn, sink, msg.status());
        conn.msg = *msg;
        if (msg->ack > slot.peer_acked.load(std::memory_order_relaxed)) {
          slot.peer_acked.store(msg->ack, std::memory_order_release);
        }
        switch (msg->kind) {
          case RailKind::kAck:
            break;
          case RailKind::kGoodbye:
            conn.said_goodbye = true;
            slot.said_goodbye = true;
            break;
          case RailKind::kHead:
            conn.rail_stage = Connection::RailStage::kFrameHeader;
            break;
          case RailKind::kChunk:
            conn.rail_stage = Connection::RailStage::kRoute;
            break;
        }
        break;
      }
      case Connection::RailStage::kFrameHeader: {
        conn.header_got += got;
        if (conn.header_got < kFrameBytes) break;
        conn.header_got = 0;
        absl::StatusOr<FrameHeader> header = DecodeFrame(conn.header_bytes);
        if (!header.ok()) {
          return RailViolation(conn, sink,
                               absl::DataLossError(absl::StrCat("malformed frame (",
                                                                header.status().message(), ")")));
        }
        conn.msg_frame = *header;
        conn.rail_stage = Connection::RailStage::kRoute;
        break;
      }
      case Connection::RailStage::kBody:
        if (conn.body == Connection::Body::kErrorText) {
          slot.error_text.append(reinterpret_cast<const char*>(scratch), got);
        }
        conn.body_got += got;
        if (conn.body_got == conn.msg.length) BodyDone(conn, sink);
        break;
      case Connection::RailStage::kRoute:
        break;
    }
  }
  if (conn.alive && !conn.blocked) SetRailLowWater(conn);
}

bool TcpTransport::RouteBody(Connection& conn, TransportSink& sink) {
  PeerSlot& slot = *conn.slot;
  std::byte* into = nullptr;
  absl::StatusOr<Fate> fate = Route(slot, conn.msg, &conn.msg_frame, sink, &conn.counts, &into);
  if (!fate.ok()) {
    RailViolation(conn, sink, fate.status());
    return false;
  }
  conn.body_got = 0;
  conn.into = into;
  switch (*fate) {
    case Fate::kPlace:
      conn.body = Connection::Body::kPlace;
      break;
    case Fate::kDiscard:
      conn.body = Connection::Body::kDiscard;
      break;
    case Fate::kErrorText:
      conn.body = Connection::Body::kErrorText;
      break;
    case Fate::kWait:
      if (!conn.read_ahead) {
        Block(conn);
        return false;
      }
      if (slot.parked_bytes + conn.msg.length > kMaxParkedBytes) {
        LosePeer(slot, sink,
                 absl::ResourceExhaustedError(absl::StrCat(
                     "its rails are ", kMaxParkedBytes, " bytes ahead of frame ", slot.next_deliver,
                     ", which does not arrive (rail ", conn.rail, ")")));
        return false;
      }
      // Read ahead (a rail failed and its pieces came again behind later
      // ones): kept in memory until its turn. Only then, never in steady state.
      conn.body = Connection::Body::kPark;
      conn.parking.msg = conn.msg;
      conn.parking.frame = conn.msg_frame;
      conn.parking.body.resize(conn.msg.length);
      break;
  }
  conn.rail_stage = Connection::RailStage::kBody;
  if (conn.msg.length == 0) BodyDone(conn, sink);
  return conn.alive.load(std::memory_order_relaxed);
}

absl::StatusOr<TcpTransport::Fate> TcpTransport::Route(PeerSlot& slot, const RailHeader& msg,
                                                       const FrameHeader* head, TransportSink& sink,
                                                       bool* counts, std::byte** into) {
  *counts = false;
  if (msg.seq < slot.next_deliver) return Fate::kDiscard;  // delivered: a copy sent again
  if (msg.seq > slot.next_deliver) return Fate::kWait;
  if (msg.kind == RailKind::kHead && !slot.resolved) {
    const NodeId self = self_.load(std::memory_order_relaxed);
    const NodeId peer = slot.peer;
    if (head->src != peer) {
      return absl::PermissionDeniedError(
          absl::StrCat("a frame claims to come from node 0x", absl::Hex(head->src)));
    }
    if (head->dst != self) {
      return absl::PermissionDeniedError(
          absl::StrCat("a frame is addressed to node 0x", absl::Hex(head->dst),
                       ", not to this node (0x", absl::Hex(self), ")"));
    }
    slot.header = *head;
    slot.pieces = msg.pieces;
    slot.pieces_got = 0;
    slot.dest = nullptr;
    slot.context = nullptr;
    slot.rejection = absl::OkStatus();
    slot.error_text.clear();
    switch (head->type) {
      case FrameType::kPush:
      case FrameType::kReply: {
        Destination dest;
        absl::Status resolved = sink.Resolve(peer, slot.header, dest, &slot.context);
        if (resolved.ok() && dest.capacity < head->payload_bytes) {
          resolved = absl::OutOfRangeError("destination smaller than payload");
        }
        if (resolved.ok()) {
          slot.dest = dest.data;
        } else {
          slot.rejection = std::move(resolved);
        }
        break;
      }
      case FrameType::kError:
        if (head->payload_bytes > kMaxErrorTextBytes || msg.pieces != 1) {
          return absl::DataLossError("oversized error frame");
        }
        break;
      default:
        if (head->payload_bytes > 0) {
          return absl::DataLossError(absl::StrCat("a frame of type ", static_cast<int>(head->type),
                                                  " with ", head->payload_bytes,
                                                  " payload bytes (it carries none)"));
        }
        break;
    }
    slot.resolved = true;
    // A rail that read a chunk of this frame before its head may go on.
    WakeWaiting(slot);
  } else if (!slot.resolved) {
    return Fate::kWait;  // a chunk before its head
  }
  if (msg.pieces != slot.pieces || msg.offset + msg.length > slot.header.payload_bytes ||
      (msg.piece + 1 == msg.pieces && msg.offset + msg.length != slot.header.payload_bytes)) {
    return absl::DataLossError(absl::StrCat(
        "piece ", msg.piece, " of ", msg.pieces, " (", msg.length, " bytes at ", msg.offset,
        ") does not fit frame ", msg.seq, " of ", slot.header.payload_bytes, " bytes"));
  }
  if (slot.pieces_got & (1u << msg.piece)) return Fate::kDiscard;  // a copy sent again
  *counts = true;
  if (slot.header.type == FrameType::kError) return Fate::kErrorText;
  if (slot.dest == nullptr) return Fate::kDiscard;  // rejected (or carries nothing)
  *into = slot.dest + msg.offset;
  return Fate::kPlace;
}

void TcpTransport::BodyDone(Connection& conn, TransportSink& sink) {
  conn.rail_stage = Connection::RailStage::kRailHeader;
  PeerSlot& slot = *conn.slot;
  if (conn.body == Connection::Body::kPark) {
    slot.parked_bytes += conn.parking.body.size();
    slot.parked.push_back(std::move(conn.parking));
    conn.parking = Parked{};
    return;
  }
  if (conn.counts) CompletePiece(slot, conn.msg.piece, sink);
}

void TcpTransport::CompletePiece(PeerSlot& slot, uint8_t piece, TransportSink& sink) {
  slot.pieces_got |= static_cast<uint8_t>(1u << piece);
  const uint64_t before = slot.next_deliver;
  (void)DeliverIfComplete(slot, sink);
  // What was read ahead for this frame (a chunk before its head) or the next.
  DrainParked(slot, sink);
  // Rails that waited for the next frame may go on.
  if (slot.next_deliver != before) WakeWaiting(slot);
}

void TcpTransport::WakeWaiting(PeerSlot& slot) {
  for (Connection* c : slot.rail) {
    if (c != nullptr && c->blocked) Unblock(*c);
  }
}

bool TcpTransport::DeliverIfComplete(PeerSlot& slot, TransportSink& sink) {
  if (slot.pieces_got != (1u << slot.pieces) - 1) return false;
  const NodeId peer = slot.header.src;
  slot.resolved = false;
  ++slot.next_deliver;
  slot.delivered.store(slot.next_deliver - 1, std::memory_order_release);
  switch (slot.header.type) {
    case FrameType::kPush:
    case FrameType::kReply:
      sink.OnFrame(peer, slot.header, std::exchange(slot.context, nullptr),
                   slot.dest != nullptr ? absl::OkStatus() : slot.rejection);
      break;
    case FrameType::kError:
      sink.OnFrame(
          peer, slot.header, nullptr,
          absl::Status(static_cast<absl::StatusCode>(slot.header.status_code), slot.error_text));
      break;
    default:
      break;  // heartbeats need no delivery
  }
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.delivered.load(std::memory_order_relaxed) >= slot.ack_sent + kAckEvery) SendAck(slot);
  return true;
}

void TcpTransport::DrainParked(PeerSlot& slot, TransportSink& sink) {
  if (slot.parked.empty()) return;
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (size_t i = 0; i < slot.parked.size(); ++i) {
      if (slot.parked[i].msg.seq > slot.next_deliver) continue;
      bool counts = false;
      std::byte* into = nullptr;
      absl::StatusOr<Fate> fate =
          Route(slot, slot.parked[i].msg, &slot.parked[i].frame, sink, &counts, &into);
      if (!fate.ok()) {
        LosePeer(slot, sink, fate.status());
        return;
      }
      if (*fate == Fate::kWait) continue;
      Parked p = std::move(slot.parked[i]);
      slot.parked.erase(slot.parked.begin() + static_cast<ptrdiff_t>(i));
      slot.parked_bytes -= p.body.size();
      if (*fate == Fate::kPlace && !p.body.empty()) {
        std::memcpy(into, p.body.data(), p.body.size());
      }
      if (*fate == Fate::kErrorText) {
        slot.error_text.append(reinterpret_cast<const char*>(p.body.data()), p.body.size());
      }
      if (counts) {
        slot.pieces_got |= static_cast<uint8_t>(1u << p.msg.piece);
        (void)DeliverIfComplete(slot, sink);
      }
      progressed = true;
      break;
    }
  }
  if (slot.parked.empty()) {
    // Caught up: the rails wait their turn again rather than copy.
    for (Connection* c : slot.rail) {
      if (c != nullptr) c->read_ahead = false;
    }
  }
}

void TcpTransport::Block(Connection& conn) {
  std::lock_guard<std::mutex> lock(conn.slot->mu);
  conn.blocked = true;
  conn.blocked_since = absl::Now();
  blocked_count_.fetch_add(1, std::memory_order_relaxed);
  ArmWritable(conn, conn.out_armed);
}

void TcpTransport::Unblock(Connection& conn) {
  {
    std::lock_guard<std::mutex> lock(conn.slot->mu);
    if (!conn.blocked) return;
    conn.blocked = false;
    blocked_count_.fetch_sub(1, std::memory_order_relaxed);
    if (conn.alive.load(std::memory_order_relaxed)) ArmWritable(conn, conn.out_armed);
  }
  // The message it read the header of is routed again at the next Poll (its
  // body may already be in the socket, below the low water mark).
  if (std::find(runnable_.begin(), runnable_.end(), &conn) == runnable_.end()) {
    runnable_.push_back(&conn);
  }
}

void TcpTransport::ReadAhead(Connection& conn) {
  if (!conn.read_ahead) {
    STEPMESH_LOG(kInfo, "tcp: rail ", conn.rail, " from ", PeerName(conn.peer),
                 " waited for another rail ", absl::FormatDuration(kParkAfter),
                 "; reading ahead into memory");
  }
  conn.read_ahead = true;
  Unblock(conn);
}

void TcpTransport::RunUnblocked(TransportSink& sink) {
  // Reading one rail may wake another; bounded, the rest waits for the next Poll.
  for (int i = 0; i < 64 && !runnable_.empty(); ++i) {
    Connection* c = runnable_.front();
    runnable_.erase(runnable_.begin());
    if (c->alive.load(std::memory_order_acquire) && !c->blocked) ReadRails(*c, sink);
  }
  if (!runnable_.empty()) Wake();
}

void TcpTransport::SetRailLowWater(Connection& conn) {
  size_t want = 1;
  switch (conn.rail_stage) {
    case Connection::RailStage::kRailHeader:
      want = kRailHeaderBytes - conn.rail_got;
      break;
    case Connection::RailStage::kFrameHeader:
      want = kFrameBytes - conn.header_got;
      break;
    case Connection::RailStage::kBody:
      want = conn.msg.length - conn.body_got;
      break;
    case Connection::RailStage::kRoute:
      break;
  }
  AskLowWater(conn, want);
}

void TcpTransport::RailViolation(Connection& conn, TransportSink& sink, absl::Status why) {
  STEPMESH_LOG_LIMITED(violations_, kWarning, "tcp: ", PeerName(conn.peer), " (", conn.address,
                       ", rail ", conn.rail, ") broke the protocol: ", why.message(),
                       "; closing its rails");
  LosePeer(*conn.slot, sink, std::move(why));
}

}  // namespace stepmesh::tcp::internal
