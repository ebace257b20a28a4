"""What the operator and the coordinator write to an ElasticTrainingJob's status, typed.

The operator writes ``status.plan`` (``StatusPlan``); the coordinator answers with an ack
(``PlanAck``: ``appliedGeneration``/``appliedAt``) or an abort (``PlanAbort``:
``abortedGeneration``/``abortReason``) and reports per-pod ``speeds`` and ``stragglers``. Each
type reads itself from the status (``from_status``, which validates and raises ``InvalidStatus``
naming the field) and writes itself as a merge patch (``to_status``). ``operator/README.md``
describes the protocol.

A plan's ``members`` are pods in rank order; a pod with ``gpusPerWorker = g`` stands for the
runtime's workers ``<pod>/0 .. <pod>/g-1``, so rank ``r`` runs on local GPU ``r % g`` of pod
``members[r // g]`` (``worker_ids``). A plan with no config and no members is a *stop*: the
running world saves a checkpoint and waits; the next plan with members restores it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from liveshard.runtime.contract.causes import Cause, cause_of
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.times import iso, parse_time


class JobPhase(StrEnum):
    """``status.phase`` of an ElasticTrainingJob."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType(StrEnum):
    """``status.conditions[].type`` of an ElasticTrainingJob."""

    READY = "Ready"
    RECONFIGURING = "Reconfiguring"
    DEGRADED = "Degraded"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CHECKPOINT_FAILING = "CheckpointFailing"
    CHECKPOINT_UNAVAILABLE = "CheckpointUnavailable"


class InvalidStatus(ValueError):
    """A status field that does not say what the contract says it must."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"status.{field_name}: {problem}")
        self.field = field_name


def worker_ids(pods: Iterable[str], gpus_per_worker: int) -> tuple[str, ...]:
    """Pods in rank order, expanded to the runtime's worker ids in rank order."""
    return tuple(f"{pod}/{i}" for pod in pods for i in range(max(1, gpus_per_worker)))


def pod_of(worker_id: str) -> str:
    """The pod a runtime worker id belongs to (``<pod>/<local rank>``; a bare id is its own pod)."""
    return worker_id.rpartition("/")[0] or worker_id


def _int(status: Mapping[str, Any], key: str, name: str, default: int | None = 0) -> int | None:
    value = status.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 0:
        raise InvalidStatus(name, f"must be a non-negative integer, got {value!r}")
    return int(value)


def _names(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or any(not isinstance(v, str) or not v for v in value):
        raise InvalidStatus(name, f"must be a list of pod names, got {value!r}")
    return tuple(value)


def _float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidStatus(name, f"must be a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StatusPlan:
    """``status.plan``: the world the operator wants, generation by generation."""

    generation: int
    config: str  # ParallelConfig string form; "" for a stop
    members: tuple[str, ...]  # pods in rank order
    gpus_per_worker: int = 1
    cause: Cause | None = None
    reason: str = ""  # one line for people: what was seen
    deadline: datetime | None = None  # when the leavers are gone (the notice)
    created_at: datetime | None = None
    leaving: tuple[str, ...] = ()
    joining: tuple[str, ...] = ()
    micro_batches: int | None = None  # per data-parallel rank per step
    step_seconds: float | None = None  # the planner's prediction
    tokens_per_second: float | None = None
    explanation: tuple[str, ...] = ()
    # pod -> uid of each member when the plan was written: the coordinator hands the plan on only
    # once each member's worker registered from that pod, not from an earlier pod of its name
    member_uids: Mapping[str, str] = field(default_factory=dict, hash=False)
    # A plan the operator wrote to record a world the runtime made on its own (``status.world``,
    # its runtime generation): already running, never a transition to make
    observed_world: int | None = None

    @property
    def is_stop(self) -> bool:
        return not self.config or not self.members

    @property
    def world_size(self) -> int:
        return 0 if self.is_stop else len(self.members) * max(1, self.gpus_per_worker)

    def worker_ids(self) -> tuple[str, ...]:
        """The runtime's worker ids in rank order."""
        return worker_ids(self.members, self.gpus_per_worker)

    def leaving_worker_ids(self) -> tuple[str, ...]:
        return worker_ids(self.leaving, self.gpus_per_worker)

    def to_status(self) -> dict[str, Any]:
        return {"plan": {
            "generation": self.generation, "config": self.config, "members": list(self.members),
            "gpusPerWorker": self.gpus_per_worker, "worldSize": self.world_size,
            "cause": str(self.cause) if self.cause else None, "reason": self.reason,
            "deadline": iso(self.deadline) if self.deadline else None,
            "createdAt": iso(self.created_at) if self.created_at else None,
            "leaving": list(self.leaving), "joining": list(self.joining),
            "microBatches": self.micro_batches, "stepSeconds": self.step_seconds,
            "tokensPerSecond": self.tokens_per_second, "explanation": list(self.explanation),
            "memberUids": dict(self.member_uids) or None, "observedWorld": self.observed_world,
        }}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> StatusPlan | None:
        """The plan in ``status`` (None if there is none yet); raises ``InvalidStatus``."""
        plan = status.get("plan")
        if not plan:
            return None
        if not isinstance(plan, Mapping):
            raise InvalidStatus("plan", f"must be an object, got {plan!r}")
        config = plan.get("config") or ""
        if not isinstance(config, str):
            raise InvalidStatus("plan.config", f"must be a parallel config string, got {config!r}")
        if config:
            from liveshard.runtime.errors import ConfigError
            from liveshard.runtime.parallel import ParallelConfig

            try:
                ParallelConfig.parse(config)
            except ConfigError as e:
                raise InvalidStatus("plan.config", str(e)) from None
        gpw = _int(plan, "gpusPerWorker", "plan.gpusPerWorker", 1) or 1
        explanation = plan.get("explanation") or ()
        uids = plan.get("memberUids") or {}
        if not isinstance(uids, Mapping):
            raise InvalidStatus("plan.memberUids", f"must map pod names to uids, got {uids!r}")
        return cls(
            generation=_int(plan, "generation", "plan.generation") or 0,
            config=config,
            members=_names(plan.get("members"), "plan.members"),
            gpus_per_worker=gpw,
            cause=cause_of(plan.get("cause")),
            reason=str(plan.get("reason") or ""),
            deadline=parse_time(plan.get("deadline")),
            created_at=parse_time(plan.get("createdAt")),
            leaving=_names(plan.get("leaving"), "plan.leaving"),
            joining=_names(plan.get("joining"), "plan.joining"),
            micro_batches=_int(plan, "microBatches", "plan.microBatches", None),
            step_seconds=_float(plan.get("stepSeconds"), "plan.stepSeconds"),
            tokens_per_second=_float(plan.get("tokensPerSecond"), "plan.tokensPerSecond"),
            explanation=tuple(str(x) for x in explanation),
            member_uids={str(k): str(v) for k, v in uids.items() if v},
            observed_world=_int(plan, "observedWorld", "plan.observedWorld", None),
        )


def same_config(a: str | None, b: str | None) -> bool:
    """Whether two parallel config strings name the same config (spellings differ: ``ep=1``
    written out or not); False when either is empty or unreadable."""
    if not a or not b:
        return False
    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.parallel import ParallelConfig

    try:
        return str(ParallelConfig.parse(a)) == str(ParallelConfig.parse(b))
    except ConfigError:
        return False


def pods_of(workers: Iterable[str]) -> tuple[str, ...]:
    """The pods of runtime worker ids, in rank order (a pod's GPUs are consecutive ranks)."""
    return tuple(dict.fromkeys(pod_of(w) for w in workers))


@dataclass(frozen=True)
class CommittedWorld:
    """``status.world``: the world the runtime committed and trains in now, written by the
    coordinator at each commit, whoever planned it (the operator, or the runtime alone after a
    loss without notice). ``status.worldSize`` and ``kubectl get etj`` show this world, never a
    plan that was acked but not run.

    ``generation`` is the runtime's own numbering (not ``status.plan.generation``);
    ``plan_generation`` the operator plan it is, when it is exactly one (None: a world the runtime
    made, which the operator records as observed)."""

    generation: int
    config: str  # "" when the job is stopped
    members: tuple[str, ...]  # pods in rank order
    world_size: int  # GPUs (ranks)
    plan_generation: int | None = None
    cause: Cause | None = None
    reason: str = ""
    committed_at: datetime | None = None

    @property
    def is_stop(self) -> bool:
        return not self.config or not self.members

    def runs(self, plan: StatusPlan | None) -> bool:
        """Whether this world is ``plan``: the same pods in the same rank order, the same config
        (a stop runs a stop plan)."""
        if plan is None:
            return False
        if self.is_stop or plan.is_stop:
            return self.is_stop and plan.is_stop
        return tuple(plan.members) == self.members and same_config(plan.config, self.config)

    def to_status(self) -> dict[str, Any]:
        return {"world": {
            "generation": self.generation, "config": self.config, "members": list(self.members),
            "worldSize": self.world_size, "planGeneration": self.plan_generation,
            "cause": str(self.cause) if self.cause else None, "reason": self.reason[:500],
            "committedAt": iso(self.committed_at) if self.committed_at else None,
        }}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> CommittedWorld | None:
        """The committed world in ``status`` (None before the coordinator wrote one); raises
        ``InvalidStatus``."""
        world = status.get("world")
        if not world:
            return None
        if not isinstance(world, Mapping):
            raise InvalidStatus("world", f"must be an object, got {world!r}")
        config = world.get("config") or ""
        if not isinstance(config, str):
            raise InvalidStatus("world.config", f"must be a parallel config string, got {config!r}")
        return cls(generation=_int(world, "generation", "world.generation") or 0, config=config,
                   members=_names(world.get("members"), "world.members"),
                   world_size=_int(world, "worldSize", "world.worldSize") or 0,
                   plan_generation=_int(world, "planGeneration", "world.planGeneration", None),
                   cause=cause_of(world.get("cause")), reason=str(world.get("reason") or ""),
                   committed_at=parse_time(world.get("committedAt")))


# A live coordinator writes its answer within a poll of deciding; its pod restarted in between
# re-reads the plan and answers it anew (seconds): the slack covers both.
ANSWER_SLACK_SECONDS = 60.0


def members_due(plan: StatusPlan) -> datetime | None:
    """Until when the coordinator waits for ``plan``'s members to come up before it aborts the
    plan: its deadline (``spec.elasticity.reconfigurationTimeoutSeconds`` after it was written,
    or the notice's end), else ``Defaults.MEMBERS_UP_TIMEOUT`` after it was written."""
    if plan.deadline is not None:
        return plan.deadline
    if plan.created_at is not None:
        return plan.created_at + timedelta(seconds=Defaults.MEMBERS_UP_TIMEOUT)
    return None


def answer_due(plan: StatusPlan, transition_timeout: float = Defaults.TRANSITION_TIMEOUT) -> datetime | None:
    """When a live coordinator has answered ``plan`` (acked or aborted) at the latest: it waits
    for the members until ``members_due``, then the change itself ends within
    ``TRANSITION_PROGRESS_CAP`` transition timeouts. The runtime alone answers a plan; the
    operator plans again without an answer only past this time, when no coordinator is there to
    answer, so the two never decide the same plan. None: the plan carries no time to count from."""
    due = members_due(plan)
    if due is None:
        return None
    return due + timedelta(seconds=Defaults.TRANSITION_PROGRESS_CAP * transition_timeout + ANSWER_SLACK_SECONDS)


@dataclass(frozen=True)
class PlanAck:
    """The coordinator applied ``generation`` (its world runs it) at ``at``."""

    generation: int
    at: datetime | None = None

    def to_status(self) -> dict[str, Any]:
        return {"appliedGeneration": self.generation, "appliedAt": iso(self.at) if self.at else None}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> PlanAck:
        return cls(_int(status, "appliedGeneration", "appliedGeneration") or 0,
                   parse_time(status.get("appliedAt")))


@dataclass(frozen=True)
class PlanAbort:
    """The runtime could not apply ``generation``; the operator plans again after a back-off."""

    generation: int
    reason: str = ""

    def to_status(self) -> dict[str, Any]:
        return {"abortedGeneration": self.generation, "abortReason": self.reason[:500]}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> PlanAbort:
        return cls(_int(status, "abortedGeneration", "abortedGeneration") or 0,
                   str(status.get("abortReason") or ""))


@dataclass(frozen=True)
class Straggler:
    """A device measured slower than its peers (relative speed < 1)."""

    pod: str
    device: str  # runtime worker id: <pod>/<local rank>
    relative_speed: float
    since: datetime | None = None
    evidence: str = ""  # what was measured (step times, NVML throttle reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"pod": self.pod, "device": self.device, "relativeSpeed": round(self.relative_speed, 3),
                "since": iso(self.since) if self.since else None, "evidence": self.evidence[:200]}


@dataclass(frozen=True)
class Telemetry:
    """The coordinator's measurements: relative speed per pod (1.0 = the median), stragglers."""

    speeds: Mapping[str, float] = field(default_factory=dict)
    stragglers: tuple[Straggler, ...] = ()

    def to_status(self) -> dict[str, Any]:
        return {"speeds": dict(self.speeds), "stragglers": [s.to_dict() for s in self.stragglers]}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Telemetry:
        raw = status.get("speeds") or {}
        if not isinstance(raw, Mapping):
            raise InvalidStatus("speeds", f"must map pod names to numbers, got {raw!r}")
        speeds = {}
        for pod, value in raw.items():
            speed = _float(value, f"speeds.{pod}")
            if speed is None or speed <= 0:
                raise InvalidStatus(f"speeds.{pod}", f"must be a positive number, got {value!r}")
            speeds[str(pod)] = speed
        stragglers = tuple(
            Straggler(str(s.get("pod", "")), str(s.get("device", "")), float(s.get("relativeSpeed") or 1.0),
                      parse_time(s.get("since")), str(s.get("evidence") or ""))
            for s in status.get("stragglers") or () if isinstance(s, Mapping))
        return cls(speeds, stragglers)


@dataclass(frozen=True)
class AdaptiveReport:
    """``status.adaptive``: the straggler policy's switches and its newest decision, with the
    numbers it decided on (``planner.adapt.Decision.to_dict``)."""

    enabled: bool = False
    switches: int = 0
    last_decision: Mapping[str, Any] | None = None

    def to_status(self) -> dict[str, Any]:
        return {"adaptive": {"enabled": self.enabled, "switches": self.switches,
                             "lastDecision": dict(self.last_decision) if self.last_decision else None}}

    @classmethod
    def from_coordinator(cls, report: Mapping[str, Any]) -> AdaptiveReport:
        decisions = [d for d in report.get("decisions") or () if isinstance(d, Mapping)]
        last = None
        if decisions:
            d = decisions[-1]
            when = parse_time(d.get("time"))  # None: absent or garbled
            last = {"switch": bool(d.get("switch")), "kind": str(d.get("kind") or ""),
                    "config": str(d.get("config") or ""), "step": d.get("step"),
                    "time": iso(when) if when is not None else None,
                    "predictedStepSeconds": d.get("predictedStepSeconds"),
                    "predictedStepSecondsAfter": d.get("predictedStepSecondsAfter"),
                    "measuredStepSeconds": d.get("measuredStepSeconds"),
                    "switchCostSeconds": d.get("switchCostSeconds"), "horizonSteps": d.get("horizonSteps"),
                    "stragglers": [str(x) for x in d.get("stragglers") or ()],
                    "reason": str(d.get("reason") or "")[:300]}
        return cls(bool(report.get("enabled")), int(report.get("switches") or 0), last)

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> AdaptiveReport:
        raw = status.get("adaptive") or {}
        if not isinstance(raw, Mapping):
            raise InvalidStatus("adaptive", f"must be a mapping, got {raw!r}")
        last = raw.get("lastDecision")
        return cls(bool(raw.get("enabled")), int(_float(raw.get("switches"), "adaptive.switches") or 0),
                   last if isinstance(last, Mapping) else None)


@dataclass(frozen=True)
class Progress:
    """Where training is (``status.progress``), from the coordinator's view of the heartbeats."""

    step: int
    train_iters: int | None = None
    consumed_samples: int | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    eta: str | None = None
    updated_at: datetime | None = None

    def to_status(self) -> dict[str, Any]:
        # the loss to 4 decimals, as the training log prints it (kubectl's LOSS column shows it as is)
        loss = round(self.loss, 4) if self.loss is not None else None
        out: dict[str, Any] = {"step": self.step, "loss": loss, "tokensPerSecond": self.tokens_per_second,
                               "eta": self.eta}
        if self.train_iters is not None:
            out["trainIters"] = self.train_iters
        if self.consumed_samples is not None:
            out["consumedSamples"] = self.consumed_samples
        if self.updated_at is not None:
            out["updatedAt"] = iso(self.updated_at)
        return {"progress": out}

    @classmethod
    def from_coordinator(cls, progress: Mapping[str, Any]) -> Progress:
        tps = progress.get("tokens_per_second")
        return cls(step=int(progress["step"]), train_iters=progress.get("train_iters"),
                   consumed_samples=progress.get("consumed_samples"), loss=progress.get("loss"),
                   tokens_per_second=round(float(tps), 1) if tps else None, eta=progress.get("eta"),
                   updated_at=parse_time(progress.get("time")))


@dataclass(frozen=True)
class Finished:
    """The runtime's report that training reached trainIters (``status.finishedAt``): the job
    is done, and ``finalCheckpoint`` holds its complete final state."""

    at: datetime
    step: int
    checkpoint: str | None = None

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"finishedAt": iso(self.at), "finishedStep": self.step}
        if self.checkpoint:
            out["finalCheckpoint"] = self.checkpoint
        return out

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Finished | None:
        if not status.get("finishedAt"):
            return None
        at = parse_time(status["finishedAt"])
        if at is None:
            raise InvalidStatus("finishedAt", f"is not an RFC 3339 time: {status['finishedAt']!r}")
        step = _int(status, "finishedStep", "finishedStep", 0)
        return cls(at, int(step or 0), status.get("finalCheckpoint"))


@dataclass(frozen=True)
class CheckpointReport:
    """What the runtime knows of the job's checkpoints (``status.checkpoints``): the newest
    complete one, the last failed save and how many failed, and why the directory cannot be
    used at all. The operator turns the last two into ``CheckpointFailing`` and
    ``CheckpointUnavailable`` conditions."""

    latest_path: str | None = None
    latest_step: int | None = None
    failed_saves: int = 0
    last_failure: str | None = None  # "step N: error"
    failed_step: int | None = None
    failed_at: datetime | None = None
    unavailable: str | None = None  # "path: error"

    def to_status(self) -> dict[str, Any]:
        """Every field, None where there is nothing: the status is merge-patched, so a field
        left out would keep an old value (a failure the runtime no longer reports)."""
        return {"checkpoints": {
            "failedSaves": self.failed_saves,
            "latest": {"path": self.latest_path, "step": self.latest_step} if self.latest_path else None,
            "lastFailure": self.last_failure,
            "lastFailedStep": self.failed_step if self.last_failure else None,
            "failedAt": iso(self.failed_at) if self.last_failure and self.failed_at is not None else None,
            "unavailable": self.unavailable,
        }}

    @classmethod
    def from_coordinator(cls, report: Mapping[str, Any]) -> CheckpointReport:
        latest = report.get("latest") or {}
        failed = report.get("failed") or {}
        unavailable = report.get("unavailable") or {}
        # a failure a later save of its step made good (the final checkpoint, retried) is history
        open_failure = bool(failed) and failed.get("resolved") is None
        return cls(latest_path=latest.get("path"), latest_step=latest.get("step"),
                   failed_saves=int(failed.get("count") or 0),
                   last_failure=f"step {failed.get('step')}: {failed.get('error')}" if open_failure else None,
                   failed_step=failed.get("step") if open_failure else None,
                   failed_at=parse_time(failed.get("time")) if open_failure else None,
                   unavailable=f"{unavailable.get('path')}: {unavailable.get('error')}" if unavailable else None)

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> CheckpointReport:
        c = status.get("checkpoints") or {}
        latest = c.get("latest") or {} if isinstance(c, Mapping) else None
        if not isinstance(c, Mapping) or not isinstance(latest, Mapping):
            raise InvalidStatus("checkpoints", f"is not an object with an object 'latest': {c!r}")
        try:
            return cls(latest_path=latest.get("path"),
                       latest_step=None if latest.get("step") is None else int(latest["step"]),
                       failed_saves=int(c.get("failedSaves") or 0), last_failure=c.get("lastFailure"),
                       failed_step=None if c.get("lastFailedStep") is None else int(c["lastFailedStep"]),
                       failed_at=parse_time(c.get("failedAt")), unavailable=c.get("unavailable"))
        except (TypeError, ValueError) as e:
            raise InvalidStatus("checkpoints", f"has a malformed field: {e}") from None

    @property
    def failing(self) -> bool:
        """The last save failed: no complete checkpoint since (a loss with no surviving copy
        would roll back further than the job's schedule promises)."""
        return self.failed_step is not None and (self.latest_step is None or self.failed_step >= self.latest_step)


@dataclass(frozen=True)
class RuntimeFailure:
    """The runtime's report that the run cannot go on (``status.runtimeFailure``): e.g. state
    lost with no surviving copy and no checkpoint. Terminal: the operator fails the job."""

    reason: str
    message: str
    at: datetime | None = None

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reason": self.reason, "message": self.message}
        if self.at is not None:
            out["time"] = iso(self.at)
        return {"runtimeFailure": out}

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> RuntimeFailure | None:
        f = status.get("runtimeFailure")
        if not f:
            return None
        if not isinstance(f, Mapping) or not f.get("reason"):
            raise InvalidStatus("runtimeFailure", f"has no reason: {f!r}")
        return cls(str(f["reason"]), str(f.get("message") or ""), parse_time(f.get("time")))


@dataclass(frozen=True)
class StandbyPods:
    """``status.standby``: the pods outside the running world whose every worker is *up* (its
    process registered from that very pod, by uid, and beats as the process that registered;
    not judged dead), written by the coordinator when the set changes. A plan racing a notice
    names only members and these: a pod still importing (a recreated one takes tens of seconds)
    would hold the switch until it registered."""

    pods: Mapping[str, str] = field(default_factory=dict)  # pod name -> uid

    def to_status(self) -> dict[str, Any]:
        return {"standby": [{"pod": p, "uid": u} for p, u in sorted(self.pods.items())]}

    def up(self, pod: str, uid: str) -> bool:
        return bool(uid) and self.pods.get(pod) == uid

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> StandbyPods:
        raw = status.get("standby")
        if raw is None:
            return cls()
        if not isinstance(raw, list):
            raise InvalidStatus("standby", f"is not a list: {str(raw)[:100]}")
        pods: dict[str, str] = {}
        for entry in raw:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("pod"), str) \
                    or not isinstance(entry.get("uid"), str):
                raise InvalidStatus("standby", f"has an entry that is not {{pod, uid}}: {str(entry)[:100]}")
            pods[entry["pod"]] = entry["uid"]
        return cls(pods)


@dataclass(frozen=True)
class Waiting:
    """What the coordinator waits for, in words, with how long of its bound (``status.waiting``,
    e.g. "generation 5: waiting for w3's ready vote, 4.2 s of 20 s"; the coordinator's report's
    ``waiting``); None while it waits for nothing. Its seconds move at every report: a writer
    that patches the job's status rates it like ``status.progress``."""

    reason: str | None = None

    def to_status(self) -> dict[str, Any]:
        return {"waiting": self.reason}  # None removes the field (a merge patch)

    @classmethod
    def from_coordinator(cls, report: Mapping[str, Any]) -> Waiting:
        reason = report.get("waiting")
        return cls(str(reason) if reason else None)

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Waiting:
        reason = status.get("waiting")
        if reason is not None and not isinstance(reason, str):
            raise InvalidStatus("waiting", f"is not a string: {reason!r}")
        return cls(reason or None)
