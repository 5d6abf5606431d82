#!/usr/bin/env bash
# Two TCP rails against one (docs/benchmarks.md, "TCP rails"), in the same run
# and the same emulated cluster (scripts/cluster.sh --hosts 2 --rails 2, each
# rail a tbf-limited link of --gbps, 10 by default): a 64 KiB push answered by
# a 1.75 MiB reply, four ways, interleaved per repetition:
#   floor1  tcp_rails_floor --sockets 1: one hand-written socket
#   floor2  tcp_rails_floor --sockets 2: the reply in two pieces, one socket
#           per rail, written and read by one thread per socket
#   single  stepmesh_perf 1A1F, one rail (STEPMESH_TCP_RAILS unset)
#   rails   stepmesh_perf 1A1F, both rails (the reply striped)
# Prints each row, the bytes each rail's link carried (tc counters of the
# replying host's egress, and its drops), the load average, and per
# repetition the ratios one / two (ours and the floor's, at p50 and t_min)
# and ours / the floor, then the median of each ratio over the repetitions. Payload checksums are off (the floor has none);
# --checksum turns them on for ours (their cost then shows against the floor).
# Needs root (network namespaces). Not a test: nothing is asserted.
#   benchmarks/tcp_rails_bench.sh BUILD_DIR [--gbps G] [--iters N] [--reps R] [--checksum]
set -uo pipefail
build="${1:?usage: tcp_rails_bench.sh BUILD_DIR [--gbps G] [--iters N] [--reps R] [--checksum]}"
shift
gbps=10 iters=300 reps=3 checksum=0
while (($#)); do
  case "$1" in
    --gbps) gbps="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --checksum) checksum=1; shift ;;
    *) echo "tcp_rails_bench.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
perf="$build/benchmarks/stepmesh_perf"
floor="$build/benchmarks/tcp_rails_floor"
for b in "$perf" "$floor"; do
  [[ -x "$b" ]] || { echo "tcp_rails_bench.sh: no $b" >&2; exit 2; }
done
run="$here/../tests/cluster/rails_on_cluster.sh"
inner() {
  IFS=, read -ra ns <<<"$CLUSTER_HOSTS"
  IFS=, read -ra ip0 <<<"$CLUSTER_ADDRS"
  IFS=, read -ra ip1 <<<"$CLUSTER_ADDRS1"
  local to="${ip0[0]}:29400,${ip1[0]}:29400" fpid row r mode
  ip netns exec "${ns[0]}" timeout 900 "$floor" --role server --listen "$to" \
    --sessions $((2 * reps)) --deadline-s 880 &
  fpid=$!
  # What each rail's link carried: the replying host's egress qdisc.
  sent_of() {  # rail -> "bytes dropped"
    ip netns exec "${ns[0]}" tc -s qdisc show dev "r$1" |
      awk '/Sent/ { b = $2; d = $7; sub(",", "", d); print b, d; exit }'
  }
  for ((r = 0; r < reps; ++r)); do
    echo "load rep $r: $(cut -d' ' -f1-3 /proc/loadavg)"
    for mode in floor1 floor2 single rails; do
      read -r b0 d0 <<<"$(sent_of 0)"
      read -r b1 d1 <<<"$(sent_of 1)"
      case "$mode" in
        floor*)
          row="$(ip netns exec "${ns[1]}" timeout 300 "$floor" --role client --connect "$to" \
            --sockets "${mode#floor}" --iters "$iters" --warmup 20 | head -1)" ;;
        *)
          row="$(RAILS_CHECKSUM="$checksum" "$run" "$mode" "$perf" --sizes 65536:1835008 \
            --iters "$iters" --warmup 20 --reps 1 | grep -E '^ stepmesh +[0-9]+ ' | head -1)" ;;
      esac
      [[ -n "$row" ]] || { echo "tcp_rails_bench.sh: $mode produced no latency row" >&2; return 1; }
      echo "$mode rep $r: $row"
      read -r a0 e0 <<<"$(sent_of 0)"
      read -r a1 e1 <<<"$(sent_of 1)"
      echo "$mode rep $r: link bytes rail 0 $((a0 - b0)) rail 1 $((a1 - b1))," \
        "dropped $((e0 - d0)) / $((e1 - d1))"
    done
  done
  kill "$fpid" 2>/dev/null
  wait "$fpid" 2>/dev/null
  return 0
}
export -f inner
export run perf floor iters reps checksum
out="$(bash "$here/../scripts/cluster.sh" run --hosts 2 --rails 2 --gbps "$gbps" -- bash -c inner 2>&1)"
rc=$?
printf '%s\n' "$out"
((rc == 0)) || exit "$rc"
# Row fields after "MODE rep R:": name iters t_min t_p50 ... ($6 t_min, $7 p50).
# The summary: the median over the repetitions of each ratio (one disturbed
# repetition on a shared machine moves a mean, not a median).
awk -v gbps="$gbps" -v checksum="$checksum" '
  function median(a, k,    i, j, t, b) {
    for (i = 0; i < k; ++i) b[i] = a[i]
    for (i = 1; i < k; ++i) for (j = i; j > 0 && b[j - 1] > b[j]; --j) { t = b[j]; b[j] = b[j - 1]; b[j - 1] = t }
    return k % 2 ? b[(k - 1) / 2] : (b[k / 2 - 1] + b[k / 2]) / 2
  }
  $1 != "load" && $3 ~ /^[0-9]+:$/ && $5 ~ /^[0-9]+$/ { r = $3 + 0; m[$1, r] = $7; t[$1, r] = $6; if (r + 1 > n) n = r + 1 }
  END {
    for (i = 0; i < n; ++i) {
      o[i] = m["single", i] / m["rails", i]; ot[i] = t["single", i] / t["rails", i]
      f[i] = m["floor1", i] / m["floor2", i]; ft[i] = t["floor1", i] / t["floor2", i]
      printf "rep %d p50 us: floor one %s two %s, ours one %s two %s; one/two: ours %.2f (t_min %.2f), floor %.2f (t_min %.2f); ours/floor: one %.2f, two %.2f\n",
        i, m["floor1", i], m["floor2", i], m["single", i], m["rails", i], o[i], ot[i], f[i], ft[i],
        m["single", i] / m["floor1", i], m["rails", i] / m["floor2", i]
    }
    printf "1.75 MiB reply at %s Gb/s per rail (checksums %s), median of %d reps: one rail / two rails = %.2f at p50, %.2f at t_min (the floor: %.2f, %.2f)\n",
      gbps, checksum ? "on" : "off", n, median(o, n), median(ot, n), median(f, n), median(ft, n)
  }' <<<"$out"
