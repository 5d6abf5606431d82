#!/usr/bin/env bash
# Two TCP rails against one (docs/benchmarks.md, "TCP rails"): stepmesh_perf
# 1A1F across two emulated hosts (scripts/cluster.sh --rails 2), each rail a
# tbf-limited link of --gbps (10 by default), a 64 KiB push answered by a
# 1.75 MiB reply; first with one rail (STEPMESH_TCP_RAILS unset), then with
# both (the reply striped), in the same run and the same cluster. Prints both
# latency rows and the ratio of the p50s, one rail / two rails (≈ 2 when the
# link is what limits; the machine's load shows in how far below 2 it is).
# Needs root (network namespaces). Not a test: nothing is asserted.
#   benchmarks/tcp_rails_bench.sh BUILD_DIR [--gbps G] [--iters N] [--reps R]
set -uo pipefail
build="${1:?usage: tcp_rails_bench.sh BUILD_DIR [--gbps G] [--iters N] [--reps R]}"
shift
gbps=10 iters=300 reps=3
while (($#)); do
  case "$1" in
    --gbps) gbps="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    *) echo "tcp_rails_bench.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
perf="$build/benchmarks/stepmesh_perf"
[[ -x "$perf" ]] || { echo "tcp_rails_bench.sh: no $perf" >&2; exit 2; }
run="$here/../tests/cluster/rails_on_cluster.sh"
inner() {
  local one two
  for ((r = 0; r < reps; ++r)); do
    for mode in single rails; do
      row="$("$run" "$mode" "$perf" --sizes 65536:1835008 --iters "$iters" --warmup 20 |
        grep -E '^ stepmesh +[0-9]+ ' | head -1)"
      [[ -n "$row" ]] || { echo "tcp_rails_bench.sh: $mode produced no latency row" >&2; exit 1; }
      echo "$mode rep $r: $row"
    done
  done
}
export -f inner
export run perf iters reps
out="$(bash "$here/../scripts/cluster.sh" run --hosts 2 --rails 2 --gbps "$gbps" -- bash -c inner 2>&1)"
rc=$?
printf '%s\n' "$out"
((rc == 0)) || exit "$rc"
# Columns of the row: name iters min p50 p99 ...
# The p50 ratio, and the t_min one (the least disturbed by a loaded machine).
awk -v gbps="$gbps" 'BEGIN { n1 = 0; n2 = 0 }

  /^single rep/ { s[n1] = $7; sm[n1++] = $6 }
  /^rails rep/  { t[n2] = $7; tm[n2++] = $6 }
  END {
    for (i = 0; i < n1 && i < n2; ++i) {
      printf "rep %d: p50 one rail %s us, two rails %s us, ratio %.2f; t_min ratio %.2f\n", i,
        s[i], t[i], s[i] / t[i], sm[i] / tm[i]
      a += s[i]; b += t[i]; c += sm[i]; d += tm[i]
    }
    printf "1.75 MiB reply at %s Gb/s per rail: one rail / two rails = %.2f at p50, %.2f at t_min (mean of %d reps)\n",
      gbps, a / b, c / d, n1
  }' <<<"$out"
