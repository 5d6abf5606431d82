#pragma once
// What AFTensorWorker::Prepare finds once, so that Post looks nothing up: each
// push's and pull's registration (named by pointer and generation: a key
// unregistered since makes the plan stale, detected without reading the old
// tensor), the byte counts, and the servers each push goes to.
//
// Registrations live in slots the worker never frees while it lives (an
// unregistered slot is reset and its generation bumped, then reused), so a
// plan's pointers always point at a TensorRegistration, current or not.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "src/core/request_table.h"
#include "stepmesh/worker.h"

namespace stepmesh {

// Plain data (no out-of-line members: nothing of it is exported).
struct PreparedRequest::Plan {
  struct PushPart {
    Key key = 0;
    size_t bytes = 0;       // what a post sends (SetBytes changes it)
    size_t registered = 0;  // the registered tensor's bytes, at Prepare
    TensorView tensor;      // the registered tensor, at Prepare
    core::TensorRegistration* reg = nullptr;
    uint32_t generation = 0;  // reg's at Prepare
  };
  struct PullPart {
    Key key = 0;
    int server = 0;
    core::TensorRegistration* reg = nullptr;
    uint32_t generation = 0;
  };

  const void* owner = nullptr;  // the worker that prepared it
  int num_servers = 0;
  std::vector<PushPart> pushes;
  std::vector<PullPart> pulls;
  std::vector<uint8_t> targets;    // [push][server]: push goes to server
  std::vector<uint8_t> addressed;  // per server: some push goes there
  // Per server: a push lists it or a pull names it (a post fails UNAVAILABLE
  // when it is not a member); the others are addressed as "every server".
  std::vector<uint8_t> named;

  static PreparedRequest Wrap(std::unique_ptr<Plan> plan) {
    PreparedRequest r;
    r.plan_ = std::move(plan);
    return r;
  }
  static const Plan* Of(const PreparedRequest& r) { return r.plan_.get(); }
};

namespace core {

using PreparedPlan = PreparedRequest::Plan;

// Room for any request of `num_servers` servers, so that BuildPlan into it
// allocates nothing (PushPull's scratch plan).
void ReservePlan(PreparedPlan& plan, int num_servers);

// Validates `pushes` and `pulls` into `plan` (cleared first), looking each key
// up once. Errors name the key or server; `plan` is then unusable.
absl::Status BuildPlan(absl::Span<const Push> pushes, absl::Span<const Pull> pulls, int num_servers,
                       absl::FunctionRef<TensorRegistration*(Key)> find_push,
                       absl::FunctionRef<TensorRegistration*(Key, int)> find_pull,
                       PreparedPlan& plan);

// FAILED_PRECONDITION naming the key when a registration the plan uses was
// unregistered since, or is in another request in flight. Reads the
// registrations' generation and in_flight (the worker's registration lock).
absl::Status CheckPlanPostable(const PreparedPlan& plan);

// Copies the plan into the free request slot `r` (pushes, targets, pulls,
// addressed); no allocation.
void FillRequest(const PreparedPlan& plan, Request& r);

}  // namespace core
}  // namespace stepmesh
