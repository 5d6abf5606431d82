// A server process for the liveness and rejoin tests: registers the harness's
// tensors (tests/reliability/harness.h layout) and answers every batch with
// push XOR (0x10 + rank) until every worker is gone, or it is killed.
//   stepmesh_reliability_node --scheduler H:P --rank R --workers W --servers S
//       [--keys K] [--bytes B] [--timeout-ms T] [--heartbeat-ms H]

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "stepmesh/server.h"

int main(int argc, char** argv) {
  stepmesh::MeshOptions options;
  options.transport = "tcp";
  options.role = stepmesh::Role::kServer;
  int64_t keys = 2, bytes = 4096;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    int64_t n = 0;
    const bool numeric = absl::SimpleAtoi(value, &n);
    if (flag == "--scheduler") options.scheduler = value;
    else if (flag == "--rank" && numeric) options.rank = static_cast<int>(n);
    else if (flag == "--workers" && numeric) options.num_workers = static_cast<int>(n);
    else if (flag == "--servers" && numeric) options.num_servers = static_cast<int>(n);
    else if (flag == "--keys" && numeric) keys = n;
    else if (flag == "--bytes" && numeric) bytes = n;
    else if (flag == "--timeout-ms" && numeric) options.timeout = absl::Milliseconds(n);
    else if (flag == "--heartbeat-ms" && numeric) options.heartbeat_interval = absl::Milliseconds(n);
    else {
      std::fprintf(stderr, "bad flag %s %s\n", flag.c_str(), value.c_str());
      return 2;
    }
  }
  auto server = stepmesh::AFTensorServer::Create(options);
  if (!server.ok()) {
    std::fprintf(stderr, "server %d: %s\n", options.rank, server.status().ToString().c_str());
    return 1;
  }
  const int64_t workers = options.num_workers;
  std::vector<std::vector<uint8_t>> recv(keys, std::vector<uint8_t>(bytes * workers));
  std::vector<std::vector<uint8_t>> reply(keys, std::vector<uint8_t>(bytes * workers));
  for (int64_t m = 0; m < keys; ++m) {
    const stepmesh::Shape shape{workers, bytes};
    if (!(*server)->RegisterRecvTensor(100 + m, {recv[m].data(), stepmesh::DType::kUInt8, shape}).ok() ||
        !(*server)->RegisterReplyTensor(200 + m, {reply[m].data(), stepmesh::DType::kUInt8, shape}).ok()) {
      return 1;
    }
  }
  const uint8_t mask = static_cast<uint8_t>(0x10 + (*server)->rank());
  for (;;) {
    absl::StatusOr<stepmesh::Batch> batch = (*server)->GetBatch(absl::Milliseconds(200));
    if (absl::IsDeadlineExceeded(batch.status())) continue;
    if (!batch.ok()) {
      std::fprintf(stderr, "server %d: %s\n", options.rank, batch.status().ToString().c_str());
      return absl::IsUnavailable(batch.status()) ? 0 : 1;
    }
    std::vector<stepmesh::Reply> replies;
    const stepmesh::BatchTensor& t = batch->tensors[0];
    const int64_t m = static_cast<int64_t>(t.key) - 100;
    for (size_t k = 0; k < batch->workers.size(); ++k) {
      const int w = batch->workers[k];
      const auto* in = static_cast<const uint8_t*>(t.region.data) + w * t.slot_bytes;
      uint8_t* out = reply[m].data() + w * bytes;
      for (int64_t j = 0; j < bytes; ++j) out[j] = in[j] ^ mask;
      replies.push_back({w});
    }
    (void)(*server)->Respond(*batch, replies);
  }
}
