"""A drop-in for StepMesh's ``fserver_lib`` on top of stepmesh.

``import fserver_lib as f`` (python/compat/ installs that name, and the
``fserver`` package, as this module) and StepMesh-style programs keep their
shape: ``f.init()``, ``f.push_pull(...)``, ``f.wait(h)``, ``f.get_batch()``,
``f.respond(...)``, ``f.barrier(...)``, ``f.fetch_trace(h)``, ``f.stop()``,
configured by the same ``DMLC_*`` / ``STEPMESH_*`` variables, every one a row
of the one environment table (src/core/env.cc), read here through
``MeshOptions.from_env()``.

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
* StepMesh's get_batch() pops each worker's oldest request: here each
  worker's n-th request carries stage n (SendOptions::stage), so the servers'
  n-th batch holds every worker's n-th request whatever its keys.
* ``pull_tensors`` is server-major: with one per server, ``pull_tensors[i]``
  is answered by server ``i``; several per server travel as one reply into a
  staging buffer that wait() copies out of.
* ``DMLC_GROUP_SIZE=g``: instance i of every group forms mesh i (scheduler
  port + i), GPU i talking to GPU i only.
* ``get_batch()`` returns one ``(handler, [tensors], [keys])`` per worker, in
  worker-rank order; the tensors are zero-copy views of the receive region
  (torch tensors when torch is importable, else numpy arrays; a numpy-less
  dtype such as bfloat16 without torch comes as a ``stepmesh.TensorSlice``).
* ``respond_vec`` gives each handler *its own* rows of ``ret_buffer``
  (consecutive, in handler order), where StepMesh slices row 0 for everyone.
* Membership (docs/elastic.md). StepMesh's shape is fixed at start
  (``DMLC_NUM_WORKER``/``DMLC_NUM_SERVER``; ps-lite's ``NumWorkers()``/
  ``NumServers()``/``MyRank()``, and ``Finalize`` as the only goodbye, a
  barrier of everyone). Here ``membership()``, ``wait_membership_change()``
  and ``leave()`` are stepmesh's ``Worker``/``Server`` ``membership``,
  ``wait_membership_change`` and ``leave`` with the same semantics (epochs,
  drains); ``leave()`` is the goodbye of one participant alone, where
  ``stop()`` is StepMesh's collective one. A ``get_batch()`` after a worker
  left holds the remaining workers' requests only.

The parts (private modules, their names reachable here as before):
``_fserver_launch`` (launch variables to mesh options), ``_fserver_tensors``
(torch/numpy helpers), ``_fserver_mesh`` (the ``_Mesh`` class and the one
instance of it: ``init``, ``stop``, ``leave``, ``_mesh()``), its mixins
``_fserver_worker``, ``_fserver_server`` and ``_fserver_announce`` (the key
announcement protocol), ``_fserver_flags`` (the host flags of StepMesh's wait
kernels); this module holds the rest of the API and ``SimpleNotify``.

docs/python.md has the migration notes and every remaining difference.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import stepmesh
from stepmesh import _fserver_announce, _fserver_flags, _fserver_launch, _fserver_mesh
from stepmesh import _fserver_tensors
from stepmesh._fserver_flags import map_pinned_tensor, seq_add_one, wait_flag, write_flag
from stepmesh._fserver_mesh import _mesh, _participant, init, stop
from stepmesh._fserver_tensors import _current_stream, _empty_like, _torch

leave = _fserver_mesh.leave  # public, though not fserver_lib's (so not in __all__)

# The parts' other private names, reachable here as they were before the split
# (tests and programs use some, e.g. stepmesh.fserver._mesh()).
_ANNOUNCE_KEY = _fserver_announce._ANNOUNCE_KEY
_ACK_KEY = _fserver_announce._ACK_KEY
_ANNOUNCE_BYTES = _fserver_announce._ANNOUNCE_BYTES
_ACK_BYTES = _fserver_announce._ACK_BYTES
_launch = _fserver_launch._launch
_scheduler_port = _fserver_launch._scheduler_port
_instance_options = _fserver_launch._instance_options
_as_user_tensor = _fserver_tensors._as_user_tensor
_bytes_of = _fserver_tensors._bytes_of
_copy = _fserver_tensors._copy
_Mesh = _fserver_mesh._Mesh
_lock = _fserver_mesh._lock
_is_cuda = _fserver_flags._is_cuda
_scalar = _fserver_flags._scalar
_unpinned_with_cuda = _fserver_flags._unpinned_with_cuda


def __getattr__(name: str) -> Any:
    # _state (the process's mesh) is rebound by init/stop/leave: read it where it lives.
    if name == "_state":
        return _fserver_mesh._state
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- API

def membership() -> stepmesh.Membership:
    """The mesh membership as this process last heard it (``stepmesh.Membership``:
    ``epoch``, ``workers``, ``servers``; ranks ascending). Epoch 0 is the shape
    the mesh formed with; every join, leave (or start of a drain) and loss after
    it is the next, the same number at every participant (with etcd: the store
    revision of the change). stepmesh's ``Worker/Server.membership``."""
    return _participant().membership


def wait_membership_change(after_epoch: int, timeout_ms: int = 10000) -> stepmesh.Membership:
    """Blocks (the GIL released) until the membership's epoch is past
    ``after_epoch`` and returns it (several changes meanwhile come as one, the
    newest); ``stepmesh.DeadlineExceeded`` after ``timeout_ms``, ``stepmesh.Cancelled``
    once this participant left. stepmesh's ``wait_membership_change``."""
    return _participant().wait_membership_change(after_epoch, timeout_ms / 1000.0)


def scheduler_address() -> str:
    """host:port the scheduler of this process bound (DMLC_PS_ROOT_PORT=0 picks a free port)."""
    m = _mesh()
    if m.scheduler is None:
        raise RuntimeError(f"stepmesh.fserver: this process is a {m.role}, not the scheduler")
    return m.scheduler.address


def register_recv_buffer(tensor, worker_ranks: Sequence[int], keys: Sequence[int]) -> None:
    """StepMesh's RegisterRecvTensor: `tensor` split evenly (by rows) into
    len(worker_ranks) chunks, chunk i receiving key keys[i] from worker
    worker_ranks[i]. stepmesh registers a region per key with a slot per
    worker: a key whose chunks are every worker's, consecutive in rank order,
    is received in place; any other key (a subset of the workers, another
    order) gets a region of its own, and get_batch's tensors are views of it
    (the chunks of `tensor` are then not written)."""
    m = _mesh("server")
    n = m.server.num_workers
    ranks = [int(r) for r in worker_ranks]
    keys = [int(k) for k in keys]
    if not ranks or len(ranks) != len(keys):
        raise ValueError(f"register_recv_buffer: {len(ranks)} worker ranks but {len(keys)} keys "
                         "(one key per chunk, at least one)")
    for r in ranks:
        if not 0 <= r < n:
            raise ValueError(f"register_recv_buffer: worker rank {r} outside [0, {n})")
    info = stepmesh.describe(tensor)
    shape = list(info["shape"]) or [1]
    if shape[0] % len(ranks) != 0:
        raise ValueError(f"register_recv_buffer: {shape[0]} rows do not split into "
                         f"{len(ranks)} equal chunks")
    rows = shape[0] // len(ranks)
    by_key: Dict[int, List[Tuple[int, int]]] = {}
    for i, (r, k) in enumerate(zip(ranks, keys)):
        if any(r == other for other, _ in by_key.get(k, [])):
            raise ValueError(f"register_recv_buffer: key {k} given twice for worker {r}")
        by_key.setdefault(k, []).append((r, i))
    for key, chunks in by_key.items():
        chunks.sort()
        first = chunks[0][1]
        in_place = ([r for r, _ in chunks] == list(range(n)) and
                    [i for _, i in chunks] == list(range(first, first + n)))
        if in_place:
            region = tensor[first * rows:(first + n) * rows]
        else:
            region = _empty_like(tensor, [n * rows] + shape[1:])
        if key in m.recv:
            m.server.unregister(key)
            m.recv.pop(key)
            if key in m.reply:  # unregister dropped the key's reply region too: put it back
                m._register(key, m.reply[key][0], True)
        m.server.register_recv(key, region)
        m.recv[key] = (region, tuple(shape[1:]), info["dtype"])


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
    """FFN side: [(handler, [tensors], [keys]) per worker] of the next micro-batch.
    Waits as long as the workers run, as StepMesh's does; stepmesh.Unavailable
    when every worker is gone (left, or silent for STEPMESH_TIMEOUT)."""
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


def barrier(include_server: bool, include_client: Optional[bool] = None,
            instance_barrier: bool = True, *, include_worker: Optional[bool] = None) -> None:
    """StepMesh's barrier(include_server, include_client, instance_barrier=True)
    (include_worker= is taken for include_client). A mesh barrier when this
    process's role is included: stepmesh has one barrier over every worker and
    server of the mesh (of this instance), so both sides must call it the same
    number of times; instance_barrier is accepted (every barrier here is one
    mesh's, i.e. an instance barrier)."""
    if include_client is None and include_worker is None:
        raise TypeError("barrier() needs include_client (StepMesh's name) or include_worker")
    if include_client is not None and include_worker is not None:
        raise TypeError("barrier(): give include_client or include_worker, not both")
    include_client = include_client if include_client is not None else include_worker
    m = _mesh()
    if m.worker is None and m.server is None:
        return  # the scheduler takes part in no barrier
    mine = include_client if m.worker is not None else include_server
    if mine:
        m.barrier()


def fetch_trace(handler: int) -> List[int]:
    """8 stamps (ns of CLOCK_MONOTONIC; 0 when not taken), StepMesh's order:
    [0] push_pull called, [1] the send thread posted the pushes, [2] the last
    push byte arrived at the server, [3] the batch was handed to get_batch,
    [4] respond() was called, [5] the server posted the reply, [6] the reply
    landed at the worker, [7] the request completed. 0, 1, 6, 7 are the
    worker's clock, 2..5 the server's: take differences within one host.
    `handler` is a push_pull handle or one of get_all_handlers(); every push
    and pull of a request shares its reply, so they report the same stamps
    (those of the server whose reply landed last)."""
    m = _mesh("worker")
    base = m.handles.get(int(handler), (int(handler),))[0]
    t = m.traces.get(base)
    if t is None:
        raise ValueError(f"no trace for handler {handler} (wait() for it first)")
    return list(t)


def get_all_handlers(handler: int) -> List[int]:
    """StepMesh's handles of one push_pull: one per push tensor, then one per
    pull slot of a server (pull_tensors[i] is server i's), the first being the
    push_pull's own handle; each works with wait() and fetch_trace()."""
    m = _mesh("worker")
    h = int(handler)
    if m.handles.get(h, (None,))[0] != h:
        raise ValueError(f"unknown handler {handler} (a push_pull's handle, not yet dropped)")
    out = []
    while m.handles.get(h, (None,))[0] == int(handler):
        out.append(h)
        h += 1
    return out


def create_stream():
    """A stepmesh.Stream of this process's worker or server backend (not in
    fserver_lib): a CUDA stream on backend 'cuda', a host thread on cpu_mock,
    for SimpleNotify(stream=...)."""
    m = _mesh()
    return (m.worker or m.server).create_stream()


def get_nanosecond() -> int:
    """This host's CLOCK_MONOTONIC in ns, the clock fetch_trace's stamps are on
    (StepMesh's is a TSC-based clock, 0 without its trace build; this one always
    runs). Differences of two readings on one host are durations."""
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
        # get_batch() waits as long as the workers live, and raises when they are gone.
        while self._future.is_alive():
            self._future.join(1.0)
        self._future = None
        kind, value = self._result[0]
        if kind == "error":
            raise value
        return value


# fserver_lib's names (StepMesh's ops.cc, public.hpp, private.hpp), plus this
# module's scheduler_address() and create_stream().
__all__ = [
    "init", "stop", "register_recv_buffer", "push_pull", "wait", "get_batch", "respond",
    "respond_vec", "fetch_trace", "get_all_handlers", "barrier", "get_nanosecond",
    "SimpleNotify", "map_pinned_tensor", "write_flag", "wait_flag", "seq_add_one",
    "scheduler_address", "create_stream",
]
