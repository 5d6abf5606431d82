#pragma once
// The first bytes on every data connection (the TCP fallback's connections and
// the RDMA transport's bootstrap sockets): the dialler names itself, both ends
// check the protocol version, and with a shared secret both prove knowledge of
// it by challenge-response (src/core/auth.h) without sending it.

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/core/frame.h"

namespace stepmesh::core {

// The bytes before a data connection's first frame, for tools that follow its
// byte stream (the tests' wire-fault proxy): the dialler's hello, then
// HandshakeBytesAfterHello more from each side.
inline constexpr size_t kHelloBytes = 48;
bool HelloAsksAuth(const std::byte* hello);  // its first kHelloBytes
size_t HandshakeBytesAfterHello(bool from_dialler, bool auth);

// Dialler side. PERMISSION_DENIED when the acceptor refuses (unexpected node,
// secret mismatch) or fails to prove the secret; `secret` empty = no auth.
absl::Status DialHandshake(int fd, NodeId self, NodeId peer, absl::string_view secret,
                           absl::Time deadline);

// Acceptor side: returns the dialler, one of `expected`, or refuses it.
absl::StatusOr<NodeId> AcceptHandshake(int fd, NodeId self, absl::Span<const NodeId> expected,
                                       absl::string_view secret, absl::Time deadline);

}  // namespace stepmesh::core
