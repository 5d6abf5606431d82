#!/usr/bin/env python3
"""Runs several Python programs as forked children of one process that
imported the heavy modules (torch) once, so a multi-process test pays one
torch import instead of one per process (seconds of CPU each on a small
machine). Each child is a fresh fork, before any thread exists, that sets its
own environment and runs its program file unchanged as __main__.

    fork_runner.py MODULE...   then one JSON spec per line on stdin:
        {"timeout_s": s, "children": [{"program": path, "env": {...}}]}

imports the MODULEs once, prints "ready", then per spec runs its children
at once and prints one JSON line: [{"rc": exit status or -signal,
"timed_out": bool, "output": text}] per child, in order (a child past the
deadline is killed by PID). Ends at EOF. Exits 3 when a module cannot be
imported."""

import ctypes
import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _child(program: str, env: dict, out_fd: int) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        _die_with_parent()
        os.environ.update(env)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        sys.argv = [program]
        runpy.run_path(program, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(spec: dict) -> list:
    deadline = time.monotonic() + float(spec.get("timeout_s", 240))
    children = []
    for c in spec["children"]:
        out = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:
            _child(c["program"], c.get("env", {}), out.fileno())
        children.append({"pid": pid, "out": out, "rc": None, "timed_out": False})
    left = {c["pid"]: c for c in children}
    while left:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in left:
            left.pop(pid)["rc"] = os.waitstatus_to_exitcode(status)
            continue
        if time.monotonic() > deadline:
            for c in left.values():
                os.kill(c["pid"], signal.SIGKILL)
                os.waitpid(c["pid"], 0)
                c["rc"], c["timed_out"] = -signal.SIGKILL, True
            left.clear()
            break
        time.sleep(0.02)
    result = []
    for c in children:
        c["out"].seek(0)
        result.append({"rc": c["rc"], "timed_out": c["timed_out"],
                       "output": c["out"].read().decode(errors="replace")})
        c["out"].close()
    return result


def main() -> int:
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"fork_runner: cannot import {name} with {sys.executable} ({e}); "
                  "the tests need Debian's python3-torch: run scripts/install-deps.sh",
                  file=sys.stderr)
            return 3
    # fork() copies only the calling thread: with another thread alive (one
    # holding a lock), a child could hang. The imports must not start any.
    tasks = len(os.listdir("/proc/self/task"))
    if threading.active_count() != 1 or tasks != 1:
        print(f"fork_runner: {tasks} threads after the imports; refusing to fork",
              file=sys.stderr)
        return 2
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
