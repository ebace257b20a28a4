"""The final checkpoint at ``trainIters``: saved until it is safe, or the job fails saying why.

An attempt is collective over the training world: every rank writes its part under one root
(``SafetyCheckpoints.save``, in the foreground), rank 0 verifies the files against the manifest
the save recorded (``checkpoint.verify``), and one all-gather of every rank's error (None: ok)
gives every rank the same verdict (``verdict``):

* **all ok**: that directory is the job's final checkpoint (``Saved``);
* **some rank failed** (a full disk, an I/O error, files that do not verify): rank 0 reports it
  as a failed save (``checkpoint/failed``: the coordinator's status, the job's
  ``CheckpointFailing`` condition) and deletes the partial directory; the next attempt follows
  the schedule (``attempts``): at once in the fallback directory
  (``WorkerOptions.final_fallback_dir``), then both again after pauses that double (waiting for
  space), until ``WorkerOptions.final_save_patience`` seconds have been waited;
* **the schedule is spent**: the last resort (``GaveUp``). The worker reports it (rank 0:
  ``Keys.FINISHED`` with an ``error``); the coordinator fails the job (``FinalCheckpointFailed``)
  and every worker exits 1 with that reason.

Every rank computes the same schedule from the same options and sees the same verdicts, so all
decide alike. A peer lost meanwhile (killed, or declared dead and cut off: ``cutoff.py``) fails
a collective of the attempt, and ``save`` raises that error: the worker treats the world as
broken, as after a failed training step (``training.train_one``), takes the coordinator's
recovery (the survivors' copy, or a restore of the newest verified checkpoint) and saves again
in the new world. A successful save after failed ones clears ``CheckpointFailing``.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from liveshard.runtime.agent.training import is_comm_failure
from liveshard.runtime.control.barrier import Backoff, wait_until
from liveshard.runtime.notice import notice

if TYPE_CHECKING:
    from liveshard.runtime.agent.worker import WorkerAgent

log = logging.getLogger("liveshard.worker")

FIRST_PAUSE = 5.0  # seconds before the first retry after every directory failed
LONGEST_PAUSE = 60.0  # the pauses double up to this


@dataclass(frozen=True)
class Attempt:
    """One try of the final save: under ``root``, after waiting ``wait`` seconds."""

    root: str
    wait: float = 0.0


@dataclass(frozen=True)
class Saved:
    path: str


@dataclass(frozen=True)
class GaveUp:
    reason: str  # one line: what failed where, and for how long it was tried


def attempts(primary: str | None, fallback: str | None, patience: float, first_pause: float = FIRST_PAUSE,
             longest_pause: float = LONGEST_PAUSE) -> list[Attempt]:
    """Every attempt of a final save, in order: the checkpoint directory and the fallback at
    once, then both again after each pause (``first_pause``, doubling up to ``longest_pause``;
    the last one shortened so that the pauses add up to ``patience``). Pure."""
    roots = [r for r in dict.fromkeys((primary, fallback)) if r]
    if not roots:
        return []
    out = [Attempt(r) for r in roots]
    waited, pause = 0.0, max(first_pause, 1e-3)
    while waited < patience:
        wait = min(pause, patience - waited)
        waited += wait
        out += [Attempt(roots[0], wait), *(Attempt(r) for r in roots[1:])]
        pause = min(2 * pause, max(longest_pause, first_pause))
    return out


def verdict(errors: list[str | None]) -> str | None:
    """The attempt's outcome from every rank's error (by rank): None when all succeeded, else
    the failure: the one error every failed rank saw (with the ranks when not all), or the
    first rank's, with how many more failed. Pure."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return None
    if len({e for _, e in failed}) == 1:  # megatron raises one write failure on every rank alike
        error = failed[0][1]
        return error if len(failed) == len(errors) else f"{error} (on rank(s) {', '.join(str(r) for r, _ in failed)})"
    rank, error = failed[0]
    return f"rank {rank}: {error} (and {len(failed) - 1} more rank(s))"


# Seconds rank 0 tries to tell a (restarted) coordinator that training finished
# (``finished_record``) before the error stands (``WorkerAgent._report_finished``).
FINISHED_REPORT_PATIENCE = 60.0


def finished_record(step: int, consumed_samples: int, checkpoint: str | None, generation: int | None,
                    now: float, error: str | None = None) -> dict:
    """``Keys.FINISHED``, written by rank 0 once the final save is decided: the step, the final
    checkpoint (None: none was configured, or with ``error`` none could be saved) and, when the
    save gave up, why (the coordinator then fails the job: ``FinalCheckpointFailed``). Pure."""
    return {"step": step, "consumed_samples": consumed_samples, "checkpoint": checkpoint, "generation": generation,
            "time": now, **({"error": error} if error else {})}


def console_line(root: str, failure: str, following: Attempt | None) -> str:
    """The console's one line for a failed attempt in ``root`` and what follows it: ``final
    checkpoint: no space left in DIR; next attempt in 5 s``. Pure."""
    full = "no space left" in failure.lower() or "[errno 28]" in failure.lower()  # ENOSPC
    what = "no space left" if full else failure
    if following is None:
        then = "giving up"
    else:
        then = "next attempt" + (f" in {following.root}" if following.root != root else "")
        then += f" in {following.wait:.0f} s" if following.wait else " now"
    return f"final checkpoint: {what} in {root}; {then}"


def give_up_reason(step: int, tried: list[str], last_error: str, waited: float) -> str:
    """The one line a job that cannot save its final checkpoint fails with. Pure."""
    where = " and ".join(dict.fromkeys(tried)) or "nowhere (no checkpoint directory)"
    return (f"the final checkpoint of step {step} could not be saved in {where} "
            f"(tried for {waited:.0f} s): {last_error}")


def save(agent: WorkerAgent) -> Saved | GaveUp:
    """Save the final checkpoint of ``agent``'s world (collective; every rank calls it at the
    same step). Raises the collective's error when a peer is lost meanwhile."""
    o = agent.options
    cp = agent.checkpoints
    t = agent.trainer
    plan = attempts(cp.configured_dir or o.checkpoint_dir, o.final_fallback_dir, o.final_save_patience)
    waited, last_error, tried = 0.0, "", []
    for i, attempt in enumerate(plan):
        if attempt.wait:
            _pause(agent, attempt.wait)
            waited += attempt.wait
        agent.at_phase("final-save", agent.state.generation if agent.state.generation is not None else -1)
        path = os.path.join(attempt.root, f"step{t.step_count:08d}")
        error = _attempt(agent, attempt.root, path)
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)  # a lost peer fails it: the world is broken
        failure = verdict(errors)
        if failure is None:
            if cp.failed_saves:
                cp.resolved(t.step_count)
                if agent.state.rank == 0:
                    notice(f"final checkpoint: saved in {path}")
            return Saved(path)
        tried.append(attempt.root)
        last_error = failure
        following = plan[i + 1] if i + 1 < len(plan) else None
        then = ("giving up" if following is None else f"next in {following.root}"
                + (f" in {following.wait:.0f} s" if following.wait else ""))
        if agent.state.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # what the attempt left: never taken for a checkpoint
            notice(console_line(attempt.root, failure, following))
        cp.failed(t.step_count, RuntimeError(f"final checkpoint in {attempt.root}: {failure}; {then}"))
    return GaveUp(give_up_reason(t.step_count, tried, last_error, waited))


def _attempt(agent: WorkerAgent, root: str, path: str) -> str | None:
    """This rank's part of one attempt: None, or why it failed here (rank 0 also verifies the
    files). A failed collective is raised: the world is broken, not the disk."""
    from torch.distributed.checkpoint import CheckpointException  # a BaseException: named here

    try:
        agent.checkpoints.save(agent.built, agent.trainer, background=False, root=root)
        if agent.state.rank == 0:
            from liveshard.runtime.agent.checkpoint import verify

            problem = verify(path)
            if problem is not None:
                return f"{path} does not verify: {problem}"
    except (Exception, CheckpointException) as e:
        if isinstance(e, Exception) and is_comm_failure(e):
            raise
        log.error("final checkpoint in %s failed here: %s: %s", root, type(e).__name__, e)
        full = _full_disk(root)
        return f"{full + ': ' if full else ''}{type(e).__name__}: {_first_cause(e)}"
    return None


FULL_BELOW = 4 << 20  # bytes free under which a failed write is put down to a full disk


def _full_disk(root: str) -> str | None:
    """"No space left on device ..." when ``root``'s filesystem is (nearly) full after a failed
    write: a writer that hits the end of a full disk does not always fail with ``ENOSPC`` (torch's
    archive writer reports "unexpected pos ..."), and the user must learn that space is the cause."""
    path = os.path.abspath(root)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    return f"No space left on device ({free} bytes free in {root})" if free < FULL_BELOW else None


def _first_cause(error: BaseException) -> str:
    """One line for ``error``: a ``CheckpointException``'s first rank failure (``[Errno 28] No
    space left on device``), not its tracebacks."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = [(rank, c[0] if isinstance(c, tuple) and c else c) for rank, c in sorted(failures.items())]
        # an OS error (a full disk) says more than what it made another writer fail with
        rank, cause = next(((r, c) for r, c in causes if isinstance(c, OSError) or "Errno" in str(c)), causes[0])
        text = f"rank {rank}: {type(cause).__name__}: {cause}"
    else:
        text = str(error)
    return " ".join(text.split())[:300]


def _pause(agent: WorkerAgent, seconds: float) -> None:
    """Wait for space (every rank waits as long). Cut short when the job is stopped or a newer
    plan is out (a peer lost meanwhile: the next attempt's collective then fails at once); the
    ranks meet again in that collective whoever stopped waiting first."""
    log.warning("final checkpoint: waiting %.0f s for space before the next attempt", seconds)

    def cut_short() -> str | None:
        generation = agent.state.generation if agent.state.generation is not None else -1
        if agent.control.stop_requested:
            return "stop"
        return "newer plan" if agent.control.latest_seen > generation else None

    wait_until(lambda: None, timeout=seconds, abort=cut_short, poll=Backoff.fixed(0.25))
