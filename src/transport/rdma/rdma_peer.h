#pragma once
// A connection to one peer: its queue pairs and control block, the prepared
// routes to its receive slots, and receive-side state. Each field says which
// thread owns it: the receive thread (Poll), or a lock -- the outbox's lock for
// everything a post changes (the send thread's Send and the receive thread's
// drain both post).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "src/base/net.h"
#include "src/base/sync.h"
#include "src/core/frame.h"
#include "src/core/transport.h"
#include "src/transport/rdma/rdma_wire.h"
#include "src/transport/rdma/send_queue.h"
#include "src/transport/rdma/verbs_resources.h"

namespace stepmesh::rdma {

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<std::byte, FreeDeleter>;

// The peer's receive slot for one key, prepared when it was advertised: the
// send path reads it without a lock (a sequence lock) and posts straight from
// it. The receive thread changes it (advert, withdrawal) while holding every
// data QP's post lock, so a post that re-checks `seq` under that lock never
// uses a withdrawn slot.
struct Route {
  std::atomic<uint32_t> seq{0};  // odd while changing
  std::atomic<uint64_t> addr{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint32_t> rkey{0};
  std::atomic<bool> live{false};  // advertised and not withdrawn
};

struct RouteView {
  uint64_t addr = 0;
  uint64_t bytes = 0;
  uint32_t rkey = 0;
  uint32_t seq = 0;
  bool live = false;
};

// A sequence lock without fences (which ThreadSanitizer cannot see): fields
// are stored with release and loaded with acquire, so a reader that saw any
// new field also sees the odd or bumped sequence when it looks again.
inline RouteView ReadRoute(const Route& route) {
  for (;;) {
    const uint32_t before = route.seq.load(std::memory_order_acquire);
    RouteView view{route.addr.load(std::memory_order_acquire),
                   route.bytes.load(std::memory_order_acquire),
                   route.rkey.load(std::memory_order_acquire), before,
                   route.live.load(std::memory_order_acquire)};
    if ((before & 1) == 0 && route.seq.load(std::memory_order_acquire) == before) return view;
  }
}

inline void WriteRoute(Route& route, uint64_t addr, uint64_t bytes, uint32_t rkey, bool live) {
  const uint32_t seq = route.seq.load(std::memory_order_relaxed);
  route.seq.store(seq + 1, std::memory_order_relaxed);
  route.addr.store(addr, std::memory_order_release);
  route.bytes.store(bytes, std::memory_order_release);
  route.rkey.store(rkey, std::memory_order_release);
  route.live.store(live, std::memory_order_release);
  route.seq.store(seq + 2, std::memory_order_release);
}

// One RC QP to a peer.
struct QueuePair {
  CqHandle send_cq;
  QpHandle qp;  // after its CQ: destroyed first
  SendQueue sq;
  uint32_t max_inline = 0;

  uint64_t frames_sent = 0;  // under the outbox's lock: WRITE_WITH_IMMs sent (credits used)

  // Receive thread.
  uint64_t frames_received = 0;   // WRITE_WITH_IMM arrivals
  uint64_t delivered = 0;         // handed on and their receives re-posted
  uint64_t credits_returned = 0;  // `delivered` as last written to the peer

  // Local memory (inside the peer's control block).
  std::byte* recv_ring = nullptr;
  std::byte* send_ring = nullptr;
  uint64_t* mailbox = nullptr;      // the peer writes its `delivered` for our sends here
  uint64_t* credit_word = nullptr;  // source of credit writes when inline is impossible

  // The peer's ring and mailbox for this QP.
  uint64_t remote_ring = 0;
  uint64_t remote_mailbox = 0;
  uint32_t local_psn = 0;
};

// A frame still in QP 0's header ring: it stays there (its receive not
// re-posted, its credit not returned) until delivered, so the frames that wait
// for a late stripe are bounded by the credit window.
struct Arrival {
  uint32_t stripes_needed = 0;
  uint32_t byte_len = 0;
};

// A withdrawal this node must acknowledge once its writes into the slot completed.
struct PendingAck {
  uint64_t key = 0;
  std::array<uint64_t, rdma::kMaxQpsPerPeer> watermarks{};
};

// A frame waiting for what the peer must provide before it can be posted:
// its advert for the key, a receive credit, room in a QP's send queue. The
// source stays where the core put it (registered memory, untouched until the
// request completes); only an error frame's small text is copied.
struct QueuedFrame {
  core::FrameHeader header;
  const std::byte* src = nullptr;  // the payload; null: `copy` holds it
  size_t bytes = 0;
  core::RegionId region = 0;
  uint32_t lkey = 0;
  Route* route = nullptr;  // a data frame with a payload: where it goes
  std::string copy;        // a queued error frame's text
  int64_t queued_ns = 0;

  // A frame partly posted (a send queue filled mid-frame) goes on from here;
  // a route that changes under it starts it again at its new place.
  bool started = false;
  RouteView dst;
  size_t chunk = 0;           // the striped tail of the payload, on QP 1
  size_t chunk_posted = 0;    // of the chunk's pieces before its last
  bool chunk_sent = false;    // the chunk's WRITE_WITH_IMM too
  size_t payload_posted = 0;  // of the payload before the chunk, on QP 0
};

// What stops an outbox's head.
enum class Blocked { kNothing, kAdvert, kCredit, kSendQueue, kFailed };

// Frames to one peer that could not be posted when sent, in order. Send never
// waits for them: the receive thread posts them as the peer's credits come
// back, and reports a peer whose head has not moved for options.timeout.
struct Outbox {
  base::Mutex mu;
  std::vector<QueuedFrame> ring ABSL_GUARDED_BY(mu);  // grows on demand, never shrinks
  size_t head ABSL_GUARDED_BY(mu) = 0;
  size_t size ABSL_GUARDED_BY(mu) = 0;
  int64_t head_since_ns ABSL_GUARDED_BY(mu) = 0;  // the head was queued or last moved
  Blocked blocked ABSL_GUARDED_BY(mu) = Blocked::kNothing;
  absl::Status failed ABSL_GUARDED_BY(mu);  // Blocked::kFailed: why the head cannot go
  std::atomic<bool> backlogged{false};      // size > 0
  QueuedFrame& at(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return ring[(head + i) % ring.size()];
  }
};

struct Peer {
  core::NodeId id = core::kNoNode;
  uint64_t token = 0;  // index in the transport's peer table
  uint32_t num_qps = 1;
  uint32_t depth = 0;

  base::UniqueFd socket;
  base::Mutex write_mu;

  // Control block: [remote part: rings, mailboxes][local part: send rings, credit words].
  AlignedBytes memory;
  size_t remote_bytes = 0;
  MrHandle remote_mr;        // LOCAL_WRITE | REMOTE_WRITE, rkey given to this peer only
  MrHandle local_mr;         // LOCAL_WRITE
  uint32_t remote_rkey = 0;  // the peer's control-block rkey

  CqHandle recv_cq;
  std::array<QueuePair, rdma::kMaxQpsPerPeer> qps;  // after recv_cq: destroyed first

  base::Mutex route_mu;  // route creation and advert waits; never on the per-frame path
  absl::flat_hash_map<uint64_t, std::unique_ptr<Route>> routes ABSL_GUARDED_BY(route_mu);

  std::atomic<bool> lost{false};           // reported (or shut down)
  std::atomic<bool> loss_reported{false};  // the sink's OnPeerLost for it returned
  FailureRecord failure;                   // waits for the receive thread to report it

  uint64_t stripes_sent = 0;  // under outbox.mu
  Outbox outbox;

  // Receive thread.
  std::array<std::byte, rdma::kBootHeaderBytes + rdma::kMaxBootBody> rx{};
  size_t rx_got = 0;
  bool said_goodbye = false;
  uint64_t stripes_seen = 0;
  std::vector<Arrival> arrivals;  // one per QP 0 ring slot
  std::vector<PendingAck> pending_acks;

  bool usable() const { return !lost.load(std::memory_order_acquire) && !failure.failed(); }
};

}  // namespace stepmesh::rdma
