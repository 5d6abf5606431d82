"""DMLC_ROLE=joint: the scheduler and a server in one process (the FFN host
of StepMesh's launch scripts, which start the scheduler beside the servers),
serving workers that push [1, 64] and pull it back doubled."""

import os

import torch

import fserver_lib as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "10"))
role = os.environ.get("DMLC_ROLE")

f.init()
if role == "worker":
    f.barrier(False, True)
    for i in range(ITERS):
        x = torch.full((1, 64), float(i))
        y = [torch.zeros(1, 64)]
        f.wait(f.push_pull([x], [3], y, [4]))
        assert torch.equal(y[0], x * 2), i
    print("worker test done", flush=True)
elif role == "joint":
    assert f.scheduler_address().endswith(":" + os.environ["DMLC_PS_ROOT_PORT"])
    f.barrier(True, False)
    for i in range(ITERS):
        for handler, tensors, keys in f.get_batch():
            f.respond([tensors[0] * 2], handler)
    print("joint test done", flush=True)
f.stop()  # the joint process's scheduler waits for the worker to leave
