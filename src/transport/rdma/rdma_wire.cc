#include "src/transport/rdma/rdma_wire.h"

#include "absl/strings/str_cat.h"
#include "src/base/little_endian.h"

namespace stepmesh::rdma {
namespace {

using Reader = base::ByteReader;  // every Get/Bytes fails (false) on a short message
using Writer = base::ByteWriter;

// Writes the header after the body is known.
size_t Finish(std::byte* out, BootType type, size_t body) {
  Writer w(out);
  w.Put<uint32_t>(kBootMagic);
  w.Put<uint16_t>(static_cast<uint16_t>(type));
  w.Put<uint16_t>(static_cast<uint16_t>(body));
  return kBootHeaderBytes + body;
}

absl::Status Malformed(const char* what) {
  return absl::DataLossError(absl::StrCat("rdma bootstrap: malformed ", what));
}

}  // namespace

size_t EncodeHello(const Hello& hello, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  w.Put<uint16_t>(hello.version);
  w.Put<uint32_t>(hello.node);
  w.Put<uint32_t>(hello.num_qps);
  w.Put<uint32_t>(hello.recv_depth);
  w.Put<uint8_t>(hello.mtu);
  w.Put<uint8_t>(hello.link_layer);
  w.Put<uint8_t>(hello.gid_type);
  w.Put<uint64_t>(hello.ring_addr);
  w.Put<uint32_t>(hello.ring_rkey);
  for (uint32_t q = 0; q < hello.num_qps && q < kMaxQpsPerPeer; ++q) {
    w.Put<uint32_t>(hello.qps[q].qpn);
    w.Put<uint32_t>(hello.qps[q].psn);
    w.Bytes(hello.qps[q].gid.data(), 16);
    w.Put<uint16_t>(hello.qps[q].lid);
  }
  return Finish(out, BootType::kHello, w.size());
}

size_t EncodeAdvert(const Advert& advert, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  w.Put<uint64_t>(advert.key);
  w.Put<uint64_t>(advert.addr);
  w.Put<uint64_t>(advert.bytes);
  w.Put<uint32_t>(advert.rkey);
  return Finish(out, BootType::kAdvert, w.size());
}

size_t EncodeWithdraw(uint64_t key, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  w.Put<uint64_t>(key);
  return Finish(out, BootType::kWithdraw, w.size());
}

size_t EncodeWithdrawAck(uint64_t key, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  w.Put<uint64_t>(key);
  return Finish(out, BootType::kWithdrawAck, w.size());
}

size_t EncodeEmpty(BootType type, std::byte* out) { return Finish(out, type, 0); }

absl::StatusOr<BootHeader> DecodeBootHeader(const std::byte* in) {
  Reader r(in, kBootHeaderBytes);
  uint32_t magic;
  uint16_t type;
  uint16_t body;
  r.Get(magic);
  r.Get(type);
  r.Get(body);
  if (magic != kBootMagic) return Malformed("header (bad magic)");
  if (type < 1 || type > kMaxBootType || body > kMaxBootBody) return Malformed("header");
  return BootHeader{static_cast<BootType>(type), body};
}

absl::StatusOr<Hello> DecodeHello(const std::byte* body, size_t bytes) {
  Reader r(body, bytes);
  Hello h;
  // The version comes first so that any other version is named, not misparsed.
  if (!r.Get(h.version)) return Malformed("hello");
  if (h.version != kBootVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("rdma bootstrap: peer speaks version ", h.version, ", not ", kBootVersion));
  }
  if (!r.Get(h.node) || !r.Get(h.num_qps) || !r.Get(h.recv_depth) || !r.Get(h.mtu) ||
      !r.Get(h.link_layer) || !r.Get(h.gid_type) || !r.Get(h.ring_addr) || !r.Get(h.ring_rkey)) {
    return Malformed("hello");
  }
  if (h.num_qps < 1 || h.num_qps > kMaxQpsPerPeer) return Malformed("hello (QP count)");
  for (uint32_t q = 0; q < h.num_qps; ++q) {
    if (!r.Get(h.qps[q].qpn) || !r.Get(h.qps[q].psn) || !r.Bytes(h.qps[q].gid.data(), 16) ||
        !r.Get(h.qps[q].lid)) {
      return Malformed("hello (QP address)");
    }
  }
  if (!r.done()) return Malformed("hello (trailing bytes)");
  return h;
}

absl::StatusOr<Advert> DecodeAdvert(const std::byte* body, size_t bytes) {
  Reader r(body, bytes);
  Advert a;
  if (!r.Get(a.key) || !r.Get(a.addr) || !r.Get(a.bytes) || !r.Get(a.rkey) || !r.done()) {
    return Malformed("advert");
  }
  return a;
}

absl::StatusOr<uint64_t> DecodeWithdraw(const std::byte* body, size_t bytes) {
  Reader r(body, bytes);
  uint64_t key;
  if (!r.Get(key) || !r.done()) return Malformed("withdraw");
  return key;
}

}  // namespace stepmesh::rdma
