"""The plugin's DP-metadata control plane over the connector's mesh.
Part of :mod:`stepmesh.vllm`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

import torch

import stepmesh
from stepmesh._vllm_types import AFDControlPayload, AFDControlPlane, AFDDPMetadata
from stepmesh._vllm_wire import (
    _CONTROL_HEADER,
    _CONTROL_MAGIC,
    CONTROL_KEY,
    FLAG_GRAPH_CAPTURE,
    FLAG_WARMUP,
)

if TYPE_CHECKING:
    from stepmesh.vllm import StepMeshAFDConnector


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
        payload = AFDControlPayload(dp_metadata_list=dp,
                                    is_graph_capturing=bool(flags & FLAG_GRAPH_CAPTURE),
                                    is_warmup=bool(flags & FLAG_WARMUP))
        # Applied here too: the step's receives follow it (a capture step's
        # receive no data) whether or not the caller applies it itself.
        self.update_state_from_dp_metadata(payload)
        return payload
