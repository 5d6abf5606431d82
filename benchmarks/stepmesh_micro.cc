// Micro-benchmarks of stepmesh's hot path (Google Benchmark):
//   BM_EncodeFrame / BM_DecodeFrame   the 104-byte wire header (CRC included)
//   BM_SubmitPushPull                 PushPull(): the hand-off to the send thread only
//   BM_RoundTrip/tcp                  PushPull + Wait, tiny payloads, in-process 1A1F over TCP
//   BM_RoundTrip/fake_verbs           the same over the RDMA transport on the fake fabric
// Each reports instr/op: user-space instructions retired by the benchmark
// thread per operation (perf_event_open), when the kernel allows it. For the
// round trips that excludes the progress threads; wall time includes them.
//   build-bench/benchmarks/stepmesh_micro --benchmark_min_time=0.2

#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmarks/perf_counter.h"
#include "src/compose/transports.h"
#include "src/core/frame.h"
#include "stepmesh/stepmesh.h"
#include "tests/support/loopback_mesh.h"

#ifdef STEPMESH_MICRO_FAKE_VERBS
#include "tests/support/fake_fabric.h"
#endif

namespace stepmesh::bench {
namespace {

void ReportInstructions(benchmark::State& state, InstructionCounter& counter, uint64_t instructions,
                        int64_t ops) {
  if (!counter.available()) {
    state.SetLabel(absl::StrCat("instr/op unavailable: ", counter.why_unavailable()));
    return;
  }
  state.counters["instr/op"] =
      benchmark::Counter(static_cast<double>(instructions) / static_cast<double>(ops));
}

core::FrameHeader SampleHeader() {
  core::FrameHeader h;
  h.type = core::FrameType::kPush;
  h.dtype = DType::kBFloat16;
  h.flags = core::kFlagHasPull;
  h.src = core::WorkerId(3);
  h.dst = core::ServerId(1);
  h.key = 1001;
  h.request_id = (uint64_t{5} << 32) | 77;
  h.payload_bytes = 917504;
  h.pull_key = 2001;
  h.part_index = 0;
  h.part_count = 1;
  h.stamps.enqueue_ns = 123456789;
  h.stamps.post_ns = 123456999;
  return h;
}

void BM_EncodeFrame(benchmark::State& state) {
  const core::FrameHeader h = SampleHeader();
  core::FrameBytes out;
  InstructionCounter counter;
  counter.Start();
  for (auto _ : state) {
    core::EncodeFrame(h, out.data());
    benchmark::DoNotOptimize(out);
    benchmark::ClobberMemory();
  }
  ReportInstructions(state, counter, counter.Stop(), state.iterations());
  state.SetBytesProcessed(state.iterations() * core::kFrameBytes);
}
BENCHMARK(BM_EncodeFrame);

void BM_DecodeFrame(benchmark::State& state) {
  const core::FrameBytes bytes = core::EncodeFrame(SampleHeader());
  InstructionCounter counter;
  counter.Start();
  for (auto _ : state) {
    absl::StatusOr<core::FrameHeader> h = core::DecodeFrame(bytes);
    benchmark::DoNotOptimize(h);
  }
  ReportInstructions(state, counter, counter.Stop(), state.iterations());
  state.SetBytesProcessed(state.iterations() * core::kFrameBytes);
}
BENCHMARK(BM_DecodeFrame);

// A scheduler, one worker (used by the benchmark thread) and one server that
// answers every batch from its own thread, all in this process.
class InProcessMesh {
 public:
  static std::unique_ptr<InProcessMesh> Create(const core::TransportFactory& factory, size_t bytes,
                                               std::string* error) {
    auto mesh = std::unique_ptr<InProcessMesh>(new InProcessMesh(bytes));
    absl::Status s = mesh->Start(factory);
    if (!s.ok()) {
      *error = s.ToString();
      return nullptr;
    }
    return mesh;
  }
  ~InProcessMesh() {
    stop_ = true;
    if (server_thread_.joinable()) server_thread_.join();
  }

  AFTensorWorker& worker() { return mesh_->worker(0); }
  static constexpr Key kPush = 1;
  static constexpr Key kPull = 2;

 private:
  explicit InProcessMesh(size_t bytes)
      : bytes_(bytes), push_(bytes, 1), pull_(bytes), recv_(bytes), reply_(bytes, 2) {}

  absl::Status Start(const core::TransportFactory& factory) {
    MeshOptions base;
    base.num_workers = 1;
    base.num_servers = 1;
    base.timeout = absl::Seconds(10);
    STEPMESH_ASSIGN_OR_RETURN(mesh_, testing::LoopbackMesh::Start(base, factory));
    AFTensorServer& server = mesh_->server(0);
    STEPMESH_RETURN_IF_ERROR(server.RegisterRecvTensor(kPush, BytesView(recv_.data(), bytes_)));
    STEPMESH_RETURN_IF_ERROR(server.RegisterReplyTensor(kPull, BytesView(reply_.data(), bytes_)));
    STEPMESH_RETURN_IF_ERROR(worker().RegisterPushTensor(kPush, BytesView(push_.data(), bytes_)));
    STEPMESH_RETURN_IF_ERROR(
        worker().RegisterPullTensor(kPull, 0, BytesView(pull_.data(), bytes_)));
    server_thread_ = std::thread([this, &server] {
      if (!server.Barrier().ok()) return;
      std::vector<Reply> replies(1);
      while (!stop_) {
        absl::StatusOr<Batch> batch = server.GetBatch(absl::Milliseconds(50));
        if (absl::IsDeadlineExceeded(batch.status())) continue;
        if (!batch.ok()) break;
        replies[0] = {batch->workers[0]};
        if (!server.Respond(*batch, replies).ok()) break;
      }
    });
    return worker().Barrier();
  }

  size_t bytes_;
  std::vector<uint8_t> push_, pull_, recv_, reply_;
  // Declared after the tensors: the mesh (and with it every registration) goes first.
  std::unique_ptr<testing::LoopbackMesh> mesh_;
  std::thread server_thread_;
  std::atomic<bool> stop_{false};
};

core::TransportFactory TcpFactory() {
  return [](const MeshOptions& o) {
    MeshOptions t = o;
    t.transport = "tcp";
    return compose::CreateTransport(t);
  };
}

// The mesh of `bytes` per tensor, or null with the benchmark skipped, saying why.
std::unique_ptr<InProcessMesh> MeshOrSkip(benchmark::State& state,
                                          const core::TransportFactory& factory, size_t bytes) {
  std::string error;
  std::unique_ptr<InProcessMesh> mesh = InProcessMesh::Create(factory, bytes, &error);
  if (mesh == nullptr) state.SkipWithError(error.c_str());
  return mesh;
}

void RoundTrip(benchmark::State& state, const core::TransportFactory& factory) {
  std::unique_ptr<InProcessMesh> mesh =
      MeshOrSkip(state, factory, static_cast<size_t>(state.range(0)));
  if (mesh == nullptr) return;
  const Push push{InProcessMesh::kPush};
  const Pull pull{InProcessMesh::kPull, 0};
  InstructionCounter counter;
  counter.Start();
  for (auto _ : state) {
    absl::StatusOr<RequestHandle> h = mesh->worker().PushPull({&push, 1}, {&pull, 1});
    if (!h.ok() || !mesh->worker().Wait(*h, absl::Seconds(10)).ok()) {
      state.SkipWithError("round trip failed");
      break;
    }
  }
  ReportInstructions(state, counter, counter.Stop(), state.iterations());
}

void BM_RoundTrip_Tcp(benchmark::State& state) { RoundTrip(state, TcpFactory()); }
BENCHMARK(BM_RoundTrip_Tcp)->Name("BM_RoundTrip/tcp")->Arg(8)->Arg(4096)->UseRealTime();

// Only the submit: PushPull() returning (request slot, send-queue push, send
// thread wake-up), timed manually so the Waits stay outside the measurement.
void BM_SubmitPushPull(benchmark::State& state) {
  std::unique_ptr<InProcessMesh> mesh = MeshOrSkip(state, TcpFactory(), 8);
  if (mesh == nullptr) return;
  const Push push{InProcessMesh::kPush};
  const Pull pull{InProcessMesh::kPull, 0};
  InstructionCounter counter;
  uint64_t instructions = 0;
  for (auto _ : state) {
    counter.Start();
    const uint64_t t0 = MonotonicNowNs();
    absl::StatusOr<RequestHandle> h = mesh->worker().PushPull({&push, 1}, {&pull, 1});
    const uint64_t t1 = MonotonicNowNs();
    instructions += counter.Stop();
    state.SetIterationTime(static_cast<double>(t1 - t0) * 1e-9);
    // A key may be in one request at a time: complete it before the next submit.
    if (!h.ok() || !mesh->worker().Wait(*h, absl::Seconds(10)).ok()) {
      state.SkipWithError("submit failed");
      break;
    }
  }
  ReportInstructions(state, counter, instructions, state.iterations());
}
BENCHMARK(BM_SubmitPushPull)->UseManualTime();

#ifdef STEPMESH_MICRO_FAKE_VERBS
void BM_RoundTrip_FakeVerbs(benchmark::State& state) {
  // Synchronous fabric: work requests execute inside post_send, no fabric thread in the
  // measurement.
  RoundTrip(state, testing::FakeRdmaFactory(std::make_shared<testing::FakeFabric>(
                       testing::FakeFabricOptions{.asynchronous = false})));
}
BENCHMARK(BM_RoundTrip_FakeVerbs)
    ->Name("BM_RoundTrip/fake_verbs")
    ->Arg(8)
    ->Arg(4096)
    ->UseRealTime();
#endif

}  // namespace
}  // namespace stepmesh::bench

int main(int argc, char** argv) {
  std::printf("perf_event_paranoid: ");
  if (std::FILE* f = std::fopen("/proc/sys/kernel/perf_event_paranoid", "r")) {
    int v = 0;
    if (std::fscanf(f, "%d", &v) == 1) std::printf("%d", v);
    std::fclose(f);
  } else {
    std::printf("unknown");
  }
  stepmesh::bench::InstructionCounter probe;
  std::printf("; instructions counter %s\n",
              probe.available() ? "available" : probe.why_unavailable().c_str());
#ifndef STEPMESH_MICRO_FAKE_VERBS
  std::printf("BM_RoundTrip/fake_verbs skipped: built without RDMA\n");
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
