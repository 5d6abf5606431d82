// The trace recorder: a 2A2F mesh's exports merged into one Chrome trace,
// parsed back as JSON (a parser of the test's own, not the library's merge
// scanner) and checked for well-formed events, every request on both ends and
// worker push -> server arrival -> reply in order on the scheduler's clock;
// the ring keeps the newest N and counts the rest; recording off is an error.

#include <atomic>
#include <catch2/catch.hpp>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "src/compose/transports.h"
#include "src/core/chrome_trace.h"
#include "src/core/membership_view.h"
#include "src/core/trace_ring.h"
#include "stepmesh/server.h"
#include "stepmesh/trace.h"
#include "stepmesh/worker.h"
#include "tests/support/answering_servers.h"
#include "tests/support/loopback_mesh.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

// --- a small JSON parser (RFC 8259 without \u escapes beyond ASCII) ---
struct Json;
using JsonObject = std::map<std::string, Json>;
using JsonArray = std::vector<Json>;
struct Json {
  std::variant<std::nullptr_t, bool, double, std::string, JsonArray, JsonObject> v;
  bool is_object() const { return std::holds_alternative<JsonObject>(v); }
  const JsonObject& object() const { return std::get<JsonObject>(v); }
  const JsonArray& array() const { return std::get<JsonArray>(v); }
  const std::string& str() const { return std::get<std::string>(v); }
  double num() const { return std::get<double>(v); }
  bool has(const std::string& key) const { return is_object() && object().count(key) == 1; }
  const Json& operator[](const std::string& key) const { return object().at(key); }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : t_(text) {}
  Json Parse() {
    Json j = Value();
    Space();
    REQUIRE(i_ == t_.size());
    return j;
  }

 private:
  void Space() {
    while (i_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[i_]))) ++i_;
  }
  char Peek() {
    Space();
    REQUIRE(i_ < t_.size());
    return t_[i_];
  }
  void Eat(char c) {
    INFO("at byte " << i_);
    REQUIRE(Peek() == c);
    ++i_;
  }
  std::string String() {
    Eat('"');
    std::string out;
    while (true) {
      REQUIRE(i_ < t_.size());
      const char c = t_[i_++];
      if (c == '"') return out;
      REQUIRE(static_cast<unsigned char>(c) >= 0x20);
      if (c != '\\') {
        out += c;
        continue;
      }
      REQUIRE(i_ < t_.size());
      const char e = t_[i_++];
      const std::string simple = "\"\\/bfnrt";
      REQUIRE((simple.find(e) != std::string::npos || e == 'u'));
      out += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      if (e == 'u') i_ += 4;
    }
  }
  // The items after an opening bracket just eaten, each read by `item`, up to
  // the closing `close`.
  template <typename ReadItem>
  void Items(char close, ReadItem item) {
    if (Peek() == close) {
      ++i_;
      return;
    }
    while (true) {
      item();
      if (Peek() != ',') break;
      ++i_;
    }
    Eat(close);
  }
  Json Value() {
    const char c = Peek();
    if (c == '{') {
      ++i_;
      JsonObject o;
      Items('}', [&] {
        std::string key = String();
        Eat(':');
        INFO("key " << key);
        REQUIRE(o.count(key) == 0);
        o[key] = Value();
      });
      return {o};
    }
    if (c == '[') {
      ++i_;
      JsonArray a;
      Items(']', [&] { a.push_back(Value()); });
      return {a};
    }
    if (c == '"') return {String()};
    for (const char* lit : {"true", "false", "null"}) {
      if (t_.compare(i_, std::strlen(lit), lit) == 0) {
        i_ += std::strlen(lit);
        if (lit[0] == 'n') return {nullptr};
        return {lit[0] == 't'};
      }
    }
    size_t used = 0;
    const double d = std::stod(t_.substr(i_, 32), &used);
    REQUIRE(used > 0);
    i_ += used;
    return {d};
  }

  const std::string& t_;
  size_t i_ = 0;
};

Json ParseJson(const std::string& text) { return Parser(text).Parse(); }

std::string IdOf(RequestHandle h) {
  return absl::StrFormat("0x%x", (uint64_t{h.index()} << 32) | h.generation());
}

// One participant's recorded request, from the merged trace.
struct Seen {
  double begin_us = 0, end_us = 0;
};

// Every event well-formed; returns the X events by name prefix and (pid,
// request, peer), and the clock uncertainty (us) of each pid.
struct Merged {
  std::map<int, std::string> process_names;
  std::map<std::pair<int, int>, std::string> thread_names;
  // [pid][stage name][(request, peer)]
  std::map<int, std::map<std::string, std::map<std::pair<std::string, int>, Seen>>> spans;
  std::map<int, double> uncertainty_us;
  // [pid] the membership epochs its instant events mark, in order, and their ts
  std::map<int, std::vector<std::pair<int, double>>> epochs;
};

Merged Check(const Json& trace) {
  Merged m;
  REQUIRE(trace.is_object());
  REQUIRE(trace.has("traceEvents"));
  for (const Json& info : trace["otherData"]["participants"].array()) {
    m.uncertainty_us[static_cast<int>(info["pid"].num())] =
        info["clock_uncertainty_ns"].num() / 1e3;
  }
  std::vector<const Json*> xs;
  for (const Json& e : trace["traceEvents"].array()) {
    REQUIRE(e.has("ph"));
    REQUIRE(e.has("pid"));
    REQUIRE(e.has("name"));
    const std::string& ph = e["ph"].str();
    const int pid = static_cast<int>(e["pid"].num());
    if (ph == "M") {
      if (e["name"].str() == "process_name") m.process_names[pid] = e["args"]["name"].str();
      if (e["name"].str() == "thread_name") {
        m.thread_names[{pid, static_cast<int>(e["tid"].num())}] = e["args"]["name"].str();
      }
      continue;
    }
    if (ph == "i") {  // a membership change (docs/elastic.md)
      REQUIRE(absl::StartsWith(e["name"].str(), "membership epoch "));
      REQUIRE(e["s"].str() == "p");
      REQUIRE(e["ts"].num() > 0);
      m.epochs[pid].push_back({static_cast<int>(e["args"]["epoch"].num()), e["ts"].num()});
      continue;
    }
    REQUIRE(ph == "X");
    REQUIRE(e.has("tid"));
    REQUIRE(e["ts"].num() > 0);
    REQUIRE(e["dur"].num() >= 0);
    xs.push_back(&e);
  }
  for (const Json* e : xs) {
    const int pid = static_cast<int>((*e)["pid"].num());
    const int tid = static_cast<int>((*e)["tid"].num());
    REQUIRE(m.process_names.count(pid) == 1);
    REQUIRE(m.thread_names.count({pid, tid}) == 1);
    const std::string& name = (*e)["name"].str();
    const Json& args = (*e)["args"];
    const bool on_server = absl::StartsWith(m.process_names[pid], "server");
    const int peer = args.has("server") && !on_server ? static_cast<int>(args["server"].num())
                                                      : static_cast<int>(args["worker"].num());
    const std::string stage = name.substr(0, name.find_last_of(' '));
    const double ts = (*e)["ts"].num();
    m.spans[pid][name == "request" ? "request" : stage][{args["request"].str(), peer}] = {
        ts, ts + (*e)["dur"].num()};
  }
  return m;
}

constexpr Key kPush = 1, kPull = 2;
constexpr size_t kBytes = 256;

TEST_CASE("2A2F: each participant's trace export, merged, lines up on the scheduler's clock",
          "[trace][tcp]") {
  constexpr int kWorkers = 2, kServers = 2, kRounds = 12;
  MeshOptions base;
  base.transport = "tcp";
  base.num_workers = kWorkers;
  base.num_servers = kServers;
  base.timeout = absl::Seconds(60);
  base.trace.events = 64;
  testing::MeshBuffers buffers(kWorkers, kServers, kBytes);
  auto mesh = testing::LoopbackMesh::Start(base, compose::CreateTransport);
  REQUIRE_OK(mesh);
  const Shape shape{kWorkers, kBytes};
  for (int s = 0; s < kServers; ++s) {
    AFTensorServer& server = (*mesh)->server(s);
    REQUIRE_OK(server.RegisterRecvTensor(kPush, {buffers.recv[s].data(), DType::kUInt8, shape}));
    REQUIRE_OK(server.RegisterReplyTensor(kPull, {buffers.reply[s].data(), DType::kUInt8, shape}));
  }
  for (int w = 0; w < kWorkers; ++w) {
    AFTensorWorker& worker = (*mesh)->worker(w);
    REQUIRE_OK(worker.RegisterPushTensor(kPush, BytesView(buffers.push[w].data(), kBytes)));
    for (int s = 0; s < kServers; ++s) {
      REQUIRE_OK(worker.RegisterPullTensor(
          kPull, s, BytesView(buffers.pull[w * kServers + s].data(), kBytes)));
    }
  }

  testing::AnsweringServers servers(**mesh, {Reply{0}, Reply{1}});
  std::atomic<int> failures{0};
  std::vector<std::set<std::string>> issued(kWorkers);
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      AFTensorWorker& worker = (*mesh)->worker(w);
      const Push p{kPush};
      const Pull pulls[kServers] = {{kPull, 0}, {kPull, 1}};
      for (int i = 0; i < kRounds; ++i) {
        absl::StatusOr<RequestHandle> h = worker.PushPull({&p, 1}, pulls);
        if (!h.ok() || !worker.Wait(*h, absl::Seconds(60)).ok()) {
          failures.fetch_add(1);
          return;
        }
        issued[w].insert(IdOf(*h));
      }
    });
  }
  for (std::thread& t : workers) t.join();
  // A server records a reply after its Send returned, which may be just after
  // the worker saw it: wait (bounded) for the servers' counts.
  const auto recorded = [&](int s) {
    absl::StatusOr<std::string> json = (*mesh)->server(s).ChromeTraceJson();
    return json.ok() ? static_cast<int>(ParseJson(*json)["otherData"]["exported"].num()) : -1;
  };
  const absl::Time settle = absl::Now() + absl::Seconds(30);
  while (absl::Now() < settle &&
         (recorded(0) < kWorkers * kRounds || recorded(1) < kWorkers * kRounds)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  servers.Stop();
  REQUIRE(failures.load() + servers.failed() == 0);

  std::vector<std::string> exports;
  for (int w = 0; w < kWorkers; ++w) {
    absl::StatusOr<std::string> json = (*mesh)->worker(w).ChromeTraceJson();
    REQUIRE_OK(json);
    exports.push_back(*json);
  }
  for (int s = 0; s < kServers; ++s) {
    absl::StatusOr<std::string> json = (*mesh)->server(s).ChromeTraceJson();
    REQUIRE_OK(json);
    exports.push_back(*json);
  }
  absl::StatusOr<std::string> merged = MergeChromeTraces(exports);
  REQUIRE_OK(merged);
  const Json trace = ParseJson(*merged);
  const Merged m = Check(trace);
  REQUIRE(trace["otherData"]["participants"].array().size() == 4);

  // One process per participant, named; a thread per stage.
  std::map<std::string, int> pid_of;
  for (const auto& [pid, name] : m.process_names) pid_of[name] = pid;
  REQUIRE(pid_of.size() == 4);
  for (const char* name : {"worker 0", "worker 1", "server 0", "server 1"}) {
    INFO(name);
    REQUIRE(pid_of.count(name) == 1);
    REQUIRE(m.uncertainty_us.count(pid_of[name]) == 1);
    // The roster's epoch (0) marked once: nobody joined or left since.
    REQUIRE(m.epochs.count(pid_of[name]) == 1);
    REQUIRE(m.epochs.at(pid_of[name]).size() == 1);
    CHECK(m.epochs.at(pid_of[name])[0].first == 0);
  }
  std::set<std::string> thread_names;
  for (const auto& [key, name] : m.thread_names) thread_names.insert(name);
  for (const char* stage : {"request", "submit", "round trip", "dispatch", "respond"}) {
    CHECK(thread_names.count(stage) == 1);
  }

  for (int w = 0; w < kWorkers; ++w) {
    const int wpid = pid_of[absl::StrCat("worker ", w)];
    const auto& wspans = m.spans.at(wpid);
    REQUIRE(issued[w].size() == kRounds);
    for (const std::string& id : issued[w]) {
      INFO("worker " << w << " request " << id);
      const Seen whole = wspans.at("request").at({id, w});
      for (int s = 0; s < kServers; ++s) {
        INFO("server " << s);
        const int spid = pid_of[absl::StrCat("server ", s)];
        const auto& sspans = m.spans.at(spid);
        // Present on both ends.
        REQUIRE(wspans.at("submit").count({id, s}) == 1);
        REQUIRE(wspans.at("round trip").count({id, s}) == 1);
        REQUIRE(sspans.at("dispatch").count({id, w}) == 1);
        REQUIRE(sspans.at("respond").count({id, w}) == 1);
        const Seen round_trip = wspans.at("round trip").at({id, s});
        const Seen dispatch = sspans.at("dispatch").at({id, w});
        const Seen respond = sspans.at("respond").at({id, w});
        // Worker stamps in order on its own clock.
        CHECK(whole.begin_us <= wspans.at("submit").at({id, s}).begin_us);
        CHECK(round_trip.end_us <= whole.end_us);
        // Across processes: each participant's clock is known to within its
        // uncertainty (half its best round trip to the scheduler), so the two
        // ends may disagree by the sum (+1 ns of printing).
        const double slack = m.uncertainty_us.at(wpid) + m.uncertainty_us.at(spid) + 1e-3;
        CHECK(round_trip.begin_us <= dispatch.begin_us + slack);  // posted before it arrived
        CHECK(dispatch.end_us <= respond.begin_us + 1e-3);        // one host: exact
        CHECK(respond.end_us <= round_trip.end_us + slack);       // replied before it landed
      }
    }
    // Nothing recorded that the worker did not issue.
    CHECK(wspans.at("request").size() == kRounds);
  }
  for (int s = 0; s < kServers; ++s) {
    CHECK(m.spans.at(pid_of[absl::StrCat("server ", s)]).at("dispatch").size() ==
          kWorkers * kRounds);
  }

  // A participant in two inputs, or an input that is not a trace: refused.
  CHECK_STATUS(MergeChromeTraces({exports[0], exports[1], exports[0]}), kInvalidArgument);
  absl::StatusOr<std::string> bad = MergeChromeTraces({exports[0], "{\"traceEvents\":[1,}"});
  CHECK_STATUS(bad, kInvalidArgument);
  CHECK(absl::StrContains(bad.status().message(), "trace 1"));
  // A merged file merges again (with the rest of a mesh).
  absl::StatusOr<std::string> two = MergeChromeTraces({exports[0], exports[2]});
  REQUIRE_OK(two);
  absl::StatusOr<std::string> again = MergeChromeTraces({*two, exports[1], exports[3]});
  REQUIRE_OK(again);
  CHECK(ParseJson(*again)["traceEvents"].array().size() == trace["traceEvents"].array().size());
}

TEST_CASE("membership epochs: each change a participant applied is an instant event at its time",
          "[trace][membership]") {
  core::MembershipView view;
  view.Reset({{core::WorkerId(0), "w0"}, {core::ServerId(0), "s0"}}, 4);
  const uint64_t before = MonotonicNowNs();
  core::MembershipEvent joined;
  joined.kind = core::MembershipEvent::Kind::kJoined;
  joined.node = core::WorkerId(1);
  joined.epoch = 5;
  view.Apply(joined);
  joined.epoch = 5;  // the same epoch again (a replay): no second mark
  view.Apply(joined);
  core::MembershipEvent left;
  left.kind = core::MembershipEvent::Kind::kLeft;
  left.node = core::ServerId(0);
  left.epoch = 7;
  view.Apply(left);
  const std::vector<core::EpochMark> marks = view.Marks();
  REQUIRE(marks.size() == 3);
  CHECK(marks[0].epoch == 4);
  CHECK(marks[1].epoch == 5);
  CHECK(marks[1].workers == 2);
  CHECK(marks[1].servers == 1);
  CHECK(marks[1].at_ns >= before);
  CHECK(marks[2].epoch == 7);
  CHECK(marks[2].servers == 0);
  CHECK(marks[2].at_ns >= marks[1].at_ns);

  // On the scheduler's clock, exactly: ts = (at + offset) / 1000 us.
  ClockSync clock;
  clock.offset_ns = 2500;
  const core::EpochMark exact[] = {{1'000'000, 4, 1, 1}, {3'000'500, 5, 2, 1}};
  core::TraceRing ring(4, core::WorkerTraceWords::Words(1));
  const std::string json = core::FormatChromeTrace(Role::kWorker, 0, 1, ring.Copy(), clock,
                                                   /*membership_epoch=*/5, exact);
  const Json trace = ParseJson(json);
  std::vector<std::pair<double, double>> seen;  // epoch, ts
  for (const Json& e : trace["traceEvents"].array()) {
    if (e["ph"].str() != "i") continue;
    CHECK(e["name"].str() == absl::StrCat("membership epoch ", e["args"]["epoch"].num()));
    seen.push_back({e["args"]["epoch"].num(), e["ts"].num()});
  }
  REQUIRE(seen.size() == 2);
  CHECK(seen[0] == std::pair<double, double>{4, 1002.5});
  CHECK(seen[1] == std::pair<double, double>{5, 3003.0});
  CHECK(trace["otherData"]["membership_epoch"].num() == 5);
}

TEST_CASE("the trace ring keeps the newest N requests and counts the dropped", "[trace][tcp]") {
  constexpr int kKeep = 4, kRounds = 11;
  MeshOptions base;
  base.transport = "tcp";
  base.timeout = absl::Seconds(60);
  base.trace.events = kKeep;
  std::vector<uint8_t> recv(kBytes), reply(kBytes), push(kBytes), pull(kBytes);
  auto mesh = testing::LoopbackMesh::Start(base, compose::CreateTransport);
  REQUIRE_OK(mesh);
  AFTensorWorker& worker = (*mesh)->worker(0);
  AFTensorServer& server = (*mesh)->server(0);
  REQUIRE_OK(server.RegisterRecvTensor(kPush, BytesView(recv.data(), kBytes)));
  REQUIRE_OK(server.RegisterReplyTensor(kPull, BytesView(reply.data(), kBytes)));
  REQUIRE_OK(worker.RegisterPushTensor(kPush, BytesView(push.data(), kBytes)));
  REQUIRE_OK(worker.RegisterPullTensor(kPull, 0, BytesView(pull.data(), kBytes)));
  std::vector<std::string> ids;
  const Push p{kPush};
  const Pull pl{kPull, 0};
  for (int i = 0; i < kRounds; ++i) {
    absl::StatusOr<RequestHandle> h = worker.PushPull({&p, 1}, {&pl, 1});
    REQUIRE_OK(h);
    absl::StatusOr<Batch> batch = server.GetBatch(absl::Seconds(30));
    REQUIRE_OK(batch);
    const Reply r{0};
    REQUIRE_OK(server.Respond(*batch, {&r, 1}));
    REQUIRE_OK(worker.Wait(*h, absl::Seconds(30)));
    ids.push_back(IdOf(*h));
  }
  const std::set<std::string> newest(ids.end() - kKeep, ids.end());
  absl::StatusOr<std::string> wjson = worker.ChromeTraceJson();
  REQUIRE_OK(wjson);
  const Json wt = ParseJson(*wjson);
  CHECK(wt["otherData"]["capacity"].num() == kKeep);
  CHECK(wt["otherData"]["recorded"].num() == kRounds);
  CHECK(wt["otherData"]["exported"].num() == kKeep);
  CHECK(wt["otherData"]["dropped"].num() == kRounds - kKeep);
  std::set<std::string> kept;
  for (const Json& e : wt["traceEvents"].array()) {
    if (e["ph"].str() == "X" && e["name"].str() == "request")
      kept.insert(e["args"]["request"].str());
  }
  CHECK(kept == newest);

  // The server's last record follows its Send: wait (bounded) for it.
  Json st;
  const absl::Time settle = absl::Now() + absl::Seconds(30);
  do {
    absl::StatusOr<std::string> sjson = server.ChromeTraceJson();
    REQUIRE_OK(sjson);
    st = ParseJson(*sjson);
  } while (st["otherData"]["recorded"].num() < kRounds && absl::Now() < settle &&
           (absl::SleepFor(absl::Milliseconds(5)), true));
  CHECK(st["otherData"]["recorded"].num() == kRounds);
  CHECK(st["otherData"]["dropped"].num() == kRounds - kKeep);
  std::set<std::string> served;
  for (const Json& e : st["traceEvents"].array()) {
    if (e["ph"].str() == "X" && absl::StartsWith(e["name"].str(), "dispatch")) {
      served.insert(e["args"]["request"].str());
    }
  }
  CHECK(served == newest);

  // Exported after Shutdown: on the clock estimate taken before leaving.
  REQUIRE_OK(worker.Shutdown());
  absl::StatusOr<std::string> after = worker.ChromeTraceJson();
  REQUIRE_OK(after);
  CHECK(ParseJson(*after)["otherData"]["exported"].num() == kKeep);
}

TEST_CASE("trace recording off: the export says how to turn it on", "[trace][tcp]") {
  MeshOptions base;
  base.transport = "tcp";
  base.timeout = absl::Seconds(60);
  auto mesh = testing::LoopbackMesh::Start(base, compose::CreateTransport);
  REQUIRE_OK(mesh);
  absl::StatusOr<std::string> w = (*mesh)->worker(0).ChromeTraceJson();
  CHECK_STATUS(w, kFailedPrecondition);
  CHECK(absl::StrContains(w.status().message(), "STEPMESH_TRACE_EVENTS"));
  CHECK_STATUS((*mesh)->server(0).ChromeTraceJson(), kFailedPrecondition);
  CHECK_STATUS((*mesh)->server(0).WriteChromeTrace("/nonexistent/x.json"), kFailedPrecondition);

  MeshOptions o;
  o.trace.events = -1;
  CHECK_STATUS(o.Validate(), kInvalidArgument);
  o.trace.events = 8;
  o.trace.enabled = false;
  absl::Status both = o.Validate();
  CHECK_STATUS(both, kInvalidArgument);
  CHECK(absl::StrContains(both.message(), "STEPMESH_TRACE"));
}

TEST_CASE("TraceRing: concurrent writers and a reader never see a torn record", "[trace]") {
  constexpr int kWriters = 3, kEach = 20000, kWords = 5;
  core::TraceRing ring(16, kWords);
  std::atomic<int> running{kWriters};
  std::vector<std::thread> writers;
  for (int t = 0; t < kWriters; ++t) {
    writers.emplace_back([&, t] {
      for (uint64_t i = 0; i < kEach; ++i) {
        const uint64_t x = (uint64_t(t) << 32) | i;
        ring.Record([&](const core::TraceRing::Writer& out) {
          for (int k = 0; k < kWords; ++k) out.Put(k, x * (k + 1));
        });
      }
      running.fetch_sub(1);
    });
  }
  int copies = 0;
  uint64_t torn = 0;
  auto check = [&](const core::TraceRing::Snapshot& s) {
    for (size_t r = 0; r < s.size(); ++r) {
      const uint64_t* w = s.record(r);
      for (int k = 0; k < kWords; ++k) torn += w[k] != w[0] * (k + 1);
    }
  };
  while (running.load() > 0 || copies == 0) {
    check(ring.Copy());
    ++copies;
  }
  for (std::thread& t : writers) t.join();
  const core::TraceRing::Snapshot last = ring.Copy();
  check(last);
  CHECK(torn == 0);
  CHECK(last.recorded == uint64_t{kWriters} * kEach);
  // Every slot holds one of the last 16 tickets unless a writer a whole ring
  // behind found its slot busy (then that record is dropped, and counted).
  CHECK(last.size() <= 16);
  CHECK(last.size() >= 15);
  CHECK(last.dropped == last.recorded - last.size());
}

}  // namespace
}  // namespace stepmesh
