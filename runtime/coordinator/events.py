"""What crosses the coordinator core's boundary: the observations its loop reads (``Observation``,
``Registration``) and the actions the core returns (``Publish``, ``Decide``, ...). Pure data."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from liveshard.runtime.control.protocol import MemberResult, OpenGeneration, WorldPlan
from liveshard.runtime.coordinator.membership import BeatRead
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest


# ---- what the loop reads ---------------------------------------------------------------------
@dataclass(frozen=True)
class Registration:
    """``members/<id>``: a worker's announcement (at start, and again to a restarted coordinator)."""

    node: str
    incarnation: str | None = None
    plan: WorldPlan | None = None  # the world it trains in
    latest_seen: int = -1  # the newest plan generation it has seen
    checkpoint: dict | None = None  # the newest checkpoint it saved
    open: OpenGeneration | None = None  # a generation inside its commit window
    pending_plan: WorldPlan | None = None  # a plan it prepared whose outcome it never learned
    gpu_memory_bytes: int | None = None  # its device's memory (None: the job's gpuMemory stands)

    @classmethod
    def parse(cls, worker: str, info: object) -> Registration | None:
        if not isinstance(info, dict):
            return None
        try:
            def plan(v: object) -> WorldPlan | None:
                if not v or isinstance(v, WorldPlan):
                    return v or None
                return WorldPlan.from_json(v if isinstance(v, str) else json.dumps(v))

            opened = info.get("open")
            vote = OpenGeneration.from_dict(opened) if isinstance(opened, dict) else None
            return cls(node=str(info.get("node") or info.get("host") or worker),
                       incarnation=info.get("incarnation") or None, plan=plan(info.get("plan")),
                       latest_seen=int(info.get("latest_seen", -1)), checkpoint=info.get("checkpoint") or None,
                       open=vote, pending_plan=plan(info.get("pending_plan")),
                       gpu_memory_bytes=_positive_int(info.get("gpu_memory_bytes")))
        except (KeyError, TypeError, ValueError):
            return None


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


@dataclass(frozen=True)
class Observation:
    now: float  # the coordinator's monotonic clock
    wall: float = 0.0  # unix time (plans carry it as ``created``; never used to judge anything)
    beats: Mapping[str, BeatRead] = field(default_factory=dict)  # of ``core.watched()``
    telemetry: Mapping[str, dict] = field(default_factory=dict)  # the valid heartbeats, as sent
    results: Mapping[str, MemberResult] = field(default_factory=dict)  # of the pending generation
    decision: str | None = None  # the pending generation's commit point
    arrived: int = 0  # new members counted in to build the pending generation's world
    ready: frozenset[str] = frozenset()  # new members whose ready vote is in (read while undecided)
    request: PlanRequest | None = None  # polled only while ``core.accepting``
    registrations: Mapping[str, Registration] | None = None  # read while adopting or with a request
    finished: dict | None = None  # rank 0's report at trainIters (with ``error``: no final checkpoint)
    inputs: PlanningInputs | None = None  # the job's planning inputs now (None: the coordinator's own)


# ---- what the loop does ----------------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    plan: WorldPlan


@dataclass(frozen=True)
class Decide:
    """Write ``value`` as the generation's decision unless one is there; the loop hands the value
    that stands back to ``CoordinatorCore.decided``."""

    generation: int
    value: str


@dataclass(frozen=True)
class WriteOutcome:
    generation: int
    outcome: str


@dataclass(frozen=True)
class MarkDead:
    """Tell the process itself (``Keys.dead``): it may be only frozen, and must rejoin as new."""

    member: str
    incarnation: str | None


@dataclass(frozen=True)
class Stop:
    """Every worker finishes (``Keys.STOP``)."""


@dataclass(frozen=True)
class Report:
    """The status changed: report it now."""


@dataclass(frozen=True)
class Precompute:
    """Ask the likeliest next events' plans in the background (``WorldChooser.precompute``)."""

    current: WorldPlan
    dead: frozenset[str]


Action = Publish | Decide | WriteOutcome | MarkDead | Stop | Report | Precompute


class CheckpointView:
    """What the core may ask about the job's checkpoints (the loop's reads of the store and the
    volume; the simulator's model). Both return ``{"path", "step", ...}`` or None."""

    def latest(self) -> dict | None:  # the newest verified checkpoint
        return None

    def on_volume(self) -> dict | None:  # the newest complete one on the job's volume
        return None
