"""Plans from the operator: the coordinator's ``PlanSource`` that reads an ElasticTrainingJob.

The operator writes ``status.plan`` (generation, config, member pods in rank order,
gpusPerWorker, deadline); the coordinator acknowledges through ``status.appliedGeneration`` /
``appliedAt``, or ``abortedGeneration`` / ``abortReason``, and reports per-pod ``speeds``
(``contract.status`` types them; operator/README.md describes the protocol). Reads and merge
patches use the official kubernetes client.

Two generation counters meet here and are kept apart:

* **operator generations** (``status.plan.generation``) number the operator's plans;
* **runtime generations** (``WorldPlan.generation``) number the worlds the coordinator
  publishes. The coordinator also publishes worlds of its own, e.g. a recovery plan after a
  worker is lost without notice, so the two never line up.

The mapping: each operator plan handed to the coordinator becomes exactly one runtime
generation (the one the coordinator publishes right after ``poll`` returns it), remembered in
``runtime_of``. When that runtime generation commits *as the plan says* (its config, its number
of GPUs: the coordinator never re-orders an operator plan, it may only leave out members that
are not up), the operator generation is acked; when it aborts, the coordinator rejects the
request, or it commits a different world, the operator generation is reported aborted. An ack
always means "this plan runs". An operator plan whose members and config equal the world already
running needs no new world: it is acked at once. Runtime-only generations are never acked.

**The world that runs** (``status.world``, ``contract.CommittedWorld``) is written at every
commit the coordinator reports, whoever planned it: the runtime's own recovery after a loss
without notice, the straggler policy's switch, an operator plan. ``planGeneration`` names the
operator plan it is, when it is one; a world the runtime made has none, and the operator records
it as observed (a plan with ``observedWorld``, never handed on as a transition: it runs already).

One authority per event: a loss without notice (a node deleted, a pod failed or gone, a node not
ready) is the runtime's alone: the coordinator sees it first (heartbeats, a failed collective)
and recovers from it; the operator plans no departure for it, and nothing here waits for or
weighs one authority's plan against the other's. The operator plans announced departures,
scaling and spec changes, and every such plan is a transition from whatever world runs then.

A pod the operator sees ``Running`` may still be importing torch and megatron: a plan is handed
on only when every member is *up*: registered in the store from the pod the plan names (the
uid it announces, ``status.plan.memberUids``; the store keeps the registration of an earlier pod
of the same name, e.g. one deleted by a scale-down), heartbeating as the process that registered
(its heartbeat key carries the registration's incarnation and does not say it ended), and not
judged dead by the coordinator (``status.dead``). None of this weighs time: the liveness judge
is the coordinator's. A plan whose members are not all up by its deadline (``contract.members_due``:
``spec.elasticity.reconfigurationTimeoutSeconds`` after it was written, or the notice's end) is
reported aborted; the operator then plans again. Every plan is answered, acked or aborted, by
``contract.answer_due``; the operator plans again without an answer only past that time.

A stop plan (``config: ""``, no members) becomes a stop request: the running world saves a
checkpoint to the job's checkpoint directory and every worker waits; it is acked once saved. The
next plan with members restores that checkpoint under its own config.

A worker id is ``<pod>/<local rank>``: a member pod with ``gpusPerWorker = g`` stands for the
workers ``<pod>/0 .. <pod>/g-1``, so rank ``r`` is local GPU ``r % g`` of pod ``members[r // g]``.

When the coordinator must plan alone (a member lost without notice), it plans from the job's
spec and measured speeds (``planning``), exactly as the operator does.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from liveshard.runtime.contract.causes import cause_of
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION
from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.status import (
    AdaptiveReport,
    CheckpointReport,
    CommittedWorld,
    Finished,
    InvalidStatus,
    PlanAbort,
    PlanAck,
    Progress,
    RuntimeFailure,
    StandbyPods,
    StatusPlan,
    Straggler,
    Telemetry,
    Waiting,
    members_due,
    pod_of,
    pods_of,
    same_config,
)
from liveshard.runtime.contract.times import iso, parse_time
from liveshard.runtime.control.protocol import Heartbeat, Registration
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.planner.pods import constraints_for

log = logging.getLogger("liveshard.kube_source")

SPEEDS_INTERVAL = 30.0  # seconds between speed reports (they feed the next plan, not this one)
STANDBY_INTERVAL = 1.0  # seconds between looks at which pods outside the world are up (status.standby)
PROGRESS_INTERVAL = 10.0  # seconds between status.progress updates (kubectl get etj's Step and Loss)

__all__ = ["KubePlanSource", "api_client", "pod_speeds", "same_config"]  # same_config: contract.status's


def pod_speeds(health: dict[str, Any]) -> dict[str, float]:
    """Relative compute speed per pod (1.0 = as fast as the median device, capped there), from
    the coordinator's straggler summary: a pod is as fast as its slowest device."""
    per_pod: dict[str, float] = {}
    for device, m in (health.get("members") or {}).items():
        speed = round(min(1.0, max(0.05, float(m.get("speed") or 1.0))), 3)
        pod = pod_of(device)
        per_pod[pod] = min(per_pod.get(pod, 1.0), speed)
    return per_pod


def api_client(kubeconfig: str | None = None) -> Any:
    """The official client: the pod's service account, else ``kubeconfig`` / $KUBECONFIG."""
    from liveshard.runtime.control.kubeapi import make_api_client

    return make_api_client(kubeconfig=kubeconfig)


class KubePlanSource:
    """Turns new operator plans into plan requests and writes the coordinator's acks back."""

    def __init__(self, store: JobStore | None, job: str, namespace: str, api: Any = None,
                 poll_interval: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        import kubernetes.client

        self.clock = clock  # paces the polls and the reports (monotonic)
        self.wall = wall  # the times written into the job's status (acks, appliedAt)
        self.store = store
        self.job = job
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(api or api_client())
        self.poll_interval = poll_interval
        self.handled = 0  # newest operator generation handed on (or acked directly)
        self.awaiting: int | None = None  # handed to the coordinator, runtime generation not yet known
        self.runtime_of: dict[int, int] = {}  # operator generation -> runtime generation
        self.answered: set[int] = set()  # operator generations whose ack or abort the API accepted
        self.current: dict[str, Any] = {}  # the committed world, from the coordinator's last report
        self._handed: dict[int, StatusPlan] = {}  # operator generation -> the plan handed on
        self._plan_of: dict[int, int] = {}  # runtime generation -> the operator plan it runs exactly
        self._world_written: CommittedWorld | None = None  # status.world as last written
        self._committed_at: dict[int, float] = {}  # runtime generation -> when a report first showed it
        self._next_poll = 0.0
        self._next_speeds = 0.0
        self._next_progress = 0.0
        self._waiting_what: str | None = None  # status.waiting as last written, its seconds left out
        self._next_waiting = 0.0
        self._standby_written: dict[str, Any] | None = None  # status.standby as last written
        self._next_standby = 0.0
        self._finished_written = False
        self._failure_written = False
        self._checkpoints_written: dict[str, Any] | None = None
        self._waiting_since: dict[int, float] = {}  # operator generation -> first seen (members not up)
        self._planning: PlanningInputs | None = None
        self._unwritten: dict[int, dict[str, Any]] = {}  # operator generation -> ack/abort to write again
        self._stragglers_written: tuple[str, ...] = ()  # the devices status.stragglers names
        self._adaptive_written: dict[str, Any] | None = None
        self._bad_status: str | None = None  # the last malformed status field reported

    # ---- the job -----------------------------------------------------------------------------
    def read_job(self) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.job)
        return job

    def patch_status(self, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.namespace, PLURAL, self.job,
                                                          {"status": status})

    def planning(self, refresh: bool = False) -> PlanningInputs | None:
        """The job's constraints, GPU memory and measured speeds: the operator's planning inputs
        (None until the job has been read once with a valid spec)."""
        if refresh or self._planning is None:
            try:
                self._update_planning(self.read_job())
            except Exception as e:  # the API server may be restarting: plan with what we had
                log.warning("reading job %s/%s: %s", self.namespace, self.job, e)
        return self._planning

    def _update_planning(self, job: dict[str, Any]) -> None:
        try:
            spec = read_spec(job.get("spec") or {})
            speeds = dict(Telemetry.from_status(job.get("status") or {}).speeds)
        except (ConfigError, InvalidStatus) as e:
            log.warning("job %s/%s: cannot plan from it: %s", self.namespace, self.job, e)
            return
        self._planning = PlanningInputs(constraints_for(spec), spec.workers.gpu_memory_bytes, speeds,
                                        spec.elasticity.adaptive)

    # ---- PlanSource --------------------------------------------------------------------------
    def poll(self) -> PlanRequest | None:
        now = self.clock()
        if now < self._next_poll:
            return None
        self._next_poll = now + self.poll_interval
        try:
            job = self.read_job()
        except Exception as e:  # API server restarting: try again next poll
            log.warning("reading job %s/%s: %s", self.namespace, self.job, e)
            return None
        self._update_planning(job)
        status = job.get("status") or {}
        try:
            plan = StatusPlan.from_status(status)
            done = max(PlanAck.from_status(status).generation, PlanAbort.from_status(status).generation)
        except InvalidStatus as e:  # reported once, never raised: the coordinator keeps running
            if str(e) != self._bad_status:
                self._bad_status = str(e)
                log.error("job %s/%s: ignoring a malformed status: %s", self.namespace, self.job, e)
            return None
        if plan is None or plan.generation <= max(self.handled, done):
            return None
        return self._request_for(plan, now)

    def _request_for(self, plan: StatusPlan, now: float) -> PlanRequest | None:
        gen = plan.generation
        reason = f"operator plan {gen}: {plan.reason}".strip()
        deadline = plan.deadline.timestamp() if plan.deadline else None
        cause = str(plan.cause) if plan.cause else None
        if plan.is_stop:
            # A stop: the running world saves a checkpoint; a later plan with members restores it.
            self.handled = gen
            if not self.current.get("config"):  # nothing is running (already stopped, or not started)
                self._ack(gen, self.wall())
                return None
            self.awaiting = gen
            self._handed[gen] = plan
            log.info("operator plan %d: stop (%s)", gen, plan.reason)
            return PlanRequest(members=(), config="", reason=reason, deadline=deadline, cause=cause)
        members = plan.worker_ids()
        idle = self.current.get("pending") is None
        running = tuple(self.current.get("members") or ())
        if plan.observed_world is not None:
            # The operator recording a world the runtime made: it runs already (acked), or the
            # runtime has moved on since (the operator records that world next): never a transition.
            self.handled = gen
            if idle and running == members and same_config(self.current.get("config"), plan.config):
                self._ack(gen, self.wall(), runtime=self.current.get("generation"))
            else:
                log.info("operator plan %d records runtime generation %s, which no longer runs: nothing to do",
                         gen, plan.observed_world)
            return None
        first = self._waiting_since.setdefault(gen, now)
        gone = self.dead_pods(members, plan)
        if gone:
            # the coordinator's verdict on the very pod the plan names: it will not come up
            self.handled = gen
            self._abort(gen, f"worker(s) {', '.join(gone[:3])} of the pod the plan names are dead")
            return None
        missing = self.not_up(members, plan)
        if missing:
            due = members_due(plan)
            if due is None:  # a plan without times: counted from when it was first read
                if now - first < Defaults.MEMBERS_UP_TIMEOUT:
                    return None
                why = f"in {Defaults.MEMBERS_UP_TIMEOUT:.0f} s"
            elif self.wall() < due.timestamp():
                return None
            else:
                why = f"by the plan's deadline ({iso(due)})"
            self.handled = gen
            self._abort(gen, f"worker(s) {', '.join(missing[:3])} did not come up {why}")
            return None
        self.handled = gen
        if idle and running == members and same_config(self.current.get("config"), plan.config):
            log.info("operator plan %d matches the running world (runtime generation %s): acked",
                     gen, self.current.get("generation"))
            self._ack(gen, self.wall(), runtime=self.current.get("generation"))
            return None
        self.awaiting = gen
        self._handed[gen] = plan
        log.info("operator plan %d: %s on %d workers (%s)", gen, plan.config, len(members), plan.reason)
        return PlanRequest(members=members, config=plan.config, reason=reason, deadline=deadline, cause=cause)

    def dead_pods(self, members: tuple[str, ...], plan: StatusPlan) -> list[str]:
        """Members the coordinator judged dead whose registration is from the pod the plan names
        (not a predecessor of the same name): that pod's process is gone, and a new process
        comes only with a new pod (a plan of its own). A frozen process that the verdict cut off
        and that rejoins as a new member of the same pod is re-admitted at the coordinator's next
        report: a plan aborted in between is planned again after the operator's back-off."""
        assert self.store is not None
        dead = set(self.current.get("dead") or ())
        out = []
        for m in members:
            uid = plan.member_uids.get(pod_of(m))
            if m not in dead or not uid:
                continue
            reg = self._registration(m)
            if reg is not None and reg.pod_uid == uid:
                out.append(m)
        return out

    def _registration(self, worker: str) -> Registration | None:
        assert self.store is not None
        try:
            return Registration.parse(worker, self.store.get_json(Keys.member(worker)))
        except ValueError:  # not JSON: read as absent
            return None

    def not_up(self, members: tuple[str, ...], plan: StatusPlan | None = None) -> list[str]:
        """Members that are not up yet: not registered from the pod the plan names (a registration
        of an earlier pod of the same name stays in the store; ``plan.member_uids``), not yet
        heartbeating as the process that registered (the key still holds an earlier process's
        beats, or beats that say it ended), or judged dead by the coordinator (its liveness
        verdict, ``status.dead``). A plan handed on before would have its joiner judged by a
        predecessor's beats: "died during the transition". Identity only, no clock: liveness is
        the coordinator's to judge."""
        assert self.store is not None
        dead = set(self.current.get("dead") or ())
        uids = plan.member_uids if plan is not None else {}
        return [m for m in members if m in dead or self._up_as(m, uids.get(pod_of(m))) is None]

    def _up_as(self, worker: str, uid: str | None) -> Registration | None:
        """``worker``'s registration if it is up: registered (from the pod ``uid``, when given;
        a registration of an earlier pod of the same name stays in the store) and heartbeating
        as the process that registered; else None."""
        reg = self._registration(worker)
        if reg is None or (uid and reg.pod_uid and reg.pod_uid != uid):
            return None
        try:
            beat = Heartbeat.parse(self.store.get_json(Keys.heartbeat(worker)))  # type: ignore[union-attr]
        except ValueError:  # not JSON: read as absent
            return None
        if beat is None or beat.ended or (reg.incarnation and beat.incarnation
                                          and beat.incarnation != reg.incarnation):
            return None
        return reg

    def standby(self, status: dict[str, Any]) -> StandbyPods:
        """The pods outside the running world whose every registered worker is up (by the pod
        uid each registered from): ``status.standby``."""
        assert self.store is not None
        dead = set(status.get("dead") or ())
        world = {pod_of(m) for m in status.get("members") or ()}
        by_pod: dict[str, list[str]] = {}
        for m in dict.fromkeys(self.store.members()):
            if pod_of(m) not in world:
                by_pod.setdefault(pod_of(m), []).append(m)
        pods: dict[str, str] = {}
        for pod, workers in by_pod.items():
            regs = [None if m in dead else self._up_as(m, None) for m in workers]
            uids = {r.pod_uid for r in regs if r is not None}
            if all(r is not None for r in regs) and len(uids) == 1 and None not in uids:
                pods[pod] = str(uids.pop())
        return StandbyPods(pods)

    def report(self, status: dict[str, Any]) -> None:
        self.current = status
        history = status.get("history") or []
        if self.awaiting is not None:
            # The report right after poll handed a request on is about that request: either
            # the coordinator published it (pending) or rejected it (a history entry without one).
            if status.get("pending") is not None:
                self.runtime_of[self.awaiting] = int(status["pending"])
                self.awaiting = None
            elif history and history[-1].get("generation") is None:
                self._abort(self.awaiting, history[-1].get("outcome", "rejected"))
                self.awaiting = None
        by_runtime = {h["generation"]: h for h in history if h.get("generation") is not None}
        answers: list[tuple[int, str | None]] = []  # (operator generation, None: ack / why it is aborted)
        for op_gen, rt_gen in sorted(self.runtime_of.items()):
            entry = by_runtime.get(rt_gen)
            if op_gen in self.answered or op_gen in self._unwritten or entry is None:
                continue
            if entry["outcome"] != "committed":
                answers.append((op_gen, entry["outcome"]))
                continue
            plan = self._handed.get(op_gen)
            if entry.get("config") is None and status.get("generation") == rt_gen:  # an entry without the world
                entry = {**entry, "config": status.get("config") or "", "world_size": len(status.get("members") or ())}
            if plan is None or self._ran(entry, plan):
                self._plan_of[rt_gen] = op_gen
                answers.append((op_gen, None))
            else:
                # Never acked as applied: the status would show a world that does not run.
                answers.append((op_gen, f"the runtime committed {entry.get('config') or 'a stop'} on "
                                        f"{entry.get('world_size') or 0} GPUs (generation {rt_gen}), not the plan's "
                                        f"{plan.config} on {plan.world_size}"))
        # The world first, then the answers: the operator never sees an ack with the world before it.
        self._report_world(status, by_runtime)
        for op_gen, why in answers:
            if why is None:
                self._ack(op_gen, self.wall())
            else:
                self._abort(op_gen, why)
        for op_gen, patch in sorted(self._unwritten.items()):  # answers the API refused before
            if self._write(patch):
                self.answered.add(op_gen)
                del self._unwritten[op_gen]
        now = self.clock()
        failure = status.get("failure")
        if failure and not self._failure_written:
            self._failure_written = self._write(RuntimeFailure(str(failure.get("reason")), str(failure.get("message")),
                                                               parse_time(failure.get("time"))).to_status())
        checkpoints = CheckpointReport.from_coordinator(status.get("checkpoints") or {}).to_status()
        if checkpoints != self._checkpoints_written and self._write(checkpoints):
            self._checkpoints_written = checkpoints
        self._report_progress(status, now)
        self._report_waiting(status, now)
        if self.store is not None and now >= self._next_standby:  # (a source without a store: tests)
            self._next_standby = now + STANDBY_INTERVAL
            standby = self.standby(status).to_status()
            if standby != self._standby_written and self._write(standby):
                self._standby_written = standby
        health = status.get("health") or {}
        stragglers = self._stragglers(status)
        changed = tuple(s.device for s in stragglers) != self._stragglers_written
        if now >= self._next_speeds or changed:
            speeds = pod_speeds(health)
            if speeds and self._write(Telemetry(speeds, stragglers).to_status()):
                self._next_speeds = now + SPEEDS_INTERVAL
                self._stragglers_written = tuple(s.device for s in stragglers)
        adaptive = AdaptiveReport.from_coordinator(health.get("adaptive") or {}).to_status()
        if adaptive != self._adaptive_written and self._write(adaptive):
            self._adaptive_written = adaptive

    def _report_progress(self, status: dict[str, Any], now: float) -> None:
        """``status.progress`` every ``PROGRESS_INTERVAL`` seconds; ``finishedAt`` once, when
        training reached trainIters (written again at the next report until the API takes it)."""
        finished = status.get("finished")
        if finished and not self._finished_written:
            patch = Finished(parse_time(finished.get("time")) or datetime.now(UTC), int(finished.get("step") or 0),
                             finished.get("checkpoint")).to_status()
            if status.get("progress"):
                patch.update(Progress.from_coordinator(status["progress"]).to_status())
            self._finished_written = self._write(patch)
            return
        if status.get("progress") and now >= self._next_progress:
            self._next_progress = now + PROGRESS_INTERVAL
            self._write(Progress.from_coordinator(status["progress"]).to_status())

    def _report_waiting(self, status: dict[str, Any], now: float) -> None:
        """``status.waiting``: at once when what the coordinator waits for changes (or it stops
        waiting), else every ``PROGRESS_INTERVAL`` seconds (its seconds move at every report)."""
        reason = Waiting.from_coordinator(status).reason
        what = None if reason is None else re.sub(r"[0-9.]+ s", "", reason)
        due = what != self._waiting_what or (reason is not None and now >= self._next_waiting)
        if due and self._write(Waiting(reason).to_status()):
            self._waiting_what, self._next_waiting = what, now + PROGRESS_INTERVAL

    def _stragglers(self, status: dict[str, Any]) -> tuple[Straggler, ...]:
        """The coordinator's straggler summary (``telemetry.SpeedTracker``): each slow device,
        since when, and the measurements that say so."""
        health = status.get("health") or {}
        members = health.get("members") or {}
        reference = health.get("reference_seconds_per_unit")
        now = self.wall()
        out = []
        for device in sorted(set(health.get("stragglers") or ())):
            m = members.get(device) or {}
            rate = m.get("seconds_per_unit")
            evidence = (f"compute {rate * 1e3:.2f} ms per layer unit vs the median device's {reference * 1e3:.2f} ms "
                        f"(median of {m.get('samples')} steps, waits excluded)"
                        if rate and reference else "compute time per layer unit")
            if m.get("throttled"):
                evidence += "; GPU reports hardware throttling"
            out.append(Straggler(pod_of(device), device, float(m.get("speed") or 1.0),
                                 parse_time(m.get("slow_since") or now), evidence))
        return tuple(out)

    @staticmethod
    def _ran(entry: dict[str, Any], plan: StatusPlan) -> bool:
        """Whether a committed runtime generation (its history entry) is ``plan`` as written: the
        same config on as many GPUs (the coordinator keeps an operator plan's rank order and may
        only leave out members that are not up, so the same count is the same members)."""
        if plan.is_stop:
            return not entry.get("config")
        return same_config(entry.get("config"), plan.config) and int(entry.get("world_size") or 0) == plan.world_size

    def _report_world(self, status: dict[str, Any], by_runtime: dict[int, dict[str, Any]]) -> None:
        """``status.world``: the world the coordinator reports it runs, written when it changes
        (a commit, or an operator plan acked as that world)."""
        gen = status.get("generation")
        if gen is None:
            return
        gen = int(gen)
        workers = tuple(status.get("members") or ())
        entry = by_runtime.get(gen) or {}
        at = self._committed_at.setdefault(gen, self.wall())
        world = CommittedWorld(generation=gen, config=str(status.get("config") or ""), members=pods_of(workers),
                               world_size=len(workers), plan_generation=self._plan_of.get(gen),
                               cause=cause_of(entry.get("cause")), reason=str(entry.get("reason") or ""),
                               committed_at=parse_time(at))
        if world != self._world_written and self._write(world.to_status()):
            self._world_written = world

    def _ack(self, op_gen: int, at: float, runtime: int | None = None) -> None:
        """Ack ``op_gen``; ``runtime``: the running runtime generation it is (acked without a
        transition), which ``status.world`` then names as that plan."""
        if runtime is not None:
            self._plan_of[int(runtime)] = op_gen
            self._report_world(self.current, {h["generation"]: h for h in self.current.get("history") or ()
                                              if h.get("generation") is not None})
        self._answer(op_gen, PlanAck(op_gen, parse_time(at)).to_status())

    def _abort(self, op_gen: int, reason: str) -> None:
        log.warning("operator plan %d aborted: %s", op_gen, reason)
        self._answer(op_gen, PlanAbort(op_gen, reason).to_status())

    def _answer(self, op_gen: int, patch: dict[str, Any]) -> None:
        """Write an ack or abort; one the API refuses is written again at the next report."""
        if self._write(patch):
            self.answered.add(op_gen)
            self._unwritten.pop(op_gen, None)
        else:
            self._unwritten[op_gen] = patch

    def _write(self, status: dict[str, Any]) -> bool:
        """Merge ``status`` into the job's status; False if the API refused it five times
        (an ack not written is written again at the next report: it is idempotent)."""
        for attempt in range(5):
            try:
                self.patch_status(status)
                return True
            except Exception as e:
                log.warning("writing %s to job %s/%s: %s", sorted(status), self.namespace, self.job, e)
                time.sleep(0.2 * (attempt + 1))
        return False

