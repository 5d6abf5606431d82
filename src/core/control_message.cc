#include "src/core/control_message.h"

#include "absl/strings/str_cat.h"
#include "src/base/little_endian.h"
#include "src/base/net.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

constexpr uint32_t kMaxRosterEntries = 1 << 14;
constexpr uint32_t kMaxText = 64 * 1024;

// Fields are appended to a growing message.
class Writer {
 public:
  template <typename T>
  void Int(T v) {
    base::AppendLittleEndian(out_, v);
  }
  void Text(const std::string& s) {
    Int<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

// Fields are read from untrusted bytes; a short read is DATA_LOSS.
class Reader {
 public:
  explicit Reader(absl::Span<const std::byte> in) : in_(in.data(), in.size()) {}
  template <typename T>
  absl::StatusOr<T> Int() {
    T v;
    if (!in_.Get(v)) return absl::DataLossError("control message truncated");
    return v;
  }
  absl::StatusOr<std::string> Text() {
    STEPMESH_ASSIGN_OR_RETURN(uint32_t n, Int<uint32_t>());
    const std::byte* text = n > kMaxText ? nullptr : in_.Take(n);
    if (text == nullptr) return absl::DataLossError("control message string overruns the payload");
    return std::string(reinterpret_cast<const char*>(text), n);
  }
  absl::Status Finish() const {
    if (!in_.done()) return absl::DataLossError("trailing bytes in control message");
    return absl::OkStatus();
  }

 private:
  base::ByteReader in_;
};

}  // namespace

std::string EncodeControl(const ControlMessage& m) {
  Writer payload;
  switch (m.type) {
    case ControlType::kJoin:
      payload.Int<uint8_t>(m.role);
      payload.Int<int32_t>(m.rank);
      payload.Text(m.text);
      payload.Int<uint32_t>(m.num_workers);
      payload.Int<uint32_t>(m.num_servers);
      payload.Int<uint32_t>(m.max_workers);
      payload.Int<uint32_t>(m.max_servers);
      payload.Text(m.mesh_id);
      payload.Int<uint8_t>(m.join_flags);
      payload.Int<uint64_t>(m.sequence);
      payload.Int<uint64_t>(m.barrier_released);
      payload.Int<uint64_t>(m.epoch);
      break;
    case ControlType::kRoster:
      payload.Int<int32_t>(m.rank);
      payload.Int<uint64_t>(m.epoch);
      payload.Int<uint64_t>(m.sequence);
      payload.Int<uint32_t>(static_cast<uint32_t>(m.roster.size()));
      for (const RosterEntry& e : m.roster) {
        payload.Int<uint32_t>(e.node);
        payload.Text(e.endpoint);
      }
      break;
    case ControlType::kBarrier:
    case ControlType::kRelease:
    case ControlType::kPing:
    case ControlType::kPong:
      payload.Int<uint64_t>(m.sequence);
      break;
    case ControlType::kLeave:
    case ControlType::kDrain:
      break;
    case ControlType::kPeerLost:
    case ControlType::kPeerJoined:
    case ControlType::kPeerLeft:
      payload.Int<uint32_t>(m.node);
      payload.Text(m.text);
      payload.Int<uint64_t>(m.epoch);
      break;
    case ControlType::kReject:
    case ControlType::kChallenge:
    case ControlType::kProof:
      payload.Text(m.text);
      break;
    case ControlType::kClock:
      payload.Int<uint64_t>(m.sequence);
      payload.Int<uint64_t>(m.clock_ns);
      break;
  }
  Writer header;
  header.Int<uint32_t>(kControlMagic);
  header.Int<uint16_t>(kControlVersion);
  header.Int<uint16_t>(static_cast<uint16_t>(m.type));
  header.Int<uint32_t>(static_cast<uint32_t>(payload.out().size()));
  return header.out() + payload.out();
}

absl::StatusOr<std::pair<ControlType, uint32_t>> DecodeControlHeader(
    absl::Span<const std::byte> header) {
  Reader r(header.subspan(0, std::min(header.size(), kControlHeaderBytes)));
  STEPMESH_ASSIGN_OR_RETURN(uint32_t magic, r.Int<uint32_t>());
  if (magic != kControlMagic) return absl::DataLossError("bad control magic");
  STEPMESH_ASSIGN_OR_RETURN(uint16_t version, r.Int<uint16_t>());
  if (version != kControlVersion) {
    return absl::FailedPreconditionError(absl::StrCat("control protocol version ", version));
  }
  STEPMESH_ASSIGN_OR_RETURN(uint16_t type, r.Int<uint16_t>());
  if (type < 1 || type > static_cast<uint16_t>(ControlType::kDrain)) {
    return absl::DataLossError(absl::StrCat("unknown control message type ", type));
  }
  STEPMESH_ASSIGN_OR_RETURN(uint32_t length, r.Int<uint32_t>());
  if (length > kMaxControlPayload) {
    return absl::OutOfRangeError(absl::StrCat("control payload of ", length, " bytes"));
  }
  return std::make_pair(static_cast<ControlType>(type), length);
}

absl::StatusOr<ControlMessage> DecodeControlPayload(ControlType type,
                                                    absl::Span<const std::byte> payload) {
  Reader r(payload);
  ControlMessage m;
  m.type = type;
  switch (type) {
    case ControlType::kJoin: {
      STEPMESH_ASSIGN_OR_RETURN(m.role, r.Int<uint8_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.rank, r.Int<int32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.text, r.Text());
      STEPMESH_ASSIGN_OR_RETURN(m.num_workers, r.Int<uint32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.num_servers, r.Int<uint32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.max_workers, r.Int<uint32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.max_servers, r.Int<uint32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.mesh_id, r.Text());
      STEPMESH_ASSIGN_OR_RETURN(m.join_flags, r.Int<uint8_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.sequence, r.Int<uint64_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.barrier_released, r.Int<uint64_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.epoch, r.Int<uint64_t>());
      if (m.role != static_cast<uint8_t>(Role::kWorker) &&
          m.role != static_cast<uint8_t>(Role::kServer)) {
        return absl::DataLossError("join with invalid role");
      }
      if ((m.join_flags & ~kJoinResume) != 0) return absl::DataLossError("join with unknown flags");
      break;
    }
    case ControlType::kRoster: {
      STEPMESH_ASSIGN_OR_RETURN(m.rank, r.Int<int32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.epoch, r.Int<uint64_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.sequence, r.Int<uint64_t>());
      STEPMESH_ASSIGN_OR_RETURN(uint32_t n, r.Int<uint32_t>());
      if (n > kMaxRosterEntries) return absl::DataLossError("roster too large");
      m.roster.reserve(n);
      for (uint32_t i = 0; i < n; ++i) {
        RosterEntry e;
        STEPMESH_ASSIGN_OR_RETURN(e.node, r.Int<uint32_t>());
        STEPMESH_ASSIGN_OR_RETURN(e.endpoint, r.Text());
        m.roster.push_back(std::move(e));
      }
      break;
    }
    case ControlType::kBarrier:
    case ControlType::kRelease:
    case ControlType::kPing:
    case ControlType::kPong: {
      STEPMESH_ASSIGN_OR_RETURN(m.sequence, r.Int<uint64_t>());
      break;
    }
    case ControlType::kLeave:
    case ControlType::kDrain:
      break;
    case ControlType::kPeerLost:
    case ControlType::kPeerJoined:
    case ControlType::kPeerLeft: {
      STEPMESH_ASSIGN_OR_RETURN(m.node, r.Int<uint32_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.text, r.Text());
      STEPMESH_ASSIGN_OR_RETURN(m.epoch, r.Int<uint64_t>());
      break;
    }
    case ControlType::kReject:
    case ControlType::kChallenge:
    case ControlType::kProof: {
      STEPMESH_ASSIGN_OR_RETURN(m.text, r.Text());
      break;
    }
    case ControlType::kClock: {
      STEPMESH_ASSIGN_OR_RETURN(m.sequence, r.Int<uint64_t>());
      STEPMESH_ASSIGN_OR_RETURN(m.clock_ns, r.Int<uint64_t>());
      break;
    }
  }
  STEPMESH_RETURN_IF_ERROR(r.Finish());
  return m;
}

void ControlAssembler::Feed(absl::Span<const std::byte> bytes) {
  if (consumed_ > 0 && consumed_ == buffer_.size()) {
    buffer_.clear();
    consumed_ = 0;
  }
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

absl::StatusOr<std::optional<ControlMessage>> ControlAssembler::Next() {
  const absl::Span<const std::byte> rest = absl::MakeConstSpan(buffer_).subspan(consumed_);
  if (rest.size() < kControlHeaderBytes) return std::nullopt;
  STEPMESH_ASSIGN_OR_RETURN(auto type_and_length, DecodeControlHeader(rest));
  if (type_and_length.second > max_payload_) {
    return absl::OutOfRangeError(absl::StrCat("control payload of ", type_and_length.second,
                                              " bytes (at most ", max_payload_, " here)"));
  }
  if (rest.size() < kControlHeaderBytes + type_and_length.second) return std::nullopt;
  STEPMESH_ASSIGN_OR_RETURN(
      ControlMessage m,
      DecodeControlPayload(type_and_length.first,
                           rest.subspan(kControlHeaderBytes, type_and_length.second)));
  consumed_ += kControlHeaderBytes + type_and_length.second;
  if (consumed_ == buffer_.size()) {
    buffer_.clear();
    consumed_ = 0;
  }
  return std::optional<ControlMessage>(std::move(m));
}

absl::Status SendControl(int fd, const ControlMessage& message, absl::Time deadline) {
  const std::string bytes = EncodeControl(message);
  return base::WriteFully(fd, bytes.data(), bytes.size(), deadline);
}

absl::StatusOr<ControlMessage> ReceiveControl(int fd, absl::Time deadline) {
  std::byte header[kControlHeaderBytes];
  STEPMESH_RETURN_IF_ERROR(base::ReadFully(fd, header, sizeof(header), deadline));
  STEPMESH_ASSIGN_OR_RETURN(auto type_and_length, DecodeControlHeader(header));
  std::vector<std::byte> payload(type_and_length.second);
  STEPMESH_RETURN_IF_ERROR(base::ReadFully(fd, payload.data(), payload.size(), deadline));
  return DecodeControlPayload(type_and_length.first, payload);
}

}  // namespace stepmesh::core
