#!/usr/bin/env python3
"""How the optimal ratio moves with context length: runs stepmesh_plan for
each plan at a range of mean prompt lengths (same batch and decode length)
and plots the seed's r* (and t_A) against the mean context mu_P + mu_D.
Dense attention's t_A grows linearly in the context, so r_A and r* do;
sparse attention (attention_context "sparse") flattens t_A, and r* with it.
Prints a Markdown table of the same numbers.

Uses only the Python standard library and gnuplot (Debian: gnuplot-nox).

  src/tools/planner/plot_context.py --planner build/src/tools/planner/stepmesh_plan \\
      --plan src/tools/planner/configs/step3_h800.json \\
      --plan src/tools/planner/configs/step5_h800_like.json --batch 1024 --ffn-instances 1 \\
      --png context.png
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from gnuplot_png import have_gnuplot, png_preamble, run_gnuplot

CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288]
COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]


def run(args, plan, mu_p):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [args.planner, plan, "--batch", str(args.batch), "--mu-p", str(mu_p), "--mu-d",
               str(args.mu_d), "--ffn-instances", str(args.ffn_instances), "--json", out.name]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit("plot_context: {} failed:\n{}".format(" ".join(cmd), done.stderr))
        with open(out.name, encoding="utf-8") as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planner", required=True)
    parser.add_argument("--plan", action="append", required=True)
    parser.add_argument("--label", action="append", default=[],
                        help="a short name per --plan (default: the plan's name)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--mu-d", type=int, default=1024)
    parser.add_argument("--ffn-instances", type=int, default=1)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()

    series = []
    for k, plan in enumerate(args.plan):
        points = []
        for context in CONTEXTS:
            mu_p = context - args.mu_d
            if mu_p < 0:
                continue
            doc = run(args, plan, mu_p)
            s = doc["seed"]
            points.append((context, s["r_star"], s["t_a_us"], s["regime"], doc["full"]["best_x"]))
        label = args.label[k] if k < len(args.label) else doc.get("name") or os.path.basename(plan)
        series.append((label, points))

    print("| mean context | " + " | ".join("{} r* (t_A us, regime)".format(n)
                                           for n, _ in series) + " |")
    print("|---|" + "---|" * len(series))
    for i, context in enumerate(CONTEXTS):
        cells = []
        for _, points in series:
            p = next((q for q in points if q[0] == context), None)
            cells.append("-" if p is None else "{:.2f} ({:.0f}, {})".format(
                p[1], p[2], p[3].split(" ")[0]))
        print("| {} | {} |".format(context, " | ".join(cells)))
    print("\nB = {} slots per micro-batch, mu_D = {}, y = {} FFN instance(s).".format(
        args.batch, args.mu_d, args.ffn_instances))

    if args.png:
        if not have_gnuplot("plot_context"):
            return 2
        with tempfile.TemporaryDirectory(prefix="stepmesh_context_") as tmp:
            plots = []
            for k, (name, points) in enumerate(series):
                data = os.path.join(tmp, "s{}.dat".format(k))
                with open(data, "w", encoding="utf-8") as out:
                    for p in points:
                        out.write("{} {} {}\n".format(p[0], p[1], p[2]))
                color = COLORS[k % len(COLORS)]
                plots.append("'{}' using 1:2 with linespoints lw 2 pt 7 lc rgb '{}' title '{} "
                             "(r*)' noenhanced".format(data, color, name.replace("'", "")))
                plots.append("'{}' using 1:3 axes x1y2 with lines dt 2 lc rgb '{}' title 't_A "
                             "(right axis)' noenhanced".format(data, color))
            title = "Optimal attention instances per FFN instance vs context " \
                "(B = {}, mu_D = {})".format(args.batch, args.mu_d)
            run_gnuplot(png_preamble(args.png, title, size="1000,600") + [
                "set logscale x 2",
                "set logscale y",
                "set logscale y2",
                "set xlabel 'mean context mu_P + mu_D (tokens)' noenhanced",
                "set ylabel 'r* (seed closed form)'",
                "set y2label 't_A per layer and micro-batch (us)'",
                "set ytics nomirror",
                "set y2tics",
                "set format x '%.0s%c'",
                "set grid",
                "set key top left",
                "plot " + ", ".join(plots),
            ])
        print("wrote " + args.png, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
