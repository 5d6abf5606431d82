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
//           [--control-fd N]  (afd_launch --autoscale: the decisions' pipe,
//                              autoscale_channel.h)
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
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/autoscale_channel.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/elastic_sync.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/process_flags.h"
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
      : shape_(shape),
        regions_(shape.ForFfn()),
        config_(config),
        rank_(rank),
        schedule_(shape.Schedule()),
        span_(schedule_.FfnSpan(rank)) {
    Derive();
  }

  absl::Status Init(const std::string& scheduler, int device);
  // --metrics-port / --metrics-file (either may be unset: 0, empty).
  void SetMetrics(int port, std::string file) {
    metrics_port_ = port;
    metrics_file_ = std::move(file);
  }
  // --chrome-trace: the server's trace written there before it leaves.
  void SetTraceFile(std::string file) { trace_file_ = std::move(file); }
  // --autoscale: the inherited pipe end the decisions come on.
  void SetControl(int control_fd) {
    control_ = std::make_unique<ControlChannel>(absl::StrCat("ffn ", rank_), control_fd, -1);
  }
  absl::Status Run();

 private:
  // Checks a batch (its stage, keys, sizes, every worker's header against
  // the stage and the schedule's members) and enqueues its forward under
  // the stage's expert layout.
  absl::Status Serve(const stepmesh::Batch& batch);
  // --resize, a rank whose span ends before the run: drains and leaves.
  absl::Status LeaveMesh();
  // The change at global step `step` (elastic_sync.h), once every request
  // before it is served.
  absl::Status CrossChange(int step);
  // The schedule's answers per step and rank, so a batch looks nothing up
  // (again after an amendment).
  void Derive();
  // --autoscale: reads checkpoint `step`'s decision and amends the schedule.
  absl::Status Checkpoint(int step);
  // Requests (worker, stage) of this rank's steps before `step`.
  int64_t RequestsBefore(int step) const;
  absl::StatusOr<stepmesh::Batch> NextBatch();

  const RunShape shape_;    // the run (global steps, the start shape)
  const RunShape regions_;  // region sizes: the capacity (ForFfn)
  const ModelConfig config_;
  const int rank_;
  ResizeSchedule schedule_;                  // --autoscale amends it at checkpoints
  const MemberSpan span_;                    // the steps this rank serves
  std::vector<int> partitions_;              // F of each global step
  std::vector<int> workers_at_;              // attention instances of each global step
  std::vector<MemberSpan> attention_spans_;  // by attention rank
  std::shared_ptr<stepmesh::Backend> backend_;
  std::vector<std::unique_ptr<stepmesh::Event>> done_;  // per micro-batch
  int64_t requests_served_ = 0;                         // (worker, stage) pairs
  int64_t batches_served_ = 0;
  int64_t tokens_served_ = 0;
  std::unique_ptr<FfnEngine> engine_;
  // Destroyed first: it reads the engine's regions.
  std::unique_ptr<stepmesh::AFTensorServer> server_;
  int metrics_port_ = 0;
  std::string metrics_file_;
  std::string trace_file_;
  std::unique_ptr<stepmesh::tools::MetricsHttpServer> metrics_;  // reads server_
  std::unique_ptr<ControlChannel> control_;                      // --autoscale
};

void FfnInstance::Derive() {
  partitions_.clear();
  workers_at_.clear();
  attention_spans_.clear();
  for (int s = 0; s < shape_.steps(); ++s) {
    partitions_.push_back(schedule_.At(s).ffn);
    workers_at_.push_back(schedule_.At(s).attention);
  }
  for (int w = 0; w < regions_.attention; ++w) {
    attention_spans_.push_back(schedule_.AttentionSpan(w));
  }
}

absl::Status FfnInstance::Checkpoint(int step) {
  STEPMESH_ASSIGN_OR_RETURN(const Decision d, control_->Await(step, shape_.timeout));
  STEPMESH_ASSIGN_OR_RETURN(const bool changed,
                            ApplyDecision(d, absl::StrCat("ffn ", rank_), step, &schedule_));
  if (!changed) return absl::OkStatus();
  Derive();
  return absl::OkStatus();
}

absl::Status FfnInstance::Init(const std::string& scheduler, int device) {
  absl::StatusOr<std::unique_ptr<stepmesh::Backend>> backend =
      stepmesh::CreateBackend(shape_.backend, device);
  if (!backend.ok()) return backend.status();
  backend_ = std::move(*backend);
  FfnEngineParams params;
  params.shape = &regions_;  // the capacity's regions; steps are the run's
  params.config = &config_;
  params.rank = rank_;
  params.partitions = schedule_.At(span_.begin).ffn;
  params.backend = backend_;
  if (!shape_.context_growth.empty()) {
    // Every member of the step is in each batch: the batch's workers are
    // the step's attention instances.
    params.virtual_batch = [this](int workers, int plan_batch) {
      return shape_.VirtualBatch(plan_batch, workers);
    };
  }
  STEPMESH_ASSIGN_OR_RETURN(engine_, CreateFfnEngine(std::move(params)));
  for (int m = 0; m < shape_.micro_batches; ++m) {
    STEPMESH_ASSIGN_OR_RETURN(auto event, backend_->CreateEvent());
    done_.push_back(std::move(event));
  }

  const int64_t w = regions_.attention;
  const int64_t slot = regions_.SlotRows();
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.top_k;
  const int64_t groups = h / config_.fp8_group;
  // The run's options: the start shape, and with --resize the capacity.
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
  StageId stage;
  if (!DecodeStage(shape_, config_.num_layers, batch.group, &stage) ||
      batch.tensors.size() != kA2FTensors) {
    return absl::InternalError(absl::StrCat("ffn ", rank_, ": unexpected batch: group ",
                                            batch.group, " with ", batch.tensors.size(),
                                            " tensors"));
  }
  const int m = stage.micro_batch;
  const int step = stage.step;
  const int layer = stage.layer;
  for (int t = 0; t < kA2FTensors; ++t) {
    if (batch.tensors[t].key != PushKey(m, static_cast<A2FTensor>(t))) {
      return absl::InternalError(
          absl::StrCat("ffn ", rank_, ": tensor ", t, " has key ", batch.tensors[t].key));
    }
  }
  // The schedule says who may send this stage: this rank only in its span,
  // the attention instances of the step.
  const int partitions = partitions_[step];
  if (!span_.Contains(step)) {
    return absl::FailedPreconditionError(
        absl::StrCat("ffn ", rank_, ": a batch of step ", step, " layer ", layer, " micro-batch ",
                     m, ", outside this FFN's steps [", span_.begin, ", ", span_.end, ") (",
                     partitions, " FFN partitions then)"));
  }
  const auto* headers = static_cast<const int32_t*>(engine_->wire(m).header->data());

  const int64_t h = config_.hidden_size;
  std::vector<WorkerRows> rows;
  std::vector<stepmesh::Reply> replies;
  for (size_t i = 0; i < batch.workers.size(); ++i) {
    const int w = batch.workers[i];
    if (w < 0 || w >= static_cast<int>(attention_spans_.size()) ||
        !attention_spans_[w].Contains(step)) {
      return absl::FailedPreconditionError(absl::StrCat("ffn ", rank_, ": attention ", w,
                                                        " sent step ", step,
                                                        ", where the schedule has it no member"));
    }
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
  requests_served_ += static_cast<int64_t>(rows.size());
  ++batches_served_;
  STEPMESH_RETURN_IF_ERROR(engine_->EnqueueForward(m, layer, partitions, rows));
  STEPMESH_RETURN_IF_ERROR(done_[m]->Record(engine_->stream()));
  return server_->Respond(batch, replies,
                          stepmesh::SendOptions{.ready = done_[m].get(), .stage = {}});
}

absl::StatusOr<stepmesh::Batch> FfnInstance::NextBatch() {
  // A rank that joined a running mesh awaits each worker only in batches
  // opened after that worker's first request here (the library's rule for
  // a joining server: every worker is new to it). So in its first step a
  // batch may wait for a worker that already sent that stage, in a batch
  // handed out before; such a batch goes out with the workers it has after
  // a short wait (kReadyByDeadline: every worker still gets its reply, the
  // FFN computes the rows it has). From its second step every batch opened
  // waits for every worker.
  if (span_.begin == 0 || requests_served_ >= RequestsBefore(span_.begin + 1)) {
    return server_->GetBatch(shape_.timeout);
  }
  const absl::Time deadline = absl::Now() + shape_.timeout;
  for (;;) {
    absl::StatusOr<stepmesh::Batch> batch =
        server_->GetBatch(absl::Milliseconds(20), stepmesh::BatchPolicy::kReadyByDeadline);
    if (batch.ok() || !absl::IsDeadlineExceeded(batch.status()) || absl::Now() > deadline) {
      return batch;
    }
  }
}

int64_t FfnInstance::RequestsBefore(int step) const {
  // Every member attention instance sends one request per (step, layer,
  // micro-batch).
  int64_t n = 0;
  for (int s = span_.begin; s < step; ++s) {
    n += int64_t{workers_at_[s]} * config_.num_layers * shape_.micro_batches;
  }
  return n;
}

absl::Status FfnInstance::CrossChange(int step) {
  auto named = [&](const absl::Status& s) {
    return absl::Status(s.code(),
                        absl::StrCat("ffn ", rank_, ": resize at step ", step, ": ", s.message()));
  };
  if (absl::StatusOr<uint64_t> e = WaitForShape(*server_, schedule_.At(step), shape_.timeout);
      !e.ok()) {
    return named(e.status());
  }
  if (absl::Status s = server_->Barrier(); !s.ok()) return named(s);  // A
  if (span_.Contains(step)) {
    // Every attention instance joining now sends this rank its first
    // requests between the barriers: they must be here before B.
    const absl::Time deadline = absl::Now() + shape_.timeout;
    for (int w = 0; w < regions_.attention; ++w) {
      if (schedule_.AttentionSpan(w).begin != step) continue;
      const uint64_t need = FirstRequestBytes(shape_.ForAttention(w), config_);
      for (;;) {
        uint64_t got = 0;
        for (const stepmesh::PeerStats& peer : server_->Stats().peers) {
          if (peer.role == stepmesh::Role::kWorker && peer.rank == w) got = peer.bytes_received;
        }
        if (got >= need) break;
        if (absl::Now() > deadline) {
          return named(absl::DeadlineExceededError(
              absl::StrCat("attention ", w, "'s first requests: ", got, " of ", need,
                           " bytes arrived within the mesh timeout")));
        }
        absl::SleepFor(absl::Microseconds(200));
      }
    }
  }
  if (absl::Status s = server_->Barrier(); !s.ok()) return named(s);  // B
  return absl::OkStatus();
}

absl::Status FfnInstance::LeaveMesh() {
  // Leave answers what still arrives while GetBatch is called on another
  // thread; the schedule says nothing more is addressed to this rank, so any
  // batch there is an error.
  absl::Status drain_status;
  std::thread drain([&] {
    for (;;) {
      absl::StatusOr<stepmesh::Batch> batch = server_->GetBatch(shape_.timeout);
      if (batch.ok()) {
        drain_status = absl::FailedPreconditionError(
            absl::StrCat("ffn ", rank_, ": a batch (group ", batch->group, ") after its last step ",
                         span_.end - 1));
        continue;
      }
      if (absl::IsUnavailable(batch.status()) || absl::IsCancelled(batch.status())) return;
      if (!absl::IsDeadlineExceeded(batch.status())) {
        drain_status = batch.status();
        return;
      }
    }
  });
  const absl::Status left = server_->Leave(shape_.timeout);
  drain.join();
  STEPMESH_RETURN_IF_ERROR(left);
  return drain_status;
}

absl::Status FfnInstance::Run() {
  // The start members meet at the start barrier; a rank that joins later
  // (--resize) comes into a mesh already decoding, at its first change.
  if (span_.begin == 0) STEPMESH_RETURN_IF_ERROR(server_->Barrier());
  std::vector<int> changes = ChangeStepsOf(schedule_, span_);
  size_t next_change = 0;
  // A fixed shape counts batches: one per (step, layer, micro-batch),
  // whoever is in it, so a lost attention instance (--lost-attention) does
  // not leave the FFN waiting for its requests. An elastic run (--resize,
  // --autoscale) counts the schedule's (worker, stage) requests: a joining
  // FFN's first step may hand out a stage in more than one batch (NextBatch).
  const bool by_batches = !shape_.elastic();
  const int64_t expected_batches =
      int64_t{shape_.steps()} * config_.num_layers * shape_.micro_batches;
  int64_t expected = RequestsBefore(span_.end);
  // --autoscale: the next checkpoint this rank reads (a member there).
  auto next_checkpoint = [&](int from) {
    while (from < span_.end && !(control_ && IsCheckpoint(shape_, from))) ++from;
    return from;
  };
  int checkpoint = next_checkpoint(span_.begin);
  for (;;) {
    for (bool progressed = true; progressed;) {
      progressed = false;
      // A checkpoint's decision before the change of the same step.
      if (checkpoint < span_.end && requests_served_ == RequestsBefore(checkpoint)) {
        STEPMESH_RETURN_IF_ERROR(Checkpoint(checkpoint));
        changes = ChangeStepsOf(schedule_, span_);
        expected = RequestsBefore(span_.end);
        checkpoint = next_checkpoint(checkpoint + 1);
        progressed = true;
      } else if (next_change < changes.size() &&
                 requests_served_ == RequestsBefore(changes[next_change])) {
        STEPMESH_RETURN_IF_ERROR(CrossChange(changes[next_change++]));
        progressed = true;
      }
    }
    if (by_batches ? batches_served_ >= expected_batches : requests_served_ >= expected) break;
    absl::StatusOr<stepmesh::Batch> batch = NextBatch();
    if (!batch.ok()) {
      return absl::Status(batch.status().code(),
                          absl::StrCat("ffn ", rank_, ": GetBatch (",
                                       by_batches ? batches_served_ : requests_served_, " of ",
                                       by_batches ? expected_batches : expected,
                                       by_batches ? " batches" : " requests",
                                       " served): ", batch.status().message()));
    }
    STEPMESH_RETURN_IF_ERROR(Serve(*batch));
  }
  STEPMESH_RETURN_IF_ERROR(engine_->stream().Synchronize(shape_.timeout));
  STEPMESH_RETURN_IF_ERROR(engine_->Finish());
  const bool leaves = span_.end < shape_.steps();
  if (!leaves) STEPMESH_RETURN_IF_ERROR(server_->Barrier());
  if (!metrics_file_.empty()) {
    STEPMESH_RETURN_IF_ERROR(stepmesh::tools::WriteMetricsFile(
        metrics_file_, stepmesh::PrometheusText(server_->Stats())));
  }
  if (!trace_file_.empty()) STEPMESH_RETURN_IF_ERROR(server_->WriteChromeTrace(trace_file_));
  metrics_.reset();
  STEPMESH_RETURN_IF_ERROR(leaves ? LeaveMesh() : server_->Shutdown());
  if (!shape_.elastic()) {
    std::printf("afd_ffn[%d]: partition %d of %d served %lld batches, %lld tokens (%s engine)\n",
                rank_, rank_, shape_.ffn, static_cast<long long>(batches_served_),
                static_cast<long long>(tokens_served_), engine_->name().c_str());
  } else {
    std::printf(
        "afd_ffn[%d]: steps %d-%d (partition %d of %d at its first step, %d at its last) served "
        "%lld batches, %lld tokens (%s engine)%s\n",
        rank_, span_.begin, span_.end - 1, rank_, schedule_.At(span_.begin).ffn,
        schedule_.At(span_.end - 1).ffn, static_cast<long long>(batches_served_),
        static_cast<long long>(tokens_served_), engine_->name().c_str(), leaves ? ", left" : "");
  }
  return absl::OkStatus();
}

}  // namespace

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = Flags::Parse(argc, argv, {});
  if (!flags.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<ProcessFlags> process = ReadProcessFlags(*flags);
  absl::StatusOr<int64_t> control_fd = flags->Int("control-fd", -1);
  absl::Status st = process.ok() ? CheckProcessFlags(*flags, *process, stepmesh::Role::kServer)
                                 : process.status();
  if (st.ok() && (!control_fd.ok() || (*control_fd >= 0) != (process->shape.decision_every > 0) ||
                  *control_fd > 1023)) {
    st = absl::InvalidArgumentError(
        "--decision-every needs --control-fd (an inherited pipe end, afd_launch --autoscale) "
        "and it needs it");
  }
  // Every model of the example has the same FFN side: its ModelConfig.
  absl::StatusOr<ExampleModel> model = st.ok() ? LoadRunModel(process->shape) : st;
  if (!model.ok()) {
    std::fprintf(stderr, "afd_ffn: %s\n", model.status().ToString().c_str());
    return 2;
  }
  const int p = static_cast<int>(process->rank);
  FfnInstance instance(process->shape, model->config, p);
  instance.SetMetrics(process->metrics_port, process->metrics_file);
  instance.SetTraceFile(process->trace_file);
  if (*control_fd >= 0) instance.SetControl(static_cast<int>(*control_fd));
  st = instance.Init(process->scheduler, static_cast<int>(process->device));
  if (st.ok()) st = instance.Run();
  if (!st.ok()) {
    std::fprintf(stderr, "afd_ffn[%d]: error: %s\n", p, st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
