// SHA-256 / HMAC-SHA256 against published vectors, and the shared-secret
// challenge-response on the scheduler and on every data connection.

#include "src/core/auth.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <future>
#include <string>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/compose/transports.h"
#include "src/core/control_message.h"
#include "src/core/handshake.h"
#include "src/core/mesh.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/scheduler.h"
#include "tests/reliability/harness.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

using core::AuthNonce;
using core::AuthSide;
using testing::StartLoopbackScheduler;

std::string Hex(const core::Sha256Digest& d) { return absl::BytesToHexString(core::AsText(d)); }

TEST_CASE("auth: SHA-256 matches FIPS 180-2 vectors", "[auth]") {
  CHECK(Hex(core::Sha256Of("")) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(Hex(core::Sha256Of("abc")) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(Hex(core::Sha256Of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  core::Sha256 million;
  const std::string chunk(1000, 'a');
  for (int i = 0; i < 1000; ++i) million.Update(chunk);
  CHECK(Hex(million.Finish()) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("auth: HMAC-SHA256 matches RFC 4231", "[auth]") {
  auto bytes = [](int value, int n) { return std::string(n, static_cast<char>(value)); };
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4.push_back(static_cast<char>(i));
  CHECK(Hex(core::HmacSha256(bytes(0x0b, 20), "Hi There")) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(Hex(core::HmacSha256("Jefe", "what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(Hex(core::HmacSha256(bytes(0xaa, 20), bytes(0xdd, 50))) ==
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  CHECK(Hex(core::HmacSha256(key4, bytes(0xcd, 50))) ==
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  CHECK(Hex(core::HmacSha256(bytes(0xaa, 131),
                             "Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(Hex(core::HmacSha256(
            bytes(0xaa, 131),
            "This is a test using a larger than block-size key and a larger than block-size "
            "data. The key needs to be hashed before being used by the HMAC algorithm.")) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST_CASE("auth: proofs depend on secret, side, context and both nonces", "[auth]") {
  const AuthNonce a = *core::RandomNonce();
  const AuthNonce b = *core::RandomNonce();
  CHECK(a != b);
  const auto proof = core::AuthProof("s3cret", AuthSide::kDialer, "ctx", a, b);
  CHECK(core::CheckAuthProof("s3cret", AuthSide::kDialer, "ctx", a, b, core::AsText(proof)));
  CHECK_FALSE(core::CheckAuthProof("s3creT", AuthSide::kDialer, "ctx", a, b, core::AsText(proof)));
  CHECK_FALSE(
      core::CheckAuthProof("s3cret", AuthSide::kAcceptor, "ctx", a, b, core::AsText(proof)));
  CHECK_FALSE(core::CheckAuthProof("s3cret", AuthSide::kDialer, "ctx2", a, b, core::AsText(proof)));
  CHECK_FALSE(core::CheckAuthProof("s3cret", AuthSide::kDialer, "ctx", b, a, core::AsText(proof)));
  CHECK_FALSE(core::CheckAuthProof("s3cret", AuthSide::kDialer, "ctx", a, b, "short"));
}

MeshOptions AuthOptions(const std::string& token) {
  MeshOptions o;
  o.transport = "tcp";
  o.timeout = absl::Seconds(3);
  o.auth_token = token;
  return o;
}

TEST_CASE("auth: a mesh whose members share the secret works", "[auth]") {
  testing::HarnessConfig c;
  c.workers = 2;
  c.servers = 1;
  c.options = AuthOptions("correct horse battery staple");
  testing::Harness mesh(c, compose::CreateTransport);
  REQUIRE_OK(mesh.status());
  auto h0 = mesh.Start(0, 0, 1);
  auto h1 = mesh.Start(1, 0, 2);
  REQUIRE(h0.ok());
  REQUIRE(h1.ok());
  CHECK(mesh.Finish(0, 0, *h0, 1, absl::Seconds(5)).ok());
  CHECK(mesh.Finish(1, 0, *h1, 2, absl::Seconds(5)).ok());
}

TEST_CASE("auth: the scheduler refuses participants without the secret", "[auth]") {
  MeshOptions o = AuthOptions("the-secret");
  o.num_workers = 1;
  o.num_servers = 1;
  auto scheduler = StartLoopbackScheduler(o);
  REQUIRE_OK(scheduler);
  MeshOptions w = o;
  w.role = Role::kWorker;
  for (const std::string& token : {std::string(), std::string("wrong-secret")}) {
    INFO("token '" << token << "'");
    w.auth_token = token;
    const absl::Time start = absl::Now();
    auto worker = AFTensorWorker::Create(w);
    INFO(worker.status().ToString());
    CHECK(absl::IsPermissionDenied(worker.status()));
    CHECK(absl::Now() - start < absl::Seconds(3));
  }
  // A participant with a secret refuses a scheduler without one.
  MeshOptions open = o;
  open.auth_token.clear();
  auto open_scheduler = StartLoopbackScheduler(open);
  REQUIRE_OK(open_scheduler);
  w.scheduler = open.scheduler;
  w.auth_token = "the-secret";
  CHECK(absl::IsPermissionDenied(AFTensorWorker::Create(w).status()));
}

TEST_CASE("auth: a raw unauthenticated join gets kReject, the secret never crosses the wire",
          "[auth]") {
  MeshOptions o = AuthOptions("never-on-the-wire");
  o.num_workers = 1;
  o.num_servers = 1;
  auto scheduler = StartLoopbackScheduler(o);
  REQUIRE_OK(scheduler);
  auto where = base::ParseHostPort(o.scheduler);
  REQUIRE(where.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  auto fd = base::ConnectTcp(*where, deadline);
  REQUIRE(fd.ok());
  core::ControlMessage join;
  join.type = core::ControlType::kJoin;
  join.role = 1;
  join.rank = 0;
  join.text = "127.0.0.1:1";
  REQUIRE(core::SendControl(fd->get(), join, deadline).ok());
  auto reply = core::ReceiveControl(fd->get(), deadline);
  REQUIRE(reply.ok());
  CHECK(reply->type == core::ControlType::kReject);
  CHECK(reply->text.find("never-on-the-wire") == std::string::npos);

  // A challenge answered with a bogus proof is refused too.
  auto fd2 = base::ConnectTcp(*where, deadline);
  REQUIRE(fd2.ok());
  core::ControlMessage challenge;
  challenge.type = core::ControlType::kChallenge;
  challenge.text = std::string(core::AsText(*core::RandomNonce()));
  REQUIRE(core::SendControl(fd2->get(), challenge, deadline).ok());
  auto their_nonce = core::ReceiveControl(fd2->get(), deadline);
  auto their_proof = core::ReceiveControl(fd2->get(), deadline);
  REQUIRE(their_nonce.ok());
  REQUIRE(their_proof.ok());
  CHECK(their_nonce->type == core::ControlType::kChallenge);
  CHECK(their_proof->type == core::ControlType::kProof);
  CHECK(their_proof->text.find("never-on-the-wire") == std::string::npos);
  core::ControlMessage bogus;
  bogus.type = core::ControlType::kProof;
  bogus.text = std::string(32, 'x');
  REQUIRE(core::SendControl(fd2->get(), bogus, deadline).ok());
  auto verdict = core::ReceiveControl(fd2->get(), deadline);
  REQUIRE(verdict.ok());
  CHECK(verdict->type == core::ControlType::kReject);
}

// Two bare TCP transports: a server (acceptor) and a worker (dialler).
struct Pair {
  absl::Status worker_result;
  absl::Status server_result;
};

Pair ConnectPair(const std::string& server_token, const std::string& worker_token) {
  MeshOptions so = AuthOptions(server_token);
  MeshOptions wo = AuthOptions(worker_token);
  auto server = *tcp::CreateTcpTransport(so);
  auto worker = *tcp::CreateTcpTransport(wo);
  const std::string endpoint = *server->LocalEndpoint();
  (void)*worker->LocalEndpoint();
  const core::NodeId w = core::WorkerId(0), s = core::ServerId(0);
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{w, ""};
    return server->Connect(s, {&peer, 1}, absl::Now() + absl::Seconds(2));
  });
  const core::PeerInfo peer{s, endpoint};
  Pair result;
  result.worker_result = worker->Connect(w, {&peer, 1}, absl::Now() + absl::Seconds(2));
  result.server_result = accepted.get();
  return result;
}

TEST_CASE("auth: data connections need the secret on both ends", "[auth]") {
  Pair ok = ConnectPair("k", "k");
  CHECK(ok.worker_result.ok());
  CHECK(ok.server_result.ok());
  for (auto [server_token, worker_token] :
       {std::pair{"k", ""}, std::pair{"", "k"}, std::pair{"k", "other"}}) {
    INFO("server '" << server_token << "', worker '" << worker_token << "'");
    Pair bad = ConnectPair(server_token, worker_token);
    INFO(bad.worker_result.ToString() << " / " << bad.server_result.ToString());
    CHECK(absl::IsPermissionDenied(bad.worker_result));
    CHECK(absl::IsDeadlineExceeded(bad.server_result));  // it waited for the real peer
  }
}

TEST_CASE("auth: a junk client on the data port is refused, the real peer still gets in",
          "[auth]") {
  MeshOptions o = AuthOptions("k");
  auto server = *tcp::CreateTcpTransport(o);
  auto worker = *tcp::CreateTcpTransport(o);
  const std::string endpoint = *server->LocalEndpoint();
  const core::NodeId w = core::WorkerId(0), s = core::ServerId(0);
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{w, ""};
    return server->Connect(s, {&peer, 1}, absl::Now() + absl::Seconds(5));
  });
  auto junk = base::ConnectTcp(*base::ParseHostPort(endpoint), absl::Now() + absl::Seconds(2));
  REQUIRE(junk.ok());
  const std::string garbage(48, 'G');
  REQUIRE(
      base::WriteFully(junk->get(), garbage.data(), garbage.size(), absl::Now() + absl::Seconds(1))
          .ok());
  absl::SleepFor(absl::Milliseconds(100));
  const core::PeerInfo peer{s, endpoint};
  CHECK(worker->Connect(w, {&peer, 1}, absl::Now() + absl::Seconds(3)).ok());
  CHECK(accepted.get().ok());
}

// A non-loopback address of this host, or "" when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return "";
  std::string found;
  for (ifaddrs* a = all; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char host[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, host,
                sizeof(host));
    if (std::string(host).rfind("127.", 0) != 0) found = host;
  }
  ::freeifaddrs(all);
  return found;
}

// The refusal happens before anything binds (CheckAuthPolicy looks at the
// address only), so these tests listen on nothing but loopback: the wildcard
// and this host's own interface address are refused before bind().
TEST_CASE("auth: without a token, a mesh refuses to listen where other machines reach it",
          "[auth]") {
  std::vector<std::string> hosts = {"0.0.0.0"};
  if (const std::string own = NonLoopbackAddress(); !own.empty()) hosts.push_back(own);
  for (const std::string& host : hosts) {
    INFO("host " << host);
    MeshOptions o = AuthOptions("");
    o.scheduler = host + ":0";
    auto scheduler = Scheduler::Start(o);
    INFO(scheduler.status().ToString());
    CHECK_STATUS(scheduler.status(), kFailedPrecondition);
    CHECK(absl::StrContains(scheduler.status().message(), "STEPMESH_AUTH_TOKEN"));
    CHECK(absl::StrContains(scheduler.status().message(), "STEPMESH_AUTH=off"));
    CHECK(absl::StrContains(scheduler.status().message(), host));

    MeshOptions w = AuthOptions("");
    w.bind_host = host;
    auto worker = AFTensorWorker::Create(w);
    INFO(worker.status().ToString());
    CHECK_STATUS(worker.status(), kFailedPrecondition);
    CHECK(absl::StrContains(worker.status().message(), "the data listener"));
  }
  // Loopback is allowed (the scheduler warns); a token or STEPMESH_AUTH=off allow any address.
  bool open = false;
  MeshOptions o = AuthOptions("");
  CHECK_OK(core::CheckAuthPolicy(o, "x", "127.0.0.1", &open));
  CHECK(open);
  CHECK_OK(core::CheckAuthPolicy(o, "x", "localhost", &open));
  CHECK(open);
  o.auth = AuthMode::kOff;
  CHECK_OK(core::CheckAuthPolicy(o, "x", "0.0.0.0", &open));
  CHECK_FALSE(open);
  o = AuthOptions("s3cret");
  CHECK_OK(core::CheckAuthPolicy(o, "x", "0.0.0.0", &open));
  CHECK_FALSE(open);
  // STEPMESH_AUTH=on insists on a token even on loopback.
  o = AuthOptions("");
  o.auth = AuthMode::kOn;
  CHECK_STATUS(o.Validate(), kInvalidArgument);
  CHECK_STATUS(core::CheckAuthPolicy(o, "x", "127.0.0.1", &open), kFailedPrecondition);
}

TEST_CASE("auth: STEPMESH_AUTH and STEPMESH_MESH_ID come from the environment", "[auth]") {
  ::setenv("STEPMESH_AUTH", "off", 1);
  ::setenv("STEPMESH_MESH_ID", "blue", 1);
  auto o = MeshOptions::FromEnv();
  ::setenv("STEPMESH_AUTH", "sometimes", 1);
  auto bad = MeshOptions::FromEnv();
  ::unsetenv("STEPMESH_AUTH");
  ::unsetenv("STEPMESH_MESH_ID");
  REQUIRE_OK(o);
  CHECK(o->auth == AuthMode::kOff);
  CHECK(o->mesh_id == "blue");
  CHECK_STATUS(bad.status(), kInvalidArgument);
  CHECK(absl::StrContains(bad.status().message(), "STEPMESH_AUTH"));
  auto token = GenerateAuthToken();
  REQUIRE_OK(token);
  CHECK(token->size() == 64);
  CHECK(*token != *GenerateAuthToken());
}

// Forwards one connection both ways and keeps what the dialler sent.
class RecordingProxy {
 public:
  explicit RecordingProxy(const std::string& target) {
    listener_ = *base::ListenTcp("127.0.0.1", 0);
    address_ = absl::StrCat("127.0.0.1:", *base::LocalPort(listener_.get()));
    thread_ = std::thread([this, target] {
      auto in = base::AcceptTcp(listener_.get(), absl::Now() + absl::Seconds(5));
      if (!in.ok()) return;
      auto out = base::ConnectTcp(*base::ParseHostPort(target), absl::Now() + absl::Seconds(5));
      if (!out.ok()) return;
      const absl::Time until = absl::Now() + absl::Seconds(3);
      pollfd fds[2] = {{in->get(), POLLIN, 0}, {out->get(), POLLIN, 0}};
      char buf[4096];
      while (absl::Now() < until && !done_.load()) {
        if (::poll(fds, 2, 20) <= 0) continue;
        for (int i = 0; i < 2; ++i) {
          if (!(fds[i].revents & (POLLIN | POLLHUP))) continue;
          const ssize_t n = ::recv(fds[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
          if (n <= 0) return;
          if (i == 0) {
            base::MutexLock lock(&mu_);
            sent_.append(buf, n);
          }
          (void)base::WriteFully(fds[1 - i].fd, buf, n, until);
        }
      }
    });
  }
  ~RecordingProxy() {
    done_ = true;
    thread_.join();
  }
  const std::string& address() const { return address_; }
  std::string sent() {
    base::MutexLock lock(&mu_);
    return sent_;
  }

 private:
  base::UniqueFd listener_;
  std::string address_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  base::Mutex mu_;
  std::string sent_;
};

TEST_CASE("auth: a replayed data handshake is refused (the acceptor's nonce is fresh)", "[auth]") {
  MeshOptions o = AuthOptions("k");
  const core::NodeId w = core::WorkerId(0), s = core::ServerId(0);
  // A real handshake through a recording proxy.
  auto server = *tcp::CreateTcpTransport(o);
  const std::string endpoint = *server->LocalEndpoint();
  RecordingProxy proxy(endpoint);
  auto accepted = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{w, ""};
    return server->Connect(s, {&peer, 1}, absl::Now() + absl::Seconds(3));
  });
  auto worker = *tcp::CreateTcpTransport(o);
  (void)*worker->LocalEndpoint();
  const core::PeerInfo via_proxy{s, proxy.address()};
  REQUIRE_OK(worker->Connect(w, {&via_proxy, 1}, absl::Now() + absl::Seconds(3)));
  REQUIRE_OK(accepted.get());
  const std::string capture = proxy.sent();
  REQUIRE(capture.size() == core::kHelloBytes + core::kSha256Bytes);

  // Replayed to a server (same secret, same identity) waiting for worker 0.
  auto fresh = *tcp::CreateTcpTransport(o);
  const std::string fresh_endpoint = *fresh->LocalEndpoint();
  auto waiting = std::async(std::launch::async, [&] {
    const core::PeerInfo peer{w, ""};
    return fresh->Connect(s, {&peer, 1}, absl::Now() + absl::Seconds(2));
  });
  auto replay =
      base::ConnectTcp(*base::ParseHostPort(fresh_endpoint), absl::Now() + absl::Seconds(2));
  REQUIRE_OK(replay);
  REQUIRE_OK(base::WriteFully(replay->get(), capture.data(), capture.size(),
                              absl::Now() + absl::Seconds(1)));
  // Accept + the acceptor's nonce and proof, then the refusal of the stale proof.
  char answer[4 + core::kAuthNonceBytes + core::kSha256Bytes + 4];
  REQUIRE_OK(
      base::ReadFully(replay->get(), answer, sizeof(answer), absl::Now() + absl::Seconds(2)));
  CHECK(std::string(answer + sizeof(answer) - 4, 4) == "SMNO");
  CHECK_STATUS(waiting.get(), kDeadlineExceeded);  // the replay never became worker 0
}

}  // namespace
}  // namespace stepmesh
