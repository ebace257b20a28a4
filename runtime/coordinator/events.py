"""What crosses the coordinator core's boundary: the observations its loop reads (``Observation``,
``Registration``) and the actions the core returns (``Publish``, ``Decide``, ...). Pure data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from liveshard.runtime.control.protocol import MemberResult, Registration, WorldPlan
from liveshard.runtime.coordinator.membership import BeatRead
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest

# ``Registration`` (``members/<id>``) is the workers' side of the wire contract: it lives in
# ``control.protocol`` (the worker writes it, and must not import the coordinator) and is named
# here too, as the observation it is.
__all__ = ["Action", "CheckpointView", "Decide", "MarkDead", "Observation", "Precompute", "Publish",
           "Registration", "Report", "Stop", "WriteOutcome"]


# ---- what the loop reads ---------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    now: float  # the coordinator's monotonic clock
    wall: float = 0.0  # unix time (plans carry it as ``created``; never used to judge anything)
    beats: Mapping[str, BeatRead] = field(default_factory=dict)  # of ``core.watched()``
    telemetry: Mapping[str, dict[str, Any]] = field(default_factory=dict)  # the valid heartbeats, as sent
    results: Mapping[str, MemberResult] = field(default_factory=dict)  # of the pending generation
    decision: str | None = None  # the pending generation's commit point
    arrived: int = 0  # new members counted in to build the pending generation's world
    ready: frozenset[str] = frozenset()  # new members whose ready vote is in (read while undecided)
    request: PlanRequest | None = None  # polled only while ``core.accepting``
    registrations: Mapping[str, Registration] | None = None  # read while adopting or with a request
    finished: dict[str, Any] | None = None  # rank 0's report at trainIters (with ``error``: no final checkpoint)
    inputs: PlanningInputs | None = None  # the job's planning inputs now (None: the coordinator's own)
    # seconds the coordinator's process was stopped before this tick (its store with it: no beat
    # could land), which the liveness judge does not count as anyone's silence
    paused: float = 0.0


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

    def latest(self) -> dict[str, Any] | None:  # the newest verified checkpoint
        return None

    def on_volume(self) -> dict[str, Any] | None:  # the newest complete one on the job's volume
        return None


def restore_choice(pointer: dict[str, Any] | None, problem: str | None,
                   newest: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """The checkpoint a restore takes, and a warning to log (or None), from ``pointer`` (what
    ``checkpoint/latest`` names, as read), ``problem`` (why the checkpoint it names fails
    verification on the job's volume; None: it verifies, or is not on a volume this process
    sees) and ``newest`` (the newest of the job's checkpoints on that volume that verifies;
    None: none, or no volume).

    The pointer, unless what it names fails verification (then the newest that verifies), or a
    newer checkpoint verifies (a validly sealed pointer replayed to a reader that never read
    the newer one: a replay must not roll the job back)."""
    if pointer and problem is not None:
        return newest, f"checkpoint {pointer.get('path')} failed verification ({problem}): looking for an older one"
    if newest is not None and (not pointer or int(newest["step"]) > int(pointer.get("step", -1))):
        warning = (f"checkpoint/latest names step {pointer.get('step')}, but step {newest['step']} verifies on the "
                   "job's volume: restoring from it") if pointer else None
        return newest, warning
    return pointer, None
