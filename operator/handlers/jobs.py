"""Jobs: one reconcile loop per ElasticTrainingJob, woken by anything that concerns it.

The loop is a kopf daemon: it re-reads the job, takes its pods and the node signals from kopf's
indexes, asks ``reconcile`` what to do, writes the status (guarded by the job's
resourceVersion), then creates and deletes pods. It is the job's only writer in this operator,
and it holds nothing the job's status does not: a restarted operator simply starts it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from liveshard.operator import builders, kueue, metrics
from liveshard.operator.conditions import condition, set_condition
from liveshard.operator.context import Context, NodeView
from liveshard.operator.kube import Conflict, NotLeader
from liveshard.operator.reconcile import Decision, reconcile
from liveshard.runtime.contract.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION

ERROR_BACKOFF = 5.0
REFUSED_RETRY_SECONDS = 30.0  # a refused child (invalid, forbidden) is tried again this often
# A job behind a Kueue queue reads its Workload this often (the operator does not watch
# Workloads: a cluster without Kueue has no such resource to watch); an eviction is seen within it.
QUEUE_POLL_SECONDS = 2.0


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_changed(namespace: str, name: str, memo: Any, **_: Any) -> None:
    memo.context.wake((namespace, name))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def job_loop(stopped: kopf.DaemonStopped, namespace: str, name: str, memo: Any, logger: Any,
                   pods_by_job: kopf.Index, nodes_index: kopf.Index, **_: Any) -> None:
    ctx: Context = memo.context
    key = (namespace, name)
    wake = ctx.waker(key)
    ctx.loops += 1
    children_ensured = False
    try:
        while not stopped:
            wake.clear()
            try:
                delay, children_ensured = await reconcile_job(ctx, namespace, name, pods_by_job, nodes_index,
                                                              logger, ensure_children=not children_ensured)
            except Conflict:
                delay = 0.0  # someone wrote the job meanwhile: read it again
            except NotLeader:
                delay = ERROR_BACKOFF  # the lease is lost and the operator is stopping: write nothing
            except Exception as e:
                metrics.RECONCILE_ERRORS.labels(type(e).__name__).inc()
                logger.exception(f"reconcile of {namespace}/{name} failed: {e}")
                delay = ERROR_BACKOFF
            if delay > 0:
                await _sleep_until_woken(wake, stopped, delay)
    finally:
        ctx.loops -= 1
        ctx.forget(key)
        with contextlib.suppress(KeyError):
            metrics.WORLD_SIZE.remove(namespace, name)


async def _sleep_until_woken(wake: asyncio.Event, stopped: kopf.DaemonStopped, delay: float) -> None:
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def reconcile_job(ctx: Context, namespace: str, name: str, pods_by_job: kopf.Index,
                        nodes_index: kopf.Index, logger: Any, ensure_children: bool) -> tuple[float, bool]:
    """One pass; returns (seconds until the next unprompted pass, children ensured)."""
    job = await ctx.kube.get_job(namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        return 60.0, not ensure_children
    pods = list(pods_by_job.get((namespace, name), ()))
    view = NodeView(nodes_index)
    nodes = {n: view[n] for n in view}  # a snapshot: the decision runs off the event loop
    labels = {n: view.labels(n) for n in nodes}
    now = datetime.now(UTC)
    # Planning a large model (a cost-model search, a transition plan for the rank order) takes
    # seconds of CPU: in a thread, so other jobs' loops and kopf's watches go on meanwhile.
    policy = ctx.options.policy
    admission = await _admission(ctx, job)
    decision = await asyncio.to_thread(reconcile, job, pods, nodes, now, node_labels=labels,
                                       scale_up_checked=ctx.scale_up_checked.get((namespace, name)), policy=policy,
                                       admission=admission)
    if decision.scale_up_key is not None:
        ctx.scale_up_checked[(namespace, name)] = decision.scale_up_key

    ensured = not ensure_children
    refused: list[str] = []  # children the API server refused (invalid, forbidden): in the status
    if decision.spec is not None:
        if ensure_children:
            for child in builders.job_children(job, decision.spec, secrets.token_hex(32), policy.egress):
                await _create(ctx, child, refused)
            ensured = not refused
        if decision.workload:
            await _change_workloads(ctx, namespace, decision.workload, admission, now, refused)
        places = decision.placements
        if decision.create_coordinator:
            pod = builders.coordinator_pod(job, decision.spec)
            await _create(ctx, kueue.place(pod, places.get(kueue.PODSET_COORDINATOR, kueue.Placement())), refused)
        for index in decision.create_workers:
            pod = kueue.place(builders.worker_pod(job, decision.spec, index),
                              places.get(kueue.PODSET_WORKERS, kueue.Placement()),
                              gated=index in decision.gated_workers)
            if await _create(ctx, pod, refused):
                logger.info(f"created worker pod {builders.worker_name(name, index)}"
                            + (f" (gated: {kueue.ELASTIC_GATE})" if index in decision.gated_workers else ""))
        by_name = {p["metadata"]["name"]: p for p in pods}
        for pod_name in decision.ungate_pods:  # admitted: the elastic-job gate goes (Kueue's ungater)
            if pod_name in by_name and await ctx.kube.patch_pod(namespace, pod_name,
                                                                 kueue.ungate_patch(by_name[pod_name])):
                logger.info(f"ungated worker pod {pod_name}")
    _report_refused(decision, refused, now, job["metadata"].get("generation"))

    if differs(job.get("status") or {}, decision.status):
        await ctx.kube.patch_job_status(namespace, name, decision.status, job["metadata"].get("resourceVersion"))
        _record(ctx, namespace, name, decision)
        ref = {"apiVersion": API_VERSION, "kind": KIND,
               "metadata": {k: job["metadata"][k] for k in ("name", "namespace", "uid")}}
        for kind, reason, message in decision.events:
            kopf.event(ref, type=kind, reason=reason, message=message[:1000])
    for pod in decision.delete_pods:
        await ctx.kube.delete_pod(namespace, pod)
    if admission is not None:
        return min(decision.requeue_after, QUEUE_POLL_SECONDS), ensured
    return decision.requeue_after, ensured


async def _admission(ctx: Context, job: dict[str, Any]) -> kueue.Admission | None:
    """Kueue's admission of a job behind a queue (None for any other job: no Kueue call)."""
    if not kueue.managed(job):
        return None
    meta = job["metadata"]
    workloads = await ctx.kube.list_workloads(meta["namespace"], meta["name"]) if kueue.queue_name(job) else []
    names = {f for w in workloads for a in ((w.get("status") or {}).get("admission") or {}).get("podSetAssignments")
             or [] for f in (a.get("flavors") or {}).values()}
    flavors = {n: f for n in sorted(names) if (f := await ctx.kube.get_cluster_object(kueue.RESOURCE_FLAVORS, n))}
    admission = kueue.read_admission(job, workloads, flavors)
    wpc = (meta.get("labels") or {}).get(kueue.PRIORITY_CLASS_LABEL)
    if admission is not None and wpc:
        found = await ctx.kube.get_cluster_object(kueue.WORKLOAD_PRIORITY_CLASSES, wpc)
        admission = dataclasses.replace(admission, priority=int((found or {}).get("value") or 0))
    return admission


async def _change_workloads(ctx: Context, namespace: str, change: kueue.WorkloadChange,
                            admission: kueue.Admission | None, now: datetime, refused: list[str]) -> None:
    """Create, shrink, (de)activate or release the job's Workload, as the decision says."""
    if change.create is not None:
        await _create(ctx, change.create, refused)
    current = admission.workload if admission is not None else None
    if change.shrink is not None and current is not None:
        await ctx.kube.patch_workload(namespace, change.shrink[0], kueue.shrink_patch(current, change.shrink[1]))
    if change.active is not None:
        await ctx.kube.patch_workload(namespace, change.active[0], {"spec": {"active": change.active[1]}})
    if change.finish is not None and current is not None:
        await ctx.kube.patch_workload(namespace, change.finish, kueue.finish_patch(
            current, now.strftime("%Y-%m-%dT%H:%M:%SZ"), "the job succeeded"), status=True)
    if change.release is not None and current is not None:
        await ctx.kube.patch_workload(namespace, change.release,
                                      kueue.release_patch(current, now.strftime("%Y-%m-%dT%H:%M:%SZ")), status=True)


async def _create(ctx: Context, obj: dict[str, Any], refused: list[str]) -> bool:
    """Create ``obj``; a refusal the job's owner must act on (4xx) is noted in ``refused``, not
    raised (kopf would retry it every few seconds, and the job's status would never say why)."""
    try:
        return await ctx.kube.create(obj)
    except ApiException as e:
        if e.status is None or not 400 <= e.status < 500:
            raise
        try:
            why = json.loads(e.body or "{}").get("message") or e.reason
        except ValueError:
            why = e.reason
        refused.append(f"{obj['kind']} {obj['metadata']['name']}: {e.status} {why}")
        return False


def _report_refused(decision: Decision, refused: list[str], now: datetime, generation: int | None) -> None:
    """The ``ChildrenCreated`` condition: True once the job's objects were created, False with
    the API server's refusal, or False while the operator refuses the spec itself (nothing was
    tried; once created, the objects stay and so does the condition)."""
    st = decision.status
    if decision.spec is None and not refused:
        old = condition(st.get("conditions") or [], "ChildrenCreated")
        if not (old and old.get("status") == "True"):
            st["conditions"] = set_condition(
                list(st.get("conditions") or []), "ChildrenCreated", False, "SpecRefused",
                f"nothing created: {st.get('message') or 'the spec was refused'}"[:1000], now,
                observed_generation=generation)
        return
    message = "; ".join(refused)[:1000]
    st["conditions"] = set_condition(list(st.get("conditions") or []), "ChildrenCreated", not refused,
                                     "Refused" if refused else "Created", message, now, observed_generation=generation)
    if refused:
        st["message"] = f"the API server refused the job's objects: {message}"
        decision.events.append(("Warning", "CreateRefused", message))
        decision.requeue_after = min(decision.requeue_after, REFUSED_RETRY_SECONDS)


def _record(ctx: Context, namespace: str, name: str, decision: Decision) -> None:
    if decision.replan_reason:
        metrics.REPLANS.labels(decision.replan_reason).inc()
        seen = [ctx.signal_seen[t] for t in decision.triggers if t in ctx.signal_seen]
        if seen:
            metrics.NOTICE_TO_PLAN.observe(time.monotonic() - min(seen))
    if decision.applied:
        metrics.RECONFIGURATION.observe(decision.applied[1])
    if decision.new_failures:
        metrics.WORKER_FAILURES.labels(namespace, name).inc(decision.new_failures)
    metrics.WORLD_SIZE.labels(namespace, name).set(decision.status.get("worldSize") or 0)


def differs(current: Any, patch: Any) -> bool:
    """Would this merge patch change ``current``?"""
    if isinstance(patch, dict):
        if not isinstance(current, dict):
            return True
        return any(differs(current.get(k), v) for k, v in patch.items())
    if patch is None:
        return current is not None
    return current != patch
