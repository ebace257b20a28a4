"""The straggler loop's pure parts: the speed estimate, the re-plan policy, its bookkeeping."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from liveshard.dev.localrun.events import parse_events
from liveshard.runtime.agent.compute_clock import ComputeClock
from liveshard.runtime.contract.jobspec import AdaptivePolicy, read_adaptive
from liveshard.runtime.control.protocol import WorldPlan
from liveshard.runtime.control.stragglers import StragglerLoop
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.planner.adapt import decide, output_units, predict_compute, work_units
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.telemetry import SpeedTracker

SPEC16 = replace(PRESETS["tiny-llama"], name="tiny-llama-16", num_layers=16)
POLICY = AdaptivePolicy(enabled=True, window=4, horizon=200, min_gain=0.05)


def check(tracker: SpeedTracker, members, now: float | None = None) -> dict:
    """One coordinator tick: the hysteresis moves, then the summary is read."""
    tracker.update(members, now)
    return tracker.summary(members)


def beats(tracker: SpeedTracker, rates: dict[str, float], steps: range, noise: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)
    for step in steps:
        for m, r in rates.items():
            seconds = r * 10 * (1 + rng.uniform(-noise, noise))
            tracker.observe(m, {"compute": [[step, seconds, 10.0]]})


# ---- the speed estimate ------------------------------------------------------------------------
def test_a_mildly_slow_device_is_a_straggler_once_slow_for_a_window_after_a_full_one():
    t = SpeedTracker(threshold=0.8, window=4)
    rates = {"a": 1.0, "b": 1.0, "c": 1.5, "d": 1.0}  # 0.67: below the threshold, above the severe 0.6
    beats(t, rates, range(1, 4))
    assert check(t, rates, 10.0)["stragglers"] == []  # 3 samples: no estimate yet
    beats(t, rates, range(4, 5))
    s = check(t, rates, 11.0)
    assert s["stragglers"] == [] and s["members"]["c"]["speed"] == 0.667  # slow, not for long enough
    beats(t, rates, range(5, 8))
    assert check(t, rates, 12.0)["stragglers"] == []
    beats(t, rates, range(8, 9))
    s = check(t, rates, 13.0)
    assert s["stragglers"] == ["c"] and s["members"]["c"]["slow_since"] == 13.0
    assert s["members"]["a"]["speed"] == 1.0


def _found_at(factor: float, seed: int, slow_at: int = 20) -> tuple[int | None, SpeedTracker]:
    """±35 % noise per step; from ``slow_at`` device w1 is ``factor`` times slower: the step at
    which it is first a straggler (no other device ever is)."""
    t = SpeedTracker(threshold=0.7, window=8)
    rates = {f"w{i}": 1.0 for i in range(4)}
    found = None
    for step in range(1, slow_at + 20):
        slowed = {**rates, "w1": factor} if step >= slow_at else rates
        beats(t, slowed, range(step, step + 1), noise=0.35, seed=seed * 1000 + step)
        s = check(t, rates, float(step))
        if s["stragglers"]:
            assert s["stragglers"] == ["w1"] and step >= slow_at, (step, s)
            found = found or step
    return found, t


@pytest.mark.parametrize("factor", [2.5, 2.86, 5.0])
@pytest.mark.parametrize("seed", range(20))
def test_a_sharp_slowdown_is_a_change_point_found_within_five_steps(factor, seed):
    """Found at the 4th or 5th slow step; the window restarted at the change, so the estimate
    is the new speed, not a blend with the old one."""
    found, t = _found_at(factor, seed)
    assert found is not None and found <= 20 + 4, found
    assert 18 <= t.devices["w1"].changed_at <= found
    assert t.summary([f"w{i}" for i in range(4)])["members"]["w1"]["speed"] < 0.7


def test_a_2x_slowdown_under_35_percent_noise_is_found_within_five_steps_nearly_always():
    """Per step the noise (0.65-1.35) overlaps a 2x device's (1.3-2.7): 4-5 steps of evidence
    find it in nearly every run (simulated: 98 % within 5 steps over 300 seeds)."""
    found = [_found_at(2.0, seed)[0] for seed in range(40)]
    within = sum(1 for f in found if f is not None and f <= 25)
    assert within >= 37, found
    assert all(f is not None and f <= 30 for f in found), found  # and the rest by the mild detector's bound


def test_in_a_world_of_two_the_slow_half_is_found():
    t = SpeedTracker(threshold=0.7, window=8)
    beats(t, {"a": 1.0, "b": 1.0}, range(1, 9))
    beats(t, {"a": 1.0, "b": 2.0}, range(9, 13))
    assert check(t, ["a", "b"])["stragglers"] == ["b"]


def test_one_slow_burst_from_a_busy_host_is_not_a_straggler():
    t = SpeedTracker(threshold=0.8, window=4)
    rates = {"a": 1.0, "b": 1.0, "c": 1.0}
    beats(t, rates, range(1, 5))
    for step in range(5, 7):  # two slow steps (fewer than ``confirm - 1``), checked at each
        beats(t, {**rates, "c": 3.0}, range(step, step + 1))
        assert check(t, rates)["stragglers"] == []
    beats(t, rates, range(7, 13))
    assert check(t, rates)["stragglers"] == []
    # delays on some steps only: the lower quartile of the window sees through them, and a
    # change point needs every one of its steps slow
    for step in range(13, 29):
        beats(t, {**rates, "c": 4.0 if step % 2 else 1.0}, range(step, step + 1))
        assert check(t, rates)["stragglers"] == [], step
    assert check(t, rates)["members"]["c"]["speed"] == 1.0


def _healthy_run_finds_a_straggler(seed: int, burst_rate: float) -> bool:
    """200 steps of 4 healthy devices, ±35 % noise per step, checked at every step; a busy host
    slows a random device 3x for 1-2 steps at ``burst_rate`` of the steps."""
    rng = random.Random(seed)
    t = SpeedTracker(threshold=0.7, window=8)
    rates = {f"w{i}": 1.0 for i in range(4)}
    burst: dict[str, int] = {}
    for step in range(1, 201):
        if rng.random() < burst_rate:
            burst.setdefault(rng.choice(sorted(rates)), rng.randint(1, 2))
        now = {m: (3.0 if burst.get(m, 0) > 0 else 1.0) for m in rates}
        burst = {m: n - 1 for m, n in burst.items() if n > 1}
        beats(t, now, range(step, step + 1), noise=0.35, seed=seed * 1000 + step)
        if check(t, rates)["stragglers"]:
            return True
    return False


def test_a_healthy_loaded_machine_makes_no_straggler_in_200_steps_checked_at_every_step():
    assert not any(_healthy_run_finds_a_straggler(seed, 0.0) for seed in range(30))
    # bursts of 1-2 slow steps on one device at 5 % of the steps (about ten per run) make a
    # straggler in some runs (simulated over 300 seeds: 16 %); the policy's trial undoes a switch
    # that does not pay
    flagged = sum(_healthy_run_finds_a_straggler(seed, 0.05) for seed in range(50))
    assert flagged <= 14, flagged


def test_noise_of_a_loaded_machine_makes_no_straggler_and_recovery_needs_the_margin():
    t = SpeedTracker(threshold=0.8, window=8)
    rates = {f"w{i}": 1.0 for i in range(4)}
    for start in range(1, 200, 8):  # +-35% per step around the same speed
        beats(t, rates, range(start, start + 8), noise=0.35, seed=start)
        assert check(t, rates)["stragglers"] == []
    beats(t, {**rates, "w2": 1.6}, range(200, 208))
    check(t, rates, 1.0)
    beats(t, {**rates, "w2": 1.6}, range(208, 216))
    assert check(t, rates, 1.5)["stragglers"] == ["w2"]
    beats(t, {**rates, "w2": 1.15}, range(216, 224))  # 0.87: above the threshold, within the margin
    assert check(t, rates, 2.0)["stragglers"] == ["w2"]
    beats(t, rates, range(224, 232))
    assert check(t, rates, 3.0)["stragglers"] == []


def test_repeated_and_malformed_samples_count_once_or_not_at_all():
    t = SpeedTracker(window=4)
    t.observe("a", {"compute": [[1, 1.0, 10.0], [1, 5.0, 10.0], ["x", 1, 1], [2, 0.0, 10.0], [3, 1.0]]})
    assert [r for _, r in t.devices["a"].rates] == [0.1]
    t.observe("a", {"compute": [[1, 1.0, 10.0], [2, 2.0, 10.0]]})
    assert [s for s, _ in t.devices["a"].rates] == [1, 2]


def test_hardware_throttling_makes_a_straggler_at_once():
    t = SpeedTracker(window=4)
    t.observe("a", {"compute": [[1, 1.0, 1.0]], "health": {"throttle": ["hw_thermal_slowdown"]}})
    t.observe("b", {"compute": [[1, 1.0, 1.0]], "health": {"throttle": ["applications_clocks"]}})
    assert check(t, ["a", "b"])["stragglers"] == ["a"]


# ---- prediction and policy ---------------------------------------------------------------------
def test_work_units_count_layers_and_the_output_layer_on_the_last_stage():
    cfg = ParallelConfig(pp=2, dp=2, layers=(6, 10))
    out = output_units(SPEC16, 32)
    assert out > 0
    assert work_units(cfg, 0, 16, out, 3) == 18  # rank 0: stage 0
    assert work_units(cfg, 3, 16, out, 2) == pytest.approx(2 * (10 + out))  # rank 3: stage 1, the last


def test_predicted_step_is_the_1f1b_pipeline_of_the_slowest_replica():
    cfg = ParallelConfig(pp=2, dp=2)
    rates = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}  # d: stage 1 of replica 1
    t = predict_compute(cfg, ["a", "b", "c", "d"], rates, 16, 0.0, 8)
    # replica 1: stages 8 and 16 s per micro-batch, 4 micro-batches: 3 * 16 + 24
    assert t == pytest.approx(3 * 16 + 24)


def test_a_slow_pipeline_stage_gets_fewer_layers():
    cfg = ParallelConfig(pp=4)
    members = ["w0", "w1", "w2", "w3"]
    rates = {"w0": 1.0, "w1": 2.0, "w2": 1.0, "w3": 1.0}
    d = decide(SPEC16, cfg, members, [], rates, measured_step=100.0, switch_cost=1.0, policy=POLICY,
               global_batch=8, micro_batch=1, seq_length=32)
    assert d.switch and d.best.kind == "layers"
    layers = d.best.config.layers
    assert sum(layers) == 16 and layers[1] == min(layers) and layers[1] < 4
    assert d.predicted_after < d.predicted_now
    assert d.to_dict()["predictedStepSecondsAfter"] == round(d.predicted_after, 5)


def test_a_slow_replica_gets_fewer_micro_batches_of_the_same_global_batch():
    cfg = ParallelConfig(pp=1, dp=2)
    d = decide(SPEC16, cfg, ["a", "b"], [], {"a": 1.0, "b": 3.0}, measured_step=1e3, switch_cost=1.0,
               policy=POLICY, global_batch=8, micro_batch=1, seq_length=32)
    assert d.switch and d.best.kind == "data"
    assert d.best.config.dp_split is not None and sum(d.best.config.dp_split) == 8
    assert d.best.config.dp_split[1] < d.best.config.dp_split[0]


def test_healthy_devices_keep_the_running_plan():
    cfg = ParallelConfig(pp=2, dp=2)
    d = decide(SPEC16, cfg, ["a", "b", "c", "d"], [], dict.fromkeys("abcd", 1.0), measured_step=50.0,
               switch_cost=1.0, policy=POLICY, global_batch=8, micro_batch=1, seq_length=32)
    assert not d.switch and d.best.config == cfg


def test_a_recovered_device_gets_the_even_plan_back():
    cfg = ParallelConfig(pp=4, layers=(5, 2, 5, 4))
    d = decide(SPEC16, cfg, ["a", "b", "c", "d"], [], dict.fromkeys("abcd", 1.0), measured_step=80.0,
               switch_cost=1.0, policy=POLICY, global_batch=8, micro_batch=1, seq_length=32,
               baseline=ParallelConfig(pp=4))
    assert d.switch and d.best.config.layers is None and d.best.config.dp_split is None


def test_a_switch_that_does_not_pay_over_the_horizon_is_not_taken():
    cfg = ParallelConfig(pp=4)
    rates = {"w0": 1.0, "w1": 2.0, "w2": 1.0, "w3": 1.0}
    d = decide(SPEC16, cfg, list(rates), [], rates, measured_step=100.0, switch_cost=1e6,
               policy=replace(POLICY, horizon=10), global_batch=8, micro_batch=1, seq_length=32)
    assert not d.switch and "does not pay" in d.reason and d.best.kind == "layers"


def test_a_hopeless_device_goes_to_standby_and_stays_there_on_probation():
    spec = PRESETS["tiny-llama"]  # 4 layers: pp=4 has no layer to move
    cfg = ParallelConfig(pp=4)
    rates = {"w0": 1.0, "w1": 10.0, "w2": 1.0, "w3": 1.0}
    d = decide(spec, cfg, list(rates), [], rates, measured_step=100.0, switch_cost=1.0, policy=POLICY,
               global_batch=8, micro_batch=1, seq_length=32)
    assert d.switch and d.best.kind.startswith("standby") and d.best.standbys == ("w1",)
    assert d.best.config.world_size == 3 and "w1" not in d.best.members
    # on probation w1 is not brought back; after it, with the job's layout as the baseline, it is
    now = d.best
    healthy = {m: 1.0 for m in now.members}
    kept = decide(spec, now.config, now.members, now.standbys, {**healthy, "w1": 10.0}, measured_step=40.0,
                  switch_cost=1.0, policy=POLICY, global_batch=8, micro_batch=1, seq_length=32,
                  slow_standbys=("w1",), baseline=cfg)
    assert not kept.switch
    back = decide(spec, now.config, now.members, now.standbys, healthy, measured_step=40.0, switch_cost=1.0,
                  policy=POLICY, global_batch=8, micro_batch=1, seq_length=32, baseline=cfg)
    assert back.switch and back.best.kind == "rejoin" and back.best.config == cfg and "w1" in back.best.members


def test_memory_caps_bound_the_layers_a_fast_stage_takes():
    cfg = ParallelConfig(pp=4)
    rates = {"w0": 1.0, "w1": 3.0, "w2": 1.0, "w3": 1.0}
    d = decide(SPEC16, cfg, list(rates), [], rates, measured_step=100.0, switch_cost=1.0, policy=POLICY,
               global_batch=8, micro_batch=1, seq_length=32, layer_caps=lambda c: (5, 5, 5, 5) if c.pp == 4 else None)
    assert d.switch and max(d.best.config.layers) <= 5


def test_policy_settings_are_validated_with_the_field_named():
    assert read_adaptive(None) == AdaptivePolicy()
    assert read_adaptive({"enabled": True, "threshold": 0.7, "horizonSteps": 50}).horizon == 50
    with pytest.raises(ConfigError, match=r"spec\.elasticity\.adaptive\.threshold"):
        read_adaptive({"threshold": 1.5})
    with pytest.raises(ConfigError, match=r"spec\.elasticity\.adaptive\.window"):
        read_adaptive({"window": 0})
    with pytest.raises(ConfigError, match=r"spec\.elasticity\.adaptive\.enabled"):
        read_adaptive({"enabled": "yes"})


# ---- the coordinator's loop --------------------------------------------------------------------
def plan(gen: int, config: str, members: tuple[str, ...], standbys: tuple[str, ...] = ()) -> WorldPlan:
    return WorldPlan(generation=gen, config=config, members=members, standbys=standbys, reason="", previous=None)


def test_the_loop_requests_a_switch_once_every_member_has_a_window():
    loop = StragglerLoop(SPEC16, replace(POLICY, window=8), global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    loop.committed(world)
    rates = {"w0": 1.0, "w1": 1.5, "w2": 1.0, "w3": 1.0}  # 0.67: mildly slow, no change point
    for step in range(1, 16):
        for m, r in rates.items():
            loop.observe(m, {"compute": [[step, r, 1.0]]})
        loop.update(world.members, now=0.0)
        if step in (3, 7, 8, 15):
            # 7: no full window; 8: the first full one below the threshold; 15: not yet for another
            assert loop.consider(world, step, 10.0, [], now=0.0) is None
    for m, r in rates.items():
        loop.observe(m, {"compute": [[16, r, 1.0]]})
    loop.update(world.members, now=0.0)
    request = loop.consider(world, 16, 10.0, [{"outcome": "committed", "downtime": 0.4}], now=0.0)
    assert request is not None and request["cause"] == "straggler" and "layers=" in request["config"]
    assert request["members"] == ("w0", "w1", "w2", "w3")
    assert loop.switches == 0 and loop.baseline is None  # nothing counts before the plan is published
    loop.taken(1, now=0.0)
    assert loop.baseline == ParallelConfig(pp=4) and loop.switches == 1
    assert loop.decisions[-1]["switch"] and loop.decisions[-1]["switchCostSeconds"] == 0.4
    loop.committed(plan(1, request["config"], request["members"]))
    assert loop.baseline == ParallelConfig(pp=4)  # kept across its own switches
    loop.committed(plan(2, "tp=1,pp=2,dp=1", ("w0", "w2")))  # a plan from elsewhere: the job's layout now
    assert loop.baseline is None


def test_a_sharp_slowdown_is_switched_around_within_five_steps_of_it():
    """A device 2.86x slower from step 20: the switch is requested as soon as a change point
    finds it, with the others' full windows and its own slow steps."""
    loop = StragglerLoop(SPEC16, replace(POLICY, window=8), global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    loop.committed(world)
    request = None
    rng = random.Random(3)
    for step in range(1, 30):
        for m in world.members:
            r = (2.86 if m == "w1" and step >= 20 else 1.0) * (1 + rng.uniform(-0.35, 0.35))
            loop.observe(m, {"compute": [[step, r, 1.0]]})
        loop.update(world.members, now=0.0)
        request = loop.consider(world, step, 10.0, [{"outcome": "committed", "downtime": 0.4}], now=0.0)
        if request is not None:
            break
    assert request is not None and 20 <= step <= 20 + 4, step
    assert "layers=" in request["config"] and request["cause"] == "straggler"


@pytest.mark.parametrize("seed", range(12))
def test_an_unseen_sharp_slowdown_is_requested_with_its_switch_at_most_five_steps_after_it(seed):
    """A slowdown whose step and factor (0.25-0.45x) come from a seed, under ±35 % noise: the
    request comes on the tick that reads the third slow step, and names the step after the one
    it saw as its switch step (``switch_at_step``): at most 5 steps after the last healthy one."""
    rng = random.Random(seed)
    slow_at, factor = rng.randint(12, 30), rng.uniform(0.25, 0.45)
    loop = StragglerLoop(SPEC16, replace(POLICY, window=8), global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    loop.committed(world)
    request, step = None, 0
    for step in range(1, slow_at + 10):
        for m in world.members:
            r = (1 / factor if m == "w1" and step > slow_at else 1.0) * (1 + rng.uniform(-0.35, 0.35))
            loop.observe(m, {"compute": [[step, r, 1.0]]})
        loop.update(world.members, now=0.0)
        request = loop.consider(world, step, 10.0, [{"outcome": "committed", "downtime": 0.4}], now=0.0)
        if request is not None:
            break
    assert request is not None and slow_at + 3 <= step <= slow_at + 4, (slow_at, factor, step)
    assert request["switch_at_step"] == step + 1 <= slow_at + 5


def test_the_switch_step_leaves_room_for_the_measured_preparation():
    lead = StragglerLoop.switch_lead
    assert lead([], 0.5) == 1  # nothing measured: the step after the one the decision saw
    history = [{"outcome": "committed", "phases": {"prepare": 1.3}},
               {"outcome": "aborted", "phases": {"prepare": 50.0}}]
    assert lead(history, 0.5) == 1 + 2  # 1.3 s of preparation over 0.5 s steps: two more steps
    assert lead(history, None) == 1 and lead([{"outcome": "committed", "phases": {"prepare": "x"}}], 0.5) == 1
    assert lead([{"outcome": "committed", "phases": {"prepare": 1e9}}], 1.0) == 1 + 1000


def test_a_healthy_world_under_noise_and_bursts_requests_no_switch():
    """±35 % noise per step and a busy host's single slow steps on one device: no request."""
    loop = StragglerLoop(SPEC16, replace(POLICY, window=8), global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    loop.committed(world)
    rng = random.Random(7)
    for step in range(1, 120):
        for m in world.members:
            burst = 3.0 if m == "w2" and step % 9 == 0 else 1.0
            loop.observe(m, {"compute": [[step, burst * (1 + rng.uniform(-0.35, 0.35)), 1.0]]})
        loop.update(world.members, now=0.0)
        assert loop.consider(world, step, 10.0, [], now=0.0) is None, step


def test_the_loop_does_nothing_when_disabled():
    loop = StragglerLoop(SPEC16, AdaptivePolicy(window=2), global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    for step in range(1, 9):
        for m, r in {"w0": 1.0, "w1": 5.0, "w2": 1.0, "w3": 1.0}.items():
            loop.observe(m, {"compute": [[step, r, 1.0]]})
        loop.update(world.members, now=0.0)
    assert loop.consider(world, 8, 10.0, [], now=0.0) is None
    assert loop.summary(world.members)["stragglers"] == ["w1"]  # measured and reported all the same


# ---- dev events and the clock ------------------------------------------------------------------
def test_slow_events_parse_and_bad_ones_name_the_fix():
    [ev] = parse_events("5:slow=1,2@0.5")
    assert ev.kind == "slow" and ev.ranks == (1, 2) and ev.factor == 0.5 and str(ev) == "5:slow=1,2@0.5"
    for bad in ("5:slow=1", "5:slow=1@0", "5:slow=1@1.5", "5:slow=x@0.5"):
        with pytest.raises(ConfigError, match="slow"):
            parse_events(bad)


def test_the_clock_times_compute_segments_only_and_calls_the_gate():
    seen = []
    clock = ComputeClock(cuda=False, gate=seen.append)
    clock.begin_step()
    clock("forward-backward", log_level=1).start(barrier=False)
    clock("forward-compute", log_level=2).start()
    sum(range(20000))
    clock("forward-compute").stop()
    clock("forward-recv", log_level=2).start()
    clock("forward-recv").stop()
    clock("backward-compute", log_level=2).start()
    clock("backward-compute").stop()
    clock("forward-backward").stop()
    total = clock.end_step()
    assert len(seen) == 2 and total >= sum(seen) and total > 0
    clock.begin_step()
    assert clock.end_step() == 0.0


def _feed(loop: StragglerLoop, world: WorldPlan, rates: dict[str, float], steps: range, step_seconds: float) -> None:
    for step in steps:
        for m, r in rates.items():
            loop.observe(m, {"compute": [[step, r, 1.0]], "generation": world.generation, "step": step,
                             "step_seconds": step_seconds})
        loop.update(world.members, now=0.0)


@pytest.mark.parametrize("after, undone", [(0.6, False), (1.05, True)])
def test_a_switch_is_kept_only_if_the_measured_step_gets_faster(after, undone):
    loop = StragglerLoop(SPEC16, POLICY, global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    loop.committed(world)
    slow = {"w0": 1.0, "w1": 2.0, "w2": 1.0, "w3": 1.0}
    _feed(loop, world, slow, range(1, 10), 1.0)
    request = loop.consider(world, 9, 1.0, [], now=0.0)
    assert request is not None
    loop.taken(1, now=0.0)
    new = plan(1, request["config"], request["members"])
    loop.committed(new)
    _feed(loop, new, slow, range(10, 16), after)
    judged = loop.consider(new, 15, after, [], now=0.0)
    if undone:
        assert judged is not None and judged["config"] == "tp=1,pp=4,dp=1" and "did not pay" in judged["reason"]
        loop.taken(2, now=0.0)
        assert loop.decisions[-1]["kind"] == "undo" and loop.switches == 2
        back = plan(2, judged["config"], judged["members"])
        loop.committed(back)
        _feed(loop, back, slow, range(16, 30), 1.0)
        assert loop.consider(back, 29, 1.0, [], now=0.0) is None  # on hold for a probation
    else:
        assert judged is None and loop.decisions[-1]["kind"] == "kept"
    # the next switch must promise more than the last prediction missed by
    predicted = next(d for d in loop.decisions if d.get("kind") == "layers")["predictedStepSecondsAfter"]
    assert loop.model_error == pytest.approx(abs(after - predicted) / after, rel=1e-3)


def test_a_refused_request_counts_nothing_and_waits_a_window():
    loop = StragglerLoop(SPEC16, POLICY, global_batch=8, micro_batch=1, seq_length=32)
    world = plan(0, "tp=1,pp=4,dp=1", ("w0", "w1", "w2", "w3"))
    loop.committed(world)
    _feed(loop, world, {"w0": 1.0, "w1": 2.0, "w2": 1.0, "w3": 1.0}, range(1, 10), 1.0)
    assert loop.consider(world, 9, 1.0, [], now=0.0) is not None
    loop.rejected(now=0.0)
    assert loop.switches == 0 and loop.baseline is None and not loop.probation
    assert loop.decisions[-1]["kind"] == "refused" and not loop.decisions[-1]["switch"]
    assert loop.consider(world, 10, 1.0, [], now=0.0) is None  # not again before a window has passed


def test_malformed_heartbeats_are_skipped_never_raised():
    t = SpeedTracker(window=2)
    for hb in ({"compute": 5}, {"compute": [{"a": 1}]}, {"compute": [[1e400, 1.0, 1.0]]},
               {"compute": [[1, float("nan"), 1.0]]}, {"compute": [[1, float("inf"), 1.0]]},
               {"health": "x"}, {"health": {"throttle": None}}, {"compute": None}, {}):
        t.observe("a", hb)
    assert not t.devices["a"].rates and not t.devices["a"].throttled
    loop = StragglerLoop(SPEC16, POLICY, global_batch=8, micro_batch=1, seq_length=32)
    loop.observe("a", {"generation": 0, "step": 1, "step_seconds": float("nan"), "compute": "x"})
    assert loop.measured_step(0) is None


def test_samples_of_the_old_world_do_not_come_back_after_a_switch():
    t = SpeedTracker(window=4)
    hb = {"compute": [[s, 1.0, 1.0] for s in range(1, 9)]}
    t.observe("a", hb)
    t.restart_window(["a"])
    t.observe("a", hb)  # the same heartbeat read again before the worker sent a new one
    assert not t.devices["a"].rates
    t.observe("a", {"compute": [[9, 2.0, 1.0]]})
    assert [s for s, _ in t.devices["a"].rates] == [9]


def test_every_candidate_fits_the_memory_caps():
    rates = {"w0": 1.0, "w1": 2.0, "w2": 1.0, "w3": 1.0}
    caps = {2: (7, 9), 4: (5, 5, 5, 5), 3: (6, 6, 6)}
    for pp in (2, 4):
        cfg = ParallelConfig(pp=pp, dp=4 // pp)
        d = decide(SPEC16, cfg, list(rates), [], rates, measured_step=100.0, switch_cost=1.0, policy=POLICY,
                   global_batch=8, micro_batch=1, seq_length=32, layer_caps=lambda c: caps.get(c.pp))
        for lay in ([d.best] if d.switch else []):
            layers = lay.config.stage_layers(16)
            assert all(n <= c for n, c in zip(layers, caps[lay.config.pp])), lay
