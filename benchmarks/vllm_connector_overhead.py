#!/usr/bin/env python3
"""What StepMeshAFDConnector adds to a per-layer round trip, against Plan.run()
on the same mesh in the same process (the paired method of python_overhead.py).

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/vllm_connector_overhead.py \\
        [--patterns 1A1F,2A2F-subgroup,2A2F-all_to_all] [--tokens 128] [--hidden 7168] \\
        [--rounds 240] [--block-iters 20] [--custom-ops auto|always] [--json out.json]

Per pattern: A attention and F FFN processes of this script, each with a
StepMeshAFDConnector (stepmesh.vllm, the stand-in plugin base from
python/tests/ or the real one), TCP on 127.0.0.1, cpu_mock, CPU bf16 tensors
of [tokens, hidden]. The FFN processes echo the hidden states: through the
connector (recv_attn_output, then send_ffn_output of them) in the connector's
rows, and as a program on stepmesh.Server would in the baselines' (--ffn-side
alternate, the default: get_batch, the same copies, respond), so every row
includes both sides' code; --ffn-side connector: the connector always (the
attention side's code only, as the rows measured until 2026-12-04). Each
attention process runs rounds of six blocks of --block-iters round trips,
the block order rotating through 12 orders (every cyclic shift, forwards and
backwards), every attention rank
in lockstep (a batch needs all of them):

* ``plan``: ``conn._plans[0].run()``, the connector's own prepared request
  (same keys, bytes and server work): the binding's floor;
* ``post_wait``: ``w.wait(plan.post())``, the same request in the two binding
  calls a split send/receive contract needs (what the connector cannot avoid);
* ``connector``: ``send_attn_output(send_buffer(0)[:n], ctx)`` +
  ``recv_ffn_output(recv_buffer(0)[:n], 0)``: the connector's whole Python
  path (checks, custom-op dispatch, metadata, two binding calls), no copy;
* ``plan_sum``: ``plan`` plus the sum of the FFN ranks' partial outputs into
  FFN rank 0's buffer, as the connector does for all_to_all (for subgroup
  there is nothing to sum: the same as ``plan``): the baseline for the
  verdict, so that the add, which is work, does not count as overhead;
* ``post_wait_sum``: ``post_wait`` plus that sum: the connector's floor given
  the split contract, so connector - post_wait_sum is the connector's own code;
* ``runner``: as vLLM's model runner calls it: a fresh hidden-states tensor
  (copied into the send buffer) and ``ref_tensor`` = that tensor (the output
  copied into it): ``connector`` plus two copies of tokens x hidden bf16.

Each row: the median over rounds of (block median - the same round's
``plan`` block median), with a distribution-free 95% interval. ``--alternate N`` replaces the blocks by a finer pairing of the two rows that
matter: connector and post_wait_sum in turn every N round trips.

The ``connector`` row takes the lanes' one-call common case (the registered
buffers, eager, host-ordered: python/src/attention_lanes.h). A last row, in
this process: the connector's Python path, which every other call takes (CUDA
streams, copies, router logits), with the lanes replaced by stand-ins that
return at once, best of 5; and
the same cold (--evict-mb MB written between round trips, as a layer's
compute or the processes sharing the CPUs leave the caches) against the
stand-in post + wait cold, paired per round trip.
The verdict:
``connector`` - ``plan_sum`` (paired the same way) <= 10 us.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STANDIN = os.path.join(ROOT, "python", "tests", "afd_plugin_standin")
sys.path.insert(0, HERE)
from python_overhead import median_ci, write_json  # noqa: E402  (the same interval, file)
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
import proc_util  # noqa: E402  (the tests' free port run)

KINDS = ("plan", "post_wait", "connector", "runner", "plan_sum", "post_wait_sum")
# Block orders: every cyclic shift of the kinds, forwards and backwards (12):
# every kind in every position equally often, after its two neighbours in turn.
_BASE = list(range(len(KINDS)))
ORDERS = [tuple(_BASE[i:] + _BASE[:i]) for i in range(len(KINDS))]
ORDERS += [tuple(reversed(o)) for o in ORDERS]
TARGET_ADDED_US = 10.0
TIMEOUT_S = 60.0


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def make_connector(args):
    import importlib.util
    if importlib.util.find_spec("afd_plugin") is None:  # the tests' stand-in base
        sys.path.insert(0, STANDIN)
    import torch

    import stepmesh.vllm as sv
    extra = {"topology": args.topology, "transport": "tcp", "backend": "cpu_mock",
             "max_tokens": args.tokens, "num_stages": 1, "timeout": TIMEOUT_S,
             "custom_ops": args.custom_ops, "poll_mode": args.poll_mode}
    vcfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(hidden_size=args.hidden), dtype=torch.bfloat16,
            enforce_eager=True),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=args.tokens),
        compilation_config=None,
        additional_config={"afd": {"connector": sv.NAME, "connector_extra_config": extra}})
    acfg = types.SimpleNamespace(connector=sv.NAME, role=args.role, host="127.0.0.1",
                                 port=args.port, num_attention_ranks=args.A,
                                 num_ffn_ranks=args.F, compute_gate_on_attention=False)
    conn = sv.StepMeshAFDConnector(args.rank, 0, vcfg, acfg, args.rank)
    conn.init_afd_connector()
    return conn, sv, torch


def total_round_trips(args) -> int:
    return (args.warmup_rounds + args.rounds) * len(KINDS) * args.block_iters + 1  # + the check


def connector_round_trips(args):
    """For every round trip the attention processes make, in order: whether
    it goes through the connector (the connector and runner rows) or is a
    baseline's (Plan.run, post + wait, their sums), the last (the check) the
    connector's."""
    if args.alternate:
        for i in range(total_round_trips(args) - 1):
            yield (i // args.alternate) % 2 == 1 and not args.null
    else:
        for r in list(range(args.warmup_rounds)) + list(range(args.rounds)):
            for k in ORDERS[r % len(ORDERS)]:
                for _ in range(args.block_iters):
                    yield k in (2, 3)
    yield True


def ffn(args) -> None:
    """Answers every round trip with the attention ranks' hidden states. With
    --ffn-side alternate (the default) a baseline's round trip is answered
    without the connector, as a program on stepmesh.Server would (the batch,
    the contract's work -- the ranks' rows gathered into one [sum(n), hidden]
    input when there are several, the output copied into the reply region's
    first rows, the replies packed there -- on views made once, then respond), so the connector's FFN-side code is in
    the connector's rows only; with --ffn-side connector every round trip is
    the connector's (what the rows measured until 2026-12-05)."""
    conn, _, _ = make_connector(args)
    srv, n, M = conn._node, args.tokens, args.tokens
    workers = range(conn.mesh_workers)
    region, gather, reply = conn._regions[0], conn._gathers[0], conn._replies[0]
    if len(workers) == 1:
        gathers, output = [], region[:n]
    else:
        gathers = [(gather[i * n:(i + 1) * n], region[w * M:w * M + n])
                   for i, w in enumerate(workers)]
        output = gather[:n * len(workers)]
    packed = reply[:n * len(workers)]  # the replies back to back: one copy, as the connector
    rows = {w: n for w in workers}
    offsets = {w: i * n for i, w in enumerate(workers)}
    for through_connector in connector_round_trips(args):
        if through_connector or args.ffn_side == "connector":
            p = conn.recv_attn_output(0)
            conn.send_ffn_output(p.hidden_states, p.context)
            continue
        batch = srv.get_batch(TIMEOUT_S)
        for dst, src in gathers:
            dst.copy_(src)
        packed.copy_(output)
        srv.respond(batch, rows=rows, offsets=offsets)
    conn.close()


def attention(args) -> None:
    conn, sv, torch = make_connector(args)
    if args.python_path:  # every call through the connector's Python path (the A/B of the lanes)
        conn._fast = None
    n, h = args.tokens, args.hidden
    ctx = sv.AFDTransferContext(metadata=sv.AFDTransferMetadata(0, 0, [n]))
    send, recv = conn.send_buffer(0)[:n], conn.recv_buffer(0)[:n]
    send.copy_(torch.randint(-4, 5, (n, h)).to(torch.bfloat16))
    fresh = send.clone()
    plan, w = conn._plans[0], conn._node
    others = [p[:n] for p in conn._recv_bufs[0][1:]]  # FFN ranks 1.. (all_to_all)
    plan.set_rows(0, n)
    clock = time.perf_counter_ns
    lat = np.empty(args.block_iters, np.int64)

    if args.alternate:  # --alternate N: connector / post_wait_sum, N round trips each, in turn
        total = total_round_trips(args) - 1
        out = np.empty((total, 2))
        for i in range(total):
            connector = (i // args.alternate) % 2 == 1
            t0 = clock()
            if connector and not args.null:
                conn.send_attn_output(send, ctx)
                conn.recv_ffn_output(recv, 0)
            else:
                w.wait(plan.post(), TIMEOUT_S)
                for p in others:
                    recv.add_(p)
            out[i] = (connector, (clock() - t0) / 1e3)
        conn.send_attn_output(send, ctx)
        conn.recv_ffn_output(recv, 0)
        conn.close()
        if args.rank == 0:
            np.save(args.out, out)
        return

    def block(kind: int) -> np.ndarray:
        for i in range(args.block_iters):
            if kind == 0:
                t0 = clock()
                plan.run(TIMEOUT_S)
            elif kind == 1:
                t0 = clock()
                w.wait(plan.post(), TIMEOUT_S)
            elif kind == 2:
                t0 = clock()
                conn.send_attn_output(send, ctx)
                conn.recv_ffn_output(recv, 0)
            elif kind == 4:
                t0 = clock()
                plan.run(TIMEOUT_S)
                for p in others:  # all_to_all: the sum of the partials the connector does
                    recv.add_(p)
            elif kind == 5:
                t0 = clock()
                w.wait(plan.post(), TIMEOUT_S)
                for p in others:
                    recv.add_(p)
            else:
                x = fresh  # the model's output tensor (not the registered buffer)
                t0 = clock()
                conn.send_attn_output(x, ctx)
                conn.recv_ffn_output(x, 0)
            lat[i] = clock() - t0
            if kind == 3:
                fresh.copy_(send)  # restore the input (the output overwrote it), untimed
        return lat / 1e3

    out = np.empty((args.rounds, len(KINDS), args.block_iters))
    for r in range(args.warmup_rounds):
        for k in ORDERS[r % len(ORDERS)]:
            block(k)
    for r in range(args.rounds):
        for k in ORDERS[r % len(ORDERS)]:
            out[r, k] = block(k)
    conn.send_attn_output(send, ctx)  # one more through the connector, checked
    conn.recv_ffn_output(recv, 0)
    want = send.float() * (args.F if args.topology == "all_to_all" else 1)
    if not torch.equal(recv.float(), want):  # the FFN echoes: the reply really arrived
        raise SystemExit("vllm_connector_overhead: wrong reply bytes")
    conn.close()
    if args.rank == 0:
        np.save(args.out, out)


def python_path(args) -> float:
    """The connector's Python path per round trip, without the binding (what
    calls outside the lanes' one-call common case run: CUDA streams, copies,
    router logits): a 1A1F attention connector whose lanes are stand-ins that
    do nothing (post and wait return at once), in place buffers; the best of
    5 runs of --python-iters round trips, in us."""
    import importlib.util
    if importlib.util.find_spec("afd_plugin") is None:
        sys.path.insert(0, STANDIN)
    import torch

    import stepmesh.vllm as sv
    n, h = args.tokens, args.hidden
    vcfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(hidden_size=h),
                                           dtype=torch.bfloat16),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=n), additional_config={})
    acfg = types.SimpleNamespace(role="attention", num_attention_ranks=1, num_ffn_ranks=1,
                                 host="127.0.0.1", port=1)
    conn = sv.StepMeshAFDConnector(0, 0, vcfg, acfg, 0)

    class Node:  # what the connector reads of a Worker
        closed = False

    class Lanes:  # what the Python path calls on the lanes, doing nothing
        rows = None

        def pending(self, s):
            return self.rows

        def post(self, s, rows, layer, flags, stream=None):
            self.rows = rows

        def wait(self, s):
            rows, self.rows = self.rows, None
            return rows

    conn._node, conn._lanes, conn._fast, conn._live_role = Node(), Lanes(), None, "attention"
    conn._send_bufs = [torch.empty(n, h, dtype=torch.bfloat16)]
    conn._recv_bufs = [[torch.empty(n, h, dtype=torch.bfloat16)]]
    conn._send_ptrs = [conn._send_bufs[0].data_ptr()]
    conn._recv_ptrs = [conn._recv_bufs[0][0].data_ptr()]
    send, recv = conn._send_bufs[0][:n], conn._recv_bufs[0][0][:n]
    ctx = sv.AFDTransferContext(metadata=sv.AFDTransferMetadata(0, 0, [n]))
    best = float("inf")
    for rep in range(6):  # the first is a warm-up
        t0 = time.perf_counter_ns()
        for _ in range(args.python_iters):
            conn.send_attn_output(send, ctx)
            conn.recv_ffn_output(recv, 0)
        if rep:
            best = min(best, (time.perf_counter_ns() - t0) / args.python_iters / 1e3)
    # Cold: what a layer's compute (or the other processes sharing the CPUs)
    # leaves of the caches, modelled by writing --evict-mb MB between round
    # trips; the same stand-in lanes' post + wait in turn is the floor.
    lanes = conn._lanes
    junk = np.ones(max(args.evict_mb, 1) << 20, np.uint8)
    clock = time.perf_counter_ns
    diffs = np.empty(min(args.python_iters, 2000))
    for i in range(len(diffs)):
        junk += 1
        t0 = clock()
        conn.send_attn_output(send, ctx)
        conn.recv_ffn_output(recv, 0)
        t1 = clock()
        junk += 1
        t2 = clock()
        lanes.post(0, n, 0, 0)
        lanes.wait(0)
        diffs[i] = ((t1 - t0) - (clock() - t2)) / 1e3
    return best, median_ci_large(diffs)


def run_pattern(args, pattern: str, work: str) -> np.ndarray:
    shape, _, topology = pattern.partition("-")
    A, F = int(shape[0]), int(shape[2])
    topology = topology or "subgroup"
    port = proc_util.free_port_run(F)
    out = os.path.join(work, f"{pattern}.npy")
    common = ["--A", str(A), "--F", str(F), "--topology", topology, "--port", str(port),
              "--tokens", str(args.tokens), "--hidden", str(args.hidden),
              "--rounds", str(args.rounds), "--warmup-rounds", str(args.warmup_rounds),
              "--block-iters", str(args.block_iters), "--custom-ops", args.custom_ops,
              "--alternate", str(args.alternate), "--out", out]
    if args.python_path:
        common.append("--python-path")
    if args.null:
        common.append("--null")
    common += ["--ffn-side", args.ffn_side]
    if args.poll_mode:
        common += ["--poll-mode", args.poll_mode]
    env = dict(os.environ)
    env.setdefault("STEPMESH_AUTH", "off")  # loopback only
    procs = []
    try:
        for role, count in (("ffn", F), ("attention", A)):
            for r in range(count):
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--role", role, "--rank", str(r)]
                    + common, env=env, preexec_fn=die_with_parent))
        deadline = time.monotonic() + args.deadline_s
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise SystemExit(f"vllm_connector_overhead: {pattern}: pid {p.pid} exited {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    return np.load(out)


def median_ci_large(values) -> tuple:
    """median_ci for any n: python_overhead's exact binomial tails up to 500
    values, the normal approximation of the same order statistics above."""
    v = np.sort(np.asarray(values, np.float64))
    n = len(v)
    if n <= 500:
        return median_ci(v)
    k = int(math.floor(n / 2 - 1.96 * math.sqrt(n) / 2))
    return float(np.median(v)), float(v[k - 1]), float(v[n - k])


def report_alternate(pattern: str, out: np.ndarray, n: int) -> dict:
    """--alternate: each connector window against the post_wait_sum window before it."""
    windows = len(out) // (2 * n)
    diffs = []
    for k in range(windows):
        base = out[2 * k * n: (2 * k + 1) * n, 1]
        conn = out[(2 * k + 1) * n: (2 * k + 2) * n, 1]
        diffs.append(np.median(conn) - np.median(base))
    d, lo, hi = median_ci_large(diffs)
    p50 = {kind: float(np.percentile(out[out[:, 0] == flag, 1], 50))
           for kind, flag in (("post_wait_sum", 0), ("connector", 1))}
    print(f"{pattern}: alternating every {n} round trips, {windows} window pairs: p50 "
          f"post_wait_sum {p50['post_wait_sum']:.1f} us, connector {p50['connector']:.1f} us; "
          f"connector - post_wait_sum {d:+.1f} us [{lo:+.1f}, {hi:+.1f}]")
    return {"p50_us": p50, "added_us": d, "ci95_us": [lo, hi], "windows": windows}


def report(pattern: str, blocks: np.ndarray) -> dict:
    med = np.median(blocks, axis=2)
    rows = {}
    print(f"{pattern}: {blocks.shape[0]} rounds of {len(KINDS)} blocks x {blocks.shape[2]} round trips")
    print(f"  {'':>13} {'p50':>8} {'p99':>8} {'added vs plan':>14} {'95% CI':>17}")
    for k, kind in enumerate(KINDS):
        allk = blocks[:, k].ravel()
        row = {"p50_us": float(np.percentile(allk, 50)), "p99_us": float(np.percentile(allk, 99))}
        line = f"  {kind:>13} {row['p50_us']:>8.1f} {row['p99_us']:>8.1f}"
        if k:
            d, lo, hi = median_ci(med[:, k] - med[:, 0])
            row.update({"added_us": d, "ci95_us": [lo, hi]})
            line += f" {d:>+14.1f} {f'[{lo:+.1f}, {hi:+.1f}]':>17}"
        rows[kind] = row
        print(line)
    d, lo, hi = median_ci(med[:, 2] - med[:, 5])
    rows["connector_vs_post_wait_sum"] = {"added_us": d, "ci95_us": [lo, hi]}
    print(f"  connector - post_wait_sum (its own code): {d:+.1f} us [{lo:+.1f}, {hi:+.1f}]")
    d, lo, hi = median_ci(med[:, 2] - med[:, 4])
    ci = "below" if hi <= TARGET_ADDED_US else "above" if lo > TARGET_ADDED_US else "straddles"
    verdict = "meets" if d <= TARGET_ADDED_US else "misses"
    rows["verdict"] = {"added_us": d, "ci95_us": [lo, hi], "verdict": verdict, "ci_vs_target": ci}
    print(f"  connector - plan_sum: {d:+.1f} us (95% CI [{lo:+.1f}, {hi:+.1f}]): {verdict} the "
          f"<= {TARGET_ADDED_US:.0f} us target (the interval is {ci} it)")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--patterns", default="1A1F,2A2F-subgroup,2A2F-all_to_all")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--rounds", type=int, default=240, help="a multiple of 12: every order")
    ap.add_argument("--warmup-rounds", type=int, default=6)
    ap.add_argument("--block-iters", type=int, default=20)
    ap.add_argument("--deadline-s", type=float, default=900.0)
    ap.add_argument("--custom-ops", choices=["auto", "always"], default="auto",
                    help="the connector's custom_ops option: always = every call through "
                         "the torch dispatcher (what a compiled/captured graph runs)")
    ap.add_argument("--alternate", type=int, default=0,
                    help="instead of the blocks: alternate connector and post_wait_sum every N "
                         "round trips (as many round trips in all), paired per window pair")
    ap.add_argument("--python-iters", type=int, default=50000,
                    help="round trips per run of the in-process Python-only row (0: skip it)")
    ap.add_argument("--evict-mb", type=int, default=16,
                    help="MB written between round trips of the cold Python-only row")
    ap.add_argument("--poll-mode", choices=["spin", "adaptive", "blocking"],
                    help="every connector's poll_mode (default: the library's, adaptive); "
                    "blocking keeps idle send and receive threads off a machine with fewer "
                    "cores than the benchmark has processes")
    ap.add_argument("--python-path", action="store_true",
                    help="the connector row through the Python path, not the lanes' one-call "
                         "common case (what the connector did before it; the A/B of the lanes)")
    ap.add_argument("--null", action="store_true",
                    help="with --alternate: the connector's windows run post_wait_sum too (an "
                         "A/A run: the pairing's own bias, which should be 0 within the "
                         "interval)")
    ap.add_argument("--ffn-side", choices=["alternate", "connector"], default="alternate",
                    help="alternate: the FFN processes answer the baselines' round trips "
                         "without the connector (a program on stepmesh.Server doing the same "
                         "copies), so the rows include the connector's FFN-side code; "
                         "connector: the FFN processes always use the connector (the rows "
                         "measure the attention side's code only)")
    ap.add_argument("--json")
    ap.add_argument("--role", choices=["ffn", "attention"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--A", type=int)
    ap.add_argument("--F", type=int)
    ap.add_argument("--topology")
    ap.add_argument("--port", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.null and not args.alternate:
        ap.error("--null needs --alternate N")
    if args.role:
        die_with_parent()
        (ffn if args.role == "ffn" else attention)(args)
        return 0
    result = {"tool": "vllm_connector_overhead", "tokens": args.tokens, "hidden": args.hidden,
              "dtype": "bfloat16", "custom_ops": args.custom_ops,
              "poll_mode": args.poll_mode or "adaptive", "target_added_us": TARGET_ADDED_US,
              "ffn_side": args.ffn_side,
              "connector_path": ("none (--null)" if args.null else
                                 "python" if args.python_path else "lanes"),
              "patterns": {}}
    with tempfile.TemporaryDirectory() as work:
        for pattern in args.patterns.split(","):
            blocks = run_pattern(args, pattern, work)
            result["patterns"][pattern] = (report_alternate(pattern, blocks, args.alternate)
                                           if args.alternate else report(pattern, blocks))
    if args.python_iters > 0:
        us, (cold, lo, hi) = python_path(args)
        result["python_only_us"] = us
        result["python_only_cold_us"] = {"added_us": cold, "ci95_us": [lo, hi],
                                         "evict_mb": args.evict_mb}
        print(f"the connector's Python path (send_attn_output + recv_ffn_output outside the "
              f"lanes' common case, on stand-in lanes, in process, best of 5 x "
              f"{args.python_iters}): {us:.2f} us")
        print(f"  cold ({args.evict_mb} MB written between round trips), minus the stand-in "
              f"post + wait: {cold:+.2f} us [{lo:+.2f}, {hi:+.2f}]")
    print(f"load {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
