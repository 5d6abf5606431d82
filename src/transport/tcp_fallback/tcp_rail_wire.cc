#include "src/transport/tcp_fallback/tcp_rail_wire.h"

#include <arpa/inet.h>

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "src/base/interfaces.h"
#include "src/base/little_endian.h"
#include "src/base/net.h"
#include "stepmesh/status.h"

namespace stepmesh::tcp::internal {
namespace {

constexpr uint16_t kRailMagic = 0x4c52;  // "RL"

bool IsAddress(const std::string& text) {
  unsigned char buf[16];
  return ::inet_pton(AF_INET, text.c_str(), buf) == 1 ||
         ::inet_pton(AF_INET6, text.c_str(), buf) == 1;
}

}  // namespace

void EncodeRailHeader(const RailHeader& h, std::byte* out) {
  std::fill(out, out + kRailHeaderBytes, std::byte{0});
  base::StoreLittleEndian(out + 0, kRailMagic);
  base::StoreLittleEndian(out + 2, static_cast<uint8_t>(h.kind));
  base::StoreLittleEndian(out + 3, h.piece);
  base::StoreLittleEndian(out + 4, h.pieces);
  base::StoreLittleEndian(out + 8, h.length);
  base::StoreLittleEndian(out + 16, h.seq);
  base::StoreLittleEndian(out + 24, h.offset);
  base::StoreLittleEndian(out + 32, h.ack);
}

absl::StatusOr<RailHeader> DecodeRailHeader(absl::Span<const std::byte> in) {
  if (in.size() != kRailHeaderBytes) return absl::DataLossError("short rail header");
  if (base::LoadLittleEndian<uint16_t>(in.data()) != kRailMagic) {
    return absl::DataLossError("bad rail magic");
  }
  RailHeader h;
  const auto kind = base::LoadLittleEndian<uint8_t>(in.data() + 2);
  if (kind < 1 || kind > 4) return absl::DataLossError(absl::StrCat("rail kind ", kind));
  h.kind = static_cast<RailKind>(kind);
  h.piece = base::LoadLittleEndian<uint8_t>(in.data() + 3);
  h.pieces = base::LoadLittleEndian<uint8_t>(in.data() + 4);
  h.length = base::LoadLittleEndian<uint64_t>(in.data() + 8);
  h.seq = base::LoadLittleEndian<uint64_t>(in.data() + 16);
  h.offset = base::LoadLittleEndian<uint64_t>(in.data() + 24);
  h.ack = base::LoadLittleEndian<uint64_t>(in.data() + 32);
  if (h.pieces < 1 || h.pieces > kMaxRails || h.piece >= h.pieces) {
    return absl::DataLossError(absl::StrCat("rail piece ", h.piece, " of ", h.pieces));
  }
  const bool framed = h.kind == RailKind::kHead || h.kind == RailKind::kChunk;
  if (framed != (h.seq != 0) || (!framed && h.length != 0) ||
      (h.kind == RailKind::kHead) != (h.piece == 0 && framed)) {
    return absl::DataLossError(absl::StrCat("rail message of kind ", kind, " with seq ", h.seq,
                                            ", piece ", h.piece, ", ", h.length, " bytes"));
  }
  return h;
}

Stripes CutPayload(size_t bytes, size_t rails, size_t stripe_min) {
  Stripes s;
  s.piece_bytes = bytes;
  if (rails < 2 || bytes < stripe_min || bytes < 2 * kPieceAlign) return s;
  rails = std::min(rails, kMaxRails);
  const size_t each = (bytes + rails - 1) / rails;
  s.piece_bytes = (each + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  s.pieces = static_cast<uint8_t>((bytes + s.piece_bytes - 1) / s.piece_bytes);
  return s;
}

absl::StatusOr<std::vector<std::string>> ResolveRails(const std::string& list) {
  std::vector<std::string> out;
  absl::flat_hash_set<std::string> seen;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    const std::string entry(absl::StripAsciiWhitespace(part));
    std::string address = entry;
    if (!IsAddress(entry)) {
      absl::StatusOr<std::string> of = base::InterfaceAddressOf(entry);
      if (!of.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tcp_rails (STEPMESH_TCP_RAILS) entry '", entry,
            "' is neither an address nor an interface with one: ", of.status().message()));
      }
      address = *of;
    }
    if (!seen.insert(address).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tcp_rails (STEPMESH_TCP_RAILS) names ", address, " twice ('", list, "')"));
    }
    out.push_back(address);
  }
  if (out.size() > kMaxRails) {
    return absl::InvalidArgumentError(absl::StrCat("tcp_rails (STEPMESH_TCP_RAILS) = '", list,
                                                   "': ", out.size(), " rails, want at most ",
                                                   kMaxRails));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> SplitRailEndpoint(const std::string& endpoint) {
  std::vector<std::string> out = absl::StrSplit(endpoint, ',', absl::SkipEmpty());
  if (out.empty() || out.size() > kMaxRails) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp endpoint '", endpoint, "': want 1..", kMaxRails, " host:port"));
  }
  for (const std::string& part : out) {
    STEPMESH_RETURN_IF_ERROR(base::ParseHostPort(part).status());
  }
  return out;
}

}  // namespace stepmesh::tcp::internal
