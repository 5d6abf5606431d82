"""How long a mesh takes to meet, per rendezvous implementation, in one run:
W+S stepmesh_etcd_member processes (tests/etcd) started at once, through our
scheduler and through a 3-member etcd cluster on 127.0.0.1.

    benchmarks/rendezvous_time.py --build build [--shapes 2x2,16x8] [--reps 3]

Per shape and implementation, the medians over the repetitions of:
  formed   wall time from the first process spawned until every one printed
           its complete roster (includes process start-up, the same for both)
  join     the median participant's own Join() (connect, rank, roster)
  barrier  the slowest participant's first barrier after the mesh formed
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "etcd"))
from etcd_cluster import EtcdCluster, free_ports  # noqa: E402


def wait_listening(port, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("scheduler not listening on %d" % port)


def one_mesh(member, url, workers, servers):
    env = dict(os.environ, STEPMESH_RENDEZVOUS=url, STEPMESH_AUTH="off")
    procs = []
    t0 = time.monotonic()
    for role, n in (("server", servers), ("worker", workers)):
        for r in range(n):
            procs.append(subprocess.Popen(
                [member, "--role", role, "--rank", str(r if role == "server" else -1),
                 "--workers", str(workers), "--servers", str(servers), "--timeout-ms", "30000"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env=env))
    try:
        joins = []
        for p in procs:
            line = p.stdout.readline()
            m = re.match(r"joined .* roster (\d+) .* ms (\d+)", line)
            if not m or int(m.group(1)) != workers + servers:
                raise RuntimeError("bad join: %r" % line)
            joins.append(int(m.group(2)))
        formed = (time.monotonic() - t0) * 1000
        for p in procs:
            p.stdin.write("barrier\n")
            p.stdin.flush()
        barrier = 0
        for p in procs:
            line = p.stdout.readline()
            m = re.match(r"barrier ok (\d+)", line)
            if not m:
                raise RuntimeError("bad barrier: %r" % line)
            barrier = max(barrier, int(m.group(1)))
        for p in procs:
            p.stdin.write("leave\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=30)
        return formed, statistics.median(joins), barrier
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--shapes", default="2x2,16x8")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    member = os.path.join(a.build, "tests", "etcd", "stepmesh_etcd_member")
    scheduler = os.path.join(a.build, "src", "stepmesh_scheduler")
    rows = []
    with EtcdCluster(3) as cluster:
        for shape in a.shapes.split(","):
            w, s = (int(x) for x in shape.split("x"))
            results = {"scheduler": [], "etcd": []}
            for rep in range(a.reps):
                # Interleaved, so both see the same load.
                port = free_ports(1)[0]
                sched = subprocess.Popen([scheduler, "--address", "127.0.0.1:%d" % port,
                                          "--workers", str(w), "--servers", str(s)],
                                         env=dict(os.environ, STEPMESH_AUTH="off"),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    wait_listening(port)
                    results["scheduler"].append(
                        one_mesh(member, "scheduler://127.0.0.1:%d" % port, w, s))
                finally:
                    sched.kill()
                    sched.wait()
                url = "etcd://%s/bench-%d-%d-%d" % (",".join(cluster.endpoints), w, s, rep)
                results["etcd"].append(one_mesh(member, url, w, s))
            for impl, runs in results.items():
                med = [statistics.median(x[i] for x in runs) for i in range(3)]
                rows.append((shape.replace("x", "A") + "F", impl, *med))
    print("| shape | rendezvous | formed (ms) | join, median participant (ms) | first barrier (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %.0f | %.0f | %.0f |" % r)


if __name__ == "__main__":
    main()
