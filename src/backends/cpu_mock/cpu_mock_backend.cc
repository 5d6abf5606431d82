// The CPU mock backend: host memory, and streams that run their work in order
// on a thread of their own, so that event/ordering mistakes surface on a
// laptop exactly as they would on a GPU (add injected_delay to widen windows).
// Graph capture is modelled too: while a stream captures, its operations are
// recorded instead of run (host code between them is not part of the graph),
// and a launch re-enqueues exactly those operations on a stream, where they
// run asynchronously like any other work. As in CUDA's default (global)
// capture mode, which torch.cuda.graph uses, an allocation (Allocate,
// CreateHostFlag: cudaMalloc / cudaHostAlloc on CUDA) while any stream of the
// backend captures is refused and breaks every capture in progress: their
// later captured operations and their EndCapture fail.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "src/base/thread_util.h"
#include "stepmesh/backend.h"

namespace stepmesh::cpu_mock {
namespace {

constexpr size_t kAlignment = 4096;  // page-aligned: registrable, DMA-friendly

class HostMemory final : public Memory {
 public:
  HostMemory(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  ~HostMemory() override { std::free(data_); }
  void* data() const override { return data_; }
  size_t bytes() const override { return bytes_; }
  Device device() const override { return Device::Cpu(); }

 private:
  void* data_;
  size_t bytes_;
};

bool Reached(uint32_t flag, uint32_t value) { return static_cast<int32_t>(flag - value) >= 0; }

// The stopping flag of the stream whose thread runs the current item: an
// operation recorded on one stream may be replayed on another, so waits ask
// the stream they run on, never the one they were enqueued on.
thread_local const std::atomic<bool>* tls_stopping = nullptr;
bool Stopping() { return tls_stopping != nullptr && tls_stopping->load(std::memory_order_relaxed); }

// The word lives in shared state that waiting stream items hold too, so a
// flag destroyed while a stream still waits on it is not read after free.
struct FlagWord {
  alignas(64) std::atomic<uint32_t> value{0};
  std::atomic<uint64_t> waited{0};      // bit 32: a WaitHostFlag was enqueued; low bits: its max
  std::atomic<bool> next_waits{false};  // a WaitHostFlagNext used it as the counter

  static constexpr uint64_t kHasWait = uint64_t{1} << 32;
  void NoteWait(uint32_t target) {
    uint64_t seen = waited.load(std::memory_order_relaxed);
    while (!((seen & kHasWait) && Reached(static_cast<uint32_t>(seen), target)) &&
           !waited.compare_exchange_weak(seen, kHasWait | target)) {
    }
  }
};

class MockHostFlag final : public HostFlag {
 public:
  ~MockHostFlag() override { ReleaseWaiters(); }
  void Store(uint32_t value) override { word_->value.store(value, std::memory_order_release); }
  uint32_t Load() const override { return word_->value.load(std::memory_order_acquire); }
  void ReleaseWaiters() override {
    const uint64_t waited = word_->waited.load(std::memory_order_acquire);
    if ((waited & FlagWord::kHasWait) && !Reached(Load(), static_cast<uint32_t>(waited))) {
      Store(static_cast<uint32_t>(waited));
    }
    // Next-waits read their target from the cursor when they run; any of them
    // is within 2^30 of the counter.
    if (word_->next_waits.load(std::memory_order_acquire)) Store(Load() + (1u << 30));
  }
  const std::shared_ptr<FlagWord>& word() const { return word_; }

 private:
  const std::shared_ptr<FlagWord> word_ = std::make_shared<FlagWord>();
};

// The backend's captures in progress, and what broke each (empty: nothing).
// Streams call in holding their own lock; this one never takes a stream's.
// Per backend (no process-wide state): CUDA's global mode spans the process,
// and in-process meshes here each have their own backend.
class Captures {
 public:
  void Begin(const void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    active_.emplace_back(stream, std::string());
  }
  // What broke the stream's capture ("" when nothing did); forgets it.
  std::string End(const void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < active_.size(); ++i) {
      if (active_[i].first != stream) continue;
      std::string broken = std::move(active_[i].second);
      active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
      return broken;
    }
    return std::string();
  }
  // What broke the stream's capture so far ("" when nothing did).
  std::string Broken(const void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [s, broken] : active_) {
      if (s == stream) return broken;
    }
    return std::string();
  }
  // FAILED_PRECONDITION, and every capture in progress broken, when one is.
  absl::Status Unsafe(absl::string_view call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_.empty()) return absl::OkStatus();
    const std::string what = absl::StrCat(call, " while a stream was being captured");
    for (auto& [stream, broken] : active_) {
      if (broken.empty()) broken = what;
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cpu_mock: ", what,
                     " (CUDA refuses allocations during a global-mode capture, "
                     "torch.cuda.graph's, and invalidates it): allocate before capturing"));
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<const void*, std::string>> active_;
};

class MockStream final : public Stream {
 public:
  MockStream(absl::Duration injected_delay, std::shared_ptr<Captures> captures)
      : injected_delay_(injected_delay), captures_(std::move(captures)) {
    worker_ = base::StartNamedThread("sm-mock-stream", {}, [this] { Run(); });
  }
  ~MockStream() override {
    (void)captures_->End(this);  // a capture never ended
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes) override {
    return LaunchHostFunc([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  }

  absl::Status LaunchHostFunc(std::function<void()> fn) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return absl::FailedPreconditionError("stream is being destroyed");
      if (capturing_) {
        if (absl::Status broken = CaptureBroken(); !broken.ok()) return broken;
        captured_.push_back(std::move(fn));
        return absl::OkStatus();
      }
      queue_.push_back(std::move(fn));
      ++enqueued_;
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  // A graph's operations, enqueued together (two launches never interleave),
  // or recorded into this stream's own capture (a graph launched while
  // capturing becomes part of that graph, as in CUDA).
  absl::Status EnqueueAll(const std::vector<std::function<void()>>& ops) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return absl::FailedPreconditionError("stream is being destroyed");
      if (capturing_) {
        if (absl::Status broken = CaptureBroken(); !broken.ok()) return broken;
        captured_.insert(captured_.end(), ops.begin(), ops.end());
        return absl::OkStatus();
      }
      for (const std::function<void()>& op : ops) queue_.push_back(std::function<void()>(op));
      enqueued_ += ops.size();
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  absl::Status IncrementCounter(int64_t* counter) override {
    if (counter == nullptr) return absl::InvalidArgumentError("IncrementCounter: a null counter");
    return LaunchHostFunc(
        [counter] { std::atomic_ref<int64_t>(*counter).fetch_add(1, std::memory_order_acq_rel); });
  }

  absl::Status BeginCapture() override {
    std::lock_guard<std::mutex> lock(mu_);  // then the registry's: it never takes a stream's
    if (capturing_) return absl::FailedPreconditionError("BeginCapture: already capturing");
    capturing_ = true;
    captured_.clear();
    captures_->Begin(this);
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<StreamGraph>> EndCapture() override;
  bool IsCapturing() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return capturing_;
  }

  absl::Status WaitHostFlag(HostFlag& flag, uint32_t value) override {
    auto* mock = dynamic_cast<MockHostFlag*>(&flag);
    if (mock == nullptr) return absl::InvalidArgumentError("WaitHostFlag: not a cpu_mock flag");
    mock->word()->NoteWait(value);
    // Like a GPU stream-wait: later work on this stream stalls, the host does not.
    return LaunchHostFunc([word = mock->word(), value] {
      while (!Reached(word->value.load(std::memory_order_acquire), value) && !Stopping()) {
        std::this_thread::yield();
      }
    });
  }

  absl::Status WaitHostFlagNext(HostFlag& counter, HostFlag& cursor) override {
    auto* mock_counter = dynamic_cast<MockHostFlag*>(&counter);
    auto* mock_cursor = dynamic_cast<MockHostFlag*>(&cursor);
    if (mock_counter == nullptr || mock_cursor == nullptr) {
      return absl::InvalidArgumentError("WaitHostFlagNext: not cpu_mock flags");
    }
    mock_counter->word()->next_waits.store(true, std::memory_order_release);
    return LaunchHostFunc([counter = mock_counter->word(), cursor = mock_cursor->word()] {
      const uint32_t target = cursor->value.load(std::memory_order_acquire) + 1;
      while (!Reached(counter->value.load(std::memory_order_acquire), target) && !Stopping()) {
        std::this_thread::yield();
      }
      cursor->value.store(target, std::memory_order_release);
    });
  }

  absl::Status WaitCounterAtLeast(const int64_t* counter, const int64_t* target) override {
    if (counter == nullptr || target == nullptr) {
      return absl::InvalidArgumentError("WaitCounterAtLeast: a null counter or target");
    }
    return LaunchHostFunc([counter, target] {
      const int64_t want = std::atomic_ref<const int64_t>(*target).load(std::memory_order_acquire);
      while (std::atomic_ref<const int64_t>(*counter).load(std::memory_order_acquire) < want &&
             !Stopping()) {
        std::this_thread::yield();
      }
    });
  }

  absl::Status SignalHostFlag(HostFlag& flag, uint32_t value) override {
    auto* mock = dynamic_cast<MockHostFlag*>(&flag);
    if (mock == nullptr) return absl::InvalidArgumentError("SignalHostFlag: not a cpu_mock flag");
    return LaunchHostFunc(
        [word = mock->word(), value] { word->value.store(value, std::memory_order_release); });
  }

  absl::Status Synchronize(absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (capturing_) {
      return absl::FailedPreconditionError("Synchronize: the stream is capturing a graph");
    }
    const uint64_t target = enqueued_;
    if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                      [&] { return completed_ >= target; })) {
      return absl::DeadlineExceededError("stream did not drain in time");
    }
    return absl::OkStatus();
  }

  // The ticket of the last item enqueued so far (events record it); none
  // while capturing (an event cannot mark a point of a graph not yet run).
  absl::StatusOr<uint64_t> Ticket() {
    std::lock_guard<std::mutex> lock(mu_);
    if (capturing_) {
      return absl::FailedPreconditionError("Event::Record: the stream is capturing a graph");
    }
    return enqueued_;
  }
  uint64_t Completed() const { return completed_atomic_.load(std::memory_order_acquire); }
  bool WaitCompleted(uint64_t ticket, absl::Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                        [&] { return completed_ >= ticket; });
  }

 private:
  // With mu_ held, capturing: a broken capture records nothing more
  // (cudaErrorStreamCaptureInvalidated for every later captured call).
  absl::Status CaptureBroken() {
    const std::string broken = captures_->Broken(this);
    if (broken.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("the stream's capture was invalidated by ", broken));
  }

  void Run() {
    tls_stopping = &stopping_;
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      if (injected_delay_ > absl::ZeroDuration()) absl::SleepFor(injected_delay_);
      fn();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++completed_;
        completed_atomic_.store(completed_, std::memory_order_release);
      }
      cv_.notify_all();
    }
  }

  const absl::Duration injected_delay_;
  const std::shared_ptr<Captures> captures_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool capturing_ = false;
  std::vector<std::function<void()>> captured_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  std::atomic<uint64_t> completed_atomic_{0};
  std::atomic<bool> stopping_{false};
  std::thread worker_;
};

class MockGraph final : public StreamGraph {
 public:
  explicit MockGraph(std::vector<std::function<void()>> ops) : ops_(std::move(ops)) {}
  absl::Status Launch(Stream& stream) override {
    auto* mock = dynamic_cast<MockStream*>(&stream);
    if (mock == nullptr)
      return absl::InvalidArgumentError("StreamGraph::Launch: not a cpu_mock stream");
    return mock->EnqueueAll(ops_);
  }
  size_t size() const override { return ops_.size(); }

 private:
  const std::vector<std::function<void()>> ops_;
};

absl::StatusOr<std::unique_ptr<StreamGraph>> MockStream::EndCapture() {
  std::vector<std::function<void()>> ops;
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!capturing_)
      return absl::FailedPreconditionError("EndCapture: the stream is not capturing");
    capturing_ = false;
    ops.swap(captured_);
    broken = captures_->End(this);
  }
  if (!broken.empty()) {  // cudaErrorStreamCaptureInvalidated
    return absl::FailedPreconditionError(
        absl::StrCat("EndCapture: the capture was invalidated by ", broken));
  }
  return std::unique_ptr<StreamGraph>(std::make_unique<MockGraph>(std::move(ops)));
}

class MockEvent final : public Event {
 public:
  absl::Status Record(Stream& stream) override {
    auto* mock = dynamic_cast<MockStream*>(&stream);
    if (mock == nullptr) return absl::InvalidArgumentError("not a cpu_mock stream");
    absl::StatusOr<uint64_t> ticket = mock->Ticket();
    if (!ticket.ok()) return ticket.status();
    stream_ = mock;
    ticket_ = *ticket;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Query() override {
    return stream_ == nullptr || stream_->Completed() >= ticket_;
  }
  absl::Status Wait(absl::Duration timeout) override {
    if (stream_ == nullptr || stream_->WaitCompleted(ticket_, timeout)) return absl::OkStatus();
    return absl::DeadlineExceededError("event not reached in time");
  }

 private:
  MockStream* stream_ = nullptr;  // the stream must outlive a recorded event's use
  uint64_t ticket_ = 0;
};

class CpuMockBackend final : public Backend {
 public:
  explicit CpuMockBackend(const CpuMockOptions& options) : options_(options) {}
  absl::string_view name() const override { return "cpu_mock"; }
  Device device() const override { return Device::Cpu(); }

  absl::StatusOr<std::unique_ptr<Memory>> Allocate(size_t bytes, MemoryKind) override {
    if (absl::Status unsafe = captures_->Unsafe(absl::StrCat("Allocate(", bytes, " bytes)"));
        !unsafe.ok()) {
      return unsafe;
    }
    const size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
    void* data = std::aligned_alloc(kAlignment, rounded);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    std::memset(data, 0, rounded);
    return std::make_unique<HostMemory>(data, bytes);
  }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::make_unique<MockStream>(options_.injected_delay, captures_);
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::make_unique<MockEvent>();
  }
  absl::StatusOr<std::unique_ptr<HostFlag>> CreateHostFlag() override {
    if (absl::Status unsafe = captures_->Unsafe("CreateHostFlag"); !unsafe.ok()) return unsafe;
    return std::make_unique<MockHostFlag>();
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::StatusOr<MemoryLocation> Locate(const void*) override {
    return MemoryLocation{Device::Cpu(), -1, ""};
  }

 private:
  const CpuMockOptions options_;
  const std::shared_ptr<Captures> captures_ = std::make_shared<Captures>();
};

}  // namespace
}  // namespace stepmesh::cpu_mock

namespace stepmesh {

std::unique_ptr<Backend> CreateCpuMockBackend(const CpuMockOptions& options) {
  return std::make_unique<cpu_mock::CpuMockBackend>(options);
}

}  // namespace stepmesh
