"""The option table (include/stepmesh/option_table.inc) against everything that
lists options: the C++ structs in options.h, the Python MeshOptions, its
stubs (_stepmesh.pyi), the generated docs, FromEnv and Validate()."""
import pathlib
import re

import pytest

import stepmesh

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = stepmesh.option_table()

# MeshOptions members that are structs of their own, and the prefix their
# fields carry in the table.
NESTED = {"RdmaOptions": "rdma.", "ThreadingOptions": "threads.", "TraceOptions": "trace.",
          "FserverOptions": "fserver."}


def struct_fields(header, struct):
    """The data members declared in `struct ... {` of `header`, in order."""
    text = header.read_text()
    m = re.search(r"struct (?:STEPMESH_EXPORT )?%s \{\n(.*?)\n\};" % struct, text, re.S)
    assert m, f"struct {struct} not found in {header}"
    fields = []
    for line in m.group(1).split("\n"):
        line = line.split("//")[0].strip()
        decl = line[:-1].split("=")[0].split("{")[0].strip()
        if not line.endswith(";") or "(" in decl or line.startswith(("static", "using")):
            continue  # a method, or not a declaration
        typ, name = decl.rsplit(" ", 1)
        fields.append((typ.strip(), name.strip()))
    return fields


def cpp_members():
    header = ROOT / "include/stepmesh/options.h"
    members = []
    for typ, name in struct_fields(header, "MeshOptions"):
        if typ in NESTED:
            members += [NESTED[typ] + n for _, n in struct_fields(header, typ)]
        else:
            members.append(name)
    return members


def test_every_field_of_options_h_has_one_row():
    members = cpp_members()
    table = [row["member"] for row in TABLE]
    assert len(members) > 50  # the parse found the structs
    missing = [m for m in members if m not in table]
    assert not missing, f"fields of options.h with no row in option_table.inc: {missing}"
    unknown = [m for m in table if m not in members]
    assert not unknown, f"rows naming no field of options.h: {unknown}"
    assert len(set(table)) == len(table), "a field has two rows"


def test_python_options_have_one_property_per_row():
    properties = [n for n in dir(stepmesh.MeshOptions)
                  if isinstance(getattr(stepmesh.MeshOptions, n), property)]
    names = [row["name"] for row in TABLE]
    assert sorted(properties) == sorted(names)
    assert list(stepmesh.MeshOptions().to_dict()) == names  # table order
    for row in TABLE:  # each property's doc is its row's
        assert row["meaning"] in getattr(stepmesh.MeshOptions, row["name"]).__doc__


def test_stubs_list_every_property_with_its_type():
    stub = (ROOT / "python/stepmesh/_stepmesh.pyi").read_text()
    body = re.search(r"class MeshOptions:\n(.*?)\n    def ", stub, re.S).group(1)
    declared = dict(re.findall(r"^    (\w+): (.+)$", body, re.M))
    assert list(declared) == [row["name"] for row in TABLE]
    spelled = {bool: "bool", int: "int", float: "float", str: "str", list: "List[int]"}
    defaults = stepmesh.MeshOptions()
    for name, typ in declared.items():
        assert typ == spelled[type(getattr(defaults, name))], name


def test_docs_list_every_field_and_variable():
    page = (ROOT / "docs/configuration.md").read_text()
    for row in TABLE:
        assert f"| `{row['member']}` | `{row['name']}` |" in page, row["name"]
        if row["variable"]:
            assert f"| `{row['variable']}` |" in page, row["variable"]


def out_of_range(accepts):
    """A value outside "lo..hi" / ">= lo", or None."""
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)|>= (-?\d+)", accepts)
    if not m:
        return None
    return int(m.group(1) if m.group(1) is not None else m.group(3)) - 1


@pytest.mark.parametrize("row", [r for r in TABLE if out_of_range(r["accepts"]) is not None],
                         ids=lambda r: r["name"])
def test_validate_refuses_outside_the_row_naming_field_and_variable(row):
    o = stepmesh.MeshOptions(**{row["name"]: out_of_range(row["accepts"])})
    with pytest.raises(stepmesh.InvalidArgument) as e:
        o.validate()
    assert f"{row['member']}={out_of_range(row['accepts'])}" in str(e.value)
    assert f"({row['variable']})" in str(e.value)
    assert row["accepts"] in str(e.value)


@pytest.mark.parametrize("row", [r for r in TABLE if " or " in r["accepts"]],
                         ids=lambda r: r["name"])
def test_names_outside_the_row_are_refused(row, monkeypatch):
    default = getattr(stepmesh.MeshOptions(), row["name"])
    if isinstance(default, int):  # path_mtu: integers
        with pytest.raises(stepmesh.InvalidArgument, match=row["variable"]):
            stepmesh.MeshOptions(**{row["name"]: 1500}).validate()
    else:
        # an enumeration's setter names the attribute; a string's check its variable
        with pytest.raises(stepmesh.InvalidArgument, match=f"{row['name']}|{row['variable']}"):
            stepmesh.MeshOptions(**{row["name"]: "bogus"}).validate()
    monkeypatch.setenv(row["variable"], "bogus")
    with pytest.raises(stepmesh.InvalidArgument, match=f"{row['variable']}='bogus'"):
        stepmesh.MeshOptions.from_env()


def a_value_not_the_default(row, default):
    """A value of the row's variable that Validate() accepts and that is not the default."""
    accepts = row["accepts"]
    if " or " in accepts:  # names (or the integers allowed)
        return next(n for n in accepts.replace(" or ", ", ").split(", ") if n != str(default))
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)|>= (-?\d+)", accepts)
    if m:
        lo = int(m.group(1) if m.group(1) is not None else m.group(3))
        return str(lo if lo != default else lo + 1)
    special = {"rank": "0", "scheduler": "h:1", "rendezvous": "scheduler://h:1",
               "trace": "false", "fserver_role": "joint"}
    if row["name"] in special:
        return special[row["name"]]
    return {bool: "true", int: "3", float: "7s", str: "x", list: "5"}[type(default)]


@pytest.mark.parametrize("row", [r for r in TABLE if r["variable"]], ids=lambda r: r["name"])
def test_each_variable_sets_its_field(row, monkeypatch):
    defaults = stepmesh.MeshOptions()
    default = getattr(defaults, row["name"])
    monkeypatch.setenv(row["variable"], a_value_not_the_default(row, default))
    if row["name"] == "auth":  # auth=on needs a token
        monkeypatch.setenv("STEPMESH_AUTH_TOKEN", "t")
    assert getattr(stepmesh.MeshOptions.from_env(), row["name"]) != default, row["variable"]
