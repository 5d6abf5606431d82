#!/usr/bin/env bash
# Interleaved stepmesh_perf acceptance runs of several builds (method order rotated per run).
# usage: benchmarks/ab_builds.sh RUNS OUTDIR [--poll-mode MODE] name=BIN [name=BIN ...]
set -euo pipefail
runs="$1"; out="$2"; shift 2; mkdir -p "$out"
poll=()
if [[ "${1:-}" == --poll-mode ]]; then poll=(--poll-mode "$2"); shift 2; fi
names=(); bins=()
for a in "$@"; do names+=("${a%%=*}"); bins+=("${a#*=}"); done
n=${#names[@]}
for r in $(seq 1 "$runs"); do
  for pat in 1A1F 2A2F; do
    iters=2000; [[ $pat == 2A2F ]] && iters=1000
    for k in $(seq 0 $((n-1))); do
      i=$(( (k + r) % n ))
      timeout 300 "${bins[$i]}" --transport tcp --pattern $pat --push-bytes 917504 --pull-bytes 1835008 \
        --iters $iters --baseline raw-tcp,raw-naive,zmq "${poll[@]}" --json "$out/${names[$i]}-$pat-$r.json" > "$out/${names[$i]}-$pat-$r.txt" 2>&1 || echo "run failed: ${names[$i]} $pat $r"
    done
  done
done
/usr/bin/python3 - "$out" "${names[@]}" <<'PY'
import json,sys,glob,statistics
out=sys.argv[1]
for pat in ("1A1F","2A2F"):
  for which in sys.argv[2:]:
    rows=[]
    for f in sorted(glob.glob(f"{out}/{which}-{pat}-*.json")):
      d=json.load(open(f)); m={x["method"]:x for x in d["results"][0]["methods"]}
      g=lambda k: m[k]["latency"]["p50_us"] if k in m and m[k].get("available",True) and m[k].get("latency") else float('nan')
      ratio=lambda k: m[k].get("ratio_p50", float('nan')) if k in m else float('nan')
      rows.append((g("stepmesh"),m["stepmesh"]["latency"]["p99_us"],m["stepmesh"]["cpu_us_per_iter"],g("raw-tcp"),g("zmq"),
                   ratio("raw-tcp"),ratio("raw-naive"),m["raw-tcp"].get("cpu_us_per_iter",float('nan')) if "raw-tcp" in m else float('nan'),
                   m["raw-tcp"].get("note","").split(": ")[-1] if "raw-tcp" in m else ""))
    if not rows: continue
    med=lambda i: statistics.median(r[i] for r in rows)
    print(f"{pat} {which:7s} runs={len(rows)} stepmesh p50/run " + " ".join(f"{r[0]:.0f}" for r in rows) +
          f" | median p50 {med(0):.0f} p99 {med(1):.0f} cpu/iter {med(2):.0f} | raw-tcp p50 {med(3):.0f} zmq p50 {med(4):.0f} us")
    # ours / floor at p50 per run (the floor: the better raw-tcp discipline), and against the old naive row
    print(f"{pat} {which:7s} ours/floor p50 per run " + " ".join(f"{r[5]:.3f}" for r in rows) +
          f" (floor row per run: {','.join(r[8] for r in rows)}; floor cpu/iter median {med(7):.0f} us)"
          f" | ours/raw-naive " + " ".join(f"{r[6]:.3f}" for r in rows) +
          f" | target ours <= 1.15x floor: {'met' if med(5) <= 1.15 else 'MISSED'} (median {med(5):.3f})")
PY
