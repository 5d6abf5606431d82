#include "python/src/store_binding.h"

#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace py = pybind11;

namespace stepmesh::python {
namespace {

// A Python store called from the library's threads: every call takes the GIL
// (the binding releases it around anything that may block), and a Python
// exception becomes a status naming the method.
class PyStore final : public RendezvousStore {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

  absl::Status Set(const std::string& key, const std::string& value) override {
    return Call("set", [&] { store_.attr("set")(key, py::bytes(value)); });
  }

  absl::StatusOr<std::string> Get(const std::string& key) override {
    std::string out;
    absl::Status s = Call("get", [&] { out = store_.attr("get")(key).cast<std::string>(); });
    if (!s.ok()) return s;
    return out;
  }

  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    absl::Status s = Call("add", [&] { out = store_.attr("add")(key, delta).cast<int64_t>(); });
    if (!s.ok()) return s;
    return out;
  }

  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    return Call("wait", [&] {
      py::object timedelta = py::module_::import("datetime").attr("timedelta");
      store_.attr("wait")(keys, timedelta(py::arg("seconds") = absl::ToDoubleSeconds(timeout)));
    });
  }

 private:
  template <typename F>
  absl::Status Call(const char* method, F f) {
    py::gil_scoped_acquire gil;
    try {
      f();
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      const std::string what = e.what();
      const std::string message = absl::StrCat("store.", method, "(): ", what);
      const std::string lower = absl::AsciiStrToLower(what);
      if (absl::StrContains(lower, "timeout") || absl::StrContains(lower, "timed out")) {
        return absl::DeadlineExceededError(message);
      }
      return absl::UnavailableError(message);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("store.", method, "(): ", e.what()));
    }
  }

  py::object store_;
};

}  // namespace

std::pair<py::kwargs, std::shared_ptr<RendezvousStore>> SplitStore(const py::kwargs& kwargs) {
  py::kwargs rest;
  std::shared_ptr<RendezvousStore> store;
  for (auto item : kwargs) {
    if (py::str(item.first).cast<std::string>() == "store") {
      if (!item.second.is_none()) {
        for (const char* m : {"set", "get", "add", "wait"}) {
          if (!py::hasattr(item.second, m)) {
            throw py::type_error(absl::StrCat(
                "store: want an object with set/get/add/wait (torch.distributed.Store); it has no ",
                m, "()"));
          }
        }
        store = std::make_shared<PyStore>(py::reinterpret_borrow<py::object>(item.second));
      }
      continue;
    }
    rest[item.first] = item.second;
  }
  return {std::move(rest), std::move(store)};
}

}  // namespace stepmesh::python
