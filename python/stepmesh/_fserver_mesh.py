"""The process's mesh: :class:`_Mesh` (the schedulers of a group, this
process's worker or server, :mod:`_fserver_worker`, :mod:`_fserver_server`
and :mod:`_fserver_announce` mixed in) and the one instance of it that
stepmesh.fserver is (``init``, ``stop``, ``leave``, ``_mesh()``: this module
alone holds and rebinds ``_state``). Part of :mod:`stepmesh.fserver`."""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional

import stepmesh
from stepmesh._fserver_announce import KeyAnnouncements
from stepmesh._fserver_launch import _instance_options, _launch, _scheduler_port
from stepmesh._fserver_server import ServerSide
from stepmesh._fserver_worker import WorkerSide

# The process's one mesh (None before init(), after stop() and leave()): only
# init, stop and leave below rebind it; stepmesh.fserver._state reads it here.
_lock = threading.Lock()
_state: Optional["_Mesh"] = None


class _Mesh(WorkerSide, ServerSide, KeyAnnouncements):
    """The schedulers, worker or server of this process (module docstring)."""

    def __init__(self):
        opts, launch = _launch()
        role = self.role = launch["role"]
        self.scheduler: Optional[stepmesh.Scheduler] = None
        self.schedulers: List[stepmesh.Scheduler] = []
        self.worker: Optional[stepmesh.Worker] = None
        self.server: Optional[stepmesh.Server] = None
        self._port: Optional[int] = None
        if role in ("scheduler", "joint"):
            self._start_schedulers(opts, launch)
        try:
            if role == "worker":
                self._init_worker(_instance_options(opts, "worker", launch, launch["instance"]))
            elif role in ("server", "joint"):
                self._init_server(_instance_options(opts, "server", launch, launch["instance"],
                                                    self._port))
        except BaseException:
            for sch in self.schedulers:
                sch.stop()
            raise

    def _start_schedulers(self, opts: stepmesh.MeshOptions, launch: Dict[str, Any]) -> None:
        """One scheduler per instance of a group (ports port .. port + DMLC_GROUP_SIZE - 1);
        port 0 finds g consecutive free ports."""
        g = launch["group_size"]
        base = _scheduler_port(opts.scheduler)
        for attempt in range(20):
            started: List[stepmesh.Scheduler] = []
            try:
                first = stepmesh.Scheduler(_instance_options(opts, "scheduler", launch, 0))
                started.append(first)
                port = _scheduler_port(first.address)
                for i in range(1, g):
                    started.append(stepmesh.Scheduler(
                        _instance_options(opts, "scheduler", launch, i, port)))
            except stepmesh.Error:
                for sch in started:
                    sch.stop()
                if base != 0 or attempt == 19:
                    raise
                continue  # port 0: another process took one of the next ports; again
            self.schedulers = started
            self.scheduler = started[0]
            self._port = port
            return
        raise AssertionError("unreachable")

    # ---- both
    def barrier(self) -> None:
        (self.worker or self.server).barrier()

    def close(self) -> None:
        node = self.worker or self.server
        if node is not None:
            try:
                node.barrier()
            finally:
                node.close()
        self._stop_schedulers()

    def leave(self, timeout_s: float) -> None:
        """This participant alone leaves in order (Worker/Server.leave: a drain)."""
        node = self.worker or self.server
        try:
            if node is not None:
                node.leave(timeout_s)
        finally:
            self._stop_schedulers()

    def _stop_schedulers(self) -> None:
        # StepMesh's scheduler waits as long as its participants run (a dead one
        # is lost by heartbeat, STEPMESH_TIMEOUT of silence), however long the job.
        try:
            for sch in self.schedulers:
                sch.wait_for_participants()
        finally:
            for sch in self.schedulers:
                sch.stop()


def _mesh(role: Optional[str] = None) -> _Mesh:
    if _state is None:
        raise RuntimeError("stepmesh.fserver: call init() first")
    if role == "worker" and _state.worker is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {_state.role}, not a worker")
    if role == "server" and _state.server is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {_state.role}, not a server")
    return _state


# ------------------------------------------------------------ the process's mesh

def init() -> None:
    """Joins the mesh named by the environment (role from DMLC_ROLE, default server)."""
    global _state
    with _lock:
        if _state is not None:
            raise RuntimeError("stepmesh.fserver: init() called twice")
        _state = _Mesh()


def stop() -> None:
    """Barrier with every participant, then leave (the scheduler waits for all to leave)."""
    global _state
    with _lock:
        mesh, _state = _state, None
    if mesh is not None:
        mesh.close()


def _participant():
    m = _mesh()
    node = m.worker or m.server
    if node is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {m.role}, not a participant")
    return node


def leave(timeout_ms: int = 10000) -> None:
    """Leaves the mesh in order, this participant alone, while the others run on
    (stepmesh's ``leave``, a drain): a worker takes no new ``push_pull`` and waits
    for what it posted; a server is counted out at once and answers what arrived
    (keep serving ``get_batch``/``respond`` on another thread until ``get_batch``
    raises ``stepmesh.Unavailable``). The others hear "left" at a new epoch, never
    a loss. No barrier, unlike ``stop()`` (StepMesh's ``Finalize``, collective).
    Past ``timeout_ms`` it leaves anyway and raises ``stepmesh.DeadlineExceeded``.
    Afterwards the module is as before ``init()``."""
    global _state
    _participant()  # a scheduler-only process has nothing to leave
    mesh = _state
    try:
        # The module stays initialised meanwhile: another thread keeps serving
        # get_batch/respond through it until the drain ends.
        mesh.leave(timeout_ms / 1000.0)
    finally:
        with _lock:
            if _state is mesh:
                _state = None
