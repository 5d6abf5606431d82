#pragma once
// The libfabric transport's two wires:
//  * Immediate data (FI_REMOTE_CQ_DATA, 32 bits, the least every provider
//    offers -- EFA has 4 bytes): [tag:12][seq:20]. `tag` names the writer at
//    the receiver (the receiver hands each peer its tag in its hello); `seq`
//    is the writer's frame number to that receiver. Every payload chunk of a
//    frame carries the same value: the receiver counts them.
//  * Control messages, carried in order over the control connection (a TCP
//    transport) as transport-private error frames (kCarrierKey): hellos,
//    region adverts and withdrawals, frame descriptors (the stepmesh header,
//    the chunk count, an inline payload), and aborts.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "src/core/frame.h"

namespace stepmesh::libfabric {

inline constexpr uint32_t kTagBits = 12;
inline constexpr uint32_t kSeqBits = 20;
inline constexpr uint32_t kMaxTags = 1u << kTagBits;
inline constexpr uint32_t kSeqMask = (1u << kSeqBits) - 1;
inline constexpr uint32_t Immediate(uint32_t tag, uint32_t seq) {
  return tag << kSeqBits | (seq & kSeqMask);
}
inline constexpr uint32_t ImmediateTag(uint64_t data) {
  return static_cast<uint32_t>(data >> kSeqBits) & (kMaxTags - 1);
}
inline constexpr uint32_t ImmediateSeq(uint64_t data) {
  return static_cast<uint32_t>(data) & kSeqMask;
}

// The `key` of the control connection's carrier frames ("LIBFABRI").
inline constexpr uint64_t kCarrierKey = 0x4952424146424C49ull;
// The most rails a hello or advert may list (kMaxRails, fabric_endpoint.h).
inline constexpr uint8_t kMaxWireRails = 32;
inline constexpr uint32_t kWireVersion = 3;  // 2: rails (a list of addresses, keys); 3: your_epoch
// A carrier's body is an error frame's text, at most core::kMaxErrorTextBytes.
inline constexpr size_t kMaxControlBytes = 4096;

enum class ControlType : uint8_t {
  kHello = 1,
  kAdvert = 2,
  kWithdraw = 3,
  kFrame = 4,
  kAbort = 5,
  kExpel = 6,  // the sender broke the protocol: the receiver dropped it
};

struct Hello {
  uint32_t version = kWireVersion;
  uint64_t epoch = 0;     // random per transport instance: a restart is a new peer
  uint32_t your_tag = 0;  // the tag the receiver of this hello writes to the sender with
  // The receiver's process the tag was given to (its hello's epoch), 0 when
  // none had said hello yet: a hello made for a process that has since been
  // restarted reaches the new one with the old one's epoch and is ignored.
  uint64_t your_epoch = 0;
  std::string provider;
  std::vector<std::string> addresses;  // raw fi_getname bytes, one per rail
};

struct Advert {
  uint64_t key = 0;
  uint64_t addr = 0;  // a virtual address (FI_MR_VIRT_ADDR) or 0 (offset into the MR)
  uint64_t bytes = 0;
  std::vector<uint64_t> mr_keys;  // one per rail of the advertising node
};

struct FrameDescriptor {
  uint32_t seq = 0;
  uint32_t chunks = 0;  // payload writes to count; 0: the payload is `inline_bytes`
  core::FrameHeader header;
  std::string inline_bytes;  // error texts, small unregistered payloads
};
// The inline payload a descriptor can carry.
inline constexpr size_t kMaxInlineBytes = kMaxControlBytes - 1 - 8 - core::kFrameBytes;

struct ControlMessage {
  ControlType type = ControlType::kHello;
  Hello hello;
  Advert advert;          // kAdvert; kWithdraw uses advert.key
  FrameDescriptor frame;  // kFrame; kAbort uses frame.seq
  std::string reason;     // kExpel, kAbort
};

std::string EncodeHello(const Hello& hello);
std::string EncodeAdvert(const Advert& advert);
std::string EncodeWithdraw(uint64_t key);
std::string EncodeFrame(const FrameDescriptor& frame);
std::string EncodeAbort(uint32_t seq, absl::string_view reason);
std::string EncodeExpel(absl::string_view reason);
// Untrusted bytes: every field bounds checked, the header CRC-checked.
absl::StatusOr<ControlMessage> DecodeControl(absl::string_view bytes);

}  // namespace stepmesh::libfabric
