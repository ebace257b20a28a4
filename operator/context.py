"""What one run of the operator keeps in memory: caches and wake-ups, never decisions.

Everything here may be lost (an operator restart starts empty): the job loops re-read the job
and rebuild their view from kopf's indexes. It lives in kopf's ``memo`` so that two operator
runs in one process (tests) never share it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from liveshard.operator import signals
from liveshard.operator.kube import Kube
from liveshard.operator.options import Options
from liveshard.operator.signals import Signal

JobKey = tuple[str, str]  # (namespace, name)


@dataclass
class Context:
    kube: Kube
    options: Options
    wakers: dict[JobKey, asyncio.Event] = field(default_factory=dict)
    # (node, kind, source) -> signal as first seen, so a deadline computed from "now" stays fixed
    _node_signals: dict[tuple[str, str, str], Signal] = field(default_factory=dict)
    # node or pod name -> monotonic time its current signal was first seen (notice-to-plan)
    signal_seen: dict[str, float] = field(default_factory=dict)
    scale_up_checked: dict[JobKey, Hashable] = field(default_factory=dict)
    node_state: dict[str, Any] = field(default_factory=dict)  # last signal a node woke jobs for
    loops: int = 0

    def waker(self, key: JobKey) -> asyncio.Event:
        return self.wakers.setdefault(key, asyncio.Event())

    def wake(self, key: JobKey) -> None:
        event = self.wakers.get(key)
        if event is not None:
            event.set()

    def forget(self, key: JobKey) -> None:
        self.wakers.pop(key, None)
        self.scale_up_checked.pop(key, None)

    def forget_node(self, name: str) -> None:
        self.node_state.pop(name, None)
        self.signal_seen.pop(name, None)
        for key in [k for k in self._node_signals if k[0] == name]:
            del self._node_signals[key]

    def node_signal(self, name: str, node: dict[str, Any], now: datetime) -> Signal | None:
        """Classify a node; the same signal keeps the deadline it had when first seen."""
        sig = signals.classify_node(node, now)
        if sig is None:
            for key in [k for k in self._node_signals if k[0] == name]:
                del self._node_signals[key]
            self.signal_seen.pop(name, None)
            return None
        first = self._node_signals.setdefault((name, sig.kind, sig.source), replace(sig, seen=now))
        self.signal_seen.setdefault(name, time.monotonic())
        return first


class NodeView(Mapping[str, Signal | None]):
    """The nodes index as ``name -> signal``; a node missing from it does not exist."""

    def __init__(self, index: Any) -> None:
        self._index = index

    def _entry(self, name: str) -> tuple[Signal | None, dict[str, str]]:
        store = self._index[name]
        return next(iter(store))

    def __getitem__(self, name: str) -> Signal | None:
        return self._entry(name)[0]

    def labels(self, name: str) -> dict[str, str]:
        try:
            return self._entry(name)[1]
        except KeyError:
            return {}

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class NodeLabels(Mapping[str, Mapping[str, str]]):
    def __init__(self, nodes: NodeView) -> None:
        self._nodes = nodes

    def __getitem__(self, name: str) -> Mapping[str, str]:
        return self._nodes.labels(name)

    def get(self, name, default=None):  # type: ignore[override]
        return self._nodes.labels(name) if name in self._nodes else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)
