"""run-local and a job file's spec.checkpoint: what it means on this machine."""

from __future__ import annotations

import pytest
import yaml

from liveshard.dev.commands.run_local import _job_checkpointing
from liveshard.runtime.errors import ConfigError


def _job(tmp_path, checkpoint: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
                                    "metadata": {"name": "j"}, "spec": {"checkpoint": checkpoint}}))
    return str(path)


def test_a_host_path_volume_is_this_machines_directory(tmp_path):
    where = tmp_path / "node" / "ckpt"
    got = _job_checkpointing(_job(tmp_path, {"path": "/checkpoints", "intervalSeconds": 60, "keep": 2,
                                             "volume": {"hostPath": {"path": str(where)}}}))
    assert got == {"checkpoint_dir": str(where), "checkpoint_interval_seconds": 60.0, "checkpoint_keep": 2}
    assert where.is_dir()  # made, as a kubelet makes a DirectoryOrCreate hostPath


def test_a_pods_path_on_another_volume_leaves_the_run_its_own_directory(tmp_path):
    got = _job_checkpointing(_job(tmp_path, {"path": "/checkpoints", "volume": {"emptyDir": {}}}))
    assert got == {}  # WORKDIR/checkpoints/periodic; /checkpoints is a path inside the pods
    assert _job_checkpointing(_job(tmp_path, {"intervalMinutes": 2})) == {"checkpoint_interval_seconds": 120.0}


def test_a_host_path_this_user_cannot_write_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as e:
        _job_checkpointing(_job(tmp_path, {"volume": {"hostPath": {"path": str(blocker / "ckpt")}}}))
    assert e.value.field == "spec.checkpoint.volume.hostPath.path" and "cannot be written" in str(e.value)


def test_a_host_path_holding_an_earlier_runs_checkpoints_is_refused(tmp_path):
    where = tmp_path / "ckpt"
    (where / "iter_0000004").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        _job_checkpointing(_job(tmp_path, {"volume": {"hostPath": {"path": str(where)}}}))
    assert e.value.field == "spec.checkpoint.volume.hostPath.path" and "not empty" in str(e.value)


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    """An interrupted command says so in one line (no traceback) and exits as a shell expects."""
    from liveshard.dev.commands import run_local
    from liveshard.runtime import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_local, "run", interrupted)
    assert cli.main(["run-local", "--model", "tiny-gpt", "--mock-data", "--procs", "1"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "liveshard run-local: interrupted"


def test_a_warm_up_the_steps_asked_for_cannot_hold_names_the_flags(capsys):
    """--train-iters below the job's warm-up: one line naming --train-iters and --warmup-iters,
    which then fixes it."""
    from pathlib import Path

    from liveshard.runtime import cli

    example = str(Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml")
    assert cli.main(["run-local", "--job", example, "--procs", "2", "--train-iters", "4", "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("liveshard run-local: error: --train-iters: 4 steps: the job's 20 warm-up steps")
    assert "--warmup-iters" in err
    assert cli.main(["run-local", "--job", example, "--procs", "2", "--train-iters", "4", "--warmup-iters", "1",
                     "--check"]) == 0
