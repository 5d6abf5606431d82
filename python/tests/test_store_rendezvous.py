"""The framework-store rendezvous: a mesh that meets through a real
torch.distributed.TCPStore (the store vLLM / PyTorch already run), with no
scheduler process; liveness through our heartbeat counters in the store."""

import datetime
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import stepmesh

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import proc_util  # noqa: E402

torch = proc_util.require_torch()
from torch.distributed import TCPStore  # noqa: E402

# No scheduler listens here: a participant that used it would fail to join.
NO_SCHEDULER = "127.0.0.1:1"


def master_store():
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30),
                    wait_for_workers=False)


def client(master):
    return TCPStore("127.0.0.1", master.port, is_master=False,
                    timeout=datetime.timedelta(seconds=30))


def run_threads(targets, timeout=60):
    errors = []

    def wrap(f):
        def run():
            try:
                f()
            except BaseException as e:  # noqa: B902
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(f)) for f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
        assert not t.is_alive(), "a participant did not finish"
    if errors:
        raise errors[0]


def test_2a2f_meets_through_a_torch_tcpstore_without_a_scheduler():
    master = master_store()
    common = dict(num_workers=2, num_servers=2, transport="tcp", scheduler=NO_SCHEDULER,
                  timeout=20.0, heartbeat_interval=0.2)
    steps, n = 5, 16
    ranks = []

    def server(rank):
        def run():
            with stepmesh.Server(store=client(master), rank=rank, **common) as s:
                recv = np.zeros(2 * n, np.float32)
                reply = np.zeros(2 * n, np.float32)
                s.register_recv(10, recv)
                s.register_reply(20, reply)
                s.barrier()
                for _ in range(steps):
                    b = s.get_batch(timeout=20)
                    reply[:] = recv + 1000 * (s.rank + 1)
                    s.respond(b)
                s.barrier()
        return run

    def worker():
        with stepmesh.Worker(store=client(master), rank=-1, **common) as w:
            ranks.append(w.rank)
            x = np.zeros(n, np.float32)
            ys = [np.zeros(n, np.float32) for _ in range(2)]
            w.register_push(10, x)
            for s in range(2):
                w.register_pull(20, s, ys[s])
            w.barrier()
            for step in range(steps):
                x[:] = np.arange(n) + 100 * step + 10 * w.rank
                w.wait(w.push_pull([10], [(20, 0), (20, 1)]), timeout=20)
                for s in range(2):
                    np.testing.assert_array_equal(ys[s], x + 1000 * (s + 1))
            w.barrier()

    run_threads([server(0), server(1), worker, worker])
    assert sorted(ranks) == [0, 1], "ranks are handed out by the store's add()"
    # What the mesh wrote is in the store: the member keys and the shape.
    # Each test has a store of its own, so the mesh's keys sit under stepmesh/default/.
    assert master.get("stepmesh/default/shape") == b"workers=2 servers=2 mesh="


def test_another_shape_in_the_store_is_refused_naming_the_key():
    master = master_store()
    first_error = []

    def first():
        try:
            stepmesh.Server(store=client(master), num_workers=1, num_servers=1, rank=0,
                            transport="tcp", timeout=3.0)
        except stepmesh.Error as e:
            first_error.append(e)

    t = threading.Thread(target=first)
    t.start()
    master.wait(["stepmesh/default/shape"], datetime.timedelta(seconds=10))
    start = time.monotonic()
    with pytest.raises(stepmesh.FailedPrecondition,
                       match=r"store key stepmesh/default/shape holds another mesh's shape"):
        stepmesh.Server(store=client(master), num_workers=2, num_servers=2, rank=0,
                        transport="tcp", timeout=3.0)
    assert time.monotonic() - start < 3.0
    t.join(timeout=20)
    # The first one's roster never completed: the error names who is missing.
    assert first_error and "missing worker/0" in str(first_error[0]), first_error


def test_a_capacity_above_the_start_shape_is_refused_naming_the_options():
    # The store's set/get/add/wait cannot hand a rank back or agree on epochs
    # (docs/elastic.md, "Where it is implemented"): a clear refusal, nothing written.
    master = master_store()
    keys = master.num_keys()
    for cls, extra in ((stepmesh.Worker, {"max_workers": 2}),
                       (stepmesh.Server, {"max_servers": 3})):
        start = time.monotonic()
        with pytest.raises(stepmesh.InvalidArgument,
                           match=r"max_workers=\d+ for num_workers=1, max_servers=\d+ for "
                                 r"num_servers=1: STEPMESH_MAX_WORKERS/STEPMESH_MAX_SERVERS\) "
                                 r"needs the scheduler or etcd rendezvous; the framework store "
                                 r"runs fixed shapes only"):
            cls(store=client(master), num_workers=1, num_servers=1, rank=0, transport="tcp",
                timeout=3.0, **extra)
        assert time.monotonic() - start < 3.0
    assert master.num_keys() == keys, "a refused join wrote to the store"


def test_a_frozen_server_is_lost_by_heartbeat_and_the_worker_told():
    master = master_store()
    server = proc_util.spawn([os.path.join(HERE, "programs", "store_server.py"),
                              str(master.port)])
    try:
        # The child (torch import and all) first: the worker's join waits only 3 s.
        master.wait(["stepmesh/default/member/server/0"], datetime.timedelta(seconds=60))
        with stepmesh.Worker(store=client(master), num_workers=1, num_servers=1, rank=0,
                             transport="tcp", scheduler=NO_SCHEDULER,
                             timeout=3.0, heartbeat_interval=0.2) as w:
            x = np.ones(8, np.float32)
            y = np.zeros(8, np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            w.barrier()
            w.wait(w.push_pull([1], [(2, 0)]), timeout=10)
            np.testing.assert_array_equal(y, x + 1)
            # Frozen, not killed: its connection stays open; only the store's
            # heartbeat counter stops moving.
            os.kill(server.pid, signal.SIGSTOP)
            start = time.monotonic()
            req = w.push_pull([1], [(2, 0)])
            with pytest.raises(stepmesh.Unavailable, match="beat/server/0"):
                w.wait(req, timeout=15)
            assert time.monotonic() - start < 3.0 + 3.0
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
        server.communicate()


def test_an_object_without_the_store_methods_is_a_type_error():
    with pytest.raises(TypeError, match="set/get/add/wait"):
        stepmesh.Worker(store=object(), transport="tcp", timeout=1.0)
