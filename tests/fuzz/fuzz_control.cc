// libFuzzer target: the rendezvous message decoder (header + payload), which
// the scheduler runs on bytes from any client that can reach its port.
// Decoded messages must survive an encode/decode round trip unchanged.

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "src/core/control_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace stepmesh::core;
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  const absl::Span<const std::byte> input(bytes, size);
  auto header = DecodeControlHeader(input);
  if (!header.ok()) return 0;
  const absl::Span<const std::byte> rest = input.subspan(std::min(size, kControlHeaderBytes));
  // The real reader takes exactly `length` bytes; the fuzzer also feeds the
  // decoder payloads of the wrong length to exercise its bounds checks.
  const absl::Span<const std::byte> payload = rest.subspan(0, header->second);
  absl::StatusOr<ControlMessage> m = DecodeControlPayload(header->first, payload);
  (void)DecodeControlPayload(header->first, rest);
  if (!m.ok()) return 0;
  const std::string encoded = EncodeControl(*m);
  const auto* e = reinterpret_cast<const std::byte*>(encoded.data());
  auto h2 = DecodeControlHeader(absl::MakeConstSpan(e, encoded.size()));
  if (!h2.ok() || h2->first != m->type) std::abort();
  auto m2 = DecodeControlPayload(
      h2->first,
      absl::MakeConstSpan(e + kControlHeaderBytes, encoded.size() - kControlHeaderBytes));
  if (!m2.ok() || m2->text != m->text || m2->roster.size() != m->roster.size() ||
      m2->sequence != m->sequence || m2->node != m->node || m2->rank != m->rank) {
    std::abort();
  }
  return 0;
}
