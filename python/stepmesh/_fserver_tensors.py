"""Tensor helpers of :mod:`stepmesh.fserver`: torch when importable (else
numpy), zero-copy user tensors over stepmesh's views, byte views, the
producing CUDA stream of device tensors, copies and empty tensors of a kind."""

from __future__ import annotations

from typing import List, Optional

import stepmesh


def _torch():
    try:
        import torch  # noqa: F401
        import torch.utils.dlpack
        return torch
    except ImportError:
        return None


def _as_user_tensor(view):
    """A framework tensor over a TensorSlice / HostTensor (zero-copy)."""
    torch = _torch()
    if torch is not None:
        return torch.utils.dlpack.from_dlpack(view)
    import numpy as np
    try:
        return np.from_dlpack(view)
    except (TypeError, BufferError, RuntimeError):
        return view  # e.g. bfloat16 without torch: the raw DLPack view


def _bytes_of(t):
    """A flat uint8 view (torch or numpy) of a contiguous tensor's bytes; the
    memory is shared. Host tensors, and torch device tensors."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        return t.reshape(-1).view(torch.uint8)
    import numpy as np
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    return _bytes_of(_as_user_tensor(t))  # a HostTensor / TensorSlice: through DLPack


def _current_stream(tensors) -> Optional[int]:
    """torch's current CUDA stream (a cudaStream_t int) when any of `tensors` is
    a device tensor, else None: host tensors have no producing stream to wait for."""
    for t in tensors:
        is_cuda = getattr(t, "is_cuda", None)  # torch: no DLPack export per call
        if is_cuda if is_cuda is not None else stepmesh.describe(t)["device"] != "cpu":
            torch = _torch()
            if torch is None:
                raise stepmesh.Unimplemented("device tensors need torch for their stream")
            return torch.cuda.current_stream().cuda_stream
    return None


def _copy(dst_view, src) -> int:
    """Copies src into the start of dst_view; returns bytes copied."""
    info = stepmesh.describe(src)
    if info["device"] != "cpu":
        torch = _torch()
        if torch is None:
            raise stepmesh.Unimplemented("device tensors need torch to be copied")
        dst = torch.utils.dlpack.from_dlpack(dst_view).reshape(-1)
        flat = src.reshape(-1)
        dst[: flat.numel()].copy_(flat)
        return info["nbytes"]
    return stepmesh.copy_(dst_view, src)


def _empty_like(tensor, shape: List[int]):
    """A tensor of `shape` of `tensor`'s kind, dtype and device."""
    torch = _torch()
    if torch is not None and isinstance(tensor, torch.Tensor):
        return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    return stepmesh.HostTensor(shape, stepmesh.describe(tensor)["dtype"])
