"""Checkpoint files are read without running their code (``runtime/megatron/safe_load.py``): torch
DCP metadata through an allow-listed unpickler, saved objects and ``common.pt`` weights-only. A
crafted file is refused with one line naming it, and what it would have run never runs."""

from __future__ import annotations

import builtins
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.megatron.safe_load import UnsafeCheckpoint, load_plain, read_metadata, refusal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Shell:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


class Exec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


class Dotted:
    """A name inside an allowed class (pickle resolves dotted names attribute by attribute)."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        import torch.distributed.checkpoint.metadata as m

        return (m.Metadata.__init__, ())


@pytest.fixture
def genuine(tmp_path: Path) -> Path:
    """A torch DCP checkpoint as torch 2.13 writes it (one process, no process group)."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "genuine"
    dcp.save({"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "obj": io.BytesIO(b"x"), "n": 3},
             checkpoint_id=str(d), no_dist=True)
    return d


def _one_line(e: BaseException, path: Path) -> str:
    text = str(e)
    assert "\n" not in text and str(path) in text, text
    return text


def test_the_payloads_run_when_unpickled(tmp_path: Path) -> None:
    """What the tests below refuse is live: a bare unpickler runs it."""
    for cls in (Shell, Exec):
        marker = tmp_path / cls.__name__
        pickle.loads(pickle.dumps(cls(marker)))
        assert marker.exists()


def test_genuine_metadata_reads_as_pickle_reads_it(genuine: Path) -> None:
    with open(genuine / ".metadata", "rb") as f:
        expected = pickle.load(f)
    got = read_metadata(genuine / ".metadata")
    assert got.state_dict_metadata == expected.state_dict_metadata
    assert got.storage_data == expected.storage_data


@pytest.mark.parametrize("payload", ["shell", "exec", "shell-inside-metadata", "dotted"])
def test_crafted_metadata_runs_nothing_and_names_the_file(genuine: Path, tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "ran"
    path = genuine / ".metadata"
    if payload == "shell":
        data = pickle.dumps(Shell(marker))
    elif payload == "exec":
        data = pickle.dumps(Exec(marker))
    elif payload == "dotted":
        data = pickle.dumps(Dotted(), protocol=4)
    else:  # a loadable checkpoint's metadata with one field replaced: the realistic attack
        metadata = read_metadata(path)
        metadata.planner_data = Shell(marker)
        data = pickle.dumps(metadata)
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpoint) as info:
        read_metadata(path)
    text = _one_line(info.value, path)
    assert isinstance(info.value, ConfigError) and "refused unread" in text
    assert {"shell": "system", "exec": "builtins.exec", "dotted": "Metadata.__init__"}.get(payload, "system") in text
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"garbage", pickle.dumps(torch.Size([1, 2])), pickle.dumps({"a": 1})])
def test_what_is_not_metadata_is_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(content)
    with pytest.raises(UnsafeCheckpoint) as info:
        read_metadata(path)
    assert "torch DCP" in _one_line(info.value, path)


def test_saved_objects_are_weights_only_whatever_the_environment(tmp_path: Path, monkeypatch: Any) -> None:
    """``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns torch.load's default into a full unpickler;
    an explicit ``weights_only=True`` is what it cannot override."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "ran"
    path = tmp_path / "common.pt"
    torch.save({"progress": {"step": 3}, "args": Shell(marker)}, path)
    with pytest.raises(UnsafeCheckpoint) as info:
        load_plain(str(path), str(path), map_location="cpu")
    assert "system" in _one_line(info.value, path)
    assert not marker.exists()
    torch.save({"progress": {"step": 3}, "rng": torch.get_rng_state()}, path)
    loaded = load_plain(str(path), str(path), map_location="cpu")
    assert loaded["progress"] == {"step": 3} and torch.equal(loaded["rng"], torch.get_rng_state())


def test_a_refusal_is_found_inside_torch_dcps_wrapper() -> None:
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.api import _wrap_exception

    inner = UnsafeCheckpoint("/ckpt/__0_0.distcp: object 'rng'", "is not plain data")
    wrapped = CheckpointException("read", {0: _wrap_exception(inner)})
    assert refusal(wrapped) is inner
    assert refusal(RuntimeError("x")) is None
