"""A join naming a worker that never registers never stalls the running world (issue #23): a real
local run (coordinator and workers as processes, gloo) whose joiner is SIGKILLed right after it
is spawned, before Python has imported anything, so it never registers with the coordinator.

The driver then asks for the join anyway. The coordinator must publish no plan naming the dead
joiner: the request waits for it while the world trains on, and after its bound (the larger of
the never-seen grace and the transition timeout; the driver's coordinator runs with a short
transition timeout) it is planned without the joiner (or refused). Every step is trained once,
every sample consumed once, and the run ends OK. A later hold step (a no-op ``slow`` event) keeps
the run from reaching trainIters before the bound.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from liveshard.dev.localrun.driver import LocalRun, RunSpec, _refusals
from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.contract.keys import Keys
from liveshard.runtime.coordinator.membership import Liveness
from liveshard.runtime.errors import RunFailed

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 4
STEPS = 10
JOIN_STEP, HOLD_STEP = 2, 6
HEARTBEAT_TIMEOUT = 2.0
TRANSITION_TIMEOUT = 20.0  # the production default (120 s) would make the join wait two minutes
# How long the coordinator waits for a worker a request names to register (planning._start)
BOUND = max(Liveness(HEARTBEAT_TIMEOUT).never_seen_grace, TRANSITION_TIMEOUT)
MARGIN = 15.0  # coordinator ticks and a loaded machine


@pytest.mark.long
def test_a_join_naming_a_worker_that_never_registers_never_stalls_the_world(tmp_path):
    run = RunSpec.mock("tiny-llama", workers=1, parallel="tp=1,pp=1,dp=1", steps=STEPS, global_batch=GLOBAL_BATCH,
                       events=parse_events(f"{JOIN_STEP}:join=1 {HOLD_STEP}:slow=0@1"), workdir=str(tmp_path),
                       heartbeat_timeout=HEARTBEAT_TIMEOUT, collective_timeout=10.0,
                       transition_timeout=TRANSITION_TIMEOUT)
    job = LocalRun(run)
    joiner = "w1"
    killed: list[float] = []
    posted: list[float] = []
    ended: list[tuple[str, float]] = []  # how the wait ended ("planned" or "refused"), and when
    plans: list = []  # every plan the coordinator published, read before it stops
    reached: list[int] = []  # the world's step, as the coordinator reported it while the join waited
    start_worker, wait_final_world = job.start_worker, job._wait_final_world

    def start_then_kill_joiner(wid, port, **kw):
        start_worker(wid, port, **kw)
        if wid == joiner:  # killed before its interpreter has imported anything: it never registers
            proc = job.procs.workers[wid]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed.append(time.time())

    def join_without_registration(store, request, gen, ev, new):
        assert new == (joiner,) and joiner not in store.members()
        job._post(store, request)
        posted.append(time.time())
        store.set(Keys.release(ev.step), "1")  # the running world trains on while the join waits
        end = time.monotonic() + BOUND + MARGIN
        while store.latest_generation() < gen:
            st = job._status(store)
            assert not st.get("failure"), st["failure"]
            # nothing pending, nobody taken for dead: the world is never held up by the join
            assert st.get("pending") is None and not st.get("dead"), (st.get("pending"), st.get("dead"))
            reached.append(int((st.get("progress") or {}).get("step") or 0))
            if [h for h in _refusals(st) if h.get("reason") == request.reason]:
                ended.append(("refused", time.time()))
                return st
            assert time.monotonic() < end, f"the join still waits {BOUND + MARGIN:.0f} s after it was asked"
            job._check_alive()
            time.sleep(0.05)
        ended.append(("planned", time.time()))
        # it switches at the next step boundary, the hold step at the latest
        return job._wait_generation(store, gen, timeout=120.0,
                                    while_waiting=lambda st: job._release_next_hold(store, st, ev.step))

    def final_world_then_plans(store, *a, **kw):
        st = wait_final_world(store, *a, **kw)
        plans.extend(store.plan(g) for g in range(store.latest_generation() + 1))
        assert joiner not in store.members()  # it never registered
        return st

    job.start_worker = start_then_kill_joiner
    job._join = join_without_registration
    job._wait_final_world = final_world_then_plans
    t0 = time.monotonic()
    try:
        report = job.run_live()
    except RunFailed:
        print((tmp_path / "coordinator.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        job.procs.kill_all()
    report["test"] = {"killed": killed, "posted": posted, "ended": ended, "bound": BOUND, "reached": max(reached, default=0),
                      "wall": time.monotonic() - t0}
    (tmp_path / "run.json").write_text(json.dumps(report))

    assert killed and posted and ended
    assert report["exit_codes"][joiner] == -signal.SIGKILL
    # no plan ever named the joiner, as a member or a standby
    assert plans and all(p is not None for p in plans)
    assert all(joiner not in (*p.members, *p.standbys) for p in plans), [(p.generation, p.members) for p in plans]
    # the request waited for it (it might have been starting), and no longer than its bound
    how, when = ended[0]
    waited = when - posted[0]
    assert BOUND - 2.0 <= waited <= BOUND + MARGIN, (how, waited, BOUND)
    if how == "planned":
        log = (tmp_path / "coordinator.log").read_text(errors="replace")
        assert f"{joiner} never registered; planned without them" in log
    # the running world trained on meanwhile: the steps after the join's up to the hold step
    # ended while the join waited, and every step and sample counts once
    steps = report["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["consumed_samples"] for s in steps] == [GLOBAL_BATCH * k for k in range(1, STEPS + 1)]
    assert all(posted[0] < s["time"] < when for s in steps if JOIN_STEP < s["step"] <= HOLD_STEP), \
        [(s["step"], s["time"] - posted[0]) for s in steps]
    assert max(reached, default=0) == HOLD_STEP, reached
    assert all(s["world_size"] == 1 for s in steps)
    assert report["exit_codes"]["w0"] == 0
