#include "python/src/request_items.h"

#include <pybind11/stl.h>

#include <climits>
#include <string>

#include "absl/strings/str_cat.h"
#include "python/src/binding_args.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

size_t RowBytes(const std::unordered_map<Key, Registered>& push_regs, Key key) {
  auto it = push_regs.find(key);
  if (it == push_regs.end()) {
    ThrowStatus(absl::NotFoundError(absl::StrCat("push key ", key, " is not registered")));
  }
  return it->second->row_bytes();
}

// A pull's server rank: an int (not a bool) that fits an int; the library
// checks the range against num_servers.
int ServerArg(py::handle server, Key key) {
  if (PyBool_Check(server.ptr()) || !PyIndex_Check(server.ptr())) {
    ThrowInvalidArgument(absl::StrCat("pull of key ", key, ": server: expected an int rank, got ",
                                      std::string(py::str(server.get_type().attr("__name__")))));
  }
  // numpy integers too (they have __index__), as pybind11's int caster took them.
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(server.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long v = PyLong_AsLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0 || v < INT_MIN || v > INT_MAX) {
    ThrowInvalidArgument(absl::StrCat("pull of key ", key, ": server ",
                                      std::string(py::str(server)), " is out of range"));
  }
  return static_cast<int>(v);
}

}  // namespace

Push ParsePush(py::handle item, std::vector<int>& servers,
               const std::unordered_map<Key, Registered>& push_regs) {
  Push push;
  if (PyLong_Check(item.ptr())) {
    push.key = KeyArg(item, "push");
    return push;
  }
  if (PyTuple_Check(item.ptr()) || PyList_Check(item.ptr())) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(item);
    const size_t len = seq.size();
    if (len < 1 || len > 3) {
      ThrowInvalidArgument("push: expected key, (key, nbytes) or (key, nbytes, servers)");
    }
    push.key = KeyArg(seq[0], "push");
    if (len >= 2 && !seq[1].is_none()) push.bytes = seq[1].cast<size_t>();
    if (len == 3 && !seq[2].is_none()) servers = seq[2].cast<std::vector<int>>();
    return push;
  }
  if (py::hasattr(item, "key") && py::hasattr(item, "rows")) {  // stepmesh.Push
    push.key = KeyArg(item.attr("key"), "push");
    py::object bytes = item.attr("bytes"), rows = item.attr("rows");
    if (!bytes.is_none() && !rows.is_none()) {
      ThrowInvalidArgument(
          absl::StrCat("push of key ", push.key, ": give bytes or rows, not both"));
    }
    if (!bytes.is_none()) push.bytes = bytes.cast<size_t>();
    if (!rows.is_none()) {
      const int64_t r = rows.cast<int64_t>();
      if (r < 0) ThrowInvalidArgument(absl::StrCat("push of key ", push.key, ": rows ", r, " < 0"));
      push.bytes = static_cast<size_t>(r) * RowBytes(push_regs, push.key);
    }
    py::object s = item.attr("servers");
    if (!s.is_none()) servers = s.cast<std::vector<int>>();
    return push;
  }
  ThrowInvalidArgument(absl::StrCat("push: cannot use a ",
                                    std::string(py::str(item.get_type().attr("__name__"))),
                                    " (want int key, tuple or stepmesh.Push)"));
}

Pull ParsePull(py::handle item) {
  Pull pull;
  if (PyTuple_CheckExact(item.ptr()) && PyTuple_GET_SIZE(item.ptr()) == 2) {
    // The common (key, server) tuple of ints without pybind11's casters;
    // anything unusual in it takes the general path below.
    PyObject* server = PyTuple_GET_ITEM(item.ptr(), 1);
    if (PyLong_CheckExact(server)) {
      int overflow = 0;
      const long v = PyLong_AsLongAndOverflow(server, &overflow);
      if (overflow == 0 && v >= INT_MIN && v <= INT_MAX) {
        pull.key = KeyArg(PyTuple_GET_ITEM(item.ptr(), 0), "pull");
        pull.server = static_cast<int>(v);
        return pull;
      }
    }
  }
  if (PyTuple_Check(item.ptr()) || PyList_Check(item.ptr())) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(item);
    if (seq.size() != 2) ThrowInvalidArgument("pull: expected (key, server)");
    pull.key = KeyArg(seq[0], "pull");
    pull.server = ServerArg(seq[1], pull.key);
    return pull;
  }
  if (py::hasattr(item, "key") && py::hasattr(item, "server")) {
    pull.key = KeyArg(item.attr("key"), "pull");
    pull.server = ServerArg(item.attr("server"), pull.key);
    return pull;
  }
  ThrowInvalidArgument(absl::StrCat("pull: cannot use a ",
                                    std::string(py::str(item.get_type().attr("__name__"))),
                                    " (want (key, server) or stepmesh.Pull)"));
}

}  // namespace stepmesh::python
