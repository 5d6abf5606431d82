#include "examples/afd_model/elastic_sync.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "examples/afd_model/wire.h"

namespace afd::example {

std::vector<int> ChangeStepsOf(const ResizeSchedule& schedule, MemberSpan span) {
  std::vector<int> steps;
  for (const ShapeChange& c : schedule.changes()) {
    if (c.step >= span.begin && c.step <= span.end) steps.push_back(c.step);
  }
  return steps;
}

absl::StatusOr<uint64_t> WaitForShape(stepmesh::Participant& p, MeshShape shape,
                                      absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  stepmesh::Membership m = p.CurrentMembership();
  auto holds = [&](const std::vector<int>& ranks, int count) {
    for (int r = 0; r < count; ++r) {
      if (!std::binary_search(ranks.begin(), ranks.end(), r)) return false;
    }
    return true;
  };
  while (!holds(m.workers, shape.attention) || !holds(m.servers, shape.ffn)) {
    const absl::Duration left = deadline - absl::Now();
    absl::StatusOr<stepmesh::Membership> next =
        p.WaitMembershipChange(m.epoch, std::max(left, absl::ZeroDuration()));
    if (!next.ok()) {
      return absl::Status(
          next.status().code(),
          absl::StrCat("waiting for the membership of ", shape.Name(), " (epoch ", m.epoch, " has ",
                       m.workers.size(), " attention and ", m.servers.size(),
                       " FFN instances): ", next.status().message()));
    }
    m = *std::move(next);
  }
  return m.epoch;
}

uint64_t FirstRequestBytes(const RunShape& shape, const ModelConfig& config) {
  uint64_t bytes = 0;
  for (int m = 0; m < shape.micro_batches; ++m) {
    const int64_t n =
        int64_t{shape.MicroBatchEnd(m) - shape.MicroBatchBegin(m)} * shape.TokensPerRequest(0);
    const A2FSizes sizes{n, config.hidden_size, config.top_k, config.fp8_group};
    bytes += sizes.codes_bytes() + sizes.scales_bytes() + sizes.topk_ids_bytes() +
             sizes.topk_weights_bytes() + sizeof(int32_t) * kWireHeaderInts;
  }
  return bytes;
}

std::string FormatEpochRecord(const EpochRecord& r) {
  return absl::StrCat("epoch ", r.epoch, " at ", r.at_ns, " workers ", r.workers, " servers ",
                      r.servers, "\n");
}

std::vector<EpochRecord> ReadEpochLog(const std::string& path) {
  std::vector<EpochRecord> out;
  std::ifstream in(path);
  std::string epoch, at, workers, servers;
  EpochRecord r;
  while (in >> epoch >> r.epoch >> at >> r.at_ns >> workers >> r.workers >> servers >> r.servers) {
    out.push_back(r);
  }
  return out;
}

std::vector<ResizeRecord> ReadResizeLog(const std::string& path) {
  std::vector<ResizeRecord> out;
  std::ifstream in(path);
  std::string resize, took;
  ResizeRecord r;
  while (in >> resize >> r.step >> took >> r.took_ns) out.push_back(r);
  return out;
}

}  // namespace afd::example
