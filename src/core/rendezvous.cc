#include "src/core/rendezvous.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

absl::StatusOr<std::unique_ptr<RendezvousClient>> RendezvousClient::Join(
    const MeshOptions& options, const std::string& endpoint) {
  const absl::Time deadline = absl::Now() + options.timeout;
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort scheduler, base::ParseHostPort(options.scheduler));
  absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(scheduler, deadline);
  if (!fd.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot reach the scheduler at ",
                                               options.scheduler, ": ", fd.status().message()));
  }
  std::unique_ptr<RendezvousClient> client(new RendezvousClient(*std::move(fd), options.timeout));
  if (!options.auth_token.empty()) {
    STEPMESH_RETURN_IF_ERROR(client->Authenticate(options.auth_token, deadline));
  }

  ControlMessage join;
  join.type = ControlType::kJoin;
  join.role = static_cast<uint8_t>(options.role);
  join.rank = options.rank;
  join.text = endpoint;
  STEPMESH_RETURN_IF_ERROR(SendControl(client->fd_.get(), join, deadline));

  for (;;) {
    absl::StatusOr<ControlMessage> reply = ReceiveControl(client->fd_.get(), deadline);
    if (!reply.ok()) {
      return absl::Status(reply.status().code(),
                          absl::StrCat("waiting for the roster: ", reply.status().message()));
    }
    if (reply->type == ControlType::kReject) {
      return absl::PermissionDeniedError(absl::StrCat("scheduler refused join: ", reply->text));
    }
    if (reply->type == ControlType::kPing) {
      ControlMessage pong;
      pong.type = ControlType::kPong;
      pong.sequence = reply->sequence;
      STEPMESH_RETURN_IF_ERROR(SendControl(client->fd_.get(), pong, deadline));
      continue;
    }
    if (reply->type != ControlType::kRoster) {
      return absl::DataLossError(absl::StrCat("unexpected control message ",
                                              static_cast<int>(reply->type), " before roster"));
    }
    client->rank_ = reply->rank;
    client->self_ = MakeNodeId(options.role, reply->rank);
    client->roster_ = std::move(reply->roster);
    return client;
  }
}

absl::Status RendezvousClient::Authenticate(const std::string& secret, absl::Time deadline) {
  // Mutual: the scheduler proves the secret first, so a participant never
  // joins (and reveals its endpoint to) an impostor scheduler.
  STEPMESH_ASSIGN_OR_RETURN(AuthNonce ours, RandomNonce());
  ControlMessage challenge;
  challenge.type = ControlType::kChallenge;
  challenge.text = std::string(AsText(ours));
  STEPMESH_RETURN_IF_ERROR(SendControl(fd_.get(), challenge, deadline));
  auto expect = [&](ControlType type) -> absl::StatusOr<ControlMessage> {
    STEPMESH_ASSIGN_OR_RETURN(ControlMessage m, ReceiveControl(fd_.get(), deadline));
    if (m.type == ControlType::kReject) {
      return absl::PermissionDeniedError(absl::StrCat("scheduler refused: ", m.text));
    }
    if (m.type != type) {
      return absl::PermissionDeniedError(absl::StrCat(
          "scheduler did not authenticate (sent message ", static_cast<int>(m.type), ")"));
    }
    return m;
  };
  STEPMESH_ASSIGN_OR_RETURN(ControlMessage theirs, expect(ControlType::kChallenge));
  AuthNonce scheduler_nonce;
  if (!NonceFromText(theirs.text, &scheduler_nonce)) {
    return absl::PermissionDeniedError("scheduler sent a malformed challenge");
  }
  STEPMESH_ASSIGN_OR_RETURN(ControlMessage proof, expect(ControlType::kProof));
  if (!CheckAuthProof(secret, AuthSide::kAcceptor, "control", ours, scheduler_nonce,
                      proof.text)) {
    STEPMESH_LOG(kWarning, "the scheduler failed authentication (wrong auth token?)");
    return absl::PermissionDeniedError("the scheduler failed authentication (wrong auth token?)");
  }
  ControlMessage answer;
  answer.type = ControlType::kProof;
  answer.text = std::string(AsText(AuthProof(secret, AuthSide::kDialer, "control", ours,
                                             scheduler_nonce)));
  return SendControl(fd_.get(), answer, deadline);
}

RendezvousClient::~RendezvousClient() {
  Leave();
  stop_.store(true);
  if (monitor_.joinable()) monitor_.join();
}

void RendezvousClient::StartMonitor(RendezvousEvents events) {
  events_ = std::move(events);
  monitor_ = base::StartNamedThread("sm-rendezvous", {}, [this] { MonitorLoop(); });
}

absl::Status RendezvousClient::Send(const ControlMessage& message) {
  base::MutexLock lock(&write_mu_);
  return SendControl(fd_.get(), message, absl::Now() + timeout_);
}

void RendezvousClient::MonitorLoop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    absl::StatusOr<bool> readable =
        base::WaitReadable(fd_.get(), absl::Now() + absl::Milliseconds(50));
    if (readable.ok() && !*readable) continue;
    absl::StatusOr<ControlMessage> m =
        readable.ok() ? ReceiveControl(fd_.get(), absl::Now() + timeout_) : readable.status();
    if (!m.ok()) {
      if (!stop_.load() && !left_.load()) {
        STEPMESH_LOG(kWarning, "lost the scheduler connection: ", m.status().ToString());
      }
      base::MutexLock lock(&mu_);
      scheduler_status_ = absl::UnavailableError(
          absl::StrCat("scheduler connection lost: ", m.status().message()));
      return;
    }
    switch (m->type) {
      case ControlType::kPing: {
        ControlMessage pong;
        pong.type = ControlType::kPong;
        pong.sequence = m->sequence;
        (void)Send(pong);  // a failed pong shows up as a closed socket on the next read
        break;
      }
      case ControlType::kRelease: {
        base::MutexLock lock(&mu_);
        barrier_released_ = std::max(barrier_released_, m->sequence);
        break;
      }
      case ControlType::kPeerLost:
        if (events_.on_peer_lost) {
          events_.on_peer_lost(m->node, absl::UnavailableError(m->text));
        }
        break;
      case ControlType::kPeerJoined:
        if (events_.on_peer_joined) events_.on_peer_joined(m->node, m->text);
        break;
      default:
        STEPMESH_LOG(kWarning, "ignoring control message ", static_cast<int>(m->type));
    }
  }
}

absl::Status RendezvousClient::Barrier(absl::Duration timeout) {
  uint64_t sequence;
  {
    base::MutexLock lock(&mu_);
    STEPMESH_RETURN_IF_ERROR(scheduler_status_);
    sequence = ++barrier_sent_;
  }
  ControlMessage m;
  m.type = ControlType::kBarrier;
  m.sequence = sequence;
  STEPMESH_RETURN_IF_ERROR(Send(m));
  base::MutexLock lock(&mu_);
  auto released = [this, sequence]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return barrier_released_ >= sequence || !scheduler_status_.ok();
  };
  if (!mu_.AwaitWithTimeout(released, timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("barrier ", sequence, " not reached in ",
                                                    absl::FormatDuration(timeout)));
  }
  return scheduler_status_;
}

void RendezvousClient::Leave() {
  if (left_.exchange(true)) return;
  ControlMessage m;
  m.type = ControlType::kLeave;
  (void)Send(m);  // the scheduler may already be gone: nothing to tell then
}

}  // namespace stepmesh::core
