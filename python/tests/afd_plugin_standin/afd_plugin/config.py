"""The plugin's AFD config: a frozen record and the validator that refuses a
connector name outside SUPPORTED_AFD_CONNECTORS (looked up at call time)."""
from dataclasses import dataclass

SUPPORTED_AFD_CONNECTORS = ("P2pNcclAFDConnector", "CAMP2pAFDConnector", "CAMAsyncAFDConnector")


@dataclass(frozen=True)
class AFDConfig:
    connector: str = "P2pNcclAFDConnector"
    role: str = "attention"
    host: str = "127.0.0.1"
    port: int = 1239
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False

    def validate(self) -> None:
        if self.role not in ("attention", "ffn"):
            raise ValueError(f"AFD role must be attention or ffn, got {self.role!r}")
        if self.connector not in SUPPORTED_AFD_CONNECTORS:  # module global, read now
            raise ValueError(f"AFD connector must be one of {SUPPORTED_AFD_CONNECTORS!r}, "
                             f"got {self.connector!r}")


def connector_extra_config_from_source(vllm_config):
    additional = getattr(vllm_config, "additional_config", None) or {}
    return dict((additional.get("afd") or {}).get("connector_extra_config") or {})
