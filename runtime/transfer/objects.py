"""Small training objects as bytes, with no pickle: what the transfer sends between ranks.

The objects a transition moves (step, LR scheduler state, data position, RNG states) arrive from
other processes over the network, so they are read by a format that can only make data: JSON,
with tagged forms for what JSON lacks (tuples, dicts with non-string keys, bytes, tensors and
numpy arrays as dtype, shape and raw bytes). Decoding builds nothing but those types; an
unknown tag or dtype is an error, and so is anything that is not this format (a pickle
included).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

TAG = "__liveshard__"
# dtypes a tensor or array may have here (RNG states are uint8; schedulers hold numbers)
_TORCH = {name: getattr(torch, name) for name in (
    "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")}
_NUMPY = {"uint8", "int8", "int16", "int32", "int64", "uint32", "uint64", "float16", "float32", "float64",
          "bool"}


class InvalidObjects(ValueError):
    """Bytes that are not an encoded object (or use a type this format does not carry)."""


def encode(obj: Any) -> bytes:
    return json.dumps(_pack(obj), separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes) -> Any:
    try:
        raw = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidObjects(f"not an encoded object: {e}") from None
    return _unpack(raw)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _pack(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, list):
        return [_pack(x) for x in obj]
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [_pack(x) for x in obj]}
    if isinstance(obj, dict):
        return {TAG: "dict", "items": [[_pack(k), _pack(v)] for k, v in obj.items()]}
    if isinstance(obj, bytes | bytearray):
        return {TAG: "bytes", "data": _b64(bytes(obj))}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH:
            raise InvalidObjects(f"tensors of {t.dtype} are not carried")
        return {TAG: "tensor", "dtype": name, "shape": list(t.shape),
                "data": _b64(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")}
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _NUMPY:
            raise InvalidObjects(f"arrays of {obj.dtype} are not carried")
        return {TAG: "ndarray", "dtype": obj.dtype.name, "shape": list(obj.shape),
                "data": _b64(np.ascontiguousarray(obj).tobytes())}
    if isinstance(obj, np.generic):
        return _pack(obj.item())
    raise InvalidObjects(f"a {type(obj).__name__} is not carried (only numbers, strings, containers, "
                         "tensors and arrays)")


def _unpack(raw: Any) -> Any:
    if raw is None or isinstance(raw, bool | int | float | str):
        return raw
    if isinstance(raw, list):
        return [_unpack(x) for x in raw]
    if not isinstance(raw, dict) or TAG not in raw:
        raise InvalidObjects("a bare JSON object: not this format")
    kind = raw[TAG]
    if kind == "tuple":
        return tuple(_unpack(x) for x in raw["items"])
    if kind == "dict":
        return {_unpack(k): _unpack(v) for k, v in raw["items"]}
    if kind == "bytes":
        return base64.b64decode(raw["data"], validate=True)
    if kind == "tensor":
        dtype = _TORCH.get(raw.get("dtype"))
        if dtype is None:
            raise InvalidObjects(f"unknown tensor dtype {raw.get('dtype')!r}")
        data = bytearray(base64.b64decode(raw["data"], validate=True))
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(raw["shape"]).clone()
    if kind == "ndarray":
        if raw.get("dtype") not in _NUMPY:
            raise InvalidObjects(f"unknown array dtype {raw.get('dtype')!r}")
        data = base64.b64decode(raw["data"], validate=True)
        return np.frombuffer(data, dtype=raw["dtype"]).reshape(raw["shape"]).copy()
    raise InvalidObjects(f"unknown tag {kind!r}")
