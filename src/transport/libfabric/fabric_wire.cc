#include "src/transport/libfabric/fabric_wire.h"

#include "absl/strings/str_cat.h"
#include "src/base/little_endian.h"

namespace stepmesh::libfabric {

using base::AppendLittleEndian;

namespace {

void AppendBytes(std::string& out, absl::string_view bytes) {
  AppendLittleEndian<uint16_t>(out, static_cast<uint16_t>(bytes.size()));
  out.append(bytes.data(), bytes.size());
}

bool GetBytes(base::ByteReader& r, std::string& out) {
  uint16_t n = 0;
  if (!r.Get(n)) return false;
  out.resize(n);
  return r.Bytes(out.data(), n);
}

std::string Start(ControlType type) {
  std::string out;
  out.push_back(static_cast<char>(type));
  return out;
}

}  // namespace

std::string EncodeHello(const Hello& hello) {
  std::string out = Start(ControlType::kHello);
  AppendLittleEndian(out, hello.version);
  AppendLittleEndian(out, hello.epoch);
  AppendLittleEndian(out, hello.your_tag);
  AppendLittleEndian(out, hello.your_epoch);
  AppendBytes(out, hello.provider);
  AppendLittleEndian<uint8_t>(out, static_cast<uint8_t>(hello.addresses.size()));
  for (const std::string& a : hello.addresses) AppendBytes(out, a);
  return out;
}

std::string EncodeAdvert(const Advert& advert) {
  std::string out = Start(ControlType::kAdvert);
  AppendLittleEndian(out, advert.key);
  AppendLittleEndian(out, advert.addr);
  AppendLittleEndian(out, advert.bytes);
  AppendLittleEndian<uint8_t>(out, static_cast<uint8_t>(advert.mr_keys.size()));
  for (uint64_t k : advert.mr_keys) AppendLittleEndian(out, k);
  return out;
}

std::string EncodeWithdraw(uint64_t key) {
  std::string out = Start(ControlType::kWithdraw);
  AppendLittleEndian(out, key);
  return out;
}

std::string EncodeFrame(const FrameDescriptor& frame) {
  std::string out = Start(ControlType::kFrame);
  AppendLittleEndian(out, frame.seq);
  AppendLittleEndian(out, frame.chunks);
  const core::FrameBytes header = core::EncodeFrame(frame.header);
  out.append(reinterpret_cast<const char*>(header.data()), header.size());
  out.append(frame.inline_bytes);
  return out;
}

std::string EncodeAbort(uint32_t seq, absl::string_view reason) {
  std::string out = Start(ControlType::kAbort);
  AppendLittleEndian(out, seq);
  AppendBytes(out, reason.substr(0, 1024));
  return out;
}

std::string EncodeExpel(absl::string_view reason) {
  std::string out = Start(ControlType::kExpel);
  AppendBytes(out, reason.substr(0, 1024));
  return out;
}

absl::StatusOr<ControlMessage> DecodeControl(absl::string_view bytes) {
  base::ByteReader r(bytes.data(), bytes.size());
  uint8_t raw_type = 0;
  ControlMessage m;
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("libfabric: malformed control message (", what, ")"));
  };
  if (!r.Get(raw_type)) return bad("empty");
  m.type = static_cast<ControlType>(raw_type);
  uint8_t rails = 0;  // hello, advert
  switch (m.type) {
    case ControlType::kHello:
      if (!r.Get(m.hello.version)) return bad("hello");
      if (m.hello.version != kWireVersion) {
        return absl::FailedPreconditionError(absl::StrCat("libfabric: peer speaks version ",
                                                          m.hello.version, ", not ", kWireVersion));
      }
      if (!r.Get(m.hello.epoch) || !r.Get(m.hello.your_tag) || !r.Get(m.hello.your_epoch) ||
          !GetBytes(r, m.hello.provider) || !r.Get(rails) || rails == 0 || rails > kMaxWireRails ||
          m.hello.your_tag >= kMaxTags) {
        return bad("hello");
      }
      m.hello.addresses.resize(rails);
      for (std::string& a : m.hello.addresses) {
        if (!GetBytes(r, a) || a.empty()) return bad("hello address");
      }
      break;
    case ControlType::kAdvert:
      if (!r.Get(m.advert.key) || !r.Get(m.advert.addr) || !r.Get(m.advert.bytes) ||
          !r.Get(rails) || rails == 0 || rails > kMaxWireRails) {
        return bad("advert");
      }
      m.advert.mr_keys.resize(rails);
      for (uint64_t& k : m.advert.mr_keys) {
        if (!r.Get(k)) return bad("advert key");
      }
      break;
    case ControlType::kWithdraw:
      if (!r.Get(m.advert.key)) return bad("withdraw");
      break;
    case ControlType::kAbort:
      if (!r.Get(m.frame.seq) || !GetBytes(r, m.reason)) return bad("abort");
      break;
    case ControlType::kExpel:
      if (!GetBytes(r, m.reason)) return bad("expel");
      break;
    case ControlType::kFrame: {
      if (!r.Get(m.frame.seq) || !r.Get(m.frame.chunks)) return bad("frame");
      const std::byte* header = r.Take(core::kFrameBytes);
      if (header == nullptr) return bad("frame header");
      absl::StatusOr<core::FrameHeader> decoded =
          core::DecodeFrame(absl::MakeConstSpan(header, core::kFrameBytes));
      if (!decoded.ok()) return bad(decoded.status().message());
      m.frame.header = *decoded;
      m.frame.inline_bytes.resize(r.remaining());
      r.Bytes(m.frame.inline_bytes.data(), m.frame.inline_bytes.size());
      if (m.frame.chunks > 0 && !m.frame.inline_bytes.empty()) return bad("chunks and inline");
      if (m.frame.chunks == 0 && m.frame.inline_bytes.size() != m.frame.header.payload_bytes) {
        return bad("inline payload size");
      }
      return m;
    }
    default:
      return bad(absl::StrCat("type ", raw_type));
  }
  if (!r.done()) return bad("trailing bytes");
  return m;
}

}  // namespace stepmesh::libfabric
