"""The example jobs: valid against the CRD (schema and CEL rules, as the API server checks them),
accepted by the operator's own spec check, runnable commands, and plannable at both ends of their
worker range. The Karpenter example matches what the 70B job selects."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from liveshard.dev.localcluster.crd_validation import CRDValidator
from liveshard.runtime.cli import COMMANDS
from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.jobspec import read_spec, validate_spec
from liveshard.runtime.data.corpus import with_builtin_paths
from liveshard.runtime.planner.pods import Candidate, plan_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
JOB_FILES = ["tiny-cpu.yaml", "llama3-70b-spot-karpenter.yaml", "qwen3-235b-moe.yaml"]


def load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


@pytest.fixture(scope="module")
def validator(crd_validator) -> CRDValidator:
    return crd_validator


def the_job(name: str) -> dict[str, Any]:
    (job,) = load(name)
    assert job["kind"] == "ElasticTrainingJob" and job["apiVersion"] == "liveshard.io/v1alpha1"
    return job


def test_every_job_example_is_listed():
    jobs = {p.name for p in EXAMPLES.glob("*.yaml") if any(d.get("kind") == "ElasticTrainingJob"
                                                            for d in load(p.name))}
    assert jobs == set(JOB_FILES)


@pytest.mark.parametrize("name", JOB_FILES)
def test_example_is_valid_against_the_crd(validator, name):
    job = the_job(name)
    assert validator.errors(validator.default(job)) == []
    assert validate_spec(job["spec"]) is None


def test_the_validator_rejects_a_broken_example(validator):
    job = the_job("tiny-cpu.yaml")
    job["spec"]["workers"]["min"] = 9  # above max
    job["spec"]["training"]["microBatch"] = 3  # globalBatch 8 is not a multiple
    errors = validator.errors(validator.default(job))
    assert any("workers.min must be <= workers.max" in e for e in errors)
    job["spec"]["workers"]["min"] = 1
    assert any("multiple of microBatch" in e for e in validator.errors(validator.default(job)))


@pytest.fixture(scope="module", autouse=True)
def builtin_corpus(tmp_path_factory) -> Iterator[str]:
    """The built-in corpus the tiny example names (``builtin:corpus/...``), built once here."""
    root = str(tmp_path_factory.mktemp("builtin") / "corpus")
    old = os.environ.get(Env.CORPUS)
    os.environ[Env.CORPUS] = root
    yield root
    if old is None:
        os.environ.pop(Env.CORPUS, None)
    else:
        os.environ[Env.CORPUS] = old


@pytest.mark.parametrize("name", JOB_FILES)
def test_example_runs_a_real_worker_command(name):
    """The worker command and the environment the operator gives it resolve to the job's own
    model and training spec: nothing about the training is said twice."""
    from liveshard.operator import builders
    from liveshard.runtime.commands import training_args

    job = the_job(name)
    spec = job["spec"]
    command, args = spec.get("command", ["liveshard", "worker"]), spec.get("args", [])
    assert command[0] == "liveshard" and command[1] in COMMANDS
    module = __import__(COMMANDS[command[1]][0], fromlist=["configure"])
    parser = argparse.ArgumentParser()
    module.configure(parser)
    parsed = parser.parse_args(command[2:] + args)
    job.setdefault("metadata", {}).setdefault("namespace", "default")
    job_spec = read_spec(spec)
    pod = builders.worker_pod({**job, "metadata": {**job["metadata"], "uid": "u"}}, job_spec, 0)
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    model, training = training_args.resolve(parsed, env=env)
    assert model == job_spec.model and training == with_builtin_paths(job_spec.training)
    assert training.global_batch == spec["training"]["globalBatch"]


@pytest.mark.parametrize("name", JOB_FILES)
def test_example_plans_at_min_and_max_workers(name):
    spec = read_spec(the_job(name)["spec"])
    for n in (spec.workers.min, spec.workers.max):
        pods = [Candidate(pod=f"w-{i}", node=f"node-{i}") for i in range(n)]
        plan = plan_for(spec, pods)
        assert plan.world_size <= n * spec.workers.gpus_per_worker
        assert plan.world_size >= spec.workers.gpus_per_worker


def test_karpenter_nodepools_match_the_70b_job():
    pools = {d["metadata"]["name"]: d for d in load("karpenter-nodepool.yaml") if d["kind"] == "NodePool"}
    classes = {d["metadata"]["name"] for d in load("karpenter-nodepool.yaml") if d["kind"] == "EC2NodeClass"}
    assert all(p["spec"]["template"]["spec"]["nodeClassRef"]["name"] in classes for p in pools.values())
    spec = the_job("llama3-70b-spot-karpenter.yaml")["spec"]

    def capacity_types(pool: dict[str, Any]) -> list[str]:
        (req,) = [r for r in pool["spec"]["template"]["spec"]["requirements"]
                  if r["key"] == "karpenter.sh/capacity-type"]
        return req["values"]

    workers = pools[spec["template"]["nodeSelector"]["karpenter.sh/nodepool"]]
    assert capacity_types(workers) == [spec["template"]["nodeSelector"]["karpenter.sh/capacity-type"]] == ["spot"]
    for taint in workers["spec"]["template"]["spec"].get("taints", []):
        assert any(t["key"] == taint["key"] and t.get("effect") == taint["effect"]
                   for t in spec["template"]["tolerations"]), taint
    assert workers["spec"]["limits"]["nvidia.com/gpu"] >= spec["workers"]["max"] * spec["workers"]["gpusPerWorker"]
    coordinator = pools[spec["coordinator"]["nodeSelector"]["karpenter.sh/nodepool"]]
    assert capacity_types(coordinator) == ["on-demand"]


def test_the_tiny_example_runs_as_shipped_with_the_built_in_corpus(builtin_corpus, tmp_path):
    """``builtin:corpus/...`` resolves to the corpus (built on first use) wherever the job runs:
    run-local's up-front check (the tokenizer loads and fits, the dataset exists and every split
    has documents) passes on the file as shipped; ``prepare-data --builtin-corpus`` builds it."""
    from liveshard.runtime.data.corpus import resolve_builtin
    from liveshard.runtime.errors import ConfigError

    env = {**os.environ, Env.CORPUS: builtin_corpus}
    check = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "run-local", "--job",
                            str(EXAMPLES / "tiny-cpu.yaml"), "--check"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)
    assert check.returncode == 0 and "is valid" in check.stdout, check.stderr[-2000:]
    assert os.path.isfile(os.path.join(builtin_corpus, "tokenizer", "tokenizer.json"))
    assert resolve_builtin("builtin:corpus/tokenizer", "f") == os.path.join(builtin_corpus, "tokenizer")
    assert resolve_builtin("/data/x", "f") == "/data/x"
    with pytest.raises(ConfigError, match=r"^f: unknown built-in 'corpora'.*\(fix: use builtin:corpus/tokenizer"):
        resolve_builtin("builtin:corpora/tokenizer", "f")
    built = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "prepare-data", "--builtin-corpus",
                            str(tmp_path / "mine")], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert built.returncode == 0 and (tmp_path / "mine" / "data" / "corpus_text_document.bin").is_file(), built.stderr
    both = subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", "prepare-data", "--builtin-corpus",
                           "--input", "x.jsonl"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert both.returncode == 2 and both.stderr.count("\n") == 1 and "--builtin-corpus" in both.stderr
