"""A worker's link to the job's store: its clients, its registration, heartbeats and results.

The coordinator serves the job's store (``control.store``). A worker keeps **one client per
thread** (``StoreClients``): a c10d store client must not be used by two threads at once (a
blocking rendezvous in one interleaves with the other's requests on the same socket), so the
training (main) thread and the control thread each have their own. When the coordinator
restarts (its store with it), the control thread connects both clients anew and announces the
world this worker trains in (``reannounce``); the main thread picks its new client up at its
next store call.

What a worker writes here: its registration (``members/<id>``: host, node, pid, time; after a
coordinator restart also its world, its open commit point and a plan whose outcome it never
learned), its heartbeats (``hb/<id>``, written by its pulse process where it has one: ``beat``)
and its outcome of each generation (``gen/<N>/result/<id>``).

What it writes for a generation under way (its result, its prepared digest, its connect answer,
its arrival, its ready vote) it keeps written until the generation is decided
(``kept_writes.KeptWrites``, ``StoreClients.kept``): a client
without the job's secret can delete any key, and a key deleted before its reader read it would
leave the generation to abort at the transition timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from liveshard.runtime import telemetry
from liveshard.runtime.agent.kept_writes import KeptWrites
from liveshard.runtime.contract.env import Env
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.protocol import (
    Heartbeat,
    MemberResult,
    OpenGeneration,
    Registration,
    WorldPlan,
)
from liveshard.runtime.control.store import JobStore, connect_store, job_secret

if TYPE_CHECKING:
    from liveshard.runtime.agent.pulse import Pulse
    from liveshard.runtime.agent.worker import WorkerState

log = logging.getLogger("liveshard.worker")


class StoreClients:
    """The worker's store clients: one for the main thread, one for the control thread."""

    def __init__(self, host: str, port: int, job: str, timeout: float = 300.0) -> None:
        self.host, self.port, self.job = host, port, job
        self.secret = job_secret()
        self.control_thread: threading.Thread | None = None  # whose calls get the "control" client
        self.epoch = 0  # clients made so far after the first: the pulse connects anew when it changes
        self.registration_slot: int | None = None  # where this worker's registration is listed
        self.replaced_at = float("-inf")  # time.monotonic() of the last replace
        self.kept = KeptWrites()  # this worker's writes for undecided generations (the control thread restores them)
        self._stores = self.connect(timeout)

    def connect(self, timeout: float) -> dict[str, JobStore]:
        """New clients (not yet in use: see ``replace``)."""
        return {name: JobStore(connect_store(self.host, self.port, timeout=timeout), self.job, self.secret)
                for name in ("main", "control")}

    def dedicated(self, timeout: float = 300.0) -> JobStore:
        """A new client for one helper thread's blocking work (a communicator's rendezvous),
        apart from the two above; it closes when the last reference to it goes."""
        return JobStore(connect_store(self.host, self.port, timeout=timeout), self.job, self.secret)

    def replace(self, stores: dict[str, JobStore]) -> None:
        # one assignment: each thread picks its new client up at its next store call
        self._stores = stores
        self.epoch += 1
        self.replaced_at = time.monotonic()

    @property
    def store(self) -> JobStore:
        """The calling thread's client."""
        return self._stores["control" if threading.current_thread() is self.control_thread else "main"]


def new_incarnation() -> str:
    """A name for this process's life as a member: a worker id (a pod, a GPU) can come back
    as a new process, or as this one after the job went on without it; either is a new member."""
    return uuid.uuid4().hex[:16]


def member_info(incarnation: str, *, reconnected: bool = False, latest_seen: int = -1) -> Registration:
    """What a worker announces about itself; the coordinator's planner reads ``node`` and
    ``gpu_memory_bytes`` (its device's, where it has one: nodes of one job may differ)."""
    host = socket.gethostname()
    return Registration(host=host, node=os.environ.get(Env.NODE_NAME) or host, pid=os.getpid(),
                        incarnation=incarnation, time=time.time(), reconnected=reconnected,
                        latest_seen=latest_seen, gpu_memory_bytes=device_memory_bytes(),
                        pod_uid=os.environ.get(Env.POD_UID) or None)


def device_memory_bytes() -> int | None:
    """The total memory of this process's CUDA device; None without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except Exception:  # no driver, a device gone: the job's gpuMemory stands in
        return None
    return None


def register(clients: StoreClients, worker_id: str, incarnation: str, timeout: float = 300.0) -> None:
    """Announce this worker; if the coordinator restarted meanwhile (its store with it),
    connect to the new one and announce there."""
    end = time.monotonic() + timeout
    while True:
        try:
            clients.registration_slot = clients.store.register_member(worker_id, member_info(incarnation).to_dict())
            return
        except Exception as e:
            if time.monotonic() > end:
                raise
            log.warning("registering with the coordinator failed (%s); reconnecting", e)
            time.sleep(0.5)
            with contextlib.suppress(Exception):
                clients.replace(clients.connect(timeout=5.0))


def reannounce(clients: StoreClients, worker_id: str, state: WorkerState,
               last_checkpoint: Callable[[], dict | None], latest_seen: int = -1,
               in_flight: Callable[[], tuple[OpenGeneration | None, WorldPlan | None]] | None = None,
               guard: Callable[[], contextlib.AbstractContextManager] | None = None) -> bool:
    """Connect to a restarted coordinator and announce the world this worker trains in, the
    newest plan generation it has seen (the new coordinator numbers its plans above it) and
    the newest checkpoint it saved; False if the coordinator is not back yet.

    ``in_flight``: the generation whose commit point this worker is in (or last passed), under
    ``"open"``, and a plan it prepared whose outcome it never learned, under ``"pending_plan"``
    (the new coordinator resolves the one and re-issues the other). They are read, announced and
    the clients replaced under ``guard`` (the commit point's lock): a vote is either in what is
    announced or tried after the switch to the new store (and then not made), never in between."""
    try:
        stores = clients.connect(timeout=5.0)
    except Exception:
        return False
    with guard() if guard is not None else contextlib.nullcontext():
        info = announcement(state, last_checkpoint, latest_seen, in_flight)
        slot = stores["control"].register_member(worker_id, info.to_dict())
        clients.replace(stores)
        clients.registration_slot = slot
    return True


def announcement(state: WorkerState, last_checkpoint: Callable[[], dict | None], latest_seen: int,
                 in_flight: Callable[[], tuple[OpenGeneration | None, WorldPlan | None]] | None) -> Registration:
    """What this worker announces when it registers again (to a restarted coordinator, or
    because its registration was deleted): its world, its newest checkpoint, the newest plan
    generation it saw and what is in flight (``reannounce``)."""
    open_generation, pending_plan = in_flight() if in_flight is not None else (None, None)
    return replace(member_info(state.incarnation, reconnected=True, latest_seen=latest_seen),
                   plan=state.plan, checkpoint=last_checkpoint(), open=open_generation, pending_plan=pending_plan)


def register_again_if_lost(clients: StoreClients, worker_id: str, announce: Callable[[], Registration],
                           guard: Callable[[], contextlib.AbstractContextManager] | None = None) -> bool:
    """Register again on the current store when this worker's registration is gone or not
    authentic (``JobStore.registration_intact``); True if it did."""
    store, slot = clients.store, clients.registration_slot
    if slot is None or store.registration_intact(worker_id, slot):
        return False
    with guard() if guard is not None else contextlib.nullcontext():
        clients.registration_slot = store.register_member(worker_id, announce().to_dict(), again=True)
    log.warning("this worker's registration was deleted or overwritten in the store: registered again")
    return True


def heartbeat_payload(now: float, state: WorkerState, trainer: Any, preparing: int | None = None) -> Heartbeat:
    """``hb/<id>``: what the coordinator watches (liveness, phase, world, step, speed, health, and
    the newest plan taken up: its members training towards it are slow, not stuck)."""
    t = trainer
    return Heartbeat(
        time=now,
        state=state.phase,
        generation=state.generation,
        rank=state.rank,
        step=t.step_count if t else None,
        consumed_samples=t.consumed_samples if t else None,
        step_seconds=t.last_step_seconds if t else None,
        # [step, compute seconds, layer units] of the recent steps: the coordinator's speed estimate
        # (a tuple first: the training thread appends meanwhile; copying a deque is one C call)
        compute=tuple(tuple(x) for x in tuple(t.compute_log)) if t else (),
        loss=t.last_loss if t else None,
        pid=os.getpid(),
        incarnation=state.incarnation,
        preparing=preparing,
        health=telemetry.gpu_health() or None,
    )


def send_heartbeat(store: JobStore, worker_id: str, heartbeat: Heartbeat) -> None:
    with contextlib.suppress(Exception):  # the coordinator may be restarting
        store.set_json(Keys.heartbeat(worker_id), heartbeat.to_dict())


PULSE_RECONNECT_GRACE = 15.0  # seconds after a reconnection in which heartbeats are also sent directly


def beat(clients: StoreClients, worker_id: str, heartbeat: Heartbeat, pulse: Pulse | None) -> None:
    """This worker's heartbeat: handed to its pulse (``pulse.py``), which writes it and keeps
    writing while this process is too busy to; sent from the calling thread where there is no
    pulse, or it has not written one yet, or it died; and for a while after the clients were
    replaced (a restarted coordinator): the pulse's own connection attempt may be in a c10d
    retry back-off of seconds, and the new coordinator judges this worker by heartbeats from its
    re-registration on."""
    if (pulse is not None and pulse.publish(heartbeat, clients.epoch)
            and time.monotonic() - clients.replaced_at > PULSE_RECONNECT_GRACE):
        return
    send_heartbeat(clients.store, worker_id, heartbeat)


def report_result(store: JobStore, worker_id: str, gen: int, result: MemberResult,
                  kept: KeptWrites | None = None) -> None:
    """This worker's outcome of generation ``gen`` (the coordinator collects every member's),
    kept written until the generation is decided where ``kept`` is given."""
    key, value = Keys.result(gen, worker_id), result.to_json()
    if kept is None:
        store.set(key, value)
    else:
        kept.write(store, gen, key, value)
