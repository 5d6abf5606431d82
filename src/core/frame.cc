#include "src/core/frame.h"

#include "absl/strings/str_cat.h"
#include "src/base/crc32c.h"
#include "src/base/little_endian.h"

namespace stepmesh::core {
namespace {

using base::LoadLittleEndian;
using base::StoreLittleEndian;

// Field offsets of the encoded header; kFrameBytes - 4 holds the CRC32C of the rest.
constexpr size_t kOffMagic = 0, kOffVersion = 4, kOffType = 5, kOffDType = 6, kOffFlags = 7,
                 kOffSrc = 8, kOffDst = 12, kOffKey = 16, kOffRequest = 24, kOffPayload = 32,
                 kOffPullKey = 40, kOffPartIndex = 48, kOffPartCount = 50, kOffStatus = 52,
                 kOffStamps = 56, kOffCrc = kFrameBytes - 4;
constexpr size_t kOffPayloadCrc = kOffCrc - 4;
static_assert(kOffStamps + 5 * 8 == kOffPayloadCrc, "five stamps, the payload CRC, the header CRC");

}  // namespace

bool IsValidFrameType(uint8_t raw) {
  return raw >= static_cast<uint8_t>(FrameType::kPush) &&
         raw <= static_cast<uint8_t>(FrameType::kControl);
}

void EncodeFrame(const FrameHeader& h, std::byte* out) {
  StoreLittleEndian<uint32_t>(out + kOffMagic, kFrameMagic);
  StoreLittleEndian<uint8_t>(out + kOffVersion, kFrameVersion);
  StoreLittleEndian<uint8_t>(out + kOffType, static_cast<uint8_t>(h.type));
  StoreLittleEndian<uint8_t>(out + kOffDType, static_cast<uint8_t>(h.dtype));
  StoreLittleEndian<uint8_t>(out + kOffFlags, h.flags);
  StoreLittleEndian<uint32_t>(out + kOffSrc, h.src);
  StoreLittleEndian<uint32_t>(out + kOffDst, h.dst);
  StoreLittleEndian<uint64_t>(out + kOffKey, h.key);
  StoreLittleEndian<uint64_t>(out + kOffRequest, h.request_id);
  StoreLittleEndian<uint64_t>(out + kOffPayload, h.payload_bytes);
  StoreLittleEndian<uint64_t>(out + kOffPullKey, h.pull_key);
  StoreLittleEndian<uint16_t>(out + kOffPartIndex, h.part_index);
  StoreLittleEndian<uint16_t>(out + kOffPartCount, h.part_count);
  StoreLittleEndian<uint32_t>(out + kOffStatus, h.status_code);
  const uint64_t stamps[5] = {h.stamps.enqueue_ns, h.stamps.post_ns, h.stamps.server_arrival_ns,
                              h.stamps.server_handler_ns, h.stamps.server_reply_ns};
  for (int i = 0; i < 5; ++i) StoreLittleEndian<uint64_t>(out + kOffStamps + 8 * i, stamps[i]);
  StoreLittleEndian<uint32_t>(out + kOffPayloadCrc, h.payload_crc);
  StoreLittleEndian<uint32_t>(out + kOffCrc, base::Crc32c(out, kOffCrc));
}

absl::StatusOr<FrameHeader> DecodeFrame(absl::Span<const std::byte> bytes) {
  if (bytes.size() < kFrameBytes) {
    return absl::DataLossError(
        absl::StrCat("truncated frame: ", bytes.size(), " of ", kFrameBytes, " bytes"));
  }
  const std::byte* in = bytes.data();
  const uint32_t magic = LoadLittleEndian<uint32_t>(in + kOffMagic);
  if (magic != kFrameMagic) {
    return absl::DataLossError(absl::StrCat("bad frame magic 0x", absl::Hex(magic)));
  }
  const uint8_t version = LoadLittleEndian<uint8_t>(in + kOffVersion);
  if (version != kFrameVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "frame version ", version, " not supported (this build speaks ", kFrameVersion, ")"));
  }
  if (LoadLittleEndian<uint32_t>(in + kOffCrc) != base::Crc32c(in, kOffCrc)) {
    return absl::DataLossError("frame checksum mismatch");
  }
  const uint8_t type = LoadLittleEndian<uint8_t>(in + kOffType);
  if (!IsValidFrameType(type)) {
    return absl::DataLossError(absl::StrCat("unknown frame type ", type));
  }
  const uint8_t dtype = LoadLittleEndian<uint8_t>(in + kOffDType);
  if (!IsValidDType(dtype)) return absl::DataLossError(absl::StrCat("unknown dtype ", dtype));

  FrameHeader h;
  h.type = static_cast<FrameType>(type);
  h.dtype = static_cast<DType>(dtype);
  h.flags = LoadLittleEndian<uint8_t>(in + kOffFlags);
  h.src = LoadLittleEndian<uint32_t>(in + kOffSrc);
  h.dst = LoadLittleEndian<uint32_t>(in + kOffDst);
  h.key = LoadLittleEndian<uint64_t>(in + kOffKey);
  h.request_id = LoadLittleEndian<uint64_t>(in + kOffRequest);
  h.payload_bytes = LoadLittleEndian<uint64_t>(in + kOffPayload);
  h.pull_key = LoadLittleEndian<uint64_t>(in + kOffPullKey);
  h.part_index = LoadLittleEndian<uint16_t>(in + kOffPartIndex);
  h.part_count = LoadLittleEndian<uint16_t>(in + kOffPartCount);
  h.status_code = LoadLittleEndian<uint32_t>(in + kOffStatus);
  h.payload_crc = LoadLittleEndian<uint32_t>(in + kOffPayloadCrc);
  h.stamps.enqueue_ns = LoadLittleEndian<uint64_t>(in + kOffStamps);
  h.stamps.post_ns = LoadLittleEndian<uint64_t>(in + kOffStamps + 8);
  h.stamps.server_arrival_ns = LoadLittleEndian<uint64_t>(in + kOffStamps + 16);
  h.stamps.server_handler_ns = LoadLittleEndian<uint64_t>(in + kOffStamps + 24);
  h.stamps.server_reply_ns = LoadLittleEndian<uint64_t>(in + kOffStamps + 32);

  if (h.payload_bytes > kMaxPayloadBytes) {
    return absl::OutOfRangeError(absl::StrCat("frame claims ", h.payload_bytes, " payload bytes"));
  }
  if (h.type == FrameType::kPush && (h.part_count == 0 || h.part_index >= h.part_count)) {
    return absl::DataLossError(
        absl::StrCat("push part ", h.part_index, " of ", h.part_count, " is impossible"));
  }
  if (h.flags & ~uint8_t{kFlagHasPull | kFlagPayloadCrc | kFlagStage}) {
    return absl::DataLossError(absl::StrCat("unknown frame flags 0x", absl::Hex(h.flags)));
  }
  if (!(h.flags & kFlagPayloadCrc) && h.payload_crc != 0) {
    return absl::DataLossError("payload CRC without its flag");
  }
  if ((h.flags & kFlagStage) && h.type != FrameType::kPush) {
    return absl::DataLossError("a stage on a frame that is not a push");
  }
  if (h.type == FrameType::kError && h.status_code == 0) {
    return absl::DataLossError("error frame carries OK status");
  }
  return h;
}

}  // namespace stepmesh::core
