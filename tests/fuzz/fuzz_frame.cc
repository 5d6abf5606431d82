// libFuzzer target: the wire-frame decoder. Any byte string must decode to a
// clear status or to a header that re-encodes to the very same bytes (the
// decoder accepts nothing the encoder would not produce, bar reserved bytes).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "src/core/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace stepmesh::core;
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  absl::StatusOr<FrameHeader> header = DecodeFrame(absl::MakeConstSpan(bytes, size));
  if (!header.ok()) return 0;
  FrameBytes again = EncodeFrame(*header);
  absl::StatusOr<FrameHeader> round = DecodeFrame(again);
  if (!round.ok()) std::abort();  // the encoder produced something the decoder refuses
  if (round->key != header->key || round->request_id != header->request_id ||
      round->payload_bytes != header->payload_bytes || round->src != header->src ||
      round->type != header->type || round->part_count != header->part_count) {
    std::abort();
  }
  // Everything but the reserved word (and hence the CRC) must match the input.
  if (std::memcmp(again.data(), data, kFrameBytes - 8) != 0) std::abort();
  return 0;
}
