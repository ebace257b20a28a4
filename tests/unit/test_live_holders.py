"""The coordinator's no-live-copy check (``device_plan.lost_state``: the dead devices' holder
sets) gives the whole plan's answer (``plan_transition`` raising ``NoSurvivingCopy``) without
planning a copy."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from liveshard.dev.reshard.cases import SPECS, candidate_configs
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps import transition as transition_mod
from liveshard.runtime.vps.device_plan import lost_state
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.transition import NoSurvivingCopy, plan_transition, rank_order

P = ParallelConfig.parse


def whole_plan_says(spec, old, new, devices: DeviceMap) -> str | None:
    try:
        plan_transition(spec, old, new, devices)
    except NoSurvivingCopy as e:
        return str(e)
    return None


def check_says(spec, old, new, devices: DeviceMap) -> str | None:
    try:
        order = rank_order(spec, old, new, devices)
    except NoSurvivingCopy:  # no order without a live copy; any valid one asks the same question
        order = devices.available[:new.world_size]
    return lost_state(spec, old, new, devices, order)


# (model, old config, new config, dead devices, whether state is lost)
CASES = [
    ("tiny-llama", "tp=2,pp=1,dp=1", "tp=1,pp=1,dp=1", {1}, True),  # half of every weight had one holder
    ("tiny-llama", "tp=2,pp=1,dp=2", "tp=2,pp=1,dp=1", {1}, False),  # its DP replica holds it
    ("tiny-llama", "tp=2,pp=1,dp=2", "tp=1,pp=1,dp=2", {1, 3}, True),  # both replicas of tp rank 1
    ("tiny-llama", "tp=2,pp=1,dp=2", "tp=1,pp=1,dp=2", {1, 2}, False),  # one replica of each tp rank left
    ("tiny-llama", "tp=1,pp=2,dp=1", "tp=1,pp=1,dp=1", {0}, True),  # a whole stage
    ("tiny-llama", "tp=1,pp=2,dp=2", "tp=1,pp=1,dp=2", {1}, False),  # the stage's replica (dp=2)
    ("tiny-llama", "tp=1,pp=2,dp=2", "tp=1,pp=2,dp=1", {2, 3}, True),  # both replicas of stage 1 (pp outermost)
    ("tiny-llama", "tp=1,pp=1,dp=2,dist_opt", "tp=1,pp=1,dp=1", {1}, True),  # its optimizer shard
    ("tiny-llama", "tp=1,pp=1,dp=2", "tp=1,pp=1,dp=1", {1}, False),  # a plain replica
    ("tiny-moe", "tp=1,pp=1,dp=4,ep=4", "tp=1,pp=1,dp=2,ep=2", {2}, True),  # its experts had one holder
    ("tiny-moe", "tp=1,pp=1,dp=4,ep=2", "tp=1,pp=1,dp=2,ep=2", {2}, False),  # ep=2: a replica of its experts
    ("tiny-llama", "tp=1,pp=1,dp=2", "tp=1,pp=1,dp=1", {0, 1}, True),  # every old device (a joiner is left)
]


@pytest.mark.parametrize(("model", "old", "new", "dead", "lost"), CASES,
                         ids=[f"{m}:{o}->{n}:dead={sorted(d)}" for m, o, n, d, _ in CASES])
def test_the_holder_check_answers_as_the_whole_plan(model, old, new, dead, lost):
    spec, a, b = PRESETS[model], P(old), P(new)
    join = 1 if len(dead) == a.world_size else 0  # a joiner to run the new world
    devices = DeviceMap(a.world_size, 8, frozenset(), join, frozenset(dead))
    whole = whole_plan_says(spec, a, b, devices)
    assert (whole is not None) == lost
    ours = check_says(spec, a, b, devices)
    assert (ours is not None) == lost, ours
    if lost:
        assert "held only by dead devices" in ours or "every old device" in ours


@pytest.mark.long
def test_every_single_and_pair_of_dead_devices_on_small_worlds():
    """Every config of up to 4 ranks of tiny-moe and tiny-llama, to a 1-rank or 2-rank world,
    with every one and every two of its devices dead (the others leaving or staying)."""
    checked = lost = 0
    for model in ("tiny-llama", "tiny-moe"):
        spec = SPECS[model]
        for old in candidate_configs(model, 4):
            a = P(old)
            for new in ("tp=1,pp=1,dp=1", "tp=1,pp=2,dp=1"):
                b = P(new)
                try:
                    b.validate(spec)
                except Exception:
                    continue
                n = a.world_size
                for k in (1, 2):
                    for dead in itertools.combinations(range(n), k):
                        if n - k < b.world_size:
                            continue
                        devices = DeviceMap(n, 2, frozenset(), 0, frozenset(dead))
                        whole = whole_plan_says(spec, a, b, devices)
                        ours = check_says(spec, a, b, devices)
                        assert (ours is None) == (whole is None), (model, old, new, dead, whole, ours)
                        checked += 1
                        lost += whole is not None
    assert checked > 100 and 0 < lost < checked  # both answers were exercised


@given(st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_transitions_with_dead_devices(data):
    model = data.draw(st.sampled_from(sorted(SPECS)))
    old = P(data.draw(st.sampled_from(candidate_configs(model, 8))))
    n = old.world_size
    dead = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=n)))
    leave = frozenset(data.draw(st.sets(st.sampled_from(sorted(set(range(n)) - dead) or [0]), max_size=2))) - dead
    join = data.draw(st.integers(0, 2))
    left = n - len(dead) - len(leave) + join
    news = [c for c in candidate_configs(model, max(left, 1)) if P(c).world_size <= left]
    if not news:
        return
    new = P(data.draw(st.sampled_from(news)))
    devices = DeviceMap(n, 4, leave, join, dead)
    note(f"{model} {old} -> {new} {devices.describe()}")
    whole = whole_plan_says(SPECS[model], old, new, devices)
    ours = check_says(SPECS[model], old, new, devices)
    assert (ours is None) == (whole is None), (whole, ours)


def test_the_check_plans_no_copy(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the whole plan was computed")

    monkeypatch.setattr(transition_mod, "_copies_and_demands", forbidden)
    monkeypatch.setattr(transition_mod, "_intersect", forbidden)
    spec, a, b = PRESETS["tiny-llama"], P("tp=2,pp=1,dp=2"), P("tp=2,pp=1,dp=1")
    assert lost_state(spec, a, b, DeviceMap(4, 8, dead=frozenset({1})), (0, 2)) is None
    assert lost_state(spec, a, b, DeviceMap(4, 8, dead=frozenset({1, 3})), (0, 2)) is not None
