"""The stepmesh package with numpy (and framework-free HostTensor) tensors:
round trips of every dtype, bad input, GIL release, tensor lifetime, options,
exceptions. Meshes run as threads of this process over TCP on 127.0.0.1; the
scheduler binds port 0, so no port is ever guessed."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import proc_util
import stepmesh
import thread_util

HERE = os.path.dirname(os.path.abspath(__file__))


def opts(addr, workers=1, servers=1, **kw):
    return stepmesh.MeshOptions(scheduler=addr, transport="tcp", num_workers=workers,
                                num_servers=servers, timeout=20.0, **kw)


def register_row_server(s):
    """The server side of register_row: recv key 1 and reply key 2, one row of 4."""
    recv = np.zeros((1, 4), np.float32)
    reply = np.zeros((1, 4), np.float32)
    s.register_recv(1, recv)
    s.register_reply(2, reply)
    return recv, reply


def register_row(w, value):
    """One float32 row of 4: push key 1 (filled with `value`), pull key 2 from server 0."""
    x = np.full((1, 4), value, np.float32)
    y = np.zeros((1, 4), np.float32)
    w.register_push(1, x)
    w.register_pull(2, 0, y)
    return x, y


class Mesh:
    """A scheduler plus servers running `server_fn(server)` in threads; the test
    body is the worker(s). Every thread is joined with a deadline."""

    def __init__(self, server_fn, workers=1, servers=1, **server_options):
        self.scheduler = stepmesh.Scheduler(num_workers=workers, num_servers=servers)
        self.addr = self.scheduler.address
        self.errors = []
        self.threads = []
        self.server_options = server_options
        for s in range(servers):
            t = threading.Thread(target=self._run, args=(server_fn, workers, servers, s))
            t.start()
            self.threads.append(t)

    def _run(self, fn, workers, servers, rank):
        try:
            with stepmesh.Server(opts(self.addr, workers, servers, rank=rank,
                                      **self.server_options)) as s:
                fn(s)
        except BaseException as e:  # reported by close()
            self.errors.append(e)

    def worker(self, workers=1, servers=1, rank=0):
        return stepmesh.Worker(opts(self.addr, workers, servers, rank=rank))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for t in self.threads:
            t.join(timeout=60)
            assert not t.is_alive(), "server thread did not finish"
        self.scheduler.stop()
        if self.errors:
            raise self.errors[0]


def echo_server(key_in, key_out, steps, make_region, times2=False):
    """Registers receive/reply regions and answers `steps` batches with the
    pushed bytes (or doubled values) in each worker's reply slot."""

    def run(s):
        recv, reply = make_region(), make_region()
        s.register_recv(key_in, recv)
        s.register_reply(key_out, reply)
        s.barrier()
        for _ in range(steps):
            b = s.get_batch(timeout=20)
            sizes = {}
            for w in b.workers:
                part = b.part(key_in, w)
                if isinstance(recv, stepmesh.HostTensor):  # raw bytes: any dtype
                    src, dst = recv.raw().numpy(), reply.raw().numpy()
                    slot = src.size // s.num_workers
                    valid = slice(w * slot, w * slot + part.valid_bytes)
                    dst[valid] = src[valid]
                else:
                    view = np.from_dlpack(part)
                    slot_rows = reply.shape[0] // s.num_workers
                    out = reply[w * slot_rows: w * slot_rows + view.shape[0]]
                    out[...] = view * 2 if times2 else view
                sizes[w] = part.valid_bytes
            s.respond(b, bytes=sizes)
        s.barrier()

    return run


NUMPY_DTYPES = ["uint8", "int32", "int64", "float32", "float16"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip_every_numpy_dtype(dtype):
    rows, cols, steps = 6, 5, 4
    with Mesh(echo_server(1, 2, steps, lambda: np.zeros((rows, cols), dtype))) as mesh:
        with mesh.worker() as w:
            x = np.zeros((rows, cols), dtype)
            y = np.zeros((rows, cols), dtype)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            w.barrier()
            rng = np.random.default_rng(7)
            for step in range(steps):
                n = [rows, 1, 3, rows][step]  # a prefix of rows: variable per step
                x[...] = rng.integers(0, 100, size=x.shape).astype(dtype)
                y[...] = 0
                w.wait(w.push_pull([stepmesh.Push(1, rows=n)], [(2, 0)]), timeout=20)
                np.testing.assert_array_equal(y[:n], x[:n])
                assert not y[n:].any()
            w.barrier()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3"])
def test_host_tensor_round_trip_dtypes_numpy_lacks(dtype):
    """bfloat16 and float8 travel as their own dtype (the server checks it);
    their bytes are compared through the uint8 view."""
    rows, cols, steps = 4, 16, 3
    with Mesh(echo_server(1, 2, steps, lambda: stepmesh.HostTensor([rows, cols], dtype))) as mesh:
        with mesh.worker() as w:
            x = stepmesh.HostTensor([rows, cols], dtype)
            y = stepmesh.HostTensor([rows, cols], dtype)
            assert stepmesh.describe(x)["dtype"] == dtype
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            w.barrier()
            xb, yb = x.raw().numpy(), y.raw().numpy()
            for step in range(steps):
                xb[...] = np.random.default_rng(step).integers(0, 255, xb.shape, dtype=np.uint8)
                yb[...] = 0
                w.wait(w.push_pull([1], [(2, 0)]), timeout=20)
                np.testing.assert_array_equal(yb, xb)
            w.barrier()


def test_two_workers_two_servers_batch_parts_are_zero_copy_views():
    rows, cols, steps = 8, 4, 3
    seen = []

    def server(s):
        recv = np.zeros((2 * rows, cols), np.float32)
        reply = np.zeros((2 * rows, cols), np.float32)
        s.register_recv(10, recv)
        s.register_reply(20, reply)
        s.barrier()
        for _ in range(steps):
            b = s.get_batch(timeout=20)
            assert b.group == 10 and b.workers == [0, 1]
            rows_back, offsets, at = {}, {}, 0
            packed = s.rank == 1  # server 1 packs the replies back to back (offsets=)
            assert b.rows(10) == [b.part(10, w).rows for w in b.workers]
            for w in b.workers:
                part = b.part(10, w)
                view = np.from_dlpack(part)
                # zero-copy: the view is worker w's slot of the registered region
                assert np.shares_memory(view, recv)
                assert part.data_ptr == recv.ctypes.data + w * recv.nbytes // 2
                assert part.valid_bytes == part.rows * cols * 4
                assert view.shape == (part.rows, cols)
                first = at if packed else w * rows
                reply[first: first + part.rows] = view + 100 * (s.rank + 1)
                rows_back[w], offsets[w] = part.rows, first
                at += part.rows
                seen.append((s.rank, w, part.rows))
            if packed:  # bad offsets are refused naming them, and change nothing
                for bad, words in (([0], "expected {worker: row}"),
                                   ({7: 0}, "worker 7 which is not in this batch"),
                                   ({1: 2 * rows}, "offset")):
                    with pytest.raises(ValueError, match=words.replace("{", r"\{")):
                        s.respond(b, rows=rows_back, offsets=bad)
                s.respond(b, rows=rows_back, offsets=offsets)
            else:
                s.respond(b, rows=rows_back)
        s.barrier()

    mesh = Mesh(server, workers=2, servers=2)
    errors = []

    def worker(rank):
        try:
            with mesh.worker(2, 2, rank) as w:
                x = np.zeros((rows, cols), np.float32)
                ys = [np.zeros((rows, cols), np.float32) for _ in range(2)]
                w.register_push(10, x)
                for s in range(2):
                    w.register_pull(20, s, ys[s])
                w.barrier()
                for step in range(steps):
                    n = 1 + (step * 3 + rank) % rows  # each worker its own row count
                    x[:n] = np.arange(n * cols, dtype=np.float32).reshape(n, cols) + rank
                    req = w.push_pull([stepmesh.Push(10, rows=n)], [(20, 0), (20, 1)])
                    w.wait(req, timeout=20)
                    for s in range(2):
                        np.testing.assert_array_equal(ys[s][:n], x[:n] + 100 * (s + 1))
                    trace = w.fetch_trace(req)
                    assert sorted(t["server"] for t in trace["servers"]) == [0, 1]
                    for t in trace["servers"]:
                        assert 0 < t["enqueue_ns"] <= t["post_ns"] <= t["reply_arrival_ns"]
                        assert t["server_arrival_ns"] <= t["server_handler_ns"] <= t[
                            "server_reply_ns"]
                    assert trace["complete_ns"] >= max(t["reply_arrival_ns"]
                                                       for t in trace["servers"])
                w.barrier()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    mesh.close()
    if errors:
        raise errors[0]
    assert len(seen) == 2 * 2 * steps


def test_bad_tensors_raise_value_error_naming_the_problem():
    def server(s):
        with pytest.raises(ValueError, match="not a multiple of num_workers"):
            s.register_recv(1, np.zeros((3, 4), np.float32))  # 3 rows, 2 workers
        s.register_recv(1, np.zeros((4, 4), np.float32))
        s.barrier()
        s.barrier()

    def other_worker():
        with mesh.worker(2, 1, 1) as w:
            w.barrier()
            w.barrier()

    with Mesh(server, workers=2) as mesh, thread_util.in_background(other_worker):
        with mesh.worker(2, 1, 0) as w:
            with pytest.raises(ValueError, match="unsupported dtype int8"):
                w.register_push(1, np.zeros(4, np.int8))
            with pytest.raises(ValueError, match="unsupported dtype float64"):
                w.register_push(1, np.zeros(4))
            with pytest.raises(ValueError, match="bool|refused"):
                w.register_push(1, np.zeros(4, bool))
            with pytest.raises(ValueError, match=r"not contiguous \(shape \[4, 2\]"):
                w.register_push(1, np.zeros((4, 4), np.float32)[:, ::2])
            with pytest.raises(ValueError, match="has no __dlpack__"):
                w.register_push(1, [1.0, 2.0])
            with pytest.raises(ValueError, match="expected an int key"):
                w.register_push("k", np.zeros(4, np.float32))
            x = np.zeros((2, 4), np.float32)
            w.register_push(1, x)
            with pytest.raises(stepmesh.AlreadyExists):
                w.register_push(1, x)
            with pytest.raises(ValueError, match="exceeds|bytes"):  # OutOfRange is a ValueError
                w.wait(w.push_pull([(1, x.nbytes + 4)]), timeout=5)
            with pytest.raises(stepmesh.NotFound, match="push key 7"):
                w.push_pull([7])
            with pytest.raises(ValueError, match="give bytes or rows"):
                w.push_pull([stepmesh.Push(1, bytes=4, rows=1)])
            with pytest.raises(ValueError, match="cannot use a str"):
                w.push_pull(["x"])
            w.barrier()
            w.barrier()


def test_wait_releases_the_gil():
    """The server answers from a Python thread of this same process only after
    the worker is inside wait(): if wait() held the GIL, the reply could never
    be computed and wait() would time out."""
    in_wait = threading.Event()
    counter = [0]

    def server(s):
        recv, reply = register_row_server(s)
        s.barrier()
        b = s.get_batch(timeout=20)
        assert in_wait.wait(20)
        time.sleep(0.3)
        before = counter[0]
        for _ in range(200000):  # pure Python work while the worker waits
            counter[0] += 1
        assert counter[0] - before == 200000
        reply[...] = np.from_dlpack(b.part(1, 0)) + 1
        s.respond(b)
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            x, y = register_row(w, 41)
            w.barrier()
            req = w.push_pull([1], [(2, 0)])
            in_wait.set()
            w.wait(req, timeout=20)
            assert counter[0] == 200000
            np.testing.assert_array_equal(y, 42)
            w.barrier()


def test_registered_tensor_is_kept_alive_after_the_user_drops_it():
    def server(s):
        recv = np.zeros((16,), np.int64)
        reply = np.zeros((16,), np.int64)
        s.register_recv(1, recv)
        s.register_reply(2, reply)
        s.barrier()
        b = s.get_batch(timeout=20)
        reply[...] = np.from_dlpack(b.part(1, 0))
        s.respond(b)
        s.barrier()

    with Mesh(server) as mesh:
        w = mesh.worker()
        x = np.arange(16, dtype=np.int64) * 3
        y = np.zeros(16, np.int64)
        alive = weakref.ref(x)
        w.register_push(1, x)
        w.register_pull(2, 0, y)
        del x
        gc.collect()
        assert alive() is not None, "the registration must keep the tensor alive"
        for _ in range(50):  # churn the allocator: a freed buffer would be reused
            np.full(16, -1, np.int64)
        w.barrier()
        w.wait(w.push_pull([1], [(2, 0)]), timeout=20)
        np.testing.assert_array_equal(y, np.arange(16) * 3)
        w.barrier()
        w.close()
        assert alive() is not None  # still referenced until the worker object goes
        del w
        gc.collect()
        assert alive() is None, "dropping the worker releases the tensor"


def test_server_killed_raises_unavailable_within_the_timeout():
    sched = stepmesh.Scheduler(num_workers=1, num_servers=1, heartbeat_interval=0.2, timeout=10.0)
    server = proc_util.spawn([os.path.join(HERE, "programs", "hanging_server.py"), sched.address])
    try:
        with stepmesh.Worker(scheduler=sched.address, transport="tcp", timeout=10.0,
                             heartbeat_interval=0.2) as w:
            x = np.ones(8, np.float32)
            y = np.zeros(8, np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            w.barrier()
            req = w.push_pull([1], [(2, 0)])
            assert server.stdout.readline().strip() == "got batch"  # it holds the request
            os.kill(server.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(stepmesh.Unavailable) as info:
                w.wait(req, timeout=8.0)
            elapsed = time.monotonic() - start
            assert elapsed < 8.0
            assert isinstance(info.value, stepmesh.Error)
            assert isinstance(info.value, ConnectionError)
            assert info.value.code == "UNAVAILABLE"
            with pytest.raises(stepmesh.Unavailable, match="server 0"):
                w.push_pull([1], [(2, 0)])
    finally:
        proc_util.kill_all([server])
        sched.stop()


def test_environment_value_reads_documented_names_only(monkeypatch):
    # The Python layer's own variables (AFD_*) are rows of the one table and
    # are read through it; a name the table does not document is refused.
    monkeypatch.delenv("AFD_RANK", raising=False)
    assert stepmesh.environment_value("AFD_RANK") is None
    monkeypatch.setenv("AFD_RANK", "3")
    assert stepmesh.environment_value("AFD_RANK") == "3"
    monkeypatch.setenv("AFD_NOT_A_SETTING", "1")
    with pytest.raises(stepmesh.NotFound, match="AFD_NOT_A_SETTING is not in the environment table"):
        stepmesh.environment_value("AFD_NOT_A_SETTING")


def test_options_from_kwargs_and_environment(monkeypatch):
    o = stepmesh.MeshOptions(num_workers=3, poll_mode="spin", timeout=2.5, send_cores=[1])
    assert (o.num_workers, o.poll_mode, o.timeout, o.send_cores) == (3, "spin", 2.5, [1])
    with pytest.raises(ValueError, match="unknown MeshOptions field 'num_worker'"):
        stepmesh.MeshOptions(num_worker=3)
    with pytest.raises(ValueError, match="num_servers: expected int, got str"):
        stepmesh.MeshOptions(num_servers="2")
    with pytest.raises(ValueError, match="poll mode 'fast'"):
        stepmesh.MeshOptions(poll_mode="fast")
    with pytest.raises(ValueError, match="MeshOptions.role: role 'ffn'"):
        stepmesh.MeshOptions(role="ffn")
    monkeypatch.setenv("DMLC_NUM_WORKER", "4")
    monkeypatch.setenv("DMLC_PS_ROOT_URI", "127.0.0.2")
    monkeypatch.setenv("DMLC_PS_ROOT_PORT", "9123")
    monkeypatch.setenv("STEPMESH_POLL_MODE", "blocking")
    e = stepmesh.MeshOptions.from_env(num_servers=2)
    assert (e.num_workers, e.num_servers, e.scheduler, e.poll_mode) == (
        4, 2, "127.0.0.2:9123", "blocking")
    monkeypatch.setenv("STEPMESH_NUM_WORKERS", "many")
    with pytest.raises(stepmesh.InvalidArgument, match="STEPMESH_NUM_WORKERS='many': not an integer"):
        stepmesh.MeshOptions.from_env()
    assert "auth_token" not in repr(stepmesh.MeshOptions(auth_token="secret"))
    monkeypatch.setenv("STEPMESH_NUM_WORKERS", "1")
    monkeypatch.setenv("DMLC_INTERFACE", "lo")
    monkeypatch.setenv("DMLC_NODE_HOST", "10.1.2.3")
    e = stepmesh.MeshOptions.from_env()
    assert (e.interface, e.node_host) == ("lo", "10.1.2.3")
    k = stepmesh.MeshOptions(interface="eth2", node_host="h1")
    assert (k.interface, k.node_host) == ("eth2", "h1")


def test_exception_hierarchy_and_closed_handles():
    for name, builtin in [("InvalidArgument", ValueError), ("OutOfRange", ValueError),
                          ("DeadlineExceeded", TimeoutError), ("Unavailable", ConnectionError),
                          ("NotFound", LookupError), ("Cancelled", None),
                          ("FailedPrecondition", None), ("DataLoss", None)]:
        cls = getattr(stepmesh, name)
        assert issubclass(cls, stepmesh.Error)
        if builtin is not None:
            assert issubclass(cls, builtin)
    assert stepmesh.DeadlineExceeded.code == "DEADLINE_EXCEEDED"

    def server(s):
        s.register_recv(1, np.zeros(4, np.float32))
        s.barrier()
        with pytest.raises(stepmesh.DeadlineExceeded, match="no batch within"):
            s.get_batch(timeout=0.05)
        with pytest.raises(ValueError, match="policy 'some'"):
            s.get_batch(timeout=0.05, policy="some")
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            w.barrier()
            w.barrier()
        assert w.closed
        with pytest.raises(stepmesh.FailedPrecondition, match="worker is closed"):
            w.barrier()


def test_tensor_slices_outlive_their_batch_safely():
    """A view taken from a batch keeps the registered memory alive even after
    the server unregisters the key and is dropped."""
    holder = {}

    def server(s):
        recv = np.zeros((1, 4), np.float32)
        s.register_recv(1, recv)
        s.barrier()
        b = s.get_batch(timeout=20)
        holder["view"] = np.from_dlpack(b.part(1, 0))
        alive = weakref.ref(recv)
        del recv
        s.respond(b)
        s.barrier()
        s.unregister(1)
        gc.collect()
        holder["alive"] = alive

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            w.register_push(1, x)
            w.barrier()
            w.wait(w.push_pull([1]), timeout=20)
            w.barrier()
    gc.collect()
    assert holder["alive"]() is not None  # the numpy view still pins it
    np.testing.assert_array_equal(holder["view"], [[0, 1, 2, 3]])
    del holder["view"]
    gc.collect()
    assert holder["alive"]() is None


def test_prepared_plan_round_trips_goes_stale_and_names_bad_keys():
    """Worker.prepare: keys checked once (an unregistered key is a LookupError
    naming it), rows resolved at preparation, run() = post + wait, post() a
    Request; the plan holds no tensor: once its keys are unregistered it is
    stale (posting it raises FailedPrecondition naming the key, even after the
    key is registered again) and the tensors go with the worker's hold."""
    rows, cols, steps = 4, 3, 3
    with Mesh(echo_server(1, 2, steps, lambda: np.zeros((rows, cols), np.float32), times2=True)) as mesh:
        with mesh.worker() as w:
            x = np.zeros((rows, cols), np.float32)
            y = np.zeros((rows, cols), np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            with pytest.raises(stepmesh.NotFound, match="push key 9"):
                w.prepare([9], [(2, 0)])
            with pytest.raises(stepmesh.NotFound, match="pull key 3 from server 0"):
                w.prepare([1], [(3, 0)])
            with pytest.raises(ValueError, match="pull of key 2 from unknown server 1"):
                w.prepare([1], [(2, 1)])
            with pytest.raises(ValueError, match="push key 1 repeated"):
                w.prepare([1, 1], [(2, 0)])
            with pytest.raises(ValueError, match="at least one push"):
                w.prepare([], [(2, 0)])
            plan = w.prepare([1], [(2, 0)])
            xr, yr = weakref.ref(x), weakref.ref(y)
            w.unregister(1)  # the worker lets go, and the plan holds nothing
            w.unregister(2)
            del x, y
            gc.collect()
            assert xr() is None and yr() is None
            with pytest.raises(stepmesh.FailedPrecondition, match="push key 1 was unregistered"):
                plan.run(20)
            x = np.zeros((rows, cols), np.float32)
            y = np.zeros((rows, cols), np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            with pytest.raises(stepmesh.FailedPrecondition, match="push key 1 was unregistered"):
                plan.post()  # the same key over new memory: still stale, never silently reused
            del plan
            plan = w.prepare([stepmesh.Push(1, rows=2)], [(2, 0)])
            assert (plan.num_pushes, plan.num_pulls, plan.last) == (1, 1, None)
            w.barrier()
            x[...] = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
            plan.run(20)
            np.testing.assert_array_equal(y[:2], 2 * x[:2])  # 2 rows: resolved at prepare
            assert not y[2:].any()
            assert plan.last is not None and w.fetch_trace(plan.last)["complete_ns"] > 0
            x += 1
            req = plan.post()
            w.wait(req, 20)
            np.testing.assert_array_equal(y[:2], 2 * x[:2])
            x += 1
            plan.run()  # default timeout: options.timeout
            np.testing.assert_array_equal(y[:2], 2 * x[:2])
            w.barrier()


def test_plan_run_many_measures_in_cpp_releases_the_gil_and_names_bad_arguments():
    """Plan.run_many(n, timeout): n round trips in C++ (each reply really
    arrives: the server adds one per batch), latencies in ns on
    monotonic_ns's clock, the GIL released for the whole loop (a Python server
    thread of this process answers meanwhile), bad n named, and a timeout
    raises DeadlineExceeded naming the iteration with the request left pending
    in plan.last."""
    n = 5
    in_loop = threading.Event()
    counter = [0]

    def server(s):
        recv, reply = register_row_server(s)
        s.barrier()
        for i in range(n):
            b = s.get_batch(timeout=20)
            if i == 0:
                assert in_loop.wait(20)
                time.sleep(0.2)
                for _ in range(100000):  # pure Python work while run_many loops
                    counter[0] += 1
            reply[...] = np.from_dlpack(b.part(1, 0)) + i
            s.respond(b)
        s.barrier()
        b = s.get_batch(timeout=20)  # the timed-out request: answered after the timeout
        s.barrier()
        reply[...] = -1
        s.respond(b)
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            x, y = register_row(w, 10)
            plan = w.prepare([1], [(2, 0)])
            for bad, what in ((0, "n = 0 is not"), (-3, "n = -3"), (2**70, "n = 1180591620717411303424"),
                              (1.5, "expected an int, got float"), (True, "got bool")):
                with pytest.raises(ValueError, match=what):
                    plan.run_many(bad)
            with pytest.raises(ValueError, match="timeout"):
                plan.run_many(1, -1.0)
            w.barrier()
            in_loop.set()
            t0 = stepmesh.monotonic_ns()
            lat = plan.run_many(n, 20)
            elapsed = stepmesh.monotonic_ns() - t0
            assert counter[0] == 100000  # the server thread ran Python during the loop
            assert len(lat) == n and all(isinstance(v, int) and v > 0 for v in lat)
            assert sum(lat) <= elapsed  # the same clock, inside the call
            assert lat[0] >= 200_000_000  # the first reply waited for the server's sleep
            np.testing.assert_array_equal(y, 10 + n - 1)  # the last batch's reply
            w.barrier()
            with pytest.raises(stepmesh.DeadlineExceeded, match="iteration 0 of 3"):
                plan.run_many(3, 0.2)
            pending = plan.last
            assert pending is not None and not w.test(pending)
            w.barrier()
            w.wait(pending, 20)  # the late reply releases it
            np.testing.assert_array_equal(y, -1)
            w.barrier()


def test_push_pull_item_forms_and_bad_pull_servers_named():
    """push_pull's parsing: lists, tuples, lists-as-pairs, generators and
    numpy-integer servers all work; a pull server that is not an int rank (a
    str, a bool, one past int range) is a ValueError naming the key, before
    anything is sent."""
    def server(s):
        s.register_recv(1, np.zeros(4, np.uint8))
        reply = np.zeros(4, np.uint8)
        s.register_reply(2, reply)
        s.barrier()
        for i in range(4):
            b = s.get_batch(timeout=20)
            reply[...] = i + 1
            s.respond(b)
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            y = np.zeros(4, np.uint8)
            w.register_push(1, np.zeros(4, np.uint8))
            w.register_pull(2, 0, y)
            for bad, what in (((2, "0"), "pull of key 2: server: expected an int rank, got str"),
                              ((2, True), "got bool"),
                              ((2, 2**40), "server 1099511627776 is out of range"),
                              ((True, 0), "expected an int key, got bool"),
                              ((2,), r"expected \(key, server\)")):
                with pytest.raises(ValueError, match=what):
                    w.push_pull([1], [bad])
            w.barrier()
            forms = [([1], [(2, 0)]), ((1,), [[2, 0]]), (iter([1]), (p for p in [(2, 0)])),
                     ([1], [(2, np.int64(0))])]
            for i, (pushes, pulls) in enumerate(forms):
                w.wait(w.push_pull(pushes, pulls), 20)
                np.testing.assert_array_equal(y, i + 1)
            w.barrier()


def test_plan_set_rows_and_bytes_change_the_push_in_place():
    """Plan.set_rows / set_bytes: the next post sends that prefix (the server
    sees the row count from the frame), a request already posted keeps its
    count, and an out-of-range index or count is a ValueError naming it that
    changes nothing."""
    rows, cols = 6, 2
    seen = []

    def server(s):
        recv = np.zeros((rows, cols), np.float32)
        s.register_recv(1, recv)
        s.register_reply(2, np.zeros((rows, cols), np.float32))
        s.barrier()
        for i in range(5):
            b = s.get_batch(timeout=20)
            seen.append(b.tensor(1).rows(0))
            if i == 4:
                time.sleep(0.5)  # the worker's run() is in flight meanwhile
            s.respond(b)
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            x = np.ones((rows, cols), np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, np.zeros((rows, cols), np.float32))
            plan = w.prepare([stepmesh.Push(1, rows=3)], [(2, 0)])
            assert plan.bytes(0) == 3 * cols * 4
            with pytest.raises(ValueError, match=r"set_rows: push 0 \(key 1\): rows = 7 is not in \[0, 6\]"):
                plan.set_rows(0, 7)
            with pytest.raises(ValueError, match="rows = -1"):
                plan.set_rows(0, -1)
            with pytest.raises(ValueError, match=r"push index 1 is not in \[0, 1\)"):
                plan.set_rows(1, 2)
            with pytest.raises(ValueError, match=r"bytes = 49 is not in \[0, 48\]"):
                plan.set_bytes(0, 49)
            with pytest.raises(ValueError, match="expected an int"):
                plan.set_rows(0, 2.0)
            assert plan.bytes(0) == 3 * cols * 4  # nothing changed
            w.barrier()
            plan.run(20)
            plan.set_rows(0, 5)
            req = plan.post()
            plan.set_rows(0, 1)  # after the post: that request keeps 5
            w.wait(req, 20)
            plan.run(20)
            plan.set_bytes(0, 0)
            plan.run(20)
            # Another thread is inside run() (GIL released): the plan is not changed under it.
            plan.set_rows(0, 2)
            runner = threading.Thread(target=plan.run, args=(20,))
            runner.start()
            time.sleep(0.2)
            with pytest.raises(stepmesh.FailedPrecondition, match="set_rows: the plan is being posted"):
                plan.set_rows(0, 4)
            runner.join(30)
            assert not runner.is_alive()
            plan.set_rows(0, 4)  # between posts: fine
            assert plan.bytes(0) == 4 * cols * 4
            w.barrier()
    assert seen == [3, 5, 1, 0, 2]


def test_stream_arguments_order_sends_and_arrivals_on_cpu_mock_streams():
    """stream= plumbing over cpu_mock streams (host threads standing in for
    CUDA streams): push_pull(stream=) sends only after the stream's earlier
    work wrote the tensor, respond(stream=) likewise, wait(req, stream=) and
    stream_wait_next_pull/_next_batch hold later stream work until the data is
    there. Each producer/consumer is delayed so that a missing wait shows as
    stale data, not as a race that happens to pass."""
    rows, cols = 2, 4
    seen = {}
    snaps = []  # the server's receive region as its batch stream saw it, per batch

    def server(s):
        recv = np.zeros((rows, cols), np.float32)
        reply = np.zeros((rows, cols), np.float32)
        recv2 = np.zeros((rows, cols), np.float32)
        reply2 = np.zeros((rows, cols), np.float32)
        s.register_recv(1, recv)
        s.register_reply(2, reply)
        s.register_recv(3, recv2)
        s.register_reply(4, reply2)
        st = s.create_stream()
        bs = s.create_stream()  # waits for every batch, counted: queued before each get_batch
        s.barrier()

        def next_batch():
            s.stream_wait_next_batch(bs)
            bs.launch_host_func(lambda: snaps.append(recv.copy()))
            batch = s.get_batch(timeout=20)
            # The snapshot runs on the stream's thread whenever it gets the
            # GIL; it must have run before the reply lets the worker send the
            # next batch into the same region (a late snapshot saw batch 2's
            # bytes under CI load). A missing wait still shows: the snapshot
            # would run at launch, before the batch landed.
            bs.synchronize(20)
            return batch
        # 1. push_pull(stream=): the worker's push carries what its stream wrote.
        b = next_batch()
        reply[...] = np.from_dlpack(b.part(1, 0))
        s.respond(b)
        # 2. respond(stream=): the reply leaves after the stream computed it.
        b = next_batch()

        def compute():
            time.sleep(0.2)
            reply[...] = recv * 3
        st.launch_host_func(compute)
        s.respond(b, stream=st)
        # 3. wait(stream=) on the worker: the reply comes late.
        b = next_batch()
        time.sleep(0.3)
        reply[...] = recv + 100
        s.respond(b)
        # 4. the batch stream: its host function ran only once the batch was in.
        b = next_batch()
        s.respond(b)
        # 5. stream_wait_next_pull on the worker (keys 3/4: their first reply).
        b = next_batch()
        time.sleep(0.3)
        reply2[...] = -1
        with pytest.raises(ValueError, match="cpu_mock"):
            s.respond(b, stream=1234)  # a cudaStream_t on a cpu_mock server: nothing sent
        s.respond(b)
        bs.synchronize(20)
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            x = np.zeros((rows, cols), np.float32)
            y = np.zeros((rows, cols), np.float32)
            y2 = np.zeros((rows, cols), np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            w.register_push(3, x)
            w.register_pull(4, 0, y2)
            st = w.create_stream()
            assert st.cuda_stream is None  # not a CUDA stream
            with pytest.raises(ValueError, match="cpu_mock"):
                w.push_pull([1], [(2, 0)], stream=0x7f00)
            with pytest.raises(ValueError, match="stream must be None"):
                w.push_pull([1], [(2, 0)], stream="default")
            with pytest.raises(stepmesh.NotFound, match="pull key 9"):
                w.stream_wait_next_pull(9, 0, st)
            w.barrier()

            def produce():
                time.sleep(0.2)
                x[...] = 7
            st.launch_host_func(produce)
            w.wait(w.push_pull([1], [(2, 0)], stream=st), 20)
            np.testing.assert_array_equal(y, 7)  # sent after produce() ran

            x[...] = 2
            plan = w.prepare([1], [(2, 0)])
            plan.run(20)
            np.testing.assert_array_equal(y, 6)  # replied after compute() ran

            req = plan.post()
            w.wait(req, stream=st)  # returns at once; the stream waits for the reply
            st.launch_host_func(lambda: seen.setdefault("reply", y.copy()))
            st.synchronize(20)
            w.wait(req, 20)  # the host wait releases the handle
            np.testing.assert_array_equal(seen["reply"], 102)

            time.sleep(0.3)  # the server's batch stream is already waiting
            x[...] = 5
            plan.run(20)

            w.stream_wait_next_pull(4, 0, st)  # the first reply under (4, 0)
            st.launch_host_func(lambda: seen.setdefault("pull", y2.copy()))
            # Not stream=st: a ready event behind the wait would never complete.
            w.wait(w.push_pull([3], [(4, 0)]), 20)
            st.synchronize(20)
            np.testing.assert_array_equal(seen["pull"], -1)
            w.barrier()
    assert len(snaps) == 5
    for got, want in zip(snaps, [7, 2, 2, 5, 5]):
        np.testing.assert_array_equal(got, want)


def test_metrics_text_and_chrome_trace_export(tmp_path):
    """Stats() and the trace recorder from Python: the Prometheus text counts
    the bytes sent on both ends, both ends' Chrome trace JSON parses and names
    the same five requests, and a node that records nothing says which
    variable to set."""
    n, rows = 5, 64
    got = {}

    def server(s):
        recv = np.zeros(rows, np.float32)
        reply = np.zeros(rows, np.float32)
        s.register_recv(1, recv)
        s.register_reply(2, reply)
        s.barrier()
        for _ in range(n):
            s.respond(s.get_batch(timeout=20))
        s.barrier()
        got["metrics"] = s.metrics_text()
        got["trace"] = json.loads(s.chrome_trace_json())

    def total(text, name):
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(name + "{")]
        assert values, name
        return sum(values)

    def request_ids(trace, span):
        return {e["args"]["request"] for e in trace["traceEvents"]
                if e["ph"] == "X" and e["name"].startswith(span)}

    with Mesh(server, trace_events=64) as mesh:
        with stepmesh.Worker(opts(mesh.addr, trace_events=64)) as w:
            x = np.ones(rows, np.float32)
            y = np.zeros(rows, np.float32)
            w.register_push(1, x)
            w.register_pull(2, 0, y)
            w.barrier()
            for _ in range(n):
                w.wait(w.push_pull([1], [(2, 0)]), 20)
            w.barrier()
            text = w.metrics_text()
            path = tmp_path / "worker0.json"
            w.write_chrome_trace(str(path))
            worker_trace = json.loads(path.read_text())
    assert total(text, "stepmesh_peer_sent_bytes_total") == n * rows * 4
    assert total(got["metrics"], "stepmesh_peer_received_bytes_total") == n * rows * 4
    ids = request_ids(worker_trace, "request")
    assert len(ids) == n
    assert request_ids(got["trace"], "respond") == ids
    quiet = Mesh(lambda s: s.barrier())  # trace_events left at 0
    try:
        with quiet.worker() as w:
            with pytest.raises(stepmesh.FailedPrecondition, match="STEPMESH_TRACE_EVENTS"):
                w.chrome_trace_json()
            w.barrier()
    finally:
        quiet.close()


def test_stream_wait_counter_holds_later_stream_work_until_the_counter_reaches_the_target():
    """stream_wait_counter (fserver_lib.wait_flag's device form) on a cpu_mock
    stream: later work on the stream runs only once counter >= target, both
    int64 words read when the stream gets there; bad addresses are named."""

    def server(s):
        s.barrier()

    with Mesh(server) as mesh:
        with mesh.worker() as w:
            st = w.create_stream()
            counter = np.zeros(1, np.int64)
            target = np.array([2], np.int64)
            ran = []
            w.stream_wait_counter(counter.ctypes.data, target.ctypes.data, st)
            st.launch_host_func(lambda: ran.append(int(counter[0])))
            time.sleep(0.1)
            assert ran == []
            counter[0] = 1  # below the target
            time.sleep(0.1)
            assert ran == []
            counter[0] = 2
            st.synchronize(10)
            assert ran == [2]
            with pytest.raises(ValueError, match="counter is a null address"):
                w.stream_wait_counter(0, target.ctypes.data, st)
            with pytest.raises(ValueError, match="stream is None"):
                w.stream_wait_counter(counter.ctypes.data, target.ctypes.data, None)
            w.barrier()
