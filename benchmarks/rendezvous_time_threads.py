"""How long a mesh takes to meet through our scheduler and through a framework
store (a real torch.distributed.TCPStore), in one run, participants as threads
of one Python process (docs/benchmarks.md, issue 33):

    /usr/bin/python3 benchmarks/rendezvous_time_threads.py [--shapes 2x2,16x8] [--reps 5]

Run from a build (PYTHONPATH=build/python). Per shape and implementation, the
medians over the repetitions (the implementations interleaved) of:
  formed   wall time from starting every participant's constructor until the
           last one returned (join, roster, data-plane connections)
  barrier  wall time of the first barrier, entered by all at once, until the
           last one returned
The process-based runs of the C++ member program (scheduler and etcd) are
benchmarks/rendezvous_time.py; these threads share one interpreter (the GIL
is released while a constructor or barrier waits).
"""

import argparse
import datetime
import statistics
import threading
import time

import stepmesh
from torch.distributed import TCPStore

NO_SCHEDULER = "127.0.0.1:1"  # store mode: nothing listens here


def one_mesh(kind, workers, servers):
    common = dict(num_workers=workers, num_servers=servers, transport="tcp", timeout=30.0,
                  auth_token="rendezvous-benchmark",
                  heartbeat_interval=0.5)
    sched = master = None
    if kind == "scheduler":
        sched = stepmesh.Scheduler(scheduler="127.0.0.1:0", **common)
        common["scheduler"] = sched.address
    else:
        master = TCPStore("127.0.0.1", 0, is_master=True,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        common["scheduler"] = NO_SCHEDULER
    nodes, errors = [], []
    formed_at, barrier_at = [], []
    go = threading.Barrier(workers + servers + 1)

    def run(role, rank):
        try:
            extra = {}
            if master is not None:
                extra["store"] = TCPStore("127.0.0.1", master.port, is_master=False,
                                          timeout=datetime.timedelta(seconds=30))
            go.wait()
            cls = stepmesh.Worker if role == "worker" else stepmesh.Server
            node = cls(rank=rank, **common, **extra)
            formed_at.append(time.monotonic())
            nodes.append(node)
            go.wait()  # all formed: the barrier starts together
            node.barrier()
            barrier_at.append(time.monotonic())
        except BaseException as e:  # noqa: B902
            errors.append(e)
            go.abort()

    threads = [threading.Thread(target=run, args=("server", s)) for s in range(servers)]
    threads += [threading.Thread(target=run, args=("worker", w)) for w in range(workers)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.monotonic()
    go.wait()
    t1 = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    formed = (max(formed_at) - t0) * 1000
    barrier = (max(barrier_at) - t1) * 1000
    for n in nodes:
        n.close()
    if sched is not None:
        sched.close()
    return formed, barrier


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2x2,16x8")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print("%-6s %-10s %10s %10s   (medians of %d, ms)" % ("shape", "rendezvous", "formed",
                                                        "barrier", args.reps))
    for shape in args.shapes.split(","):
        w, s = (int(x) for x in shape.split("x"))
        results = {"scheduler": [], "store": []}
        for rep in range(args.reps):
            order = ("scheduler", "store") if rep % 2 == 0 else ("store", "scheduler")
            for kind in order:
                results[kind].append(one_mesh(kind, w, s))
        for kind, runs in results.items():
            print("%dA%dF  %-10s %10.1f %10.1f" % (
                w, s, kind, statistics.median(r[0] for r in runs),
                statistics.median(r[1] for r in runs)))


if __name__ == "__main__":
    main()
