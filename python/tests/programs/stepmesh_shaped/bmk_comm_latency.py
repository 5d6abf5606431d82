"""StepMesh's tests/benchmark/bmk_comm_latency_multiserver.py, in shape: per
micro-batch (3, round robin) a [num_token, dim] bfloat16 push plus an int32[1]
token count, one [num_token, dim] pull per server, per-rank keys; the worker
times push_pull + wait with get_nanosecond(), keeps fetch_trace() of every
handle of get_all_handlers(), and every 500 iterations prints the window:
overall mean / p50 / p99 / max, then per handle (push 1, push 2, pull 1) the
stages python_req, req_send, req_recv, process, rsp_send, rsp_recv,
python_rsp, net_cost (mean, p50, p99, the three largest). The servers answer
with respond_vec from one return buffer. CPU tensors; sizes and iteration
count from BMK_TOKENS, BMK_DIM, BMK_ITERS (defaults 1024, 7168, 500)."""

import os

import numpy as np
import torch

import fserver_lib as f

role = os.environ.get("DMLC_ROLE")
server_count = int(os.environ.get("DMLC_NUM_SERVER", "1"))
worker_count = int(os.environ.get("DMLC_NUM_WORKER", "1"))
rank = int(os.environ.get("DMLC_NODE_RANK", "0"))
num_token = int(os.environ.get("BMK_TOKENS", "1024"))
dim = int(os.environ.get("BMK_DIM", "7168"))
num_iters = int(os.environ.get("BMK_ITERS", "500"))
WINDOW = 500
NAMES = ["push 1", "push 2", "pull 1"]
STAGES = ["python_req", "req_send", "req_recv", "process", "rsp_send", "rsp_recv",
          "python_rsp", "net_cost"]


def gen_push_key(private_key, microbatch=0):
    return private_key + microbatch * (1 << 8) + rank * (1 << 16)


def gen_pull_key(private_key, microbatch=0):
    return gen_push_key(private_key, microbatch) + (1 << 24)


def report(times, costs):
    overall = [(end - start) / 1e6 for start, end in times]
    print(f"comm bmk rank={rank}: mean={np.mean(overall):0.3f}ms, "
          f"p50={np.percentile(overall, 50):0.3f}ms, p99={np.percentile(overall, 99):0.3f}ms, "
          f"max={np.max(overall):0.3f}ms", flush=True)
    for j, name in enumerate(NAMES):
        per = {s: [] for s in STAGES}
        for (start, end), c in zip(times, costs):
            t = c[j]
            per["python_req"].append((t[0] - start) / 1e6)
            per["req_send"].append((t[1] - t[0]) / 1e6)
            per["req_recv"].append((t[3] - t[2]) / 1e6)
            per["process"].append((t[4] - t[3]) / 1e6)
            per["rsp_send"].append((t[5] - t[4]) / 1e6)
            per["rsp_recv"].append((t[7] - t[6]) / 1e6)
            per["python_rsp"].append((end - t[7]) / 1e6)
            per["net_cost"].append((t[6] - t[1] - (t[5] - t[2])) / 1e6)
        print(f"\t rank={rank} {name}:", flush=True)
        for s in STAGES:
            d = np.sort(per[s])
            print(f"\t\t{s:<10}\t{np.mean(d):0.3f}\t{np.percentile(d, 50):0.3f}\t"
                  f"{np.percentile(d, 99):0.3f}\t{d[-1]:0.3f} {d[-2]:0.3f} {d[-3]:0.3f}",
                  flush=True)
            assert min(d) >= 0 or s in ("net_cost", "python_rsp"), (name, s, d[0])


f.init()
if role == "worker":
    send, push_keys, recv, pull_keys = [], [], [], []
    for mb in range(3):
        tokens = [torch.rand([num_token, dim]).to(torch.bfloat16),
                  torch.tensor([num_token], dtype=torch.int32)]
        send.append(tokens)
        push_keys.append([gen_push_key(i, mb) for i in range(len(tokens))])
        recv.append([torch.zeros([num_token, dim], dtype=torch.bfloat16)
                     for _ in range(server_count)])
        pull_keys.append([gen_pull_key(i, mb) for i in range(server_count)])
    f.barrier(False, True)
    times, costs, windows = [], [], 0
    for idx in range(num_iters):
        start = f.get_nanosecond()
        handler = f.push_pull(send[idx % 3], push_keys[idx % 3], recv[idx % 3],
                              pull_keys[idx % 3])
        handlers = f.get_all_handlers(handler)
        f.wait(handler)
        end = f.get_nanosecond()
        times.append((start, end))
        costs.append([f.fetch_trace(h) for h in handlers])
        if len(times) == WINDOW:
            report(times, costs)
            windows += 1
            times, costs = [], []
    print(f"worker {rank} test done ({windows} windows)", flush=True)
elif role == "server":
    ret_buffer = torch.rand([num_token * worker_count, dim]).to(torch.bfloat16)
    f.barrier(True, False)
    for it in range(num_iters):
        batches = f.get_batch()
        recv_tensor_list = [batches[i][1][0] for i in range(worker_count)]
        comm_id_list = [batches[i][0] for i in range(worker_count)]
        f.respond_vec(ret_buffer, recv_tensor_list, comm_id_list)
    print(f"server {rank} test done", flush=True)
f.stop()
