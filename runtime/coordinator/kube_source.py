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
``runtime_of``. When that runtime generation commits, the operator generation is acked; when it
aborts (or the coordinator rejects the request), the operator generation is reported aborted.
An operator plan whose members and config equal the world already running (typically the
operator catching up with a recovery the runtime already made) needs no new world: it is acked
at once. Runtime-only generations are never written to the job.

A pod the operator sees ``Running`` may still be importing torch and megatron: a plan is handed
on only when every member has registered in the store and heartbeats (a joiner that is not up
would stall the other members' preparation). A plan whose members do not all come up within
``REGISTER_TIMEOUT`` is reported aborted; the operator then plans again.

A stop plan (``config: ""``, no members) becomes a stop request: the running world saves a
checkpoint to the job's checkpoint directory and every worker waits; it is acked once saved. The
next plan with members restores that checkpoint under its own config.

A worker id is ``<pod>/<local rank>``: a member pod with ``gpusPerWorker = g`` stands for the
workers ``<pod>/0 .. <pod>/g-1``, so rank ``r`` is local GPU ``r % g`` of pod ``members[r // g]``.

When the coordinator must plan alone (a member lost without notice), it plans from the job's
spec and measured speeds (``planning``), exactly as the operator does, so the operator's own plan
for the same loss finds the world already running and is acked at once.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from liveshard.runtime.contract.causes import LOSSES
from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION
from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.status import (
    AdaptiveReport,
    CheckpointReport,
    Finished,
    InvalidStatus,
    PlanAbort,
    PlanAck,
    Progress,
    RuntimeFailure,
    StatusPlan,
    Straggler,
    Telemetry,
    pod_of,
)
from liveshard.runtime.contract.times import parse_time
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator.requests import PlanningInputs, PlanRequest
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.pods import constraints_for

log = logging.getLogger("liveshard.kube_source")

SPEEDS_INTERVAL = 30.0  # seconds between speed reports (they feed the next plan, not this one)
PROGRESS_INTERVAL = 10.0  # seconds between status.progress updates (kubectl get etj's Step and Loss)
REGISTER_TIMEOUT = 300.0  # how long a plan waits for its joining workers to come up
# Plans for a loss the operator saw (node gone, unreachable, pod failed) may arrive before the
# coordinator's heartbeat timeout: wait this long for it to declare the leavers dead and recover.
LOSS_GRACE = 8.0


def same_config(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    return str(ParallelConfig.parse(a)) == str(ParallelConfig.parse(b))


def pod_speeds(health: dict) -> dict[str, float]:
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
                 poll_interval: float = 0.5) -> None:
        import kubernetes.client

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
        self._next_poll = 0.0
        self._next_speeds = 0.0
        self._next_progress = 0.0
        self._finished_written = False
        self._failure_written = False
        self._checkpoints_written: dict | None = None
        self._waiting_since: dict[int, float] = {}  # operator generation -> first seen (members not up)
        self._planning: PlanningInputs | None = None
        self._unwritten: dict[int, dict[str, Any]] = {}  # operator generation -> ack/abort to write again
        self._stragglers_written: tuple[str, ...] = ()  # the devices status.stragglers names
        self._adaptive_written: dict | None = None
        self._bad_status: str | None = None  # the last malformed status field reported

    # ---- the job -----------------------------------------------------------------------------
    def read_job(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.job)

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
            spec = read_spec(job.get("spec"))
            speeds = dict(Telemetry.from_status(job.get("status") or {}).speeds)
        except (ConfigError, InvalidStatus) as e:
            log.warning("job %s/%s: cannot plan from it: %s", self.namespace, self.job, e)
            return
        self._planning = PlanningInputs(constraints_for(spec), spec.workers.gpu_memory_bytes, speeds,
                                        spec.elasticity.adaptive)

    # ---- PlanSource --------------------------------------------------------------------------
    def poll(self) -> PlanRequest | None:
        now = time.monotonic()
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
                self._ack(gen, time.time())
                return None
            self.awaiting = gen
            log.info("operator plan %d: stop (%s)", gen, plan.reason)
            return PlanRequest(members=(), config="", reason=reason, deadline=deadline, cause=cause)
        members = plan.worker_ids()
        first = self._waiting_since.setdefault(gen, now)
        missing = self.not_up(members)
        if not missing and plan.cause in LOSSES and now - first < LOSS_GRACE:
            dead = set(self.current.get("dead") or ())
            running = set(self.current.get("members") or ())
            if any(w not in dead for w in plan.leaving_worker_ids() if w in running):
                return None
        if missing:
            if now - first < REGISTER_TIMEOUT:
                return None
            self.handled = gen
            self._abort(gen, f"worker(s) {', '.join(missing[:3])} did not come up in {REGISTER_TIMEOUT:.0f} s")
            return None
        self.handled = gen
        running = tuple(self.current.get("members") or ())
        leaving = set(plan.leaving_worker_ids())
        if plan.cause in LOSSES and self.current.get("pending") is None and running and leaving \
                and not leaving & set(running):
            # One authority per event: a loss without notice is the runtime's to recover (it sees
            # it first), and it already did. The operator's plan for the same loss is recorded as
            # that world, never made a second transition.
            log.info("operator plan %d (%s): the runtime already recovered from the loss (generation %s, %s): "
                     "acked as observed", gen, plan.cause, self.current.get("generation"), self.current.get("config"))
            self._ack(gen, time.time())
            return None
        if (self.current.get("pending") is None and running == members
                and same_config(self.current.get("config"), plan.config)):
            log.info("operator plan %d matches the running world (runtime generation %s): acked",
                     gen, self.current.get("generation"))
            self._ack(gen, time.time())
            return None
        self.awaiting = gen
        log.info("operator plan %d: %s on %d workers (%s)", gen, plan.config, len(members), plan.reason)
        return PlanRequest(members=members, config=plan.config, reason=reason, deadline=deadline, cause=cause)

    def not_up(self, members: tuple[str, ...]) -> list[str]:
        """Members that have not registered with the coordinator, or that it judges dead (its
        liveness verdict, ``status.dead``: nobody here judges heartbeats again)."""
        assert self.store is not None
        dead = set(self.current.get("dead") or ())
        return [m for m in members if m in dead or not self.store.has(Keys.member(m))]

    def report(self, status: dict) -> None:
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
        for op_gen, rt_gen in sorted(self.runtime_of.items()):
            entry = by_runtime.get(rt_gen)
            if op_gen in self.answered or op_gen in self._unwritten or entry is None:
                continue
            if entry["outcome"] == "committed":
                self._ack(op_gen, time.time())
            else:
                self._abort(op_gen, entry["outcome"])
        for op_gen, patch in sorted(self._unwritten.items()):  # answers the API refused before
            if self._write(patch):
                self.answered.add(op_gen)
                del self._unwritten[op_gen]
        now = time.monotonic()
        failure = status.get("failure")
        if failure and not self._failure_written:
            self._failure_written = self._write(RuntimeFailure(str(failure.get("reason")), str(failure.get("message")),
                                                               parse_time(failure.get("time"))).to_status())
        checkpoints = CheckpointReport.from_coordinator(status.get("checkpoints") or {}).to_status()
        if checkpoints != self._checkpoints_written and self._write(checkpoints):
            self._checkpoints_written = checkpoints
        self._report_progress(status, now)
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

    def _report_progress(self, status: dict, now: float) -> None:
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

    def _stragglers(self, status: dict) -> tuple[Straggler, ...]:
        """The coordinator's straggler summary (``telemetry.SpeedTracker``): each slow device,
        since when, and the measurements that say so."""
        health = status.get("health") or {}
        members = health.get("members") or {}
        reference = health.get("reference_seconds_per_unit")
        now = time.time()
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

    def _ack(self, op_gen: int, at: float) -> None:
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

