// libFuzzer target: the scheduler's reassembly of rendezvous messages from a
// non-blocking socket (ControlAssembler), fed a stream cut at arbitrary split
// points.
//
// Input: byte 0 = k (mod 33) split points, then k little-endian u16 offsets,
// then the stream (fuzz_tcp_stream's format; tests/fuzz/capture_seeds.py
// seeds it with real control streams and the split points their sender used).
// The stream goes to two assemblers, once in one piece and once cut at the
// split points, draining Next() after every piece as the scheduler does.
// Both must yield the same messages (type, fields, re-encoded bytes) and the
// same error; after an error the stream is given up, as the scheduler does.
// Without an error, both hold the same incomplete rest, never more than one
// header and a payload within the limit.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "src/core/control_message.h"

namespace {

using stepmesh::core::ControlAssembler;
using stepmesh::core::ControlMessage;
using stepmesh::core::EncodeControl;

constexpr uint32_t kMaxPayload = 4096;  // small, so the limit is reached

struct Result {
  std::vector<std::string> messages;  // each re-encoded
  absl::StatusCode error = absl::StatusCode::kOk;
  size_t buffered = 0;
};

void Check(bool ok) {
  if (!ok) std::abort();
}

void Drain(ControlAssembler& in, Result& r) {
  // Bounded: each message consumes at least its 12-byte header.
  const size_t most = in.buffered() / 12 + 1;
  for (size_t guard = 0; guard < most; ++guard) {
    absl::StatusOr<std::optional<ControlMessage>> next = in.Next();
    if (!next.ok()) {
      r.error = next.status().code();
      return;
    }
    if (!next->has_value()) return;
    r.messages.push_back(EncodeControl(**next));
  }
  std::abort();  // more messages than bytes
}

Result Run(absl::Span<const std::byte> stream, const std::vector<size_t>& cuts) {
  ControlAssembler in{kMaxPayload};
  Result r;
  size_t from = 0;
  for (size_t i = 0; i <= cuts.size() && r.error == absl::StatusCode::kOk; ++i) {
    const size_t to = i < cuts.size() ? cuts[i] : stream.size();
    if (to < from) continue;
    in.Feed(stream.subspan(from, to - from));
    from = to;
    Drain(in, r);
  }
  r.buffered = in.buffered();
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t k = data[0] % 33;
  if (size < 1 + 2 * k) return 0;
  const absl::Span<const std::byte> stream(reinterpret_cast<const std::byte*>(data) + 1 + 2 * k,
                                           size - 1 - 2 * k);
  std::vector<size_t> cuts;
  for (size_t i = 0; i < k; ++i) {
    const size_t at = data[1 + 2 * i] | (size_t{data[2 + 2 * i]} << 8);
    cuts.push_back(std::min(at, stream.size()));
  }
  std::sort(cuts.begin(), cuts.end());
  const Result whole = Run(stream, {});
  const Result split = Run(stream, cuts);
  Check(whole.error == split.error);
  Check(whole.messages == split.messages);
  if (whole.error == absl::StatusCode::kOk) {
    // Nothing taken that was not a whole message: what is left is buffered,
    // at most a header and a payload within the limit.
    Check(split.buffered == whole.buffered);
    Check(whole.buffered < 12 + kMaxPayload);
  }
  return 0;
}
