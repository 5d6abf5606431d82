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
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Mapping, NamedTuple, Optional

import torch

import stepmesh
from stepmesh._connector import join as join_mesh

NAME = "StepMeshAFDConnector"
_log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------
# The plugin's types, or a minimal copy of their shape.
# ----------------------------------------------------------------------------
try:
    from afd_plugin.connectors.base import (  # type: ignore
        AFDConnectorBase,
        AFDControlPlane,
        ConnectorExtraInfo,
    )
    from afd_plugin.connectors.metadata import (  # type: ignore
        AFDA2FTransferPayload,
        AFDControlPayload,
        AFDDPMetadata,
        AFDExpertRoutingSpec,
        AFDTransferContext,
        AFDTransferMetadata,
        AFDTransferState,
    )

    PLUGIN_BASE = True
except ImportError:  # no afd_plugin (or no vLLM under it): our own copy
    PLUGIN_BASE = False

    @dataclass(frozen=True)
    class ConnectorExtraInfo:  # type: ignore[no-redef]
        @classmethod
        def from_mapping(cls, raw):
            raise NotImplementedError

        def to_mapping(self) -> Dict[str, Any]:
            return {}

    def _extra_config_from(vllm_config) -> Dict[str, Any]:
        additional = getattr(vllm_config, "additional_config", None) or {}
        afd = additional.get("afd") or {}
        return dict(afd.get("connector_extra_config") or {})

    class AFDConnectorBase(abc.ABC):  # type: ignore[no-redef]
        control_plane = None
        attn_size = 0
        ffn_size = 0

        @classmethod
        @abc.abstractmethod
        def parse_extra_config(cls, raw):
            raise NotImplementedError

        def __init__(self, rank, local_rank, vllm_config, afd_config, role_rank):
            self.rank = rank
            self.local_rank = local_rank
            self.vllm_config = vllm_config
            self.afd_config = afd_config
            self.role_rank = role_rank
            self.extra_info = self.parse_extra_config(_extra_config_from(vllm_config))

        @abc.abstractmethod
        def close(self): ...

        @abc.abstractmethod
        def init_afd_connector(self): ...

        @property
        @abc.abstractmethod
        def is_initialized(self): ...

        @abc.abstractmethod
        def send_attn_output(self, hidden_states, context, **kwargs): ...

        @abc.abstractmethod
        def recv_ffn_output(self, ref_tensor, ubatch_idx=0, **kwargs): ...

        @abc.abstractmethod
        def recv_attn_output(self, ubatch_idx=0, **kwargs): ...

        @abc.abstractmethod
        def send_ffn_output(self, ffn_output, context, **kwargs): ...

    class AFDControlPlane(abc.ABC):  # type: ignore[no-redef]
        @abc.abstractmethod
        def update_state_from_dp_metadata(self, payload): ...

        @abc.abstractmethod
        def send_dp_metadata_list(self, payload): ...

        @abc.abstractmethod
        def recv_dp_metadata_list(self): ...

    @dataclass
    class AFDDPMetadata:  # type: ignore[no-redef]
        num_tokens_across_dp_cpu: Any
        max_tokens_across_dp_cpu: Any = None

        def __post_init__(self):
            self.num_tokens_across_dp_cpu = torch.as_tensor(
                self.num_tokens_across_dp_cpu, dtype=torch.int32, device="cpu")
            if self.max_tokens_across_dp_cpu is None:
                self.max_tokens_across_dp_cpu = self.num_tokens_across_dp_cpu.max()

    @dataclass
    class AFDControlPayload:  # type: ignore[no-redef]
        dp_metadata_list: Dict[int, Any]
        is_graph_capturing: bool
        is_warmup: bool

    @dataclass
    class AFDTransferState:  # type: ignore[no-redef]
        pass

    class AFDExpertRoutingSpec(NamedTuple):  # type: ignore[no-redef]
        router_logits_width: int
        router_logits_dtype: Any

    @dataclass
    class AFDTransferMetadata:  # type: ignore[no-redef]
        layer_idx: int
        stage_idx: int
        seq_lens: List[int]

        def __post_init__(self):
            if not self.seq_lens:
                raise ValueError("seq_lens cannot be empty")
            if any(n <= 0 for n in self.seq_lens):
                raise ValueError("all sequence lengths must be positive")

        @property
        def total_tokens(self) -> int:
            return sum(self.seq_lens)

    @dataclass
    class AFDTransferContext:  # type: ignore[no-redef]
        metadata: Any
        states: Any = None

    @dataclass
    class AFDA2FTransferPayload:  # type: ignore[no-redef]
        hidden_states: Any
        context: Any
        router_logits: Any = None


# ----------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------
_TOPOLOGIES = ("subgroup", "all_to_all")
_TRANSPORTS = ("auto", "tcp", "rdma")
_POLL_MODES = ("spin", "adaptive", "blocking")
_BACKENDS = ("auto", "cpu_mock", "cuda")


@dataclass(frozen=True)
class StepMeshExtraInfo(ConnectorExtraInfo):
    """Our ``connector_extra_config``; every key optional, ``{}`` valid.

    ``None`` for a mesh field leaves the library default (or its
    ``STEPMESH_*`` variable). ``auth_token``: ``"env"`` (STEPMESH_AUTH_TOKEN,
    the default), ``"none"``, or ``"file:PATH"`` (the token is the file's
    first line). ``max_tokens`` 0: ``scheduler_config.max_num_batched_tokens``.
    ``router_logits_width`` 0: ``hf_config.n_routed_experts`` (or
    ``num_experts``) when ``afd_config.compute_gate_on_attention``, else no
    router logits. ``custom_ops``: ``"auto"`` calls the data path through the
    torch custom ops only while torch.compile traces or a CUDA graph captures
    (in eager mode the same implementation is called directly, without the
    dispatcher's ~1 us per call), ``"always"`` through them every call."""

    topology: str = "subgroup"
    transport: Optional[str] = None
    interface: Optional[str] = None
    auth_token: str = "env"
    poll_mode: Optional[str] = None
    trace: Optional[bool] = None
    trace_events: int = 0
    backend: str = "auto"
    num_stages: int = 2
    max_tokens: int = 0
    router_logits_width: int = 0
    timeout: float = 30.0
    custom_ops: str = "auto"

    @classmethod
    def from_mapping(cls, raw: Optional[Mapping[str, Any]]) -> "StepMeshExtraInfo":
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise TypeError(f"{NAME} connector_extra_config must be a mapping, "
                            f"got {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: Dict[str, Any] = {}
        for key, value in raw.items():
            if key not in fields:
                raise ValueError(f"{NAME} connector_extra_config: unknown key {key!r} "
                                 f"(known: {sorted(fields)})")
            values[key] = _coerce(key, value)
        info = cls(**values)
        info._validate()
        return info

    def _validate(self) -> None:
        def one_of(name, allowed, allow_none=False):
            v = getattr(self, name)
            if (v is None and allow_none) or v in allowed:
                return
            raise ValueError(f"connector_extra_config.{name}={v!r}: want one of {allowed}")

        one_of("topology", _TOPOLOGIES)
        one_of("transport", _TRANSPORTS, allow_none=True)
        one_of("poll_mode", _POLL_MODES, allow_none=True)
        one_of("backend", _BACKENDS)
        one_of("custom_ops", ("auto", "always"))
        if not (self.auth_token in ("env", "none") or self.auth_token.startswith("file:")):
            raise ValueError(f"connector_extra_config.auth_token={self.auth_token!r}: want "
                             "'env', 'none' or 'file:PATH'")
        for name, low in (("num_stages", 1), ("max_tokens", 0), ("router_logits_width", 0),
                          ("trace_events", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"connector_extra_config.{name}={getattr(self, name)}: "
                                 f"must be >= {low}")
        if not self.timeout > 0:
            raise ValueError(f"connector_extra_config.timeout={self.timeout}: must be > 0")

    def to_mapping(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


_INT_KEYS = ("trace_events", "num_stages", "max_tokens", "router_logits_width")


def _coerce(key: str, value: Any) -> Any:
    try:
        if key in _INT_KEYS:
            if isinstance(value, bool) or int(value) != float(value):
                raise ValueError
            return int(value)
        if key == "timeout":
            return float(value)
        if key == "trace":
            if isinstance(value, bool) or value is None:
                return value
            if str(value).lower() in ("1", "true", "on", "yes"):
                return True
            if str(value).lower() in ("0", "false", "off", "no"):
                return False
            raise ValueError
        if value is not None and not isinstance(value, str):
            raise ValueError
        return value
    except (TypeError, ValueError):
        raise ValueError(f"connector_extra_config.{key}={value!r} is not a valid "
                         f"{'integer' if key in _INT_KEYS else 'value'}") from None


# ----------------------------------------------------------------------------
# Keys, wire words
# ----------------------------------------------------------------------------
_KEYS_PER_STAGE = 8
_HIDDEN, _META, _LOGITS, _OUT = 1, 2, 3, 4
_META_WORDS = 4  # layer_idx, stage_idx, flags, reserved
CONTROL_KEY = 1 << 20
_CONTROL_MAGIC = 0x534D4354  # "SMCT"
_CONTROL_HEADER = 4  # magic, flags, stages, width
FLAG_WARMUP = 1
FLAG_GRAPH_CAPTURE = 2


def _key(stage: int, kind: int) -> int:
    return stage * _KEYS_PER_STAGE + kind


def _find_is_compiling():
    """torch.compiler.is_compiling (2.3+), torch._dynamo.is_compiling (2.0-2.2),
    or None (1.13: nothing compiles)."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn


_IS_COMPILING = _find_is_compiling()


def _is_compiling() -> bool:
    return _IS_COMPILING is not None and bool(_IS_COMPILING())


def _torch_dtype(value: Any, field: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
               "fp32": "float32"}
    dt = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{field}={value!r} is not a torch dtype")
    return dt


_ELEMENT_SIZES: Dict[torch.dtype, int] = {}


def _element_size(dt: torch.dtype) -> int:
    size = _ELEMENT_SIZES.get(dt)
    if size is None:
        size = _ELEMENT_SIZES[dt] = torch.empty(0, dtype=dt).element_size()
    return size


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _attr(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return default
    return obj


# ----------------------------------------------------------------------------
# The torch custom ops (attention side data path)
# ----------------------------------------------------------------------------
_CONNECTORS: Dict[int, "StepMeshAFDConnector"] = {}
_NEXT_ID = [1]
_OPS_LOCK = threading.Lock()
_OPS: Dict[str, Any] = {}  # "lib": the torch.library.Library keeping the ops alive
#: how the fake implementations were registered: "register_fake" (torch >= 2.4),
#: "impl_abstract" (2.1-2.3) or "meta" (Meta/AutogradMeta kernels: torch 1.13, 2.0)
FAKE_REGISTRATION: Optional[str] = None


def _connector(connector_id: int) -> "StepMeshAFDConnector":
    conn = _CONNECTORS.get(int(connector_id))
    if conn is None:
        raise RuntimeError(f"{NAME} id {connector_id} is not initialised (closed?)")
    return conn


#: calls that came through the custom ops' real (CPU/CUDA) kernels (tests read it)
OP_CALLS = collections.Counter()


def _send_attn_impl(hidden_states, router_logits, connector_id: int, layer_idx: int,
                    stage_idx: int) -> None:
    OP_CALLS["afd_send_attn"] += 1
    _connector(connector_id)._send_op(hidden_states, router_logits, layer_idx, stage_idx)


def _recv_ffn_impl(out, connector_id: int, stage_idx: int) -> None:
    OP_CALLS["afd_recv_ffn"] += 1
    _connector(connector_id)._recv_op(out, stage_idx)


def _send_ffn_impl(ffn_output, connector_id: int, context_id: int) -> None:
    OP_CALLS["afd_send_ffn"] += 1
    conn = _connector(connector_id)
    context = conn._ffn_contexts.pop(int(context_id), None)
    if context is None:
        raise RuntimeError(f"afd_send_ffn: context {context_id} is not pending (answered "
                           "already, or not from this connector's recv_attn_output)")
    conn._send_ffn(ffn_output, context)


def _send_ffn_fake(ffn_output, connector_id, context_id) -> None:
    return None


def _send_attn_fake(hidden_states, router_logits, connector_id, layer_idx, stage_idx) -> None:
    return None


def _recv_ffn_fake(out, connector_id, stage_idx) -> None:
    return None


def register_ops() -> None:
    """Defines ``torch.ops.stepmesh.afd_send_attn``, ``afd_recv_ffn`` (attention
    side) and ``afd_send_ffn`` (FFN side) once per process (reused when already
    defined, e.g. after a module reload)."""
    global FAKE_REGISTRATION
    with _OPS_LOCK:
        if "lib" in _OPS:
            return
        try:
            lib = torch.library.Library("stepmesh", "DEF")
        except RuntimeError:  # defined by an earlier copy of this module
            _OPS["lib"] = None
            return
        lib.define("afd_send_attn(Tensor(a!) hidden_states, Tensor? router_logits, "
                   "int connector, int layer_idx, int stage_idx) -> ()")
        lib.define("afd_recv_ffn(Tensor(a!) out, int connector, int stage_idx) -> ()")
        lib.define("afd_send_ffn(Tensor ffn_output, int connector, int context) -> ()")
        for key in ("CPU", "CUDA"):
            lib.impl("afd_send_attn", _send_attn_impl, key)
            lib.impl("afd_recv_ffn", _recv_ffn_impl, key)
            lib.impl("afd_send_ffn", _send_ffn_impl, key)
        register_fake = getattr(torch.library, "register_fake", None)
        impl_abstract = getattr(torch.library, "impl_abstract", None)
        if register_fake is not None:
            register_fake("stepmesh::afd_send_attn", _send_attn_fake, lib=lib)
            register_fake("stepmesh::afd_recv_ffn", _recv_ffn_fake, lib=lib)
            register_fake("stepmesh::afd_send_ffn", _send_ffn_fake, lib=lib)
            FAKE_REGISTRATION = "register_fake"
        elif impl_abstract is not None:
            impl_abstract("stepmesh::afd_send_attn", _send_attn_fake, lib=lib)
            impl_abstract("stepmesh::afd_recv_ffn", _recv_ffn_fake, lib=lib)
            impl_abstract("stepmesh::afd_send_ffn", _send_ffn_fake, lib=lib)
            FAKE_REGISTRATION = "impl_abstract"
        else:
            keys = ["Meta"]
            if int(torch.__version__.split(".")[0]) < 2:
                keys.append("AutogradMeta")  # 1.13 has no autograd fallthrough for Meta
            for key in keys:
                lib.impl("afd_send_attn", _send_attn_fake, key)
                lib.impl("afd_recv_ffn", _recv_ffn_fake, key)
                lib.impl("afd_send_ffn", _send_ffn_fake, key)
            FAKE_REGISTRATION = "meta"
        _OPS["lib"] = lib


# ----------------------------------------------------------------------------
# The connector
# ----------------------------------------------------------------------------
@dataclass
class StepMeshTransferState(AFDTransferState):
    """Our state on ``AFDTransferContext.states`` (FFN side): the stepmesh batch
    the context answers, its stage, and the mesh-local worker order."""

    batch: Any = None
    stage: int = 0
    workers: List[int] = dataclasses.field(default_factory=list)
    is_warmup: bool = False  # the sender's flags (from its last control payload)
    is_graph_capturing: bool = False
    op_id: int = 0  # names the context to torch.ops.stepmesh.afd_send_ffn


class StepMeshAFDConnector(AFDConnectorBase):
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
        # Graph mode, recorded (buffers are always preallocated, so eager and
        # graph mode take the same path here).
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
        self._requests: Dict[int, Any] = {}
        # Graph mode (docs/python.md, "CUDA graphs"): the trigger posting the
        # captured sends, the slots armed, the stage -> (slot, rows) captured
        # but not yet received, the cpu_mock stream a capture records.
        self._trigger: Any = None
        self._graph_slots: List[int] = []
        self._graph_pending: Dict[int, Any] = {}
        self._capture_stream: Any = None
        self._graph_stream_obj: Any = None
        self._rows: Dict[int, int] = {}
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
        self._stream = options.backend == "cuda"
        self._device = (torch.device("cuda", int(self.local_rank)) if self._stream
                        else torch.device("cpu"))
        if self.role == "ffn" and self.mesh_rank == 0:
            self._scheduler = stepmesh.Scheduler(options.copy(role="scheduler"))
        join_mesh(self, self.role == "attention", options)
        self._id = _NEXT_ID[0]
        _NEXT_ID[0] += 1
        _CONNECTORS[self._id] = self
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
        _CONNECTORS.pop(self._id, None)
        self._id = 0
        self._plans = []
        self._control_plan = None
        self._requests.clear()
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
            self._meta_bufs.append(words)
            self._logit_bufs.append(logits)
            self._recv_bufs.append(recv)
            self._plans.append(w.prepare(pushes, [(_key(s, _OUT), f)
                                                  for f in range(self.mesh_servers)]))
        self._plan_rows = [self.max_tokens] * self.num_stages  # what each plan's push 0 holds
        self._meta_flags = [0] * self.num_stages  # what each stage's words[2] holds
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
        # The hot path: attribute reads and compares only (docs/benchmarks.md).
        if self._live_role != "attention":
            self._live("attention")
        metadata = context.metadata
        s = metadata.stage_idx
        if type(s) is not int or not 0 <= s < self.num_stages:
            s = self._stage(s, "context.metadata.stage_idx")
        shape = hidden_states.shape
        compiling = _IS_COMPILING is not None and _IS_COMPILING()
        router_logits = kwargs.get("router_logits") if kwargs else None
        if not compiling:
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
        if s in self._requests:
            raise RuntimeError(f"stage {s}: recv_ffn_output() of the previous send is pending")
        if self._trigger is not None:  # graph mode was used: its checks
            self._check_trigger("send_attn_output")
            if s in self._graph_pending:
                raise RuntimeError(f"stage {s}: recv_ffn_output() of the previous (captured) "
                                   "send is pending")
        if compiling or self._always_ops or self._capture_stream is not None or (
                self._stream and torch.cuda.is_current_stream_capturing()):
            torch.ops.stepmesh.afd_send_attn(hidden_states, router_logits, self._id,
                                             int(metadata.layer_idx), s)
        else:
            self._send(hidden_states, router_logits, metadata.layer_idx, s)

    def _send_op(self, hidden_states, router_logits, layer_idx: int, s: int) -> None:
        """The op's kernel: the graph path while a capture is in progress."""
        if self._capture_stream is not None or (self._stream and
                                                torch.cuda.is_current_stream_capturing()):
            self._send_graph(hidden_states, router_logits, layer_idx, s)
        else:
            self._send(hidden_states, router_logits, layer_idx, s)

    def _recv_op(self, out: torch.Tensor, s: int) -> None:
        if s in self._graph_pending:
            self._recv_graph(out, s)
        else:
            self._recv(out, s)

    def _send(self, hidden_states, router_logits, layer_idx: int, s: int) -> None:
        n = hidden_states.shape[0]
        send = self._send_bufs[s]
        if hidden_states.data_ptr() != send.data_ptr():  # not computed in place: copy in
            send[:n].copy_(hidden_states)
        plan = self._plans[s]
        if self._logit_row_bytes:
            nbytes = 0
            if router_logits is not None:
                flat = router_logits.contiguous().view(-1).view(torch.uint8)
                nbytes = flat.numel()
                self._logit_bufs[s][:nbytes].copy_(flat)
            plan.set_bytes(2, nbytes)
        elif router_logits is not None:
            raise ValueError("router_logits given, but the connector has no router logits "
                             "(connector_extra_config.router_logits_width is 0)")
        words = self._meta_bufs[s]
        words[0] = layer_idx  # [1] is the stage, written at init
        if self._meta_flags[s] != self._flags:  # [2]: the flags, when they changed
            words[2] = self._meta_flags[s] = self._flags
        if self._plan_rows[s] != n:  # a binding call (~1 us): only when the count changes
            plan.set_rows(0, n)
            self._plan_rows[s] = n
        try:
            self._requests[s] = plan.post(
                torch.cuda.current_stream(self._device).cuda_stream if self._stream else None)
        except stepmesh.Error as e:
            raise self._peer_error(f"stage {s}: send_attn_output", e) from e
        self._rows[s] = n

    def recv_ffn_output(self, ref_tensor: Optional[torch.Tensor] = None, ubatch_idx: int = 0,
                        **kwargs: Any) -> torch.Tensor:
        """Waits for the stage's FFN output and writes it into ``ref_tensor``
        (same storage returned; allocated when None): the subgroup's FFN rank's
        output, or the FFN ranks' partial outputs summed in rank order."""
        if self._live_role != "attention":
            self._live("attention")
        s = ubatch_idx
        if type(s) is not int or not 0 <= s < self.num_stages:
            s = self._stage(s, "ubatch_idx")
        n = self._rows.get(s) if s in self._requests else None
        graph = False
        if self._trigger is not None:  # graph mode was used: its checks
            self._check_trigger("recv_ffn_output")
            if s in self._graph_pending:
                n, graph = self._graph_pending[s][1], True
        if n is None:
            raise RuntimeError(f"stage {s}: no send_attn_output() to receive for")
        compiling = _IS_COMPILING is not None and _IS_COMPILING()
        if ref_tensor is None:
            ref_tensor = self._empty((n, self.hidden_size), self.dtype)
        elif not compiling and (ref_tensor.shape != (n, self.hidden_size)
                                or ref_tensor.dtype != self.dtype):
            raise ValueError(f"ref_tensor {tuple(ref_tensor.shape)} "
                             f"{_dtype_name(ref_tensor.dtype)}: want ({n}, "
                             f"{self.hidden_size}) {_dtype_name(self.dtype)}")
        if compiling or self._always_ops or graph:
            torch.ops.stepmesh.afd_recv_ffn(ref_tensor, self._id, s)
        else:
            self._recv(ref_tensor, s)
        return ref_tensor

    def _recv(self, out: torch.Tensor, s: int) -> None:
        req = self._requests.pop(s)
        try:
            self._node.wait(req, self._timeout)
        except stepmesh.Error as e:
            raise self._peer_error(f"stage {s}: recv_ffn_output", e) from e
        parts = self._recv_bufs[s]
        first = parts[0]
        if out.data_ptr() != first.data_ptr():  # not received in place (recv_buffer): copy
            out.copy_(first[:self._rows[s]])
        if len(parts) > 1:
            n = self._rows[s]
            for p in parts[1:]:
                out.add_(p[:n])

    # ------------------------------------------------------------ graph mode
    def graph_stream(self) -> Any:
        """The stepmesh.Stream a cpu_mock capture records (made once). On CUDA,
        captures use torch's current stream."""
        if self._graph_stream_obj is None:
            self._graph_stream_obj = self._live("attention").create_stream()
        return self._graph_stream_obj

    def graph_capture(self) -> "StepMeshGraphCapture":
        """``with conn.graph_capture() as g: ...`` records the sends and
        receives made inside on ``graph_stream()`` (cpu_mock: CI's model of a
        CUDA graph); ``g.graph.launch(conn.graph_stream())`` replays them, every
        replay posting its sends again. On CUDA use torch.cuda.graph: the ops
        detect the capture themselves."""
        self._live("attention")
        if self._stream:
            raise RuntimeError(f"{NAME}: graph_capture() models graphs on cpu_mock; on CUDA "
                               "capture with torch.cuda.graph")
        return StepMeshGraphCapture(self)

    def _graph_target_stream(self) -> Any:
        if self._capture_stream is not None:
            return self._capture_stream
        return torch.cuda.current_stream(self._device).cuda_stream

    def _ensure_trigger(self) -> Any:
        if self._trigger is None:
            self._trigger = self._live("attention").create_trigger(timeout=self._timeout)
        return self._trigger

    def _send_graph(self, hidden_states, router_logits, layer_idx: int, s: int) -> None:
        """Captured send: the copy in and the go increment are stream work, the
        post is the trigger's (once per replay, the layer index written
        before each); the request is frozen now (token count, logits bytes)."""
        n = hidden_states.shape[0]
        stream = self._graph_target_stream()
        on_stream = self._capture_stream is not None  # cpu_mock: our stream records
        send = self._send_bufs[s]
        plan = self._plans[s]
        if hidden_states.data_ptr() != send.data_ptr():
            if on_stream:
                if not hidden_states.is_contiguous():
                    raise ValueError("hidden_states: graph mode needs a contiguous tensor")
                stream.copy_async(send.data_ptr(), hidden_states.data_ptr(),
                                  n * self.hidden_size * send.element_size())
            else:
                send[:n].copy_(hidden_states)
        nbytes = 0
        if self._logit_row_bytes:
            if router_logits is not None:
                nbytes = router_logits.numel() * router_logits.element_size()
                dst = self._logit_bufs[s]
                if on_stream:
                    if not router_logits.is_contiguous():
                        raise ValueError("router_logits: graph mode needs a contiguous tensor")
                    stream.copy_async(dst.data_ptr(), router_logits.data_ptr(), nbytes)
                else:
                    dst[:nbytes].copy_(router_logits.contiguous().view(-1).view(torch.uint8))
            plan.set_bytes(2, nbytes)
        elif router_logits is not None:
            raise ValueError("router_logits given, but the connector has no router logits "
                             "(connector_extra_config.router_logits_width is 0)")
        words = self._meta_bufs[s]
        if self._meta_flags[s] != self._flags:
            words[2] = self._meta_flags[s] = self._flags
        plan.set_rows(0, n)
        self._plan_rows[s] = n
        trigger = self._ensure_trigger()
        try:
            slot = trigger.arm(plan.trigger_target(),
                               [(self._meta_tensors[s].data_ptr(), int(layer_idx))])
            self._graph_slots.append(slot)
            trigger.post_on(slot, stream)
        except stepmesh.Error as e:
            raise self._peer_error(f"stage {s}: send_attn_output (graph capture)", e) from e
        self._graph_pending[s] = (slot, n)

    def _recv_graph(self, out: torch.Tensor, s: int) -> None:
        """Captured receive: the stream waits until the trigger completed the
        replay's send (done >= go), then copies / sums on the stream."""
        slot, n = self._graph_pending.pop(s)
        stream = self._graph_target_stream()
        self._trigger.wait_on(slot, stream)
        parts = self._recv_bufs[s]
        first = parts[0]
        if self._capture_stream is None:  # CUDA: torch's captured kernels
            if out.data_ptr() != first.data_ptr():
                out.copy_(first[:n])
            for p in parts[1:]:
                out.add_(p[:n])
            return
        if out.data_ptr() != first.data_ptr():
            if not out.is_contiguous():
                raise ValueError("ref_tensor: graph mode needs a contiguous tensor")
            stream.copy_async(out.data_ptr(), first.data_ptr(),
                              n * self.hidden_size * out.element_size())
        if len(parts) > 1:  # the partial sums: a host function, replayed like a kernel
            rest = [p[:n] for p in parts[1:]]

            def add_partials(out=out, rest=rest):
                for p in rest:
                    out.add_(p)

            stream.launch_host_func(add_partials)

    def _check_trigger(self, what: str) -> None:
        """Raises a failure of a device-triggered send (recorded by the
        trigger's thread since the last host call), naming the FFN rank."""
        try:
            self._trigger.check()
        except stepmesh.Error as e:
            raise self._peer_error(f"{what}: an earlier graph replay's send failed", e) from e

    def _peer_error(self, what: str, e: Exception) -> Exception:
        """A stepmesh error with the FFN rank(s) it concerns named."""
        text = str(e)
        if "device-triggered post of" in text:  # the library's words come after the target's
            text = text.split("): ", 1)[-1]
        m = re.search(r"server (\d+)", text)
        if m is not None:
            ranks = [self._ffn_rank_of_server(int(m.group(1)))]
        else:
            ranks = [self._ffn_rank_of_server(f) for f in range(self.mesh_servers)]
        names = ", ".join(f"FFN rank {r}" for r in ranks)
        self._peer_lost = True  # close() skips its barrier: that peer will not come
        kind = TimeoutError if isinstance(e, TimeoutError) else ConnectionError
        return kind(f"{NAME} attention rank {self.role_rank}: {what}: {names} "
                    f"({e.__class__.__name__}: {e})")

    # ------------------------------------------------------------ FFN side
    def _init_ffn(self, options: Any) -> None:
        srv = self._node = stepmesh.Server(options)
        W, M, H = self.mesh_workers, self.max_tokens, self.hidden_size
        self._regions, self._replies, self._gathers = [], [], []
        self._meta_regions, self._logit_regions, self._logit_gathers = [], [], []
        for s in range(self.num_stages):
            region = self._empty((W * M, H), self.dtype)
            meta = torch.zeros(W * _META_WORDS, dtype=torch.int64)
            srv.register_recv(_key(s, _HIDDEN), region)
            srv.register_recv(_key(s, _META), meta)
            logits = gather_logits = None
            if self._logit_row_bytes:
                logits = self._empty((W * M * self._logit_row_bytes,), torch.uint8)
                gather_logits = self._empty((W * M * self._logit_row_bytes,), torch.uint8)
                srv.register_recv(_key(s, _LOGITS), logits)
            reply = self._empty((W * M, H), self.dtype)
            srv.register_reply(_key(s, _OUT), reply)
            self._regions.append(region)
            self._meta_regions.append(memoryview(meta.numpy()))  # plain int reads
            self._logit_regions.append(logits)
            self._logit_gathers.append(gather_logits)
            self._replies.append(reply)
            self._gathers.append(self._empty((W * M, H), self.dtype))
        words = self._control_words()
        self._control_region = torch.zeros(W * words, dtype=torch.int32)
        srv.register_recv(CONTROL_KEY, self._control_region)

    def _next_batch(self, group: int, what: str):
        """The next batch of `group`, keeping the other groups' batches that
        arrive first (stages out of order, the control payload)."""
        stash = self._stash.get(group)
        if stash:
            return stash.popleft()
        while True:
            try:
                batch = self._node.get_batch(self.extra_info.timeout)
            except stepmesh.Error as e:
                raise self._worker_error(what, e) from e
            if batch.group == group:
                return batch
            self._stash[batch.group].append(batch)

    def _worker_error(self, what: str, e: Exception) -> Exception:
        m = re.search(r"worker (\d+)", str(e))
        if m is not None:
            ranks = [self._attention_rank_of_worker(int(m.group(1)))]
        else:
            ranks = [self._attention_rank_of_worker(w) for w in range(self.mesh_workers)]
        names = ", ".join(f"attention rank {r}" for r in ranks)
        self._peer_lost = True
        kind = TimeoutError if isinstance(e, TimeoutError) else ConnectionError
        return kind(f"{NAME} FFN rank {self.role_rank}: {what}: waiting for {names} "
                    f"({e.__class__.__name__}: {e})")

    def recv_attn_output(self, ubatch_idx: int = 0, **kwargs: Any) -> Any:
        """The stage's hidden states from this FFN rank's attention ranks
        (``[sum(seq_lens), hidden]`` in rank order), their router logits when a
        ``routing_spec`` (AFDExpertRoutingSpec) is given, and the context to
        hand back to ``send_ffn_output``."""
        self._live("ffn")
        s = self._stage(ubatch_idx, "ubatch_idx")
        spec = kwargs.get("routing_spec")
        batch = self._next_batch(_key(s, _HIDDEN), f"recv_attn_output(ubatch_idx={s})")
        hidden_t = batch.tensor(_key(s, _HIDDEN))
        M = self.max_tokens
        workers = list(batch.workers)
        seq_lens = [hidden_t.rows(w) for w in workers]
        for w, n in zip(workers, seq_lens):
            if n <= 0:  # the plugin pads an idle rank to one dummy token
                raise RuntimeError(f"stage {s}: attention rank "
                                   f"{self._attention_rank_of_worker(w)} sent 0 tokens "
                                   "(every rank must send >= 1; pad an idle rank to 1 token)")
        region, gather = self._regions[s], self._gathers[s]
        if len(workers) == 1:
            hidden = region[workers[0] * M: workers[0] * M + seq_lens[0]]
        else:
            row = 0
            for w, n in zip(workers, seq_lens):
                gather[row: row + n].copy_(region[w * M: w * M + n])
                row += n
            hidden = gather[:row]
        total = sum(seq_lens)
        logits = None
        if spec is not None:
            logits = self._gather_logits(batch, s, workers, seq_lens, spec)
        meta = self._meta_regions[s]
        layer_idx = meta[workers[0] * _META_WORDS]
        flags = meta[workers[0] * _META_WORDS + 2]
        metadata = AFDTransferMetadata(layer_idx=layer_idx, stage_idx=s, seq_lens=seq_lens)
        state = StepMeshTransferState(batch=batch, stage=s, workers=workers,
                                      is_warmup=bool(flags & FLAG_WARMUP),
                                      is_graph_capturing=bool(flags & FLAG_GRAPH_CAPTURE))
        context = AFDTransferContext(metadata=metadata, states=state)
        state.op_id = self._next_ffn_op = self._next_ffn_op + 1
        self._ffn_contexts[state.op_id] = context
        assert hidden.shape[0] == total
        return AFDA2FTransferPayload(hidden_states=hidden, context=context, router_logits=logits)

    def _gather_logits(self, batch, s, workers, seq_lens, spec) -> torch.Tensor:
        width = int(spec.router_logits_width)
        dtype = _torch_dtype(spec.router_logits_dtype, "routing_spec.router_logits_dtype")
        row_bytes = width * _element_size(dtype)
        if not 0 < row_bytes <= self._logit_row_bytes:
            raise ValueError(f"routing_spec.router_logits_width={width} "
                             f"({_dtype_name(dtype)}): the connector registered "
                             f"{self._logit_row_bytes} bytes per token "
                             "(connector_extra_config.router_logits_width)")
        lt = batch.tensor(_key(s, _LOGITS))
        region, gather = self._logit_regions[s], self._logit_gathers[s]
        slot = self.max_tokens * self._logit_row_bytes
        at = 0
        for w, n in zip(workers, seq_lens):
            got = lt.valid_bytes[w]
            if got != n * row_bytes:
                raise ValueError(
                    f"stage {s}: attention rank {self._attention_rank_of_worker(w)} sent "
                    f"{got} bytes of router_logits for {n} tokens; routing_spec wants "
                    f"{n * row_bytes} ({width} x {_dtype_name(dtype)} per token)")
            gather[at: at + got].copy_(region[w * slot: w * slot + got])
            at += got
        return gather[:at].view(dtype).view(sum(seq_lens), width)

    def send_ffn_output(self, ffn_output: torch.Tensor, context: Any, **kwargs: Any) -> None:
        """Returns ``ffn_output`` (``[sum(seq_lens), hidden]``, rank order) to the
        attention ranks: rank ``a``'s rows to rank ``a``."""
        srv = self._live("ffn")
        state = getattr(context, "states", None)
        if not isinstance(state, StepMeshTransferState):
            raise RuntimeError("send_ffn_output: context.states is not a StepMeshTransferState "
                               "(pass the context recv_attn_output returned)")
        if state.batch is None or state.batch.answered:
            raise RuntimeError(f"send_ffn_output: stage {state.stage}: context already answered")
        total = context.metadata.total_tokens
        shape = tuple(ffn_output.shape)
        if not _is_compiling() and (shape != (total, self.hidden_size)
                                    or ffn_output.dtype != self.dtype):
            raise ValueError(f"ffn_output {shape} {_dtype_name(ffn_output.dtype)}: want "
                             f"({total}, {self.hidden_size}) {_dtype_name(self.dtype)} "
                             "(context.metadata.total_tokens)")
        if _is_compiling() or self._always_ops:
            torch.ops.stepmesh.afd_send_ffn(ffn_output, self._id, state.op_id)
        else:
            self._ffn_contexts.pop(state.op_id, None)
            self._send_ffn(ffn_output, context)

    def _send_ffn(self, ffn_output: torch.Tensor, context: Any) -> None:
        state = context.states
        reply = self._replies[state.stage]
        M = self.max_tokens
        row = 0
        rows = {}
        for w, n in zip(state.workers, context.metadata.seq_lens):
            reply[w * M: w * M + n].copy_(ffn_output[row: row + n])
            rows[w] = n
            row += n
        self._node.respond(state.batch, rows=rows, stream=self._current_stream())

    # ------------------------------------------------------------ control plane
    def _control_words(self) -> int:
        return _CONTROL_HEADER + self.num_stages * (1 + self.attn_size)


class StepMeshGraphCapture:
    """``with conn.graph_capture() as g``: begins a capture on the
    connector's graph stream, ends it on exit; ``g.graph`` (a
    stepmesh.StreamGraph) then replays it: ``g.replay()`` launches on the
    graph stream, ``g.synchronize()`` waits for it."""

    def __init__(self, connector: StepMeshAFDConnector) -> None:
        self.connector = connector
        self.stream = connector.graph_stream()
        self.graph: Any = None

    def __enter__(self) -> "StepMeshGraphCapture":
        self.stream.begin_capture()
        self.connector._capture_stream = self.stream
        return self

    def __exit__(self, *exc: Any) -> None:
        self.connector._capture_stream = None
        graph = self.stream.end_capture()
        if exc[0] is None:
            if self.connector._graph_pending:
                raise RuntimeError(f"graph capture ended with stage(s) "
                                   f"{sorted(self.connector._graph_pending)} sent but not "
                                   "received (recv_ffn_output inside the capture)")
            self.graph = graph

    def replay(self) -> None:
        self.graph.launch(self.stream)

    def synchronize(self, timeout: float = 30.0) -> None:
        self.stream.synchronize(timeout)


class StepMeshAFDControlPlane(AFDControlPlane):
    """The plugin's DP-metadata control plane over the connector's mesh, on
    its own key (``CONTROL_KEY``): int32 words ``[magic, flags, stages, width,
    (stage, counts[width]) per stage]`` in a buffer registered once; per step
    the attention side writes the words and posts a prepared push (nothing
    allocated), the FFN side decodes them into an ``AFDControlPayload``."""

    def __init__(self, connector: StepMeshAFDConnector) -> None:
        self.connector = connector

    def update_state_from_dp_metadata(self, payload: Any) -> None:
        c = self.connector
        c.dp_metadata_list = payload.dp_metadata_list
        c.is_graph_capturing = bool(payload.is_graph_capturing)
        c.is_warmup = bool(payload.is_warmup)
        c._flags = ((FLAG_WARMUP if c.is_warmup else 0)
                    | (FLAG_GRAPH_CAPTURE if c.is_graph_capturing else 0))

    def expected_tokens(self, stage_idx: int, attention_rank: int) -> int:
        """Tokens attention rank `attention_rank` sends in `stage_idx` per the last
        payload applied (an idle rank counts 1: the dummy token)."""
        counts = self.connector.dp_metadata_list[stage_idx].num_tokens_across_dp_cpu
        counts = counts.flatten().tolist()
        a = self.connector.attn_size
        if len(counts) < a and a % len(counts) == 0:  # one count per DP rank, TP peers share it
            counts = [counts[i // (a // len(counts))] for i in range(a)]
        return max(1, int(counts[attention_rank]))

    def send_dp_metadata_list(self, payload: Any) -> None:
        c = self.connector
        w = c._live("attention")
        if c._trigger is not None:
            c._check_trigger("send_dp_metadata_list")
        if c._control_request is not None:  # one in flight per key, and its words are read
            try:                            # until it completes: wait (it is long done)
                w.wait(c._control_request, c.extra_info.timeout)
            except stepmesh.Error as e:
                raise c._peer_error("send_dp_metadata_list", e) from e
            finally:
                c._control_request = None
        words = c._control_buf
        items = sorted(payload.dp_metadata_list.items())
        if len(items) > c.num_stages:
            raise ValueError(f"payload.dp_metadata_list has {len(items)} stages, more than "
                             f"connector_extra_config.num_stages={c.num_stages}")
        width = None
        at = _CONTROL_HEADER
        for stage, dp in items:
            counts = torch.as_tensor(dp.num_tokens_across_dp_cpu).reshape(-1)
            if width is None:
                width = counts.numel()
            if counts.numel() != width or not 0 < width <= c.attn_size:
                raise ValueError(
                    f"payload.dp_metadata_list[{stage}].num_tokens_across_dp_cpu has "
                    f"{counts.numel()} entries: want the same count (1..num_attention_ranks="
                    f"{c.attn_size}) for every stage")
            words[at] = int(stage)
            words[at + 1: at + 1 + width] = counts.numpy()
            at += 1 + width
        flags = ((FLAG_WARMUP if payload.is_warmup else 0)
                 | (FLAG_GRAPH_CAPTURE if payload.is_graph_capturing else 0))
        words[0], words[1], words[2], words[3] = _CONTROL_MAGIC, flags, len(items), width or 0
        c._control_plan.set_bytes(0, at * 4)
        try:
            c._control_request = c._control_plan.post()
        except stepmesh.Error as e:
            raise c._peer_error("send_dp_metadata_list", e) from e

    def recv_dp_metadata_list(self) -> Any:
        c = self.connector
        c._live("ffn")
        batch = c._next_batch(CONTROL_KEY, "recv_dp_metadata_list")
        words_per = c._control_words()
        region = c._control_region
        first = batch.workers[0]
        mine = region[first * words_per: (first + 1) * words_per]
        if int(mine[0]) != _CONTROL_MAGIC:
            raise RuntimeError(f"control payload from attention rank "
                               f"{c._attention_rank_of_worker(first)}: bad magic")
        nbytes = batch.tensor(CONTROL_KEY).valid_bytes
        for w in batch.workers[1:]:
            other = region[w * words_per: (w + 1) * words_per]
            if nbytes[w] != nbytes[first] or not torch.equal(
                    other[: nbytes[w] // 4], mine[: nbytes[first] // 4]):
                raise RuntimeError(
                    f"control payloads differ: attention rank "
                    f"{c._attention_rank_of_worker(w)} vs "
                    f"{c._attention_rank_of_worker(first)} (every attention rank must send "
                    "the same AFDControlPayload)")
        flags, stages, width = int(mine[1]), int(mine[2]), int(mine[3])
        dp: Dict[int, Any] = {}
        at = _CONTROL_HEADER
        for _ in range(stages):
            dp[int(mine[at])] = AFDDPMetadata(
                num_tokens_across_dp_cpu=mine[at + 1: at + 1 + width].clone())
            at += 1 + width
        c._node.respond(batch)
        return AFDControlPayload(dp_metadata_list=dp,
                                 is_graph_capturing=bool(flags & FLAG_GRAPH_CAPTURE),
                                 is_warmup=bool(flags & FLAG_WARMUP))


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
