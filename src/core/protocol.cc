#include "src/core/protocol.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

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

std::string PeerLossMessage(NodeId id, absl::string_view reason) {
  const std::string name = PeerName(id);
  const std::string lost = absl::StrCat(name, " lost: ");
  while (absl::ConsumePrefix(&reason, lost)) {
  }
  if (!absl::ConsumePrefix(&reason, absl::StrCat(name, ": "))) {
    absl::ConsumePrefix(&reason, absl::StrCat(name, " "));
  }
  return absl::StrCat(lost, reason);
}

}  // namespace stepmesh::core
