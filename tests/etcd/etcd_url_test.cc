// What STEPMESH_RENDEZVOUS accepts, what it refuses and how errors name it
// (never echoing an etcd password), without an etcd: the cluster tests are
// etcd_test.py.

#include <catch2/catch.hpp>
#include <string>

#include "absl/strings/match.h"
#include "src/compose/transports.h"
#include "src/core/rendezvous.h"
#include "src/rendezvous/etcd/etcd_client.h"
#include "stepmesh/options.h"
#include "tests/support/scoped_env.h"

namespace stepmesh {
namespace {

TEST_CASE("etcd URL: endpoints and credentials and prefix and bad endpoints named", "[etcd]") {
  absl::StatusOr<etcd::EtcdUrl> url =
      etcd::ParseEtcdUrl("me:p@ss:w0rd@10.0.0.1:2379,10.0.0.2:2379/stepmesh/mesh-a/");
  REQUIRE(url.ok());
  CHECK(url->endpoints == std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379"});
  CHECK(url->user == "me");
  CHECK(url->password == "p@ss:w0rd");
  CHECK(url->prefix == "/stepmesh/mesh-a");
  CHECK(etcd::ParseEtcdUrl("127.0.0.1:2379")->prefix.empty());

  absl::StatusOr<etcd::EtcdUrl> bad = etcd::ParseEtcdUrl("127.0.0.1:2379,host-without-port");
  REQUIRE(absl::IsInvalidArgument(bad.status()));
  CHECK(absl::StrContains(bad.status().message(), "'host-without-port' is not HOST:PORT"));
  CHECK(absl::IsInvalidArgument(etcd::ParseEtcdUrl("/prefix-only").status()));
  CHECK(absl::IsInvalidArgument(etcd::ParseEtcdUrl("nopassword@h:1").status()));
  CHECK(etcd::PrefixEnd("/stepmesh/a/") == "/stepmesh/a0");
}

TEST_CASE("STEPMESH_RENDEZVOUS: schemes and the scheduler default and errors that redact passwords",
          "[etcd]") {
  MeshOptions o;
  o.scheduler = "10.1.1.1:9000";
  absl::StatusOr<core::RendezvousUrl> url = core::ParseRendezvousUrl(o);
  REQUIRE(url.ok());
  CHECK((url->scheme == "scheduler" && url->rest == "10.1.1.1:9000"));
  o.rendezvous = "etcd://root:hunter2@127.0.0.1:2379/x";
  CHECK(core::RedactedRendezvous(o.rendezvous) == "etcd://root:***@127.0.0.1:2379/x");
  CHECK(core::ParseRendezvousUrl(o)->scheme == "etcd");

  o.rendezvous = "zk://root:hunter2@127.0.0.1:2181";
  absl::Status invalid = o.Validate();
  REQUIRE(absl::IsInvalidArgument(invalid));
  CHECK(absl::StrContains(invalid.message(), "STEPMESH_RENDEZVOUS"));
  CHECK(!absl::StrContains(invalid.message(), "hunter2"));
  absl::Status parsed = core::ParseRendezvousUrl(o).status();
  CHECK(absl::IsInvalidArgument(parsed));
  CHECK(!absl::StrContains(parsed.message(), "hunter2"));

  testing::ScopedEnv env({{"STEPMESH_RENDEZVOUS", "etcd://127.0.0.1:1/from-env"}});
  CHECK(MeshOptions::FromEnv()->rendezvous == "etcd://127.0.0.1:1/from-env");
}

TEST_CASE("without the composition root only the scheduler can be joined", "[etcd]") {
  MeshOptions o;
  o.rendezvous = "etcd://u:secret@127.0.0.1:1";
  absl::Status s = core::JoinScheduler(o, "tcp://127.0.0.1:1").status();
  REQUIRE(absl::IsInvalidArgument(s));
  CHECK(absl::StrContains(s.message(), "etcd://u:***@127.0.0.1:1"));
  CHECK(!absl::StrContains(s.message(), "secret"));
}

TEST_CASE("an unreachable etcd fails UNAVAILABLE naming its endpoints within the timeout",
          "[etcd]") {
  MeshOptions o;
  o.role = Role::kServer;
  o.rank = 0;
  o.timeout = absl::Milliseconds(600);
  o.rendezvous = "etcd://127.0.0.1:1,127.0.0.1:2/p";
  const absl::Time start = absl::Now();
  absl::Status s = compose::JoinRendezvous(o, "tcp://127.0.0.1:1").status();
  CHECK(absl::Now() - start < absl::Seconds(3));
  REQUIRE(absl::IsUnavailable(s));
  CHECK(absl::StrContains(s.message(), "127.0.0.1:1,127.0.0.1:2"));
}

}  // namespace
}  // namespace stepmesh
