// Trigger over cpu_mock graphs: a captured go increment posts once per
// replay, the done wait holds the stream until that post completed, and
// failures release the stream and reach the next host call.

#include "stepmesh/trigger.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "stepmesh/backend.h"

namespace stepmesh {
namespace {

// A stand-in transport: a post hands the send buffer to a peer thread that
// answers after `latency` with every byte + 1 in the receive buffer.
class EchoPeer {
 public:
  EchoPeer(const uint8_t* send, uint8_t* recv, size_t bytes, absl::Duration latency)
      : send_(send), recv_(recv), bytes_(bytes), latency_(latency) {
    thread_ = std::thread([this] { Run(); });
  }
  ~EchoPeer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    thread_.join();
  }
  TriggerTarget Target(std::string name) {
    TriggerTarget t;
    t.post = [this]() -> absl::StatusOr<RequestHandle> {
      std::lock_guard<std::mutex> lock(mu_);
      if (refuse_) return absl::UnavailableError("server 1 is lost");
      ++generation_;
      pending_.push_back(
          {generation_, absl::Now() + latency_, std::vector<uint8_t>(send_, send_ + bytes_)});
      return RequestHandle(0, generation_);
    };
    t.poll = [this](RequestHandle h) -> absl::StatusOr<bool> {
      std::lock_guard<std::mutex> lock(mu_);
      if (h.generation() > answered_) return false;
      return true;
    };
    t.name = std::move(name);
    return t;
  }
  void Refuse() {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_ = true;
  }
  void Stall() {
    std::lock_guard<std::mutex> lock(mu_);
    stall_ = true;
  }
  int posted() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(generation_);
  }

 private:
  struct Pending {
    uint32_t generation;
    absl::Time due;
    std::vector<uint8_t> data;
  };
  void Run() {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        if (!pending_.empty() && !stall_ && absl::Now() >= pending_.front().due) {
          for (size_t i = 0; i < bytes_; ++i) recv_[i] = pending_.front().data[i] + 1;
          answered_ = pending_.front().generation;
          pending_.pop_front();
        }
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }
  const uint8_t* send_;
  uint8_t* recv_;
  const size_t bytes_;
  const absl::Duration latency_;
  std::mutex mu_;
  std::deque<Pending> pending_;
  uint32_t generation_ = 0;
  uint32_t answered_ = 0;
  bool refuse_ = false;
  bool stall_ = false;
  bool stop_ = false;
  std::thread thread_;
};

struct Step {
  std::unique_ptr<StreamGraph> graph;
  Trigger::Armed armed;
};

// Captures one send + receive: input -> send, go++, wait done >= go, recv -> output.
Step Capture(Stream& stream, Trigger& trigger, TriggerTarget target, uint8_t* input, uint8_t* send,
             uint8_t* recv, uint8_t* output, size_t bytes) {
  Step step;
  REQUIRE(stream.BeginCapture().ok());
  REQUIRE(stream.CopyAsync(send, input, bytes).ok());
  auto armed = trigger.Arm(std::move(target));
  REQUIRE(armed.ok());
  step.armed = *armed;
  REQUIRE(stream.IncrementCounter(armed->go).ok());
  REQUIRE(stream.WaitCounterAtLeast(armed->done, armed->go).ok());
  REQUIRE(stream.CopyAsync(output, recv, bytes).ok());
  auto graph = stream.EndCapture();
  REQUIRE(graph.ok());
  step.graph = *std::move(graph);
  return step;
}

constexpr size_t kBytes = 256;

// One step captured on a cpu_mock stream, posting to `target` of an echo peer
// that answers after 100 us, or never (`stall`).
struct CapturedStep {
  explicit CapturedStep(const char* target, TriggerOptions options = {}, bool stall = false)
      : peer(send.data(), recv.data(), kBytes, absl::Microseconds(100)) {
    if (stall) peer.Stall();
    trigger = *Trigger::Create(*backend, options);
    step = Capture(*stream, *trigger, peer.Target(target), input.data(), send.data(), recv.data(),
                   output.data(), kBytes);
  }
  std::unique_ptr<Backend> backend = CreateCpuMockBackend();
  std::unique_ptr<Stream> stream = *backend->CreateStream();
  std::vector<uint8_t> input = std::vector<uint8_t>(kBytes), send = std::vector<uint8_t>(kBytes),
                       recv = std::vector<uint8_t>(kBytes), output = std::vector<uint8_t>(kBytes);
  EchoPeer peer;
  std::unique_ptr<Trigger> trigger;
  Step step;
};

TEST_CASE("trigger: one capture, 100 replays, one post and the right bytes per replay",
          "[trigger]") {
  auto backend = CreateCpuMockBackend();
  auto stream = *backend->CreateStream();
  std::vector<uint8_t> input(kBytes), send(kBytes), recv(kBytes), output(kBytes);
  EchoPeer peer(send.data(), recv.data(), kBytes, absl::Microseconds(200));
  auto trigger = *Trigger::Create(*backend);
  CHECK(trigger->armed() == 0);
  Step step = Capture(*stream, *trigger, peer.Target("key 9 to server 0"), input.data(),
                      send.data(), recv.data(), output.data(), kBytes);
  CHECK(peer.posted() == 0);  // capturing posts nothing
  CHECK(trigger->armed() == 1);
  for (int r = 0; r < 100; ++r) {
    for (size_t i = 0; i < kBytes; ++i) input[i] = static_cast<uint8_t>(r * 3 + i);
    REQUIRE(step.graph->Launch(*stream).ok());
    REQUIRE(stream->Synchronize(absl::Seconds(5)).ok());
    for (size_t i = 0; i < kBytes; ++i) {
      REQUIRE(output[i] == static_cast<uint8_t>(r * 3 + i + 1));
    }
  }
  CHECK(peer.posted() == 100);
  CHECK(trigger->posts() == 100);
  CHECK(trigger->completions() == 100);
  CHECK(trigger->TakeError().ok());
  REQUIRE(trigger->Disarm(step.armed.slot, absl::Seconds(5)).ok());
  CHECK(trigger->armed() == 0);
  CHECK(absl::IsNotFound(trigger->Disarm(step.armed.slot, absl::Seconds(1))));
}

TEST_CASE("trigger: replays queued back to back post in order, one in flight", "[trigger]") {
  CapturedStep s("key 1");
  // Ten launches without a host sync between them: each waits for its own post.
  std::vector<uint8_t> seen;
  std::mutex seen_mu;
  for (int r = 0; r < 10; ++r) {
    REQUIRE(
        s.stream->LaunchHostFunc([&, r] { std::fill(s.input.begin(), s.input.end(), r); }).ok());
    REQUIRE(s.step.graph->Launch(*s.stream).ok());
    REQUIRE(s.stream
                ->LaunchHostFunc([&] {
                  std::lock_guard<std::mutex> lock(seen_mu);
                  seen.push_back(s.output[0]);
                })
                .ok());
  }
  REQUIRE(s.stream->Synchronize(absl::Seconds(10)).ok());
  REQUIRE(seen.size() == 10);
  for (int r = 0; r < 10; ++r) CHECK(seen[r] == r + 1);
  CHECK(s.peer.posted() == 10);
}

TEST_CASE("trigger: a refused post releases the stream and names the target", "[trigger]") {
  CapturedStep s("key 17 to server 1");
  REQUIRE(s.step.graph->Launch(*s.stream).ok());
  REQUIRE(s.stream->Synchronize(absl::Seconds(5)).ok());
  CHECK(s.trigger->TakeError().ok());
  s.peer.Refuse();
  for (int r = 0; r < 3; ++r) {  // never hangs: a failed slot releases at once
    REQUIRE(s.step.graph->Launch(*s.stream).ok());
    REQUIRE(s.stream->Synchronize(absl::Seconds(5)).ok());
  }
  const absl::Status e = s.trigger->TakeError();
  CHECK(absl::IsUnavailable(e));
  CHECK_THAT(std::string(e.message()), Catch::Contains("key 17 to server 1"));
  CHECK_THAT(std::string(e.message()), Catch::Contains("server 1 is lost"));
  CHECK(s.trigger->TakeError().ok());  // reported once
  CHECK(s.trigger->posts() == 1);
}

TEST_CASE("trigger: a post that never completes fails at the timeout", "[trigger]") {
  CapturedStep s("key 3", {.timeout = absl::Milliseconds(50)}, /*stall=*/true);
  const absl::Time start = absl::Now();
  REQUIRE(s.step.graph->Launch(*s.stream).ok());
  REQUIRE(s.stream->Synchronize(absl::Seconds(5)).ok());
  CHECK(absl::Now() - start >= absl::Milliseconds(50));
  const absl::Status e = s.trigger->TakeError();
  CHECK(absl::IsDeadlineExceeded(e));
  CHECK_THAT(std::string(e.message()), Catch::Contains("key 3"));
}

TEST_CASE("trigger: bounded queue, bad arguments, capacity, shutdown releases", "[trigger]") {
  auto backend = CreateCpuMockBackend();
  std::vector<uint8_t> input(kBytes), send(kBytes), recv(kBytes), output(kBytes);
  EchoPeer peer(send.data(), recv.data(), kBytes, absl::Milliseconds(20));
  TriggerOptions options;
  options.capacity = 2;
  options.max_queued = 1;
  CHECK(absl::IsInvalidArgument(Trigger::Create(*backend, TriggerOptions{.capacity = 0}).status()));
  auto trigger = *Trigger::Create(*backend, options);
  CHECK(absl::IsInvalidArgument(trigger->Arm(TriggerTarget{}).status()));
  auto a = trigger->Arm(peer.Target("a"));
  auto b = trigger->Arm(peer.Target("b"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(absl::IsResourceExhausted(trigger->Arm(peer.Target("c")).status()));
  // Three increments at once, before any post: more than max_queued = 1.
  std::atomic_ref<int64_t>(*a->go).fetch_add(3, std::memory_order_release);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  absl::Status e;
  while (e.ok() && absl::Now() < deadline) {
    e = trigger->TakeError();
    absl::SleepFor(absl::Milliseconds(1));
  }
  CHECK(absl::IsResourceExhausted(e));
  CHECK_THAT(std::string(e.message()), Catch::Contains("max_queued"));
  trigger->Shutdown();
  CHECK(absl::IsFailedPrecondition(trigger->Arm(peer.Target("d")).status()));
  trigger->Shutdown();  // idempotent
}

TEST_CASE("trigger: shutdown with a post in flight releases the waiting stream", "[trigger]") {
  CapturedStep s("key 5", {.timeout = absl::Milliseconds(200)}, /*stall=*/true);
  REQUIRE(s.step.graph->Launch(*s.stream).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (s.peer.posted() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  REQUIRE(s.peer.posted() == 1);
  const absl::Time start = absl::Now();
  s.trigger->Shutdown();  // waits for the request in flight (bounded), then releases
  CHECK(absl::Now() - start < absl::Seconds(3));
  CHECK(s.stream->Synchronize(absl::Seconds(5)).ok());
  CHECK(s.trigger->armed() == 0);
}

}  // namespace
}  // namespace stepmesh
