"""How a job ends: ``Succeeded`` at trainIters, or ``Failed`` on its budget of crashed pods, on
a configuration error every worker pod repeats, or on the runtime's own report. The end phases
of ``reconcile``: functions of the pass's ``Observation`` that write into its ``Outputs``; pure."""

from __future__ import annotations

from typing import Any

from liveshard.operator import tracking
from liveshard.operator.conditions import condition
from liveshard.operator.observation import Observation, Outputs, cond, status_count, track
from liveshard.runtime.cli import EXIT_BAD_INPUT
from liveshard.runtime.contract.crd import LABEL_ROLE, ROLE_COORDINATOR, ROLE_WORKER
from liveshard.runtime.contract.status import ConditionType, Finished, JobPhase, RuntimeFailure

HISTORY_LIMIT = 20  # entries kept in status.history
FAILED_REQUEUE_SECONDS = 300.0
# After the run's end (status.finishedAt), the seconds a worker pod still running has to exit by
# itself before it is deleted: anything running later (a pod re-created as the run ended) would
# hold its GPU for nothing.
FINISHED_WORKER_GRACE_SECONDS = 30.0
# Worker pods that exit with the runtime's "bad input" code and the same one-line message, one
# after another while the job is not training: a configuration error no re-creation will fix.
# The job fails after this many (a job of several pods, all failing at once, at its first try).
CONFIG_ERROR_LIMIT = 3


def close(out: Outputs) -> None:
    """Write the conditions and the (bounded) history this pass built into the status."""
    out.decision.status["conditions"] = out.conditions
    out.decision.status["history"] = out.history[-HISTORY_LIMIT:]


def _coordinators(o: Observation) -> list[str]:
    """The names of the job's coordinator pods not being deleted."""
    names = []
    for p in o.pods:
        meta = p.get("metadata") or {}
        if (meta.get("labels") or {}).get(LABEL_ROLE) == ROLE_COORDINATOR and not meta.get("deletionTimestamp"):
            names.append(meta["name"])
    return names


def succeeded(o: Observation, out: Outputs, finished: Finished) -> None:
    """Training reached trainIters and its final checkpoint is complete: the job is done.
    Nothing is planned or created any more (an operator restart reads the same status); the
    coordinator pod, which restarts on exit, is deleted. Nothing else of the job may keep
    running or pending (a worker pod re-created while the run ended would hold, or wait for,
    a GPU): pending worker pods are deleted at once, running ones once the run has been over
    for ``FINISHED_WORKER_GRACE_SECONDS`` (the members exit 0 by themselves right after the
    final checkpoint). Worker pods that exited stay for their logs."""
    d = out.decision
    where = f"; final checkpoint {finished.checkpoint}" if finished.checkpoint else ""
    message = f"trained {finished.step} steps{where}"
    if o.status.get("phase") != JobPhase.SUCCEEDED:
        out.event("Normal", "Succeeded", message)
    d.status["phase"] = JobPhase.SUCCEEDED
    d.status["message"] = message
    d.create_coordinator = False
    d.requeue_after = FAILED_REQUEUE_SECONDS
    wait = FINISHED_WORKER_GRACE_SECONDS - (o.now - finished.at).total_seconds()
    for p in o.pods:
        meta = p.get("metadata") or {}
        role = (meta.get("labels") or {}).get(LABEL_ROLE)
        phase = (p.get("status") or {}).get("phase") or "Pending"
        if meta.get("deletionTimestamp") or role not in (ROLE_COORDINATOR, ROLE_WORKER):
            continue
        if role == ROLE_WORKER and phase in ("Succeeded", "Failed"):
            continue  # exited: kept for its logs
        if role == ROLE_WORKER and phase != "Pending" and wait > 0:
            out.requeue(wait + 0.1)  # let it exit on its own first
            continue
        d.delete_pods.append(meta["name"])
    cond(o, out, ConditionType.SUCCEEDED, True, "TrainItersReached", message)
    cond(o, out, ConditionType.READY, False, "Succeeded", message)
    cond(o, out, ConditionType.RECONFIGURING, False, "Idle", "")
    close(out)


# -- failed pods and the job's budget for them --
def failure_budget_spent(o: Observation) -> bool:
    """Whether, with the worker pods that crashed since the last pass, more have failed than
    ``spec.elasticity.maxPodFailures`` allows."""
    assert o.spec is not None
    limit = o.spec.elasticity.max_pod_failures
    return limit is not None and o.pod_failures + len(o.crashed) > limit


def failed(o: Observation, out: Outputs) -> None:
    """More worker pods failed than the job allows: the job has failed. Nothing is planned or
    created; pods still running or pending are deleted (their GPUs are released), failed ones
    are kept for their logs. Raising ``maxPodFailures`` (or removing it) resumes the job."""
    assert o.spec is not None
    total = _count_crashed(o, out)
    limit = o.spec.elasticity.max_pod_failures
    message = (f"{total} worker pods failed, more than spec.elasticity.maxPodFailures={limit}: the job "
               "has failed and its running pods are deleted (raise maxPodFailures to resume it)")
    old = condition(out.conditions, ConditionType.FAILED)
    if not (old and old.get("status") == "True"):
        last = "; ".join(f"{w.name}: {w.signal.reason}" for w in o.crashed if w.signal)
        out.event("Warning", "PodFailureBudgetExceeded", message + (f"; last: {last}" if last else ""))
    _fail_job(o, out, "PodFailureBudgetExceeded", message)


def _count_crashed(o: Observation, out: Outputs) -> int:
    """Count the pods that crashed since the last pass (the job's pod failures, now)."""
    st, d = out.decision.status, out.decision
    total = o.pod_failures + len(o.crashed)
    if o.crashed:
        counted = [*o.tracking[tracking.COUNTED], *(w.uid for w in o.crashed)]
        d.new_failures = len(o.crashed)
        st["failures"] = status_count(o.status.get("failures")) + len(o.crashed)
        track(o, out, tracking.COUNTED, counted[-tracking.COUNTED_LIMIT:])
        st["podFailures"] = total
    return total


# -- a configuration error: the same bad input from worker pod after worker pod --
def config_error(o: Observation, out: Outputs) -> bool:
    """Note the worker pods that exited ``EXIT_BAD_INPUT`` since the last pass in
    ``status.tracking.configError`` (the message, how many in a row, the job generation); whether
    ``CONFIG_ERROR_LIMIT`` of them said the same. Another exit, or a job training (an
    applied plan with GPUs and a worker pod running: the input works for some), clears the
    count; a new spec generation resumes a job this failed."""
    old: dict[str, Any] = o.tracking[tracking.CONFIG_ERROR] or {}
    generation = o.generation
    message, count = str(old.get("message") or ""), status_count(old.get("count"))
    if old and old.get("generation") != generation:
        message, count, out.resume_reason = "", 0, "SpecChanged"  # the spec was edited: try it
    plan = o.plan
    applied = status_count(o.status.get("worldSize")) > 0 or (
        plan is not None and bool(plan.members) and o.ack.generation >= plan.generation)
    if applied and any(w.running for w in o.workers):
        message, count = "", 0  # training (an applied plan has GPUs, a pod runs): the input works
    else:
        for w in o.crashed:
            sig = w.signal
            if sig is not None and sig.exit_code == EXIT_BAD_INPUT:
                said = sig.termination or f"exit code {EXIT_BAD_INPUT} (no message)"
                message, count = said, (count + 1 if said == message else 1)
            else:
                message, count = "", 0
    new = {"message": message, "count": count, "generation": generation} if count else None
    if new != (old or None):
        track(o, out, tracking.CONFIG_ERROR, new)
    out.config_error = new
    return new is not None and count >= CONFIG_ERROR_LIMIT


def config_failed(o: Observation, out: Outputs) -> None:
    """Worker pods keep exiting on the same bad input: the job has failed with the workers'
    own message. Nothing is planned or created; pods still running or pending (and the
    coordinator) are deleted, failed ones stay for their logs. A new spec resumes the job."""
    assert out.config_error is not None
    _count_crashed(o, out)
    line, count = out.config_error["message"], out.config_error["count"]
    message = (f"{line} (worker pods exited {EXIT_BAD_INPUT}, bad input, {count} times in a row with this "
               "message: fix the job's spec and the job starts again)")
    old = condition(out.conditions, ConditionType.FAILED)
    if not (old and old.get("status") == "True" and old.get("reason") == "WorkerConfigError"):
        out.event("Warning", "WorkerConfigError", message)
    _fail_job(o, out, "WorkerConfigError", message)


def _fail_job(o: Observation, out: Outputs, reason: str, message: str) -> None:
    """The job ends ``Failed`` for ``reason``: phase, message and conditions say why, and its
    running pods are released: the coordinator and every worker pod still running or pending
    are deleted; nothing is created."""
    d = out.decision
    d.status["phase"] = JobPhase.FAILED
    d.status["message"] = message
    cond(o, out, ConditionType.FAILED, True, reason, message)
    cond(o, out, ConditionType.READY, False, reason, message)
    cond(o, out, ConditionType.RECONFIGURING, False, "Idle", "")
    d.create_coordinator = False
    d.delete_pods.extend(w.name for w in o.workers if not w.deleting and not w.dead)
    d.delete_pods.extend(_coordinators(o))
    d.status["replicas"] = sum(1 for w in o.workers if not w.deleting and w.name not in d.delete_pods)
    close(out)
    d.requeue_after = FAILED_REQUEUE_SECONDS


def runtime_failed(o: Observation, out: Outputs, failure: RuntimeFailure) -> None:
    """The runtime reported that the run cannot go on (e.g. state lost with no surviving
    copy and no checkpoint): the job has failed. Its workers were told to stop; their pods
    and the coordinator's are deleted (the GPUs are released), and nothing is created."""
    d = out.decision
    message = f"{failure.message} (the runtime cannot continue the run)"
    old = condition(out.conditions, ConditionType.FAILED)
    if not (old and old.get("status") == "True"):
        out.event("Warning", failure.reason, message)
    d.status["phase"] = JobPhase.FAILED
    d.status["message"] = message
    cond(o, out, ConditionType.FAILED, True, failure.reason, message)
    cond(o, out, ConditionType.READY, False, failure.reason, message)
    cond(o, out, ConditionType.RECONFIGURING, False, "Idle", "")
    d.create_coordinator = False
    d.delete_pods.extend(w.name for w in o.workers if not w.deleting)
    d.delete_pods.extend(_coordinators(o))
    close(out)
    d.requeue_after = FAILED_REQUEUE_SECONDS
