#include "src/core/prepared_request.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/core/protocol.h"

namespace stepmesh {

PreparedRequest::PreparedRequest() = default;
PreparedRequest::PreparedRequest(PreparedRequest&&) noexcept = default;
PreparedRequest& PreparedRequest::operator=(PreparedRequest&&) noexcept = default;
PreparedRequest::~PreparedRequest() = default;

size_t PreparedRequest::num_pushes() const { return plan_ == nullptr ? 0 : plan_->pushes.size(); }
size_t PreparedRequest::num_pulls() const { return plan_ == nullptr ? 0 : plan_->pulls.size(); }

Key PreparedRequest::push_key(size_t push) const {
  return push < num_pushes() ? plan_->pushes[push].key : 0;
}
size_t PreparedRequest::bytes(size_t push) const {
  return push < num_pushes() ? plan_->pushes[push].bytes : 0;
}
size_t PreparedRequest::registered_bytes(size_t push) const {
  return push < num_pushes() ? plan_->pushes[push].registered : 0;
}

TensorView PreparedRequest::push_tensor(size_t push) const {
  return push < num_pushes() ? plan_->pushes[push].tensor : TensorView{};
}

absl::Status PreparedRequest::SetBytes(size_t push, size_t bytes) {
  if (push >= num_pushes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("push index ", push, " is not in [0, ", num_pushes(), ")"));
  }
  Plan::PushPart& p = plan_->pushes[push];
  if (bytes > p.registered) {
    return absl::OutOfRangeError(absl::StrCat("push of ", bytes, " bytes under key ", p.key,
                                              " exceeds the registered ", p.registered));
  }
  p.bytes = bytes;
  return absl::OkStatus();
}

namespace core {

void ReservePlan(PreparedPlan& plan, int num_servers) {
  plan.pushes.reserve(kMaxPushesPerRequest);
  plan.pulls.reserve(num_servers);
  plan.targets.reserve(size_t{kMaxPushesPerRequest} * num_servers);
  plan.addressed.reserve(num_servers);
  plan.named.reserve(num_servers);
}

absl::Status BuildPlan(absl::Span<const Push> pushes, absl::Span<const Pull> pulls, int num_servers,
                       absl::FunctionRef<TensorRegistration*(Key)> find_push,
                       absl::FunctionRef<TensorRegistration*(Key, int)> find_pull,
                       PreparedPlan& plan) {
  if (pushes.empty()) return absl::InvalidArgumentError("a request needs at least one push");
  if (pushes.size() > kMaxPushesPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat(pushes.size(), " pushes; at most ", kMaxPushesPerRequest, " per request"));
  }
  plan.num_servers = num_servers;
  plan.pushes.clear();
  plan.pulls.clear();
  plan.targets.assign(pushes.size() * num_servers, 0);
  plan.addressed.assign(num_servers, 0);
  plan.named.assign(num_servers, 0);
  for (size_t i = 0; i < pushes.size(); ++i) {
    const Push& push = pushes[i];
    TensorRegistration* reg = find_push(push.key);
    if (reg == nullptr) {
      return absl::NotFoundError(absl::StrCat("push key ", push.key, " is not registered"));
    }
    const size_t registered = reg->view.bytes();
    const size_t bytes = push.bytes == kWholeTensor ? registered : push.bytes;
    if (bytes > registered) {
      return absl::OutOfRangeError(absl::StrCat("push of ", bytes, " bytes under key ", push.key,
                                                " exceeds the registered ", registered));
    }
    for (size_t j = 0; j < i; ++j) {
      if (pushes[j].key == push.key) {
        return absl::InvalidArgumentError(absl::StrCat("push key ", push.key, " repeated"));
      }
    }
    uint8_t* targets = &plan.targets[i * num_servers];
    if (push.servers.empty()) std::fill(targets, targets + num_servers, 1);
    for (int s : push.servers) {
      if (s < 0 || s >= num_servers) {
        return absl::InvalidArgumentError(
            absl::StrCat("push of key ", push.key, " to unknown server ", s));
      }
      targets[s] = 1;
      plan.named[s] = 1;
    }
    for (int s = 0; s < num_servers; ++s) plan.addressed[s] |= targets[s];
    plan.pushes.push_back({push.key, bytes, registered, reg->view, reg, reg->generation});
  }
  for (const Pull& pull : pulls) {
    if (pull.server < 0 || pull.server >= num_servers) {
      return absl::InvalidArgumentError(
          absl::StrCat("pull of key ", pull.key, " from unknown server ", pull.server));
    }
    TensorRegistration* reg = find_pull(pull.key, pull.server);
    if (reg == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("pull key ", pull.key, " from server ", pull.server, " is not registered"));
    }
    for (const PreparedPlan::PullPart& other : plan.pulls) {
      if (other.server == pull.server) {
        return absl::InvalidArgumentError(
            absl::StrCat("two pulls from server ", pull.server, " in one request"));
      }
    }
    if (!plan.addressed[pull.server]) {
      return absl::InvalidArgumentError(absl::StrCat("pull key ", pull.key, " from server ",
                                                     pull.server,
                                                     " without a push to it in the same request"));
    }
    plan.named[pull.server] = 1;
    plan.pulls.push_back({pull.key, pull.server, reg, reg->generation});
  }
  return absl::OkStatus();
}

absl::Status CheckPlanPostable(const PreparedPlan& plan) {
  for (const PreparedPlan::PushPart& p : plan.pushes) {
    if (p.reg->generation != p.generation) {
      return absl::FailedPreconditionError(
          absl::StrCat("push key ", p.key, " was unregistered after this request was prepared"));
    }
    if (p.reg->in_flight) {
      return absl::FailedPreconditionError(
          absl::StrCat("push key ", p.key, " is still in flight in another request"));
    }
  }
  for (const PreparedPlan::PullPart& p : plan.pulls) {
    if (p.reg->generation != p.generation) {
      return absl::FailedPreconditionError(
          absl::StrCat("pull key ", p.key, " from server ", p.server,
                       " was unregistered after this request was prepared"));
    }
    if (p.reg->in_flight) {
      return absl::FailedPreconditionError(
          absl::StrCat("pull key ", p.key, " is still in flight in another request"));
    }
  }
  return absl::OkStatus();
}

void FillRequest(const PreparedPlan& plan, Request& r) {
  const size_t num_servers = static_cast<size_t>(plan.num_servers);
  std::copy(plan.targets.begin(), plan.targets.end(), r.targets.begin());
  std::copy(plan.addressed.begin(), plan.addressed.end(), r.addressed.begin());
  for (size_t i = 0; i < plan.pushes.size(); ++i) {
    const PreparedPlan::PushPart& p = plan.pushes[i];
    r.pushes[i] = {p.key, p.reg->wire.wire, p.bytes, p.reg->view.dtype, p.reg->wire.region, p.reg};
  }
  r.num_pushes = static_cast<int>(plan.pushes.size());
  std::fill(r.pull_key.begin(), r.pull_key.begin() + num_servers, kNoPull);
  for (const PreparedPlan::PullPart& p : plan.pulls) {
    r.pull_key[p.server] = p.key;
    r.pull_reg[p.server] = p.reg;
  }
}

}  // namespace core
}  // namespace stepmesh
