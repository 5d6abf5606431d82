#include "src/core/handshake.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/base/little_endian.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/core/auth.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

// Data-connection handshake (the dialler is always the worker):
//   dialler  -> acceptor: hello = magic, version, dialler id, flags, dialler nonce (48 bytes)
//   acceptor -> dialler : verdict (kVerdictAccept / kVerdictRefuse)
// and with an auth token (flags & kHelloAuth), instead of that verdict:
//   acceptor -> dialler : kVerdictAccept, acceptor nonce, acceptor proof
//   dialler  -> acceptor: dialler proof
//   acceptor -> dialler : final verdict
// The dialler adopts the connection only after an accepting verdict, so a
// refusal is a synchronous error of Connect rather than a later disconnect.
constexpr uint32_t kHelloMagic = 0x49484D53;  // "SMHI"
static_assert(kHelloBytes == 16 + kAuthNonceBytes, "magic, version, id, flags, nonce");
constexpr uint32_t kHelloAuth = 1;
constexpr uint32_t kVerdictAccept = 0x4B4F4D53;  // "SMOK"
constexpr uint32_t kVerdictRefuse = 0x4F4E4D53;  // "SMNO"

void PutU32(std::byte* p, uint32_t v) { base::StoreLittleEndian(p, v); }
uint32_t GetU32(const std::byte* p) { return base::LoadLittleEndian<uint32_t>(p); }

// Binds a proof to this connection's purpose and both identities.
std::string AuthContext(NodeId dialler, NodeId acceptor) {
  return absl::StrCat("data:", absl::Hex(dialler), ">", absl::Hex(acceptor));
}

}  // namespace

bool HelloAsksAuth(const std::byte* hello) { return (GetU32(hello + 12) & kHelloAuth) != 0; }

size_t HandshakeBytesAfterHello(bool from_dialler, bool auth) {
  if (from_dialler) return auth ? kSha256Bytes : 0;          // the dialler's proof
  return auth ? 4 + kAuthNonceBytes + kSha256Bytes + 4 : 4;  // verdicts, nonce and proof
}

absl::Status DialHandshake(int fd, NodeId self, NodeId peer, absl::string_view secret,
                           absl::Time deadline) {
  STEPMESH_ASSIGN_OR_RETURN(HandshakeDialer handshake,
                            HandshakeDialer::Start(self, peer, std::string(secret)));
  for (;;) {
    const std::string out = handshake.TakeOutput();
    STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, out.data(), out.size(), deadline));
    if (handshake.step() == HandshakeDialer::Step::kDone) return absl::OkStatus();
    if (handshake.step() == HandshakeDialer::Step::kRefused) return handshake.refusal();
    std::byte in[HandshakeDialer::kMaxRead];
    const size_t want = handshake.wanted();
    absl::Status read = base::ReadFully(fd, in, want, deadline);
    if (absl::IsUnavailable(read)) {
      handshake.Closed();
      continue;
    }
    STEPMESH_RETURN_IF_ERROR(read);
    handshake.Received(absl::MakeConstSpan(in, want));
  }
}

absl::StatusOr<HandshakeDialer> HandshakeDialer::Start(NodeId self, NodeId peer,
                                                       std::string secret) {
  STEPMESH_ASSIGN_OR_RETURN(AuthNonce ours, RandomNonce());
  return HandshakeDialer(self, peer, std::move(secret), ours);
}

HandshakeDialer::HandshakeDialer(NodeId self, NodeId peer, std::string secret,
                                 const AuthNonce& ours)
    : self_(self), peer_(peer), secret_(std::move(secret)), ours_(ours) {
  std::byte hello[kHelloBytes];
  PutU32(hello, kHelloMagic);
  PutU32(hello + 4, kFrameVersion);
  PutU32(hello + 8, self);
  PutU32(hello + 12, secret_.empty() ? 0 : kHelloAuth);
  std::memcpy(hello + 16, ours_.data(), kAuthNonceBytes);
  output_.assign(reinterpret_cast<const char*>(hello), sizeof(hello));
}

size_t HandshakeDialer::wanted() const {
  if (step_ != Step::kRead) return 0;
  return (expect_ == Expect::kReply ? kMaxRead : 4) - got_;
}

void HandshakeDialer::Received(absl::Span<const std::byte> bytes) {
  if (step_ != Step::kRead) return;
  const size_t n = std::min(bytes.size(), wanted());
  std::memcpy(in_ + got_, bytes.data(), n);
  got_ += n;
  if (wanted() > 0) return;
  got_ = 0;
  if (expect_ == Expect::kReply) return OnReply();
  OnVerdict();
}

void HandshakeDialer::OnVerdict() {
  if (GetU32(in_) != kVerdictAccept) {
    return Refuse("refused (bad hello, unexpected peer or authentication mismatch)");
  }
  if (expect_ == Expect::kFinalVerdict || secret_.empty()) {
    step_ = Step::kDone;
    return;
  }
  expect_ = Expect::kReply;
}

void HandshakeDialer::OnReply() {
  AuthNonce theirs;
  std::memcpy(theirs.data(), in_, kAuthNonceBytes);
  const absl::string_view proof(reinterpret_cast<const char*>(in_) + kAuthNonceBytes, kSha256Bytes);
  const std::string context = AuthContext(self_, peer_);
  if (!CheckAuthProof(secret_, AuthSide::kAcceptor, context, ours_, theirs, proof)) {
    return Refuse("failed authentication (wrong auth token?)");
  }
  const Sha256Digest answer = AuthProof(secret_, AuthSide::kDialer, context, ours_, theirs);
  output_.assign(reinterpret_cast<const char*>(answer.data()), answer.size());
  expect_ = Expect::kFinalVerdict;
}

void HandshakeDialer::Closed() {
  if (step_ != Step::kRead) return;
  if (expect_ == Expect::kReply) {
    step_ = Step::kRefused;
    refusal_ =
        absl::UnavailableError(absl::StrCat("data connection to ", PeerName(peer_),
                                            ": connection closed by peer during the handshake"));
    return;
  }
  Refuse("refused (closed during the handshake)");
}

void HandshakeDialer::Refuse(absl::string_view why) {
  STEPMESH_LOG(kWarning, "data connection to node 0x", absl::Hex(peer_), ": ", why);
  output_.clear();
  refusal_ =
      absl::PermissionDeniedError(absl::StrCat("data connection to ", PeerName(peer_), ": ", why));
  step_ = Step::kRefused;
}

HandshakeAcceptor::HandshakeAcceptor(std::string secret) : secret_(std::move(secret)) {}

size_t HandshakeAcceptor::wanted() const {
  if (step_ != Step::kRead) return 0;
  return (awaiting_proof_ ? kSha256Bytes : kHelloBytes) - got_;
}

void HandshakeAcceptor::Received(absl::Span<const std::byte> bytes) {
  if (step_ != Step::kRead) return;
  const size_t n = std::min(bytes.size(), wanted());
  std::memcpy(in_ + got_, bytes.data(), n);
  got_ += n;
  if (bytes.size() > n) {
    // The dialler waits for a verdict before it sends anything more.
    return Refuse(absl::InvalidArgumentError("sent more than the handshake before the verdict"));
  }
  if (wanted() > 0) return;
  if (awaiting_proof_) return OnProof();
  OnHello();
}

void HandshakeAcceptor::OnHello() {
  claimed_ = GetU32(in_ + 8);
  if (GetU32(in_) != kHelloMagic) return Refuse(absl::InvalidArgumentError("bad hello magic"));
  if (GetU32(in_ + 4) != kFrameVersion) {
    return Refuse(absl::FailedPreconditionError(absl::StrCat(
        "hello of protocol version ", GetU32(in_ + 4), ", this node speaks ", int{kFrameVersion})));
  }
  if ((GetU32(in_ + 12) & ~kHelloAuth) != 0) {
    return Refuse(absl::InvalidArgumentError("hello with unknown flags"));
  }
  std::memcpy(dialler_nonce_.data(), in_ + 16, kAuthNonceBytes);
  step_ = Step::kDecide;
}

void HandshakeAcceptor::Decide(NodeId self, const absl::Status& verdict) {
  if (step_ != Step::kDecide) return;
  self_ = self;
  if (!verdict.ok()) return Refuse(verdict);
  const bool auth = !secret_.empty();
  if (auth != HelloAsksAuth(in_)) {
    return Refuse(absl::PermissionDeniedError(
        auth ? "peer did not authenticate (no auth token)"
             : "peer wants authentication but this node has no auth token"));
  }
  std::byte verdict_bytes[4];
  PutU32(verdict_bytes, kVerdictAccept);
  output_.append(reinterpret_cast<const char*>(verdict_bytes), sizeof(verdict_bytes));
  if (!auth) {
    step_ = Step::kDone;
    return;
  }
  absl::StatusOr<AuthNonce> ours = RandomNonce();
  if (!ours.ok()) return Refuse(ours.status());
  acceptor_nonce_ = *ours;
  const Sha256Digest proof = AuthProof(secret_, AuthSide::kAcceptor, AuthContext(claimed_, self_),
                                       dialler_nonce_, acceptor_nonce_);
  output_.append(reinterpret_cast<const char*>(acceptor_nonce_.data()), kAuthNonceBytes);
  output_.append(reinterpret_cast<const char*>(proof.data()), kSha256Bytes);
  awaiting_proof_ = true;
  got_ = 0;
  step_ = Step::kRead;
}

void HandshakeAcceptor::OnProof() {
  if (!CheckAuthProof(secret_, AuthSide::kDialer, AuthContext(claimed_, self_), dialler_nonce_,
                      acceptor_nonce_,
                      absl::string_view(reinterpret_cast<const char*>(in_), kSha256Bytes))) {
    return Refuse(absl::PermissionDeniedError(
        absl::StrCat(PeerName(claimed_), " failed authentication (wrong auth token?)")));
  }
  std::byte verdict_bytes[4];
  PutU32(verdict_bytes, kVerdictAccept);
  output_.append(reinterpret_cast<const char*>(verdict_bytes), sizeof(verdict_bytes));
  step_ = Step::kDone;
}

void HandshakeAcceptor::Withdraw(const absl::Status& why) {
  if (step_ == Step::kRefused) return;
  output_.clear();
  Refuse(why);
}

void HandshakeAcceptor::Refuse(absl::Status why) {
  std::byte verdict_bytes[4];
  PutU32(verdict_bytes, kVerdictRefuse);
  output_.append(reinterpret_cast<const char*>(verdict_bytes), sizeof(verdict_bytes));
  refusal_ = std::move(why);
  step_ = Step::kRefused;
}

absl::StatusOr<NodeId> AcceptHandshake(int fd, NodeId self, absl::Span<const NodeId> expected,
                                       absl::string_view secret, absl::Time deadline) {
  HandshakeAcceptor handshake{std::string(secret)};
  for (;;) {
    switch (handshake.step()) {
      case HandshakeAcceptor::Step::kRead: {
        std::byte in[kHelloBytes];
        const size_t want = handshake.wanted();
        STEPMESH_RETURN_IF_ERROR(base::ReadFully(fd, in, want, deadline));
        handshake.Received(absl::MakeConstSpan(in, want));
        break;
      }
      case HandshakeAcceptor::Step::kDecide: {
        const NodeId from = handshake.claimed();
        handshake.Decide(self, std::find(expected.begin(), expected.end(), from) == expected.end()
                                   ? absl::PermissionDeniedError(absl::StrCat(
                                         "hello from unexpected node 0x", absl::Hex(from)))
                                   : absl::OkStatus());
        break;
      }
      case HandshakeAcceptor::Step::kDone: {
        const std::string out = handshake.TakeOutput();
        STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, out.data(), out.size(), deadline));
        return handshake.claimed();
      }
      case HandshakeAcceptor::Step::kRefused: {
        const std::string out = handshake.TakeOutput();
        (void)base::WriteFully(fd, out.data(), out.size(), deadline);
        return handshake.refusal();
      }
    }
    if (handshake.step() == HandshakeAcceptor::Step::kRead) {
      const std::string out = handshake.TakeOutput();
      STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, out.data(), out.size(), deadline));
    }
  }
}

}  // namespace stepmesh::core
