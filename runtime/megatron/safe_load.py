"""Loading a checkpoint runs none of its code: the readers megatron-core and torch DCP use, made safe.

Every load path (a worker's restore, ``spec.training.initialWeights``, ``spec.training.resume``,
Megatron-LM save roots, ``liveshard convert --from``) goes through megatron's ``torch_dist``
strategy and torch DCP, which in torch 2.13 read three kinds of pickle:

* ``.metadata``: ``FileSystemReader.read_metadata`` is a bare ``pickle.load``;
* saved objects (megatron ``ShardedObject``\\ s: the RNG states, modules' ``_extra_state``):
  ``DefaultLoadPlanner.load_bytes`` is ``torch.load(weights_only=False)``;
* ``common.pt`` (megatron's common state; Megatron-LM's holds its pickled arguments): megatron's
  ``TorchCommonLoadStrategy`` calls ``torch.load`` without ``weights_only``, which
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into a full unpickler.

So a crafted checkpoint ran code in whatever loaded it, and a matching sha256 manifest did not help
(whoever crafts the files writes the manifest too). ``install()`` replaces the three readers,
process-wide and on every machine (unlike ``compat``, which patches only CPU-only processes):
``.metadata`` is read by an unpickler that resolves only the classes torch DCP writes there
(``METADATA_GLOBALS``, listed with ``pickletools`` from saves of this project's save path, sync
and async, with and without the distributed optimizer, from a two-rank megatron save and from a
plain torch DCP save) and torch's dtypes; saved
objects and ``common.pt`` are read with ``torch.load(weights_only=True)``. Anything else is
refused before it is built, as an ``UnsafeCheckpoint``: a ``ConfigError`` whose one line names
the file. Installing is idempotent; the load functions of ``agent.checkpoint`` and ``hf.weights``
call it before they read, so no caller has to remember.

Written against torch 2.13 and megatron-core 0.16.1. A patch whose target has moved is not
skipped (a silent skip would leave the pickle path open): ``install()`` raises instead.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from liveshard.runtime.errors import ConfigError

_DCP = "torch.distributed.checkpoint"

# What a torch DCP ``.metadata`` pickle names, and nothing more (torch dtypes are added by name:
# ``_is_dtype``). Each is a dataclass, an enum, ``torch.Size`` or a path, or turns a string back
# into ``torch.strided`` (``_get_layout``): building them with any arguments runs no code of the
# file's.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a plain torch DCP save
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    # megatron records every rank's save plan in the metadata (``all_local_plans``)
    (f"{_DCP}.planner", "SavePlan"),
    (f"{_DCP}.planner", "WriteItem"),
    (f"{_DCP}.planner", "WriteItemType"),
    (f"{_DCP}.planner", "TensorWriteData"),
})

FIX = "load only checkpoints written by liveshard or megatron-core's torch_dist save"
_MARK = "_liveshard_source"  # set on each Metadata read here: where its objects' files are

_lock = threading.Lock()
_installed = False
_dtype_names: frozenset[str] | None = None


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file holds something its format never does (code, a foreign class): refused
    before anything of it is built."""

    def __reduce__(self) -> tuple:
        # torch DCP gathers what each rank raised while reading to every rank, pickled
        return (type(self), (self.field, self.problem, self.fix))


def _is_dtype(name: str) -> bool:
    global _dtype_names
    if _dtype_names is None:
        import torch

        _dtype_names = frozenset(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))
    return name in _dtype_names


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``METADATA_GLOBALS`` and torch dtypes."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and _is_dtype(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(self._source, f"names {module}.{name}, which torch DCP metadata never holds "
                                             "(refused unread: unpickling it could run code)", FIX)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(self._source, "holds a persistent reference, which torch DCP metadata never does", FIX)


def load_metadata(stream: IO[bytes], source: str) -> Any:
    """The torch DCP ``Metadata`` pickled in ``stream`` (``source`` names it in errors)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(stream, source).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # not a pickle, truncated, or an allowed class given arguments it rejects
        raise UnsafeCheckpoint(source, f"is not torch DCP metadata ({type(e).__name__}: {_first_line(e)})",
                               FIX) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(source, f"holds a {type(metadata).__name__}, not torch DCP Metadata", FIX)
    return metadata


def read_metadata(path: str | os.PathLike) -> Any:
    """``load_metadata`` of the file ``path``."""
    with open(path, "rb") as f:
        return load_metadata(f, str(path))


def load_plain(source: Any, where: str, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)``: tensors and plain data only, whatever the
    environment says. A refusal names ``where``."""
    import torch

    kwargs.pop("weights_only", None)
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except OSError:  # a missing file is not a refusal: megatron falls back to an older name on it
        raise
    except Exception as e:
        raise UnsafeCheckpoint(where, f"is not plain data ({_weights_only_reason(e)}; refused unread: "
                                      "unpickling it could run code)", FIX) from None


def refusal(error: BaseException) -> UnsafeCheckpoint | None:
    """The ``UnsafeCheckpoint`` behind ``error``: torch DCP wraps what a rank raised while reading
    in a ``CheckpointException`` (a traceback per rank), megatron in its own exceptions."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UnsafeCheckpoint):
            return e
        failures = getattr(e, "failures", None)  # torch DCP's CheckpointException: {rank: (exc, tb)}
        if isinstance(failures, dict):
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    todo.append(first)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """Around a megatron or DCP load: a refused file surfaces as its one-line ``UnsafeCheckpoint``,
    not as the wrapper exceptions (with every rank's traceback) it arrives in."""
    try:
        yield
    except UnsafeCheckpoint:
        raise
    except BaseException as e:  # torch DCP's CheckpointException is a BaseException
        found = refusal(e)
        if found is None:
            raise
        raise UnsafeCheckpoint(found.field, found.problem, found.fix) from None


def install() -> None:
    """Replace torch DCP's and megatron's checkpoint readers with the safe ones. Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        _patch_metadata_reader()
        _patch_saved_objects()
        _patch_common_state()
        _installed = True


def is_installed() -> bool:
    return _installed


# ---- the patches ------------------------------------------------------------------------------
def _patch_metadata_reader() -> None:
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    reader = filesystem.FileSystemReader
    if not hasattr(reader, "_get_metadata_path") or not hasattr(reader, "read_metadata"):
        raise RuntimeError("torch DCP's FileSystemReader has changed: liveshard cannot make its metadata "
                           "reading safe (written against torch 2.13)")

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        # torch's own method, with the allow-listed unpickler in place of pickle.load
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        setattr(metadata, _MARK, str(self.path))
        return metadata

    read_metadata.__doc__ = "torch DCP metadata through liveshard's allow-listed unpickler (safe_load)."
    reader.read_metadata = read_metadata  # CachedMetadataFileSystemReader (megatron) calls it via super()


def _patch_saved_objects() -> None:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not hasattr(DefaultLoadPlanner, "load_bytes"):
        raise RuntimeError("torch DCP's DefaultLoadPlanner has changed: liveshard cannot make its object "
                           "reading safe (written against torch 2.13)")

    def load_bytes(self: Any, read_item: Any, value: Any) -> None:
        # torch's own method, with weights_only=True where it has weights_only=False
        obj = load_plain(value, _object_source(self, read_item))
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    DefaultLoadPlanner.load_bytes = load_bytes  # megatron's MCoreLoadPlanner inherits it


def _object_source(planner: Any, read_item: Any) -> str:
    """``<checkpoint>/<file>.distcp: object <key>`` of a saved object, as far as it is known."""
    metadata = getattr(planner, "metadata", None)
    fqn = read_item.storage_index.fqn
    info = (getattr(metadata, "storage_data", None) or {}).get(read_item.storage_index)
    name = getattr(info, "relative_path", None)
    directory = getattr(metadata, _MARK, None)
    where = str(Path(directory) / name) if directory and name else (name or directory or "checkpoint")
    return f"{where}: object {fqn!r}"


class _WeightsOnlyTorch:
    """``torch`` for megatron's common-state module: ``load`` is ``load_plain``."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def load(self, f: Any, map_location: Any = None, **kwargs: Any) -> Any:
        where = os.fspath(f) if isinstance(f, (str, os.PathLike)) else "common state"
        return load_plain(f, str(where), map_location=map_location, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _patch_common_state() -> None:
    import importlib

    import torch

    common = importlib.import_module("megatron.core.dist_checkpointing.strategies.common")
    if getattr(common, "torch", None) is not torch and not isinstance(getattr(common, "torch", None), _WeightsOnlyTorch):
        raise RuntimeError("megatron-core's TorchCommonLoadStrategy has changed: liveshard cannot make its "
                           "common.pt reading safe (written against megatron-core 0.16.1)")
    # module-local: common.pt and per-object .pt files (load_common, load_sharded_objects)
    common.torch = _WeightsOnlyTorch(torch)


# ---- messages ---------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _weights_only_reason(e: BaseException) -> str:
    """The line of torch's weights-only error that says what was found (it puts it in the middle
    of a paragraph of advice)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines[1:]:
        if not line.startswith(("Please file an issue", "Check the documentation")):
            return line[:200]
    return _first_line(e)


__all__ = ["FIX", "METADATA_GLOBALS", "UnsafeCheckpoint", "install", "is_installed", "load_metadata", "load_plain",
           "read_metadata", "refusal", "refusals"]
