"""A Hugging Face checkpoint directory: ``config.json`` and safetensors shards, read by slice.

Reading goes through ``safetensors.safe_open(...).get_slice``: only the bytes of the rows and
columns asked for are read (the file is memory-mapped; nothing else is touched), so a rank
importing its shard of a model reads its shard, not the model. Every file name comes from the
checkpoint's own index and must be a plain name inside the directory; config and index are
JSON. Nothing here executes or unpickles anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.hf.names import HFTensor

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# What export copies next to the weights when given a tokenizer directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "not found", "point at a Hugging Face model directory (config.json + "
                          "*.safetensors)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(str(path), f"cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "is not a JSON object")
    return data


def config_dtype(config: dict[str, Any]) -> str:
    """The checkpoint's parameter dtype as a ModelSpec ``params_dtype`` (bf16 when unknown)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return {"float32": "fp32", "float16": "fp16"}.get(name, "bf16")


class HFCheckpoint:
    """Slices of the tensors of one Hugging Face checkpoint directory."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ConfigError(str(directory), "is not a directory", "point at a Hugging Face model directory")
        self.config = read_config(self.directory)
        self.weight_map = self._weight_map()
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX
        if index.exists():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise ConfigError(str(index), "is not a safetensors index (no weight_map)") from None
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{index}: weight_map", "must be an object of tensor name -> file")
            for file in set(weight_map.values()):
                self._confined(str(file))
            return {str(k): str(v) for k, v in weight_map.items()}
        files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(str(self.directory), "has no *.safetensors files",
                              "save the model with safe_serialization (the default of save_pretrained)")
        from safetensors import safe_open

        out: dict[str, str] = {}
        for file in files:
            with safe_open(str(self.directory / file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    out[name] = file
        return out

    def _confined(self, file: str) -> Path:
        if not file or "/" in file or "\\" in file or file in (".", ".."):
            raise ConfigError(f"{self.directory / INDEX}: weight_map", f"file {file!r} is not a plain file name",
                              "a checkpoint's shards must lie in its own directory")
        return self.directory / file

    def _handle(self, name: str) -> Any:
        file = self.weight_map.get(name)
        if file is None:
            raise ConfigError(str(self.directory), f"has no tensor {name!r}",
                              "the checkpoint is incomplete or of another architecture")
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            path = self._confined(file)
            if not path.exists():
                raise ConfigError(str(path), f"missing (holds {name!r} by the index)", "download every shard")
            handle = self._handles[file] = safe_open(str(path), framework="pt")
        return handle

    def check(self, expected: list[HFTensor]) -> None:
        """Every tensor the model needs is present with its shape (one line naming the first that is not)."""
        for t in expected:
            sl = self._handle(t.name).get_slice(t.name)
            shape = tuple(sl.get_shape())
            if shape != t.shape:
                raise ConfigError(f"{self.directory}: {t.name}", f"has shape {list(shape)}, the model needs "
                                  f"{list(t.shape)}", "the config.json does not match the weights")

    def dtype(self, name: str) -> str:
        return _DTYPES.get(self._handle(name).get_slice(name).get_dtype(), "fp32")

    def read(self, name: str, rows: slice, cols: slice | None = None) -> Any:
        """Rows (and columns) of tensor ``name``: only those bytes are read."""
        sl = self._handle(name).get_slice(name)
        out = sl[rows] if cols is None else sl[rows, cols]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._handles.clear()


__all__ = ["INDEX", "SINGLE", "TOKENIZER_FILES", "HFCheckpoint", "config_dtype", "read_config"]
