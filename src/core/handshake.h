#pragma once
// The first bytes on every data connection (the TCP fallback's connections and
// the RDMA transport's bootstrap sockets): the dialler names itself, both ends
// check the protocol version, and with a shared secret both prove knowledge of
// it by challenge-response (src/core/auth.h) without sending it.

#include <array>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/core/auth.h"
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
// Blocking (up to `deadline`); a dialler of many peers at once uses
// HandshakeDialer instead.
absl::Status DialHandshake(int fd, NodeId self, NodeId peer, absl::string_view secret,
                           absl::Time deadline);

// The dialler's side as a state machine fed with whatever bytes arrived, so
// that one thread can run the handshakes of many connections at once (a
// worker dials all its servers together). It never reads past the handshake:
//   kRead    send TakeOutput() (the hello, later the proof), then read at
//            most wanted() bytes and pass them to Received()
//   kDone    the acceptor took the connection (TakeOutput() is empty)
//   kRefused refusal() says why: PERMISSION_DENIED for a refusing verdict or
//            a failed proof; Closed() when the acceptor hung up first
class HandshakeDialer {
 public:
  enum class Step { kRead, kDone, kRefused };

  // Fails only when no nonce can be drawn.
  static absl::StatusOr<HandshakeDialer> Start(NodeId self, NodeId peer, std::string secret);
  Step step() const { return step_; }
  size_t wanted() const;
  void Received(absl::Span<const std::byte> bytes);
  // The acceptor closed the connection before the handshake ended.
  void Closed();
  std::string TakeOutput() { return std::exchange(output_, std::string()); }
  const absl::Status& refusal() const { return refusal_; }

  // The most wanted() asks for at once (the acceptor's nonce and proof).
  static constexpr size_t kMaxRead = kAuthNonceBytes + kSha256Bytes;

 private:
  enum class Expect { kVerdict, kReply, kFinalVerdict };
  HandshakeDialer(NodeId self, NodeId peer, std::string secret, const AuthNonce& ours);
  void OnVerdict();
  void OnReply();
  void Refuse(absl::string_view why);

  NodeId self_;
  NodeId peer_;
  std::string secret_;
  AuthNonce ours_;
  Step step_ = Step::kRead;
  Expect expect_ = Expect::kVerdict;
  std::byte in_[kMaxRead];
  size_t got_ = 0;
  std::string output_;
  absl::Status refusal_;
};

// Acceptor side: returns the dialler, one of `expected`, or refuses it.
// Blocking (up to `deadline`); event loops use HandshakeAcceptor instead.
absl::StatusOr<NodeId> AcceptHandshake(int fd, NodeId self, absl::Span<const NodeId> expected,
                                       absl::string_view secret, absl::Time deadline);

// The acceptor's side as a state machine fed with whatever bytes arrived, for
// event loops: it never blocks and never reads past the handshake (wanted()
// says how much to read), so a silent or trickling client costs nothing but
// its descriptor until the loop's own deadline for it.
//   kRead    read at most wanted() bytes and pass them to Received()
//   kDecide  the hello is in: claimed() names the dialler; call Decide()
//   kDone    the connection belongs to claimed(); TakeOutput() still to send
//   kRefused refusal() says why; TakeOutput() holds the refusing verdict
// Withdraw() refuses at any step before the accepting verdict went out (a
// deadline, another connection that proved the same identity first).
class HandshakeAcceptor {
 public:
  enum class Step { kRead, kDecide, kDone, kRefused };

  explicit HandshakeAcceptor(std::string secret);
  Step step() const { return step_; }
  size_t wanted() const;
  void Received(absl::Span<const std::byte> bytes);
  NodeId claimed() const { return claimed_; }
  // kDecide: OK admits the dialler to node `self` (then the proofs, with a
  // secret); an error refuses it with that reason.
  void Decide(NodeId self, const absl::Status& verdict);
  // Refuses now: the output becomes the refusing verdict alone.
  void Withdraw(const absl::Status& why);
  // Bytes to send to the dialler now (verdicts, nonce and proof).
  std::string TakeOutput() { return std::exchange(output_, std::string()); }
  const absl::Status& refusal() const { return refusal_; }

 private:
  void Refuse(absl::Status why);
  void OnHello();
  void OnProof();

  NodeId self_ = kNoNode;
  const std::string secret_;
  Step step_ = Step::kRead;
  bool awaiting_proof_ = false;
  std::byte in_[kHelloBytes];
  size_t got_ = 0;
  NodeId claimed_ = kNoNode;
  std::array<uint8_t, 32> dialler_nonce_{};
  std::array<uint8_t, 32> acceptor_nonce_{};
  std::string output_;
  absl::Status refusal_;
};

}  // namespace stepmesh::core
