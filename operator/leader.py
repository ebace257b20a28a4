"""Leader election: one operator replica acts at a time, over a ``coordination.k8s.io/v1`` Lease.

It follows client-go's ``leaderelection`` package, with the same Lease fields (``kubectl get
lease`` reads it as for any controller):

* A candidate takes the Lease when nobody holds it (no Lease, or an empty ``holderIdentity``), or
  when its holder has not renewed it for ``leaseDurationSeconds`` counted by the candidate's own
  clock from the moment it saw the record last change: clocks of different machines are never
  compared.
* Every write is a replace carrying the ``resourceVersion`` just read, so of two candidates only
  one wins; the other gets 409 Conflict and tries again later.
* The leader renews every retry period. A leader that has not renewed for ``renew_deadline``
  (shorter than the lease duration) stops acting, before any other replica can take the lease:
  the other counts the full lease duration from when it saw the last renewal, which the leader
  sent before it started counting its own deadline.
* On a clean stop the leader empties ``holderIdentity``, so another replica takes over at once.

``LeaderElector.is_leader`` is the fence the operator's own writes check (``kube.Kube.fence``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from liveshard.operator.options import LeaderElection
from liveshard.runtime.contract.times import iso

logger = logging.getLogger("liveshard.operator.leader")

LEASE_API_VERSION = "coordination.k8s.io/v1"
RETRY_JITTER = 0.2  # candidates spread their retries (client-go's JitterFactor 1.2)


class LeaseStore:
    """One Lease, read and written as plain JSON on a thread pool of its own, so renewals never
    queue behind the job loops' API calls. The client's models are avoided: they would write
    ``renewTime`` without microseconds when they are zero, which a real API server refuses."""

    def __init__(self, api_client: Any, namespace: str, name: str, timeout: float) -> None:
        import kubernetes.client as k8s

        self.api = k8s.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lease")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        response = await loop.run_in_executor(
            self._pool, lambda: fn(*args, _preload_content=False, _request_timeout=self.timeout))
        return json.loads(response.data)

    async def get(self) -> dict[str, Any] | None:
        from kubernetes.client.rest import ApiException

        try:
            return await self._call(self.api.read_namespaced_lease, self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self.api.create_namespaced_lease, self.namespace, body)

    async def replace(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self.api.replace_namespaced_lease, self.name, self.namespace, body)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LeaderElector:
    def __init__(self, store: Any, config: LeaderElection, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        if not 0 < config.retry_period < config.renew_deadline < config.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration")
        self.store = store
        self.config = config
        self._clock = clock
        self._wall = wall
        self._observed: tuple[Any, ...] | None = None  # the Lease record last seen
        self._observed_at = 0.0  # and when it was first seen like that (this process' clock)
        self._valid_until = -math.inf  # leader until then (this process' clock)
        self.lost = False  # held the lease, then failed to renew it in time
        self.holder = ""  # the holder last seen
        self._last_error = ""

    @property
    def identity(self) -> str:
        return self.config.identity

    @property
    def is_leader(self) -> bool:
        return not self.lost and self._clock() < self._valid_until

    # ---- one round ------------------------------------------------------------------------------
    async def try_acquire_or_renew(self) -> bool:
        """Take or renew the Lease once; whether this replica holds it now."""
        from kubernetes.client.rest import ApiException

        sent = self._clock()  # the deadline counts from before the request: never too late
        try:
            lease = await self.store.get()
            if lease is None:
                return self._won(await self.store.create(self._record(None)), sent)
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime"), (lease.get("metadata") or {}).get("resourceVersion"))
            if record != self._observed:
                self._observed, self._observed_at = record, sent
            self.holder = holder
            if holder and holder != self.identity:
                duration = _positive(spec.get("leaseDurationSeconds"), self.config.lease_duration)
                if sent < self._observed_at + duration:
                    return False  # held, and renewed within the lease duration as this process saw it
            return self._won(await self.store.replace(self._record(lease)), sent)
        except ApiException as e:
            if e.status == 409:
                return False  # another replica wrote the Lease first
            self._report(f"{e.status} {e.reason}: {_message(e)}")
            return False
        except Exception as e:  # the API server unreachable, a timeout: try again next round
            self._report(f"{type(e).__name__}: {e}")
            return False

    def _record(self, lease: dict[str, Any] | None) -> dict[str, Any]:
        now = iso(self._wall())
        spec = dict((lease or {}).get("spec") or {})
        if (spec.get("holderIdentity") or "") != self.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1 if lease else 0
        # Others wait at least the configured duration: round up, never down.
        spec.update(holderIdentity=self.identity, renewTime=now,
                    leaseDurationSeconds=math.ceil(self.config.lease_duration))
        meta: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        if lease:
            meta["resourceVersion"] = (lease.get("metadata") or {}).get("resourceVersion")
        return {"apiVersion": LEASE_API_VERSION, "kind": "Lease", "metadata": meta, "spec": spec}

    def _won(self, lease: dict[str, Any], sent: float) -> bool:
        was = self.is_leader
        spec = lease.get("spec") or {}
        self._observed = (spec.get("holderIdentity") or "", spec.get("renewTime"),
                          (lease.get("metadata") or {}).get("resourceVersion"))
        self._observed_at = sent
        self._valid_until = sent + self.config.renew_deadline
        self.holder = self.identity
        self._last_error = ""
        if not was:
            logger.info(f"became the leader: lease {self.config.namespace}/{self.config.name}, "
                        f"identity {self.identity}")
        return True

    def _report(self, error: str) -> None:
        if error != self._last_error:  # once per kind of error, not every retry period
            logger.warning(f"lease {self.config.namespace}/{self.config.name}: {error} (the operator needs "
                           f"get, create and update on leases.coordination.k8s.io in {self.config.namespace})")
            self._last_error = error

    # ---- the loops ------------------------------------------------------------------------------
    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this replica holds the lease (True) or ``stop`` is set (False)."""
        logger.info(f"waiting for the leader lease {self.config.namespace}/{self.config.name} "
                    f"(identity {self.identity})")
        while not stop.is_set():
            if await self.try_acquire_or_renew():
                return True
            if await _wait(stop, self.config.retry_period * (1 + RETRY_JITTER * random.random())):
                break
        return False

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew the lease until ``stop`` is set. If it is not renewed within the renew deadline,
        mark it ``lost`` and set ``stop``: this replica must stop acting."""
        while not stop.is_set():
            if await _wait(stop, self.config.retry_period):
                return
            left = self._valid_until - self._clock()
            if left > 0:
                with contextlib.suppress(TimeoutError):  # a renewal must not outlast the lease's validity
                    await asyncio.wait_for(self.try_acquire_or_renew(), timeout=left)
            if not self.is_leader:
                self.lost = True
                logger.error(f"lost the leader lease {self.config.namespace}/{self.config.name} (not renewed "
                             f"within {self.config.renew_deadline:g}s; holder now {self.holder or 'unknown'}): "
                             "stopping")
                stop.set()
                return

    async def release(self) -> None:
        """Give the lease up (a clean stop): another replica takes it at once."""
        if not self.is_leader:
            return
        self._valid_until = -math.inf  # stop acting before the lease says so
        try:
            lease = await self.store.get()
            spec = (lease or {}).get("spec") or {}
            if lease is None or spec.get("holderIdentity") != self.identity:
                return
            now = iso(self._wall())
            # as client-go: no holder, a 1 s duration, so candidates take it on their next round
            spec = {"leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                    "leaseTransitions": int(spec.get("leaseTransitions") or 0)}
            await self.store.replace({"apiVersion": LEASE_API_VERSION, "kind": "Lease", "spec": spec, "metadata": {
                "name": self.config.name, "namespace": self.config.namespace,
                "resourceVersion": (lease.get("metadata") or {}).get("resourceVersion")}})
            logger.info(f"released the leader lease {self.config.namespace}/{self.config.name}")
        except Exception as e:  # the lease then expires by itself
            logger.warning(f"could not release the leader lease: {type(e).__name__}: {e}")


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` or until ``stop`` is set; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


def _positive(value: Any, default: float) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return default
    return seconds if seconds > 0 else default


def _message(e: Any) -> str:
    try:
        return json.loads(e.body or "{}").get("message") or ""
    except (ValueError, AttributeError):
        return ""


__all__ = ["LeaderElector", "LeaseStore"]
