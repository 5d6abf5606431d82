"""The stepmesh wire formats written independently of the C++ code, for the
hostile-peer tests: control messages (src/core/control_message.h), the
data-connection handshake (src/core/handshake.h), frame headers
(src/core/frame.h) and the shared-secret proofs (src/core/auth.h). Python
standard library only. Also the process plumbing the tests share: a mesh of
real processes on 127.0.0.1, and what /proc says about them."""

import hashlib
import hmac
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

# --- checksums ---------------------------------------------------------------

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283  # the standard check value

# --- node ids ------------------------------------------------------------------

ROLE_WORKER, ROLE_SERVER = 1, 2


def worker_id(rank):
    return (ROLE_WORKER << 24) | rank


def server_id(rank):
    return (ROLE_SERVER << 24) | rank

# --- control messages ------------------------------------------------------------

CONTROL_MAGIC = 0x54434D53
# The version src/core/control_message.h speaks (4: the join carries the
# capacity and an epoch, the roster its epoch and barrier count; 3: the
# scheduler also sends PEER_LEFT). HOSTILE_CONTROL_VERSION=1, 2 or 3 speaks an
# older protocol (1: the join before the mesh shape): only to run these tests
# against a build from before it.
CONTROL_VERSION = int(os.environ.get("HOSTILE_CONTROL_VERSION", "4"))
(JOIN, ROSTER, BARRIER, RELEASE, LEAVE, PEER_LOST, PING, PONG, REJECT, PEER_JOINED, CHALLENGE,
 PROOF) = range(1, 13)
JOIN_RESUME = 1


def _text(s):
    b = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<I", len(b)) + b


def control(kind, payload=b""):
    return struct.pack("<IHHI", CONTROL_MAGIC, CONTROL_VERSION, kind, len(payload)) + payload


def join_message(role, rank, endpoint, workers, servers, mesh_id="", flags=0, barrier=0,
                 released=0, max_workers=None, max_servers=None, epoch=0):
    payload = struct.pack("<Bi", role, rank) + _text(endpoint)
    if CONTROL_VERSION >= 4:
        payload += (struct.pack("<IIII", workers, servers, max_workers or workers,
                                max_servers or servers) + _text(mesh_id) +
                    struct.pack("<BQQQ", flags, barrier, released, epoch))
    elif CONTROL_VERSION >= 2:
        payload += (struct.pack("<II", workers, servers) + _text(mesh_id) +
                    struct.pack("<BQQ", flags, barrier, released))
    return control(JOIN, payload)


# Where the roster's entries start: after rank and count (4: also the epoch
# and the barrier count, between them).
ROSTER_ENTRIES_AT = 24 if CONTROL_VERSION >= 4 else 8


def roster_header(payload):
    """(rank, entries) of a ROSTER payload."""
    (rank,) = struct.unpack_from("<i", payload)
    (n,) = struct.unpack_from("<I", payload, ROSTER_ENTRIES_AT - 4)
    return rank, n


def pong_message(sequence):
    return control(PONG, struct.pack("<Q", sequence))


def recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed after %d of %d bytes" % (len(out), n))
        out += chunk
    return out


def read_control(sock):
    """(type, payload bytes) of the next control message."""
    magic, version, kind, length = struct.unpack("<IHHI", recv_exact(sock, 12))
    if magic != CONTROL_MAGIC or version != CONTROL_VERSION:
        raise ValueError("not a control message: magic %x version %d" % (magic, version))
    return kind, recv_exact(sock, length)


def text_of(payload, offset=0):
    (n,) = struct.unpack_from("<I", payload, offset)
    return payload[offset + 4:offset + 4 + n].decode(errors="replace")

# --- shared-secret proofs ---------------------------------------------------------

def auth_proof(secret, side, context, dialer_nonce, acceptor_nonce):
    label = b"stepmesh-auth-v1/dialer" if side == "dialer" else b"stepmesh-auth-v1/acceptor"
    message = b""
    for part in (label, context.encode()):
        message += struct.pack("<I", len(part)) + part
    return hmac.new(secret.encode(), message + dialer_nonce + acceptor_nonce,
                    hashlib.sha256).digest()


def control_authenticate(sock, secret):
    """The participant's side of the control challenge-response; returns what it sent."""
    ours = os.urandom(32)
    sent = control(CHALLENGE, _text(ours))
    sock.sendall(sent)
    kind, payload = read_control(sock)
    if kind == REJECT:
        raise PermissionError(text_of(payload))
    theirs = payload[4:36]
    kind, payload = read_control(sock)
    assert kind == PROOF, kind
    proof = control(PROOF, _text(auth_proof(secret, "dialer", "control", ours, theirs)))
    sock.sendall(proof)
    return sent + proof

# --- data connections -------------------------------------------------------------

HELLO_MAGIC = 0x49484D53
VERDICT_ACCEPT = 0x4B4F4D53
VERDICT_REFUSE = 0x4F4E4D53
FRAME_VERSION = 1


def hello(self_id, auth, nonce=None):
    return struct.pack("<IIII", HELLO_MAGIC, FRAME_VERSION, self_id, 1 if auth else 0) + (
        nonce if nonce is not None else os.urandom(32))


def data_context(dialler, acceptor):
    return "data:%x>%x" % (dialler, acceptor)


def dial_data(address, self_id, peer_id, secret="", timeout=5.0):
    """Dials a server's data port as `self_id`; returns (socket, bytes sent).
    Raises PermissionError when refused."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    nonce = os.urandom(32)
    sent = hello(self_id, bool(secret), nonce)
    sock.sendall(sent)
    (verdict,) = struct.unpack("<I", recv_exact(sock, 4))
    if verdict != VERDICT_ACCEPT:
        sock.close()
        raise PermissionError("refused")
    if secret:
        reply = recv_exact(sock, 64)
        theirs, their_proof = reply[:32], reply[32:]
        ctx = data_context(self_id, peer_id)
        if not hmac.compare_digest(their_proof,
                                   auth_proof(secret, "acceptor", ctx, nonce, theirs)):
            raise PermissionError("the acceptor failed authentication")
        answer = auth_proof(secret, "dialer", ctx, nonce, theirs)
        sock.sendall(answer)
        sent += answer
        (verdict,) = struct.unpack("<I", recv_exact(sock, 4))
        if verdict != VERDICT_ACCEPT:
            sock.close()
            raise PermissionError("refused after the proof")
    return sock, sent

# --- frames ----------------------------------------------------------------------

FRAME_MAGIC = 0x48534D53
PUSH, REPLY, ERROR, HEARTBEAT, GOODBYE = 1, 2, 3, 4, 5
DTYPE_UINT8 = 1
FLAG_HAS_PULL = 1


def frame(kind, src, dst, key=0, request_id=0, payload_bytes=0, pull_key=0, part_index=0,
          part_count=0, flags=0, dtype=DTYPE_UINT8, status=0):
    head = struct.pack("<IBBBBIIQQQQHHI", FRAME_MAGIC, FRAME_VERSION, kind, dtype, flags, src, dst,
                       key, request_id, payload_bytes, pull_key, part_index, part_count, status)
    head += b"\0" * (5 * 8) + struct.pack("<I", 0)
    assert len(head) == 100
    return head + struct.pack("<I", crc32c(head))

# --- processes -------------------------------------------------------------------


def fd_count(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _socket_inodes(pid):
    """The socket inodes of `pid`'s open descriptors, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    return inodes


def _tcp_sockets(pid):
    """(state, local port, remote port) of `pid`'s IPv4 TCP sockets, from /proc/net/tcp."""
    inodes = _socket_inodes(pid)
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[9] in inodes:
                yield parts[3], int(parts[1].split(":")[1], 16), int(parts[2].split(":")[1], 16)


def listening_ports(pid):
    """TCP ports `pid` listens on (IPv4), from /proc."""
    return sorted(local for state, local, _ in _tcp_sockets(pid) if state == "0A")  # LISTEN


def connected_to(pid, port):
    """Whether `pid` has an established TCP connection to 127.0.0.1:`port` (from /proc)."""
    return any(state == "01" and remote == port for state, _, remote in _tcp_sockets(pid))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOSS_LINE = re.compile(r"(worker|server) \d+ lost")


class Mesh:
    """A scheduler (stepmesh_scheduler) and reliability nodes as processes on
    127.0.0.1, logging into a temporary directory; everything it started is
    killed by PID when it is closed."""

    def __init__(self, programs, workers, servers, timeout_ms=3000, heartbeat_ms=300,
                 bytes_=65536, env=None):
        self.programs = programs  # name -> path
        self.workers = workers
        self.servers = servers
        self.timeout_ms = timeout_ms
        self.heartbeat_ms = heartbeat_ms
        self.bytes = bytes_
        self.env = dict(os.environ)
        self.env.pop("STEPMESH_AUTH_TOKEN", None)
        self.env.update(env or {})
        self.dir = tempfile.mkdtemp(prefix="stepmesh-hostile-")
        self.stop_file = os.path.join(self.dir, "stop")
        self.procs = {}  # name -> Popen
        self.port = None

    def _spawn(self, name, argv, preexec_fn=None):
        out = open(os.path.join(self.dir, name + ".out"), "w")
        err = open(os.path.join(self.dir, name + ".err"), "w")
        p = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env, preexec_fn=preexec_fn)
        out.close()
        err.close()
        self.procs[name] = p
        return p

    def start_scheduler(self, port=0, preexec_fn=None):
        """Starts (or restarts, on the same port) the scheduler."""
        p = self._spawn("scheduler", [self.programs["stepmesh_scheduler"], "--address",
                                      "127.0.0.1:%d" % (port or self.port or 0), "--workers",
                                      str(self.workers), "--servers", str(self.servers)],
                        preexec_fn)
        deadline = time.time() + 10
        path = os.path.join(self.dir, "scheduler.out")
        while time.time() < deadline:
            with open(path) as f:
                m = re.search(r"listening on 127\.0\.0\.1:(\d+)", f.read())
            if m:
                self.port = int(m.group(1))
                return p
            if p.poll() is not None:
                raise RuntimeError("scheduler exited: " + self.log("scheduler"))
            time.sleep(0.01)
        raise RuntimeError("scheduler did not start")

    @property
    def scheduler(self):
        return "127.0.0.1:%d" % self.port

    def node_args(self, role, rank):
        return [self.programs["stepmesh_reliability_node"], "--role", role,
                "--rank", str(rank), "--scheduler", self.scheduler, "--workers",
                str(self.workers), "--servers", str(self.servers), "--bytes", str(self.bytes),
                "--timeout-ms", str(self.timeout_ms), "--heartbeat-ms", str(self.heartbeat_ms)]

    def start_server(self, rank, extra=(), preexec_fn=None):
        return self._spawn("server%d" % rank, self.node_args("server", rank) + list(extra),
                           preexec_fn)

    def start_worker(self, rank, extra=(), name=None):
        return self._spawn(name or "worker%d" % rank,
                           self.node_args("worker", rank) + ["--stop-file", self.stop_file] +
                           list(extra))

    def log(self, name):
        text = ""
        for ext in (".out", ".err"):
            try:
                with open(os.path.join(self.dir, name + ext)) as f:
                    text += f.read()
            except OSError:
                pass
        return text

    def wait_progress(self, name, rounds, timeout=20):
        """Waits until worker `name` reported at least `rounds` rounds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.findall(r"progress (\d+)", self.log(name))
            if m and int(m[-1]) >= rounds:
                return int(m[-1])
            if self.procs[name].poll() is not None:
                raise AssertionError("%s exited early:\n%s" % (name, self.log(name)))
            time.sleep(0.02)
        raise AssertionError("%s made no progress:\n%s" % (name, self.log(name)))

    def stop_workers(self, timeout=30):
        """Asks the workers to finish; returns {name: exit code}."""
        open(self.stop_file, "w").close()
        codes = {}
        deadline = time.time() + timeout
        for name, p in self.procs.items():
            if not name.startswith("worker"):
                continue
            try:
                codes[name] = p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = "hung"
        return codes

    def losses(self, names):
        found = []
        for name in names:
            for line in self.log(name).splitlines():
                if LOSS_LINE.search(line):
                    found.append("%s: %s" % (name, line))
        return found

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if os.environ.get("HOSTILE_KEEP_LOGS"):
            print("logs kept in", self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def kill9(p):
    os.kill(p.pid, signal.SIGKILL)
    p.wait(5)
