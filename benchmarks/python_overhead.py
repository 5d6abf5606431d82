#!/usr/bin/env python3
"""What the Python binding adds to a round trip: 1A1F at the acceptance sizes
(896 KiB push, 1.75 MiB pull), a worker driven from Python (stepmesh.Worker)
against a worker driven from C++ (stepmesh_perf --role worker), both against
the same server program (stepmesh_perf --role server), reps interleaved; and
the same three loops paired inside ONE worker process (the verdict).

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/python_overhead.py \\
        [--perf build/benchmarks/stepmesh_perf] [--iters 1000] [--reps 5] \\
        [--blocks 200] [--block-iters 50] [--only cross|paired] [--json out.json]

Like for like: every row is a scheduler in this process and two child
processes, a worker and a server, on TCP 127.0.0.1, the cpu_mock backend, the
default (adaptive) poll mode, page-aligned buffers, the same keys, barriers and
iteration counts; only the worker program differs. (An earlier version paired
the Python worker with a Python server and the C++ worker with stepmesh_perf's
launcher; its rows differed by 94 us in the reply stage, where no Python runs.)

Rows: "C++" (stepmesh_perf's worker loop: PushPull then Wait), "call" (Python:
w.push_pull(...) then w.wait(...), two binding calls and a Request object per
round trip), "plan" (plan = w.prepare(...) once, then plan.run(): one call, one
GIL release, no Python object per round trip), and, for information, "plan,
Python server" (the plan loop against a Python get_batch/respond server, as an
fserver-style FFN would run: what a Python server adds on top). The target
(<= 15 us added at p50) is judged on "call" and "plan" against "C++": the
median over reps of each rep's difference. Then, from the requests' trace
stamps, where the time goes per stage (p50, us): "pre" is the binding's entry
to the library's submit stamp; "respond" the server loop (get_batch returned ->
reply posted); "wake" the return to the caller after completion.

Why a paired mode: separate processes per row make rep-to-rep drift (which
cores the threads land on, the other processes' load) dominate: the per-rep
differences above spread over +-100 us, so a median of 15 of them cannot
resolve 15 us. The paired mode runs, in each rep, ONE Python worker process on
ONE mesh connection (against stepmesh_perf --role server) that alternates
short blocks of --block-iters round trips: "C++" (plan.run_many(n): Post +
Wait n times in C++ under one GIL release, latencies taken in C++ on the clock
stepmesh.monotonic_ns reads), "call" and "plan" (the Python loops above), the
order of the three rotating through all 6 permutations. Each block's median is
compared with the C++ block of the same round (seconds apart, same process,
same sockets), and the verdict per path is the median of those paired
differences with a distribution-free 95% confidence interval (order
statistics of the binomial(n, 1/2)).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

PUSH_BYTES = 917504   # 896 KiB
PULL_BYTES = 1835008  # 1.75 MiB
# stepmesh_perf's keys for size 0, micro-batch 0 (PushKey / PullKey there).
PUSH_KEY, PULL_KEY = 1000, 100000
TARGET_ADDED_P50_US = 15.0
TIMEOUT_S = 60.0

STAGES = ("submit", "push", "dispatch", "respond", "reply", "complete", "wake")
ROWS = ("cpp", "call", "plan", "plan_pyserver")
LABELS = {"cpp": "C++", "call": "call", "plan": "plan", "plan_pyserver": "plan,pysrv"}
# The paired mode's block kinds, in one worker process.
PAIRED = ("cpp", "call", "plan")
PAIRED_LABELS = {"cpp": "C++ (run_many)", "call": "call", "plan": "plan"}
ORDERS = list(itertools.permutations(range(len(PAIRED))))


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array (cpu_mock's Allocate aligns to 4096 too)."""
    raw = np.empty(nbytes + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off: off + nbytes]


def mesh_options(scheduler: str):
    """The environment's STEPMESH_* settings (spin budget, poll mode, auth), as
    stepmesh_perf applies them to its nodes, under this benchmark's fields."""
    import stepmesh
    return stepmesh.MeshOptions.from_env(scheduler=scheduler, transport="tcp", timeout=TIMEOUT_S)


def die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def python_server(args) -> None:
    """stepmesh_perf's server loop (the same registrations and barriers), in Python."""
    import stepmesh
    die_with_parent()
    with stepmesh.Server(mesh_options(args.scheduler)) as s:
        recv = aligned(PUSH_BYTES)
        recv[:] = 0
        s.register_recv(PUSH_KEY, recv)
        reply = aligned(PULL_BYTES)
        reply[:] = 1  # stepmesh_perf's server s fills its reply with s + 1
        s.register_reply(PULL_KEY, reply)
        s.barrier()  # registered
        s.barrier()  # the method starts
        for _ in range(args.warmup + args.iters):
            s.respond(s.get_batch(timeout=TIMEOUT_S))
        s.barrier()  # every worker done


def stages_of(trace: dict, t0_ns: int, returned_ns: int) -> list:
    """[pre, submit, ..., wake] in us from one request's trace (1A1F: one server)."""
    x = trace["servers"][0]
    points = [t0_ns, x["enqueue_ns"], x["post_ns"], x["server_arrival_ns"], x["server_handler_ns"],
              x["server_reply_ns"], x["reply_arrival_ns"], trace["complete_ns"], returned_ns]
    return [(b - a) / 1e3 for a, b in zip(points, points[1:])]


def register_worker(w) -> tuple:
    """stepmesh_perf's worker registrations (its keys, page-aligned buffers)
    and barrier: (pull buffer, push items, pull items, prepared plan)."""
    x = aligned(PUSH_BYTES)
    x[:] = 0x5A
    y = aligned(PULL_BYTES)
    y[:] = 0
    w.register_push(PUSH_KEY, x)
    w.register_pull(PULL_KEY, 0, y)
    w.barrier()  # registered
    pushes, pulls = [PUSH_KEY], [(PULL_KEY, 0)]
    return y, pushes, pulls, w.prepare(pushes, pulls)


def python_worker(args) -> None:
    """stepmesh_perf's worker loop (same keys, barriers, counts), in Python;
    latencies and stage samples to args.out (.npy pair)."""
    import stepmesh
    die_with_parent()
    with stepmesh.Worker(mesh_options(args.scheduler)) as w:
        y, pushes, pulls, plan = register_worker(w)
        lat = np.empty(args.iters, np.float64)
        stages = np.empty((args.iters, len(STAGES) + 1), np.float64)
        clock = stepmesh.monotonic_ns  # the trace stamps' clock, as stepmesh_perf's
        w.barrier()  # the method starts
        for i in range(args.warmup + args.iters):
            t0 = clock()
            if args.mode == "plan":
                plan.run(TIMEOUT_S)
                t1 = clock()
                req = plan.last
            else:
                req = w.push_pull(pushes, pulls)
                w.wait(req, TIMEOUT_S)
                t1 = clock()
            if i >= args.warmup:
                lat[i - args.warmup] = (t1 - t0) / 1e3
                stages[i - args.warmup] = stages_of(w.fetch_trace(req), t0, t1)
        if y[PULL_BYTES - 1] != 1:  # the reply really arrived
            raise SystemExit("python_overhead: wrong reply bytes")
        w.barrier()  # every worker done
    np.save(args.out + ".lat.npy", lat)
    np.save(args.out + ".stages.npy", stages)


def paired_batches(args) -> tuple:
    """(warmup, measured) round trips of one paired worker process."""
    return len(PAIRED) * args.warmup_blocks * args.block_iters, \
        len(PAIRED) * args.blocks_per_rep * args.block_iters


def paired_worker(args) -> None:
    """One worker process, one mesh: blocks of C++ / call / plan round trips,
    the order rotating through every permutation; (blocks, 3, n) latencies in
    us to args.out + ".paired.npy"."""
    import stepmesh
    die_with_parent()
    n = args.block_iters
    with stepmesh.Worker(mesh_options(args.scheduler)) as w:
        y, pushes, pulls, plan = register_worker(w)
        clock = stepmesh.monotonic_ns  # the clock run_many's C++ stamps read
        lat = np.empty(n, np.int64)
        delay_ns = int(args.inject_us * 1000)

        def block(kind: int) -> np.ndarray:
            if kind == 0:
                return np.asarray(plan.run_many(n, TIMEOUT_S), np.int64)
            if kind == 1 and delay_ns:  # --inject-us: the calibration check
                gap = args.inject_at == "gap"
                for i in range(n):
                    t0 = clock()
                    if not gap:  # on the critical path: adds delay_ns to every round trip
                        until = clock() + delay_ns
                        while clock() < until:
                            pass
                    req = w.push_pull(pushes, pulls)
                    if gap:  # while the request travels: costs only what it takes from it
                        until = clock() + delay_ns
                        while clock() < until:
                            pass
                    w.wait(req, TIMEOUT_S)
                    lat[i] = clock() - t0
            elif kind == 1:
                for i in range(n):
                    t0 = clock()
                    req = w.push_pull(pushes, pulls)
                    w.wait(req, TIMEOUT_S)
                    lat[i] = clock() - t0
            else:
                for i in range(n):
                    t0 = clock()
                    plan.run(TIMEOUT_S)
                    lat[i] = clock() - t0
            return lat.copy()

        out = np.empty((args.blocks_per_rep, len(PAIRED), n), np.float64)
        w.barrier()  # the method starts (stepmesh_perf's server counts batches from here)
        for r in range(args.warmup_blocks):
            for k in ORDERS[r % len(ORDERS)]:
                block(k)
        for r in range(args.blocks_per_rep):
            # Rotated from this rep's offset: every order, every kind after every other.
            for k in ORDERS[(r + args.rep) % len(ORDERS)]:
                out[r, k] = block(k) / 1e3
        if y[PULL_BYTES - 1] != 1:  # the reply really arrived
            raise SystemExit("python_overhead: wrong reply bytes")
        w.barrier()  # every worker done
    np.save(args.out + ".paired.npy", out)


def median_ci(values, level: float = 0.95) -> tuple:
    """(median, low, high): a distribution-free confidence interval for the
    median from order statistics (binomial(n, 1/2) tails of (1-level)/2)."""
    v = np.sort(np.asarray(values, np.float64))
    n = len(v)
    med = float(np.median(v))
    tail = (1 - level) / 2
    cdf, k = 0.0, 0  # k: the largest count with P(Bin(n, 1/2) < k) <= tail
    for j in range(n + 1):
        p = math.comb(n, j) / 2.0 ** n
        if cdf + p > tail:
            break
        cdf += p
        k = j + 1
    if k == 0:  # too few blocks for this level: the whole range
        return med, float(v[0]), float(v[-1])
    return med, float(v[k - 1]), float(v[n - k])


def perf_args(args, role: str, scheduler: str) -> list:
    return [args.perf, "--role", role, "--rank", "0", "--scheduler", scheduler,
            "--host", "127.0.0.1", "--transport", "tcp", "--backend", "cpu_mock",
            "--pattern", "1A1F", "--sizes", f"{PUSH_BYTES}:{PULL_BYTES}",
            "--micro-batches", "1", "--warmup", str(args.warmup), "--iters", str(args.iters),
            "--reps", "1", "--timeout-ms", str(int(TIMEOUT_S * 1000)), "--deadline-s", "600"]


def self_args(args, role: str, scheduler: str) -> list:
    return [sys.executable, os.path.abspath(__file__), "--role", role, "--scheduler", scheduler,
            "--iters", str(args.iters), "--warmup", str(args.warmup)]


def run_row(args, row: str, work: str, rep: int = 0) -> dict:
    """One row: a scheduler here, a server and a worker as child processes."""
    import stepmesh
    out = os.path.join(work, row)
    with stepmesh.Scheduler(mesh_options("127.0.0.1:0")) as sched:
        a = sched.address
        server_cmd = (self_args(args, "server", a) if row == "plan_pyserver"
                      else perf_args(args, "server", a))
        if row == "paired":
            warmup, measured = paired_batches(args)
            server_cmd = perf_args(args, "server", a)
            server_cmd[server_cmd.index("--warmup") + 1] = str(warmup)
            server_cmd[server_cmd.index("--iters") + 1] = str(measured)
            worker_cmd = self_args(args, "worker", a) + [
                "--mode", "paired", "--out", out, "--rep", str(rep),
                "--block-iters", str(args.block_iters), "--blocks-per-rep",
                str(args.blocks_per_rep), "--warmup-blocks", str(args.warmup_blocks),
                "--inject-us", str(args.inject_us), "--inject-at", args.inject_at]
        elif row == "cpp":
            worker_cmd = perf_args(args, "worker", a) + ["--json", out + ".json"]
        else:
            mode = "call" if row == "call" else "plan"
            worker_cmd = self_args(args, "worker", a) + ["--mode", mode, "--out", out]
        procs = [subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL),
                 subprocess.Popen(worker_cmd, stdout=subprocess.DEVNULL)]
        try:
            for p in procs:
                p.wait(timeout=600)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
        for name, p in zip(("server", "worker"), procs):
            if p.returncode != 0:
                raise SystemExit(f"python_overhead: {row}: {name} exited {p.returncode}")
    if row == "paired":
        return {"blocks": np.load(out + ".paired.npy")}
    if row == "cpp":
        with open(out + ".json") as f:
            first = json.load(f)["results"][0]
        lat = first["methods"][0]["latency"]
        st = {x["stage"]: x["p50_us"] for x in first.get("stepmesh_stages", [])}
        if not set(STAGES) <= set(st):
            raise SystemExit("python_overhead: stepmesh_perf --role worker printed no stages")
        # stepmesh_perf splits "respond" into "handle" (GetBatch returned ->
        # Respond called) and "respond" (-> reply posted); this table's
        # "respond" is both: the sum of their p50s (an approximation of the
        # p50 of the sum; "handle" is a fraction of a microsecond here).
        st["respond"] += st.get("handle", 0.0)
        # stepmesh_perf stamps right before PushPull(): no "pre" stage.
        return {"p50_us": lat["p50_us"], "p99_us": lat["p99_us"],
                "stages": [0.0] + [st[n] for n in STAGES]}
    lat = np.load(out + ".lat.npy")
    stages = np.load(out + ".stages.npy")
    return {"p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)),
            "stages": [float(v) for v in np.median(stages, axis=0)]}


def report_cross(args, reps: list) -> dict:
    """The cross-process rows (a worker process per row per rep)."""
    print(f"cross-process rows: {args.iters} iters x {args.reps} interleaved reps "
          "(a scheduler, a server and a worker process per row)")
    print(f"{'rep':>4}" + "".join(f" {LABELS[r] + ' p50':>15} {'p99':>8}" for r in ROWS)
          + f" {'+call':>7} {'+plan':>7}")
    for i, r in enumerate(reps):
        print(f"{i:>4}" + "".join(f" {r[x]['p50_us']:>15.1f} {r[x]['p99_us']:>8.1f}" for x in ROWS)
              + f" {r['call']['p50_us'] - r['cpp']['p50_us']:>7.1f}"
              + f" {r['plan']['p50_us'] - r['cpp']['p50_us']:>7.1f}")
    summary = {}
    cpp_p50 = float(np.median([r["cpp"]["p50_us"] for r in reps]))
    for row in ROWS[1:]:
        added = [r[row]["p50_us"] - r["cpp"]["p50_us"] for r in reps]
        p50 = float(np.median([r[row]["p50_us"] for r in reps]))
        summary[row] = {"p50_us": p50, "added_p50_us": float(np.median(added)),
                        "added_min_us": float(min(added)), "added_max_us": float(max(added))}
    for row in ("call", "plan"):
        m = summary[row]
        print(f"{row}: median over reps of (Python p50 - C++ p50) = {m['added_p50_us']:+.1f} us "
              f"(reps {m['added_min_us']:+.1f} .. {m['added_max_us']:+.1f}); C++ p50 "
              f"{cpp_p50:.1f} us (information: the verdict is the paired rows')")
    m = summary["plan_pyserver"]
    print(f"plan with a Python server: {m['added_p50_us']:+.1f} us over C++ on both ends "
          "(information: the target is the worker binding's)")
    names = ("pre",) + STAGES
    print(f"{'stage p50 us':>14}" + "".join(f" {LABELS[r]:>10}" for r in ROWS)
          + f" {'call-C++':>9} {'plan-C++':>9}")
    stage_table = {}
    for k, name in enumerate(names):
        vals = {row: float(np.median([r[row]["stages"][k] for r in reps])) for row in ROWS}
        stage_table[name] = vals
        print(f"{name:>14}" + "".join(f" {vals[r]:>10.1f}" for r in ROWS)
              + f" {vals['call'] - vals['cpp']:>9.1f} {vals['plan'] - vals['cpp']:>9.1f}")
    return {"cpp_p50_us": cpp_p50, "rows": summary, "stages_p50_us": stage_table,
            "reps": [{row: r[row] for row in ROWS} for r in reps]}


def report_paired(args, blocks: np.ndarray) -> dict:
    """The paired rows: `blocks` is (rounds, 3, block_iters) us, all reps' rounds."""
    rounds = blocks.shape[0]
    med = np.median(blocks, axis=2)  # (rounds, 3): each block's median
    print(f"paired rows: one worker process per rep, {rounds} rounds ({args.blocks_per_rep} per "
          f"rep) of 3 blocks x {args.block_iters} round trips, block order rotating"
          + (f"; CALIBRATION: call busy-waits {args.inject_us:g} us per round trip "
             f"({args.inject_at})" if args.inject_us else ""))
    print(f"{'':>16} {'p50 all':>8} {'p99 all':>8} {'added: paired median':>21} "
          f"{'95% CI':>17} {'pooled p50 diff':>16}")
    out = {"rounds": rounds, "block_iters": args.block_iters, "rows": {}}
    cpp_all = blocks[:, 0].ravel()
    for k, kind in enumerate(PAIRED):
        allk = blocks[:, k].ravel()
        row = {"p50_us": float(np.percentile(allk, 50)), "p99_us": float(np.percentile(allk, 99))}
        line = f"{PAIRED_LABELS[kind]:>16} {row['p50_us']:>8.1f} {row['p99_us']:>8.1f}"
        if k > 0:
            d, lo, hi = median_ci(med[:, k] - med[:, 0])
            pooled = row["p50_us"] - float(np.percentile(cpp_all, 50))
            row.update({"added_p50_us": d, "ci95_us": [lo, hi], "pooled_p50_diff_us": pooled,
                        "verdict": "meets" if d <= TARGET_ADDED_P50_US else "misses",
                        "ci_vs_target": ("below" if hi <= TARGET_ADDED_P50_US else
                                         "above" if lo > TARGET_ADDED_P50_US else "straddles")})
            line += f" {d:>+21.1f} {f'[{lo:+.1f}, {hi:+.1f}]':>17} {pooled:>+16.1f}"
        print(line)
        out["rows"][kind] = row
    for kind in PAIRED[1:]:
        r = out["rows"][kind]
        lo, hi = r["ci95_us"]
        print(f"{kind}: adds {r['added_p50_us']:+.1f} us at p50 (paired median over {rounds} "
              f"rounds, 95% CI [{lo:+.1f}, {hi:+.1f}]): {r['verdict']} the <= "
              f"{TARGET_ADDED_P50_US:.0f} us target ("
              + {"below": "the whole interval is below it", "above": "the whole interval is above it",
                 "straddles": "the interval straddles it"}[r["ci_vs_target"]] + ")")
    out["block_medians_us"] = med.tolist()
    return out


def write_json(path: str | None, result: dict) -> None:
    """The result as JSON at `path` (--json), when one was asked for."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--perf", default=os.path.join(root, "build", "benchmarks", "stepmesh_perf"))
    ap.add_argument("--iters", type=int, default=1000, help="cross-process rows: per row per rep")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=200,
                    help="paired rows: rounds of 3 blocks, over all reps")
    ap.add_argument("--block-iters", type=int, default=50)
    ap.add_argument("--warmup-blocks", type=int, default=2)
    ap.add_argument("--only", choices=["cross", "paired"])
    ap.add_argument("--inject-us", type=float, default=0.0,
                    help="calibration: the paired call loop busy-waits this long per round "
                         "trip, where --inject-at says")
    ap.add_argument("--inject-at", choices=["before", "gap"], default="before",
                    help="before: inside the timed window before push_pull (call's added p50 "
                         "must grow by about --inject-us); gap: between push_pull and wait, "
                         "while the request travels (what a caller's delay there costs)")
    ap.add_argument("--json")
    ap.add_argument("--role", choices=["server", "worker"])
    ap.add_argument("--mode", choices=["call", "plan", "paired"])
    ap.add_argument("--scheduler")
    ap.add_argument("--out")
    ap.add_argument("--rep", type=int, default=0)
    ap.add_argument("--blocks-per-rep", type=int)
    args = ap.parse_args()
    if args.role == "server":
        python_server(args)
        return 0
    if args.role == "worker":
        if args.mode == "paired":
            paired_worker(args)
        else:
            python_worker(args)
        return 0
    for name in ("iters", "reps", "blocks", "block_iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not os.access(args.perf, os.X_OK):
        print(f"python_overhead: {args.perf} not built (ninja -C build stepmesh_perf)",
              file=sys.stderr)
        return 2
    args.blocks_per_rep = -(-args.blocks // args.reps)
    rows = (() if args.only == "paired" else ROWS) + (() if args.only == "cross" else ("paired",))
    reps = []
    with tempfile.TemporaryDirectory() as work:
        for rep in range(args.reps):
            # Rotated each rep: no row always runs first or after the same neighbour.
            order = rows[rep % len(rows):] + rows[:rep % len(rows)]
            reps.append({row: run_row(args, row, work, rep) for row in order})
    print(f"python_overhead: 1A1F tcp, push {PUSH_BYTES} B, pull {PULL_BYTES} B, "
          f"load {os.getloadavg()[0]:.2f}")
    result = {"tool": "python_overhead", "push_bytes": PUSH_BYTES, "pull_bytes": PULL_BYTES,
              "iters": args.iters, "reps": args.reps,
              "target_added_p50_us": TARGET_ADDED_P50_US}
    if args.only != "paired":
        result["cross"] = report_cross(args, reps)
    if args.only != "cross":
        result["paired"] = report_paired(
            args, np.concatenate([r["paired"]["blocks"] for r in reps]))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
