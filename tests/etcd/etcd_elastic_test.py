"""Elastic membership through the etcd rendezvous (docs/elastic.md), against a
real one-member etcd that the test starts and stops itself (etcd_cluster.py).

    etcd_elastic_test.py --program NAME=PATH ... --case traffic|capacity

traffic   processes of stepmesh_elastic_node (workers check every reply byte,
          server s answers push XOR 0x40+s) meeting through etcd, start shape
          1A1F, capacity 2A2F: grow 1A1F -> 2A1F -> 2A2F with rank -1 joiners
          (the lowest free rank), shrink back by a drain of the server (SIGTERM
          while the workers push: what it holds is answered, no request lost)
          and an orderly leave of the worker; then a server is lost (SIGKILL,
          seen at its lease expiry) and a worker joins meanwhile: it is
          served by the live server alone. Epochs are store revisions: they
          only grow, and every participant numbers one change alike.
capacity  stepmesh_etcd_member processes (rendezvous only), 1A1F, capacity
          2A1F: two joiners race for the last free worker rank (exactly one
          gets it, the other RESOURCE_EXHAUSTED naming max_workers and
          STEPMESH_MAX_WORKERS) while a barrier is in progress (it passes
          without the joiner, which takes part in the next one), a server
          beyond max_servers likewise refused; a drain counts the node out at
          a new epoch while its key stays, a barrier passes without it, its
          Leave then is no loss; the rank is free again for the next joiner;
          a barrier whose counter left with its last writer's lease still
          counts for the joiner after it.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from etcd_cluster import EtcdCluster  # noqa: E402
import etcd_test  # noqa: E402
from etcd_test import Member, fail, url_of  # noqa: E402

PROGRAMS = etcd_test.PROGRAMS
STARTED = etcd_test.STARTED


class Node:
    """A stepmesh_elastic_node process; its progress in a status file."""

    def __init__(self, url, tmp, role, rank, start, capacity, name):
        self.name = name
        self.status = os.path.join(tmp, name + ".status")
        self.err = open(os.path.join(tmp, name + ".err"), "w+")
        args = [PROGRAMS["stepmesh_elastic_node"], "--role", role, "--rank", str(rank),
                "--workers", str(start[0]), "--servers", str(start[1]),
                "--max-workers", str(capacity[0]), "--max-servers", str(capacity[1]),
                "--timeout-ms", "3000", "--status", self.status]
        env = dict(os.environ, STEPMESH_RENDEZVOUS=url, STEPMESH_AUTH="off")
        self.proc = subprocess.Popen(args, stdout=self.err, stderr=self.err, env=env,
                                     start_new_session=True)
        STARTED.append(self.proc)

    def read(self):
        try:
            with open(self.status) as f:
                line = f.readline()
        except FileNotFoundError:
            return {}
        return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)

    def stderr(self):
        self.err.flush()
        self.err.seek(0)
        return self.err.read()[-1500:]

    def wait_for(self, what, pred, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.read()
            if st and pred(st):
                return st
            if self.proc.poll() is not None:
                fail("%s exited %d while waiting for %s; stderr %r"
                     % (self.name, self.proc.returncode, what, self.stderr()))
            time.sleep(0.01)
        fail("%s: no %s within %ss (status %r; stderr %r)"
             % (self.name, what, timeout, self.read(), self.stderr()))

    def count(self, key):
        return int(self.read().get(key, "0"))

    def progress(self, more=20, servers=None, timeout=10):
        """`more` iterations (batches for a server) from now, [with these servers]."""
        key = "iterations" if "iterations" in self.read() or "server" not in self.name \
            else "batches"
        now = self.count(key)
        return self.wait_for("%d more %s%s" % (more, key, " with servers " + servers
                                               if servers else ""),
                             lambda st: int(st.get(key, "0")) >= now + more and
                             (servers is None or st.get("servers") == servers), timeout)

    def term(self):
        os.kill(self.proc.pid, signal.SIGTERM)

    def exit(self, timeout=15):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            fail("%s did not exit within %ss" % (self.name, timeout))


def case_traffic():
    tmp = tempfile.mkdtemp(prefix="stepmesh_etcd_elastic_")
    try:
        with EtcdCluster(1) as cluster:
            url = url_of(cluster, "stepmesh-test-elastic")
            start, cap = (1, 1), (2, 2)
            t0 = time.monotonic()

            def spawn(role, name, rank=-1):
                return Node(url, tmp, role, rank, start, cap, name)

            s0, w0 = spawn("server", "server-a"), spawn("worker", "worker-a")
            st = w0.progress()
            print("1A1F runs: %s" % st)
            epochs = [int(st["epoch"])]

            w1 = spawn("worker", "worker-b")  # 2A1F: the lowest free worker rank, 1
            for w in (w1, w0):
                w.progress()
            st = s0.wait_for("workers 0,1", lambda s: s.get("workers") == "0,1")
            print("2A1F: server 0 serves %s" % st)
            epochs.append(int(st["epoch"]))

            s1 = spawn("server", "server-b")  # 2A2F
            for w in (w0, w1):
                st = w.progress(servers="0,1")
            s1.progress(10)
            e_grown = int(w0.read()["epoch"])
            if int(w1.read()["epoch"]) != e_grown:
                fail("the two workers number 2A2F differently: %s vs %s"
                     % (w0.read(), w1.read()))
            epochs.append(e_grown)
            print("2A2F: %s / %s" % (w0.read(), w1.read()))

            s1.term()  # drain while both workers push
            if s1.exit() != 0:
                fail("the draining server exited %d: %r" % (s1.proc.returncode, s1.stderr()))
            for w in (w0, w1):
                w.progress(servers="0")
            epochs.append(int(w0.read()["epoch"]))
            w1.term()
            if w1.exit() != 0:
                fail("the leaving worker exited %d: %r" % (w1.proc.returncode, w1.stderr()))
            st = s0.wait_for("workers 0 again", lambda s: s.get("workers") == "0")
            w0.progress()
            epochs.append(int(st["epoch"]))
            for w in (w0,):
                if w.count("lost") != 0:
                    fail("%s lost requests during orderly changes: %s" % (w.name, w.read()))
            print("shrunk back to 1A1F, epochs %s, in %.1f s" % (epochs, time.monotonic() - t0))
            if epochs != sorted(epochs) or len(set(epochs)) != len(epochs):
                fail("membership epochs did not grow with each change: %s" % epochs)

            # A server lost (no goodbye: its lease expires); a worker joins meanwhile.
            s2 = spawn("server", "server-c")
            w0.progress(servers="0,1")
            s2.proc.kill()
            s2.exit()
            t_kill = time.monotonic()
            w0.progress(5, servers="0", timeout=12)
            print("server 1's loss seen after %.1f s" % (time.monotonic() - t_kill))
            w2 = spawn("worker", "worker-c")
            st = w2.progress(servers="0")
            w0.progress()
            if st.get("lost") != "0":
                fail("the joiner lost requests: %s" % st)
            print("a worker joined while a server was lost: %s" % st)

            for n in (w0, w2):
                n.term()
            for n in (w0, w2):
                if n.exit() != 0:
                    fail("%s exited %d: %r" % (n.name, n.proc.returncode, n.stderr()))
            s0.term()
            if s0.exit() != 0:
                fail("server 0 exited %d: %r" % (s0.proc.returncode, s0.stderr()))
            deadline = time.monotonic() + 6
            while cluster.keys("/stepmesh-test-elastic"):
                if time.monotonic() > deadline:
                    fail("keys left: %s" % cluster.keys("/stepmesh-test-elastic"))
                time.sleep(0.1)
            print("traffic case done in %.1f s" % (time.monotonic() - t0))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def case_capacity():
    with EtcdCluster(1) as cluster:
        prefix = "stepmesh-test-capacity"
        url = url_of(cluster, prefix)
        t0 = time.monotonic()

        def member(role, rank=-1):
            return Member(url, role, rank, workers=1, servers=1, timeout_ms=3000,
                          extra=["--max-workers", "2", "--max-servers", "1"])

        w0, s0 = member("worker"), member("server")
        for m in (w0, s0):
            m.expect(r"^joined .* roster 2 .* running 0$", 10)
        w0.send("barrier")  # barrier 1 is in progress (server 0 not in it yet)
        deadline = time.monotonic() + 5
        while "/%s/barriers/1" % prefix not in cluster.keys("/" + prefix):
            if time.monotonic() > deadline:
                fail("worker 0 did not enter barrier 1: %s" % cluster.keys("/" + prefix))
            time.sleep(0.02)

        # Two joiners race for worker rank 1, the last one below max_workers=2.
        racers = [member("worker"), member("worker")]
        lines = [r.expect(r"^(joined|join failed)", 10) for r in racers]
        won = [i for i, line in enumerate(lines) if line.startswith("joined worker 1 ")]
        lost = [i for i, line in enumerate(lines) if line.startswith("join failed")]
        if len(won) != 1 or len(lost) != 1:
            fail("not exactly one holder of worker rank 1: %s" % lines)
        if not re.search(r"RESOURCE_EXHAUSTED.*no free worker rank: all 2 .*max_workers, "
                         r"STEPMESH_MAX_WORKERS", lines[lost[0]]):
            fail("the loser's error does not name the capacity: %s" % lines[lost[0]])
        if not re.search(r"roster 3 .* running 1$", lines[won[0]]):
            fail("the winner did not join the running mesh with its 3 members: %s"
                 % lines[won[0]])
        racers[lost[0]].wait(10)
        w1 = racers[won[0]]
        # A join during a barrier: barrier 1 passes without the joiner, which
        # takes part from the next one.
        s0.send("barrier")
        for m in (w0, s0):
            m.expect(r"^barrier ok", 5)
        for m in (w0, s0, w1):
            m.send("barrier")
        for m in (w0, s0, w1):
            m.expect(r"^barrier ok", 5)
        joined_epoch = int(re.search(r"epoch (\d+)", lines[won[0]]).group(1))
        for m in (w0, s0):
            e = int(re.search(r"epoch (\d+)", m.expect(r"^event joined worker 1 epoch", 10))
                    .group(1))
            if e > joined_epoch:
                fail("the join's epoch %d is after the joiner's roster epoch %d" % (e, joined_epoch))
        print("race: %s" % lines)

        # Beyond max_servers=1 (the start shape): refused at once, naming the option.
        extra = member("server")
        line = extra.expect(r"^join failed", 5)
        if not re.search(r"RESOURCE_EXHAUSTED.*max_servers, STEPMESH_MAX_SERVERS", line):
            fail("a server beyond the capacity: %s" % line)
        extra.wait(10)

        # A drain: counted out at a new epoch, the key kept until Leave.
        w1.send("drain")
        w1.expect(r"^drain announced$", 5)
        epochs = set()
        for m in (w0, s0):
            epochs.add(int(re.search(r"epoch (\d+)", m.expect(r"^event left worker 1 epoch",
                                                             5)).group(1)))
        if len(epochs) != 1 or min(epochs) <= joined_epoch:
            fail("the drain's epochs %s (after the join at %d)" % (epochs, joined_epoch))
        if "/%s/members/worker/00001" % prefix not in cluster.keys("/" + prefix):
            fail("the draining worker's key went before its Leave: %s"
                 % cluster.keys("/" + prefix))
        for m in (w0, s0):
            m.send("barrier")  # counted out: a barrier does not wait for it
        for m in (w0, s0):
            m.expect(r"^barrier ok", 5)
        w1.send("leave")
        w1.expect(r"^left$", 5)
        w1.wait(10)

        # Its rank is free again.
        again = member("worker")
        again.expect(r"^joined worker 1 roster 3 .* running 1$", 10)
        for m in (w0, s0):
            m.expect(r"^event joined worker 1 epoch", 10)
        # A barrier whose counter's last writer leaves: its key goes with that
        # lease, yet the next joiner still counts barriers from it.
        for m in (w0, s0):
            m.send("barrier")
        time.sleep(0.3)  # both wait in it: the joiner's entry is the last write
        again.send("barrier")
        for m in (w0, s0, again):
            m.expect(r"^barrier ok", 5)
        again.send("leave")
        again.expect(r"^left$", 5)
        again.wait(10)
        for m in (w0, s0):
            m.expect(r"^event left worker 1 epoch", 5)
        third = member("worker")
        third.expect(r"^joined worker 1 roster 3 .* running 1$", 10)
        for m in (w0, s0, third):
            m.send("barrier")
        for m in (w0, s0, third):
            m.expect(r"^barrier ok", 5)
        for m in (third, w0, s0):
            m.send("leave")
        for m in (third, w0, s0):
            m.expect(r"^left$", 10)
            m.wait(10)
        for m in (w0, s0):
            for line in m.seen:
                if " lost " in line:
                    fail("%s saw an orderly change as a loss: %s" % (m.name, line))
        if cluster.keys("/" + prefix):
            fail("keys left: %s" % cluster.keys("/" + prefix))
        print("capacity case done in %.1f s" % (time.monotonic() - t0))


if __name__ == "__main__":
    etcd_test.main(globals(), "etcd_elastic")
