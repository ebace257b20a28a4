"""``spec.training``: what the workers train on and how — data, tokenizer, batch, schedule, precision.

Pure: no torch, no I/O. ``read_training`` reads the CRD section (camelCase, as a user writes it)
into a frozen ``TrainingSpec`` with every default applied and every cross-field rule checked;
``TrainingSpec.to_section()`` writes it back in the same form, which is what the operator hands
to the job's pods (``LIVESHARD_TRAINING``, JSON) and what ``liveshard run-local --job`` reads from
the manifest — one reader for the API server, the coordinator, the workers and local runs.
Every problem is a ``ConfigError`` naming the field (``spec.training.…``) and the fix.

What needs files (the tokenizer's vocabulary against the model's, the dataset prefixes) is
checked where the files are: in the worker (``liveshard.runtime.data``), before it joins a world.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, overload

from liveshard.runtime.contract.env import Env
from liveshard.runtime.errors import ConfigError, short

TRAINING_ENV = Env.TRAINING  # the resolved section, JSON, in every pod of a job

PRECISIONS = ("bf16", "fp16", "fp32")
DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
TOKENIZER_TYPES = ("huggingface", "sentencepiece")
WEIGHT_FORMATS = ("huggingface", "megatron")
DEFAULT_SPLIT = "969,30,1"

# Sane horizons: far beyond any training run (the longest published ones take a few million
# steps and under 10^14 tokens), far below what breaks: megatron indexes every sample in memory
# (a worker asked for 10^18 steps dies building that index), numpy seeds are 32-bit.
MAX_TRAIN_ITERS = 10**8
MAX_TRAIN_SAMPLES = 10**10  # megatron's sample and shuffle indices: ~24 bytes a sample
MAX_TRAIN_TOKENS = 10**15
MAX_SEQ_LENGTH = 1 << 22
MAX_GLOBAL_BATCH = 1 << 24
MAX_SEED = 2**32 - 1

_GET_DATA = ("tokenize a corpus with `liveshard prepare-data --input FILE --tokenizer DIR --output-prefix "
             "PREFIX` and set spec.training.data.blend: [{prefix: PREFIX}] and spec.training.tokenizer, "
             "or set spec.training.data.mock: true for synthetic tokens (demos and tests only)")


@dataclass(frozen=True)
class DatasetRef:
    prefix: str  # PREFIX of PREFIX.bin / PREFIX.idx (megatron's indexed format)
    weight: float = 1.0


@dataclass(frozen=True)
class DataSpec:
    blend: tuple[DatasetRef, ...] = ()
    split: str = DEFAULT_SPLIT  # train,valid,test weights (megatron's "969,30,1")
    mock: bool = False
    cache_dir: str | None = None  # megatron's index cache; default: <checkpoint dir>/data-cache

    @property
    def split_weights(self) -> tuple[float, float, float]:
        parts = [float(x) for x in self.split.split(",")]
        parts += [0.0] * (3 - len(parts))
        return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class TokenizerSpec:
    type: str
    path: str


@dataclass(frozen=True)
class WeightsRef:
    """Weights a first world starts from: a Hugging Face model directory, or a megatron
    (liveshard or Megatron-LM torch_dist) checkpoint whose model part alone is read."""

    format: str
    path: str


@dataclass(frozen=True)
class OptimizerSpec:
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class ScheduleSpec:
    warmup_iters: int = 0
    decay_style: str = "cosine"
    decay_iters: int = 0  # 0: trainIters
    wsd_decay_iters: int = 0  # WSD only: the final decay phase
    wsd_decay_style: str = "linear"


@dataclass(frozen=True)
class EvalSpec:
    interval: int = 0  # steps between evaluations; 0: off
    iters: int = 10  # global batches of the validation split per evaluation


@dataclass(frozen=True)
class LoggingSpec:
    interval: int = 10
    tensorboard_dir: str | None = None  # default: <checkpoint dir>/tensorboard
    wandb_project: str | None = None


@dataclass(frozen=True)
class TrainingSpec:
    data: DataSpec
    train_iters: int
    global_batch: int
    micro_batch: int = 1
    seq_length: int = 2048
    seed: int = 1234
    tokenizer: TokenizerSpec | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    precision: str = "bf16"
    initial_loss_scale: float = 2.0**16  # fp16 dynamic loss scaling
    eval: EvalSpec = field(default_factory=EvalSpec)
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    initial_weights: WeightsRef | None = None  # fresh optimizer state, step 0
    resume: str | None = None  # a checkpoint continued with its optimizer state and step

    @property
    def train_samples(self) -> int:
        return self.train_iters * self.global_batch

    @property
    def decay_iters(self) -> int:
        return self.schedule.decay_iters or self.train_iters

    def eval_samples(self) -> int:
        """Validation samples one evaluation reads (the same ones every time, any layout)."""
        return self.eval.iters * self.global_batch if self.eval.interval else 0

    # ---- the CRD form ------------------------------------------------------------------------
    def to_section(self) -> dict[str, Any]:
        """This spec in the CRD's camelCase form, every default spelled out."""
        d = self.data
        data: dict[str, Any] = {"split": d.split}
        if d.mock:
            data["mock"] = True
        else:
            data["blend"] = [{"prefix": r.prefix, "weight": r.weight} for r in d.blend]
        if d.cache_dir:
            data["cacheDir"] = d.cache_dir
        o, s, lg = self.optimizer, self.schedule, self.logging
        out: dict[str, Any] = {
            "data": data,
            "trainIters": self.train_iters,
            "globalBatch": self.global_batch,
            "microBatch": self.micro_batch,
            "seqLength": self.seq_length,
            "seed": self.seed,
            "optimizer": {"lr": o.lr, "minLr": o.min_lr, "weightDecay": o.weight_decay, "adamBeta1": o.adam_beta1,
                          "adamBeta2": o.adam_beta2, "adamEps": o.adam_eps, "clipGrad": o.clip_grad},
            "schedule": {"warmupIters": s.warmup_iters, "decayStyle": s.decay_style, "decayIters": s.decay_iters,
                         "wsdDecayIters": s.wsd_decay_iters, "wsdDecayStyle": s.wsd_decay_style},
            "precision": self.precision,
            "initialLossScale": self.initial_loss_scale,
            "eval": {"interval": self.eval.interval, "iters": self.eval.iters},
            "logging": {"interval": lg.interval},
        }
        if self.tokenizer is not None:
            out["tokenizer"] = {"type": self.tokenizer.type, "path": self.tokenizer.path}
        if lg.tensorboard_dir:
            out["logging"]["tensorboardDir"] = lg.tensorboard_dir
        if lg.wandb_project:
            out["logging"]["wandbProject"] = lg.wandb_project
        if self.initial_weights is not None:
            out["initialWeights"] = {"format": self.initial_weights.format, "path": self.initial_weights.path}
        if self.resume:
            out["resume"] = {"path": self.resume}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_section(), sort_keys=True)

    @staticmethod
    def from_json(text: str, source: str = TRAINING_ENV) -> TrainingSpec:
        from liveshard.runtime.inputs import check_job_text, parse_json

        try:
            check_job_text(text, source)
            section = parse_json(text, source, source)
        except ConfigError as e:
            raise ConfigError(source, e.problem, "the operator writes it; do not edit it") from None
        return read_training(section)


# ---- reading ---------------------------------------------------------------------------------
MAX_BLEND = 10_000  # datasets in spec.training.data.blend: each is opened and checked at start
_SPLIT = re.compile(r"^\s*\d+(\.\d+)?\s*(,\s*\d+(\.\d+)?\s*){0,2}$")


def _section(parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}.{key}", f"must be a mapping, got {type(value).__name__}")
    return value


@overload
def int_field(section: dict[str, Any], key: str, path: str, default: int, minimum: int = 1,
              maximum: int | None = None, fix: str = "", too_big: str = "") -> int: ...


@overload
def int_field(section: dict[str, Any], key: str, path: str, default: int | None, minimum: int = 1,
              maximum: int | None = None, fix: str = "", too_big: str = "") -> int | None: ...


def int_field(section: dict[str, Any], key: str, path: str, default: int | None, minimum: int = 1,
              maximum: int | None = None, fix: str = "", too_big: str = "") -> int | None:
    """``section[key]`` as an integer in ``minimum..maximum`` (``default`` when absent); ConfigError
    naming ``path.key`` and ``fix`` (``too_big``, when given, for a value above ``maximum``). A null
    value is an absent one."""
    value = section.get(key)
    if value is None:
        value = default
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{path}.{key}", f"must be an integer >= {minimum}, got {_short(value)}", fix)
    if maximum is not None and value > maximum:
        raise ConfigError(f"{path}.{key}", f"{value} is beyond a sane limit of {maximum:,}",
                          too_big or fix or f"use at most {maximum:,}")
    return value


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to one short line (an error message is one line)."""
    return short(value, limit)


def _float(section: dict[str, Any], key: str, path: str, default: float, *, low: float = 0.0,
           high: float | None = None, open_low: bool = False, open_high: bool = False, fix: str = "") -> float:
    """``section[key]`` as a finite number in ``[low, high]`` (ends excluded with ``open_*``; null: absent)."""
    value = section.get(key)
    if value is None:
        value = default
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{path}.{key}", f"{_short(value)} is not a number", fix) from None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{path}.{key}", f"must be a number, got {_short(value)}", fix)
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        raise ConfigError(f"{path}.{key}", f"{_short(value)} is out of range", fix) from None
    bound = f"{'>' if open_low else '>='} {low:g}" + (f" and {'<' if open_high else '<='} {high:g}"
                                                      if high is not None else "")
    if not math.isfinite(value):
        raise ConfigError(f"{path}.{key}", f"must be a finite number {bound}, got {short(value)}", fix)
    if (value < low or (open_low and value == low) or (high is not None and value > high)
            or (open_high and value == high)):
        raise ConfigError(f"{path}.{key}", f"must be {bound}, got {short(value)}", fix)
    return value


def _choice(section: dict[str, Any], key: str, path: str, default: str, choices: tuple[str, ...]) -> str:
    value: str = section.get(key, default)
    if value not in choices:
        raise ConfigError(f"{path}.{key}", f"unknown value {short(value)}", f"use one of: {', '.join(choices)}")
    return value


def _text(section: dict[str, Any], key: str, path: str) -> str | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}.{key}", f"must be a non-empty string, got {short(value)}")
    return value


def _read_data(section: dict[str, Any], path: str) -> DataSpec:
    if not section:
        raise ConfigError(path, "is required: a job says what it trains on", _GET_DATA)
    mock = section.get("mock", False)
    if not isinstance(mock, bool):
        raise ConfigError(f"{path}.mock", f"must be true or false, got {short(mock)}")
    blend_raw = section.get("blend")
    if mock and blend_raw:
        raise ConfigError(f"{path}.mock", "is set together with blend", "train on blend or on mock data, not both")
    blend: list[DatasetRef] = []
    if not mock:
        if not isinstance(blend_raw, list) or not blend_raw:
            raise ConfigError(f"{path}.blend", "is required (a list of {prefix, weight})", _GET_DATA)
        if len(blend_raw) > MAX_BLEND:
            raise ConfigError(f"{path}.blend", f"lists {len(blend_raw):,} datasets, more than a job reads "
                              f"({MAX_BLEND:,})", "merge shards into fewer datasets (prepare-data takes many inputs)")
        for i, item in enumerate(blend_raw):
            where = f"{path}.blend[{i}]"
            if isinstance(item, str):
                item = {"prefix": item}
            if not isinstance(item, dict):
                raise ConfigError(where, f"must be {{prefix, weight}}, got {short(item)}")
            prefix = _text(item, "prefix", where)
            if prefix is None:
                raise ConfigError(f"{where}.prefix", "is required",
                                  "the PREFIX of PREFIX.bin/PREFIX.idx written by liveshard prepare-data")
            if prefix.endswith((".bin", ".idx")):
                raise ConfigError(f"{where}.prefix", f"{short(prefix)} names a file, not a prefix",
                                  f"drop the extension: {short(prefix[:-4])}")
            blend.append(DatasetRef(prefix, _float(item, "weight", where, 1.0, open_low=True, high=1e9)))
    split = section.get("split", DEFAULT_SPLIT)
    if (not isinstance(split, str) or not _SPLIT.match(split) or len(split) > 64
            or sum(float(x) for x in split.split(",")) <= 0):
        raise ConfigError(f"{path}.split", f"{short(split)} is not a train,valid,test split",
                          'write weights such as "969,30,1" (the train weight must be > 0)')
    if float(split.split(",")[0]) <= 0:
        raise ConfigError(f"{path}.split", f"{short(split)} leaves nothing to train on", "give the train split a weight > 0")
    return DataSpec(blend=tuple(blend), split=split.replace(" ", ""), mock=mock,
                    cache_dir=_text(section, "cacheDir", path))


def read_training(section: Any, path: str = "spec.training", *, default_seq_length: int = 2048) -> TrainingSpec:
    """Read and check a ``spec.training`` section; raise ConfigError on the first problem.
    ``default_seq_length``: the sequence length when the section sets none (the model's)."""
    if section is None:
        raise ConfigError(path, "is required: data, tokenizer, trainIters and globalBatch", _GET_DATA)
    if not isinstance(section, dict):
        raise ConfigError(path, f"must be a mapping, got {type(section).__name__}")
    data = _read_data(_section(section, "data", path), f"{path}.data")
    tokenizer = _read_tokenizer(section, path, data)
    train_iters, global_batch, micro_batch, seq_length, seed = _read_steps(section, path, default_seq_length)
    optimizer = _read_optimizer(_section(section, "optimizer", path), f"{path}.optimizer")
    schedule = _read_schedule(_section(section, "schedule", path), f"{path}.schedule", train_iters)
    precision = _choice(section, "precision", path, "bf16", PRECISIONS)
    loss_scale = _float(section, "initialLossScale", path, 2.0**16, open_low=True, high=2.0**40, fix="e.g. 65536")
    evaluation = _read_eval(_section(section, "eval", path), f"{path}.eval", data, global_batch)
    lg = _section(section, "logging", path)
    logging_spec = LoggingSpec(interval=int_field(lg, "interval", f"{path}.logging", 10, maximum=MAX_TRAIN_ITERS) or 10,
                               tensorboard_dir=_text(lg, "tensorboardDir", f"{path}.logging"),
                               wandb_project=_text(lg, "wandbProject", f"{path}.logging"))
    initial_weights, resume = _read_start(section, path)
    return TrainingSpec(initial_weights=initial_weights, resume=resume, data=data, train_iters=train_iters, global_batch=global_batch, micro_batch=micro_batch,
                        seq_length=seq_length or default_seq_length, seed=seed if seed is not None else 1234, tokenizer=tokenizer,
                        optimizer=optimizer, schedule=schedule, precision=precision,
                        initial_loss_scale=loss_scale, eval=evaluation, logging=logging_spec)


def _read_tokenizer(section: dict[str, Any], path: str, data: DataSpec) -> TokenizerSpec | None:
    """``tokenizer``: required with real data (its end-of-document id and vocabulary size)."""
    tok = _section(section, "tokenizer", path)
    if tok:
        kind = _choice(tok, "type", f"{path}.tokenizer", "huggingface", TOKENIZER_TYPES)
        tpath = _text(tok, "path", f"{path}.tokenizer")
        if tpath is None:
            raise ConfigError(f"{path}.tokenizer.path", "is required",
                              "a directory with tokenizer.json (huggingface) or a .model file (sentencepiece)")
        return TokenizerSpec(kind, tpath)
    if not data.mock:
        raise ConfigError(f"{path}.tokenizer", "is required with real data (its end-of-document id and "
                          "vocabulary size)", "set {type: huggingface, path: DIR with tokenizer.json}")
    return None


def _read_steps(section: dict[str, Any], path: str,
                default_seq_length: int) -> tuple[int, int, int, int | None, int | None]:
    """(trainIters, globalBatch, microBatch, seqLength, seed): the run's length (trainIters, or
    trainSamples in whole steps) and batch, within a sane horizon."""
    horizon = "a sane horizon is far shorter: give the steps this run really takes"
    train_iters = int_field(section, "trainIters", path, None, maximum=MAX_TRAIN_ITERS, too_big=horizon,
                            fix="optimizer steps of the whole run, e.g. 10000")
    train_samples = int_field(section, "trainSamples", path, None, maximum=MAX_TRAIN_SAMPLES, too_big=horizon,
                              fix="sequences of the whole run, a multiple of globalBatch")
    global_batch = int_field(section, "globalBatch", path, None, maximum=MAX_GLOBAL_BATCH,
                             fix="sequences per optimizer step, e.g. 256")
    if global_batch is None:
        raise ConfigError(f"{path}.globalBatch", "is required", "sequences per optimizer step, e.g. 256")
    if train_iters is None and train_samples is None:
        raise ConfigError(f"{path}.trainIters", "is required", "set trainIters (optimizer steps) or trainSamples")
    if train_iters is not None and train_samples is not None:
        raise ConfigError(f"{path}.trainSamples", "is set together with trainIters", "set one of them")
    if train_iters is None:
        assert train_samples is not None
        if train_samples % global_batch:
            raise ConfigError(f"{path}.trainSamples", f"{train_samples} is not a multiple of globalBatch={global_batch}",
                              "make it a whole number of steps")
        train_iters = train_samples // global_batch
    micro_batch = int_field(section, "microBatch", path, 1)
    assert micro_batch is not None
    if global_batch % micro_batch:
        raise ConfigError(f"{path}.globalBatch", f"{global_batch} is not a multiple of microBatch={micro_batch}",
                          "make globalBatch a multiple of microBatch")
    seq_length = int_field(section, "seqLength", path, default_seq_length, maximum=MAX_SEQ_LENGTH,
                           fix="tokens per sample, at most the model's max_sequence_length, e.g. 4096")
    seed = int_field(section, "seed", path, 1234, minimum=0, maximum=MAX_SEED,
                     fix=f"a seed in 0..{MAX_SEED} (numpy's range)")
    samples = train_iters * global_batch
    if samples > MAX_TRAIN_SAMPLES or samples * (seq_length or default_seq_length) > MAX_TRAIN_TOKENS:
        field_name = "trainIters" if section.get("trainIters") is not None else "trainSamples"
        raise ConfigError(f"{path}.{field_name}", f"{train_iters:,} steps of globalBatch={global_batch} are "
                          f"{samples:,} samples, beyond a sane horizon of {MAX_TRAIN_SAMPLES:,} samples and "
                          f"{MAX_TRAIN_TOKENS:,} tokens (megatron indexes every sample in memory)", horizon)
    return train_iters, global_batch, micro_batch, seq_length, seed


def _read_optimizer(o: dict[str, Any], op: str) -> OptimizerSpec:
    optimizer = OptimizerSpec(
        lr=_float(o, "lr", op, 3e-4, open_low=True, high=1.0, fix="Adam learning rates are about 1e-5 .. 1e-2"),
        min_lr=_float(o, "minLr", op, 0.0, high=1.0, fix="a floor at or below lr, e.g. lr / 10"),
        weight_decay=_float(o, "weightDecay", op, 0.01, high=10.0, fix="e.g. 0.1"),
        adam_beta1=_float(o, "adamBeta1", op, 0.9, high=1.0, open_high=True, fix="e.g. 0.9"),
        adam_beta2=_float(o, "adamBeta2", op, 0.95, high=1.0, open_high=True, fix="e.g. 0.95"),
        adam_eps=_float(o, "adamEps", op, 1e-8, open_low=True, high=1.0, fix="e.g. 1e-8"),
        clip_grad=_float(o, "clipGrad", op, 1.0, fix="e.g. 1.0 (0: no clipping)"))
    if optimizer.min_lr > optimizer.lr:
        raise ConfigError(f"{op}.minLr", f"{optimizer.min_lr} is above lr={optimizer.lr}", "make minLr <= lr")
    return optimizer


def _read_schedule(s: dict[str, Any], sp: str, train_iters: int) -> ScheduleSpec:
    """The learning-rate schedule; its warm-up must leave a decay (``decayIters``, else the run)."""
    warmup = int_field(s, "warmupIters", sp, None, minimum=0, maximum=MAX_TRAIN_ITERS)
    fraction = s.get("warmupFraction")
    if fraction is not None:
        if warmup is not None:
            raise ConfigError(f"{sp}.warmupFraction", "is set together with warmupIters", "set one of them")
        warmup = round(_float(s, "warmupFraction", sp, 0.0, high=1.0) * train_iters)
    schedule = ScheduleSpec(
        warmup_iters=warmup or 0,
        decay_style=_choice(s, "decayStyle", sp, "cosine", DECAY_STYLES),
        decay_iters=int_field(s, "decayIters", sp, 0, minimum=0, maximum=MAX_TRAIN_ITERS) or 0,
        wsd_decay_iters=int_field(s, "wsdDecayIters", sp, 0, minimum=0, maximum=MAX_TRAIN_ITERS) or 0,
        wsd_decay_style=_choice(s, "wsdDecayStyle", sp, "linear", WSD_DECAY_STYLES),
    )
    decay_iters = schedule.decay_iters or train_iters
    if schedule.decay_style != "constant" and schedule.warmup_iters >= decay_iters:
        raise ConfigError(f"{sp}.warmupIters", f"{schedule.warmup_iters} warm-up steps leave no decay "
                          f"(decayIters={decay_iters})", "warm up for fewer steps than the decay lasts")
    if schedule.decay_style == "WSD" and not 0 < schedule.wsd_decay_iters <= decay_iters:
        raise ConfigError(f"{sp}.wsdDecayIters", f"must be in 1..{decay_iters} with decayStyle WSD",
                          "set the length of WSD's final decay, e.g. 10% of trainIters")
    return schedule


def _read_eval(ev: dict[str, Any], ep: str, data: DataSpec, global_batch: int) -> EvalSpec:
    """Evaluation every ``interval`` steps needs a validation split (or mock data)."""
    evaluation = EvalSpec(interval=int_field(ev, "interval", ep, 0, minimum=0, maximum=MAX_TRAIN_ITERS) or 0,
                          iters=int_field(ev, "iters", ep, 10, maximum=MAX_TRAIN_SAMPLES // global_batch)
                          or 10)
    if evaluation.interval and data.split_weights[1] <= 0 and not data.mock:
        raise ConfigError(f"{ep}.interval", f"is set but data.split {short(data.split)} has no validation part",
                          'give the validation split a weight, e.g. "969,30,1", or set eval.interval: 0')
    return evaluation


def _read_start(section: dict[str, Any], path: str) -> tuple[WeightsRef | None, str | None]:
    """(initialWeights, resume.path): what the run starts from; at most one of them."""
    iw = _section(section, "initialWeights", path)
    initial_weights = None
    if iw:
        wpath = _text(iw, "path", f"{path}.initialWeights")
        if wpath is None:
            raise ConfigError(f"{path}.initialWeights.path", "is required",
                              "a Hugging Face model directory or a megatron checkpoint directory")
        initial_weights = WeightsRef(_choice(iw, "format", f"{path}.initialWeights", "huggingface", WEIGHT_FORMATS),
                                     wpath)
    rs = _section(section, "resume", path)
    resume = _text(rs, "path", f"{path}.resume") if rs else None
    if rs and resume is None:
        raise ConfigError(f"{path}.resume.path", "is required", "a liveshard or Megatron-LM checkpoint directory")
    if initial_weights is not None and resume is not None:
        raise ConfigError(f"{path}.resume", "is set together with initialWeights",
                          "resume continues a run (weights, optimizer, step); initialWeights starts one: set one")
    return initial_weights, resume


def check_against_model(training: TrainingSpec, max_sequence_length: int,
                        field: str = "spec.training.seqLength") -> None:
    """The checks that need the model: the sequence fits its position range."""
    if training.seq_length > max_sequence_length:
        raise ConfigError(field, f"{training.seq_length} exceeds the model's "
                          f"max_sequence_length={max_sequence_length}",
                          "train on shorter sequences or raise the model's max_sequence_length")
