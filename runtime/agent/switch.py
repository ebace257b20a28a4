"""Where the world is switched: transfer, commit vote, commit or abort; or through a checkpoint.

A worker moves to a prepared plan (``prepare.Prepared``) in one of two places: at a step
boundary, when the old world has agreed to switch (``training.StepBoundary`` calls ``switch``),
or while it is not training (``wait_for_plan``: at the start, as a joiner or standby, or with a
broken world), where it starts the first world, or follows the old world's switch step.

``switch`` for a live transition:

1. **transfer**: every member moves its part of the state over the transition group
   (``transition.execute_transition``) into new tensors; the old model is never written;
2. **commit vote**: one MIN all-reduce over the transition group; a no leaves the old world
   training on its untouched state (the coordinator aborts the generation);
3. **build**: the old world's process groups go (the new world needs the default group) but
   its model and optimizer stay in this process; the new members meet on the store, build the
   new training world and load the received state, progress and RNG;
4. **commit point** (``Keys.decision``): the last new member to be ready writes "committed";
   a member that failed, a waiter out of time or the coordinator (on a death) writes
   "aborted" instead, whichever comes first (compare-and-set in the store: every process reads
   the same answer). Committed: the old state is freed, a leaver exits, a standby waits.
   Aborted: what was built goes and every survivor holds the old world's state again, as a
   broken world: the coordinator's recovery moves it from there. No process ever frees state
   the job may still need.

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
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from liveshard.runtime.agent import release
from liveshard.runtime.agent import world as worlds
from liveshard.runtime.agent.commit_point import CommitPoint, Failed, WriteReady
from liveshard.runtime.agent.state import capture_rng, load_state, restore_rng, state_tensors
from liveshard.runtime.agent.training import is_comm_failure
from liveshard.runtime.agent.transition import TransitionResult, execute_transition
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.parallel import ParallelConfig

if TYPE_CHECKING:
    from liveshard.runtime.agent.prepare import Prepared
    from liveshard.runtime.agent.worker import WorkerAgent
    from liveshard.runtime.control.store import JobStore

log = logging.getLogger("liveshard.worker")


# ---- not training: wait for a plan -----------------------------------------------------------
def wait_for_plan(agent: WorkerAgent) -> bool:
    """Not training (start, joiner, standby, broken world): wait for a plan to act on. False
    when the worker is to stop."""
    if agent.state.phase != "broken":
        agent.state.phase = "waiting"
    while not agent.stopping():
        if agent.control.excluded is not None:
            return True  # the run loop makes this worker a new member (WorkerAgent.rejoin)
        prep = agent.preparations.newest_after(agent.state.generation)
        if prep is None:
            time.sleep(0.02)
        elif _take(agent, prep):
            return True
    return False


def _take(agent: WorkerAgent, prep: Prepared) -> bool:
    """Act on ``prep``; False while its switch step is not known yet (look again)."""
    if prep.old is None:
        if agent.id in prep.plan.members:
            # a first world continues the job's newest checkpoint when the coordinator found one
            start_world(agent, prep.plan, load_dir=prep.plan.restore_from)
        else:
            agent.adopt(prep.plan, None)  # a standby from the start
        return True
    if not prep.plan.is_live_transition:
        through_checkpoint(agent, prep, agent.trainer.step_count if agent.trainer else -1)
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

    The members meet on the store first (``_arrive``: a member lost before it arrives is waited
    for only until the coordinator decides the generation). A member lost after that leaves the
    others in the world's rendezvous or its first collectives until they fail: like a failed
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
    try:
        _arrive(agent, plan, decided=Keys.outcome(plan.generation))
        agent.at_phase("start", plan.generation)
        worlds.init_training_world(agent.store.store, Keys.world_prefix(plan.generation), rank,
                                   cfg.world_size, agent.options.collective_timeout)
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
            log.info("loaded %s from %s in %.2f s", f"initial weights ({weights.format})" if weights else "a checkpoint",
                     load_dir or weights.path, phases["load"])
    except Exception as e:
        if not (isinstance(e, NotArrived) or is_comm_failure(e)):
            raise
        _not_started(agent, plan, f"start: {type(e).__name__}: {' '.join(str(e).split())[:300]}", phases)
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
    """Switch to ``prep.plan`` after step ``switch_step``: transfer, vote, commit or abort."""
    plan, old = prep.plan, prep.old
    assert old is not None
    # the old world settles its background save first
    agent.checkpoints.settle(broken=agent.state.phase == "broken")
    if not plan.is_live_transition:
        through_checkpoint(agent, prep, switch_step)
        return
    phases: dict[str, float] = {"prepare": prep.seconds}
    connected_before = Counter(worlds.CONNECTED)
    t_stop = time.perf_counter()
    agent.at_phase("transfer", plan.generation)
    ok, error, result = _transfer(agent, prep)
    phases["transfer"] = time.perf_counter() - t_stop
    try:
        ok = worlds.group_all_ok(prep.transfer_group(), ok)
    except Exception as e:
        ok, error = False, error or f"commit vote: {e}"
    if not ok:
        phases["downtime"] = time.perf_counter() - t_stop
        agent.preparations.abort(plan.generation, error or "aborted")  # first: see _commit
        with contextlib.suppress(Exception):
            agent.report(plan.generation, MemberResult(ok=False, error=error or "another member failed",
                                                       phases=phases, step=switch_step))
        return  # the old world (if any) keeps training on its untouched state
    _commit(agent, prep, switch_step, result, phases, t_stop, connected_before)


def _transfer(agent: WorkerAgent, prep: Prepared) -> tuple[bool, str, TransitionResult | None]:
    """This member's part of the transfer: (ok, error, what it received). Its old tensors
    (``sources``) live on after it returns only where the new state aliases them."""
    holds_state = agent.trainer is not None and agent.id in prep.old.members
    sources = state_tensors(agent.built) if holds_state else {}
    objects = _progress_objects(agent.trainer) if holds_state else None
    try:
        result = execute_transition(prep, agent.id, sources, objects, budget=agent.options.transfer_budget,
                                    verify=agent.options.verify)
    except Exception as e:
        log.error("transfer for generation %d failed: %s", prep.plan.generation, traceback.format_exc())
        return False, f"transfer: {type(e).__name__}: {e}", None
    return True, "", result


def _commit(agent: WorkerAgent, prep: Prepared, switch_step: int, result: TransitionResult,
            phases: dict[str, float], t_stop: float, connected_before: Counter[str]) -> None:
    """After a yes vote: build the new world beside the old state, then pass the commit point.
    ``connected_before``: ``world.CONNECTED`` when the pause began (what it connected is recorded)."""
    plan = prep.plan
    gen = plan.generation
    t_commit = time.perf_counter()
    spare: list[torch.Tensor] = [prep.grad_buffer] if prep.grad_buffer is not None else []
    if agent.trainer is not None:
        from liveshard.runtime.megatron.build import gradient_buffers

        spare += gradient_buffers(agent.built)  # the new model's gradients reuse this memory
    t_retire = time.perf_counter()
    old = agent.retire(defer_free=True)  # the old world's state, kept until the decision
    phases["retire"] = time.perf_counter() - t_retire
    agent.state.phase = "committing"
    agent.at_phase("commit", gen)
    error = ""
    if agent.id in plan.members:
        try:
            _build_new_world(agent, prep, result, spare, phases)
        except Exception as e:
            error = f"commit: {type(e).__name__}: {e}"
            log.error("building the world of generation %d failed: %s", gen, traceback.format_exc())
        spare = []
        if not error:
            agent.at_phase("built", gen)
    t_decide = time.perf_counter()
    decision = _decide(agent, plan, error, prep.epoch)
    phases["decide"] = time.perf_counter() - t_decide
    if decision == COMMITTED and error:
        # cannot happen unless the store was tampered with: never train on a world not built
        raise CommitPointLost(f"generation {gen} committed although this member failed: {error}")
    if decision != COMMITTED:
        agent.reinstate(old)
        phases["downtime"] = time.perf_counter() - t_stop
        log.warning("generation %d did not commit (%s): %s", gen, decision,
                    "holding the old world's state for the recovery" if old else "waiting")
        # dropped first: a report to a store that died with its coordinator may raise, and what
        # was prepared for an aborted generation must never be switched to again
        agent.preparations.abort(gen, decision)
        with contextlib.suppress(Exception):  # a restarted coordinator resolves without it
            agent.report(gen, MemberResult(ok=False, error=error or decision, phases=phases, step=switch_step))
        return
    # The new world is the job's now: the old state goes. On CPU, returning gigabytes of pages
    # to the OS is slow, so that happens while the next step computes; an accelerator's caching
    # allocator frees at once, and the next step may need that memory.
    release.later(old, device_memory=True)
    del old
    agent.at_phase("committed", gen)
    stats = result.stats
    if agent.id not in plan.members:
        phases["commit"] = time.perf_counter() - t_commit
        agent.report(gen, MemberResult(ok=True, phases=phases, step=switch_step, bytes_sent=stats.bytes_sent))
        agent.adopt(plan, None)
        if agent.id not in plan.standbys:
            agent.state.phase = "left"
        return
    agent.adopt(plan, plan.members.index(agent.id))
    phases["commit"] = time.perf_counter() - t_commit
    phases["downtime"] = time.perf_counter() - t_stop
    agent.reporter.reconfiguration(switch_step, gen, phases["downtime"],
                                   prep.old.config if prep.old else "", plan.config)
    agent.report(gen, MemberResult(ok=True, phases=phases, step=switch_step,
                                   bytes_received=stats.bytes_received, bytes_sent=stats.bytes_sent))
    agent.state.events.append({"kind": "switch", "generation": gen, "step": switch_step,
                               "phases": phases, "time": time.time(),
                               "connected": {"prepare": prep.connected,
                                             "pause": worlds.connected_since(connected_before)}})


def _build_new_world(agent: WorkerAgent, prep: Prepared, result: TransitionResult,
                     spare: list[torch.Tensor], phases: dict[str, float]) -> None:
    """A new member: make the training world (from the communicators built ahead, when there
    are), build the model, load what was received."""
    from liveshard.runtime.megatron.build import init_parallel

    plan, ahead = prep.plan, prep.world
    cfg = ParallelConfig.parse(plan.config)
    rank = plan.members.index(agent.id)
    t0 = time.perf_counter()
    # Arrival tells the coordinator that the sources have delivered (a leaver's death no longer
    # matters). With the communicators built ahead the world is made without waiting for the
    # other members; otherwise its rendezvous would, so they are awaited here first.
    _arrive(agent, plan, wait=ahead is None, epoch=prep.epoch)
    t1 = time.perf_counter()
    worlds.init_training_world(agent.store.store, Keys.world_prefix(plan.generation), rank,
                               cfg.world_size, agent.options.collective_timeout, ahead=ahead)
    init_parallel(cfg, ahead, timeout=agent.options.collective_timeout)
    t2 = time.perf_counter()
    agent.build(cfg, initialize=False, spare_buffers=spare, groups_ready=True)
    spare.clear()
    t3 = time.perf_counter()
    objs = result.objects
    load_state(agent.built, result.tensors, step=int(objs["step"]))
    result.tensors.clear()  # the model holds them now (adopted, or copied: then freed here)
    agent.trainer.restore_progress({"step": objs["step"], "consumed_samples": objs["data_cursor"],
                                    "scheduler": objs["scheduler"], **objs["loss_scaler"]})
    restore_rng(objs["rng"])
    t4 = time.perf_counter()
    phases.update(meet=t1 - t0, world=t2 - t1, model=t3 - t2, load=t4 - t3)
    handed = f", {ahead.handed} communicators built ahead, {len(ahead.missed)} made now" if ahead else ""
    log.info("commit %d: meet %.3fs, world %.3fs, model %.3fs, load %.3fs%s", plan.generation,
             t1 - t0, t2 - t1, t3 - t2, t4 - t3, handed)


class CommitPointLost(Exception):
    """Nobody resolved this process's generation within the bound after the store holding its
    commit point was lost (``commit_point.Failed``): it must not train on either world, so it
    ends with this error. Not a RuntimeError, so no handler takes it for a broken collective."""


# Seconds a process that cannot read its generation's decision waits for a restarted coordinator
# to resolve it (a coordinator pod comes back within a minute or two), at least.
RESOLUTION_BOUND = 600.0


def _poll_delay(attempt: int) -> float:
    """5 ms at first, backing off to 100 ms: hundreds of ranks poll the one store."""
    return min(0.1, 0.005 * 1.5 ** min(attempt, 20))


class NotArrived(RuntimeError):
    """Not every member of a new world came to build it (``_arrive``)."""


def _arrive(agent: WorkerAgent, plan: WorldPlan, wait: bool = True, epoch: int | None = None,
            decided: str | None = None) -> None:
    """Count this member in (``Keys.arrived``: the coordinator reads it as the transfer having
    delivered) and, with ``wait``, wait until every new member is here to build the world, or
    the generation is decided against (a member died: the coordinator wrote ``decided``, by
    default the decision of a live transition; a first world's is its outcome), rather than in
    the world's rendezvous, which only gives up after the collective timeout. A store other
    than the one of the plan (``epoch``: the coordinator restarted) fails it."""
    gen = plan.generation
    if epoch is not None and agent.clients.epoch != epoch:
        raise NotArrived(f"the coordinator restarted during the switch to generation {gen}")
    store = agent.store
    store.set(Keys.arrived(gen, agent.id), "1")  # sealed, one key per member: nobody else can count it in
    store.store.add(Keys.arrivals(gen), 1)
    if not wait:
        return
    end = time.monotonic() + agent.options.commit_timeout
    attempt = 0
    while store.store.add(Keys.arrivals(gen), 0) < len(plan.members):
        decision = store.get(decided or Keys.decision(gen))
        if decision is not None:
            raise NotArrived(f"generation {gen} was decided while members were arriving: {decision}")
        if time.monotonic() > end:
            raise NotArrived(f"not every member arrived in {agent.options.commit_timeout:.0f} s")
        time.sleep(_poll_delay(attempt))
        attempt += 1


def _decide(agent: WorkerAgent, plan: WorldPlan, error: str, epoch: int) -> str:
    """This process's vote at the commit point, then the generation's decision: the first value
    written to ``Keys.decision`` in the store the plan came from (clients' ``epoch``), the same
    for every process that reads it. ``commit_point.CommitPoint`` says what to write and what to
    conclude; this function does the store's part.

    A new member's ready vote is a confirmed write (set, then read back: a ``set`` to a store
    whose server died can return without error). If the coordinator dies meanwhile, a process
    that voted ready, or may have, waits: the control thread connects to the restarted
    coordinator and reports this commit point (``ControlThread._in_flight``), and the decision
    is then read from the new store, where the new coordinator writes its resolution. Only when
    nobody resolves it within ``RESOLUTION_BOUND`` does it raise ``CommitPointLost``."""
    gen, key = plan.generation, Keys.decision(plan.generation)
    # New members may take up to commit_timeout to arrive, then build: a leaver or standby
    # gives them that and more before it decides against them.
    timeout = agent.options.commit_timeout * (1 if agent.id in plan.members else 3)
    cp = CommitPoint(plan, agent.id, error=error, now=time.monotonic(), timeout=timeout,
                     bound=max(RESOLUTION_BOUND, 3 * agent.options.commit_timeout))
    agent.state.commit_point = cp

    def in_old_store(op: Callable[[JobStore], None]) -> None:
        """``op`` on the plan's store, under the commit point's lock (the control thread reads
        the commit point under it when it re-announces); the store lost if it is gone."""
        with cp.lock:
            if agent.clients.epoch != epoch:
                cp.store_lost(time.monotonic())
                cp.reconnected()
                return
            try:
                op(agent.store)
            except Exception as e:  # the store is going away with its coordinator
                if not cp.lost:
                    log.warning("generation %d: the commit point's store does not answer: %s", gen, e)
                cp.store_lost(time.monotonic())

    def cas(value: str) -> Callable[[JobStore], None]:
        return lambda store: cp.decision_read(store.decide(key, value) or "aborted: the decision is not authentic")

    def vote_ready(store: JobStore) -> None:
        confirmed = False
        try:
            store.set(Keys.ready(gen, agent.id), "1")
            confirmed = store.get(Keys.ready(gen, agent.id)) == "1"
        finally:
            cp.voted(ok=True, write_confirmed=confirmed)

    def commit_if_all_ready(store: JobStore) -> None:
        # Authenticated ready keys, one per member: whoever sets the last one sees all of them
        # (each sets its own, then looks) and writes the commit.
        keys = [Keys.ready(gen, m) for m in plan.members]
        if cp.ready and store.store.check(keys) and all(store.get(k) == "1" for k in keys):
            cp.decision_read(store.decide(key, COMMITTED))

    for action in cp.start():
        if isinstance(action, WriteReady):
            in_old_store(vote_ready)
            if not cp.vote_written:
                cp.voted(ok=True, write_confirmed=False)  # the store was gone before the vote
            agent.at_phase("commit-window", gen)
            in_old_store(commit_if_all_ready)
        else:  # this member failed: it aborts, and says so
            in_old_store(cas(action.value))
            cp.voted(ok=False, write_confirmed=cp.decided)
            if agent.clients.epoch != epoch:
                # and to the restarted coordinator's store, where a leaver waiting for the
                # resolution reads it: no commit can contradict it (the commit needed this
                # member's ready vote), and a new coordinator never reuses this generation
                with contextlib.suppress(Exception):
                    agent.store.decide(key, action.value)
    attempt = 0
    announced = False
    while not cp.decided:
        for action in cp.tick(time.monotonic()):  # the timeout's abort, in a store that answers
            in_old_store(cas(action.value))
        if cp.decided:
            break
        if cp.polls_resolution:
            if not announced:
                announced = True
                log.warning("generation %d: the coordinator restarted inside the commit window; waiting for "
                            "the new one to resolve it (ready vote %s)", gen, "cast" if cp.ready else "not cast")
            try:  # the new coordinator's resolution, in its store (the current one)
                store = agent.store
                cp.resolution_read(store.get(key) or store.get(Keys.outcome(gen)))
            except Exception:  # that coordinator is restarting too: the control thread reconnects
                pass
        else:
            in_old_store(lambda store: cp.decision_read(store.get(key)))
        # a store that stopped answering is tried now and then until the control thread has
        # connected to the restarted coordinator (each failed try is logged by c10d)
        time.sleep(0.25 if cp.lost and not cp.polls_resolution else _poll_delay(attempt))
        attempt += 1
    verdict = cp.verdict()
    if isinstance(verdict, Failed):
        log.error("%s", verdict.reason)
        with contextlib.suppress(Exception):  # best effort: the coordinator hears of it
            agent.report(gen, MemberResult(ok=False, error=verdict.reason))
        raise CommitPointLost(verdict.reason)
    return verdict


def _progress_objects(trainer: Any) -> dict:
    """The small objects that travel with the tensors: progress, LR schedule, RNG."""
    p = trainer.progress()
    return {"step": p["step"], "data_cursor": p["consumed_samples"], "scheduler": p["scheduler"],
            "loss_scaler": {"skipped_steps": p["skipped_steps"], "grad_scalers": p["grad_scalers"]},
            "rng": capture_rng()}


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
