#!/usr/bin/env python3
"""What the Python binding adds to a round trip: 1A1F at the acceptance sizes
(896 KiB push, 1.75 MiB pull) driven from Python (stepmesh.Worker /
stepmesh.Server, worker and server in separate processes) against the C++
stepmesh_perf doing the same in the same run, reps interleaved.

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/python_overhead.py \\
        [--perf build/benchmarks/stepmesh_perf] [--iters 2000] [--reps 3] [--json out.json]

Prints the p50/p99 of both and the added p50 (target: <= 15 us). Both sides
use TCP on 127.0.0.1, the cpu_mock backend and the default (adaptive) poll mode.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

PUSH_BYTES = 917504   # 896 KiB
PULL_BYTES = 1835008  # 1.75 MiB
PUSH_KEY, PULL_KEY = 1, 2
TARGET_ADDED_P50_US = 15.0


def serve(args) -> None:
    import stepmesh
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # die with the benchmark
    with stepmesh.Server(scheduler=args.scheduler, transport="tcp", timeout=60.0) as s:
        s.register_recv(PUSH_KEY, np.zeros(PUSH_BYTES, np.uint8))
        reply = np.zeros(PULL_BYTES, np.uint8)
        reply[:] = np.arange(PULL_BYTES) % 251
        s.register_reply(PULL_KEY, reply)
        s.barrier()
        for _ in range(args.warmup + args.iters):
            s.respond(s.get_batch(timeout=60))
        s.barrier()


def python_run(args) -> np.ndarray:
    """Round-trip latencies (us) of the Python worker against a Python server process."""
    import stepmesh
    with stepmesh.Scheduler() as sched:
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "server",
                                   "--scheduler", sched.address, "--iters", str(args.iters),
                                   "--warmup", str(args.warmup)])
        try:
            with stepmesh.Worker(scheduler=sched.address, transport="tcp", timeout=60.0) as w:
                x = np.ones(PUSH_BYTES, np.uint8)
                y = np.zeros(PULL_BYTES, np.uint8)
                w.register_push(PUSH_KEY, x)
                w.register_pull(PULL_KEY, 0, y)
                w.barrier()
                pushes, pulls = [PUSH_KEY], [(PULL_KEY, 0)]
                lat = np.empty(args.iters, np.float64)
                clock = time.perf_counter_ns
                for i in range(args.warmup + args.iters):
                    t0 = clock()
                    w.wait(w.push_pull(pushes, pulls), 60.0)
                    t1 = clock()
                    if i >= args.warmup:
                        lat[i - args.warmup] = (t1 - t0) / 1e3
                if y[PULL_BYTES - 1] != (PULL_BYTES - 1) % 251:  # the reply really arrived
                    raise SystemExit("python_overhead: wrong reply bytes")
                w.barrier()
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
        if server.returncode != 0:
            raise SystemExit(f"python_overhead: server exited {server.returncode}")
    return lat


def cpp_run(args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "perf.json")
        cmd = [args.perf, "--transport", "tcp", "--pattern", "1A1F", "--push-bytes",
               str(PUSH_BYTES), "--pull-bytes", str(PULL_BYTES), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--reps", "1", "--json", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            result = json.load(f)
    lat = result["results"][0]["methods"][0]["latency"]
    return {"p50_us": lat["p50_us"], "p99_us": lat["p99_us"]}


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perf", default=os.path.join(root, "build", "benchmarks", "stepmesh_perf"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--role", choices=["server"])
    ap.add_argument("--scheduler")
    args = ap.parse_args()
    if args.role == "server":
        serve(args)
        return 0
    if not os.access(args.perf, os.X_OK):
        print(f"python_overhead: {args.perf} not built (ninja -C build stepmesh_perf)",
              file=sys.stderr)
        return 2
    rows = []
    for rep in range(args.reps):  # interleaved: load changes hit both alike
        cpp = cpp_run(args)
        lat = python_run(args)
        py = {"p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99))}
        rows.append({"rep": rep, "cpp": cpp, "python": py,
                     "added_p50_us": py["p50_us"] - cpp["p50_us"]})
    cpp_p50 = float(np.median([r["cpp"]["p50_us"] for r in rows]))
    py_p50 = float(np.median([r["python"]["p50_us"] for r in rows]))
    added = py_p50 - cpp_p50
    print(f"python_overhead: 1A1F tcp, push {PUSH_BYTES} B, pull {PULL_BYTES} B, "
          f"{args.iters} iters x {args.reps} interleaved reps, load {os.getloadavg()[0]:.2f}")
    print(f"{'rep':>4} {'C++ p50':>10} {'C++ p99':>10} {'Py p50':>10} {'Py p99':>10} "
          f"{'added p50':>10}")
    for r in rows:
        print(f"{r['rep']:>4} {r['cpp']['p50_us']:>10.1f} {r['cpp']['p99_us']:>10.1f} "
              f"{r['python']['p50_us']:>10.1f} {r['python']['p99_us']:>10.1f} "
              f"{r['added_p50_us']:>10.1f}")
    verdict = "meets" if added <= TARGET_ADDED_P50_US else "misses"
    print(f"median: C++ p50 {cpp_p50:.1f} us, Python p50 {py_p50:.1f} us, added {added:.1f} us "
          f"(ratio {py_p50 / cpp_p50:.3f}); {verdict} the <= {TARGET_ADDED_P50_US:.0f} us target")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "python_overhead", "push_bytes": PUSH_BYTES,
                       "pull_bytes": PULL_BYTES, "iters": args.iters, "reps": rows,
                       "cpp_p50_us": cpp_p50, "python_p50_us": py_p50, "added_p50_us": added,
                       "ratio_p50": py_p50 / cpp_p50, "target_added_p50_us": TARGET_ADDED_P50_US},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
