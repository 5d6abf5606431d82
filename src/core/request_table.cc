#include "src/core/request_table.h"

#include <algorithm>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace stepmesh::core {
namespace {

// A status equal to `s` that shares no storage with it. A failed status's
// message lives in a reference-counted rep, which Debian's Abseil counts in
// code built without TSan: if the request's result shared the receive
// thread's rep, the application's copy (counted in our, instrumented, code)
// and that thread's last release of its own copy (not) would look unordered
// to TSan. With a rep of its own, every count of the result's rep is taken
// under `status_mu` or by the application after Collect.
absl::Status Unshared(const absl::Status& s) {
  absl::Status copy(s.code(), s.message());
  s.ForEachPayload([&copy](absl::string_view type_url, const absl::Cord& payload) {
    copy.SetPayload(type_url, absl::Cord(std::string(payload)));
  });
  return copy;
}

}  // namespace

Request::Request(int num_servers)
    : targets(kMaxPushesPerRequest * num_servers, 0),
      pull_key(num_servers, kNoPull),
      pull_reg(num_servers, nullptr),
      addressed(num_servers, 0),
      settled(new std::atomic<bool>[num_servers]),
      stamps(num_servers) {}

RequestTable::RequestTable(int slots, int num_servers, uint32_t first_generation) {
  requests_.reserve(slots);
  free_.reserve(slots);
  for (int i = 0; i < slots; ++i) {
    requests_.push_back(std::make_unique<Request>(num_servers));
    requests_.back()->generation.store(first_generation, std::memory_order_relaxed);
    requests_.back()->index = static_cast<uint32_t>(i);
    free_.push_back(slots - 1 - i);
  }
}

absl::Status RequestTable::CreateDoneFlags(Backend& backend) {
  for (const auto& r : requests_) {
    absl::StatusOr<std::unique_ptr<HostFlag>> flag = backend.CreateHostFlag();
    if (!flag.ok()) return flag.status();
    (*flag)->Store(r->generation.load(std::memory_order_relaxed));
    r->done_flag = *std::move(flag);
  }
  return absl::OkStatus();
}

Request* RequestTable::NextFree() {
  return free_.empty() ? nullptr : requests_[free_.back()].get();
}

RequestHandle RequestTable::Commit(int addressed, uint64_t enqueue_ns) {
  const uint32_t index = free_.back();
  free_.pop_back();
  Request& r = *requests_[index];
  const uint32_t previous = r.generation.load(std::memory_order_relaxed);
  const uint32_t generation = previous == UINT32_MAX ? 1 : previous + 1;
  r.generation.store(generation, std::memory_order_relaxed);
  for (size_t s = 0; s < r.addressed.size(); ++s) {
    r.settled[s].store(!r.addressed[s], std::memory_order_relaxed);
    r.stamps[s] = TraceStamps{};
  }
  r.outstanding.store(addressed + 1, std::memory_order_relaxed);
  pending_.fetch_add(1, std::memory_order_relaxed);
  r.enqueue_ns = enqueue_ns;
  r.complete_ns = 0;
  {
    base::MutexLock lock(&r.status_mu);
    r.status = absl::OkStatus();
  }
  // Publishes every field above to the threads that see the request pending.
  r.state.store(RequestState::kPending, std::memory_order_release);
  return RequestHandle(index, generation);
}

void RequestTable::Free(uint32_t index) { free_.push_back(index); }

std::vector<RequestHandle> RequestTable::PendingAddressing(int server) const {
  std::vector<RequestHandle> pending;
  for (uint32_t i = 0; i < requests_.size(); ++i) {
    const Request& r = *requests_[i];
    // A server that already replied is not owed anything: its departure
    // strands nothing of this request (the warning counts only these).
    if (r.state.load() == RequestState::kPending && r.addressed[server] &&
        !r.settled[server].load(std::memory_order_acquire)) {
      pending.emplace_back(i, r.generation.load());
    }
  }
  return pending;
}

absl::StatusOr<Request*> RequestTable::Lookup(RequestHandle handle) const {
  if (!handle.valid() || handle.index() >= requests_.size()) {
    return absl::InvalidArgumentError("invalid request handle");
  }
  Request* r = requests_[handle.index()].get();
  const RequestState state = r->state.load(std::memory_order_acquire);
  if (r->generation != handle.generation()) {
    return absl::FailedPreconditionError("stale request handle (its slot was reused)");
  }
  if (state == RequestState::kReleased) {
    return absl::FailedPreconditionError("handle already waited on");
  }
  if (state == RequestState::kFree) return absl::InvalidArgumentError("invalid request handle");
  return r;
}

absl::Status RequestTable::Collect(Request& r, absl::Status* result) {
  RequestState expected = RequestState::kDone;
  if (!r.state.compare_exchange_strong(expected, RequestState::kReleased)) {
    return absl::FailedPreconditionError("handle already waited on");
  }
  base::MutexLock lock(&r.status_mu);
  *result = r.status;
  return absl::OkStatus();
}

absl::StatusOr<Request*> RequestTable::PendingFor(uint64_t request_id, int server) const {
  const uint32_t index = static_cast<uint32_t>(request_id >> 32);
  const uint32_t generation = static_cast<uint32_t>(request_id);
  // State first (acquire): a pending request's fields are published with it.
  if (index >= requests_.size() ||
      requests_[index]->state.load(std::memory_order_acquire) != RequestState::kPending ||
      requests_[index]->generation.load(std::memory_order_acquire) != generation) {
    return absl::FailedPreconditionError("reply for an unknown or finished request");
  }
  Request* r = requests_[index].get();
  if (!r->addressed[server] || r->settled[server].load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError(
        absl::StrCat("unexpected or duplicate reply from server ", server));
  }
  return r;
}

bool RequestTable::IsCurrent(const Request& r, uint64_t request_id) const {
  return r.state.load(std::memory_order_acquire) == RequestState::kPending &&
         r.generation.load(std::memory_order_acquire) == static_cast<uint32_t>(request_id);
}

bool RequestTable::Settle(Request& r, int server, const absl::Status& status, bool* first) {
  const bool settled_before = r.settled[server].exchange(true, std::memory_order_acq_rel);
  if (first != nullptr) *first = !settled_before;
  if (settled_before) return false;
  if (!status.ok()) FailIfOk(r, status);
  // The reply is in the pull tensor (staged in, or flushed), or never will
  // be: a stream waiting for the next reply under this key may go
  // (StreamWaitNextPull).
  if (r.pull_key[server] != kNoPull) {
    TensorRegistration& reg = *r.pull_reg[server];
    if (reg.arrivals != nullptr) reg.arrivals->Store(++reg.arrived);
  }
  return Release(r);
}

bool RequestTable::Release(Request& r) {
  return r.outstanding.fetch_sub(1, std::memory_order_acq_rel) == 1;
}

void RequestTable::FailIfOk(Request& r, const absl::Status& why) {
  base::MutexLock lock(&r.status_mu);
  if (r.status.ok()) r.status = Unshared(why);
}

void RequestTable::MarkDone(Request& r, uint64_t complete_ns) {
  r.complete_ns = complete_ns;
  r.state.store(RequestState::kDone, std::memory_order_seq_cst);
  pending_.fetch_sub(1, std::memory_order_release);
  if (r.done_flag != nullptr) r.done_flag->Store(r.generation.load(std::memory_order_relaxed));
}

}  // namespace stepmesh::core
