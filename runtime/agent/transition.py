"""The worker side of a transition: world plans mapped onto the VPS transition planner and executor.

A world plan names workers in rank order (the planner chose it: ``planner.world``); the
transition planner numbers devices (old rank ``i`` is device ``i``, joiners follow in sorted
order). ``plan_for`` is what every member recomputes, with no communication, before it moves
data, and what the coordinator checks a plan with (is there a live copy of everything?).
"""

from __future__ import annotations

from typing import Any

from liveshard.runtime.control.protocol import WorldPlan, joiners, transition_devices
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.transition import TransitionPlan, plan_transition

# One node per worker unless told otherwise: locality only changes which replica serves.
DEFAULT_GPUS_PER_NODE = 8


def device_map(old: WorldPlan, candidates: tuple[str, ...], dead: tuple[str, ...],
               gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> DeviceMap:
    keep = set(candidates)
    gone = set(dead)
    leaving = frozenset(i for i, m in enumerate(old.members) if m not in keep and m not in gone)
    dead_ids = frozenset(i for i, m in enumerate(old.members) if m in gone)
    return DeviceMap(old_world=len(old.members), gpus_per_node=gpus_per_node, leaving=leaving,
                     joining=len(joiners(old, candidates)), dead=dead_ids)


def plan_for(spec: ModelSpec, old: WorldPlan, new: WorldPlan,
             gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> TransitionPlan:
    """The transition plan of ``new``, with its ranks on the devices its members order names.

    Raises ``vps.transition.NoSurvivingCopy`` when some state has no live holder left."""
    candidates = (*new.members, *new.standbys)
    devices = device_map(old, candidates, new.dead, gpus_per_node)
    device_of = {m: d for d, m in enumerate(transition_devices(old, new))}
    rank_to_device = tuple(device_of[m] for m in new.members)
    return plan_transition(spec, ParallelConfig.parse(old.config), ParallelConfig.parse(new.config), devices,
                           rank_to_device)


def group_ranks(old: WorldPlan, new: WorldPlan) -> list[Any]:
    """Transition-group rank of each device (None for dead devices, which have no process)."""
    dead = set(new.dead)
    out: list[Any] = []
    next_rank = 0
    for m in transition_devices(old, new):
        if m in dead:
            out.append(None)
        else:
            out.append(next_rank)
            next_rank += 1
    return out


class TransitionResult:
    """What a member gets out of a transition: its new tensors and small objects."""

    def __init__(self, tensors: dict, objects: dict, stats: Any) -> None:
        self.tensors = tensors
        self.objects = objects
        self.stats = stats


def execute_transition(prep: Any, worker: str, sources: dict, objects: dict | None, *,
                       budget: int, verify: bool, mode: str | None = None) -> TransitionResult:
    """Move this worker's part of the transition ``prep`` over its transition group."""
    from liveshard.runtime.agent import world as worlds
    from liveshard.runtime.transfer import executor
    from liveshard.runtime.transfer.storage import LocalShards
    from liveshard.runtime.vps.schedule import schedule

    plan, old, new = prep.transition, prep.old, prep.plan
    devices = transition_devices(old, new)
    device_id = devices.index(worker)
    shards = LocalShards()
    for (state, name), tensor in sources.items():
        shards.tensors.setdefault(state, {})[name] = tensor
    sched = schedule(plan, budget)
    result = executor.execute(plan, sched, device_id, shards, objects or {},
                              mode=mode or executor.DEFAULT_MODE,
                              verify=verify, group=prep.group, ranks=group_ranks(old, new),
                              tensor_device=worlds.device(),  # a joiner has no old tensor to take it from
                              destinations=prep.destinations)
    tensors = {(state, name): t for state, name, t in result.shards.items()}
    return TransitionResult(tensors, result.objects, result.stats)
