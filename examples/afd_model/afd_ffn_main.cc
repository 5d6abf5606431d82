// afd_ffn: one FFN instance of a disaggregated run (Step-3 and Step-5 share
// the FFN side: the model's ModelConfig): stepmesh server
// rank p computes FFN partition p of F (routed experts e with e % F == p, a
// 1/F column slice of the dense FFN and the shared expert). Normally started
// by afd_launch.
//
//   afd_ffn --scheduler HOST:PORT --rank P [run flags, as afd_attention]
//           [--metrics-port P] [--metrics-file FILE]  (docs/metrics.md)
//           [--chrome-trace FILE]  (the server's stepmesh trace, docs/tracing.md;
//                                   needs STEPMESH_TRACE_EVENTS)
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
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/wire.h"
#include "src/tools/metrics/metrics_http.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using stepmesh::DType;
using stepmesh::Shape;

class FfnInstance {
 public:
  FfnInstance(const RunShape& shape, const ModelConfig& config, int rank)
      : shape_(shape), config_(config), rank_(rank) {}

  absl::Status Init(const std::string& scheduler, int device);
  // --metrics-port / --metrics-file (either may be unset: 0, empty).
  void SetMetrics(int port, std::string file) {
    metrics_port_ = port;
    metrics_file_ = std::move(file);
  }
  // --chrome-trace: the server's trace written there before it leaves.
  void SetTraceFile(std::string file) { trace_file_ = std::move(file); }
  absl::Status Run();

 private:
  // Checks a batch (keys, sizes, every worker's header against this FFN's
  // count of the micro-batch's batches) and enqueues its forward.
  absl::Status Serve(const stepmesh::Batch& batch);

  const RunShape shape_;
  const ModelConfig config_;
  const int rank_;
  std::shared_ptr<stepmesh::Backend> backend_;
  std::vector<std::unique_ptr<stepmesh::Event>> done_;  // per micro-batch
  std::vector<int64_t> batches_;                        // served so far per micro-batch
  int64_t tokens_served_ = 0;
  std::unique_ptr<FfnEngine> engine_;
  // Destroyed first: it reads the engine's regions.
  std::unique_ptr<stepmesh::AFTensorServer> server_;
  int metrics_port_ = 0;
  std::string metrics_file_;
  std::string trace_file_;
  std::unique_ptr<stepmesh::tools::MetricsHttpServer> metrics_;  // reads server_
};

absl::Status FfnInstance::Init(const std::string& scheduler, int device) {
  absl::StatusOr<std::unique_ptr<stepmesh::Backend>> backend =
      stepmesh::CreateBackend(shape_.backend, device);
  if (!backend.ok()) return backend.status();
  backend_ = std::move(*backend);
  FfnEngineParams params;
  params.shape = &shape_;
  params.config = &config_;
  params.rank = rank_;
  params.backend = backend_;
  STEPMESH_ASSIGN_OR_RETURN(engine_, CreateFfnEngine(std::move(params)));
  for (int m = 0; m < shape_.micro_batches; ++m) {
    STEPMESH_ASSIGN_OR_RETURN(auto event, backend_->CreateEvent());
    done_.push_back(std::move(event));
  }
  batches_.assign(shape_.micro_batches, 0);

  const int64_t w = shape_.attention;
  const int64_t slot = shape_.SlotRows();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t groups = h / config_.fp8_group;
  STEPMESH_ASSIGN_OR_RETURN(stepmesh::MeshOptions options,
                            MeshOptionsFor(shape_, stepmesh::Role::kServer, rank_, scheduler));
  options.device = device;
  STEPMESH_ASSIGN_OR_RETURN(server_, stepmesh::AFTensorServer::Create(options, backend_));
  if (metrics_port_ > 0) {
    STEPMESH_ASSIGN_OR_RETURN(metrics_, stepmesh::tools::MetricsHttpServer::Start(
                                            static_cast<uint16_t>(metrics_port_), [this] {
                                              return stepmesh::PrometheusText(server_->Stats());
                                            }));
    std::printf("afd_ffn[%d]: metrics at http://127.0.0.1:%u/metrics\n", rank_, metrics_->port());
    std::fflush(stdout);
  }
  for (int m = 0; m < shape_.micro_batches; ++m) {
    FfnWire& r = engine_->wire(m);
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kCodes), r.codes->View(DType::kFloat8E4M3, Shape{w, slot, h})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kScales), r.scales->View(DType::kFloat32, Shape{w, slot, groups})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kTopkIds), r.topk_ids->View(DType::kInt32, Shape{w, slot, k})));
    STEPMESH_RETURN_IF_ERROR(
        server_->RegisterRecvTensor(PushKey(m, A2FTensor::kTopkWeights),
                                    r.topk_weights->View(DType::kFloat32, Shape{w, slot, k})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterRecvTensor(
        PushKey(m, A2FTensor::kHeader), r.header->View(DType::kInt32, Shape{w, kWireHeaderInts})));
    STEPMESH_RETURN_IF_ERROR(server_->RegisterReplyTensor(
        PullKey(m), r.reply->View(DType::kBFloat16, Shape{w, slot, h})));
  }
  return absl::OkStatus();
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
      return absl::InternalError(
          absl::StrCat("ffn ", rank_, ": tensor ", t, " has key ", batch.tensors[t].key));
    }
  }
  // What this micro-batch's next batch must be: the FFN counts them (the
  // requests of one key are strictly ordered) and every header must agree.
  const int layer = static_cast<int>(batches_[m] % config_.num_layers);
  const int step = static_cast<int>(batches_[m] / config_.num_layers);
  ++batches_[m];
  const auto* headers = static_cast<const int32_t*>(engine_->wire(m).header->data());

  const int64_t h = config_.hidden_size;
  std::vector<WorkerRows> rows;
  std::vector<stepmesh::Reply> replies;
  for (size_t i = 0; i < batch.workers.size(); ++i) {
    const int w = batch.workers[i];
    const size_t code_bytes = batch.tensors[0].valid_bytes[w];
    const int64_t n = static_cast<int64_t>(code_bytes) / h;
    const A2FSizes sizes{n, h, config_.top_k, config_.fp8_group};
    if (code_bytes % h != 0 || batch.tensors[1].valid_bytes[w] != sizes.scales_bytes() ||
        batch.tensors[2].valid_bytes[w] != sizes.topk_ids_bytes() ||
        batch.tensors[3].valid_bytes[w] != sizes.topk_weights_bytes() ||
        batch.tensors[4].valid_bytes[w] != sizeof(int32_t) * kWireHeaderInts) {
      return absl::DataLossError(
          absl::StrCat("ffn ", rank_, ": inconsistent A2F sizes from attention ", w));
    }
    const WireHeader expected{step,
                              layer,
                              m,
                              static_cast<int32_t>(n),
                              w,
                              config_.is_moe_layer[layer] ? WireHeader::kMoeLayer : 0,
                              static_cast<int32_t>(h)};
    STEPMESH_RETURN_IF_ERROR(
        CheckWireHeader(headers + int64_t{w} * kWireHeaderInts, expected, rank_));
    if (batch.pull_keys[i] != PullKey(m)) {
      return absl::InternalError(
          absl::StrCat("ffn ", rank_, ": attention ", w, " pulls key ", batch.pull_keys[i]));
    }
    rows.push_back({w, n});
    replies.push_back({w, F2APartialBytes(n, h)});
    tokens_served_ += n;
  }
  if (rows.empty()) return absl::InternalError("empty batch");
  STEPMESH_RETURN_IF_ERROR(engine_->EnqueueForward(m, layer, rows));
  STEPMESH_RETURN_IF_ERROR(done_[m]->Record(engine_->stream()));
  return server_->Respond(batch, replies,
                          stepmesh::SendOptions{.ready = done_[m].get(), .stage = {}});
}

absl::Status FfnInstance::Run() {
  STEPMESH_RETURN_IF_ERROR(server_->Barrier());
  const int64_t expected = int64_t{shape_.steps()} * config_.num_layers * shape_.micro_batches;
  for (int64_t b = 0; b < expected; ++b) {
    absl::StatusOr<stepmesh::Batch> batch = server_->GetBatch(shape_.timeout);
    if (!batch.ok()) {
      return absl::Status(batch.status().code(),
                          absl::StrCat("ffn ", rank_, ": GetBatch (batch ", b, " of ", expected,
                                       "): ", batch.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(Serve(*batch));
  }
  STEPMESH_RETURN_IF_ERROR(engine_->stream().Synchronize(shape_.timeout));
  STEPMESH_RETURN_IF_ERROR(engine_->Finish());
  STEPMESH_RETURN_IF_ERROR(server_->Barrier());
  if (!metrics_file_.empty()) {
    STEPMESH_RETURN_IF_ERROR(stepmesh::tools::WriteMetricsFile(
        metrics_file_, stepmesh::PrometheusText(server_->Stats())));
  }
  if (!trace_file_.empty()) STEPMESH_RETURN_IF_ERROR(server_->WriteChromeTrace(trace_file_));
  metrics_.reset();
  STEPMESH_RETURN_IF_ERROR(server_->Shutdown());
  std::printf("afd_ffn[%d]: partition %d of %d served %lld batches, %lld tokens (%s engine)\n",
              rank_, rank_, shape_.ffn, static_cast<long long>(expected),
              static_cast<long long>(tokens_served_), engine_->name().c_str());
  return absl::OkStatus();
}

}  // namespace

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = Flags::Parse(argc, argv, {});
  if (!flags.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<RunShape> shape = ParseRunFlags(*flags);
  // Unset --scheduler, --rank and --device come from the environment
  // (STEPMESH_SCHEDULER or DMLC_PS_ROOT_URI/PORT, STEPMESH_RANK, STEPMESH_DEVICE).
  absl::StatusOr<stepmesh::MeshOptions> env = stepmesh::MeshOptions::FromEnv();
  if (!env.ok()) shape = env.status();
  const stepmesh::MeshOptions mesh = env.ok() ? *env : stepmesh::MeshOptions();
  const std::string scheduler = flags->Str("scheduler", mesh.scheduler);
  absl::StatusOr<int64_t> rank = flags->Int("rank", mesh.rank);
  absl::StatusOr<int64_t> device = flags->Int("device", mesh.device);
  const std::string metrics_file = flags->Str("metrics-file", "");
  const std::string trace_file = flags->Str("chrome-trace", "");
  absl::StatusOr<int64_t> metrics_port = flags->Int("metrics-port", 0);
  absl::Status st = shape.ok() ? flags->CheckAllUsed() : shape.status();
  if (st.ok() && (!rank.ok() || !device.ok())) st = !rank.ok() ? rank.status() : device.status();
  if (st.ok() && (!metrics_port.ok() || *metrics_port < 0 || *metrics_port > 65535)) {
    st = absl::InvalidArgumentError("--metrics-port wants a port in [0, 65535]");
  }
  if (st.ok() && (scheduler.empty() || *rank < 0 || *rank >= shape->ffn)) {
    st = absl::InvalidArgumentError("need --scheduler and --rank (or STEPMESH_RANK) in [0, --ffn)");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", st.ToString().c_str());
    return 2;
  }
  std::string error;
  // Every model of the example has the same FFN side: its ModelConfig.
  const std::optional<ExampleModel> model =
      LoadExampleModel(shape->config, BundledConfigDir(), &error);
  if (!model) {
    std::fprintf(stderr, "afd_ffn: config: %s\n", error.c_str());
    return 2;
  }
  if (st = ValidateRunForModel(*shape, *model); !st.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", st.ToString().c_str());
    return 2;
  }
  const int p = static_cast<int>(*rank);
  FfnInstance instance(*shape, model->config, p);
  instance.SetMetrics(static_cast<int>(*metrics_port), metrics_file);
  instance.SetTraceFile(trace_file);
  st = instance.Init(scheduler, static_cast<int>(*device));
  if (st.ok()) st = instance.Run();
  if (!st.ok()) {
    std::fprintf(stderr, "afd_ffn[%d]: error: %s\n", p, st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
