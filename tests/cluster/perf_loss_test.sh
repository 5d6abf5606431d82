#!/usr/bin/env bash
# stepmesh_perf 1A1F across two emulated hosts at 1 % packet loss on every
# link (payload checksums on, so a changed byte would fail the run): no
# error, and the latency table (t_p99 included) is printed and parsed.
#   perf_loss_test.sh STEPMESH_PERF
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=perf_cluster_lib.sh
source "$here/perf_cluster_lib.sh"
out="$(bash "$here/../../scripts/cluster.sh" run --hosts 2 --rtt-us 50 --gbps 10 --loss 1 -- \
  "$here/perf_on_cluster.sh" "$1" --sizes 917504:1835008 --iters 200 --warmup 20 2>&1)"
perf_cluster_row $? "at 1 % loss" "$out"
read -r _ iters tmin p50 p99 _ <<<"$row"
((iters == 200)) || { echo "FAIL: $iters iterations measured, want 200"; exit 1; }
echo "PASS: 1 % loss, 896 KiB push / 1.75 MiB pull, 10 Gb/s, 50 us RTT asked: p50 ${p50} us, p99 ${p99} us"
