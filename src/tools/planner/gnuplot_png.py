"""What the plotting scripts share (plot_plan.py, plot_context.py and
benchmarks/plot_latency.py): the JSON-in PNG-out command line, the check
that gnuplot is installed, the PNG preamble and running a script.

Uses only the Python standard library and gnuplot (Debian: gnuplot-nox).
"""

import argparse
import json
import shutil
import subprocess
import sys


def json_to_png_args(description):
    """`tool JSON_FILE PNG_FILE [--title TEXT]`, parsed."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_file")
    parser.add_argument("png_file")
    parser.add_argument("--title", default=None)
    return parser.parse_args()


def have_gnuplot(tool):
    """True when gnuplot is on PATH; otherwise says so for `tool`."""
    if shutil.which("gnuplot") is None:
        print(tool + ": gnuplot not found (apt-get install gnuplot-nox)", file=sys.stderr)
        return False
    return True


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def png_preamble(png_file, title, size="1000,650"):
    """The lines that make gnuplot write `png_file` with `title` (quotes dropped)."""
    return [
        "set terminal pngcairo size {} enhanced font 'Sans,10'".format(size),
        "set output '{}'".format(png_file.replace("'", "")),
        "set title '{}' noenhanced".format(title.replace("'", "")),
    ]


def run_gnuplot(lines):
    subprocess.run(["gnuplot"], input="\n".join(lines), text=True, check=True)
