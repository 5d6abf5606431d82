#pragma once
// The rendezvous protocol between participants and the scheduler: small,
// length-prefixed, versioned messages whose decoder validates every field.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/core/frame.h"

namespace stepmesh::core {

inline constexpr uint32_t kControlMagic = 0x54434D53;  // "SMCT"
// 2: the join carries the mesh shape; 3: kPeerLeft; 4: membership epochs,
// the capacity and kDrain (elastic membership, docs/elastic.md).
inline constexpr uint16_t kControlVersion = 4;
inline constexpr size_t kControlHeaderBytes = 12;
inline constexpr uint32_t kMaxControlPayload = 1 << 20;

enum class ControlType : uint16_t {
  kJoin = 1,         // participant -> scheduler: role, wanted rank, data endpoint, mesh
                     // shape and id; a resume (the scheduler restarted) also its barriers
  kRoster = 2,       // scheduler -> participant: assigned rank, everyone's endpoint
  kBarrier = 3,      // participant -> scheduler: reached barrier `sequence`
  kRelease = 4,      // scheduler -> participant: barrier `sequence` passed
  kLeave = 5,        // participant -> scheduler: orderly exit
  kPeerLost = 6,     // scheduler -> participant: `node` left without kLeave / went silent
  kPing = 7,         // scheduler -> participant
  kPong = 8,         // participant -> scheduler
  kReject = 9,       // scheduler -> participant: join refused, `reason`
  kPeerJoined = 10,  // scheduler -> participant: `node` (re)joined at `endpoint`
  kChallenge = 11,   // either way: auth nonce
  kProof = 12,       // either way: auth proof
  kClock = 13,       // participant -> scheduler: `sequence` = its send time; the scheduler
                     // echoes it with `clock_ns` = its own clock (ClockOffset)
  kPeerLeft = 14,    // scheduler -> participant: `node` left in order (its kLeave), or
                     // began to drain (its kDrain): either way no longer a member
  kDrain = 15,       // participant -> scheduler: count me out now, I leave once drained
};

struct RosterEntry {
  NodeId node = kNoNode;
  std::string endpoint;
};

// kJoin flags.
inline constexpr uint8_t kJoinResume = 1;  // already a member: the scheduler lost its state

// One decoded message; only the fields of its type are meaningful.
struct ControlMessage {
  ControlType type = ControlType::kPing;
  uint8_t role = 0;
  int32_t rank = -1;
  NodeId node = kNoNode;
  // kJoin: the last barrier this participant entered; kRoster: the barrier
  // count a participant joining a running mesh starts from.
  uint64_t sequence = 0;
  // kRoster, kPeerLost/Joined/Left: the membership epoch (the scheduler's
  // count of changes since the mesh formed at 0); kJoin with kJoinResume: the
  // last one this participant heard.
  uint64_t epoch = 0;
  std::string text;  // endpoint, reason, nonce or proof
  std::vector<RosterEntry> roster;
  // kJoin only: the mesh as this participant was configured, so the scheduler
  // refuses a participant of another mesh instead of running a wrong one.
  uint32_t num_workers = 0;
  uint32_t num_servers = 0;
  uint32_t max_workers = 0;  // the capacity (MeshOptions::WorkerCapacity())
  uint32_t max_servers = 0;
  std::string mesh_id;
  uint8_t join_flags = 0;
  uint64_t barrier_released = 0;  // kJoin with kJoinResume: the last barrier released to it
  uint64_t clock_ns = 0;          // kClock from the scheduler: its CLOCK_MONOTONIC
};

std::string EncodeControl(const ControlMessage& message);  // header + payload
// Decodes the 12-byte header: returns the type and payload length after checks.
absl::StatusOr<std::pair<ControlType, uint32_t>> DecodeControlHeader(
    absl::Span<const std::byte> header);
absl::StatusOr<ControlMessage> DecodeControlPayload(ControlType type,
                                                    absl::Span<const std::byte> payload);

// Reassembles messages from a byte stream read in arbitrary pieces (a
// non-blocking socket): garbage is refused as soon as its header is complete,
// and a claimed payload above `max_payload` before any of it is buffered.
class ControlAssembler {
 public:
  explicit ControlAssembler(uint32_t max_payload = kMaxControlPayload)
      : max_payload_(max_payload) {}
  void Feed(absl::Span<const std::byte> bytes);
  // The next complete message, nullopt while one is incomplete, or the
  // decoder's error (the stream cannot be resynchronised after it).
  absl::StatusOr<std::optional<ControlMessage>> Next();
  size_t buffered() const { return buffer_.size() - consumed_; }
  void set_max_payload(uint32_t max_payload) { max_payload_ = max_payload; }

 private:
  uint32_t max_payload_;
  std::vector<std::byte> buffer_;
  size_t consumed_ = 0;
};

// Blocking helpers over a socket, bounded by `deadline`.
absl::Status SendControl(int fd, const ControlMessage& message, absl::Time deadline);
absl::StatusOr<ControlMessage> ReceiveControl(int fd, absl::Time deadline);

}  // namespace stepmesh::core
