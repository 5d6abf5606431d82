#include "tests/support/mesh_scenarios.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "stepmesh/status.h"
#include "tests/support/loopback_mesh.h"

namespace stepmesh::testing {
namespace {

uint8_t Seed(int worker, int micro_batch, int iteration) {
  return static_cast<uint8_t>(worker * 97 + micro_batch * 61 + iteration * 29 + 1);
}

// Worker `w`'s push for (m, i): distinct per worker, micro-batch and iteration.
void FillPush(uint8_t* out, size_t bytes, uint8_t seed) {
  for (size_t j = 0; j < bytes; ++j) out[j] = static_cast<uint8_t>(seed + j * 13 + (j >> 8));
}
uint8_t PushByte(uint8_t seed, size_t j) { return static_cast<uint8_t>(seed + j * 13 + (j >> 8)); }

// What every worker's push contributes to the batch digest.
uint8_t Contribution(const uint8_t* push, size_t bytes) { return push[0] + push[bytes - 1]; }

// The server's reply to one worker: its own push, mixed with the whole batch.
void ComputeReply(const uint8_t* push, size_t push_bytes, uint8_t digest, uint8_t* out,
                  size_t pull_bytes) {
  for (size_t j = 0; j < pull_bytes; ++j) {
    out[j] = push[j % push_bytes] ^ digest;
  }
}

// Shuts a participant down when it goes out of scope: declared after the
// tensors, it runs before they are freed, on every return path (registered
// memory must outlive the progress threads that may still touch it).
template <typename Participant>
class ShutdownOnExit {
 public:
  explicit ShutdownOnExit(Participant& p) : p_(p) {}
  ~ShutdownOnExit() { (void)p_.Shutdown(); }

 private:
  Participant& p_;
};

}  // namespace

absl::Status RunWorker(AFTensorWorker& worker, const Scenario& sc) {
  const int w = worker.rank();
  std::vector<std::vector<uint8_t>> push(sc.micro_batches, std::vector<uint8_t>(sc.push_bytes));
  std::vector<std::vector<std::vector<uint8_t>>> pull(
      sc.micro_batches,
      std::vector<std::vector<uint8_t>>(sc.servers, std::vector<uint8_t>(sc.pull_bytes)));
  ShutdownOnExit<AFTensorWorker> shutdown(worker);
  for (int m = 0; m < sc.micro_batches; ++m) {
    STEPMESH_RETURN_IF_ERROR(worker.RegisterPushTensor(
        PushKey(m), {push[m].data(), DType::kFloat8E4M3,
                     Shape{1, static_cast<int64_t>(sc.push_bytes)}, Device::Cpu()}));
    for (int s = 0; s < sc.servers; ++s) {
      STEPMESH_RETURN_IF_ERROR(worker.RegisterPullTensor(
          PullKey(m), s,
          {pull[m][s].data(), DType::kBFloat16, Shape{1, static_cast<int64_t>(sc.pull_bytes / 2)},
           Device::Cpu()}));
    }
  }
  STEPMESH_RETURN_IF_ERROR(worker.Barrier());

  std::vector<Pull> pulls(sc.servers);
  std::vector<RequestHandle> handles(sc.micro_batches);
  auto check = [&](int m, int i) -> absl::Status {
    STEPMESH_RETURN_IF_ERROR(worker.Wait(handles[m], sc.step_timeout));
    uint8_t digest = 0;
    for (int v = 0; v < sc.workers; ++v) {
      const uint8_t seed = Seed(v, m, i);
      digest ^= static_cast<uint8_t>(PushByte(seed, 0) + PushByte(seed, sc.push_bytes - 1));
    }
    const uint8_t seed = Seed(w, m, i);
    for (int s = 0; s < sc.servers; ++s) {
      const uint8_t* got = pull[m][s].data();
      const uint8_t key = static_cast<uint8_t>(digest ^ s);
      for (size_t j = 0; j < sc.pull_bytes; ++j) {
        const uint8_t want = PushByte(seed, j % sc.push_bytes) ^ key;
        if (got[j] != want) {
          return absl::DataLossError(absl::StrCat("worker ", w, " micro-batch ", m, " iteration ",
                                                  i, " server ", s, ": byte ", j, " is ",
                                                  int{got[j]}, ", expected ", int{want}));
        }
      }
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < sc.iterations; ++i) {
    for (int m = 0; m < sc.micro_batches; ++m) {
      if (i > 0) STEPMESH_RETURN_IF_ERROR(check(m, i - 1));
      FillPush(push[m].data(), sc.push_bytes, Seed(w, m, i));
      for (int s = 0; s < sc.servers; ++s) pulls[s] = {PullKey(m), s};
      const Push p{PushKey(m)};
      STEPMESH_ASSIGN_OR_RETURN(handles[m], worker.PushPull({&p, 1}, pulls));
    }
  }
  for (int m = 0; m < sc.micro_batches; ++m) STEPMESH_RETURN_IF_ERROR(check(m, sc.iterations - 1));
  return worker.Barrier();
}

absl::Status RunServer(AFTensorServer& server, const Scenario& sc) {
  const int s = server.rank();
  const int64_t workers = sc.workers;
  std::vector<std::vector<uint8_t>> recv(sc.micro_batches,
                                         std::vector<uint8_t>(sc.push_bytes * workers));
  std::vector<std::vector<uint8_t>> reply(sc.micro_batches,
                                          std::vector<uint8_t>(sc.pull_bytes * workers));
  ShutdownOnExit<AFTensorServer> shutdown(server);
  for (int m = 0; m < sc.micro_batches; ++m) {
    STEPMESH_RETURN_IF_ERROR(server.RegisterRecvTensor(
        PushKey(m), {recv[m].data(), DType::kFloat8E4M3,
                     Shape{workers, static_cast<int64_t>(sc.push_bytes)}, Device::Cpu()}));
    STEPMESH_RETURN_IF_ERROR(server.RegisterReplyTensor(
        PullKey(m), {reply[m].data(), DType::kBFloat16,
                     Shape{workers, static_cast<int64_t>(sc.pull_bytes / 2)}, Device::Cpu()}));
  }
  STEPMESH_RETURN_IF_ERROR(server.Barrier());
  std::vector<Reply> replies;
  replies.reserve(sc.workers);
  for (int b = 0; b < sc.iterations * sc.micro_batches; ++b) {
    STEPMESH_ASSIGN_OR_RETURN(Batch batch, server.GetBatch(sc.step_timeout));
    if (batch.tensors.size() != 1) {
      return absl::InternalError(absl::StrCat("batch with ", batch.tensors.size(), " tensors"));
    }
    const BatchTensor& t = batch.tensors[0];
    const int m = static_cast<int>(t.key - PushKey(0));
    if (m < 0 || m >= sc.micro_batches || batch.group != t.key) {
      return absl::InternalError(absl::StrCat("batch for unexpected key ", t.key));
    }
    const auto* base = static_cast<const uint8_t*>(t.region.data);
    uint8_t digest = 0;
    for (int w : batch.workers) {
      if (t.valid_bytes[w] != sc.push_bytes) {
        return absl::DataLossError(absl::StrCat("worker ", w, " pushed ", t.valid_bytes[w],
                                                " bytes, expected ", sc.push_bytes));
      }
      digest ^= Contribution(base + w * t.slot_bytes, sc.push_bytes);
    }
    digest ^= static_cast<uint8_t>(s);
    replies.clear();
    for (size_t k = 0; k < batch.workers.size(); ++k) {
      const int w = batch.workers[k];
      if (batch.pull_keys[k] != PullKey(m)) {
        return absl::InternalError(absl::StrCat("worker ", w, " pulls ", batch.pull_keys[k]));
      }
      ComputeReply(base + w * t.slot_bytes, sc.push_bytes, digest,
                   reply[m].data() + w * sc.pull_bytes, sc.pull_bytes);
      replies.push_back({w});
    }
    STEPMESH_RETURN_IF_ERROR(server.Respond(batch, replies));
  }
  return server.Barrier();
}

absl::Status RunInProcess(const Scenario& sc, MeshOptions base,
                          const core::TransportFactory& transport) {
  base.num_workers = sc.workers;
  base.num_servers = sc.servers;
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<LoopbackMesh> mesh,
                            LoopbackMesh::Start(base, transport));
  return RunParticipants(
      *mesh, [&](AFTensorWorker& worker) { return RunWorker(worker, sc); },
      [&](AFTensorServer& server) { return RunServer(server, sc); });
}

}  // namespace stepmesh::testing
