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

docs/python.md has the migration notes and every remaining difference.
"""

from __future__ import annotations

import json
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

# Every variable is read by the one environment table (src/core/env.cc):
# MeshOptions.from_env() gives the DMLC_* / STEPMESH_* settings, the fserver_lib
# launch ones in its fserver_* fields. This module reads no environment itself.

def _launch() -> Tuple[stepmesh.MeshOptions, Dict[str, Any]]:
    """The options of the environment and what fserver_lib derives from them."""
    opts = stepmesh.MeshOptions.from_env()
    role = opts.fserver_role or "server"  # fserver_lib's default role
    g = opts.fserver_group_size
    instance = opts.fserver_instance_id
    if instance < 0:
        instance = opts.fserver_gpu + opts.fserver_rank_offset
    if g > 1 and not 0 <= instance < g:
        raise ValueError(f"instance {instance} (DMLC_INSTANCE_ID, else STEPMESH_GPU + "
                         f"DMLC_RANK_OFFSET) is outside DMLC_GROUP_SIZE={g}")
    # StepMesh's rank rule: DMLC_NODE_RANK * DMLC_GROUP_SIZE + STEPMESH_GPU + DMLC_RANK_OFFSET.
    # With DMLC_GROUP_SIZE > 1, instance i of every group forms its own mesh
    # (GPU i talks to GPU i), in which the group's rank is the rank.
    rank = opts.fserver_node_rank if g > 1 else (
        opts.fserver_node_rank + opts.fserver_gpu + opts.fserver_rank_offset)
    return opts, {"role": role, "group_size": g, "instance": instance, "rank": rank}


def _scheduler_port(address: str) -> int:
    host, _, port = address.rpartition(":")
    return int(port)


def _instance_options(opts: stepmesh.MeshOptions, role: str, launch: Dict[str, Any],
                      instance: int, port: Optional[int] = None) -> stepmesh.MeshOptions:
    """The options of `role` in mesh `instance` (its scheduler on port + instance)."""
    changes: Dict[str, Any] = {"role": role}
    base = _scheduler_port(opts.scheduler) if port is None else port  # `port`: the one bound
    offset = instance if launch["group_size"] > 1 else 0
    if base != 0 and (offset or port is not None):
        host = opts.scheduler.rpartition(":")[0]
        changes["scheduler"] = f"{host}:{base + offset}"
    if role != "scheduler" and opts.rank < 0:  # STEPMESH_RANK, when set, wins
        changes["rank"] = launch["rank"]
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


def _bytes_of(t):
    """A flat uint8 view (torch or numpy) of a contiguous tensor's bytes; the
    memory is shared. Host tensors, and torch device tensors."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        return t.reshape(-1).view(torch.uint8)
    import numpy as np
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    return _bytes_of(_as_user_tensor(t))  # a HostTensor / TensorSlice: through DLPack


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

    # ---- worker side
    def _init_worker(self, options: stepmesh.MeshOptions) -> None:
        w = self.worker = stepmesh.Worker(options)
        self.seq = 0  # requests sent: the n-th of every worker forms the servers' n-th batch
        self.next_handle = 1
        self.handles: Dict[int, Tuple[int, str, int]] = {}  # sub-handle -> (handle, kind, i)
        # Several pulls per server: key -> part capacities, (key, server) -> staging
        # buffer, handle -> [(staging, offset, bytes, user tensor)] to copy after wait.
        self.pull_parts: Dict[int, List[int]] = {}
        self.pull_stage: Dict[Tuple[int, int], stepmesh.HostTensor] = {}
        self.copyouts: Dict[int, list] = {}
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
        per = 1
        if len(pull_tensors) > self.num_servers:
            if len(pull_tensors) % self.num_servers:
                raise ValueError(f"{len(pull_tensors)} pull tensors for {self.num_servers} "
                                 "server(s): several pulls per server come server-major, the same "
                                 "number from each")
            per = len(pull_tensors) // self.num_servers
        if not push_keys:
            raise ValueError("a request needs at least one push")
        copyouts = []
        if per > 1:  # StepMesh's server-major layout: slot j of server s is s * per + j
            pull_tensors, pull_keys, copyouts = self._group_pulls(list(pull_tensors),
                                                                  list(pull_keys), per)
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
        for n in notes["pull"]:
            if n["key"] in self.pull_parts:
                n["parts"] = self.pull_parts[n["key"]]
        if notes["push"] or notes["pull"]:
            self._announce(notes)
        req = self.worker.push_pull([(int(k), nbytes[int(k)]) for k in push_keys],
                                    [(int(k), s) for s, k in enumerate(pull_keys)],
                                    stream=stream, stage=self._next_stage())
        # StepMesh's handles: one per push tensor, then one per pull slot of a
        # server; the first names the request.
        handle = self.next_handle
        count = len(push_keys) + (per if pull_keys else 0)
        self.next_handle += count
        self.requests[handle] = req
        if copyouts:
            self.copyouts[handle] = copyouts
        for i in range(count):
            self.handles[handle + i] = (handle, "push" if i < len(push_keys) else "pull", i)
        return handle

    def _group_pulls(self, tensors: list, keys: list, per: int):
        """Several pulls per server: server s's `per` tensors travel as one reply
        under its first key, into a staging buffer that wait() copies out of.
        Returns the one-per-server tensors and keys, and the copies to make."""
        out_tensors, out_keys, copyouts = [], [], []
        for s in range(self.num_servers):
            mine = tensors[s * per:(s + 1) * per]
            mykeys = [int(k) for k in keys[s * per:(s + 1) * per]]
            if len(set(mykeys)) != per:
                raise ValueError(f"server {s}'s pull keys {mykeys} repeat a key")
            infos = [stepmesh.describe(t) for t in mine]
            if any(i["device"] != "cpu" for i in infos):
                raise stepmesh.Unimplemented(
                    "several pulls per server are staged through host memory: host tensors only")
            wire = mykeys[0]
            parts = self.pull_parts.get(wire)
            if parts is None:  # the first use of the layout is its largest, as for any key
                parts = self.pull_parts[wire] = [i["nbytes"] for i in infos]
                self.pull_stage[(wire, s)] = stepmesh.HostTensor([sum(parts)], "uint8")
            elif len(parts) != per or any(i["nbytes"] > cap for i, cap in zip(infos, parts)):
                raise ValueError(f"pull key {wire}: {per} pulls of "
                                 f"{[i['nbytes'] for i in infos]} bytes, but its first use was "
                                 f"{len(parts)} of {parts} bytes (at most)")
            if (wire, s) not in self.pull_stage:
                self.pull_stage[(wire, s)] = stepmesh.HostTensor([sum(parts)], "uint8")
            staging = self.pull_stage[(wire, s)]
            offset = 0
            for t, info, cap in zip(mine, infos, parts):
                copyouts.append((staging, offset, info["nbytes"], t))
                offset += cap
            out_tensors.append(staging)
            out_keys.append(wire)
        return out_tensors, out_keys, copyouts

    def _next_stage(self) -> int:
        """StepMesh's batching rule: the servers' n-th batch holds every worker's n-th
        request, whatever its keys (a stage per request, counting key announcements)."""
        stage = self.seq & 0xFFFFFFFF
        self.seq += 1
        return stage

    def _announce(self, notes: dict) -> None:
        import numpy as np
        payload = json.dumps(notes).encode()
        if len(payload) > _ANNOUNCE_BYTES:
            raise ValueError(f"too many new keys in one call ({len(payload)} bytes of metadata)")
        self.announce.numpy()[: len(payload)] = np.frombuffer(payload, np.uint8)
        # To the servers of the current membership (a push to every server
        # goes there too); one that drained or was lost is not asked.
        servers = self.worker.membership.servers
        req = self.worker.push_pull([(_ANNOUNCE_KEY, len(payload))],
                                    [(_ACK_KEY, s) for s in servers],
                                    stage=self._next_stage())
        self.worker.wait(req, self.timeout)
        for s in servers:
            if int(self.acks[s].numpy()[0]) != 0:
                raise stepmesh.FailedPrecondition(
                    f"server {s} refused the key announcement {notes} (see its log)")
        for kind in ("push", "pull"):
            for n in notes[kind]:
                self.announced[kind][n["key"]] = (n["nbytes"], n["dtype"])

    def wait(self, handle: int, timeout_ms: int) -> None:
        handle = self.handles.get(handle, (handle,))[0]  # a sub-handle waits for its request
        req = self.requests.pop(handle, None)
        if req is None:
            raise ValueError(f"unknown or already waited handler {handle}")
        try:
            self.worker.wait(req, timeout_ms / 1000.0)
        except stepmesh.DeadlineExceeded:
            self.requests[handle] = req  # still pending: may be waited again
            raise
        for staging, offset, nbytes, user in self.copyouts.pop(handle, []):
            _bytes_of(user)[:nbytes] = _bytes_of(staging)[offset:offset + nbytes]
        t = self.worker.fetch_trace(req)
        # StepMesh keeps the trace of a handle's last response: the server whose
        # reply landed last (every push and pull of a request shares its reply).
        s = max(t["servers"], key=lambda x: x.get("reply_arrival_ns", 0), default={})
        self.traces[handle] = [s.get("enqueue_ns", 0), s.get("post_ns", 0),
                               s.get("server_arrival_ns", 0), s.get("server_handler_ns", 0),
                               s.get("server_respond_ns", 0), s.get("server_reply_ns", 0),
                               s.get("reply_arrival_ns", 0), t["complete_ns"]]
        while len(self.traces) > 4096:  # bounded: traces of old handlers are dropped
            old = next(iter(self.traces))
            self.traces.pop(old)
            sub = old
            while self.handles.get(sub, (None,))[0] == old:
                self.handles.pop(sub)
                sub += 1

    # ---- server side
    def _init_server(self, options: stepmesh.MeshOptions) -> None:
        s = self.server = stepmesh.Server(options)
        self.timeout = s.options.timeout
        n = s.num_workers
        self.recv: Dict[int, Tuple[stepmesh.HostTensor, tuple, str]] = {}  # key -> region, row shape
        self.reply: Dict[int, Tuple[stepmesh.HostTensor, int]] = {}  # key -> region, slot bytes
        self.pending: Dict[int, Tuple[Any, int]] = {}  # handler -> (batch entry, worker)
        self.pull_parts: Dict[int, List[int]] = {}  # key -> part capacities (several pulls)
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
                if "parts" in n:
                    self.pull_parts[key] = n["parts"]
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
            info = stepmesh.describe(table[key][0])
            if info["nbytes"] // n >= note["nbytes"] and info["dtype"] == note["dtype"]:
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
            try:
                batch = self.server.get_batch(self.timeout)
            except stepmesh.DeadlineExceeded:
                # StepMesh's get_batch waits as long as the workers run (an idle
                # attention side is no error); when every worker is gone it ends
                # here with stepmesh.Unavailable (liveness is the mesh's).
                continue
            self.batches_seen += 1
            if any(t.key == _ANNOUNCE_KEY for t in batch.tensors):
                if len(batch.tensors) != 1:
                    raise stepmesh.FailedPrecondition(
                        "a key announcement arrived in the same batch as data: every worker "
                        "must introduce its new keys in the same push_pull call")
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
        parts = self.pull_parts.get(pull_key) if pull_key is not None else None
        want = 0 if pull_key is None else len(parts) if parts else 1
        if len(tensors) != want:
            self.pending[handler] = got
            raise ValueError(f"handler {handler} (worker {w}) pulls {want} tensor(s), "
                             f"respond got {len(tensors)}")
        if parts:  # several pulls: each part at its offset of the one reply
            slot = _bytes_of(_as_user_tensor(self.server.reply_slot(pull_key, w)))
            offset = end = 0
            for j, (t, cap) in enumerate(zip(tensors, parts)):
                src = _bytes_of(t)
                if src.shape[0] > cap:
                    self.pending[handler] = got
                    raise ValueError(f"handler {handler}: pull {j} of {src.shape[0]} bytes, more "
                                     f"than the {cap} its worker pulls")
                slot[offset:offset + src.shape[0]] = src
                end = offset + src.shape[0]
                offset += cap
            entry["bytes"][w] = end
            entry["stream"] = entry["stream"] or _current_stream(tensors)
        elif want:
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


# --------------------------------------------------------------------------- API

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


def _empty_like(tensor, shape: List[int]):
    """A tensor of `shape` of `tensor`'s kind, dtype and device."""
    torch = _torch()
    if torch is not None and isinstance(tensor, torch.Tensor):
        return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    return stepmesh.HostTensor(shape, stepmesh.describe(tensor)["dtype"])


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


# ------------------------------------------------------------ host flags (wait kernels)
#
# StepMesh's wait_kernel.cu helpers let a CUDA graph signal a CPU proxy thread
# and wait for its acknowledgement: flags are int64 tensors in mapped pinned
# host memory, `seq` an int64 counter. Here, on host tensors, they run on the
# calling thread in program order (the cpu_mock's stream is the caller), with
# the same meaning; on CUDA tensors write_flag and seq_add_one are queued on
# torch's current stream (graph-capturable), and wait_flag, which needs a spin
# kernel, is refused (docs/python.md).

def _is_cuda(t) -> bool:
    return bool(getattr(t, "is_cuda", False))


def _scalar(t) -> int:
    return int(t.reshape(-1)[0])


def map_pinned_tensor(tensor, device_index: int):
    """The view of host-flag memory a stream uses: on the CPU (cpu_mock) the
    host tensor itself; with CUDA, `tensor` must be pinned (page-locked) host
    memory, which the device addresses directly (unified addressing), and it is
    returned as is for write_flag / wait_flag."""
    if int(device_index) < 0:
        raise ValueError(f"map_pinned_tensor: device_index {device_index} is negative")
    if stepmesh.describe(tensor)["device"] != "cpu":
        raise ValueError("map_pinned_tensor: wants a host tensor (the flag lives in host memory)")
    if _unpinned_with_cuda(tensor):
        raise ValueError("map_pinned_tensor: with CUDA the host tensor must be pinned "
                         "(torch.empty(..., pin_memory=True))")
    return tensor


def _unpinned_with_cuda(tensor) -> bool:
    """True when torch has CUDA and `tensor` is a torch host tensor that is not pinned."""
    torch = _torch()
    return (torch is not None and torch.cuda.is_available() and isinstance(tensor, torch.Tensor)
            and not tensor.is_pinned())


def write_flag(flag, seq) -> None:
    """flag[0] = seq[0] (int64), visible to other threads once it returns (host),
    or once torch's current stream reaches it (CUDA seq: a device-to-host copy)."""
    if _is_cuda(seq):
        flag.reshape(-1)[:1].copy_(seq.reshape(-1)[:1], non_blocking=True)
        return
    flag.reshape(-1)[0] = _scalar(seq)


def seq_add_one(seq) -> None:
    """seq[0] += 1 (on torch's current stream for a CUDA seq)."""
    if _is_cuda(seq):
        seq.reshape(-1)[:1].add_(1)
        return
    flag = seq.reshape(-1)
    flag[0] = int(flag[0]) + 1


def wait_flag(flag, seq, *, timeout_ms: Optional[int] = None) -> None:
    """Until flag[0] >= seq[0]. A CUDA seq: torch's current stream waits on the
    device (a one-thread kernel reading both words when it runs, so it captures
    into CUDA graphs; needs backend cuda; timeout_ms does not apply). A host
    seq: the caller blocks, polling (yielding, then
    sleeping 50 us), at most `timeout_ms` (default: the mesh's STEPMESH_TIMEOUT,
    30 s before init): stepmesh.DeadlineExceeded names both values then."""
    if _is_cuda(seq):
        # On the device, as StepMesh's spin kernel: torch's current stream waits
        # (graph-safe: both words are read at every replay); the host goes on.
        m = _mesh()
        node = m.worker if m.worker is not None else m.server
        if flag.dtype != seq.dtype or str(seq.dtype) != "torch.int64":
            raise ValueError(f"wait_flag: flag and seq must be int64, got {flag.dtype} and {seq.dtype}")
        node.stream_wait_counter(flag.data_ptr(), seq.data_ptr(),
                                 _torch().cuda.current_stream().cuda_stream)
        return
    import time
    want = _scalar(seq)
    if timeout_ms is None:
        limit = _state.timeout if _state is not None and hasattr(_state, "timeout") else 30.0
    else:
        limit = timeout_ms / 1000.0
    deadline = time.monotonic() + limit
    spins = 0
    view = flag.reshape(-1)
    while int(view[0]) < want:
        spins += 1
        if time.monotonic() >= deadline:
            raise stepmesh.DeadlineExceeded(
                f"wait_flag: flag is {int(view[0])}, still below seq {want} after {limit} s")
        time.sleep(0 if spins < 1000 else 50e-6)


# fserver_lib's names (StepMesh's ops.cc, public.hpp, private.hpp), plus this
# module's scheduler_address() and create_stream().
__all__ = [
    "init", "stop", "register_recv_buffer", "push_pull", "wait", "get_batch", "respond",
    "respond_vec", "fetch_trace", "get_all_handlers", "barrier", "get_nanosecond",
    "SimpleNotify", "map_pinned_tensor", "write_flag", "wait_flag", "seq_add_one",
    "scheduler_address", "create_stream",
]
