"""When a worker saves a checkpoint, and when a save counts as complete.

Safety checkpoints are the fallback for a loss with no surviving copy of some state. They are
due every ``checkpoint_every`` steps or ``checkpoint_interval`` seconds (``SafetyCheckpoints.due``);
all ranks learn at the step boundary's all-reduce whether any rank's is due, and then all save at
that same step (``save``, in the background: megatron's async ``torch_dist`` writer). A background
save is finalized collectively at a later step boundary (``finalize``): once it is done, or
``checkpoint_finalize_steps`` after it started, or before a switch or a stop (``settle``). Only
then is it complete: rank 0 publishes it as ``checkpoint/latest``, the one a restore plan loads.
A broken world cannot agree that a save is complete: its save in flight is dropped (``abandon``).

A stop saves in the foreground (complete on return). How a checkpoint is written and loaded is
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
import time
from typing import TYPE_CHECKING, Any

from liveshard.runtime.agent.connection import StoreClients
from liveshard.runtime.contract.keys import Keys

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

    if not root or keep <= 0 or not os.path.isdir(root):
        return []
    done, other = [], []
    for entry in Path(root).iterdir():
        if not entry.is_dir() or not entry.name.startswith("step"):
            continue  # the dataset cache, TensorBoard, anything else: not ours to remove
        if is_complete(entry):
            done.append((int(read_meta(entry).get("step", -1)), entry))
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
        self.failed_saves = 0

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

    def save(self, built: Any, trainer: Any, background: bool = False) -> None:
        """Save the training world's state (collective) as ``<checkpoint_dir>/step<N>``. Once it
        is complete, rank 0 publishes it as the newest checkpoint: the one a recovery with no
        surviving copy loads. ``background``: written while training goes on (a safety
        checkpoint); otherwise complete on return (a stop)."""
        from liveshard.runtime.agent import checkpoint

        t = trainer
        if not self.options.checkpoint_dir:
            raise RuntimeError("no checkpoint directory (--checkpoint-dir or LIVESHARD_CHECKPOINT_DIR)")
        if background and self._saves is not None and self._saves.get_num_unfinalized_calls():
            return  # the previous one is still being written (every rank knows the same)
        if not background:
            self.finalize(step=t.step_count, wait=True)
        path = os.path.join(self.options.checkpoint_dir, f"step{t.step_count:08d}")
        info = {"path": path, "step": t.step_count, "config": str(built.cfg)}
        t0 = time.perf_counter()
        self.last_save = time.monotonic()

        def complete() -> None:
            self.last = {**info, "time": time.time()}
            if self.state.rank == 0:
                self.clients.store.publish_checkpoint(self.last)  # a rewind after a restore (control.store)
                prune(self.options.checkpoint_dir, self.options.checkpoint_keep)
            self.state.events.append({"kind": "checkpoint", "step": info["step"], "path": path,
                                      "seconds": time.perf_counter() - t0, "time": time.time()})

        if checkpoint.is_complete(path, t.step_count):
            complete()
            return
        if background:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            if self._saves is None:
                self._saves = AsyncCallsQueue()
            self._save_started_at = t.step_count
            checkpoint.save(built, t, path, queue=self._saves, on_complete=complete)
        else:
            checkpoint.save(built, t, path, on_complete=complete)

    def finalize(self, step: int | None, wait: bool = False) -> None:
        """Complete the background saves that are done (all ranks call this at the same step:
        it is collective); ``wait`` for the one in flight, as at a switch or a stop, or when
        ``checkpoint_finalize_steps`` have passed since it started (``step``: the current one,
        None without a model)."""
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
        self.state.events.append({"kind": "checkpoint_failed", "step": step, "error": str(error)[:500],
                                  "time": time.time()})
        if self.state.rank == 0:
            with contextlib.suppress(Exception):
                self.clients.store.set_json(Keys.CHECKPOINT_FAILED, {"step": step, "error": str(error)[:500],
                                                                     "count": self.failed_saves, "time": time.time()})

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
