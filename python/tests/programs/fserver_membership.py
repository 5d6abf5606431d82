"""StepMesh-shaped fserver program with the membership calls of
stepmesh.fserver (docs/elastic.md): 2 workers, 1 server. Both workers run
FSERVER_TEST_ITERS push_pulls (the server answers push + 1, every value
checked); then worker 1 leaves alone (f.leave: a drain, no barrier) while
worker 0 and the server go on; both hear the change (epoch 1, workers [0])
through f.wait_membership_change, and worker 0's next FSERVER_TEST_ITERS
requests are served in batches of worker 0 alone. Prints one line per
membership it saw: "membership <role> <rank> epoch E workers W servers S"."""

import torch

import stepmesh
import stepmesh.fserver as f

from fserver_program import mesh_env, show

ITERS, role, rank = mesh_env()


def exchange(i):
    push = torch.full((1, 256), float(rank * 1000 + i))
    pull = torch.zeros(1, 256)
    f.wait(f.push_pull([push], [7], [pull], [7]))
    assert torch.equal(pull, push + 1), f"worker {rank} iteration {i}: wrong reply"


f.init()
m = f.membership()
show(m)
assert (m.epoch, m.workers, m.servers) == (0, [0, 1], [0]), m
if role == "worker":
    for i in range(ITERS):
        exchange(i)
    if rank == 1:
        f.leave(10000)
        try:
            f.membership()
            raise AssertionError("membership() after leave() did not raise")
        except RuntimeError:
            pass
        print("worker 1 left", flush=True)
    else:
        changed = f.wait_membership_change(m.epoch, 10000)
        show(changed)
        assert changed.workers == [0] and changed.servers == [0], changed
        for i in range(ITERS, 2 * ITERS):
            exchange(i)
        try:
            f.wait_membership_change(changed.epoch, 200)
            raise AssertionError("a membership change nobody made")
        except stepmesh.DeadlineExceeded:
            pass
        print("worker test done", flush=True)
        f.stop()
elif role == "server":
    sizes = []
    while len(sizes) < 2 * ITERS:
        batches = f.get_batch()
        sizes.append(len(batches))
        for handler, tensors, keys in batches:
            assert keys == [7], keys
            f.respond([tensors[0] + 1], handler)
    changed = f.wait_membership_change(0, 10000)
    show(changed)
    assert changed.workers == [0], changed
    # Every worker's n-th request is the n-th batch: ITERS of both, then worker 0's alone.
    assert sizes == [2] * ITERS + [1] * ITERS, sizes
    print("server test done", flush=True)
    f.stop()
