#pragma once
// Protocol constants and node identities, shared by the core, the transports
// and the scheduler. Each constant is defined here once.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "stepmesh/options.h"
#include "stepmesh/server.h"
#include "stepmesh/types.h"

namespace stepmesh::core {

// Node ids: role in the top byte, rank below. Stable across transports.
using NodeId = uint32_t;
inline constexpr NodeId kNoNode = 0xFFFFFFFF;

inline constexpr NodeId MakeNodeId(Role role, uint32_t rank) {
  return (static_cast<uint32_t>(role) << 24) | (rank & 0xFFFFFF);
}
inline constexpr NodeId WorkerId(uint32_t rank) { return MakeNodeId(Role::kWorker, rank); }
inline constexpr NodeId ServerId(uint32_t rank) { return MakeNodeId(Role::kServer, rank); }
inline constexpr Role NodeRole(NodeId id) { return static_cast<Role>(id >> 24); }
inline constexpr uint32_t NodeRank(NodeId id) { return id & 0xFFFFFF; }
inline constexpr bool IsWorker(NodeId id) { return NodeRole(id) == Role::kWorker; }
inline constexpr bool IsServer(NodeId id) { return NodeRole(id) == Role::kServer; }
// The role a participant exchanges data with: workers talk to servers and back.
inline constexpr Role PeerRole(Role self) {
  return self == Role::kWorker ? Role::kServer : Role::kWorker;
}
// "worker 3", "server 0"; "node 0x..." for an id that names no participant.
std::string PeerName(NodeId id);
// "server 1 lost: <reason>", one prefix however the reason was phrased: a
// reason that already names the peer ("server 1 closed its connection", or a
// whole "server 1 lost: ..." passed on) does not name it twice.
std::string PeerLossMessage(NodeId id, absl::string_view reason);

// The most pushes one request carries (a part count per server fits easily).
inline constexpr int kMaxPushesPerRequest = 16;
// The pull key of a worker that only pushed (the public Batch::kNoPull).
inline constexpr Key kNoPull = Batch::kNoPull;
// The key of a worker's fence: a kError frame (status CANCELLED, no text)
// after its last push to a server that drains (docs/elastic.md); no request
// uses it.
inline constexpr Key kFenceKey = ~Key{0} - 1;
// The longest error text a kError frame carries; longer messages are cut.
inline constexpr size_t kMaxErrorTextBytes = 4096;

}  // namespace stepmesh::core
