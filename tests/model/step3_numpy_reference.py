#!/usr/bin/python3
"""An independent float64 forward of the Step-3 example model (numpy).

Written from the model notes alone (docs reference: step3_model.md section
1.3 "Forward pass of one decoder layer", section 3 "configurations,
deterministic weights and tolerances", and for the AFD codec the F2A row of
the wire contract in section 2.3), without reading the C++ implementation,
so that comparing the two checks that the C++ computes Step-3 and not only
that it agrees with itself.

Everything is float64 except where the notes prescribe a narrower format:
  * the FP8 A2F codec (E4M3 "fn", round to nearest even, saturating at 448,
    one fp32 scale per token and 128-channel group, scale = fp32(amax)/448
    computed in fp32, 1 when amax is 0);
  * the BF16 F2A return (round to nearest even from fp32), one partial per
    FFN partition.

  step3_numpy_reference.py --config tiny.cfg --batch B --prompt-len T \
      --decode-steps N --codec none|afd --partitions F --out golden.npz

The .npz holds `tokens` [B, N+1] (int64; step 0 is the token after the
prompt), `logits` [N+1, B, V] (the last position of every request each
step), and `hidden_s{step}` [layers, rows, H] (the residual stream after
every layer; rows are request-major: B*T rows at step 0, B after).
"""

import argparse
import itertools
import math
import sys

import numpy as np

MASK64 = (1 << 64) - 1
# An FP8 code is a near tie when y/scale lies this close (relative) to a
# rounding midpoint: fp32 arithmetic (~1e-7 relative per operation, a few
# operations deep) may round it the other way.
NEAR_TIE = 1e-5
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# ---------------------------------------------------------------------------
# Config: "key = value" lines, '#' comments; moe_layers_enum is a comma
# separated list of layer ids or inclusive ranges "a-b".

def load_config(path):
    values = {}
    with open(path) as f:
        for line in f:
            line = line.split('#', 1)[0].strip()
            if not line:
                continue
            key, value = line.split('=', 1)
            values[key.strip()] = value.strip()

    def integer(key):
        return int(values[key], 0)

    c = {
        'name': values['name'],
        'H': integer('hidden_size'),
        'layers': integer('num_hidden_layers'),
        'q_rank': integer('share_q_dim'),
        'heads': integer('num_attention_heads'),
        'head_dim': integer('head_dim'),
        'dense_inter': integer('intermediate_size'),
        'experts': integer('moe_num_experts'),
        'top_k': integer('moe_top_k'),
        'expert_inter': integer('moe_intermediate_size'),
        'shared_inter': integer('share_expert_dim'),
        'vocab': integer('vocab_size'),
        'eps': float(values['rms_norm_eps']),
        'theta': float(values['rope_theta']),
        'max_pos': integer('max_position_embedding'),
        'group': integer('fp8_group_size'),
        'seed': integer('weight_seed'),
    }
    moe = set()
    for item in values['moe_layers_enum'].split(','):
        item = item.strip()
        if not item:
            continue
        if '-' in item:
            a, b = item.split('-')
            moe.update(range(int(a), int(b) + 1))
        else:
            moe.add(int(item))
    c['moe'] = [l in moe for l in range(c['layers'])]
    return c


# ---------------------------------------------------------------------------
# Deterministic weights (section 3.3): SplitMix64, counter-based.

def fnv1a64(text):
    h = 0xcbf29ce484222325
    for b in text.encode('utf-8'):
        h ^= b
        h = (h * 0x100000001b3) & MASK64
    return h


def mix(z):
    """SplitMix64 on a uint64 array (numpy wraps modulo 2^64)."""
    with np.errstate(over='ignore'):
        z = z + GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def stream(name, seed, n):
    """mix(key + i * golden) for i = 0..n-1, key = fnv1a64(name) ^ seed."""
    key = np.uint64(fnv1a64(name) ^ seed)
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over='ignore'):
        return mix(key + i * GOLDEN)


def ints(name, seed, shape):
    """k(i) in [-128, 127], row-major over the HF shape."""
    n = int(np.prod(shape))
    k = ((stream(name, seed, n) >> np.uint64(56)) & np.uint64(0xFF)).astype(np.int64) - 128
    return k.reshape(shape)


def round_half_away(x):
    return math.floor(x + 0.5) if x >= 0 else -math.floor(-x + 0.5)


def linear(name, seed, shape, router=False):
    """[.., out, in] weights: k * 2^-(7+s), s = round(log2(sqrt(fan_in)));
    the router gate uses s - 2."""
    fan_in = shape[-1]
    s = round_half_away(math.log2(math.sqrt(fan_in)))
    if router:
        s -= 2
    return ints(name, seed, shape).astype(np.float64) * 2.0 ** -(7 + s)


def norm_weight(name, seed, n):
    k = ints(name, seed, (n,))
    return 1.0 + (k >> 3).astype(np.float64) * 2.0 ** -7  # arithmetic shift


def embedding(name, seed, shape):
    return ints(name, seed, shape).astype(np.float64) * 2.0 ** -7


def load_weights(c):
    seed, H = c['seed'], c['H']
    w = {
        'embed': embedding('model.embed_tokens.weight', seed, (c['vocab'], H)),
        'final_norm': norm_weight('model.norm.weight', seed, H),
        'lm_head': linear('lm_head.weight', seed, (c['vocab'], H)),
        'layers': [],
    }
    A = c['heads'] * c['head_dim']
    for l in range(c['layers']):
        p = 'model.layers.%d.' % l
        L = {
            'in_norm': norm_weight(p + 'input_layernorm.weight', seed, H),
            'q_proj': linear(p + 'self_attn.q_proj.weight', seed, (c['q_rank'], H)),
            'k_proj': linear(p + 'self_attn.k_proj.weight', seed, (c['head_dim'], H)),
            'v_proj': linear(p + 'self_attn.v_proj.weight', seed, (c['head_dim'], H)),
            'inter_norm': norm_weight(p + 'self_attn.inter_norm.weight', seed, c['q_rank']),
            'wq': linear(p + 'self_attn.wq.weight', seed, (A, c['q_rank'])),
            'o_proj': linear(p + 'self_attn.o_proj.weight', seed, (H, A)),
            'post_norm': norm_weight(p + 'post_attention_layernorm.weight', seed, H),
        }
        if c['moe'][l]:
            E, I = c['experts'], c['expert_inter']
            S = c['shared_inter']
            L['router'] = linear(p + 'moe.gate.weight', seed, (E, H), router=True)
            L['e_gate'] = linear(p + 'moe.gate_proj.weight', seed, (E, I, H))
            L['e_up'] = linear(p + 'moe.up_proj.weight', seed, (E, I, H))
            L['e_down'] = linear(p + 'moe.down_proj.weight', seed, (E, H, I))
            L['s_gate'] = linear(p + 'share_expert.gate_proj.weight', seed, (S, H))
            L['s_up'] = linear(p + 'share_expert.up_proj.weight', seed, (S, H))
            L['s_down'] = linear(p + 'share_expert.down_proj.weight', seed, (H, S))
        else:
            I = c['dense_inter']
            L['d_gate'] = linear(p + 'mlp.gate_proj.weight', seed, (I, H))
            L['d_up'] = linear(p + 'mlp.up_proj.weight', seed, (I, H))
            L['d_down'] = linear(p + 'mlp.down_proj.weight', seed, (H, I))
        w['layers'].append(L)
    return w


def prompt_tokens(c, batch, prompt_len):
    """id = mix(key + i*golden) % vocab, key from "input_ids", i = b*T + t."""
    z = stream('input_ids', c['seed'], batch * prompt_len)
    return (z % np.uint64(c['vocab'])).astype(np.int64).reshape(batch, prompt_len)


# ---------------------------------------------------------------------------
# Codecs (section 3.4).

def e4m3_rne(x):
    """Nearest E4M3fn value (ties to even), saturating at +-448, no NaN.
    3 mantissa bits, exponent bias 7, subnormal step 2^-9."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    exponent = np.maximum(e - 1, -6)  # below 2^-6 the subnormal step applies
    quantum = np.ldexp(1.0, exponent - 3)
    r = np.rint(a / quantum) * quantum  # a / quantum is exact (power of two)
    r = np.where(a == 0, 0.0, np.minimum(r, 448.0))
    return np.copysign(r, x)


def fp8_roundtrip(y, group, near=None):
    """Quantises rows of y per (token, group) and dequantises them.

    With `near` (a relative distance), also returns the near ties: elements
    whose y/scale lies within near*|y/scale| of the midpoint between two
    E4M3 values, where an fp32 implementation may legitimately round the
    other way. Each is (row, column, the other dequantised value)."""
    n, h = y.shape
    g = y.reshape(n, h // group, group)
    amax = np.max(np.abs(g), axis=2)
    scale = np.where(amax > 0, np.float32(amax) / np.float32(448.0), np.float32(1.0))
    scale = scale.astype(np.float32).astype(np.float64)[:, :, None]
    q = g / scale
    x = (e4m3_rne(q) * scale).reshape(n, h)
    if near is None:
        return x
    a = np.abs(q)
    _, e = np.frexp(a)
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    lo = np.floor(a / quantum) * quantum
    hi = lo + quantum
    mid = (lo + hi) / 2
    tie = (np.abs(a - mid) <= near * a) & (hi <= 448.0) & (a > 0)
    chosen = np.abs(e4m3_rne(q))
    other = np.copysign(np.where(chosen == lo, hi, lo), q) * scale
    other = other.reshape(n, h)
    ties = [(int(r), int(col), float(other[r, col]))
            for r, col in np.argwhere(tie.reshape(n, h))]
    return x, ties


def bf16_near_ties(x, near):
    """Elements of x (before bf16_rne) within near*|x| of a bf16 rounding
    midpoint, and the other bf16 value each could round to."""
    a = np.abs(x)
    _, e = np.frexp(a)
    ulp = np.ldexp(1.0, e - 1 - 7)  # 8 significant bits
    lo = np.floor(a / ulp) * ulp
    mid = lo + ulp / 2
    tie = (np.abs(a - mid) <= near * a) & (a > 0)
    chosen = np.abs(bf16_rne(x))
    other = np.copysign(np.where(chosen == lo, lo + ulp, lo), x)
    return tie, other


def bf16_rne(x):
    """fp32 -> bf16 with round to nearest even (via fp32, as the wire does)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------
# The forward pass (section 1.3).

def rms(x, gamma, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(y, gate, up, down):
    return (silu(y @ gate.T) * (y @ up.T)) @ down.T


def rope(x, positions, theta):
    """NeoX half-split RoPE over the last dim: pairs (i, i + d/2)."""
    d = x.shape[-1]
    half = d // 2
    i = np.arange(half, dtype=np.float64)
    angle = positions[:, None].astype(np.float64) * theta ** (-2.0 * i / d)  # [n, d/2]
    cos, sin = np.cos(angle), np.sin(angle)
    if x.ndim == 3:  # [n, heads, d]
        cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def column_slice(width, p, parts):
    return slice(p * width // parts, (p + 1) * width // parts)


class Model:
    def __init__(self, c, w, codec, partitions, batch, max_len):
        self.c, self.w = c, w
        self.codec, self.partitions = codec, partitions
        L, D = c['layers'], c['head_dim']
        self.k_cache = np.zeros((L, batch, max_len, D))
        self.v_cache = np.zeros((L, batch, max_len, D))
        self.length = np.zeros(batch, dtype=np.int64)

    def attention(self, l, h, seq, pos):
        """MFA for rows h (sequence seq[r], position pos[r]); appends K/V."""
        c, W = self.c, self.w['layers'][l]
        a = rms(h, W['in_norm'], c['eps'])
        cq = rms(a @ W['q_proj'].T, W['inter_norm'], c['eps'])
        k = rope(a @ W['k_proj'].T, pos, c['theta'])
        v = a @ W['v_proj'].T  # no RoPE on V
        q = (cq @ W['wq'].T).reshape(len(h), c['heads'], c['head_dim'])
        q = rope(q, pos, c['theta'])
        self.k_cache[l, seq, pos] = k
        self.v_cache[l, seq, pos] = v
        out = np.empty((len(h), c['heads'], c['head_dim']))
        for r in range(len(h)):
            keys = self.k_cache[l, seq[r], :pos[r] + 1]  # causal: s <= t
            vals = self.v_cache[l, seq[r], :pos[r] + 1]
            scores = q[r] @ keys.T / math.sqrt(c['head_dim'])  # [heads, s]
            scores = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[r] = (scores / scores.sum(axis=1, keepdims=True)) @ vals
        return h + out.reshape(len(h), -1) @ W['o_proj'].T

    def route(self, l, y):
        """Router softmax over all experts and top-k, ties toward the lower
        id; no renormalisation."""
        r = y @ self.w['layers'][l]['router'].T
        p = np.exp(r - r.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top = np.argsort(-p, axis=1, kind='stable')[:, :self.c['top_k']]
        return top, p

    def ffn_output(self, l, x, route, bf16_ties=None):
        """f for rows x (the FFN input after the codec): the sum over the
        partitions of their partials (bf16 in the afd codec). With a list
        `bf16_ties`, appends (mask, other - rounded) per partition: the
        partial elements near a bf16 rounding midpoint."""
        c, W = self.c, self.w['layers'][l]
        parts = self.partitions if self.codec == 'afd' else 1
        f = np.zeros_like(x)
        for part in range(parts):
            # Partition `part` owns experts e % F == part and a contiguous
            # 1/F slice of the shared / dense intermediate columns.
            if c['moe'][l]:
                top, p = route
                cols = column_slice(c['shared_inter'], part, parts)
                partial = swiglu(x, W['s_gate'][cols], W['s_up'][cols], W['s_down'][:, cols])
                for row in range(len(x)):
                    for e in top[row]:
                        if e % parts != part:
                            continue
                        partial[row] += p[row, e] * swiglu(
                            x[row:row + 1], W['e_gate'][e], W['e_up'][e], W['e_down'][e])[0]
            else:
                cols = column_slice(c['dense_inter'], part, parts)
                partial = swiglu(x, W['d_gate'][cols], W['d_up'][cols], W['d_down'][:, cols])
            if self.codec == 'afd':
                rounded = bf16_rne(partial)
                if bf16_ties is not None:
                    tie, other = bf16_near_ties(partial, NEAR_TIE)
                    bf16_ties.append((tie, other - rounded))
                partial = rounded
            f += partial
        return f

    def ffn(self, l, h, target=None):
        """h + FFN(RMS(h; post norm)).

        With `target` (the other implementation's result for these rows),
        every codec near tie (an FP8 code or a BF16 partial element that an
        fp32 implementation may legitimately round the other way, see
        NEAR_TIE) is resolved whichever way brings the row closer to the
        target; returns (h, number of near ties)."""
        c, W = self.c, self.w['layers'][l]
        y = rms(h, W['post_norm'], c['eps'])
        route = self.route(l, y) if c['moe'][l] else None  # on the unquantised y
        if self.codec != 'afd':
            return h + self.ffn_output(l, y, route) if target is None else (
                h + self.ffn_output(l, y, route), 0)
        if target is None:
            return h + self.ffn_output(l, fp8_roundtrip(y, c['group']), route)

        x, fp8_ties = fp8_roundtrip(y, c['group'], near=NEAR_TIE)
        by_row = {}
        for row, col, other in fp8_ties:
            by_row.setdefault(row, []).append((col, other))
        for row, alternatives in by_row.items():
            if len(alternatives) > 4:
                raise ValueError('layer %d row %d: %d FP8 near ties' % (l, row, len(alternatives)))
            row_route = None if route is None else (route[0][row:row + 1], route[1][row:row + 1])
            best, best_err = None, np.inf
            for choice in itertools.product([False, True], repeat=len(alternatives)):
                xr = x[row:row + 1].copy()
                for (col, other), flip in zip(alternatives, choice):
                    if flip:
                        xr[0, col] = other
                err = np.linalg.norm(h[row] + self.ffn_output(l, xr, row_route)[0] - target[row])
                if err < best_err:
                    best, best_err = xr[0], err
            x[row] = best
        bf16_ties = []
        f = self.ffn_output(l, x, route, bf16_ties)
        near = len(fp8_ties)
        for tie, delta in bf16_ties:
            better = np.abs(h + f + delta - target) < np.abs(h + f - target)
            f = np.where(tie & better, f + delta, f)
            near += int(tie.sum())
        return h + f, near

    def step(self, tokens, seq, pos):
        """One forward over rows (token, sequence, position); returns the
        residual stream after every layer and the final hidden rows."""
        h = self.w['embed'][tokens]
        per_layer = []
        for l in range(self.c['layers']):
            h = self.attention(l, h, seq, pos)
            h = self.ffn(l, h)
            per_layer.append(h.copy())
        return h, np.stack(per_layer)

    def logits(self, h):
        return rms(h, self.w['final_norm'], self.c['eps']) @ self.w['lm_head'].T


def run(c, batch, prompt_len, decode_steps, codec, partitions):
    w = load_weights(c)
    model = Model(c, w, codec, partitions, batch, prompt_len + decode_steps)
    prompts = prompt_tokens(c, batch, prompt_len)
    tokens = np.zeros((batch, decode_steps + 1), dtype=np.int64)
    logits_all = []
    hidden = {}
    # Prefill: every prompt at once, rows request-major.
    seq = np.repeat(np.arange(batch), prompt_len)
    pos = np.tile(np.arange(prompt_len), batch)
    h, per_layer = model.step(prompts.reshape(-1), seq, pos)
    hidden['hidden_s0'] = per_layer
    last = h.reshape(batch, prompt_len, -1)[:, -1]
    for s in range(decode_steps + 1):
        logits = model.logits(last)
        logits_all.append(logits)
        tokens[:, s] = np.argmax(logits, axis=1)  # ties: the lower id
        if s == decode_steps:
            break
        seq = np.arange(batch)
        pos = np.full(batch, prompt_len + s)
        last, per_layer = model.step(tokens[:, s], seq, pos)
        hidden['hidden_s%d' % (s + 1)] = per_layer
    return prompts, tokens, np.stack(logits_all), hidden


def teacher_forced(c, codec, partitions, batch, prompt_len, decode_steps, tokens, hidden):
    """Every layer of every step fed the other implementation's input.

    `tokens` [batch, steps] and `hidden[s]` [layers, rows, H] (the residual
    stream after every layer) come from the implementation under test. Layer
    l of step s runs here on its hidden[s][l-1] (the embedding of its tokens
    for l = 0), with a KV cache built the same way, so every layer is checked
    on its own and errors do not compound. Returns per step the residual
    after every layer computed here [layers, rows, H], the logits of the
    last rows of hidden[s][-1], and the number of FP8 near ties resolved."""
    w = load_weights(c)
    model = Model(c, w, codec, partitions, batch, prompt_len + decode_steps)
    prompts = prompt_tokens(c, batch, prompt_len)
    out_hidden, out_logits, near_ties = [], [], 0
    for s in range(decode_steps + 1):
        if s == 0:
            toks = prompts.reshape(-1)
            seq = np.repeat(np.arange(batch), prompt_len)
            pos = np.tile(np.arange(prompt_len), batch)
        else:
            toks = tokens[:, s - 1]
            seq = np.arange(batch)
            pos = np.full(batch, prompt_len + s - 1)
        h_in = w['embed'][toks]
        per_layer = []
        for l in range(c['layers']):
            target = hidden[s][l].astype(np.float64)
            h_out, ties = model.ffn(l, model.attention(l, h_in, seq, pos), target=target)
            near_ties += ties
            per_layer.append(h_out)
            h_in = target
        last = h_in.reshape(batch, -1, c['H'])[:, -1]
        out_hidden.append(np.stack(per_layer))
        out_logits.append(model.logits(last))
    return out_hidden, np.stack(out_logits), near_ties


def add_run_args(ap):
    """The run this reference computes: config, shape, codec, FFN partitions
    (compare_numpy_reference.py takes the same)."""
    ap.add_argument('--config', required=True)
    ap.add_argument('--batch', type=int, default=4)
    ap.add_argument('--prompt-len', type=int, default=16)
    ap.add_argument('--decode-steps', type=int, default=16)
    ap.add_argument('--codec', choices=['none', 'afd'], default='none')
    ap.add_argument('--partitions', type=int, default=1)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    add_run_args(ap)
    ap.add_argument('--out', required=True)
    args = ap.parse_args(argv)
    c = load_config(args.config)
    prompts, tokens, logits, hidden = run(c, args.batch, args.prompt_len, args.decode_steps,
                                          args.codec, args.partitions)
    np.savez(args.out, prompts=prompts, tokens=tokens, logits=logits, **hidden)
    print('%s: %s codec, %d partitions, batch %d, prompt %d, %d decode steps; tokens of '
          'request 0: %s' % (c['name'], args.codec, args.partitions, args.batch,
                             args.prompt_len, args.decode_steps,
                             ' '.join(str(t) for t in tokens[0])))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
