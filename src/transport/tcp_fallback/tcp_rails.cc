// Rails, the sending side: how many rails a peer pair uses, a frame cut into
// pieces over them, the frames kept until the peer acknowledges them, acks,
// and a failed rail's pieces sent again on the others (docs/tcp.md, "Rails").

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/ring.h"
#include "src/transport/tcp_fallback/tcp_transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {

// A frame stays kept until acknowledged; each rail's queue then holds at most
// this many pieces of them even when every other rail failed onto it.
constexpr size_t kMaxUnacknowledged = kMaxQueuedFrames / kMaxRails;
// How much of one piece a striped send writes before it turns to the next
// rail (see SendStriped).
constexpr size_t kStripeSlice = 128 << 10;

bool TcpTransport::IsCurrent(const Connection& c) {
  return c.slot->conn == &c || (c.railed && c.slot->rail[c.rail] == &c);
}

int TcpTransport::PrepareRails(const PeerInfo& peer) {
  PeerSlot* slot = SlotOf(peer.id);
  if (slot == nullptr) return 1;
  size_t theirs = 1;
  if (absl::StatusOr<std::vector<std::string>> at = SplitRailEndpoint(peer.endpoint); at.ok()) {
    theirs = at->size();
  }
  const int rails = static_cast<int>(std::min(theirs, std::max<size_t>(1, rail_hosts_.size())));
  std::lock_guard<std::mutex> lock(slot->mu);
  const bool was_railed = slot->rails > 1;
  // A peer that connects again is a new process (or came back): its rails and
  // their numbering start over.
  for (Connection* c : slot->rail) {
    if (c == nullptr) continue;
    c->superseded = true;
    if (c->alive.exchange(false)) Retire(*c);
  }
  if (rails > 1 && slot->conn != nullptr) {
    slot->conn->superseded = true;
    if (slot->conn->alive.exchange(false)) Retire(*slot->conn);
  }
  slot->peer = peer.id;
  slot->rails = rails;
  slot->lost = false;
  slot->said_goodbye = false;
  slot->next_seq = 1;
  for (size_t i = 0; i < slot->sent_count; ++i) slot->sent_at(i) = SentFrame{};
  slot->sent_head = 0;
  slot->sent_count = 0;
  slot->peer_acked.store(0, std::memory_order_relaxed);
  slot->delivered.store(0, std::memory_order_relaxed);
  slot->ack_sent = 0;
  slot->generation.fetch_add(1, std::memory_order_relaxed);
  if (rails > 1 && slot->sent.empty()) slot->sent.resize(kInitialQueueFrames);
  if (rails > 1 && !was_railed) railed_peers_.fetch_add(1, std::memory_order_relaxed);
  if (rails <= 1 && was_railed) railed_peers_.fetch_sub(1, std::memory_order_relaxed);
  return rails;
}

int TcpTransport::LiveRails(const PeerSlot& slot, int* live) {
  int n = 0;
  for (int r = 0; r < slot.rails; ++r) {
    const Connection* c = slot.rail[r];
    if (c != nullptr && c->alive.load(std::memory_order_relaxed) && c->broken.ok()) live[n++] = r;
  }
  return n;
}

void TcpTransport::ReleaseAcked(PeerSlot& slot) {
  const uint64_t acked = slot.peer_acked.load(std::memory_order_acquire);
  while (slot.sent_count > 0 && slot.sent_at(0).seq <= acked) {
    SentFrame& f = slot.sent_at(0);
    f.payload = nullptr;
    f.copy.clear();
    slot.sent_head = (slot.sent_head + 1) % slot.sent.size();
    --slot.sent_count;
  }
}

absl::Status TcpTransport::SendRails(PeerSlot& slot, const FrameHeader& header, const void* src,
                                     RegionId region, size_t bytes) {
  int live[kMaxRails];
  const int n = LiveRails(slot, live);
  if (n == 0) {
    return absl::UnavailableError(
        absl::StrCat("tcp: every rail to ", PeerName(header.dst), " is closed"));
  }
  ReleaseAcked(slot);
  if (slot.sent_count == kMaxUnacknowledged) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tcp: ", PeerName(header.dst), " has not acknowledged ", kMaxUnacknowledged,
                     " frames sent over its rails (it does not read them)"));
  }
  if (slot.sent_count == slot.sent.size()) {
    base::GrowRing(slot.sent, slot.sent_head, slot.sent_count, kInitialQueueFrames,
                   kMaxUnacknowledged);
  }
  SentFrame& f = slot.sent_at(slot.sent_count);
  f.seq = slot.next_seq;
  f.header = EncodeFrame(header);
  f.bytes = bytes;
  f.region = region;
  if (region == 0 && bytes > 0) {
    const auto* from = static_cast<const std::byte*>(src);
    f.copy.assign(from, from + bytes);  // error texts: small, rare
    f.payload = f.copy.data();
  } else {
    f.copy.clear();
    f.payload = static_cast<const std::byte*>(src);
  }
  f.stripes = CutPayload(bytes, static_cast<size_t>(n), stripe_min_bytes_);
  ++slot.sent_count;
  ++slot.next_seq;
  // Small frames go whole on the first rail up; a striped one's pieces on
  // one rail each, side by side. A piece whose rail fails here is sent
  // again on the others when the receive thread takes that rail down.
  for (uint8_t p = 0; p < f.stripes.pieces; ++p) f.rail_of[p] = static_cast<uint8_t>(live[p]);
  absl::Status sent =
      f.stripes.pieces == 1 ? SendPiece(slot, f, 0, *slot.rail[live[0]]) : SendStriped(slot, f);
  if (absl::IsResourceExhausted(sent)) return sent;
  if (LiveRails(slot, live) == 0) {
    return absl::UnavailableError(
        absl::StrCat("tcp: sending to ", PeerName(header.dst), ": every rail failed"));
  }
  return absl::OkStatus();
}

namespace {

// Piece `piece` of `f` as it goes on its rail: the rail header (and for
// piece 0 the frame's header), then `bytes` payload bytes from `payload`.
struct PieceOut {
  std::array<std::byte, kMaxPrefixBytes> prefix;
  size_t prefix_bytes = 0;
  const std::byte* payload = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // of prefix and payload together
  Connection* conn = nullptr;
  bool handed_off = false;  // written whole, queued, or its rail failed
};

void PreparePiece(PeerSlot& slot, const SentFrame& f, uint8_t piece, PieceOut& out) {
  RailHeader h;
  h.kind = piece == 0 ? RailKind::kHead : RailKind::kChunk;
  h.piece = piece;
  h.pieces = f.stripes.pieces;
  h.seq = f.seq;
  h.offset = static_cast<uint64_t>(piece) * f.stripes.piece_bytes;
  h.length = std::min<uint64_t>(f.stripes.piece_bytes, f.bytes - h.offset);
  h.ack = slot.delivered.load(std::memory_order_acquire);
  slot.ack_sent = std::max(slot.ack_sent, h.ack);
  EncodeRailHeader(h, out.prefix.data());
  out.prefix_bytes = kRailHeaderBytes;
  if (piece == 0) {
    std::copy(f.header.begin(), f.header.end(), out.prefix.begin() + kRailHeaderBytes);
    out.prefix_bytes += kFrameBytes;
  }
  out.payload = f.payload + h.offset;
  out.bytes = h.length;
  out.sent = 0;
}

}  // namespace

absl::Status TcpTransport::SendPiece(PeerSlot& slot, const SentFrame& f, uint8_t piece,
                                     Connection& conn) {
  PieceOut out;
  PreparePiece(slot, f, piece, out);
  return WriteOrQueue(conn, out.prefix.data(), out.prefix_bytes, out.payload, out.bytes, f.region,
                      /*copy=*/false);
}

absl::Status TcpTransport::SendStriped(PeerSlot& slot, const SentFrame& f) {
  // One write per piece would leave rail 1 idle until rail 0's whole piece
  // is written: a large send() on a rate-limited link takes about as long as
  // the wire (the kernel forwards on the sending CPU what it takes in), so
  // the pieces would cross one after the other. Written kStripeSlice at a
  // time, rail after rail, every rail is busy from the first slice on.
  PieceOut out[kMaxRails];
  for (uint8_t p = 0; p < f.stripes.pieces; ++p) {
    PreparePiece(slot, f, p, out[p]);
    out[p].conn = slot.rail[f.rail_of[p]];
  }
  absl::Status result;
  for (size_t left = f.stripes.pieces; left > 0;) {
    for (uint8_t p = 0; p < f.stripes.pieces; ++p) {
      PieceOut& o = out[p];
      if (o.handed_off) continue;
      Connection& c = *o.conn;
      const size_t total = o.prefix_bytes + o.bytes;
      const size_t want = std::min(kStripeSlice, total - o.sent);
      size_t wrote = 0;
      absl::Status written;
      if (c.queued == 0) {
        iovec iov[2];
        int iovcnt = 0;
        size_t from = o.sent, room = want;
        if (from < o.prefix_bytes) {
          const size_t n = std::min(room, o.prefix_bytes - from);
          iov[iovcnt++] = {o.prefix.data() + from, n};
          room -= n;
          from = o.prefix_bytes;
        }
        if (room > 0) {
          iov[iovcnt++] = {const_cast<std::byte*>(o.payload) + (from - o.prefix_bytes), room};
        }
        written = WriteSome(c, iov, iovcnt, &wrote);
        o.sent += wrote;
      }
      if (!written.ok() || o.sent == total || wrote < want) {
        // Done, failed (the rail goes down and its pieces go again), or its
        // socket is full (or was backlogged): the rest waits in its queue.
        o.handed_off = true;
        --left;
        const size_t payload_out = o.sent > o.prefix_bytes ? o.sent - o.prefix_bytes : 0;
        c.payload_sent += payload_out;
        if (!written.ok() || o.sent == total) continue;
        const std::byte* prefix = o.prefix.data() + std::min(o.sent, o.prefix_bytes);
        absl::Status queued =
            WriteOrQueue(c, prefix, o.prefix_bytes - std::min(o.sent, o.prefix_bytes),
                         o.payload + payload_out, o.bytes - payload_out, f.region, /*copy=*/false);
        if (absl::IsResourceExhausted(queued)) result = queued;
      }
    }
  }
  return result;
}

void TcpTransport::SendAck(PeerSlot& slot) {
  int live[kMaxRails];
  const int n = LiveRails(slot, live);
  for (int i = 0; i < n; ++i) {
    Connection& c = *slot.rail[live[i]];
    if (c.queued >= kMaxQueuedFrames / 2) continue;  // a later message carries it
    RailHeader h;
    h.kind = RailKind::kAck;
    h.ack = slot.delivered.load(std::memory_order_acquire);
    std::array<std::byte, kRailHeaderBytes> bytes;
    EncodeRailHeader(h, bytes.data());
    if (WriteOrQueue(c, bytes.data(), bytes.size(), nullptr, 0, 0, false).ok()) {
      slot.ack_sent = std::max(slot.ack_sent, h.ack);
      return;
    }
  }
}

bool TcpTransport::RailDown(PeerSlot& slot, Connection& conn, const absl::Status& why) {
  int live[kMaxRails];
  const int n = LiveRails(slot, live);
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.push_back(absl::StrCat(live[i]));
  if (conn.said_goodbye || slot.said_goodbye) {
    STEPMESH_LOG(kInfo, "tcp: rail ", conn.rail, " to ", PeerName(conn.peer), " (", conn.address,
                 ") closed after its goodbye");
    return n > 0;
  }
  if (n == 0) {
    STEPMESH_LOG(kWarning, "tcp: rail ", conn.rail, " to ", PeerName(conn.peer), " (", conn.address,
                 ") is down (", why.message(), "), and it was the last");
    return false;
  }
  ReleaseAcked(slot);
  size_t resent = 0;
  size_t next = 0;
  for (size_t i = 0; i < slot.sent_count; ++i) {
    SentFrame& f = slot.sent_at(i);
    for (uint8_t p = 0; p < f.stripes.pieces; ++p) {
      if (f.rail_of[p] != conn.rail) continue;
      if (f.payload == nullptr && f.bytes > 0) {
        STEPMESH_LOG(kWarning, "tcp: rail ", conn.rail, " to ", PeerName(conn.peer), " (",
                     conn.address, ") is down (", why.message(), "); frame ", f.seq,
                     " it carried cannot be sent again (its region is unregistered)");
        return false;
      }
      const int to = live[next++ % static_cast<size_t>(n)];
      f.rail_of[p] = static_cast<uint8_t>(to);
      (void)SendPiece(slot, f, p, *slot.rail[to]);  // a failure: that rail goes down next
      ++resent;
    }
  }
  STEPMESH_LOG(kWarning, "tcp: rail ", conn.rail, " to ", PeerName(conn.peer), " (", conn.address,
               ") is down (", why.message(), "); ", resent,
               " unacknowledged piece(s) sent again, traffic continues on rail(s) ",
               absl::StrJoin(names, ", "));
  return true;
}

void TcpTransport::LosePeer(PeerSlot& slot, TransportSink& sink, absl::Status why) {
  const NodeId peer = slot.peer;
  {
    std::lock_guard<std::mutex> lock(slot.mu);
    for (Connection* c : slot.rail) {
      if (c != nullptr && c->alive.exchange(false)) Retire(*c);
    }
    if (slot.lost) return;
    slot.lost = true;
  }
  sink.OnPeerLost(peer, std::move(why));
}

void TcpTransport::RailHousekeeping(absl::Time now) {
  for (auto* slots : {&worker_slots_, &server_slots_}) {
    for (PeerSlot& slot : *slots) {
      if (slot.rails < 2) continue;
      Connection* waited[kMaxRails] = {};
      {
        std::lock_guard<std::mutex> lock(slot.mu);
        for (int r = 0; r < slot.rails; ++r) {
          Connection* c = slot.rail[r];
          if (c != nullptr && c->blocked && now - c->blocked_since > kParkAfter) waited[r] = c;
        }
        if (slot.delivered.load(std::memory_order_relaxed) > slot.ack_sent) SendAck(slot);
      }
      for (Connection* c : waited) {
        if (c != nullptr) ReadAhead(*c);
      }
    }
  }
}

}  // namespace stepmesh::tcp::internal
