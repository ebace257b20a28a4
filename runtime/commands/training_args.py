"""What a process trains, from the three places it can be said, for ``worker``, ``coordinator``
and ``run-local``:

1. ``--job FILE``: an ElasticTrainingJob manifest, the same file ``kubectl apply`` takes;
2. the environment the operator sets in a job's pods (``LIVESHARD_MODEL``, ``LIVESHARD_TRAINING``);
3. flags alone (``--model``, ``--data-prefix``/``--tokenizer`` or ``--mock-data``, ``--train-iters``…).

Flags given together with 1 or 2 override single fields (``--global-batch``, ``--seq-length``,
``--lr``, ``--train-iters``, ``--seed``); every result is checked by the one reader of
``spec.training`` (``contract.training.read_training``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.training import TRAINING_ENV, TrainingSpec, check_against_model, read_training
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.spec import ModelSpec


@dataclass(frozen=True)
class JobFile:
    """What a local run takes from a manifest besides the model and training spec."""

    name: str
    raw: dict[str, Any]
    workers_max: int
    workers_replicas: int  # the pods the operator starts: spec.workers.replicas, else max
    gpus_per_worker: int


def add_arguments(p: argparse.ArgumentParser, *, defaults_from_env: bool = True) -> None:
    g = p.add_argument_group("what to train (overrides of --job / the job's spec)")
    g.add_argument("--job", dest="job_file", default=None, metavar="FILE",
                   help="an ElasticTrainingJob manifest (YAML): its spec.model and spec.training")
    g.add_argument("--model", default=None,
                   help="preset name or YAML file (default: the job's spec.model, or $LIVESHARD_MODEL)")
    g.add_argument("--data-prefix", action="append", default=None, metavar="[WEIGHT:]PREFIX",
                   help="a Megatron indexed dataset (PREFIX.bin/.idx from liveshard prepare-data); repeat to blend")
    g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json, or a SentencePiece .model")
    g.add_argument("--mock-data", action="store_true", help="train on synthetic tokens (tests and demos)")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps of the whole run")
    g.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (globalBatch)")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (microBatch)")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (seqLength)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (optimizer.lr)")
    g.add_argument("--warmup-iters", type=int, default=None,
                   help="steps of learning-rate warm-up (schedule.warmupIters)")
    g.add_argument("--seed", type=int, default=None, help="random seed (seed)")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                   help="training dtype (precision; default: the job's, else the model's dtype)")


_WARNED: set[tuple[str, str]] = set()


def read_job_file(path: str) -> JobFile:
    """The manifest at ``path``: one ElasticTrainingJob (``---`` separated documents allowed)."""
    from liveshard.runtime.inputs import load_job_manifest

    docs = [d for d in load_job_manifest(path, "--job") if d]
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "ElasticTrainingJob"]
    if len(jobs) != 1:
        raise ConfigError("--job", f"{path} holds {len(jobs)} ElasticTrainingJob documents",
                          "give a file with exactly one (kind: ElasticTrainingJob)")
    job = jobs[0]
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
    from liveshard.runtime.contract.jobspec import deprecated_fields

    for line in deprecated_fields(spec):
        if (path, line) not in _WARNED:  # the file is read more than once per command
            _WARNED.add((path, line))
            print(f"warning: {path}: {line}", file=sys.stderr)
    workers = spec.get("workers") if isinstance(spec.get("workers"), dict) else {}
    meta = job.get("metadata") if isinstance(job.get("metadata"), dict) else {}
    workers_max = _count(workers, "max", 1)
    return JobFile(name=str(meta.get("name") or "job"), raw=job, workers_max=workers_max,
                   workers_replicas=_count(workers, "replicas", workers_max),
                   gpus_per_worker=_count(workers, "gpusPerWorker", 8))


def _count(workers: dict[str, Any], key: str, default: int) -> int:
    """``spec.workers.<key>`` as a positive integer (``read_spec`` names a bad one first)."""
    value = workers.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"spec.workers.{key}", f"must be an integer >= 1, got {value!r}")
    return value


# flags that override single fields of spec.training (lr: of its optimizer section)
_FLAGS = (("train_iters", "trainIters"), ("global_batch", "globalBatch"), ("micro_batch", "microBatch"),
          ("seq_length", "seqLength"), ("seed", "seed"), ("precision", "precision"), ("lr", "lr"))


def _blend(prefixes: list[str]) -> list[dict[str, Any]]:
    out = []
    for item in prefixes:
        weight, sep, prefix = item.partition(":")
        try:
            out.append({"prefix": prefix, "weight": float(weight)} if sep else {"prefix": item})
        except ValueError:
            out.append({"prefix": item})  # a path with a colon in it
    return out


def resolve(args: argparse.Namespace, *, env: dict[str, str] | None = None,
            default_steps: int | None = None) -> tuple[ModelSpec, TrainingSpec]:
    """The model and training spec this process runs: ``--job``, else the operator's
    environment, else the flags; flags override single fields of the first two."""
    env = dict(os.environ) if env is None else env
    model, section, source = _base(args, env, default_steps)
    _override(args, section, source, default_steps)
    path = "spec.training" if source != "flags" else "training"
    training = _read_named_by_flag(args, section, path, model)
    check_against_model(training, model.max_sequence_length,
                        field="--seq-length" if args.seq_length else "spec.training.seqLength")
    from liveshard.runtime.data.corpus import with_builtin_paths

    training = with_builtin_paths(training, path)
    return replace(model, params_dtype=training.precision), training


def _base(args: argparse.Namespace, env: dict[str, str],
          default_steps: int | None) -> tuple[ModelSpec, dict[str, Any], str]:
    """(model, training section, where it came from): the job file, the operator's environment,
    or a small run from the flags."""
    if getattr(args, "job_file", None):
        model, section = _from_job_file(args)
        return model, section, "spec.training"
    if env.get(TRAINING_ENV) and not args.model:
        if not env.get(Env.MODEL):
            raise ConfigError(Env.MODEL, f"is not set but {TRAINING_ENV} is", "pass --model PRESET|FILE")
        from liveshard.runtime.inputs import parse_json

        model = ModelSpec.from_dict(parse_json(env[Env.MODEL], Env.MODEL, Env.MODEL), source=Env.MODEL)
        return model, TrainingSpec.from_json(env[TRAINING_ENV]).to_section(), TRAINING_ENV
    from liveshard.runtime.spec import model_from_ref_or_env

    model = model_from_ref_or_env(args.model)
    section = {"globalBatch": 8, "microBatch": 1, "seqLength": min(32, model.max_sequence_length),
               "trainIters": default_steps or 100, "optimizer": {"lr": 1e-3, "minLr": 1e-4, "weightDecay": 0.0},
               "schedule": {"warmupIters": 2, "decayIters": 1000}, "precision": model.params_dtype}
    if not (args.mock_data or args.data_prefix):
        raise ConfigError("--data-prefix", "no training data given",
                          "pass --job FILE (its spec.training.data), --data-prefix PREFIX --tokenizer DIR "
                          "(liveshard prepare-data writes them) or --mock-data")
    return model, section, "flags"


def _from_job_file(args: argparse.Namespace) -> tuple[ModelSpec, dict[str, Any]]:
    """The model and training section of ``--job`` (``--model`` overrides its model)."""
    from liveshard.runtime.contract.jobspec import read_spec
    from liveshard.runtime.spec import load_model

    job = read_job_file(args.job_file)
    if not isinstance(job.raw.get("spec"), dict):
        raise ConfigError(f"{args.job_file}: spec", "is missing or not a mapping",
                          "give the job a spec: {model, workers, training}")
    raw_spec = dict(job.raw["spec"])
    raw_spec.setdefault("image", "local")  # a local run has no image
    if args.model:  # --model overrides the manifest's
        raw_spec["model"] = load_model(args.model).to_crd()
    try:
        spec = read_spec(raw_spec)
    except ConfigError as e:
        raise ConfigError(f"{args.job_file}: {e.field}", e.problem, e.fix) from None
    return spec.model, spec.training.to_section()


def _override(args: argparse.Namespace, section: dict[str, Any], source: str, default_steps: int | None) -> None:
    """The flags' single fields over ``section`` (data, tokenizer, sizes, warm-up, lr)."""
    if args.mock_data:
        section["data"] = {"mock": True}
        section.pop("tokenizer", None)
    if args.data_prefix:
        section["data"] = {**(section.get("data") or {}), "blend": _blend(args.data_prefix)}
        section["data"].pop("mock", None)
    if args.tokenizer:
        kind = "sentencepiece" if args.tokenizer.endswith(".model") else "huggingface"
        section["tokenizer"] = {"type": kind, "path": args.tokenizer}
    for flag, key in _FLAGS[:-1]:
        value = getattr(args, flag, None)
        if value is not None:
            section[key] = value
            if key == "trainIters":
                section.pop("trainSamples", None)
    if args.train_iters is None and default_steps is not None and source == "flags":
        section["trainIters"] = default_steps
    warmup = getattr(args, "warmup_iters", None)
    if warmup is not None:
        schedule = {k: v for k, v in (section.get("schedule") or {}).items() if k != "warmupFraction"}
        section["schedule"] = {**schedule, "warmupIters": warmup}
    if args.lr is not None:
        section["optimizer"] = {**(section.get("optimizer") or {}), "lr": args.lr}
        if section["optimizer"].get("minLr", 0) > args.lr:
            section["optimizer"]["minLr"] = args.lr / 10


def _read_named_by_flag(args: argparse.Namespace, section: dict[str, Any], path: str,
                        model: ModelSpec) -> TrainingSpec:
    """``read_training`` of the section; a value a flag gave is named by its flag."""
    try:
        return read_training(section, path=path, default_seq_length=model.max_sequence_length)
    except ConfigError as e:
        flag = next((f"--{name.replace('_', '-')}" for name, key in _FLAGS
                     if e.field in (f"{path}.{key}", f"{path}.optimizer.{key}") and getattr(args, name, None) is not None),
                    None)
        if flag is None and e.field == f"{path}.schedule.warmupIters":
            if getattr(args, "warmup_iters", None) is not None:
                raise ConfigError("--warmup-iters", e.problem, e.fix) from None
            if args.train_iters is not None:  # the job's warm-up does not fit the steps asked for
                raise ConfigError("--train-iters", f"{args.train_iters} steps: the job's {e.problem}",
                                  "add --warmup-iters N with N below the steps, or ask for more steps") from None
        if flag is None:
            raise
        raise ConfigError(flag, e.problem, e.fix) from None
