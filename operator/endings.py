"""How a job ends: ``Succeeded`` at trainIters, or ``Failed`` on its budget of crashed pods, on
a configuration error every worker pod repeats, or on the runtime's own report. Part of
``reconcile._Reconciler`` (its end phase, beside ``planning.Planning``); pure."""

from __future__ import annotations

from typing import Any

from liveshard.operator import tracking
from liveshard.operator.conditions import condition
from liveshard.operator.observed import Worker
from liveshard.runtime.cli import EXIT_BAD_INPUT
from liveshard.runtime.contract.causes import Cause
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


def status_count(value: Any) -> int:
    """A counter from the status; a malformed one reads as 0 (never raised)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


class Endings:
    """Mixed into the reconciler: the phases that end a job. Reads and writes the reconciler's
    state (``self.d``, ``self.status``, ``self.tracking`` and ``self.track``, ``self.conditions``,
    ``self.pods``, ``self.spec``)."""

    def _succeeded(self, finished: Finished) -> None:
        """Training reached trainIters and its final checkpoint is complete: the job is done.
        Nothing is planned or created any more (an operator restart reads the same status); the
        coordinator pod, which restarts on exit, is deleted. Nothing else of the job may keep
        running or pending (a worker pod re-created while the run ended would hold, or wait for,
        a GPU): pending worker pods are deleted at once, running ones once the run has been over
        for ``FINISHED_WORKER_GRACE_SECONDS`` (the members exit 0 by themselves right after the
        final checkpoint). Worker pods that exited stay for their logs."""
        st, d = self.d.status, self.d
        where = f"; final checkpoint {finished.checkpoint}" if finished.checkpoint else ""
        message = f"trained {finished.step} steps{where}"
        if self.status.get("phase") != JobPhase.SUCCEEDED:
            self.event("Normal", "Succeeded", message)
        st["phase"] = JobPhase.SUCCEEDED
        st["message"] = message
        d.create_coordinator = False
        d.requeue_after = FAILED_REQUEUE_SECONDS
        wait = FINISHED_WORKER_GRACE_SECONDS - (self.now - finished.at).total_seconds()
        for p in self.pods:
            meta = p.get("metadata") or {}
            role = (meta.get("labels") or {}).get(LABEL_ROLE)
            phase = (p.get("status") or {}).get("phase") or "Pending"
            if meta.get("deletionTimestamp") or role not in (ROLE_COORDINATOR, ROLE_WORKER):
                continue
            if role == ROLE_WORKER and phase in ("Succeeded", "Failed"):
                continue  # exited: kept for its logs
            if role == ROLE_WORKER and phase != "Pending" and wait > 0:
                d.requeue_after = min(d.requeue_after, wait + 0.1)  # let it exit on its own first
                continue
            d.delete_pods.append(meta["name"])
        self.cond(ConditionType.SUCCEEDED, True, "TrainItersReached", message)
        self.cond(ConditionType.READY, False, "Succeeded", message)
        self.cond(ConditionType.RECONFIGURING, False, "Idle", "")
        st["conditions"] = self.conditions
        st["history"] = self.history[-HISTORY_LIMIT:]

    # -- failed pods and the job's budget for them --
    def _failure_budget_spent(self, workers: list[Worker]) -> bool:
        """Note the worker pods that crashed since the last pass; whether, with them, more have
        failed than ``spec.elasticity.maxPodFailures`` allows."""
        counted = set(self.tracking[tracking.COUNTED])
        self.pod_failures = status_count(self.status.get("podFailures"))
        self.crashed = [w for w in workers if w.dead and not w.deleting and w.signal is not None
                        and w.signal.kind == Cause.POD_FAILED and w.signal.failure and w.uid not in counted]
        limit = self.spec.elasticity.max_pod_failures
        return limit is not None and self.pod_failures + len(self.crashed) > limit

    def _failed(self, workers: list[Worker]) -> None:
        """More worker pods failed than the job allows: the job has failed. Nothing is planned or
        created; pods still running or pending are deleted (their GPUs are released), failed ones
        are kept for their logs. Raising ``maxPodFailures`` (or removing it) resumes the job."""
        total = self._count_crashed()
        limit = self.spec.elasticity.max_pod_failures
        message = (f"{total} worker pods failed, more than spec.elasticity.maxPodFailures={limit}: the job "
                   "has failed and its running pods are deleted (raise maxPodFailures to resume it)")
        old = condition(self.conditions, ConditionType.FAILED)
        if not (old and old.get("status") == "True"):
            last = "; ".join(f"{w.name}: {w.signal.reason}" for w in self.crashed if w.signal)
            self.event("Warning", "PodFailureBudgetExceeded", message + (f"; last: {last}" if last else ""))
        self._fail_job(workers, "PodFailureBudgetExceeded", message)

    def _count_crashed(self) -> int:
        """Count the pods that crashed since the last pass (the job's pod failures, now)."""
        st, d = self.d.status, self.d
        total = self.pod_failures + len(self.crashed)
        if self.crashed:
            counted = [*self.tracking[tracking.COUNTED], *(w.uid for w in self.crashed)]
            d.new_failures = len(self.crashed)
            st["failures"] = status_count(self.status.get("failures")) + len(self.crashed)
            self.track(tracking.COUNTED, counted[-tracking.COUNTED_LIMIT:])
            st["podFailures"] = total
        return total

    # -- a configuration error: the same bad input from worker pod after worker pod --
    def _config_error(self, workers: list[Worker]) -> bool:
        """Note the worker pods that exited ``EXIT_BAD_INPUT`` since the last pass in
        ``status.tracking.configError`` (the message, how many in a row, the job generation); whether
        ``CONFIG_ERROR_LIMIT`` of them said the same. Another exit, or a job training (an
        applied plan with GPUs and a worker pod running: the input works for some), clears the
        count; a new spec generation resumes a job this failed."""
        old = self.tracking[tracking.CONFIG_ERROR] or {}
        generation = self.meta.get("generation")
        message, count = str(old.get("message") or ""), status_count(old.get("count"))
        if old and old.get("generation") != generation:
            message, count, self.resume_reason = "", 0, "SpecChanged"  # the spec was edited: try it
        plan = self.plan
        applied = status_count(self.status.get("worldSize")) > 0 or (
            plan is not None and bool(plan.members) and self.ack.generation >= plan.generation)
        if applied and any(w.running for w in workers):
            message, count = "", 0  # training (an applied plan has GPUs, a pod runs): the input works
        else:
            for w in self.crashed:
                sig = w.signal
                if sig is not None and sig.exit_code == EXIT_BAD_INPUT:
                    said = sig.termination or f"exit code {EXIT_BAD_INPUT} (no message)"
                    message, count = said, (count + 1 if said == message else 1)
                else:
                    message, count = "", 0
        new = {"message": message, "count": count, "generation": generation} if count else None
        if new != (old or None):
            self.track(tracking.CONFIG_ERROR, new)
        self.config_error = new
        return new is not None and count >= CONFIG_ERROR_LIMIT

    def _config_failed(self, workers: list[Worker]) -> None:
        """Worker pods keep exiting on the same bad input: the job has failed with the workers'
        own message. Nothing is planned or created; pods still running or pending (and the
        coordinator) are deleted, failed ones stay for their logs. A new spec resumes the job."""
        assert self.config_error is not None
        self._count_crashed()
        line, count = self.config_error["message"], self.config_error["count"]
        message = (f"{line} (worker pods exited {EXIT_BAD_INPUT}, bad input, {count} times in a row with this "
                   "message: fix the job's spec and the job starts again)")
        old = condition(self.conditions, ConditionType.FAILED)
        if not (old and old.get("status") == "True" and old.get("reason") == "WorkerConfigError"):
            self.event("Warning", "WorkerConfigError", message)
        self._fail_job(workers, "WorkerConfigError", message)

    def _fail_job(self, workers: list[Worker], reason: str, message: str) -> None:
        """The job ends ``Failed`` for ``reason``: phase, message and conditions say why, and its
        running pods are released."""
        st = self.d.status
        st["phase"] = JobPhase.FAILED
        st["message"] = message
        self.cond(ConditionType.FAILED, True, reason, message)
        self.cond(ConditionType.READY, False, reason, message)
        self.cond(ConditionType.RECONFIGURING, False, "Idle", "")
        self._release(workers)
        st["conditions"] = self.conditions
        st["history"] = self.history[-HISTORY_LIMIT:]
        self.d.requeue_after = FAILED_REQUEUE_SECONDS

    def _release(self, workers: list[Worker]) -> None:
        """Delete the coordinator and every worker pod still running or pending; create nothing."""
        d = self.d
        d.create_coordinator = False
        for w in workers:
            if not w.deleting and not w.dead:
                d.delete_pods.append(w.name)
        for p in self.pods:
            meta = p.get("metadata") or {}
            if (meta.get("labels") or {}).get(LABEL_ROLE) == ROLE_COORDINATOR and not meta.get("deletionTimestamp"):
                d.delete_pods.append(meta["name"])
        d.status["replicas"] = sum(1 for w in workers if not w.deleting and w.name not in d.delete_pods)

    def _runtime_failed(self, failure: RuntimeFailure, workers: list[Worker]) -> None:
        """The runtime reported that the run cannot go on (e.g. state lost with no surviving
        copy and no checkpoint): the job has failed. Its workers were told to stop; their pods
        and the coordinator's are deleted (the GPUs are released), and nothing is created."""
        st, d = self.d.status, self.d
        message = f"{failure.message} (the runtime cannot continue the run)"
        old = condition(self.conditions, ConditionType.FAILED)
        if not (old and old.get("status") == "True"):
            self.event("Warning", failure.reason, message)
        st["phase"] = JobPhase.FAILED
        st["message"] = message
        self.cond(ConditionType.FAILED, True, failure.reason, message)
        self.cond(ConditionType.READY, False, failure.reason, message)
        self.cond(ConditionType.RECONFIGURING, False, "Idle", "")
        d.create_coordinator = False
        d.delete_pods.extend(w.name for w in workers if not w.deleting)
        for p in self.pods:
            meta = p.get("metadata") or {}
            if (meta.get("labels") or {}).get(LABEL_ROLE) == ROLE_COORDINATOR and not meta.get("deletionTimestamp"):
                d.delete_pods.append(meta["name"])
        st["conditions"] = self.conditions
        st["history"] = self.history[-HISTORY_LIMIT:]
        d.requeue_after = FAILED_REQUEUE_SECONDS
