"""The torch custom ops of the data path (``torch.ops.stepmesh.*``, with
fake/meta implementations so torch.compile and graph capture see opaque ops)
and the id -> connector table their kernels resolve. Part of :mod:`stepmesh.vllm`."""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from stepmesh._vllm_types import NAME

if TYPE_CHECKING:
    from stepmesh.vllm import StepMeshAFDConnector

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
    context = conn._ffn_contexts.get(int(context_id))
    if context is None:
        raise RuntimeError(f"send_ffn_output (afd_send_ffn): context {context_id} already "
                           "answered, or not from this connector's recv_attn_output")
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
