#include "src/core/protocol.h"

#include "absl/strings/str_cat.h"

namespace stepmesh::core {

std::string PeerName(NodeId id) {
  switch (NodeRole(id)) {
    case Role::kWorker:
      return absl::StrCat("worker ", NodeRank(id));
    case Role::kServer:
      return absl::StrCat("server ", NodeRank(id));
    case Role::kScheduler:
      break;
  }
  return absl::StrCat("node 0x", absl::Hex(id));
}

}  // namespace stepmesh::core
