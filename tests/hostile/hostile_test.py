#!/usr/bin/env python3
"""Hostile peers against real meshes of processes on 127.0.0.1.

    hostile_test.py --program NAME=PATH ... --case CASE

Every case runs a mesh of stepmesh_scheduler and stepmesh_reliability_node
processes (2 workers x 2 servers unless it says otherwise; each worker
checks every reply byte of every round) while it attacks the scheduler or
the servers' data ports, then checks that every healthy worker kept being
served (exit 0), that no real process was declared lost, and that
descriptors and memory of the attacked processes came back to where they
were. Python standard library only; wire formats in stepmesh_wire.py.
"""

import argparse
import os
import random
import re
import resource
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stepmesh_wire as wire  # noqa: E402

# Slack for "back to baseline": the allocator keeps some of what a flood made
# it hand out, but a leak per connection (thousands here) shows far above it.
RSS_SLACK_KIB = 4096


class Failure(AssertionError):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def connect(port, timeout=5.0):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
    return s


def open_many(port, count):
    """`count` connections that stay open and silent (a refused one is skipped)."""
    out = []
    for _ in range(count):
        try:
            out.append(connect(port, timeout=2))
        except OSError:
            pass
    return out


class Trickler:
    """Connections that each send one byte of `stream` every `period` seconds."""

    def __init__(self, port, count, stream, period=0.1):
        self.socks = open_many(port, count)
        self.stream = stream
        self.period = period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        i = 0
        while not self.stop.wait(self.period):
            for s in list(self.socks):
                try:
                    s.send(self.stream[i % len(self.stream):i % len(self.stream) + 1])
                except OSError:
                    self.socks.remove(s)
            i += 1

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def garbage(port, count, size=4096):
    out = []
    for _ in range(count):
        try:
            s = connect(port, timeout=2)
            s.sendall(os.urandom(size))
            out.append(s)
        except OSError:
            pass
    return out


def close_all(socks):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def read_verdict(sock, timeout):
    """The 4-byte verdict a data port answers a hello with, or None."""
    sock.settimeout(timeout)
    try:
        data = wire.recv_exact(sock, 4)
    except (OSError, ConnectionError):
        return None
    return struct.unpack("<I", data)[0]


def snapshot(pids):
    return {name: (wire.fd_count(pid), wire.rss_kib(pid)) for name, pid in pids.items()}


def check_back_to_baseline(before, pids, what):
    """Descriptors back to exactly where they were; memory within RSS_SLACK_KIB."""
    deadline = time.time() + 5
    while True:
        after = snapshot(pids)
        bad = [(n, before[n], after[n]) for n in pids
               if after[n][0] != before[n][0] or after[n][1] > before[n][1] + RSS_SLACK_KIB]
        if not bad or time.time() > deadline:
            break
        time.sleep(0.1)
    check(not bad, "%s: (fds, RSS KiB) before -> after: %s" % (what, bad))
    print("%s: back to baseline %s" % (what, after))


def finish(mesh, allowed_losses=()):
    """Stops the workers; every one must exit 0, and no real process lost."""
    codes = mesh.stop_workers()
    for name, code in codes.items():
        check(code == 0, "%s exited %s:\n%s" % (name, code, mesh.log(name)[-3000:]))
    names = list(mesh.procs)
    losses = [l for l in mesh.losses(names) if not any(a in l for a in allowed_losses)]
    check(not losses, "participants were declared lost:\n" + "\n".join(losses))
    print("workers:", codes, "; no participant lost")


def start_mesh(args, workers=2, servers=2, server_preexec=None, scheduler_preexec=None,
               worker_extra=(), server_extra=(), real_workers=None, **kw):
    mesh = wire.Mesh(args.programs, workers, servers, **kw)
    mesh.start_scheduler(preexec_fn=scheduler_preexec)
    for s in range(servers):
        mesh.start_server(s, server_extra, preexec_fn=server_preexec if s == 0 else None)
    for w in range(workers if real_workers is None else real_workers):
        mesh.start_worker(w, worker_extra)
    return mesh


def warm(mesh, workers=2, rounds=20):
    return [mesh.wait_progress("worker%d" % w, rounds) for w in range(workers)]


# An attack lasts longer than the meshes' timeout (3 s) plus a heartbeat, so
# that a starved heartbeat, a blocked send or a parked accept shows as a loss.
ATTACK_SECONDS = 4.0


# Under attack, the attacked process must still answer a newcomer: within this
# long (its normal answer takes a millisecond), garbage gets the connection
# closed. A loop that serves connections one at a time misses it by seconds.
PROBE_SECONDS = 2.0


def probe(port):
    """Sends garbage; true when the listener's owner closed the connection in time."""
    try:
        s = connect(port, timeout=PROBE_SECONDS)
        s.sendall(b"\xff" * 64)
        s.settimeout(PROBE_SECONDS)
        while s.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True  # reset: closed too
    finally:
        s.close()


def hold(mesh, seconds, workers=2, probe_ports=()):
    """Keeps the attack up for `seconds`; fails as soon as a worker dies or an
    attacked listener stops answering."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        for w in range(workers):
            p = mesh.procs["worker%d" % w]
            check(p.poll() is None,
                  "worker %d exited %s under attack:\n%s" % (w, p.returncode,
                                                             mesh.log("worker%d" % w)[-3000:]))
        for port in probe_ports:
            start = time.time()
            check(probe(port), "port %d did not answer a newcomer within %.1f s under attack" %
                  (port, time.time() - start))
        time.sleep(0.1)


def progressed(mesh, before, workers=2, by=40):
    """Every worker completed `by` more rounds than `before` (while under attack)."""
    for w in range(workers):
        mesh.wait_progress("worker%d" % w, before[w] + by, timeout=20)


def data_ports(mesh, servers=2):
    ports = []
    for s in range(servers):
        listening = wire.listening_ports(mesh.procs["server%d" % s].pid)
        check(len(listening) == 1, "server %d listens on %s" % (s, listening))
        ports.append(listening[0])
    return ports

# --- cases -----------------------------------------------------------------------


def case_scheduler_flood(args):
    """Idle, trickling, garbage and replayed connections to the scheduler: the
    heartbeats go on, nobody is lost, every bad client is refused or dropped."""
    mesh = start_mesh(args)
    try:
        before_rounds = warm(mesh)
        sched = {"scheduler": mesh.procs["scheduler"].pid}
        base = snapshot(sched)
        port = mesh.port
        join0 = wire.join_message(wire.ROLE_WORKER, 0, "127.0.0.1:1", 2, 2)
        idle = open_many(port, 150)
        trickle = Trickler(port, 40, join0)
        junk = garbage(port, 40)
        hold(mesh, ATTACK_SECONDS, probe_ports=[port])
        # A replayed join of worker 0 and a join of another mesh shape: refused,
        # naming the address worker 0 joined from / both shapes.
        replay = connect(port)
        replay.sendall(join0)
        kind, payload = wire.read_control(replay)
        check(kind == wire.REJECT and "already joined from 127.0.0.1:" in wire.text_of(payload),
              "replayed join: %d %r" % (kind, payload))
        other = connect(port)
        other.sendall(wire.join_message(wire.ROLE_WORKER, -1, "127.0.0.1:1", 2, 1))
        kind, payload = wire.read_control(other)
        text = wire.text_of(payload)
        check(kind == wire.REJECT and "for 2 workers and 1 servers" in text and
              "this mesh has 2 workers and 2 servers" in text, "other mesh: %r" % text)
        progressed(mesh, before_rounds)
        trickle.close()
        close_all(idle + junk + [replay, other])
        check_back_to_baseline(base, sched, "scheduler after the flood")
        log = mesh.log("scheduler")
        warnings = [l for l in log.splitlines() if " W " in l and "127.0.0.1:" in l]
        check(warnings, "no warning names a remote address:\n" + log[-2000:])
        check(len(warnings) <= 40, "%d warnings: not rate limited" % len(warnings))
        finish(mesh)
    finally:
        mesh.close()


def case_data_port_flood(args):
    """Idle, trickling, garbage, out-of-range and replayed connections to every
    server's data port while a worker is killed and rejoins."""
    mesh = start_mesh(args)
    try:
        before_rounds = warm(mesh)
        ports = data_ports(mesh)
        servers = {"server%d" % s: mesh.procs["server%d" % s].pid for s in range(2)}
        base = snapshot(servers)
        attack = []
        tricklers = []
        for port in ports:
            attack += open_many(port, 60)
            tricklers.append(Trickler(port, 20, wire.hello(wire.worker_id(0), False)))
            attack += garbage(port, 20)
        # A replayed hello of worker 0 (connected): refused, never served.
        replayed = connect(ports[1])
        replayed.sendall(wire.hello(wire.worker_id(0), False))
        # Meanwhile worker 1 dies and a new process takes its rank.
        wire.kill9(mesh.procs["worker1"])
        deadline = time.time() + 20
        while True:
            p = mesh.start_worker(1, name="worker1")
            try:
                code = p.wait(1.0)
            except subprocess.TimeoutExpired:
                break  # joined and running
            check(code == 3 and time.time() < deadline,
                  "the restarted worker 1 exited %s:\n%s" % (code, mesh.log("worker1")))
            time.sleep(0.2)
        before_rounds[1] = 0
        hold(mesh, ATTACK_SECONDS, probe_ports=ports)
        progressed(mesh, before_rounds)
        # A hello claiming a rank outside the mesh gets a refusing verdict at once.
        out_of_range = connect(ports[0])
        out_of_range.sendall(wire.hello(wire.worker_id(7), False))
        check(read_verdict(out_of_range, 3) == wire.VERDICT_REFUSE,
              "a hello claiming worker 7 of 2 was not refused")
        check(read_verdict(replayed, 8) == wire.VERDICT_REFUSE,
              "a replayed hello claiming the connected worker 0 was not refused")
        for t in tricklers:
            t.close()
        close_all(attack + [out_of_range, replayed])
        check_back_to_baseline(base, servers, "servers after the flood")
        finish(mesh, allowed_losses=("worker 1 lost",))
    finally:
        mesh.close()


def read_roster(sock):
    kind, payload = wire.read_control(sock)
    while kind == wire.PING:
        sock.sendall(wire.pong_message(struct.unpack("<Q", payload)[0]))
        kind, payload = wire.read_control(sock)
    check(kind == wire.ROSTER, "expected the roster, got %d %r" % (kind, payload))
    rank, n = wire.roster_header(payload)
    at = wire.ROSTER_ENTRIES_AT
    roster = {}
    for _ in range(n):
        (node,) = struct.unpack_from("<I", payload, at)
        endpoint = wire.text_of(payload, at + 4)
        at += 8 + len(endpoint.encode())
        roster[node] = endpoint
    return rank, roster


def case_stuck_reader(args):
    """A joined worker (this script, rank 2 of 3) keeps pushing but never reads
    its data sockets: the servers keep answering the two real workers, and
    drop the stuck one after its own deadline."""
    mesh = start_mesh(args, workers=3, real_workers=2, bytes_=262144)
    try:
        control = connect(mesh.port)
        control.sendall(wire.join_message(wire.ROLE_WORKER, 2, "127.0.0.1:1", 3, 2))
        _, roster = read_roster(control)
        stop = threading.Event()

        def answer_pings():
            control.settimeout(0.2)
            while not stop.is_set():
                try:
                    kind, payload = wire.read_control(control)
                except socket.timeout:
                    continue
                except (OSError, ConnectionError, ValueError):
                    return
                if kind == wire.PING:
                    control.sendall(wire.pong_message(struct.unpack("<Q", payload)[0]))

        pinger = threading.Thread(target=answer_pings, daemon=True)
        pinger.start()
        me = wire.worker_id(2)
        socks = [wire.dial_data(roster[wire.server_id(s)], me, wire.server_id(s))[0]
                 for s in range(2)]
        payload = bytes(mesh.bytes)

        def push_forever():
            request = 1
            while not stop.is_set():
                for s, sock in enumerate(socks):
                    head = wire.frame(wire.PUSH, me, wire.server_id(s), key=100,
                                      request_id=(request << 32) | 1, payload_bytes=len(payload),
                                      pull_key=200, part_index=0, part_count=1,
                                      flags=wire.FLAG_HAS_PULL)
                    try:
                        sock.settimeout(0.5)
                        sock.sendall(head + payload)
                    except OSError:
                        pass
                request += 1
                time.sleep(0.002)

        pusher = threading.Thread(target=push_forever, daemon=True)
        pusher.start()
        before_rounds = warm(mesh)
        # Long enough for the stuck queues to fill and for the servers'
        # deadline (the mesh timeout, 3 s) to drop worker 2.
        progressed(mesh, before_rounds, by=100)
        deadline = time.time() + 15
        while time.time() < deadline and not all(
                "did not read its socket" in mesh.log("server%d" % s) for s in range(2)):
            time.sleep(0.1)
        for s in range(2):
            check("worker 2" in mesh.log("server%d" % s) and
                  "did not read its socket" in mesh.log("server%d" % s),
                  "server %d never dropped the stuck worker:\n%s" % (s, mesh.log("server%d" % s)))
        after = warm(mesh, rounds=0)
        progressed(mesh, after, by=40)
        stop.set()
        pusher.join(5)
        close_all(socks + [control])
        finish(mesh, allowed_losses=("worker 2 lost",))
    finally:
        mesh.close()


def low_fd_limit(n):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def case_fd_exhaustion(args):
    """The scheduler and server 0 run with a tiny RLIMIT_NOFILE and get more
    connections than they have descriptors: no spinning (CPU), one warning,
    and once the flood is gone they accept again."""
    mesh = start_mesh(args, scheduler_preexec=low_fd_limit(24), server_preexec=low_fd_limit(40))
    try:
        before_rounds = warm(mesh)
        sched = mesh.procs["scheduler"].pid
        server = mesh.procs["server0"].pid
        port = data_ports(mesh)[0]
        cpu = {pid: wire.cpu_seconds(pid) for pid in (sched, server)}
        flood = open_many(mesh.port, 100) + open_many(port, 100)
        window = ATTACK_SECONDS
        hold(mesh, window)
        for pid, name in ((sched, "scheduler"), (server, "server 0")):
            used = wire.cpu_seconds(pid) - cpu[pid]
            check(used < 0.5 * window, "%s used %.2f s of CPU in %.1f s out of descriptors" %
                  (name, used, window))
        progressed(mesh, before_rounds)
        close_all(flood)
        time.sleep(0.5)
        for name in ("scheduler", "server0"):
            exhausted = [l for l in mesh.log(name).splitlines() if "out of file descriptors" in l]
            check(1 <= len(exhausted) <= 3, "%s: %d fd-exhaustion warnings:\n%s" %
                  (name, len(exhausted), mesh.log(name)[-2000:]))
        # Both accept again: a join of another mesh gets its refusal, a hello
        # from outside the mesh its verdict.
        deadline = time.time() + 5
        while True:
            try:
                s = connect(mesh.port, timeout=1)
                s.sendall(wire.join_message(wire.ROLE_WORKER, -1, "127.0.0.1:1", 9, 9))
                s.settimeout(1)
                kind, _ = wire.read_control(s)
                s.close()
                check(kind == wire.REJECT, "control message %d" % kind)
                break
            except (OSError, ConnectionError) as e:
                check(time.time() < deadline, "the scheduler never accepted again: %s" % e)
                time.sleep(0.1)
        d = connect(port)
        d.sendall(wire.hello(wire.worker_id(9), False))
        check(read_verdict(d, 3) == wire.VERDICT_REFUSE, "server 0 never answered a hello")
        d.close()
        finish(mesh)
    finally:
        mesh.close()


def case_scheduler_restart(args):
    """kill -9 of the scheduler mid-run and a new one on the same address: the
    data plane never stops, every reply arrives, barriers pass again."""
    mesh = start_mesh(args, worker_extra=["--barrier-every", "10"],
                      server_extra=["--barrier-loop", "1"])
    try:
        warm(mesh)
        wire.kill9(mesh.procs["scheduler"])
        killed_at = time.time()
        time.sleep(0.5)
        mesh.start_scheduler(port=mesh.port)
        restarted_at = time.time()
        print("scheduler killed at %.3f, restarted at %.3f" % (killed_at, restarted_at))
        deadline = time.time() + 20
        while True:
            after = [re.findall(r"barrier (\d+) round \d+ at ([\d.]+)", mesh.log("worker%d" % w))
                     for w in range(2)]
            late = [[b for b in a if float(b[1]) > restarted_at] for a in after]
            if all(len(l) >= 3 for l in late):
                break
            check(time.time() < deadline,
                  "barriers after the restart: %s\n%s" % (late, mesh.log("worker0")[-2000:]))
            for w in range(2):
                check(mesh.procs["worker%d" % w].poll() is None,
                      "worker %d died:\n%s" % (w, mesh.log("worker%d" % w)[-2000:]))
            time.sleep(0.1)
        for w in range(2):
            log = mesh.log("worker%d" % w)
            check("lost the connection to the scheduler" in log and "reconnected" in log,
                  "worker %d did not report the loss and the reconnection:\n%s" % (w, log))
        finish(mesh)
        print("barriers after the restart:", [len(l) for l in late])
    finally:
        mesh.close()


def case_ffn_kill_prefix(args):
    """kill -9 of an FFN: the worker's error names the loss once."""
    mesh = wire.Mesh(args.programs, 1, 2)
    try:
        mesh.start_scheduler()
        for s in range(2):
            mesh.start_server(s)
        mesh.start_worker(0)
        mesh.wait_progress("worker0", 20)
        wire.kill9(mesh.procs["server1"])
        code = mesh.procs["worker0"].wait(20)
        log = mesh.log("worker0")
        check(code == 1, "worker exited %s" % code)
        lines = [l for l in log.splitlines() if "server 1" in l and "lost" in l]
        check(lines, "no error names the lost server:\n" + log)
        for line in lines:
            check(line.count("lost") == 1 and line.count("server 1") == 1,
                  "doubled prefix: " + line)
        print("error:", lines[-1])
    finally:
        mesh.close()


def latency_line(log):
    m = re.search(r"latency rounds (\d+) p50_us ([\d.]+) p99_us ([\d.]+) max_us ([\d.]+)", log)
    check(m, "no latency line in:\n" + log[-2000:])
    return int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4))


def run_rounds(args, rounds, worker1_extra=()):
    """A 2A2F mesh of processes; both workers run `rounds` round trips (worker 1
    with `worker1_extra`); worker 0's latency line and worker 1's log."""
    mesh = start_mesh(args, real_workers=0, bytes_=4096)
    try:
        mesh.start_worker(0, ["--rounds", str(rounds), "--latency", "1"])
        mesh.start_worker(1, ["--rounds", str(rounds)] + list(worker1_extra))
        for w in range(2):
            code = mesh.procs["worker%d" % w].wait(90)
            check(code == 0, "worker %d exited %s:\n%s" % (w, code, mesh.log("worker%d" % w)[-3000:]))
        losses = mesh.losses(list(mesh.procs))
        check(not losses, "participants were declared lost:\n" + "\n".join(losses))
        return latency_line(mesh.log("worker0")), mesh.log("worker1")
    finally:
        mesh.close()


def case_alone_unregistered_push(args):
    """Worker 1 pushes a key no server registered in each of its first 20 rounds
    (besides its honest round trips); worker 0's 1,000 round trips, every byte
    checked, keep their p99 within 2x of a run where worker 1 behaves."""
    # Interleaved, twice each: on a shared 2-core machine one run's p99 is
    # its ten worst rounds, which another process can make; two runs of each
    # kind and the best of the misbehaving ones against the worst baseline
    # keep a spike from deciding. Before the fix worker 0 failed outright
    # (its round 1 waited out the timeout).
    base_p99, bad_p99 = [], []
    for _ in range(2):
        base = run_rounds(args, 1000)[0]
        print("baseline worker 0: rounds %d p50 %.1f us p99 %.1f us max %.1f us" % base)
        base_p99.append(base[2])
        got, log1 = run_rounds(args, 1000, ["--bad-push-key", "900", "--bad-rounds", "20"])
        print("with worker 1 pushing an unregistered key: rounds %d p50 %.1f us p99 %.1f us "
              "max %.1f us" % got)
        bad_p99.append(got[2])
        m = re.search(r"bad pushes: (\d+) refused \((.*)\)", log1)
        check(m and int(m.group(1)) == 20,
              "worker 1's bad pushes were not all refused:\n" + log1[-3000:])
        check("push key" in m.group(2) and "worker 1" in m.group(2) and "server" in m.group(2),
              "the refusal does not name key, worker and server: " + m.group(2))
        print("worker 1:", m.group(0))
    # 2x the baseline's p99, and 500 us for the machine's scheduling noise.
    check(min(bad_p99) <= 2 * max(base_p99) + 500,
          "worker 0's p99 %s us is above 2x its baseline %s us" % (bad_p99, base_p99))


def case_alone_bad_pull(args):
    """Worker 1 pulls a key no server has a reply tensor for, in round 1: its
    request alone fails, naming worker, key and server; worker 0's round is
    answered (every byte checked) and both go on."""
    got, log1 = run_rounds(args, 40, ["--bad-pull-key", "3", "--bad-rounds", "1"])
    m = re.search(r"bad pull refused: (.*)", log1)
    check(m, "worker 1's bad pull was not refused:\n" + log1[-3000:])
    check("worker 1 pulls key 3" in m.group(1) and "server" in m.group(1),
          "the refusal does not name worker, key and server: " + m.group(1))
    print("worker 1:", m.group(0))
    print("worker 0: rounds %d p50 %.1f us p99 %.1f us max %.1f us" % got)


def case_alone_startup_death(args):
    """An FFN process killed (-9) after it joined, before the mesh formed: the
    workers keep waiting, its restart takes the rank, and the mesh forms and
    runs with every byte checked."""
    mesh = wire.Mesh(args.programs, 2, 2)
    try:
        mesh.start_scheduler()
        for w in range(2):
            mesh.start_worker(w, ["--rounds", "40"])
        doomed = mesh.start_server(0)
        deadline = time.time() + 10
        while time.time() < deadline and not wire.connected_to(doomed.pid, mesh.port):
            time.sleep(0.01)
        check(wire.connected_to(doomed.pid, mesh.port), "server 0 never dialled the scheduler")
        time.sleep(0.3)  # its join is read (the scheduler's loop ticks every 50 ms)
        wire.kill9(doomed)
        time.sleep(0.3)
        for w in range(2):
            p = mesh.procs["worker%d" % w]
            check(p.poll() is None, "worker %d exited %s when server 0 died before the roster:\n%s"
                  % (w, p.returncode, mesh.log("worker%d" % w)[-3000:]))
        mesh.start_server(0)
        mesh.start_server(1)
        for w in range(2):
            code = mesh.procs["worker%d" % w].wait(60)
            check(code == 0, "worker %d exited %s:\n%s" % (w, code, mesh.log("worker%d" % w)[-3000:]))
        print("scheduler:", [l for l in mesh.log("scheduler").splitlines() if "before the mesh" in l])
    finally:
        mesh.close()


def run_example(args, env):
    launcher = args.programs["afd_launch"]
    p = subprocess.Popen([launcher, "--attention", "2", "--ffn", "2", "--requests", "9",
                          "--prompt-len", "32", "--decode-steps", "16", "--micro-batches", "3",
                          "--transport", "tcp", "--backend", "cpu_mock"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    first = p.stdout.readline()
    m = re.search(r"scheduler 127\.0\.0\.1:(\d+)", first)
    check(m, "no scheduler address in %r" % first)
    return p, int(m.group(1))


def case_auth_example(args):
    """The README's main command with a secret, end to end; the mesh refuses an
    unauthenticated join and a replay of an authenticated one. Without a
    secret in the environment the launcher makes one up for its children."""
    token = os.urandom(16).hex()
    for env_token in (token, None):
        env = dict(os.environ)
        env.pop("STEPMESH_AUTH_TOKEN", None)
        if env_token:
            env["STEPMESH_AUTH_TOKEN"] = env_token
            env["STEPMESH_AUTH"] = "on"
        p, port = run_example(args, env)
        try:
            plain = connect(port)
            plain.sendall(wire.join_message(wire.ROLE_WORKER, 0, "127.0.0.1:1", 2, 2))
            kind, payload = wire.read_control(plain)
            check(kind == wire.REJECT and "authentication required" in wire.text_of(payload),
                  "a join without the secret: %d %r" % (kind, payload))
            if env_token:
                # Authenticated, then refused for its mesh shape (it must not
                # take a rank from the real processes, which may still be joining).
                legit = connect(port)
                sent = wire.control_authenticate(legit, env_token)
                join = wire.join_message(wire.ROLE_WORKER, -1, "127.0.0.1:1", 9, 9)
                legit.sendall(join)
                kind, payload = wire.read_control(legit)
                check(kind == wire.REJECT and "configured for 9 workers" in wire.text_of(payload),
                      "an authenticated join of another mesh: %d %r" % (kind, payload))
                replay = connect(port)
                replay.sendall(sent + join)
                kind, payload = wire.read_control(replay)
                while kind in (wire.CHALLENGE, wire.PROOF):
                    kind, payload = wire.read_control(replay)
                check(kind == wire.REJECT and "authentication failed" in wire.text_of(payload),
                      "a replayed authenticated join: %d %r" % (kind, payload))
            out, _ = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        check(p.returncode == 0 and "reference check: PASS" in out,
              "example exited %s:\n%s" % (p.returncode, out[-3000:]))
        print("example with %s: PASS" % ("the given secret" if env_token else "a made-up secret"))


def case_log_level(args):
    """Every program reads STEPMESH_LOG_LEVEL (a bad value is refused, naming it)."""
    env = dict(os.environ, STEPMESH_LOG_LEVEL="chatty")
    programs = [
        ["stepmesh_scheduler", "--address", "127.0.0.1:0"],
        ["stepmesh_reliability_node", "--role", "worker", "--rank", "0"],
        ["stepmesh_test_node", "--role", "worker", "--rank", "0"],
        ["quickstart", "--steps", "1"],
        ["afd_launch", "--attention", "1", "--ffn", "1"],
        ["stepmesh_soak", "--iterations", "1"],
    ]
    for argv in programs:
        if argv[0] not in args.programs:
            continue  # not built in this configuration
        path = args.programs[argv[0]]
        r = subprocess.run([path] + argv[1:], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60)
        check(r.returncode != 0 and "STEPMESH_LOG_LEVEL" in r.stdout,
              "%s with STEPMESH_LOG_LEVEL=chatty exited %d:\n%s" %
              (argv[0], r.returncode, r.stdout[-1500:]))
        print("%s refuses STEPMESH_LOG_LEVEL=chatty" % argv[0])


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--program", action="append", default=[], metavar="NAME=PATH",
                        help="where a program is (stepmesh_scheduler, stepmesh_reliability_node, ...)")
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    args = parser.parse_args()
    args.programs = dict(p.split("=", 1) for p in args.program)
    start = time.time()
    try:
        CASES[args.case](args)
    except AssertionError as e:
        print("FAIL %s: %s" % (args.case, e))
        return 1
    print("PASS %s (%.1f s)" % (args.case, time.time() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
