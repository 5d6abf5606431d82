#include "src/core/chrome_trace.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"

namespace stepmesh::core {
namespace {

// One "X" (complete) event before it gets its thread.
struct Span {
  int stage = 0;
  uint64_t begin_ns = 0;  // local clock
  uint64_t end_ns = 0;
  std::string name;
  std::string args;  // a JSON object
};

// Local CLOCK_MONOTONIC nanoseconds -> the scheduler's, in the microseconds
// Chrome's "ts" counts, printed exactly (no double rounding of ~1e15 ns).
std::string Micros(int64_t ns) {
  const bool negative = ns < 0;
  const uint64_t abs_ns = negative ? static_cast<uint64_t>(-ns) : static_cast<uint64_t>(ns);
  return absl::StrFormat("%s%u.%03u", negative ? "-" : "", abs_ns / 1000, abs_ns % 1000);
}

std::string Hex(uint64_t v) { return absl::StrFormat("\"0x%x\"", v); }

// A thread per stage; requests in flight together overlap, and a Chrome
// thread's slices must nest, so each stage spreads its spans over lanes (the
// first lane free at the span's start), each lane a thread of its own.
void AppendSpans(std::string& json, int pid, std::vector<Span>& spans,
                 absl::Span<const absl::string_view> stage_names, int64_t offset_ns) {
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.stage != b.stage ? a.stage < b.stage : a.begin_ns < b.begin_ns;
  });
  std::vector<std::vector<uint64_t>> lane_ends(stage_names.size());
  for (const Span& s : spans) {
    std::vector<uint64_t>& ends = lane_ends[s.stage];
    size_t lane = 0;
    while (lane < ends.size() && ends[lane] > s.begin_ns) ++lane;
    if (lane == ends.size()) ends.push_back(0);
    ends[lane] = s.end_ns;
    // Lanes past 999 (that many requests overlapping) share the last one.
    const int tid = 1 + s.stage * 1000 + static_cast<int>(std::min<size_t>(lane, 999));
    absl::StrAppend(&json, ",\n{\"name\":\"", s.name, "\",\"ph\":\"X\",\"pid\":", pid,
                    ",\"tid\":", tid,
                    ",\"ts\":", Micros(static_cast<int64_t>(s.begin_ns) + offset_ns),
                    ",\"dur\":", Micros(static_cast<int64_t>(s.end_ns - s.begin_ns)),
                    ",\"args\":", s.args, "}");
  }
  for (size_t stage = 0; stage < lane_ends.size(); ++stage) {
    for (size_t lane = 0; lane < std::min<size_t>(lane_ends[stage].size(), 1000); ++lane) {
      const int tid = 1 + static_cast<int>(stage) * 1000 + static_cast<int>(lane);
      const std::string name = lane == 0 ? std::string(stage_names[stage])
                                         : absl::StrCat(stage_names[stage], " #", lane + 1);
      absl::StrAppend(&json, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", pid,
                      ",\"tid\":", tid, ",\"args\":{\"name\":\"", name, "\"}}",
                      ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":", pid,
                      ",\"tid\":", tid, ",\"args\":{\"sort_index\":", tid, "}}");
    }
  }
}

// Spans are kept only when both stamps were taken and in order.
bool Valid(uint64_t begin_ns, uint64_t end_ns) { return begin_ns != 0 && end_ns >= begin_ns; }

void WorkerSpans(const TraceRing::Snapshot& records, int num_servers, int rank,
                 std::vector<Span>& spans) {
  using W = WorkerTraceWords;
  for (size_t i = 0; i < records.size(); ++i) {
    const uint64_t* r = records.record(i);
    const std::string id = Hex(r[W::kRequestId]);
    int addressed = 0;
    for (int s = 0; s < num_servers; ++s) {
      const uint64_t* p = r + W::kFirstServer + W::kPerServer * s;
      if (p[W::kAddressed] == 0) continue;
      ++addressed;
      const std::string args =
          absl::StrCat("{\"request\":", id, ",\"worker\":", rank, ",\"server\":", s, "}");
      if (Valid(r[W::kEnqueue], p[W::kPost])) {
        spans.push_back({1, r[W::kEnqueue], p[W::kPost], absl::StrCat("submit s", s), args});
      }
      if (Valid(p[W::kPost], p[W::kReplyArrival])) {
        spans.push_back(
            {2, p[W::kPost], p[W::kReplyArrival], absl::StrCat("round trip s", s), args});
      }
    }
    if (Valid(r[W::kEnqueue], r[W::kComplete])) {
      spans.push_back({0, r[W::kEnqueue], r[W::kComplete], "request",
                       absl::StrCat("{\"request\":", id, ",\"worker\":", rank,
                                    ",\"servers\":", addressed, "}")});
    }
  }
}

void ServerSpans(const TraceRing::Snapshot& records, int rank, std::vector<Span>& spans) {
  using S = ServerTraceWords;
  for (size_t i = 0; i < records.size(); ++i) {
    const uint64_t* r = records.record(i);
    const std::string args =
        absl::StrCat("{\"request\":", Hex(r[S::kRequestId]), ",\"worker\":", r[S::kWorker],
                     ",\"server\":", rank, ",\"status\":", r[S::kCode], "}");
    if (Valid(r[S::kArrival], r[S::kHandler])) {
      spans.push_back(
          {0, r[S::kArrival], r[S::kHandler], absl::StrCat("dispatch w", r[S::kWorker]), args});
    }
    if (Valid(r[S::kHandler], r[S::kReply])) {
      spans.push_back(
          {1, r[S::kHandler], r[S::kReply], absl::StrCat("respond w", r[S::kWorker]), args});
    }
  }
}

}  // namespace

std::string FormatChromeTrace(Role role, int rank, int num_peers,
                              const TraceRing::Snapshot& records, const ClockSync& clock,
                              uint64_t membership_epoch, absl::Span<const EpochMark> epochs) {
  const int pid = ChromeTraceProcessId(role, rank);
  const std::string participant = absl::StrCat(RoleName(role), " ", rank);
  std::string json = absl::StrCat(
      "{\"displayTimeUnit\":\"ns\",\n\"otherData\":{\"participant\":\"", participant,
      "\",\"pid\":", pid, ",\"clock_offset_ns\":", clock.offset_ns,
      ",\"clock_uncertainty_ns\":", clock.round_trip_ns / 2, ",\"capacity\":", records.capacity,
      ",\"recorded\":", records.recorded, ",\"exported\":", records.size(),
      ",\"dropped\":", records.dropped, ",\"membership_epoch\":", membership_epoch,
      "},\n\"traceEvents\":[\n", "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", pid,
      ",\"args\":{\"name\":\"", participant,
      "\"}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":", pid,
      ",\"args\":{\"sort_index\":", pid, "}}");
  for (const EpochMark& m : epochs) {
    absl::StrAppend(&json, ",\n{\"name\":\"membership epoch ", m.epoch,
                    "\",\"ph\":\"i\",\"s\":\"p\",\"pid\":", pid,
                    ",\"tid\":0,\"ts\":", Micros(static_cast<int64_t>(m.at_ns) + clock.offset_ns),
                    ",\"args\":{\"epoch\":", m.epoch, ",\"workers\":", m.workers,
                    ",\"servers\":", m.servers, "}}");
  }
  std::vector<Span> spans;
  spans.reserve(records.size() * 3);
  if (role == Role::kWorker) {
    WorkerSpans(records, num_peers, rank, spans);
    static constexpr absl::string_view kStages[] = {"request", "submit", "round trip"};
    AppendSpans(json, pid, spans, kStages, clock.offset_ns);
  } else {
    ServerSpans(records, rank, spans);
    static constexpr absl::string_view kStages[] = {"dispatch", "respond"};
    AppendSpans(json, pid, spans, kStages, clock.offset_ns);
  }
  json += "\n]}\n";
  return json;
}

absl::Status WriteTextFile(const std::string& path, absl::string_view text) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "w"), &std::fclose);
  if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  if (std::fwrite(text.data(), 1, text.size(), f.get()) != text.size()) {
    return absl::DataLossError(absl::StrCat("short write to ", path));
  }
  if (std::fclose(f.release()) != 0) {
    return absl::DataLossError(absl::StrCat("cannot close ", path));
  }
  return absl::OkStatus();
}

}  // namespace stepmesh::core

namespace stepmesh {

int ChromeTraceProcessId(Role role, int rank) {
  return role == Role::kServer ? 1000001 + rank : 1 + rank;
}

}  // namespace stepmesh
