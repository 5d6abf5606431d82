#pragma once
// What the RDMA transport puts on the wire besides the frame itself:
//   - the 32-bit immediate of every RDMA_WRITE_WITH_IMM;
//   - the bootstrap messages exchanged over one small TCP connection per peer
//     (hello, ready, region adverts and withdrawals, goodbye).
// Everything is explicit little-endian, like the frame.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "src/core/frame.h"

namespace stepmesh::rdma {

// ---- Immediate data (sent in network byte order) ----
// bit 31 = 0: a frame. bits 0..15: the receiver's header-ring slot;
//             bits 16..30: how many stripe chunks (mod 2^15) must have arrived
//             on the stripe QP before this frame may be delivered.
// bit 31 = 1: a stripe chunk (second half of a payload on QP 1);
//             bits 0..30: its sequence number (mod 2^31).
inline constexpr uint32_t kImmChunkBit = 1u << 31;
inline constexpr uint32_t kImmStripeMask = 0x7FFF;
inline constexpr uint32_t kImmChunkMask = 0x7FFFFFFF;
inline constexpr uint32_t kMaxRecvDepth = 1u << 13;  // ring slots fit 16 bits, stripes 15

inline constexpr uint32_t FrameImm(uint32_t ring_slot, uint64_t stripes_needed) {
  return (static_cast<uint32_t>(stripes_needed & kImmStripeMask) << 16) | (ring_slot & 0xFFFF);
}
inline constexpr uint32_t ChunkImm(uint64_t sequence) {
  return kImmChunkBit | static_cast<uint32_t>(sequence & kImmChunkMask);
}
inline constexpr bool ImmIsChunk(uint32_t imm) { return (imm & kImmChunkBit) != 0; }
inline constexpr uint32_t ImmRingSlot(uint32_t imm) { return imm & 0xFFFF; }
inline constexpr uint32_t ImmStripes(uint32_t imm) { return (imm >> 16) & kImmStripeMask; }
// True when `seen` chunks satisfy a frame that needs `needed` (both mod 2^15).
inline constexpr bool StripesArrived(uint64_t seen, uint32_t needed) {
  const uint32_t ahead = (needed - static_cast<uint32_t>(seen)) & kImmStripeMask;
  return ahead == 0 || ahead > kImmStripeMask / 2;
}

// ---- Header rings ----
// Each QP has a ring of `recv_depth` slots of kRingStride bytes on the
// receiver: a frame, then (for frames other than push/reply) up to
// kSmallPayloadMax bytes of payload (error text, control bytes).
inline constexpr size_t kRingStride = 512;
inline constexpr size_t kSmallPayloadMax = kRingStride - core::kFrameBytes;
inline constexpr size_t kMailboxStride = 64;  // one credit counter per cache line

// ---- Bootstrap messages ----
inline constexpr uint32_t kBootMagic = 0x52534D53;  // "SMSR"
// 2: the hello carries the link layer (and a real LID); withdrawals are
// acknowledged (kWithdrawAck) before the slot is deregistered.
// 3: the hello carries the GID type (RoCE v1 / v2 / IB), so a mismatch fails
// at connect instead of after every retry. Other versions are refused at connect.
inline constexpr uint16_t kBootVersion = 3;
inline constexpr int kMaxQpsPerPeer = 2;

enum class BootType : uint16_t {
  kHello = 1,
  kReady = 2,
  kAdvert = 3,
  kWithdraw = 4,
  kGoodbye = 5,
  kWithdrawAck = 6,  // the writer will not touch the withdrawn slot again
};
inline constexpr uint16_t kMaxBootType = 6;

inline constexpr size_t kBootHeaderBytes = 8;  // magic u32, type u16, body length u16
inline constexpr size_t kMaxBootBody = 128;

struct QpAddress {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  std::array<uint8_t, 16> gid{};
  uint16_t lid = 0;
};

struct Hello {
  uint16_t version = kBootVersion;
  core::NodeId node = core::kNoNode;
  uint32_t num_qps = 1;
  uint32_t recv_depth = 0;
  uint8_t mtu = 0;         // enum ibv_mtu
  uint8_t link_layer = 0;  // IBV_LINK_LAYER_*: both ends must match
  uint8_t gid_type = 0;    // enum ibv_gid_type of the QPs' GID: RoCE ends must match
  uint64_t ring_addr = 0;  // remote-writable part of the control block
  uint32_t ring_rkey = 0;
  std::array<QpAddress, kMaxQpsPerPeer> qps{};
};

// A receive slot the peer may write: region `key`, this node's slot.
struct Advert {
  uint64_t key = 0;
  uint64_t addr = 0;
  uint64_t bytes = 0;
  uint32_t rkey = 0;
};

// Encoders return the message length (header included) written into `out`.
size_t EncodeHello(const Hello& hello, std::byte* out);
size_t EncodeAdvert(const Advert& advert, std::byte* out);
size_t EncodeWithdraw(uint64_t key, std::byte* out);
size_t EncodeWithdrawAck(uint64_t key, std::byte* out);
size_t EncodeEmpty(BootType type, std::byte* out);

// Parses a message header; the body length is bounded by kMaxBootBody.
struct BootHeader {
  BootType type;
  uint16_t body_bytes;
};
absl::StatusOr<BootHeader> DecodeBootHeader(const std::byte* in);
absl::StatusOr<Hello> DecodeHello(const std::byte* body, size_t bytes);
absl::StatusOr<Advert> DecodeAdvert(const std::byte* body, size_t bytes);
// A withdrawal or its acknowledgement: the key.
absl::StatusOr<uint64_t> DecodeWithdraw(const std::byte* body, size_t bytes);

}  // namespace stepmesh::rdma
