#include "python/src/options_binding.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/errors.h"
#include "stepmesh/option_table.h"

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

// An int (not a bool) that fits `Int`.
template <typename Int>
Int CastInteger(py::handle v, const char* f) {
  if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr())) WrongType(v, f, "int");
  try {
    return v.cast<Int>();
  } catch (const py::cast_error&) {
    ThrowInvalidArgument(
        absl::StrCat("MeshOptions.", f, ": ", std::string(py::str(v)),
                     sizeof(Int) == 4 ? " does not fit an int" : " does not fit an int64"));
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

// A field's value as Python sees it, by the field's C++ type: durations in
// seconds, enumerations by name.
py::object ToPy(int v) { return py::int_(v); }
py::object ToPy(int64_t v) { return py::int_(v); }
py::object ToPy(bool v) { return py::bool_(v); }
py::object ToPy(const std::string& v) { return py::str(v); }
py::object ToPy(absl::Duration v) { return py::float_(absl::ToDoubleSeconds(v)); }
py::object ToPy(const std::vector<int>& v) { return py::cast(v); }
py::object ToPy(Role v) { return py::str(std::string(RoleName(v))); }
py::object ToPy(PollMode v) { return py::str(std::string(PollModeName(v))); }
py::object ToPy(GpuDirect v) { return py::str(std::string(GpuDirectName(v))); }
py::object ToPy(AuthMode v) { return py::str(std::string(AuthModeName(v))); }

// Sets a field from Python, refusing another type (a bool for an int, ...);
// `f` names the attribute in errors. Ranges are Validate()'s.
void FromPy(py::handle v, const char* f, int& field) { field = CastInteger<int>(v, f); }
void FromPy(py::handle v, const char* f, int64_t& field) { field = CastInteger<int64_t>(v, f); }
void FromPy(py::handle v, const char* f, bool& field) { field = CastBool(v, f); }
void FromPy(py::handle v, const char* f, std::string& field) { field = CastStr(v, f); }
void FromPy(py::handle v, const char* f, absl::Duration& field) { field = CastSeconds(v, f); }
void FromPy(py::handle v, const char* f, std::vector<int>& field) { field = CastCores(v, f); }
template <typename Enum>
void FromPyEnum(py::handle v, const char* f, Enum& field,
                absl::StatusOr<Enum> (*parse)(absl::string_view)) {
  absl::StatusOr<Enum> parsed = parse(CastStr(v, f));
  if (!parsed.ok())
    ThrowInvalidArgument(absl::StrCat("MeshOptions.", f, ": ", parsed.status().message()));
  field = *parsed;
}
void FromPy(py::handle v, const char* f, Role& field) { FromPyEnum(v, f, field, &ParseRole); }
void FromPy(py::handle v, const char* f, PollMode& field) {
  FromPyEnum(v, f, field, &ParsePollMode);
}
void FromPy(py::handle v, const char* f, GpuDirect& field) {
  FromPyEnum(v, f, field, &ParseGpuDirect);
}
void FromPy(py::handle v, const char* f, AuthMode& field) {
  FromPyEnum(v, f, field, &ParseAuthMode);
}

// One property per row of the option table (stepmesh/option_table.inc), in
// its order; Fields()[i] is OptionTable()[i].
const std::vector<Field>& Fields() {
  static const std::vector<Field>* fields = new std::vector<Field>{
#define STEPMESH_OPTION(name, member, variable, check, parse, default_value, meaning) \
  Field{#name, [](const MeshOptions& o) { return ToPy(o.member); },                   \
        [](MeshOptions& o, py::handle v) { FromPy(v, #name, o.member); }},
#include "stepmesh/option_table.inc"
#undef STEPMESH_OPTION
  };
  return *fields;
}

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
(docs/configuration.md). Durations are seconds (float); role, poll_mode,
rdma_gpudirect and auth are names ("worker", "adaptive", "auto", ...).
One property per row of the option table (stepmesh.option_table()).
)doc");
  cls.def(py::init([](const py::kwargs& kwargs) { return OptionsFrom(py::none(), kwargs); }));
  const absl::Span<const OptionInfo> table = OptionTable();
  for (size_t i = 0; i < table.size(); ++i) {
    const Field& f = Fields()[i];
    const OptionInfo& row = table[i];
    const std::string doc =
        absl::StrCat(row.meaning, " (C++ ", row.member,
                     row.variable.empty() ? "" : absl::StrCat("; ", row.variable), ")");
    cls.def_property(
        f.name, [get = f.get](const MeshOptions& o) { return get(o); },
        [set = f.set](MeshOptions& o, py::handle v) { set(o, v); }, doc.c_str());
  }
  m.def(
      "option_table",
      [] {
        py::list rows;
        for (const OptionInfo& row : OptionTable()) {
          py::dict d;
          d["name"] = std::string(row.name);
          d["member"] = std::string(row.member);
          d["variable"] = std::string(row.variable);
          d["accepts"] = row.check.Describe();
          d["default"] = std::string(row.default_value);
          d["meaning"] = std::string(row.meaning);
          rows.append(std::move(d));
        }
        return rows;
      },
      "The option table (stepmesh/option_table.inc): one dict per MeshOptions field, in order\n"
      "(name, member, variable, accepts, default, meaning).");
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
