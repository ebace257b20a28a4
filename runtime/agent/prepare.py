"""Preparing a plan in the background, while training goes on: everything a switch can pay early.

For a live transition every member of the old and the new world (``Preparer.prepare``, run by
the control thread):

1. computes its own device's part of the transition plan (``transition.device_plan_for``:
   pure, no communication, only the boxes around its device);
2. publishes the plan's inputs digest (``gen/<N>/prepared/<id>``: every input of the plan and
   the planner's version) and waits for every other member's, heartbeating meanwhile: all must
   be equal, so that the parts are parts of one plan;
3. builds the transition group over old and new members (``world.build_transition_group``), unless
   the change is a leave (nobody joins, nobody is dead): then the transfer runs over the running
   world's default group;
4. allocates and touches the new tensors the transfer will fill, and gradient memory when the
   old buffer is too small (joiners always; members too per ``WorkerOptions.preallocate``), so
   the pause does not pay for fresh memory;
5. connects the new training world's communicators (``world.build_world_ahead``: the default
   group and every megatron group this member is in; per ``WorkerOptions.build_world_ahead``),
   so the commit hands them over instead of connecting them, unless the change makes the new
   world from the running one (a leave with notice shrinks it: ``world_change.Shrink``).

What the change is (which of 3 and 5 it takes) is its ``world_change`` strategy's to say.

A first world, or one built through a checkpoint (a stop, a restore), has nothing to plan or
connect. The result is a ``Prepared``, kept in ``Preparations`` (shared with the training
thread, which switches to it at a step boundary); a failure is recorded there and reported to
the coordinator, which aborts the generation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from liveshard.runtime.agent.connection import StoreClients, report_result
from liveshard.runtime.agent.transition import device_plan_for
from liveshard.runtime.agent.world_change import WorldChange, choose
from liveshard.runtime.comms import release
from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.barrier import Backoff, wait_until
from liveshard.runtime.control.protocol import MemberResult, WorldPlan, transition_devices, transition_members
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.spec import ModelSpec

if TYPE_CHECKING:
    from liveshard.runtime.agent.worker import WorkerOptions

log = logging.getLogger("liveshard.worker")

# What a new member says at the connect meeting (``Keys.connecting``).
AHEAD, AT_COMMIT = "ahead", "at-commit"


@dataclass
class Prepared:
    """A plan this worker is ready to switch to."""

    plan: WorldPlan
    old: WorldPlan | None
    transition: Any  # this member's liveshard.runtime.vps.device_plan.DevicePlan (None for generation 0)
    group: Any  # the transition ProcessGroup (None: none, or the running world's, see over_running_world)
    group_rank: int
    members: tuple[str, ...]  # transition group members
    seconds: float
    destinations: Any = None  # new tensors allocated and touched ahead (see WorkerOptions.preallocate)
    grad_buffer: Any = None  # and memory for its gradients when the old DDP buffer is too small
    world: Any = None  # the new training world's communicators, built ahead (comms.world.WorldAhead)
    epoch: int = 0  # the store clients' epoch the plan was read in (``StoreClients.epoch``)
    # a leave (nobody joins, nobody is dead): every device of the transition is a rank of the
    # running world, in the same order, so the transfer runs over its default group (no new connection)
    over_running_world: bool = False
    connected: dict[str, int] = field(default_factory=dict)  # communicators connected while preparing, by kind
    created: dict[str, int] = field(default_factory=dict)  # and created (``comms.world.CREATED``), by kind

    @property
    def change(self) -> WorldChange:
        """How the new world comes to exist (``world_change.choose``: the plan and the old world)."""
        return choose(self.old, self.plan)

    def transfer_group(self) -> Any:
        """The process group the transfer and the commit vote run over."""
        return dist.group.WORLD if self.over_running_world else self.group


class Preparations:
    """Generations this worker has prepared, or failed to, by generation (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[int, Prepared] = {}
        self._failed: dict[int, str] = {}

    def add(self, prep: Prepared) -> None:
        with self._lock:
            self._ready[prep.plan.generation] = prep

    def fail(self, gen: int, error: str) -> None:
        with self._lock:
            self._failed[gen] = error

    def abort(self, gen: int, error: str) -> None:
        """A switch to ``gen`` failed: drop what was prepared for it (its communicators are
        freed off the training thread's path, ``release``)."""
        with self._lock:
            release.later(self._ready.pop(gen, None), device_memory=True)
            self._failed[gen] = error

    def known(self, gen: int) -> bool:
        """Prepared, or failed to."""
        with self._lock:
            return gen in self._ready or gen in self._failed

    def get(self, gen: int) -> Prepared:
        with self._lock:
            return self._ready[gen]

    def prepared_from(self, gen: int | None) -> list[int]:
        """The generations prepared as the successor of the world of generation ``gen``."""
        with self._lock:
            return [g for g, p in self._ready.items() if p.old is not None and p.old.generation == gen]

    def newest_after(self, gen: int | None) -> Prepared | None:
        """The newest prepared generation above ``gen`` (any, for None)."""
        with self._lock:
            ready = [p for g, p in self._ready.items() if gen is None or g > gen]
        return max(ready, key=lambda p: p.plan.generation) if ready else None

    def wait(self, gen: int, timeout: float = 300.0) -> Prepared | None:
        """Wait until ``gen`` is prepared (None if it failed, or after ``timeout`` seconds)."""
        def settled() -> Prepared | str | None:
            with self._lock:
                if gen in self._ready:
                    return self._ready[gen]
                return "failed" if gen in self._failed else None

        found = wait_until(settled, timeout=timeout, poll=Backoff.fixed(0.005)).value
        return found if isinstance(found, Prepared) else None

    def drop_after(self, gen: int | None) -> None:
        """Forget every generation above ``gen`` (all, for None): plans of a store that is gone."""
        with self._lock:
            for g in [g for g in self._ready if gen is None or g > gen]:
                release.later(self._ready.pop(g), device_memory=True)
            for g in [g for g in self._failed if gen is None or g > gen]:
                del self._failed[g]

    def abandon_after(self, gen: int | None, upto: int, why: str) -> None:
        """The store these plans came from is gone (a coordinator restart): every generation
        above ``gen`` up to ``upto`` counts as failed here, so that a switch waiting for one
        gives up at once; a restarted coordinator never reuses their numbers."""
        with self._lock:
            for g in [g for g in self._ready if gen is None or g > gen]:
                release.later(self._ready.pop(g), device_memory=True)
            for g in range(0 if gen is None else gen + 1, upto + 1):
                self._failed.setdefault(g, why)

    def drop_through(self, gen: int) -> None:
        """A world of generation ``gen`` was adopted: what was prepared for it or older ones
        (groups, buffers) goes."""
        with self._lock:
            for g in [g for g in self._ready if g <= gen]:
                release.later(self._ready.pop(g), device_memory=True)


def confined(path: str, root: str | None) -> str:
    """``path``, if it lies inside the job's checkpoint directory ``root``: a plan read from the
    store never makes a worker open anything else (ValueError, and the plan is refused)."""
    if not root:
        raise ValueError(f"a restore from {path!r} but this worker has no checkpoint directory")
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise ValueError(f"a restore from {path!r}, outside the job's checkpoint directory {root!r}")
    return real


class Preparer:
    """Prepares plans for one worker (called from the control thread)."""

    def __init__(self, worker_id: str, spec: ModelSpec, options: WorkerOptions, device: torch.device,
                 clients: StoreClients, preparations: Preparations, heartbeat: Callable[[float], None],
                 at_phase: Callable[[str, int], None] = lambda phase, gen: None) -> None:
        self.id = worker_id
        self.spec = spec
        self.options = options
        self.device = device  # fixed in the main thread (CUDA's current device is per thread)
        self.clients = clients
        self.preparations = preparations
        self.heartbeat = heartbeat
        self.at_phase = at_phase

    def prepare(self, plan: WorldPlan) -> None:
        """Background: transition plan, checksum agreement, transition group."""
        start = time.perf_counter()
        epoch = self.clients.epoch
        try:
            if plan.restore_from is not None:
                confined(plan.restore_from, self.options.checkpoint_dir)
            old = self.clients.store.plan(plan.previous) if plan.previous is not None else None
            if old is None or not plan.is_live_transition:
                # a first world, or one built through a checkpoint: nothing to plan or connect
                prepared = Prepared(plan, old, None, None, 0, plan.members, time.perf_counter() - start)
            else:
                prepared = self._prepare_live(plan, old, start)
            prepared.epoch = epoch
            self.preparations.add(prepared)
        except Exception as e:
            log.error("prepare %d failed: %s", plan.generation, traceback.format_exc())
            self.preparations.fail(plan.generation, f"{type(e).__name__}: {e}")
            report_result(self.clients.store, self.id, plan.generation, MemberResult(ok=False, error=f"prepare: {e}"),
                          self.clients.kept)

    def _prepare_live(self, plan: WorldPlan, old: WorldPlan, start: float) -> Prepared:
        connected_before, created_before = Counter(worlds.CONNECTED), Counter(worlds.CREATED)
        change = choose(old, plan)
        transition = device_plan_for(self.spec, old, plan, self.id)
        members = transition_members(old, plan)
        self.at_phase("prepare", plan.generation)
        self._agree(plan.generation, members, transition.digest)
        group_rank = members.index(self.id)
        # Connections are made on a store client of their own, in a thread, while this one
        # heartbeats and watches the decision: a connection waiting for a peer that died blocks
        # every other request on its client until the collective timeout.
        connecting = self.clients.dedicated()
        # A leave (someone goes, nobody joins, nobody is dead): every device is a rank of the
        # running world (``world_change.is_leave``).
        over_running_world = change.transfers_over_running_world(old, plan)
        group = None
        if not over_running_world:  # joiners (or the dead) make it another set of processes
            group = self._connect(plan.generation, lambda stop: worlds.build_transition_group(
                connecting.store, Keys.transfer_prefix(plan.generation), group_rank, len(members),
                self.options.collective_timeout))
        destinations, grad_buffer = self._preallocate(plan, old, transition)
        world = None
        if self.id in plan.members and change.builds_ahead():
            world = self._build_world_ahead(plan, connecting)
        return Prepared(plan, old, transition, group, group_rank, members, time.perf_counter() - start,
                        destinations, grad_buffer, world, over_running_world=over_running_world,
                        connected=worlds.connected_since(connected_before),
                        created=worlds.created_since(created_before))

    def _connect(self, gen: int, work: Callable[[Any], Any]) -> Any:
        """``work(stop)`` in a thread, heartbeating meanwhile; called off once ``gen`` is decided."""
        store = self.clients.store

        def cancelled() -> str | None:
            decided = store.get(Keys.decision(gen))
            return f"generation {gen} was decided while connecting: {decided}" if decided else None

        return worlds.run_heartbeating(work, lambda: self.heartbeat(time.time()), cancelled)

    def _build_world_ahead(self, plan: WorldPlan, connecting: Any) -> Any:
        """Connect the new training world's communicators now (the default group and each of
        megatron's groups this member is in), so the commit only hands them over. The new
        members first meet on the store, where each says whether it builds ahead (its
        ``WorkerOptions.build_world_ahead``, and whether megatron's groups could be probed) and a
        death is decided by the coordinator; unless every one of them builds ahead, none does and
        the world is made at the commit (None)."""
        gen, cfg, rank = plan.generation, ParallelConfig.parse(plan.config), plan.members.index(self.id)
        requests = None
        if self._builds_world_ahead():
            from liveshard.runtime.megatron.build import group_requests

            try:
                requests = group_requests(cfg, rank, self.options.collective_timeout)
            except Exception as e:  # a megatron-core this probe does not know: make the world at the commit
                log.warning("generation %d: megatron's process groups could not be probed (%s: %s); the new "
                            "world is made at the commit", gen, type(e).__name__, e)
        store = self.clients.store
        self.clients.kept.write(store, gen, Keys.connecting(gen, self.id), AHEAD if requests is not None else AT_COMMIT)
        answers = []
        for m in plan.members:
            answer = self._wait_heartbeating(Keys.connecting(gen, m), timeout=120.0, gen=gen)
            if answer is None:
                decided = store.get(Keys.decision(gen))
                raise RuntimeError(f"member {m} did not connect generation {gen}" + (f" ({decided})" if decided else ""))
            answers.append(answer)
        if requests is None or any(a != AHEAD for a in answers):
            return None
        self.at_phase("connect", gen)
        world = self._connect(gen, lambda stop: worlds.build_world_ahead(
            connecting.store, f"{Keys.world_prefix(gen)}ahead/", rank, cfg.world_size, requests,
            self.options.collective_timeout, stop))
        log.info("generation %d: %d communicators of the new world connected ahead in %.3f s",
                 gen, len(world.groups) + 1, world.seconds)
        return world

    def _builds_world_ahead(self) -> bool:
        mode = self.options.build_world_ahead
        return mode in ("on", "auto")

    def _agree(self, gen: int, members: tuple[str, ...], checksum: str) -> None:
        """Publish our plan's inputs digest and check every member's against it."""
        self.clients.kept.write(self.clients.store, gen, Keys.prepared(gen, self.id), checksum)
        for m in members:
            other = self._wait_heartbeating(Keys.prepared(gen, m), timeout=120.0, gen=gen)
            if other is None:
                decided = self.clients.store.get(Keys.decision(gen))
                raise RuntimeError(f"member {m} did not prepare generation {gen}"
                                   + (f" ({decided})" if decided else ""))
            if other != checksum:
                raise RuntimeError(f"transition plan inputs digest of {m} differs from ours")

    def _wait_heartbeating(self, key: str, timeout: float, gen: int) -> str | None:
        """Wait for a store key from the control thread, heartbeating meanwhile (a member
        waiting for a slow peer must not look dead to the coordinator); None at once when
        generation ``gen`` is decided meanwhile (the coordinator aborted it: a member died)."""
        # each look is itself a 0.25 s wait for the key; between looks it heartbeats, not sleeps
        return wait_until(lambda: self.clients.store.wait_for(key, timeout=0.25), timeout=timeout,
                          abort=lambda: "decided" if self.clients.store.has(Keys.decision(gen)) else None,
                          poll=Backoff.fixed(0.0), sleep=lambda _: self.heartbeat(time.time())).value

    def _preallocate(self, plan: WorldPlan, old: WorldPlan, transition: Any) -> tuple[Any, Any]:
        """Pay the first touch of the new memory now, not during the pause: the new tensors, and
        a gradient buffer when the old one (reused) is too small. (None, None) when this member
        does not pre-allocate."""
        joiner = self.id in plan.members and self.id not in old.members
        if not (joiner or (self.id in plan.members and self._preallocates_as_member())):
            return None, None
        from liveshard.runtime.transfer.executor import allocate_destinations

        device_id = transition_devices(old, plan).index(self.id)
        destinations = allocate_destinations(transition, device_id, self.device)
        grad_buffer = None
        params = param_count(transition.new_layout, transition.device_to_rank[device_id])
        held = 0 if joiner else param_count(transition.old_layout, device_id)
        if params > held:
            # DDP pads its buckets: a little more than the parameters (fp32 gradients)
            grad_buffer = torch.zeros(params + params // 64 + (1 << 16), dtype=torch.float32, device=self.device)
        return destinations, grad_buffer

    def _preallocates_as_member(self) -> bool:
        mode = self.options.preallocate
        return mode == "all" or (mode == "auto" and self.device.type == "cpu")


def param_count(layout: Any, rank: int) -> int:
    """Model parameters (elements) a rank holds in a layout."""
    return sum(p.numel for p in layout.local_params(rank))
