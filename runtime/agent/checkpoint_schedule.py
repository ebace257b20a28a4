"""When a worker saves a checkpoint, and when a save counts as complete.

Safety checkpoints are the fallback for a loss with no surviving copy of some state. They are
due every ``checkpoint_every`` steps or ``checkpoint_interval`` seconds (``SafetyCheckpoints.due``);
all ranks learn at the step boundary's all-reduce whether any rank's is due, and then all save at
that same step (``save``, in the background: megatron's async ``torch_dist`` writer). A background
save is finalized collectively at a later step boundary (``finalize``): once it is done, or
``checkpoint_finalize_steps`` after it started, or before a switch or a stop (``settle``). Only
then is it complete: rank 0 publishes it as ``checkpoint/latest``, the one a restore plan loads.
A broken world cannot agree that a save is complete: its save in flight is dropped (``abandon``).

A stop and the final checkpoint save in the foreground (complete on return; the final save's
retries and fallback are ``final_save.py``). How a checkpoint is written and loaded is
``checkpoint.py``.

A save that fails (a full disk, an I/O error: megatron raises the same ``CheckpointException``
on every rank at finalize) costs that checkpoint, not the run: training goes on, the next save
is due a full interval later, and rank 0 reports it (``checkpoint/failed``: the coordinator's
status, the job's ``CheckpointFailing`` condition). A directory that cannot be used at all is
reported at start (``checkpoint/unavailable``: ``CheckpointUnavailable``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from liveshard.runtime.agent.connection import StoreClients
from liveshard.runtime.contract.checkpoint import MARKER
from liveshard.runtime.contract.keys import Keys

CLIP = 500  # characters of a save's error kept in events and the store


def clip(text: str, limit: int = CLIP) -> str:
    """``text`` within ``limit`` characters, its head and its tail kept: a message ends with what
    happens next ("next in DIR in 5 s"), which must survive long paths in the middle."""
    if len(text) <= limit:
        return text
    tail = limit // 3
    return f"{text[:limit - tail - 3]}...{text[-tail:]}"

if TYPE_CHECKING:
    from liveshard.runtime.agent.worker import WorkerOptions, WorkerState

log = logging.getLogger("liveshard.worker")


def prune(root: str | None, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``, and saves that were
    abandoned before the newest complete one (a save interrupted by a kill or a broken world).
    A directory newer than the newest complete one may still be being written: it stays. Returns
    the deleted paths. Called by rank 0 right after a checkpoint became complete."""
    import shutil
    from pathlib import Path

    from liveshard.runtime.agent.checkpoint import is_complete, read_meta
    from liveshard.runtime.contract.checkpoint import JobIdentity

    if not root or keep <= 0 or not os.path.isdir(root):
        return []
    identity = JobIdentity.from_env()
    done, other = [], []
    for entry in Path(root).iterdir():
        if not entry.is_dir() or not entry.name.startswith("step"):
            continue  # the dataset cache, TensorBoard, anything else: not ours to remove
        if is_complete(entry):
            meta = read_meta(entry)
            if identity is not None and not identity.owns(meta):
                continue  # another job's run (the one spec.training.resume names): never removed
            done.append((int(meta.get("step", -1)), entry))
        else:
            other.append(entry)
    done.sort()
    if not done:
        return []
    newest = done[-1][1].name
    doomed = [p for _, p in done[:-keep]] + [p for p in other if p.name < newest]
    removed = []
    for path in doomed:
        try:
            shutil.rmtree(path)
            removed.append(str(path))
        except OSError as e:  # retention must never stop training
            log.warning("could not delete old checkpoint %s: %s", path, e)
    if removed:
        log.info("deleted %d old checkpoint(s); kept the newest %d", len(removed), keep)
    return removed


class SafetyCheckpoints:
    """One worker's checkpoint schedule and its saves in flight."""

    def __init__(self, options: WorkerOptions, state: WorkerState, clients: StoreClients) -> None:
        self.options = options
        self.state = state
        self.clients = clients
        self.last: dict | None = None  # newest complete checkpoint this worker saved
        self.last_save = time.monotonic()
        self._saves: Any = None  # megatron AsyncCallsQueue of this world's background saves
        self._save_started_at = 0  # step at which the save in flight started
        # rank 0 hashes every byte of a background save off the training thread (``verify_later``);
        # the checkpoint's completion then runs on the training thread at the next finalize
        self._hashing: list[threading.Thread] = []
        self._verified: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.failed_saves = 0
        # the directory the job names, also when it was unusable at start (the final save
        # tries it again: space may have come back)
        self.configured_dir: str | None = options.checkpoint_dir
        # the size of the last checkpoint rank 0 saw complete: the free space the next save needs
        self.expected_bytes = 0

    def check_dir(self) -> None:
        """An unusable checkpoint directory turns safety checkpoints off (and a stop is refused)."""
        d = self.options.checkpoint_dir
        if not d:
            return
        try:
            os.makedirs(d, exist_ok=True)
            if not os.access(d, os.W_OK):
                raise PermissionError(f"{d} is not writable")
        except OSError as e:
            log.error("checkpoint directory %s is unusable (%s): no safety checkpoints, and a stop will be "
                      "refused; mount a shared writable volume there (spec.checkpoint)", d, e)
            self.options.checkpoint_dir = None
            with contextlib.suppress(Exception):  # reported where the job's status can show it
                self.clients.store.set_json(Keys.CHECKPOINT_UNAVAILABLE, {"path": d, "error": str(e),
                                                                          "time": time.time()})

    def due(self, step: int) -> bool:
        """Whether this rank's safety checkpoint is due after ``step``."""
        o = self.options
        if not o.checkpoint_dir:
            return False
        if o.checkpoint_every and step % o.checkpoint_every == 0:
            return True
        return bool(o.checkpoint_interval) and time.monotonic() - self.last_save >= o.checkpoint_interval

    def postpone(self) -> None:
        """A safety checkpoint failed: the next one is due a full interval from now."""
        self.last_save = time.monotonic()

    def save(self, built: Any, trainer: Any, background: bool = False, root: str | None = None) -> None:
        """Save the training world's state (collective) as ``<checkpoint_dir>/step<N>`` (under
        ``root`` instead, if given: the final save's fallback). Once it is complete, rank 0
        publishes it as the newest checkpoint: the one a recovery with no surviving copy loads.
        ``background``: written while training goes on (a safety checkpoint); otherwise complete
        on return (a stop, the final checkpoint)."""
        from liveshard.runtime.agent import checkpoint

        t = trainer
        root = root or self.options.checkpoint_dir
        if not root:
            raise RuntimeError("no checkpoint directory (--checkpoint-dir or LIVESHARD_CHECKPOINT_DIR)")
        if background and self._saves is not None and self._saves.get_num_unfinalized_calls():
            return  # the previous one is still being written (every rank knows the same)
        if not background:
            self.finalize(step=t.step_count, wait=True)
        path = os.path.join(root, f"step{t.step_count:08d}")
        info = {"path": path, "step": t.step_count, "config": str(built.cfg)}
        t0 = time.perf_counter()
        self.last_save = time.monotonic()

        def complete() -> None:
            self.last = {**info, "time": time.time()}
            if self.state.rank == 0:
                self.expected_bytes = checkpoint.manifest_bytes(path) or self.expected_bytes
                self.clients.store.publish_checkpoint(self.last)  # a rewind after a restore (control.store)
                prune(self.options.checkpoint_dir, self.options.checkpoint_keep)
            self.state.events.append({"kind": "checkpoint", "step": info["step"], "path": path,
                                      "seconds": time.perf_counter() - t0, "time": time.time()})

        if checkpoint.is_complete(path, t.step_count):
            # the same step saved before this restore (a recompute): published again only if it
            # still verifies; a corrupt one (what the restore went back past) is saved anew. Every
            # rank verifies, so all take the same way (the save is collective)
            problem = checkpoint.verify(path)
            if problem is None:
                complete()
                return
            log.warning("checkpoint %s fails verification (%s): saved anew, not published as it is", path, problem)
            if self.state.rank == 0:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(path, MARKER))  # complete again only once saved anew
        if background:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            if self._saves is None:
                self._saves = AsyncCallsQueue()
            self._save_started_at = t.step_count
            checkpoint.save(built, t, path, queue=self._saves, on_complete=complete, min_free=self.expected_bytes,
                            verify_later=lambda mark: self._verify_later(mark, complete, t.step_count))
        else:
            checkpoint.save(built, t, path, on_complete=complete, min_free=self.expected_bytes)

    def _verify_later(self, mark: Callable[[], None], complete: Callable[[], None], step: int) -> None:
        """Rank 0: hash the finished save's files and write its marker in a thread; its
        completion (publication, pruning) waits for the training thread (``_drain_verified``)."""

        def run() -> None:
            try:
                mark()
            except Exception as e:  # a file gone or unreadable: the save never becomes complete
                error = e
                self._verified.put(lambda: self.failed(step, error))
                return
            self._verified.put(complete)

        thread = threading.Thread(target=run, name="liveshard-checkpoint-hash", daemon=True)
        self._hashing = [h for h in self._hashing if h.is_alive()] + [thread]
        thread.start()

    def _drain_verified(self, wait: bool) -> None:
        """Complete the saves whose files are hashed (``wait``: for every one being hashed)."""
        if wait:
            for thread in self._hashing:
                thread.join()
            self._hashing = []
        while True:
            try:
                done = self._verified.get_nowait()
            except queue.Empty:
                return
            done()

    def finalize(self, step: int | None, wait: bool = False) -> None:
        """Complete the background saves that are done (all ranks call this at the same step:
        it is collective); ``wait`` for the one in flight, as at a switch or a stop, or when
        ``checkpoint_finalize_steps`` have passed since it started (``step``: the current one,
        None without a model)."""
        try:
            self._finalize_saves(step, wait)
        finally:
            self._drain_verified(wait)

    def _finalize_saves(self, step: int | None, wait: bool) -> None:
        if self._saves is None or not self._saves.get_num_unfinalized_calls():
            return
        steps = self.options.checkpoint_finalize_steps
        due = bool(steps) and step is not None and step - self._save_started_at >= steps
        from torch.distributed.checkpoint import CheckpointException

        try:
            self._saves.maybe_finalize_async_calls(blocking=wait or due)
        except CheckpointException as e:
            # raised on every rank alike (megatron gathers every rank's write result first);
            # anything else (a peer gone, rank 0's own marker write) is not caught here
            self.failed(self._save_started_at, e)

    def failed(self, step: int, error: BaseException) -> None:
        """A save failed (at finalize: on every rank alike; a save that did not start: on the
        ranks that tried): training goes on without it; rank 0 reports it."""
        self.failed_saves += 1
        self.postpone()
        log.error("checkpoint of step %d failed (training goes on; the next one is due a full interval "
                  "later): %s", step, error)
        self.state.events.append({"kind": "checkpoint_failed", "step": step, "error": clip(str(error)),
                                  "time": time.time()})
        if self.state.rank == 0:
            with contextlib.suppress(Exception):
                self.clients.store.set_json(Keys.CHECKPOINT_FAILED, {"step": step, "error": clip(str(error)),
                                                                     "count": self.failed_saves, "time": time.time()})

    def resolved(self, step: int) -> None:
        """A save of ``step`` completed after failed ones (the final checkpoint, retried): rank 0
        marks the last failure resolved, which clears ``CheckpointFailing``."""
        if self.state.rank != 0:
            return
        with contextlib.suppress(Exception):
            failed = self.clients.store.get_json(Keys.CHECKPOINT_FAILED)
            if isinstance(failed, dict):
                self.clients.store.set_json(Keys.CHECKPOINT_FAILED, {**failed, "resolved": step})

    def abandon(self) -> None:
        """A broken world cannot agree that a save is complete: it never becomes the newest."""
        if self._saves is not None:
            with contextlib.suppress(Exception):
                self._saves.close(abort=True)
        self._saves = None

    def settle(self, broken: bool) -> None:
        """Before a switch: the old world completes its save in flight (abandons it if
        ``broken``); the next world numbers its saves afresh, joiners included."""
        if self._saves is None:
            return
        if broken:
            self.abandon()
        else:
            self.finalize(step=None, wait=True)
        self._saves = None
