#pragma once
// Shared-secret authentication for the control and data connections.
//
// Both ends prove knowledge of MeshOptions::auth_token without sending it: each
// side contributes a fresh random nonce and answers with
//   HMAC-SHA256(secret, label || context || nonce_dialer || nonce_acceptor)
// where `label` differs per direction (so a proof cannot be reflected back) and
// `context` binds the proof to the connection's purpose and claimed identity.
// SHA-256/HMAC are implemented here (RFC 6234 / RFC 2104) because the project
// carries no crypto dependency; auth_test checks them against RFC 4231 vectors.
// Nothing here encrypts traffic: see docs/reliability.md for what it protects.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "stepmesh/options.h"

namespace stepmesh::core {

inline constexpr size_t kSha256Bytes = 32;
inline constexpr size_t kAuthNonceBytes = 32;
using Sha256Digest = std::array<uint8_t, kSha256Bytes>;
using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;

// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t bytes);
  void Update(absl::string_view text) { Update(text.data(), text.size()); }
  Sha256Digest Finish();  // the object is spent afterwards

 private:
  void Block(const uint8_t* block);
  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

Sha256Digest Sha256Of(absl::string_view data);
Sha256Digest HmacSha256(absl::string_view key, absl::string_view message);

// Fresh nonce from getrandom(2); fails only when the kernel has no entropy source.
absl::StatusOr<AuthNonce> RandomNonce();

// Which side of a handshake a proof comes from.
enum class AuthSide : uint8_t { kDialer = 1, kAcceptor = 2 };

// The proof `side` sends: HMAC over side label, context and both nonces.
Sha256Digest AuthProof(absl::string_view secret, AuthSide side, absl::string_view context,
                       const AuthNonce& dialer_nonce, const AuthNonce& acceptor_nonce);

// Compares without an early exit, so timing does not reveal the matching prefix.
bool ConstantTimeEqual(const void* a, const void* b, size_t bytes);
// True when `proof` (raw bytes) is what `side` must send.
bool CheckAuthProof(absl::string_view secret, AuthSide side, absl::string_view context,
                    const AuthNonce& dialer_nonce, const AuthNonce& acceptor_nonce,
                    absl::string_view proof);

// Digests and nonces are both 32 bytes (one type): their raw bytes as text.
inline absl::string_view AsText(const Sha256Digest& d) {
  return absl::string_view(reinterpret_cast<const char*>(d.data()), d.size());
}
// Parses a received nonce; false when it has the wrong length.
bool NonceFromText(absl::string_view text, AuthNonce* out);

// MeshOptions::auth applied to a listener about to bind `host` (`what` names
// it in the error: "the scheduler", "the data listener"). FAILED_PRECONDITION
// when the options forbid running there without a token, naming the address
// and both variables. Sets `*open_on_loopback` when no token is set and the
// address is loopback under AuthMode::kAuto (the caller may warn).
absl::Status CheckAuthPolicy(const MeshOptions& options, absl::string_view what,
                             const std::string& host, bool* open_on_loopback);

}  // namespace stepmesh::core
