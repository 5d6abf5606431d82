"""Per-rank keys, as StepMesh's benchmark and utilities make them: push key
private + microbatch << 8 + worker_rank << 16, pull key the same + 1 << 24.
The workers' keys differ, yet each server batches one request of every worker
per micro-batch (StepMesh batches by arrival order, whatever the keys) and
answers with respond_vec; each worker checks its own rows came back."""

import os

import torch

import fserver_lib as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "12"))
role = os.environ.get("DMLC_ROLE")
num_servers = int(os.environ.get("DMLC_NUM_SERVER", "1"))
num_workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
rank = int(os.environ.get("DMLC_NODE_RANK", "0"))
TOKENS, DIM, MB = 8, 64, 3


def gen_push_key(private_key, microbatch=0, worker_rank=rank):
    return private_key + microbatch * (1 << 8) + worker_rank * (1 << 16)


def gen_pull_key(private_key, microbatch=0, worker_rank=rank):
    return gen_push_key(private_key, microbatch, worker_rank) + (1 << 24)


f.init()
if role == "worker":
    f.barrier(False, True)
    send = [[torch.zeros(TOKENS, DIM), torch.tensor([TOKENS], dtype=torch.int32)]
            for _ in range(MB)]
    recv = [[torch.zeros(TOKENS, DIM) for _ in range(num_servers)] for _ in range(MB)]
    for it in range(ITERS):
        mb = it % MB
        send[mb][0].fill_(rank * 100 + it)
        h = f.push_pull(send[mb], [gen_push_key(i, mb) for i in range(2)],
                        recv[mb], [gen_pull_key(s, mb) for s in range(num_servers)])
        handlers = f.get_all_handlers(h)
        assert len(handlers) == 3 and handlers[0] == h, handlers  # 2 pushes + a pull slot
        f.wait(h)
        for s in range(num_servers):
            assert torch.equal(recv[mb][s], send[mb][0] * 2 + s), (it, s, recv[mb][s][0, 0])
        for sub in handlers:
            t = f.fetch_trace(sub)
            assert len(t) == 8 and all(x > 0 for x in t), t
    print(f"worker {rank} test done", flush=True)
elif role == "server":
    f.barrier(True, False)
    ret_buffer = torch.zeros(TOKENS * num_workers, DIM)
    for it in range(ITERS):
        batches = f.get_batch()
        assert len(batches) == num_workers, len(batches)
        mb = it % MB
        for w, (handler, tensors, keys) in enumerate(batches):
            assert keys == [gen_push_key(i, mb, w) for i in range(2)], (it, w, keys)
            assert int(tensors[1][0]) == TOKENS
        tokens = torch.cat([b[1][0] for b in batches])
        ret_buffer.copy_(tokens * 2 + rank)
        f.respond_vec(ret_buffer, [b[1][0] for b in batches], [b[0] for b in batches])
    print(f"server {rank} test done", flush=True)
f.stop()
