#include "src/rendezvous/etcd/etcd_member_keys.h"

#include <algorithm>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "src/core/auth.h"

namespace stepmesh::etcd {
namespace {

std::string ShapeOf(int workers, int servers, int max_workers, int max_servers,
                    const std::string& mesh) {
  std::string out = absl::StrCat("workers=", workers, " servers=", servers);
  if (max_workers > workers || max_servers > servers) {
    absl::StrAppend(&out, " max_workers=", std::max(max_workers, workers),
                    " max_servers=", std::max(max_servers, servers));
  }
  absl::StrAppend(&out, " mesh=", mesh);
  return out;
}

std::string Hex(absl::string_view bytes) { return absl::BytesToHexString(bytes); }

}  // namespace

std::string Shape(const MeshOptions& o) {
  return ShapeOf(o.num_workers, o.num_servers, o.WorkerCapacity(), o.ServerCapacity(), o.mesh_id);
}

const char* CapacityOption(Role role) {
  return role == Role::kWorker ? "max_workers, STEPMESH_MAX_WORKERS"
                               : "max_servers, STEPMESH_MAX_SERVERS";
}

std::string RoleDir(Role role) { return role == Role::kWorker ? "worker" : "server"; }

std::string MemberKey(const std::string& prefix, Role role, int rank) {
  return absl::StrFormat("%s/members/%s/%05d", prefix, RoleDir(role), rank);
}

std::string LeaseId(int64_t lease) { return absl::StrCat(absl::Hex(lease, absl::kZeroPad16)); }

std::string Proof(const std::string& token, const std::string& key, const std::string& endpoint,
                  const std::string& shape) {
  if (token.empty()) return "";
  return Hex(core::AsText(core::HmacSha256(
      token, absl::StrCat("stepmesh etcd member\n", key, "\n", endpoint, "\n", shape))));
}

absl::StatusOr<Member> ParseMember(const KeyValue& kv) {
  Json::CharReaderBuilder builder;
  std::unique_ptr<Json::CharReader> reader(builder.newCharReader());
  Json::Value v;
  std::string errors;
  if (!reader->parse(kv.value.data(), kv.value.data() + kv.value.size(), &v, &errors) ||
      !v.isObject()) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", kv.key, " does not hold a stepmesh member (", errors, ")"));
  }
  Member m;
  m.endpoint = v["endpoint"].asString();
  // A value without max_workers/max_servers is one of a fixed shape.
  m.shape = ShapeOf(v["workers"].asInt(), v["servers"].asInt(), v["max_workers"].asInt(),
                    v["max_servers"].asInt(), v["mesh"].asString());
  m.proof = v["proof"].asString();
  m.left = v["left"].asBool();
  m.barriers = v["barriers"].asUInt64();
  return m;
}

std::string MemberValue(const MeshOptions& o, const std::string& endpoint, const std::string& proof,
                        bool left, uint64_t barriers) {
  Json::Value v;
  v["endpoint"] = endpoint;
  v["workers"] = o.num_workers;
  v["servers"] = o.num_servers;
  if (o.WorkerCapacity() > o.num_workers || o.ServerCapacity() > o.num_servers) {
    v["max_workers"] = o.WorkerCapacity();
    v["max_servers"] = o.ServerCapacity();
  }
  v["mesh"] = o.mesh_id;
  v["proof"] = proof;
  v["left"] = left;
  if (barriers > 0) v["barriers"] = static_cast<Json::UInt64>(barriers);
  Json::StreamWriterBuilder w;
  w["indentation"] = "";
  return Json::writeString(w, v);
}

core::NodeId NodeOfKey(absl::string_view key, absl::string_view members_dir) {
  if (!absl::ConsumePrefix(&key, members_dir)) return core::kNoNode;
  Role role;
  if (absl::ConsumePrefix(&key, "worker/")) {
    role = Role::kWorker;
  } else if (absl::ConsumePrefix(&key, "server/")) {
    role = Role::kServer;
  } else {
    return core::kNoNode;
  }
  uint32_t rank = 0;
  if (!absl::SimpleAtoi(key, &rank)) return core::kNoNode;
  return core::MakeNodeId(role, rank);
}

Json::Value CreateIfAbsent(const std::string& key, const std::string& value, int64_t lease,
                           const std::string& also_read) {
  Json::Value txn;
  Json::Value compare;
  compare["target"] = "CREATE";
  compare["key"] = EtcdClient::Encode(key);
  compare["create_revision"] = "0";
  txn["compare"].append(compare);
  Json::Value put;
  put["request_put"]["key"] = EtcdClient::Encode(key);
  put["request_put"]["value"] = EtcdClient::Encode(value);
  put["request_put"]["lease"] = std::to_string(lease);
  txn["success"].append(put);
  if (!also_read.empty()) {
    Json::Value dir;
    dir["request_range"]["key"] = EtcdClient::Encode(also_read);
    dir["request_range"]["range_end"] = EtcdClient::Encode(PrefixEnd(also_read));
    txn["success"].append(dir);
  }
  Json::Value range;
  range["request_range"]["key"] = EtcdClient::Encode(key);
  txn["failure"].append(range);
  return txn;
}

}  // namespace stepmesh::etcd
