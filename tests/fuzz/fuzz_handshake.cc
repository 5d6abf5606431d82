// libFuzzer target: the acceptor's side of the data-connection handshake
// (HandshakeAcceptor), which every data listener runs on the first bytes of
// any connection that reaches its port, before anything is authenticated.
//
// Input: what the dialler sends (tests/fuzz/capture_seeds.py seeds it with
// real hellos and what followed them). The same bytes go to four acceptors:
// without and with a shared secret, each fed the way the event loop reads
// (at most wanted() bytes at a time) and one byte at a time. Checked:
//  - wanted() is within the hello or the proof, and 0 outside kRead;
//  - the outcome (step, claimed node, refusal code) does not depend on how
//    the bytes were cut;
//  - with a secret the input can never be accepted: the proof it would need
//    covers the acceptor's random nonce, which the input cannot know;
//  - without a secret, acceptance means a well-formed hello (right magic and
//    version, no unknown flags, no auth asked) and nothing after it;
//  - a refusal always has a reason and sends the refusing verdict last.
// And all of it in one call (a dialler that does not wait for the verdict):
// more than the hello at once must be refused, never buffered.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "src/core/frame.h"
#include "src/core/handshake.h"

namespace {

using stepmesh::core::HandshakeAcceptor;
using stepmesh::core::kHelloBytes;
using stepmesh::core::NodeId;

constexpr NodeId kSelf = 9;
constexpr size_t kProofBytes = 32;

struct Outcome {
  HandshakeAcceptor::Step step;
  NodeId claimed;
  absl::StatusCode refusal;
  std::string last_output;  // the last verdict sent (4 bytes), or empty
  size_t used;              // input bytes the acceptor was given
};

void Check(bool ok) {
  if (!ok) std::abort();
}

// Feeds `input` to a fresh acceptor in pieces of at most `piece` bytes (0 =
// exactly what it wants); at kDecide, admits whoever it is.
Outcome Run(absl::Span<const std::byte> input, const std::string& secret, size_t piece) {
  HandshakeAcceptor acceptor{secret};
  std::string output;
  size_t at = 0;
  // Bounded: every kRead step consumes at least one byte or ends the loop.
  for (int guard = 0; guard < 4 * static_cast<int>(kHelloBytes + kProofBytes) + 8; ++guard) {
    const HandshakeAcceptor::Step step = acceptor.step();
    if (step == HandshakeAcceptor::Step::kDecide) {
      acceptor.Decide(kSelf, absl::OkStatus());
      output += acceptor.TakeOutput();
      continue;
    }
    if (step != HandshakeAcceptor::Step::kRead) break;
    const size_t wanted = acceptor.wanted();
    Check(wanted >= 1 && wanted <= std::max(kHelloBytes, kProofBytes));
    if (at == input.size()) break;  // the dialler waits for us
    size_t n = piece == 0 ? wanted : std::min(piece, wanted);
    n = std::min(n, input.size() - at);
    acceptor.Received(input.subspan(at, n));
    at += n;
  }
  if (acceptor.step() != HandshakeAcceptor::Step::kRead) Check(acceptor.wanted() == 0);
  output += acceptor.TakeOutput();
  Outcome o{acceptor.step(), acceptor.claimed(), acceptor.refusal().code(),
            output.size() >= 4 ? output.substr(output.size() - 4) : std::string(), at};
  if (o.step == HandshakeAcceptor::Step::kRefused) {
    Check(o.refusal != absl::StatusCode::kOk);
    Check(o.last_output == "SMNO");
  } else {
    Check(o.refusal == absl::StatusCode::kOk);
  }
  if (o.step == HandshakeAcceptor::Step::kDone) Check(o.last_output == "SMOK");
  return o;
}

uint32_t U32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;  // little-endian host (x86-64, aarch64)
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const std::byte> input(reinterpret_cast<const std::byte*>(data), size);
  for (const std::string secret : {std::string(), std::string("fuzz-secret")}) {
    const Outcome whole = Run(input, secret, 0);
    const Outcome bytewise = Run(input, secret, 1);
    Check(whole.step == bytewise.step && whole.claimed == bytewise.claimed &&
          whole.refusal == bytewise.refusal && whole.used == bytewise.used);
    // A verdict is the same; mid-authentication the last bytes out are the
    // acceptor's proof, which covers its random nonce and so differs.
    if (whole.step != HandshakeAcceptor::Step::kRead) {
      Check(whole.last_output == bytewise.last_output);
    }
    if (!secret.empty()) {
      Check(whole.step != HandshakeAcceptor::Step::kDone);
    } else if (whole.step == HandshakeAcceptor::Step::kDone) {
      Check(size >= kHelloBytes && whole.used == kHelloBytes);
      Check(U32(data) == 0x49484D53);  // "SMHI"
      Check(U32(data + 4) == stepmesh::core::kFrameVersion);
      Check(U32(data + 12) == 0);  // no auth asked, no unknown flags
      Check(whole.claimed == U32(data + 8));
    }
    // A dialler that sends more than the hello before the verdict is refused
    // when the surplus arrives with it.
    if (size > kHelloBytes) {
      HandshakeAcceptor greedy{secret};
      greedy.Received(input);
      Check(greedy.step() == HandshakeAcceptor::Step::kRefused);
    }
  }
  return 0;
}
