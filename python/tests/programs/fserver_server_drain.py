"""StepMesh-shaped fserver program, a server's drain through stepmesh.fserver
(docs/elastic.md): 1 worker, 2 servers. The worker runs FSERVER_TEST_ITERS
push_pulls pulling from both servers (server s answers push + 1 + s, every
value checked) and posts one more; server 1, holding that one unanswered,
leaves alone: f.leave() on a thread (counted out at once, a new epoch) while
its main thread answers it and keeps serving get_batch/respond until
get_batch raises stepmesh.Unavailable (drained). The worker hears servers [0]
(f.wait_membership_change) and pulls from server 0 alone from then on."""

import threading
import time

import torch

import stepmesh
import stepmesh.fserver as f

from fserver_program import mesh_env, show

ITERS, role, rank = mesh_env()


def post(i, servers):
    push = torch.full((1, 256), float(i))
    pulls = [torch.zeros(1, 256) for _ in servers]
    return f.push_pull([push], [7], pulls, [7] * len(servers)), push, pulls


def check(i, push, pulls):
    for s, pull in enumerate(pulls):
        assert torch.equal(pull, push + 1 + s), f"iteration {i}: wrong reply from server {s}"


f.init()
m = f.membership()
show(m)
assert (m.epoch, m.workers, m.servers) == (0, [0], [0, 1]), m
if role == "worker":
    for i in range(ITERS):
        h, push, pulls = post(i, [0, 1])
        f.wait(h)
        check(i, push, pulls)
    # One more to both; server 1 drains with it (it answers it before it goes).
    h, push, pulls = post(ITERS, [0, 1])
    changed = f.wait_membership_change(m.epoch, 10000)
    f.wait(h)
    check(ITERS, push, pulls)
    show(changed)
    assert changed.servers == [0], changed
    for i in range(ITERS + 1, 2 * ITERS + 1):
        h, push, pulls = post(i, [0])
        f.wait(h)
        check(i, push, pulls)
    print("worker test done", flush=True)
    f.stop()
elif role == "server":
    served = 0
    leaver = None
    errors = []

    def leave():
        try:
            f.leave(10000)
        except BaseException as e:  # noqa: B902
            errors.append(e)

    while True:
        try:
            batches = f.get_batch()
        except stepmesh.Unavailable:
            assert rank == 1 and leaver is not None, "drained without a leave"
            break
        if rank == 1 and served == ITERS:
            # The worker's last request to it is in hand, unanswered: the drain
            # begins (the worker hears it) before the answer goes out.
            leaver = threading.Thread(target=leave)
            leaver.start()
            time.sleep(0.3)
        for handler, tensors, keys in batches:
            f.respond([tensors[0] + 1 + rank], handler)
        served += 1
        if rank == 0 and served == 2 * ITERS + 1:
            break
    if rank == 1:
        leaver.join(15)
        assert not leaver.is_alive() and not errors, errors
        # It answered the request it held when it began to drain, and no other.
        assert served == ITERS + 1, served
        print("server 1 drained and left", flush=True)
    else:
        show(f.membership())
        print("server test done", flush=True)
        f.stop()
