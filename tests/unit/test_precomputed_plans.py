"""Plans precomputed after a commit (``Coordinator._precompute``, ``planner.precompute``): the plan
published for a node lost without notice, or for waiting workers joining, is the one the
coordinator computes on the spot without the cache; an event the precomputation did not foresee
(other inputs) is planned afresh."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch.distributed as dist

from liveshard.runtime.contract.keys import COMMITTED, Keys
from liveshard.runtime.control.protocol import MemberResult, WorldPlan
from liveshard.runtime.control.store import JobStore
from liveshard.runtime.coordinator import Coordinator, PlanningInputs, PlanRequest
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner import FEWEST_CHANGES, THROUGHPUT, Constraints, NoFeasiblePlan
from liveshard.runtime.planner.precompute import PlanCache
from liveshard.runtime.presets import PRESETS

# 4 nodes of 2 workers
NODES = {f"w{i}": f"node-{i // 2}" for i in range(8)}
FEWEST = PlanningInputs(Constraints(global_batch=12, micro_batch=1, objective=FEWEST_CHANGES))
FASTEST = PlanningInputs(Constraints(global_batch=12, micro_batch=1, objective=THROUGHPUT))


class Source:
    def __init__(self, inputs: PlanningInputs) -> None:
        self.queue: list[PlanRequest] = []
        self.inputs = inputs

    def poll(self) -> PlanRequest | None:
        return self.queue.pop(0) if self.queue else None

    def report(self, status: dict) -> None:
        pass

    def planning(self) -> PlanningInputs | None:
        return self.inputs


_sent = [time.time()]


def _beat(c: Coordinator, *workers: str) -> None:
    for w in workers:
        _sent[0] = max(time.time(), _sent[0] + 1e-3)  # each beat newer than the last
        c.store.set_json(Keys.member(w), {"host": "h", "node": NODES[w], "time": _sent[0]})
        c.store.set_json(Keys.heartbeat(w), {"time": _sent[0], "state": "training"})


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _register(c: Coordinator, *workers: str) -> None:
    for w in workers:
        c.store.register_member(w, {"host": "h", "node": NODES[w], "time": time.time()})
    _beat(c, *workers)


def _commit(c: Coordinator) -> WorldPlan:
    plan = c.pending.plan
    involved = set(plan.members) | (set(c.current.members) if c.current else set())
    for m in involved - c.dead:
        c.store.set(Keys.result(plan.generation, m), MemberResult(ok=True).to_json())
    if plan.is_live_transition:
        c.store.decide(Keys.decision(plan.generation), COMMITTED)
    c.tick()
    assert c.pending is None and c.current == plan
    return plan


def _settled(c: Coordinator) -> None:
    """Wait for the precomputation of the current world to end."""
    end = time.monotonic() + 60
    while (c.precomputed or {}).get("generation") != c.current.generation:
        assert time.monotonic() < end, "the precomputation never ended"
        time.sleep(0.01)


def _scenario(precompute: bool, inputs: PlanningInputs, event: str, change_inputs: bool = False,
              model: str = "tiny-gpt", config: str = "tp=2,pp=1,dp=3") -> tuple[Coordinator, WorldPlan | None]:
    """A world on w0..w5 (nodes 0-2; w6, w7 registered and waiting), then ``event``: "lose"
    node 1 (w2, w3) without notice, or "join" w6 and w7. Returns the coordinator and the plan it
    published for the event (None: it published none)."""
    source = Source(inputs)
    c = Coordinator(JobStore(dist.HashStore(), secret=b"test-secret"), PRESETS[model], source, inputs, heartbeat_timeout=1.0,
                    precompute=precompute, clock=Clock())
    workers = tuple(f"w{i}" for i in range(6))
    _register(c, *workers, "w6", "w7")
    source.queue.append(PlanRequest(members=workers, config=config))
    c.tick()
    _commit(c)
    if precompute:
        _settled(c)
        assert c.precomputed["events"] == 4  # three nodes lost, one join
    c.plans.hits = c.plans.misses = 0
    if change_inputs:
        source.inputs = replace(inputs, gpu_memory_bytes=inputs.gpu_memory_bytes // 2)
    if event == "lose":
        c.clock.t += 10  # w2 and w3 fall silent
        _beat(c, "w0", "w1", "w4", "w5", "w6", "w7")
    else:
        _beat(c, *workers, "w6", "w7")
        source.queue.append(PlanRequest(members=(*workers, "w6", "w7"), reason="2 worker(s) joined"))
    c.tick()
    return c, c.pending.plan if c.pending is not None else None


def _same(a: WorldPlan, b: WorldPlan) -> None:
    assert replace(a, created=0.0) == replace(b, created=0.0)


@pytest.mark.parametrize("inputs", [FEWEST, FASTEST], ids=["fewest-changes", "throughput"])
@pytest.mark.parametrize("event", ["lose", "join"])
def test_the_precomputed_plan_is_the_one_computed_on_the_spot(inputs, event):
    cached, plan = _scenario(True, inputs, event)
    assert plan is not None, cached.history
    assert cached.plans.misses == 0 and cached.plans.hits >= 1  # nothing was planned on the event
    fresh, expected = _scenario(False, inputs, event)
    assert fresh.plans.hits == 0 and fresh.plans.misses >= 1
    _same(plan, expected)
    if event == "lose":
        assert plan.dead == ("w2", "w3") and not {"w2", "w3"} & set(plan.members)


def test_an_event_with_other_inputs_is_planned_afresh():
    """The planning inputs changed after the precomputation (half the GPU memory): the cached
    plan answers another question and is not used."""
    cached, plan = _scenario(True, FASTEST, "lose", change_inputs=True)
    assert cached.plans.misses >= 1
    _, expected = _scenario(False, FASTEST, "lose", change_inputs=True)
    assert plan is not None and expected is not None
    _same(plan, expected)


def test_a_loss_with_no_live_copy_is_answered_from_the_cache_too():
    """tp=2 on node 1 alone (w2, w3 hold a tensor-parallel pair with no replica): losing it
    loses state; the precomputed check says so, as the fresh one does."""
    cached, plan = _scenario(True, FEWEST, "lose", config="tp=2,pp=3,dp=1,layers=1+1+2")
    fresh, expected = _scenario(False, FEWEST, "lose", config="tp=2,pp=3,dp=1,layers=1+1+2")
    assert cached.plans.misses == 0
    assert plan is None and expected is None  # no live copy and no checkpoint: the run fails
    assert cached.failure is not None and fresh.failure is not None
    assert cached.failure["message"] == fresh.failure["message"]


def test_the_cache_computes_each_question_once_and_keeps_exceptions():
    cache = PlanCache()
    calls: list[int] = []
    started, release = threading.Event(), threading.Event()

    def slow():
        calls.append(1)
        started.set()
        release.wait(5)
        return "plan"

    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(cache.get("k", slow, count=False)))
    t.start()
    started.wait(5)
    waiter = threading.Thread(target=lambda: got.append(cache.get("k", lambda: "other")))
    waiter.start()
    time.sleep(0.05)
    release.set()
    t.join(5)
    waiter.join(5)
    assert got == ["plan", "plan"] and len(calls) == 1 and cache.hits == 1 and cache.misses == 0

    def infeasible():
        raise NoFeasiblePlan("nothing fits", "gpus")

    for _ in range(2):
        with pytest.raises(NoFeasiblePlan):
            cache.get("bad", infeasible)
    assert cache.misses == 1 and cache.hits == 2
    cache.clear()
    assert len(cache) == 0 and cache.get("k", lambda: "new") == "new"


def test_planning_a_world_keeps_no_whole_transition_plan(monkeypatch):
    """The planner's rank-order comparison reads the layouts' overlap figures: it builds no
    transition plan (hundreds of MiB each at a thousand GPUs), so nothing whole is kept either."""
    from liveshard.runtime.planner import GPU, plan_world
    from liveshard.runtime.vps import transition as transition_mod

    calls: list[str] = []
    real_plan, real_figures = transition_mod.plan_transition, transition_mod.overlap_figures
    monkeypatch.setattr(transition_mod, "plan_transition", lambda *a, **k: calls.append("plan") or real_plan(*a, **k))
    monkeypatch.setattr(transition_mod, "overlap_figures",
                        lambda *a, **k: calls.append("figures") or real_figures(*a, **k))
    transition_mod.cached_plan.cache_clear()
    members = ("w0", "w1", "w2", "w3")
    gpus = [GPU(m, NODES[m], 80 << 30) for m in members if m != "w3"]
    plan = plan_world(PRESETS["tiny-llama"], gpus, FEWEST.constraints, current=ParallelConfig.parse("tp=2,pp=1,dp=2"),
                      current_members=members, lost=("w3",))
    assert plan.config.tp == 1 and calls == ["figures"]  # the layout changed: it compared orders, planned none
    assert transition_mod.cached_plan.cache_info().currsize == 0
