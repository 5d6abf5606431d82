#!/usr/bin/env python3
"""Attention-FFN disaggregation in numpy through stepmesh.afd.Connector.

2 attention + 2 FFN processes over TCP on 127.0.0.1 run a small MoE layer
stack: each attention rank runs its "attention" (a per-token mixing layer)
and the router on its own tokens, and sends hidden states plus router logits
for 3 micro-batch stages; each FFN rank holds half of the experts, applies
the top-k routing to every attention rank's tokens and returns partial sums,
which the attention side adds up. Token counts vary per step, stage and rank.
The result is checked bit for bit against a single-process numpy computation
of the same layers; tokens/s and per-stage round-trip latency are printed.

    /usr/bin/python3 examples/python/afd_numpy.py [--steps 8] [--layers 4]

(PYTHONPATH must reach the stepmesh package: build/python, or install it.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # same BLAS path in every process
import numpy as np  # noqa: E402

HIDDEN, EXPERTS, TOP_K, STAGES = 64, 8, 2, 3
NUM_ATTN, NUM_FFN = 2, 2


# ------------------------------------------------------------------ the model

def weights(layers: int):
    rng = np.random.default_rng(1234)
    w = []
    for _ in range(layers):
        w.append({
            "attn": (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32),
            "router": rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32),
            "w1": (rng.standard_normal((EXPERTS, HIDDEN, 2 * HIDDEN)) / np.sqrt(HIDDEN)).astype(
                np.float32),
            "w2": (rng.standard_normal((EXPERTS, 2 * HIDDEN, HIDDEN)) / np.sqrt(2 * HIDDEN)).astype(
                np.float32),
        })
    return w


def attention(x, w):
    """The attention side of a layer: mixing + residual, then router logits."""
    x = np.tanh(x @ w["attn"]) + x
    return x.astype(np.float32), (x @ w["router"]).astype(np.float32)


def experts_of(ffn_rank: int):
    per = EXPERTS // NUM_FFN
    return range(ffn_rank * per, (ffn_rank + 1) * per)


def moe_partial(x, logits, w, ffn_rank: int):
    """The FFN rank's share of the MoE: its experts' weighted outputs for every token."""
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
    chosen = np.take_along_axis(logits, top, axis=1)
    gates = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    gates = (gates / gates.sum(axis=1, keepdims=True)).astype(np.float32)
    out = np.zeros_like(x)
    for e in experts_of(ffn_rank):
        rows, slot = np.nonzero(top == e)
        if rows.size == 0:
            continue
        h = np.maximum(x[rows] @ w["w1"][e], 0) @ w["w2"][e]
        out[rows] += gates[rows, slot][:, None] * h
    return out


def tokens(step: int, stage: int, rank: int, max_tokens: int) -> int:
    rng = np.random.default_rng([step, stage, rank])
    return int(rng.integers(1, max_tokens + 1))


def inputs(step: int, stage: int, rank: int, n: int):
    return np.random.default_rng([99, step, stage, rank]).standard_normal((n, HIDDEN)).astype(
        np.float32)


def reference(args):
    """The same layers in one process, with the same shapes and summation order."""
    w = weights(args.layers)
    out = {}
    for step in range(args.steps):
        xs = {(a, s): inputs(step, s, a, tokens(step, s, a, args.max_tokens))
              for a in range(NUM_ATTN) for s in range(STAGES)}
        for layer in range(args.layers):
            for s in range(STAGES):
                attn = [attention(xs[(a, s)], w[layer]) for a in range(NUM_ATTN)]
                x = np.concatenate([h for h, _ in attn])
                logits = np.concatenate([lg for _, lg in attn])
                partials = [moe_partial(x, logits, w[layer], f) for f in range(NUM_FFN)]
                row = 0
                for a in range(NUM_ATTN):
                    n = attn[a][0].shape[0]
                    total = partials[0][row: row + n].copy()
                    for p in partials[1:]:
                        total += p[row: row + n]
                    xs[(a, s)] = attn[a][0] + total
                    row += n
        for key, x in xs.items():
            out[(step,) + key] = x
    return out


# ------------------------------------------------------------------ the roles

def connector(args, role, rank, on_scheduler=None):
    from stepmesh.afd import Connector
    return Connector(role=role, rank=rank, num_attention=NUM_ATTN, num_ffn=NUM_FFN,
                     hidden_size=HIDDEN, max_tokens=args.max_tokens, num_stages=STAGES,
                     dtype="float32", router_logits_dim=EXPERTS,
                     mesh={"scheduler": args.scheduler, "transport": "tcp", "timeout": 30.0},
                     on_scheduler=on_scheduler)


def run_ffn(args):
    w = weights(args.layers)
    conn = connector(args, "ffn", args.rank,
                     on_scheduler=lambda addr: print(f"scheduler {addr}", flush=True))
    with conn:
        for step in range(args.steps):
            for layer in range(args.layers):
                for s in range(STAGES):
                    p = conn.recv_attn_output(s)
                    assert p.context.layer_idx == layer and p.context.stage_idx == s
                    expected = [tokens(step, s, a, args.max_tokens) for a in range(NUM_ATTN)]
                    assert p.seq_lens == expected, (p.seq_lens, expected)
                    conn.send_ffn_output(
                        moe_partial(p.hidden_states, p.router_logits, w[layer], args.rank),
                        p.context)


def run_attention(args):
    w = weights(args.layers)
    results, latency = {}, {s: [] for s in range(STAGES)}
    out = np.zeros((args.max_tokens, HIDDEN), np.float32)  # preallocated, stable address
    n_tokens = 0
    with connector(args, "attention", args.rank) as conn:
        start = time.perf_counter()
        for step in range(args.steps):
            xs = [inputs(step, s, args.rank, tokens(step, s, args.rank, args.max_tokens))
                  for s in range(STAGES)]
            n_tokens += sum(x.shape[0] for x in xs)
            for layer in range(args.layers):
                hs, sent = [], []
                for s in range(STAGES):
                    h, logits = attention(xs[s], w[layer])
                    sent.append(time.perf_counter())
                    conn.send_attn_output(h, layer, s, router_logits=logits)
                    hs.append(h)
                for s in range(STAGES):
                    conn.recv_ffn_output(out, s)
                    latency[s].append(time.perf_counter() - sent[s])
                    xs[s] = hs[s] + out[: hs[s].shape[0]]
            for s in range(STAGES):
                results[f"{step}_{args.rank}_{s}"] = xs[s]
        elapsed = time.perf_counter() - start
    np.savez(os.path.join(args.out_dir, f"attention{args.rank}.npz"), **results)
    print(json.dumps({"tokens": n_tokens, "seconds": elapsed,
                      "stage_p50_us": [float(np.median(latency[s]) * 1e6) for s in range(STAGES)]}),
          flush=True)


# ------------------------------------------------------------------ launcher

def launch(args) -> int:
    me = os.path.abspath(__file__)
    common = ["--steps", str(args.steps), "--layers", str(args.layers),
              "--max-tokens", str(args.max_tokens)]
    procs = []

    def spawn(extra):
        p = subprocess.Popen([sys.executable, me, *common, *extra], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        return p

    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            # FFN rank 0 starts the scheduler on a free port and reports it.
            ffn0 = spawn(["--role", "ffn", "--rank", "0", "--scheduler", "127.0.0.1:0",
                          "--out-dir", out_dir])
            line = ffn0.stdout.readline()
            if not line.startswith("scheduler "):
                print(f"afd_numpy: FFN rank 0 did not start the scheduler: {line!r}",
                      file=sys.stderr)
                return 1
            addr = line.split()[1]
            spawn(["--role", "ffn", "--rank", "1", "--scheduler", addr, "--out-dir", out_dir])
            for a in range(NUM_ATTN):
                spawn(["--role", "attention", "--rank", str(a), "--scheduler", addr,
                       "--out-dir", out_dir])
            outputs, failed = [], False
            for p in procs:
                try:
                    o, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"afd_numpy: pid {p.pid} timed out", file=sys.stderr)
                    failed = True
                    break
                outputs.append(o)
                failed |= p.returncode != 0
            if failed:
                print("afd_numpy: a process failed", file=sys.stderr)
                return 1
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.communicate()
        stats = [json.loads(o.strip().splitlines()[-1]) for o in outputs[NUM_FFN:]]
        got = {}
        for a in range(NUM_ATTN):
            with np.load(os.path.join(out_dir, f"attention{a}.npz")) as z:
                got.update({k: z[k] for k in z.files})
    ref = reference(args)
    mismatched = [k for k, x in ref.items()
                  if not np.array_equal(got["_".join(map(str, k))].view(np.uint32),
                                        x.view(np.uint32))]
    total_tokens = sum(s["tokens"] for s in stats)
    seconds = max(s["seconds"] for s in stats)
    print(f"afd_numpy: {NUM_ATTN}A{NUM_FFN}F over TCP, {STAGES} stages, {args.steps} steps x "
          f"{args.layers} layers, {total_tokens} tokens")
    print(f"  throughput: {total_tokens / seconds:.1f} tokens/s "
          f"(each token through all {args.layers} layers)")
    for s in range(STAGES):
        p50 = np.median([st["stage_p50_us"][s] for st in stats])
        print(f"  stage {s}: send_attn_output -> recv_ffn_output p50 {p50:.0f} us")
    if mismatched:
        print(f"  reference check: FAILED, {len(mismatched)} of {len(ref)} outputs differ "
              f"(first: step/rank/stage {mismatched[0]})")
        return 1
    print(f"  reference check: {len(ref)} outputs bit-identical to the single-process numpy run")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole run")
    ap.add_argument("--role", choices=["attention", "ffn"])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--scheduler", default="127.0.0.1:0")
    ap.add_argument("--out-dir")
    args = ap.parse_args()
    if args.role is None:
        return launch(args)
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # die with the launcher
    (run_ffn if args.role == "ffn" else run_attention)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
