#pragma once
// Fault injection for the reliability tests: a Transport decorator that drops,
// delays, duplicates, rewrites, stalls, kills or refuses, driven by a shared
// FaultPlan. Frame-level faults work over any transport. Byte-level faults
// (corrupt a header or payload byte, truncate a frame) happen on the wire, in
// a proxy in front of a TCP transport's listener (tests/reliability/
// wire_proxy.h); on a transport without one those rules never fire.
//
// What each fault must look like to the caller (tests/reliability/fault_test.cc):
//   drop        : reliable transports never drop silently, so nothing notices
//                 but the request's deadline: Wait() -> DEADLINE_EXCEEDED.
//   corrupt hdr : the receiver's frame CRC fails -> DATA_LOSS on the connection
//                 -> the peer is lost -> its pending requests fail UNAVAILABLE.
//   corrupt pay : NOT detectable at this layer (no payload checksum; TCP's own
//                 checksum guards the wire, not a buggy sender). Documented.
//   truncate    : the receiver sees EOF inside a frame -> peer lost.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "src/base/sync.h"
#include "src/core/transport.h"

namespace stepmesh::testing {

enum class FaultAction : uint8_t {
  kDrop,            // the frame is not sent; Send reports success
  kDelay,           // Send sleeps `delay` first (a slow link; delays what follows too)
  kDuplicate,       // the frame is sent twice
  kCorruptHeader,   // wire: one encoded header byte flipped after the CRC was computed
  kCorruptPayload,  // wire: one payload byte flipped (in a copy)
  kTruncate,        // wire: half the payload, then the connection is shut
  kRewriteKey,      // header.key := new_key before encoding (a forged but well-formed frame)
  kForgeSource,     // header.src := new_src before encoding (claims another sender)
  kKill,            // the sender's transport shuts down for good before this frame
};

struct FaultRule {
  FaultAction action = FaultAction::kDrop;
  std::optional<core::FrameType> type;  // any frame when empty
  core::NodeId from = core::kNoNode;    // sender; kNoNode: any
  core::NodeId to = core::kNoNode;      // receiver; kNoNode: any
  int skip = 0;                         // matching frames let through first
  int count = 1;                        // then this many are hit (-1: all)
  absl::Duration delay = absl::ZeroDuration();
  uint64_t new_key = 0;
  core::NodeId new_src = core::kNoNode;
};

// Shared by every node's decorator (the rules name nodes). Thread-safe.
class FaultPlan {
 public:
  void Add(const FaultRule& rule);
  // `node`'s Connect fails with UNAVAILABLE (a refused connection).
  void RefuseConnect(core::NodeId node);
  // `node`'s receive path delivers nothing until now + `duration` (a stalled peer).
  void Stall(core::NodeId node, absl::Duration duration);
  // How often `action` fired so far.
  int fired(FaultAction action) const;
  // Frames (accepted or refused) `node`'s transport handed to its core so far.
  int delivered(core::NodeId node) const;
  void CountDelivered(core::NodeId node);

  // The rule this frame hits, if any (consumes it): among the byte-level
  // rules for the wire proxy (`wire`), among the others for the decorator.
  std::optional<FaultRule> Match(const core::FrameHeader& header, bool wire);
  bool refuses(core::NodeId node) const;
  absl::Time stalled_until(core::NodeId node) const;

 private:
  struct Armed {
    FaultRule rule;
    int seen = 0;
    int hit = 0;
  };
  mutable base::Mutex mu_;
  std::vector<Armed> rules_ ABSL_GUARDED_BY(mu_);
  std::vector<core::NodeId> refused_ ABSL_GUARDED_BY(mu_);
  std::map<core::NodeId, absl::Time> stalls_ ABSL_GUARDED_BY(mu_);
  std::map<FaultAction, int> fired_ ABSL_GUARDED_BY(mu_);
  std::map<core::NodeId, int> delivered_ ABSL_GUARDED_BY(mu_);
};

// Byte-level faults: corrupt a header or payload byte, cut a frame short.
bool IsWireFault(FaultAction action);

// Wraps `inner` (any transport) for the frame-level faults.
std::unique_ptr<core::Transport> WrapWithFaults(std::unique_ptr<core::Transport> inner,
                                                std::shared_ptr<FaultPlan> plan);

// Factories for the core: any transport with the frame-level faults, and with
// `wire` (a TCP transport: TransportCase::wire_faults) the byte-level ones too.
core::TransportFactory Faulty(core::TransportFactory inner, std::shared_ptr<FaultPlan> plan,
                              bool wire = false);
// The TCP transport with every fault.
core::TransportFactory FaultyTcp(std::shared_ptr<FaultPlan> plan);

}  // namespace stepmesh::testing
