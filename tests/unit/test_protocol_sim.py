"""The protocol simulator (``liveshard.dev.sim``): the shipped store, coordinator loop and commit
driver under seeded faults, safety and liveness invariants checked at every step. A fixed
budget here; ``bench/bench_protocol_sim.py`` soaks, ``test_sim_mutants.py`` plants bugs."""

from __future__ import annotations

import pytest

from liveshard.dev.sim import run_schedule, run_schedules
from liveshard.dev.sim.__main__ import main
from liveshard.dev.sim.kinds import FAULTS
from liveshard.dev.sim.scenarios import SCENARIOS
from liveshard.dev.sim.world import Simulation
from liveshard.runtime.control.store import JobStore


def test_seeded_fault_schedules_hold_every_invariant():
    report = run_schedules(300, seed=20261127)
    assert report.failed is None, (report.failed.seed, report.failed.violations, report.failed.trace[-40:])
    # every fault class was injected, and the job trained on, finished, or (where state was lost) failed
    assert set(FAULTS) <= set(report.faults), sorted(set(FAULTS) - set(report.faults))
    assert report.outcomes.get("training", 0) + report.outcomes.get("finished", 0) > 250
    # some reached trainIters and saved a final checkpoint; some final saves gave up: Failed
    assert report.outcomes.get("finished", 0) > 0 and report.outcomes.get("failed: FinalCheckpointFailed", 0) > 0


# Schedules that once violated an invariant, each with what it found.
REGRESSIONS = {
    # a member frozen after reading "committed", before switching, re-registers late with a
    # restarted coordinator: it is the holder of the adopted world, not another process
    991110: "w3 declared dead while heartbeating validly",
    # a member declared dead and frozen; the coordinator restarted before the plan without it
    # committed: the new one resolves that plan, and must carry its verdict
    26157: "w1.0 is broken outside generation 1",
    # every key deleted while the process declared dead was frozen: it never learned it, and
    # stayed broken in a world the job left (the coordinator now re-asserts its pointers)
    1220: "w1.0 is broken outside generation 2",
    # the decision, results and votes of a committed generation deleted before the coordinator
    # read them: it aborted what every member had committed (a member's beat in the new world
    # now proves the commit)
    486: "a coordinator resolved it aborted while live processes acted on committed",
    # the registrations in a restarted coordinator's store deleted before it read them: nothing
    # to adopt, the job's plan refused, for ever (workers now register again)
    1734: "not settled: current None, pending None",
    # a worker's own append passed over a forged registration slot without counting it
    159: "read 1 forged values and counted 0 as tampering",
    # the list of registrations emptied under a restarted coordinator that had not read it:
    # re-registrations went after the holes, which hid them (they now fill the holes, and a
    # list reads past a few absent slots)
    22924: "not settled: current None, pending None (adopting, waiting for w0 and w1)",
    # a final save gave up while a generation was pending: the coordinator did not read the
    # report until the generation ended, and died first (it now reads it while pending; the
    # operator ends a job whose every worker exited 1)
    2260: "the final save gave up and the job has not ended Failed",
    # a committed decision and every vote deleted before the coordinator and one member read
    # them; the member that committed beat from its new world, broken since: a beat naming the
    # new world proves the commit whatever the state it reports
    5550914: "live processes acted on different decisions",
    # a worker frozen past the timeout, then the coordinator frozen: the worker's death is its own
    # silence, not the coordinator's pause (an invariant that was too strict)
    8880047: "declared dead while heartbeating validly",
    # a request polled in the tick a restarted coordinator began adopting was dropped unanswered
    1110590: "not settled: current None, pending None",
    # members that aborted a generation on their own (the coordinator's store stopped under
    # them) took it up again later: a generation once prepared is never switched to again
    2220800: "live processes acted on different decisions",
    # a restarted coordinator resolved as aborted a generation that a member still held (its
    # world broken) and that the newest world followed: it now takes a decision a process read,
    # and commits what someone holds or the newest world follows
    1111025: "generation 101 given both outcomes by coordinators",
    # a live member's heartbeat key overwritten all along while another member died: the peers'
    # report that the world broke was taken against the member under attack too, which was
    # evicted (and the job restored from a checkpoint); a death that explains the break ends the
    # report's weight
    1739: "w0 declared dead while heartbeating validly",
    # a waiting worker named a standby of a plan never prepared it in the simulator's worker
    # (the shipped one does): the transition never formed
    1923: "not settled 66 s after the last fault",
    # a change pending when rank 0 of the running world saved the final checkpoint: the workers
    # exited, and each recovery of their world kept a change pending, so the finished report was
    # never taken (a change the end of training makes moot is now decided aborted); the
    # simulator's workers also switched inside their final save
    3569: "not settled 66 s after the last fault: current 4, pending 7",
    # a process declared dead (frozen) and back after a coordinator restart prepared the recovery
    # plan that counts it dead (``takes_up`` now never takes such a plan up), and the simulator
    # started the transition a second time for members already in its commit window
    5001427: "generation 1: live processes acted on different decisions",
    # two members' heartbeat keys overwritten all along, one of them killed: the peers' report of
    # the broken world was held against both, and the live one was evicted (a report now decides
    # against a contested member only when it is the one suspect)
    5012578: "w2 declared dead while heartbeating validly",
    # a member frozen past the timeout while its heartbeat key was overwritten, back in time to
    # give its result for the restore's generation: held dead on its peer's report right after
    # (a sealed result read for the first time is now a sign of life, as a beat is)
    6001238: "w0 declared dead while heartbeating validly",
    # the change a finished job made moot was decided aborted, then the world's lost member was
    # recovered anew, and aborted again, for ever: the finished report is now taken at once
    6004413: "not settled 66 s after the last fault: current 0, pending 111",
    # the coordinator stopped, then killed, during the final save: rank 0 wrote the end of
    # training into the dead coordinator's store and exited, and the restarted one never learned
    # it (rank 0 now tells a restarted coordinator, for FINISHED_REPORT_PATIENCE)
    7004366: "not settled 66 s after the last fault: current 0, pending 104",
}


@pytest.mark.parametrize("seed", sorted(REGRESSIONS))
def test_schedules_that_once_failed_hold(seed):
    r = run_schedule(seed)
    assert not r.violations, (REGRESSIONS[seed], r.violations, r.trace[-30:])


def test_a_schedule_is_its_seed():
    a, b = run_schedule(77), run_schedule(77)
    assert a.trace == b.trace and a.outcome == b.outcome


def test_every_process_uses_the_production_store_with_the_secret():
    """Nothing that decides is the simulator's: each process's store is a ``JobStore`` that
    checks MACs, and the coordinator is the shipped loop."""
    from liveshard.runtime.coordinator.loop import Coordinator

    sim = Simulation(5)
    sim.run()
    assert sim.clients and all(type(store) is JobStore and store._secret for _, _, store in sim.clients)
    assert type(sim.coordinator) is Coordinator or sim.coordinator is None


@pytest.mark.parametrize("argv, code", [(["--schedules", "30", "--seed", "5"], 0),
                                        (["--schedules", "3", "--faults", "meteor"], 2)])
def test_the_command_line(argv, code, capsys):
    assert main(argv) == code
    out, err = capsys.readouterr()
    if code == 2:
        assert "--faults: unknown meteor" in err and len(err.strip().splitlines()) == 1
    else:
        assert "30 schedules" in out


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_newcomers_cases_as_scenarios(name):
    result, problems = SCENARIOS[name]()
    assert result.ok and not problems, (result.violations, problems, result.trace[-40:])
