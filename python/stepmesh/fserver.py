"""A drop-in for StepMesh's ``fserver_lib`` on top of stepmesh.

``import stepmesh.fserver as f`` and StepMesh-style programs keep their shape:
``f.init()``, ``f.push_pull(...)``, ``f.wait(h)``, ``f.get_batch()``,
``f.respond(...)``, ``f.barrier(...)``, ``f.fetch_trace(h)``, ``f.stop()``,
configured by the same ``DMLC_*`` variables (plus any ``STEPMESH_*`` one).

Like ``fserver_lib`` this module is process-global (one mesh per process);
the stepmesh classes underneath have no such limit.

How StepMesh's implicit rules map onto stepmesh's explicit registration:

* StepMesh binds a key to the first buffer it sees. Here the worker side
  registers a tensor the first time its key is used (and re-registers it
  locally when a later call passes another buffer), and *announces* new keys
  to the servers in-band, on two reserved keys, before the data request: each
  server then registers a receive region (a slot per worker) and, for pull
  keys, a reply region, both sized by the announcement. Announcements are
  collective, like StepMesh's first transfer: every worker introduces its new
  keys in the same call, and the first use of a key is at its largest size
  (a larger later push is a ValueError, not silent corruption).
* ``pull_tensors[i]`` is answered by server ``i`` (at most one pull per server
  per request, as in StepMesh's own tests and connector).
* ``get_batch()`` returns one ``(handler, [tensors], [keys])`` per worker, in
  worker-rank order, once every worker's request of a micro-batch arrived;
  the tensors are zero-copy views of the receive region (torch tensors when
  torch is importable, else numpy arrays; a numpy-less dtype such as bfloat16
  without torch comes as a ``stepmesh.TensorSlice``).
* ``respond_vec`` gives each handler *its own* rows of ``ret_buffer``
  (consecutive, in handler order), where StepMesh slices row 0 for everyone.

docs/python.md has the migration table.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import stepmesh
from stepmesh import _stepmesh

# Reserved keys of the announcement protocol (the two largest keys).
_ANNOUNCE_KEY = (1 << 64) - 2  # worker -> server: JSON list of new keys
_ACK_KEY = (1 << 64) - 3  # server -> worker: int64 status per announcement
_ANNOUNCE_BYTES = 64 * 1024
_ACK_BYTES = 8

_lock = threading.Lock()
_state: Optional["_Mesh"] = None


# --------------------------------------------------------------------------- env

def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _fserver_env() -> Dict[str, Any]:
    """The fserver_lib-only variables (the rest go through MeshOptions.from_env)."""
    role = os.environ.get("DMLC_ROLE", "server")
    if role not in ("worker", "server", "scheduler", "joint"):
        raise ValueError(f"DMLC_ROLE={role!r} (want worker, server, scheduler or joint)")
    group_size = _env_int("DMLC_GROUP_SIZE", 1)
    if group_size < 1:
        raise ValueError(f"DMLC_GROUP_SIZE={group_size} (must be >= 1)")
    gpu = _env_int("STEPMESH_GPU", 0)
    node_rank = _env_int("DMLC_NODE_RANK", 0)
    offset = _env_int("DMLC_RANK_OFFSET", 0)
    rdma = os.environ.get("DMLC_ENABLE_RDMA")
    return {
        "role": role,
        "group_size": group_size,
        "rank": node_rank * group_size + gpu + offset,
        "transport": None if rdma is None else ("tcp" if rdma in ("", "0", "false") else "rdma"),
    }


def _options(role: str) -> stepmesh.MeshOptions:
    env = _fserver_env()
    base = {}
    if env["transport"] is not None:
        base["transport"] = env["transport"]
    opts = stepmesh.MeshOptions.from_env(**base)  # DMLC_* / STEPMESH_* (wins over base)
    g = env["group_size"]
    # DMLC_NUM_WORKER / DMLC_NUM_SERVER count groups; stepmesh counts instances.
    changes: Dict[str, Any] = {"role": role, "num_workers": opts.num_workers * g,
                               "num_servers": opts.num_servers * g}
    if role != "scheduler" and "STEPMESH_RANK" not in os.environ:
        changes["rank"] = env["rank"]
    return opts.copy(**changes)


# --------------------------------------------------------------------------- tensors

def _torch():
    try:
        import torch  # noqa: F401
        import torch.utils.dlpack
        return torch
    except ImportError:
        return None


def _as_user_tensor(view):
    """A framework tensor over a TensorSlice / HostTensor (zero-copy)."""
    torch = _torch()
    if torch is not None:
        return torch.utils.dlpack.from_dlpack(view)
    import numpy as np
    try:
        return np.from_dlpack(view)
    except (TypeError, BufferError, RuntimeError):
        return view  # e.g. bfloat16 without torch: the raw DLPack view


def _current_stream(tensors) -> Optional[int]:
    """torch's current CUDA stream (a cudaStream_t int) when any of `tensors` is
    a device tensor, else None: host tensors have no producing stream to wait for."""
    for t in tensors:
        is_cuda = getattr(t, "is_cuda", None)  # torch: no DLPack export per call
        if is_cuda if is_cuda is not None else stepmesh.describe(t)["device"] != "cpu":
            torch = _torch()
            if torch is None:
                raise stepmesh.Unimplemented("device tensors need torch for their stream")
            return torch.cuda.current_stream().cuda_stream
    return None


def _copy(dst_view, src) -> int:
    """Copies src into the start of dst_view; returns bytes copied."""
    info = stepmesh.describe(src)
    if info["device"] != "cpu":
        torch = _torch()
        if torch is None:
            raise stepmesh.Unimplemented("device tensors need torch to be copied")
        dst = torch.utils.dlpack.from_dlpack(dst_view).reshape(-1)
        flat = src.reshape(-1)
        dst[: flat.numel()].copy_(flat)
        return info["nbytes"]
    return stepmesh.copy_(dst_view, src)


# --------------------------------------------------------------------------- mesh

class _Mesh:
    def __init__(self, role: str):
        self.role = role
        self.scheduler: Optional[stepmesh.Scheduler] = None
        self.worker: Optional[stepmesh.Worker] = None
        self.server: Optional[stepmesh.Server] = None
        if role in ("scheduler", "joint"):
            self.scheduler = stepmesh.Scheduler(_options("scheduler"))
        if role == "worker":
            self._init_worker()
        elif role in ("server", "joint"):
            self._init_server()

    # ---- worker side
    def _init_worker(self) -> None:
        w = self.worker = stepmesh.Worker(_options("worker"))
        self.timeout = w.options.timeout
        self.num_servers = w.num_servers
        # key -> {"push": (ptr, bytes, tensor) | None, "pull": {server: (ptr, bytes, tensor)}}
        self.regs: Dict[int, dict] = {}
        # kind -> key -> (bytes, dtype) the servers were told
        self.announced: Dict[str, Dict[int, Tuple[int, str]]] = {"push": {}, "pull": {}}
        self.requests: Dict[int, stepmesh.Request] = {}
        self.traces: Dict[int, List[int]] = {}
        self.announce = stepmesh.HostTensor([_ANNOUNCE_BYTES], "uint8")
        self.acks = [stepmesh.HostTensor([1], "int64") for _ in range(self.num_servers)]
        w.register_push(_ANNOUNCE_KEY, self.announce)
        for s, ack in enumerate(self.acks):
            w.register_pull(_ACK_KEY, s, ack)
        w.barrier()

    def _bind(self, key: int, push, pulls: Dict[int, Any], notes: dict) -> Optional[int]:
        """Makes `push` (or None) and `pulls` {server: tensor} the tensors registered
        under `key`, re-registering the key only when a buffer moved or grew (a prefix
        view of the registered buffer is used as is). Returns the push's byte count."""
        regs = self.regs.setdefault(key, {"push": None, "pull": {}})
        replaced = False  # a registered buffer moved or grew: re-register the key
        added = []  # registrations that are simply new
        nbytes = None
        if push is not None:
            info = stepmesh.describe(push)
            nbytes = info["nbytes"]
            self._check_announce("push", key, info, notes)
            cur = regs["push"]
            if cur is None or cur[0] != info["data_ptr"] or cur[1] < nbytes:
                replaced |= cur is not None
                regs["push"] = (info["data_ptr"], nbytes, push)
                added.append(None)
        for server, tensor in pulls.items():
            info = stepmesh.describe(tensor)
            self._check_announce("pull", key, info, notes)
            cur = regs["pull"].get(server)
            if cur is None or cur[0] != info["data_ptr"] or cur[1] < info["nbytes"]:
                replaced |= cur is not None
                regs["pull"][server] = (info["data_ptr"], info["nbytes"], tensor)
                added.append(server)
        if replaced:
            # stepmesh unregisters a key's push and pulls together: register all again.
            self.worker.unregister(key)
            added = ([None] if regs["push"] is not None else []) + list(regs["pull"])
        for what in added:
            if what is None:
                self.worker.register_push(key, regs["push"][2])
            else:
                self.worker.register_pull(key, what, regs["pull"][what][2])
        return nbytes

    def _check_announce(self, kind: str, key: int, info: dict, notes: dict) -> None:
        table = self.announced[kind]
        if key not in table:
            if all(n["key"] != key for n in notes[kind]):
                notes[kind].append({"key": key, "nbytes": info["nbytes"], "dtype": info["dtype"],
                                    "shape": list(info["shape"]) or [1]})
            return
        cap, dtype = table[key]
        if info["nbytes"] > cap or info["dtype"] != dtype:
            raise ValueError(
                f"{kind} key {key}: {info['nbytes']} bytes of {info['dtype']}, but its first use "
                f"announced at most {cap} bytes of {dtype} (the first use of a key must be its "
                "largest, with the same dtype)")

    def push_pull(self, push_tensors, push_keys, pull_tensors, pull_keys,
                  stream=None) -> int:
        if len(push_tensors) != len(push_keys):
            raise ValueError(f"{len(push_tensors)} push tensors but {len(push_keys)} push keys")
        if len(pull_tensors) != len(pull_keys):
            raise ValueError(f"{len(pull_tensors)} pull tensors but {len(pull_keys)} pull keys")
        if len(pull_tensors) > self.num_servers:
            raise ValueError(f"{len(pull_tensors)} pull tensors for {self.num_servers} server(s): "
                             "pull_tensors[i] is answered by server i")
        if not push_keys:
            raise ValueError("a request needs at least one push")
        wanted: Dict[int, list] = {}
        for tensor, key in zip(push_tensors, push_keys):
            entry = wanted.setdefault(int(key), [None, {}])
            if entry[0] is not None:
                raise ValueError(f"push key {int(key)} repeated")
            entry[0] = tensor
        for server, (tensor, key) in enumerate(zip(pull_tensors, pull_keys)):
            wanted.setdefault(int(key), [None, {}])[1][server] = tensor
        notes: dict = {"push": [], "pull": []}
        nbytes = {key: self._bind(key, push, pulls, notes) for key, (push, pulls) in wanted.items()}
        if notes["push"] or notes["pull"]:
            self._announce(notes)
        req = self.worker.push_pull([(int(k), nbytes[int(k)]) for k in push_keys],
                                    [(int(k), s) for s, k in enumerate(pull_keys)],
                                    stream=stream)
        handle = int(req)
        self.requests[handle] = req
        return handle

    def _announce(self, notes: dict) -> None:
        import numpy as np
        payload = json.dumps(notes).encode()
        if len(payload) > _ANNOUNCE_BYTES:
            raise ValueError(f"too many new keys in one call ({len(payload)} bytes of metadata)")
        self.announce.numpy()[: len(payload)] = np.frombuffer(payload, np.uint8)
        req = self.worker.push_pull([(_ANNOUNCE_KEY, len(payload))],
                                    [(_ACK_KEY, s) for s in range(self.num_servers)])
        self.worker.wait(req, self.timeout)
        for s, ack in enumerate(self.acks):
            if int(ack.numpy()[0]) != 0:
                raise stepmesh.FailedPrecondition(
                    f"server {s} refused the key announcement {notes} (see its log)")
        for kind in ("push", "pull"):
            for n in notes[kind]:
                self.announced[kind][n["key"]] = (n["nbytes"], n["dtype"])

    def wait(self, handle: int, timeout_ms: int) -> None:
        req = self.requests.pop(handle, None)
        if req is None:
            raise ValueError(f"unknown or already waited handler {handle}")
        try:
            self.worker.wait(req, timeout_ms / 1000.0)
        except stepmesh.DeadlineExceeded:
            self.requests[handle] = req  # still pending: may be waited again
            raise
        t = self.worker.fetch_trace(req)
        s = t["servers"][0] if t["servers"] else {}
        self.traces[handle] = [s.get("enqueue_ns", 0), s.get("post_ns", 0),
                               s.get("server_arrival_ns", 0), s.get("server_handler_ns", 0),
                               s.get("server_reply_ns", 0), s.get("server_reply_ns", 0),
                               s.get("reply_arrival_ns", 0), t["complete_ns"]]
        if len(self.traces) > 4096:  # bounded: traces of old handlers are dropped
            self.traces.pop(next(iter(self.traces)))

    # ---- server side
    def _init_server(self) -> None:
        s = self.server = stepmesh.Server(_options("server"))
        self.timeout = s.options.timeout
        n = s.num_workers
        self.recv: Dict[int, Tuple[stepmesh.HostTensor, tuple, str]] = {}  # key -> region, row shape
        self.reply: Dict[int, Tuple[stepmesh.HostTensor, int]] = {}  # key -> region, slot bytes
        self.pending: Dict[int, Tuple[Any, int]] = {}  # handler -> (batch entry, worker)
        # Batches taken (key announcements too) and device waits queued
        # (SimpleNotify): the device counts every batch, announcements included.
        self.batches_seen = 0
        self.device_waits = 0
        self.next_handler = 1
        s.register_recv(_ANNOUNCE_KEY, stepmesh.HostTensor([n, _ANNOUNCE_BYTES], "uint8"))
        s.register_reply(_ACK_KEY, stepmesh.HostTensor([n, 1], "int64"))
        s.barrier()

    def _on_announce(self, batch) -> None:
        import numpy as np
        s = self.server
        wanted: Dict[str, Dict[int, dict]] = {"push": {}, "pull": {}}
        for w in batch.workers:
            part = batch.part(_ANNOUNCE_KEY, w).numpy()
            notes = json.loads(part.tobytes().decode())
            for kind in ("push", "pull"):
                for n in notes[kind]:
                    prev = wanted[kind].get(n["key"])
                    if prev is None or n["nbytes"] > prev["nbytes"]:
                        wanted[kind][n["key"]] = n
        status = 0
        try:
            for key, n in wanted["push"].items():
                self._ensure_region(key, n, reply=False)
            for key, n in wanted["pull"].items():
                self._ensure_region(key, n, reply=True)
        except stepmesh.Error as e:
            import sys
            print(f"stepmesh.fserver: key announcement refused: {e}", file=sys.stderr)
            status = 1
        for w in batch.workers:
            s.reply_slot(_ACK_KEY, w).numpy()[0] = status
        s.respond(batch)

    def _ensure_region(self, key: int, note: dict, reply: bool) -> None:
        table = self.reply if reply else self.recv
        n = self.server.num_workers
        shape = note["shape"]
        if key in table:
            region = table[key][0]
            if region.nbytes // n >= note["nbytes"] and region.dtype == note["dtype"]:
                return
            self.server.unregister(key)
            (self.recv if not reply else self.reply).pop(key)
            other = self.recv if reply else self.reply
            if key in other:  # unregister dropped it too: put it back
                o = other.pop(key)
                self._register(key, o[0], not reply)
                other[key] = o
        region = stepmesh.HostTensor([n * shape[0]] + list(shape[1:]), note["dtype"])
        self._register(key, region, reply)
        table[key] = (region, tuple(shape[1:]), note["dtype"])

    def _register(self, key, region, reply):
        if reply:
            self.server.register_reply(key, region)
        else:
            self.server.register_recv(key, region)

    def get_batch(self):
        while True:
            batch = self.server.get_batch(self.timeout)
            self.batches_seen += 1
            if batch.group == _ANNOUNCE_KEY:
                self._on_announce(batch)
                continue
            entry = {"batch": batch, "left": len(batch.workers), "bytes": {}, "stream": None}
            out = []
            for i, w in enumerate(batch.workers):
                handler = self.next_handler
                self.next_handler += 1
                self.pending[handler] = (entry, w, batch.pull_keys[i])
                tensors, keys = [], []
                for t in batch.tensors:
                    if t.valid_bytes[w] == 0:
                        continue
                    tensors.append(_as_user_tensor(t.part(w)))
                    keys.append(t.key)
                out.append((handler, tensors, keys))
            return out

    def respond(self, tensors: Sequence[Any], handler: int) -> None:
        got = self.pending.pop(handler, None)
        if got is None:
            raise ValueError(f"unknown or already answered handler {handler}")
        entry, w, pull_key = got
        want = 0 if pull_key is None else 1
        if len(tensors) != want:
            self.pending[handler] = got
            raise ValueError(f"handler {handler} (worker {w}) pulls {want} tensor(s), "
                             f"respond got {len(tensors)}")
        if want:
            entry["bytes"][w] = _copy(self.server.reply_slot(pull_key, w), tensors[0])
            # A device tensor is copied on torch's current stream: the reply
            # leaves after that copy (a ready event), never before.
            entry["stream"] = entry["stream"] or _current_stream(tensors)
        entry["left"] -= 1
        if entry["left"] == 0:
            self.server.respond(entry["batch"], bytes=entry["bytes"], stream=entry["stream"])

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
        if self.scheduler is not None:
            try:
                self.scheduler.wait_until_done()
            finally:
                self.scheduler.stop()


def _mesh(role: Optional[str] = None) -> _Mesh:
    if _state is None:
        raise RuntimeError("stepmesh.fserver: call init() first")
    if role == "worker" and _state.worker is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {_state.role}, not a worker")
    if role == "server" and _state.server is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {_state.role}, not a server")
    return _state


# --------------------------------------------------------------------------- API

def init() -> None:
    """Joins the mesh named by the environment (role from DMLC_ROLE, default server)."""
    global _state
    with _lock:
        if _state is not None:
            raise RuntimeError("stepmesh.fserver: init() called twice")
        _state = _Mesh(_fserver_env()["role"])


def stop() -> None:
    """Barrier with every participant, then leave (the scheduler waits for all to leave)."""
    global _state
    with _lock:
        mesh, _state = _state, None
    if mesh is not None:
        mesh.close()


def scheduler_address() -> str:
    """host:port the scheduler of this process bound (DMLC_PS_ROOT_PORT=0 picks a free port)."""
    m = _mesh()
    if m.scheduler is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {m.role}, not the scheduler")
    return m.scheduler.address


def register_recv_buffer(tensor, worker_ranks: Sequence[int], keys: Sequence[int]) -> None:
    """Pre-registers a receive region: `tensor` split evenly by worker, all under one key."""
    m = _mesh("server")
    n = m.server.num_workers
    if sorted(worker_ranks) != list(range(n)) or len(set(int(k) for k in keys)) != 1:
        raise stepmesh.Unimplemented(
            "register_recv_buffer: stepmesh registers one region per key with a slot per worker; "
            f"pass worker_ranks=range({n}) and the same key for every worker")
    info = stepmesh.describe(tensor)
    key = int(keys[0])
    m.server.register_recv(key, tensor)
    m.recv[key] = (tensor, tuple(info["shape"][1:]), info["dtype"])


def push_pull(push_tensors, push_keys, pull_tensors, pull_keys, need_event: bool = True) -> int:
    """Attention side: one request; returns the handler for wait(). With
    need_event and device tensors, the send waits (a ready event, not the
    caller) for the work queued so far on torch's current CUDA stream."""
    push_tensors = list(push_tensors)
    stream = _current_stream(push_tensors) if need_event else None
    return _mesh("worker").push_pull(push_tensors, list(push_keys), list(pull_tensors),
                                     list(pull_keys), stream=stream)


def wait(handler: int, timeout_ms: int = 10000) -> None:
    """Blocks (GIL released) until the request finished; stepmesh.DeadlineExceeded after timeout_ms."""
    _mesh("worker").wait(int(handler), timeout_ms)


def get_batch():
    """FFN side: [(handler, [tensors], [keys]) per worker] of the next micro-batch."""
    return _mesh("server").get_batch()


def respond(tensors, handler: int, need_event: bool = False) -> None:
    """FFN side: answers one worker's part of a batch (one tensor per pull, none if it pulled nothing)."""
    _mesh("server").respond(list(tensors), int(handler))


def respond_vec(ret_buffer, tensors_vec, handler_vec) -> None:
    """Answers handler i with ret_buffer's rows for it (tensors_vec[i] rows each, consecutive)."""
    if len(tensors_vec) != len(handler_vec):
        raise ValueError(f"{len(tensors_vec)} tensors but {len(handler_vec)} handlers")
    row = 0
    for t, h in zip(tensors_vec, handler_vec):
        rows = int(t.shape[0])
        respond([ret_buffer[row: row + rows]], h)
        row += rows


def barrier(include_server: bool, include_worker: bool, instance_barrier: bool = True) -> None:
    """A mesh barrier when this process's role is included (stepmesh has one barrier
    over every worker and server: both sides must call it the same number of times)."""
    m = _mesh()
    mine = include_worker if m.worker is not None else include_server
    if mine:
        m.barrier()


def fetch_trace(handler: int) -> List[int]:
    """8 stamps, StepMesh's order: req start, post, server arrival, server handler,
    reply start, reply post, reply arrival, complete (ns; 0 when not taken)."""
    m = _mesh("worker")
    t = m.traces.get(int(handler))
    if t is None:
        raise ValueError(f"no trace for handler {handler} (wait() for it first)")
    return list(t)


def get_all_handlers(handler: int) -> List[int]:
    """stepmesh has one handle per request."""
    return [int(handler)]


def create_stream():
    """A stepmesh.Stream of this process's worker or server backend (not in
    fserver_lib): a CUDA stream on backend 'cuda', a host thread on cpu_mock,
    for SimpleNotify(stream=...)."""
    m = _mesh()
    return (m.worker or m.server).create_stream()


def get_nanosecond() -> int:
    return stepmesh.monotonic_ns()


class SimpleNotify:
    """StepMesh's SimpleNotify on stepmesh's arrival-on-stream calls: a stream
    waits for network data on the device, without a host sync.

    `stream`: the stream to block; None (the default, as in StepMesh) means
    torch's current CUDA stream at each call; a stepmesh.Stream or a
    cudaStream_t int may be given instead.

    * worker: ``stream_wait_event(handler)`` makes the stream wait for that
      request's replies (Worker.wait(req, stream=)); ``wait_event_done()``
      then waits on the host for those requests (as StepMesh's joined thread
      did), which releases their handlers for fetch_trace.
    * server: ``block_now_stream()`` makes the stream wait for the next batch
      (Server.stream_wait_next_batch, counted on the device; batches taken
      before are accounted for). A key announcement (a worker's first
      push_pull of new keys) is a batch too: a stream blocked while one is on
      the way goes when it arrives, so introduce keys before blocking.
      ``block_now_stream_and_get_batch()`` also starts get_batch() on a
      thread, ``get_future_batch_data()`` returns its result.
    """

    def __init__(self, stream=None):
        self._stream = stream
        self._handlers: List[int] = []
        self._future: Optional[threading.Thread] = None
        self._result: list = []

    def init(self) -> None:
        """StepMesh allocates its flag here; stepmesh's flags belong to the mesh."""

    def _target(self):
        if self._stream is not None:
            return self._stream
        torch = _torch()
        if torch is None or not torch.cuda.is_available():
            raise stepmesh.Unimplemented(
                "SimpleNotify() without a stream uses torch's current CUDA stream, and torch "
                "has no CUDA here; pass stream= (a stepmesh.Stream or a cudaStream_t)")
        return torch.cuda.current_stream().cuda_stream

    def stream_wait_event(self, handler: int) -> None:
        m = _mesh("worker")
        req = m.requests.get(int(handler))
        if req is None:
            raise ValueError(f"unknown or already waited handler {handler}")
        m.worker.wait(req, stream=self._target())
        self._handlers.append(int(handler))

    def wait_event_done(self, timeout_ms: int = 10000) -> None:
        handlers, self._handlers = self._handlers, []
        for h in handlers:
            wait(h, timeout_ms)

    def block_now_stream(self) -> None:
        m = _mesh("server")
        stream = self._target()
        # The device counts batches: the n-th wait is for the n-th batch. Waits
        # for batches already taken without one (announcements, batches before
        # the first block) are queued first and pass at once.
        for _ in range(m.batches_seen - m.device_waits):
            m.server.stream_wait_next_batch(stream)
        m.server.stream_wait_next_batch(stream)
        m.device_waits = m.batches_seen + 1

    def block_now_stream_and_get_batch(self) -> None:
        if self._future is not None:
            raise RuntimeError("get_future_batch_data() the previous batch first")
        self.block_now_stream()
        self._result = []

        def fetch():
            try:
                self._result.append(("ok", get_batch()))
            except BaseException as e:  # handed to get_future_batch_data
                self._result.append(("error", e))
        self._future = threading.Thread(target=fetch, daemon=True)
        self._future.start()

    def get_future_batch_data(self):
        if self._future is None:
            raise RuntimeError("block_now_stream_and_get_batch() first")
        m = _mesh("server")
        self._future.join(m.timeout + 5.0)  # get_batch itself gives up after m.timeout
        if self._future.is_alive():
            raise stepmesh.DeadlineExceeded("get_batch() did not return in time")
        self._future = None
        kind, value = self._result[0]
        if kind == "error":
            raise value
        return value


def _unimplemented(name: str):
    def fn(*args, **kwargs):
        raise stepmesh.Unimplemented(f"{name}: CUDA wait-kernel helpers are not provided yet")
    fn.__name__ = name
    return fn


map_pinned_tensor = _unimplemented("map_pinned_tensor")
write_flag = _unimplemented("write_flag")
wait_flag = _unimplemented("wait_flag")
seq_add_one = _unimplemented("seq_add_one")
