#pragma once
// The message every TCP rail carries when a peer pair shares two or more rails
// (docs/tcp.md, "Rails"): a 40-byte rail header, then for a head the frame's
// 104-byte header, then `length` payload bytes. A frame is numbered (`seq`,
// per peer pair and direction, from 1); its payload goes whole with its head
// or, when striped, in `pieces` pieces (piece 0 with the head, the others as
// chunks on the other rails). Every message also carries `ack`: the sender of
// the message has delivered every frame up to that number from its receiver,
// which may forget them. With a single rail the stream is the plain frames of
// tcp_receive.cc, unchanged.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace stepmesh::tcp::internal {

inline constexpr size_t kMaxRails = 4;
inline constexpr size_t kRailHeaderBytes = 40;
// Pieces of a striped payload start at multiples of this (page-aligned in the
// destination when the destination is).
inline constexpr size_t kPieceAlign = 4096;

enum class RailKind : uint8_t {
  kHead = 1,     // a frame's header and piece 0 of its payload
  kChunk = 2,    // piece 1.. of a striped payload
  kAck = 3,      // only the ack (sent when nothing else goes back)
  kGoodbye = 4,  // the sender leaves: everything it queued on this rail came first
};

struct RailHeader {
  RailKind kind = RailKind::kAck;
  uint8_t piece = 0;
  uint8_t pieces = 1;
  uint64_t length = 0;  // payload bytes in this message
  uint64_t seq = 0;     // the frame (0 for kAck / kGoodbye)
  uint64_t offset = 0;  // of this message's bytes in the frame's payload
  uint64_t ack = 0;
};

void EncodeRailHeader(const RailHeader& header, std::byte* out);  // kRailHeaderBytes
// Checks the magic, the kind and the piece fields (piece < pieces <= kMaxRails).
absl::StatusOr<RailHeader> DecodeRailHeader(absl::Span<const std::byte> bytes);

// How a payload of `bytes` is cut for `rails` live rails at `stripe_min`: the
// size of every piece but the last (a multiple of kPieceAlign), and how many
// there are (1: not striped).
struct Stripes {
  size_t piece_bytes = 0;
  uint8_t pieces = 1;
};
Stripes CutPayload(size_t bytes, size_t rails, size_t stripe_min);

// STEPMESH_TCP_RAILS resolved: each entry an IPv4/IPv6 address as given or an
// interface's address; at most kMaxRails, no repeats. Errors name the entry.
absl::StatusOr<std::vector<std::string>> ResolveRails(const std::string& list);

// "host:port,host:port" (the endpoint of a transport with rails) or
// "host:port" (without): the addresses of rail 0.. in order.
absl::StatusOr<std::vector<std::string>> SplitRailEndpoint(const std::string& endpoint);

}  // namespace stepmesh::tcp::internal
