"""Nodes: index each node's going-away signal, wake the jobs with pods on it when it changes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kopf

from liveshard.runtime.planner.pods import GPU_MEMORY_LABELS


@kopf.index("nodes")
async def nodes_index(name: str, body: kopf.Body, labels: kopf.Labels, memo: Any, **_: Any) -> dict[str, Any]:
    sig = memo.context.node_signal(name, body, datetime.now(UTC))
    gpu_labels = {k: labels[k] for k in GPU_MEMORY_LABELS if k in labels}
    return {name: (sig, gpu_labels)}


@kopf.on.event("nodes")
async def node_changed(name: str, type: str | None, memo: Any, nodes_index: kopf.Index,
                       pods_by_node: kopf.Index, **_: Any) -> None:
    ctx = memo.context
    if type == "DELETED" or name not in nodes_index:
        state: Any = "gone"
    else:
        sig = next(iter(nodes_index[name]))[0]
        state = None if sig is None else (sig.kind, sig.source)
    # Nodes change often (heartbeats, images); only a change of signal concerns the jobs.
    if ctx.node_state.get(name, None) == state and type != "DELETED":
        return
    ctx.node_state[name] = state
    if type == "DELETED":
        ctx.forget_node(name)
    for key in set(pods_by_node.get(name, ())):
        ctx.wake(key)
