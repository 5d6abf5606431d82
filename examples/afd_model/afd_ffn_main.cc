// afd_ffn: one FFN instance of a disaggregated Step-3 run: stepmesh server
// rank p computes FFN partition p of F (routed experts e with e % F == p, a
// 1/F column slice of the dense FFN and the shared expert). Normally started
// by afd_launch.
//
//   afd_ffn --scheduler HOST:PORT --rank P [run flags, as afd_attention]
//
// Every micro-batch has its own recv regions (codes, scales, topk ids, topk
// weights; one slot per attention instance) and reply region. A batch holds
// the same micro-batch and layer of every attention instance; its tokens are
// run through FfnSide::Forward at once (one pass over the expert weights for
// all instances), on a backend stream, and Respond is gated on that work's
// event, so the loop goes straight back to GetBatch.

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/emulated_compute.h"
#include "examples/afd_model/ffn_side.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/wire.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using stepmesh::DType;
using stepmesh::Shape;

struct MicroBatchRegions {
  // [workers, slot_rows, ...] recv regions and the [workers, slot_rows, H]
  // reply region.
  std::unique_ptr<stepmesh::Memory> codes, scales, topk_ids, topk_weights, reply;
  // Compaction buffers for batches whose rows are not contiguous (decode:
  // each slot is mostly empty). Per micro-batch because batches of different
  // micro-batches may be queued on the stream at once.
  std::vector<uint8_t> codes_stage;
  std::vector<float> scales_stage, topk_weights_stage;
  std::vector<int32_t> topk_ids_stage;
  std::vector<uint16_t> partial_stage;
  std::unique_ptr<stepmesh::Event> done;
  int64_t batches = 0;  // served so far: layer = batches % layers
};

struct WorkerRows {
  int worker = 0;
  int64_t rows = 0;
};

class FfnInstance {
 public:
  FfnInstance(const RunShape& shape, const ModelConfig& config, int rank)
      : shape_(shape), config_(config), rank_(rank), ffn_(config, FfnPartition{rank, shape.ffn}) {}

  absl::Status Init(const std::string& scheduler, int device);
  absl::Status Run();

 private:
  absl::Status Serve(const stepmesh::Batch& batch);
  // Runs on the stream: gathers the rows if needed, computes the partial,
  // scatters it into the reply slots.
  void Compute(MicroBatchRegions& r, int layer, const std::vector<WorkerRows>& rows,
               bool contiguous);

  const RunShape shape_;
  const ModelConfig config_;
  const int rank_;
  FfnSide ffn_;
  std::unique_ptr<EmulatedFfn> emulated_;  // --emulate-compute
  FfnWorkspace workspace_;  // one stream runs every Compute, so one suffices
  std::shared_ptr<stepmesh::Backend> backend_;
  std::vector<MicroBatchRegions> regions_;
  std::unique_ptr<stepmesh::Stream> stream_;
  int64_t tokens_served_ = 0;
  // Destroyed first: it reads the regions above.
  std::unique_ptr<stepmesh::AFTensorServer> server_;
};

absl::Status FfnInstance::Init(const std::string& scheduler, int device) {
  absl::StatusOr<std::unique_ptr<stepmesh::Backend>> backend =
      stepmesh::CreateBackend(shape_.backend, device);
  if (!backend.ok()) return backend.status();
  backend_ = std::move(*backend);
  STEPMESH_ASSIGN_OR_RETURN(stream_, backend_->CreateStream());
  if (!shape_.emulate_compute.empty()) {
    STEPMESH_ASSIGN_OR_RETURN(const auto plan, LoadEmulationPlan(shape_.emulate_compute));
    emulated_ = std::make_unique<EmulatedFfn>(plan, shape_.ffn);
  }

  const int64_t w = shape_.attention;
  const int64_t slot = shape_.SlotRows();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t groups = h / config_.fp8_group;
  const A2FSizes sizes{w * slot, h, k, config_.fp8_group};
  auto alloc = [&](size_t bytes) {
    return backend_->Allocate(bytes, stepmesh::MemoryKind::kHostPinned);
  };
  regions_.resize(shape_.micro_batches);
  for (auto& r : regions_) {
    STEPMESH_ASSIGN_OR_RETURN(r.codes, alloc(sizes.codes_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(r.scales, alloc(sizes.scales_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(r.topk_ids, alloc(sizes.topk_ids_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(r.topk_weights, alloc(sizes.topk_weights_bytes()));
    STEPMESH_ASSIGN_OR_RETURN(r.reply, alloc(F2APartialBytes(w * slot, h)));
    STEPMESH_ASSIGN_OR_RETURN(r.done, backend_->CreateEvent());
  }

  STEPMESH_ASSIGN_OR_RETURN(stepmesh::MeshOptions options,
                            MeshOptionsFor(shape_, stepmesh::Role::kServer, rank_, scheduler));
  options.device = device;
  STEPMESH_ASSIGN_OR_RETURN(server_, stepmesh::AFTensorServer::Create(options, backend_));
  for (int m = 0; m < shape_.micro_batches; ++m) {
    MicroBatchRegions& r = regions_[m];
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kCodes), r.codes->View(DType::kFloat8E4M3, Shape{w, slot, h})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kScales), r.scales->View(DType::kFloat32, Shape{w, slot, groups})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kTopkIds), r.topk_ids->View(DType::kInt32, Shape{w, slot, k})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kTopkWeights),
        r.topk_weights->View(DType::kFloat32, Shape{w, slot, k})));
    STEPMESH_RETURN_IF_ERROR(
        server_->RegisterReplyTensor(PullKey(m), r.reply->View(DType::kBFloat16, Shape{w, slot, h})));
  }
  return absl::OkStatus();
}

void FfnInstance::Compute(MicroBatchRegions& r, int layer, const std::vector<WorkerRows>& rows,
                          bool contiguous) {
  if (emulated_) {  // a sleep instead of the experts; the reply bytes still go back
    emulated_->RunBatch(static_cast<int>(rows.size()));
    return;
  }
  const int64_t slot = shape_.SlotRows();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t groups = h / config_.fp8_group;
  auto* codes = static_cast<uint8_t*>(r.codes->data());
  auto* scales = static_cast<float*>(r.scales->data());
  auto* ids = static_cast<int32_t*>(r.topk_ids->data());
  auto* weights = static_cast<float*>(r.topk_weights->data());
  auto* reply = static_cast<uint16_t*>(r.reply->data());
  int64_t n = 0;
  for (const WorkerRows& wr : rows) n += wr.rows;
  if (contiguous) {
    // Zero-copy: the rows already sit back to back in the recv regions.
    const int64_t base = int64_t{rows.front().worker} * slot;
    ffn_.Forward(layer, A2FView{n, codes + base * h, scales + base * groups, ids + base * k,
                                weights + base * k},
                 reply + base * h, &workspace_);
    return;
  }
  r.codes_stage.resize(n * h);
  r.scales_stage.resize(n * groups);
  r.topk_ids_stage.resize(n * k);
  r.topk_weights_stage.resize(n * k);
  r.partial_stage.resize(n * h);
  int64_t at = 0;
  for (const WorkerRows& wr : rows) {
    const int64_t src = int64_t{wr.worker} * slot;
    std::memcpy(&r.codes_stage[at * h], codes + src * h, wr.rows * h);
    std::memcpy(&r.scales_stage[at * groups], scales + src * groups, wr.rows * groups * 4);
    std::memcpy(&r.topk_ids_stage[at * k], ids + src * k, wr.rows * k * 4);
    std::memcpy(&r.topk_weights_stage[at * k], weights + src * k, wr.rows * k * 4);
    at += wr.rows;
  }
  ffn_.Forward(layer,
               A2FView{n, r.codes_stage.data(), r.scales_stage.data(), r.topk_ids_stage.data(),
                       r.topk_weights_stage.data()},
               r.partial_stage.data(), &workspace_);
  at = 0;
  for (const WorkerRows& wr : rows) {
    std::memcpy(reply + int64_t{wr.worker} * slot * h, &r.partial_stage[at * h],
                wr.rows * h * sizeof(uint16_t));
    at += wr.rows;
  }
}

absl::Status FfnInstance::Serve(const stepmesh::Batch& batch) {
  const int m = MicroBatchOfGroup(batch.group, shape_.micro_batches);
  if (m < 0 || batch.tensors.size() != kA2FTensors) {
    return absl::InternalError(absl::StrCat("ffn ", rank_, ": unexpected batch: group ",
                                            batch.group, " with ", batch.tensors.size(),
                                            " tensors"));
  }
  for (int t = 0; t < kA2FTensors; ++t) {
    if (batch.tensors[t].key != PushKey(m, static_cast<A2FTensor>(t))) {
      return absl::InternalError(absl::StrCat("ffn ", rank_, ": tensor ", t, " has key ",
                                              batch.tensors[t].key));
    }
  }
  MicroBatchRegions& r = regions_[m];
  const int layer = static_cast<int>(r.batches % config_.num_layers);
  ++r.batches;

  const int64_t h = config_.hidden_size;
  std::vector<WorkerRows> rows;
  std::vector<stepmesh::Reply> replies;
  bool contiguous = true;
  for (size_t i = 0; i < batch.workers.size(); ++i) {
    const int w = batch.workers[i];
    const size_t code_bytes = batch.tensors[0].valid_bytes[w];
    const int64_t n = static_cast<int64_t>(code_bytes) / h;
    const A2FSizes sizes{n, h, config_.top_k, config_.fp8_group};
    if (code_bytes % h != 0 || batch.tensors[1].valid_bytes[w] != sizes.scales_bytes() ||
        batch.tensors[2].valid_bytes[w] != sizes.topk_ids_bytes() ||
        batch.tensors[3].valid_bytes[w] != sizes.topk_weights_bytes()) {
      return absl::DataLossError(absl::StrCat("ffn ", rank_, ": inconsistent A2F sizes from "
                                              "attention ", w));
    }
    if (batch.pull_keys[i] != PullKey(m)) {
      return absl::InternalError(absl::StrCat("ffn ", rank_, ": attention ", w, " pulls key ",
                                              batch.pull_keys[i]));
    }
    // Rows are contiguous across slots only if the workers are consecutive
    // and every slot but the last is full (prefill with equal micro-batches).
    if (!rows.empty() && (w != rows.back().worker + 1 || rows.back().rows != shape_.SlotRows())) {
      contiguous = false;
    }
    rows.push_back({w, n});
    replies.push_back({w, F2APartialBytes(n, h)});
    tokens_served_ += n;
  }
  if (rows.empty()) return absl::InternalError("empty batch");
  STEPMESH_RETURN_IF_ERROR(stream_->LaunchHostFunc(
      [this, &r, layer, rows, contiguous] { Compute(r, layer, rows, contiguous); }));
  STEPMESH_RETURN_IF_ERROR(r.done->Record(*stream_));
  return server_->Respond(batch, replies, stepmesh::SendOptions{.ready = r.done.get()});
}

absl::Status FfnInstance::Run() {
  STEPMESH_RETURN_IF_ERROR(server_->Barrier());
  const int64_t expected =
      int64_t{shape_.steps()} * config_.num_layers * shape_.micro_batches;
  for (int64_t b = 0; b < expected; ++b) {
    absl::StatusOr<stepmesh::Batch> batch = server_->GetBatch(shape_.timeout);
    if (!batch.ok()) {
      return absl::Status(batch.status().code(),
                          absl::StrCat("ffn ", rank_, ": GetBatch (batch ", b, " of ", expected,
                                       "): ", batch.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(Serve(*batch));
  }
  STEPMESH_RETURN_IF_ERROR(stream_->Synchronize(shape_.timeout));
  STEPMESH_RETURN_IF_ERROR(server_->Barrier());
  STEPMESH_RETURN_IF_ERROR(server_->Shutdown());
  std::printf("afd_ffn[%d]: partition %d of %d served %lld batches, %lld tokens\n", rank_, rank_,
              shape_.ffn, static_cast<long long>(expected),
              static_cast<long long>(tokens_served_));
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = Flags::Parse(argc, argv, {});
  if (!flags.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<RunShape> shape = ParseRunFlags(*flags);
  const std::string scheduler = flags->Str("scheduler", "");
  absl::StatusOr<int64_t> rank = flags->Int("rank", -1);
  absl::StatusOr<int64_t> device = flags->Int("device", 0);
  absl::Status st = shape.ok() ? flags->CheckAllUsed() : shape.status();
  if (st.ok() && (!rank.ok() || !device.ok())) st = !rank.ok() ? rank.status() : device.status();
  if (st.ok() && (scheduler.empty() || *rank < 0 || *rank >= shape->ffn)) {
    st = absl::InvalidArgumentError("need --scheduler and --rank in [0, --ffn)");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", st.ToString().c_str());
    return 2;
  }
  std::string error;
  const std::optional<ModelConfig> config =
      LoadModelConfig(shape->config, BundledConfigDir(), &error);
  if (!config) {
    std::fprintf(stderr, "afd_ffn: config: %s\n", error.c_str());
    return 2;
  }
  if (shape->ffn > config->num_experts) {
    std::fprintf(stderr, "afd_ffn: --ffn must not exceed the expert count\n");
    return 2;
  }
  const int p = static_cast<int>(*rank);
  FfnInstance instance(*shape, *config, p);
  st = instance.Init(scheduler, static_cast<int>(*device));
  if (st.ok()) st = instance.Run();
  if (!st.ok()) {
    std::fprintf(stderr, "afd_ffn[%d]: error: %s\n", p, st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
