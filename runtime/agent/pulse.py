"""The worker's pulse: a heartbeat that the work beside it cannot starve.

A worker's heartbeats used to come from its control thread, a Python thread: a data build, a
compile or any C call that holds the GIL for a few seconds kept it from running, and the
coordinator took a busy member for dead (it aborted a join that way on a loaded machine). The
pulse is a small process of its own per worker (``python -P -m liveshard.runtime.agent.pulse``,
started by ``Pulse.start``; its own interpreter, its own GIL, its own store client) that writes
the worker's heartbeat key every ``interval`` for as long as the worker process is alive and
running:

* what it writes is the latest payload the worker published (``Pulse.publish``: the control
  thread's ``heartbeat_payload``, handed over as a file replaced atomically in a private
  directory), with ``time`` set to the pulse's clock (what the coordinator's liveness watch
  reads), ``published`` the worker's own time of that payload and ``age`` the difference: the
  payload may be stale while the worker is busy, and says by how much. A new payload is sent at
  once (the pulse looks every ``CHECK`` seconds), so a change of phase is not delayed;
* it writes nothing while the worker is stopped (``/proc/<pid>/stat`` state ``T``, ``t``): a
  frozen process is still found dead. It exits when the worker exits (it is handed to another
  parent, or the worker is a zombie) and writes nothing once the worker has published nothing
  for ``stale_after`` seconds (a process hung with the GIL held is found dead too, later);
* its values are authenticated with the job's secret as the worker's own (``JobStore``,
  ``$LIVESHARD_JOB_SECRET`` inherited); after a coordinator restart the worker's control
  thread connects anew and says so (``epoch``), and the pulse connects anew too. A ``set`` to a
  store whose server died can return without error, so every write is followed by a ``check``,
  which cannot.

The worker sends a heartbeat itself when the pulse is not connected to the store as it is
published (at the start, after a failed write, after the pulse died: logged); every payload has
one writer, so the worker and its pulse never race on the heartbeat key. Where there is no
``/proc`` the pulse cannot tell a frozen worker from a busy one: it is not started, and the
control thread heartbeats as before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from liveshard.runtime.control.protocol import Heartbeat

log = logging.getLogger("liveshard.pulse")

MODULE = "liveshard.runtime.agent.pulse"
CHECK = 0.05  # seconds between the pulse's looks at the worker and its payload
# /proc states: running, sleeping, in uninterruptible sleep (I/O) are alive; stopped (T, t: a
# SIGSTOP, a debugger) is not, though it may go on; Z, X: exited (a zombie until reaped)
RUNNING = frozenset("RSD")
EXITED = frozenset("ZXx")
PAYLOAD, READY = "payload.json", "ready"
PREFIX = "liveshard-pulse-"  # payload directories: PREFIX<worker pid>-<random>


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``: R, S, D, T, Z, ...); None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (in parentheses) may itself hold spaces and parentheses
    end = data.rfind(b")")
    return data[end + 2: end + 3].decode() if end >= 0 and len(data) > end + 2 else None


def stamped(heartbeat: Heartbeat, now: float) -> Heartbeat:
    """The heartbeat the pulse writes: ``heartbeat`` at the pulse's time ``now``, with the time
    the worker published it and its age."""
    published = heartbeat.time
    return replace(heartbeat, time=now, published=published, age=round(max(0.0, now - published), 3), pulse=True)


class Pulse:
    """The worker's side: starts the pulse process, hands it payloads, stops it."""

    def __init__(self, worker_id: str, host: str, port: int, job: str, *, interval: float = 0.5,
                 stale_after: float = 300.0) -> None:
        self.id, self.host, self.port, self.job = worker_id, host, port, job
        self.interval = interval
        self.stale_after = stale_after
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None
        self._lock = threading.Lock()  # the control thread and the main thread both publish
        self._stopped = False
        self._lost = False

    def start(self) -> bool:
        """Start the pulse process; False (thread heartbeats only) where it cannot judge a
        frozen worker (no ``/proc``)."""
        if process_state(os.getpid()) is None:
            log.warning("no /proc here: the pulse cannot tell a frozen worker; heartbeats come from the control thread")
            return False
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        root = shm or tempfile.gettempdir()
        sweep(root)
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)  # 0700: this user's only
        cmd = [sys.executable, "-P", "-m", MODULE, "--pid", str(os.getpid()), "--host", self.host,
               "--port", str(self.port), "--job", self.job, "--id", self.id, "--dir", self.dir,
               "--interval", repr(self.interval), "--stale-after", repr(self.stale_after)]
        # -P: the worker's working directory is not put on sys.path (a folder there named like
        # a stdlib module would shadow it). Same process group: a signal to the worker's group
        # (a stop, a kill) reaches the pulse too.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        return True

    def publish(self, heartbeat: Heartbeat, epoch: int = 0) -> bool:
        """Hand ``heartbeat`` (``connection.heartbeat_payload``) to the pulse; True when the pulse
        writes it, False when the caller must send it itself (the pulse is not running, or not
        connected): each payload has one writer, so two never race on the heartbeat key."""
        proc = self.proc
        if proc is None or self.dir is None or self._stopped:
            return False
        if proc.poll() is not None:
            if not self._lost:
                self._lost = True
                log.warning("the pulse exited with %s: heartbeats come from the control thread", proc.returncode)
            return False
        handover = self.ready()
        doc = json.dumps({"epoch": epoch, "payload": heartbeat.to_dict(), "pulse": handover}, sort_keys=True)
        path = os.path.join(self.dir, PAYLOAD)
        try:
            with self._lock:
                with open(path + ".tmp", "w") as f:
                    f.write(doc)
                os.replace(path + ".tmp", path)  # the pulse never reads half a payload
        except OSError as e:
            log.warning("cannot hand the heartbeat to the pulse (%s): sending it from this thread", e)
            return False
        return handover

    def ready(self) -> bool:
        """Whether the pulse is connected to the store (it then writes every payload handed over)."""
        return self.dir is not None and os.path.exists(os.path.join(self.dir, READY))

    def stop(self, timeout: float = 5.0) -> None:
        """End the pulse (the caller writes the last heartbeat itself, after this)."""
        self._stopped = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if self.dir is not None:
            _remove_dir(self.dir)


def sweep(root: str) -> None:
    """Remove the payload directories of workers that are gone: a pulse removes its own when
    its worker exits, but not when both are killed at once (a signal to their process group)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(PREFIX):].partition("-")[0]
            if name.startswith(PREFIX) and pid.isdigit() and process_state(int(pid)) in (None, *EXITED):
                _remove_dir(os.path.join(root, name))


def _remove_dir(path: str) -> None:
    for name in (PAYLOAD, PAYLOAD + ".tmp", READY):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


class Pulsing:
    """The pulse process's loop (``main``)."""

    def __init__(self, pid: int, host: str, port: int, job: str, worker_id: str, directory: str, *,
                 interval: float, stale_after: float, secret: bytes | None) -> None:
        self.pid, self.host, self.port, self.job, self.id = pid, host, port, job, worker_id
        self.dir = directory
        self.interval = interval
        self.stale_after = stale_after
        self.secret = secret
        self.store: Any = None  # a JobStore while connected (``Pulse.ready`` says so)
        self.epoch = 0  # the worker's clients' epoch this connection follows
        self._text: str | None = None  # the payload file as last read
        self._doc: dict | None = None
        self._next_connect = 0.0
        self._last_sent = 0.0
        self._quiet: str | None = None  # why it is not writing (logged once per reason)

    def worker_gone(self) -> bool:
        # handed to another parent: the worker exited (its pid may be reused by another process)
        return os.getppid() != self.pid or process_state(self.pid) in (None, *EXITED)

    def read(self) -> bool:
        """Read the worker's payload; True if it changed (a few kB from memory: read every time,
        file times are too coarse to tell two quick publishes apart)."""
        try:
            with open(os.path.join(self.dir, PAYLOAD)) as f:
                text = f.read()
            if text == self._text:
                return False
            doc = json.loads(text)
        except (OSError, ValueError):
            return False
        self._text, self._doc = text, doc
        return True

    def connect(self, epoch: int) -> bool:
        """Be connected to the store the worker's clients use (``epoch``); tells the worker
        (``READY``) whether this process writes the heartbeats."""
        if self.store is not None and epoch == self.epoch:
            return True
        self.disconnect()
        now = time.monotonic()
        if now < self._next_connect:
            return False
        from liveshard.runtime.control.store import JobStore, connect_store

        try:
            self.store = JobStore(connect_store(self.host, self.port, timeout=5.0), self.job, self.secret)
        except Exception as e:  # the coordinator may be restarting
            self._next_connect = now + 0.5
            self._say(f"cannot connect to the store ({e})")
            return False
        self.epoch = epoch
        with contextlib.suppress(OSError), open(os.path.join(self.dir, READY), "w"):
            pass
        return True

    def disconnect(self) -> None:
        if self.store is not None:
            self.store = None
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.dir, READY))  # the worker sends its own until connected again

    def send(self, heartbeat: Heartbeat, now: float) -> bool:
        from liveshard.runtime.contract.keys import Keys

        key = Keys.heartbeat(self.id)
        try:
            self.store.set_json(key, stamped(heartbeat, now).to_dict())
            self.store.store.check([key])  # a set to a server that died can return without error
        except Exception as e:
            self.disconnect()
            self._say(f"heartbeat not written ({e}); connecting anew")
            return False
        self._quiet = None
        return True

    def _say(self, why: str) -> None:
        if why != self._quiet:
            self._quiet = why
            log.warning("%s: %s", self.id, why)

    def run(self) -> int:
        """Until the worker exits: ``tick`` every ``CHECK`` seconds."""
        while not self.worker_gone():
            self.tick(time.time())
            time.sleep(CHECK)
        _remove_dir(self.dir)
        return 0

    def tick(self, now: float) -> str:
        """One look: stay connected, and write the newest payload the worker handed over
        (``"pulse"`` true: published while this process was connected, so the worker did not
        send it itself) when it is new and every ``interval`` after. A payload the worker sent
        itself is taken over once it is ``2 * interval`` old (the worker got busy right after):
        its own write is long done, so the two never race on the key. What it did, as a word."""
        changed = self.read()
        doc = self._doc
        if not self.connect(int(doc.get("epoch", 0)) if doc else self.epoch):
            return "unconnected"
        if doc is None:
            return "nothing published"
        heartbeat = Heartbeat.parse(doc.get("payload"))
        if heartbeat is None:
            return "nothing published"
        age = now - heartbeat.time
        state = process_state(self.pid)
        if not doc.get("pulse") and age <= 2 * self.interval:
            return "sent by the worker"
        if state is not None and state not in RUNNING:
            self._say(f"worker process {self.pid} is not running (state {state}): not pulsing")
            return "worker stopped"
        if age > self.stale_after:
            self._say(f"the worker published nothing for {self.stale_after:.0f} s: not pulsing")
            return "stale"
        if not changed and now - self._last_sent < self.interval:
            return "sent recently"
        if not self.send(heartbeat, now):
            return "failed"
        self._last_sent = now
        return "sent"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                description="a liveshard worker's pulse: writes its heartbeats while it is alive")
    p.add_argument("--pid", type=int, required=True, help="the worker process (this process's parent)")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--id", required=True, help="the worker id whose heartbeat key it writes")
    p.add_argument("--dir", required=True, help="where the worker publishes its payload")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--stale-after", type=float, default=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from liveshard.runtime.control.store import job_secret
    from liveshard.runtime.errors import ConfigError

    try:
        secret = job_secret()
    except ConfigError as e:
        print(f"pulse: error: {e}", file=sys.stderr)
        return 2
    pulsing = Pulsing(args.pid, args.host, args.port, args.job, args.id, args.dir, interval=args.interval,
                      stale_after=args.stale_after, secret=secret)
    # SIGTERM (the worker's stop) ends it at once: the worker writes the last heartbeat itself.
    # A Ctrl-C reaches the whole process group: the worker decides, the pulse follows it out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return pulsing.run()


if __name__ == "__main__":
    sys.exit(main())
