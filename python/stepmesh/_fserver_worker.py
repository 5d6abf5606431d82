"""The worker (attention) side of the fserver mesh: StepMesh's push_pull and
wait over a stepmesh Worker, a key registered the first time it is used
(announced to the servers, :mod:`_fserver_announce`), several pulls per
server staged through host memory, StepMesh's handles and traces. A mixin of
:class:`_fserver_mesh._Mesh`. Part of :mod:`stepmesh.fserver`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import stepmesh
from stepmesh._fserver_announce import _ACK_KEY, _ANNOUNCE_BYTES, _ANNOUNCE_KEY
from stepmesh._fserver_tensors import _bytes_of


class WorkerSide:
    """The mesh's worker-side methods (see the module docstring)."""

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
