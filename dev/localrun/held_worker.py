"""``liveshard worker`` that waits at chosen steps: the local driver's gate for scripted events.

    python -m liveshard.dev.localrun.held_worker WORKER-ARGS --hold-at-steps 3,5,7 [--phase-holds]

Takes exactly the arguments of ``liveshard worker`` plus ``--hold-at-steps`` and runs the same
worker (``liveshard.runtime.commands.worker.run``) with a step gate (``HeldSteps``): at the
boundary after each listed step, before the old world agrees whether to switch, the worker
writes ``Keys.held(step, id)`` and waits for ``Keys.release(step)`` (keys of the job's store).
Meanwhile the driver does what is due at that step: publishes a plan, restarts the
coordinator, or SIGKILLs a victim's process group from outside (after seeing it held) and only
then releases the others. Events so land on exact steps however fast steps are. The production
worker has no such gate and never kills itself.

The gate polls with its own store client and reconnects when the store goes away (a
coordinator restart); after 300 s without a release it logs and trains on.

With ``--slowdown`` the worker's device can be slowed (``Slowdown``, a compute gate): at every
step boundary (at a held step, after the release) it reads ``Keys.slowdown(id)`` (a factor F in
(0, 1]) and from then on sleeps ``(1/F - 1)`` times each forward and backward it computes.

With ``--phase-holds`` the worker also has a phase gate (``HeldPhases``): at every phase of a
reconfiguration (``protocol.PHASES``) it reads ``Keys.hold_phase(id)``; when that names the
phase, it writes ``Keys.at_phase(id)`` and waits there, for the driver to SIGKILL it at that
exact point of the switch, or to kill the coordinator meanwhile: it goes on once the store (the
restarted coordinator's) no longer names the phase.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

from liveshard.runtime.commands import worker as worker_command
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.control.store import JobStore, connect_store, job_secret

log = logging.getLogger("liveshard.held_worker")

MODULE = "liveshard.dev.localrun.held_worker"


def parse_steps(text: str) -> frozenset[int]:
    """``"3,5,7"`` -> {3, 5, 7} (empty: none)."""
    return frozenset(int(x) for x in text.split(",") if x.strip())


class Slowdown:
    """A compute gate (``agent.compute_clock.ComputeGate``): a device at ``factor`` of its speed.

    After each compute segment of ``s`` seconds it sleeps ``s * (stretch/factor - 1)``: the
    segment then takes ``s * stretch / factor``, and the sleeping process leaves the CPU to the
    others (on this machine every rank shares the same cores, so burning cycles would slow
    everybody). ``stretch`` > 1 emulates devices that many times slower than this CPU for every
    rank: most of a step's compute is then sleep, so ranks stop competing for the cores and a
    slow device costs what it would on dedicated hardware (benchmarks)."""

    def __init__(self, stretch: float = 1.0) -> None:
        self.factor = 1.0
        self.stretch = stretch

    def __call__(self, seconds: float) -> None:
        total = self.stretch / self.factor
        if total > 1.0:
            time.sleep(seconds * (total - 1.0))


class HeldSteps:
    """A ``WorkerAgent`` step gate: hold at ``steps`` until the driver releases them."""

    def __init__(self, host: str, port: int, job: str, worker_id: str, steps: frozenset[int],
                 timeout: float = 300.0, poll: float = 0.5, slowdown: Slowdown | None = None) -> None:
        self.host, self.port, self.job = host, port, job
        self.worker_id = worker_id
        self.steps = steps
        self.timeout = timeout
        self.poll = poll
        self.slowdown = slowdown
        self._store: JobStore | None = None  # the gate's own client (the worker's are per thread)

    def __call__(self, step: int) -> bool:
        """Hold at ``step`` if it is listed (True), else pass at once (False)."""
        if step not in self.steps:
            if self.slowdown is not None:  # a standby that came back reads its speed here
                self._retry(time.monotonic() + 10.0, self._read_slowdown)
            return False
        end = time.monotonic() + self.timeout
        if not (self._retry(end, lambda store: self._mark_held(store, step))
                and self._retry(end, lambda store: self._released(store, step))):
            log.warning("step %d was not released in %.0f s; training on", step, self.timeout)
        if self.slowdown is not None:
            self._retry(end, self._read_slowdown)
        return True

    def _read_slowdown(self, store: JobStore) -> bool:
        value = store.get(Keys.slowdown(self.worker_id))
        if value is not None and float(value) != self.slowdown.factor:
            self.slowdown.factor = float(value)
            log.warning("device speed set to %.2f of its own", self.slowdown.factor)
        return True

    def _mark_held(self, store: JobStore, step: int) -> bool:
        store.set(Keys.held(step, self.worker_id), str(os.getpid()))
        return True

    def _released(self, store: JobStore, step: int) -> bool:
        return store.wait_for(Keys.release(step), timeout=self.poll) is not None

    def _retry(self, end: float, attempt: Callable[[JobStore], bool]) -> bool:
        """Repeat ``attempt(store)`` until it returns True (False once ``end`` has passed),
        reconnecting when the store is gone: it may be restarting with its coordinator."""
        while True:
            try:
                if attempt(self._client()):
                    return True
            except Exception:
                self._store = None
                time.sleep(0.2)
            if time.monotonic() > end:
                return False

    def _client(self) -> JobStore:
        if self._store is None:
            self._store = JobStore(connect_store(self.host, self.port, timeout=5.0), self.job, job_secret())
        return self._store


class HeldPhases:
    """A ``WorkerAgent`` phase gate: wait at the phase the driver names (to be killed there)."""

    def __init__(self, host: str, port: int, job: str, worker_id: str, timeout: float = 120.0,
                 poll: float = 0.1) -> None:
        self.steps = HeldSteps(host, port, job, worker_id, frozenset())  # its store client
        self.worker_id = worker_id
        self.timeout = timeout
        self.poll = poll
        self._lock = threading.Lock()  # phases come from the main and the control thread

    def __call__(self, phase: str, generation: int) -> None:
        with self._lock:
            end = time.monotonic() + 10.0
            wanted: list[str | None] = []
            if not self.steps._retry(end, lambda store: wanted.append(store.get(Keys.hold_phase(self.worker_id))) or True):
                return
            if wanted[-1] != phase:
                return
            log.warning("held at phase %s of generation %d", phase, generation)
            self.steps._retry(end, lambda store: store.set(Keys.at_phase(self.worker_id), f"{phase}:{generation}") or True)
            # Held until killed, or until the store no longer names this phase: a coordinator
            # killed here takes its store along, and the new one's holds none.
            end = time.monotonic() + self.timeout
            while time.monotonic() < end:
                time.sleep(self.poll)
                if self.steps._retry(time.monotonic() + self.poll, lambda store: wanted.append(
                        store.get(Keys.hold_phase(self.worker_id))) or True) and wanted[-1] != phase:
                    log.warning("released at phase %s of generation %d", phase, generation)
                    return
            log.warning("not released at phase %s in %.0f s; going on", phase, self.timeout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                description="liveshard worker, held at chosen steps until the driver releases them")
    worker_command.configure(p)
    p.add_argument("--hold-at-steps", default="",
                   help="comma-separated steps at whose boundary the worker waits for the driver")
    p.add_argument("--slowdown", action="store_true",
                   help="read a speed factor for this device at every held step (slow events)")
    p.add_argument("--stretch", type=float, default=1.0,
                   help="emulate a device this many times slower than the CPU by sleeping (with --slowdown)")
    p.add_argument("--phase-holds", action="store_true",
                   help="wait at the reconfiguration phase the driver names in the store (to be killed there)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from liveshard.runtime.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    host, _, port = args.coordinator.rpartition(":")
    wid = worker_command.worker_id(args)
    slowdown = Slowdown(args.stretch) if args.slowdown else None
    gate = HeldSteps(host, int(port), args.job_name, wid, parse_steps(args.hold_at_steps), slowdown=slowdown)
    phases = HeldPhases(host, int(port), args.job_name, wid) if args.phase_holds else None
    try:  # a pod's supervisor starts this module again per GPU, holds included
        return int(worker_command.run(args, step_gate=gate, command=[sys.executable, "-m", MODULE, *argv],
                                      phase_gate=phases, compute_gate=slowdown) or 0)
    except ConfigError as e:
        print(f"held_worker: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
