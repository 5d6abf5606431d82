#include "python/src/scheduler_binding.h"

#include <memory>
#include <string>
#include <utility>

#include "python/src/binding_args.h"
#include "python/src/errors.h"
#include "python/src/options_binding.h"
#include "stepmesh/options.h"
#include "stepmesh/scheduler.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

class PyScheduler {
 public:
  explicit PyScheduler(MeshOptions options) {
    options.role = Role::kScheduler;
    absl::StatusOr<std::unique_ptr<Scheduler>> started;
    {
      py::gil_scoped_release release;
      started = Scheduler::Start(options);
    }
    scheduler_ = ValueOrThrow(std::move(started));
    timeout_ = options.timeout;
  }
  ~PyScheduler() {
    py::gil_scoped_release release;
    scheduler_.reset();
  }
  std::string address() const { return scheduler_->address(); }
  void WaitUntilDone(py::handle timeout) {
    const absl::Duration t = TimeoutArg(timeout, timeout_);
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = scheduler_->WaitUntilDone(t);
    }
    ThrowIfError(s);
  }
  void WaitForParticipants() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = scheduler_->WaitForParticipants();
    }
    ThrowIfError(s);
  }
  void Stop() {
    py::gil_scoped_release release;
    scheduler_->Stop();
  }

 private:
  std::unique_ptr<Scheduler> scheduler_;
  absl::Duration timeout_;
};

}  // namespace

void BindScheduler(py::module_& m) {
  py::class_<PyScheduler> scheduler(m, "Scheduler", R"doc(
The rendezvous service, in this process. Scheduler(options=None, **fields);
the default address is 127.0.0.1:0 (a free port: read .address).)doc");
  scheduler
      .def(py::init([](py::handle options, const py::kwargs& kwargs) {
             MeshOptions o = OptionsFrom(options, kwargs);
             if (options.is_none() && !kwargs.contains("scheduler")) o.scheduler = "127.0.0.1:0";
             return std::make_unique<PyScheduler>(std::move(o));
           }),
           py::arg("options") = py::none())
      .def_property_readonly("address", &PyScheduler::address)
      .def("wait_until_done", &PyScheduler::WaitUntilDone, py::arg("timeout") = py::none())
      .def("wait_for_participants", &PyScheduler::WaitForParticipants,
           "Waits while the participants run, however long (Scheduler::WaitForParticipants)")
      .def("stop", &PyScheduler::Stop)
      .def("close", &PyScheduler::Stop);
  scheduler.def("__enter__", [](py::object self) { return self; });
  scheduler.def("__exit__", [](PyScheduler& self, py::handle, py::handle, py::handle) {
    self.Stop();
    return false;
  });
}

}  // namespace stepmesh::python
