#!/usr/bin/env python3
"""The stream= paths of the Python API with torch CUDA tensors on
backend="cuda" (docs/python.md, "CUDA streams"): a push ordered after a
producing kernel on a side stream, a reply ordered after the server's kernel,
a kernel queued behind wait(req, stream=) before the reply is there, and the
server's batch stream counted from the first batch. The producers sleep on
the device (torch.cuda._sleep) and the server delays a reply on the host, so
a missing wait shows as stale data.

Exits 77 (ctest: skipped) only when the CUDA driver reports no device; a GPU
with a torch that has no CUDA is a failure, not a skip. A worker and a server
thread of this process over TCP on 127.0.0.1."""

import ctypes
import os
import sys
import threading
import time

# Kernels load at start-up: a lazily loaded kernel's first launch waits for the
# whole device, which a stream waiting for an arrival keeps busy (docs/cuda.md).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def cuda_devices() -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


if cuda_devices() == 0:
    print("gpu_streams: no CUDA device: skipped")
    sys.exit(77)

import torch  # noqa: E402

import stepmesh  # noqa: E402

if not torch.cuda.is_available():
    print(f"gpu_streams: a CUDA device is present but {sys.executable}'s torch has no CUDA "
          f"(torch {torch.__version__}); run with a CUDA build of torch", file=sys.stderr)
    sys.exit(1)

ROWS, COLS, TIMEOUT = 4, 256, 20.0
SLEEP_CYCLES = 50_000_000  # tens of ms of device time before the producer writes
errors = []
snaps = []


def opts(addr):
    return stepmesh.MeshOptions(scheduler=addr, transport="tcp", backend="cuda", device=0,
                                num_workers=1, num_servers=1, timeout=TIMEOUT)


def server_main(addr):
    try:
        with stepmesh.Server(opts(addr)) as s:
            recv = torch.zeros(ROWS, COLS, device="cuda")
            reply = torch.zeros(ROWS, COLS, device="cuda")
            s.register_recv(1, recv)
            s.register_reply(2, reply)
            compute, batches = torch.cuda.Stream(), torch.cuda.Stream()
            s.barrier()

            def next_batch():  # every batch from the first: the device counts them
                s.stream_wait_next_batch(batches.cuda_stream)
                with torch.cuda.stream(batches):
                    snaps.append(recv.clone())
                return s.get_batch(timeout=TIMEOUT)
            for step in range(3):
                b = next_batch()
                if step == 2:
                    time.sleep(0.3)  # the worker's stream is already waiting for this reply
                with torch.cuda.stream(compute):
                    torch.cuda._sleep(SLEEP_CYCLES)
                    reply.copy_(recv * 2)
                s.respond(b, stream=compute.cuda_stream)  # leaves after the copy ran
            batches.synchronize()
            s.barrier()
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def main() -> int:
    with stepmesh.Scheduler(num_workers=1, num_servers=1) as sched:
        t = threading.Thread(target=server_main, args=(sched.address,))
        t.start()
        try:
            with stepmesh.Worker(opts(sched.address)) as w:
                x = torch.zeros(ROWS, COLS, device="cuda")
                y = torch.zeros(ROWS, COLS, device="cuda")
                w.register_push(1, x)
                w.register_pull(2, 0, y)
                produce, consume = torch.cuda.Stream(), torch.cuda.Stream()
                w.barrier()
                for step in range(3):
                    value = float(step + 1)
                    with torch.cuda.stream(produce):
                        torch.cuda._sleep(SLEEP_CYCLES)
                        x.fill_(value)
                    req = w.push_pull([1], [(2, 0)], stream=produce.cuda_stream)
                    if step < 2:
                        w.wait(req, TIMEOUT)
                        got = y.clone()
                    else:  # arrival on the GPU timeline: queued before the reply exists
                        w.wait(req, stream=consume.cuda_stream)
                        with torch.cuda.stream(consume):
                            got = y.clone()
                        consume.synchronize()
                        w.wait(req, TIMEOUT)
                    torch.cuda.synchronize()
                    if not torch.equal(got, torch.full_like(got, 2 * value)):
                        raise AssertionError(f"step {step}: reply {got[0, 0].item()}, "
                                             f"expected {2 * value}")
                w.barrier()
        finally:
            t.join(timeout=60)
    if t.is_alive():
        raise AssertionError("server thread did not finish")
    if errors:
        raise errors[0]
    got = [float(s[0, 0].item()) for s in snaps]
    if got != [1.0, 2.0, 3.0]:
        raise AssertionError(f"server batch stream saw {got}, expected [1.0, 2.0, 3.0]")
    print("gpu_streams: 3 steps, push/respond/wait/next_batch streams ordered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
