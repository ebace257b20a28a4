"""The worker pods of a job as the decision sees them, each with the signal it acts on. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from liveshard.operator import signals
from liveshard.operator.signals import Signal
from liveshard.runtime.contract.crd import LABEL_INDEX, LABEL_ROLE, ROLE_WORKER
from liveshard.runtime.planner.pods import node_gpu_memory


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
    gated: bool = False  # spec.schedulingGates not empty: not scheduled yet (Kueue's elastic-job gate)

    @property
    def dead(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.node) and not self.deleting


def observe_workers(pods: list[dict[str, Any]], nodes: Mapping[str, Signal | None],
                    node_labels: Mapping[str, Mapping[str, str]], act_on: frozenset[str],
                    now: datetime, debounce_seconds: float = 0.0) -> list[Worker]:
    """Worker pods with their signals. ``nodes`` has every node that exists (missing: gone).
    A withdrawable node signal younger than ``debounce_seconds`` does not count yet."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL_ROLE) != ROLE_WORKER:
            continue
        try:
            index = int(labels.get(LABEL_INDEX, ""))
        except ValueError:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        sig = signals.classify_pod(pod, now)
        if sig is None and node:
            if node not in nodes:
                sig = signals.node_gone(node, now)
            else:
                node_sig = nodes[node]
                if node_sig is not None and signals.acts_on(node_sig, act_on) \
                        and not node_sig.settling(now, debounce_seconds):
                    sig = node_sig
        out.append(Worker(
            name=meta["name"], index=index, uid=meta.get("uid", ""), node=node,
            phase=(pod.get("status") or {}).get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")), signal=sig,
            gpu_memory_bytes=node_gpu_memory(node_labels.get(node)) if node else None,
            gated=bool((pod.get("spec") or {}).get("schedulingGates")),
        ))
    return sorted(out, key=lambda w: w.index)
