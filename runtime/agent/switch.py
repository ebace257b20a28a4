"""Where the world is switched: transfer, commit vote, commit or abort; or through a checkpoint.

A worker moves to a prepared plan (``prepare.Prepared``) in one of two places: at a step
boundary, when the old world has agreed to switch (``training.StepBoundary`` calls ``switch``),
or while it is not training (``wait_for_plan``: at the start, as a joiner or standby, or with a
broken world), where it starts the first world, or follows the old world's switch step.

What the switch does is the plan's ``world_change`` strategy's to say (``Prepared.change``):
``switch`` and ``_take`` call it. A live one runs the phases of a ``live_switch.Transition``:

1. ``transfer``: every member moves its part of the state over the transition group
   (``transition.execute_transition``) into new tensors; the old model is never written;
2. ``vote``: one MIN all-reduce over the transition group; a no (``abort``) leaves the old
   world training on its untouched state (the coordinator aborts the generation);
3. ``build``: the old world's process groups go (the new world needs the default group) but
   its model and optimizer stay in this process; the new members meet on the store, build the
   new training world and load the received state, progress and RNG;
4. ``decide``, the commit point (``Keys.decision``): the last new member to be ready writes
   "committed"; a member that failed, a waiter out of time or the coordinator (on a death)
   writes "aborted" instead, whichever comes first (compare-and-set in the store: every
   process reads the same answer);
5. ``commit``: the old state is freed, a leaver exits, a standby waits; or ``abort``: what was
   built goes and every survivor holds the old world's state again, as a broken world: the
   coordinator's recovery moves it from there. No process ever frees state the job may still
   need.

Every wait on the store here (for a plan, the switch step, the members' arrival, the decision)
is ``control.barrier.wait_until``.

A plan with no live state (``through_checkpoint``): a stop saves a checkpoint (all must succeed,
or the stop is refused) and leaves every worker waiting; a restore builds the new world from
the checkpoint it names. A world built from scratch (a first world, a restore: ``start_world``)
whose member is lost while it starts fails like a transition: reported, torn down, and the
coordinator plans it again without that member.

These functions work on the ``WorkerAgent``: its current world (``trainer``, ``built``,
``state``) and its lifecycle methods (``build``, ``adopt``, ``teardown``, ``report``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from liveshard.runtime.agent.live_switch import (  # noqa: F401  (CommitPointLost, RESOLUTION_BOUND: imported from here)
    RESOLUTION_BOUND,
    CommitPointLost,
    NotArrived,
    Transition,
    arrive,
    decide,
)
from liveshard.runtime.agent.training import is_comm_failure
from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.barrier import Backoff, wait_until
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.parallel import ParallelConfig

if TYPE_CHECKING:
    from liveshard.runtime.agent.prepare import Prepared
    from liveshard.runtime.agent.worker import WorkerAgent

log = logging.getLogger("liveshard.worker")

_arrive, _decide = arrive, decide  # their former names here

# How often a worker that is not training looks for a prepared plan.
PLAN_POLL = Backoff.fixed(0.02)


# ---- not training: wait for a plan -----------------------------------------------------------
def wait_for_plan(agent: WorkerAgent) -> bool:
    """Not training (start, joiner, standby, broken world): wait for a plan to act on. False
    when the worker is to stop."""
    if agent.state.phase != "broken":
        agent.state.phase = "waiting"

    def next_thing() -> Prepared | str | None:
        if agent.stopping():
            return "stop"
        if agent.control.excluded is not None:
            return "excluded"
        return agent.preparations.newest_after(agent.state.generation)

    while True:
        found = wait_until(next_thing, poll=PLAN_POLL).value
        if found == "stop":
            return False
        if found == "excluded":
            return True  # the run loop makes this worker a new member (WorkerAgent.rejoin)
        if _take(agent, found):
            return True


def _take(agent: WorkerAgent, prep: Prepared) -> bool:
    """Act on ``prep``; False while its switch step is not known yet (look again)."""
    change = prep.change
    if not change.live:  # a first world (or a standby), or a change through a checkpoint
        change.switch(agent, prep, agent.trainer.step_count if agent.trainer else -1)
        return True
    if agent.state.phase == "broken":
        # The old world cannot agree on a step: the transition group, which every
        # member has joined by now, is the synchronisation. The first old rank marks it.
        if agent.state.rank is not None and agent.id == prep.members[0]:
            agent.store.set(Keys.switch(prep.plan.generation), str(agent.trainer.step_count))
        switch(agent, prep, switch_step=agent.trainer.step_count)
        return True
    try:
        step = agent.store.wait_for(Keys.switch(prep.plan.generation), timeout=0.2)
    except Exception:  # the coordinator is restarting
        time.sleep(0.2)
        return False
    if step is None:
        return False
    switch(agent, prep, switch_step=int(step))
    return True


def start_world(agent: WorkerAgent, plan: WorldPlan, load_dir: str | None = None,
                phases: dict[str, float] | None = None) -> bool:
    """Build the world of ``plan`` from scratch: initialised, or loaded from a checkpoint.

    The members meet on the store first (``arrive``: a member lost before it arrives is waited
    for only until the coordinator decides the generation). A member lost after that leaves the
    others in the world's rendezvous or its first collectives until they fail, or until the
    coordinator decides the generation against it: the control thread then aborts the creation
    (``comms.world.Start``), instead of each group's rendezvous timing out in turn. Like a failed
    transition, the start is then reported failed and torn down, and this worker waits for the
    coordinator's next plan (a first world made again without the lost member). False then."""
    cfg = ParallelConfig.parse(plan.config)
    rank = plan.members.index(agent.id)
    # the job's own newest checkpoint, else --load, else spec.training.resume; initialWeights
    # only when none of them is given
    load_dir = load_dir or agent.options.load_dir or agent.training.resume
    weights = agent.training.initial_weights if load_dir is None else None
    phases = dict(phases or {})
    t0 = time.perf_counter()
    start: worlds.Start | None = None
    try:
        arrive(agent, plan, decided=Keys.outcome(plan.generation))
        agent.at_phase("start", plan.generation)
        # a member lost from here on: the control thread aborts the creation once the coordinator
        # decides the generation (``ControlThread._poll``), not each group's timeout in turn
        start = worlds.Start(plan.generation, lambda: agent.clients.dedicated(), agent.clients.port)
        with start:
            worlds.World.scratch(start.client.store, Keys.world_prefix(plan.generation), rank, cfg.world_size,
                                 agent.options.collective_timeout)
            agent.build(cfg, initialize=load_dir is None and weights is None)
            phases["build"] = time.perf_counter() - t0
            if load_dir or weights:
                from liveshard.runtime.agent import checkpoint

                t1 = time.perf_counter()
                if load_dir:
                    checkpoint.load(agent.built, agent.trainer, load_dir)
                else:
                    checkpoint.load_initial_weights(agent.built, weights)
                phases["load"] = time.perf_counter() - t1
                log.info("loaded %s from %s in %.2f s",
                         f"initial weights ({weights.format})" if weights else "a checkpoint",
                         load_dir or weights.path, phases["load"])
    except Exception as e:
        aborted = start is not None and start.aborted is not None
        if not (aborted or isinstance(e, NotArrived) or is_comm_failure(e)):
            raise
        why = f" (aborted: {start.aborted})" if start is not None and start.aborted else ""
        _not_started(agent, plan, f"start: {type(e).__name__}: {' '.join(str(e).split())[:300]}{why}", phases)
        return False
    if start is not None and start.aborted is not None:  # aborted as it ended: its connections are shut down
        _not_started(agent, plan, f"start: aborted: {start.aborted}", phases)
        return False
    agent.adopt(plan, rank)
    agent.report(plan.generation, MemberResult(ok=True, phases=phases, step=agent.trainer.step_count))
    return True


def _not_started(agent: WorkerAgent, plan: WorldPlan, error: str, phases: dict[str, float]) -> None:
    """The world of ``plan`` could not be made (a member lost while it started): drop what was
    built of it, never take that plan again, and tell the coordinator; then wait for a plan."""
    log.error("the world of generation %d did not start: %s", plan.generation, error)
    agent.preparations.abort(plan.generation, error)
    try:
        agent.teardown()
    finally:
        agent.state.phase = "waiting"
    agent.state.events.append({"kind": "start-failed", "generation": plan.generation, "error": error,
                               "time": time.time()})
    with contextlib.suppress(Exception):  # the coordinator decides without it (the member's death)
        agent.report(plan.generation, MemberResult(ok=False, error=error, phases=phases))


# ---- a live transition -----------------------------------------------------------------------
def switch(agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
    """Switch to ``prep.plan`` after step ``switch_step``, as its ``world_change`` strategy does
    it: the phases of a ``Transition`` in order (transfer, vote, build, decide, then commit or
    abort), or ``through_checkpoint``."""
    assert prep.old is not None
    # the old world settles its background save first
    agent.checkpoints.settle(broken=agent.state.phase == "broken")
    prep.change.switch(agent, prep, switch_step)


# ---- through a checkpoint --------------------------------------------------------------------
def through_checkpoint(agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
    """Switch to a plan that carries no live state: a stop saves a checkpoint and leaves
    every worker waiting; a restore builds the new world from the checkpoint it names."""
    plan = prep.plan
    phases: dict[str, float] = {"prepare": prep.seconds}
    t0 = time.perf_counter()
    if plan.is_stop and agent.trainer is not None and agent.state.phase != "broken":
        if not _save_for_stop(agent, plan, switch_step):
            return  # training goes on; the coordinator aborts the stop
        phases["save"] = time.perf_counter() - t0
    agent.teardown()
    if plan.restore_from is not None and agent.id in plan.members:
        if start_world(agent, plan, load_dir=plan.restore_from, phases=phases):
            agent.state.events.append({"kind": "restore", "generation": plan.generation,
                                       "from": plan.restore_from, "phases": phases, "time": time.time()})
        return
    agent.report(plan.generation, MemberResult(ok=True, phases=phases, step=switch_step))
    agent.adopt(plan, None)
    if agent.id not in plan.members and agent.id not in plan.standbys:
        agent.state.phase = "left"


def _save_for_stop(agent: WorkerAgent, plan: WorldPlan, switch_step: int) -> bool:
    """Every rank saves the checkpoint a stop leaves behind; False (reported, generation
    dropped) unless all of them succeeded."""
    ok, error = True, ""
    try:
        agent.checkpoints.save(agent.built, agent.trainer)
    except Exception as e:
        ok, error = False, f"checkpoint: {type(e).__name__}: {e}"
        log.error("saving before the stop failed: %s", traceback.format_exc())
    vote = torch.tensor([1 if ok else 0], dtype=torch.int64, device=worlds.device())
    try:
        dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        ok = ok and bool(int(vote))
    except Exception as e:
        ok, error = False, error or f"checkpoint vote: {e}"
    if not ok:
        agent.report(plan.generation, MemberResult(ok=False, error=error or "another member failed to save",
                                                   step=switch_step))
        agent.preparations.abort(plan.generation, error or "aborted")
    return ok
