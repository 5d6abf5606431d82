// The rendezvous service (stepmesh/scheduler.h): one thread running an event
// loop over the listener and every control connection. Ranks, roster,
// barriers, liveness.
//
// Nothing a connection does can hold the loop: sockets are non-blocking,
// messages are reassembled from whatever arrived (ControlAssembler) and sent
// from a per-connection output buffer continued on writability, so a client
// that trickles a byte a second, never reads, or never finishes its handshake
// costs a descriptor and a few bytes until its own deadline, never the
// heartbeats of everyone else. Connections that have not joined are capped
// per source address and in total (the oldest goes first), and running out
// of descriptors backs off instead of spinning (base::Acceptor).
//
// A scheduler restarted on the same address rebuilds its roster from the
// participants that reconnect (kJoin with kJoinResume): after rendezvous the
// data plane never needs the scheduler, so losing it only pauses barriers and
// liveness reports until it is back.
//
// This file: the loop and the connections. The jobs of the members are in
// the files that src/core/scheduler_impl.h lists.

#include "stepmesh/scheduler.h"

#include <sys/epoll.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/logging.h"
#include "src/base/thread_util.h"
#include "src/core/scheduler_impl.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

// A connection gets this long (or the mesh timeout, if shorter) from accept to
// its join; participants need a round trip or two.
constexpr absl::Duration kJoinTimeout = absl::Seconds(10);
// Connections that have not joined yet, per source address and in total: at
// least these, and room for every participant of the mesh (CapsForPeers).
constexpr size_t kMaxPendingPerAddress = 16;
constexpr size_t kMaxPending = 64;
// A refused connection gets this long to read why before it is closed.
constexpr absl::Duration kLinger = absl::Seconds(1);

}  // namespace

SchedulerImpl::SchedulerImpl(const MeshOptions& options, base::EventLoop loop,
                             base::Acceptor acceptor, std::string address)
    : options_(options),
      loop_(std::move(loop)),
      acceptor_(std::move(acceptor)),
      address_(std::move(address)),
      join_timeout_(std::min(options.timeout, kJoinTimeout)),
      join_caps_(base::CapsForPeers(static_cast<size_t>(options.WorkerCapacity()) +
                                        static_cast<size_t>(options.ServerCapacity()),
                                    {kMaxPendingPerAddress, kMaxPending})),
      workers_(options.WorkerCapacity()),
      servers_(options.ServerCapacity()),
      start_workers_(options.num_workers),
      start_servers_(options.num_servers) {
  thread_ = base::StartNamedThread("sm-scheduler", {}, [this] { Run(); });
}

absl::Status SchedulerImpl::WaitUntilDone(absl::Duration timeout) {
  if (!done_.WaitForNotificationWithTimeout(timeout)) {
    return absl::DeadlineExceededError("scheduler: participants still running");
  }
  return absl::OkStatus();
}

absl::Status SchedulerImpl::WaitForParticipants() {
  const absl::Time form_deadline = absl::Now() + options_.timeout;
  // Until everyone left or was lost: liveness is the heartbeat's (a
  // participant silent for options.timeout is lost), not a deadline here.
  while (!done_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
    if (stop_.load()) return absl::CancelledError("scheduler: stopped while waiting");
    if (!formed_note_.HasBeenNotified() && absl::Now() >= form_deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("scheduler: the mesh did not form within ",
                       absl::FormatDuration(options_.timeout), " (", joined_count_.load(), " of ",
                       options_.num_workers + options_.num_servers, " participants joined)"));
    }
  }
  return absl::OkStatus();
}

void SchedulerImpl::Stop() {
  stop_.store(true);
  loop_.Wake();
  if (thread_.joinable()) thread_.join();
}

// Queues `m` on `c` and writes what the socket takes now.
void SchedulerImpl::Queue(Conn& c, const ControlMessage& m) {
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
  }
  c.out += EncodeControl(m);
  Flush(c);
}

// Writes queued bytes without blocking; false when the connection broke.
bool SchedulerImpl::Flush(Conn& c) {
  while (c.out_sent < c.out.size()) {
    const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out_sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    return false;
  }
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
  }
  return true;
}

// Tells a connection that has not joined why it is refused, then closes it
// once that went out (or after kLinger).
void SchedulerImpl::Refuse(Conn& c, absl::string_view reason) {
  STEPMESH_LOG_LIMITED(refusals_, kWarning, "scheduler: refused ", c.peer, ": ", reason);
  ControlMessage m;
  m.type = ControlType::kReject;
  m.text = std::string(reason);
  Queue(c, m);
  c.stage = Conn::Stage::kClosing;
  c.deadline = absl::Now() + kLinger;
}

// A protocol violation by a connection that has not joined: logged (rate
// limited, with the address and the reason) and closed.
void SchedulerImpl::Drop(Conn& c, absl::string_view reason) {
  STEPMESH_LOG_LIMITED(violations_, kWarning, "scheduler: dropped the connection from ", c.peer,
                       ": ", reason);
  Close(c);
}

void SchedulerImpl::Close(Conn& c) {
  if (c.watched) loop_.Unwatch(c.fd.get());
  c.fd.Reset();
  if (c.node != kNoNode && At(c.node).conn == &c) At(c.node).conn = nullptr;
  c.node = kNoNode;
}

void SchedulerImpl::Accept(absl::Time now) {
  base::AcceptAndAdmit(
      acceptor_, exhausted_, "scheduler", conns_,
      [](const Conn& c) { return c.fd.valid() && c.pending(); },
      [](const Conn& c) -> const std::string& { return c.peer; }, join_caps_,
      [this](Conn& c, const std::string& why) { Drop(c, why); },
      [&](base::Acceptor::Accepted accepted) {
        conns_.emplace_back();
        Conn& c = conns_.back();
        c.fd = std::move(accepted.fd);
        c.peer = std::move(accepted.peer);
        c.accepted = now;
        c.deadline = now + join_timeout_;
      });
}

// Reads what arrived and handles complete messages; bounded per call, so
// one busy connection cannot starve the others.
void SchedulerImpl::Read(Conn& c) {
  std::byte chunk[16 << 10];
  for (int round = 0; round < 4 && c.fd.valid(); ++round) {
    const ssize_t n = ::recv(c.fd.get(), chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n == 0) return Broken(c, "closed the connection");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return Broken(c, base::ErrnoMessage("recv", errno));
    }
    if (c.stage == Conn::Stage::kClosing) continue;  // draining before the close
    c.in.Feed(absl::MakeConstSpan(chunk, static_cast<size_t>(n)));
    for (int messages = 0; messages < 64 && c.fd.valid() && c.stage != Conn::Stage::kClosing;
         ++messages) {
      absl::StatusOr<std::optional<ControlMessage>> m = c.in.Next();
      if (!m.ok()) return Violation(c, m.status().ToString());
      if (!m->has_value()) break;
      if (c.stage == Conn::Stage::kMember) {
        HandleMessage(c.node, **m);
      } else {
        Advance(c, **m);
      }
    }
  }
}

void SchedulerImpl::Broken(Conn& c, absl::string_view why) {
  if (c.stage == Conn::Stage::kMember) {
    const NodeId node = c.node;
    Close(c);
    MarkLost(node, std::string(why));
    return;
  }
  if (c.stage != Conn::Stage::kClosing) {
    STEPMESH_LOG(kInfo, "scheduler: ", c.peer, " ", why, " before joining");
  }
  Close(c);
}

void SchedulerImpl::Violation(Conn& c, absl::string_view why) {
  if (c.stage == Conn::Stage::kMember) {
    const NodeId node = c.node;
    STEPMESH_LOG_LIMITED(violations_, kWarning, "scheduler: ", PeerName(node), " (", c.peer,
                         ") broke the control protocol: ", why);
    Close(c);
    MarkLost(node, absl::StrCat("broke the control protocol: ", why));
    return;
  }
  Drop(c, why);
}

void SchedulerImpl::Expire(absl::Time now) {
  for (Conn& c : conns_) {
    if (!c.fd.valid() || now < c.deadline) continue;
    if (c.stage == Conn::Stage::kClosing) {
      Close(c);
    } else if (c.pending()) {
      Drop(c, absl::StrCat("did not join within ", absl::FormatDuration(join_timeout_)));
    }
  }
  conns_.remove_if([](const Conn& c) { return !c.fd.valid(); });
}

void SchedulerImpl::Run() {
  // The loop watches the listener (while not paused) and every connection,
  // for writability too while it has bytes to write.
  bool listening = false;
  epoll_event events[64];
  while (!stop_.load()) {
    absl::Time now = absl::Now();
    if (const bool listen = now >= acceptor_.paused_until(); listen != listening) {
      if (listen) {
        listening = loop_.Watch(acceptor_.fd(), EPOLLIN, kListenerToken).ok();
      } else {
        loop_.Unwatch(acceptor_.fd());
        listening = false;
      }
    }
    absl::Time wake = now + absl::Milliseconds(50);
    for (Conn& c : conns_) {
      if (!c.fd.valid()) continue;
      const bool out = c.out_sent < c.out.size();
      const uint32_t wanted = EPOLLIN | (out ? uint32_t{EPOLLOUT} : 0u);
      const uint64_t token = reinterpret_cast<uintptr_t>(&c);
      if (!c.watched) {
        c.watched = loop_.Watch(c.fd.get(), wanted, token).ok();
        c.out_armed = out;
      } else if (out != c.out_armed && loop_.Modify(c.fd.get(), wanted, token).ok()) {
        c.out_armed = out;
      }
      wake = std::min(wake, c.deadline);
    }
    const int timeout_ms =
        static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - now) + 1, 0, 50));
    absl::StatusOr<int> ready = loop_.Wait(events, 64, timeout_ms);
    if (!ready.ok()) {
      STEPMESH_LOG_LIMITED(violations_, kWarning, "scheduler: ", ready.status().message());
    }
    now = absl::Now();
    for (int i = 0; i < (ready.ok() ? *ready : 0); ++i) {
      if (events[i].data.u64 == kListenerToken) {
        Accept(now);
        continue;
      }
      // Connections leave the loop before they close, and the list only in
      // Expire below: the pointer is valid.
      Conn& c = *reinterpret_cast<Conn*>(static_cast<uintptr_t>(events[i].data.u64));
      if (!c.fd.valid()) continue;  // closed while handling an earlier one
      const uint32_t revents = events[i].events;
      // Reads first: a participant that leaves sends its kLeave and closes
      // with our messages unread, which resets the connection; its leave
      // is still in the receive queue, and must be read before a write
      // that fails on the reset declares it lost.
      if (revents & (EPOLLIN | EPOLLHUP | EPOLLERR)) Read(c);
      if (!c.fd.valid()) continue;
      if ((revents & EPOLLOUT) && !Flush(c)) {
        Broken(c, "connection reset while writing");
        continue;
      }
      if (c.stage == Conn::Stage::kClosing && c.out_sent == c.out.size()) Close(c);
    }
    Expire(now);
    if (formed_) {
      Heartbeat(now);
      bool anyone = false;
      ForEachMember([&](NodeId, Member& o) { anyone = anyone || o.live(); });
      if (!anyone && !done_.HasBeenNotified()) done_.Notify();
    }
  }
}

}  // namespace stepmesh::core

namespace stepmesh {

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Start(const MeshOptions& options) {
  STEPMESH_RETURN_IF_ERROR(options.Validate());
  STEPMESH_ASSIGN_OR_RETURN(base::HostPort where, base::ParseHostPort(options.scheduler));
  bool open_on_loopback = false;
  STEPMESH_RETURN_IF_ERROR(
      core::CheckAuthPolicy(options, "the scheduler", where.host, &open_on_loopback));
  STEPMESH_ASSIGN_OR_RETURN(base::UniqueFd listener, base::ListenTcp(where.host, where.port));
  STEPMESH_ASSIGN_OR_RETURN(uint16_t port, base::LocalPort(listener.get()));
  STEPMESH_ASSIGN_OR_RETURN(base::Acceptor acceptor, base::Acceptor::Create(std::move(listener)));
  const std::string address = absl::StrCat(where.host, ":", port);
  if (open_on_loopback) {
    STEPMESH_LOG(kWarning, "scheduler at ", address,
                 ": no auth token, so any local process can join this mesh (set "
                 "STEPMESH_AUTH_TOKEN on every process, or STEPMESH_AUTH=off to silence this)");
  }
  STEPMESH_ASSIGN_OR_RETURN(base::EventLoop loop, base::EventLoop::Create());
  return std::unique_ptr<Scheduler>(
      new core::SchedulerImpl(options, std::move(loop), std::move(acceptor), address));
}

}  // namespace stepmesh
