"""stepmesh: communication for Attention-FFN disaggregation, from Python.

The classes mirror the C++ API (include/stepmesh/): Scheduler, Worker (the
attention side), Server (the FFN side) and MeshOptions. Tensors are any
object with ``__dlpack__`` (numpy >= 1.22, torch, CuPy, JAX); nothing here
imports a framework. Failures raise a subclass of :class:`stepmesh.Error`
named after the status code (``stepmesh.Unavailable``, ...). docs/python.md
has the whole story; ``stepmesh.fserver`` is a drop-in for StepMesh's
``fserver_lib`` and ``stepmesh.afd`` an AFD connector for serving frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ._stepmesh import (  # noqa: F401  (re-exported)
    Aborted,
    AlreadyExists,
    Batch,
    BatchTensor,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Error,
    FailedPrecondition,
    HostTensor,
    Internal,
    InvalidArgument,
    Membership,
    MeshOptions,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Plan,
    Request,
    ResourceExhausted,
    Scheduler,
    Server,
    Stream,
    StreamGraph,
    TensorSlice,
    Trigger,
    TriggerTarget,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
    Worker,
    environment_value,
    option_table,
    copy_,
    describe,
    monotonic_ns,
)

__version__ = "0.1.0"

#: dtypes a registered tensor may have (DLPack types they come from in docs/python.md).
DTYPES = ("uint8", "int32", "int64", "float32", "float16", "bfloat16", "float8_e4m3")


@dataclass(frozen=True)
class Push:
    """One push of a request: `key`, optionally a prefix (`bytes` or `rows`
    of the registered tensor) and the servers to send to (default: all)."""

    key: int
    bytes: Optional[int] = None
    rows: Optional[int] = None
    servers: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class Pull:
    """The reply `server` sends under `key` (into register_pull(key, server, ...))."""

    key: int
    server: int = 0


__all__ = [
    "Aborted", "AlreadyExists", "Batch", "BatchTensor", "Cancelled", "DataLoss",
    "DeadlineExceeded", "DTYPES", "Error", "FailedPrecondition", "HostTensor", "Internal",
    "InvalidArgument", "Membership", "MeshOptions", "NotFound", "OutOfRange", "PermissionDenied", "Plan", "Pull",
    "Push", "Request", "ResourceExhausted", "Scheduler", "Server", "Stream", "StreamGraph",
    "TensorSlice", "Trigger", "TriggerTarget", "Unauthenticated", "Unavailable", "Unimplemented", "Unknown", "Worker", "copy_", "describe", "monotonic_ns",
]
