"""The job's key-value store: a c10d ``TCPStore`` served by the coordinator, with JSON helpers.

The same store carries the protocol keys (``contract.keys.Keys``) and, under per-generation
prefixes, the rendezvous keys of every process group the job builds, so a new world never sees a
previous world's stale addresses.

The store's port is reachable by anything on the network the job's pods share, and it has no
access control of its own. So every value that steers the job (plans, requests, membership,
heartbeats, results, outcomes, checkpoints) is authenticated: written as ``<HMAC>.<value>``
with the job's secret (``$LIVESHARD_JOB_SECRET``, a Secret the operator creates per job; the
local driver makes one per run), the key bound into the MAC so a value cannot be replayed under
another key. A value without a valid MAC reads as absent. Values are JSON or plain text, never
pickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from liveshard.runtime.contract.keys import SECRET_ENV, Keys
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.errors import ConfigError


def serve_store(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    """Start the store server (the coordinator's); ``port=0`` picks a free port."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


def connect_store(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


log = logging.getLogger("liveshard.store")


def job_secret() -> bytes | None:
    """The job's secret from the environment. In a pod the operator built (``LIVESHARD_ROLE``
    set) it is required: a ``ConfigError`` rather than a job anyone on the network can steer."""
    value = os.environ.get(SECRET_ENV, "")
    if not value and os.environ.get("LIVESHARD_ROLE"):
        raise ConfigError(SECRET_ENV, "not set: the job's store would accept values from anyone",
                          "run the pod as the operator builds it (the job's Secret is mounted as this variable)")
    return value.encode() if value else None


class JobStore:
    """Typed access to the protocol keys of one job; values authenticated with ``secret``
    (None: unauthenticated, for in-process tests only)."""

    def __init__(self, store: dist.Store, job: str = "job", secret: bytes | None = None) -> None:
        self.raw = store
        self.store = dist.PrefixStore(f"liveshard/{job}/", store)
        self._secret = secret
        self._refused: set[str] = set()  # keys whose forged values were already logged

    def _mac(self, key: str, value: str) -> str:
        assert self._secret is not None
        return hmac.new(self._secret, f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()

    def _seal(self, key: str, value: str) -> str:
        return value if self._secret is None else f"{self._mac(key, value)}.{value}"

    def _open(self, key: str, raw: str) -> str | None:
        if self._secret is None:
            return raw
        mac, sep, value = raw.partition(".")
        if sep and hmac.compare_digest(mac, self._mac(key, value)):
            return value
        if key not in self._refused:
            self._refused.add(key)
            log.warning("store key %s holds a value without a valid MAC: ignored", key)
        return None

    def prefixed(self, prefix: str) -> dist.Store:
        return dist.PrefixStore(prefix, self.store)

    # ---- primitives -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        """Whether ``key`` holds an authentic value."""
        return self.get(key) is not None

    def set(self, key: str, value: str) -> None:
        self.store.set(key, self._seal(key, value))

    def get(self, key: str) -> str | None:
        """The value, or None if the key is not there or its value is not authentic (never blocks)."""
        if not self.store.check([key]):
            return None
        return self._open(key, self.store.get(key).decode())

    def decide(self, key: str, value: str) -> str | None:
        """Write ``value`` unless ``key`` holds a value already, atomically in the store (the
        first writer wins); the value the key holds afterwards (None: not authentic)."""
        return self._open(key, self.store.compare_set(key, "", self._seal(key, value)).decode())

    def set_json(self, key: str, value: Any) -> None:
        self.set(key, json.dumps(value, sort_keys=True))

    def get_json(self, key: str) -> Any:
        text = self.get(key)
        return None if text is None else json.loads(text)

    def wait_for(self, key: str, timeout: float, poll: float = 0.01) -> str | None:
        """Poll until ``key`` exists (None after ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while True:
            value = self.get(key)
            if value is not None or time.monotonic() >= end:
                return value
            time.sleep(poll)

    # ---- membership -------------------------------------------------------------------------
    def register_member(self, worker: str, info: dict) -> None:
        self.set_json(Keys.member(worker), info)
        index = self.store.add(Keys.MEMBER_COUNT, 1) - 1
        self.set(Keys.member_index(index), worker)

    def members(self) -> list[str]:
        count = self.store.add(Keys.MEMBER_COUNT, 0)
        out = []
        for i in range(count):
            name = self.get(Keys.member_index(i))
            if name is not None:
                out.append(name)
        return out

    # ---- plans ------------------------------------------------------------------------------
    def publish_plan(self, plan: WorldPlan) -> None:
        self.set(Keys.plan(plan.generation), plan.to_json())
        self.set(Keys.LATEST, str(plan.generation))

    def latest_generation(self) -> int:
        value = self.get(Keys.LATEST)
        return -1 if value is None else int(value)

    def plan(self, gen: int) -> WorldPlan | None:
        text = self.get(Keys.plan(gen))
        return None if text is None else WorldPlan.from_json(text)
