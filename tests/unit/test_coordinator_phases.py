"""The coordinator's phase (``coordinator.phases``): derived in one place from its state, the loop's
questions as functions of it, and the reason it waits, in words, for the status."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from liveshard.dev.localcluster.crd_validation import CRDValidator
from liveshard.runtime.contract.keys import COMMITTED
from liveshard.runtime.contract.status import InvalidStatus, Waiting
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.coordinator import (
    CoordinatorCore,
    Observation,
    PlanningInputs,
    PlanRequest,
    Registration,
)
from liveshard.runtime.coordinator.generations import Generation
from liveshard.runtime.coordinator.phases import (
    ControlState,
    Deferred,
    Limits,
    Phase,
    Restart,
    Waits,
    accepting,
    names,
    phase_of,
    reads_adoption,
    waiting_reason,
    wants_registrations,
    wants_request,
)
from liveshard.runtime.coordinator.status import CoordinatorStatus
from liveshard.runtime.coordinator.world_choice import WorldChooser
from liveshard.runtime.planner import Constraints
from liveshard.runtime.presets import PRESETS

WORLD = WorldPlan(generation=3, config="tp=1,pp=1,dp=2", members=("w0", "w1"))
NEXT = WorldPlan(generation=4, config="tp=1,pp=1,dp=3", members=("w0", "w1", "w2"), previous=3)
LIMITS = Limits(heartbeat_timeout=10.0, transition_timeout=20.0, never_seen_grace=300.0, adoption_grace=20.0)


# ---- the phase -------------------------------------------------------------------------------
@pytest.mark.parametrize("state, phase", [
    (ControlState(), Phase.STARTING),
    (ControlState(current=WORLD), Phase.STEADY),
    (ControlState(current=WORLD, pending=Generation(NEXT, 0.0)), Phase.SWITCHING),
    (ControlState(current=WORLD, pending=Generation(NEXT, 0.0, reopened=True)), Phase.RESOLVING),
    (ControlState(restart=Restart(True, 0.0)), Phase.RESTARTING),
    (ControlState(awaiting_adoption=True, adopting_since=0.0), Phase.ADOPTING),
    (ControlState(current=WORLD, deferred=Deferred(PlanRequest(("w0", "w1", "w9")), 0.0, ("w9",))), Phase.DEFERRED),
    (ControlState(deferred=Deferred(PlanRequest(("w9",)), 0.0, ("w9",))), Phase.DEFERRED),
    (ControlState(current=WORLD, finished={"step": 9}), Phase.FINISHED),
    # terminal first: a failure stands whatever else is in flight
    (ControlState(current=WORLD, pending=Generation(NEXT, 0.0), failure={"reason": "X"}), Phase.FAILED),
    (ControlState(restart=Restart(False, 0.0), failure={"reason": "X"}), Phase.FAILED),
])
def test_one_phase_is_derived_from_the_state(state, phase):
    assert phase_of(state) is phase


def _states():
    """Every combination of the fields the phases decide over the core can reach: a takeover's
    wait and a first world to make again only without a world or a generation in flight, and
    never both (a takeover that restarts clears its wait), a deferred request only with none in
    flight, finished never with a generation in flight."""
    request = PlanRequest(("w0", "w9"))
    for current, pending, failure, finished, restart, deferred, reissue, awaiting in itertools.product(
            (None, WORLD), (None, "open", "reopened"), (None, {"reason": "X"}), (None, {"step": 1}),
            (None, Restart(True, 0.0)), (None, Deferred(request, 0.0, ("w9",))), ((), (request,)), (False, True)):
        if (awaiting or restart) and (current is not None or pending is not None or (awaiting and restart)):
            continue
        if (deferred or finished) and pending is not None:
            continue
        gen = None if pending is None else Generation(NEXT, 0.0, reopened=pending == "reopened")
        yield ControlState(current=current, pending=gen, failure=failure, finished=finished, restart=restart,
                           deferred=deferred, reissue=reissue, awaiting_adoption=awaiting)


def test_the_loops_questions_agree_with_the_field_predicates_they_replace():
    """The phase answers what eight nullable fields used to: the same answers in every reachable
    state (registrations are not read once terminal: the core acts on nothing then)."""
    count = 0
    for s in _states():
        adopting = s.current is None and s.pending is None and s.failure is None and s.restart is None
        old_accepting = s.failure is None and s.pending is None and s.finished is None and not s.awaiting_adoption
        old_request = old_accepting and s.deferred is None and not s.reissue and s.restart is None
        old_regs = adopting or s.deferred is not None or s.restart is not None or bool(s.reissue) \
            or (s.pending is not None and s.pending.reopened)
        assert accepting(s) == old_accepting, s
        assert wants_request(s) == old_request, s
        if s.failure is None and s.finished is None:
            assert reads_adoption(s) == adopting, s
            assert wants_registrations(s) == old_regs, s
        else:
            assert not wants_registrations(s)
        count += 1
    assert count > 50


# ---- the reason it waits ---------------------------------------------------------------------
def test_names_are_listed_in_words():
    assert names(()) == "" and names(["w1"]) == "w1" and names(["w1", "w2"]) == "w1 and w2"
    assert names(["w1", "w2", "w3", "w4", "w5"]) == "w1, w2, w3 and 2 more"


def test_a_live_transition_waits_for_the_ready_votes_then_the_reports():
    gen = Generation(NEXT, 100.0)
    state = ControlState(current=WORLD, pending=gen)
    gen.ready = frozenset({"w0", "w1"})
    assert waiting_reason(state, 104.2, LIMITS) == "generation 4: waiting for w2's ready vote, 4.2 s of 20 s"
    gen.ready = frozenset()
    assert waiting_reason(state, 101.0, LIMITS) == \
        "generation 4: waiting for the ready votes of w0, w1 and w2, 1.0 s of 20 s"
    gen.decision = COMMITTED
    gen.results.update({"w0": MemberResult(ok=True), "w1": MemberResult(ok=True)})
    assert waiting_reason(state, 102.0, LIMITS) == "generation 4 committed: waiting for the reports of w2"


def test_a_first_world_waits_for_its_members_results():
    first = WorldPlan(generation=0, config="tp=1,pp=1,dp=2", members=("w0", "w1"))
    gen = Generation(first, 10.0, results={"w0": MemberResult(ok=True)})
    assert waiting_reason(ControlState(pending=gen), 13.0, LIMITS) == \
        "generation 0: waiting for the results of w1, 3.0 s of 20 s"
    assert waiting_reason(ControlState(pending=gen), 13.0, LIMITS, Waits(dead=frozenset({"w1"}))) == \
        "generation 0: waiting for its decision"


@pytest.mark.parametrize("state, now, reason", [
    (ControlState(restart=Restart(True, 50.0)), 53.0,
     "restarting from the newest checkpoint: waiting for workers to register, 3.0 s of 300 s"),
    (ControlState(awaiting_adoption=True, adopting_since=5.0, adoption_waits_for=("w1", "w3")), 7.5,
     "adopting: waiting for w1 and w3 to re-register, 2.5 s of 20 s"),
    (ControlState(awaiting_adoption=True, adopting_since=5.0), 6.0,
     "adopting: waiting for the workers' registrations, 1.0 s of 20 s"),
    (ControlState(current=WORLD, deferred=Deferred(PlanRequest(("w0", "w1", "w2"), reason="w2 joins"), 1.0, ("w2",))),
     4.0, "request 'w2 joins': waiting for w2 to register, 3.0 s of 300 s"),
    (ControlState(), 0.0, "no world yet: waiting for a plan request"),
    (ControlState(current=WORLD), 9.0, None),
    (ControlState(current=WORLD, finished={"step": 1}), 9.0, None),
    (ControlState(failure={"reason": "NoWorkers"}), 9.0, None),
    (ControlState(current=WORLD, pending=Generation(NEXT, 0.0, reopened=True)), 1.0,
     "generation 4 was open when the coordinator restarted: waiting for its members' reports to decide it"),
])
def test_each_waiting_phase_says_what_it_waits_for(state, now, reason):
    assert waiting_reason(state, now, LIMITS) == reason


def test_a_running_world_says_why_it_is_not_recovered_yet():
    state = ControlState(current=WORLD)
    assert waiting_reason(state, 12.0, LIMITS, Waits(broken={"w1": 10.0})) == \
        "w1 reports the world of generation 3 broken: recovering unless a death explains it first, 2.0 s of 10 s"
    assert waiting_reason(state, 12.0, LIMITS, Waits(refused={"fewer than workers.min": 2.0})) == \
        "no world can be planned for the survivors (fewer than workers.min): asking again, 10.0 s of 20 s"
    assert "reconnect after the coordinator restart" in waiting_reason(state, 0.0, LIMITS, Waits(holders_missing=True))


# ---- the core --------------------------------------------------------------------------------
def _core() -> CoordinatorCore:
    constraints = Constraints(global_batch=8, micro_batch=1, seq_length=64)
    return CoordinatorCore(WorldChooser(PRESETS["tiny-gpt"]), PlanningInputs(constraints), heartbeat_timeout=1.0,
                           transition_timeout=20.0)


def test_the_core_publishes_the_reason_it_waits_as_of_its_last_observation():
    core = _core()
    assert core.phase is Phase.STARTING and core.wants_request
    request = PlanRequest(members=("w0", "w1"), reason="first world")
    out = core.step(Observation(now=100.0, request=request, registrations={"w0": Registration(node="n0")}))
    assert out == [] and core.phase is Phase.DEFERRED and not core.wants_request and core.wants_registrations
    assert core.deferred_members() == ("w0", "w1")
    core.step(Observation(now=103.0, registrations={"w0": Registration(node="n0")}))
    assert core.waiting == "request 'first world': waiting for w1 to register, 3.0 s of 30 s"
    assert core.state.deferred is not None and core.state.deferred.since == 100.0


def test_a_restarted_core_adopting_names_the_members_it_waits_for():
    core = _core()
    held = {"w0": Registration(node="n0", incarnation="a", plan=WORLD, latest_seen=3)}
    core.step(Observation(now=10.0, registrations=held))
    assert core.phase is Phase.ADOPTING and not core.accepting and core.adopting
    core.step(Observation(now=11.0, registrations=held))
    assert core.waiting == "adopting: waiting for w1 to re-register, 1.0 s of 2 s"
    both = {**held, "w1": Registration(node="n1", incarnation="b", plan=WORLD, latest_seen=3)}
    core.step(Observation(now=12.0, registrations=both))
    assert core.phase is Phase.STEADY and core.current == WORLD and core.waiting is None
    assert core.state.adopting_since is None and not core.state.awaiting_adoption


# ---- status.waiting --------------------------------------------------------------------------
def test_the_job_status_takes_the_reason_and_a_merge_patch_clears_it():
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "elastictrainingjob.yaml").read_text())
    reason = "generation 4: waiting for w2's ready vote, 4.2 s of 20 s"
    patch = Waiting.from_coordinator(CoordinatorStatus(
        generation=3, config="tp=1,pp=1,dp=2", members=["w0", "w1"], standbys=[], pending=4, dead=[], history=[],
        telemetry={}, health={}, progress=None, finished=None, failure=None, checkpoints={},
        waiting=reason).to_dict()).to_status()
    assert patch == {"waiting": reason}
    job = {"apiVersion": "liveshard.io/v1alpha1", "kind": "ElasticTrainingJob",
           "metadata": {"name": "w", "namespace": "ml"},
           "spec": {"model": {"preset": "tiny-gpt"}, "image": "img", "workers": {"max": 2, "gpusPerWorker": 1},
                    "training": {"data": {"mock": True}, "trainIters": 10, "globalBatch": 4}},
           "status": patch}
    assert CRDValidator(crd).validate(job)["status"]["waiting"] == reason
    assert Waiting.from_status(job["status"]) == Waiting(reason)
    assert Waiting.from_coordinator({"waiting": None}).to_status() == {"waiting": None}  # removes the field
    with pytest.raises(InvalidStatus):
        Waiting.from_status({"waiting": 5})
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Waiting"]["jsonPath"] == ".status.waiting" and columns["Waiting"]["priority"] == 1
