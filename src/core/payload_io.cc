#include "src/core/payload_io.h"

#include "absl/strings/str_cat.h"
#include "src/base/crc32c.h"

namespace stepmesh::core {

absl::Status PayloadIo::StageOut(const WireTensor& t, const void* tensor, size_t offset,
                                 size_t bytes) const {
  if (!t.staged || bytes == 0) return absl::OkStatus();
  return backend_.Copy(t.wire + offset, static_cast<const std::byte*>(tensor) + offset, bytes);
}

absl::Status PayloadIo::StageIn(const WireTensor& t, void* tensor, size_t offset,
                                size_t bytes) const {
  if (t.device_direct && bytes != 0) return backend_.FlushRemoteWrites();
  if (!t.staged || bytes == 0) return absl::OkStatus();
  return backend_.Copy(static_cast<std::byte*>(tensor) + offset, t.wire + offset, bytes);
}

void PayloadIo::Seal(FrameHeader& h, const WireTensor& t, const std::byte* src) const {
  h.flags &= static_cast<uint8_t>(~kFlagPayloadCrc);
  h.payload_crc = 0;
  if (!payload_checksum_ || t.device_direct || h.payload_bytes == 0) return;
  h.flags |= kFlagPayloadCrc;
  h.payload_crc = base::Crc32c(src, h.payload_bytes);
}

absl::Status PayloadIo::Check(const FrameHeader& h, const WireTensor& t,
                              const std::byte* landed) const {
  if (!(h.flags & kFlagPayloadCrc) || t.device_direct) return absl::OkStatus();
  const uint32_t crc = base::Crc32c(landed, h.payload_bytes);
  if (crc == h.payload_crc) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "payload checksum mismatch under key ", h.key, " (", h.payload_bytes,
      " bytes: sent CRC32C 0x", absl::Hex(h.payload_crc), ", received 0x", absl::Hex(crc), ")"));
}

}  // namespace stepmesh::core
