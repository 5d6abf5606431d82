"""stepmesh.afd.Connector with 2 attention + 2 FFN processes over TCP, variable
tokens per rank per step, the scheduler started inside FFN rank 0."""
import os

import numpy as np
import pytest

import proc_util
from stepmesh.afd import Connector

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "programs", "afd_peer.py")


def test_two_attention_two_ffn_variable_seq_lens():
    procs = []
    try:
        ffn0 = proc_util.spawn([PEER, "ffn", "0", "127.0.0.1:0", "6"])
        procs.append(ffn0)
        line = ""
        for _ in range(20):  # log lines may come first
            line = ffn0.stdout.readline()
            if not line or line.startswith("scheduler "):
                break
        assert line.startswith("scheduler 127.0.0.1:"), line
        addr = line.split()[1]
        procs.append(proc_util.spawn([PEER, "ffn", "1", addr, "6"]))
        for a in range(2):
            procs.append(proc_util.spawn([PEER, "attention", str(a), addr, "6"]))
        outs = proc_util.reap(procs, timeout_s=180)
    finally:
        proc_util.kill_all(procs)
    joined = "".join(outs)
    for name in ("ffn 0 ok", "ffn 1 ok", "attention 0 ok", "attention 1 ok"):
        assert name in joined, joined


def test_configuration_errors(monkeypatch):
    with pytest.raises(ValueError, match="setting 'num_ffn' missing"):
        Connector(role="ffn", rank=0, num_attention=1, hidden_size=4, max_tokens=2)
    with pytest.raises(ValueError, match="unknown AFD connector setting"):
        Connector(role="ffn", rank=0, num_attention=1, num_ffn=1, hidden_size=4, max_tokens=2,
                  hiden_size=3)
    with pytest.raises(ValueError, match="rank=2 out of range"):
        Connector(role="attention", rank=2, num_attention=2, num_ffn=1, hidden_size=4,
                  max_tokens=2)
    monkeypatch.setenv("AFD_ROLE", "attention")
    monkeypatch.setenv("AFD_RANK", "0")
    monkeypatch.setenv("AFD_NUM_ATTENTION", "1")
    monkeypatch.setenv("AFD_NUM_FFN", "1")
    monkeypatch.setenv("AFD_HIDDEN_SIZE", "8")
    monkeypatch.setenv("AFD_MAX_TOKENS", "4")
    c = Connector()
    assert c.config["hidden_size"] == 8 and c.config["num_stages"] == 3
    with pytest.raises(RuntimeError, match="not initialised"):
        c.send_attn_output(np.zeros((1, 8), np.float32), 0, 0)
    monkeypatch.setenv("AFD_MAX_TOKENS", "lots")
    with pytest.raises(ValueError, match="AFD_MAX_TOKENS='lots'"):
        Connector()
