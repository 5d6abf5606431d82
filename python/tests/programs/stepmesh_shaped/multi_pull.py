"""Several pulls per server in one request, laid out as StepMesh's
ZBatchPushPull takes them (server-major: pull_tensors[s * per + j] is slot j
of server s, each with its own key): 2 slots per server, of different dtypes
and sizes, rows varying per iteration (the first is the largest). Server s
answers slot 0 with x + s and slot 1 with the row sums in float32; the worker
checks every slot of every server, and that get_all_handlers has a handle per
push and per slot."""

import os
import random

import torch

import fserver_lib as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "15"))
role = os.environ.get("DMLC_ROLE")
num_servers = int(os.environ.get("DMLC_NUM_SERVER", "1"))
rank = int(os.environ.get("DMLC_NODE_RANK", "0"))
ROWS, DIM, PER = 32, 16, 2

f.init()
if role == "worker":
    f.barrier(False, True)
    rng = random.Random(rank)
    send = torch.zeros(ROWS, DIM, dtype=torch.bfloat16)
    recv = []
    for s in range(num_servers):
        recv += [torch.zeros(ROWS, DIM, dtype=torch.bfloat16),
                 torch.zeros(ROWS, dtype=torch.float32)]
    keys = [100 + s * PER + j for s in range(num_servers) for j in range(PER)]
    for it in range(ITERS):
        n = ROWS if it == 0 else rng.randint(1, ROWS)
        send[:n] = torch.randn(n, DIM).to(torch.bfloat16)
        pulls = [t[:n] for t in recv]
        h = f.push_pull([send[:n]], [7], pulls, keys)
        assert len(f.get_all_handlers(h)) == 1 + PER
        f.wait(h)
        for s in range(num_servers):
            assert torch.equal(recv[s * PER][:n], send[:n] + s), (it, s)
            want = send[:n].to(torch.float32).sum(dim=1)
            assert torch.allclose(recv[s * PER + 1][:n], want), (it, s)
    print(f"worker {rank} test done", flush=True)
elif role == "server":
    f.barrier(True, False)
    for it in range(ITERS):
        for handler, tensors, keys in f.get_batch():
            x = tensors[0]
            f.respond([x + rank, x.to(torch.float32).sum(dim=1)], handler)
    print(f"server {rank} test done", flush=True)
f.stop()
