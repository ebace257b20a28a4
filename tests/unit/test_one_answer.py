"""One job file, one answer: ``run-local --job`` starts the world the operator plans for the same
file (the same call, the same standby rule); a plan's predicted throughput says whose figures it
is; a notice for one node moves only that node's pods."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from test_operator_reconcile import T0, ack, coordinator, healthy, make_job, make_pod, step

from liveshard.operator import signals
from liveshard.runtime.cli import build_parser
from liveshard.runtime.commands import training_args

ROOT = Path(__file__).resolve().parents[2]
TINY_CPU = ROOT / "examples" / "tiny-cpu.yaml"


def tiny_cpu_job() -> dict:
    job = make_job()
    job["spec"] = copy.deepcopy(yaml.safe_load(TINY_CPU.read_text())["spec"])
    return job


def operator_plan(job: dict, pods: int, node_labels=None) -> dict:
    d, _ = step(job, [make_pod(i) for i in range(pods)] + [coordinator()], healthy(pods), node_labels=node_labels)
    return d.status["plan"]


def test_run_local_starts_the_world_the_operator_plans_for_the_same_file():
    from liveshard.dev.commands.run_local import _start_config
    from liveshard.runtime.parallel import ParallelConfig

    args = build_parser().parse_args(["run-local", "--job", str(TINY_CPU)])
    spec, training = training_args.resolve(args, env={})
    job_file = training_args.read_job_file(str(TINY_CPU))
    processes = job_file.workers_replicas * job_file.gpus_per_worker  # run-local's default --procs
    started = _start_config(args, spec, training, processes)
    plan = operator_plan(tiny_cpu_job(), job_file.workers_replicas)
    assert started == plan["config"]
    world = ParallelConfig.parse(started).world_size
    assert world == plan["worldSize"] == 2 and processes - world == 2  # dp=2 on 2, two standing by
    # a flag overriding the file is the operator's input too (a batch of 4 cannot take dp=4 either)
    args = build_parser().parse_args(["run-local", "--job", str(TINY_CPU), "--global-batch", "6"])
    spec, training = training_args.resolve(args, env={})
    job = tiny_cpu_job()
    job["spec"]["training"]["globalBatch"] = 6
    assert _start_config(args, spec, training, processes) == operator_plan(job, 4)["config"]


@pytest.mark.parametrize(("labels", "noted"), [
    (None, "no GPU model"),  # CPU nodes that advertise nvidia.com/gpu (local-cluster, kind)
    ({"nvidia.com/gpu.product": "NVIDIA-A10G"}, "NVIDIA-A10G"),
    ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, None),
])
def test_a_plans_predicted_throughput_says_whose_figures_it_is(labels, noted):
    nodes = {f"node-{i}": labels for i in range(4)} if labels else None
    plan = operator_plan(tiny_cpu_job(), 4, node_labels=nodes)
    assert "tokens/s from H100 figures" in plan["explanation"][0]
    notes = [line for line in plan["explanation"] if "GPU figures (H100)" in line]
    if noted is None:
        assert notes == []
    else:
        assert len(notes) == 1 and noted in notes[0] and "status.progress.tokensPerSecond" in notes[0]


def test_a_karpenter_notice_for_one_node_moves_only_its_pods():
    """Seen against a real API server: a Karpenter notice for worker-1's node left
    ``plan.leaving == [worker-0, worker-1]``: the planner swapped the healthy worker-0 (measured
    slower) for two standbys, restarting it for nothing. Only the noticed pod leaves."""
    job = tiny_cpu_job()
    pods = [make_pod(i) for i in range(4)] + [coordinator()]
    d, job = step(job, pods, healthy(4))
    assert d.status["plan"]["members"] == ["train-worker-0", "train-worker-1"]
    _, job = step(ack(job), pods, healthy(4), T0 + timedelta(seconds=5))
    job["status"]["standby"] = [{"pod": f"train-worker-{i}", "uid": f"pod-{i}"} for i in (2, 3)]  # up
    job["status"]["speeds"] = {"train-worker-0": 0.8, "train-worker-1": 1.0, "train-worker-2": 1.0,
                               "train-worker-3": 1.0}
    t1 = T0 + timedelta(seconds=10)
    nodes = healthy(4)
    nodes["node-1"] = signals.classify_node(
        {"metadata": {"name": "node-1"}, "spec": {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}},
        t1)
    d, _ = step(job, pods, nodes, t1)
    plan = d.status["plan"]
    assert plan["leaving"] == ["train-worker-1"], plan
    assert "train-worker-0" in plan["members"] and plan["worldSize"] == 2  # a standby fills worker-1's place
    assert "leaving: train-worker-1" in plan["reason"] and "train-worker-0" not in plan["reason"]


def test_run_local_without_a_workdir_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch, capsys):
    """Its directory of its own goes with the run, finished or failed (a failure says its logs
    went), after the run's report and failure line have read it."""
    import dataclasses
    import io
    import tempfile

    from liveshard.dev.commands.run_local import _workdir
    from liveshard.runtime.errors import RunFailed

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    @dataclasses.dataclass
    class Spec:
        workdir: str | None = None
        log: object = None

    with _workdir(Spec()) as running:
        made = Path(running.workdir)
        (made / "coordinator.log").write_text("log")
        assert made.name.startswith("liveshard-run-") and made.parent == tmp_path
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RunFailed), _workdir(Spec(log=io.StringIO())) as running:
        (Path(running.workdir) / "w0.log").write_text("the crash line")
        assert (Path(running.workdir) / "w0.log").read_text() == "the crash line"  # still there to report
        raise RunFailed("the job did not finish")
    assert list(tmp_path.iterdir()) == []
    assert "removed with it; give --workdir DIR to keep them" in capsys.readouterr().err
    kept = tmp_path / "mine"
    kept.mkdir()
    with _workdir(Spec(workdir=str(kept))) as running:  # a --workdir is the user's: kept
        (Path(running.workdir) / "coordinator.log").write_text("log")
    assert (kept / "coordinator.log").exists()


def test_plan_job_gives_the_operators_answer_for_the_same_file(capsys):
    import json

    from liveshard.runtime.cli import main

    assert main(["plan", "--job", str(TINY_CPU), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    job_file = training_args.read_job_file(str(TINY_CPU))
    operator = operator_plan(tiny_cpu_job(), job_file.workers_max)  # plan --job: workers.max pods
    assert planned["config"] == operator["config"] == "tp=1,pp=1,dp=2,ep=1"  # minDataParallel 2 kept
