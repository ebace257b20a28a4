"""The reconfiguration protocol between the coordinator and the workers: world plans and results.

Both travel through the job's c10d store as JSON, under the keys of ``contract.keys``; nothing
here does I/O.

Generation 0 is the initial world; a plan replaces the world of its ``previous`` generation,
live (state moves to its new owners), or through a checkpoint: a *stop* plan (``config ""``, no
members) saves one and leaves every worker waiting, a plan with ``restore_from`` loads one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# The phases of a live reconfiguration a worker passes, in order: "prepare" (the control thread,
# before the transition group), "connect" (a new member, after the new members met on the store and
# before it connects the new world's communicators ahead; see agent.world.build_world_ahead), "transfer" (before moving state), "commit" (after the vote, the
# old world's groups gone, its state kept), "built" (the new world built and loaded, before the
# commit point) and "committed" (after it: the old state is gone).
PHASES = ("prepare", "connect", "transfer", "commit", "built", "committed")


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

    @property
    def is_stop(self) -> bool:
        """A stop: the old world saves a checkpoint and every worker waits (``config == ""``)."""
        return self.config == ""

    @property
    def is_live_transition(self) -> bool:
        """State moves from the old world's members over the transition group."""
        return self.previous is not None and not self.is_stop and self.restore_from is None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorldPlan:
        data = json.loads(text)
        for name in ("members", "standbys", "dead"):
            data[name] = tuple(data.get(name, ()))
        return cls(**data)


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
