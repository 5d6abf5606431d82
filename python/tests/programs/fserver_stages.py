"""The shape of StepMesh's test_fserver_dynamic.py / test_fserver_diff_stage.py
for stepmesh.fserver: 3 micro-batch stages of bfloat16 [rows, 64] pushed from
fixed buffers as prefix views (rows vary per iteration; the first iteration
uses the largest), push key stage + 1e6, pull key 1000 + stage + i from server
i; the servers echo the pushed rows (plus their rank) back."""

import os
import random

import torch

import stepmesh.fserver as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "30"))
MAX_ROWS, DIM, STAGES = 128, 64, 3
role = os.environ.get("DMLC_ROLE")
num_servers = int(os.environ["DMLC_NUM_SERVER"])

f.init()
if role == "worker":
    rank = int(os.environ["DMLC_NODE_RANK"])
    rng = random.Random(rank)
    send = [torch.zeros(MAX_ROWS, DIM, dtype=torch.bfloat16) for _ in range(STAGES)]
    recv = [[torch.zeros(MAX_ROWS, DIM, dtype=torch.bfloat16) for _ in range(num_servers)]
            for _ in range(STAGES)]
    f.barrier(False, True)
    for it in range(ITERS):
        handlers, rows = [], []
        for stage in range(STAGES):
            n = MAX_ROWS if it == 0 else rng.randint(1, MAX_ROWS)
            send[stage][:n] = torch.randn(n, DIM).to(torch.bfloat16)
            h = f.push_pull([send[stage][:n]], [stage + 1_000_000],
                            [recv[stage][s][:n] for s in range(num_servers)],
                            [1000 + stage + s for s in range(num_servers)])
            handlers.append(h)
            rows.append(n)
        for stage, h in enumerate(handlers):  # all stages in flight, then wait
            f.wait(h, 500000)
            n = rows[stage]
            for s in range(num_servers):
                assert torch.equal(recv[stage][s][:n], send[stage][:n] + s), (it, stage, s)
    print("worker test done", flush=True)
elif role == "server":
    rank = int(os.environ["DMLC_NODE_RANK"])
    f.barrier(True, False)
    for it in range(ITERS * STAGES):
        for handler, tensors, keys in f.get_batch():
            (x,) = tensors
            assert keys[0] - 1_000_000 in range(STAGES)
            f.respond([x + rank], handler)
    print("server test done", flush=True)
f.stop()
