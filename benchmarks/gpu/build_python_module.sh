#!/usr/bin/env bash
# Builds stepmesh's Python package for another interpreter than the one this
# build was made for: on a lent GPU machine, whose python3 (CPython 3.12, with
# torch 2.11) cannot import a module built here for Debian's 3.11 (pybind11
# has no stable ABI). Run from the repository root:
#
#   benchmarks/gpu/build_python_module.sh [PYTHON]     (default: python3)
#
# BUNDLE (default .device-bundle) says where the bundle is (link.txt names its
# files relative to it).
#
# The binding's sources (python/CMakeLists.txt's list, read from there) are
# compiled against PYTHON's headers and the pybind11 it imports (or, when it
# has none or that fails, Debian's 2.10 headers carried in the bundle) and linked with what
# scripts/device-bundle.sh carried in .device-bundle/python: libstepmesh.a,
# the archives and libraries its link line names, Abseil's headers. Writes the
# package to .device-bundle/python/site (PYTHONPATH=that directory), then
# imports it once. Exits 2, saying what is missing, without a compiler,
# Python.h or the bundle.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${1:-python3}
bundle=${BUNDLE:-.device-bundle}
parts=$bundle/python
site=$parts/site
cxx=${CXX:-g++}
missing() {
  echo "build_python_module: $*" >&2
  exit 2
}
[[ -f $parts/link.txt ]] || missing "no $parts/link.txt: run scripts/device-bundle.sh and carry $bundle"
command -v "$cxx" > /dev/null || missing "no C++ compiler ($cxx)"
info=$("$python" -c \
  'import sysconfig; print(sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX"))') ||
  missing "cannot run $python"
read -r pyinc ext <<< "$info"
[[ -f $pyinc/Python.h ]] || missing "no Python.h in $pyinc ($python's headers)"
# The pybind11 the interpreter imports (made for it), then Debian's 2.10, carried.
candidates=()
own=$("$python" -c 'import pybind11; print(pybind11.get_include())' 2> /dev/null || true)
[[ -n $own && -f $own/pybind11/pybind11.h ]] && candidates+=("$own")
candidates+=("$parts/include")
echo "build_python_module: $("$python" -c 'import sys; print(sys.version.split()[0])') at" \
  "$(command -v "$python"), $("$cxx" --version | head -1)"

sources=$(sed -n '/^pybind11_add_module(_stepmesh/,/^)/p' python/CMakeLists.txt |
  grep -o 'src/[a-z0-9_]*\.cc' || true)
[[ -n $sources ]] || missing "no sources in python/CMakeLists.txt's pybind11_add_module(_stepmesh"
objects=$parts/obj
rm -rf "$site"
mkdir -p "$site/stepmesh" "$site/fserver"
start=$SECONDS
compiled=""
for pybind in "${candidates[@]}"; do
  rm -rf "$objects"
  mkdir -p "$objects"
  # Abseil's headers after pybind11's: the carried include/ holds Debian's pybind11 too.
  flags=(-std=c++20 -O2 -g1 -DNDEBUG -fPIC -fvisibility=hidden -Wall -Wextra
    -Wno-unused-parameter -I. -Iinclude -isystem "$pybind" -isystem "$pyinc"
    -isystem "$parts/include")
  # One compiler per core; a failure prints its errors and moves to the next pybind11.
  if printf '%s\n' $sources | xargs -P "$(nproc)" -I{} sh -c \
    'f={}; o="$1/$(basename "$f" .cc).o"; shift; "$@" -c "python/$f" -o "$o"' _ "$objects" \
    "$cxx" "${flags[@]}"; then
    compiled=$pybind
    break
  fi
  echo "build_python_module: the binding did not compile with the pybind11 in $pybind" >&2
done
[[ -n $compiled ]] || missing "the binding compiled with none of: ${candidates[*]}"
echo "build_python_module: compiled with the pybind11 in $compiled"
mapfile -t link < "$parts/link.txt"
link=("${link[@]//@bundle@/$bundle}")
# DT_RPATH, not RUNPATH: the carried libraries' own dependencies (Abseil's on
# each other, hwloc's) are found there too, with no LD_LIBRARY_PATH, which
# would also change the libraries torch finds.
"$cxx" -shared -o "$site/stepmesh/_stepmesh$ext" "$objects"/*.o "${link[@]}" \
  -Wl,--disable-new-dtags,-rpath,"$(cd "$bundle/lib" && pwd)"
# The pure-Python part beside it, as python/CMakeLists.txt lays it out.
cp python/stepmesh/*.py python/stepmesh/*.pyi python/stepmesh/py.typed "$site/stepmesh/"
cp python/compat/fserver_lib.py "$site/"
cp python/compat/fserver/__init__.py "$site/fserver/"
echo "build_python_module: $site/stepmesh/_stepmesh$ext in $((SECONDS - start)) s"
PYTHONPATH=$site "$python" -c \
  'import stepmesh, stepmesh._stepmesh as m; print("build_python_module: imported", m.__file__)'
