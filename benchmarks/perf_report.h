#pragma once
// Statistics, CPU accounting, machine facts and the table/JSON output of
// stepmesh_perf. Kept apart from the measuring code so the report format is
// one place (docs/benchmarks.md describes every column).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace stepmesh::bench {

// Latency statistics of one sample set, in microseconds. Percentiles are
// nearest-rank on the sorted samples (as perftest and nccl-tests -I do).
struct LatencyStats {
  size_t count = 0;
  double min_us = 0, p50_us = 0, p99_us = 0, p999_us = 0, max_us = 0, mean_us = 0, stdev_us = 0;
};
LatencyStats ComputeStats(std::vector<uint64_t> samples_ns);

// CPU time consumed so far: the whole process (every thread: the library's
// send/receive threads, ZeroMQ's I/O thread) and the calling thread alone.
struct CpuClock {
  uint64_t process_ns = 0;
  uint64_t thread_ns = 0;
};
CpuClock CpuNow();

struct MachineInfo {
  std::string cpu_model;
  int online_cores = 0;
  int allowed_cores = 0;  // sched_getaffinity: what this process may use
  std::string kernel;
  std::string hostname;
  double load_average_1m = 0;
};
MachineInfo GetMachineInfo();

// One method (ours or a baseline) at one size.
struct MethodResult {
  std::string method;  // "stepmesh", "raw-tcp", "zmq", "memcpy"
  bool available = true;
  std::string note;  // why unavailable, or a caveat
  LatencyStats stats;
  double goodput_gbps = 0;            // bytes this worker moved per iteration / mean latency
  double cpu_us_per_iter = 0;         // process CPU (all threads) per iteration
  double thread_cpu_us_per_iter = 0;  // the calling thread's CPU per iteration
  // ours ÷ this method (filled for baselines only; 0 when not applicable).
  double ratio_p50 = 0;
  double ratio_p99 = 0;
  // p50 of each interleaved repetition alone, and for baselines the ratio
  // ours ÷ this method per repetition: its median resists load that drifts
  // between repetitions (perf_anchors.md §8: medians of the repetitions).
  std::vector<double> rep_p50_us;
  double rep_ratio_p50_median = 0, rep_ratio_p50_min = 0, rep_ratio_p50_max = 0;
};

struct SizeResult {
  size_t push_bytes = 0;              // per server
  size_t pull_bytes = 0;              // per server
  std::vector<MethodResult> methods;  // methods[0] is ours
  // Software overhead of ours over the raw-socket floor for the same bytes,
  // per iteration ("per layer" in the AFD patterns); NaN-free: 0 when no raw-tcp.
  bool has_overhead = false;
  double overhead_p50_us = 0;
  double overhead_mean_us = 0;
  double overhead_p50_pct = 0;  // of the raw p50
  // Where ours spends a request (one host only; see kStageNames in perf_roles.cc).
  struct Stage {
    std::string name;
    double p50_us = 0, p99_us = 0, mean_us = 0;
  };
  std::vector<Stage> stages;
};

struct RunInfo {
  std::string command_line;
  std::string pattern;
  int workers = 1;
  int servers = 1;
  std::string transport;
  std::string backend;
  std::string poll_mode;
  int micro_batches = 1;
  int warmup = 0;
  int iters = 0;
  int reps = 1;
  bool processes = true;
};

// Fills ratio_* of every baseline and the overhead against "raw-tcp".
void DeriveRatios(SizeResult& result);

void PrintHeader(const RunInfo& run, const MachineInfo& machine);
void PrintSizeTable(const SizeResult& result);
absl::Status WriteJson(const std::string& path, const RunInfo& run, const MachineInfo& machine,
                       const std::vector<SizeResult>& results);

}  // namespace stepmesh::bench
