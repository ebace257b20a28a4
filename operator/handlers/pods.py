"""Pods of liveshard jobs: indexed by job and by node; any change wakes the pod's job."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import kopf

from liveshard.operator import signals
from liveshard.runtime.contract.crd import LABEL_JOB

JOB_PODS = {LABEL_JOB: kopf.PRESENT}


def snapshot(body: kopf.Body) -> dict[str, Any]:
    """The parts of a pod the decision reads, as plain data (the body itself is a live view)."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels", "deletionTimestamp")
                     if k in meta},
        "spec": {k: spec[k] for k in ("nodeName", "terminationGracePeriodSeconds", "schedulingGates") if k in spec},
        "status": {**{k: status[k] for k in ("phase", "reason", "message", "conditions") if k in status},
                   "containerStatuses": _stopped_containers(status)},
    }


def _stopped_containers(status: dict[str, Any]) -> list[dict[str, Any]]:
    """How each container that stopped did (exit code, reason, termination message)."""
    out = []
    for c in status.get("containerStatuses") or []:
        terminated = (c.get("state") or {}).get("terminated")
        if terminated:
            out.append({"name": c.get("name"), "state": {"terminated": {
                k: terminated[k] for k in ("exitCode", "reason", "message") if k in terminated}}})
    return out


@kopf.index("pods", labels=JOB_PODS)
async def pods_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_JOB]): snapshot(body)}


@kopf.index("pods", labels=JOB_PODS)
async def pods_by_node(namespace: str, labels: kopf.Labels, spec: kopf.Spec, **_: Any) -> dict[Any, Any] | None:
    node = spec.get("nodeName")
    return {node: (namespace, labels[LABEL_JOB])} if node else None


@kopf.on.event("pods", labels=JOB_PODS)
async def pod_changed(name: str, namespace: str, type: str | None, labels: kopf.Labels, body: kopf.Body,
                      memo: Any, **_: Any) -> None:
    ctx = memo.context
    if type != "DELETED" and signals.classify_pod(body, datetime.now(UTC)) is not None:
        ctx.signal_seen.setdefault(name, time.monotonic())  # for the notice-to-plan metric
    else:
        ctx.signal_seen.pop(name, None)
    ctx.wake((namespace, labels[LABEL_JOB]))
