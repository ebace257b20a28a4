"""The coordinator killed in the middle of a live change (``kill=coordinator@PHASE`` events of a
local run) and restarted on the same address, as Kubernetes restarts its pod. Real coordinator
and worker processes on CPU (gloo).

Inside the commit window (every ready vote cast, no decision read) the store holding the commit
point dies with the coordinator: the members wait, report their votes to the new one and adopt
its resolution (``agent.commit_point``); earlier (prepare, transfer) the generation aborts and the
new coordinator asks for the change again. Either way the run trains every step, the change is
made, and every worker ends with exit code 0, none with ``CommitPointLost``.
"""

from __future__ import annotations

import json

import pytest

from liveshard.dev.localrun.driver import LocalRun, RunSpec
from liveshard.dev.localrun.events import parse_events

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
GLOBAL_BATCH = 4
TP2, DP2 = "tp=2,pp=1,dp=1", "tp=1,pp=1,dp=2"


def _run(path, events: str, steps: int) -> tuple[dict, dict[str, int | None]]:
    """The report, and each worker's exit code."""
    job = LocalRun(RunSpec.mock(MODEL, workers=2, parallel=TP2, steps=steps, global_batch=GLOBAL_BATCH,
                                events=parse_events(events), workdir=str(path), heartbeat_timeout=2.0,
                                collective_timeout=10.0))
    try:
        report = job.run_live()
        codes = {w: p.wait(timeout=60) for w, p in job.procs.workers.items()}
    finally:
        job.procs.kill_all()
    (path / "run.json").write_text(json.dumps(report))
    return report, codes


def _check(report: dict, codes: dict, steps: int, path) -> None:
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    assert [s["consumed_samples"] for s in report["steps"]] == [GLOBAL_BATCH * k for k in range(1, steps + 1)]
    assert codes == {"w0": 0, "w1": 0}, codes
    logs = "".join(p.read_text(errors="replace") for p in path.glob("w*.log"))
    assert "CommitPointLost" not in logs


def test_the_coordinator_killed_inside_the_commit_window_then_at_transfer_loses_no_change(tmp_path):
    """Commit window: both ready votes confirmed, the store gone: the new coordinator resolves
    the generation committed from the members' reports, at the step it was asked for. Transfer:
    the members abort on their own (their switch's store is gone) and the new coordinator asks
    for the change again: it commits later, from the old world's state they still hold."""
    steps = 8
    report, codes = _run(tmp_path, f"2:kill=coordinator@commit-window 3:parallel={DP2} "
                                   f"4:kill=coordinator@transfer 5:parallel={TP2}", steps)
    _check(report, codes, steps, tmp_path)
    window, transfer = report["faults"]
    assert window["phase"] == "commit-window" and transfer["phase"] == "transfer"
    # the open generation is resolved committed: the change lands at step 3, as asked
    assert window["applied"] == window["asked"], window
    assert window["generations"][0] == {"generation": window["asked"], "outcome": "committed",
                                        "reason": f"config change to {DP2}"}, window
    assert [s["config"] for s in report["steps"][:5]] == [TP2 + ",ep=1"] * 3 + [DP2 + ",ep=1"] * 2
    # at transfer: no member voted, the generation aborts and the change is asked again
    assert transfer["applied"] > transfer["asked"], transfer
    assert all(g["outcome"].startswith("aborted") for g in transfer["generations"]
               if g["generation"] == transfer["asked"]), transfer
    assert transfer["generations"][-1]["outcome"] == "committed", transfer
    assert report["steps"][-1]["config"] == TP2 + ",ep=1"
    losses = [s["loss"] for s in report["steps"]]
    assert all(x is not None and 0 < x < 10 for x in losses) and losses[-1] < losses[0]


@pytest.mark.long
def test_the_coordinator_killed_while_the_members_prepare_loses_no_change(tmp_path):
    """Prepare: the members' preparation fails with the store, they report the plan they were
    preparing, and the new coordinator asks for it again. The old world trains on meanwhile (a
    no-op event at step 5 holds it there until the change is prepared): the change lands at the
    first step boundary where it is prepared, by step 5 (a change asked again has no switch
    step: it may come before the step first asked for)."""
    steps = 8
    report, codes = _run(tmp_path, f"2:kill=coordinator@prepare 3:parallel={DP2} 5:slow=0@1", steps)
    _check(report, codes, steps, tmp_path)
    (fault,) = report["faults"]
    assert fault["applied"] > fault["asked"] and fault["generations"][-1]["outcome"] == "committed", fault
    configs = [s["config"] for s in report["steps"]]
    switched = configs.index(DP2 + ",ep=1")
    assert 1 <= switched <= 5 and configs == [TP2 + ",ep=1"] * switched + [DP2 + ",ep=1"] * (steps - switched)
