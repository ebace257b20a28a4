"""A live transition on the worker: ``Transition``, one object per switch, one method per phase.

The change's ``world_change`` strategy (``LiveRebuild``, or ``Shrink`` for a leave with notice)
runs them in this order, and ``build`` asks it what of the old world goes and how the new one
is made:

1. ``transfer``: this member moves its part of the state over the transition group
   (``transition.execute_transition``) into new tensors; the old model is never written;
2. ``vote``: one MIN all-reduce over the transition group; a no goes to ``abort`` and leaves the
   old world training on its untouched state (the coordinator aborts the generation);
3. ``build``: the old world is retired (its groups go, or only megatron's when the survivors
   shrink the default group; its model and optimizer stay in this process); a new member counts
   itself in (``arrive``), makes the new world (``WorldChange.make_world``) and loads the
   received state, progress and RNG;
4. ``decide``: the commit point (``Keys.decision``, ``commit_point.CommitPoint``): every
   process reads the same decision from the store;
5. ``commit`` (the old state is freed; a leaver exits, a standby waits) or ``abort`` (what was
   built goes, the old world's state is held again as a broken world for the recovery).

``at_phase`` is called at "transfer", "commit", "built", "commit-window" and "committed" (tests
kill processes there). The waits on the store (``arrive``, the decision) are
``control.barrier.wait_until``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from liveshard.runtime.agent.commit_driver import CommitDriver
from liveshard.runtime.agent.commit_point import CommitPoint, Failed
from liveshard.runtime.agent.state import capture_rng, load_state, restore_rng, state_tensors
from liveshard.runtime.agent.transition import TransitionResult, execute_transition
from liveshard.runtime.comms import release
from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.barrier import STORE_BACKOFF, wait_until
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.parallel import ParallelConfig

if TYPE_CHECKING:
    from liveshard.runtime.agent.prepare import Prepared
    from liveshard.runtime.agent.worker import WorkerAgent

log = logging.getLogger("liveshard.worker")


class CommitPointLost(Exception):
    """Nobody resolved this process's generation within the bound after the store holding its
    commit point was lost (``commit_point.Failed``): it must not train on either world, so it
    ends with this error. Not a RuntimeError, so no handler takes it for a broken collective."""


class NotArrived(RuntimeError):
    """Not every member of a new world came to build it (``arrive``)."""


# Seconds a process that cannot read its generation's decision waits for a restarted coordinator
# to resolve it (a coordinator pod comes back within a minute or two), at least.
RESOLUTION_BOUND = 600.0


class Transition:
    """The switch of this worker to ``prep.plan`` after step ``switch_step``, phase by phase.
    It holds what the phases share: the timings (``phases``, from ``t_stop``, the start of the
    pause), what the transfer received (``result``), the retired old world (``old``) and this
    member's error, if any."""

    def __init__(self, agent: WorkerAgent, prep: Prepared, switch_step: int) -> None:
        assert prep.old is not None
        self.agent, self.prep, self.switch_step = agent, prep, switch_step
        self.plan = prep.plan
        self.gen = prep.plan.generation
        self.phases: dict[str, float] = {"prepare": prep.seconds}
        self.change = prep.change  # how the new world comes to exist (``world_change``)
        self.connected_before = Counter(worlds.CONNECTED)  # what the pause connects is recorded
        self.created_before = Counter(worlds.CREATED)  # and creates, by kind
        self.marks: dict[str, float] = {}
        self.fallback: str | None = None  # why the strategy's way failed and the world was rebuilt
        self.t_stop = time.perf_counter()
        self.t_commit = 0.0
        self.ok = False
        self.error = ""
        self.result: TransitionResult | None = None
        self.retired = False
        self.old: Any = None  # the old world's state, kept until the decision

    # ---- 1. transfer ---------------------------------------------------------------------------
    def transfer(self) -> bool:
        """This member's part of the transfer. Its old tensors (``sources``) live on after it
        returns only where the new state aliases them."""
        agent, prep = self.agent, self.prep
        agent.at_phase("transfer", self.gen)
        holds_state = agent.trainer is not None and agent.id in prep.old.members
        sources = state_tensors(agent.built) if holds_state else {}
        objects = _progress_objects(agent.trainer) if holds_state else None
        try:
            self.result = execute_transition(prep, agent.id, sources, objects, budget=agent.options.transfer_budget,
                                             verify=agent.options.verify)
            self.ok = True
        except Exception as e:
            log.error("transfer for generation %d failed: %s", self.gen, traceback.format_exc())
            self.ok, self.error = False, f"transfer: {type(e).__name__}: {e}"
        self.phases["transfer"] = time.perf_counter() - self.t_stop
        return self.ok

    # ---- 2. commit vote ------------------------------------------------------------------------
    def vote(self) -> bool:
        """Every member's yes (one MIN all-reduce over the transition group)."""
        try:
            self.ok = worlds.group_all_ok(self.prep.transfer_group(), self.ok)
        except Exception as e:
            self.ok, self.error = False, self.error or f"commit vote: {e}"
        return self.ok

    # ---- 3. build ------------------------------------------------------------------------------
    def build(self) -> None:
        """After a yes vote: retire the old world (its state stays until the decision) and, as a
        new member, build the new world beside it. A failure is this member's ``error``."""
        agent, prep = self.agent, self.prep
        self.t_commit = time.perf_counter()
        spare: list[torch.Tensor] = [prep.grad_buffer] if prep.grad_buffer is not None else []
        if agent.trainer is not None:
            from liveshard.runtime.megatron.build import gradient_buffers

            spare += gradient_buffers(agent.built)  # the new model's gradients reuse this memory
        t_retire = time.perf_counter()
        self.old, self.retired = self.change.retire(agent, self.plan, agent.id), True
        self.phases["retire"] = time.perf_counter() - t_retire
        agent.state.phase = "committing"
        agent.at_phase("commit", self.gen)
        self.error = ""
        if agent.id in self.plan.members:
            try:
                self._build_new_world(spare)
            except Exception as e:
                self.error = f"commit: {type(e).__name__}: {e}"
                log.error("building the world of generation %d failed: %s", self.gen, traceback.format_exc())
            spare = []
            if not self.error:
                agent.at_phase("built", self.gen)

    def mark(self, name: str) -> None:
        """A strategy's step inside ``build`` ends now (``meet``: the members counted in)."""
        self.marks[name] = time.perf_counter()

    def _build_new_world(self, spare: list[torch.Tensor]) -> None:
        """A new member: the strategy makes the training world and megatron's groups (from the
        communicators built ahead, from the running world shrunk, or from scratch); then the
        model is built and what was received loaded."""
        agent, plan, ahead, result = self.agent, self.plan, self.prep.world, self.result
        cfg = ParallelConfig.parse(plan.config)
        rank = plan.members.index(agent.id)
        t0 = time.perf_counter()
        self.change.make_world(self, cfg, rank)
        t2 = time.perf_counter()
        t1 = self.marks.get("meet", t0)
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
        self.phases.update(meet=t1 - t0, world=t2 - t1, model=t3 - t2, load=t4 - t3)
        handed = f", {ahead.handed} communicators built ahead, {len(ahead.missed)} made now" if ahead else ""
        log.info("commit %d: meet %.3fs, world %.3fs, model %.3fs, load %.3fs%s", plan.generation,
                 t1 - t0, t2 - t1, t3 - t2, t4 - t3, handed)

    # ---- 4. the commit point -------------------------------------------------------------------
    def decide(self) -> str:
        """This member's vote at the commit point, then the generation's decision (``decide``)."""
        t_decide = time.perf_counter()
        decision = decide(self.agent, self.plan, self.error, self.prep.epoch)
        self.phases["decide"] = time.perf_counter() - t_decide
        if decision == COMMITTED and self.error:
            # cannot happen unless the store was tampered with: never train on a world not built
            raise CommitPointLost(f"generation {self.gen} committed although this member failed: {self.error}")
        return decision

    # ---- 5. commit or abort --------------------------------------------------------------------
    def commit(self) -> None:
        """The new world is the job's now: the old state goes, the worker adopts its place in the
        plan (a rank, a standby, or none: it leaves) and reports."""
        agent, plan, gen, step = self.agent, self.plan, self.gen, self.switch_step
        # On CPU, returning gigabytes of pages to the OS is slow, so that happens while the next
        # step computes; an accelerator's caching allocator frees at once, and the next step may
        # need that memory.
        release.later(self.old, device_memory=True)
        self.old = None
        agent.at_phase("committed", gen)
        stats, phases = self.result.stats, self.phases
        if agent.id not in plan.members:
            phases["commit"] = time.perf_counter() - self.t_commit
            agent.report(gen, MemberResult(ok=True, phases=phases, step=step, bytes_sent=stats.bytes_sent))
            agent.adopt(plan, None)
            if agent.id not in plan.standbys:
                agent.state.phase = "left"
            return
        agent.adopt(plan, plan.members.index(agent.id))
        phases["commit"] = time.perf_counter() - self.t_commit
        phases["downtime"] = time.perf_counter() - self.t_stop
        agent.reporter.reconfiguration(step, gen, phases["downtime"],
                                       self.prep.old.config if self.prep.old else "", plan.config)
        agent.report(gen, MemberResult(ok=True, phases=phases, step=step,
                                       bytes_received=stats.bytes_received, bytes_sent=stats.bytes_sent))
        agent.state.events.append({"kind": "switch", "generation": gen, "step": step,
                                   "phases": phases, "time": time.time(),
                                   "change": self.change.name, "fallback": self.fallback,
                                   "connected": {"prepare": self.prep.connected,
                                                 "pause": worlds.connected_since(self.connected_before)},
                                   "created": {"prepare": self.prep.created,
                                               "pause": worlds.created_since(self.created_before)}})

    def abort(self, decision: str | None = None) -> None:
        """The generation failed: after a no vote (``decision`` None) nothing was retired and the
        old world (if any) keeps training on its untouched state; after ``build`` (``decision``:
        what the commit point decided) the retired state is held again, as a broken world."""
        agent, gen = self.agent, self.gen
        if self.retired:
            agent.reinstate(self.old)
        self.phases["downtime"] = time.perf_counter() - self.t_stop
        if decision is None:
            dropped, reported = self.error or "aborted", self.error or "another member failed"
        else:
            log.warning("generation %d did not commit (%s): %s", gen, decision,
                        "holding the old world's state for the recovery" if self.old else "waiting")
            dropped, reported = decision, self.error or decision
        # dropped first: a report to a store that died with its coordinator may raise, and what
        # was prepared for an aborted generation must never be switched to again
        agent.preparations.abort(gen, dropped)
        with contextlib.suppress(Exception):  # a restarted coordinator resolves without it
            agent.report(gen, MemberResult(ok=False, error=reported, phases=self.phases, step=self.switch_step))


def arrive(agent: WorkerAgent, plan: WorldPlan, wait: bool = True, epoch: int | None = None,
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
    # sealed, one key per member: nobody else can count it in; written again if deleted before it is read
    agent.clients.kept.write(store, gen, Keys.arrived(gen, agent.id), "1")
    store.store.add(Keys.arrivals(gen), 1)
    if not wait:
        return
    outcome = wait_until(lambda: store.store.add(Keys.arrivals(gen), 0) >= len(plan.members),
                         abort=lambda: store.get(decided or Keys.decision(gen)),
                         timeout=agent.options.commit_timeout, poll=STORE_BACKOFF)
    if outcome.aborted:
        raise NotArrived(f"generation {gen} was decided while members were arriving: {outcome.reason}")
    if outcome.timed_out:
        raise NotArrived(f"not every member arrived in {agent.options.commit_timeout:.0f} s")


def decide(agent: WorkerAgent, plan: WorldPlan, error: str, epoch: int) -> str:
    """This process's vote at the commit point, then the generation's decision: the first value
    written to ``Keys.decision`` in the store the plan came from (clients' ``epoch``), the same
    for every process that reads it. ``commit_point.CommitPoint`` says what to write and what to
    conclude; ``commit_driver.CommitDriver`` does the store's part.

    If the coordinator dies meanwhile, a process that voted ready, or may have, waits: the
    control thread connects to the restarted coordinator and reports this commit point
    (``ControlThread._in_flight``), and the decision is then read from the new store, where the
    new coordinator writes its resolution. Only when nobody resolves it within
    ``RESOLUTION_BOUND`` does it raise ``CommitPointLost``."""
    gen = plan.generation
    # New members may take up to commit_timeout to arrive, then build: a leaver or standby
    # gives them that and more before it decides against them.
    timeout = agent.options.commit_timeout * (1 if agent.id in plan.members else 3)
    cp = CommitPoint(plan, agent.id, error=error, now=time.monotonic(), timeout=timeout,
                     bound=max(RESOLUTION_BOUND, 3 * agent.options.commit_timeout))
    agent.state.commit_point = cp
    driver = CommitDriver(cp, agent.clients, epoch, on_voted=lambda: agent.at_phase("commit-window", gen),
                          incarnation=agent.state.incarnation)
    driver.open()
    # No timeout here: the commit point decides (its own timeout, then the resolution bound).
    wait_until(driver.poll, poll=driver.backoff)
    verdict = cp.verdict()
    if isinstance(verdict, Failed):
        log.error("%s", verdict.reason)
        with contextlib.suppress(Exception):  # best effort: the coordinator hears of it
            agent.report(gen, MemberResult(ok=False, error=verdict.reason))
        raise CommitPointLost(verdict.reason)
    assert verdict is not None
    return verdict


def _progress_objects(trainer: Any) -> dict:
    """The small objects that travel with the tensors: progress, LR schedule, RNG."""
    p = trainer.progress()
    return {"step": p["step"], "data_cursor": p["consumed_samples"], "scheduler": p["scheduler"],
            "loss_scaler": {"skipped_steps": p["skipped_steps"], "grad_scalers": p["grad_scalers"]},
            "rng": capture_rng()}
