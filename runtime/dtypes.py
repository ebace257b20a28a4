"""The dtypes a model's state may have: one table, by the names ``ModelSpec.params_dtype`` uses.

Pure (no torch at import): ``torch_dtype`` imports torch only when it is called.
"""

from __future__ import annotations

from typing import Any

# name -> (torch attribute, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}


def itemsize(name: str) -> int:
    return DTYPES[name][1]


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name][0])
