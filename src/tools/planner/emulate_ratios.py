#!/usr/bin/env python3
"""Runs the emulated AFD cluster (afd_launch --emulate-compute) at several
xAyF topologies and compares the measured decode throughput per instance
with the planner's models and its simulator: a Markdown table on stdout
(docs/planning.md carries one) and, with --png, a gnuplot chart.

Repetitions are interleaved (every topology once, then again) and the
median is reported, so load that drifts during the sweep hits every
topology alike. The machine's load average is printed with the table:
the emulated compute is sleeps, but the bytes, the wake-ups and the
processes are real.

Uses only the Python standard library and gnuplot (Debian: gnuplot-nox).

  src/tools/planner/emulate_ratios.py --build build \\
      --plan src/tools/planner/configs/step3_emulated.json \\
      --topologies 1A1F,2A1F,3A1F,4A1F,5A1F,6A1F,2A2F --reps 3 --png ratios.png
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SUMMARY = re.compile(r"model time, x[0-9.e+]+: ([0-9.e+]+) per instance")


def parse_topology(text, tool="emulate_ratios"):
    """ "xAyF" as (x, y); `tool` names the program in the error."""
    m = re.fullmatch(r"(\d+)A(\d+)F", text)
    if not m:
        raise SystemExit(tool + ": bad topology " + text + " (want e.g. 3A1F)")
    return int(m.group(1)), int(m.group(2))


def measure(args, x, y):
    cmd = [os.path.join(args.build, "examples/afd_model/afd_launch"), "--attention", str(x),
           "--ffn", str(y), "--requests", str(args.micro_batches), "--prompt-len", "4",
           "--decode-steps", str(args.decode_steps), "--micro-batches", str(args.micro_batches),
           "--emulate-compute", args.plan, "--timeout-ms", "30000", "--deadline-s", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = SUMMARY.search(done.stdout)
    if done.returncode != 0 or not m:
        raise SystemExit("emulate_ratios: {} failed ({}):\n{}\n{}".format(
            " ".join(cmd), done.returncode, done.stdout[-3000:], done.stderr[-3000:]))
    return float(m.group(1))


def predict(args, x, y):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [os.path.join(args.build, "src/tools/planner/stepmesh_plan"), args.plan,
               "--layers", str(args.layers), "--ffn-instances", str(y), "--micro-batches",
               str(args.micro_batches), "--max-attention", str(x), "--simulate",
               "--sim-steps", "300", "--json", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit("emulate_ratios: {} failed:\n{}".format(" ".join(cmd), done.stderr))
        with open(out.name, encoding="utf-8") as f:
            doc = json.load(f)
    row = doc["ratios"][x - 1]
    return {"seed": row["seed"], "full": row["full"], "barrier": row["barrier"],
            "simulated": row["simulated"], "bound": row["full_bound"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--topologies", default="1A1F,2A1F,3A1F,4A1F,5A1F,6A1F,2A2F")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6,
                        help="layers of the emulated model (the example's tiny config: 6)")
    parser.add_argument("--png", default=None)
    args = parser.parse_args()

    topologies = [parse_topology(t) for t in args.topologies.split(",")]
    load_before = os.getloadavg()
    started = time.time()
    measured = {t: [] for t in topologies}
    for rep in range(args.reps):
        for t in topologies:
            measured[t].append(measure(args, *t))
            print("rep {} {}A{}F: {:.6g}".format(rep, t[0], t[1], measured[t][-1]),
                  file=sys.stderr)
    load_after = os.getloadavg()
    predicted = {t: predict(args, *t) for t in topologies}

    best_measured = max(statistics.median(v) for v in measured.values())
    best_full = max(p["full"] for p in predicted.values())
    print("| topology | seed model | full model | barrier-aware | simulated | emulated (median of "
          "{}) | emulated / full | bound |".format(args.reps))
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for t in topologies:
        p = predicted[t]
        med = statistics.median(measured[t])
        rows.append((t, p, med))
        print("| {}A{}F | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} ({}) | {:.2f} | {} |".format(
            t[0], t[1], p["seed"], p["full"], p["barrier"], p["simulated"], med,
            ", ".join("{:.0f}".format(v) for v in measured[t]), med / p["full"], p["bound"]))
    order_measured = [t for t, _, _ in sorted(rows, key=lambda r: -r[2])]
    order_full = [t for t, _, _ in sorted(rows, key=lambda r: -r[1]["full"])]
    name = lambda ts: " > ".join("{}A{}F".format(*t) for t in ts)
    print("\nmodel-time decode tokens/s per instance ({} layers, {} micro-batches); ranking "
          "measured: {}; full model: {}".format(args.layers, args.micro_batches,
                                              name(order_measured), name(order_full)))
    print("conditions: {} cores, load average {:.1f} before / {:.1f} after, {:.0f} s, {}".format(
        os.cpu_count(), load_before[0], load_after[0], time.time() - started,
        time.strftime("%Y-%m-%d %H:%M")))

    if args.png:
        if shutil.which("gnuplot") is None:
            print("emulate_ratios: gnuplot not found (apt-get install gnuplot-nox)",
                  file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="stepmesh_emulate_") as tmp:
            data = os.path.join(tmp, "rows.dat")
            with open(data, "w", encoding="utf-8") as out:
                for i, (t, p, med) in enumerate(rows):
                    lo, hi = min(measured[t]), max(measured[t])
                    out.write("{} {}A{}F {} {} {} {} {} {}\n".format(
                        i, t[0], t[1], p["full"], p["simulated"], med, lo, hi, p["seed"]))
            script = "\n".join([
                "set terminal pngcairo size 1000,600 enhanced font 'Sans,10'",
                "set output '{}'".format(args.png.replace("'", "")),
                "set title 'Emulated AFD cluster vs planner ({})' noenhanced".format(
                    os.path.basename(args.plan)),
                "set ylabel 'model-time decode tokens/s per instance'",
                "set yrange [0:*]",
                "set xrange [-0.5:{}]".format(len(rows) - 0.5),
                "set grid ytics",
                "set key bottom right opaque",
                "plot '{0}' using 1:3:xtic(2) with linespoints lw 2 pt 7 lc rgb '#1f77b4' "
                "title 'full model', '{0}' using 1:9 with points pt 2 ps 1.5 lc rgb '#d62728' "
                "title 'seed model', '{0}' using 1:4 with points pt 6 ps 2 lw 2 lc rgb '#2ca02c' "
                "title 'simulated', '{0}' using 1:5:6:7 with yerrorbars pt 5 ps 1.3 "
                "lc rgb '#000000' title 'emulated cluster (median, bar: min..max)'".format(data),
            ])
            subprocess.run(["gnuplot"], input=script, text=True, check=True)
        print("wrote " + args.png, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
