"""The connector's keys and wire words, and the torch helpers both sides use.
Part of :mod:`stepmesh.vllm`."""

from __future__ import annotations

from typing import Any, Dict

import torch

_KEYS_PER_STAGE = 8
_HIDDEN, _META, _LOGITS, _OUT = 1, 2, 3, 4
_META_WORDS = 4  # layer_idx, stage_idx, flags, reserved
CONTROL_KEY = 1 << 20
_CONTROL_MAGIC = 0x534D4354  # "SMCT"
_CONTROL_HEADER = 4  # magic, flags, stages, width
FLAG_WARMUP = 1
FLAG_GRAPH_CAPTURE = 2


def _key(stage: int, kind: int) -> int:
    return stage * _KEYS_PER_STAGE + kind


def _find_is_compiling():
    """torch.compiler.is_compiling (2.3+), torch._dynamo.is_compiling (2.0-2.2),
    or None (1.13: nothing compiles)."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn


_IS_COMPILING = _find_is_compiling()


def _is_compiling() -> bool:
    return _IS_COMPILING is not None and bool(_IS_COMPILING())


def _torch_dtype(value: Any, field: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
               "fp32": "float32"}
    dt = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{field}={value!r} is not a torch dtype")
    return dt


_ELEMENT_SIZES: Dict[torch.dtype, int] = {}


def _element_size(dt: torch.dtype) -> int:
    size = _ELEMENT_SIZES.get(dt)
    if size is None:
        size = _ELEMENT_SIZES[dt] = torch.empty(0, dtype=dt).element_size()
    return size


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _attr(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return default
    return obj
