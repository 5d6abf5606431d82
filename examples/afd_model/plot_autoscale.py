#!/usr/bin/env python3
"""Throughput per instance over an elastic emulated run, as an SVG.

    plot_autoscale.py WORK_DIR/throughput.csv LAUNCHER_OUTPUT OUT.svg

THROUGHPUT.csv is what afd_launch writes for an elastic emulated run
(--autoscale or --resize with --emulate-compute; kept with --work-dir):
per decode step the shape, the mean context, the measured and the
planner's throughput per instance (model time). LAUNCHER_OUTPUT is the
launcher's stdout: its "resize at step ..." lines mark the changes. No
plotting library: the SVG is written by hand (docs/elastic.md, "Autoscale").
"""
import csv
import re
import sys


def main(csv_path, out_path, svg_path):
    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        sys.exit(f"{csv_path}: no rows")
    resizes = []
    for line in open(out_path):
        m = re.match(r"^resize at step (\d+): (\S+) -> (\S+) \(", line)
        if m:
            resizes.append((int(m.group(1)), m.group(2), m.group(3)))
    steps = [int(r["step"]) for r in rows]
    measured = [float(r["measured"]) for r in rows]
    predicted = [float(r["predicted"]) for r in rows]
    width, height, left, right, top, bottom = 760, 360, 70, 20, 30, 50
    x0, x1 = min(steps), max(steps)
    y1 = max(measured + predicted) * 1.1
    sx = lambda s: left + (s - x0) / max(1, x1 - x0) * (width - left - right)
    sy = lambda v: top + (1 - v / y1) * (height - top - bottom)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    # Axes and the y grid (thousands of tokens/s per instance).
    for i in range(6):
        v = y1 * i / 5
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v / 1e3:.0f}k'
                   f'</text>')
    for s in range(x0 - x0 % 8, x1 + 1, 8):
        if s < x0:
            continue
        out.append(f'<text x="{sx(s):.1f}" y="{height - bottom + 16}" text-anchor="middle">{s}'
                   f'</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">'
               f'decode step (mean context {rows[0]["context"]} -> {rows[-1]["context"]} tokens)'
               f'</text>')
    out.append(f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(top + height - bottom) / 2})">'
               f'tokens/s per instance (model time)</text>')
    # The resize points.
    for step, frm, to in resizes:
        out.append(f'<line x1="{sx(step):.1f}" x2="{sx(step):.1f}" y1="{top}" '
                   f'y2="{height - bottom}" stroke="#c33" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{sx(step) + 4:.1f}" y="{top + 12}" fill="#c33">step {step}: '
                   f'{frm} -> {to}</text>')

    def line(values, colour, dash=""):
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in zip(steps, values))
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return (f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.6"'
                f'{extra}/>')

    out.append(line(predicted, "#888", "6 3"))
    out.append(line(measured, "#1f5fbf"))
    lx = width - right - 230
    out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{height - bottom - 30}" '
               f'y2="{height - bottom - 30}" stroke="#1f5fbf" stroke-width="1.6"/>')
    out.append(f'<text x="{lx + 30}" y="{height - bottom - 26}">measured (per step)</text>')
    out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{height - bottom - 14}" '
               f'y2="{height - bottom - 14}" stroke="#888" stroke-dasharray="6 3" '
               f'stroke-width="1.6"/>')
    out.append(f'<text x="{lx + 30}" y="{height - bottom - 10}">planner (Predict)</text>')
    out.append("</svg>")
    with open(svg_path, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"{svg_path}: {len(rows)} steps, {len(resizes)} resize(s)")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
