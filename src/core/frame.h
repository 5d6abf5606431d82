#pragma once
// The wire frame: one fixed-size, versioned header in front of every payload,
// the same on TCP and RDMA (where it travels as the WRITE_WITH_IMM / inline send).
// Encoding is explicit little-endian so peers never depend on struct layout.

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "src/core/protocol.h"
#include "stepmesh/tensor.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {

inline constexpr uint32_t kFrameMagic = 0x48534D53;  // "SMSH" read little-endian
inline constexpr uint8_t kFrameVersion = 1;
inline constexpr size_t kFrameBytes = 104;
// Upper bound on any payload: a decoder refuses larger claims before touching memory.
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 32;

enum class FrameType : uint8_t {
  kPush = 1,       // worker -> server: one push of a request
  kReply = 2,      // server -> worker: reply (payload may be empty: an acknowledgement)
  kError = 3,      // either way: the request `request_id` failed; payload = UTF-8 message
  kHeartbeat = 4,  // liveness on a data connection
  kGoodbye = 5,    // orderly close
  kCredit = 6,     // flow-control credit return (RDMA)
  kControl = 7,    // transport-private (e.g. RDMA region adverts); payload is opaque
};
bool IsValidFrameType(uint8_t raw);

enum FrameFlags : uint8_t {
  kFlagHasPull = 1 << 0,     // push frames: `pull_key` is expected back from this server
  kFlagPayloadCrc = 1 << 1,  // `payload_crc` is the CRC32C of the payload (payload_checksum)
  kFlagStage = 1 << 2,       // push frames: `status_code` is the request's stage (SendOptions)
};

struct FrameHeader {
  FrameType type = FrameType::kPush;
  DType dtype = DType::kUInt8;
  uint8_t flags = 0;
  NodeId src = kNoNode;
  NodeId dst = kNoNode;
  uint64_t key = 0;
  uint64_t request_id = 0;  // worker's request: slot index << 32 | generation
  uint64_t payload_bytes = 0;
  uint64_t pull_key = 0;
  uint16_t part_index = 0;  // this push among the request's pushes to this server
  uint16_t part_count = 0;
  // kError: an absl::StatusCode; kPush with kFlagStage: the stage; kReply:
  // ns from Respond() to server_reply_ns (TraceStamps::server_respond_ns), capped.
  uint32_t status_code = 0;
  uint32_t payload_crc = 0;  // with kFlagPayloadCrc only
  TraceStamps stamps;        // reply_arrival_ns is never sent (always 0 on the wire)
};

using FrameBytes = std::array<std::byte, kFrameBytes>;

void EncodeFrame(const FrameHeader& header, std::byte* out);  // writes kFrameBytes
inline FrameBytes EncodeFrame(const FrameHeader& header) {
  FrameBytes out;
  EncodeFrame(header, out.data());
  return out;
}
// Validates magic, version, type, dtype, sizes, part counters and the checksum.
absl::StatusOr<FrameHeader> DecodeFrame(absl::Span<const std::byte> bytes);

}  // namespace stepmesh::core
