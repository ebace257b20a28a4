"""Processes killed at every phase of a live reconfiguration (``kill=R@PHASE`` events of a
local run): the job recovers from a surviving copy of the state and ends exactly where the
matching planned run ends. Real coordinator and worker processes on CPU (gloo).

The dangerous window is between the commit vote and the commit point: the old world's groups
are gone, the new world is not yet the job's. A death there must leave every survivor holding
the old state (the generation aborts, the coordinator recovers from it), never state that was
already freed.
"""

from __future__ import annotations

import json

import pytest

from liveshard.dev.localrun.driver import RunSpec, run_local
from liveshard.dev.localrun.events import parse_events

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
GLOBAL_BATCH = 4


def _run(path, events: str, steps: int, workers: int, parallel: str) -> dict:
    report = run_local(RunSpec.mock(MODEL, workers=workers, parallel=parallel, steps=steps, global_batch=GLOBAL_BATCH,
                                    events=parse_events(events), workdir=str(path), heartbeat_timeout=2.0,
                                    collective_timeout=10.0))
    (path / "run.json").write_text(json.dumps(report))
    return report


def _same_training(faulted: dict, planned: dict, steps: int) -> None:
    assert [s["step"] for s in faulted["steps"]] == list(range(1, steps + 1))
    # no sample lost or repeated, and the same losses and final state as the planned run
    assert [s["consumed_samples"] for s in faulted["steps"]] == [GLOBAL_BATCH * k for k in range(1, steps + 1)]
    assert [s["loss"] for s in faulted["steps"]] == [s["loss"] for s in planned["steps"]]
    assert faulted["checksums"] and faulted["checksums"] == planned["checksums"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One worker, dp=1, no event, ``steps`` steps: what the joiner and restart cases must end
    as (each length run once per module)."""
    runs: dict[int, dict] = {}

    def run(steps: int) -> dict:
        if steps not in runs:
            runs[steps] = _run(tmp_path_factory.mktemp(f"uninterrupted{steps}"), "", steps, 1, "tp=1,pp=1,dp=1")
        return runs[steps]
    return run


def test_a_joiner_killed_between_its_new_world_and_the_commit_point_leaves_no_trace(tmp_path, uninterrupted):
    """The hardest phase of the three below, in the default run: the joiner dies after the new
    world was built and before the commit point; the members fall back to the old state they
    hold, train on, and the next join commits."""
    steps = 4
    faulted = _run(tmp_path / "faulted", "1:kill=+1@built 2:join=1", steps, 1, "tp=1,pp=1,dp=1")
    _same_training(faulted, uninterrupted(steps), steps)
    (built,) = faulted["faults"]
    assert [g["outcome"][:7] for g in built["generations"]] == ["aborted", "committ"]
    assert built["recovery_seconds"] < 30, built


@pytest.mark.long
def test_a_joiner_killed_at_any_phase_of_its_join_leaves_the_run_as_if_it_never_came(tmp_path, uninterrupted):
    """Three joins, each losing its joiner at another phase: before its vote (prepare), between
    the new world built and the commit point (built: the members hold the old state again) and
    just after the commit point (committed: the new world lost a member, its replica survives)."""
    steps = 8
    faulted = _run(tmp_path / "faulted", "1:kill=+1@prepare 2:join=1 3:kill=+1@built 4:join=1 "
                   "5:kill=+1@committed 6:join=1", steps, 1, "tp=1,pp=1,dp=1")
    _same_training(faulted, uninterrupted(steps), steps)
    prepare, built, committed = faulted["faults"]
    assert [g["outcome"][:7] for g in prepare["generations"]] == ["aborted"]  # the old world trains on
    assert [g["outcome"][:7] for g in built["generations"]] == ["aborted", "committ"]  # recovered from the old state
    assert [g["outcome"][:7] for g in committed["generations"]] == ["committ", "committ"]  # from the new world
    assert all(f["recovery_seconds"] < 30 for f in faulted["faults"]), faulted["faults"]


@pytest.mark.long
def test_a_joiner_killed_while_the_new_world_connects_aborts_only_its_join(tmp_path):
    """New members connect the next world's communicators during prepare; the joiner dies at
    ``connect``, after the members met on the store, so the member is already waiting for it in
    a connection. That wait runs on a store client and thread of its own: the member keeps
    heartbeating (not declared dead itself), the coordinator's abort calls the connection off,
    the old world trains on untouched, and the next join commits. The run ends as the same run
    with only that join ends."""
    steps = 8
    faulted = _run(tmp_path / "faulted", "1:kill=+1@connect 2:join=1 4:join=1", steps, 1, "tp=1,pp=1,dp=1")
    planned = _run(tmp_path / "planned", "4:join=1", steps, 1, "tp=1,pp=1,dp=1")
    _same_training(faulted, planned, steps)
    (connect,) = faulted["faults"]
    assert [g["outcome"][:7] for g in connect["generations"]] == ["aborted"]
    assert [s["world_size"] for s in faulted["steps"]] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert connect["recovery_seconds"] < 30, connect


@pytest.mark.long
def test_a_leaver_killed_after_the_vote_does_not_undo_what_it_delivered(tmp_path):
    """A leaver dies at ``commit`` (after the vote, its state already sent) while the survivor
    makes its new world from communicators connected ahead: the leave commits and the run ends
    as the planned leave ends. (Whether the coordinator or the member decides first depends on
    timing; ``test_commit_arrival`` and ``test_coordinator`` check the arrival count that makes
    the coordinator's answer right.)"""
    steps = 5
    faulted = _run(tmp_path / "faulted", "2:kill=1@commit 3:leave=1", steps, 2, "tp=1,pp=1,dp=2")
    planned = _run(tmp_path / "planned", "3:leave=1", steps, 2, "tp=1,pp=1,dp=2")
    _same_training(faulted, planned, steps)
    (commit,) = faulted["faults"]
    assert [g["outcome"] for g in commit["generations"]] == ["committed"]


@pytest.mark.long
def test_a_frozen_member_comes_back_new_and_a_member_killed_after_the_vote_loses_nothing(tmp_path):
    """A member frozen (SIGSTOP) at step 1 is lost without notice; let go at step 2, it finds the
    job went on without it, drops its stale state and rejoins as a new member. Then the case
    that used to lose the run: a member dies after the commit vote, when its peers have torn
    their old world down. They kept its state, so the recovery moves it from them. A last
    joiner killed during its transfer only aborts that join. The run ends as the planned
    leaves and join end."""
    steps = 7
    faulted = _run(tmp_path / "faulted", "1:sigstop=1 2:sigcont=all 3:kill=1@commit 4:join=1 "
                   "5:kill=+1@transfer 6:join=1", steps, 2, "tp=1,pp=1,dp=2")
    planned = _run(tmp_path / "planned", "1:leave=1 2:join=1 4:leave=1", steps, 2, "tp=1,pp=1,dp=2")
    _same_training(faulted, planned, steps)
    assert [s["world_size"] for s in faulted["steps"]] == [2, 1, 2, 2, 1, 1, 1]
    rejoined = next(e for e in faulted["events"] if e["kind"] == "sigcont")
    assert rejoined["outcome"] == "committed"
    commit, transfer = faulted["faults"]
    # aborted by the coordinator (w1 died) or, first, by w0 itself: its new world, connected
    # ahead with w1 in it, fails at once on the dead peer's connection
    first = commit["generations"][0]["outcome"]
    assert first.startswith("aborted: member w1 died") or first.startswith("aborted: w0: commit:"), first
    assert commit["generations"][-1]["outcome"] == "committed"
    assert [g["outcome"][:7] for g in transfer["generations"]] == ["aborted"]
    assert all(f["recovery_seconds"] < 30 for f in faulted["faults"]), faulted["faults"]


@pytest.mark.long  # the same run through the CLI: test_exit_codes' dead job, in the default run
def test_state_lost_with_no_copy_and_no_checkpoint_is_a_clear_failure_within_a_minute(tmp_path):
    """tp=2 on two workers, no safety checkpoints: a kill takes the only copy of half of every
    weight. Nothing can continue the run: the coordinator reports why (the operator fails the
    job), and the survivor is told to stop instead of waiting for a plan forever."""
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the job failed \(NoSurvivingCopy\).*no checkpoint"):
        _run(tmp_path / "lost", "3:kill=1", 6, 2, "tp=2,pp=1,dp=1")
    assert time.monotonic() - t0 < 90  # start-up included; the failure itself comes seconds after the kill


@pytest.mark.long
def test_every_process_replaced_at_once_continues_from_the_newest_checkpoint(tmp_path, uninterrupted):
    """The coordinator and every worker killed at step 5 (a whole spot pool gone), new processes
    started on the same checkpoint directory: the first world of the new coordinator restores
    the step-4 checkpoint and recomputes step 5; the run ends as an uninterrupted one."""
    restarted = run_local(RunSpec.mock(MODEL, workers=1, parallel="tp=1,pp=1,dp=1", steps=8, global_batch=GLOBAL_BATCH,
                                       events=parse_events("5:restart=all"), workdir=str(tmp_path / "r"),
                                       heartbeat_timeout=2.0, collective_timeout=10.0, checkpoint_every=2))
    # the killed processes' own records die with them: the report holds what the new ones trained
    got = restarted["steps"]
    assert [s["step"] for s in got] == [5, 6, 7, 8]  # from the step-4 checkpoint, not from step 1
    assert [s["consumed_samples"] for s in got] == [GLOBAL_BATCH * k for k in (5, 6, 7, 8)]
    assert [s["loss"] for s in got] == [s["loss"] for s in uninterrupted(8)["steps"]][4:]
    assert restarted["checksums"] and restarted["checksums"] == uninterrupted(8)["checksums"]
    assert restarted["events"][0]["outcome"] == "restarted"
    # the resume was said on the console as it happened (run-local prints the run's notices)
    notices = [json.loads(line)["text"] for line in (tmp_path / "r" / "notices.jsonl").read_text().splitlines()]
    assert any(n.startswith("resuming from the checkpoint of step 4 (") for n in notices), notices
