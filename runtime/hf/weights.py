"""Move weights between a Hugging Face checkpoint and megatron-core, in any layout.

* ``load_hf(model, spec, directory)`` fills this rank's parameters of a built ``GPTModel`` from a
  Hugging Face checkpoint. It walks the model's own ``sharded_state_dict()`` boxes (key, global
  offset, local slice: ``megatron.extract.param_boxes``), so any layer spec whose sharded keys
  are megatron's (the local spec, TransformerEngine's) is filled, and each rank reads only the
  rows and columns of the boxes it holds.
* ``export_hf(checkpoint, spec, out)`` writes a megatron ``dist_checkpointing`` checkpoint of any
  layout as sharded safetensors: for each output file, the logical tensors it is made of are
  loaded at full shape through megatron's ``torch_dist`` strategy (which reshards from whatever
  layout wrote them), reassembled into Hugging Face's tensors and saved; memory holds one
  output file at a time.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from liveshard.runtime.dtypes import torch_dtype
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.hf.checkpoint import INDEX, SINGLE, TOKENIZER_FILES, HFCheckpoint
from liveshard.runtime.hf.config import hf_config_from_spec, spec_from_hf_config
from liveshard.runtime.hf.names import (
    HFTensor,
    LogicalTensor,
    hf_tensors,
    logical_units,
    reads_for_box,
    segments_by_unit,
)
from liveshard.runtime.spec import ModelSpec

# ModelSpec fields that do not change a checkpoint's tensors or the forward pass.
_NOT_COMPARED = ("name", "params_dtype", "max_sequence_length", "make_vocab_size_divisible_by", "transformer_impl")
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default


def check_matches(spec: ModelSpec, config: dict[str, Any], source: str) -> None:
    """Raise when the job's model is not the model of ``config`` (one line naming the first field)."""
    theirs = spec_from_hf_config(config, source=source)
    for name, value in spec.to_dict().items():
        if name in _NOT_COMPARED:
            continue
        if getattr(theirs, name) != value:
            raise ConfigError(f"model.{name}", f"is {value!r}, the weights' {source} says {getattr(theirs, name)!r}",
                              f"set model.{name}: {getattr(theirs, name)!r} (or take the model from the "
                              f"weights: liveshard convert --from hf:DIR --print-model)")


def load_hf(model: Any, spec: ModelSpec, directory: str | os.PathLike,
            progress: Callable[[int, int], None] | None = None) -> int:
    """Fill ``model``'s local parameters from the Hugging Face checkpoint in ``directory``;
    return the bytes read. Vocabulary padding rows are zeroed."""
    from liveshard.runtime.megatron.extract import param_boxes

    ckpt = HFCheckpoint(directory)
    check_matches(spec, ckpt.config, str(Path(directory) / "config.json"))
    ckpt.check(hf_tensors(spec))
    segments = segments_by_unit(spec)
    boxes = param_boxes(model)
    with torch.no_grad():
        for i, b in enumerate(boxes):
            n_index = len(b.global_shape) - len(b.local_shape)
            index, inner = tuple(b.global_offset[:n_index]), b.global_offset[n_index:]
            segs = segments.get((b.key, index))
            if segs is None:
                raise ConfigError(f"model: {b.key}", "has no Hugging Face counterpart",
                                  "import supports Llama/Qwen-style models (RMSNorm, rope, SwiGLU)")
            view = b.param.data[tuple(slice(o, o + n) for o, n in zip(b.local_offset, b.local_shape))]
            cols = slice(inner[1], inner[1] + b.local_shape[1]) if len(inner) > 1 else None
            filled = 0
            for seg, hf_row, box_row, count in reads_for_box(segs, inner[0], b.local_shape[0]):
                part = ckpt.read(seg.hf_name, slice(hf_row, hf_row + count), cols)
                view[box_row:box_row + count].copy_(part)
                filled += count
            if filled < b.local_shape[0]:  # vocabulary padding: after the last real row
                view[filled:].zero_()
            if progress is not None:
                progress(i + 1, len(boxes))
    ckpt.close()
    return ckpt.bytes_read


# ---- export ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputFile:
    name: str
    tensors: tuple[HFTensor, ...]


def plan_files(spec: ModelSpec, itemsize: int, max_bytes: int = DEFAULT_SHARD_BYTES) -> list[OutputFile]:
    """Hugging Face tensors grouped into ``model-0000i-of-0000n.safetensors`` files of at most
    ``max_bytes`` (a tensor larger than that gets a file of its own)."""
    groups: list[list[HFTensor]] = [[]]
    size = 0
    for t in hf_tensors(spec):
        nbytes = t.numel * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    n = len(groups)
    if n == 1:
        return [OutputFile(SINGLE, tuple(groups[0]))]
    return [OutputFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def megatron_checkpoint_dir(directory: str | os.PathLike, *, check: bool = True) -> Path:
    """The directory holding ``.metadata``: ``directory`` itself, or the iteration a Megatron-LM
    save root names in ``latest_checkpointed_iteration.txt``. With ``check``, its ``.metadata``
    is read through the allow-listed unpickler (``megatron.safe_load``): one that is not torch
    DCP metadata is an ``UnsafeCheckpoint`` naming it, before anything else is read."""
    root = Path(directory)
    if (root / ".metadata").exists():
        return _checked(root) if check else root
    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.exists():
        text = tracker.read_text().strip()
        if text.isdigit():
            path = root / f"iter_{int(text):07d}"
            if (path / ".metadata").exists():
                return _checked(path) if check else path
        raise ConfigError(str(tracker), f"names iteration {text!r}, which has no torch_dist checkpoint",
                          "point at an iteration directory saved with --ckpt-format torch_dist")
    raise ConfigError(str(root), "is not a megatron torch_dist checkpoint (no .metadata)",
                      "point at a liveshard checkpoint or a Megatron-LM save directory")


def _checked(directory: Path) -> Path:
    from liveshard.runtime.megatron import safe_load

    try:
        safe_load.read_metadata(directory / ".metadata")
    except OSError as e:
        raise ConfigError(str(directory / ".metadata"), f"cannot be read ({e.strerror or e})") from None
    return directory


def load_logical(directory: str | os.PathLike, units: list[LogicalTensor], dtype: torch.dtype) -> dict[tuple, torch.Tensor]:
    """Whole (key, layer[, expert]) slices of a torch_dist checkpoint, at ``dtype``.

    One box per key (torch DCP takes one local shard per key and load): the bounding box of the
    indices asked for, which for the tensors of one output file are consecutive layers (and
    experts). Reads through megatron's sharded strategy only: the checkpoint's common state
    (``common.pt``, a pickle in Megatron-LM's saves) is never opened.
    """
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from liveshard.runtime.megatron import safe_load

    safe_load.install()
    if not dist.is_initialized():  # an exporting process is a world of its own
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    by_key: dict[str, list[LogicalTensor]] = {}
    for u in units:
        by_key.setdefault(u.key, []).append(u)
    keys = sorted(by_key)
    sd: dict[str, Any] = {}
    starts: dict[str, tuple[int, ...]] = {}
    for i, key in enumerate(keys):
        group = by_key[key]
        u0 = group[0]
        n = len(u0.index)
        lo = tuple(min(u.index[a] for u in group) for a in range(n))
        hi = tuple(max(u.index[a] for u in group) + 1 for a in range(n))
        local = (*(h - low for low, h in zip(lo, hi)), *u0.shape)
        starts[key] = lo
        sd[f"t{i}"] = ShardedTensor(key=key, data=torch.empty(local, dtype=dtype), dtype=dtype, local_shape=local,
                                    global_shape=u0.global_shape, global_offset=(*lo, *(0,) * len(u0.shape)),
                                    axis_fragmentations=None, replica_id=0)
    try:
        with safe_load.refusals():
            loaded = TorchDistLoadShardedStrategy().load(sd, Path(directory))
    except safe_load.UnsafeCheckpoint:
        raise
    except Exception as e:  # a key or shape the checkpoint does not have
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(str(directory), f"cannot be read as this model: {first[:300]}",
                          "give the model the checkpoint was trained with (--model)") from None
    boxes = {key: loaded[f"t{i}"] for i, key in enumerate(keys)}
    return {(u.key, u.index): boxes[u.key][tuple(i - s for i, s in zip(u.index, starts[u.key]))] for u in units}


def export_hf(checkpoint: str | os.PathLike, spec: ModelSpec, out: str | os.PathLike, *, dtype: str | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: str | None = None, procs: int = 1,
              proc: int = 0, progress: Callable[[int, int], None] | None = None) -> list[OutputFile]:
    """Write the model weights of ``checkpoint`` (any layout) as a Hugging Face model in ``out``.

    With ``procs > 1`` this is process ``proc`` of ``procs`` independent writers: it writes every
    ``procs``-th file; process 0 writes config.json, the index and the tokenizer files.
    """
    source = megatron_checkpoint_dir(checkpoint)
    dtype = dtype or spec.params_dtype
    tdtype = torch_dtype(dtype)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    itemsize = tdtype.itemsize
    files = plan_files(spec, itemsize, max_shard_bytes)
    units = logical_units(spec)
    from safetensors.torch import save_file

    mine = files[proc::procs]
    for done, f in enumerate(mine):
        needed = sorted({(s.key, s.index) for t in f.tensors for s in t.segments})
        loaded = load_logical(source, [units[k] for k in needed], tdtype)
        tensors: dict[str, torch.Tensor] = {}
        for t in f.tensors:
            full = torch.empty(t.shape, dtype=tdtype)
            for s in t.segments:
                full[s.hf_row:s.hf_row + s.rows] = loaded[(s.key, s.index)][s.row:s.row + s.rows]
            tensors[t.name] = full
        del loaded
        tmp = out_dir / f".{f.name}.partial"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, _file_mode())  # safetensors writes 0600: a model is read by other users and tools
        os.replace(tmp, out_dir / f.name)
        if progress is not None:
            progress(done + 1, len(mine))
    if proc == 0:
        config = hf_config_from_spec(spec, {"fp32": "float32", "fp16": "float16"}.get(dtype, "bfloat16"))
        if tokenizer:
            config.update(special_token_ids(tokenizer))
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(t.numel * itemsize for f in files for t in f.tensors)},
                     "weight_map": {t.name: f.name for f in files for t in f.tensors}}
            (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if tokenizer:
            copy_tokenizer(tokenizer, out_dir)
    return files


@functools.cache
def _file_mode() -> int:
    """0666 less this process's umask: the mode an ordinary file write gets. Read once:
    reading the umask means setting it, for a moment, process-wide."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def special_token_ids(tokenizer_dir: str | os.PathLike) -> dict[str, int]:
    """``bos_token_id``/``eos_token_id`` for config.json: the ids, in the tokenizer's vocabulary,
    of the tokens its ``tokenizer_config.json`` names (none when it names none or the vocabulary
    has no such token)."""
    from liveshard.runtime.inputs import MAX_TOKENIZER_BYTES

    src = Path(tokenizer_dir)
    try:
        if max((src / n).stat().st_size for n in ("tokenizer_config.json", "tokenizer.json")) > MAX_TOKENIZER_BYTES:
            return {}  # no tokenizer file: copy_tokenizer refuses it in one line
        names = json.loads((src / "tokenizer_config.json").read_text())
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(src / "tokenizer.json"))
    except Exception:  # no config, no tokenizer.json, or one the tokenizers library cannot read
        return {}
    ids: dict[str, int] = {}
    for key in ("bos", "eos"):
        token = names.get(f"{key}_token") if isinstance(names, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        index = vocab.token_to_id(token) if isinstance(token, str) else None
        if index is not None:
            ids[f"{key}_token_id"] = index
    return ids


def tokenizer_files(source: str | os.PathLike) -> list[str]:
    """The tokenizer files of directory ``source`` an export copies, each within
    ``MAX_TOKENIZER_BYTES`` (checked before anything is written: one line, exit 2)."""
    from liveshard.runtime.inputs import MAX_TOKENIZER_BYTES, check_size

    src = Path(source)
    if not src.is_dir():
        raise ConfigError("--tokenizer", f"{source} is not a directory", "a directory with tokenizer.json")
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise ConfigError("--tokenizer", f"{source} has no tokenizer.json or tokenizer.model")
    for name in copied:  # each a few MB at most: a larger one is no tokenizer file
        check_size(src / name, "--tokenizer", what="tokenizer file", limit=MAX_TOKENIZER_BYTES)
    return copied


def copy_tokenizer(source: str | os.PathLike, out_dir: Path) -> list[str]:
    src = Path(source)
    copied = tokenizer_files(src)
    for name in copied:
        shutil.copyfile(src / name, out_dir / name)
    return copied


__all__ = ["DEFAULT_SHARD_BYTES", "OutputFile", "check_matches", "export_hf", "load_hf", "load_logical",
           "megatron_checkpoint_dir", "plan_files"]
