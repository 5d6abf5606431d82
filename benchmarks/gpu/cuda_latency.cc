// Latency of the GPU <-> host synchronisation paths of the CUDA backend:
//   ready   event Record() -> a polling "send thread" sees it complete, per
//           ReadyEventMode, on an otherwise idle stream;
//   resume  host flag Store() -> the waiting stream resumes, per wait path,
//           observed as the stream's SignalHostFlag write arriving back on the
//           host (so it includes one GPU->host write as well);
//   copy    Backend::Copy (cudaMemcpyAsync on the backend's own stream + stream
//           sync) against the cudaMemcpy it replaced (legacy default stream),
//           measured interleaved in the same run; prints the ratio.
// Usage: cuda_latency [iterations=2000] [device=0]. Exits 77 without a GPU.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "src/backends/cuda/cuda_backend.h"
#include "src/base/thread_util.h"
#include "stepmesh/backend.h"

namespace stepmesh {
namespace {

using Clock = std::chrono::steady_clock;

void Report(const char* what, std::vector<double>& micros) {
  std::sort(micros.begin(), micros.end());
  auto at = [&](double q) { return micros[static_cast<size_t>(q * (micros.size() - 1))]; };
  std::printf("%-34s n=%-6zu p50=%8.2f us  p90=%8.2f us  p99=%8.2f us  max=%8.2f us\n", what,
              micros.size(), at(0.5), at(0.9), at(0.99), micros.back());
}

double Micros(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

int ReadyLatency(int device, ReadyEventMode mode, int iterations) {
  CudaBackendOptions options;
  options.ready_event_mode = mode;
  auto backend = CreateCudaBackend(device, options);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  auto stream = *(*backend)->CreateStream();
  auto event = *(*backend)->CreateEvent();
  std::vector<Clock::time_point> seen(iterations);
  std::atomic<int> armed{-1};
  std::atomic<int> finished{-1};
  std::atomic<bool> failed{false};
  // The "send thread": spins on Query() as stepmesh's send thread does.
  std::thread poller([&] {
    for (int i = 0; i < iterations; ++i) {
      while (armed.load(std::memory_order_acquire) < i) base::CpuRelax();
      for (;;) {
        auto ready = event->Query();
        if (!ready.ok()) {
          failed = true;
          break;
        }
        if (*ready) break;
        base::CpuRelax();
      }
      seen[i] = Clock::now();
      finished.store(i, std::memory_order_release);
    }
  });
  std::vector<double> micros;
  for (int i = 0; i < iterations && !failed; ++i) {
    const Clock::time_point start = Clock::now();
    if (!event->Record(*stream).ok()) {
      failed = true;
      armed.store(iterations);
      break;
    }
    armed.store(i, std::memory_order_release);
    while (finished.load(std::memory_order_acquire) < i && !failed) base::CpuRelax();
    micros.push_back(Micros(start, seen[i]));
  }
  armed.store(iterations);
  poller.join();
  if (failed) return 1;
  Report(mode == ReadyEventMode::kCopyEngineFlag ? "ready: record->seen (copy-engine)"
                                                 : "ready: record->seen (cuda-event)",
         micros);
  return 0;
}

// Times how fast a stream resumes: `enqueue(i)` queues on `stream` a wait
// that storing i into `release` ends, then a signal of i on `ack`. Once the
// wait has reached the GPU (200 us, so the release is timed and not the
// launch), one sample is the time from the store to the ack. Empty when a
// call failed.
std::optional<std::vector<double>> TimeResumes(Stream& stream, HostFlag& release, HostFlag& ack,
                                               int iterations,
                                               const std::function<bool(uint32_t)>& enqueue) {
  std::vector<double> micros;
  for (uint32_t i = 1; i <= static_cast<uint32_t>(iterations); ++i) {
    if (!enqueue(i)) return std::nullopt;
    absl::SleepFor(absl::Microseconds(200));
    const Clock::time_point start = Clock::now();
    release.Store(i);
    while (ack.Load() != i) base::CpuRelax();
    micros.push_back(Micros(start, Clock::now()));
  }
  if (!stream.Synchronize(absl::Seconds(10)).ok()) return std::nullopt;
  return micros;
}

int ResumeLatency(int device, StreamWaitMode mode, int iterations) {
  CudaBackendOptions options;
  options.stream_wait_mode = mode;
  auto backend = CreateCudaBackend(device, options);
  if (!backend.ok()) return 1;
  auto stream = *(*backend)->CreateStream();
  auto gate = *(*backend)->CreateHostFlag();
  auto ack = *(*backend)->CreateHostFlag();
  auto micros = TimeResumes(*stream, *gate, *ack, iterations, [&](uint32_t i) {
    return stream->WaitHostFlag(*gate, i).ok() && stream->SignalHostFlag(*ack, i).ok();
  });
  if (!micros) return 1;
  Report(mode == StreamWaitMode::kKernel ? "resume: flag->stream (wait kernel)"
                                         : "resume: flag->stream (memop)",
         *micros);
  return 0;
}

int NextLatency(int device, int iterations) {
  auto backend = CreateCudaBackend(device, {});
  if (!backend.ok()) return 1;
  auto stream = *(*backend)->CreateStream();
  auto counter = *(*backend)->CreateHostFlag();
  auto cursor = *(*backend)->CreateHostFlag();
  auto ack = *(*backend)->CreateHostFlag();
  auto micros = TimeResumes(*stream, *counter, *ack, iterations, [&](uint32_t i) {
    return stream->WaitHostFlagNext(*counter, *cursor).ok() && stream->SignalHostFlag(*ack, i).ok();
  });
  if (!micros) return 1;
  Report("resume: counter->stream (wait-next)", *micros);
  return 0;
}

// The backend's synchronous copy against the baseline it replaced, device to
// pinned host (what the send thread does when it stages a push).
int CopyLatency(int device, size_t bytes, int iterations) {
  auto backend = CreateCudaBackend(device, {});
  if (!backend.ok()) return 1;
  auto source = *(*backend)->Allocate(bytes, MemoryKind::kDevice);
  auto target = *(*backend)->Allocate(bytes, MemoryKind::kHostPinned);
  if (cudaSetDevice(device) != cudaSuccess) return 1;
  std::vector<double> ours, baseline;
  for (int i = 0; i < iterations; ++i) {
    Clock::time_point start = Clock::now();
    if (!(*backend)->Copy(target->data(), source->data(), bytes).ok()) return 1;
    ours.push_back(Micros(start, Clock::now()));
    start = Clock::now();
    if (cudaMemcpy(target->data(), source->data(), bytes, cudaMemcpyDefault) != cudaSuccess) {
      return 1;
    }
    baseline.push_back(Micros(start, Clock::now()));
  }
  const std::string size = bytes >= (1 << 20) ? std::to_string(bytes >> 20) + " MiB"
                                              : std::to_string(bytes >> 10) + " KiB";
  Report(("copy " + size + ": Backend::Copy").c_str(), ours);
  Report(("copy " + size + ": cudaMemcpy (baseline)").c_str(), baseline);
  std::printf("copy %s: p50 ratio Backend::Copy / cudaMemcpy = %.2f\n", size.c_str(),
              ours[ours.size() / 2] / baseline[baseline.size() / 2]);
  return 0;
}

}  // namespace
}  // namespace stepmesh

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::max(10, std::atoi(argv[1])) : 2000;
  const int device = argc > 2 ? std::atoi(argv[2]) : 0;
  auto probe = stepmesh::CreateCudaBackend(device);
  if (!probe.ok()) {
    std::fprintf(stderr, "cuda_latency: %s; skipping\n", probe.status().ToString().c_str());
    return probe.status().code() == absl::StatusCode::kUnavailable ? 77 : 1;
  }
  probe->reset();
  int rc = 0;
  rc |= stepmesh::ReadyLatency(device, stepmesh::ReadyEventMode::kCopyEngineFlag, iterations);
  rc |= stepmesh::ReadyLatency(device, stepmesh::ReadyEventMode::kCudaEvent, iterations);
  rc |= stepmesh::ResumeLatency(device, stepmesh::StreamWaitMode::kStreamMemOp, iterations);
  rc |= stepmesh::ResumeLatency(device, stepmesh::StreamWaitMode::kKernel, iterations);
  rc |= stepmesh::NextLatency(device, iterations);
  rc |= stepmesh::CopyLatency(device, size_t{4} << 10, iterations);
  rc |= stepmesh::CopyLatency(device, size_t{1} << 20, iterations);
  return rc;
}
