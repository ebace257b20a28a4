"""What the operator should do for one job, given what it sees now: a pure decision.

``reconcile(job, pods, nodes, now)`` reads the job (spec and status), its pods and the signal
of every node, and returns a ``Decision``: the status to write (a new plan, conditions,
history), pods to create and to delete, events to post. It keeps no state of its own: all of
it lives in the job's status, so an operator restarted mid-reconfiguration decides the same
thing again from the same objects.

The protocol with the runtime (operator/README.md): a plan is written with a new generation;
the coordinator acks it by setting ``status.appliedGeneration``. Leaving pods are deleted only
after the ack of a plan that excludes them (or once they are dead), never before: until then
they may still hold state the new owners copy from.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from liveshard.operator import builders, signals
from liveshard.operator.signals import Signal
from liveshard.runtime.contract.jobspec import JobSpec, read_spec
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.planner.pods import Candidate, PodAssignment, micro_batches, node_gpu_memory, plan_for
from liveshard.runtime.planner.search import NoFeasiblePlan, plan_parallelism

HISTORY_LIMIT = 20
ABORT_RETRY_SECONDS = 30.0
IDLE_REQUEUE_SECONDS = 30.0
UNACKED_REQUEUE_SECONDS = 5.0

# Replan reasons (the metric label; the status carries the full sentence).
INITIAL, RESUME, MEMBER_LOST, SCALE_UP, SCALE_DOWN, SPEC_CHANGED, RETRY = (
    "initial", "resume", "member-lost", "scale-up", "scale-down", "spec-changed", "retry")


@dataclass(frozen=True)
class Worker:
    """A worker pod as the decision sees it."""

    name: str
    index: int
    uid: str
    node: str | None
    phase: str
    deleting: bool
    signal: Signal | None  # why it is going away (already filtered by the job's policy)
    gpu_memory_bytes: int | None

    @property
    def dead(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.node) and not self.deleting


@dataclass
class Decision:
    status: dict[str, Any] = field(default_factory=dict)  # merge patch for .status
    create_workers: list[int] = field(default_factory=list)
    create_coordinator: bool = False
    delete_pods: list[str] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    replan_reason: str | None = None  # metric label of a plan written now
    triggers: list[str] = field(default_factory=list)  # nodes/pods whose signal caused it
    applied: tuple[int, float] | None = None  # (generation, plan-to-ack seconds) newly acked
    new_failures: int = 0
    requeue_after: float = IDLE_REQUEUE_SECONDS
    scale_up_key: Hashable | None = None  # candidates already tried for scale-up
    spec: JobSpec | None = None


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---- observing --------------------------------------------------------------------------------
def observe_workers(pods: list[dict[str, Any]], nodes: Mapping[str, Signal | None],
                    node_labels: Mapping[str, Mapping[str, str]], act_on: frozenset[str],
                    now: datetime) -> list[Worker]:
    """Worker pods with their signals. ``nodes`` has every node that exists (missing: gone)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(builders.LABEL_ROLE) != builders.ROLE_WORKER:
            continue
        try:
            index = int(labels.get(builders.LABEL_INDEX, ""))
        except ValueError:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        sig = signals.classify_pod(pod, now)
        if sig is None and node:
            if node not in nodes:
                sig = signals.node_gone(node, now)
            else:
                node_sig = nodes[node]
                if node_sig is not None and signals.acts_on(node_sig, act_on):
                    sig = node_sig
        out.append(Worker(
            name=meta["name"], index=index, uid=meta.get("uid", ""), node=node,
            phase=(pod.get("status") or {}).get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")), signal=sig,
            gpu_memory_bytes=node_gpu_memory(node_labels.get(node)) if node else None,
        ))
    return sorted(out, key=lambda w: w.index)


# ---- conditions -------------------------------------------------------------------------------
def set_condition(conditions: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str,
                  now: datetime) -> list[dict[str, Any]]:
    value = "True" if status else "False"
    out = [c for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    since = old["lastTransitionTime"] if old and old.get("status") == value and old.get(
        "lastTransitionTime") else iso(now)
    out.append({"type": ctype, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": since})
    order = {"Ready": 0, "Reconfiguring": 1, "Degraded": 2, "Suspended": 3}
    return sorted(out, key=lambda c: (order.get(c["type"], 9), c["type"]))


def condition(conditions: list[dict[str, Any]], ctype: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)


# ---- the decision -----------------------------------------------------------------------------
def reconcile(job: dict[str, Any], pods: list[dict[str, Any]], nodes: Mapping[str, Signal | None],
              now: datetime, *, node_labels: Mapping[str, Mapping[str, str]] | None = None,
              planner: Callable[..., Any] = plan_parallelism,
              scale_up_checked: Hashable | None = None) -> Decision:
    return _Reconciler(job, pods, nodes, node_labels or {}, now, planner, scale_up_checked).run()


class _Reconciler:
    def __init__(self, job, pods, nodes, node_labels, now, planner, scale_up_checked) -> None:
        self.job = job
        self.meta = job.get("metadata") or {}
        self.name = self.meta.get("name", "")
        self.status: dict[str, Any] = dict(job.get("status") or {})
        self.pods = pods
        self.nodes = nodes
        self.node_labels = node_labels
        self.now = now
        self.planner = planner
        self.scale_up_checked = scale_up_checked
        self.d = Decision()
        self.conditions = list(self.status.get("conditions") or [])
        self.history = [dict(h) for h in self.status.get("history") or []]

    # -- helpers --
    def event(self, kind: str, reason: str, message: str) -> None:
        self.d.events.append((kind, reason, message))

    def cond(self, ctype: str, status: bool, reason: str, message: str) -> None:
        old = condition(self.conditions, ctype)
        was = bool(old and old.get("status") == "True")
        self.conditions = set_condition(self.conditions, ctype, status, reason, message, self.now)
        if status and not was and ctype in ("Suspended", "Degraded"):
            self.event("Warning", reason, message)

    def run(self) -> Decision:
        d, st = self.d, self.d.status
        st["observedGeneration"] = self.meta.get("generation")
        st["selector"] = builders.worker_selector(self.name)
        try:
            spec = read_spec(self.job.get("spec"))
        except ConfigError as e:
            st["phase"] = "Failed"
            st["message"] = str(e)
            self.cond("Ready", False, "InvalidSpec", str(e))
            if self.status.get("message") != str(e):
                self.event("Warning", "InvalidSpec", str(e))
            st["conditions"] = self.conditions
            return d
        d.spec = spec
        self.spec = spec

        coordinators = [p for p in self.pods if ((p.get("metadata") or {}).get("labels") or {}).get(
            builders.LABEL_ROLE) == builders.ROLE_COORDINATOR and not p["metadata"].get("deletionTimestamp")]
        for p in coordinators:
            if (p.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                # e.g. evicted: a stopped pod is not restarted, so replace it (next pass)
                d.delete_pods.append(p["metadata"]["name"])
                self.event("Warning", "CoordinatorReplaced",
                           f"coordinator pod {p['metadata']['name']} stopped: "
                           f"{(p.get('status') or {}).get('reason') or 'no reason given'}")
        d.create_coordinator = not coordinators

        workers = observe_workers(self.pods, self.nodes, self.node_labels, spec.elasticity.act_on, self.now)
        desired = spec.workers.replicas
        by_name = {w.name: w for w in workers}
        self.by_name = by_name

        plan = self.status.get("plan") or None
        gen = int(plan.get("generation", 0)) if plan else 0
        applied = int(self.status.get("appliedGeneration") or 0)
        acked = plan is None or applied >= gen
        members = list(plan.get("members") or []) if plan else []
        st["worldSize"] = int(self.status.get("worldSize") or 0)

        # 1. the runtime's answer to the current plan
        if plan and acked and gen:
            self._note_ack(plan, gen)
            st["worldSize"] = int(plan.get("worldSize") or 0)
        aborted = bool(plan) and not acked and int(self.status.get("abortedGeneration") or 0) >= gen
        if aborted:
            self._note_abort(plan, gen)

        # 2. who is leaving, who can take part
        def leaving(w: Worker) -> Signal | None:
            if w.signal is not None:
                return w.signal
            if w.index >= desired:
                return Signal(SCALE_DOWN, f"scaled down to {desired} workers", None,
                              source="spec.workers.replicas")
            return None

        candidates = [Candidate(w.name, w.node or "", w.gpu_memory_bytes,
                                float((self.status.get("speeds") or {}).get(w.name, 1.0)))
                      for w in workers if w.running and leaving(w) is None]
        leaving_members = [(m, leaving(by_name[m])) for m in members if m in by_name and leaving(by_name[m])]
        lost = [m for m in members if m not in by_name]

        # 3. a new plan?
        new: PodAssignment | None = None
        reason_kind, reason_text, deadline = None, "", None
        stop_reason: str | None = None
        if members and (leaving_members or lost):
            if leaving_members:
                first = signals.most_pressing([s for _, s in leaving_members])
                reason_kind = first.kind
                names = [m for m, s in leaving_members]
                where = sorted({by_name[m].node for m in names if by_name[m].node})
                reason_text = (f"{first.kind}: {first.reason}"
                               + (f" (node {', '.join(where)})" if where and first.kind != SCALE_DOWN else "")
                               + f"; leaving: {', '.join(names)}")
                deadline = min((s.deadline for _, s in leaving_members if s.deadline), default=None)
                d.triggers = [by_name[m].node or m for m in names]
            else:
                reason_kind = MEMBER_LOST
                reason_text = f"member-lost: pods {', '.join(lost)} no longer exist"
            if lost and leaving_members:
                reason_text += f"; lost: {', '.join(lost)}"
            new, stop_reason = self._try_plan(candidates)
        elif not members:
            ready_to_start = len(candidates) >= spec.workers.min and (
                len(candidates) >= desired or self._waited(spec.elasticity.scale_up_cooldown_seconds))
            if ready_to_start:
                reason_kind = INITIAL if plan is None else RESUME
                reason_text = (f"{reason_kind}: {len(candidates)} worker pods running")
                new, stop_reason = self._try_plan(candidates)
                if new is None:
                    reason_kind = None  # nothing to stop: just stay suspended
            elif plan is None:
                running = len(candidates)
                st["phase"] = "Pending"
                st["message"] = f"waiting for worker pods: {running} of {desired} running (min {spec.workers.min})"
            if stop_reason and not plan:
                st["phase"] = "Suspended"
                st["message"] = stop_reason
        elif aborted and self._abort_backoff_over(gen):
            reason_kind, reason_text = RETRY, f"retry: generation {gen} was aborted by the runtime"
            new, stop_reason = self._try_plan(candidates)
        elif self.status.get("observedGeneration") not in (None, self.meta.get("generation")):
            proposal, why = self._try_plan(candidates)
            if proposal is not None and (proposal.config != plan.get("config")
                                         or list(proposal.members) != members):
                new, reason_kind = proposal, SPEC_CHANGED
                reason_text = f"spec-changed: job generation {self.meta.get('generation')}"
        elif acked and any(c.pod not in members for c in candidates):
            key = (tuple(c.pod for c in candidates), gen)
            wait = self._cooldown_left(plan, spec.elasticity.scale_up_cooldown_seconds)
            if wait > 0:
                d.requeue_after = min(d.requeue_after, wait + 0.1)
            elif key != self.scale_up_checked:
                d.scale_up_key = key
                proposal, _ = self._try_plan(candidates)
                if proposal is not None and proposal.world_size > int(plan.get("worldSize") or 0):
                    new, reason_kind = proposal, SCALE_UP
                    joining = [m for m in proposal.members if m not in members]
                    reason_text = f"scale-up: {', '.join(joining)} joined"
            else:
                d.scale_up_key = key

        # 4. write it
        if new is not None:
            self._write_plan(plan, new, reason_kind, reason_text, deadline, members)
            plan, members, acked = st["plan"], list(new.members), False
        elif stop_reason is not None and members:
            self._write_stop(plan, reason_kind or MEMBER_LOST, reason_text, deadline, stop_reason, members)
            plan, members, acked = st["plan"], [], False

        # 5. pods: delete leavers once it is safe, create what is missing
        counted = list(self.status.get("countedFailures") or [])
        for w in workers:
            why = leaving(w)
            if w.deleting or why is None:
                continue
            safe = w.dead or (acked and w.name not in members)
            if not safe:
                continue
            d.delete_pods.append(w.name)
            if why.failure and w.uid not in counted:
                counted.append(w.uid)
                d.new_failures += 1
            self.event("Normal", "WorkerRemoved", f"deleting {w.name}: {why.reason}")
        if d.new_failures:
            st["failures"] = int(self.status.get("failures") or 0) + d.new_failures
            st["countedFailures"] = counted[-50:]
        existing = {w.name for w in workers}
        for i in range(desired):
            if builders.worker_name(self.name, i) not in existing:
                d.create_workers.append(i)
        st["replicas"] = sum(1 for w in workers if not w.deleting and w.name not in d.delete_pods)

        # 6. phase and conditions
        self._conditions(plan, members, acked, applied, desired, spec)
        st["conditions"] = self.conditions
        st["history"] = self.history[-HISTORY_LIMIT:]
        if plan and not acked:
            d.requeue_after = min(d.requeue_after, UNACKED_REQUEUE_SECONDS)
        return d

    # -- planning --
    def _try_plan(self, candidates: list[Candidate]) -> tuple[PodAssignment | None, str | None]:
        spec = self.spec
        if len(candidates) < spec.workers.min:
            return None, (f"{len(candidates)} running worker pods, fewer than workers.min="
                          f"{spec.workers.min}")
        try:
            return plan_for(spec, candidates, self.planner), None
        except NoFeasiblePlan as e:
            return None, f"no feasible plan: {e}"

    def _write_plan(self, old: dict[str, Any] | None, new: PodAssignment, kind: str, text: str,
                    deadline: datetime | None, old_members: list[str]) -> None:
        st = self.d.status
        gen = int(old.get("generation", 0)) + 1 if old else 1
        if deadline is None:
            deadline = self.now + timedelta(seconds=self.spec.elasticity.reconfiguration_timeout_seconds)
        st["plan"] = {
            "generation": gen, "config": new.config, "members": list(new.members),
            "gpusPerWorker": self.spec.workers.gpus_per_worker, "worldSize": new.world_size,
            "reason": text, "deadline": iso(deadline), "createdAt": iso(self.now),
            "leaving": [m for m in old_members if m not in new.members],
            "joining": [m for m in new.members if m not in old_members],
            "microBatches": micro_batches(self.spec, new.plan),
            "stepSeconds": round(float(new.plan.step_seconds), 6),
            "tokensPerSecond": round(float(new.plan.tokens_per_second), 3),
            "explanation": list(new.plan.explanation)[:12],
        }
        self._supersede(old)
        self.history.append({"generation": gen, "reason": text,
                             "from": (old or {}).get("config") or "", "to": new.config,
                             "worldSize": new.world_size, "createdAt": iso(self.now)})
        self.d.replan_reason = kind
        self.event("Normal", "Replanned", f"generation {gen}: {new.config} on {new.world_size} GPUs "
                   f"({len(new.members)} pods); {text}")

    def _write_stop(self, old: dict[str, Any] | None, kind: str, text: str, deadline: datetime | None,
                    why: str, old_members: list[str]) -> None:
        """No plan fits the pods that remain: tell the runtime to checkpoint and stop."""
        st = self.d.status
        gen = int(old.get("generation", 0)) + 1 if old else 1
        if deadline is None:
            deadline = self.now + timedelta(seconds=self.spec.elasticity.reconfiguration_timeout_seconds)
        st["plan"] = {
            "generation": gen, "config": "", "members": [], "gpusPerWorker": self.spec.workers.gpus_per_worker,
            "worldSize": 0, "reason": f"{text}; suspended: {why}", "deadline": iso(deadline),
            "createdAt": iso(self.now), "leaving": list(old_members), "joining": [],
            "microBatches": None, "stepSeconds": None, "tokensPerSecond": None, "explanation": [why],
        }
        self._supersede(old)
        self.history.append({"generation": gen, "reason": st["plan"]["reason"],
                             "from": (old or {}).get("config") or "", "to": "", "worldSize": 0,
                             "createdAt": iso(self.now)})
        self.d.replan_reason = kind

    def _supersede(self, old: dict[str, Any] | None) -> None:
        if not old:
            return
        for h in self.history:
            if h.get("generation") == old.get("generation") and not h.get("outcome"):
                h["outcome"] = "Superseded"

    # -- the runtime's answers --
    def _note_ack(self, plan: dict[str, Any], gen: int) -> None:
        entry = next((h for h in self.history if h.get("generation") == gen), None)
        if entry is None or entry.get("outcome"):
            return
        applied_at = signals.parse_time(self.status.get("appliedAt")) or self.now
        created = signals.parse_time(plan.get("createdAt")) or applied_at
        seconds = max(0.0, (applied_at - created).total_seconds())
        entry.update(appliedAt=iso(applied_at), seconds=round(seconds, 3), outcome="Applied")
        self.d.applied = (gen, seconds)
        what = f"{plan.get('config')} on {plan.get('worldSize')} GPUs" if plan.get("members") else "stopped"
        self.event("Normal", "Reconfigured", f"generation {gen} applied: {what} ({seconds:.1f}s after the plan)")

    def _note_abort(self, plan: dict[str, Any], gen: int) -> None:
        entry = next((h for h in self.history if h.get("generation") == gen), None)
        if entry is not None and entry.get("outcome") != "Aborted":
            entry.update(outcome="Aborted", abortedAt=iso(self.now))
            self.event("Warning", "ReconfigurationAborted",
                       f"generation {gen} aborted by the runtime: {self.status.get('abortReason') or 'no reason'}")

    def _abort_backoff_over(self, gen: int) -> bool:
        entry = next((h for h in self.history if h.get("generation") == gen), None)
        since = signals.parse_time((entry or {}).get("abortedAt")) or self.now
        left = ABORT_RETRY_SECONDS - (self.now - since).total_seconds()
        if left > 0:
            self.d.requeue_after = min(self.d.requeue_after, left + 0.1)
            return False
        return True

    # -- time --
    def _waited(self, seconds: float) -> bool:
        created = signals.parse_time(self.meta.get("creationTimestamp"))
        if created is None:
            return True
        left = seconds - (self.now - created).total_seconds()
        if left > 0:
            self.d.requeue_after = min(self.d.requeue_after, left + 0.1)
        return left <= 0

    def _cooldown_left(self, plan: dict[str, Any] | None, seconds: float) -> float:
        created = signals.parse_time((plan or {}).get("createdAt"))
        if created is None:
            return 0.0
        return seconds - (self.now - created).total_seconds()

    # -- status --
    def _conditions(self, plan, members, acked, applied, desired, spec: JobSpec) -> None:
        st = self.d.status
        stopped = bool(plan) and not members
        if st.get("phase") == "Suspended" or (stopped and plan):
            why = (plan or {}).get("reason") or st.get("message") or "no feasible plan"
            st["phase"] = "Suspended"
            st["message"] = why
            kind = "BelowMinWorkers" if "fewer than workers.min" in why else "NoFeasiblePlan"
            self.cond("Suspended", True, kind, why)
        else:
            self.cond("Suspended", False, "Planned" if plan else "Waiting", "")
        if "phase" not in st:
            if not acked:
                st["phase"] = "Pending" if applied == 0 else "Reconfiguring"
            else:
                st["phase"] = "Running"
            st["message"] = (plan or {}).get("reason", "")
        running = st["phase"] == "Running"
        self.cond("Ready", running, st["phase"], st.get("message", ""))
        self.cond("Reconfiguring", bool(plan) and not acked, "PlanPending" if plan and not acked else "Idle",
                  f"waiting for the runtime to apply generation {plan['generation']}" if plan and not acked else "")
        degraded, reason, message = False, "AsDesired", ""
        deadline = signals.parse_time((plan or {}).get("deadline"))
        if plan and not acked and deadline and self.now > deadline:
            degraded, reason = True, "AckDeadlineExceeded"
            message = f"generation {plan['generation']} not applied by its deadline {plan['deadline']}"
        elif plan and not acked and int(self.status.get("abortedGeneration") or 0) >= int(plan["generation"]):
            degraded, reason = True, "ReconfigurationAborted"
            message = str(self.status.get("abortReason") or "the runtime aborted the reconfiguration")
        elif running and len(members) < desired:
            degraded, reason = True, "BelowDesiredSize"
            message = f"training on {len(members)} of {desired} desired worker pods"
        self.cond("Degraded", degraded, reason, message)


__all__ = ["Decision", "Worker", "iso", "observe_workers", "reconcile", "set_condition"]
