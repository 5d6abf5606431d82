#!/usr/bin/env bash
# What a stepmesh process maps at exec (docs/benchmarks.md, "Scale"): 128
# participants on one machine start 128 processes, and each pays the dynamic
# loader for every library it needs. libcurl (only the etcd rendezvous speaks
# HTTP) and its ~30 dependencies made that 13.9 ms of CPU per start instead of
# 5.4; it is now loaded when an etcd client is made
# (src/rendezvous/etcd/curl_library.h). This holds both the shared library and
# a program linked with the static one to that: neither may need libcurl.
#   startup_libraries_test.sh LIBSTEPMESH_SO PROGRAM
set -uo pipefail
fails=0
for f in "$@"; do
  needed="$(readelf -d "$f" | awk '/NEEDED/ {gsub(/[\[\]]/, "", $5); print $5}')"
  [[ -n "$needed" ]] || { echo "FAIL: readelf found no NEEDED entries in $f"; exit 1; }
  if grep -q '^libcurl' <<<"$needed"; then
    echo "FAIL: $f needs $(grep '^libcurl' <<<"$needed" | tr '\n' ' ')at exec"
    fails=$((fails + 1))
  else
    echo "ok:   $f: $(wc -l <<<"$needed") libraries needed, no libcurl"
  fi
done
((fails == 0))
