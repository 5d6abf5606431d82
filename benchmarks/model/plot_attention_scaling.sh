#!/usr/bin/env bash
# Measures attention time per decode token against context length (64 ->
# 4096 tokens, CPU, tiny widths) for tiny-Step-3 (MFA) and tiny-step5
# (sliding + global sparse), prints the table and draws the PNG of
# docs/model.md with gnuplot (Debian: gnuplot-nox).
#
#   benchmarks/model/plot_attention_scaling.sh [BUILD_DIR] [PNG]
# defaults: build/ and docs/images/step5_attention_scaling.png. Run it on a
# quiet machine: the numbers are single-thread CPU times.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
png=${2:-docs/images/step5_attention_scaling.png}
program=$build/benchmarks/model/step5_attention_scaling
if [[ ! -x $program ]]; then
  echo "plot_attention_scaling: build it first: ninja -C $build step5_attention_scaling" >&2
  exit 2
fi
dat=$(mktemp /tmp/step5_attention_scaling.XXXXXX.dat)
trap 'rm -f "$dat"' EXIT
"$program" --contexts 64,128,256,512,1024,2048,4096 --decode 16 --dat "$dat"
mkdir -p "$(dirname "$png")"
gnuplot <<GNUPLOT
set terminal pngcairo size 900,560 font "sans,11"
set output "$png"
set title "Attention time per decode token vs context (CPU, one thread, tiny widths)"
set xlabel "context length (tokens)"
set ylabel "microseconds per decode token (all attention layers)"
set logscale xy 2
set format x "%g"
set key top left
set grid
plot "$dat" using 1:2 with linespoints lw 2 pt 7 title "tiny-Step-3: 6 MFA layers", \
     "$dat" using 1:3 with linespoints lw 2 pt 5 title "tiny-step5: 6 sliding + 2 sparse layers", \
     "$dat" using 1:4 with linespoints lw 1 pt 4 dt 2 title "tiny-step5: the 2 sparse layers", \
     "$dat" using 1:5 with linespoints lw 1 pt 6 dt 3 title "tiny-step5: the 6 sliding layers"
GNUPLOT
echo "plot_attention_scaling: wrote $png"
