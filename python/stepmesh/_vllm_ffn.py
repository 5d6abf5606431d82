"""The FFN side of the connector: one stepmesh Server per mesh, a batch per
micro-batch stage from the attention ranks it serves, the reply written into
registered rows. A mixin of :class:`stepmesh.vllm.StepMeshAFDConnector`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, List

import torch

import stepmesh
from stepmesh._vllm_types import (
    NAME,
    AFDA2FTransferPayload,
    AFDTransferContext,
    AFDTransferMetadata,
    AFDTransferState,
)
from stepmesh._vllm_wire import (
    _HIDDEN,
    _LOGITS,
    _META,
    _META_WORDS,
    _OUT,
    CONTROL_KEY,
    FLAG_GRAPH_CAPTURE,
    FLAG_WARMUP,
    _dtype_name,
    _element_size,
    _is_compiling,
    _key,
    _torch_dtype,
)


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
    shape: Any = None  # the batch's _FfnShape: its views and reply rows
    dummy: bool = False  # a capture step's: nothing was received, nothing is sent


class _FfnShape:
    """What the FFN side's copies and reply need for one batch shape (which
    workers sent, how many tokens each) of a stage: the views of the
    registered buffers, made once per shape and reused while the shape
    repeats (a torch slice costs ~7 us with the caches a round trip leaves,
    docs/benchmarks.md)."""

    __slots__ = ("workers", "seq_lens", "total", "hidden", "gathers", "reply", "rows",
                 "offsets")

    def __init__(self, workers, seq_lens, total, hidden, gathers, reply, rows, offsets) -> None:
        self.workers = workers  # our copies: the caller gets its own lists
        self.seq_lens = seq_lens
        self.total = total
        self.hidden = hidden  # the model's input: a region slot, or the gathered rows
        self.gathers = gathers  # (gather rows, region slot) pairs copied per batch
        self.reply = reply  # the reply region's first `total` rows: the replies packed
        self.rows = rows  # respond()'s {worker: rows}
        self.offsets = offsets  # and {worker: first row}, in rank order


def _check_answerable(state: StepMeshTransferState, pending: Any) -> None:
    """A context is answered once: a batch's until its respond, a capture
    step's dummy while its op id is pending (`pending`: the connector's)."""
    if (state.op_id not in pending if state.dummy
            else state.batch is None or state.batch.answered):
        raise RuntimeError(f"send_ffn_output: stage {state.stage}: context already answered")


class FfnSide:
    """The connector's FFN-side methods (see the module docstring)."""

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
        self._ffn_shapes: List[Any] = [None] * self.num_stages  # the last _FfnShape per stage
        self._dummy_shapes: List[Any] = [None] * self.num_stages  # a capture step's
        self._recv_what = [f"recv_attn_output(ubatch_idx={s})" for s in range(self.num_stages)]
        self._hidden_keys = [_key(s, _HIDDEN) for s in range(self.num_stages)]
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
                batch = self._node.get_batch(self._timeout)
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
        hand back to ``send_ffn_output``. The hidden states are a view of the
        connector's registered rows, valid until that call (the same view
        object while the batch shape repeats: do not resize it in place)."""
        if self._live_role != "ffn":
            self._live("ffn")
        s = ubatch_idx
        if type(s) is not int or not 0 <= s < self.num_stages:
            s = self._stage(s, "ubatch_idx")
        if self.is_graph_capturing:  # the attention ranks capture: no data comes (docs/python.md)
            return self._capture_step_payload(s, kwargs)
        key = self._hidden_keys[s]
        if self._stash.get(key):  # arrived while another group was waited for
            batch = self._next_batch(key, self._recv_what[s])
        else:
            try:
                batch = self._node.get_batch(self._timeout)
            except stepmesh.Error as e:
                raise self._worker_error(self._recv_what[s], e) from e
            if batch.group != key:  # another group's (a stage out of order, the control)
                self._stash[batch.group].append(batch)
                batch = self._next_batch(key, self._recv_what[s])
        workers = batch.workers
        seq_lens = batch.rows(key)
        shape = self._ffn_shapes[s]
        if shape is None or shape.seq_lens != seq_lens or shape.workers != workers:
            shape = self._ffn_shapes[s] = self._ffn_shape(s, workers, seq_lens)
        for dst, src in shape.gathers:
            dst.copy_(src)
        logits = None
        if kwargs:
            spec = kwargs.get("routing_spec")
            if spec is not None:
                logits = self._gather_logits(batch, s, workers, seq_lens, spec)
        meta = self._meta_regions[s]
        first = workers[0] * _META_WORDS
        flags = meta[first + 2]
        metadata = AFDTransferMetadata(layer_idx=meta[first], stage_idx=s, seq_lens=seq_lens)
        state = StepMeshTransferState(batch=batch, stage=s, workers=workers,
                                      is_warmup=bool(flags & FLAG_WARMUP),
                                      is_graph_capturing=bool(flags & FLAG_GRAPH_CAPTURE),
                                      shape=shape)
        context = AFDTransferContext(metadata=metadata, states=state)
        state.op_id = self._next_ffn_op = self._next_ffn_op + 1
        self._ffn_contexts[state.op_id] = context
        return AFDA2FTransferPayload(hidden_states=shape.hidden, context=context,
                                     router_logits=logits)

    def _capture_step_payload(self, s: int, kwargs: Any) -> Any:
        """recv_attn_output while the control payload says the attention ranks
        capture a graph: their captured sends post nothing (a replay does), so
        nothing is waited for. The hidden states are the stage's buffer rows
        at the token counts the payload announces (contents unspecified), the
        context answers nothing (send_ffn_output returns at once)."""
        cp = self.control_plane
        workers = list(range(self.mesh_workers))
        seq_lens = []
        for w in workers:
            a = self._attention_rank_of_worker(w)
            try:
                n = cp.expected_tokens(s, a)
            except (KeyError, IndexError):
                raise RuntimeError(
                    f"recv_attn_output(ubatch_idx={s}) in a graph-capture step: the control "
                    f"payload applied has no token count for stage {s}, attention rank {a} "
                    "(update_state_from_dp_metadata / recv_dp_metadata_list)") from None
            if n > self.max_tokens:
                raise ValueError(f"stage {s}: the control payload gives attention rank {a} "
                                 f"{n} tokens, more than max_tokens={self.max_tokens}")
            seq_lens.append(n)
        # The stage's gather rows, never the receive region: nothing answers the
        # capture step, so the next step's data may land in the region while the
        # work queued on the dummy still runs (an FFN writing its input in place).
        shape = self._dummy_shapes[s]
        if shape is None or shape.seq_lens != seq_lens:
            total = sum(seq_lens)
            shape = self._dummy_shapes[s] = _FfnShape(
                workers, list(seq_lens), total, self._gathers[s][:total], (), None, None, None)
        logits = None
        spec = kwargs.get("routing_spec") if kwargs else None
        if spec is not None:
            width, dtype, row_bytes = self._logit_spec(spec)
            logits = self._logit_gathers[s][:shape.total * row_bytes].view(dtype).view(
                shape.total, width)
        metadata = AFDTransferMetadata(layer_idx=0, stage_idx=s, seq_lens=seq_lens)
        state = StepMeshTransferState(stage=s, workers=workers, is_warmup=self.is_warmup,
                                      is_graph_capturing=True, shape=shape, dummy=True)
        context = AFDTransferContext(metadata=metadata, states=state)
        state.op_id = self._next_ffn_op = self._next_ffn_op + 1
        self._ffn_contexts[state.op_id] = context
        return AFDA2FTransferPayload(hidden_states=shape.hidden, context=context,
                                     router_logits=logits)

    def _ffn_shape(self, s: int, workers: List[int], seq_lens: List[int]) -> _FfnShape:
        """The views for a batch of stage `s` from `workers` with `seq_lens`
        tokens each (checked: every rank sends >= 1, the dummy-token rule)."""
        for w, n in zip(workers, seq_lens):
            if n <= 0:
                raise RuntimeError(f"stage {s}: attention rank "
                                   f"{self._attention_rank_of_worker(w)} sent 0 tokens "
                                   "(every rank must send >= 1; pad an idle rank to 1 token)")
        M = self.max_tokens
        region, gather, reply = self._regions[s], self._gathers[s], self._replies[s]
        one = len(workers) == 1  # its slot is the input; several ranks' rows are gathered
        gathers, offsets, row = [], {}, 0
        for w, n in zip(workers, seq_lens):
            if not one:
                gathers.append((gather[row: row + n], region[w * M: w * M + n]))
            offsets[w] = row  # the replies packed back to back: one copy per batch
            row += n
        hidden = region[workers[0] * M: workers[0] * M + row] if one else gather[:row]
        return _FfnShape(list(workers), list(seq_lens), row, hidden, tuple(gathers),
                         reply[:row], dict(zip(workers, seq_lens)), offsets)

    def _logit_spec(self, spec: Any):
        """(width, dtype, bytes per token) of a routing spec, checked against
        the registered logits rows."""
        width = int(spec.router_logits_width)
        dtype = _torch_dtype(spec.router_logits_dtype, "routing_spec.router_logits_dtype")
        row_bytes = width * _element_size(dtype)
        if not 0 < row_bytes <= self._logit_row_bytes:
            raise ValueError(f"routing_spec.router_logits_width={width} "
                             f"({_dtype_name(dtype)}): the connector registered "
                             f"{self._logit_row_bytes} bytes per token "
                             "(connector_extra_config.router_logits_width)")
        return width, dtype, row_bytes

    def _gather_logits(self, batch, s, workers, seq_lens, spec) -> torch.Tensor:
        width, dtype, row_bytes = self._logit_spec(spec)
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
        state = getattr(context, "states", None)
        if not isinstance(state, StepMeshTransferState) or state.shape is None:
            raise RuntimeError("send_ffn_output: context.states is not a StepMeshTransferState "
                               "(pass the context recv_attn_output returned)")
        if _is_compiling():  # traced: the op alone, its kernel checks and replies (_send_ffn)
            torch.ops.stepmesh.afd_send_ffn(ffn_output, self._id, state.op_id)
            return
        if self._live_role != "ffn":
            self._live("ffn")
        if ffn_output.shape != (state.shape.total, self.hidden_size) or \
                ffn_output.dtype != self.dtype:
            raise ValueError(f"ffn_output {tuple(ffn_output.shape)} "
                             f"{_dtype_name(ffn_output.dtype)}: want ({state.shape.total}, "
                             f"{self.hidden_size}) {_dtype_name(self.dtype)} "
                             "(context.metadata.total_tokens)")
        if self._always_ops:
            # Before the dispatch: a refused call changes nothing.
            _check_answerable(state, self._ffn_contexts)
            torch.ops.stepmesh.afd_send_ffn(ffn_output, self._id, state.op_id)
        else:
            self._send_ffn(ffn_output, context)

    def _send_ffn(self, ffn_output: torch.Tensor, context: Any) -> None:
        """Copies each worker's rows into its reply rows and replies (the op's
        kernel too: the answered check is here, where every path passes)."""
        state = context.states
        _check_answerable(state, self._ffn_contexts)
        self._ffn_contexts.pop(state.op_id, None)
        if state.dummy:  # a capture step's: no attention rank waits for it
            return
        shape = state.shape
        shape.reply.copy_(ffn_output)  # one copy, no per-call views (~20 us each, cold)
        self._node.respond(state.batch, rows=shape.rows, offsets=shape.offsets,
                           stream=self._current_stream() if self._stream else None)
