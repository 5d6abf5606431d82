#include "python/src/options_binding.h"

#include <pybind11/stl.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/errors.h"

namespace stepmesh::python {
namespace py = pybind11;

namespace {

// One row per MeshOptions field: its Python name, how to read it and how to set it.
struct Field {
  const char* name;
  std::function<py::object(const MeshOptions&)> get;
  std::function<void(MeshOptions&, py::handle)> set;
};

[[noreturn]] void WrongType(py::handle value, const char* field, const char* want) {
  ThrowInvalidArgument(absl::StrCat("MeshOptions.", field, ": expected ", want, ", got ",
                                    std::string(py::str(value.get_type().attr("__name__")))));
}

int CastInt(py::handle v, const char* f) {
  if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr())) WrongType(v, f, "int");
  try {
    return v.cast<int>();
  } catch (const py::cast_error&) {
    ThrowInvalidArgument(
        absl::StrCat("MeshOptions.", f, ": ", std::string(py::str(v)), " does not fit an int"));
  }
}
bool CastBool(py::handle v, const char* f) {
  if (!PyBool_Check(v.ptr())) WrongType(v, f, "bool");
  return v.cast<bool>();
}
std::string CastStr(py::handle v, const char* f) {
  if (!PyUnicode_Check(v.ptr())) WrongType(v, f, "str");
  return v.cast<std::string>();
}
absl::Duration CastSeconds(py::handle v, const char* f) {
  if (PyBool_Check(v.ptr()) || !(PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()))) {
    WrongType(v, f, "seconds (float)");
  }
  const double s = v.cast<double>();
  if (!(s >= 0)) ThrowInvalidArgument(absl::StrCat("MeshOptions.", f, ": ", s, " s is negative"));
  return absl::Seconds(s);
}
std::vector<int> CastCores(py::handle v, const char* f) {
  if (PyUnicode_Check(v.ptr())) WrongType(v, f, "list of core ids");
  try {
    return v.cast<std::vector<int>>();
  } catch (const py::cast_error&) {
    WrongType(v, f, "list of core ids");
  }
}

Role ParseRoleName(const std::string& name) {
  if (name == "worker") return Role::kWorker;
  if (name == "server") return Role::kServer;
  if (name == "scheduler") return Role::kScheduler;
  ThrowInvalidArgument(
      absl::StrCat("MeshOptions.role: '", name, "' (want worker, server or scheduler)"));
}

#define SM_INT(field)                                                                                 \
  Field {                                                                                             \
#field,                                                                                           \
        [](const MeshOptions&                                                                         \
               o) { return py::object(py::int_(o.field)); },                                          \
                                                          [](MeshOptions & o,                         \
                                                             py::handle                               \
                                                                 v) { o.field =                       \
                                                                          CastInt(v, #field); } \
  }
#define SM_STR(field)                                                                                \
  Field {                                                                                            \
#field,                                                                                          \
        [](const MeshOptions&                                                                        \
               o) { return py::object(py::str(o.field)); },                                          \
                                                         [](MeshOptions & o,                         \
                                                            py::handle                               \
                                                                v) { o.field = CastStr(v, #field); } \
  }
// Python attributes are flat (rdma_port); the C++ field may be nested (rdma.port).
#define SM_INT_AS(name, member)                                                \
  Field {                                                                      \
    name, [](const MeshOptions& o) { return py::object(py::int_(o.member)); }, \
        [](MeshOptions& o, py::handle v) { o.member = CastInt(v, name); }      \
  }
#define SM_STR_AS(name, member)                                               \
  Field {                                                                     \
    name, [](const MeshOptions& o) { return py::object(py::str(o.member)); }, \
        [](MeshOptions& o, py::handle v) { o.member = CastStr(v, name); }     \
  }
#define SM_SECONDS(name, member)                                              \
  Field {                                                                     \
    name,                                                                     \
        [](const MeshOptions& o) {                                            \
          return py::object(py::float_(absl::ToDoubleSeconds(o.member)));     \
        },                                                                    \
        [](MeshOptions& o, py::handle v) { o.member = CastSeconds(v, name); } \
  }

const std::vector<Field>& Fields() {
  static const std::vector<Field>* fields = new std::vector<Field>{
      {"role",
       [](const MeshOptions& o) { return py::object(py::str(std::string(RoleName(o.role)))); },
       [](MeshOptions& o, py::handle v) { o.role = ParseRoleName(CastStr(v, "role")); }},
      SM_INT(rank),
      SM_INT(num_workers),
      SM_INT(num_servers),
      SM_INT(max_workers),
      SM_INT(max_servers),
      SM_STR(scheduler),
      SM_STR(rendezvous),
      SM_STR(bind_host),
      SM_STR(node_host),
      SM_STR(interface),
      SM_STR(transport),
      SM_STR(backend),
      SM_INT(device),
      SM_STR_AS("rdma_device", rdma.device),
      SM_INT_AS("rdma_port", rdma.port),
      SM_INT_AS("rdma_gid_index", rdma.gid_index),
      SM_STR_AS("rdma_interface", rdma.interface),
      SM_INT_AS("rdma_traffic_class", rdma.traffic_class),
      SM_INT_AS("rdma_service_level", rdma.service_level),
      SM_INT_AS("rdma_path_mtu", rdma.path_mtu),
      SM_INT_AS("rdma_ack_timeout", rdma.ack_timeout),
      SM_INT_AS("rdma_retry_count", rdma.retry_count),
      SM_INT_AS("rdma_rnr_retry", rdma.rnr_retry),
      SM_INT_AS("rdma_min_rnr_timer", rdma.min_rnr_timer),
      SM_INT_AS("rdma_recv_depth", rdma.recv_depth),
      SM_INT_AS("rdma_qps_per_peer", rdma.qps_per_peer),
      SM_INT_AS("rdma_stripe_min_bytes", rdma.stripe_min_bytes),
      {"rdma_gpudirect",
       [](const MeshOptions& o) {
         return py::object(py::str(std::string(GpuDirectName(o.rdma.gpudirect))));
       },
       [](MeshOptions& o, py::handle v) {
         o.rdma.gpudirect = ValueOrThrow(ParseGpuDirect(CastStr(v, "rdma_gpudirect")));
       }},
      {"poll_mode",
       [](const MeshOptions& o) {
         return py::object(py::str(std::string(PollModeName(o.threads.poll_mode))));
       },
       [](MeshOptions& o, py::handle v) {
         o.threads.poll_mode = ValueOrThrow(ParsePollMode(CastStr(v, "poll_mode")));
       }},
      SM_SECONDS("spin_budget", threads.spin_budget),
      {"send_cores",
       [](const MeshOptions& o) { return py::object(py::cast(o.threads.send_cores)); },
       [](MeshOptions& o, py::handle v) { o.threads.send_cores = CastCores(v, "send_cores"); }},
      {"recv_cores",
       [](const MeshOptions& o) { return py::object(py::cast(o.threads.recv_cores)); },
       [](MeshOptions& o, py::handle v) { o.threads.recv_cores = CastCores(v, "recv_cores"); }},
      {"auto_pin", [](const MeshOptions& o) { return py::object(py::bool_(o.threads.auto_pin)); },
       [](MeshOptions& o, py::handle v) { o.threads.auto_pin = CastBool(v, "auto_pin"); }},
      SM_SECONDS("timeout", timeout),
      SM_SECONDS("heartbeat_interval", heartbeat_interval),
      SM_INT(max_inflight_requests),
      SM_INT(max_registrations),
      SM_STR(auth_token),
      {"payload_checksum",
       [](const MeshOptions& o) { return py::object(py::bool_(o.payload_checksum)); },
       [](MeshOptions& o, py::handle v) { o.payload_checksum = CastBool(v, "payload_checksum"); }},
      {"trace", [](const MeshOptions& o) { return py::object(py::bool_(o.trace.enabled)); },
       [](MeshOptions& o, py::handle v) { o.trace.enabled = CastBool(v, "trace"); }},
      {"trace_events", [](const MeshOptions& o) { return py::object(py::int_(o.trace.events)); },
       [](MeshOptions& o, py::handle v) { o.trace.events = CastInt(v, "trace_events"); }},
      // fserver_lib's launch settings (FserverOptions), for python/stepmesh/fserver.py.
      SM_STR_AS("fserver_role", fserver.role),
      SM_INT_AS("fserver_group_size", fserver.group_size),
      SM_INT_AS("fserver_node_rank", fserver.node_rank),
      SM_INT_AS("fserver_rank_offset", fserver.rank_offset),
      SM_INT_AS("fserver_instance_id", fserver.instance_id),
      SM_INT_AS("fserver_gpu", fserver.gpu),
  };
  return *fields;
}

#undef SM_INT
#undef SM_STR
#undef SM_SECONDS

void Apply(MeshOptions& options, const py::kwargs& kwargs) {
  for (const auto& [key, value] : kwargs) {
    const std::string name = key.cast<std::string>();
    const Field* field = nullptr;
    for (const Field& f : Fields()) {
      if (name == f.name) field = &f;
    }
    if (field == nullptr) {
      ThrowInvalidArgument(
          absl::StrCat("unknown MeshOptions field '", name, "' (see help(stepmesh.MeshOptions))"));
    }
    field->set(options, value);
  }
}

}  // namespace

MeshOptions OptionsFrom(py::handle options, const py::kwargs& kwargs) {
  MeshOptions result;
  if (!options.is_none()) {
    if (!py::isinstance<MeshOptions>(options)) {
      ThrowInvalidArgument(absl::StrCat("options: expected stepmesh.MeshOptions, got ",
                                        std::string(py::str(options.get_type().attr("__name__")))));
    }
    result = options.cast<const MeshOptions&>();
  }
  Apply(result, kwargs);
  return result;
}

void BindOptions(py::module_& m) {
  py::class_<MeshOptions> cls(m, "MeshOptions", R"doc(
Configuration of one mesh participant (mirrors the C++ stepmesh::MeshOptions).

MeshOptions(**fields) sets any field by name; MeshOptions.from_env(**fields)
starts from those fields and overlays every set STEPMESH_* / DMLC_* variable
(docs/configuration.md). Durations are seconds (float); role, poll_mode and
rdma_gpudirect are names ("worker", "adaptive", "auto", ...).
)doc");
  cls.def(py::init([](const py::kwargs& kwargs) { return OptionsFrom(py::none(), kwargs); }));
  for (const Field& f : Fields()) {
    cls.def_property(
        f.name, [get = f.get](const MeshOptions& o) { return get(o); },
        [set = f.set](MeshOptions& o, py::handle v) { set(o, v); });
  }
  cls.def_static(
      "from_env",
      [](const py::kwargs& kwargs) {
        MeshOptions base = OptionsFrom(py::none(), kwargs);
        return ValueOrThrow(MeshOptions::FromEnv(base));
      },
      "The given fields with every set STEPMESH_* / DMLC_* variable applied on top.");
  m.def(
      "environment_value",
      [](const std::string& name) { return ValueOrThrow(EnvironmentValue(name)); }, py::arg("name"),
      "The value of a variable of the environment table (None when unset); raises "
      "stepmesh.NotFound for a name the table does not document.");
  cls.def(
      "validate", [](const MeshOptions& o) { ThrowIfError(o.Validate()); },
      "Raises stepmesh.InvalidArgument naming the first bad field.");
  cls.def(
      "copy",
      [](const MeshOptions& o, const py::kwargs& kwargs) {
        MeshOptions copy = o;
        Apply(copy, kwargs);
        return copy;
      },
      "A copy with the given fields changed.");
  cls.def("to_dict", [](const MeshOptions& o) {
    py::dict d;
    for (const Field& f : Fields()) d[f.name] = f.get(o);
    return d;
  });
  cls.def("__repr__", [](const MeshOptions& o) {
    std::string s = "MeshOptions(";
    bool first = true;
    for (const Field& f : Fields()) {
      if (std::string(f.name) == "auth_token") continue;  // a secret: never printed
      if (std::string(f.name) == "rendezvous" && o.rendezvous.find('@') != std::string::npos) {
        absl::StrAppend(&s, first ? "" : ", ", "rendezvous='<with credentials>'");
        first = false;
        continue;  // etcd://USER:PASSWORD@...: the password is a secret
      }
      absl::StrAppend(&s, first ? "" : ", ", f.name, "=", std::string(py::repr(f.get(o))));
      first = false;
    }
    return s + ")";
  });
}

}  // namespace stepmesh::python
