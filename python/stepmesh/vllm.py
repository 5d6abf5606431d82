"""``StepMeshAFDConnector``: stepmesh as a connector of vLLM's AFD plugin.

The plugin (``vllm-project/afd-plugin``) picks a connector by name and builds
it as ``cls(rank, local_rank, vllm_config, afd_config, role_rank)``. This
module is that connector over stepmesh's Worker (attention) and Server (FFN):

* the base classes and metadata types are the plugin's own when
  ``afd_plugin`` is importable, else a minimal internal copy of their shape
  (``PLUGIN_BASE`` says which), so the module also works without vLLM;
* everything comes from ``afd_config`` (role, ``num_attention_ranks``,
  ``num_ffn_ranks``, ``host``/``port``), ``role_rank`` and vLLM's standard
  fields (``model_config.hf_config.hidden_size``, ``model_config.dtype``,
  ``scheduler_config.max_num_batched_tokens``, ``compilation_config`` /
  ``model_config.enforce_eager``); our own options come from
  ``additional_config["afd"]["connector_extra_config"]``
  (:class:`StepMeshExtraInfo`). No ``DMLC_*`` variable is needed; any
  ``STEPMESH_*`` still applies through ``MeshOptions.from_env``;
* the scheduler runs inside an FFN process (``stepmesh.Scheduler``, a thread
  of the library), never a subprocess;
* two topologies (``topology`` option): ``subgroup`` (the plugin's p2p
  layout: FFN rank ``f`` serves attention ranks ``f*r .. f*r+r-1``,
  ``r = A/F``, and returns a full output; one mesh per subgroup, its
  scheduler in FFN rank ``f`` at ``port + f``) and ``all_to_all`` (every
  attention rank sends to every FFN rank, each returns a partial output,
  ``recv_ffn_output`` sums them in FFN rank order; one mesh, its scheduler
  in FFN rank 0 at ``port``);
* the attention-side data path runs through the torch custom ops
  ``torch.ops.stepmesh.afd_send_attn`` / ``afd_recv_ffn``, the FFN side's send
  through ``afd_send_ffn`` (all with fake/meta implementations), so
  ``torch.compile`` sees opaque ops;
* graph mode: while a CUDA stream capture (or a cpu_mock capture,
  ``graph_capture()``) is in progress the ops enqueue a go increment and a
  done wait on the stream instead of posting from host code, and the
  library's ``stepmesh.Trigger`` posts the frozen request at every replay
  (``_send_graph`` / ``_recv_graph``); a replay's failure is raised by the
  next host call, naming the FFN rank.

Wire layout, per micro-batch stage ``s`` (keys ``s * 8 + k``): ``HIDDEN``
(``[n, hidden]`` rows of a ``[max_tokens, hidden]`` registered buffer),
``META`` (int64: layer, stage, flags), ``LOGITS`` (router logits as raw
bytes, 0 bytes when none) pushed; ``OUT`` pulled from every FFN rank of the
mesh. The control plane uses its own key ``CONTROL_KEY`` (int32 words, a
push without a pull). The FFN side learns each rank's token count from the
frame's byte count. docs/python.md "vLLM AFD plugin" has the whole contract.

The parts: ``_vllm_types`` (the plugin's classes or our copy),
``_vllm_options`` (``StepMeshExtraInfo``), ``_vllm_wire`` (keys, wire words,
torch helpers), ``_vllm_ops`` (the custom ops), ``_vllm_graph`` and
``_vllm_ffn`` (the graph-mode and FFN-side methods of the connector, mixed
in), ``_vllm_control`` (the control plane); this module holds the connector's
construction, lifecycle and attention side, and registration.
"""


from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Deque, Dict, List, Mapping, Optional

import torch

import stepmesh
from stepmesh import _stepmesh, _vllm_ops, _vllm_wire
from stepmesh._connector import join as join_mesh
from stepmesh._vllm_control import StepMeshAFDControlPlane
from stepmesh._vllm_ffn import FfnSide, StepMeshTransferState
from stepmesh._vllm_graph import GraphMode, StepMeshGraphCapture  # noqa: F401
from stepmesh._vllm_ops import OP_CALLS, register_ops  # noqa: F401 (tests read OP_CALLS)
from stepmesh._vllm_options import StepMeshExtraInfo
# The plugin's types (or our copy), offered here as they always were.
from stepmesh._vllm_types import (  # noqa: F401
    NAME,
    PLUGIN_BASE,
    AFDA2FTransferPayload,
    AFDConnectorBase,
    AFDControlPayload,
    AFDControlPlane,
    AFDDPMetadata,
    AFDExpertRoutingSpec,
    AFDTransferContext,
    AFDTransferMetadata,
    AFDTransferState,
    ConnectorExtraInfo,
)
from stepmesh._vllm_wire import (
    _HIDDEN,
    _LOGITS,
    _META,
    _META_WORDS,
    _OUT,
    _CONTROL_HEADER,
    CONTROL_KEY,
    _attr,
    _dtype_name,
    _key,
    _torch_dtype,
)

_log = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    # FAKE_REGISTRATION is set by register_ops(): read it where it lives.
    if name == "FAKE_REGISTRATION":
        return _vllm_ops.FAKE_REGISTRATION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------
# The connector
# ----------------------------------------------------------------------------
class StepMeshAFDConnector(GraphMode, FfnSide, AFDConnectorBase):
    """The plugin's connector contract over stepmesh (module docstring)."""

    @classmethod
    def parse_extra_config(cls, raw: Optional[Mapping[str, Any]]) -> StepMeshExtraInfo:
        return StepMeshExtraInfo.from_mapping(raw)

    def __init__(self, rank: int, local_rank: int, vllm_config: Any, afd_config: Any,
                 role_rank: int) -> None:
        super().__init__(rank, local_rank, vllm_config, afd_config, role_rank)
        x: StepMeshExtraInfo = self.extra_info
        self.role = str(afd_config.role)
        if self.role not in ("attention", "ffn"):
            raise ValueError(f"afd_config.role={self.role!r}: want 'attention' or 'ffn'")
        self.attn_size = int(afd_config.num_attention_ranks)
        self.ffn_size = int(afd_config.num_ffn_ranks)
        if self.attn_size < 1 or self.ffn_size < 1:
            raise ValueError(f"afd_config.num_attention_ranks={self.attn_size}, "
                             f"num_ffn_ranks={self.ffn_size}: both must be >= 1")
        size = self.attn_size if self.role == "attention" else self.ffn_size
        if not 0 <= int(role_rank) < size:
            raise ValueError(f"role_rank={role_rank} out of range [0, {size}) for role "
                             f"{self.role}")
        self.role_rank = int(role_rank)
        self.topology = x.topology
        if self.topology == "subgroup":
            if self.attn_size % self.ffn_size:
                raise ValueError(
                    f"topology 'subgroup' needs num_attention_ranks ({self.attn_size}) to be a "
                    f"multiple of num_ffn_ranks ({self.ffn_size})")
            self.ratio = self.attn_size // self.ffn_size
        else:
            self.ratio = self.attn_size
        hidden = _attr(vllm_config, "model_config.hf_config.hidden_size")
        get_hidden = _attr(vllm_config, "model_config.get_hidden_size")
        if hidden is None and callable(get_hidden):  # e.g. a text_config nested in hf_config
            hidden = get_hidden()
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"vllm_config.model_config.hf_config.hidden_size={hidden!r}: "
                             "want a positive int")
        self.hidden_size = hidden
        self.dtype = _torch_dtype(_attr(vllm_config, "model_config.dtype", "bfloat16"),
                                  "vllm_config.model_config.dtype")
        max_tokens = x.max_tokens or _attr(vllm_config,
                                           "scheduler_config.max_num_batched_tokens", 0)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("vllm_config.scheduler_config.max_num_batched_tokens="
                             f"{max_tokens!r} (or connector_extra_config.max_tokens): want "
                             "a positive int")
        self.max_tokens = max_tokens
        self.num_stages = x.num_stages
        width = x.router_logits_width
        if not width and getattr(afd_config, "compute_gate_on_attention", False):
            hf = _attr(vllm_config, "model_config.hf_config")
            width = int(getattr(hf, "n_routed_experts", 0) or getattr(hf, "num_experts", 0) or 0)
        self.router_logits_width = width
        self._logit_row_bytes = 4 * width  # room for float32 logits; bf16 uses half
        # Graph mode: buffers are always preallocated; unless enforce_eager the
        # attention side makes its graph trigger at init_afd_connector().
        self.enforce_eager = bool(_attr(vllm_config, "model_config.enforce_eager", False))
        self.compilation_config = _attr(vllm_config, "compilation_config")
        # Mesh placement.
        if self.topology == "subgroup":
            if self.role == "attention":
                self.group_index = self.role_rank // self.ratio
                self.mesh_rank = self.role_rank % self.ratio
            else:
                self.group_index = self.role_rank
                self.mesh_rank = 0
            self.mesh_workers, self.mesh_servers = self.ratio, 1
            self.first_attention = self.group_index * self.ratio
        else:
            self.group_index = 0
            self.mesh_rank = self.role_rank
            self.mesh_workers, self.mesh_servers = self.attn_size, self.ffn_size
            self.first_attention = 0
        self.host = str(afd_config.host)
        self.port = int(afd_config.port) + self.group_index
        self.scheduler_address = f"{self.host}:{self.port}"
        # State
        self.control_plane = StepMeshAFDControlPlane(self)
        self.dp_metadata_list: Dict[int, Any] = {}
        self.is_graph_capturing = False
        self.is_warmup = False
        self._node: Any = None
        self._scheduler: Any = None
        self._id = 0
        self._plans: List[Any] = []
        # The attention side's stages in C++ (_stepmesh._AttentionLanes: each
        # stage's request in flight and its rows); _fast is the same object
        # while send/recv may take its one-call common case (eager, host
        # ordered, no graph mode used), else None.
        self._lanes: Any = None
        self._fast: Any = None
        # Graph mode (docs/python.md, "CUDA graphs"): the trigger posting the
        # captured sends, the slots armed, the stage -> (slot, rows) captured
        # but not yet received, the cpu_mock stream a capture records.
        self._trigger: Any = None
        self._graph_slots: List[int] = []
        self._graph_pending: Dict[int, Any] = {}
        self._capture_stream: Any = None
        self._graph_stream_obj: Any = None
        self._stash: Dict[int, Deque[Any]] = collections.defaultdict(collections.deque)
        self._ffn_contexts: Dict[int, Any] = {}  # op_id -> context not yet answered
        self._next_ffn_op = 0
        self._control_request: Any = None
        self._peer_lost = False
        self._device = torch.device("cpu")
        self._stream = False
        self._always_ops = x.custom_ops == "always"
        self._timeout = x.timeout
        self._flags = 0  # FLAG_* of the last control payload applied (sent with every push)
        self._live_role: Optional[str] = None  # the role while initialised

    # ------------------------------------------------------------ lifecycle
    @property
    def is_initialized(self) -> bool:
        return self._node is not None and not self._node.closed

    def _ffn_rank_of_server(self, server: int) -> int:
        return self.group_index if self.topology == "subgroup" else server

    def _attention_rank_of_worker(self, worker: int) -> int:
        return self.first_attention + worker

    def _mesh_options(self) -> Any:
        x: StepMeshExtraInfo = self.extra_info
        backend = x.backend
        if backend == "auto":
            backend = "cuda" if torch.cuda.is_available() else "cpu_mock"
        fields: Dict[str, Any] = dict(
            role="worker" if self.role == "attention" else "server", rank=self.mesh_rank,
            num_workers=self.mesh_workers, num_servers=self.mesh_servers,
            scheduler=self.scheduler_address, backend=backend, timeout=x.timeout,
            trace_events=x.trace_events)
        if backend == "cuda":
            fields["device"] = int(self.local_rank)
        for name in ("transport", "interface", "poll_mode", "trace"):
            if getattr(x, name) is not None:
                fields[name] = getattr(x, name)
        if x.auth_token == "none":
            fields["auth_token"] = ""
        elif x.auth_token.startswith("file:"):
            path = x.auth_token[5:]
            try:
                with open(path, encoding="utf-8") as f:
                    fields["auth_token"] = f.readline().strip()
            except OSError as e:
                raise ValueError(f"connector_extra_config.auth_token: cannot read {path!r} "
                                 f"({e.strerror})") from None
        base = stepmesh.MeshOptions.from_env()  # STEPMESH_* (the library's one table)
        if x.auth_token == "env":
            fields["auth_token"] = base.auth_token
        return base.copy(**fields)

    def init_afd_connector(self) -> None:
        """Joins the mesh (collective: every rank of the topology calls it),
        starting the scheduler in the FFN rank that owns it, and registers every
        buffer once at its largest size. Idempotent."""
        if self.is_initialized:
            return
        register_ops()
        options = self._mesh_options()
        stream = options.backend == "cuda"
        if stream and self.role == "ffn" and not self.enforce_eager:
            raise RuntimeError(
                f"{NAME} FFN rank {self.role_rank}: model_config.enforce_eager is False, so the "
                "plugin would capture the FFN forward in a CUDA graph and replay it without "
                "calling the connector; the FFN side receives and replies from host code: start "
                "the FFN instance with --enforce-eager (the attention instances may use graphs)")
        self._stream = stream
        self._device = (torch.device("cuda", int(self.local_rank)) if self._stream
                        else torch.device("cpu"))
        # Registration exports CUDA tensors through DLPack, which torch 2.x refuses
        # for a device other than the current one: local_rank's is made current.
        with torch.cuda.device(self._device) if self._stream else contextlib.nullcontext():
            if self.role == "ffn" and self.mesh_rank == 0:
                self._scheduler = stepmesh.Scheduler(options.copy(role="scheduler"))
            join_mesh(self, self.role == "attention", options)
            if self.role == "attention" and not self.enforce_eager:
                try:  # vLLM will capture graphs: the trigger is made now, not inside a capture
                    self._make_trigger()
                except BaseException:
                    self._teardown()
                    raise
        self._id = _vllm_ops._NEXT_ID[0]
        _vllm_ops._NEXT_ID[0] += 1
        _vllm_ops._CONNECTORS[self._id] = self
        self._live_role = self.role

    def close(self) -> None:
        """Leaves the mesh; safe to repeat and after a peer died (then the
        closing barrier's error is dropped: the mesh is gone either way)."""
        if self._node is None and self._scheduler is None:
            return
        try:
            if self._node is not None and not self._node.closed and not self._peer_lost:
                try:
                    self._node.barrier()  # nobody leaves while a peer still sends
                except stepmesh.Error:
                    pass
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._live_role = None
        _vllm_ops._CONNECTORS.pop(self._id, None)
        self._id = 0
        self._fast = self._lanes = None
        self._plans = []
        self._control_plan = None
        self._graph_pending.clear()
        self._ffn_contexts.clear()
        self._graph_slots = []
        self._capture_stream = None
        self._graph_stream_obj = None
        trigger, self._trigger = self._trigger, None
        if trigger is not None:
            try:
                trigger.close()  # waits (bounded) for sends in flight, releases every stream
            except stepmesh.Error as e:
                _log.warning("%s: a device-triggered send failed before close: %s", NAME, e)
        self._stash.clear()
        self._control_request = None
        self._peer_lost = False
        node, self._node = self._node, None
        sched, self._scheduler = self._scheduler, None
        try:
            if node is not None:
                node.close()
        finally:
            if sched is not None:
                try:
                    sched.wait_until_done(self.extra_info.timeout)
                except stepmesh.Error:
                    pass  # a peer died: stop regardless
                sched.stop()

    def _live(self, role: str):
        if self._live_role == role and not self._node.closed:  # the hot path: one compare
            return self._node
        if not self.is_initialized:
            raise RuntimeError(f"{NAME} is not initialised (call init_afd_connector())")
        if self.role != role:
            raise RuntimeError(f"{NAME}: this is the {self.role} side, not {role}")
        return self._node

    def _stage(self, stage_idx: Any, field: str) -> int:
        s = int(stage_idx)
        if not 0 <= s < self.num_stages:
            raise ValueError(f"{field}={stage_idx} out of range [0, {self.num_stages}) "
                             "(connector_extra_config.num_stages)")
        return s

    def _current_stream(self) -> Optional[int]:
        return torch.cuda.current_stream(self._device).cuda_stream if self._stream else None

    def _empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self._device)

    # ------------------------------------------------------------ attention side
    def _init_attention(self, options: Any) -> None:
        w = self._node = stepmesh.Worker(options)
        self._send_bufs, self._meta_bufs, self._logit_bufs, self._recv_bufs = [], [], [], []
        self._meta_tensors = []
        self._plans = []
        for s in range(self.num_stages):
            send = self._empty((self.max_tokens, self.hidden_size), self.dtype)
            meta = torch.zeros(_META_WORDS, dtype=torch.int64)
            w.register_push(_key(s, _HIDDEN), send)
            w.register_push(_key(s, _META), meta)
            pushes = [stepmesh.Push(_key(s, _HIDDEN), rows=self.max_tokens), _key(s, _META)]
            logits = None
            if self._logit_row_bytes:
                logits = self._empty((self.max_tokens * self._logit_row_bytes,), torch.uint8)
                w.register_push(_key(s, _LOGITS), logits)
                pushes.append(stepmesh.Push(_key(s, _LOGITS), bytes=0))
            recv = []
            for f in range(self.mesh_servers):
                r = self._empty((self.max_tokens, self.hidden_size), self.dtype)
                w.register_pull(_key(s, _OUT), f, r)
                recv.append(r)
            self._send_bufs.append(send)
            self._meta_tensors.append(meta)
            words = memoryview(meta.numpy())  # element writes: ~20 ns each
            words[1] = s
            self._meta_bufs.append(words)  # the graph path's layer / flags words
            self._logit_bufs.append(logits)
            self._recv_bufs.append(recv)
            self._plans.append(w.prepare(pushes, [(_key(s, _OUT), f)
                                                  for f in range(self.mesh_servers)]))
        # Each stage's buffer addresses, read once: the hot path compares ints.
        self._send_ptrs = [b.data_ptr() for b in self._send_bufs]
        self._recv_ptrs = [r[0].data_ptr() for r in self._recv_bufs]
        self._lanes = _stepmesh._AttentionLanes(
            w, self._plans, self._send_bufs, [r[0] for r in self._recv_bufs],
            self._meta_tensors, self.hidden_size, self.max_tokens, self.dtype,
            2 if self._logit_row_bytes else -1, self._timeout)
        self._fast = None if self._stream or self._always_ops else self._lanes
        # all_to_all: the other FFN ranks' partials as [:n] views, made again only
        # when n changes (a slice is a torch call, ~2 us with cold caches).
        self._sum_views: List[Any] = [(None, ())] * self.num_stages
        control = torch.zeros(self._control_words(), dtype=torch.int32)
        w.register_push(CONTROL_KEY, control)
        self._control_buf = control.numpy()
        self._control_plan = w.prepare([stepmesh.Push(CONTROL_KEY)], [])

    def send_buffer(self, stage_idx: int = 0) -> torch.Tensor:
        """The registered ``[max_tokens, hidden]`` send buffer of a stage: hidden
        states computed into its first rows are sent without a copy."""
        return self._send_bufs[self._stage(stage_idx, "stage_idx")]

    def recv_buffer(self, stage_idx: int = 0) -> torch.Tensor:
        """The registered ``[max_tokens, hidden]`` buffer FFN rank 0's output of a
        stage lands in: ``recv_ffn_output(recv_buffer(s)[:n], s)`` receives (and
        sums) in place, without a copy. Valid until the stage's next send."""
        return self._recv_bufs[self._stage(stage_idx, "stage_idx")][0]

    def send_attn_output(self, hidden_states: torch.Tensor, context: Any, **kwargs: Any) -> None:
        fast = self._fast  # the common case in one binding call (docs/benchmarks.md)
        if fast is not None and not kwargs and not self.is_graph_capturing and (
                _vllm_wire._IS_COMPILING is None or not _vllm_wire._IS_COMPILING()):
            try:
                if fast.send(hidden_states, context.metadata, self._flags):
                    return
            except stepmesh.Error as e:
                raise self._peer_error(f"stage {context.metadata.stage_idx}: send_attn_output",
                                       e) from e
        router_logits = kwargs.get("router_logits") if kwargs else None
        if _vllm_wire._IS_COMPILING is not None and _vllm_wire._IS_COMPILING():
            # Traced by torch.compile: the op alone, no binding call or state read
            # (a graph break); its kernel checks the state when it runs (_send_op).
            metadata = context.metadata
            torch.ops.stepmesh.afd_send_attn(hidden_states, router_logits, self._id,
                                             int(metadata.layer_idx), int(metadata.stage_idx))
            return
        # Everything else: attribute reads and compares, then the lanes' post.
        if self._live_role != "attention":
            self._live("attention")
        metadata = context.metadata
        s = metadata.stage_idx
        if type(s) is not int or not 0 <= s < self.num_stages:
            s = self._stage(s, "context.metadata.stage_idx")
        shape = hidden_states.shape
        if len(shape) != 2 or shape[1] != self.hidden_size:
            raise ValueError(f"hidden_states shape {tuple(shape)}: want [tokens, "
                             f"{self.hidden_size}] (hf_config.hidden_size)")
        if shape[0] != metadata.total_tokens:
            raise ValueError(f"hidden_states shape {tuple(shape)} does not match "
                             f"context.metadata.total_tokens={metadata.total_tokens}")
        if shape[0] > self.max_tokens:
            raise ValueError(f"hidden_states has {shape[0]} tokens, more than max_tokens="
                             f"{self.max_tokens}")
        if hidden_states.dtype != self.dtype:
            raise ValueError(f"hidden_states dtype {_dtype_name(hidden_states.dtype)}: the "
                             f"connector carries {_dtype_name(self.dtype)} "
                             "(model_config.dtype)")
        if router_logits is not None:
            if router_logits.dim() != 2 or router_logits.shape[0] != shape[0]:
                raise ValueError(f"router_logits shape {tuple(router_logits.shape)}: want "
                                 f"[{shape[0]}, width] (the token count of hidden_states)")
            nbytes = router_logits.shape[1] * router_logits.element_size()
            if nbytes > self._logit_row_bytes:
                raise ValueError(
                    f"router_logits row of {nbytes} bytes exceeds the registered "
                    f"{self._logit_row_bytes} (connector_extra_config.router_logits_width="
                    f"{self.router_logits_width} x 4 bytes)")
        if self._always_ops or self._capture_stream is not None or (
                self._stream and torch.cuda.is_current_stream_capturing()):
            torch.ops.stepmesh.afd_send_attn(hidden_states, router_logits, self._id,
                                             int(metadata.layer_idx), s)
        else:
            self._check_send_state(s)
            self._send(hidden_states, router_logits, metadata.layer_idx, s, shape[0])

    def _check_send_state(self, s: int) -> None:
        """What a send of stage `s` needs of the connector's state, checked when
        it is posted (eagerly, or by the op's kernel): nothing pending on the
        stage, no graph replay's failure unraised."""
        if self._lanes.pending(s) is not None:
            raise RuntimeError(f"stage {s}: recv_ffn_output() of the previous send is pending")
        if self._trigger is not None:  # graph mode on (a trigger): a replay's failure, raised
            self._check_trigger("send_attn_output")
            if s in self._graph_pending:
                raise RuntimeError(f"stage {s}: recv_ffn_output() of the previous (captured) "
                                   "send is pending")

    def _send_op(self, hidden_states, router_logits, layer_idx: int, s: int) -> None:
        """The op's kernel: the graph path while a capture is in progress."""
        if self._live_role != "attention":
            self._live("attention")
        if not 0 <= s < self.num_stages:
            s = self._stage(s, "context.metadata.stage_idx")
        self._check_send_state(s)
        if self._capture_stream is not None or (self._stream and
                                                torch.cuda.is_current_stream_capturing()):
            self._send_graph(hidden_states, router_logits, layer_idx, s)
        else:
            self._send(hidden_states, router_logits, layer_idx, s)

    def _recv_op(self, out: torch.Tensor, s: int) -> None:
        """The op's kernel: waits (or, captured, enqueues the wait) for stage s."""
        if self._live_role != "attention":
            self._live("attention")
        if not 0 <= s < self.num_stages:
            s = self._stage(s, "ubatch_idx")
        if self._trigger is not None:
            self._check_trigger("recv_ffn_output")
        if s in self._graph_pending:
            self._recv_graph(out, s)
        elif self._lanes.pending(s) is None:
            raise RuntimeError(f"stage {s}: no send_attn_output() to receive for")
        else:
            self._recv(out, s)

    def _send(self, hidden_states, router_logits, layer_idx: int, s: int,
              n: Optional[int] = None) -> None:
        # This runs with cold caches (the layer's compute evicted them), where
        # each torch accessor (shape, dtype, data_ptr) costs ~1.5 us: n comes
        # from the caller's shape read (docs/benchmarks.md).
        if self.is_graph_capturing:
            raise RuntimeError(
                f"stage {s}: send_attn_output outside a graph capture, but the control payload "
                "applied says this step captures one (is_graph_capturing): the FFN ranks "
                "receive nothing in a capture step (a captured send posts at its replays)")
        if n is None:
            n = hidden_states.shape[0]
        if hidden_states.data_ptr() != self._send_ptrs[s]:  # not computed in place: copy in
            self._send_bufs[s][:n].copy_(hidden_states)
        if self._logit_row_bytes or router_logits is not None:
            self._set_logits(self._plans[s], router_logits, s)
        try:  # the metadata words, the row count, the post: the lanes' one definition
            self._lanes.post(s, n, layer_idx, self._flags,
                             torch.cuda.current_stream(self._device).cuda_stream
                             if self._stream else None)
        except stepmesh.Error as e:
            raise self._peer_error(f"stage {s}: send_attn_output", e) from e

    def _set_logits(self, plan, router_logits, s: int) -> None:
        if not self._logit_row_bytes:
            raise ValueError("router_logits given, but the connector has no router logits "
                             "(connector_extra_config.router_logits_width is 0)")
        nbytes = 0
        if router_logits is not None:
            flat = router_logits.contiguous().view(-1).view(torch.uint8)
            nbytes = flat.numel()
            self._logit_bufs[s][:nbytes].copy_(flat)
        plan.set_bytes(2, nbytes)

    def recv_ffn_output(self, ref_tensor: Optional[torch.Tensor] = None, ubatch_idx: int = 0,
                        **kwargs: Any) -> torch.Tensor:
        """Waits for the stage's FFN output and writes it into ``ref_tensor``
        (same storage returned; allocated when None): the subgroup's FFN rank's
        output, or the FFN ranks' partial outputs summed in rank order."""
        fast = self._fast
        if fast is not None and ref_tensor is not None and (_vllm_wire._IS_COMPILING is None
                                                            or not _vllm_wire._IS_COMPILING()):
            try:
                n = fast.recv(ref_tensor, ubatch_idx)
            except stepmesh.Error as e:
                raise self._peer_error(f"stage {ubatch_idx}: recv_ffn_output", e) from e
            if n is not None:  # received in place
                if self.mesh_servers > 1:
                    self._add_partials(ref_tensor, ubatch_idx, n)
                return ref_tensor
        if _vllm_wire._IS_COMPILING is not None and _vllm_wire._IS_COMPILING():
            # Traced by torch.compile: the op alone (see send_attn_output); the
            # token count is only known when it runs, so the caller's tensor is needed.
            if ref_tensor is None:
                raise ValueError("recv_ffn_output under torch.compile needs ref_tensor (the "
                                 "token count of a send is known when the graph runs)")
            torch.ops.stepmesh.afd_recv_ffn(ref_tensor, self._id, int(ubatch_idx))
            return ref_tensor
        if self._live_role != "attention":
            self._live("attention")
        s = ubatch_idx
        if type(s) is not int or not 0 <= s < self.num_stages:
            s = self._stage(s, "ubatch_idx")
        n = self._lanes.pending(s)
        graph = False
        if self._trigger is not None:  # graph mode on (a trigger): a replay's failure, raised
            self._check_trigger("recv_ffn_output")
            if s in self._graph_pending:
                n, graph = self._graph_pending[s][1], True
        if n is None:
            raise RuntimeError(f"stage {s}: no send_attn_output() to receive for")
        if ref_tensor is None:
            ref_tensor = self._empty((n, self.hidden_size), self.dtype)
        elif ref_tensor.shape != (n, self.hidden_size) or ref_tensor.dtype != self.dtype:
            raise ValueError(f"ref_tensor {tuple(ref_tensor.shape)} "
                             f"{_dtype_name(ref_tensor.dtype)}: want ({n}, "
                             f"{self.hidden_size}) {_dtype_name(self.dtype)}")
        if self._always_ops or graph:
            torch.ops.stepmesh.afd_recv_ffn(ref_tensor, self._id, s)
        else:
            self._recv(ref_tensor, s)
        return ref_tensor

    def _recv(self, out: torch.Tensor, s: int) -> None:
        try:
            n = self._lanes.wait(s)
        except stepmesh.Error as e:
            raise self._peer_error(f"stage {s}: recv_ffn_output", e) from e
        if out.data_ptr() != self._recv_ptrs[s]:  # not received in place (recv_buffer): copy
            out.copy_(self._recv_bufs[s][0][:n])
        if self.mesh_servers > 1:
            self._add_partials(out, s, n)

    def _add_partials(self, out: torch.Tensor, s: int, n: int) -> None:
        """all_to_all: FFN ranks 1.. partial outputs added to ``out`` in rank order."""
        rows, views = self._sum_views[s]
        if rows != n:
            views = tuple(p[:n] for p in self._recv_bufs[s][1:])
            self._sum_views[s] = (n, views)
        for p in views:
            out.add_(p)

    # ------------------------------------------------------------ control plane
    def _control_words(self) -> int:
        return _CONTROL_HEADER + self.num_stages * (1 + self.attn_size)


# ----------------------------------------------------------------------------
# Registration with the plugin
# ----------------------------------------------------------------------------
def register() -> bool:
    """Adds ``StepMeshAFDConnector`` to the plugin's factory and to its tuple of
    supported connector names (idempotent). False when ``afd_plugin`` is not
    importable. The ``vllm.general_plugins`` entry point ``stepmesh_afd`` calls
    this."""
    try:
        from afd_plugin import config as afd_config_module  # type: ignore
        from afd_plugin.connectors.factory import AFDConnectorFactory  # type: ignore
    except ImportError:
        return False
    registry = getattr(AFDConnectorFactory, "_registry", {})
    if NAME not in registry:
        AFDConnectorFactory.register_connector(NAME, __name__, NAME)
    names = tuple(getattr(afd_config_module, "SUPPORTED_AFD_CONNECTORS", ()))
    if NAME not in names:
        afd_config_module.SUPPORTED_AFD_CONNECTORS = names + (NAME,)
    return True


__all__ = ["CONTROL_KEY", "NAME", "PLUGIN_BASE", "StepMeshAFDConnector",
           "StepMeshAFDControlPlane", "StepMeshExtraInfo", "StepMeshTransferState",
           "register", "register_ops"]

