#include "src/transport/rdma/rdma_wire.h"

#include <infiniband/verbs.h>

#include <catch2/catch.hpp>

namespace stepmesh::rdma {
namespace {

TEST_CASE("rdma wire: immediates keep ring slot and stripe count apart", "[rdma][wire]") {
  const uint32_t imm = FrameImm(8191, 0x12345);
  CHECK_FALSE(ImmIsChunk(imm));
  CHECK(ImmRingSlot(imm) == 8191);
  CHECK(ImmStripes(imm) == (0x12345 & kImmStripeMask));
  CHECK(ImmIsChunk(ChunkImm(5)));
  CHECK((ChunkImm(uint64_t{1} << 33 | 7) & kImmChunkMask) == 7);
}

TEST_CASE("rdma wire: stripe counts compare modulo 2^15", "[rdma][wire]") {
  CHECK(StripesArrived(0, 0));
  CHECK_FALSE(StripesArrived(0, 1));
  CHECK(StripesArrived(5, 3));
  CHECK(StripesArrived(0x8000, 0));        // wrapped: 32768 seen satisfies 0
  CHECK_FALSE(StripesArrived(0x7FFF, 0));  // needs one more after the wrap
}

TEST_CASE("rdma wire: hello, advert and withdraw round-trip", "[rdma][wire]") {
  Hello hello{.node = 0x02000003,
              .num_qps = 2,
              .recv_depth = 256,
              .mtu = 5,
              .link_layer = IBV_LINK_LAYER_INFINIBAND,
              .ring_addr = 0x7F0012345000,
              .ring_rkey = 0xCAFE};
  hello.qps[1] = {.qpn = 77, .psn = 0xABCDEF, .lid = 0x1234};
  hello.qps[1].gid[15] = 9;
  std::byte msg[kBootHeaderBytes + kMaxBootBody];
  const size_t n = EncodeHello(hello, msg);
  auto header = DecodeBootHeader(msg);
  REQUIRE(header.ok());
  CHECK(header->type == BootType::kHello);
  REQUIRE(header->body_bytes == n - kBootHeaderBytes);
  auto back = DecodeHello(msg + kBootHeaderBytes, header->body_bytes);
  REQUIRE(back.ok());
  CHECK(back->node == hello.node);
  CHECK(back->ring_addr == hello.ring_addr);
  CHECK(back->qps[1].psn == hello.qps[1].psn);
  CHECK(back->qps[1].gid[15] == 9);
  CHECK(back->qps[1].lid == 0x1234);
  CHECK(back->link_layer == IBV_LINK_LAYER_INFINIBAND);
  CHECK_FALSE(DecodeHello(msg + kBootHeaderBytes, header->body_bytes - 1).ok());

  Advert advert{42, 0x1000, 4096, 0x77};
  const size_t m = EncodeAdvert(advert, msg);
  auto a = DecodeAdvert(msg + kBootHeaderBytes, m - kBootHeaderBytes);
  REQUIRE(a.ok());
  CHECK(a->key == 42);
  CHECK(a->bytes == 4096);
  CHECK(a->rkey == 0x77);

  const size_t w = EncodeWithdraw(9, msg);
  CHECK(*DecodeWithdraw(msg + kBootHeaderBytes, w - kBootHeaderBytes) == 9);
  const size_t k = EncodeWithdrawAck(11, msg);
  auto ack = DecodeBootHeader(msg);
  REQUIRE(ack.ok());
  CHECK(ack->type == BootType::kWithdrawAck);
  CHECK(*DecodeWithdraw(msg + kBootHeaderBytes, k - kBootHeaderBytes) == 11);
  msg[0] = std::byte{0};
  CHECK_FALSE(DecodeBootHeader(msg).ok());
}

TEST_CASE("rdma wire: a hello of another version is named, not misparsed", "[rdma][wire]") {
  Hello hello;
  hello.version = 1;  // before LIDs and withdrawal acknowledgements
  std::byte msg[kBootHeaderBytes + kMaxBootBody];
  const size_t n = EncodeHello(hello, msg);
  auto back = DecodeHello(msg + kBootHeaderBytes, n - kBootHeaderBytes);
  REQUIRE_FALSE(back.ok());
  CHECK(back.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(back.status().message().find("version 1") != absl::string_view::npos);
}

}  // namespace
}  // namespace stepmesh::rdma
