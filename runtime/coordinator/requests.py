"""Where plan requests come from, and what the planner is given besides the workers.

A ``PlanSource`` is the coordinator's only input of wishes: the local driver posts requests in the
store (``StorePlanSource``), the operator writes them into the job's status
(``coordinator.kube_source.KubePlanSource``). A source also receives the coordinator's status report.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from liveshard.runtime.contract.env import Defaults
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.contract.status import pod_of
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.planner import Constraints
from liveshard.runtime.planner.adapt import AdaptivePolicy

log = logging.getLogger("liveshard.coordinator")


@dataclass
class PlanRequest:
    """A wish for a new world: explicit members (in rank order) and config, or "plan a world
    for these workers" (``config`` None: the planner chooses the config and the rank order)."""

    members: tuple[str, ...]
    config: str | None = None
    reason: str = ""
    switch_at_step: int | None = None
    deadline: float | None = None
    cause: str | None = None  # a contract.Cause value
    # Whether ``members`` is the rank order (the operator's plans: its planner chose it); if not,
    # the planner places an explicit config over them too.
    ordered: bool = True


@dataclass(frozen=True)
class PlanningInputs:
    """What the planner is given besides the workers: the job's constraints (the same the
    operator plans with), each GPU's memory, and measured relative speeds per pod."""

    constraints: Constraints
    gpu_memory_bytes: int = Defaults.GPU_MEMORY
    speeds: Mapping[str, float] = field(default_factory=dict)
    adaptive: AdaptivePolicy | None = None  # the straggler policy (spec.elasticity.adaptive)


class PlanSource(Protocol):
    def poll(self) -> PlanRequest | None:
        """The next request, or None (called only while the coordinator takes requests)."""
        ...

    def report(self, status: dict[str, Any]) -> None:
        """The coordinator's status (``CoordinatorStatus.to_dict()``)."""
        ...

    def planning(self) -> PlanningInputs | None:
        """The job's current planning inputs, or None to keep the coordinator's own."""
        ...


def whole_pods(workers: tuple[str, ...], gpus_per_pod: int) -> tuple[str, ...]:
    """The workers of pods all of whose ``gpus_per_pod`` processes are here, in the order given:
    plans come in whole pods (a pod that lost one process keeps the others as standbys)."""
    if gpus_per_pod <= 1:
        return workers
    have: dict[str, set[str]] = {}
    for w in workers:
        have.setdefault(pod_of(w), set()).add(w)
    return tuple(w for w in workers if len(have[pod_of(w)]) == gpus_per_pod)


class StorePlanSource:
    """Requests posted in the store by the local driver (``request/<k>``, a list of slots)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.seen = 0

    @staticmethod
    def post(store: JobStore, request: PlanRequest) -> None:
        store.append(Keys.request, json.dumps(asdict(request), sort_keys=True))

    def poll(self) -> PlanRequest | None:
        """The next request in posting order. The list has no counter an attacker could bump:
        each request claims its own slot, and a forged slot is passed over."""
        for index, text in self.store.entries(Keys.request, self.seen):
            self.seen = index + 1
            try:
                data = json.loads(text)
                return PlanRequest(**{**data, "members": tuple(data["members"])})
            except (KeyError, TypeError, ValueError) as e:
                log.error("plan request %d is malformed (%s): ignored", index, e)
        return None

    def report(self, status: dict[str, Any]) -> None:
        pass  # the coordinator's status is in the store already (Keys.COORDINATOR_STATUS)

    def planning(self) -> PlanningInputs | None:
        return None


class BackgroundSource:
    """A plan source whose I/O (the Kubernetes API, with its retries and timeouts) runs on a thread
    of its own, so the coordinator's tick, which judges liveness and decides generations, never
    waits on it. ``poll`` hands over a request the thread fetched; ``report`` and ``planning``
    return at once. The order the wrapped source relies on holds: after a request is handed over,
    the report that follows reaches it before it is polled again."""

    def __init__(self, source: PlanSource, period: float = 0.2) -> None:
        self.source = source
        self.period = period
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._request: PlanRequest | None = None  # fetched, not handed over yet
        self._handed = 0  # requests handed over so far
        self._reported = 0  # handovers the delivered reports were made after
        self._report: tuple[dict[str, Any], int] | None = None  # the newest status (and handovers before it), undelivered
        self._planning: PlanningInputs | None = None
        self.thread = threading.Thread(target=self._run, name="plan-source", daemon=True)
        self.thread.start()

    def poll(self) -> PlanRequest | None:
        with self._lock:
            request, self._request = self._request, None
            if request is not None:
                self._handed += 1
        self._wake.set()
        return request

    def report(self, status: dict[str, Any]) -> None:
        with self._lock:
            self._report = (status, self._handed)
        self._wake.set()

    def planning(self) -> PlanningInputs | None:
        with self._lock:
            return self._planning

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period)
            self._wake.clear()
            try:
                self._once()
            except Exception:  # the API server may be restarting: try again next round
                log.exception("plan source")

    def _once(self) -> None:
        with self._lock:
            report, self._report = self._report, None
        if report is not None:
            self.source.report(report[0])
            with self._lock:
                self._reported = max(self._reported, report[1])
        inputs = self.source.planning()
        with self._lock:
            if inputs is not None:
                self._planning = inputs
            if self._request is not None or self._reported < self._handed:
                return  # the report about the request handed over comes first
        request = self.source.poll()
        if request is not None:
            with self._lock:
                self._request = request
