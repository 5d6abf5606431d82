"""The contract's metadata records."""
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional

import torch


@dataclass
class AFDDPMetadata:
    num_tokens_across_dp_cpu: Any
    max_tokens_across_dp_cpu: Any = None

    def __post_init__(self):
        self.num_tokens_across_dp_cpu = torch.as_tensor(self.num_tokens_across_dp_cpu,
                                                        dtype=torch.int32, device="cpu")
        if self.max_tokens_across_dp_cpu is None:
            self.max_tokens_across_dp_cpu = self.num_tokens_across_dp_cpu.max()


@dataclass
class AFDControlPayload:
    dp_metadata_list: Dict[int, AFDDPMetadata]
    is_graph_capturing: bool
    is_warmup: bool


@dataclass
class AFDTransferState:
    pass


class AFDExpertRoutingSpec(NamedTuple):
    router_logits_width: int
    router_logits_dtype: torch.dtype


@dataclass
class AFDTransferMetadata:
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
class AFDTransferContext:
    metadata: AFDTransferMetadata
    states: Optional[AFDTransferState] = None


@dataclass
class AFDA2FTransferPayload:
    hidden_states: torch.Tensor
    context: AFDTransferContext
    router_logits: Optional[torch.Tensor] = None


__all__ = ["AFDA2FTransferPayload", "AFDControlPayload", "AFDDPMetadata", "AFDExpertRoutingSpec",
           "AFDTransferContext", "AFDTransferMetadata", "AFDTransferState"]
