"""Elastic membership from Python (docs/elastic.md): a worker joins a running
mesh, everyone hears the epoch, a server drains with a request in flight and
leaves, and every reply byte is checked."""

import threading

import numpy as np
import pytest

import stepmesh


def opts(sched, role, rank=-1):
    return stepmesh.MeshOptions(scheduler=sched.address, transport="tcp", role=role, rank=rank,
                                num_workers=1, num_servers=2, max_workers=2, max_servers=2,
                                timeout=5.0)


def test_join_epoch_and_server_drain_with_a_request_in_flight():
    sched = stepmesh.Scheduler(num_workers=1, num_servers=2, max_workers=2, max_servers=2,
                               timeout=5.0)
    made = {}

    def make(name, cls, o):
        made[name] = cls(o)

    threads = [threading.Thread(target=make, args=("w0", stepmesh.Worker, opts(sched, "worker", 0))),
               threading.Thread(target=make, args=("s0", stepmesh.Server, opts(sched, "server", 0))),
               threading.Thread(target=make, args=("s1", stepmesh.Server, opts(sched, "server", 1)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    w0, s0, s1 = made["w0"], made["s0"], made["s1"]
    assert w0.membership.epoch == 0
    assert w0.membership.servers == [0, 1]

    # A second worker joins the running mesh: rank 1, epoch 1 everywhere.
    w1 = stepmesh.Worker(opts(sched, "worker"))
    assert w1.rank == 1
    m = s0.wait_membership_change(0, timeout=5.0)
    assert (m.epoch, m.workers) == (1, [0, 1])
    with pytest.raises(stepmesh.PermissionDenied, match="max_workers"):
        stepmesh.Worker(opts(sched, "worker"))

    n = 64
    push = np.arange(n, dtype=np.uint8)
    pulls = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
    w0.register_push(1, push)
    for s in range(2):
        w0.register_pull(2, s, pulls[s])
    servers = [s0, s1]
    recvs = [np.zeros((2, n), dtype=np.uint8) for _ in range(2)]
    replies = [np.zeros((2, n), dtype=np.uint8) for _ in range(2)]
    for s in range(2):
        servers[s].register_recv(1, recvs[s])
        servers[s].register_reply(2, replies[s])

    req = w0.push_pull([1], [(2, 0), (2, 1)])
    batches = [servers[s].get_batch(timeout=5.0) for s in range(2)]
    replies[0][0] = recvs[0][0] ^ 0x11
    s0.respond(batches[0])
    # Server 1 drains while it holds the request.
    left = {}
    leaver = threading.Thread(target=lambda: left.update(ok=s1.leave(timeout=5.0) is None))
    leaver.start()
    m = w0.wait_membership_change(1, timeout=5.0)
    assert (m.epoch, m.servers) == (2, [0])
    assert not w0.test(req)
    replies[1][0] = recvs[1][0] ^ 0x22
    s1.respond(batches[1])
    w0.wait(req, timeout=5.0)
    assert np.array_equal(pulls[0], push ^ 0x11)
    assert np.array_equal(pulls[1], push ^ 0x22)
    leaver.join(10)
    assert left.get("ok")
    assert s1.closed
    assert "stepmesh_membership_epoch" in w0.metrics_text()
    for p in (w1, w0, s0):
        p.close()
