"""register_recv_buffer as StepMesh's RegisterRecvTensor takes it: one tensor
split evenly into chunks, chunk i receiving keys[i] from worker_ranks[i].
Here chunks 0 and 1 take the shared key 50 from workers 0 and 1 (received in
place: the server reads them straight from its tensor), chunks 2 and 3 each
worker's own key (10 + rank, a subset of the workers). The server answers the
sum of a worker's two pushes; the worker checks it."""

import os

import torch

import fserver_lib as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "10"))
role = os.environ.get("DMLC_ROLE")
rank = int(os.environ.get("DMLC_NODE_RANK", "0"))
ROWS, DIM = 4, 32

f.init()
if role == "worker":
    f.barrier(False, True)
    shared, own = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    out = [torch.zeros(ROWS, DIM)]
    for it in range(ITERS):
        shared.fill_(100 * rank + it)
        own.fill_(-it)
        f.wait(f.push_pull([shared, own], [50, 10 + rank], out, [7]))
        assert torch.equal(out[0], shared + own), (it, out[0][0, 0].item())
    print(f"worker {rank} test done", flush=True)
elif role == "server":
    big = torch.zeros(4 * ROWS, DIM)
    f.register_recv_buffer(big, [0, 1, 0, 1], [50, 50, 10, 11])
    f.barrier(True, False)
    for it in range(ITERS):
        batches = f.get_batch()
        for w, (handler, tensors, keys) in enumerate(batches):
            assert keys == [50, 10 + w], keys
            # key 50 landed in place, in worker w's chunk of the registered tensor
            assert torch.equal(big[w * ROWS:(w + 1) * ROWS], tensors[0]), (it, w)
            assert float(tensors[0][0, 0]) == 100 * w + it
            f.respond([tensors[0] + tensors[1]], handler)
    print("server test done", flush=True)
f.stop()
