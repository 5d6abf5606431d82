"""StepMesh's tests/fserver/test_fserver.py, in shape (written from its
documented API): `import fserver_lib as f`, the worker pushes three [1, 8192]
float32 tensors under keys 0, 1, 2 and pulls one under key 0, the server
answers each worker with the sum of its batch. CPU tensors instead of CUDA."""

import os

import torch

import fserver
import fserver_lib as f

assert fserver.f is f, "fserver.f is fserver_lib"
ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "20"))
is_worker = os.environ.get("DMLC_ROLE") == "worker"
is_server = os.environ.get("DMLC_ROLE") == "server"

f.init()
if is_worker:
    f.barrier(False, True)
    for i in range(ITERS):
        push = [torch.rand(1, 8192) for _ in range(3)]
        pull = [torch.zeros(1, 8192)]
        handler = f.push_pull(push, [0, 1, 2], pull, [0])
        f.wait(handler)
        assert torch.allclose(sum(push), pull[0]), f"iteration {i}: wrong sum"
    print("worker test done", flush=True)
elif is_server:
    f.barrier(True, False)
    for i in range(ITERS):
        batches = f.get_batch()
        for handler, tensors, keys in batches:
            assert keys == [0, 1, 2], keys
            f.respond([sum(tensors)], handler)
    print("server test done", flush=True)
f.stop()
