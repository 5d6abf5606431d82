"""One side of the connector test: argv = role rank scheduler steps.
FFN rank f answers each stage with 2 * hidden + f; attention ranks check the
sum over FFN ranks. Token counts vary per step, stage and rank (1..max); the
FFN side checks seq_lens against the same formula, and takes the stages in
reverse order (2, 1, 0) to exercise out-of-order arrival."""
import ctypes
import signal
import sys

import numpy as np

from stepmesh.afd import Connector

ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # die with the test
role, rank, scheduler, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
A, F, H, MAX, STAGES = 2, 2, 16, 24, 3


def n_tokens(step, stage, a):
    return 1 + (step * 7 + stage * 5 + a * 11) % MAX


conn = Connector({"role": role, "rank": rank, "num_attention": A, "num_ffn": F,
                  "hidden_size": H, "max_tokens": MAX, "num_stages": STAGES},
                 mesh={"scheduler": scheduler, "transport": "tcp", "timeout": 30.0},
                 on_scheduler=lambda addr: print(f"scheduler {addr}", flush=True))
assert not conn.is_initialized
conn.init()
assert conn.is_initialized
if role == "ffn":
    for step in range(steps):
        for s in reversed(range(STAGES)):
            p = conn.recv_attn_output(s)
            assert p.context.stage_idx == s and p.context.layer_idx == step
            assert p.seq_lens == [n_tokens(step, s, a) for a in range(A)], p.seq_lens
            assert p.hidden_states.shape == (sum(p.seq_lens), H)
            for a, part in enumerate(p.context.parts):  # zero-copy per-rank views
                assert part.shape == (p.seq_lens[a], H)
            conn.send_ffn_output(2 * p.hidden_states + rank, p.context)
else:
    out = np.zeros((MAX, H), np.float32)
    addr = out.ctypes.data
    rng = np.random.default_rng(rank)
    for step in range(steps):
        xs = []
        for s in range(STAGES):
            x = rng.standard_normal((n_tokens(step, s, rank), H)).astype(np.float32)
            if s == 0:  # computed in place into the registered buffer: no copy
                buf = conn.send_buffer(0)
                buf[: len(x)] = x
                conn.send_attn_output(buf[: len(x)], step, s)
            else:
                conn.send_attn_output(x, step, s)
            xs.append(x)
        for s in range(STAGES):
            conn.recv_ffn_output(out, s)
            n = len(xs[s])
            np.testing.assert_array_equal(out[:n], (2 * xs[s] + 0) + (2 * xs[s] + 1))
    assert out.ctypes.data == addr
    try:
        conn.send_attn_output(np.zeros((MAX + 1, H), np.float32), 0, 0)
        raise AssertionError("oversized send accepted")
    except ValueError as e:
        assert "exceed max_tokens" in str(e)
conn.close()
assert not conn.is_initialized
print(f"{role} {rank} ok", flush=True)
