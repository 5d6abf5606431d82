#include "python/src/trigger_binding.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "python/src/errors.h"
#include "python/src/gil.h"

namespace stepmesh::python {
namespace py = pybind11;

TriggerTarget PreparedTriggerTarget(AFTensorWorker& node,
                                    std::shared_ptr<const PreparedRequest> prepared) {
  TriggerTarget t;
  std::vector<std::string> keys;
  for (size_t i = 0; i < prepared->num_pushes(); ++i) {
    keys.push_back(absl::StrCat(prepared->push_key(i)));
  }
  t.name = absl::StrCat(
      "push keys ", absl::StrJoin(keys, ","),
      prepared->num_pulls() == 0 ? "" : absl::StrCat(" (", prepared->num_pulls(), " pulls)"));
  t.post = [&node, prepared = std::move(prepared)]() { return node.Post(*prepared); };
  t.poll = [&node](RequestHandle h) -> absl::StatusOr<bool> {
    absl::StatusOr<bool> done = node.Test(h);
    if (!done.ok()) return done.status();
    if (!*done) return false;
    absl::Status s = node.Wait(h, absl::ZeroDuration());  // releases the handle
    if (!s.ok()) return s;
    return true;
  };
  return t;
}

PyTrigger::PyTrigger(Backend& backend, int capacity, double timeout) : streams_(backend) {
  TriggerOptions options;
  options.capacity = capacity;
  if (!(timeout > 0)) ThrowInvalidArgument("create_trigger: timeout must be > 0 seconds");
  options.timeout = absl::Seconds(timeout);
  trigger_ = ValueOrThrow(Trigger::Create(backend, options));
}

PyTrigger::~PyTrigger() {
  {
    py::gil_scoped_release release;
    trigger_.reset();  // waits (bounded) for requests in flight
  }
  keep_.clear();
}

Trigger& PyTrigger::trigger() {
  if (trigger_ == nullptr) ThrowStatus(absl::FailedPreconditionError("the trigger is closed"));
  return *trigger_;
}

const Trigger::Armed& PyTrigger::armed(int slot) {
  auto it = armed_.find(slot);
  if (it == armed_.end()) {
    ThrowStatus(absl::NotFoundError(absl::StrCat("trigger slot ", slot, " is not armed")));
  }
  return it->second;
}

int PyTrigger::Arm(PyTriggerTarget& target, py::handle writes) {
  Trigger& t = trigger();
  TriggerTarget copy = target.target;
  for (py::handle item : writes) {
    auto pair = item.cast<std::pair<uintptr_t, int64_t>>();
    if (pair.first == 0 || pair.first % alignof(int64_t) != 0) {
      ThrowInvalidArgument(
          absl::StrCat("arm: writes: address ", pair.first, " is null or not 8-byte aligned"));
    }
    copy.writes.emplace_back(reinterpret_cast<int64_t*>(pair.first), pair.second);
  }
  Trigger::Armed a = ValueOrThrow(t.Arm(std::move(copy)));
  armed_[a.slot] = a;
  keep_[a.slot] = target.keep;
  return a.slot;
}

void PyTrigger::PostOn(int slot, py::handle stream) {
  const Trigger::Armed& a = armed(slot);
  if (stream.is_none()) ThrowInvalidArgument("post_on: stream is None");
  py::object keep;
  Stream* s = streams_.Resolve(stream, "post_on", keep);
  ThrowIfError(s->IncrementCounter(a.go));
}

void PyTrigger::WaitOn(int slot, py::handle stream) {
  const Trigger::Armed& a = armed(slot);
  if (stream.is_none()) ThrowInvalidArgument("wait_on: stream is None");
  py::object keep;
  Stream* s = streams_.Resolve(stream, "wait_on", keep);
  ThrowIfError(s->WaitCounterAtLeast(a.done, a.go));
}

void PyTrigger::Disarm(int slot, double timeout) {
  armed(slot);
  Trigger& t = trigger();
  CallReleased([&] { return t.Disarm(slot, absl::Seconds(timeout)); });
  armed_.erase(slot);
  keep_.erase(slot);
}

void PyTrigger::Check() {
  if (trigger_ == nullptr) return;
  ThrowIfError(trigger_->TakeError());
}

void PyTrigger::Close() {
  if (trigger_ == nullptr) return;
  absl::Status error;
  {
    py::gil_scoped_release release;
    trigger_->Shutdown();
    error = trigger_->TakeError();
    trigger_.reset();
  }
  armed_.clear();
  keep_.clear();
  ThrowIfError(error);
}

void BindTrigger(py::module_& m) {
  py::class_<PyTriggerTarget>(m, "TriggerTarget",
                              "A plan's request frozen for Trigger.arm (Plan.trigger_target()).");
  py::class_<PyTrigger>(m, "Trigger", R"doc(
Device-triggered posting (Worker.create_trigger()): a captured graph's replay
sends again. arm(plan.trigger_target()) returns a slot; post_on(slot, stream)
enqueues the go increment (a stream op: the trigger's thread posts the request
when the stream gets there), wait_on(slot, stream) a wait until that post
completed. Both capture into a graph and repeat at every replay. A failure is
raised by the next check() (and close()); the stream is released, never left
waiting. docs/python.md, vLLM AFD plugin, graph mode.)doc")
      .def("arm", &PyTrigger::Arm, py::arg("target"), py::arg("writes") = py::tuple(),
           "Arms a slot posting `target` once per go increment; writes=[(address, int64), ...] "
           "are stored before every post.")
      .def("post_on", &PyTrigger::PostOn, py::arg("slot"), py::arg("stream"))
      .def("wait_on", &PyTrigger::WaitOn, py::arg("slot"), py::arg("stream"))
      .def("disarm", &PyTrigger::Disarm, py::arg("slot"), py::arg("timeout") = 30.0)
      .def("check", &PyTrigger::Check, "Raises the first failure since the last check.")
      .def("close", &PyTrigger::Close)
      .def("go_address",
           [](PyTrigger& t, int slot) { return reinterpret_cast<uintptr_t>(t.armed(slot).go); })
      .def("done_address",
           [](PyTrigger& t, int slot) { return reinterpret_cast<uintptr_t>(t.armed(slot).done); })
      .def_property_readonly("armed", [](PyTrigger& t) { return t.trigger().armed(); })
      .def_property_readonly("posts", [](PyTrigger& t) { return t.trigger().posts(); })
      .def_property_readonly("completions", [](PyTrigger& t) { return t.trigger().completions(); });
}

}  // namespace stepmesh::python
