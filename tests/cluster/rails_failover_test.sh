#!/usr/bin/env bash
# One rail down: stepmesh_perf 1A1F across two emulated hosts with two TCP
# rails each at 10 Gb/s per rail, 1.75 MiB replies (payload checksums on, so
# a changed byte fails the run), the worker host's data rail (rail 1) set
# down 2 s into the run: every iteration still completes, on rail 0.
#   rails_failover_test.sh STEPMESH_PERF
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=perf_cluster_lib.sh
source "$here/perf_cluster_lib.sh"
out="$(bash "$here/../../scripts/cluster.sh" run --hosts 2 --rails 2 --gbps 10 -- \
  "$here/rails_on_cluster.sh" fault "$1" --sizes 65536:1835008 --iters 3000 --warmup 20 \
  --timeout-ms 4000 2>&1)"
perf_cluster_row $? "with one rail down" "$out"
read -r _ iters _ <<<"$row"
((iters == 3000)) || { echo "FAIL: $iters iterations measured, want 3000"; exit 1; }
grep -q "is down" <<<"$out" || { echo "FAIL: no rail went down"; exit 1; }
echo "PASS: rail 1 down mid-run, 3000 iterations of 64 KiB push / 1.75 MiB pull completed on rail 0"
