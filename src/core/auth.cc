#include "src/core/auth.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "src/base/net.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t RotR(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

absl::string_view SideLabel(AuthSide side) {
  return side == AuthSide::kDialer ? "stepmesh-auth-v1/dialer" : "stepmesh-auth-v1/acceptor";
}

}  // namespace

Sha256::Sha256()
    : state_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
             0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19},
      buffer_{} {}

void Sha256::Block(const uint8_t* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t{p[4 * i]} << 24) | (uint32_t{p[4 * i + 1]} << 16) |
           (uint32_t{p[4 * i + 2]} << 8) | uint32_t{p[4 * i + 3]};
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = RotR(w[i - 15], 7) ^ RotR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = RotR(w[i - 2], 17) ^ RotR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3], e = state_[4], f = state_[5],
           g = state_[6], h = state_[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t s1 = RotR(e, 6) ^ RotR(e, 11) ^ RotR(e, 25);
    const uint32_t ch = (e & f) ^ (~e & g);
    const uint32_t t1 = h + s1 + ch + kRoundConstants[i] + w[i];
    const uint32_t s0 = RotR(a, 2) ^ RotR(a, 13) ^ RotR(a, 22);
    const uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
    const uint32_t t2 = s0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
}

void Sha256::Update(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_bytes_ += bytes;
  while (bytes > 0) {
    const size_t take = std::min(bytes, sizeof(buffer_) - buffered_);
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    bytes -= take;
    if (buffered_ == sizeof(buffer_)) {
      Block(buffer_);
      buffered_ = 0;
    }
  }
}

Sha256Digest Sha256::Finish() {
  const uint64_t bits = total_bytes_ * 8;
  const uint8_t pad = 0x80;
  Update(&pad, 1);
  const uint8_t zero = 0;
  while (buffered_ != 56) Update(&zero, 1);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  Update(length, 8);
  Sha256Digest out;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(state_[i] >> (24 - 8 * j));
  }
  return out;
}

Sha256Digest Sha256Of(absl::string_view data) {
  Sha256 h;
  h.Update(data);
  return h.Finish();
}

Sha256Digest HmacSha256(absl::string_view key, absl::string_view message) {
  uint8_t block[64] = {};
  if (key.size() > sizeof(block)) {
    const Sha256Digest k = Sha256Of(key);
    std::memcpy(block, k.data(), k.size());
  } else {
    std::memcpy(block, key.data(), key.size());
  }
  uint8_t ipad[64], opad[64];
  for (int i = 0; i < 64; ++i) {
    ipad[i] = block[i] ^ 0x36;
    opad[i] = block[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.Update(ipad, sizeof(ipad));
  inner.Update(message);
  const Sha256Digest inner_digest = inner.Finish();
  Sha256 outer;
  outer.Update(opad, sizeof(opad));
  outer.Update(inner_digest.data(), inner_digest.size());
  return outer.Finish();
}

absl::StatusOr<AuthNonce> RandomNonce() {
  AuthNonce nonce;
  size_t got = 0;
  while (got < nonce.size()) {
    const ssize_t n = ::getrandom(nonce.data() + got, nonce.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return nonce;
}

Sha256Digest AuthProof(absl::string_view secret, AuthSide side, absl::string_view context,
                       const AuthNonce& dialer_nonce, const AuthNonce& acceptor_nonce) {
  // Length-prefixed fields: no two (label, context) pairs encode to the same message.
  std::string message;
  for (absl::string_view part : {SideLabel(side), context}) {
    const uint32_t n = static_cast<uint32_t>(part.size());
    for (int i = 0; i < 4; ++i) message.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
    message.append(part.data(), part.size());
  }
  message.append(AsText(dialer_nonce).data(), kAuthNonceBytes);
  message.append(AsText(acceptor_nonce).data(), kAuthNonceBytes);
  return HmacSha256(secret, message);
}

bool ConstantTimeEqual(const void* a, const void* b, size_t bytes) {
  const auto* x = static_cast<const volatile uint8_t*>(a);
  const auto* y = static_cast<const volatile uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < bytes; ++i) diff |= x[i] ^ y[i];
  return diff == 0;
}

bool CheckAuthProof(absl::string_view secret, AuthSide side, absl::string_view context,
                    const AuthNonce& dialer_nonce, const AuthNonce& acceptor_nonce,
                    absl::string_view proof) {
  if (proof.size() != kSha256Bytes) return false;
  const Sha256Digest want = AuthProof(secret, side, context, dialer_nonce, acceptor_nonce);
  return ConstantTimeEqual(want.data(), proof.data(), kSha256Bytes);
}

absl::Status CheckAuthPolicy(const MeshOptions& options, absl::string_view what,
                             const std::string& host, bool* open_on_loopback) {
  *open_on_loopback = false;
  if (!options.auth_token.empty() || options.auth == AuthMode::kOff) return absl::OkStatus();
  if (options.auth == AuthMode::kOn) {
    return absl::FailedPreconditionError(
        "STEPMESH_AUTH=on but no auth token is set (STEPMESH_AUTH_TOKEN)");
  }
  STEPMESH_ASSIGN_OR_RETURN(bool loopback, base::IsLoopbackHost(host));
  if (loopback) {
    *open_on_loopback = true;
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to start ", what, " on '", host,
      "', which other machines can reach, without an auth token: set STEPMESH_AUTH_TOKEN to the "
      "same secret on every process of the mesh, or STEPMESH_AUTH=off to run unauthenticated"));
}

bool NonceFromText(absl::string_view text, AuthNonce* out) {
  if (text.size() != kAuthNonceBytes) return false;
  std::memcpy(out->data(), text.data(), kAuthNonceBytes);
  return true;
}

}  // namespace stepmesh::core

namespace stepmesh {

absl::StatusOr<std::string> GenerateAuthToken() {
  STEPMESH_ASSIGN_OR_RETURN(core::AuthNonce bytes, core::RandomNonce());
  return absl::BytesToHexString(core::AsText(bytes));
}

}  // namespace stepmesh
