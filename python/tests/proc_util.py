"""Child processes for the Python tests: spawned by path with this interpreter,
waited with a deadline, killed by PID, and killed by the kernel should the
test process itself die (PR_SET_PDEATHSIG), so no test leaves one behind."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(args: Sequence[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """Runs `python args...` with `env` added to a copy of this environment."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, *args], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)


def reap(procs: List[subprocess.Popen], timeout_s: float) -> List[str]:
    """Waits for every process until the shared deadline, kills (by PID) what is
    left, and returns each one's output. Raises if one timed out or failed."""
    deadline = time.monotonic() + timeout_s
    outputs, failures = [], []
    for p in procs:
        name = f"pid {p.pid} ({' '.join(p.args[1:])})"
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if p.returncode != 0:
                failures.append(f"{name} exited {p.returncode}")
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            failures.append(f"{name} timed out after {timeout_s}s")
        outputs.append(out)
    if failures:
        raise AssertionError("; ".join(failures) + "\n" +
                             "\n----\n".join(o or "" for o in outputs))
    return outputs


def kill_all(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.communicate()


def require_torch():
    """torch (Debian python3-torch) is a test dependency: its absence is a failure
    with the remedy in the message, never a silent skip."""
    try:
        import torch
        import torch.utils.dlpack  # noqa: F401
    except ImportError as e:
        raise AssertionError(
            f"torch is not importable by {sys.executable} ({e}); the torch tests need Debian's "
            "python3-torch: run scripts/install-deps.sh") from None
    return torch


def free_port_run(n: int) -> int:
    """A base port on 127.0.0.1 with n consecutive free ports from it (a
    subgroup mesh per FFN rank listens on port + f). Free when looked at: a
    caller binds them at once."""
    for _ in range(100):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        try:
            for i in range(n):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                t.close()
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {n} free ports on 127.0.0.1 in 100 tries")


def run_on_free_ports(n: int, make_children, run, attempts: int = 3):
    """Runs the processes make_children(port) makes (they bind the n ports
    from `port`) with run(children) -> results (dicts with "output"); returns
    (children, results). free_port_run's ports are free only when looked at:
    a test running beside this one, or an outgoing connection's ephemeral
    port, may take one before a child binds it. A run whose output says so
    ("Address already in use") is made again on new ports, at most
    `attempts` times; the last run is returned whatever it says."""
    for attempt in range(attempts):
        children = make_children(free_port_run(n))
        results = run(children)
        taken = any("Address already in use" in r["output"] for r in results)
        if not taken or attempt + 1 == attempts:
            return children, results
