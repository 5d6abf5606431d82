#!/usr/bin/env bash
# stepmesh_perf 1A1F across two emulated hosts at 1 % packet loss on every
# link (payload checksums on, so a changed byte would fail the run): no
# error, and the latency table (t_p99 included) is printed and parsed.
#   perf_loss_test.sh STEPMESH_PERF
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(bash "$here/../../scripts/cluster.sh" run --hosts 2 --rtt-us 50 --gbps 10 --loss 1 -- \
  "$here/perf_on_cluster.sh" "$1" --sizes 917504:1835008 --iters 200 --warmup 20 2>&1)"
rc=$?
printf '%s\n' "$out"
((rc == 77)) && exit 77
((rc == 0)) || { echo "FAIL: exited $rc at 1 % loss"; exit 1; }
row="$(grep -E '^ stepmesh +[0-9]+ ' <<<"$out" | head -1)"
[[ -n "$row" ]] || { echo "FAIL: no stepmesh latency row"; exit 1; }
read -r _ iters tmin p50 p99 _ <<<"$row"
((iters == 200)) || { echo "FAIL: $iters iterations measured, want 200"; exit 1; }
echo "PASS: 1 % loss, 896 KiB push / 1.75 MiB pull, 10 Gb/s, 50 us RTT asked: p50 ${p50} us, p99 ${p99} us"
