"""The operator's planning step for one job: whether to plan anew (a start, a departure, an
overdue ack, a spec change, a scale-up) and how a plan is written into the status. Part of
``reconcile._Reconciler``; pure."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from liveshard.operator import signals
from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.contract.status import JobPhase, StatusPlan
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
        leaving = [(m, self._leaving(by_name[m])) for m in members if m in by_name and self._leaving(by_name[m])]
        lost = [m for m in members if m not in by_name]
        if members and (leaving or lost):
            return self._plan_departures(plan, candidates, leaving, lost)
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
        wait = self._cooldown_left(plan, self.spec.elasticity.scale_up_cooldown_seconds)
        if wait > 0:
            self.d.requeue_after = min(self.d.requeue_after, wait + 0.1)
            return _NextPlan()
        self.d.scale_up_key = key
        if key == self.scale_up_checked:
            return _NextPlan()
        proposal, _ = self._try_plan(candidates, plan)
        if proposal is not None and proposal.world_size > plan.world_size:
            joining = [m for m in proposal.members if m not in members]
            return _NextPlan(proposal, None, Cause.SCALE_UP, f"scale-up: {', '.join(joining)} joined")
        return _NextPlan()

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
            explanation=tuple(new.plan.explanation)[:12])
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
