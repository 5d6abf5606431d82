#include "stepmesh/options.h"

#include <catch2/catch.hpp>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "stepmesh/tensor.h"
#include "tests/support/env_options.h"
#include "tests/support/scoped_env.h"

namespace stepmesh {
namespace {

using testing::FromEnvWith;
using testing::ScopedEnv;

TEST_CASE("FromEnv overlays STEPMESH_* on the base", "[options]") {
  ScopedEnv env({{"STEPMESH_ROLE", "server"},
                 {"STEPMESH_RANK", "1"},
                 {"STEPMESH_NUM_WORKERS", "4"},
                 {"STEPMESH_NUM_SERVERS", "2"},
                 {"STEPMESH_TRANSPORT", "tcp"},
                 {"STEPMESH_POLL_MODE", "blocking"},
                 {"STEPMESH_RDMA_GPUDIRECT", "require"},
                 {"STEPMESH_TIMEOUT", "250ms"},
                 {"STEPMESH_SEND_CORES", "2,3"}});
  MeshOptions base;
  base.backend = "cpu_mock";
  auto o = MeshOptions::FromEnv(base);
  REQUIRE(o.ok());
  CHECK(o->role == Role::kServer);
  CHECK(o->rank == 1);
  CHECK(o->num_workers == 4);
  CHECK(o->num_servers == 2);
  CHECK(o->transport == "tcp");
  CHECK(o->threads.poll_mode == PollMode::kBlocking);
  CHECK(o->rdma.gpudirect == GpuDirect::kRequire);
  CHECK(o->timeout == absl::Milliseconds(250));
  CHECK(o->threads.send_cores == std::vector<int>{2, 3});
}

TEST_CASE("FromEnv understands StepMesh's DMLC_* names, STEPMESH_* wins", "[options]") {
  const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_ROLE", "worker"},
                                                    {"DMLC_NUM_WORKER", "3"},
                                                    {"DMLC_NUM_SERVER", "5"},
                                                    {"DMLC_PS_ROOT_URI", "10.1.2.3"},
                                                    {"DMLC_PS_ROOT_PORT", "8123"},
                                                    {"STEPMESH_NUM_SERVERS", "6"}});
  CHECK(o->role == Role::kWorker);
  CHECK(o->num_workers == 3);
  CHECK(o->num_servers == 6);
  CHECK(o->scheduler == "10.1.2.3:8123");
}

TEST_CASE("DMLC_ENABLE_RDMA picks the transport as ps-lite does", "[options]") {
  {
    const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_ENABLE_RDMA", "0"}});
    CHECK(o->transport == "tcp");
  }
  {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"DMLC_ENABLE_RDMA", "1"}, {"STEPMESH_TRANSPORT", "tcp"}});
    CHECK(o->transport == "tcp");  // STEPMESH_* wins
  }
  {
    const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_ENABLE_RDMA", "1"}});
    CHECK(o->transport == "rdma");
  }
}

TEST_CASE("DMLC_ENABLE_RDMA / DMLC_PS_VAN_TYPE take StepMesh's van names", "[options]") {
  const std::pair<const char*, const char*> vans[] = {{"zmq", "tcp"}, {"0", "tcp"},
                                                      {"", "tcp"},    {"ibverbs", "rdma"},
                                                      {"1", "rdma"},  {"fabric", "libfabric"}};
  for (auto [van, transport] : vans) {
    ScopedEnv env({{"DMLC_ENABLE_RDMA", van}});
    auto o = MeshOptions::FromEnv();
    INFO(van);
    REQUIRE(o.ok());
    CHECK(o->transport == transport);
  }
  {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"DMLC_PS_VAN_TYPE", "ibverbs"}, {"DMLC_ENABLE_RDMA", "zmq"}});
    CHECK(o->transport == "tcp");  // DMLC_ENABLE_RDMA wins
  }
  {
    ScopedEnv env({{"DMLC_ENABLE_RDMA", "ucx"}});
    const absl::Status s = MeshOptions::FromEnv().status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(absl::StrContains(s.message(), "DMLC_ENABLE_RDMA='ucx'"));
  }
}

TEST_CASE("fserver_lib's launch variables land in MeshOptions::fserver", "[options]") {
  {
    const std::optional<MeshOptions> o = FromEnvWith({{"DMLC_ROLE", "joint"},
                                                      {"DMLC_GROUP_SIZE", "8"},
                                                      {"DMLC_NODE_RANK", "2"},
                                                      {"DMLC_RANK_OFFSET", "1"},
                                                      {"DMLC_INSTANCE_ID", "5"},
                                                      {"STEPMESH_GPU", "4"}});
    CHECK(o->fserver.role == "joint");
    CHECK(o->role == MeshOptions().role);  // joint leaves the core role alone
    CHECK(o->fserver.group_size == 8);
    CHECK(o->fserver.node_rank == 2);
    CHECK(o->fserver.rank_offset == 1);
    CHECK(o->fserver.instance_id == 5);
    CHECK(o->fserver.gpu == 4);
    CHECK(o->device == 4);  // StepMesh's GPU is the accelerator too
  }
  {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"STEPMESH_GPU", "4"}, {"STEPMESH_DEVICE", "2"}});
    CHECK(o->device == 2);  // ours wins
    CHECK(o->fserver.gpu == 4);
  }
  {
    ScopedEnv env({{"DMLC_GROUP_SIZE", "0"}});
    const absl::Status s = MeshOptions::FromEnv().status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(absl::StrContains(s.message(), "DMLC_GROUP_SIZE"));
  }
  {
    // StepMesh's knobs: honoured where there is a counterpart, ours win.
    const std::optional<MeshOptions> o = FromEnvWith({{"STEPMESH_SPLIT_QP_LAG", "1"},
                                                      {"STEPMESH_BIND_CPU_CORE", "1"},
                                                      {"STEPMESH_BAKCEND", "CPU"}});
    CHECK(o->rdma.qps_per_peer == 2);
    CHECK(o->threads.auto_pin);
    CHECK(o->backend == "cpu_mock");
  }
  {
    const std::optional<MeshOptions> o =
        FromEnvWith({{"STEPMESH_SPLIT_QP_LAG", "1"}, {"STEPMESH_RDMA_QPS_PER_PEER", "1"}});
    CHECK(o->rdma.qps_per_peer == 1);
  }
}

TEST_CASE("FromEnv rejects bad values with the variable's name", "[options]") {
  // Each error names the variable and the value it had.
  const std::pair<const char*, const char*> bad[] = {
      {"STEPMESH_NUM_WORKERS", "many"},     {"STEPMESH_POLL_MODE", "sometimes"},
      {"STEPMESH_RDMA_GPUDIRECT", "maybe"}, {"STEPMESH_TRANSPORT", "carrier-pigeon"},
      {"STEPMESH_AUTH", "perhaps"},         {"STEPMESH_TIMEOUT", "soon"},
      {"DMLC_NUM_WORKER", "two"},           {"STEPMESH_LOG_LEVEL", "loud"},
  };
  for (auto [name, value] : bad) {
    ScopedEnv env({{name, value}});
    const absl::Status s = MeshOptions::FromEnv().status();
    INFO(s.ToString());
    CHECK(absl::IsInvalidArgument(s));
    CHECK(absl::StrContains(s.message(), absl::StrCat(name, "='", value, "'")));
  }
  SECTION("rank out of range") {
    ScopedEnv env({{"STEPMESH_RANK", "7"}, {"STEPMESH_NUM_WORKERS", "2"}});
    CHECK(absl::IsInvalidArgument(MeshOptions::FromEnv().status()));
  }
}

TEST_CASE("every RDMA knob has a STEPMESH_RDMA_* variable", "[options][rdma]") {
  const MeshOptions defaults;
  CHECK(defaults.rdma.ack_timeout >= 18);  // NCCL's IB_TIMEOUT range: survives PFC pauses
  CHECK(defaults.rdma.ack_timeout <= 20);
  const std::optional<MeshOptions> o = FromEnvWith({{"STEPMESH_RDMA_DEVICE", "mlx5_3"},
                                                    {"STEPMESH_RDMA_PORT", "2"},
                                                    {"STEPMESH_RDMA_GID_INDEX", "3"},
                                                    {"STEPMESH_RDMA_INTERFACE", "10.0.0.0/24"},
                                                    {"STEPMESH_RDMA_TRAFFIC_CLASS", "104"},
                                                    {"STEPMESH_RDMA_SERVICE_LEVEL", "3"},
                                                    {"STEPMESH_RDMA_PATH_MTU", "2048"},
                                                    {"STEPMESH_RDMA_ACK_TIMEOUT", "20"},
                                                    {"STEPMESH_RDMA_RETRY_COUNT", "5"},
                                                    {"STEPMESH_RDMA_RNR_RETRY", "2"},
                                                    {"STEPMESH_RDMA_MIN_RNR_TIMER", "10"},
                                                    {"STEPMESH_RDMA_RECV_DEPTH", "512"},
                                                    {"STEPMESH_RDMA_QPS_PER_PEER", "2"},
                                                    {"STEPMESH_RDMA_STRIPE_MIN_BYTES", "131072"},
                                                    {"STEPMESH_RDMA_GPUDIRECT", "off"},
                                                    {"STEPMESH_RDMA_PKEY", "0x8001"},
                                                    {"STEPMESH_RDMA_RELAXED_ORDERING", "off"},
                                                    {"STEPMESH_RDMA_FORK_INIT", "on"}});
  const RdmaOptions& r = o->rdma;
  CHECK(r.pkey == 0x8001);
  CHECK(r.relaxed_ordering == "off");
  CHECK(r.fork_init == "on");
  CHECK(r.device == "mlx5_3");
  CHECK(r.port == 2);
  CHECK(r.gid_index == 3);
  CHECK(r.interface == "10.0.0.0/24");
  CHECK(r.traffic_class == 104);
  CHECK(r.service_level == 3);
  CHECK(r.path_mtu == 2048);
  CHECK(r.ack_timeout == 20);
  CHECK(r.retry_count == 5);
  CHECK(r.rnr_retry == 2);
  CHECK(r.min_rnr_timer == 10);
  CHECK(r.recv_depth == 512);
  CHECK(r.qps_per_peer == 2);
  CHECK(r.stripe_min_bytes == 131072);
  CHECK(r.gpudirect == GpuDirect::kOff);
}

TEST_CASE("bad RDMA settings are refused naming the variable", "[options][rdma]") {
  const std::pair<const char*, const char*> cases[] = {
      {"STEPMESH_RDMA_ACK_TIMEOUT", "40"},
      {"STEPMESH_RDMA_ACK_TIMEOUT", "soon"},
      {"STEPMESH_RDMA_RETRY_COUNT", "8"},
      {"STEPMESH_RDMA_RNR_RETRY", "7"},
      {"STEPMESH_RDMA_RECV_DEPTH", "2"},
      {"STEPMESH_RDMA_RECV_DEPTH", "9000"},
      {"STEPMESH_RDMA_PATH_MTU", "1500"},
      {"STEPMESH_RDMA_QPS_PER_PEER", "3"},
      {"STEPMESH_RDMA_TRAFFIC_CLASS", "256"},
      {"STEPMESH_RDMA_SERVICE_LEVEL", "16"},
      {"STEPMESH_RDMA_STRIPE_MIN_BYTES", "4096"},
      {"STEPMESH_RDMA_GID_INDEX", "x"},
      {"STEPMESH_RDMA_MIN_RNR_TIMER", "0"},
      {"STEPMESH_RDMA_GPUDIRECT", "maybe"},
      {"STEPMESH_RDMA_PKEY", "0x10000"},
      {"STEPMESH_RDMA_PKEY", "partition"},
      {"STEPMESH_RDMA_RELAXED_ORDERING", "yes"},
      {"STEPMESH_RDMA_FORK_INIT", "sometimes"},
      {"STEPMESH_RDMA_DSCP", "64"},
  };
  for (const auto& [name, value] : cases) {
    ScopedEnv env({{name, value}});
    const absl::Status status = MeshOptions::FromEnv().status();
    INFO(name << "=" << value << ": " << status.ToString());
    CHECK(absl::IsInvalidArgument(status));
    CHECK(std::string(status.message()).find(name) != std::string::npos);
  }
  MeshOptions direct;
  direct.rdma.ack_timeout = 0;
  const absl::Status status = direct.Validate();
  CHECK(absl::IsInvalidArgument(status));
  CHECK(std::string(status.message()).find("rdma.ack_timeout") != std::string::npos);
}

TEST_CASE("STEPMESH_RDMA_DSCP sets the traffic class to DSCP << 2", "[options][rdma]") {
  const std::optional<MeshOptions> o =
      FromEnvWith({{"STEPMESH_RDMA_TRAFFIC_CLASS", "104"}, {"STEPMESH_RDMA_DSCP", "46"}});
  CHECK(o->rdma.traffic_class == 46 << 2);  // the DSCP wins
}

TEST_CASE("FromEnv reads CUDA_DEVICE_MAX_CONNECTIONS for the cuda backend", "[options]") {
  {
    const std::optional<MeshOptions> o = FromEnvWith({{"CUDA_DEVICE_MAX_CONNECTIONS", "1"}});
    CHECK(o->cuda_device_max_connections == 1);
  }
  {
    ScopedEnv env({{"CUDA_DEVICE_MAX_CONNECTIONS", "-3"}});
    auto o = MeshOptions::FromEnv();
    CHECK(absl::IsInvalidArgument(o.status()));
    CHECK(absl::StrContains(o.status().message(), "cuda_device_max_connections"));
  }
}

TEST_CASE("dtype sizes and names", "[tensor]") {
  CHECK(DTypeSize(DType::kFloat8E4M3) == 1);
  CHECK(DTypeSize(DType::kBFloat16) == 2);
  CHECK(DTypeSize(DType::kInt64) == 8);
  auto parsed = ParseDType("bfloat16");
  REQUIRE(parsed.ok());
  CHECK(*parsed == DType::kBFloat16);
  CHECK_FALSE(ParseDType("float128").ok());
  TensorView v{nullptr, DType::kBFloat16, Shape{128, 7168}, Device::Cpu()};
  CHECK(v.bytes() == 128 * 7168 * 2);
  CHECK_FALSE(Shape::Make(std::vector<int64_t>(9, 1).data(), 9).ok());
}

}  // namespace
}  // namespace stepmesh
