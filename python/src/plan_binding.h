#pragma once
// stepmesh.Plan: a request prepared once and posted many times
// (Worker.prepare): the item lists are parsed here once and the request
// prepared in the library (AFTensorWorker::Prepare), so a post does no Python
// parsing and no lookup, and run() posts and waits under a single GIL release
// without creating a Python object. The plan holds no tensor: a key
// unregistered since makes it stale, and the library refuses to post it
// (FailedPrecondition).

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "python/src/worker_binding.h"
#include "stepmesh/trigger.h"
#include "stepmesh/worker.h"

namespace stepmesh::python {

class PyPlan {
 public:
  PyPlan(PyWorker& worker, pybind11::handle pushes, pybind11::handle pulls);

  RequestRef Post(pybind11::handle stream);

  void Run(pybind11::handle timeout, pybind11::handle stream);

  // Plan.run_many(n, timeout): see PyWorker::RunPreparedMany.
  std::vector<int64_t> RunMany(pybind11::handle n_arg, pybind11::handle timeout);

  // Plan.set_bytes / set_rows: push i's byte count changed in place (no
  // re-parsing, no lookup by key), for requests whose keys stay and whose
  // sizes follow the step's token count. Checked here against the tensor
  // registered at preparation, so a bad count fails at the call that set it.
  // A request already posted is unaffected (Post copies the counts).
  void SetBytes(size_t i, pybind11::handle bytes_arg);
  void SetRows(size_t i, pybind11::handle rows_arg);
  size_t bytes(size_t i) const;

  // For stepmesh.vllm's attention lanes (python/src/attention_lanes.h), which
  // check their counts against their own buffers first: push `i`'s row size,
  // and push `i` sends `bytes` bytes (refused while another thread posts).
  size_t RowBytes(size_t i) const;
  void SetCount(size_t i, size_t bytes) {
    CheckWritable("send");
    ThrowIfError(prepared_.SetBytes(i, bytes));
  }

  std::optional<RequestRef> last() const {
    if (!last_.valid()) return std::nullopt;
    return RequestRef{last_};
  }
  size_t num_pushes() const { return prepared_.num_pushes(); }
  size_t num_pulls() const { return prepared_.num_pulls(); }
  // Plan.trigger_target(): the request as it stands now (its byte counts
  // included), prepared afresh for the trigger's thread to post, so later
  // set_bytes/set_rows on this plan do not race the trigger.
  TriggerTarget TriggerTargetNow();

 private:
  static constexpr long long kMaxRunMany = 10'000'000;

  // Counts the calls that read the prepared request with the GIL released
  // (post, run, run_many, from any thread); set_rows/set_bytes, which hold
  // the GIL, refuse to write it meanwhile.
  struct Posting {
    explicit Posting(PyPlan& p) : plan(p) { ++plan.posting_; }
    ~Posting() { --plan.posting_; }
    PyPlan& plan;
  };

  void CheckWritable(const char* what) const;
  void CheckPushIndex(size_t i, const char* what) const;
  // set_bytes / set_rows' argument: an int (not a bool) for push `i`, once the
  // plan may be written and `i` is a push; `name` names it in errors.
  long long CountArg(size_t i, pybind11::handle arg, const char* what, const char* name) const;
  void SetPushBytes(size_t i, long long b, const std::string& shown, const char* what,
                    const char* name);

  PyWorker& worker_;  // kept alive by the Python plan object (keep_alive)
  PreparedRequest prepared_;
  pybind11::object pushes_arg_;  // as given: trigger_target prepares them again
  pybind11::object pulls_arg_;
  absl::Duration default_timeout_;
  RequestHandle last_;
  int posting_ = 0;  // Posting scopes in progress (read and written holding the GIL)
};

void BindPlan(pybind11::module_& m);

}  // namespace stepmesh::python
