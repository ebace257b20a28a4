"""An aborted join is retried, never fatal: a real local run (coordinator and workers as
processes, gloo) whose joiner is frozen while its join is decided.

The joiner's process group (the worker and its pulse) is SIGSTOPped just before the driver asks
for the join and let go after the heartbeat timeout: the coordinator declares it dead and aborts
the join; the joiner finds itself excluded and comes back as a new member; the driver asks again
and the second try commits. A later hold step (a no-op ``slow`` event) keeps the run from
reaching trainIters before the retry.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.contract.keys import Keys

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 4
STEPS = 10
HEARTBEAT_TIMEOUT = 2.0


@pytest.mark.long
def test_a_join_aborted_by_a_frozen_joiner_is_retried_and_commits(tmp_path):
    run = RunSpec.mock("tiny-llama", workers=1, parallel="tp=1,pp=1,dp=1", steps=STEPS, global_batch=GLOBAL_BATCH,
                       events=parse_events("2:join=1 8:slow=0@1"), workdir=str(tmp_path),
                       heartbeat_timeout=HEARTBEAT_TIMEOUT, collective_timeout=10.0, join_backoff=1.0)
    job = LocalRun(run)
    join = job._join
    frozen: list[float] = []

    def freeze_then_join(store, request, gen, ev, new):
        (joiner,) = new
        end = time.monotonic() + 120
        while store.get(Keys.heartbeat(joiner)) is None:  # it registered and beat: a known member
            assert time.monotonic() < end
            time.sleep(0.05)
        pgid = job.procs.workers[joiner].pid
        os.killpg(pgid, signal.SIGSTOP)
        frozen.append(time.time())

        def thaw() -> None:
            time.sleep(HEARTBEAT_TIMEOUT + 3.0)
            os.killpg(pgid, signal.SIGCONT)

        threading.Thread(target=thaw, daemon=True).start()
        return join(store, request, gen, ev, new)

    job._join = freeze_then_join
    try:
        report = job.run_live()
    finally:
        job.procs.kill_all()
    (tmp_path / "run.json").write_text(json.dumps(report))
    assert frozen
    assert [s["step"] for s in report["steps"]] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    joined = report["events"][0]
    assert joined["kind"] == "join" and joined["outcome"] == "committed", joined
    (aborted,) = joined["retried"]
    assert aborted["outcome"].startswith("aborted") and "w1" in aborted["outcome"], aborted
    assert report["steps"][-1]["world_size"] == 2  # the joiner trains in the end
