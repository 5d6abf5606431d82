#!/usr/bin/env python3
"""What the Python binding adds to a round trip: 1A1F at the acceptance sizes
(896 KiB push, 1.75 MiB pull) driven from Python (stepmesh.Worker /
stepmesh.Server, worker and server in separate processes) against the C++
stepmesh_perf doing the same in the same run, reps interleaved.

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/python_overhead.py \\
        [--perf build/benchmarks/stepmesh_perf] [--iters 2000] [--reps 3] [--json out.json]

Prints the p50/p99 of each and the added p50 (target: <= 15 us) of two Python
loops: "call" (w.push_pull(...) then w.wait(...), two binding calls and a
Request object per round trip) and "plan" (plan = w.prepare(...) once, then
plan.run(): one call, one GIL release, no Python object per round trip). Both
sides use TCP on 127.0.0.1, the cpu_mock backend, the default (adaptive) poll
mode, page-aligned buffers (as cpu_mock allocates them for stepmesh_perf), a
worker process and a server process. Then, from the requests' trace stamps,
where the time goes per stage (p50, us) in C++ and in each Python loop: "pre"
is the binding's entry to the library's submit stamp; "respond" includes the
Python server loop (get_batch returned -> reply posted); "wake" the return
to Python after completion.
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


STAGES = ("submit", "push", "dispatch", "respond", "reply", "complete", "wake")


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array (cpu_mock's Allocate aligns to 4096 too)."""
    raw = np.empty(nbytes + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off: off + nbytes]


def serve(args) -> None:
    import stepmesh
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # die with the benchmark
    with stepmesh.Server(scheduler=args.scheduler, transport="tcp", timeout=60.0) as s:
        recv = aligned(PUSH_BYTES)
        recv[:] = 0
        s.register_recv(PUSH_KEY, recv)
        reply = aligned(PULL_BYTES)
        reply[:] = np.arange(PULL_BYTES) % 251
        s.register_reply(PULL_KEY, reply)
        s.barrier()
        for _ in range(args.warmup + args.iters):
            s.respond(s.get_batch(timeout=60))
        s.barrier()


def stages_of(trace: dict, t0_ns: int, returned_ns: int) -> list:
    """[pre, submit, ..., wake] in us from one request's trace (1A1F: one server)."""
    x = trace["servers"][0]
    points = [t0_ns, x["enqueue_ns"], x["post_ns"], x["server_arrival_ns"], x["server_handler_ns"],
              x["server_reply_ns"], x["reply_arrival_ns"], trace["complete_ns"], returned_ns]
    return [(b - a) / 1e3 for a, b in zip(points, points[1:])]


def python_run(args, mode: str):
    """Round-trip latencies (us) and per-stage samples of the Python worker
    (loop `mode`: "call" or "plan") against a Python server process."""
    import stepmesh
    with stepmesh.Scheduler() as sched:
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "server",
                                   "--scheduler", sched.address, "--iters", str(args.iters),
                                   "--warmup", str(args.warmup)])
        try:
            with stepmesh.Worker(scheduler=sched.address, transport="tcp", timeout=60.0) as w:
                x = aligned(PUSH_BYTES)
                x[:] = 1
                y = aligned(PULL_BYTES)
                y[:] = 0
                w.register_push(PUSH_KEY, x)
                w.register_pull(PULL_KEY, 0, y)
                w.barrier()
                pushes, pulls = [PUSH_KEY], [(PULL_KEY, 0)]
                plan = w.prepare(pushes, pulls)
                lat = np.empty(args.iters, np.float64)
                stages = np.empty((args.iters, len(STAGES) + 1), np.float64)
                clock = time.perf_counter_ns  # lat: the same clock for both loops
                mono = stepmesh.monotonic_ns  # stages: the trace stamps' clock
                for i in range(args.warmup + args.iters):
                    m0 = mono()
                    t0 = clock()
                    if mode == "plan":
                        plan.run(60.0)
                        t1 = clock()
                        req = plan.last
                    else:
                        req = w.push_pull(pushes, pulls)
                        w.wait(req, 60.0)
                        t1 = clock()
                    m1 = mono()
                    if i >= args.warmup:
                        lat[i - args.warmup] = (t1 - t0) / 1e3
                        stages[i - args.warmup] = stages_of(w.fetch_trace(req), m0, m1)
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
    return lat, stages


def cpp_run(args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "perf.json")
        cmd = [args.perf, "--transport", "tcp", "--pattern", "1A1F", "--push-bytes",
               str(PUSH_BYTES), "--pull-bytes", str(PULL_BYTES), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--reps", "1", "--json", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            result = json.load(f)
    first = result["results"][0]
    lat = first["methods"][0]["latency"]
    st = {x["stage"]: x["p50_us"] for x in first.get("stepmesh_stages", [])}
    return {"p50_us": lat["p50_us"], "p99_us": lat["p99_us"], "stages": st}


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
    stage_samples = {"call": [], "plan": []}
    for rep in range(args.reps):  # interleaved: load changes hit all three alike
        row = {"rep": rep, "cpp": cpp_run(args)}
        for mode in ("call", "plan"):
            lat, st = python_run(args, mode)
            stage_samples[mode].append(st)
            row[mode] = {"p50_us": float(np.percentile(lat, 50)),
                         "p99_us": float(np.percentile(lat, 99))}
            row[mode]["added_p50_us"] = row[mode]["p50_us"] - row["cpp"]["p50_us"]
        rows.append(row)
    cpp_p50 = float(np.median([r["cpp"]["p50_us"] for r in rows]))
    print(f"python_overhead: 1A1F tcp, push {PUSH_BYTES} B, pull {PULL_BYTES} B, "
          f"{args.iters} iters x {args.reps} interleaved reps, load {os.getloadavg()[0]:.2f}")
    print(f"{'rep':>4} {'C++ p50':>9} {'C++ p99':>9} {'call p50':>9} {'call p99':>9} "
          f"{'+call':>7} {'plan p50':>9} {'plan p99':>9} {'+plan':>7}")
    for r in rows:
        print(f"{r['rep']:>4} {r['cpp']['p50_us']:>9.1f} {r['cpp']['p99_us']:>9.1f} "
              f"{r['call']['p50_us']:>9.1f} {r['call']['p99_us']:>9.1f} "
              f"{r['call']['added_p50_us']:>7.1f} {r['plan']['p50_us']:>9.1f} "
              f"{r['plan']['p99_us']:>9.1f} {r['plan']['added_p50_us']:>7.1f}")
    summary = {}
    for mode in ("call", "plan"):
        py_p50 = float(np.median([r[mode]["p50_us"] for r in rows]))
        added = py_p50 - cpp_p50
        summary[mode] = {"python_p50_us": py_p50, "added_p50_us": added,
                         "ratio_p50": py_p50 / cpp_p50}
        verdict = "meets" if added <= TARGET_ADDED_P50_US else "misses"
        print(f"median {mode}: C++ p50 {cpp_p50:.1f} us, Python p50 {py_p50:.1f} us, added "
              f"{added:.1f} us (ratio {py_p50 / cpp_p50:.3f}); {verdict} the <= "
              f"{TARGET_ADDED_P50_US:.0f} us target")
    # Where the time goes: stage p50s over all reps (C++: median of the reps' p50s).
    names = ("pre",) + STAGES
    print(f"{'stage p50 us':>14} {'C++':>8} {'call':>8} {'plan':>8} {'call-C++':>9} {'plan-C++':>9}")
    stage_table = {}
    for k, name in enumerate(names):
        cpp_vals = [r["cpp"]["stages"].get(name) for r in rows]
        # stepmesh_perf has no "pre" stage: it stamps right before PushPull().
        cpp_v = float(np.median(cpp_vals)) if all(v is not None for v in cpp_vals) else None
        vals = {m: float(np.median(np.concatenate(stage_samples[m])[:, k])) for m in stage_samples}
        stage_table[name] = {"cpp": cpp_v, **vals}
        base = 0.0 if cpp_v is None else cpp_v
        print(f"{name:>14} {'-' if cpp_v is None else f'{cpp_v:.1f}':>8} {vals['call']:>8.1f} "
              f"{vals['plan']:>8.1f} {vals['call'] - base:>9.1f} {vals['plan'] - base:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "python_overhead", "push_bytes": PUSH_BYTES,
                       "pull_bytes": PULL_BYTES, "iters": args.iters, "reps": rows,
                       "cpp_p50_us": cpp_p50, "python": summary, "stages_p50_us": stage_table,
                       "target_added_p50_us": TARGET_ADDED_P50_US}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
