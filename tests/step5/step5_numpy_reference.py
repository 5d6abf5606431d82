#!/usr/bin/python3
"""Independent float64 numpy implementation of one sliding-window layer and
one global sparse layer of the Step-5 variant, compared with the C++ example.

Written from the reference notes (step3_model.md §4.3-4.4: indexer, block
summaries, weighted-ReLU scores, top-k with the prefix tie rule plus the
current block, sparse attention over the original K/V) and the choices
docs/model.md records for the unknowns of §4.6, not from the C++ code. It
regenerates every weight itself (SplitMix64 over the tensor names, the rules
of docs/model.md "Weights"), reads the configuration file itself, and takes
from the C++ side only the residual stream entering each attention block
(written by step5_layer_dump), so the computation under test is the layer.

Checks, for every sliding and every global layer of the dump:
  * the residual stream after the attention block: per-token relative L2
    error <= 1e-5 (fp32 vs float64);
  * global layers: the selected history blocks per (token, group) equal the
    float64 selection; a difference is accepted only where the float64
    scores make the C++ choice an equally valid top-k within 1e-5 (a
    near-tie that fp32 may resolve the other way), and the output of such a
    token is then compared under the C++ selection.

  step5_numpy_reference.py --dump-binary build/.../step5_layer_dump \
      --config examples/afd_model/configs/tiny_step5.cfg [--prompt-len 112]
Exit 0 on PASS, 1 on FAIL, 2 on usage errors.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
from step3_numpy_reference import ints as step3_ints  # noqa: E402  (the same weights)


# ------------------------------------------------------------------ weights

def draws(name, seed, count):
    """Signed bytes k in [-128, 127] of elements 0..count-1 of a tensor: the
    Step-3 model's counter-based SplitMix64 stream (docs/model.md 3.3)."""
    return step3_ints(name, seed, (count,))


def linear_weight(name, seed, rows, fan_in, router=False):
    # s = round(log2(sqrt(fan_in))), halves rounded up.
    s = int(math.floor(math.log2(math.sqrt(fan_in)) + 0.5))
    if router:
        s -= 2
    k = draws(name, seed, rows * fan_in).astype(np.float64)
    return (k * 2.0 ** -(7 + s)).reshape(rows, fan_in)


def norm_factor(name, seed, count):
    # 1 + (k >> 3) * 2^-7 with an arithmetic (floor) shift.
    k = draws(name, seed, count)
    return 1.0 + np.floor_divide(k, 8).astype(np.float64) / 128.0


# ------------------------------------------------------------------ formats

def round_mantissa(x, bits):
    """Round to `bits` significant bits, ties to even (np.round is RNE)."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    return np.ldexp(np.round(np.ldexp(m, bits)), e - bits)


def bf16(x):
    return round_mantissa(x, 8)


def e4m3(x):
    """OCP E4M3 (fn): 3 mantissa bits, min normal 2^-6, subnormal step
    2^-9, saturating at +-448, round to nearest even."""
    x = np.asarray(x, dtype=np.float64)
    normal = round_mantissa(x, 4)
    subnormal = np.round(x * 512.0) / 512.0
    y = np.where(np.abs(x) < 2.0 ** -6, subnormal, normal)
    return np.clip(y, -448.0, 448.0)


# ------------------------------------------------------------------ config

def read_config(path):
    values = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                key, value = line.split("=", 1)
                values[key.strip()] = value.strip()
    c = {
        "H": int(values["hidden_size"]),
        "heads": int(values["num_attention_heads"]),
        "G": int(values["num_attention_groups"]),
        "d": int(values["head_dim"]),
        "W": int(values["sliding_window"]),
        "rot_full": int(values["full_rotary_dim"]),
        "theta_full": float(values["full_rope_theta"]),
        "rot_sliding": int(values["sliding_rotary_dim"]),
        "theta_sliding": float(values["sliding_rope_theta"]),
        "IH": int(values["index_n_heads"]),
        "P": int(values["index_head_dim"]),
        "rot_index": int(values["index_rotary_dim"]),
        "B": int(values["index_block_size"]),
        "K": int(values["index_topk_blocks"]),
        "eps_index": float(values["index_norm_eps"]),
        "eps": float(values["rms_norm_eps"]),
        "seed": int(values["weight_seed"], 0),
    }
    return c


# ------------------------------------------------------------------ layers

def rms_norm(x, factor, eps):
    # Zero-centred norms store (1 + w) as the factor (docs/model.md).
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * factor


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def rope(x, rotary, theta):
    """NeoX rotation of the first `rotary` coordinates of the last axis;
    x has shape [T, ..., width], position = index along axis 0."""
    if rotary == 0:
        return x
    half = rotary // 2
    T = x.shape[0]
    inv = theta ** (-2.0 * np.arange(half) / rotary)
    angle = np.arange(T)[:, None] * inv[None, :]
    shape = (T,) + (1,) * (x.ndim - 2) + (half,)
    cos = np.cos(angle).reshape(shape)
    sin = np.sin(angle).reshape(shape)
    out = x.copy()
    a = x[..., :half]
    b = x[..., half:rotary]
    out[..., :half] = a * cos - b * sin
    out[..., half:rotary] = b * cos + a * sin
    return out


def attend(q, k, v, positions):
    """Softmax attention of one head over the given positions."""
    s = k[positions] @ q / math.sqrt(q.shape[0])
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v[positions]


class Layer:
    def __init__(self, c, layer, is_global):
        self.c, self.is_global = c, is_global
        H, heads, G, d, seed = c["H"], c["heads"], c["G"], c["d"], c["seed"]
        n = lambda s: f"model.layers.{layer}.{s}"
        self.input_norm = norm_factor(n("input_layernorm.weight"), seed, H)
        self.wq = linear_weight(n("self_attn.q_proj.weight"), seed, heads * d, H)
        self.wk = linear_weight(n("self_attn.k_proj.weight"), seed, G * d, H)
        self.wv = linear_weight(n("self_attn.v_proj.weight"), seed, G * d, H)
        self.wg = linear_weight(n("self_attn.g_proj.weight"), seed, heads, H)
        self.q_norm = norm_factor(n("self_attn.q_norm.weight"), seed, d)
        self.k_norm = norm_factor(n("self_attn.k_norm.weight"), seed, d)
        self.wo = linear_weight(n("self_attn.o_proj.weight"), seed, H, heads * d)
        if is_global:
            IH, P = c["IH"], c["P"]
            self.wqi = linear_weight(n("self_attn.indexer.q_proj.weight"), seed, IH * P, H)
            self.wki = linear_weight(n("self_attn.indexer.k_proj.weight"), seed, P, H)
            self.wz = linear_weight(n("self_attn.indexer.compress_proj.weight"), seed, P, H)
            self.ww = linear_weight(n("self_attn.indexer.weights_proj.weight"), seed, IH, H)
            self.qi_norm = norm_factor(n("self_attn.indexer.q_norm.weight"), seed, P)
            self.ki_weight = norm_factor(n("self_attn.indexer.k_norm.weight"), seed, P)
            self.ki_bias = norm_factor(n("self_attn.indexer.k_norm.bias"), seed, P) - 1.0

    def forward(self, x, forced=None):
        """x [T, H] -> (x + attention block, selection[T][G] lists).
        forced[(t, g)] overrides the selection of that (token, group)."""
        c = self.c
        T = x.shape[0]
        heads, G, d = c["heads"], c["G"], c["d"]
        hg = heads // G
        a = rms_norm(x, self.input_norm, c["eps"])
        q = rms_norm((a @ self.wq.T).reshape(T, heads, d), self.q_norm, c["eps"])
        k = rms_norm((a @ self.wk.T).reshape(T, G, d), self.k_norm, c["eps"])
        v = (a @ self.wv.T).reshape(T, G, d)
        gate = 1.0 / (1.0 + np.exp(-(a @ self.wg.T)))
        rot, theta = ((c["rot_full"], c["theta_full"]) if self.is_global
                      else (c["rot_sliding"], c["theta_sliding"]))
        q, k = rope(q, rot, theta), rope(k, rot, theta)
        o = np.zeros((T, heads, d))
        selection = None
        if not self.is_global:
            for t in range(T):
                window = np.arange(max(0, t - c["W"] + 1), t + 1)
                for h in range(heads):
                    o[t, h] = attend(q[t, h], k[:, h // hg], v[:, h // hg], window)
        else:
            selection, scores = self.select(a, T)
            for t in range(T):
                B = c["B"]
                current = list(range(B * (t // B), t + 1))
                for g in range(G):
                    blocks = selection[t][g]
                    if forced is not None and (t, g) in forced:
                        blocks = forced[(t, g)]
                    positions = [p for r in sorted(blocks) for p in range(B * r, B * r + B)]
                    positions = np.array(positions + current)
                    for h in range(g * hg, (g + 1) * hg):
                        o[t, h] = attend(q[t, h], k[:, g], v[:, g], positions)
            self.scores = scores
        o = o * gate[:, :, None]
        return x + o.reshape(T, heads * d) @ self.wo.T, selection

    def select(self, a, T):
        c = self.c
        G, IH, P, B, K = c["G"], c["IH"], c["P"], c["B"], c["K"]
        hg = IH // G
        qi = rms_norm((a @ self.wqi.T).reshape(T, IH, P), self.qi_norm, c["eps_index"])
        ki = layer_norm(a @ self.wki.T, self.ki_weight, self.ki_bias, c["eps_index"])
        qi = rope(qi, c["rot_index"], c["theta_full"])
        ki = rope(ki, c["rot_index"], c["theta_full"])
        z = a @ self.wz.T
        w = (a @ self.ww.T) / math.sqrt(hg)
        complete = T // B
        summaries = np.zeros((complete, P))
        for r in range(complete):
            zb = z[B * r:B * r + B]
            weights = np.exp(zb - zb.max(axis=0)) / np.exp(zb - zb.max(axis=0)).sum(axis=0)
            summaries[r] = e4m3(bf16((weights * ki[B * r:B * r + B]).sum(axis=0)))
        q8 = e4m3(qi)
        selection, scores = [], []
        for t in range(T):
            history = t // B
            per_group, per_scores = [], []
            for g in range(G):
                dots = q8[t, g * hg:(g + 1) * hg] @ summaries[:history].T  # [hg, history]
                s = (w[t, g * hg:(g + 1) * hg, None] * np.maximum(dots, 0.0)).sum(axis=0)
                order = sorted(range(history), key=lambda r: (-s[r], r))
                per_group.append(sorted(order[:min(K, history)]))
                per_scores.append(s)
            selection.append(per_group)
            scores.append(per_scores)
        return selection, scores


# ------------------------------------------------------------------ main

def near_tie_equivalent(s, mine, theirs, tolerance):
    """True if `theirs` is as good a top-k as `mine` under scores s, up to
    `tolerance` (the blocks that differ score within it of each other, and
    not exactly equal)."""
    only_mine = sorted(set(mine) - set(theirs))
    only_theirs = sorted(set(theirs) - set(mine))
    if len(only_mine) != len(only_theirs):
        return False
    gaps = [abs(s[a] - s[b]) for a, b in zip(only_mine, only_theirs)]
    # Exactly equal float64 scores are structural ties (every ReLU term zero,
    # the same in fp32): the tie rule decides them, so no leeway there.
    if min(gaps) == 0.0:
        return False
    return max(gaps) <= tolerance * (1.0 + max(abs(s[r]) for r in mine))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dump-binary", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompt-len", type=int, default=112)
    args = parser.parse_args()
    c = read_config(args.config)

    with tempfile.TemporaryDirectory(prefix="step5_numpy.") as work:
        prefix = os.path.join(work, "dump")
        run = subprocess.run([args.dump_binary, "--config", args.config, "--prompt-len",
                              str(args.prompt_len), "--out", prefix],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            print(run.stdout + run.stderr)
            print("numpy reference: FAIL (step5_layer_dump exited %d)" % run.returncode)
            return 1
        with open(prefix + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        with open(prefix + ".bin", "rb") as f:
            blob = f.read()

    T, H, G, K = meta["tokens"], meta["hidden"], meta["groups"], meta["topk_blocks"]
    assert H == c["H"] and G == c["G"] and K == c["K"], "dump and config disagree"
    failures = []
    for entry in meta["layers"]:
        layer, is_global = entry["layer"], entry["global"]
        x = np.frombuffer(blob, np.float32, T * H, entry["input"]).astype(np.float64).reshape(T, H)
        want = np.frombuffer(blob, np.float32, T * H, entry["output"]).astype(np.float64)
        want = want.reshape(T, H)
        model = Layer(c, layer, is_global)
        got, selection = model.forward(x)
        forced, near_ties = {}, 0
        attended = history = 0
        if is_global:
            cpp = np.frombuffer(blob, np.int32, T * G * K, entry["selection"]).reshape(T, G, K)
            for t in range(T):
                for g in range(G):
                    theirs = sorted(int(r) for r in cpp[t, g] if r >= 0)
                    mine = selection[t][g]
                    history += t // c["B"]
                    attended += len(mine)
                    if theirs == mine:
                        continue
                    if near_tie_equivalent(model.scores[t][g], mine, theirs, 1e-5):
                        near_ties += 1
                        forced[(t, g)] = theirs
                    else:
                        failures.append("layer %d token %d group %d: selected %s, numpy %s"
                                        % (layer, t, g, theirs, mine))
            if forced:
                got, _ = model.forward(x, forced)
        err = np.sqrt(((got - want) ** 2).sum(axis=1) / (want ** 2).sum(axis=1))
        worst = float(err.max())
        kind = "global sparse" if is_global else "sliding"
        extra = ""
        if is_global:
            extra = ", history blocks attended %d/%d (%.2f), near-tie selections %d" % (
                attended, history, attended / max(history, 1), near_ties)
        print("layer %d (%s): worst per-token rel L2 %.3g%s" % (layer, kind, worst, extra))
        if worst > 1e-5:
            failures.append("layer %d: rel L2 %.3g > 1e-5" % (layer, worst))
    if failures:
        for f in failures[:20]:
            print("  " + f)
        print("numpy reference: FAIL (%d problems)" % len(failures))
        return 1
    print("numpy reference: PASS (%d layers, %d tokens, float64 vs the C++ fp32 example)"
          % (len(meta["layers"]), T))
    return 0


if __name__ == "__main__":
    sys.exit(main())
