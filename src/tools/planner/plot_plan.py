#!/usr/bin/env python3
"""Plots stepmesh_plan --json output: throughput per instance against the
attention/FFN ratio r, the seed's three regimes shaded (I attention-bound,
II communication-bound, III FFN-bound), r_A / r_C / r_peak / r* marked, the
full model (micro-batch depth, FFN link) dashed, the FFN link's own ceiling
dotted (the "dead zone" once it is below the curve), integer ratios as
points and simulated ones when stepmesh_plan ran with --simulate.

Uses only the Python standard library and gnuplot (Debian: gnuplot-nox).

  src/tools/planner/plot_plan.py plan_out.json ratio.png [--title TEXT]
"""

import os
import sys
import tempfile

from gnuplot_png import have_gnuplot, json_to_png_args, load_json, png_preamble, run_gnuplot

SHADES = {"A": ("#fde0c5", "I attention-bound"), "C": ("#d9e8f5", "II comm-bound"),
          "F": ("#dff2d8", "III FFN-bound")}


def regime_spans(curve):
    """Contiguous r intervals over which the seed's binding term is the same."""
    spans = []
    for point in curve:
        bound = point["seed_bound"]
        if spans and spans[-1][2] == bound:
            spans[-1][1] = point["r"]
        else:
            start = spans[-1][1] if spans else 0.0
            spans.append([start, point["r"], bound])
    return spans


def main() -> int:
    args = json_to_png_args(__doc__)
    if not have_gnuplot("plot_plan"):
        return 2
    doc = load_json(args.json_file)
    curve = doc.get("curve", [])
    if not curve:
        print("plot_plan: no curve in " + args.json_file, file=sys.stderr)
        return 1
    seed = doc["seed"]
    full = doc["full"]
    r_max = curve[-1]["r"]
    y_max = 1.15 * max(max(p["seed"], p["full"]) for p in curve)
    title = args.title or doc.get("name") or "stepmesh_plan"

    with tempfile.TemporaryDirectory(prefix="stepmesh_plan_plot_") as tmp:
        curve_dat = os.path.join(tmp, "curve.dat")
        with open(curve_dat, "w", encoding="utf-8") as out:
            for p in curve:
                link = p["link_only"] if p["link_only"] else float("nan")
                out.write("{} {} {} {}\n".format(p["r"], p["seed"], p["full"], link))
        ratios_dat = os.path.join(tmp, "ratios.dat")
        with open(ratios_dat, "w", encoding="utf-8") as out:
            for row in doc.get("ratios", []):
                out.write("{} {} {}\n".format(row["r"], row["full"],
                                              row.get("simulated", float("nan"))))
        has_sim = any("simulated" in row for row in doc.get("ratios", []))
        # The link's ceiling is drawn only where it comes into view.
        has_link = any(p["link_only"] and p["link_only"] < y_max for p in curve)

        lines = png_preamble(args.png_file, title) + [
            "set xlabel 'r = attention instances per FFN instance'",
            "set ylabel 'decode tokens/s per instance'",
            "set xrange [0:{}]".format(r_max),
            "set yrange [0:{}]".format(y_max),
            "set grid",
            "set key bottom right opaque",
        ]
        used = set()
        for i, (lo, hi, bound) in enumerate(regime_spans(curve)):
            color, label = SHADES.get(bound, ("#eeeeee", bound))
            lines.append("set object {} rect from {},0 to {},{} fc rgb '{}' fs solid 1.0 "
                         "noborder behind".format(i + 1, lo, hi, y_max, color))
            if bound not in used:
                lines.append("set label '{}' at {},{} center tc rgb '#555555'".format(
                    label, (lo + hi) / 2, 0.96 * y_max))
                used.add(bound)
        marks = [("r_A", seed["r_a"]), ("r_C", seed["r_c"]), ("r_peak", seed["r_peak"]),
                 ("r* seed", seed["r_star"])]
        if abs(full["r_star"] - seed["r_star"]) > 1e-9 * max(1.0, seed["r_star"]):
            marks.append(("r* full", full["r_star"]))
        # Marks closer than 1 % of the axis share one line: "r_peak = r* seed".
        merged = []
        for name, r in sorted((m for m in marks if m[1] is not None and 0 < m[1] < r_max),
                              key=lambda m: m[1]):
            if merged and r - merged[-1][1] < 0.01 * r_max:
                merged[-1][0] += " = " + name
            else:
                merged.append([name, r])
        for i, (name, r) in enumerate(merged):
            lines.append("set arrow from {0},0 to {0},{1} nohead dt 3 lc rgb '#444444'".format(
                r, 0.9 * y_max))
            lines.append("set label '{}' at {},{} right rotate by 90 offset -0.6,0 noenhanced "
                         "tc rgb '#444444'".format(name, r, (0.88 - 0.12 * (i % 2)) * y_max))
        plots = [
            "'{}' using 1:2 with lines lw 2 lc rgb '#d62728' title 'seed model "
            "max(t_A, t_C, t_F)'".format(curve_dat),
            "'{}' using 1:3 with lines lw 2 dt 2 lc rgb '#1f77b4' title 'full model "
            "(+ micro-batch depth, FFN link)'".format(curve_dat),
            "'{}' using 1:2 with points pt 7 ps 1.2 lc rgb '#1f77b4' title 'integer ratios "
            "(full model)'".format(ratios_dat),
        ]
        if has_link:
            plots.append("'{}' using 1:4 with lines lw 1 dt 3 lc rgb '#7f7f7f' title 'FFN link "
                         "alone (bytes per layer / bandwidth)'".format(curve_dat))
        if has_sim:
            plots.append("'{}' using 1:3 with points pt 6 ps 1.8 lw 2 lc rgb '#2ca02c' "
                         "title 'simulated'".format(ratios_dat))
        lines.append("plot " + ", ".join(plots))
        run_gnuplot(lines)
    print("wrote " + args.png_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
