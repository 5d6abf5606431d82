"""Host flags (StepMesh's wait_kernel.cu helpers): map_pinned_tensor,
write_flag, seq_add_one and wait_flag. Part of :mod:`stepmesh.fserver`."""

from __future__ import annotations

from typing import Optional

import stepmesh
from stepmesh import _fserver_mesh
from stepmesh._fserver_mesh import _mesh
from stepmesh._fserver_tensors import _torch

# StepMesh's wait_kernel.cu helpers let a CUDA graph signal a CPU proxy thread
# and wait for its acknowledgement: flags are int64 tensors in mapped pinned
# host memory, `seq` an int64 counter. Here, on host tensors, they run on the
# calling thread in program order (the cpu_mock's stream is the caller), with
# the same meaning; on CUDA tensors write_flag, seq_add_one and wait_flag are
# queued on torch's current stream (graph-capturable; wait_flag is a one-thread
# kernel reading both words when it runs, and needs backend cuda; docs/python.md).


def _is_cuda(t) -> bool:
    return bool(getattr(t, "is_cuda", False))


def _scalar(t) -> int:
    return int(t.reshape(-1)[0])


def map_pinned_tensor(tensor, device_index: int):
    """The view of host-flag memory a stream uses: on the CPU (cpu_mock) the
    host tensor itself; with CUDA, `tensor` must be pinned (page-locked) host
    memory, which the device addresses directly (unified addressing), and it is
    returned as is for write_flag / wait_flag."""
    if int(device_index) < 0:
        raise ValueError(f"map_pinned_tensor: device_index {device_index} is negative")
    if stepmesh.describe(tensor)["device"] != "cpu":
        raise ValueError("map_pinned_tensor: wants a host tensor (the flag lives in host memory)")
    if _unpinned_with_cuda(tensor):
        raise ValueError("map_pinned_tensor: with CUDA the host tensor must be pinned "
                         "(torch.empty(..., pin_memory=True))")
    return tensor


def _unpinned_with_cuda(tensor) -> bool:
    """True when torch has CUDA and `tensor` is a torch host tensor that is not pinned."""
    torch = _torch()
    return (torch is not None and torch.cuda.is_available() and isinstance(tensor, torch.Tensor)
            and not tensor.is_pinned())


def write_flag(flag, seq) -> None:
    """flag[0] = seq[0] (int64), visible to other threads once it returns (host),
    or once torch's current stream reaches it (CUDA seq: a device-to-host copy)."""
    if _is_cuda(seq):
        flag.reshape(-1)[:1].copy_(seq.reshape(-1)[:1], non_blocking=True)
        return
    flag.reshape(-1)[0] = _scalar(seq)


def seq_add_one(seq) -> None:
    """seq[0] += 1 (on torch's current stream for a CUDA seq)."""
    if _is_cuda(seq):
        seq.reshape(-1)[:1].add_(1)
        return
    flag = seq.reshape(-1)
    flag[0] = int(flag[0]) + 1


def wait_flag(flag, seq, *, timeout_ms: Optional[int] = None) -> None:
    """Until flag[0] >= seq[0]. A CUDA seq: torch's current stream waits on the
    device (a one-thread kernel reading both words when it runs, so it captures
    into CUDA graphs; needs backend cuda; timeout_ms does not apply). A host
    seq: the caller blocks, polling (yielding, then
    sleeping 50 us), at most `timeout_ms` (default: the mesh's STEPMESH_TIMEOUT,
    30 s before init): stepmesh.DeadlineExceeded names both values then."""
    if _is_cuda(seq):
        # On the device, as StepMesh's spin kernel: torch's current stream waits
        # (graph-safe: both words are read at every replay); the host goes on.
        m = _mesh()
        node = m.worker if m.worker is not None else m.server
        if flag.dtype != seq.dtype or str(seq.dtype) != "torch.int64":
            raise ValueError(f"wait_flag: flag and seq must be int64, got {flag.dtype} and {seq.dtype}")
        node.stream_wait_counter(flag.data_ptr(), seq.data_ptr(),
                                 _torch().cuda.current_stream().cuda_stream)
        return
    import time
    want = _scalar(seq)
    if timeout_ms is None:
        state = _fserver_mesh._state  # the process's mesh, where init() put it
        limit = state.timeout if state is not None and hasattr(state, "timeout") else 30.0
    else:
        limit = timeout_ms / 1000.0
    deadline = time.monotonic() + limit
    spins = 0
    view = flag.reshape(-1)
    while int(view[0]) < want:
        spins += 1
        if time.monotonic() >= deadline:
            raise stepmesh.DeadlineExceeded(
                f"wait_flag: flag is {int(view[0])}, still below seq {want} after {limit} s")
        time.sleep(0 if spins < 1000 else 50e-6)
