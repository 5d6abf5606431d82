"""The etcd rendezvous against a real 3-member etcd cluster (etcd_cluster.py).

    etcd_test.py --program NAME=PATH ... --case membership|leader_kill_mesh|bad_input

membership        2A2F rendezvous participants (stepmesh_etcd_member): ranks
                  by transaction, barriers, the etcd leader killed and a barrier
                  after it, a participant frozen (SIGSTOP) so only its lease
                  expiry can tell, its peers told, a barrier without it, orderly
                  leaves seen as such, and no key left behind.
leader_kill_mesh  a 2A2F mesh of stepmesh_test_node processes meeting through
                  etcd; the leader is killed while they exchange; every
                  process finishes its exchange; no key left behind.
bad_input         unreachable etcd, another mesh's shape under the prefix, a
                  stale lease from a crashed run holding a rank, wrong
                  etcd credentials: each a clear error naming the endpoint or
                  key, within the timeout.
"""

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from etcd_cluster import EtcdCluster, free_ports  # noqa: E402

PROGRAMS = {}
STARTED = []  # every process this test started, killed at exit if still there


def fail(message):
    raise AssertionError(message)


class Member:
    """A stepmesh_etcd_member process: lines of stdout in a queue, commands on stdin."""

    def __init__(self, url, role, rank=-1, workers=2, servers=2, timeout_ms=4000, env=None,
                 extra=None):
        args = [PROGRAMS["stepmesh_etcd_member"], "--role", role, "--rank", str(rank),
                "--workers", str(workers), "--servers", str(servers),
                "--timeout-ms", str(timeout_ms)] + list(extra or [])
        e = dict(os.environ, STEPMESH_RENDEZVOUS=url, STEPMESH_AUTH="off")
        e.update(env or {})
        self.name = "%s %s" % (role, rank)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=e,
                                     start_new_session=True)
        STARTED.append(self.proc)
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()
        self.stderr = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, pattern, timeout):
        """The first line (seen or new) matching `pattern`, else fail."""
        for line in self.seen:
            if re.search(pattern, line):
                self.seen.remove(line)
                return line
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self.lines.put(None)
                break
            if re.search(pattern, line):
                return line
            self.seen.append(line)
        fail("%s: no line matching %r within %ss; saw %r; stderr %r"
             % (self.name, pattern, timeout, self.seen, "".join(self.stderr)[-1500:]))

    def send(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            fail("%s did not exit within %ss" % (self.name, timeout))


def kill_all():
    for p in STARTED:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def url_of(cluster, prefix, cred=""):
    return "etcd://%s%s/%s" % (cred, ",".join(cluster.endpoints), prefix)


def case_membership():
    with EtcdCluster(3) as cluster:
        prefix = "stepmesh-test-membership"
        url = url_of(cluster, prefix)
        timeout_ms = 4000
        t0 = time.monotonic()
        members = [Member(url, "worker", -1, timeout_ms=timeout_ms),
                   Member(url, "worker", -1, timeout_ms=timeout_ms),
                   Member(url, "server", 0, timeout_ms=timeout_ms),
                   Member(url, "server", 1, timeout_ms=timeout_ms)]
        joined = [m.expect(r"^joined .* roster 4 ", 10) for m in members]
        print("all joined in %.0f ms: %s" % ((time.monotonic() - t0) * 1000, joined))
        worker_ranks = sorted(int(j.split()[2]) for j in joined[:2])
        if worker_ranks != [0, 1]:
            fail("workers were not given ranks 0 and 1 by the transactions: %s" % joined)
        for m in members:
            m.send("barrier")
        for m in members:
            m.expect(r"^barrier ok", 10)

        leader = cluster.leader()
        cluster.kill(leader)
        print("killed etcd leader m%d" % leader)
        for m in members:
            m.send("barrier")
        for m in members:
            print("%s after the leader kill: %s" % (m.name, m.expect(r"^barrier ok", 15)))

        # Frozen, not killed: its sockets stay open, only the lease can tell.
        frozen = members[3]
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        rest = members[:3]
        for m in rest:
            line = m.expect(r"^event lost server 1 epoch \d+", timeout_ms / 1000 + 6)
            print("%s told: %s" % (m.name, line))
        noticed = time.monotonic() - t_stop
        print("server 1's loss noticed after %.1f s (TTL %d s)" % (noticed, timeout_ms // 1000))
        if noticed > timeout_ms / 1000 + 5:
            fail("the loss took %.1f s, longer than the lease TTL allows" % noticed)
        for m in rest:
            m.send("barrier")
        for m in rest:
            m.expect(r"^barrier ok", 10)
        os.kill(frozen.proc.pid, signal.SIGKILL)
        frozen.wait(10)

        # Orderly: the others see "left", and nothing stays behind.
        members[2].send("leave")
        members[2].expect(r"^left$", 10)
        members[2].wait(10)
        for m in members[:2]:
            m.expect(r"^event left server 0 epoch", 10)
        for m in members[:2]:
            m.send("leave")
        for m in members[:2]:
            m.expect(r"^left$", 10)
            if m.wait(10) != 0:
                fail("%s exited %s" % (m.name, m.proc.returncode))
        for m in members[:2]:
            for line in m.seen:
                if "lost worker" in line or "lost server 0" in line:
                    fail("%s saw an orderly leave as a loss: %s" % (m.name, line))
        deadline = time.monotonic() + timeout_ms / 1000 + 3
        while True:
            left = cluster.keys("/" + prefix)
            if not left:
                break
            if time.monotonic() > deadline:
                fail("keys left in etcd after the mesh left: %s" % left)
            time.sleep(0.2)  # the frozen member's lease may still be expiring
        print("no keys left under /%s" % prefix)


def case_leader_kill_mesh():
    with EtcdCluster(3) as cluster:
        prefix = "stepmesh-test-mesh"
        env = dict(os.environ, STEPMESH_RENDEZVOUS=url_of(cluster, prefix), STEPMESH_AUTH="off")
        procs = []
        for role, rank in (("server", 0), ("server", 1), ("worker", 0), ("worker", 1)):
            p = subprocess.Popen([PROGRAMS["stepmesh_test_node"], "--role", role, "--rank",
                                  str(rank), "--workers", "2", "--servers", "2",
                                  "--iterations", "10000", "--push-bytes", "4096", "--pull-bytes", "4096",
                                  "--timeout-ms", "8000"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=env, start_new_session=True)
            STARTED.append(p)
            procs.append((role, rank, p))
        deadline = time.monotonic() + 15
        while len([k for k in cluster.keys("/" + prefix) if "/members/" in k]) < 4:
            if time.monotonic() > deadline:
                fail("the mesh did not join through etcd: %s" % cluster.keys("/" + prefix))
            time.sleep(0.05)
        time.sleep(0.3)
        running = [p.poll() is None for _, _, p in procs]
        leader = cluster.leader()
        cluster.kill(leader)
        print("killed etcd leader m%d while %d of 4 participants ran" % (leader, sum(running)))
        if not all(running):
            fail("the mesh finished before the leader kill: raise --iterations")
        t_kill = time.monotonic()
        for role, rank, p in procs:
            try:
                out, _ = p.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                fail("%s %d did not finish" % (role, rank))
            print("%s %d exit %d: %s" % (role, rank, p.returncode, out.strip()[-300:]))
            if p.returncode != 0:
                fail("%s %d failed after the etcd leader was killed" % (role, rank))
        print("the mesh ran %.1f s past the leader kill" % (time.monotonic() - t_kill))
        left = cluster.keys("/" + prefix)
        if left:
            fail("keys left in etcd after an orderly shutdown: %s" % left)
        print("no keys left under /%s" % prefix)


def timed_failure(member, pattern, within):
    t = time.monotonic()
    line = member.expect(r"^join failed: ", within + 5)
    took = time.monotonic() - t
    if not re.search(pattern, line):
        fail("%s: error %r does not match %r" % (member.name, line, pattern))
    if took > within + 3:
        fail("%s: the error took %.1f s (timeout %.1f s)" % (member.name, took, within))
    member.wait(10)
    print("%.1f s: %s" % (took, line))


def case_bad_input():
    port = free_ports(1)[0]
    timed_failure(Member("etcd://127.0.0.1:%d/x" % port, "server", 0, timeout_ms=2000),
                  r"UNAVAILABLE.*127\.0\.0\.1:%d" % port, 2)
    with EtcdCluster(3) as cluster:
        # Another mesh's shape under the prefix.
        url = url_of(cluster, "shape-test")
        holder = Member(url, "server", 0, workers=1, servers=1, timeout_ms=4000)
        deadline = time.monotonic() + 10
        while "/shape-test/shape" not in cluster.keys("/shape-test"):
            if time.monotonic() > deadline:
                fail("the first participant did not write its shape")
            time.sleep(0.05)
        timed_failure(Member(url, "server", 0, workers=2, servers=2, timeout_ms=2000),
                      r"FAILED_PRECONDITION.*/shape-test/shape.*another mesh's shape", 2)
        # The holder's own roster never completes: that error names what is missing.
        timed_failure(holder, r"DEADLINE_EXCEEDED.*roster under etcd key "
                      r"/shape-test/members/.*1 of 2 joined.*missing: worker 0", 4)
        if cluster.keys("/shape-test"):
            fail("a failed join left keys: %s" % cluster.keys("/shape-test"))

        # A crashed run's lease still holds server 0.
        # Its ID begins with a zero nibble: the error must print it as etcdctl does (16 hex
        # digits), or the "etcdctl lease revoke" it suggests names another lease.
        lease = cluster.grant_lease(0x0e19a233aaf6b405, 600)
        key = "/stale-test/members/server/00000"
        cluster.etcdctl("put", "--lease=" + lease, key,
                        '{"endpoint":"tcp://127.0.0.1:1","workers":1,"servers":1,"mesh":"",'
                        '"proof":"","left":false}')
        timed_failure(Member(url_of(cluster, "stale-test"), "server", 0, workers=1, servers=1,
                             timeout_ms=2000),
                      r"ALREADY_EXISTS.*%s.*lease %s.*crashed run.*expires in \d+ s" % (key, lease), 2)
        cluster.etcdctl("lease", "revoke", lease)
        if cluster.keys("/stale-test"):
            fail("keys left under /stale-test: %s" % cluster.keys("/stale-test"))

        # etcd authentication: wrong password refused, the right one works.
        cluster.enable_auth("root", "s3cret")
        timed_failure(Member(url_of(cluster, "auth-test", "root:wrong@"), "server", 0,
                             workers=1, servers=1, timeout_ms=2000),
                      r"PERMISSION_DENIED.*etcd user 'root'.*authentication failed", 2)
        good = url_of(cluster, "auth-test", "root:s3cret@")
        pair = [Member(good, "worker", 0, workers=1, servers=1, timeout_ms=4000),
                Member(good, "server", 0, workers=1, servers=1, timeout_ms=4000)]
        for m in pair:
            m.expect(r"^joined .* roster 2 ", 10)
        for m in pair:
            m.send("leave")
        for m in pair:
            m.expect(r"^left$", 10)
            m.wait(10)
        if cluster.keys("/auth-test"):
            fail("keys left under /auth-test: %s" % cluster.keys("/auth-test"))


def main(cases=None, name="etcd"):
    """--program NAME=PATH ... --case C: runs `case_C` of `cases` (this module's
    globals by default; etcd_elastic_test.py passes its own), then kills what
    it started."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--program", action="append", default=[])
    parser.add_argument("--case", required=True)
    args = parser.parse_args()
    for p in args.program:
        program, path = p.split("=", 1)
        PROGRAMS[program] = path
    try:
        (cases or globals())["case_" + args.case]()
    finally:
        kill_all()
    print("PASS %s_%s" % (name, args.case))


if __name__ == "__main__":
    main()
