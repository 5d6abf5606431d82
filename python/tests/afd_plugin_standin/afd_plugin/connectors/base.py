"""The abstract connector and control plane (the contract's shape)."""
from abc import ABC, abstractmethod
from dataclasses import dataclass

from afd_plugin.config import connector_extra_config_from_source


@dataclass(frozen=True)
class ConnectorExtraInfo:
    @classmethod
    def from_mapping(cls, raw):
        raise NotImplementedError

    def to_mapping(self):
        return {}


class AFDConnectorBase(ABC):
    control_plane = None
    attn_size = 0
    ffn_size = 0

    @classmethod
    @abstractmethod
    def parse_extra_config(cls, raw): ...

    def __init__(self, rank, local_rank, vllm_config, afd_config, role_rank):
        self.rank, self.local_rank, self.role_rank = rank, local_rank, role_rank
        self.vllm_config, self.afd_config = vllm_config, afd_config
        self.extra_info = self.parse_extra_config(connector_extra_config_from_source(vllm_config))

    @abstractmethod
    def close(self): ...

    @abstractmethod
    def init_afd_connector(self): ...

    @property
    @abstractmethod
    def is_initialized(self): ...

    @abstractmethod
    def send_attn_output(self, hidden_states, context, **kwargs): ...

    @abstractmethod
    def recv_ffn_output(self, ref_tensor, ubatch_idx=0, **kwargs): ...

    @abstractmethod
    def recv_attn_output(self, ubatch_idx=0, **kwargs): ...

    @abstractmethod
    def send_ffn_output(self, ffn_output, context, **kwargs): ...


class AFDControlPlane(ABC):
    @abstractmethod
    def update_state_from_dp_metadata(self, payload): ...

    @abstractmethod
    def send_dp_metadata_list(self, payload): ...

    @abstractmethod
    def recv_dp_metadata_list(self): ...
