#!/usr/bin/env bash
# Measures mesh_scale at 4, 16, 64 and 128 participants (3A1F, 12A4F,
# 48A16F, 96A32F; 8 participants per emulated host, scripts/cluster.sh),
# prints the table rows of docs/benchmarks.md ("Scale") and draws
# docs/images/mesh_scale.png with gnuplot (Debian: gnuplot-nox).
#   tests/cluster/plot_scale.sh [BUILD_DIR] [PNG] [SPAWN_GAP_US] [DAT]
# With DAT (an existing file, as this script writes it) only plots it.
# Needs root (network namespaces). SPAWN_GAP_US (default 2000, as the
# earlier tables of docs/benchmarks.md) starts the participants that far
# apart; 0 starts them all at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
png=${2:-docs/images/mesh_scale.png}
gap=${3:-2000}
program=$build/tests/cluster/mesh_scale
[[ -x $program ]] || { echo "plot_scale: build it first: ninja -C $build mesh_scale" >&2; exit 2; }
given=${4:-}
dat=$(mktemp /tmp/mesh_scale.XXXXXX.dat)
trap 'rm -f "$dat"' EXIT
if [[ -n $given ]]; then cp "$given" "$dat"; fi
for shape in "3 1 1" "12 4 2" "48 16 8" "96 32 16"; do
  [[ -z $given ]] || break
  read -r x y hosts <<<"$shape"
  row="$(bash scripts/cluster.sh run --hosts "$hosts" -- sh -c "$program --workers $x --servers $y \
    --rounds 100 --deadline-s 200 --spawn-gap-us $gap --hosts \$CLUSTER_HOSTS \
    --host-addrs \$CLUSTER_ADDRS" 2>/dev/null | grep -E '^\| [0-9]+ \|')"
  echo "$row  (hosts $hosts, load $(cut -d' ' -f1 /proc/loadavg))"
  # participants rendezvous_ms barrier_ms round_p50_ms rss_mib worker_fds server_fds
  awk -F'|' '{print $2, $4, $6, $7, $9, $10, $11}' <<<"$row" >>"$dat"
done
echo "plot_scale: data"
cat "$dat"
mkdir -p "$(dirname "$png")"
gnuplot <<GNUPLOT
set terminal pngcairo size 1000,560 font "sans,11" noenhanced
set output "$png"
set multiplot layout 1,2 title "mesh_scale: xAyF processes on emulated hosts (8 per host), 64-byte tensors, 2 shared cores"
set xlabel "participants"
set logscale xy 2
set format x "%g"
set grid
set key top left
set ylabel "milliseconds"
plot "$dat" using 1:2 with linespoints lw 2 pt 7 title "rendezvous (spawn to last Create)", \
     "$dat" using 1:3 with linespoints lw 2 pt 5 title "barrier", \
     "$dat" using 1:4 with linespoints lw 2 pt 9 title "round p50 (PushPull to all servers)"
set ylabel "per participant"
set logscale y 2
plot "$dat" using 1:5 with linespoints lw 2 pt 7 title "peak RSS (MiB)", \
     "$dat" using 1:6 with linespoints lw 2 pt 5 title "worker fds", \
     "$dat" using 1:7 with linespoints lw 2 pt 9 title "server fds"
unset multiplot
GNUPLOT
echo "plot_scale: wrote $png"
