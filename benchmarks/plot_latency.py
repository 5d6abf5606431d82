#!/usr/bin/env python3
"""Plots stepmesh_perf --json output: latency (p50, with a whisker up to p99)
against message size, one series per method (ours and each baseline).

Uses only the Python standard library and gnuplot (Debian: gnuplot-nox).

  benchmarks/plot_latency.py out.json latency.png [--title TEXT]
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "src", "tools", "planner"))
from gnuplot_png import (have_gnuplot, json_to_png_args, load_json, png_preamble,  # noqa: E402
                         run_gnuplot)

# Each method is drawn slightly to the side of the true size so the whiskers
# of different methods at one size do not hide each other (log x axis).
OFFSETS = {"stepmesh": 1.0, "raw-tcp": 0.94, "zmq": 1.06, "memcpy": 0.89}
COLORS = {"stepmesh": "#d62728", "raw-tcp": "#1f77b4", "zmq": "#2ca02c", "memcpy": "#7f7f7f"}


def main() -> int:
    args = json_to_png_args(__doc__)
    if not have_gnuplot("plot_latency"):
        return 2
    doc = load_json(args.json_file)

    # method -> list of (bytes per server per iteration, p50, p99)
    series = {}
    for result in doc.get("results", []):
        size = result["push_bytes"] + result["pull_bytes"]
        for m in result["methods"]:
            if not m.get("available", False):
                continue
            lat = m["latency"]
            if lat.get("p50_us") is None:
                continue
            series.setdefault(m["method"], []).append((size, lat["p50_us"], lat["p99_us"]))
    if not series:
        print("plot_latency: no results in " + args.json_file, file=sys.stderr)
        return 1

    cfg = doc.get("config", {})
    machine = doc.get("machine", {})
    title = args.title or (
        "stepmesh_perf {} {} ({} / {} cores, {})".format(
            cfg.get("pattern", "?"), cfg.get("transport", "?"), machine.get("cpu_model", "?"),
            machine.get("online_cores", "?"), machine.get("kernel", "?")))

    with tempfile.TemporaryDirectory(prefix="stepmesh_plot_") as tmp:
        plots = []
        for method, points in series.items():
            data = os.path.join(tmp, method + ".dat")
            with open(data, "w", encoding="utf-8") as out:
                for size, p50, p99 in sorted(points):
                    x = size * OFFSETS.get(method, 1.0)
                    out.write("{} {} {} {}\n".format(x, p50, p50, p99))
            color = COLORS.get(method, "#000000")
            plots.append("'{0}' using 1:2:3:4 with yerrorbars lc rgb '{1}' pt 7 ps 1 "
                         "title '{2} p50 (bar: p99)', '{0}' using 1:2 with lines lc rgb '{1}' "
                         "notitle".format(data, color, method))
        run_gnuplot(png_preamble(args.png_file, title) + [
            "set logscale xy",
            "set xlabel 'bytes moved per server per iteration (push + pull)'",
            "set ylabel 'latency per iteration (us)'",
            "set grid",
            "set key top left",
            "set format x '%.0s%cB'",
            "plot " + ", ".join(plots),
        ])
    print("wrote " + args.png_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
