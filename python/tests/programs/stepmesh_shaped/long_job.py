"""A job that runs longer than STEPMESH_TIMEOUT (FSERVER_JOB_S seconds of
traffic, with one idle spell of FSERVER_IDLE_S, longer than the timeout, in
the middle while the server sits in get_batch): the scheduler must wait for
it, as StepMesh's does, get_batch must wait through the idle spell, and every
participant's stop() must succeed."""

import os
import time

import torch

import fserver_lib as f

JOB_S = float(os.environ.get("FSERVER_JOB_S", "6"))
IDLE_S = float(os.environ.get("FSERVER_IDLE_S", "0"))
role = os.environ.get("DMLC_ROLE")

f.init()
if role == "worker":
    f.barrier(False, True)
    t0, it, idled = time.monotonic(), 0, False
    while time.monotonic() - t0 < JOB_S:
        if not idled and time.monotonic() - t0 > JOB_S / 2 - IDLE_S / 2:
            time.sleep(IDLE_S)  # the attention side is idle; the server waits in get_batch
            idled = True
        x = torch.full((1, 16), float(it))
        y = [torch.zeros(1, 16)]
        f.wait(f.push_pull([x], [0], y, [0]))
        assert torch.equal(y[0], x + 1)
        it += 1
        time.sleep(0.05)
    f.wait(f.push_pull([torch.full((1, 16), -1.0)], [0], [torch.zeros(1, 16)], [0]))
    print(f"worker test done after {it} iterations", flush=True)
elif role == "server":
    f.barrier(True, False)
    while True:
        (handler, tensors, keys), = f.get_batch()
        f.respond([tensors[0] + 1], handler)
        if float(tensors[0][0, 0]) == -1.0:
            break
    print("server test done", flush=True)
f.stop()
