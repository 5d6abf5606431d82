#pragma once
// Private to src/transport/tcp_fallback: the TCP transport's state, shared by
// the files that implement it (one job each: tcp_transport.cc the lifecycle and
// the epoll loop, tcp_send.cc the send path, tcp_receive.cc the receive path,
// tcp_accept.cc the listener and handshakes, tcp_connections.cc dialling,
// adopting and losing connections).

#include <sys/epoll.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/base/admission.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/base/tsan.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::tcp::internal {

using core::DecodeFrame;
using core::Destination;
using core::DialHandshake;
using core::EncodeFrame;
using core::FrameBytes;
using core::FrameHeader;
using core::FrameType;
using core::HandshakeAcceptor;
using core::kFrameBytes;
using core::kMaxErrorTextBytes;
using core::kNoNode;
using core::NodeId;
using core::PeerInfo;
using core::PeerName;
using core::RegionId;
using core::RegionInfo;
using core::Transport;
using core::TransportSink;

// A dialler gets this long from accept to the end of its handshake, so one
// silent client costs a descriptor for a while, never a real peer's place.
inline constexpr absl::Duration kHandshakeTimeout = absl::Seconds(5);
// Connections still in their handshake, per source address and in total (at
// least these, room for every participant: CapsForPeers); the oldest goes
// first when a new one would exceed either.
inline constexpr size_t kMaxPendingPerAddress = 32;
inline constexpr size_t kMaxPending = 128;
inline constexpr int kSocketBufferBytes = 8 << 20;
// The most SO_RCVLOWAT asks for (see SetLowWater): large payloads still wake
// the receive thread every 256 KiB, so its copy-out trails the sender's
// copy-in by at most that much. The kernel also caps it at half the receive
// buffer and reports readable anyway under memory pressure or a closing
// window, so a low water mark above what can arrive never stalls a frame.
inline constexpr size_t kLowWaterCap = 256 << 10;
// Frames waiting for one peer's socket to drain. A healthy peer needs a few
// (a worker's pushes of its requests in flight; a server's replies to the
// batches it answered); the ring grows on demand up to this, then Send fails
// RESOURCE_EXHAUSTED naming the peer.
inline constexpr size_t kMaxQueuedFrames = 4096;
inline constexpr size_t kInitialQueueFrames = 16;
// Shutdown gives queued frames at most this long (or the timeout) to go out
// before the goodbye.
inline constexpr absl::Duration kShutdownFlush = absl::Seconds(2);

// epoll tokens besides Connection pointers.
inline constexpr uint64_t kWakeToken = ~uint64_t{0};
inline constexpr uint64_t kAcceptToken = ~uint64_t{0} - 1;
inline constexpr uint64_t kListenerToken = ~uint64_t{0} - 2;

// One frame waiting for its peer's socket: the encoded header, then the
// payload straight from registered memory (or `copy`, for the small
// unregistered payloads of error frames).
struct OutFrame {
  FrameBytes header{};
  const std::byte* payload = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // of kFrameBytes + bytes
  RegionId region = 0;
  std::string copy;
};

struct PeerSlot;

// One peer's connection: the frame being received (receive thread only) and
// the frames waiting to be sent (under the slot's lock).
struct Connection {
  enum class Stage { kHeader, kPayload, kDiscard };

  PeerSlot* slot = nullptr;
  NodeId peer = kNoNode;
  std::string address;  // the remote end, for logs
  base::UniqueFd fd;    // closed when the connection is destroyed (Reap), exactly once
  // The peer's half of "it answered, so the kernel is done with my bytes", for
  // ThreadSanitizer builds (empty otherwise): see WriteSome and ReadFrom.
  [[no_unique_address]] base::SocketCausality causality;
  std::atomic<bool> alive{true};
  bool superseded = false;  // replaced by a newer connection to the same peer
  bool said_goodbye = false;

  Stage stage = Stage::kHeader;
  FrameBytes header_bytes{};
  size_t header_got = 0;
  FrameHeader header;
  std::byte* dest = nullptr;             // kPayload: where the payload goes
  core::FrameContext context = nullptr;  // the core's, from Resolve to OnFrame
  size_t payload_got = 0;
  absl::Status rejection;  // kDiscard: why
  std::string error_text;  // kError payloads are read here
  int lowat = 1;           // the socket's SO_RCVLOWAT (receive thread only)

  // Send side, under slot->mu.
  std::vector<OutFrame> ring;
  size_t head = 0;
  size_t queued = 0;
  bool out_armed = false;    // EPOLLOUT requested
  absl::Time last_progress;  // the queue last moved (or started)
  absl::Status broken;       // a send failed: the receive thread loses it
  OutFrame& at(size_t i) { return ring[(head + i) % ring.size()]; }
};

// The connection to one peer rank; Send finds it without a lookup table and
// holds `mu` while it writes, so the connection cannot be replaced or closed
// under it.
struct PeerSlot {
  std::mutex mu;
  Connection* conn = nullptr;  // owned by the transport's connections_ list
};

// A connection in its handshake (accepted, not yet a peer's).
struct Pending {
  base::UniqueFd fd;
  std::string address;
  HandshakeAcceptor handshake;
  absl::Time deadline;
  bool parked = false;  // its hello names a peer not expected (yet)
  bool done = false;    // adopted, refused or dropped: freed at the end of the pump
  explicit Pending(std::string secret) : handshake(std::move(secret)) {}
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const MeshOptions& options)
      : options_(options),
        worker_slots_(static_cast<size_t>(options.num_workers)),
        server_slots_(static_cast<size_t>(options.num_servers)),
        handshake_caps_(base::CapsForPeers(
            static_cast<size_t>(options.num_workers) + static_cast<size_t>(options.num_servers),
            {kMaxPendingPerAddress, kMaxPending})) {}
  ~TcpTransport() override {
    Shutdown();
    // Every connection and handshake closes its descriptor as it is destroyed.
  }

  absl::Status Init();

  absl::string_view name() const override { return "tcp"; }

  absl::StatusOr<std::string> LocalEndpoint() override;

  absl::Status Connect(NodeId self, absl::Span<const PeerInfo> peers, absl::Time deadline) override;

  absl::Status RegisterRegion(const RegionInfo&) override { return absl::OkStatus(); }

  absl::Status UnregisterRegion(RegionId id) override;

  bool SendNeverWaits() const override { return true; }  // a full queue is RESOURCE_EXHAUSTED

  absl::Status Send(NodeId peer, const FrameHeader& header, const void* src, RegionId region,
                    size_t bytes) override;

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override;

  void Wake() override;
  int WaitFd() const override { return epoll_fd_.valid() ? epoll_fd_.get() : -1; }

  void Shutdown() override;

 private:
  static absl::Status Watch(int epoll_fd, int fd, uint32_t events, uint64_t token);

  PeerSlot* SlotOf(NodeId peer);

  // --- sending ---

  // sendmsg without blocking until the iovecs are out or the socket is full;
  // adds what went out to *sent. A failure marks the connection broken.
  absl::Status WriteSome(Connection& c, iovec* iov, int iovcnt, size_t* sent);

  // Writes queued frames while the socket takes them (slot lock held).
  void DrainQueue(Connection& c);

  // Receive thread, on writability.
  void Flush(Connection& conn, TransportSink& sink);

  void ArmWritable(Connection& c, bool on);

  // Doubles a full ring (only while a peer is slow; steady state never grows it).
  static void Grow(Connection& c);

  // --- losing connections ---

  // Receive thread: reports connections a send found broken.
  void LoseBroken(TransportSink& sink);

  // Closes a connection (the descriptor itself at the next Reap) and reports
  // the peer lost unless a newer connection superseded it.
  void Lose(Connection& conn, TransportSink& sink, absl::Status why);

  // Takes `conn` out of the epoll set and its slot (slot lock held); the
  // receive thread destroys it, closing its descriptor, at its next Poll.
  void Retire(Connection& conn);

  // Receive thread, before it waits: destroys retired connections. No event
  // of this thread's can name them any more (the previous epoll batch is done).
  void Reap();

  // Receive thread: peers whose queue has not moved for the timeout are lost;
  // handshakes past their deadline are dropped; a paused listener is resumed.
  void Housekeeping(TransportSink& sink);

  // --- accepting (servers) ---

  // Runs the listener and the handshakes: accepts, advances every handshake
  // that has bytes, re-examines parked ones, expires overdue ones. Never
  // blocks longer than `max_wait`. accept_mu_ held.
  void Pump(absl::Duration max_wait);

  void AcceptAll();

  // Makes room for one more handshake from `address` (base/admission.h).
  void MakeRoomFor(const std::string& address);

  void Advance(Pending& p);

  // Whether the dialler may connect now: a peer of this mesh's other role
  // that a Connect expects. A hello for a peer not expected yet waits (its
  // rejoin notice may still be on the way) until its deadline, unwatched.
  void Decide(Pending& p);

  // Sends what the handshake has to say and acts on its outcome; false when
  // the handshake is over (adopted or refused).
  bool Answer(Pending& p);

  // "connected from ADDR" / "not connected" for a peer, for logs.
  std::string ConnectedFrom(NodeId peer);

  void Refuse(Pending& p, const absl::Status& why);

  // Ends a handshake: a protocol violation, logged (rate limited) with the
  // address and the reason unless `quiet` (a client that simply went away).
  void Drop(Pending& p, absl::string_view reason, bool quiet = false);

  // --- dialling (workers) ---

  absl::Status Dial(NodeId self, const PeerInfo& peer, absl::Time deadline);

  absl::Status Adopt(NodeId peer, base::UniqueFd fd, std::string address);

  // --- receiving ---

  // Reads as much as is available, frame by frame, straight into destinations.
  void ReadFrom(Connection& conn, TransportSink& sink);

  // Asks the kernel to report the connection readable (and wake the receive
  // thread) only once the rest of the current frame is there, or kLowWaterCap
  // of it. Without it, the receive thread chases the sender segment by
  // segment: a wake-up, an epoll round and a small copy per 64 KiB, with the
  // socket's lock and counters bouncing between the cores (measured in
  // docs/benchmarks.md). Set only when it changes, when leaving ReadFrom.
  void SetLowWater(Connection& conn);

  // A peer broke the framing or lied about a header: the byte stream cannot
  // be trusted (or resynchronised) after it. Logged with the address.
  void Violation(Connection& conn, TransportSink& sink, absl::Status why);

  void OnHeader(Connection& conn, TransportSink& sink);

  void FinishFrame(Connection& conn, TransportSink& sink);

  const MeshOptions options_;
  std::atomic<NodeId> self_{kNoNode};
  std::atomic<bool> shut_down_{false};
  base::UniqueFd epoll_fd_;
  base::UniqueFd accept_epoll_fd_;
  base::UniqueFd wake_fd_;

  // One slot per peer rank of each role; connections owned by connections_.
  std::vector<PeerSlot> worker_slots_;
  std::vector<PeerSlot> server_slots_;
  const base::AdmissionCaps handshake_caps_;
  std::mutex connections_mu_;
  std::list<std::unique_ptr<Connection>> connections_;   // live and superseded-but-open
  std::list<std::unique_ptr<Connection>> retired_list_;  // closed at the next Reap
  std::atomic<bool> retired_{false};
  std::atomic<bool> attention_{false};                   // a send found a connection broken
  std::atomic<int> backlogged_{0};                       // connections with frames waiting
  absl::Time next_housekeeping_ = absl::InfinitePast();  // receive thread only

  // The listener and the handshakes, run by whoever holds accept_mu_.
  std::mutex accept_mu_;
  base::Acceptor acceptor_;
  std::list<std::unique_ptr<Pending>> pending_;
  absl::flat_hash_set<NodeId> expected_;  // peers a Connect waits for
  std::atomic<size_t> pending_count_{0};
  std::atomic<bool> accept_paused_{false};

  base::RateLimiter violations_{10, absl::Seconds(10)};
  base::RateLimiter exhausted_{1, absl::Seconds(10)};
};

}  // namespace stepmesh::tcp::internal
