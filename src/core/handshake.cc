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
  const bool auth = !secret.empty();
  STEPMESH_ASSIGN_OR_RETURN(AuthNonce ours, RandomNonce());
  std::byte hello[kHelloBytes];
  PutU32(hello, kHelloMagic);
  PutU32(hello + 4, kFrameVersion);
  PutU32(hello + 8, self);
  PutU32(hello + 12, auth ? kHelloAuth : 0);
  std::memcpy(hello + 16, ours.data(), kAuthNonceBytes);
  auto refused = [&](absl::string_view why) {
    STEPMESH_LOG(kWarning, "data connection to node 0x", absl::Hex(peer), ": ", why);
    return absl::PermissionDeniedError(
        absl::StrCat("data connection to ", PeerName(peer), ": ", why));
  };
  auto read_verdict = [&]() -> absl::Status {
    std::byte verdict[4];
    absl::Status read = base::ReadFully(fd, verdict, sizeof(verdict), deadline);
    if (absl::IsUnavailable(read)) return refused("refused (closed during the handshake)");
    STEPMESH_RETURN_IF_ERROR(read);
    if (GetU32(verdict) != kVerdictAccept) {
      return refused("refused (bad hello, unexpected peer or authentication mismatch)");
    }
    return absl::OkStatus();
  };
  STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, hello, sizeof(hello), deadline));
  STEPMESH_RETURN_IF_ERROR(read_verdict());
  if (auth) {
    std::byte reply[kAuthNonceBytes + kSha256Bytes];
    STEPMESH_RETURN_IF_ERROR(base::ReadFully(fd, reply, sizeof(reply), deadline));
    AuthNonce theirs;
    std::memcpy(theirs.data(), reply, kAuthNonceBytes);
    const absl::string_view proof(reinterpret_cast<const char*>(reply) + kAuthNonceBytes,
                                  kSha256Bytes);
    const std::string context = AuthContext(self, peer);
    if (!CheckAuthProof(secret, AuthSide::kAcceptor, context, ours, theirs, proof)) {
      return refused("failed authentication (wrong auth token?)");
    }
    const Sha256Digest answer = AuthProof(secret, AuthSide::kDialer, context, ours, theirs);
    STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, answer.data(), answer.size(), deadline));
    STEPMESH_RETURN_IF_ERROR(read_verdict());
  }
  return absl::OkStatus();
}

absl::StatusOr<NodeId> AcceptHandshake(int fd, NodeId self, absl::Span<const NodeId> expected,
                                       absl::string_view secret, absl::Time deadline) {
  auto refuse = [&](absl::string_view why) {
    std::byte verdict[4];
    PutU32(verdict, kVerdictRefuse);
    (void)base::WriteFully(fd, verdict, sizeof(verdict), deadline);
    return absl::PermissionDeniedError(why);
  };
  std::byte hello[kHelloBytes];
  STEPMESH_RETURN_IF_ERROR(base::ReadFully(fd, hello, sizeof(hello), deadline));
  const NodeId from = GetU32(hello + 8);
  if (GetU32(hello) != kHelloMagic || GetU32(hello + 4) != kFrameVersion) {
    return refuse("bad hello");
  }
  if (std::find(expected.begin(), expected.end(), from) == expected.end()) {
    return refuse(absl::StrCat("hello from unexpected node 0x", absl::Hex(from)));
  }
  const bool auth = !secret.empty();
  const bool dialler_auth = HelloAsksAuth(hello);
  if (auth != dialler_auth) {
    return refuse(auth ? "peer did not authenticate (no auth token)"
                       : "peer wants authentication but this node has no auth token");
  }
  std::byte verdict[4];
  PutU32(verdict, kVerdictAccept);
  STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, verdict, sizeof(verdict), deadline));
  if (!auth) return from;
  AuthNonce theirs;
  std::memcpy(theirs.data(), hello + 16, kAuthNonceBytes);
  STEPMESH_ASSIGN_OR_RETURN(AuthNonce ours, RandomNonce());
  const std::string context = AuthContext(from, self);
  const Sha256Digest proof = AuthProof(secret, AuthSide::kAcceptor, context, theirs, ours);
  std::byte reply[kAuthNonceBytes + kSha256Bytes];
  std::memcpy(reply, ours.data(), kAuthNonceBytes);
  std::memcpy(reply + kAuthNonceBytes, proof.data(), kSha256Bytes);
  STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, reply, sizeof(reply), deadline));
  std::byte answer[kSha256Bytes];
  STEPMESH_RETURN_IF_ERROR(base::ReadFully(fd, answer, sizeof(answer), deadline));
  if (!CheckAuthProof(secret, AuthSide::kDialer, context, theirs, ours,
                      absl::string_view(reinterpret_cast<const char*>(answer), sizeof(answer)))) {
    return refuse(absl::StrCat("node 0x", absl::Hex(from), " failed authentication"));
  }
  STEPMESH_RETURN_IF_ERROR(base::WriteFully(fd, verdict, sizeof(verdict), deadline));
  return from;
}

}  // namespace stepmesh::core
