// libFuzzer target: the RDMA transport's bootstrap messages (hello, region
// adverts, withdrawals), which it reads from a TCP connection any host that
// can reach the port may open. The input is a message as it arrives: an 8-byte
// header, then the body. Every decoder also sees the body at every length
// (bounds checks). A message that decodes must re-encode to the very same
// body bytes: the decoders accept nothing the encoders would not produce.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "src/transport/rdma/rdma_wire.h"

namespace rdma = ::stepmesh::rdma;

namespace {

void ExpectSameBody(const std::byte* encoded, size_t encoded_bytes, const std::byte* body,
                    size_t body_bytes) {
  if (encoded_bytes != rdma::kBootHeaderBytes + body_bytes) std::abort();
  if (std::memcmp(encoded + rdma::kBootHeaderBytes, body, body_bytes) != 0) std::abort();
  // The encoder's header must decode to the same body length.
  auto header = rdma::DecodeBootHeader(encoded);
  if (!header.ok() || header->body_bytes != body_bytes) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  if (size < rdma::kBootHeaderBytes) {
    // The transport never decodes a short header; the body decoders must
    // still refuse short bodies cleanly.
    (void)rdma::DecodeHello(bytes, size);
    (void)rdma::DecodeAdvert(bytes, size);
    (void)rdma::DecodeWithdraw(bytes, size);
    return 0;
  }
  const std::byte* body = bytes + rdma::kBootHeaderBytes;
  const size_t available = size - rdma::kBootHeaderBytes;
  // Bounds: every decoder on every prefix of what follows the header.
  for (size_t n = 0; n <= available && n <= rdma::kMaxBootBody + 8; ++n) {
    (void)rdma::DecodeHello(body, n);
    (void)rdma::DecodeAdvert(body, n);
    (void)rdma::DecodeWithdraw(body, n);
  }
  auto header = rdma::DecodeBootHeader(bytes);
  if (!header.ok()) return 0;
  if (header->body_bytes > rdma::kMaxBootBody) std::abort();  // the bound it promises
  if (header->body_bytes > available) return 0;               // the reader would wait for more
  const size_t body_bytes = header->body_bytes;
  std::byte out[rdma::kBootHeaderBytes + rdma::kMaxBootBody + 64];
  switch (header->type) {
    case rdma::BootType::kHello: {
      auto hello = rdma::DecodeHello(body, body_bytes);
      if (hello.ok()) ExpectSameBody(out, rdma::EncodeHello(*hello, out), body, body_bytes);
      break;
    }
    case rdma::BootType::kAdvert: {
      auto advert = rdma::DecodeAdvert(body, body_bytes);
      if (advert.ok()) ExpectSameBody(out, rdma::EncodeAdvert(*advert, out), body, body_bytes);
      break;
    }
    case rdma::BootType::kWithdraw: {
      auto key = rdma::DecodeWithdraw(body, body_bytes);
      if (key.ok()) ExpectSameBody(out, rdma::EncodeWithdraw(*key, out), body, body_bytes);
      break;
    }
    default:
      break;
  }
  return 0;
}
