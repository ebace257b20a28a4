"""A Hugging Face checkpoint directory: ``config.json`` and safetensors shards, read by slice.

Reading goes through ``safetensors.safe_open(...).get_slice``: only the bytes of the rows and
columns asked for are read (the file is memory-mapped; nothing else is touched), so a rank
importing its shard of a model reads its shard, not the model. Every file name comes from the
checkpoint's own index and must be a plain name inside the directory; config and index are
JSON. Nothing here executes or unpickles anything.
"""

from __future__ import annotations

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
    from liveshard.runtime.inputs import load_json

    path = Path(directory) / "config.json"
    if not path.exists():
        raise ConfigError(str(path), "not found", "point at a Hugging Face model directory (config.json + "
                          "*.safetensors)")
    data = load_json(path, str(path), what="Hugging Face config.json")
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
        self._names: dict[str, set[str]] = {}  # per open shard: the tensors its header lists
        self.bytes_read = 0

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX
        if index.exists():
            from liveshard.runtime.inputs import load_json

            data = load_json(index, str(index), what="safetensors index")
            try:
                weight_map = data["weight_map"]
            except (KeyError, TypeError):
                raise ConfigError(str(index), "is not a safetensors index (no weight_map)",
                                  "download the model's model.safetensors.index.json again") from None
            if not isinstance(weight_map, dict):
                raise ConfigError(f"{index}: weight_map", "must be an object of tensor name -> file")
            for file in set(weight_map.values()):
                self._confined(str(file))
            return {str(k): str(v) for k, v in weight_map.items()}
        files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(str(self.directory), "has no *.safetensors files",
                              "save the model with safe_serialization (the default of save_pretrained)")
        out: dict[str, str] = {}
        for file in files:
            with _open(self.directory / file) as f:
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
            path = self._confined(file)
            if not path.exists():
                raise ConfigError(str(path), f"missing (holds {name!r} by the index)", "download every shard")
            handle = self._handles[file] = _open(path)
            self._names[file] = set(handle.keys())
        if name not in self._names[file]:
            raise ConfigError(str(self.directory / file), f"has no tensor {name!r}, which the index places there",
                              "the index and the shards are of different downloads: download them again")
        return handle

    def check(self, expected: list[HFTensor]) -> None:
        """Every tensor the model needs is present with its shape (one line naming the first that is not)."""
        for t in expected:
            sl = self._handle(t.name).get_slice(t.name)
            shape = tuple(sl.get_shape())
            if shape != t.shape:
                raise ConfigError(f"{self.directory}: {t.name}", f"has shape {list(shape)}, the model needs "
                                  f"{list(t.shape)}", "the config.json does not match the weights")
            if sl.get_dtype() not in _DTYPES:
                raise ConfigError(f"{self.directory / self.weight_map[t.name]}: {t.name}",
                                  f"holds {sl.get_dtype()} values, not weights (F32, BF16 or F16)",
                                  "use a checkpoint of floating-point weights")

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
        self._names.clear()


def _open(path: Path) -> Any:
    """``safe_open`` of one shard; a header that lies about the file (sizes, offsets, JSON) is one
    line naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        why = " ".join(str(e).split())[:200]
        raise ConfigError(str(path), f"is not a valid safetensors file ({why})",
                          "download it again: its header does not match its contents") from None


__all__ = ["INDEX", "SINGLE", "TOKENIZER_FILES", "HFCheckpoint", "config_dtype", "read_config"]
