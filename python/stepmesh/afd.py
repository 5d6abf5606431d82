"""An Attention-FFN disaggregation connector for serving frameworks.

``Connector`` follows the shape of the vLLM AFD plugin's connector contract
(``init``/``close``/``is_initialized``; ``send_attn_output``/``recv_ffn_output``
on the attention side, ``recv_attn_output``/``send_ffn_output`` on the FFN
side) without importing vLLM, over stepmesh's Worker (attention) and Server
(FFN). docs/python.md describes the contract.

Wire layout, per micro-batch stage ``s`` (keys are ``s * 8 + k``):

* attention rank ``a`` pushes ``HIDDEN`` (``[n_a, hidden]`` rows of its
  ``[max_tokens, hidden]`` stage buffer), ``META`` (int64: layer, stage,
  flags) and, when configured, ``LOGITS`` (``[n_a, router_logits_dim]``
  float32) to every FFN rank, and pulls ``OUT`` from each;
* each FFN rank receives every attention rank's rows into slot ``a`` of one
  registered region and learns ``n_a`` from the frame's byte count (no side
  channel), computes, and replies to rank ``a`` from slot ``a`` of its reply
  region.

Every buffer is allocated and registered once, at ``init``, at its largest
size; per step nothing is registered. With several FFN ranks (experts split
across them) each replies a partial output and ``recv_ffn_output`` sums the
partials in FFN rank order into the caller's preallocated tensor
(``combine="sum"``), or stacks them (``combine="stack"``).

The scheduler is started by the library inside FFN rank 0 (``init``), not by a
subprocess; with ``scheduler="host:0"`` it binds a free port and reports it
through ``on_scheduler(address)`` and ``scheduler_address``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import stepmesh
from stepmesh._connector import join as join_mesh

_KEYS_PER_STAGE = 8
_HIDDEN, _META, _LOGITS, _OUT = 1, 2, 3, 4
_META_WORDS = 4  # layer_idx, stage_idx, flags, reserved
FLAG_WARMUP = 1
FLAG_GRAPH_CAPTURE = 2

# Connector settings and the environment variables they may come from (the
# mesh itself, scheduler address included, comes from MeshOptions.from_env:
# STEPMESH_* / DMLC_*).
_SETTINGS: Dict[str, Tuple[str, Callable[[str], Any], Any]] = {
    # name: (environment variable, parser, default; None = required)
    "role": ("AFD_ROLE", str, None),
    "rank": ("AFD_RANK", int, None),
    "num_attention": ("AFD_NUM_ATTENTION", int, None),
    "num_ffn": ("AFD_NUM_FFN", int, None),
    "hidden_size": ("AFD_HIDDEN_SIZE", int, None),
    "max_tokens": ("AFD_MAX_TOKENS", int, None),
    "num_stages": ("AFD_NUM_STAGES", int, 3),
    "dtype": ("AFD_DTYPE", str, "float32"),
    "router_logits_dim": ("AFD_ROUTER_LOGITS_DIM", int, 0),
    "combine": ("AFD_COMBINE", str, "sum"),
    "array": ("AFD_ARRAY", str, "numpy"),
}


def _key(stage: int, kind: int) -> int:
    return stage * _KEYS_PER_STAGE + kind


@dataclass
class AFDContext:
    """What travels with a stage: ``layer_idx``, ``stage_idx``, ``seq_lens``
    (tokens per attention rank, rank order; their sum is the leading dimension
    of the hidden states), flags, and the zero-copy per-rank ``parts``."""

    layer_idx: int
    stage_idx: int
    seq_lens: List[int]
    is_warmup: bool = False
    is_graph_capturing: bool = False
    parts: List[Any] = field(default_factory=list)
    _batch: Any = None


@dataclass
class AFDPayload:
    hidden_states: Any
    seq_lens: List[int]
    router_logits: Optional[Any]
    context: AFDContext


class Connector:
    """Connector(config=None, **settings): settings from the mapping, then the
    keyword arguments, then the AFD_* environment (see _SETTINGS); the mesh
    options (scheduler, transport, timeout, ...) from ``mesh`` (a
    stepmesh.MeshOptions or a dict) over MeshOptions.from_env()."""

    def __init__(self, config: Optional[Mapping[str, Any]] = None, *,
                 mesh: Any = None, on_scheduler: Optional[Callable[[str], None]] = None,
                 **settings: Any):
        merged = dict(config or {})
        merged.update(settings)
        self.config = self.parse_extra_config(merged)
        self._mesh_arg = mesh
        self._on_scheduler = on_scheduler
        self._node = None
        self._scheduler: Optional[stepmesh.Scheduler] = None
        self._requests: Dict[int, Any] = {}
        self._rows: Dict[int, int] = {}
        self._stash: Dict[int, Any] = {}
        self._plans: List[Any] = []

    # ------------------------------------------------------------ configuration
    @staticmethod
    def parse_extra_config(mapping: Mapping[str, Any]) -> Dict[str, Any]:
        unknown = set(mapping) - set(_SETTINGS)
        if unknown:
            raise ValueError(f"unknown AFD connector setting(s) {sorted(unknown)} "
                             f"(known: {sorted(_SETTINGS)})")
        out: Dict[str, Any] = {}
        for name, (env, parse, default) in _SETTINGS.items():
            if name in mapping:
                value = mapping[name]
            elif stepmesh.environment_value(env):
                raw = stepmesh.environment_value(env)
                try:
                    value = parse(raw)
                except ValueError:
                    raise ValueError(f"{env}={raw!r} is not a valid {name}") from None
            elif default is not None:
                value = default
            else:
                raise ValueError(f"AFD connector setting '{name}' missing (config or {env})")
            out[name] = value
        if out["role"] not in ("attention", "ffn"):
            raise ValueError(f"role={out['role']!r} (want 'attention' or 'ffn')")
        for name in ("num_attention", "num_ffn", "hidden_size", "max_tokens", "num_stages"):
            if int(out[name]) < 1:
                raise ValueError(f"{name}={out[name]} (must be >= 1)")
        peers = out["num_attention"] if out["role"] == "attention" else out["num_ffn"]
        if not 0 <= int(out["rank"]) < peers:
            raise ValueError(f"rank={out['rank']} out of range [0, {peers}) for role {out['role']}")
        if out["dtype"] not in stepmesh.DTYPES:
            raise ValueError(f"dtype={out['dtype']!r} (want one of {stepmesh.DTYPES})")
        if out["combine"] not in ("sum", "stack"):
            raise ValueError(f"combine={out['combine']!r} (want 'sum' or 'stack')")
        if out["array"] not in ("numpy", "torch"):
            raise ValueError(f"array={out['array']!r} (want 'numpy' or 'torch')")
        return out

    def _mesh_options(self) -> stepmesh.MeshOptions:
        c = self.config
        arg = self._mesh_arg
        if isinstance(arg, stepmesh.MeshOptions):
            base = arg
        else:
            base = stepmesh.MeshOptions.from_env(**dict(arg or {}))
        is_attn = c["role"] == "attention"
        return base.copy(num_workers=c["num_attention"], num_servers=c["num_ffn"],
                         rank=c["rank"], role="worker" if is_attn else "server")

    # ---------------------------------------------------------------- lifecycle
    @property
    def is_initialized(self) -> bool:
        return self._node is not None and not self._node.closed

    @property
    def scheduler_address(self) -> Optional[str]:
        return None if self._scheduler is None else self._scheduler.address

    def init(self) -> None:
        if self._node is not None:
            raise RuntimeError("AFD connector already initialised")
        c = self.config
        options = self._mesh_options()
        if c["role"] == "ffn" and c["rank"] == 0:
            self._scheduler = stepmesh.Scheduler(options.copy(role="scheduler"))
            options = options.copy(scheduler=self._scheduler.address)
            if self._on_scheduler is not None:
                self._on_scheduler(self._scheduler.address)
        join_mesh(self, c["role"] == "attention", options)

    init_afd_connector = init  # the vLLM plugin's name

    def close(self) -> None:
        if self._node is None:
            return
        try:
            if not self._node.closed:
                self._node.barrier()  # nobody leaves while a peer still sends
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._plans = []  # they keep the worker object alive
        if self._node is not None:
            try:
                self._node.close()
            finally:
                if self._scheduler is not None:
                    try:
                        self._scheduler.wait_until_done(self._node.options.timeout)
                    except stepmesh.Error:
                        pass  # a peer died: stop regardless
                    self._scheduler.stop()
        elif self._scheduler is not None:
            self._scheduler.stop()

    def __enter__(self) -> "Connector":
        self.init()
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _live(self, role: str):
        if not self.is_initialized:
            raise RuntimeError("AFD connector is not initialised (call init())")
        if self.config["role"] != role:
            raise RuntimeError(f"this connector is the {self.config['role']} side, not {role}")
        return self._node

    def _stage(self, stage_idx: int) -> int:
        if not 0 <= int(stage_idx) < self.config["num_stages"]:
            raise ValueError(f"stage_idx={stage_idx} out of range [0, {self.config['num_stages']})")
        return int(stage_idx)

    # ------------------------------------------------------------ array helpers
    def _array(self, view):
        if self.config["array"] == "torch":
            import torch.utils.dlpack
            return torch.utils.dlpack.from_dlpack(view)
        return view.numpy()

    @staticmethod
    def _like(template, view):
        """`view` as the framework of `template` (torch or numpy)."""
        if type(template).__module__.startswith("torch"):
            import torch.utils.dlpack
            return torch.utils.dlpack.from_dlpack(view)
        return view.numpy()

    # ------------------------------------------------------------ attention side
    def _init_attention(self, options: stepmesh.MeshOptions) -> None:
        c = self.config
        w = self._node = stepmesh.Worker(options)
        n_ffn = c["num_ffn"]
        self._send, self._meta, self._logits, self._recv = [], [], [], []
        for s in range(c["num_stages"]):
            send = stepmesh.HostTensor([c["max_tokens"], c["hidden_size"]], c["dtype"])
            meta = stepmesh.HostTensor([_META_WORDS], "int64")
            w.register_push(_key(s, _HIDDEN), send)
            w.register_push(_key(s, _META), meta)
            logits = None
            if c["router_logits_dim"] > 0:
                logits = stepmesh.HostTensor([c["max_tokens"], c["router_logits_dim"]], "float32")
                w.register_push(_key(s, _LOGITS), logits)
            recv = []
            for f in range(n_ffn):
                r = stepmesh.HostTensor([c["max_tokens"], c["hidden_size"]], c["dtype"])
                w.register_pull(_key(s, _OUT), f, r)
                recv.append(r)
            self._send.append(send)
            self._meta.append(meta)
            self._logits.append(logits)
            self._recv.append(recv)
        # One prepared request per stage: the keys never change, only the row
        # counts (set in place per step), so a step parses nothing and looks
        # nothing up by key (docs/python.md "The AFD connector").
        self._plans = []
        for s in range(c["num_stages"]):
            pushes = [stepmesh.Push(_key(s, _HIDDEN), rows=c["max_tokens"]), _key(s, _META)]
            if c["router_logits_dim"] > 0:
                pushes.append(stepmesh.Push(_key(s, _LOGITS), rows=c["max_tokens"]))
            self._plans.append(w.prepare(pushes, [(_key(s, _OUT), f) for f in range(n_ffn)]))

    def send_buffer(self, stage_idx: int):
        """The registered [max_tokens, hidden] send buffer of a stage: compute into
        its first rows and send_attn_output() sends them without a copy."""
        return self._array(self._send[self._stage(stage_idx)])

    def send_attn_output(self, hidden_states, layer_idx: int, stage_idx: int,
                         router_logits=None, *, is_warmup: bool = False,
                         is_graph_capturing: bool = False) -> None:
        self._live("attention")
        s = self._stage(stage_idx)
        c = self.config
        info = stepmesh.describe(hidden_states)
        shape = info["shape"]
        if len(shape) != 2 or shape[1] != c["hidden_size"]:
            raise ValueError(f"hidden_states shape {shape}: want [tokens, {c['hidden_size']}]")
        if info["dtype"] != c["dtype"]:
            raise ValueError(f"hidden_states dtype {info['dtype']}: connector carries {c['dtype']}")
        n = shape[0]
        if n > c["max_tokens"]:
            raise ValueError(f"{n} tokens exceed max_tokens={c['max_tokens']}")
        if s in self._requests:
            raise RuntimeError(f"stage {s}: recv_ffn_output() of the previous send is pending")
        send = self._send[s]
        if info["data_ptr"] != send.data_ptr:  # not computed in place: copy in
            stepmesh.copy_(send, hidden_states)
        plan = self._plans[s]
        if c["router_logits_dim"] > 0:
            if router_logits is None:
                raise ValueError("router_logits required (router_logits_dim > 0)")
            li = stepmesh.describe(router_logits)
            if li["shape"] != (n, c["router_logits_dim"]) or li["dtype"] != "float32":
                raise ValueError(f"router_logits {li['shape']} {li['dtype']}: want "
                                 f"({n}, {c['router_logits_dim']}) float32")
            stepmesh.copy_(self._logits[s], router_logits)
            plan.set_rows(2, n)
        elif router_logits is not None:
            raise ValueError("router_logits given but router_logits_dim is 0")
        flags = (FLAG_WARMUP if is_warmup else 0) | (FLAG_GRAPH_CAPTURE if is_graph_capturing else 0)
        self._meta[s].numpy()[:3] = (layer_idx, s, flags)
        plan.set_rows(0, n)
        self._requests[s] = plan.post()
        self._rows[s] = n

    def recv_ffn_output(self, out, stage_idx: int, timeout: Optional[float] = None):
        """Waits for the stage's FFN output and writes it into `out` (preallocated:
        [>= tokens, hidden] for combine="sum", [num_ffn, >= tokens, hidden] for
        "stack"); returns `out`."""
        w = self._live("attention")
        s = self._stage(stage_idx)
        req = self._requests.get(s)
        if req is None:
            raise RuntimeError(f"stage {s}: no send_attn_output() to receive for")
        w.wait(req, timeout)
        del self._requests[s]
        n = self._rows[s]
        parts = [self._like(out, r)[:n] for r in self._recv[s]]
        if self.config["combine"] == "stack":
            for f, p in enumerate(parts):
                out[f, :n] = p
        else:
            out[:n] = parts[0]
            for p in parts[1:]:
                out[:n] += p
        return out

    # ------------------------------------------------------------ FFN side
    def _init_ffn(self, options: stepmesh.MeshOptions) -> None:
        c = self.config
        srv = self._node = stepmesh.Server(options)
        slots = c["num_attention"] * c["max_tokens"]
        self._regions, self._replies, self._gather, self._out = [], [], [], []
        for s in range(c["num_stages"]):
            region = stepmesh.HostTensor([slots, c["hidden_size"]], c["dtype"])
            srv.register_recv(_key(s, _HIDDEN), region)
            srv.register_recv(_key(s, _META),
                              stepmesh.HostTensor([c["num_attention"] * _META_WORDS], "int64"))
            if c["router_logits_dim"] > 0:
                srv.register_recv(_key(s, _LOGITS),
                                  stepmesh.HostTensor([slots, c["router_logits_dim"]], "float32"))
            reply = stepmesh.HostTensor([slots, c["hidden_size"]], c["dtype"])
            srv.register_reply(_key(s, _OUT), reply)
            self._regions.append(region)
            self._replies.append(reply)
            # Per-stage buffers for the compact [sum(seq_lens), ...] views.
            self._gather.append(stepmesh.HostTensor([slots, c["hidden_size"]], c["dtype"]))
            self._out.append(None)
        self._gather_logits = [stepmesh.HostTensor([slots, max(1, c["router_logits_dim"])],
                                                   "float32") for _ in range(c["num_stages"])]

    def recv_attn_output(self, stage_idx: Optional[int] = None,
                         timeout: Optional[float] = None) -> AFDPayload:
        """The next stage's hidden states from every attention rank (the given
        stage's when `stage_idx` is set; other stages arriving first are kept)."""
        srv = self._live("ffn")
        want = None if stage_idx is None else self._stage(stage_idx)
        if want is not None and want in self._stash:
            batch = self._stash.pop(want)
        elif want is None and self._stash:
            batch = self._stash.pop(next(iter(self._stash)))
        else:
            while True:
                batch = srv.get_batch(timeout)
                got = batch.group // _KEYS_PER_STAGE
                if want is None or got == want:
                    break
                if got in self._stash:
                    raise RuntimeError(f"stage {got} arrived twice before being received")
                self._stash[got] = batch
        return self._payload(batch)

    def _payload(self, batch) -> AFDPayload:
        c = self.config
        s = batch.group // _KEYS_PER_STAGE
        hidden_t = batch.tensor(_key(s, _HIDDEN))
        meta_t = batch.tensor(_key(s, _META))
        seq_lens = [hidden_t.rows(a) if a in batch.workers else 0
                    for a in range(c["num_attention"])]
        parts = [hidden_t.part(a) for a in batch.workers]
        total = sum(seq_lens)
        # Compact: each rank's rows one after the other in the stage's gather buffer.
        gather = self._array(self._gather[s])
        row = 0
        for a, p in zip(batch.workers, parts):
            gather[row: row + p.rows] = self._array(p)
            row += p.rows
        hidden = gather[:total]
        logits = None
        if c["router_logits_dim"] > 0:
            lt = batch.tensor(_key(s, _LOGITS))
            lg = self._array(self._gather_logits[s])
            row = 0
            for a in batch.workers:
                p = lt.part(a)
                lg[row: row + p.rows] = self._array(p)
                row += p.rows
            logits = lg[:total]
        meta = meta_t.part(batch.workers[0]).numpy()
        ctx = AFDContext(layer_idx=int(meta[0]), stage_idx=int(meta[1]), seq_lens=seq_lens,
                         is_warmup=bool(meta[2] & FLAG_WARMUP),
                         is_graph_capturing=bool(meta[2] & FLAG_GRAPH_CAPTURE),
                         parts=[self._array(p) for p in parts], _batch=batch)
        return AFDPayload(hidden, seq_lens, logits, ctx)

    def send_ffn_output(self, ffn_output, context: AFDContext) -> None:
        """Replies `ffn_output` ([sum(seq_lens), hidden], rank order) to the attention ranks."""
        srv = self._live("ffn")
        batch = context._batch
        if batch is None or batch.answered:
            raise RuntimeError("context already answered (or not from recv_attn_output)")
        c = self.config
        total = sum(context.seq_lens)
        info = stepmesh.describe(ffn_output)
        if info["shape"][:1] != (total,) or info["dtype"] != c["dtype"]:
            raise ValueError(f"ffn_output {info['shape']} {info['dtype']}: want "
                             f"[{total}, {c['hidden_size']}] {c['dtype']}")
        s = context.stage_idx
        row = 0
        rows = {}
        for a in batch.workers:
            n = context.seq_lens[a]
            slot = self._array(srv.reply_slot(_key(s, _OUT), a))
            slot[:n] = ffn_output[row: row + n]
            rows[a] = n
            row += n
        srv.respond(batch, rows=rows)
