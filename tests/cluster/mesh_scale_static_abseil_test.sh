#!/usr/bin/env bash
# STEPMESH_STATIC_ABSEIL (CMakeLists.txt, src/CMakeLists.txt): with it ON,
# this build's programs carry Abseil's code themselves and need none of its
# ~40 shared libraries at exec (docs/benchmarks.md, "Scale": mapping them
# was most of a process start); libstepmesh.so always needs Abseil's shared
# libraries (its API is Abseil's types, so it shares the consumer's Abseil).
# With it OFF, the programs need the shared libraries like libstepmesh.so.
#   mesh_scale_static_abseil_test.sh ON|OFF LIBSTEPMESH_SO PROGRAM...
set -uo pipefail
mode=$1 so=$2
shift 2
fails=0
needs_absl() { readelf -d "$1" | grep -c 'NEEDED.*\[libabsl_'; }
# Abseil's code defined in the file itself (its status type's constructor).
defines_absl() { nm -C --defined-only "$1" 2>/dev/null | grep -c ' T absl::.*Status::Status('; }
n=$(needs_absl "$so")
if ((n > 0)); then
  echo "ok:   $so needs $n Abseil shared libraries"
else
  echo "FAIL: $so needs no Abseil shared library: it would carry a private copy"
  fails=$((fails + 1))
fi
for f in "$@"; do
  n=$(needs_absl "$f") d=$(defines_absl "$f")
  if [[ $mode == ON ]]; then
    if ((n == 0 && d > 0)); then
      echo "ok:   $f: Abseil linked in, no Abseil shared library needed"
    else
      echo "FAIL: $f: needs $n Abseil shared libraries, defines Abseil's Status: $d"
      fails=$((fails + 1))
    fi
  elif ((n > 0 && d == 0)); then
    echo "ok:   $f: Abseil shared ($n libraries)"
  else
    echo "FAIL: $f: STEPMESH_STATIC_ABSEIL=OFF, yet it needs $n Abseil shared libraries and defines Abseil's Status: $d"
    fails=$((fails + 1))
  fi
done
((fails == 0))
