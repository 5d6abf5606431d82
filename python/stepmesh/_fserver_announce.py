"""The key announcement protocol: a worker introduces its new keys in-band,
on two reserved keys, before the data request that uses them; every server
then registers a receive region (a slot per worker) and, for pull keys, a
reply region, sized by the announcement, and acknowledges it (int64 status
0, else a refusal). Both halves, a mixin of :class:`_fserver_mesh._Mesh`
whose worker (:mod:`_fserver_worker`) and server (:mod:`_fserver_server`)
state it uses. Part of :mod:`stepmesh.fserver`."""

from __future__ import annotations

import json
from typing import Dict

import stepmesh

# Reserved keys of the announcement protocol (the two largest keys).
_ANNOUNCE_KEY = (1 << 64) - 2  # worker -> server: JSON list of new keys
_ACK_KEY = (1 << 64) - 3  # server -> worker: int64 status per announcement
_ANNOUNCE_BYTES = 64 * 1024
_ACK_BYTES = 8


class KeyAnnouncements:
    """The mesh's announcement methods (see the module docstring)."""

    # ---- worker side
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

    # ---- server side
    def _on_announce(self, batch) -> None:
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
