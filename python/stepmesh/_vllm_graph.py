"""Graph mode of the attention side: while a CUDA stream capture (or a
cpu_mock capture, ``graph_capture()``) is in progress the ops enqueue stream
work and ``stepmesh.Trigger`` posts the frozen request at every replay. A
mixin of :class:`stepmesh.vllm.StepMeshAFDConnector`, whose state it uses."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

import stepmesh
from stepmesh._vllm_types import NAME
from stepmesh._vllm_wire import _attr

_DEFAULT_SLOTS = 4096  # the library's Trigger default (include/stepmesh/trigger.h)

if TYPE_CHECKING:
    from stepmesh.vllm import StepMeshAFDConnector


class GraphMode:
    """The connector's graph-mode methods (see the module docstring)."""

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

    def _make_trigger(self) -> None:
        """The trigger that posts captured sends, made before any capture: its
        words are an allocation (cudaHostAlloc on CUDA), which CUDA refuses while
        a stream captures in global mode (torch.cuda.graph's) and which breaks
        that capture (cpu_mock refuses it too). Its thread sleeps until a slot
        is armed."""
        if self._trigger is None:
            self._trigger = self._node.create_trigger(capacity=self._graph_slot_capacity(),
                                                      timeout=self._timeout)

    def _graph_slot_capacity(self) -> int:
        """Slots the trigger holds: every captured send keeps one, so vLLM's
        capture of every batch size needs sizes x layers x stages (e.g. 51 x 58
        x 2 = 5916 for a large MoE model); at least the library's 4096."""
        sizes = _attr(self.compilation_config, "cudagraph_capture_sizes")
        layers = _attr(self.vllm_config, "model_config.hf_config.num_hidden_layers")
        try:
            need = len(sizes) * int(layers) * self.num_stages
        except (TypeError, ValueError):  # not given: the library's default
            need = 0
        return max(_DEFAULT_SLOTS, need)

    def _send_graph(self, hidden_states, router_logits, layer_idx: int, s: int) -> None:
        """Captured send: the copy in and the go increment are stream work, the
        post is the trigger's (once per replay, the layer index written
        before each); the request is frozen now (token count, logits bytes)."""
        if self._trigger is None:  # a CUDA capture (graph_capture() makes it for cpu_mock)
            raise RuntimeError(  # before any stream work: the capture is left as it was
                f"{NAME}: send_attn_output inside a CUDA graph capture, but the connector was "
                "initialised with model_config.enforce_eager=True: the trigger that posts a "
                "graph's sends is made by init_afd_connector() unless enforce_eager (CUDA "
                "refuses its allocation during a capture)")
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
        plan.set_rows(0, n)
        trigger = self._trigger
        self._fast = None  # from now on every call runs the trigger's checks
        meta = self._meta_tensors[s].data_ptr()
        try:  # before each post the trigger writes the layer and the flags (a replay is
            # a decode step: neither warm-up nor capture, whatever this step's payload says)
            slot = trigger.arm(plan.trigger_target(), [(meta, int(layer_idx)), (meta + 16, 0)])
        except stepmesh.ResourceExhausted as e:
            raise RuntimeError(
                f"stage {s}: send_attn_output (graph capture): the graph trigger's "
                f"{len(self._graph_slots)} slots are all armed (one per captured send: "
                "compilation_config.cudagraph_capture_sizes x hf_config.num_hidden_layers x "
                f"num_stages; {e})") from e
        except stepmesh.Error as e:
            raise self._peer_error(f"stage {s}: send_attn_output (graph capture)", e) from e
        self._graph_slots.append(slot)
        try:
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


class StepMeshGraphCapture:
    """``with conn.graph_capture() as g``: begins a capture on the
    connector's graph stream, ends it on exit; ``g.graph`` (a
    stepmesh.StreamGraph) then replays it: ``g.replay()`` launches on the
    graph stream, ``g.synchronize()`` waits for it."""

    def __init__(self, connector: StepMeshAFDConnector) -> None:
        self.connector = connector
        connector._make_trigger()  # before the capture: an allocation
        self.stream = connector.graph_stream()
        self.graph: Any = None

    def __enter__(self) -> "StepMeshGraphCapture":
        self.stream.begin_capture()
        self.connector._capture_stream = self.stream
        self.connector._fast = None  # captured calls take the graph path
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
