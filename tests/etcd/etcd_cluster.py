"""A real etcd cluster on 127.0.0.1 for tests: free ports, temporary data
directories, a bounded start, and always stopped and removed (the PIDs it
started, nothing else). Needs Debian's etcd-server and etcd-client.

    with EtcdCluster(3) as cluster:
        cluster.endpoints        # ["127.0.0.1:P", ...]
        cluster.leader()         # index of the current leader
        cluster.kill(i)          # SIGKILL member i
        cluster.etcdctl("get", "--prefix", "/")
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


def free_ports(n):
    """n distinct free ports (bound then released: a tiny race with others)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class EtcdCluster:
    def __init__(self, members=3, start_timeout=30.0):
        self.members = members
        self.start_timeout = start_timeout
        self.procs = []
        self.dir = None
        self.endpoints = []
        self.user = None
        self.password = None

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        self.dir = tempfile.mkdtemp(prefix="stepmesh-etcd-")
        ports = free_ports(2 * self.members)
        client, peer = ports[: self.members], ports[self.members :]
        names = ["m%d" % i for i in range(self.members)]
        initial = ",".join("%s=http://127.0.0.1:%d" % (n, p) for n, p in zip(names, peer))
        self.endpoints = ["127.0.0.1:%d" % p for p in client]
        self.logs = []
        for i, name in enumerate(names):
            log = open(os.path.join(self.dir, name + ".log"), "wb")
            self.logs.append(log)
            args = [
                ETCD, "--name", name, "--data-dir", os.path.join(self.dir, name),
                "--listen-client-urls", "http://127.0.0.1:%d" % client[i],
                "--advertise-client-urls", "http://127.0.0.1:%d" % client[i],
                "--listen-peer-urls", "http://127.0.0.1:%d" % peer[i],
                "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer[i],
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", os.path.basename(self.dir),
                # Fast elections: a killed leader is replaced within about a second.
                "--heartbeat-interval", "50", "--election-timeout", "500",
            ]
            self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        deadline = time.monotonic() + self.start_timeout
        for i in range(self.members):
            while not self.healthy(i):
                if self.procs[i].poll() is not None:
                    raise RuntimeError("etcd member %d exited: %s" % (i, self.log(i)[-2000:]))
                if time.monotonic() > deadline:
                    raise RuntimeError("etcd member %d not healthy within %ss: %s"
                                       % (i, self.start_timeout, self.log(i)[-2000:]))
                time.sleep(0.1)

    def log(self, i):
        with open(os.path.join(self.dir, "m%d.log" % i), "rb") as f:
            return f.read().decode(errors="replace")

    def healthy(self, i):
        try:
            with urllib.request.urlopen("http://%s/health" % self.endpoints[i], timeout=1) as r:
                return json.load(r).get("health") == "true"
        except Exception:
            return False

    def alive(self):
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def etcdctl(self, *args, endpoints=None, check=True):
        cmd = [ETCDCTL, "--endpoints", ",".join(endpoints or [self.endpoints[i] for i in self.alive()]),
               "--dial-timeout", "2s", "--command-timeout", "5s"]
        if self.user:
            cmd += ["--user", "%s:%s" % (self.user, self.password)]
        r = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=20,
                           env=dict(os.environ, ETCDCTL_API="3"))
        if check and r.returncode != 0:
            raise RuntimeError("etcdctl %s: %s" % (" ".join(args), r.stderr))
        return r.stdout

    def leader(self, timeout=10.0):
        """Index of the member that leads now (after an election settles)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in self.alive():
                try:
                    out = self.etcdctl("endpoint", "status", "-w", "json",
                                       endpoints=[self.endpoints[i]], check=True)
                    st = json.loads(out)[0]["Status"]
                    if st["leader"] == st["header"]["member_id"]:
                        return i
                except Exception:
                    pass
            time.sleep(0.1)
        raise RuntimeError("no etcd leader within %ss" % timeout)

    def kill(self, i):
        p = self.procs[i]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)

    def enable_auth(self, user, password):
        self.etcdctl("user", "add", "root:%s" % password)
        if user != "root":
            self.etcdctl("user", "add", "%s:%s" % (user, password))
            self.etcdctl("user", "grant-role", user, "root")
        self.etcdctl("auth", "enable")
        self.user, self.password = "root", password

    def grant_lease(self, lease_id, ttl):
        """Grants lease `lease_id` (chosen, not etcd's random pick) through the JSON gateway."""
        body = json.dumps({"TTL": ttl, "ID": lease_id}).encode()
        req = urllib.request.Request("http://%s/v3/lease/grant" % self.endpoints[self.alive()[0]],
                                     data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            granted = json.load(r)
        if int(granted.get("ID", 0)) != lease_id:
            raise RuntimeError("lease grant of %x answered %s" % (lease_id, granted))
        return "%016x" % lease_id

    def keys(self, prefix):
        out = self.etcdctl("get", "--prefix", "--keys-only", prefix)
        return [k for k in out.splitlines() if k.strip()]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        for log in getattr(self, "logs", []):
            log.close()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
