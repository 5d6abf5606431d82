#include "src/transport/rdma/rdma_wire.h"

#include <array>
#include <cstdint>
#include <type_traits>

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

// The encoder's and the decoder's visit of one field: a Put, or a Get that
// fails on a short message. GIDs go as their 16 bytes.
auto Putter(Writer& w) {
  return [&w](const auto& field) {
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::array<uint8_t, 16>>) {
      w.Bytes(field.data(), field.size());
    } else {
      w.Put(field);
    }
    return true;
  };
}
auto Getter(Reader& r) {
  return [&r](auto& field) {
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::array<uint8_t, 16>>) {
      return r.Bytes(field.data(), field.size());
    } else {
      return r.Get(field);
    }
  };
}

// Each message's fields in wire order, once for both directions (`io`: a
// Putter or a Getter; false: the message ended early).
template <typename Io, typename H>
bool HelloFields(Io&& io, H& h) {  // after the version, before the QPs
  return io(h.node) && io(h.num_qps) && io(h.recv_depth) && io(h.mtu) && io(h.link_layer) &&
         io(h.gid_type) && io(h.ring_addr) && io(h.ring_rkey);
}
template <typename Io, typename Q>
bool QpFields(Io&& io, Q& q) {
  return io(q.qpn) && io(q.psn) && io(q.gid) && io(q.lid);
}
template <typename Io, typename A>
bool AdvertFields(Io&& io, A& a) {
  return io(a.key) && io(a.addr) && io(a.bytes) && io(a.rkey);
}

// Withdraw and its ack: the region key alone.
size_t EncodeKey(BootType type, uint64_t key, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  w.Put(key);
  return Finish(out, type, w.size());
}

}  // namespace

size_t EncodeHello(const Hello& hello, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  auto put = Putter(w);
  put(hello.version);
  HelloFields(put, hello);
  for (uint32_t q = 0; q < hello.num_qps && q < kMaxQpsPerPeer; ++q) QpFields(put, hello.qps[q]);
  return Finish(out, BootType::kHello, w.size());
}

size_t EncodeAdvert(const Advert& advert, std::byte* out) {
  Writer w(out + kBootHeaderBytes);
  AdvertFields(Putter(w), advert);
  return Finish(out, BootType::kAdvert, w.size());
}

size_t EncodeWithdraw(uint64_t key, std::byte* out) {
  return EncodeKey(BootType::kWithdraw, key, out);
}

size_t EncodeWithdrawAck(uint64_t key, std::byte* out) {
  return EncodeKey(BootType::kWithdrawAck, key, out);
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
  auto get = Getter(r);
  if (!HelloFields(get, h)) return Malformed("hello");
  if (h.num_qps < 1 || h.num_qps > kMaxQpsPerPeer) return Malformed("hello (QP count)");
  for (uint32_t q = 0; q < h.num_qps; ++q) {
    if (!QpFields(get, h.qps[q])) return Malformed("hello (QP address)");
  }
  if (!r.done()) return Malformed("hello (trailing bytes)");
  return h;
}

absl::StatusOr<Advert> DecodeAdvert(const std::byte* body, size_t bytes) {
  Reader r(body, bytes);
  Advert a;
  if (!AdvertFields(Getter(r), a) || !r.done()) {
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
