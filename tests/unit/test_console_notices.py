"""The console tells the truth: a damaged checkpoint skipped, a resume, a failed final save and
the wait for space each reach run-local's console as one line as they happen (``notice``: a
file every process of the run appends to, printed once by the step printer), and a reused
workdir's earlier run is never replayed as this run's steps."""

from __future__ import annotations

import json
from pathlib import Path

from liveshard.dev.localrun.progress import StepPrinter
from liveshard.runtime.agent.checkpoint import MARKER, file_manifest, newest_complete
from liveshard.runtime.agent.final_save import Attempt, console_line
from liveshard.runtime.notice import NOTICES_ENV, notice


def _step(step: int, loss: float = 6.5) -> str:
    return json.dumps({"step": step, "loss": loss, "world_size": 1, "generation": 0}) + "\n"


def _save(root: Path, step: int) -> Path:
    d = root / f"step{step:08d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 100)
    (d / MARKER).write_text(json.dumps({"step": step, "config": "tp=1,pp=1,dp=1", "files": file_manifest(d)}))
    return d


def test_a_damaged_checkpoint_is_one_console_line_naming_the_one_resumed_from(tmp_path, monkeypatch):
    notices = tmp_path / "notices.jsonl"
    monkeypatch.setenv(NOTICES_ENV, str(notices))
    said: list[str] = []
    printer = StepPrinter(tmp_path, 10, said.append, notices=notices)
    _save(tmp_path / "ckpt", 4)
    newest = _save(tmp_path / "ckpt", 8)
    (newest / "__0_0.distcp").write_bytes(b"y" * 100)  # same size, other bytes: caught by sha256
    assert newest_complete(tmp_path / "ckpt")["step"] == 4
    assert newest_complete(tmp_path / "ckpt")["step"] == 4  # asked again (another first world)
    printer.poll()
    assert said == ["checkpoint step00000008 is damaged (__0_0.distcp: content differs from what the save "
                    "wrote (sha256)); resuming from step00000004"]


def test_only_this_runs_lines_are_printed_from_a_reused_workdir(tmp_path, monkeypatch):
    notices = tmp_path / "notices.jsonl"
    (tmp_path / "w0.steps.jsonl").write_text(_step(1) + _step(2))  # an earlier run's
    monkeypatch.setenv(NOTICES_ENV, str(notices))
    notice("resuming from the checkpoint of step 2 (/old)")  # an earlier run's notice
    said: list[str] = []
    printer = StepPrinter(tmp_path, 4, said.append, notices=notices)
    printer.poll()
    assert said == []
    with open(tmp_path / "w0.steps.jsonl", "a") as f:
        f.write(_step(1, 7.25))
    (tmp_path / "w1.steps.jsonl").write_text(_step(2, 7.0))  # a worker the earlier run did not have
    notice("final checkpoint: no space left in /ckpt; next attempt in 5 s")
    printer.poll()
    assert said == ["final checkpoint: no space left in /ckpt; next attempt in 5 s",
                    "step 1/4  loss 7.2500  world 1", "step 2/4  loss 7.0000  world 1"]


def test_the_final_saves_console_line_says_where_it_failed_and_what_comes_next():
    full = "No space left on device (1024 bytes free in /ckpt): OSError: [Errno 28] No space left on device"
    assert console_line("/ckpt", full, Attempt("/ckpt", 5.0)) == \
        "final checkpoint: no space left in /ckpt; next attempt in 5 s"
    assert console_line("/ckpt", full, Attempt("/fallback")) == \
        "final checkpoint: no space left in /ckpt; next attempt in /fallback now"
    assert console_line("/ckpt", "rank 1: OSError: EIO", None) == \
        "final checkpoint: rank 1: OSError: EIO in /ckpt; giving up"
