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
#include "src/base/sync.h"
#include "src/transport/tcp_fallback/tcp_transport_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {

void TcpTransport::ReadFrom(Connection& conn, TransportSink& sink) {
  for (int rounds = 0; rounds < 64 && conn.alive; ++rounds) {
    void* into = nullptr;
    size_t want = 0;
    std::byte scratch[64 * 1024];
    switch (conn.stage) {
      case Connection::Stage::kHeader:
        into = conn.header_bytes.data() + conn.header_got;
        want = kFrameBytes - conn.header_got;
        break;
      case Connection::Stage::kPayload:
        into = conn.dest + conn.payload_got;
        want = conn.header.payload_bytes - conn.payload_got;
        break;
      case Connection::Stage::kDiscard:
        into = scratch;
        want = std::min(sizeof(scratch), conn.header.payload_bytes - conn.payload_got);
        break;
    }
    const ssize_t n = ::recv(conn.fd.get(), into, want, MSG_DONTWAIT);
    // What the peer did before sending these bytes (and what this process
    // sent before them) happened before their use here, and before the next
    // receive into the same memory: that one starts only after a header the
    // peer sent once it had this process's answer.
    if (n >= 0) conn.causality.Acquire();
    if (n == 0) {
      // CANCELLED: an orderly departure (see TransportSink::OnPeerLost).
      Lose(conn, sink,
           conn.said_goodbye ? absl::CancelledError("left")
                             : absl::UnavailableError("closed its connection"));
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        SetLowWater(conn);
        return;
      }
      Lose(conn, sink, absl::UnavailableError(base::ErrnoMessage("recv", errno)));
      return;
    }
    if (conn.stage == Connection::Stage::kHeader) {
      conn.header_got += static_cast<size_t>(n);
      if (conn.header_got == kFrameBytes) OnHeader(conn, sink);
    } else {
      if (conn.stage == Connection::Stage::kDiscard && conn.header.type == FrameType::kError) {
        conn.error_text.append(reinterpret_cast<const char*>(scratch), static_cast<size_t>(n));
      }
      conn.payload_got += static_cast<size_t>(n);
      if (conn.payload_got == conn.header.payload_bytes) FinishFrame(conn, sink);
    }
  }
  // Out of rounds with bytes maybe still queued: the mark must fit the frame
  // now being read, or the rest of a short one would never be reported.
  if (conn.alive) SetLowWater(conn);
}

void TcpTransport::SetLowWater(Connection& conn) {
  size_t want = 0;
  switch (conn.stage) {
    case Connection::Stage::kHeader:
      want = kFrameBytes - conn.header_got;
      break;
    case Connection::Stage::kPayload:
    case Connection::Stage::kDiscard:
      want = conn.header.payload_bytes - conn.payload_got;
      break;
  }
  AskLowWater(conn, want);
}

void TcpTransport::AskLowWater(Connection& conn, size_t want) {
  const int lowat = static_cast<int>(std::clamp<size_t>(want, 1, kLowWaterCap));
  if (lowat == conn.lowat) return;
  if (::setsockopt(conn.fd.get(), SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof(lowat)) == 0) {
    conn.lowat = lowat;
  }
}

void TcpTransport::Violation(Connection& conn, TransportSink& sink, absl::Status why) {
  STEPMESH_LOG_LIMITED(violations_, kWarning, "tcp: ", PeerName(conn.peer), " (", conn.address,
                       ") broke the protocol: ", why.message(), "; closing the connection");
  Lose(conn, sink, std::move(why));
}

void TcpTransport::OnHeader(Connection& conn, TransportSink& sink) {
  conn.header_got = 0;
  absl::StatusOr<FrameHeader> header = DecodeFrame(conn.header_bytes);
  if (!header.ok()) {
    return Violation(
        conn, sink,
        absl::DataLossError(absl::StrCat("malformed frame (", header.status().message(), ")")));
  }
  if (header->src != conn.peer) {
    return Violation(conn, sink,
                     absl::PermissionDeniedError(absl::StrCat("a frame claims to come from node 0x",
                                                              absl::Hex(header->src))));
  }
  const NodeId self = self_.load(std::memory_order_relaxed);
  if (header->dst != self) {
    return Violation(conn, sink,
                     absl::PermissionDeniedError(
                         absl::StrCat("a frame is addressed to node 0x", absl::Hex(header->dst),
                                      ", not to this node (0x", absl::Hex(self), ")")));
  }
  conn.header = *header;
  conn.payload_got = 0;
  conn.rejection = absl::OkStatus();
  conn.error_text.clear();
  switch (header->type) {
    case FrameType::kPush:
    case FrameType::kReply: {
      Destination dest;
      absl::Status resolved = sink.Resolve(conn.peer, conn.header, dest, &conn.context);
      if (resolved.ok() && dest.capacity < header->payload_bytes) {
        resolved = absl::OutOfRangeError("destination smaller than payload");
      }
      if (resolved.ok()) {
        conn.dest = dest.data;
        conn.stage = Connection::Stage::kPayload;
      } else {
        conn.rejection = std::move(resolved);
        conn.stage = Connection::Stage::kDiscard;
      }
      break;
    }
    case FrameType::kError:
      if (header->payload_bytes > kMaxErrorTextBytes) {
        return Violation(conn, sink, absl::DataLossError("oversized error frame"));
      }
      conn.stage = Connection::Stage::kDiscard;
      break;
    case FrameType::kGoodbye:
      conn.said_goodbye = true;
      [[fallthrough]];
    default:
      if (header->payload_bytes > 0) {
        return Violation(conn, sink,
                         absl::DataLossError(absl::StrCat(
                             "a frame of type ", static_cast<int>(header->type), " with ",
                             header->payload_bytes, " payload bytes (it carries none)")));
      }
      conn.stage = Connection::Stage::kDiscard;
      break;
  }
  if (conn.header.payload_bytes == 0) FinishFrame(conn, sink);
}

void TcpTransport::FinishFrame(Connection& conn, TransportSink& sink) {
  const Connection::Stage stage = conn.stage;
  conn.stage = Connection::Stage::kHeader;
  switch (conn.header.type) {
    case FrameType::kPush:
    case FrameType::kReply:
      sink.OnFrame(conn.peer, conn.header, std::exchange(conn.context, nullptr),
                   stage == Connection::Stage::kPayload ? absl::OkStatus() : conn.rejection);
      break;
    case FrameType::kError:
      sink.OnFrame(
          conn.peer, conn.header, nullptr,
          absl::Status(static_cast<absl::StatusCode>(conn.header.status_code), conn.error_text));
      break;
    default:
      break;  // heartbeats and goodbyes need no delivery
  }
}

}  // namespace stepmesh::tcp::internal
