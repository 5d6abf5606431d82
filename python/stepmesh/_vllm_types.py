"""The vLLM AFD plugin's base classes and metadata types: the plugin's own
when ``afd_plugin`` is importable (``PLUGIN_BASE``), else a minimal copy of
their shape written from the documented contract, so ``stepmesh.vllm`` works
without vLLM (CI). Part of :mod:`stepmesh.vllm`."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple

import torch

#: the name operators type in ``afd_config.connector``
NAME = "StepMeshAFDConnector"

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
