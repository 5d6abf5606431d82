#pragma once
// stepmesh.Trigger (stepmesh/trigger.h): device-triggered
// posting of a prepared request, so that a captured graph's replay sends
// again. Worker.create_trigger() makes one; Plan.trigger_target() hands it the
// request as it stands; arm() returns a slot whose go/done words the stream
// increments (post_on) and waits on (wait_on).

#include <pybind11/pybind11.h>

#include <memory>
#include <unordered_map>

#include "absl/types/span.h"
#include "python/src/stream_binding.h"
#include "stepmesh/trigger.h"
#include "stepmesh/worker.h"

namespace stepmesh::python {

// A plan's request frozen at the call (its pushes' byte counts included), for
// Trigger.arm; `keep` holds the plan (and so its registered tensors).
struct PyTriggerTarget {
  TriggerTarget target;
  pybind11::object keep;
};

// The callbacks posting `prepared` on `node` from the trigger's thread (no
// GIL, no Python, no lookup: AFTensorWorker::Post), and checking it.
TriggerTarget PreparedTriggerTarget(AFTensorWorker& node,
                                    std::shared_ptr<const PreparedRequest> prepared);

class PyTrigger {
 public:
  PyTrigger(Backend& backend, int capacity, double timeout);
  ~PyTrigger();
  int Arm(PyTriggerTarget& target, pybind11::handle writes);
  void PostOn(int slot, pybind11::handle stream);
  void WaitOn(int slot, pybind11::handle stream);
  void Disarm(int slot, double timeout);
  void Check();
  void Close();
  Trigger& trigger();
  const Trigger::Armed& armed(int slot);

 private:
  StreamArgs streams_;
  std::unique_ptr<Trigger> trigger_;
  std::unordered_map<int, Trigger::Armed> armed_;
  std::unordered_map<int, pybind11::object> keep_;
};

void BindTrigger(pybind11::module_& m);

}  // namespace stepmesh::python
