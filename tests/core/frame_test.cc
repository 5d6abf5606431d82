#include "src/core/frame.h"

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "src/base/crc32c.h"
#include "src/core/control_message.h"

namespace stepmesh::core {
namespace {

FrameHeader SampleHeader() {
  FrameHeader h;
  h.type = FrameType::kPush;
  h.dtype = DType::kFloat8E4M3;
  h.flags = kFlagHasPull | kFlagPayloadCrc;
  h.payload_crc = 0xA1B2C3D4;
  h.src = WorkerId(3);
  h.dst = ServerId(1);
  h.key = 0x1122334455667788ull;
  h.request_id = (uint64_t{7} << 32) | 9;
  h.payload_bytes = 917504;
  h.pull_key = 42;
  h.part_index = 1;
  h.part_count = 3;
  h.stamps = {1, 2, 3, 4, 5, 0};
  return h;
}

TEST_CASE("frame round trip keeps every field", "[frame]") {
  const FrameHeader in = SampleHeader();
  const FrameBytes bytes = EncodeFrame(in);
  auto out = DecodeFrame(bytes);
  REQUIRE(out.ok());
  CHECK(out->type == in.type);
  CHECK(out->dtype == in.dtype);
  CHECK(out->flags == in.flags);
  CHECK(out->src == in.src);
  CHECK(out->dst == in.dst);
  CHECK(out->key == in.key);
  CHECK(out->request_id == in.request_id);
  CHECK(out->payload_bytes == in.payload_bytes);
  CHECK(out->pull_key == in.pull_key);
  CHECK(out->part_index == in.part_index);
  CHECK(out->part_count == in.part_count);
  CHECK(out->payload_crc == 0xA1B2C3D4);
  CHECK(out->stamps.enqueue_ns == 1);
  CHECK(out->stamps.server_reply_ns == 5);
  CHECK(out->stamps.reply_arrival_ns == 0);
}

TEST_CASE("a push's stage travels in status_code, and only on a push", "[frame][stage]") {
  FrameHeader in = SampleHeader();
  in.flags |= kFlagStage;
  in.status_code = 0xFFFFFFF0u;  // stages use all 32 bits
  auto out = DecodeFrame(EncodeFrame(in));
  REQUIRE(out.ok());
  CHECK((out->flags & kFlagStage) != 0);
  CHECK(out->status_code == 0xFFFFFFF0u);
  in.type = FrameType::kReply;
  const absl::Status refused = DecodeFrame(EncodeFrame(in)).status();
  CHECK(absl::IsDataLoss(refused));
  CHECK(absl::StrContains(refused.message(), "stage"));
}

TEST_CASE("frame decoder rejects truncated frames", "[frame]") {
  const FrameBytes bytes = EncodeFrame(SampleHeader());
  for (size_t n : {size_t{0}, size_t{1}, kFrameBytes / 2, kFrameBytes - 1}) {
    auto out = DecodeFrame(absl::MakeConstSpan(bytes.data(), n));
    CHECK(absl::IsDataLoss(out.status()));
  }
}

TEST_CASE("frame decoder rejects wrong magic, version and corruption", "[frame]") {
  FrameBytes bytes = EncodeFrame(SampleHeader());
  SECTION("magic") {
    bytes[0] ^= std::byte{0xFF};
    CHECK(absl::IsDataLoss(DecodeFrame(bytes).status()));
  }
  SECTION("version") {
    bytes[4] = std::byte{kFrameVersion + 1};
    auto out = DecodeFrame(bytes);
    CHECK(absl::IsFailedPrecondition(out.status()));
    CHECK(std::string(out.status().message()).find("version") != std::string::npos);
  }
  SECTION("any flipped bit fails the checksum") {
    for (size_t i = 8; i < kFrameBytes - 4; i += 7) {
      FrameBytes copy = bytes;
      copy[i] ^= std::byte{0x10};
      CHECK_FALSE(DecodeFrame(copy).ok());
    }
  }
}

TEST_CASE("frame decoder rejects impossible fields even with a valid checksum", "[frame]") {
  SECTION("oversized payload") {
    FrameHeader h = SampleHeader();
    h.payload_bytes = kMaxPayloadBytes + 1;
    CHECK(absl::IsOutOfRange(DecodeFrame(EncodeFrame(h)).status()));
  }
  SECTION("part index past count") {
    FrameHeader h = SampleHeader();
    h.part_index = 3;
    CHECK(absl::IsDataLoss(DecodeFrame(EncodeFrame(h)).status()));
  }
  SECTION("unknown type and dtype") {
    FrameHeader h = SampleHeader();
    h.type = static_cast<FrameType>(99);
    CHECK(absl::IsDataLoss(DecodeFrame(EncodeFrame(h)).status()));
    h = SampleHeader();
    h.dtype = static_cast<DType>(0);
    CHECK(absl::IsDataLoss(DecodeFrame(EncodeFrame(h)).status()));
  }
  SECTION("a payload CRC without its flag") {
    FrameHeader h = SampleHeader();
    h.flags = kFlagHasPull;
    CHECK(absl::IsDataLoss(DecodeFrame(EncodeFrame(h)).status()));
  }
  SECTION("error frame with OK status") {
    FrameHeader h = SampleHeader();
    h.type = FrameType::kError;
    h.status_code = 0;
    CHECK(absl::IsDataLoss(DecodeFrame(EncodeFrame(h)).status()));
  }
}

TEST_CASE("crc32c matches the standard check value", "[frame]") {
  CHECK(base::Crc32c("123456789", 9) == 0xE3069283u);
  // Lengths around the 8-byte stride of the hardware path agree with chaining.
  const std::string text = "The quick brown fox jumps over the lazy dog";
  for (size_t split = 0; split <= text.size(); ++split) {
    const uint32_t whole = base::Crc32c(text.data(), text.size());
    const uint32_t chained =
        base::Crc32c(text.data() + split, text.size() - split, base::Crc32c(text.data(), split));
    CHECK(whole == chained);
  }
  CHECK(base::Crc32c(text.data(), text.size()) == 0x22620404u);
}

TEST_CASE("control messages round trip and reject garbage", "[control]") {
  ControlMessage roster;
  roster.type = ControlType::kRoster;
  roster.rank = 1;
  roster.epoch = 3;
  roster.sequence = 2;
  roster.roster = {{WorkerId(0), "127.0.0.1:5000"}, {ServerId(0), "127.0.0.1:5001"}};
  const std::string bytes = EncodeControl(roster);
  auto span = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
  auto header = DecodeControlHeader(span.subspan(0, kControlHeaderBytes));
  REQUIRE(header.ok());
  auto decoded = DecodeControlPayload(header->first, span.subspan(kControlHeaderBytes));
  REQUIRE(decoded.ok());
  CHECK(decoded->rank == 1);
  CHECK(decoded->epoch == 3);
  CHECK(decoded->sequence == 2);
  REQUIRE(decoded->roster.size() == 2);
  CHECK(decoded->roster[1].endpoint == "127.0.0.1:5001");

  // Truncated payload, trailing bytes, and a string longer than the payload.
  CHECK_FALSE(DecodeControlPayload(header->first, span.subspan(kControlHeaderBytes, 5)).ok());
  std::string longer = bytes + "x";
  auto longer_span =
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(longer.data()), longer.size());
  CHECK_FALSE(DecodeControlPayload(header->first, longer_span.subspan(kControlHeaderBytes)).ok());
  std::string bad = bytes;
  // first endpoint length: after rank, epoch, barrier count, entries, node
  bad[kControlHeaderBytes + 28] = '\x7f';
  auto bad_span = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bad.data()), bad.size());
  CHECK_FALSE(DecodeControlPayload(header->first, bad_span.subspan(kControlHeaderBytes)).ok());
  std::string wrong_magic = bytes;
  wrong_magic[0] = 'X';
  CHECK_FALSE(DecodeControlHeader(
                  absl::MakeConstSpan(reinterpret_cast<const std::byte*>(wrong_magic.data()),
                                      kControlHeaderBytes))
                  .ok());
}

TEST_CASE("kPeerLeft needs control protocol 3: a version-2 header is refused by version",
          "[control]") {
  ControlMessage left;
  left.type = ControlType::kPeerLeft;
  left.node = WorkerId(1);
  std::string bytes = EncodeControl(left);
  auto header = DecodeControlHeader(
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bytes.data()), kControlHeaderBytes));
  REQUIRE(header.ok());
  CHECK(header->first == ControlType::kPeerLeft);
  CHECK(kControlVersion >= 3);
  // A participant built before kPeerLeft speaks version 2 (bytes 4-5, little endian).
  bytes[4] = '\x02';
  bytes[5] = '\x00';
  auto old = DecodeControlHeader(
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(bytes.data()), kControlHeaderBytes));
  REQUIRE_FALSE(old.ok());
  CHECK(old.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(old.status().message() == "control protocol version 2");
}

}  // namespace
}  // namespace stepmesh::core
