"""The server (FFN) side of the fserver mesh: StepMesh's get_batch and
respond over a stepmesh Server, one handler per worker of a batch, key
announcements answered on the way (:mod:`_fserver_announce`), several pulls
per server written at their offsets of one reply. A mixin of
:class:`_fserver_mesh._Mesh`. Part of :mod:`stepmesh.fserver`."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import stepmesh
from stepmesh._fserver_announce import _ACK_KEY, _ANNOUNCE_BYTES, _ANNOUNCE_KEY
from stepmesh._fserver_tensors import _as_user_tensor, _bytes_of, _copy, _current_stream


class ServerSide:
    """The mesh's server-side methods (see the module docstring)."""

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
