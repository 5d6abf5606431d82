// SHA-256 / HMAC-SHA256 against published vectors, and the shared-secret
// challenge-response on the scheduler and on every data connection.

#include "src/core/auth.h"

#include <catch2/catch.hpp>
#include <future>
#include <string>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "src/compose/transports.h"
#include "src/core/control_message.h"
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

std::string Hex(const core::Sha256Digest& d) {
  return absl::BytesToHexString(core::AsText(d));
}

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
  CHECK_FALSE(core::CheckAuthProof("s3cret", AuthSide::kAcceptor, "ctx", a, b, core::AsText(proof)));
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

}  // namespace
}  // namespace stepmesh
