"""The reconfiguration protocol between the coordinator and the workers: world plans and results.

Both travel through the job's c10d store as JSON, under the keys of ``contract.keys``; nothing
here does I/O.

Generation 0 is the initial world; a plan replaces the world of its ``previous`` generation,
live (state moves to its new owners), or through a checkpoint: a *stop* plan (``config ""``, no
members) saves one and leaves every worker waiting, a plan with ``restore_from`` loads one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

_T = TypeVar("_T")

# The phases of a live reconfiguration a worker passes, in order: "prepare" (the control thread,
# before the transition group), "connect" (a new member, after the new members met on the store and
# before it connects the new world's communicators ahead; see comms.world.build_world_ahead), "transfer" (before moving state), "commit" (after the vote, the
# old world's groups gone, its state kept), "built" (the new world built and loaded, before the
# commit point), "commit-window" (a new member's ready vote is cast, the decision not read yet)
# and "committed" (after it: the old state is gone).
PHASES = ("prepare", "connect", "transfer", "commit", "built", "commit-window", "committed")


# WorldPlan.mode: how a plan's world comes to exist.
START, LIVE, CHECKPOINT = "start", "live", "checkpoint"


@dataclass(frozen=True)
class WorldPlan:
    generation: int
    config: str  # ParallelConfig string form
    members: tuple[str, ...]  # worker ids in rank order: rank i is members[i]
    standbys: tuple[str, ...] = ()  # available workers the config does not use (they wait)
    reason: str = ""
    previous: int | None = None  # the generation this plan replaces
    switch_at_step: int | None = None  # switch exactly after this step (None: as soon as prepared)
    deadline: float | None = None  # unix time by which leaving members are gone (the notice)
    dead: tuple[str, ...] = ()  # old members that are gone without notice (never sources)
    created: float = 0.0
    # The new world is built from this megatron checkpoint instead of a live transfer: after a
    # stop, or when some state has no surviving copy (a loss without notice).
    restore_from: str | None = None
    cause: str | None = None  # why (a contract.Cause value), as the request said
    # (worker, node) of every member and standby, as they registered: which devices share a
    # node (fast links, one failure domain) in the transition's device map
    nodes: tuple[tuple[str, str], ...] = ()

    @property
    def is_stop(self) -> bool:
        """A stop: the old world saves a checkpoint and every worker waits (``config == ""``)."""
        return self.config == ""

    @property
    def mode(self) -> str:
        """How the world of this plan comes to exist: ``START`` (a first world), ``CHECKPOINT``
        (a stop, or a restore from a checkpoint) or ``LIVE`` (state moves from the old world's
        members). The worker's ``agent.world_change.choose`` refines a live change by the old
        world (a leave with notice shrinks it)."""
        if self.previous is None:
            return START
        return CHECKPOINT if self.is_stop or self.restore_from is not None else LIVE

    @property
    def is_live_transition(self) -> bool:
        """State moves from the old world's members over the transition group (``mode`` LIVE)."""
        return self.mode == LIVE

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorldPlan:
        data = json.loads(text)
        for name in ("members", "standbys", "dead"):
            data[name] = tuple(data.get(name, ()))
        data["nodes"] = tuple((str(w), str(n)) for w, n in data.get("nodes", ()))
        return cls(**data)

    def node_of(self, worker: str) -> str | None:
        """The node ``worker`` registered from, if this plan says."""
        return dict(self.nodes).get(worker)


@dataclass
class MemberResult:
    """What one member reports about a generation."""

    ok: bool
    error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    bytes_received: int = 0
    bytes_sent: int = 0
    step: int = -1  # the step boundary it switched at

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> MemberResult:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class OpenGeneration:
    """What a worker inside (or just past) a live transition's commit window tells a restarted
    coordinator (``members/<id>`` under ``"open"``): the generation and its plan, whether this
    member's ready vote was cast and confirmed, and the decision it read, if any. The coordinator
    resolves the generation from every member's (``agent.commit_point.resolve``)."""

    generation: int
    plan: WorldPlan
    ready: bool = False
    decision: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """As it goes into a worker's registration (``members/<id>``, a JSON object)."""
        return {"generation": self.generation, "plan": asdict(self.plan), "ready": self.ready,
                "decision": self.decision}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> OpenGeneration:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpenGeneration:
        plan = data["plan"]
        plan = WorldPlan.from_json(plan if isinstance(plan, str) else json.dumps(plan))
        if int(data["generation"]) != plan.generation:
            raise ValueError(f"open generation {data['generation']} carries the plan of generation {plan.generation}")
        decision = data.get("decision")
        return cls(generation=int(data["generation"]), plan=plan, ready=bool(data.get("ready", False)),
                   decision=None if decision is None else str(decision))


@dataclass(frozen=True)
class Registration:
    """``members/<id>``: a worker's announcement (at start, and again to a restarted coordinator).

    Written by the worker (``agent.connection.register``, ``reannounce``) as ``to_dict()``; read
    by the coordinator (``coordinator.events`` names it too) with ``parse``."""

    node: str
    incarnation: str | None = None
    plan: WorldPlan | None = None  # the world it trains in
    latest_seen: int = -1  # the newest plan generation it has seen
    checkpoint: dict[str, Any] | None = None  # the newest checkpoint it saved
    open: OpenGeneration | None = None  # a generation inside its commit window
    pending_plan: WorldPlan | None = None  # a plan it prepared whose outcome it never learned
    gpu_memory_bytes: int | None = None  # its device's memory (None: the job's gpuMemory stands)
    host: str | None = None  # its host name (``node`` falls back to it)
    pid: int | None = None
    time: float | None = None  # unix time it announced itself
    reconnected: bool = False  # announced again, to a restarted coordinator
    # The uid of the pod it runs in (``$LIVESHARD_POD_UID``): a registration left in the store by
    # an earlier pod of the same name (same worker id) is not this pod's (``kube_source.not_up``)
    pod_uid: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """As it goes into the store (``members/<id>``, a JSON object): the plans as their JSON
        text, the open generation as an object; what is unknown is left out."""
        out: dict[str, Any] = {"host": self.host, "node": self.node, "pid": self.pid,
                               "incarnation": self.incarnation, "time": self.time}
        if self.reconnected:
            out["reconnected"] = True
        if self.reconnected or self.latest_seen != -1:
            out["latest_seen"] = self.latest_seen
        if self.gpu_memory_bytes is not None:
            out["gpu_memory_bytes"] = self.gpu_memory_bytes
        if self.pod_uid:
            out["pod_uid"] = self.pod_uid
        if self.plan is not None:
            out["plan"] = self.plan.to_json()
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        if self.open is not None:
            out["open"] = self.open.to_dict()
        if self.pending_plan is not None:
            out["pending_plan"] = self.pending_plan.to_json()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def parse(cls, worker: str, info: object) -> Registration | None:
        if not isinstance(info, dict):
            return None
        try:
            def plan(v: object) -> WorldPlan | None:
                if not v:
                    return None
                if isinstance(v, WorldPlan):
                    return v
                return WorldPlan.from_json(v if isinstance(v, str) else json.dumps(v))

            opened = info.get("open")
            vote = OpenGeneration.from_dict(opened) if isinstance(opened, dict) else None
            return cls(node=str(info.get("node") or info.get("host") or worker),
                       incarnation=info.get("incarnation") or None, plan=plan(info.get("plan")),
                       latest_seen=int(info.get("latest_seen", -1)), checkpoint=info.get("checkpoint") or None,
                       open=vote, pending_plan=plan(info.get("pending_plan")),
                       gpu_memory_bytes=_positive_int(info.get("gpu_memory_bytes")),
                       host=str(info["host"]) if info.get("host") else None,
                       pid=_optional(int, info.get("pid")), time=_optional(float, info.get("time")),
                       reconnected=info.get("reconnected") is True,
                       pod_uid=str(info["pod_uid"]) if info.get("pod_uid") else None)
        except (KeyError, TypeError, ValueError):
            return None


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def joiners(old: WorldPlan, candidates: tuple[str, ...]) -> tuple[str, ...]:
    """Workers new to the job, in device order (sorted ids: every member computes the same)."""
    have = set(old.members)
    return tuple(sorted(c for c in candidates if c not in have))


def transition_devices(old: WorldPlan, new: WorldPlan) -> tuple[str, ...]:
    """Workers by device id of the transition: old rank i is device i, joiners follow."""
    return (*old.members, *joiners(old, (*new.members, *new.standbys)))


def transition_members(old: WorldPlan, new: WorldPlan) -> tuple[str, ...]:
    """Members of the transition group in its rank order: the devices, less the dead."""
    dead = set(new.dead)
    return tuple(m for m in transition_devices(old, new) if m not in dead)


class WorkerPhase(StrEnum):
    """What a worker is doing, as its heartbeat says (``Heartbeat.state``)."""

    WAITING = "waiting"  # not in a world: starting, a joiner, after a broken world was left
    TRAINING = "training"
    STANDBY = "standby"  # available, not used by the running config
    COMMITTING = "committing"  # inside a live switch
    BROKEN = "broken"  # its world's collective failed; it holds its state and waits for a recovery
    LEFT = "left"  # left the job by plan
    EXITED = "exited"  # the process is ending
    FINISHED = "finished"  # the job reached trainIters
    FAILED = "failed"  # gave up: the final checkpoint could not be saved (the job fails); the process ends


# A member in one of these phases is gone on purpose: silence after it is not a death, and no
# new plan names it.
ENDED_PHASES = frozenset({WorkerPhase.LEFT, WorkerPhase.EXITED, WorkerPhase.FINISHED})


@dataclass(frozen=True)
class Heartbeat:
    """``hb/<id>``: a worker's sign of life and its progress. ``time`` is the writer's clock, used
    only to tell a newer beat from an older one of the same process (liveness is judged on the
    reader's clock: ``coordinator.membership``).

    Written by the worker (``agent.connection.heartbeat_payload``) and its pulse (``stamped``)
    as ``to_dict()``; read back with ``parse``."""

    time: float
    state: str
    incarnation: str | None = None
    generation: int | None = None
    rank: int | None = None
    step: int | None = None
    consumed_samples: int | None = None
    step_seconds: float | None = None
    loss: float | None = None
    seq: int | None = None  # a per-process counter, where the sender has one
    preparing: int | None = None  # the newest plan the worker took up (its generation)
    # [step, compute seconds, layer units] of the recent steps: the coordinator's speed estimate
    compute: tuple[tuple[float, ...], ...] = ()
    pid: int | None = None
    health: dict[str, Any] | None = None  # the device's health (``telemetry.gpu_health``), where known
    # set by the pulse process (``agent.pulse.stamped``): when the worker published this beat,
    # how old it was when the pulse wrote it, and that the pulse wrote it
    published: float | None = None
    age: float | None = None
    pulse: bool = False

    # Always on the wire (None when unknown); the rest only when set.
    _ALWAYS: ClassVar[tuple[str, ...]] = ("time", "state", "generation", "rank", "step", "consumed_samples", "step_seconds",
               "compute", "loss", "pid", "incarnation", "preparing")

    def to_dict(self) -> dict[str, Any]:
        """As it goes into the store (``hb/<id>``, a JSON object)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in self._ALWAYS}
        out["compute"] = [list(x) for x in self.compute]
        if self.health:
            out["health"] = self.health
        if self.seq is not None:
            out["seq"] = self.seq
        if self.published is not None:
            out["published"] = self.published
        if self.age is not None:
            out["age"] = self.age
        if self.pulse:
            out["pulse"] = True
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def parse(cls, data: object) -> Heartbeat | None:
        """The heartbeat in ``data`` (a decoded JSON object), None when it is not one: a value
        with a valid MAC but a wrong shape is treated as no heartbeat, never raised. The fields
        only reported (``compute``, ``pid``, ``health``, the pulse's stamps) never make a beat
        invalid: a malformed one reads as unknown."""
        if not isinstance(data, dict):
            return None
        health = data.get("health")
        try:
            return cls(time=float(data["time"]), state=str(data.get("state") or WorkerPhase.WAITING),
                       incarnation=data.get("incarnation") or None,
                       generation=None if data.get("generation") is None else int(data["generation"]),
                       rank=None if data.get("rank") is None else int(data["rank"]),
                       step=None if data.get("step") is None else int(data["step"]),
                       consumed_samples=None if data.get("consumed_samples") is None else int(data["consumed_samples"]),
                       step_seconds=None if data.get("step_seconds") is None else float(data["step_seconds"]),
                       loss=None if data.get("loss") is None else float(data["loss"]),
                       seq=None if data.get("seq") is None else int(data["seq"]),
                       preparing=None if data.get("preparing") is None else int(data["preparing"]),
                       compute=_compute_log(data.get("compute")), pid=_optional(int, data.get("pid")),
                       health=health if isinstance(health, dict) else None,
                       published=_optional(float, data.get("published")), age=_optional(float, data.get("age")),
                       pulse=data.get("pulse") is True)
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def ended(self) -> bool:
        return self.state in ENDED_PHASES


def _optional(kind: Callable[[Any], _T], value: object) -> _T | None:
    """``kind(value)``; None when ``value`` is None or not one."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def _compute_log(value: object) -> tuple[tuple[float, ...], ...]:
    """A heartbeat's ``compute`` entries (lists of numbers); () when malformed."""
    if not isinstance(value, list | tuple):
        return ()
    if not all(isinstance(x, list | tuple) for x in value):
        return ()
    return tuple(tuple(x) for x in value)


class Outcome(StrEnum):
    """How a generation ended (``GenerationOutcome.outcome`` starts with one of these)."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    REJECTED = "rejected"
    FAILED = "failed"


@dataclass(frozen=True)
class GenerationOutcome:
    """One entry of the coordinator's history: a generation's end, or a request refused."""

    generation: int | None
    outcome: str  # "committed", "aborted: <why>", "rejected: <why>", "failed: <why>"
    reason: str = ""
    config: str | None = None
    world_size: int | None = None
    cause: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    downtime: float = 0.0
    switch_step: int = -1
    seconds: float = 0.0

    @property
    def committed(self) -> bool:
        return self.outcome == Outcome.COMMITTED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
