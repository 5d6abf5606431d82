#pragma once
// The mesh's keys and values in etcd (the layout: etcd_rendezvous.h): key
// names, the member value and its signature, the create-if-absent txn.

#include <json/json.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "src/core/protocol.h"
#include "src/rendezvous/etcd/etcd_client.h"
#include "stepmesh/options.h"

namespace stepmesh::etcd {

// The start shape, and the capacity where it is above it (a joiner of
// another capacity is another mesh).
std::string Shape(const MeshOptions& o);

// The option that sets `role`'s capacity, for messages.
const char* CapacityOption(Role role);

std::string RoleDir(Role role);  // "worker" or "server"

// PREFIX/members/worker/00003.
std::string MemberKey(const std::string& prefix, Role role, int rank);

// A lease ID as etcdctl prints (and an operator pastes) it: 16 hex digits.
std::string LeaseId(int64_t lease);

// The member value's signature with the mesh token: binds key, endpoint and shape.
std::string Proof(const std::string& token, const std::string& key, const std::string& endpoint,
                  const std::string& shape);

struct Member {
  std::string endpoint;
  std::string shape;
  std::string proof;
  bool left = false;
  uint64_t barriers = 0;  // the newest barrier it entered
};

absl::StatusOr<Member> ParseMember(const KeyValue& kv);

// `barriers`: the newest barrier this member entered (a joiner counts its
// barriers from the mesh's, even when that barrier's counter is gone with
// the lease of its last writer).
std::string MemberValue(const MeshOptions& o, const std::string& endpoint, const std::string& proof,
                        bool left, uint64_t barriers = 0);

// PREFIX/members/worker/00003 -> the node; kNoNode for other keys.
core::NodeId NodeOfKey(absl::string_view key, absl::string_view members_dir);

// txn: create `key` = `value` under `lease` if it does not exist; the
// failure branch reads the holder, the success branch (with `also_read`, a
// directory) what that directory held at the same revision.
Json::Value CreateIfAbsent(const std::string& key, const std::string& value, int64_t lease,
                           const std::string& also_read = "");

}  // namespace stepmesh::etcd
