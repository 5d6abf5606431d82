// Configuration as a user meets it: every enumeration refuses an unknown value
// at FromEnv naming the variable, the value and what it accepts; unknown
// STEPMESH_* / DMLC_* names are warned about once; STEPMESH_INTERFACE /
// DMLC_INTERFACE pick the address bound and advertised (errors list the
// interfaces found); DMLC_NODE_HOST / node_host the host advertised.

#include <catch2/catch.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "src/base/interfaces.h"
#include "src/compose/transports.h"
#include "src/core/env_table.h"
#include "src/core/mesh.h"
#include "src/transport/tcp_fallback/tcp_transport.h"
#include "stepmesh/options.h"
#include "tests/support/env_options.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/scoped_env.h"
#include "tests/support/stderr_capture.h"

namespace stepmesh {
namespace {

using testing::FromEnvWith;
using testing::ScopedEnv;
using testing::StderrCapture;

int Count(absl::string_view text, absl::string_view needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != absl::string_view::npos;
       at = text.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

TEST_CASE("unknown values of every enumeration are refused at FromEnv, listing the accepted",
          "[options][config]") {
  struct Case {
    const char* name;
    const char* value;
    const char* accepted;  // one accepted value the message must list
  };
  const Case cases[] = {
      {"STEPMESH_BACKEND", "rocm", "cpu_mock"},
      {"STEPMESH_TRANSPORT", "ib", "rdma"},
      {"STEPMESH_POLL_MODE", "sometimes", "adaptive"},
      {"STEPMESH_RDMA_GPUDIRECT", "maybe", "require"},
      {"STEPMESH_AUTH", "perhaps", "off"},
      {"STEPMESH_LOG_LEVEL", "loud", "warning"},
      {"STEPMESH_ROLE", "boss", "scheduler"},
      {"DMLC_ROLE", "boss", "scheduler"},
      {"STEPMESH_TRACE", "maybe", "false"},
      {"STEPMESH_PAYLOAD_CHECKSUM", "sometimes", "true"},
      {"STEPMESH_SEND_CORES", "two", "auto"},
  };
  for (const Case& c : cases) {
    ScopedEnv env({{c.name, c.value}});
    const absl::Status s = MeshOptions::FromEnv().status();
    INFO(s.ToString());
    CHECK(absl::IsInvalidArgument(s));
    CHECK(absl::StrContains(s.message(), absl::StrCat(c.name, "='", c.value, "'")));
    CHECK(absl::StrContains(s.message(), c.accepted));
  }
  SECTION("the accepted values pass") {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"STEPMESH_BACKEND", "cuda"}, {"STEPMESH_POLL_MODE", "spin"}});
    CHECK(o->backend == "cuda");
  }
}

// What three MeshOptions::FromEnv calls (each succeeding) write to stderr.
std::string LogOfThreeReads() {
  StderrCapture capture("config_test");
  for (int i = 0; i < 3; ++i) REQUIRE(MeshOptions::FromEnv().ok());
  return capture.Finish();
}

TEST_CASE("unknown STEPMESH_* and DMLC_* names are warned about once per process",
          "[options][config]") {
  ScopedEnv env({{"STEPMESH_NUM_WORKER", "2"},  // a typo of STEPMESH_NUM_WORKERS
                 {"DMLC_PS_ROOT_URL", "10.0.0.1"},
                 {"DMLC_NODE_RANK", "0"}});  // read by the Python layer: no warning
  const std::string log = LogOfThreeReads();
  INFO(log);
  CHECK(Count(log, "unknown environment variable STEPMESH_NUM_WORKER ") == 1);
  CHECK(Count(log, "unknown environment variable DMLC_PS_ROOT_URL ") == 1);
  CHECK(Count(log, "DMLC_NODE_RANK") == 0);
}

TEST_CASE("StepMesh knobs with no counterpart are named as ignored once per process",
          "[options][config]") {
  ScopedEnv env({{"STEPMESH_MEM_SYNC", "1"}, {"STEPMESH_CPU_START_OFFSET", "10"}});
  const std::string log = LogOfThreeReads();
  INFO(log);
  CHECK(Count(log, "environment variable STEPMESH_MEM_SYNC ignored: ") == 1);
  CHECK(Count(log, "environment variable STEPMESH_CPU_START_OFFSET ignored: ") == 1);
  CHECK(Count(log, "unknown environment variable") == 0);
}

TEST_CASE("RoleFromEnv: STEPMESH_ROLE, else DMLC_ROLE, else none", "[options][config]") {
  {
    absl::StatusOr<std::optional<Role>> r = RoleFromEnv();
    REQUIRE(r.ok());
    CHECK_FALSE(r->has_value());
  }
  {
    ScopedEnv env({{"DMLC_ROLE", "server"}});
    absl::StatusOr<std::optional<Role>> r = RoleFromEnv();
    REQUIRE(r.ok());
    CHECK(**r == Role::kServer);
  }
  {
    ScopedEnv env({{"DMLC_ROLE", "server"}, {"STEPMESH_ROLE", "scheduler"}});
    CHECK(**RoleFromEnv() == Role::kScheduler);
  }
  {
    ScopedEnv env({{"DMLC_ROLE", "attention"}});
    absl::Status s = RoleFromEnv().status();
    CHECK(absl::StrContains(s.message(), "DMLC_ROLE='attention'"));
  }
}

TEST_CASE("DMLC_INTERFACE / STEPMESH_INTERFACE pick the address bound and advertised",
          "[options][config][interface]") {
  SECTION("lo binds 127.0.0.1, and narrows RoCE GIDs to lo's subnet") {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"DMLC_INTERFACE", "lo"}, {"STEPMESH_BIND_HOST", "0.0.0.0"}});
    CHECK(o->interface == "lo");
    absl::StatusOr<MeshOptions> resolved = core::OptionsForRole(*o, Role::kServer);
    REQUIRE(resolved.ok());
    CHECK(resolved->bind_host == "127.0.0.1");
    CHECK(resolved->rdma.interface == "lo");
    CHECK(core::AdvertisedHost(*resolved) == "127.0.0.1");
    absl::StatusOr<std::string> lo = base::InterfaceAddressOf("lo");
    REQUIRE(lo.ok());
    CHECK(*lo == "127.0.0.1");
  }
  SECTION("STEPMESH_INTERFACE wins over DMLC_INTERFACE; STEPMESH_RDMA_INTERFACE is kept") {
    const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_INTERFACE", "nosuchif0"},
                                                      {"STEPMESH_INTERFACE", "lo"},
                                                      {"STEPMESH_RDMA_INTERFACE", "10.0.0.0/24"}});
    absl::StatusOr<MeshOptions> resolved = core::OptionsForRole(*o, Role::kWorker);
    REQUIRE(resolved.ok());
    CHECK(resolved->bind_host == "127.0.0.1");
    CHECK(resolved->rdma.interface == "10.0.0.0/24");
  }
  SECTION("an unknown interface is an error naming it, the variables and what exists") {
    MeshOptions o;
    o.interface = "nosuchif0";
    const absl::Status s = core::OptionsForRole(o, Role::kWorker).status();
    INFO(s.ToString());
    CHECK(absl::IsInvalidArgument(s));
    CHECK(absl::StrContains(s.message(), "'nosuchif0'"));
    CHECK(absl::StrContains(s.message(), "DMLC_INTERFACE"));
    CHECK(absl::StrContains(s.message(), "found: "));
    CHECK(absl::StrContains(s.message(), "lo 127.0.0.1"));
    // And creating a participant fails the same way, before anything starts.
    absl::StatusOr<std::unique_ptr<AFTensorWorker>> w = AFTensorWorker::Create(o);
    CHECK(absl::StrContains(w.status().message(), "'nosuchif0'"));
  }
  SECTION("a mesh told to bind every address on lo binds lo's address and runs") {
    // bind_host 0.0.0.0 alone is refused without an auth token (auth=auto):
    // that the mesh starts shows the interface's address was bound instead.
    MeshOptions base;
    base.transport = "tcp";
    base.num_workers = 1;
    base.num_servers = 1;
    base.timeout = absl::Seconds(10);
    base.bind_host = "0.0.0.0";
    {
      MeshOptions wide = base;
      wide.role = Role::kServer;
      CHECK_FALSE(AFTensorServer::Create(wide).ok());
    }
    base.interface = "lo";
    absl::StatusOr<std::unique_ptr<testing::LoopbackMesh>> mesh =
        testing::LoopbackMesh::Start(base, compose::CreateTransport);
    INFO(mesh.status().ToString());
    REQUIRE(mesh.ok());
  }
}

TEST_CASE("node_host (DMLC_NODE_HOST) is the host a participant advertises",
          "[options][config][interface]") {
  {
    const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_NODE_HOST", "127.0.0.1"}});
    CHECK(o->node_host == "127.0.0.1");
    CHECK(o->bind_host == "127.0.0.1");
  }
  {
    // STEPMESH_BIND_HOST wins for the bind; the advertised host stays.
    const std::optional<MeshOptions> o =
        FromEnvWith({{"DMLC_NODE_HOST", "node7.example"}, {"STEPMESH_BIND_HOST", "127.0.0.1"}});
    CHECK(o->node_host == "node7.example");
    CHECK(o->bind_host == "127.0.0.1");
  }
  MeshOptions o;
  o.role = Role::kServer;
  o.node_host = "localhost";
  absl::StatusOr<std::unique_ptr<core::Transport>> t = tcp::CreateTcpTransport(o);
  REQUIRE(t.ok());
  absl::StatusOr<std::string> endpoint = (*t)->LocalEndpoint();
  REQUIRE(endpoint.ok());
  CHECK(absl::StartsWith(*endpoint, "localhost:"));
}

// Every field FromEnv can set, as text: two options that print the same are the same.
std::string Dump(const MeshOptions& o) {
  const RdmaOptions& r = o.rdma;
  return absl::StrCat(
      RoleName(o.role), "|", o.rank, "|", o.num_workers, "|", o.num_servers, "|", o.scheduler, "|",
      o.bind_host, "|", o.node_host, "|", o.interface, "|", o.transport, "|", o.backend, "|",
      o.device, "|", o.cuda_device_max_connections, "|", r.device, "|", r.port, "|", r.gid_index,
      "|", r.interface, "|", r.traffic_class, "|", r.service_level, "|", r.path_mtu, "|",
      r.ack_timeout, "|", r.retry_count, "|", r.rnr_retry, "|", r.min_rnr_timer, "|", r.recv_depth,
      "|", r.qps_per_peer, "|", r.stripe_min_bytes, "|", GpuDirectName(r.gpudirect), "|",
      PollModeName(o.threads.poll_mode), "|", absl::FormatDuration(o.threads.spin_budget), "|",
      absl::StrJoin(o.threads.send_cores, ","), "|", absl::StrJoin(o.threads.recv_cores, ","), "|",
      o.threads.auto_pin, "|", absl::FormatDuration(o.timeout), "|",
      absl::FormatDuration(o.heartbeat_interval), "|", o.max_inflight_requests, "|",
      o.max_registrations, "|", o.auth_token, "|", AuthModeName(o.auth), "|", o.mesh_id, "|",
      o.payload_checksum, "|", o.trace.enabled, "|", o.fserver.role, "|", o.fserver.group_size, "|",
      o.fserver.node_rank, "|", o.fserver.rank_offset, "|", o.fserver.instance_id, "|",
      o.fserver.gpu);
}

TEST_CASE("DMLC_INTERFACE=auto picks an interface as StepMesh does",
          "[options][config][interface]") {
  using base::InterfaceAddress;
  const std::vector<InterfaceAddress> all = {{"lo", "127.0.0.1", false, false},
                                             {"eth0", "fe80::1", true, true},
                                             {"eth0", "10.0.0.5", false, false},
                                             {"ib0", "192.168.7.2", false, false},
                                             {"docker0", "172.17.0.1", false, false}};
  // The interface holding node_host (StepMesh's scripts set DMLC_NODE_HOST too).
  CHECK(*base::PickAutoInterface(all, "192.168.7.2", {}) == "ib0");
  CHECK(*base::PickAutoInterface(all, "127.0.0.1", {"ib0"}) == "lo");
  // Else an RDMA device's netdev with an IPv4 address, in the order given.
  CHECK(*base::PickAutoInterface(all, "", {"mlx5_9", "ib0"}) == "ib0");
  CHECK(*base::PickAutoInterface(all, "node7.example", {"ib0"}) == "ib0");
  // Else the first non-loopback IPv4 interface, else loopback.
  CHECK(*base::PickAutoInterface(all, "", {}) == "eth0");
  CHECK(*base::PickAutoInterface({{"lo", "127.0.0.1", false, false}}, "", {}) == "lo");
  const absl::Status none =
      base::PickAutoInterface({{"eth0", "2001:db8::5", true, false}}, "", {}).status();
  CHECK(absl::IsNotFound(none));
  CHECK(absl::StrContains(none.message(), "eth0 2001:db8::5"));
  SECTION("end to end: auto with DMLC_NODE_HOST=127.0.0.1 binds loopback") {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"DMLC_INTERFACE", "auto"}, {"DMLC_NODE_HOST", "127.0.0.1"}});
    absl::StatusOr<MeshOptions> resolved = core::OptionsForRole(*o, Role::kServer);
    REQUIRE(resolved.ok());
    CHECK(resolved->interface == "lo");
    CHECK(resolved->bind_host == "127.0.0.1");
  }
}

TEST_CASE("DMLC_ENABLE_RDMA=fabric makes a libfabric transport, or names what is missing",
          "[options][config]") {
  const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_ENABLE_RDMA", "fabric"}});
  REQUIRE(o->transport == "libfabric");
  absl::StatusOr<std::unique_ptr<core::Transport>> made = compose::CreateTransport(*o);
  if (made.ok()) {  // built with libfabric (scripts/install-deps.sh installs libfabric-dev)
    CHECK((*made)->name() == "libfabric");
    return;
  }
  INFO(made.status().ToString());
  CHECK(absl::IsUnimplemented(made.status()));
  CHECK(absl::StrContains(made.status().message(), "libfabric transport is not built"));
  CHECK(absl::StrContains(made.status().message(), "DMLC_ENABLE_RDMA=fabric"));
}

TEST_CASE("the documented defaults are the code's defaults", "[options][config]") {
  // docs/configuration.md is generated from the table (config_doc_check); here
  // the table's default column is held to MeshOptions: setting a variable to
  // its documented default changes nothing.
  const std::string defaults = Dump(MeshOptions());
  {
    ScopedEnv env({{"STEPMESH_TIMEOUT", "31s"}});
    REQUIRE(Dump(*MeshOptions::FromEnv()) != defaults);  // the dump sees a change
  }
  int checked = 0;
  for (const core::EnvVariableDoc& v : core::DocumentedEnvironment()) {
    // "`30s`" -> 30s, "0 (any)" -> 0; words ("empty", "unpinned", "unset
    // (0)", "auto" for a name, "—") are not values of the variable.
    std::string value = absl::StrReplaceAll(v.default_value, {{"`", ""}});
    value = value.substr(0, value.find(' '));
    if (value == "—" || value == "empty" || value == "unpinned" || value == "unset" ||
        v.name == "STEPMESH_RDMA_DEVICE") {
      continue;
    }
    const std::string name(v.name);
    ScopedEnv env({{name.c_str(), value.c_str()}});
    absl::StatusOr<MeshOptions> o = MeshOptions::FromEnv();
    INFO(name << "='" << value << "': " << o.status().ToString());
    REQUIRE(o.ok());
    CHECK(Dump(*o) == defaults);
    ++checked;
  }
  CHECK(checked >= 30);
}

}  // namespace
}  // namespace stepmesh
