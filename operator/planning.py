"""The operator's planning step for one job: whether to plan anew (a start, a departure, an
overdue ack, a spec change, a scale-up) and how a plan is written into the status. Part of
``reconcile._Reconciler``; pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from liveshard.operator import signals
from liveshard.operator.signals import Signal
from liveshard.runtime.contract.causes import RUNTIME_JUDGED, WITHOUT_NOTICE, Cause
from liveshard.runtime.contract.status import CommittedWorld, JobPhase, StatusPlan
from liveshard.runtime.contract.times import iso
from liveshard.runtime.planner.pods import Candidate, PodAssignment, micro_batches, plan_for
from liveshard.runtime.planner.search import NoFeasiblePlan

ACK_GRACE_SECONDS = 60.0  # after a plan's deadline, before the operator plans again without an ack

@dataclass
class _NextPlan:
    """What phase 3 decided: a new plan, a stop, or nothing (``assignment`` and ``stop_reason`` None)."""

    assignment: PodAssignment | None = None
    stop_reason: str | None = None
    cause: Cause | None = None
    text: str = ""
    deadline: datetime | None = None



class Planning:
    """Mixed into the reconciler: whether and what to plan anew (its phase 3), and writing the
    plan into the status. Reads and writes the reconciler's state; pure."""

    def _next_plan(self, plan: StatusPlan | None, members: list[str], candidates: list[Candidate],
                   acked: bool, aborted: bool) -> _NextPlan:
        by_name = self.by_name
        leaving = [(m, why) for m in members if m in by_name and (why := self._departure(by_name[m]))]
        lost = [m for m in members if m not in by_name]
        if members and (leaving or lost):
            unnoticed = [m for m, why in leaving if why.kind in WITHOUT_NOTICE] + lost
            if not unnoticed:
                return self._plan_departures(plan, candidates, leaving, [])
            if not acked:
                # A plan the runtime does not run yet that names a pod lost since: it cannot run
                # as written. Replaced (it is a wish, not a world: no other authority is involved).
                return self._attempt(plan, candidates, Cause.RETRY,
                                     f"retry: generation {plan.generation} names {', '.join(unnoticed)}, "
                                     "lost without notice")
            # One authority per event: a loss without notice is the runtime's. It recovers on its
            # own (it sees the loss first) and the world it commits is recorded when reported
            # (``status.world``, which wakes this loop); nothing is planned for it here, and
            # nothing else either until then: any plan now would race that recovery.
            return _NextPlan()
        if not members:
            return self._plan_start(plan, candidates)
        if aborted and self._abort_backoff_over(plan.generation):
            return self._attempt(plan, candidates, Cause.RETRY,
                                 f"retry: generation {plan.generation} was aborted by the runtime")
        if not acked and not aborted and self._ack_overdue(plan):
            return self._plan_overdue(plan, members, candidates)
        if self.status.get("observedGeneration") not in (None, self.meta.get("generation")):
            return self._plan_spec_change(plan, members, candidates)
        if acked and any(c.pod not in members for c in candidates):
            return self._plan_scale_up(plan, members, candidates)
        return _NextPlan()

    def _ack_overdue(self, plan: StatusPlan) -> bool:
        """Whether ``plan`` is past its deadline plus ``ACK_GRACE_SECONDS`` without an answer."""
        if plan.deadline is None:
            return False
        left = (plan.deadline - self.now).total_seconds() + ACK_GRACE_SECONDS
        if left > 0:
            self.d.requeue_after = min(self.d.requeue_after, left + 0.1)
        return left <= 0

    def _plan_overdue(self, plan: StatusPlan, members: list[str], candidates: list[Candidate]) -> _NextPlan:
        """A plan nobody answered: plan again for the pods running now, if that gives another
        world (the same one again would only restart the wait; the job stays Degraded)."""
        proposal, _ = self._try_plan(candidates, plan)
        if proposal is not None and (proposal.config != plan.config or list(proposal.members) != members):
            return _NextPlan(proposal, None, Cause.RETRY,
                             f"retry: generation {plan.generation} was not applied by its deadline")
        return _NextPlan()

    def _attempt(self, plan: StatusPlan | None, candidates: list[Candidate], cause: Cause, text: str,
                 deadline: datetime | None = None) -> _NextPlan:
        assignment, stop_reason = self._try_plan(candidates, plan)
        return _NextPlan(assignment, stop_reason, cause, text, deadline)

    def _plan_departures(self, plan, candidates, leaving, lost) -> _NextPlan:
        by_name = self.by_name
        deadline = None
        if leaving:
            first = signals.most_pressing([s for _, s in leaving])
            cause = first.kind
            names = [m for m, _ in leaving]
            where = sorted({by_name[m].node for m in names if by_name[m].node})
            text = (f"{first.kind}: {first.reason}"
                    + (f" (node {', '.join(where)})" if where and first.kind != Cause.SCALE_DOWN else "")
                    + f"; leaving: {', '.join(names)}")
            deadline = min((s.deadline for _, s in leaving if s.deadline), default=None)
            if deadline is not None and deadline <= self.now:
                # already gone (a pod deleted with no grace, a node deleted): nothing to race, the
                # switch gets the job's reconfiguration timeout, not a deadline in the past
                deadline = None
            self.d.triggers = [by_name[m].node or m for m in names]
            if lost:
                text += f"; lost: {', '.join(lost)}"
        else:
            cause, text = Cause.MEMBER_LOST, f"member-lost: pods {', '.join(lost)} no longer exist"
        return self._attempt(plan, candidates, cause, text, deadline)

    def _plan_start(self, plan: StatusPlan | None, candidates: list[Candidate]) -> _NextPlan:
        spec, st = self.spec, self.d.status
        desired = spec.workers.replicas
        ready = len(candidates) >= spec.workers.min and (
            len(candidates) >= desired or self._waited(spec.elasticity.scale_up_cooldown_seconds))
        if ready:
            cause = Cause.INITIAL if plan is None else Cause.RESUME
            nxt = self._attempt(plan, candidates, cause, f"{cause}: {len(candidates)} worker pods running")
            if nxt.assignment is None:
                nxt.cause = None  # nothing to stop: just stay suspended
        else:
            nxt = _NextPlan()
            if plan is None:
                st["phase"] = JobPhase.PENDING
                st["message"] = (f"waiting for worker pods: {len(candidates)} of {desired} running "
                                 f"(min {spec.workers.min})")
        if nxt.stop_reason and not plan:
            st["phase"] = JobPhase.SUSPENDED
            st["message"] = nxt.stop_reason
        return nxt

    def _plan_spec_change(self, plan: StatusPlan, members: list[str], candidates: list[Candidate]) -> _NextPlan:
        proposal, _ = self._try_plan(candidates, plan)
        if proposal is not None and (proposal.config != plan.config or list(proposal.members) != members):
            return _NextPlan(proposal, None, Cause.SPEC_CHANGED,
                             f"spec-changed: job generation {self.meta.get('generation')}")
        return _NextPlan()

    def _plan_scale_up(self, plan: StatusPlan, members: list[str], candidates: list[Candidate]) -> _NextPlan:
        key = (tuple(c.pod for c in candidates), plan.generation)
        # Growing back after the runtime shrank alone (a loss without notice: ``plan`` records its
        # world) is not a scale-up to batch: the pods standing by run already, and the job may be
        # below spec.parallelism.minDataParallel, one more loss from losing state. So no cooldown.
        # The operator is the one authority for it, not the runtime's recovery: which pods may
        # join is a capacity decision made from what only the operator sees (node signals, e.g.
        # a standby on a node with a spot notice or a cordon; spec.workers.replicas; each node's
        # GPU memory), the recovery itself must stay on its short path (survivors only: no
        # joiner's bootstrap while the world is broken), and the runtime's world never holds the
        # operator's standby pods (a plan's members are all it is given).
        # (a world the straggler policy made is not a loss: its left-out pod is not taken back,
        # as no plan's leaver is, and the cooldown stands)
        regrow = plan.observed_world is not None and plan.cause == Cause.LOST_WITHOUT_NOTICE
        wait = 0.0 if regrow else self._cooldown_left(plan, self.spec.elasticity.scale_up_cooldown_seconds)
        if wait > 0:
            self.d.requeue_after = min(self.d.requeue_after, wait + 0.1)
            return _NextPlan()
        self.d.scale_up_key = key
        if key == self.scale_up_checked:
            return _NextPlan()
        proposal, _ = self._try_plan(candidates, plan)
        if proposal is not None and proposal.world_size > plan.world_size:
            joining = [m for m in proposal.members if m not in members]
            if regrow:
                return _NextPlan(proposal, None, Cause.SCALE_UP,
                                 f"scale-up: grow back after the runtime's recovery ({plan.reason}): "
                                 f"{', '.join(joining)} join")
            return _NextPlan(proposal, None, Cause.SCALE_UP, f"scale-up: {', '.join(joining)} joined")
        return _NextPlan()

    def _departure(self, w) -> Signal | None:
        """Why a member leaves, as far as plans go: a member on a node that stopped answering the
        API server (not-ready, unreachable) may train on, and only the runtime's liveness judge
        says it is gone (then its world without it is recorded)."""
        why = self._leaving(w)
        return None if why is not None and why.kind in RUNTIME_JUDGED and not w.dead else why

    # -- the world the runtime runs --
    def _unrecorded(self, world: CommittedWorld, plan: StatusPlan | None) -> bool:
        """Whether ``world`` is one the runtime made on its own that the status does not show yet:
        no operator plan is it (``planGeneration``), the current plan is not it, and it was not
        recorded before (``observedWorld`` of the plan or of a past one in the history)."""
        if world.plan_generation is not None or world.runs(plan):
            return False
        recorded = {h.get("runtimeGeneration") for h in self.history}
        return world.generation not in recorded and (plan is None or plan.observed_world != world.generation)

    def _record_observed(self, old: StatusPlan | None, world: CommittedWorld) -> StatusPlan:
        """Record the world the runtime committed on its own as the job's plan, applied: the
        status shows what runs. A record, not a request: the coordinator acks it as the world it
        runs and never makes it a transition (``observedWorld``)."""
        old_members = list(old.members) if old is not None and not old.is_stop else []
        gen = (old.generation if old else self.last_generation) + 1
        leaving = tuple(m for m in old_members if m not in world.members)
        # the uids of the pods it names (members and leavers): a leaver the runtime lost is not
        # taken back into the grow-back while its node's signal still settles (same uid)
        uids = {m: self.by_name[m].uid for m in world.members if m in self.by_name and self.by_name[m].uid}
        uids.update({m: old.member_uids[m] for m in leaving if old is not None and old.member_uids.get(m)})
        at = world.committed_at or self.now
        why = world.reason or "the runtime changed its world"
        plan = StatusPlan(
            generation=gen, config=world.config, members=world.members,
            gpus_per_worker=self.spec.workers.gpus_per_worker, cause=world.cause or Cause.LOST_WITHOUT_NOTICE,
            reason=f"observed: {why}", created_at=at, leaving=leaving, member_uids=uids,
            joining=tuple(m for m in world.members if m not in old_members),
            explanation=(f"the world the runtime committed on its own (runtime generation {world.generation})",),
            observed_world=world.generation)
        self.d.status.update(plan.to_status())
        if old is not None:
            for h in self.history:
                if h.get("generation") == old.generation and not h.get("outcome"):
                    h["outcome"] = "Superseded"
        self.history.append({"generation": gen, "reason": plan.reason, "from": old.config if old else "",
                             "to": plan.config, "worldSize": world.world_size, "createdAt": iso(at),
                             "appliedAt": iso(at), "seconds": 0.0, "outcome": "Observed",
                             "runtimeGeneration": world.generation})
        self.event("Normal", "RuntimeReconfigured",
                   f"generation {gen}: the runtime runs {world.config or 'nothing (stopped)'} on {world.world_size} "
                   f"GPUs ({why})")
        return plan

    # -- phase 5: pods --
    def _try_plan(self, candidates: list[Candidate], current: StatusPlan | None
                  ) -> tuple[PodAssignment | None, str | None]:
        spec = self.spec
        if len(candidates) < spec.workers.min:
            return None, (f"{len(candidates)} running worker pods, fewer than workers.min="
                          f"{spec.workers.min}")
        running = current if current is not None and not current.is_stop else None
        lost = [m for m in running.members if self._lost(m)] if running else []
        try:
            return plan_for(spec, candidates, running.config if running else "",
                            running.members if running else (), lost), None
        except NoFeasiblePlan as e:
            return None, f"no feasible plan: {e}"

    def _write_plan(self, old: StatusPlan | None, nxt: _NextPlan, old_members: list[str]) -> StatusPlan:
        new = nxt.assignment
        assert new is not None
        gen = (old.generation if old else self.last_generation) + 1
        plan = StatusPlan(
            generation=gen, config=new.config, members=new.members,
            gpus_per_worker=self.spec.workers.gpus_per_worker, cause=nxt.cause, reason=nxt.text,
            deadline=nxt.deadline or self._default_deadline(), created_at=self.now,
            leaving=tuple(m for m in old_members if m not in new.members),
            joining=tuple(m for m in new.members if m not in old_members),
            micro_batches=micro_batches(self.spec, new.plan),
            step_seconds=round(float(new.plan.step_seconds), 6),
            tokens_per_second=round(float(new.plan.tokens_per_second), 3),
            explanation=tuple(new.plan.explanation)[:12],
            member_uids={m: self.by_name[m].uid for m in (*new.members, *old_members)
                         if m in self.by_name and self.by_name[m].uid})
        self._record_plan(old, plan)
        standby = f"; {len(new.standby)} pod(s) stand by: {new.standby_reason}" if new.standby_reason else ""
        self.event("Normal", "Replanned", f"generation {gen}: {new.config} on {new.world_size} GPUs "
                   f"({len(new.members)} pods); {nxt.text}{standby}")
        return plan

    def _write_stop(self, old: StatusPlan | None, nxt: _NextPlan, old_members: list[str]) -> StatusPlan:
        """No plan fits the pods that remain: tell the runtime to checkpoint and stop."""
        why = nxt.stop_reason or ""
        plan = StatusPlan(
            generation=(old.generation if old else self.last_generation) + 1, config="", members=(),
            gpus_per_worker=self.spec.workers.gpus_per_worker, cause=nxt.cause or Cause.MEMBER_LOST,
            reason=f"{nxt.text}; suspended: {why}", deadline=nxt.deadline or self._default_deadline(),
            created_at=self.now, leaving=tuple(old_members), explanation=(why,))
        self._record_plan(old, plan)
        return plan

    def _default_deadline(self) -> datetime:
        return self.now + timedelta(seconds=self.spec.elasticity.reconfiguration_timeout_seconds)

    def _record_plan(self, old: StatusPlan | None, plan: StatusPlan) -> None:
        self.d.status.update(plan.to_status())
        if old is not None:
            for h in self.history:
                if h.get("generation") == old.generation and not h.get("outcome"):
                    h["outcome"] = "Superseded"
        self.history.append({"generation": plan.generation, "reason": plan.reason,
                             "from": old.config if old else "", "to": plan.config,
                             "worldSize": plan.world_size, "createdAt": iso(self.now)})
        self.d.replan_reason = plan.cause

    # -- the runtime's answers --
