"""What the fserver test programs (programs/fserver_*.py) take from the
environment their test gives them, and the membership line they print."""

import os


def mesh_env():
    """(iterations, DMLC_ROLE, DMLC_NODE_RANK) of this participant."""
    return (int(os.environ.get("FSERVER_TEST_ITERS", "20")), os.environ.get("DMLC_ROLE"),
            int(os.environ.get("DMLC_NODE_RANK", "0")))


def show(m):
    """Prints "membership <role> <rank> epoch E workers W servers S"."""
    _, role, rank = mesh_env()
    print(f"membership {role} {rank} epoch {m.epoch} workers {m.workers} servers {m.servers}",
          flush=True)
