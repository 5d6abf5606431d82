"""StepMesh's SimpleNotify pattern under stepmesh.fserver, without a GPU: the
streams are cpu_mock's (f.create_stream(); on CUDA, SimpleNotify() takes
torch's current stream). The worker's stream waits for each request's reply
(stream_wait_event) and only then copies the pulled tensor; the server's
stream waits for each batch (block_now_stream_and_get_batch) and only then
snapshots the received tensor. Both streams' work is queued before the data
is there, so a stream that did not wait would see stale data."""

import os
import time

import torch

import stepmesh.fserver as f

ITERS = int(os.environ.get("FSERVER_TEST_ITERS", "5"))
role = os.environ.get("DMLC_ROLE")

f.init()
if role == "worker":
    rank = int(os.environ["DMLC_NODE_RANK"])
    stream = f.create_stream()
    notify = f.SimpleNotify(stream=stream)
    f.barrier(False, True)
    push, pull = torch.zeros(1, 16), torch.zeros(1, 16)
    h = f.push_pull([push], [7], [pull], [7])  # introduces key 7 (an announcement)
    f.wait(h)
    for i in range(ITERS):
        push.fill_(10 * i + rank)
        h = f.push_pull([push], [7], [pull], [7])
        notify.stream_wait_event(h)
        seen = []
        stream.launch_host_func(lambda: seen.append(pull.clone()))
        notify.wait_event_done()
        stream.synchronize(30)
        assert torch.equal(seen[0], push * 2), (i, seen[0][0, 0].item(), push[0, 0].item())
    print("worker test done", flush=True)
elif role == "server":
    stream = f.create_stream()
    notify = f.SimpleNotify(stream=stream)
    f.barrier(True, False)
    for handler, tensors, keys in f.get_batch():  # the first request of key 7
        f.respond([tensors[0] * 2], handler)
    for i in range(ITERS):
        snaps = []
        notify.block_now_stream_and_get_batch()  # queued before the batch is there
        stream.launch_host_func(lambda: snaps.append(f._mesh().recv[7][0].numpy().copy()))
        batches = notify.get_future_batch_data()
        stream.synchronize(30)
        for handler, tensors, keys in batches:
            f.respond([tensors[0] * 2], handler)
        expect = [10 * i + w for w in range(len(batches))]
        got = [float(snaps[0][w * 1, 0]) for w in range(len(batches))]
        assert got == expect, (i, got, expect)
        time.sleep(0.05 * (i % 2))  # the next batch sometimes arrives before the block
    print("server test done", flush=True)
f.stop()
