"""StepMesh's run_multi_gpu.sh layout, in shape: DMLC_GROUP_SIZE=8 and one
process per STEPMESH_GPU on each side; instance i of the workers talks to
instance i of the servers only (GPU i to GPU i). Each server adds its GPU
index to what it echoes, so a worker answered by another instance's server
fails its check."""

import os

import torch

import fserver_lib as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "10"))
gpu = int(os.environ.get("STEPMESH_GPU", "0"))
role = os.environ.get("DMLC_ROLE")

f.init()
if role == "worker":
    f.barrier(False, True)
    send = torch.zeros(4, 256)
    recv = [torch.zeros(4, 256)]
    for i in range(ITERS):
        send.fill_(1000 * gpu + i)
        h = f.push_pull([send], [gpu], recv, [gpu + 100])
        f.wait(h)
        assert torch.equal(recv[0], send + gpu), (gpu, i, recv[0][0, 0].item())
    print(f"worker {gpu} test done", flush=True)
elif role == "server":
    f.barrier(True, False)
    for i in range(ITERS):
        batches = f.get_batch()
        assert len(batches) == 1, f"instance {gpu}: {len(batches)} workers in a batch"
        for handler, tensors, keys in batches:
            assert keys == [gpu], (gpu, keys)
            f.respond([tensors[0] + gpu], handler)
    print(f"server {gpu} test done", flush=True)
f.stop()
