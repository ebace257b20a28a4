"""The worker's training thread: one optimizer step at a time, and what happens between steps.

* ``warm_up``: the one-off costs (imports, megatron's set-up, the first backward and optimizer
  step) paid before the worker registers, so a joiner is admitted ready.
* ``train_one``: one step and its record; a collective that fails because a peer is gone marks
  the world broken (a step whose update was applied is recorded even if reporting its loss
  failed: the state a recovery moves is after it).
* ``StepBoundary``: after every step the old world agrees, with **one** tiny all-reduce (MAX of
  three integers), on the newest plan generation any rank has seen, the lowest generation every
  rank has prepared, and whether any rank's safety checkpoint is due. All ranks see the same
  result, so they decide alike: save a safety checkpoint now, and/or switch to the newest plan
  (after a MIN vote that everybody is ready). The switch itself is ``switch.py``.

The training thread never waits on the store for a plan: the control thread watches for plans
and prepares them (``control.py``, ``prepare.py``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from liveshard.runtime.agent.connection import StoreClients
from liveshard.runtime.comms import world as worlds
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan

if TYPE_CHECKING:
    from liveshard.runtime.agent.checkpoint_schedule import SafetyCheckpoints
    from liveshard.runtime.agent.control import ControlThread
    from liveshard.runtime.agent.prepare import Preparations, Prepared
    from liveshard.runtime.agent.worker import WorkerState

log = logging.getLogger("liveshard.worker")

# Called at every step boundary with the step just done, before the world agrees whether to
# switch (dev tooling holds a worker there: ``liveshard.dev.localrun.held_worker``). Returns
# True when it held the worker: the newest plan generation is then read again from the store.
StepGate = Callable[[int], bool]
TAMPERED_REREAD = 5.0  # seconds a held worker reads a tampered plan pointer again (``_refresh_latest``)

# Called when the worker reaches a phase of a reconfiguration (``protocol.PHASES``), with the
# phase and the plan's generation (dev tooling holds a worker there to kill it at that point).
PhaseGate = Callable[[str, int], None]


def warm_up(device: torch.device) -> float:
    """Pay the one-off costs (imports, megatron's CPU/GPU set-up) before joining the job, so a
    joiner is admitted ready and only the transfer and commit stop training. Returns seconds."""
    t0 = time.perf_counter()
    from liveshard.runtime.megatron import compat

    with compat.eager_fusions():
        import megatron.core.distributed
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.optimizer
        import megatron.core.optimizer_param_scheduler
        import megatron.core.pipeline_parallel  # noqa: F401

    compat.install()
    if torch.cuda.is_available():
        torch.cuda.init()
    # One-off set-up that would otherwise land in the first step after admission: the first
    # optimizer step imports torch._dynamo (about 1 s), the first backward starts autograd's
    # threads.
    p = torch.zeros(8, requires_grad=True, device=device)
    (p * 2.0).sum().backward()
    torch.optim.Adam([p]).step()
    # Millions of objects from the imports above would otherwise be traversed by every full
    # garbage collection, and one lands in each model build (0.2 s for a 124M model on CPU):
    # they live for the whole process, so take them out of the collector's view once.
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


def is_comm_failure(e: BaseException) -> bool:
    """A collective failed because a peer is gone (gloo/NCCL errors, timeouts), not a bug."""
    if isinstance(e, (dist.DistError, TimeoutError, ConnectionError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset", "Timed out", "timed out", "NCCL", "gloo",
        "Broken pipe", "ProcessGroup", "Socket"))


def train_one(state: WorkerState, trainer: Any, world_size: int, after_step: Callable[[], None]) -> None:
    """One optimizer step of ``trainer`` (a ``Trainer``), recorded in ``state``, then
    ``after_step`` (the step boundary). A peer lost meanwhile marks the world broken."""
    t = trainer
    before = t.step_count
    try:
        loss = t.step()
        state.record_step(t, world_size, loss)
        after_step()
    except Exception as e:  # a collective failed: a peer is gone
        if not is_comm_failure(e):
            raise
        if t.step_count > before and (not state.records or state.records[-1].step < t.step_count):
            # the update was applied and only reporting the loss failed: the step is done
            state.record_step(t, world_size, None)
        broke(state, t.step_count, e)


def broke(state: WorkerState, step: int, error: BaseException, where: str = "") -> None:
    """A collective of the world failed (``is_comm_failure``): this worker holds its state as a
    broken world and waits for the coordinator's recovery (the run loop, ``switch.wait_for_plan``)."""
    log.error("world of generation %s broke at step %d%s: %s", state.generation, step, f" {where}" if where else "",
              error)
    state.phase = "broken"
    state.events.append({"kind": "broken", "step": step, "error": str(error)[:200], "time": time.time(),
                         **({"where": where} if where else {})})


class StepBoundary:
    """What the old world does between two steps: agree, maybe save, maybe switch."""

    def __init__(self, clients: StoreClients, state: WorkerState, control: ControlThread,
                 preparations: Preparations, checkpoints: SafetyCheckpoints,
                 switch: Callable[[Prepared, int], None], step_gate: StepGate | None = None) -> None:
        self.clients = clients
        self.state = state
        self.control = control
        self.preparations = preparations
        self.checkpoints = checkpoints
        self.switch = switch
        self.step_gate = step_gate
        self._plans = control.plans_read  # shared with the control thread: a plan either one read

    def __call__(self, trainer: Any, built: Any) -> None:
        """Agree over the old world whether to switch to the newest plan now.

        One all-reduce of three integers: the newest generation any rank has seen, the lowest
        generation every rank has prepared, and whether a safety checkpoint is due. All ranks see
        the same result, so they decide alike. While a newer generation is announced, a second
        one (``_everyone_holds``) agrees that every rank holds its plan: a rank that could not
        read it (deleted from the store before it read it) holds every rank back instead of
        skipping the vote the others cast.
        """
        step = trainer.step_count
        self.control.stepped()  # this step's compute sample goes to the coordinator now
        self.checkpoints.finalize(step)
        if self.step_gate is not None and self.step_gate(step):
            self._refresh_latest()
        latest, all_prepared, save_due = self._agree(step)
        if save_due:  # some rank's safety checkpoint is due: all save, at the same step
            self._save(trainer, built)
        plan = self._next_plan(latest)
        if plan is None or not self._all_ready(plan, latest, all_prepared, step):
            return
        if self.state.rank == 0:
            self.clients.store.set(Keys.switch(latest), str(step))
        self.switch(self.preparations.get(latest), step)

    def _refresh_latest(self, timeout: float = 300.0) -> None:
        """After a gate held this worker: read the newest plan generation again (the plan due
        at this step may have been published meanwhile). The store may be coming back with a
        restarted coordinator: the control thread connects this thread's client anew. A pointer
        deleted or forged meanwhile reads as the last value this client accepted (which may
        predate the plan) or as absent: it is read again until the coordinator has written it back
        (``coordinator.kept``, within a second), and so is the plan it names, for at most
        ``TAMPERED_REREAD`` seconds."""
        end = time.monotonic() + timeout
        tampered_until = time.monotonic() + TAMPERED_REREAD
        while True:
            try:
                store = self.clients.store
                r = store.read(Keys.LATEST)
                latest = -1 if r.value is None else int(r.value)
                missing = latest > self.state.generation and latest not in self._plans
                if missing and (plan := store.plan(latest)) is not None:
                    self._plans[latest], missing = plan, False
                # absent (never read by this client, then deleted), below this world, or not
                # authentic: not the pointer the coordinator wrote
                stale = r.tampered or latest < self.state.generation
                if (stale or missing) and time.monotonic() < tampered_until:
                    time.sleep(0.02)
                    continue
                break
            except Exception:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        self.control.latest_seen = max(self.control.latest_seen, latest)

    def _agree(self, step: int) -> tuple[int, int, bool]:
        """The MAX all-reduce: (newest generation seen, lowest newest-prepared, checkpoint due)."""
        prepared = self.preparations.prepared_from(self.state.generation)
        flags = torch.tensor([self.control.latest_seen, -max(prepared, default=-1), int(self.checkpoints.due(step))],
                             dtype=torch.int64, device=worlds.device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), -int(flags[1]), bool(int(flags[2]))

    @staticmethod
    def _everyone_holds(held: bool) -> bool:
        """The MIN all-reduce of whether each rank holds the announced plan."""
        flag = torch.tensor([int(held)], dtype=torch.int64, device=worlds.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(int(flag))

    def _save(self, trainer: Any, built: Any) -> None:
        try:
            self.checkpoints.save(built, trainer, background=True)
        except Exception as e:
            if is_comm_failure(e):
                raise
            self.checkpoints.failed(trainer.step_count, e)

    def forget_plans(self) -> None:
        """Plans read from a store that is gone (a coordinator restart, a rejoin): read anew."""
        self._plans.clear()

    def _next_plan(self, latest: int) -> WorldPlan | None:
        """The plan of generation ``latest`` if it follows this world and every rank holds it,
        else None. Collective when ``latest`` is newer than this world (agreed: every rank
        calls it alike)."""
        if latest <= self.state.generation:
            return None
        plan = self._plans.get(latest) or self.clients.store.plan(latest)
        if not self._everyone_holds(plan is not None):
            return None
        assert plan is not None
        self._plans[latest] = plan
        return plan if plan.previous == self.state.generation else None

    def _all_ready(self, plan: WorldPlan, latest: int, all_prepared: int, step: int) -> bool:
        """Whether to switch at this step: its time has come (``switch_at_step``, waiting for
        our own preparation) or every rank has prepared it; then the MIN vote of every rank."""
        if plan.switch_at_step is not None:
            if step < plan.switch_at_step:
                return False
            ok = self.preparations.wait(latest) is not None  # every rank waits at the same step
        elif all_prepared == latest:
            ok = True
        else:
            return False
        vote = torch.tensor([1 if ok else 0], dtype=torch.int64, device=worlds.device())
        dist.all_reduce(vote, op=dist.ReduceOp.MIN)
        return bool(int(vote))  # no: some rank failed to prepare, the coordinator aborts this generation
