#include "src/core/frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace stepmesh::core {
namespace {

// Field offsets of the encoded header; kFrameBytes - 4 holds the CRC32C of the rest.
constexpr size_t kOffMagic = 0, kOffVersion = 4, kOffType = 5, kOffDType = 6, kOffFlags = 7,
                 kOffSrc = 8, kOffDst = 12, kOffKey = 16, kOffRequest = 24, kOffPayload = 32,
                 kOffPullKey = 40, kOffPartIndex = 48, kOffPartCount = 50, kOffStatus = 52,
                 kOffStamps = 56, kOffCrc = kFrameBytes - 4;
constexpr size_t kOffPayloadCrc = kOffCrc - 4;
static_assert(kOffStamps + 5 * 8 == kOffPayloadCrc, "five stamps, the payload CRC, the header CRC");

template <typename T>
void Put(std::byte* out, size_t offset, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out[offset + i] = static_cast<std::byte>((static_cast<uint64_t>(value) >> (8 * i)) & 0xFF);
  }
}

template <typename T>
T Get(const std::byte* in, size_t offset) {
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<uint64_t>(in[offset + i]) << (8 * i);
  }
  return static_cast<T>(value);
}

struct Crc32cTable {
  uint32_t entries[256];
  constexpr Crc32cTable() : entries() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      entries[i] = c;
    }
  }
};
constexpr Crc32cTable kCrcTable;

}  // namespace

uint32_t Crc32cPortable(const uint8_t* p, size_t bytes, uint32_t crc) {
  for (size_t i = 0; i < bytes; ++i) crc = kCrcTable.entries[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// SSE4.2 has CRC32C in hardware: ~20x faster than the table on a 100-byte header.
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const uint8_t* p, size_t bytes,
                                                       uint32_t crc) {
  uint64_t c = crc;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; bytes > 0; --bytes, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
const bool kHaveSse42 = __builtin_cpu_supports("sse4.2");
#endif

uint32_t Crc32c(const void* data, size_t bytes, uint32_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (kHaveSse42) return ~Crc32cSse42(p, bytes, ~seed);
#endif
  return ~Crc32cPortable(p, bytes, ~seed);
}

bool IsValidFrameType(uint8_t raw) {
  return raw >= static_cast<uint8_t>(FrameType::kPush) &&
         raw <= static_cast<uint8_t>(FrameType::kControl);
}

void EncodeFrame(const FrameHeader& h, std::byte* out) {
  Put<uint32_t>(out, kOffMagic, kFrameMagic);
  Put<uint8_t>(out, kOffVersion, kFrameVersion);
  Put<uint8_t>(out, kOffType, static_cast<uint8_t>(h.type));
  Put<uint8_t>(out, kOffDType, static_cast<uint8_t>(h.dtype));
  Put<uint8_t>(out, kOffFlags, h.flags);
  Put<uint32_t>(out, kOffSrc, h.src);
  Put<uint32_t>(out, kOffDst, h.dst);
  Put<uint64_t>(out, kOffKey, h.key);
  Put<uint64_t>(out, kOffRequest, h.request_id);
  Put<uint64_t>(out, kOffPayload, h.payload_bytes);
  Put<uint64_t>(out, kOffPullKey, h.pull_key);
  Put<uint16_t>(out, kOffPartIndex, h.part_index);
  Put<uint16_t>(out, kOffPartCount, h.part_count);
  Put<uint32_t>(out, kOffStatus, h.status_code);
  const uint64_t stamps[5] = {h.stamps.enqueue_ns, h.stamps.post_ns, h.stamps.server_arrival_ns,
                              h.stamps.server_handler_ns, h.stamps.server_reply_ns};
  for (int i = 0; i < 5; ++i) Put<uint64_t>(out, kOffStamps + 8 * i, stamps[i]);
  Put<uint32_t>(out, kOffPayloadCrc, h.payload_crc);
  Put<uint32_t>(out, kOffCrc, Crc32c(out, kOffCrc));
}

absl::StatusOr<FrameHeader> DecodeFrame(absl::Span<const std::byte> bytes) {
  if (bytes.size() < kFrameBytes) {
    return absl::DataLossError(
        absl::StrCat("truncated frame: ", bytes.size(), " of ", kFrameBytes, " bytes"));
  }
  const std::byte* in = bytes.data();
  const uint32_t magic = Get<uint32_t>(in, kOffMagic);
  if (magic != kFrameMagic) {
    return absl::DataLossError(absl::StrCat("bad frame magic 0x", absl::Hex(magic)));
  }
  const uint8_t version = Get<uint8_t>(in, kOffVersion);
  if (version != kFrameVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "frame version ", version, " not supported (this build speaks ", kFrameVersion, ")"));
  }
  if (Get<uint32_t>(in, kOffCrc) != Crc32c(in, kOffCrc)) {
    return absl::DataLossError("frame checksum mismatch");
  }
  const uint8_t type = Get<uint8_t>(in, kOffType);
  if (!IsValidFrameType(type)) {
    return absl::DataLossError(absl::StrCat("unknown frame type ", type));
  }
  const uint8_t dtype = Get<uint8_t>(in, kOffDType);
  if (!IsValidDType(dtype)) return absl::DataLossError(absl::StrCat("unknown dtype ", dtype));

  FrameHeader h;
  h.type = static_cast<FrameType>(type);
  h.dtype = static_cast<DType>(dtype);
  h.flags = Get<uint8_t>(in, kOffFlags);
  h.src = Get<uint32_t>(in, kOffSrc);
  h.dst = Get<uint32_t>(in, kOffDst);
  h.key = Get<uint64_t>(in, kOffKey);
  h.request_id = Get<uint64_t>(in, kOffRequest);
  h.payload_bytes = Get<uint64_t>(in, kOffPayload);
  h.pull_key = Get<uint64_t>(in, kOffPullKey);
  h.part_index = Get<uint16_t>(in, kOffPartIndex);
  h.part_count = Get<uint16_t>(in, kOffPartCount);
  h.status_code = Get<uint32_t>(in, kOffStatus);
  h.payload_crc = Get<uint32_t>(in, kOffPayloadCrc);
  h.stamps.enqueue_ns = Get<uint64_t>(in, kOffStamps);
  h.stamps.post_ns = Get<uint64_t>(in, kOffStamps + 8);
  h.stamps.server_arrival_ns = Get<uint64_t>(in, kOffStamps + 16);
  h.stamps.server_handler_ns = Get<uint64_t>(in, kOffStamps + 24);
  h.stamps.server_reply_ns = Get<uint64_t>(in, kOffStamps + 32);

  if (h.payload_bytes > kMaxPayloadBytes) {
    return absl::OutOfRangeError(absl::StrCat("frame claims ", h.payload_bytes, " payload bytes"));
  }
  if (h.type == FrameType::kPush && (h.part_count == 0 || h.part_index >= h.part_count)) {
    return absl::DataLossError(
        absl::StrCat("push part ", h.part_index, " of ", h.part_count, " is impossible"));
  }
  if (h.flags & ~uint8_t{kFlagHasPull | kFlagPayloadCrc}) {
    return absl::DataLossError(absl::StrCat("unknown frame flags 0x", absl::Hex(h.flags)));
  }
  if (!(h.flags & kFlagPayloadCrc) && h.payload_crc != 0) {
    return absl::DataLossError("payload CRC without its flag");
  }
  if (h.type == FrameType::kError && h.status_code == 0) {
    return absl::DataLossError("error frame carries OK status");
  }
  return h;
}

}  // namespace stepmesh::core
