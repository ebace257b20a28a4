"""The job's key-value store: a c10d ``TCPStore`` served by the coordinator, with JSON helpers.

The same store carries the protocol keys (``protocol.Keys``) and, under per-generation prefixes,
the rendezvous keys of every process group the job builds, so a new world never sees a previous
world's stale addresses.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import WorldPlan


def serve_store(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    """Start the store server (the coordinator's); ``port=0`` picks a free port."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


def connect_store(host: str, port: int, timeout: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


class JobStore:
    """Typed access to the protocol keys of one job."""

    def __init__(self, store: dist.Store, job: str = "job") -> None:
        self.raw = store
        self.store = dist.PrefixStore(f"liveshard/{job}/", store)

    def prefixed(self, prefix: str) -> dist.Store:
        return dist.PrefixStore(prefix, self.store)

    # ---- primitives -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self.store.check([key])

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str | None:
        """The value, or None if the key is not there (never blocks)."""
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def set_json(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value, sort_keys=True))

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
