// afd_attention: one attention instance of a disaggregated run of the example
// model (Step-3, or Step-5 with --model tiny-step5; a stepmesh worker). Its
// engine owns the embedding, attention + KV cache, the norms,
// the router, FP8 quantisation of the A2F activations, the reduction of the
// FFN partials, the residual stream and the LM head; the FFN lives on the
// afd_ffn servers. Normally started by afd_launch.
//
//   afd_attention --scheduler HOST:PORT --rank A --results FILE [--dump-layers]
//                 [--progress FILE] [--inject-wrong-layer STEP:LAYER]
//                 [--metrics-port P] [--metrics-file FILE]  (docs/metrics.md)
//                 [--chrome-trace FILE]  (the worker's stepmesh trace, docs/tracing.md;
//                                         needs STEPMESH_TRACE_EVENTS)
//                 [--control-fd N --report-fd N]  (afd_launch --autoscale: the
//                                  decisions' and the reports' pipes)
//                 [run flags: --model (or --config) --attention --ffn --requests
//                  --prompt-len --decode-steps --micro-batches --transport --backend
//                  --poll-mode --engine --kv-cache --timeout-ms --emulate-compute
//                  --resize --context-growth --emulated-batch --max-attention
//                  --decision-every] [--device N]
//
// Pipeline: the instance's requests are split into micro-batches, each with
// its own pre-registered wire tensors, StepState and backend stream. The main
// thread only enqueues: micro-batch m's attention for layer l runs on m's
// stream, an event is recorded after it, and a Post of the micro-batch's
// request (prepared once at Init) is gated on that event (the send thread
// waits, not the caller). The main thread then moves on to
// micro-batch m+1, whose attention overlaps m's A2F / FFN / F2A, and only
// blocks on m's reply right before enqueueing m's next layer.

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "examples/afd_model/afd_common.h"
#include "examples/afd_model/afd_engine.h"
#include "examples/afd_model/autoscale_channel.h"
#include "examples/afd_model/config.h"
#include "examples/afd_model/elastic_sync.h"
#include "examples/afd_model/example_model.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/process_flags.h"
#include "examples/afd_model/wire.h"
#include "examples/afd_model/workload_metrics.h"
#include "src/tools/metrics/metrics_http.h"
#include "stepmesh/stepmesh.h"

namespace afd::example {
namespace {

using stepmesh::DType;
using stepmesh::Shape;

// The pipeline's view of a micro-batch: its request in flight and the event
// that gates its next send. The compute state lives in the engine.
struct MicroBatch {
  int index = 0;
  int begin = 0;  // requests [begin, end) of this instance
  int end = 0;
  int count() const { return end - begin; }
  std::unique_ptr<stepmesh::Event> ready;  // the engine's stage of the current layer is done
  // Its request, prepared once (keys checked, servers routed) and posted at
  // every layer; only the byte counts change, per step.
  // Indexed by the number of FFN partitions F the request goes to (--resize:
  // one per F of the instance's span; else only shape.ffn).
  std::vector<stepmesh::PreparedRequest> request;
  std::vector<int> prepared_step;  // the step whose byte counts request[F] holds
  stepmesh::RequestHandle handle;
  bool in_flight = false;
  size_t in_flight_stage = 0;  // StageIndex of the request in flight
  int in_flight_step = 0, in_flight_layer = 0;
};

class AttentionInstance {
 public:
  AttentionInstance(const RunShape& run, const ExampleModel& model, int rank, bool dump_layers)
      : run_(run),
        shape_(run.ForAttention(rank)),
        model_(model),
        config_(model.config),
        rank_(rank),
        dump_layers_(dump_layers),
        schedule_(run.Schedule()),
        span_(schedule_.AttentionSpan(rank)),
        change_steps_(ChangeStepsOf(schedule_, span_)) {
    // F of each of its steps, so a Launch looks nothing up.
    for (int local = 0; local < shape_.steps(); ++local) {
      partitions_.push_back(schedule_.empty() ? shape_.ffn : schedule_.At(Global(local)).ffn);
    }
  }

  ~AttentionInstance() { StopEpochLog(); }

  // Creates the engine, joins the mesh and registers every micro-batch's tensors.
  absl::Status Init(const std::string& scheduler, int device);
  absl::Status Run();
  absl::Status OpenProgress(const std::string& path) { return progress_.Open(path); }
  // Test hook: the header of (step, layer) names layer + 1 (the FFN must refuse it).
  void InjectWrongLayer(int step, int layer) { wrong_layer_ = {step, layer}; }
  const AttentionResults& results() const { return results_; }
  // --resize: "resize S took NS" per change this instance crossed.
  void SetResizeLog(std::string path) { resize_log_ = std::move(path); }
  // --autoscale: the inherited pipe ends.
  void SetControl(int control_fd, int report_fd) {
    control_ =
        std::make_unique<ControlChannel>(absl::StrCat("attention ", rank_), control_fd, report_fd);
  }
  // --resize (attention 0): every membership epoch heard, until Finish.
  absl::Status StartEpochLog(const std::string& path);
  // --metrics-port: the worker's Stats() over HTTP until Finish.
  absl::Status ServeMetrics(int port) {
    STEPMESH_ASSIGN_OR_RETURN(
        metrics_, stepmesh::tools::MetricsHttpServer::Start(static_cast<uint16_t>(port), [this] {
          return stepmesh::PrometheusText(worker_->Stats()) + workload_.PrometheusText(rank_);
        }));
    std::printf("afd_attention[%d]: metrics at http://127.0.0.1:%u/metrics\n", rank_,
                metrics_->port());
    std::fflush(stdout);
    return absl::OkStatus();
  }
  // `metrics_file` (may be empty): the final Stats() in Prometheus text;
  // `trace_file` (may be empty): the worker's Chrome trace.
  absl::Status Finish(const std::string& metrics_file, const std::string& trace_file) {
    const bool leaves = span_.end < run_.steps();
    // A leaving instance crosses its last change (the barriers) and drains.
    if (leaves) STEPMESH_RETURN_IF_ERROR(CrossChange(span_.end));
    if (!leaves) STEPMESH_RETURN_IF_ERROR(worker_->Barrier());
    StopEpochLog();
    if (!metrics_file.empty()) {
      STEPMESH_RETURN_IF_ERROR(stepmesh::tools::WriteMetricsFile(
          metrics_file, stepmesh::PrometheusText(worker_->Stats())));
    }
    if (!trace_file.empty()) STEPMESH_RETURN_IF_ERROR(worker_->WriteChromeTrace(trace_file));
    metrics_.reset();
    return leaves ? worker_->Leave(shape_.timeout) : worker_->Shutdown();
  }

 private:
  // Global step of this instance's step `local`.
  int Global(int local) const { return span_.begin + local; }
  // --resize: the FFN partitions of the instance's step `local`.
  int PartitionsAt(int local) const { return partitions_[local]; }
  // The change at global step `step` (elastic_sync.h): a member at step - 1
  // drains its replies first; a joiner posts its first requests between the
  // barriers.
  absl::Status CrossChange(int step);
  void StopEpochLog();
  // --autoscale: checkpoint at global step `step` (local `local`): report
  // the workload of the step before, read the launcher's decision, amend
  // the schedule (autoscale_channel.h).
  absl::Status Checkpoint(int step, int local);
  absl::Status WaitReply(MicroBatch& mb);
  absl::Status Launch(int step, int layer, MicroBatch& mb);
  void SizeResults();

  const RunShape run_;    // the run: global steps, the start shape
  const RunShape shape_;  // this instance's (RunShape::ForAttention)
  const ExampleModel model_;
  const ModelConfig& config_;  // model_.config
  const int rank_;
  const bool dump_layers_;
  ResizeSchedule schedule_;  // --autoscale amends it at checkpoints
  const MemberSpan span_;    // global steps this instance is a member for
  std::vector<int> change_steps_;
  std::unique_ptr<ControlChannel> control_;  // --autoscale
  std::vector<int> partitions_;              // F of each step of the instance
  std::vector<int> server_ranks_;            // 0 .. capacity - 1 (Push::servers)
  std::string resize_log_;
  std::unique_ptr<std::thread> epoch_log_;
  std::atomic<bool> epoch_log_stop_{false};
  Progress wrong_layer_;
  std::shared_ptr<stepmesh::Backend> backend_;
  AttentionResults results_;
  ProgressWriter progress_;
  std::vector<MicroBatch> micro_batches_;
  // Destroyed before the results: its streams drain on destruction and the
  // queued stages write the results.
  std::unique_ptr<AttentionEngine> engine_;
  // The worker reads the registered memory the engine owns, so it is
  // declared last and destroyed first.
  std::unique_ptr<stepmesh::AFTensorWorker> worker_;
  WorkloadMetrics workload_;  // stepmesh_plan --watch reads it from metrics_
  std::unique_ptr<stepmesh::tools::MetricsHttpServer> metrics_;  // reads worker_
};

void AttentionInstance::SizeResults() {
  results_ = SizedResults(rank_, shape_, config_);
  results_.tokens.assign(size_t(shape_.requests) * shape_.steps(), -1);
  results_.logits.assign(size_t(shape_.steps()) * shape_.requests * config_.vocab_size, 0.0f);
  if (dump_layers_) {
    const size_t rows = size_t(shape_.requests) * (shape_.prompt_len + shape_.decode_steps);
    results_.layer_hidden.assign(rows * config_.num_layers * config_.hidden_size, 0.0f);
  }
}

absl::Status AttentionInstance::Init(const std::string& scheduler, int device) {
  const int64_t h = config_.hidden_size;
  const int64_t slot = shape_.SlotRows();
  SizeResults();

  absl::StatusOr<std::unique_ptr<stepmesh::Backend>> backend =
      stepmesh::CreateBackend(shape_.backend, device);
  if (!backend.ok()) return backend.status();
  backend_ = std::move(*backend);

  AttentionEngineParams params;
  params.shape = &shape_;
  params.model = &model_;
  params.rank = rank_;
  params.dump_layers = dump_layers_;
  params.backend = backend_;
  params.results = &results_;
  if (!schedule_.empty()) {
    for (int local = 0; local < shape_.steps(); ++local) {
      params.partitions_per_step.push_back(PartitionsAt(local));
    }
  }
  if (!run_.context_growth.empty()) {
    // The step's context, and its B from the shape the (amended) schedule
    // gives the step.
    params.emulated_load = [this](int local, int plan_batch) {
      const int global = Global(local);
      return EmulatedLoad{run_.ContextAt(global),
                          run_.VirtualBatch(plan_batch, schedule_.At(global).attention)};
    };
  }
  const std::vector<int32_t> all =
      GeneratePromptTokens(config_, shape_.attention * shape_.requests, shape_.prompt_len);
  for (int r = 0; r < shape_.requests; ++r) {
    const int64_t g = int64_t{rank_} * shape_.requests + r;
    params.prompts.emplace_back(all.begin() + g * shape_.prompt_len,
                                all.begin() + (g + 1) * shape_.prompt_len);
  }
  STEPMESH_ASSIGN_OR_RETURN(engine_, CreateAttentionEngine(std::move(params)));

  micro_batches_.resize(shape_.micro_batches);
  for (int m = 0; m < shape_.micro_batches; ++m) {
    MicroBatch& mb = micro_batches_[m];
    mb.index = m;
    mb.begin = shape_.MicroBatchBegin(m);
    mb.end = shape_.MicroBatchEnd(m);
    STEPMESH_ASSIGN_OR_RETURN(mb.ready, backend_->CreateEvent());
  }

  // The run's options: the start shape, and with --resize the capacity.
  STEPMESH_ASSIGN_OR_RETURN(stepmesh::MeshOptions options,
                            MeshOptionsFor(run_, stepmesh::Role::kWorker, rank_, scheduler));
  options.device = device;
  STEPMESH_ASSIGN_OR_RETURN(worker_, stepmesh::AFTensorWorker::Create(options, backend_));

  const int64_t groups = h / config_.fp8_group;
  for (int s = 0; s < shape_.ffn; ++s) server_ranks_.push_back(s);
  for (int m = 0; m < shape_.micro_batches; ++m) {
    AttentionWire& w = engine_->wire(m);
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kCodes), w.codes->View(DType::kFloat8E4M3, Shape{slot, h})));
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kScales), w.scales->View(DType::kFloat32, Shape{slot, groups})));
    STEPMESH_RETURN_IF_ERROR(
        worker_->RegisterPushTensor(PushKey(m, A2FTensor::kTopkIds),
                                    w.topk_ids->View(DType::kInt32, Shape{slot, config_.top_k})));
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kTopkWeights),
        w.topk_weights->View(DType::kFloat32, Shape{slot, config_.top_k})));
    STEPMESH_RETURN_IF_ERROR(worker_->RegisterPushTensor(
        PushKey(m, A2FTensor::kHeader), w.header->View(DType::kInt32, Shape{kWireHeaderInts})));
    for (int s = 0; s < shape_.ffn; ++s) {
      STEPMESH_RETURN_IF_ERROR(worker_->RegisterPullTensor(
          PullKey(m), s, w.partials[s]->View(DType::kBFloat16, Shape{slot, h})));
    }
    // Every layer of every step sends the same keys: one prepared request per
    // micro-batch (and, with --resize, per FFN partition count F of the
    // span: it goes to FFN ranks [0, F)), its push sizes set per step (Launch).
    MicroBatch& mb = micro_batches_[m];
    mb.request.resize(shape_.ffn + 1);
    mb.prepared_step.assign(shape_.ffn + 1, -1);
    for (int local = 0; local < shape_.steps(); ++local) {
      const int f = PartitionsAt(local);
      if (mb.prepared_step[f] != -1) continue;
      mb.prepared_step[f] = -2;  // prepared, no byte counts yet
      // A fixed run addresses every server (empty); an elastic one names them.
      const absl::Span<const int> servers =
          !run_.elastic() ? absl::Span<const int>() : absl::Span<const int>(server_ranks_).first(f);
      const stepmesh::Push pushes[kA2FTensors] = {
          {PushKey(m, A2FTensor::kCodes), stepmesh::kWholeTensor, servers},
          {PushKey(m, A2FTensor::kScales), stepmesh::kWholeTensor, servers},
          {PushKey(m, A2FTensor::kTopkIds), stepmesh::kWholeTensor, servers},
          {PushKey(m, A2FTensor::kTopkWeights), stepmesh::kWholeTensor, servers},
          {PushKey(m, A2FTensor::kHeader), sizeof(int32_t) * kWireHeaderInts, servers},
      };
      std::vector<stepmesh::Pull> pulls;
      for (int s = 0; s < f; ++s) pulls.push_back({PullKey(m), s});
      STEPMESH_ASSIGN_OR_RETURN(mb.request[f], worker_->Prepare(pushes, pulls));
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionInstance::WaitReply(MicroBatch& mb) {
  if (!mb.in_flight) return absl::OkStatus();
  mb.in_flight = false;
  const absl::Status s = worker_->Wait(mb.handle, shape_.timeout);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("attention ", rank_, ": step ", mb.in_flight_step,
                                               " layer ", mb.in_flight_layer, " micro-batch ",
                                               mb.index, ": FFN reply: ", s.message()));
  }
  absl::StatusOr<stepmesh::TraceRecord> trace = worker_->FetchTrace(mb.handle);
  if (trace.ok()) {
    for (const auto& per : trace->servers) {
      if (per.server >= 0 && per.server < shape_.ffn) {
        results_.traces[mb.in_flight_stage * shape_.ffn + per.server] = per.stamps;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionInstance::Launch(int step, int layer, MicroBatch& mb) {
  const int m = mb.index;
  STEPMESH_RETURN_IF_ERROR(engine_->EnqueueStage(m, step, layer));
  STEPMESH_RETURN_IF_ERROR(mb.ready->Record(engine_->stream(m)));
  const int64_t n = int64_t{mb.count()} * shape_.TokensPerRequest(step);
  // The wire names global steps (an instance that joined at step S counts
  // its own from S).
  const int global = Global(step);
  // The header is written here, not on the stream: the previous request of
  // this micro-batch has completed (WaitReply), so nothing reads it now, and
  // the send thread reads it only after `ready`.
  WireHeader header{global,
                    layer,
                    m,
                    static_cast<int32_t>(n),
                    rank_,
                    config_.is_moe_layer[layer] ? WireHeader::kMoeLayer : 0,
                    static_cast<int32_t>(config_.hidden_size)};
  if (wrong_layer_.step == global && wrong_layer_.layer == layer) header.layer = layer + 1;
  WriteWireHeader(header, static_cast<int32_t*>(engine_->wire(m).header->data()));
  const int f = PartitionsAt(step);
  stepmesh::PreparedRequest& request = mb.request[f];
  if (mb.prepared_step[f] != step) {
    // Only the rows of this step travel: a prefix of each registered tensor
    // (the push order of Init's Prepare).
    const A2FSizes sizes{n, config_.hidden_size, config_.top_k, config_.fp8_group};
    const size_t bytes[] = {sizes.codes_bytes(), sizes.scales_bytes(), sizes.topk_ids_bytes(),
                            sizes.topk_weights_bytes()};
    for (size_t i = 0; i < std::size(bytes); ++i) {
      STEPMESH_RETURN_IF_ERROR(request.SetBytes(i, bytes[i]));
    }
    mb.prepared_step[f] = step;
  }
  // The stage batches this request with the other instances' of the same
  // (step, layer, micro-batch) on every server.
  absl::StatusOr<stepmesh::RequestHandle> handle = worker_->Post(
      request,
      stepmesh::SendOptions{.ready = mb.ready.get(),
                            .stage = StageOf(run_, config_.num_layers, {global, layer, m})});
  if (!handle.ok()) {
    return absl::Status(handle.status().code(),
                        absl::StrCat("attention ", rank_, ": Post step ", global, " layer ", layer,
                                     ": ", handle.status().message()));
  }
  mb.handle = *handle;
  mb.in_flight = true;
  mb.in_flight_stage = results_.StageIndex(step, layer, m);
  mb.in_flight_step = global;
  mb.in_flight_layer = layer;
  return absl::OkStatus();
}

absl::Status AttentionInstance::CrossChange(int step) {
  const absl::Time start = absl::Now();
  const uint64_t start_ns = stepmesh::MonotonicNowNs();
  const bool joins = step == span_.begin;
  // A member finishes step - 1 first: every reply in, so no batch of it is
  // still open anywhere when a joiner's first request arrives.
  if (!joins) {
    for (MicroBatch& mb : micro_batches_) STEPMESH_RETURN_IF_ERROR(WaitReply(mb));
  }
  const MeshShape target = schedule_.At(step);
  absl::StatusOr<uint64_t> epoch = WaitForShape(*worker_, target, shape_.timeout);
  if (!epoch.ok()) {
    return absl::Status(epoch.status().code(),
                        absl::StrCat("attention ", rank_, ": resize at step ", step, ": ",
                                     epoch.status().message()));
  }
  STEPMESH_RETURN_IF_ERROR(worker_->Barrier());  // A
  if (joins) {
    // The first requests: the prefill's layer 0 of every micro-batch.
    for (MicroBatch& mb : micro_batches_) STEPMESH_RETURN_IF_ERROR(Launch(0, 0, mb));
    const absl::Time deadline = absl::Now() + shape_.timeout;
    while (worker_->Stats().sends_queued > 0) {
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("attention ", rank_,
                                                        ": its first requests (step ", step,
                                                        ") still queued after the mesh timeout"));
      }
      absl::SleepFor(absl::Microseconds(200));
    }
  }
  STEPMESH_RETURN_IF_ERROR(worker_->Barrier());  // B
  if (!resize_log_.empty()) {
    std::ofstream log(resize_log_, std::ios::app);
    log << "resize " << step << " took " << stepmesh::MonotonicNowNs() - start_ns << "\n";
    if (!log) return absl::UnavailableError(absl::StrCat("cannot write ", resize_log_));
  }
  (void)start;
  return absl::OkStatus();
}

absl::Status AttentionInstance::StartEpochLog(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::UnavailableError(absl::StrCat("cannot create ", path));
  auto write = [f](const stepmesh::Membership& m) {
    const std::string line =
        FormatEpochRecord({m.epoch, stepmesh::MonotonicNowNs(), static_cast<int>(m.workers.size()),
                           static_cast<int>(m.servers.size())});
    std::fputs(line.c_str(), f);
    std::fflush(f);
  };
  stepmesh::Membership first = worker_->CurrentMembership();
  write(first);
  epoch_log_ = std::make_unique<std::thread>([this, f, write, epoch = first.epoch]() mutable {
    // Bounded waits, so StopEpochLog is seen within one.
    while (!epoch_log_stop_.load()) {
      absl::StatusOr<stepmesh::Membership> m =
          worker_->WaitMembershipChange(epoch, absl::Milliseconds(100));
      if (m.ok()) {
        write(*m);
        epoch = m->epoch;
      } else if (!absl::IsDeadlineExceeded(m.status())) {
        break;
      }
    }
    std::fclose(f);
  });
  return absl::OkStatus();
}

absl::Status AttentionInstance::Checkpoint(int step, int local) {
  if (span_.begin < step) {
    // What its engine ran at step - 1 (layer 0 of every micro-batch; that
    // stage's reply was awaited before layer 1 went out).
    if (config_.num_layers < 2) {
      for (MicroBatch& mb : micro_batches_) STEPMESH_RETURN_IF_ERROR(WaitReply(mb));
    }
    WorkloadReport r{step, 0, 0, shape_.micro_batches};
    for (int m = 0; m < shape_.micro_batches; ++m) {
      const StageTiming& t = results_.attention[results_.StageIndex(local - 1, 0, m)];
      r.requests += t.rows;
      r.context_tokens += t.kv_tokens;
    }
    STEPMESH_RETURN_IF_ERROR(control_->Report(r));
  }
  STEPMESH_ASSIGN_OR_RETURN(const Decision d, control_->Await(step, shape_.timeout));
  STEPMESH_ASSIGN_OR_RETURN(const bool changed,
                            ApplyDecision(d, absl::StrCat("attention ", rank_), step, &schedule_));
  if (!changed) return absl::OkStatus();
  change_steps_ = ChangeStepsOf(schedule_, span_);
  return absl::OkStatus();
}

void AttentionInstance::StopEpochLog() {
  if (epoch_log_ == nullptr) return;
  epoch_log_stop_.store(true);
  epoch_log_->join();
  epoch_log_.reset();
}

absl::Status AttentionInstance::Run() {
  // The start members meet at the start barrier; a joiner crosses its first
  // change instead.
  if (span_.begin == 0) STEPMESH_RETURN_IF_ERROR(worker_->Barrier());
  results_.start_ns = stepmesh::MonotonicNowNs();
  size_t next_change = 0;
  for (int step = 0; step < shape_.steps(); ++step) {
    bool joined_now = false;
    if (control_ && IsCheckpoint(run_, Global(step))) {
      STEPMESH_RETURN_IF_ERROR(Checkpoint(Global(step), step));
    }
    if (next_change < change_steps_.size() && change_steps_[next_change] == Global(step)) {
      STEPMESH_RETURN_IF_ERROR(CrossChange(Global(step)));
      joined_now = step == 0;  // its layer 0 went out between the barriers
      ++next_change;
    }
    // Every request attends over its prompt and the `step` tokens decoded so far.
    workload_.Observe(shape_.requests, int64_t{shape_.requests} * (shape_.prompt_len + step),
                      shape_.micro_batches, int64_t{shape_.requests} * step);
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      progress_.Update(Global(step), layer);
      if (joined_now && layer == 0) continue;
      for (MicroBatch& mb : micro_batches_) {
        // The previous layer's partials must have landed before this
        // micro-batch's stage reduces them.
        STEPMESH_RETURN_IF_ERROR(WaitReply(mb));
        STEPMESH_RETURN_IF_ERROR(Launch(step, layer, mb));
      }
    }
  }
  for (MicroBatch& mb : micro_batches_) {
    STEPMESH_RETURN_IF_ERROR(WaitReply(mb));
    STEPMESH_RETURN_IF_ERROR(engine_->EnqueueFinishStep(mb.index, shape_.steps() - 1));
  }
  for (int m = 0; m < shape_.micro_batches; ++m) {
    STEPMESH_RETURN_IF_ERROR(engine_->stream(m).Synchronize(shape_.timeout));
  }
  return engine_->Finish();
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = Flags::Parse(argc, argv, {"dump-layers"});
  if (!flags.ok()) {
    std::fprintf(stderr, "afd_attention: %s\n", flags.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<ProcessFlags> process = ReadProcessFlags(*flags);
  const std::string results_path = flags->Str("results", "");
  const std::string progress_path = flags->Str("progress", "");
  const std::string resize_log = flags->Str("resize-log", "");
  const std::string epoch_log = flags->Str("epoch-log", "");
  absl::StatusOr<int64_t> control_fd = flags->Int("control-fd", -1);
  absl::StatusOr<int64_t> report_fd = flags->Int("report-fd", -1);
  Progress wrong_layer;
  if (const std::string inject = flags->Str("inject-wrong-layer", ""); !inject.empty()) {
    std::vector<std::string> parts = absl::StrSplit(inject, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &wrong_layer.step) ||
        !absl::SimpleAtoi(parts[1], &wrong_layer.layer)) {
      std::fprintf(stderr, "afd_attention: --inject-wrong-layer wants STEP:LAYER\n");
      return 2;
    }
  }
  const bool dump_layers = flags->Bool("dump-layers");
  absl::Status st = process.ok() ? CheckProcessFlags(*flags, *process, stepmesh::Role::kWorker)
                                 : process.status();
  if (st.ok() && (!control_fd.ok() || !report_fd.ok() ||
                  (*control_fd >= 0) != (process->shape.decision_every > 0) || *control_fd > 1023 ||
                  (*control_fd >= 0 && (*report_fd < 0 || *report_fd > 1023)))) {
    st = absl::InvalidArgumentError(
        "--decision-every needs --control-fd and --report-fd (inherited pipe ends, "
        "afd_launch --autoscale) and they need it");
  }
  absl::StatusOr<ExampleModel> model = st.ok() ? LoadRunModel(process->shape) : st;
  if (!model.ok()) {
    std::fprintf(stderr, "afd_attention: %s\n", model.status().ToString().c_str());
    return 2;
  }

  const RunShape& shape = process->shape;
  const int a = static_cast<int>(process->rank);
  AttentionInstance instance(shape, *model, a, dump_layers);
  if (wrong_layer.step >= 0) instance.InjectWrongLayer(wrong_layer.step, wrong_layer.layer);
  if (!progress_path.empty()) st = instance.OpenProgress(progress_path);
  instance.SetResizeLog(resize_log);
  if (*control_fd >= 0) {
    instance.SetControl(static_cast<int>(*control_fd), static_cast<int>(*report_fd));
  }
  if (st.ok()) st = instance.Init(process->scheduler, static_cast<int>(process->device));
  if (st.ok() && !epoch_log.empty()) st = instance.StartEpochLog(epoch_log);
  if (st.ok() && process->metrics_port > 0) st = instance.ServeMetrics(process->metrics_port);
  if (st.ok()) st = instance.Run();
  if (st.ok() && !results_path.empty()) st = WriteResults(results_path, instance.results());
  if (st.ok()) st = instance.Finish(process->metrics_file, process->trace_file);
  if (!st.ok()) {
    std::fprintf(stderr, "afd_attention[%d]: error: %s\n", a, st.ToString().c_str());
    return 1;
  }
  std::printf("afd_attention[%d]: %d requests, %d steps done\n", a, shape.requests,
              shape.ForAttention(a).steps());
  return 0;
}

}  // namespace
}  // namespace afd::example

int main(int argc, char** argv) { return afd::example::Main(argc, argv); }
