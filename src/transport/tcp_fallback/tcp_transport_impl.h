#pragma once
// Private to src/transport/tcp_fallback: the TCP transport's state, shared by
// the files that implement it (one job each: tcp_transport.cc the lifecycle and
// the receive thread's wait on base::EventLoop, tcp_send.cc the send path, tcp_receive.cc the
// receive path, tcp_accept.cc the listener and handshakes, tcp_connections.cc dialling, adopting
// and losing connections).
//
// "The receive thread" below is whoever calls Poll: the core's receive thread,
// or an application thread the core let poll while it waits
// (PollFromAnyThread; MeshNode::AwaitDriving). One at a time, handed over
// under the core's lock, so "receive thread only" state has one owner at a
// time and each sees what the previous one wrote.

#include <sys/epoll.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
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
#include "src/base/event_loop.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/base/tsan.h"
#include "src/core/handshake.h"
#include "src/core/protocol.h"
#include "src/core/transport.h"
#include "src/transport/tcp_fallback/tcp_rail_wire.h"
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

// Event-loop tokens besides Connection pointers (base::EventLoop reserves ~0).
inline constexpr uint64_t kAcceptToken = ~uint64_t{0} - 1;
// Listener of rail r: kListenerToken - r.
inline constexpr uint64_t kListenerToken = ~uint64_t{0} - 2;
// A rail whose next message must wait for another rail's (its frame is not
// the next to deliver) stops being read; one that waited this long reads
// ahead into memory instead (a rail failed and its bytes were re-sent behind
// later ones, or a rail is much slower than the others).
inline constexpr absl::Duration kParkAfter = absl::Milliseconds(200);
// Read-ahead bytes one peer may hold before it is lost.
inline constexpr size_t kMaxParkedBytes = 256 << 20;
// A receiver acknowledges at least every this many frames when it sends
// nothing back meanwhile (every message it sends carries its ack).
inline constexpr uint64_t kAckEvery = 32;
// The most bytes a message's prefix has: rail header + frame header.
inline constexpr size_t kMaxPrefixBytes = kRailHeaderBytes + core::kFrameBytes;

// One frame waiting for its peer's socket: the encoded header, then the
// payload straight from registered memory (or `copy`, for the small
// unregistered payloads of error frames).
// With rails the prefix is the rail header, then (heads) the frame header.
struct OutFrame {
  std::array<std::byte, kMaxPrefixBytes> prefix{};
  size_t prefix_bytes = core::kFrameBytes;
  const std::byte* payload = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // of prefix_bytes + bytes
  RegionId region = 0;
  std::string copy;
};

// A frame sent to a peer over rails, kept until the peer acknowledges it so
// that the pieces of a rail that fails can be sent again on another.
struct SentFrame {
  uint64_t seq = 0;
  FrameBytes header{};
  const std::byte* payload = nullptr;  // null once its region is unregistered
  size_t bytes = 0;
  RegionId region = 0;
  std::vector<std::byte> copy;  // region 0 (a moved vector keeps its buffer)
  Stripes stripes;
  uint8_t rail_of[kMaxRails] = {};  // the rail each piece went on
};

// A message read ahead of its turn (see kParkAfter).
struct Parked {
  RailHeader msg;
  FrameHeader frame;  // heads
  std::vector<std::byte> body;
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
  // Rails: which rail (0 without), and whether the peer pair uses the rail
  // messages of tcp_rail_wire.h (it shares 2+ rails).
  int rail = 0;
  bool railed = false;

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

  // Rails, receive thread only: the message being read. Its body goes to
  // `into` (a destination, scratch or a read-ahead buffer) as `sink_as` says.
  enum class Body { kPlace, kDiscard, kErrorText, kPark };
  enum class RailStage { kRailHeader, kFrameHeader, kRoute, kBody };
  RailStage rail_stage = RailStage::kRailHeader;
  std::array<std::byte, kRailHeaderBytes> rail_bytes{};
  size_t rail_got = 0;
  RailHeader msg;
  FrameHeader msg_frame;  // heads
  Body body = Body::kDiscard;
  std::byte* into = nullptr;
  size_t body_got = 0;
  Parked parking;            // kPark: the message being read ahead
  bool blocked = false;      // waits for another rail (EPOLLIN off)
  absl::Time blocked_since;  //
  bool read_ahead = false;   // blocked too long: reads ahead into memory
  bool counts = false;       // the body is a piece of the frame being delivered
  uint32_t generation = 0;   // the slot's when adopted

  // Send side, under slot->mu.
  std::vector<OutFrame> ring;
  size_t head = 0;
  size_t queued = 0;
  bool out_armed = false;     // EPOLLOUT requested
  absl::Time last_progress;   // the queue last moved (or started)
  absl::Status broken;        // a send failed: the receive thread loses it
  uint64_t payload_sent = 0;  // payload bytes of fully written messages (tests)
  OutFrame& at(size_t i) { return ring[(head + i) % ring.size()]; }
};

// The connection to one peer rank; Send finds it without a lookup table and
// holds `mu` while it writes, so the connection cannot be replaced or closed
// under it.
struct PeerSlot {
  std::mutex mu;
  Connection* conn = nullptr;  // owned by the transport's connections_ list
  // Rails (the peer shares 2+; `conn` is then null): one connection per rail,
  // null once that rail failed. Set at Connect (rails), under mu.
  NodeId peer = kNoNode;
  int rails = 1;
  Connection* rail[kMaxRails] = {};
  bool lost = false;  // every rail failed and the loss was reported
  // Send side, under mu: frames not yet acknowledged, oldest first.
  uint64_t next_seq = 1;
  std::vector<SentFrame> sent;
  size_t sent_head = 0;
  size_t sent_count = 0;
  SentFrame& sent_at(size_t i) { return sent[(sent_head + i) % sent.size()]; }
  std::atomic<uint64_t> peer_acked{0};  // the peer delivered every frame up to this
  std::atomic<uint64_t> delivered{0};   // this node delivered every frame up to this
  uint64_t ack_sent = 0;                // the highest ack a message carried (under mu)
  // Receive side, receive thread only: the frame to deliver next.
  uint64_t next_deliver = 1;
  bool resolved = false;  // its head was read (and resolved)
  FrameHeader header;
  std::byte* dest = nullptr;
  core::FrameContext context = nullptr;
  absl::Status rejection;
  std::string error_text;
  uint8_t pieces = 1;
  uint8_t pieces_got = 0;  // bit per piece
  std::vector<Parked> parked;
  size_t parked_bytes = 0;
  bool said_goodbye = false;
  // Bumped when the peer (re)connects with rails; the receive thread starts
  // the numbering again when it first reads a connection of a newer one.
  std::atomic<uint32_t> generation{0};
  uint32_t rx_generation = 0;
};

// (peer, rail) as a Connect waits for it.
inline uint64_t ExpectKey(NodeId peer, int rail) {
  return (uint64_t{peer} << 8) | static_cast<uint64_t>(rail);
}

// A connection in its handshake (accepted, not yet a peer's).
struct Pending {
  base::UniqueFd fd;
  std::string address;
  HandshakeAcceptor handshake;
  absl::Time deadline;
  bool parked = false;  // its hello names a peer not expected (yet)
  bool done = false;    // adopted, refused or dropped: freed at the end of the pump
  int rail = 0;         // the listener that accepted it
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
  // Its receive state is guarded by the caller's serialization (Poll's contract), no thread's own.
  bool PollFromAnyThread() const override { return true; }

  absl::Status Send(NodeId peer, const FrameHeader& header, const void* src, RegionId region,
                    size_t bytes) override;

  absl::Status Poll(TransportSink& sink, absl::Duration max_wait) override;

  void Wake() override;
  int WaitFd() const override { return loop_.valid() ? loop_.fd() : -1; }

  void Shutdown() override;

  // The test seams of tcp_transport.h.
  absl::Status ShutdownRail(NodeId peer, int rail);
  absl::StatusOr<std::vector<uint64_t>> RailBytes(NodeId peer);
  absl::Status SetBuffers(NodeId peer, int bytes);

 private:
  // An event loop's error, named as the transport's ("tcp: ...").
  static absl::Status Check(absl::Status status);

  PeerSlot* SlotOf(NodeId peer);

  // --- sending ---

  // sendmsg without blocking until the iovecs are out or the socket is full;
  // adds what went out to *sent. A failure marks the connection broken.
  absl::Status WriteSome(Connection& c, iovec* iov, int iovcnt, size_t* sent);

  // Writes prefix + payload now, queueing what the socket does not take
  // (`copy`: the payload is copied, for region 0); slot lock held.
  absl::Status WriteOrQueue(Connection& c, const std::byte* prefix, size_t prefix_bytes,
                            const std::byte* payload, size_t bytes, RegionId region, bool copy);

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

  // Accepts what waits on rail `rail`'s listener and admits it under
  // handshake_caps_ (base::AcceptAndAdmit); out of descriptors, the listener
  // is paused until its acceptor's back-off ends.
  void AcceptAll(int rail);

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

  // Dials the peers (each rail) a few at a time, side by side, and runs the
  // handshakes as their bytes arrive, all within `deadline` (tcp_connections.cc).
  absl::Status Dial(NodeId self, absl::Span<const PeerInfo> peers, absl::Time deadline);

  absl::Status Adopt(NodeId peer, base::UniqueFd fd, std::string address, int rail);

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
  // Sets the socket's SO_RCVLOWAT to `want` bytes (1 to kLowWaterCap) when
  // that changes it (both framings: SetLowWater, SetRailLowWater).
  static void AskLowWater(Connection& conn, size_t want);

  // A peer broke the framing or lied about a header: the byte stream cannot
  // be trusted (or resynchronised) after it. Logged with the address.
  void Violation(Connection& conn, TransportSink& sink, absl::Status why);

  void OnHeader(Connection& conn, TransportSink& sink);

  void FinishFrame(Connection& conn, TransportSink& sink);

  // --- rails (tcp_rails.cc: set-up, sending, failover; tcp_rail_receive.cc) ---

  // How long a rail may go without progress (its queue, or the kernel's
  // unacknowledged bytes: TCP_USER_TIMEOUT) before it is given up: a quarter
  // of the timeout (at least 250 ms), so that its frames are sent again on the
  // other rails before the requests they carry time out.
  absl::Duration RailTimeout() const {
    return std::max(options_.timeout / 4, absl::Milliseconds(250));
  }
  // Whether `c` is its slot's connection (or one of its rails).
  static bool IsCurrent(const Connection& c);
  // How many rails the pair uses with `peer` (both ends compute the same: the
  // fewer of the two); with 2+ a fresh numbering, old connections superseded.
  int PrepareRails(const PeerInfo& peer);
  // The rails of `slot` still up (indices into slot.rail); slot lock held.
  static int LiveRails(const PeerSlot& slot, int* live);
  absl::Status SendRails(PeerSlot& slot, const FrameHeader& header, const void* src,
                         RegionId region, size_t bytes);
  // Writes (or queues) piece `piece` of `f` on `conn`; slot lock held.
  absl::Status SendPiece(PeerSlot& slot, const SentFrame& f, uint8_t piece, Connection& conn);
  // Writes the pieces of striped `f` on their rails side by side; slot lock held.
  absl::Status SendStriped(PeerSlot& slot, const SentFrame& f);
  // Forgets frames the peer acknowledged; slot lock held.
  static void ReleaseAcked(PeerSlot& slot);
  // Sends an ack alone (nothing else went back); slot lock held.
  void SendAck(PeerSlot& slot);
  // `conn` (retired) was a rail of `slot`: its pieces not yet acknowledged go
  // on the other rails. False when none is left (or a piece cannot be sent
  // again): the peer is lost. Slot lock held.
  bool RailDown(PeerSlot& slot, Connection& conn, const absl::Status& why);
  // Closes every rail of `slot` and reports the peer lost (once).
  void LosePeer(PeerSlot& slot, TransportSink& sink, absl::Status why);
  // Receive thread, every housekeeping round: rails waiting too long read
  // ahead; acks owed go out.
  void RailHousekeeping(absl::Time now);

  // Reads rail messages (tcp_rail_receive.cc).
  void ReadRails(Connection& conn, TransportSink& sink);
  // What becomes of the body of conn's message: false when the rail waits
  // (or the peer was lost).
  bool RouteBody(Connection& conn, TransportSink& sink);
  enum class Fate { kPlace, kDiscard, kErrorText, kWait };
  // Where a message of the peer's goes; `*counts`: it is a piece of the frame
  // being delivered; `*into` where to place it (kPlace). An error: the peer
  // broke the protocol.
  absl::StatusOr<Fate> Route(PeerSlot& slot, const RailHeader& msg, const FrameHeader* head,
                             TransportSink& sink, bool* counts, std::byte** into);
  void BodyDone(Connection& conn, TransportSink& sink);
  // A piece of the frame being delivered is in: delivers it when it was the
  // last, then what was read ahead, then wakes the rails that waited.
  void CompletePiece(PeerSlot& slot, uint8_t piece, TransportSink& sink);
  // Hands the frame being delivered to the sink; true when it was.
  bool DeliverIfComplete(PeerSlot& slot, TransportSink& sink);
  void DrainParked(PeerSlot& slot, TransportSink& sink);
  // Unblocks the rails of `slot` that wait (their message may be next now).
  void WakeWaiting(PeerSlot& slot);
  void Block(Connection& conn);
  void Unblock(Connection& conn);
  // A waiting rail reads ahead into memory from now on.
  void ReadAhead(Connection& conn);
  // Receive thread: reads the rails Unblock woke.
  void RunUnblocked(TransportSink& sink);
  void SetRailLowWater(Connection& conn);
  void RailViolation(Connection& conn, TransportSink& sink, absl::Status why);

  const MeshOptions options_;
  std::atomic<NodeId> self_{kNoNode};
  std::atomic<bool> shut_down_{false};
  // The receive thread's loop: the connections and, as one descriptor,
  // handshakes_ (the listeners and the connections in their handshake).
  base::EventLoop loop_;
  base::EventLoop handshakes_;

  // One slot per peer rank of each role; connections owned by connections_.
  std::vector<PeerSlot> worker_slots_;
  std::vector<PeerSlot> server_slots_;
  const base::AdmissionCaps handshake_caps_;
  std::mutex connections_mu_;
  std::list<std::unique_ptr<Connection>> connections_;   // live and superseded-but-open
  std::list<std::unique_ptr<Connection>> retired_list_;  // closed at the next Reap
  std::atomic<bool> retired_{false};
  std::atomic<bool> attention_{false};  // a send found a connection broken
  std::atomic<int> backlogged_{0};      // connections with frames waiting
  // Rails: this host's rail addresses (empty: none), the stripe threshold,
  // peers using rails, rails waiting for another, rails to read again.
  std::vector<std::string> rail_hosts_;
  size_t stripe_min_bytes_ = 0;
  std::atomic<int> railed_peers_{0};
  std::atomic<int> blocked_count_{0};
  std::vector<Connection*> runnable_;                    // receive thread only
  absl::Time next_housekeeping_ = absl::InfinitePast();  // receive thread only

  // The listener and the handshakes, run by whoever holds accept_mu_.
  std::mutex accept_mu_;
  std::vector<base::Acceptor> acceptors_;  // one per rail (one without rails)
  std::vector<bool> acceptor_paused_;
  std::list<std::unique_ptr<Pending>> pending_;
  absl::flat_hash_set<uint64_t> expected_;  // (peer, rail)s a Connect waits for (ExpectKey)
  std::atomic<size_t> pending_count_{0};
  std::atomic<bool> accept_paused_{false};

  base::RateLimiter violations_{10, absl::Seconds(10)};
  base::RateLimiter exhausted_{1, absl::Seconds(10)};
};

}  // namespace stepmesh::tcp::internal
