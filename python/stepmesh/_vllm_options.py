"""``connector_extra_config``: :class:`StepMeshExtraInfo`, parsed and validated
once at construction. Part of :mod:`stepmesh.vllm`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from stepmesh._vllm_types import NAME, ConnectorExtraInfo

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
