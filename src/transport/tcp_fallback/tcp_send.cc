#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/ring.h"
#include "src/base/sync.h"
#include "src/transport/tcp_fallback/tcp_transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {

absl::Status TcpTransport::UnregisterRegion(RegionId id) {
  // Frames still queued read their payload from the region when the socket
  // drains: it must stay until they are out.
  for (auto* slots : {&worker_slots_, &server_slots_}) {
    for (PeerSlot& slot : *slots) {
      std::lock_guard<std::mutex> lock(slot.mu);
      for (Connection* c : {slot.conn, slot.rail[0], slot.rail[1], slot.rail[2], slot.rail[3]}) {
        if (c == nullptr) continue;
        for (size_t i = 0; i < c->queued; ++i) {
          if (c->at(i).region == id) {
            return absl::FailedPreconditionError(
                absl::StrCat("region ", id, " still has frames queued to ", PeerName(c->peer),
                             " (slow to read); try again"));
          }
        }
      }
    }
  }
  // Written but not yet acknowledged over rails: out, so kept only to be sent
  // again should their rail fail; the region goes, and such a frame can no
  // longer be re-sent (the peer is then lost, see ResendRail).
  for (auto* slots : {&worker_slots_, &server_slots_}) {
    for (PeerSlot& slot : *slots) {
      std::lock_guard<std::mutex> lock(slot.mu);
      for (size_t i = 0; i < slot.sent_count; ++i) {
        if (slot.sent_at(i).region == id) slot.sent_at(i).payload = nullptr;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::Send(NodeId peer, const FrameHeader& header, const void* src,
                                RegionId region, size_t bytes) {
  PeerSlot* slot = SlotOf(peer);
  if (slot == nullptr) {
    return absl::NotFoundError(absl::StrCat("tcp: no connection to ", PeerName(peer)));
  }
  std::lock_guard<std::mutex> lock(slot->mu);
  if (slot->rails > 1) return SendRails(*slot, header, src, region, bytes);
  Connection* c = slot->conn;
  if (c == nullptr || !c->alive.load(std::memory_order_relaxed) || !c->broken.ok()) {
    return absl::UnavailableError(
        absl::StrCat("tcp: the connection to ", PeerName(peer), " is closed"));
  }
  FrameBytes frame = EncodeFrame(header);
  return WriteOrQueue(*c, frame.data(), frame.size(), static_cast<const std::byte*>(src), bytes,
                      region, /*copy=*/region == 0 && bytes > 0);
}

absl::Status TcpTransport::WriteOrQueue(Connection& c, const std::byte* prefix, size_t prefix_bytes,
                                        const std::byte* payload, size_t bytes, RegionId region,
                                        bool copy) {
  size_t sent = 0;
  if (c.queued == 0) {
    // Nothing waiting: write now. A socket with room takes the whole frame
    // (the usual case, no queueing at all); what it does not take waits in
    // the queue for writability, so this thread moves on to other peers.
    iovec iov[2] = {{const_cast<std::byte*>(prefix), prefix_bytes},
                    {const_cast<std::byte*>(payload), bytes}};
    absl::Status written = WriteSome(c, iov, bytes > 0 ? 2 : 1, &sent);
    if (!written.ok()) return written;
    if (sent == prefix_bytes + bytes) {
      c.payload_sent += bytes;
      return absl::OkStatus();
    }
  }
  if (c.queued == kMaxQueuedFrames) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tcp: the send queue to ", PeerName(c.peer), " is full (", kMaxQueuedFrames,
        " frames waiting: it has not read its socket for ",
        absl::FormatDuration(absl::Trunc(absl::Now() - c.last_progress, absl::Milliseconds(1))),
        ")"));
  }
  if (c.queued == c.ring.size()) Grow(c);
  OutFrame& out = c.at(c.queued);
  std::copy(prefix, prefix + prefix_bytes, out.prefix.begin());
  out.prefix_bytes = prefix_bytes;
  out.sent = sent;
  out.bytes = bytes;
  out.region = region;
  if (copy) {
    out.copy.assign(reinterpret_cast<const char*>(payload), bytes);  // error texts: small, rare
    out.payload = reinterpret_cast<const std::byte*>(out.copy.data());
  } else {
    out.payload = payload;
  }
  if (c.queued++ == 0) {
    c.last_progress = absl::Now();
    ArmWritable(c, true);
    backlogged_.fetch_add(1, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::Status TcpTransport::WriteSome(Connection& c, iovec* iov, int iovcnt, size_t* sent) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    // The kernel reads registered memory here, and the application rewrites
    // it once the peer has answered: in TSan builds the connection carries
    // this thread's past and the kernel's read to whoever receives from it
    // (src/base/tsan.h). Nothing is suppressed in these functions.
    const ssize_t n = c.causality.SendMsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
      c.broken = absl::UnavailableError(base::ErrnoMessage("send", errno));
      attention_.store(true, std::memory_order_release);
      Wake();
      return absl::UnavailableError(
          absl::StrCat("tcp: sending to ", PeerName(c.peer), ": ", c.broken.message()));
    }
    *sent += static_cast<size_t>(n);
    base::SkipWritten(static_cast<size_t>(n), &iov, &iovcnt);
  }
  return absl::OkStatus();
}

void TcpTransport::DrainQueue(Connection& c) {
  while (c.queued > 0 && c.broken.ok()) {
    OutFrame& f = c.at(0);
    iovec iov[2];
    int iovcnt = 0;
    if (f.sent < f.prefix_bytes) {
      iov[iovcnt++] = {f.prefix.data() + f.sent, f.prefix_bytes - f.sent};
      if (f.bytes > 0) iov[iovcnt++] = {const_cast<std::byte*>(f.payload), f.bytes};
    } else {
      iov[iovcnt++] = {const_cast<std::byte*>(f.payload) + (f.sent - f.prefix_bytes),
                       f.prefix_bytes + f.bytes - f.sent};
    }
    const size_t before = f.sent;
    if (!WriteSome(c, iov, iovcnt, &f.sent).ok()) return;
    if (f.sent != before) c.last_progress = absl::Now();
    if (f.sent < f.prefix_bytes + f.bytes) return;  // the socket is full again
    c.payload_sent += f.bytes;
    f.copy.clear();
    f.payload = nullptr;
    c.head = (c.head + 1) % c.ring.size();
    --c.queued;
  }
  if (c.queued == 0 && c.out_armed) {
    ArmWritable(c, false);
    backlogged_.fetch_sub(1, std::memory_order_relaxed);
  }
}

void TcpTransport::Flush(Connection& conn, TransportSink& sink) {
  {
    std::lock_guard<std::mutex> lock(conn.slot->mu);
    if (!IsCurrent(conn)) return;
    DrainQueue(conn);
    if (conn.broken.ok()) return;
  }
  LoseBroken(sink);
}

void TcpTransport::ArmWritable(Connection& c, bool on) {
  // A rail that waits for another is not read (see kParkAfter).
  (void)loop_.Modify(
      c.fd.get(),
      (c.blocked ? 0u : uint32_t{EPOLLIN | EPOLLRDHUP}) | (on ? uint32_t{EPOLLOUT} : 0u),
      base::EventLoop::TokenOf(&c));
  c.out_armed = on;
}

void TcpTransport::Grow(Connection& c) {
  base::GrowRing(c.ring, c.head, c.queued, kInitialQueueFrames, kMaxQueuedFrames);
  for (size_t i = 0; i < c.queued; ++i) {
    // A short copy lives inside the string: it moved with it.
    if (!c.ring[i].copy.empty()) {
      c.ring[i].payload = reinterpret_cast<const std::byte*>(c.ring[i].copy.data());
    }
  }
}

}  // namespace stepmesh::tcp::internal
