"""An ElasticTrainingJob's spec, read into typed values with the CRD's defaults.

Pure: no kopf, no kubernetes client. The CRD's structural schema already fills defaults and
rejects wrong types on a real API server; this module applies the same defaults again (the
emulator and old objects may lack them) and checks what the schema cannot say: that the model
is a valid ``ModelSpec`` and that the parallelism constraints fit it. Every problem is a
``ConfigError`` naming the field (``spec.…``) and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from liveshard.runtime.contract.causes import NODE_KINDS
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.training import TrainingSpec, _section, check_against_model, read_training
from liveshard.runtime.contract.training import int_field as _int
from liveshard.runtime.errors import ConfigError, short
from liveshard.runtime.spec import CRD_NAMES, ModelSpec, megatron_name, megatron_named
from liveshard.runtime.units import parse_bytes

DEFAULT_GPU_MEMORY = 80 * 2**30

@dataclass(frozen=True)
class Workers:
    min: int
    max: int
    replicas: int  # desired pods: spec.workers.replicas, or max when unset
    gpus_per_worker: int
    gpu_memory_bytes: int  # per GPU, when the node does not say (nvidia.com/gpu.memory label)


@dataclass(frozen=True)
class Parallelism:
    tp: tuple[int, ...] | None
    pp: tuple[int, ...] | None
    ep: tuple[int, ...] | None
    dist_opt: bool
    # copies of the model state the planner keeps when the GPUs allow (spec.parallelism.
    # minDataParallel): with 2 or more, losing one node's GPUs loses no state
    min_dp: int = 1


@dataclass(frozen=True)
class AdaptivePolicy:
    """``spec.elasticity.adaptive``: when a slow device is worth a new plan (``planner.adapt``)."""

    enabled: bool = False
    threshold: float = 0.7  # relative speed (1.0 = the median device) below which a device is slow
    window: int = 8  # steps of measurements in each estimate; a device must stay slow this long
    horizon: int = 200  # steps over which a switch must pay for itself
    min_gain: float = 0.1  # the least predicted saving, as a share of the step, worth a switch
    probation: int = 200  # steps after which a device sent to standby for slowness is tried again

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError("spec.elasticity.adaptive.threshold", f"must be between 0 and 1, got {short(self.threshold)}",
                              "e.g. 0.7: a device at under 70% of the median speed is slow")
        for name in ("window", "horizon", "probation"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"spec.elasticity.adaptive.{name}", f"must be a positive number of steps, got {short(value)}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ConfigError("spec.elasticity.adaptive.minGain", f"must be in [0, 1), got {short(self.min_gain)}")


@dataclass(frozen=True)
class Elasticity:
    act_on: frozenset[str]
    scale_up_cooldown_seconds: float
    reconfiguration_timeout_seconds: float
    debounce_seconds: float = 5.0  # withdrawable signals count only after holding this long
    max_pod_failures: int | None = None  # failed worker pods the job survives; None: no limit
    adaptive: AdaptivePolicy = field(default_factory=lambda: AdaptivePolicy())


@dataclass(frozen=True)
class Network:
    # NetworkPolicy egress rules (networking.k8s.io/v1 NetworkPolicyEgressRule) added to the
    # workers' policy, e.g. object storage or a model hub the training data comes from
    extra_egress: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Checkpointing:
    """``spec.checkpoint``: where the fallback checkpoints go, how often, how many are kept."""

    path: str = "/checkpoints"
    interval_seconds: int = Defaults.CHECKPOINT_INTERVAL  # spec.checkpoint.intervalSeconds
    keep: int = 3  # complete checkpoints kept; 0 keeps all


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec  # with params_dtype set from spec.training.precision
    image: str
    workers: Workers
    parallelism: Parallelism
    elasticity: Elasticity
    training: TrainingSpec
    network: Network = field(default_factory=Network)
    checkpoint: Checkpointing = field(default_factory=Checkpointing)
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def max_gpus(self) -> int:
        return self.workers.max * self.workers.gpus_per_worker


def read_model(model: Any) -> ModelSpec:
    """``spec.model``: a preset name, ModelSpec fields, or a preset with field overrides."""
    from liveshard.runtime.presets import PRESETS

    if isinstance(model, str):
        model = {"preset": model}
    if not isinstance(model, dict) or not model:
        raise ConfigError("spec.model", "is required", "set spec.model.preset or the model's fields")
    data = dict(model)
    preset = data.pop("preset", None)
    if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
        raise ConfigError("spec.model.preset", f"unknown preset {short(preset)}",
                          f"use one of: {', '.join(sorted(PRESETS))}")
    try:
        return ModelSpec.from_dict(data, source="spec.model", base=PRESETS[preset] if preset else None)
    except ConfigError as e:
        if e.field.startswith("spec.model"):
            raise
        raise ConfigError(f"spec.model.{e.field}", e.problem, e.fix) from None


def _degrees(value: Any, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (not isinstance(value, list) or not value
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value)):
        raise ConfigError(f"spec.parallelism.{name}", f"{short(value)} is not a list of positive degrees",
                          f"write e.g. {name}: [1, 2, 4, 8]")
    return tuple(sorted(set(value)))


def read_spec(spec: dict[str, Any]) -> JobSpec:
    """Read and check ``spec``; raise ConfigError on the first problem."""
    if not isinstance(spec, dict):
        raise ConfigError("spec", "is missing")
    model = read_model(spec.get("model"))
    image = spec.get("image")
    if not isinstance(image, str) or not image:
        raise ConfigError("spec.image", "is required", "set the training image, e.g. ghcr.io/org/train:1.0")

    w = _section(spec, "workers", "spec")
    w_min = _int(w, "min", "spec.workers", 1)
    w_max = _int(w, "max", "spec.workers", None)
    if w_max is None:
        raise ConfigError("spec.workers.max", "is required", "set the largest number of worker pods")
    if w_min > w_max:
        raise ConfigError("spec.workers.min", f"min={w_min} is larger than max={w_max}",
                          "make workers.min <= workers.max")
    replicas = _int(w, "replicas", "spec.workers", w_max, minimum=0)
    if not w_min <= replicas <= w_max:
        raise ConfigError("spec.workers.replicas", f"{replicas} is outside min..max = {w_min}..{w_max}",
                          "scale within workers.min and workers.max, or change them")
    gpus = _int(w, "gpusPerWorker", "spec.workers", 8)
    mem = parse_bytes(w.get("gpuMemory", DEFAULT_GPU_MEMORY), "spec.workers.gpuMemory")
    workers = Workers(w_min, w_max, replicas, gpus, mem)

    p = _section(spec, "parallelism", "spec")
    moved = sorted({"globalBatch", "microBatch", "seqLength"} & set(p))
    if moved:
        raise ConfigError(f"spec.parallelism.{moved[0]}", "moved to spec.training",
                          f"write it as spec.training.{moved[0]}: spec.parallelism keeps only the layout constraints")
    par = Parallelism(
        tp=_degrees(p.get("tp"), "tp"), pp=_degrees(p.get("pp"), "pp"), ep=_degrees(p.get("ep"), "ep"),
        dist_opt=bool(p.get("distributedOptimizer", True)),
        min_dp=_int(p, "minDataParallel", "spec.parallelism", 1),
    )
    # The precision is set once, in spec.training.precision; a model that names its params_dtype
    # (an older job) is read as that precision, and contradicting both is refused.
    raw_model = spec.get("model")
    model_dtype = next((v for k, v in raw_model.items() if megatron_name(str(k)) == "params_dtype"),
                       None) if isinstance(raw_model, dict) else None
    section = spec.get("training")
    if model_dtype and isinstance(section, dict) and "precision" not in section:
        section = {**section, "precision": model_dtype}
    training = read_training(section, default_seq_length=model.max_sequence_length)
    check_against_model(training, model.max_sequence_length)
    if model_dtype and model_dtype != training.precision:
        raise ConfigError("spec.training.precision", f"{training.precision} contradicts spec.model.paramsDtype="
                          f"{model_dtype}", "set the precision in one place: spec.training.precision")
    model = replace(model, params_dtype=training.precision)
    if par.ep and not model.is_moe and par.ep != (1,):
        raise ConfigError("spec.parallelism.ep", f"{list(par.ep)} on a dense model",
                          "drop ep or use [1] (the model has no experts)")
    if par.tp and all(model.num_attention_heads % t for t in par.tp):
        raise ConfigError("spec.parallelism.tp", f"no degree in {list(par.tp)} divides the model's "
                          f"{model.num_attention_heads} attention heads", "allow a tp that divides them")

    e = _section(spec, "elasticity", "spec")
    act_on = e.get("actOn", list(NODE_KINDS))
    if not isinstance(act_on, list) or any(k not in NODE_KINDS for k in act_on):
        bad = next((k for k in act_on if k not in NODE_KINDS), act_on) if isinstance(act_on, list) else act_on
        raise ConfigError("spec.elasticity.actOn", f"unknown signal {short(bad)}",
                          f"use some of: {', '.join(NODE_KINDS)}")
    elastic = Elasticity(
        act_on=frozenset(act_on),
        scale_up_cooldown_seconds=float(_int(e, "scaleUpCooldownSeconds", "spec.elasticity", 300, 0)),
        reconfiguration_timeout_seconds=float(_int(e, "reconfigurationTimeoutSeconds",
                                                   "spec.elasticity", 300)),
        debounce_seconds=float(_int(e, "debounceSeconds", "spec.elasticity", 5, 0)),
        max_pod_failures=_int(e, "maxPodFailures", "spec.elasticity", None, 0),
        adaptive=read_adaptive(e.get("adaptive")),
    )
    return JobSpec(model=model, image=image, workers=workers, parallelism=par, elasticity=elastic, training=training,
                   network=read_network(spec.get("network")), checkpoint=read_checkpointing(spec.get("checkpoint")),
                   raw=spec)


# Fields renamed to the CRD's conventions (camelCase, durations in *Seconds). The old spellings
# are read, with a warning (``deprecated_fields``), until liveshard 0.3.
OLD_SPELLINGS_READ_UNTIL = "0.3"


def read_checkpointing(section: Any) -> Checkpointing:
    """``spec.checkpoint`` (absent: the defaults); ``intervalMinutes`` is the old spelling of
    ``intervalSeconds``."""
    if section is None:
        return Checkpointing()
    if not isinstance(section, dict):
        raise ConfigError("spec.checkpoint", f"must be a mapping, got {short(section)}", "e.g. checkpoint: {intervalSeconds: 1800}")
    path = section.get("path", Checkpointing.path)
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError("spec.checkpoint.path", f"must be an absolute path, got {short(path)}", "e.g. /checkpoints")
    if "intervalSeconds" in section and "intervalMinutes" in section:
        raise ConfigError("spec.checkpoint.intervalMinutes", "given beside intervalSeconds",
                          "keep intervalSeconds (intervalMinutes is its old spelling)")
    if "intervalMinutes" in section:
        interval = 60 * (_int(section, "intervalMinutes", "spec.checkpoint", None) or 0)
    else:
        interval = _int(section, "intervalSeconds", "spec.checkpoint", Defaults.CHECKPOINT_INTERVAL)
    return Checkpointing(path=path, interval_seconds=interval,
                         keep=_int(section, "keep", "spec.checkpoint", Checkpointing.keep, minimum=0))


def deprecated_fields(spec: Any) -> list[str]:
    """One warning line per field of ``spec`` written in an old spelling, naming the new one."""
    if not isinstance(spec, dict):
        return []
    until = f"read until liveshard {OLD_SPELLINGS_READ_UNTIL}"
    model = spec.get("model")
    out = [f"spec.model.{k} is megatron's name: write {CRD_NAMES[k]} ({until})" for k in megatron_named(model)]
    ckpt = spec.get("checkpoint")
    if isinstance(ckpt, dict) and "intervalMinutes" in ckpt:
        minutes = ckpt["intervalMinutes"]
        seconds = f"{60 * minutes}" if isinstance(minutes, int) and not isinstance(minutes, bool) else "N"
        out.append(f"spec.checkpoint.intervalMinutes is deprecated: write intervalSeconds: {seconds} ({until})")
    return out


EGRESS_RULE_KEYS = frozenset({"to", "ports"})  # the fields of a NetworkPolicyEgressRule


def read_network(section: Any) -> Network:
    """``spec.network``: extra egress rules, each a NetworkPolicyEgressRule (``to``, ``ports``)."""
    if section is None:
        return Network()
    if not isinstance(section, dict):
        raise ConfigError("spec.network", f"must be a mapping, got {short(section)}")
    rules = section.get("extraEgress") or []
    if not isinstance(rules, list):
        raise ConfigError("spec.network.extraEgress", f"must be a list of egress rules, got {short(rules)}",
                          "write e.g. [{to: [{ipBlock: {cidr: 10.0.0.0/8}}], ports: [{port: 443, protocol: TCP}]}]")
    for i, rule in enumerate(rules):
        unknown = sorted(set(rule) - EGRESS_RULE_KEYS) if isinstance(rule, dict) else None
        if unknown is None or unknown:
            what = f"unknown field {short(unknown[0])}" if unknown else f"{short(rule)} is not a mapping"
            raise ConfigError(f"spec.network.extraEgress[{i}]", what,
                              "an egress rule has only 'to' (peers) and 'ports', as in a NetworkPolicy")
        for key in EGRESS_RULE_KEYS & set(rule):
            if not isinstance(rule[key], list):
                raise ConfigError(f"spec.network.extraEgress[{i}].{key}", f"must be a list, got {short(rule[key])}")
    return Network(extra_egress=tuple(rules))


def validate_spec(spec: dict[str, Any]) -> str | None:
    """The first problem with ``spec`` as one line, or None."""
    try:
        read_spec(spec)
    except ConfigError as e:
        return str(e)
    return None


def read_adaptive(section: Any) -> AdaptivePolicy:
    """``spec.elasticity.adaptive`` (absent: off)."""
    if section is None:
        return AdaptivePolicy()
    if not isinstance(section, dict):
        raise ConfigError("spec.elasticity.adaptive", f"must be a mapping, got {short(section)}",
                          "e.g. adaptive: {enabled: true}")
    path = "spec.elasticity.adaptive"
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{path}.enabled", f"must be true or false, got {short(enabled)}")
    numbers = {}
    for key in ("threshold", "minGain"):
        value = section.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{path}.{key}", f"must be a number, got {short(value)}")
        numbers[key] = value
    defaults = AdaptivePolicy()
    return AdaptivePolicy(
        enabled=enabled,
        threshold=float(numbers["threshold"]) if numbers["threshold"] is not None else defaults.threshold,
        window=_int(section, "window", path, defaults.window),
        horizon=_int(section, "horizonSteps", path, defaults.horizon),
        min_gain=float(numbers["minGain"]) if numbers["minGain"] is not None else defaults.min_gain,
        probation=_int(section, "probationSteps", path, defaults.probation),
    )
