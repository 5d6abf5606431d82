"""The shape of StepMesh's tests/fserver/test_fserver.py, written for
stepmesh.fserver: a worker pushes three [1, 8192] float32 tensors under keys
0, 1, 2 and pulls one under key 0; the server sums each worker's batch and
responds. Role and mesh from DMLC_* variables; torch CPU tensors."""

import os

import torch

import stepmesh.fserver as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "20"))
role = os.environ.get("DMLC_ROLE")

f.init()
if role == "worker":
    f.barrier(False, True)
    for i in range(ITERS):
        push = [torch.rand(1, 8192) for _ in range(3)]  # fresh tensors every time
        pull = [torch.zeros(1, 8192)]
        handler = f.push_pull(push, [0, 1, 2], pull, [0])
        f.wait(handler)
        assert torch.allclose(sum(push), pull[0]), f"iteration {i}: wrong sum"
        assert len(f.fetch_trace(handler)) == 8
    print("worker test done", flush=True)
elif role == "server":
    f.barrier(True, False)
    for i in range(ITERS):
        batches = f.get_batch()
        for handler, tensors, keys in batches:
            assert keys == [0, 1, 2], keys
            f.respond([sum(tensors)], handler)
    print("server test done", flush=True)
f.stop()
