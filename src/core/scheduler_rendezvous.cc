#include "src/core/scheduler_rendezvous.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/thread_util.h"
#include "src/core/auth.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

// How long one reconnection attempt may take, and the pause between attempts
// (doubling up to the last).
constexpr absl::Duration kRedialAttempt = absl::Milliseconds(500);
constexpr absl::Duration kRedialFirstPause = absl::Milliseconds(50);
constexpr absl::Duration kRedialMaxPause = absl::Seconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<SchedulerRendezvous>> SchedulerRendezvous::Join(
    const MeshOptions& options, const std::string& endpoint) {
  const absl::Time deadline = absl::Now() + options.timeout;
  std::unique_ptr<SchedulerRendezvous> client(new SchedulerRendezvous(options, endpoint));
  STEPMESH_RETURN_IF_ERROR(client->Dial(deadline, /*resume=*/false));
  const int fd = client->fd_.get();  // no other thread yet
  for (;;) {
    absl::StatusOr<ControlMessage> reply = ReceiveControl(fd, deadline);
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
      STEPMESH_RETURN_IF_ERROR(SendControl(fd, pong, deadline));
      continue;
    }
    if (reply->type != ControlType::kRoster) {
      return absl::DataLossError(absl::StrCat("unexpected control message ",
                                              static_cast<int>(reply->type), " before roster"));
    }
    client->rank_ = reply->rank;
    client->self_ = MakeNodeId(options.role, reply->rank);
    client->roster_ = std::move(reply->roster);
    // Epoch 0 is the roster the mesh formed with; a later one, a join into
    // the running mesh.
    client->roster_epoch_ = reply->epoch;
    client->joined_running_ = reply->epoch > 0;
    client->epoch_ = reply->epoch;
    base::MutexLock lock(&client->mu_);
    // A joiner counts barriers from the mesh's (the one in progress passes without it).
    client->barrier_sent_ = client->barrier_released_ = reply->sequence;
    client->connected_ = true;
    return client;
  }
}

absl::Status SchedulerRendezvous::Dial(absl::Time deadline, bool resume) {
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort scheduler, base::ParseHostPort(options_.scheduler));
  absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp(scheduler, deadline);
  if (!fd.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot reach the scheduler at ", options_.scheduler,
                                               ": ", fd.status().message()));
  }
  {
    base::MutexLock lock(&write_mu_);
    fd_ = *std::move(fd);
  }
  if (!options_.auth_token.empty()) STEPMESH_RETURN_IF_ERROR(Authenticate(deadline));
  ControlMessage join;
  join.type = ControlType::kJoin;
  join.role = static_cast<uint8_t>(options_.role);
  join.rank = resume ? rank_ : options_.rank;
  join.text = endpoint_;
  join.num_workers = static_cast<uint32_t>(options_.num_workers);
  join.num_servers = static_cast<uint32_t>(options_.num_servers);
  join.max_workers = static_cast<uint32_t>(options_.WorkerCapacity());
  join.max_servers = static_cast<uint32_t>(options_.ServerCapacity());
  join.mesh_id = options_.mesh_id;
  if (resume) {
    join.join_flags = kJoinResume;
    join.epoch = epoch_.load();
    base::MutexLock lock(&mu_);
    join.sequence = barrier_sent_;
    join.barrier_released = barrier_released_;
  }
  base::MutexLock lock(&write_mu_);
  return SendControl(fd_.get(), join, deadline);
}

absl::Status SchedulerRendezvous::Authenticate(absl::Time deadline) {
  // Mutual: the scheduler proves the secret first, so a participant never
  // joins (and reveals its endpoint to) an impostor scheduler.
  const std::string& secret = options_.auth_token;
  const int fd = fd_.get();  // only the dialling thread uses the new connection yet
  STEPMESH_ASSIGN_OR_RETURN(AuthNonce ours, RandomNonce());
  ControlMessage challenge;
  challenge.type = ControlType::kChallenge;
  challenge.text = std::string(AsText(ours));
  STEPMESH_RETURN_IF_ERROR(SendControl(fd, challenge, deadline));
  auto expect = [&](ControlType type) -> absl::StatusOr<ControlMessage> {
    STEPMESH_ASSIGN_OR_RETURN(ControlMessage m, ReceiveControl(fd, deadline));
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
  if (!CheckAuthProof(secret, AuthSide::kAcceptor, "control", ours, scheduler_nonce, proof.text)) {
    STEPMESH_LOG(kWarning, "the scheduler failed authentication (wrong auth token?)");
    return absl::PermissionDeniedError("the scheduler failed authentication (wrong auth token?)");
  }
  ControlMessage answer;
  answer.type = ControlType::kProof;
  answer.text =
      std::string(AsText(AuthProof(secret, AuthSide::kDialer, "control", ours, scheduler_nonce)));
  return SendControl(fd, answer, deadline);
}

SchedulerRendezvous::~SchedulerRendezvous() {
  Leave();
  stop_.store(true);
  peer_events_.Stop();  // the node is stopping: pending events no longer matter
  if (monitor_.joinable()) monitor_.join();
}

void SchedulerRendezvous::StartMonitor(RendezvousEvents events) {
  events_ = std::move(events);
  peer_events_.Start();
  monitor_ = base::StartNamedThread("sm-rendezvous", {}, [this] { MonitorLoop(); });
}

absl::Status SchedulerRendezvous::Send(const ControlMessage& message) {
  base::MutexLock lock(&write_mu_);
  if (!fd_.valid()) return absl::UnavailableError("no scheduler connection");
  return SendControl(fd_.get(), message, absl::Now() + options_.timeout);
}

void SchedulerRendezvous::MonitorLoop() {
  absl::Duration pause = kRedialFirstPause;
  while (!stop_.load(std::memory_order_relaxed)) {
    bool connected, gave_up;
    {
      base::MutexLock lock(&mu_);
      connected = connected_;
      gave_up = gave_up_;
    }
    if (!connected) {
      if (gave_up || left_.load()) {
        absl::SleepFor(absl::Milliseconds(20));
        continue;
      }
      if (Reconnect()) {
        pause = kRedialFirstPause;
        continue;
      }
      const absl::Time until = absl::Now() + pause;
      while (!stop_.load() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
      pause = std::min(pause * 2, kRedialMaxPause);
      continue;
    }
    const int fd = fd_.get();  // only this thread replaces it
    absl::StatusOr<bool> readable = base::WaitReadable(fd, absl::Now() + absl::Milliseconds(50));
    if (readable.ok() && !*readable) continue;
    absl::StatusOr<ControlMessage> m =
        readable.ok() ? ReceiveControl(fd, absl::Now() + options_.timeout) : readable.status();
    if (!m.ok()) {
      Disconnected(m.status());
      continue;
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
      case ControlType::kClock: {
        const uint64_t now = MonotonicNowNs();
        base::MutexLock lock(&mu_);
        if (m->sequence == clock_sent_ns_ && clock_received_ns_ == 0) {  // else a late answer
          clock_scheduler_ns_ = m->clock_ns;
          clock_received_ns_ = now;
        }
        break;
      }
      case ControlType::kPeerLost:
      case ControlType::kPeerLeft:
      case ControlType::kPeerJoined: {
        MembershipEvent event;
        event.kind = m->type == ControlType::kPeerLost   ? MembershipEvent::Kind::kLost
                     : m->type == ControlType::kPeerLeft ? MembershipEvent::Kind::kLeft
                                                         : MembershipEvent::Kind::kJoined;
        event.node = m->node;
        if (m->type == ControlType::kPeerLost) event.why = absl::UnavailableError(m->text);
        if (m->type == ControlType::kPeerJoined) event.endpoint = m->text;
        // Stamped by the scheduler: every participant numbers a change alike.
        event.epoch = m->epoch;
        epoch_.store(std::max(epoch_.load(), m->epoch));
        Post([this, event = std::move(event)] { Dispatch(events_, event); });
        break;
      }
      case ControlType::kRoster:
        break;  // a restarted scheduler's view after a resume: ours is the same
      default:
        STEPMESH_LOG(kWarning, "ignoring control message ", static_cast<int>(m->type),
                     " from the scheduler");
    }
  }
}

void SchedulerRendezvous::Disconnected(const absl::Status& why) {
  {
    base::MutexLock lock(&write_mu_);
    fd_.Reset();
  }
  base::MutexLock lock(&mu_);
  connected_ = false;
  disconnected_at_ = absl::Now();
  scheduler_status_ = absl::UnavailableError(absl::StrCat(
      "lost the connection to the scheduler at ", options_.scheduler, ": ", why.message()));
  if (!stop_.load() && !left_.load()) {
    STEPMESH_LOG(kWarning, scheduler_status_.message(),
                 "; the data plane carries on, redialling (barriers wait for it)");
  }
}

bool SchedulerRendezvous::Reconnect() {
  const absl::Time deadline = absl::Now() + kRedialAttempt;
  absl::Status dialled = Dial(deadline, /*resume=*/true);
  absl::StatusOr<ControlMessage> reply = absl::UnknownError("no answer");
  if (!dialled.ok()) reply = dialled;
  while (dialled.ok()) {
    reply = ReceiveControl(fd_.get(), std::max(deadline, absl::Now() + absl::Seconds(2)));
    if (!reply.ok() || reply->type != ControlType::kPing) break;
    ControlMessage pong;
    pong.type = ControlType::kPong;
    pong.sequence = reply->sequence;
    (void)Send(pong);
  }
  if (reply.ok() && reply->type == ControlType::kRoster) {
    base::MutexLock lock(&mu_);
    connected_ = true;
    STEPMESH_LOG(
        kWarning, "reconnected to the scheduler at ", options_.scheduler, " after ",
        absl::FormatDuration(absl::Trunc(absl::Now() - disconnected_at_, absl::Milliseconds(1))));
    scheduler_status_ = absl::OkStatus();
    return true;
  }
  {
    base::MutexLock lock(&write_mu_);
    fd_.Reset();
  }
  if (reply.ok() || absl::IsPermissionDenied(reply.status())) {
    // The scheduler answered and refused: it runs another mesh, or declared
    // this node lost. Redialling cannot change that.
    const std::string reason =
        reply.ok() ? (reply->type == ControlType::kReject
                          ? reply->text
                          : absl::StrCat("sent control message ", static_cast<int>(reply->type)))
                   : std::string(reply.status().message());
    base::MutexLock lock(&mu_);
    gave_up_ = true;
    scheduler_status_ = absl::UnavailableError(
        absl::StrCat("the scheduler at ", options_.scheduler, " refused this node back: ", reason));
    STEPMESH_LOG(kWarning, scheduler_status_.message(), "; no more barriers");
  }
  return false;
}
ClockSync ClockFromExchange(uint64_t sent_ns, uint64_t scheduler_ns, uint64_t received_ns) {
  const uint64_t rtt = received_ns - sent_ns;
  return ClockSync{static_cast<int64_t>(scheduler_ns - (sent_ns + rtt / 2)), rtt};
}

absl::StatusOr<ClockSync> SchedulerRendezvous::EstimateClock(int samples, absl::Duration timeout) {
  base::MutexLock one_at_a_time(&clock_mu_);
  std::optional<ClockSync> best;
  absl::Status last = absl::InvalidArgumentError("no samples asked for");
  for (int i = 0; i < samples; ++i) {
    ControlMessage m;
    m.type = ControlType::kClock;
    {
      base::MutexLock lock(&mu_);
      // Distinct per exchange even within one clock tick: the answer is matched by it.
      m.sequence = std::max(MonotonicNowNs(), clock_sent_ns_ + 1);
      clock_sent_ns_ = m.sequence;
      clock_received_ns_ = 0;
    }
    if (absl::Status sent = Send(m); !sent.ok()) {
      last = sent;
      continue;
    }
    base::MutexLock lock(&mu_);
    auto answered = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return clock_received_ns_ != 0; };
    if (!mu_.AwaitWithTimeout(answered, timeout)) {
      last = absl::DeadlineExceededError(absl::StrCat(
          "the scheduler did not answer a clock query within ", absl::FormatDuration(timeout)));
      continue;
    }
    const ClockSync sample =
        ClockFromExchange(clock_sent_ns_, clock_scheduler_ns_, clock_received_ns_);
    if (!best || sample.round_trip_ns < best->round_trip_ns) best = sample;
  }
  if (!best) return last;
  return *best;
}

absl::Status SchedulerRendezvous::Barrier(absl::Duration timeout) {
  uint64_t sequence;
  {
    base::MutexLock lock(&mu_);
    if (!connected_ || gave_up_) {
      return absl::UnavailableError(absl::StrCat(
          scheduler_status_.message(), gave_up_ ? "" : " (redialling; barriers need it)"));
    }
    sequence = ++barrier_sent_;
  }
  ControlMessage m;
  m.type = ControlType::kBarrier;
  m.sequence = sequence;
  // A failed send is a lost connection the monitor is about to see: the
  // barrier is re-sent with the resume, so keep waiting.
  (void)Send(m);
  base::MutexLock lock(&mu_);
  auto released = [this, sequence]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return barrier_released_ >= sequence || gave_up_;
  };
  if (!mu_.AwaitWithTimeout(released, timeout)) {
    if (!connected_) {
      return absl::UnavailableError(
          absl::StrCat("barrier ", sequence, ": ", scheduler_status_.message(),
                       " and it did not come back within ", absl::FormatDuration(timeout)));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("barrier ", sequence, " not reached in ", absl::FormatDuration(timeout)));
  }
  if (barrier_released_ >= sequence) return absl::OkStatus();
  return scheduler_status_;
}

absl::Status SchedulerRendezvous::AnnounceLeaving() {
  {
    base::MutexLock lock(&mu_);
    if (!connected_ || gave_up_) {
      return absl::UnavailableError(
          absl::StrCat("cannot announce the drain: ", scheduler_status_.message(),
                       gave_up_ ? "" : " (redialling; the scheduler must hear of a drain)"));
    }
  }
  ControlMessage m;
  m.type = ControlType::kDrain;
  return Send(m);
}

void SchedulerRendezvous::Leave() {
  if (left_.exchange(true)) return;
  {
    base::MutexLock lock(&mu_);
    if (!connected_) return;  // nobody to tell (or a redial half done)
  }
  ControlMessage m;
  m.type = ControlType::kLeave;
  (void)Send(m);  // the scheduler may already be gone: nothing to tell then
}

absl::StatusOr<std::unique_ptr<Rendezvous>> JoinScheduler(const MeshOptions& options,
                                                          const std::string& endpoint) {
  STEPMESH_ASSIGN_OR_RETURN(RendezvousUrl url, ParseRendezvousUrl(options));
  if (url.scheme != "scheduler") {
    return absl::InvalidArgumentError(absl::StrCat(
        "rendezvous '", RedactedRendezvous(options.rendezvous),
        "' (STEPMESH_RENDEZVOUS): this participant was built without a rendezvous factory for ",
        url.scheme, ":// (create it through AFTensorWorker/AFTensorServer::Create)"));
  }
  MeshOptions at = options;
  at.scheduler = url.rest;
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<SchedulerRendezvous> joined,
                            SchedulerRendezvous::Join(at, endpoint));
  return std::unique_ptr<Rendezvous>(std::move(joined));
}

}  // namespace stepmesh::core
