#pragma once
// The RDMA transport's bootstrap listener (servers accept, workers dial): it
// runs the data-connection handshake (src/core/handshake.h) for every
// accepted socket at once, in one poll loop, with the admission caps the TCP
// fallback and the scheduler use (src/base/admission.h). A silent, trickling
// or refused client costs one descriptor until its own deadline and never
// holds up a real peer -- a blocking accept-then-handshake loop would wait out
// each silent client's deadline in turn before reaching the peer behind it.

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/base/net.h"
#include "src/base/rate_limit.h"
#include "src/core/frame.h"

namespace stepmesh::rdma {

class BootstrapListener {
 public:
  // Unfinished handshakes: at most this many from one address, and in all
  // (raised to room for every expected peer: base::CapsForPeers); a newcomer
  // over a cap evicts the oldest. Each gets this long.
  static constexpr size_t kMaxPendingPerAddress = 32;
  static constexpr size_t kMaxPending = 128;
  static constexpr absl::Duration kHandshakeTimeout = absl::Seconds(5);

  BootstrapListener();
  ~BootstrapListener();
  BootstrapListener(BootstrapListener&&) noexcept;
  BootstrapListener& operator=(BootstrapListener&&) noexcept;

  static absl::StatusOr<BootstrapListener> Listen(const std::string& host);
  absl::StatusOr<uint16_t> port() const;

  // Until `deadline`: the first connection whose dialler proved to be one of
  // `expected` (with `secret`, by challenge-response), and its socket, in
  // blocking mode, the handshake's verdict sent. Other connections are
  // refused (a dialler not expected), dropped (their deadline, the caps) or
  // left in progress for the next call.
  absl::StatusOr<std::pair<core::NodeId, base::UniqueFd>> AcceptOne(
      core::NodeId self, absl::Span<const core::NodeId> expected, const std::string& secret,
      absl::Time deadline);

  // Unfinished handshakes now (tests).
  size_t pending() const { return pending_.size(); }

 private:
  struct Pending;
  // Accepts what is waiting; `expected` peers may all be mid-handshake at once.
  void AcceptAll(const std::string& secret, size_t expected);
  // Reads what `p` sent and answers; its NodeId once it proved to be expected.
  core::NodeId Advance(Pending& p, core::NodeId self, absl::Span<const core::NodeId> expected);
  void Drop(Pending& p, const std::string& why);

  base::Acceptor acceptor_;
  std::list<std::unique_ptr<Pending>> pending_;   // oldest first
  std::unique_ptr<base::RateLimiter> log_limit_;  // a flood logs a few lines, not one each
};

}  // namespace stepmesh::rdma
