"""StepMesh's tests/fserver/test_fserver_diff_stage.py, in shape: three
micro-batch stages of bfloat16 [128, 4], push key = stage, pull key stage + i
from server i, every stage in flight before the waits; the servers echo
(plus their rank, so that each pull is checked to be its server's)."""

import os

import torch

import fserver_lib as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "20"))
STAGES = 3
role = os.environ.get("DMLC_ROLE")
num_servers = int(os.environ.get("DMLC_NUM_SERVER", "1"))
rank = int(os.environ.get("DMLC_NODE_RANK", "0"))

f.init()
if role == "worker":
    f.barrier(False, True)
    send = [torch.zeros(128, 4, dtype=torch.bfloat16) for _ in range(STAGES)]
    recv = [[torch.zeros(128, 4, dtype=torch.bfloat16) for _ in range(num_servers)]
            for _ in range(STAGES)]
    for it in range(ITERS):
        handlers = []
        for stage in range(STAGES):
            send[stage].fill_(it % 50 + stage)
            handlers.append(f.push_pull([send[stage]], [stage], recv[stage],
                                        [stage + i for i in range(num_servers)]))
        for stage, h in enumerate(handlers):
            f.wait(h)
            for s in range(num_servers):
                assert torch.equal(recv[stage][s], send[stage] + s), (it, stage, s)
    print(f"worker {rank} test done", flush=True)
elif role == "server":
    f.barrier(True, False)
    for it in range(ITERS * STAGES):
        batches = f.get_batch()
        stage = it % STAGES
        for handler, tensors, keys in batches:
            assert keys == [stage], (it, keys)
            f.respond([tensors[0] + rank], handler)
    print(f"server {rank} test done", flush=True)
f.stop()
