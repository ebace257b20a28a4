"""The coordinator's decisions, driven tick by tick over an in-process store (no processes)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from liveshard.runtime.contract.causes import Cause
from liveshard.runtime.contract.jobspec import read_spec
from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.contract.status import pod_of
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator import Coordinator, PlanningInputs, PlanRequest
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import FEWEST_CHANGES, Constraints
from liveshard.runtime.planner.pods import Candidate, constraints_for, plan_for
from liveshard.runtime.presets import PRESETS


class Requests:
    """A plan source the test feeds by hand."""

    def __init__(self, inputs: PlanningInputs | None = None) -> None:
        self.queue: list[PlanRequest] = []
        self.reports: list[dict] = []
        self.inputs = inputs

    def poll(self) -> PlanRequest | None:
        return self.queue.pop(0) if self.queue else None

    def report(self, status: dict) -> None:
        self.reports.append(status)

    def planning(self) -> PlanningInputs | None:
        return self.inputs


# The production store with the job's secret: every value sealed, as in a job (the tests about
# the unauthenticated branch are in test_store_auth.py).
SECRET = b"coordinator-test-secret"


class Clock:
    """The coordinator's clock, moved by hand: silence is time passing without beats."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _coordinator(source: Requests, planning: PlanningInputs, model: str = "tiny-gpt") -> Coordinator:
    return Coordinator(JobStore(dist.HashStore(), secret=SECRET), PRESETS[model], source, planning,
                       heartbeat_timeout=1.0, clock=Clock())


_sent = [time.time()]


def _now() -> float:
    """A sender's clock that always moves forward (each beat is newer than the last)."""
    _sent[0] = max(time.time(), _sent[0] + 1e-3)
    return _sent[0]


def _beat(c: Coordinator, *workers: str) -> None:
    for w in workers:
        c.store.set_json(Keys.member(w), {"host": "h", "node": f"node-{w}", "time": time.time()})
        c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "training"})


def _commit(c: Coordinator) -> WorldPlan:
    """Every involved member reports success for the pending generation; the coordinator commits."""
    plan = c.pending.plan
    involved = set(plan.members) | (set(c.current.members) if c.current else set())
    for m in involved - c.dead:
        c.store.set(Keys.result(plan.generation, m), MemberResult(ok=True).to_json())
    if plan.is_live_transition:  # the last member ready writes the commit point
        c.store.decide(Keys.decision(plan.generation), COMMITTED)
    c.tick()
    assert c.pending is None and c.current == plan
    return plan


def _running(c: Coordinator, source: Requests, workers: tuple[str, ...], config: str) -> WorldPlan:
    """A committed first world of ``workers`` under ``config``."""
    _beat(c, *workers)
    source.queue.append(PlanRequest(members=workers, config=config))
    c.tick()
    return _commit(c)


def _lose(c: Coordinator, worker: str, survivors: tuple[str, ...]) -> None:
    """``worker`` falls silent past the heartbeat timeout; the survivors keep beating; one tick
    (after one that saw everyone: the coordinator ticks all along)."""
    c.tick()
    c.clock.advance(10)
    _beat(c, *survivors)
    c.tick()


LOCAL = PlanningInputs(Constraints(global_batch=4, micro_batch=1, objective=FEWEST_CHANGES))


def test_an_explicit_plan_runs_in_exactly_the_order_it_names():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _beat(c, "p1", "p2")
    source.queue.append(PlanRequest(members=("p2", "p1"), config="tp=1,pp=2,dp=1"))
    c.tick()
    assert c.pending.plan.members == ("p2", "p1")  # never re-ordered
    _commit(c)
    # a later explicit plan over the same world keeps its order too, even against continuity
    source.queue.append(PlanRequest(members=("p1", "p2"), config="tp=2,pp=1,dp=1"))
    c.tick()
    assert c.pending.plan.members == ("p1", "p2") and c.pending.plan.previous == 0


def test_a_config_the_global_batch_cannot_split_is_rejected_before_anything_moves():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _beat(c, "a", "b", "c")
    source.queue.append(PlanRequest(members=("a", "b", "c"), config="tp=1,pp=1,dp=3", reason="bad"))
    c.tick()
    assert c.pending is None and c.store.latest_generation() == -1
    assert c.history[-1]["generation"] is None and "global batch 4" in c.history[-1]["outcome"]


def test_a_member_lost_without_notice_is_replanned_from_the_survivors_in_their_rank_order():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1", "w2", "w3"), "tp=1,pp=1,dp=4")
    _lose(c, "w2", ("w0", "w1", "w3"))
    plan = c.pending.plan
    assert c.dead == {"w2"} and plan.dead == ("w2",)
    # fewest changes: dp over as many survivors as the batch of 4 splits over (2), survivors in order
    assert plan.config.startswith("tp=1,pp=1,dp=2") and plan.members == ("w0", "w1") and plan.standbys == ("w3",)
    assert plan.restore_from is None  # every replica survives somewhere


def test_the_coordinator_plans_a_loss_exactly_as_the_operator_would():
    """Same function, same inputs: the operator's plan for the survivors is the world the
    coordinator already runs, so the operator's own plan is acked without a second switch."""
    job_spec = read_spec({"model": {"preset": "tiny-gpt"}, "image": "x",
                          "workers": {"min": 1, "max": 4, "replicas": 4, "gpusPerWorker": 1, "gpuMemory": "80Gi"},
                          "parallelism": {"tp": [1], "pp": [1], "distributedOptimizer": False},
                          "training": {"data": {"mock": True}, "trainIters": 1000, "globalBatch": 240, "microBatch": 4}})
    pods = ["job-worker-0", "job-worker-1", "job-worker-2", "job-worker-3"]
    first = plan_for(job_spec, [Candidate(p, f"n{i}") for i, p in enumerate(pods)])
    speeds = {"job-worker-3": 0.5}
    inputs = PlanningInputs(constraints_for(job_spec), job_spec.workers.gpu_memory_bytes, speeds)
    source = Requests(inputs)
    c = _coordinator(source, LOCAL)
    workers = tuple(f"{p}/0" for p in first.members)
    _running(c, source, workers, first.config)
    lost = workers[1]
    _lose(c, lost, tuple(w for w in workers if w != lost))
    recovery = c.pending.plan
    survivors = [p for p in first.members if p != pod_of(lost)]
    operator = plan_for(job_spec, [Candidate(p, f"node-{p}/0", speed=speeds.get(p, 1.0)) for p in survivors],
                        first.config, first.members)
    assert recovery.config == operator.config
    assert tuple(pod_of(m) for m in recovery.members) == operator.members


@pytest.mark.parametrize("checkpoint", [None, {"path": "/ckpt/step00000004", "step": 4, "config": "tp=2,pp=1,dp=1"}])
def test_state_with_no_surviving_copy_is_restored_from_the_latest_checkpoint_or_ends_the_run(checkpoint):
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("a", "b"), "tp=2,pp=1,dp=1")
    if checkpoint is not None:
        c.store.set_json(Keys.CHECKPOINT, checkpoint)
    _lose(c, "b", ("a",))  # b held the only copy of half of every tensor
    if checkpoint is None:
        assert c.pending is None and "no checkpoint to restore from" in c.history[-1]["outcome"]
        assert c.failure["reason"] == "NoSurvivingCopy"
    else:
        plan = c.pending.plan
        assert plan.restore_from == "/ckpt/step00000004" and plan.members == ("a",)


def test_an_unknown_objective_is_a_config_error():
    from liveshard.runtime.errors import ConfigError
    from liveshard.runtime.planner import GPU, plan_world

    with pytest.raises(ConfigError, match="objective"):
        plan_world(PRESETS["tiny-gpt"], [GPU("a", "n", 1 << 30)], Constraints(objective="cheapest"))


def test_recovery_plans_carry_their_cause():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("a", "b"), "tp=1,pp=1,dp=2")
    _lose(c, "b", ("a",))
    assert c.pending.plan.cause == Cause.LOST_WITHOUT_NOTICE and "lost b without notice" in c.pending.plan.reason


def test_a_pod_that_lost_one_of_its_processes_sits_out_the_recovery():
    """Plans come in whole pods: with 2 GPUs per pod, a pod with one live process is a standby."""
    inputs = PlanningInputs(Constraints(global_batch=4, micro_batch=1, granularity=2, objective=FEWEST_CHANGES))
    source = Requests(inputs)
    c = _coordinator(source, inputs)
    _running(c, source, ("a/0", "a/1", "b/0", "b/1"), "tp=1,pp=1,dp=4")
    _lose(c, "b/1", ("a/0", "a/1", "b/0"))
    plan = c.pending.plan
    assert plan.members == ("a/0", "a/1") and plan.standbys == ("b/0",) and plan.dead == ("b/1",)


def test_progress_metrics_and_the_finish_come_from_the_heartbeats():
    """The coordinator's view of training: step, loss, samples, tokens/s and ETA in its status
    (the job's status.progress), the same in its Prometheus metrics; rank 0's report at
    trainIters ends planning: requests are no longer taken."""
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.control.metrics import JobMetrics

    training = read_training({"data": {"mock": True}, "trainIters": 100, "globalBatch": 4, "seqLength": 32})
    source, metrics = Requests(), JobMetrics("train")
    c = Coordinator(JobStore(dist.HashStore(), secret=SECRET), PRESETS["tiny-gpt"], source, LOCAL, heartbeat_timeout=5.0,
                    training=training, metrics=metrics)
    _running(c, source, ("p1", "p2"), "tp=1,pp=2,dp=1")
    now = time.time()
    for w, loss in (("p1", None), ("p2", 3.25)):  # the last pipeline stage knows the loss
        c.store.set_json(Keys.heartbeat(w), {"time": now, "state": "training", "step": 40, "loss": loss,
                                             "consumed_samples": 160, "step_seconds": 0.5})
    c.tick()
    p = c.status()["progress"]
    assert (p["step"], p["loss"], p["consumed_samples"], p["train_iters"]) == (40, 3.25, 160, 100)
    assert p["tokens_per_second"] == pytest.approx(4 * 32 / 0.5) and p["eta"]
    text = metrics.exposition().decode()
    assert 'liveshard_job_step{job="train"} 40.0' in text and 'liveshard_job_loss{job="train"} 3.25' in text
    c.store.set_json(Keys.FINISHED, {"step": 100, "checkpoint": "/ckpt/step00000100", "time": now})
    c.tick()
    assert c.status()["finished"]["checkpoint"] == "/ckpt/step00000100"
    source.queue.append(PlanRequest(members=("p1",), config="tp=1,pp=1,dp=1"))
    c.tick()
    assert c.pending is None and source.queue  # a finished job plans nothing more
    # the workers exit; a forger overwrites their last beats: silence after the end is no death
    later = time.monotonic() + 60
    c.clock = lambda: later
    for w in ("p1", "p2"):
        c.store.store.set(Keys.heartbeat(w), "forged")
    c.tick()
    assert c.pending is None and not c.dead and not c.status().get("dead")


def _four_training() -> Coordinator:
    """A coordinator over the production store (with a secret: a forgery is tampering) whose
    world of four trains at dp=4, every member seen beating."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1", "w2", "w3"), "tp=1,pp=1,dp=4")
    _beat(c, "w0", "w1", "w2", "w3")
    c.tick()
    return c


def test_a_broken_world_report_never_picks_one_of_two_members_under_attack():
    """Two members' heartbeat keys are overwritten all along and one of them (w3) is lost for
    real; their peers report the world broken. The report says someone is gone, not who: neither
    is declared dead on it (a live one would be evicted half the time); the recovery of the world
    broken with every member alive asks both, and the silent one is found dead there."""
    c = _four_training()
    gen = c.current.generation
    for i in range(12):  # 6 s, twice contest_limit
        c.clock.advance(0.5)
        for w in ("w0", "w2"):
            c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "broken" if i >= 1 else "training",
                                                 "generation": gen})
        for w in ("w1", "w3"):
            c.store.store.set(Keys.heartbeat(w), "forged")
        c.tick()
    assert not ({"w1", "w3"} & c.dead), c.dead
    from liveshard.runtime.coordinator.generations import involved

    assert c.pending is not None and {"w1", "w3"} <= set(involved(c.current, c.pending.plan)), c.pending


def test_a_job_that_finishes_while_a_change_is_pending_ends_without_waiting_for_the_change():
    """Rank 0 of the running world saves the final checkpoint while a change to another world is
    pending and undecided: its workers exit, so the change can never commit. It is decided
    aborted at once (not after the transition timeout, nor kept alive by recoveries of a world
    whose workers ended), and the job is finished."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    first = _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2"), reason="w2 joins"))
    c.tick()
    assert c.pending is not None
    gen = c.pending.plan.generation
    c.store.set_json(Keys.FINISHED, {"step": 100, "checkpoint": "/ckpt/final", "generation": first.generation,
                                     "time": time.time()})
    c.tick()
    assert c.store.get(Keys.decision(gen)) == f"aborted: training finished in generation {first.generation}"
    c.tick()
    assert c.pending is None and c.status()["finished"]["checkpoint"] == "/ckpt/final"
    # a decision that stands wins: a change already committed is not undone by the report
    source = Requests()
    c = _coordinator(source, LOCAL)
    first = _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2"), reason="w2 joins"))
    c.tick()
    gen = c.pending.plan.generation
    c.store.decide(Keys.decision(gen), COMMITTED)
    c.store.set_json(Keys.FINISHED, {"step": 100, "checkpoint": "/ckpt/final", "generation": first.generation,
                                     "time": time.time()})
    c.tick()
    assert c.store.get(Keys.decision(gen)) == COMMITTED
    # the change is the recovery from a member's loss: the world is not recovered again after it
    source = Requests()
    c = _coordinator(source, LOCAL)
    first = _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _lose(c, "w1", ("w0",))
    assert c.pending is not None and "w1" in c.pending.plan.dead
    c.store.set_json(Keys.FINISHED, {"step": 100, "checkpoint": "/ckpt/final", "generation": first.generation,
                                     "time": time.time()})
    published = c.core.next_generation
    for _ in range(3):
        _beat(c, "w0")
        c.tick()
    assert c.pending is None and c.finished is not None and c.core.next_generation == published


def test_a_first_world_continues_the_newest_complete_checkpoint_on_the_jobs_volume(tmp_path):
    """Every process of the job was replaced (a whole spot pool gone): the new coordinator's first
    world restores the newest *complete* checkpoint instead of starting from scratch."""
    import json

    from liveshard.runtime.agent.checkpoint import newest_complete

    for step, complete in ((4, True), (8, True), (12, False)):  # step 12: interrupted mid-save
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        if complete:
            (d / "liveshard.json").write_text(json.dumps({"step": step, "config": "tp=1,pp=1,dp=2,ep=1"}))
    assert newest_complete(tmp_path)["step"] == 8 and newest_complete(tmp_path / "none") is None
    source = Requests()
    c = Coordinator(JobStore(dist.HashStore(), secret=SECRET), PRESETS["tiny-gpt"], source, LOCAL, heartbeat_timeout=5.0,
                    checkpoint_dir=str(tmp_path))
    plan = _running(c, source, ("p1", "p2"), "tp=1,pp=1,dp=2")
    assert plan.restore_from == str(tmp_path / "step00000008")
    fresh = Coordinator(JobStore(dist.HashStore(), secret=SECRET), PRESETS["tiny-gpt"], Requests(), LOCAL,
                        checkpoint_dir=str(tmp_path / "empty"))
    fresh.source.queue.append(PlanRequest(members=("p1",), config="tp=1,pp=1,dp=1"))
    _beat(fresh, "p1")
    fresh.tick()
    assert fresh.pending.plan.restore_from is None  # a new run starts from its initial weights


def test_a_reported_checkpoint_that_fails_verification_gives_way_to_an_older_intact_one(tmp_path):
    """The workers reported step 8, but its files are not the ones the save recorded: a loss with
    no surviving copy restores step 4, the newest intact checkpoint on the job's volume."""
    import json

    from liveshard.runtime.agent.checkpoint import MARKER, file_manifest

    for step in (4, 8):
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"metadata %d" % step)
        (d / MARKER).write_text(json.dumps({"step": step, "config": "tp=2,pp=1,dp=1,ep=1", "files": file_manifest(d)}))
    (tmp_path / "step00000008" / ".metadata").write_bytes(b"metadata 9")  # corrupted after the save
    source = Requests()
    c = Coordinator(JobStore(dist.HashStore(), secret=SECRET), PRESETS["tiny-gpt"], source, LOCAL, heartbeat_timeout=5.0,
                    checkpoint_dir=str(tmp_path))
    c.store.set_json(Keys.CHECKPOINT, {"path": str(tmp_path / "step00000008"), "step": 8, "config": "tp=2,pp=1,dp=1"})
    assert c.latest_checkpoint()["path"] == str(tmp_path / "step00000004")


def test_a_replayed_checkpoint_pointer_does_not_roll_the_restore_back(tmp_path):
    """A client without the secret writes the validly sealed pointer of step 9 back after step 12
    was published, before the coordinator read 12: the pointer reads valid to it, but the restore
    loads step 12, the newest checkpoint that verifies on the job's volume."""
    import json

    from liveshard.runtime.agent.checkpoint import MARKER, file_manifest
    from liveshard.runtime.control.store import JobStore as Sealed

    for step in (9, 12):
        d = tmp_path / f"step{step:08d}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"metadata %d" % step)
        (d / MARKER).write_text(json.dumps({"step": step, "config": "tp=2,pp=1,dp=1,ep=1", "files": file_manifest(d)}))
    raw = dist.HashStore()
    rank0 = Sealed(raw, secret=b"s")
    rank0.publish_checkpoint({"path": str(tmp_path / "step00000009"), "step": 9, "config": "tp=2,pp=1,dp=1"})
    old = rank0.store.get(Keys.CHECKPOINT)  # what an attacker copies
    rank0.publish_checkpoint({"path": str(tmp_path / "step00000012"), "step": 12, "config": "tp=2,pp=1,dp=1"})
    rank0.store.set(Keys.CHECKPOINT, old)  # replayed before the coordinator read step 12
    c = Coordinator(Sealed(raw, secret=b"s"), PRESETS["tiny-gpt"], Requests(), LOCAL, heartbeat_timeout=5.0,
                    checkpoint_dir=str(tmp_path))
    assert c.store.get_json(Keys.CHECKPOINT)["step"] == 9  # the pointer alone would roll the job back
    assert c.latest_checkpoint()["step"] == 12


def test_a_live_generation_commits_at_its_decision_not_at_its_results():
    """Every member reporting ok is not a commit: the decision in the store is (written once,
    by the last member ready, or by the coordinator on a failure)."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2"), config="tp=1,pp=1,dp=1", ordered=False))
    c.tick()
    plan = c.pending.plan
    for m in ("w0", "w1", "w2"):
        c.store.set(Keys.result(plan.generation, m), MemberResult(ok=True).to_json())
    c.tick()
    assert c.pending is not None and c.current.generation == 0  # results alone: not decided
    assert c.store.decide(Keys.decision(plan.generation), COMMITTED) == COMMITTED
    c.tick()
    assert c.pending is None and c.current == plan and c.history[-1]["outcome"] == COMMITTED


def test_a_death_before_the_commit_point_aborts_it_for_everyone():
    """The coordinator writes the abort; a member that becomes ready later cannot commit."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2"), config="tp=1,pp=1,dp=1", ordered=False))
    c.tick()
    gen = c.pending.plan.generation
    _lose(c, "w2", ("w0", "w1"))  # the joiner dies after the vote
    decision = c.store.get(Keys.decision(gen))
    assert decision.startswith("aborted: member w2 died")
    assert c.store.decide(Keys.decision(gen), COMMITTED) == decision  # too late: the first value stands
    assert c.current.generation == 0 and c.history[-1]["outcome"] == decision


def test_a_death_after_the_commit_point_is_recovered_from_the_new_world():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2"), config="tp=1,pp=1,dp=2", ordered=False))
    c.tick()
    plan = c.pending.plan
    c.store.decide(Keys.decision(plan.generation), COMMITTED)
    victim = plan.members[-1]
    _lose(c, victim, tuple(m for m in ("w0", "w1", "w2") if m != victim))
    assert c.history[-1]["generation"] == plan.generation and c.history[-1]["outcome"] == COMMITTED
    recovery = c.pending.plan
    assert recovery.previous == plan.generation and victim not in recovery.members
    assert recovery.dead == (victim,)


def test_a_world_broken_with_every_member_alive_is_recovered_after_the_grace():
    """An abort after the vote leaves the members holding the old state in a broken world; no
    one died, so only their heartbeats say so: the coordinator recovers once a death had time
    to be noticed instead."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")

    def broken():
        for w in ("w0", "w1"):
            c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "broken", "generation": 0})

    broken()
    c.tick()
    assert c.pending is None  # not yet: a death would be the better explanation
    c.clock.advance(1.1)
    broken()
    c.tick()
    plan = c.pending.plan
    assert plan.previous == 0 and set(plan.members) == {"w0", "w1"} and "broken" in plan.reason


def test_a_dead_member_comes_back_only_as_a_new_incarnation():
    """A replacement process under the same id (a pod recreated with its name) may join again;
    the old process heartbeating again (it was stopped, not dead) holds stale state and stays
    out until it rejoins as a new incarnation."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")

    def beat(w: str, incarnation: str) -> None:
        c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "training", "incarnation": incarnation})

    beat("w0", "a0")
    beat("w1", "a1")
    c.tick()
    c.clock.advance(10)  # w1 falls silent
    beat("w0", "a0")
    c.tick()
    assert c.dead == {"w1"}
    _commit(c)  # the recovery without w1
    beat("w0", "a0")
    beat("w1", "a1")  # the same process again
    c.tick()
    assert "w1" in c.dead
    beat("w1", "b1")  # a new one
    c.tick()
    assert "w1" not in c.dead
    source.queue.append(PlanRequest(members=("w0", "w1"), config="tp=1,pp=1,dp=2"))
    c.tick()
    assert c.pending.plan.members == ("w0", "w1")


def test_a_restarted_coordinator_numbers_its_plans_above_every_generation_a_worker_saw():
    source = Requests()
    c = _coordinator(source, LOCAL)
    running = WorldPlan(generation=3, config="tp=1,pp=1,dp=2", members=("w0", "w1"))
    for w, seen in (("w0", 5), ("w1", 4)):
        c.store.register_member(w, {"host": "h", "time": time.time(), "plan": running.to_json(), "latest_seen": seen})
        c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "training", "generation": 3})
    c.tick()
    assert c.current == running
    source.queue.append(PlanRequest(members=("w0",), reason="leave"))
    c.tick()
    # 4 and 5 may be prepared somewhere, and the dead coordinator may have published more that only
    # a worker still reconnecting saw: never reused
    assert c.pending.plan.generation > 5 + 50


def test_state_lost_with_no_copy_and_no_checkpoint_ends_the_run_clearly():
    """tp=2: each member holds the only copy of half of every weight. One dies, no checkpoint
    exists: the coordinator reports a terminal failure (the operator fails the job) and stops
    the survivors, instead of retrying a plan that cannot be carried out."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=2,pp=1,dp=1")
    _lose(c, "w1", ("w0",))
    assert c.pending is None
    assert c.failure["reason"] == "NoSurvivingCopy" and "no checkpoint" in c.failure["message"]
    assert c.store.has(Keys.STOP)
    assert source.reports[-1]["failure"] == c.failure


def test_checkpoint_reports_reach_the_status_and_bad_values_are_absent():
    source = Requests()
    c = _coordinator(source, LOCAL)
    c.store.set_json(Keys.CHECKPOINT_FAILED, {"step": 6, "error": "No space left on device", "count": 2,
                                              "time": time.time()})
    c.store.set(Keys.CHECKPOINT_UNAVAILABLE, "not json {")
    report = c.status()["checkpoints"]
    assert report["failed"]["count"] == 2 and report["unavailable"] is None and report["latest"] is None


def test_a_leaver_dying_after_the_vote_does_not_abort_what_it_already_delivered():
    """Once a new member arrived to build the new world every source has delivered: a leaver
    reclaimed then (its spot deadline) must not abort the commit and throw the state away."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    _beat(c, "w0", "w1", "w2")
    source.queue.append(PlanRequest(members=("w0", "w2"), config="tp=1,pp=1,dp=2", reason="w1 leaves"))
    c.tick()
    gen = c.pending.plan.generation
    c.store.set(Keys.arrived(gen, "w2"), "1")  # past the vote: a new member is building
    _lose(c, "w1", ("w0", "w2"))
    assert c.pending is not None and c.store.get(Keys.decision(gen)) is None
    c.store.decide(Keys.decision(gen), COMMITTED)
    for m in ("w0", "w2"):
        c.store.set(Keys.result(gen, m), MemberResult(ok=True).to_json())
    _beat(c, "w0", "w2")
    c.tick()
    assert c.current.generation == gen and c.pending is None  # and no recovery: w1 is not in it


def test_a_member_restarted_under_the_same_id_is_a_death_not_the_same_member():
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    for w in ("w0", "w1"):
        c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "training", "incarnation": f"{w}-a"})
    c.tick()
    assert not c.dead
    c.store.set_json(Keys.heartbeat("w1"), {"time": _now(), "state": "waiting", "incarnation": "w1-b"})
    c.tick()
    assert c.dead == {"w1"} and c.store.get(Keys.dead("w1")) == "w1-a"
    assert c.pending is not None and "w1" not in c.pending.plan.members  # recovered without its state


def test_a_slow_device_measured_in_the_heartbeats_gets_a_straggler_plan_with_its_numbers():
    from dataclasses import replace as _replace

    from liveshard.runtime.contract.jobspec import AdaptivePolicy
    from liveshard.runtime.contract.training import read_training

    training = read_training({"data": {"mock": True}, "trainIters": 1000, "globalBatch": 4, "microBatch": 1,
                              "seqLength": 32, "precision": "fp32"})
    planning = _replace(LOCAL, adaptive=AdaptivePolicy(enabled=True, window=4))
    source = Requests()
    c = Coordinator(JobStore(dist.HashStore(), secret=SECRET), PRESETS["tiny-gpt"], source, planning, heartbeat_timeout=5.0,
                    training=training)
    workers = ("w0", "w1")
    _running(c, source, workers, "tp=1,pp=2,dp=1")
    for step in range(1, 11):
        for w, rate in (("w0", 0.01), ("w1", 0.03)):  # w1 (the last stage) computes three times slower
            c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "training", "generation": 0,
                                                 "step": step, "step_seconds": 0.4,
                                                 "compute": [[step, rate * 10, 10.0]]})
        c.tick()
        if c.pending is not None:
            break
    assert c.pending is not None, c.status()["health"]
    plan = c.pending.plan
    assert plan.cause == "straggler" and set(plan.members) | set(plan.standbys) == set(workers)
    if "w1" in plan.members:  # the slow last stage gets fewer layers, or w1 waits on standby
        assert ParallelConfig.parse(plan.config).layers[1] < 2
    else:
        assert plan.standbys == ("w1",) and ParallelConfig.parse(plan.config).world_size == 1
    health = c.status()["health"]
    assert health["stragglers"] == ["w1"] and health["members"]["w1"]["speed"] < 0.7  # vs the median of two
    [decision] = [d for d in health["adaptive"]["decisions"] if d["switch"]]
    assert decision["predictedStepSecondsAfter"] < decision["predictedStepSeconds"] == 0.4
    assert decision["switchCostSeconds"] > 0 and health["adaptive"]["switches"] == 1


def test_a_member_silent_while_its_peers_report_their_world_broken_is_dead_sooner():
    """A failed collective is the first sign of a peer lost without notice: once a member reports
    the world broken, a silent peer is dead after half the heartbeat timeout, not all of it; a
    silence that short with no such report is not a death."""
    source = Requests()
    c = _coordinator(source, LOCAL)  # heartbeat_timeout 1.0
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    gen = c.current.generation
    _beat(c, "w0", "w1")
    c.tick()
    c.clock.advance(0.7)
    _beat(c, "w0")
    c.tick()
    assert not c.dead  # 0.7 s of silence, nobody reports a failure: alive
    c.store.set_json(Keys.heartbeat("w0"), {"time": _now(), "state": "broken", "generation": gen})
    c.tick()  # the coordinator reads w0's report
    c.tick()
    assert c.dead == {"w1"}
    assert c.pending is not None and c.pending.plan.members == ("w0",)


def test_a_plan_never_names_a_worker_that_has_not_registered():
    """A join naming a worker that never registered (killed before it did) waits for it while the
    running world trains on, and after the grace goes without it: the world is never stalled by
    a plan that names it."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    source.queue.append(PlanRequest(members=("w0", "w1", "w9"), reason="w9 joins"))
    c.tick()
    assert c.pending is None and c.current.members == ("w0", "w1")  # nothing published naming w9
    c.clock.advance(c.core.transition_timeout + 1)
    _beat(c, "w0", "w1")
    c.tick()
    assert c.pending is None or "w9" not in c.pending.plan.members
    assert "w9" not in c.current.members and not c.core.deferred_members()


def test_a_forged_heartbeat_never_kills_a_live_member_and_never_keeps_a_dead_one():
    """Tampering is not silence: the last valid beat stands and the member is contested; silence
    alone never kills it however long the forgery lasts (a client without the secret must not
    decide a death). It is found dead on a peer's sealed report that their world broke (after
    ``contest_limit``), or by its silence once the tampering has stopped for a timeout."""
    from liveshard.runtime.control.store import JobStore

    def attacked(seconds: float) -> Coordinator:
        source = Requests()
        c = Coordinator(JobStore(dist.HashStore(), secret=b"s"), PRESETS["tiny-gpt"], source, LOCAL,
                        heartbeat_timeout=1.0, clock=Clock())
        _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
        c.tick()
        for _ in range(int(seconds / 0.5)):  # w1's key holds garbage at every read
            c.clock.advance(0.5)
            _beat(c, "w0")
            c.store.store.set(Keys.heartbeat("w1"), "forged")
            c.tick()
        return c

    c = attacked(5.0)  # past contest_limit (3 timeouts): still alive
    assert not c.dead and c.status()["contested"] == ["w1"]
    gen = c.current.generation
    c.store.set_json(Keys.heartbeat("w0"), {"time": _now(), "state": "broken", "generation": gen})
    c.store.store.set(Keys.heartbeat("w1"), "forged")
    c.tick()  # the coordinator reads w0's report
    c.tick()
    assert c.dead == {"w1"}  # its peer's sealed report, and no beat of its own for contest_limit

    c = attacked(2.0)
    for _ in range(3):  # the attack stops; w1 stays silent: a timeout after the last forgery
        c.clock.advance(0.5)
        _beat(c, "w0")
        c.tick()
    assert c.dead == {"w1"}


def test_a_death_that_explains_a_broken_world_ends_the_reports_weight_against_a_member_under_attack():
    """w1's heartbeat key is overwritten all along while w2 is lost for real and w0 reports the
    world broken: w2's silence, which needs no report, explains the break; w1 (alive, its beats
    hidden by the forgery) is not evicted on that report, in the same look or after it. Without
    the death, the report still finds a silent member under attack dead (the test above)."""
    for same_look in (True, False):
        c = _four_training()
        gen = c.current.generation
        # 6 s: w1 contested past contest_limit (3 s). w3 goes silent from the start, or (same
        # look) beats until its peers report the break, so that its death, on the report's
        # shorter limit, and w1's, on the report alone, fall in one look
        for i in range(12):
            c.clock.advance(0.5)
            state = "broken" if (i >= 8 if same_look else i >= 1) else "training"
            for w in ("w0", "w2"):
                c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": state, "generation": gen})
            if same_look and i < 8:
                c.store.set_json(Keys.heartbeat("w3"), {"time": _now(), "state": "training", "generation": gen})
            c.store.store.set(Keys.heartbeat("w1"), "forged")
            c.tick()
        assert "w3" in c.dead, same_look
        assert "w1" not in c.dead, (same_look, c.dead)
        plan = c.pending.plan if c.pending is not None else c.current
        assert "w1" in (*plan.members, *plan.standbys) and "w3" not in plan.members, (same_look, plan)


def _train(c: Coordinator, step: int, *workers: str) -> None:
    for w in workers:
        c.store.set_json(Keys.heartbeat(w), {"time": _now(), "state": "training", "step": step,
                                             "generation": c.current.generation,
                                             "preparing": c.pending.plan.generation if c.pending else None})


def test_a_change_whose_members_still_train_towards_it_is_slow_not_stuck_within_a_bound():
    """The transition timeout counts from the stalest missing member's last training step: on a
    loaded node steps are slow and the switch step is some away. Progress extends the wait to
    ``PROGRESS_CAP`` timeouts at most; a member that stops advancing ends it one timeout later."""
    from liveshard.runtime.coordinator.generations import PROGRESS_CAP

    def run(advance_until: float) -> tuple[float, str]:
        source = Requests()
        c = _coordinator(source, LOCAL)
        _running(c, source, ("w0", "w1", "w2", "w3"), "tp=1,pp=1,dp=4")
        source.queue.append(PlanRequest(members=("w0", "w1"), config="tp=1,pp=1,dp=2", reason="w2, w3 leave",
                                        switch_at_step=1000))
        c.tick()
        assert c.pending is not None
        timeout, step, t = c.core.transition_timeout, 1, 0.0
        while c.pending is not None and t < (PROGRESS_CAP + 2) * timeout:
            c.clock.advance(timeout / 4)
            t += timeout / 4
            step += t <= advance_until  # one step every quarter timeout, then none
            _beat(c, "w0", "w1", "w2", "w3")
            _train(c, step, "w0", "w1", "w2", "w3")
            c.tick()
        return t, c.history[-1]["outcome"]

    t, outcome = run(advance_until=10 * PROGRESS_CAP * 120.0)  # training never stops
    assert outcome.startswith("aborted: no result from") and PROGRESS_CAP * 120.0 < t <= PROGRESS_CAP * 120.0 + 60
    t, outcome = run(advance_until=180.0)  # steps until 1.5 timeouts in, then stuck
    assert outcome.startswith("aborted: no result from") and 180.0 + 120.0 < t <= 180.0 + 120.0 + 60
    t, outcome = run(advance_until=0.0)  # never a step: the plain timeout
    assert outcome.startswith("aborted: no result from") and 120.0 < t <= 150.0


def test_each_member_is_planned_with_the_device_memory_it_announced():
    """A worker announces its device's memory when it registers (nodes of one job may differ):
    the coordinator plans with it, not with the job's ``gpuMemory``. Here the job says 80 GiB,
    but the workers' devices hold 1 KiB: no layout of the model fits them."""
    throughput = PlanningInputs(Constraints(global_batch=4, micro_batch=1))  # the planner checks memory
    for announced, planned in ((None, True), (2**10, False)):
        source = Requests()
        c = _coordinator(source, throughput)
        _beat(c, "w0", "w1")
        if announced is not None:
            for w in ("w0", "w1"):
                c.store.set_json(Keys.member(w), {"host": "h", "node": f"node-{w}", "time": time.time(),
                                                  "gpu_memory_bytes": announced})
        source.queue.append(PlanRequest(members=("w0", "w1"), reason="start"))
        c.tick()
        assert (c.pending is not None) == planned, c.history
        if not planned:
            assert c.history[-1]["outcome"].startswith("rejected") and "GiB" in c.history[-1]["outcome"]
            assert c.core.memory == {"w0": 2**10, "w1": 2**10}


def test_after_a_stop_the_store_stays_up_for_every_registered_worker_not_only_the_worlds():
    """A worker registered but in no plan yet (a replacement pod, a joiner) must read the stop key
    too: the coordinator keeps its store up until that worker's heartbeat says it ended (or falls
    silent), else the worker would reconnect to a restarted coordinator's store without it."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    for w in ("w0", "w1"):
        c.store.set_json(Keys.heartbeat(w), {"time": time.time(), "state": "exited"})
    c.store.register_member("w9", {"host": "h", "node": "node-w9", "time": time.time(), "incarnation": "i9"})
    c.store.set_json(Keys.heartbeat("w9"), {"time": time.time(), "state": "waiting"})
    t0 = time.monotonic()
    c._drain(timeout=0.6)
    assert time.monotonic() - t0 >= 0.5  # waited for w9
    c.store.set_json(Keys.heartbeat("w9"), {"time": time.time(), "state": "exited"})
    t0 = time.monotonic()
    c._drain(timeout=5.0)
    assert time.monotonic() - t0 < 1.0  # every worker ended: at once


def test_a_join_waiting_for_its_worker_is_asked_again_after_a_recovery_not_dropped():
    """A member dies while a join waits for a worker to register: the recovery goes first, and
    the join is asked again after it (its worker registers meanwhile and is planned in)."""
    source = Requests()
    c = _coordinator(source, LOCAL)
    _running(c, source, ("w0", "w1", "w2", "w3"), "tp=1,pp=1,dp=4")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2", "w3", "w9"), reason="w9 joins"))
    c.tick()
    assert c.core.deferred_members() == ("w0", "w1", "w2", "w3", "w9")
    _lose(c, "w3", ("w0", "w1", "w2"))  # the recovery plans the survivors
    assert c.pending is not None and "w3" not in c.pending.plan.members
    assert not c.core.deferred_members() and c.core.state.reissue and c.core.state.reissue[0].reason == "w9 joins"
    _commit(c)
    _beat(c, "w0", "w1", "w2", "w9")  # w9 registered meanwhile
    c.tick()
    assert c.pending is not None and "w9" in (*c.pending.plan.members, *c.pending.plan.standbys)
    assert "w3" not in c.pending.plan.members


def test_a_change_whose_rendezvous_broke_is_asked_again_a_bounded_number_of_times():
    """A change of a running world fails in its members (its group's c10d keys overwritten:
    "Connection reset by peer"): the old world trains on and the change is asked again as a new
    generation (a new rendezvous prefix), ``RETRIES`` times in a row at most."""
    from liveshard.runtime.coordinator.switching import RETRIES

    source = Requests()
    c = _coordinator(source, LOCAL)
    first = _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
    for w in ("w0", "w1", "w2", "w3"):
        c.store.register_member(w, {"host": "h", "node": f"node-{w}", "time": time.time()})
    _beat(c, "w0", "w1", "w2", "w3")
    source.queue.append(PlanRequest(members=("w0", "w1", "w2", "w3"), config="tp=1,pp=1,dp=4",
                                    reason="w2, w3 join"))
    c.tick()
    generations = []
    for _ in range(RETRIES + 2):
        if c.pending is None:
            break
        gen = c.pending.plan
        generations.append(gen.generation)
        assert gen.members == ("w0", "w1", "w2", "w3") and c.current == first
        for m in ("w0", "w1", "w2", "w3"):
            c.store.set(Keys.result(gen.generation, m),
                        MemberResult(ok=False, error="prepare: gloo: Connection reset by peer").to_json())
        _beat(c, "w0", "w1", "w2", "w3")
        c.tick()  # aborted, and asked again
        c.tick()
    assert len(generations) == RETRIES + 1 and len(set(generations)) == RETRIES + 1, generations
    assert c.pending is None and c.current == first  # gave up; the old world trains on
    assert [h["outcome"].startswith("aborted") for h in c.history if h.get("generation") in generations] == \
        [True] * (RETRIES + 1)


def test_a_change_failed_by_a_joiner_that_died_is_not_asked_again():
    """A joiner killed in its transfer resets its peers' connections: a member reports the failure
    at once, before the joiner's silence counts. The change is not asked again while the joiner
    gave no result and has not beaten since; found dead, it is dropped (no try that only waits
    for the dead). Alive (a new beat), it is asked again."""
    for joiner_lives in (False, True):
        source = Requests()
        c = _coordinator(source, LOCAL)
        first = _running(c, source, ("w0", "w1"), "tp=1,pp=1,dp=2")
        _beat(c, "w0", "w1", "w2", "w3")
        source.queue.append(PlanRequest(members=("w0", "w1", "w2", "w3"), config="tp=1,pp=1,dp=4",
                                        reason="w2, w3 join"))
        c.tick()
        gen = c.pending.plan
        for m in ("w0", "w1", "w2"):
            c.store.set(Keys.result(gen.generation, m),
                        MemberResult(ok=False, error="transfer: gloo: Connection reset by peer").to_json())
        c.tick()  # aborted: w3 gave no result
        assert c.pending is None and c.current == first and c.core.state.reissue
        c.clock.advance(0.6)
        _beat(c, "w0", "w1", "w2")
        c.tick()
        assert c.pending is None  # held: w3 not heard since
        c.clock.advance(0.6)
        _beat(c, "w0", "w1", "w2", *(("w3",) if joiner_lives else ()))
        c.tick()
        c.tick()
        if joiner_lives:
            assert c.pending is not None and c.pending.plan.reason == "w2, w3 join (try 2)"
            assert c.pending.plan.members == ("w0", "w1", "w2", "w3")
        else:
            assert "w3" in c.dead and c.pending is None and not c.core.state.reissue, c.history
            assert [h["generation"] for h in c.history if h.get("reason", "").startswith("w2, w3 join")] == \
                [gen.generation]
