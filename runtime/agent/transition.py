"""The worker side of a transition: world plans mapped onto the VPS transition planner and executor.

A world plan names workers in rank order (the planner chose it: ``planner.world``); the
transition planner numbers devices (old rank ``i`` is device ``i``, joiners follow in sorted
order). ``device_plan_for`` is what each member computes, with no communication, before it
moves data: its own device's part of the transition (``vps.device_plan``), which equals its
slice of the whole plan; members compare the plan's inputs digest. ``plan_for`` is the whole
plan, for tools and tests.
"""

from __future__ import annotations

from typing import Any

from liveshard.runtime.control.protocol import WorldPlan, joiners, transition_devices
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec
from liveshard.runtime.vps.device_plan import DevicePlan, plan_device
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.transition import TransitionPlan, plan_transition

# One node per worker unless told otherwise: locality only changes which replica serves.
DEFAULT_GPUS_PER_NODE = 8


def device_map(old: WorldPlan, candidates: tuple[str, ...], dead: tuple[str, ...],
               gpus_per_node: int = DEFAULT_GPUS_PER_NODE, nodes: dict[str, str] | None = None) -> DeviceMap:
    """The transition's devices: old members, then joiners among ``candidates``. ``nodes``
    (worker -> node, from the plans) gives every device its real node when it names them all;
    else devices are grouped ``gpus_per_node`` to a node."""
    keep = set(candidates)
    gone = set(dead)
    leaving = frozenset(i for i, m in enumerate(old.members) if m not in keep and m not in gone)
    dead_ids = frozenset(i for i, m in enumerate(old.members) if m in gone)
    coming = joiners(old, candidates)
    node_ids: tuple[int, ...] = ()
    if nodes and all(m in nodes for m in (*old.members, *coming)):
        index: dict[str, int] = {}
        node_ids = tuple(index.setdefault(nodes[m], len(index)) for m in (*old.members, *coming))
    return DeviceMap(old_world=len(old.members), gpus_per_node=gpus_per_node, leaving=leaving,
                     joining=len(coming), dead=dead_ids, node_ids=node_ids)


def transition_inputs(old: WorldPlan, new: WorldPlan, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                      ) -> tuple[ParallelConfig, ParallelConfig, DeviceMap, tuple[int, ...]]:
    """(old config, new config, device map, new rank -> device) of the transition to ``new``."""
    candidates = (*new.members, *new.standbys)
    devices = device_map(old, candidates, new.dead, gpus_per_node, {**dict(old.nodes), **dict(new.nodes)})
    device_of = {m: d for d, m in enumerate(transition_devices(old, new))}
    rank_to_device = tuple(device_of[m] for m in new.members)
    return ParallelConfig.parse(old.config), ParallelConfig.parse(new.config), devices, rank_to_device


def plan_for(spec: ModelSpec, old: WorldPlan, new: WorldPlan,
             gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> TransitionPlan:
    """The whole transition plan of ``new``, with its ranks on the devices its members order names.

    Raises ``vps.transition.NoSurvivingCopy`` when some state has no live holder left."""
    return plan_transition(spec, *transition_inputs(old, new, gpus_per_node))


def device_plan_for(spec: ModelSpec, old: WorldPlan, new: WorldPlan, worker: str,
                    gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> DevicePlan:
    """``worker``'s part of the transition to ``new`` (``vps.device_plan.plan_device``); its
    ``digest`` is the inputs digest, equal on every member exactly when their plans are parts
    of one plan.

    Raises ``vps.transition.NoSurvivingCopy`` when state this worker needs has no live holder."""
    device = transition_devices(old, new).index(worker)
    return plan_device(spec, *transition_inputs(old, new, gpus_per_node), device)


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
    from liveshard.runtime.comms import world as worlds
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
                              verify=verify, group=prep.transfer_group(), ranks=group_ranks(old, new),
                              tensor_device=worlds.device(),  # a joiner has no old tensor to take it from
                              destinations=prep.destinations)
    tensors = {(state, name): t for state, name, t in result.shards.items()}
    return TransitionResult(tensors, result.objects, result.stats)
