#!/usr/bin/env bash
# The 128-participant rendezvous of two mesh_scale binaries, interleaved
# (A, B, A, B, ...), so both see the same minutes of this shared machine
# (docs/benchmarks.md, "Scale"). Prints each run's rendezvous, Create() CPU
# and the load average when it started, then the median of each.
#   tests/cluster/mesh_scale_ab.sh BINARY_A BINARY_B [RUNS] [SPAWN_GAP_US] [WORKERS SERVERS HOSTS]
# RUNS default 5, SPAWN_GAP_US default 2000 (as the tables), 96A32F on 16
# emulated hosts. Needs root (network namespaces, scripts/cluster.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
a=$1 b=$2 runs=${3:-5} gap=${4:-2000} x=${5:-96} y=${6:-32} hosts=${7:-16}
for bin in "$a" "$b"; do
  [[ -x $bin ]] || { echo "mesh_scale_ab: $bin is not an executable" >&2; exit 2; }
done
declare -A rdv
for ((i = 0; i < runs; i++)); do
  for side in A B; do
    bin=$a
    [[ $side == B ]] && bin=$b
    load=$(cut -d' ' -f1 /proc/loadavg)
    out="$(bash scripts/cluster.sh run --hosts "$hosts" -- sh -c "$bin --workers $x --servers $y \
      --rounds 20 --deadline-s 200 --spawn-gap-us $gap --hosts \$CLUSTER_HOSTS \
      --host-addrs \$CLUSTER_ADDRS" 2>&1)" || { printf '%s\n' "$out" >&2; exit 1; }
    ms=$(sed -n 's/^  rendezvous \([0-9.]*\) ms.*/\1/p' <<<"$out")
    cpu=$(sed -n 's/.*Create() \([0-9.]*\) s (workers.*/\1/p' <<<"$out")
    [[ -n $ms ]] || { printf '%s\n' "$out" >&2; echo "mesh_scale_ab: no rendezvous line" >&2; exit 1; }
    echo "run $i $side: rendezvous $ms ms, Create() CPU $cpu s, load $load"
    rdv[$side]+="$ms "
  done
done
for side in A B; do
  median=$(tr ' ' '\n' <<<"${rdv[$side]}" | grep . | sort -n | awk '{v[NR] = $1} END {
    print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
  echo "$side median $median ms of: ${rdv[$side]}"
done
