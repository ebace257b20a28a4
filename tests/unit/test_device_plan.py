"""Per-device transition plans: every device's own plan (``vps.device_plan``) is exactly its slice
of the whole plan (``vps.transition``): the same copies, small objects, chunks, rounds and frees,
and the same load bounds the rounds are sized with; and the inputs digest devices compare
changes with every input. (Speed at scale: bench/bench_transition_planning.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from liveshard.dev.cli import run_cli
from liveshard.dev.reshard.cases import CASES, SPECS, Case, transition_case
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps import device_plan as dp_mod
from liveshard.runtime.vps.device_plan import inputs_digest, plan_device, planner
from liveshard.runtime.vps.devices import DeviceMap, parse_devices
from liveshard.runtime.vps.schedule import pairwise, schedule
from liveshard.runtime.vps.transition import NoSurvivingCopy, plan_transition, rank_order

P = ParallelConfig.parse


def assert_slices_equal(spec, old, new, devices: DeviceMap, budget: int, every: int = 1) -> None:
    """Each device's plan and schedule (every ``every``-th device, and all leaving ones) equal
    its part of the whole plan's."""
    whole = plan_transition(spec, old, new, devices)
    sched = schedule(whole, budget)
    pl = planner(spec, old, new, devices, whole.rank_to_device)
    for d in range(devices.num_devices):
        assert pl.bound(d) == whole.device_bound(d), f"device {d}: load bound"
    for d in sorted(set(range(0, devices.num_devices, every)) | devices.leaving):
        mine = plan_device(spec, old, new, devices, whole.rank_to_device, d)
        assert sorted(mine.copies) == sorted(c for c in whole.copies if d in (c.src, c.dst)), f"device {d}: copies"
        assert sorted(mine.objects) == sorted(m for m in whole.objects if d in (m.src, m.dst)), f"device {d}: objects"
        own = schedule(mine, budget)
        assert _chunks(mine, own) == _chunks(whole, sched, d), f"device {d}: chunks and rounds"
        assert own.last_read == {k: r for k, r in sched.last_read.items() if k[0] == d}, f"device {d}: frees"
        assert own.peak_staging[d] <= budget


def _chunks(plan, sched, device: int | None = None) -> list:
    return sorted((plan.copies[ch.copy], ch.offset, ch.shape, ch.nbytes, ch.staging, ch.round)
                  for ch in sched.chunks
                  if device is None or device in (plan.copies[ch.copy].src, plan.copies[ch.copy].dst))


def test_the_locator_finds_every_box_of_the_whole_geometry_with_all_its_holders():
    from liveshard.runtime.vps.boxes import DOPT_GEOMETRY, PARAM_GEOMETRY, build_geometry
    from liveshard.runtime.vps.layout import Layout
    from liveshard.runtime.vps.locate import Side

    configs = {(c.model, c.old) for c in CASES} | {(c.model, c.new) for c in CASES}
    configs |= {("tiny-moe", "tp=2,pp=1,dp=2,ep=2,etp=1,dist_opt"), ("tiny-moe", "tp=1,pp=2,dp=2,ep=2,dist_opt")}
    checked = 0
    for model, text in sorted(configs):
        layout = Layout(SPECS[model], P(text))
        for geometry in (PARAM_GEOMETRY, DOPT_GEOMETRY) if layout.cfg.dist_opt else (PARAM_GEOMETRY,):
            whole, side = build_geometry(layout, geometry), Side(layout, geometry)
            by_holders: dict[tuple, set] = {}
            for key, boxes in whole.boxes.items():
                for (off, shape), box in boxes.items():
                    found = [b for b in side.overlapping(key, off, shape) if (b.offset, b.shape) == (off, shape)]
                    assert len(found) == 1 and found[0].views() == box.views(), (text, geometry, key, off)
                    by_holders.setdefault(tuple(sorted(box.views())), set()).add((key, off, shape))
                    checked += 1
            for holders, want in by_holders.items():
                assert {(b.key, b.offset, b.shape) for b in side.holder_boxes(holders)} == want, (text, holders)
            for r in range(layout.world_size):
                mine = {(k, o, s, v) for k, o, s, _, v, _ in side.rank_pieces(r)}
                regions = (layout.dist_opt_regions(r, layout.optimizer_states[0]) if geometry == DOPT_GEOMETRY
                           else layout.param_regions(r))
                assert mine == {(g.key, g.global_offset, g.box_shape, (g.local_name, g.local_offset, g.local_shape))
                                for g in regions}, (text, geometry, r)
    assert checked > 1000


EXTRA = [
    # lost without notice: a dead device's replicas serve, its own optimizer shard is gone
    Case("dead-replica", "tiny-llama", "tp=1,pp=2,dp=3", "tp=2,pp=1,dp=2", gpus_per_node=2),
    # budgets too small for pairwise rounds: the whole plan's greedy rounds, sliced
    Case("tiny-budget", "tiny-llama-bf16", "tp=2,pp=1,dp=2,dist_opt", "tp=1,pp=2,dp=2,dist_opt", leave="1",
         join=1, budget=700),
    Case("tied-embeddings-pp-to-one-stage", "tiny-gpt", "tp=1,pp=2,dp=3,layers=1+3", "tp=1,pp=1,dp=1",
         gpus_per_node=1, budget=2048),
]


@pytest.mark.parametrize("case", CASES + EXTRA, ids=[c.name for c in CASES + EXTRA])
def test_every_device_plan_is_its_slice_of_the_whole_plan(case):
    devices = case.devices()
    if case.name == "dead-replica":
        devices = replace(devices, dead=frozenset({4}))
    assert_slices_equal(case.spec, P(case.old), P(case.new), devices, case.budget)


def test_the_tiny_budget_case_takes_the_greedy_rounds_and_the_others_pairwise_ones():
    case = EXTRA[1]
    groups = plan_transition(case.spec, P(case.old), P(case.new), case.devices()).groups
    assert not pairwise(case.devices().num_devices, groups, case.budget)
    assert pairwise(case.devices().num_devices, groups, 1 << 16)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_transitions_plan_per_device_exactly(data):
    case = transition_case(data.draw, max_procs=10)
    devices = case.devices()
    spare = [d for d in range(devices.old_world) if d not in devices.leaving]
    if data.draw(st.booleans()) and len(spare) > 1:
        devices = replace(devices, dead=frozenset({data.draw(st.sampled_from(spare))}))
    if len(devices.available) < P(case.new).world_size:
        return
    note(repr((case, devices)))
    with contextlib.suppress(NoSurvivingCopy):
        assert_slices_equal(case.spec, P(case.old), P(case.new), devices, case.budget)


# Presets at modest scale: node loss, TP, EP and PP changes (uneven layers), dense and MoE.
SCALE = [
    ("llama3-8b", "tp=8,pp=2,dp=4,dist_opt", "tp=8,pp=2,dp=3,dist_opt", "24-31", 0, 3),
    ("llama3-8b", "tp=8,pp=2,dp=4,dist_opt", "tp=4,pp=3,dp=2,layers=11+11+10,dist_opt", "", 0, 3),
    ("qwen3-30b-a3b", "tp=2,pp=2,dp=4,ep=4,etp=1,dist_opt", "tp=2,pp=2,dp=4,ep=8,etp=1,dist_opt", "", 0, 5),
    ("qwen3-30b-a3b", "tp=2,pp=2,dp=4,ep=8,etp=1,dist_opt", "tp=2,pp=2,dp=3,ep=2,etp=1,layers=25+23,dist_opt",
     "14,15", 0, 7),
]


@pytest.mark.parametrize(("model", "old", "new", "leave", "join", "every"), SCALE,
                         ids=[f"{m}:{o}->{n}" for m, o, n, _, _, _ in SCALE])
def test_presets_at_scale_plan_per_device_exactly(model, old, new, leave, join, every):
    devices = DeviceMap(P(old).world_size, 8, parse_devices(leave), join)
    assert_slices_equal(PRESETS[model], P(old), P(new), devices, 1 << 30, every)


def test_a_device_plan_needs_neither_the_whole_plan_nor_the_whole_layouts(monkeypatch):
    """Given the rank order, one device's plan builds no global geometry and plans no other device."""
    from liveshard.runtime.vps import boxes, transition

    spec, old, new = PRESETS["llama3-8b"], P("tp=8,pp=2,dp=4,dist_opt"), P("tp=4,pp=3,dp=2,layers=11+11+10,dist_opt")
    devices = DeviceMap(64, 8, parse_devices("40-47"))
    order = rank_order(spec, old, new, devices)

    def forbidden(*a, **k):
        raise AssertionError("the whole layout was built")

    monkeypatch.setattr(boxes, "build_geometry", forbidden)
    monkeypatch.setattr(transition, "build_geometry", forbidden)
    monkeypatch.setattr(transition, "_copies_and_demands", forbidden)
    planner.cache_clear()
    mine = plan_device(spec, old, new, devices, order, 5)
    assert mine.copies and all(5 in (c.src, c.dst) for c in mine.copies)
    assert any(c.src != c.dst for c in mine.copies)
    assert schedule(mine, 1 << 30).chunks
    assert mine.plan_seconds > 0


def test_inputs_digest_changes_with_every_input_and_nothing_else():
    spec, old, new = SPECS["tiny-moe"], P("tp=1,pp=2,dp=4,ep=2,dist_opt"), P("tp=2,pp=1,dp=3,ep=2,etp=1")
    devices = DeviceMap(8, 4, parse_devices("6,7"), 1)
    order = rank_order(spec, old, new, devices)
    base = inputs_digest(spec, old, new, devices, order)
    assert inputs_digest(spec, P(str(old)), P(str(new)), DeviceMap(8, 4, parse_devices("6,7"), 1), tuple(order)) == base
    assert plan_device(spec, old, new, devices, order, 0).digest == base
    other = {
        "old config": inputs_digest(spec, P("tp=1,pp=2,dp=4,ep=4,dist_opt"), new, devices, order),
        "new config": inputs_digest(spec, old, P("tp=2,pp=1,dp=3,ep=2,etp=1,dist_opt"), devices, order),
        "dtype": inputs_digest(replace(spec, params_dtype="bf16"), old, new, devices, order),
        "model": inputs_digest(replace(spec, ffn_hidden_size=spec.ffn_hidden_size * 2), old, new, devices, order),
        "leaving": inputs_digest(spec, old, new, DeviceMap(8, 4, parse_devices("5,7"), 1), order),
        "dead": inputs_digest(spec, old, new, DeviceMap(8, 4, parse_devices("6"), 1, frozenset({7})), order),
        "joining": inputs_digest(spec, old, new, DeviceMap(8, 4, parse_devices("6,7"), 2), order),
        "gpus per node": inputs_digest(spec, old, new, DeviceMap(8, 2, parse_devices("6,7"), 1), order),
        "rank order": inputs_digest(spec, old, new, devices, (*order[1:], order[0])),
    }
    for what, digest in other.items():
        assert digest != base, what
    assert len(set(other.values())) == len(other)
    real = dp_mod.PLANNER_VERSION
    try:
        dp_mod.PLANNER_VERSION = real + "-other"
        assert inputs_digest(spec, old, new, devices, order) != base
    finally:
        dp_mod.PLANNER_VERSION = real
    code = ("from liveshard.runtime.vps.device_plan import inputs_digest;"
            "from liveshard.runtime.vps.devices import DeviceMap, parse_devices;"
            "from liveshard.dev.reshard.cases import SPECS;"
            "from liveshard.runtime.parallel import ParallelConfig; P = ParallelConfig.parse;"
            "print(inputs_digest(SPECS['tiny-moe'], P('tp=1,pp=2,dp=4,ep=2,dist_opt'), P('tp=2,pp=1,dp=3,ep=2,etp=1'),"
            f" DeviceMap(8, 4, parse_devices('6,7'), 1), {tuple(order)!r}))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == base


def test_cli_device_prints_exactly_its_slice_of_the_whole_plan():
    args = ("plan-transition", "--model", "tiny-moe", "--from-parallel", "tp=1,pp=2,dp=4,ep=2,dist_opt",
            "--to-parallel", "tp=2,pp=1,dp=3,ep=2,etp=1", "--leave", "6,7", "--join", "1", "--gpus-per-node", "4",
            "--budget", "64KiB")
    spec, old, new = SPECS["tiny-moe"], P("tp=1,pp=2,dp=4,ep=2,dist_opt"), P("tp=2,pp=1,dp=3,ep=2,etp=1")
    devices = DeviceMap(8, 4, parse_devices("6,7"), 1)
    whole = plan_transition(spec, old, new, devices)
    sched = schedule(whole, 64 * 1024)
    checked = 0
    for d in (0, 3, 6, 8):
        out = run_cli(*args, "--device", str(d), "--json")
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["device"] == d and r["plan_seconds"] > 0 and r["rank_to_device"] == list(whole.rank_to_device)
        chunks = {}
        for ch in sched.chunks:
            chunks.setdefault(ch.copy, []).append((ch.round, tuple(ch.offset), tuple(ch.shape), ch.nbytes))
        for side, end, peer in (("sends", "src", "dst"), ("receives", "dst", "src")):
            want = sorted((getattr(c, peer), c.key, c.offset, c.shape, c.nbytes, tuple(sorted(chunks[i])))
                          for i, c in enumerate(whole.copies) if getattr(c, end) == d != getattr(c, peer))
            got = sorted((s["peer"], s["key"], tuple(s["offset"]), tuple(s["shape"]), s["bytes"],
                          tuple(sorted((k["round"], tuple(k["offset"]), tuple(k["shape"]), k["bytes"])
                                       for k in s["chunks"]))) for s in r[side])
            assert got == want, (d, side)
            checked += len(got)
        rounds = {ch.round for ch in sched.chunks if d in (whole.copies[ch.copy].src, whole.copies[ch.copy].dst)}
        assert r["rounds"] == (max(rounds) + 1 if rounds else 0)
    assert checked > 0
    order = ",".join(map(str, whole.rank_to_device))
    given_order = json.loads(run_cli(*args, "--device", "0", "--rank-to-device", order, "--json").stdout)
    assert given_order["mapping_seconds"] == 0.0 and given_order["inputs_digest"] == r["inputs_digest"]
    text = run_cli(*args, "--device", "0")
    assert text.returncode == 0 and "device 0 (new rank" in text.stdout and r["inputs_digest"][:16] in text.stdout
    bad = run_cli(*args, "--device", "0", "--rank-to-device", "0,0,1,2,3,4")
    assert bad.returncode == 2 and "--rank-to-device" in bad.stderr
    assert run_cli(*args, "--device", "99").returncode == 2


def test_per_device_planning_imports_no_torch():
    code = ("import sys; import liveshard.runtime.vps.device_plan, liveshard.runtime.vps.locate, "
            "liveshard.runtime.vps.sources, liveshard.runtime.commands.plan_transition; "
            "print(sorted(m for m in ('torch', 'kopf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_both_plans_implement_one_view_and_a_device_plan_is_not_a_whole_plan():
    from liveshard.runtime.vps.device_plan import DevicePlan
    from liveshard.runtime.vps.plan_view import TransitionPlanView
    from liveshard.runtime.vps.transition import TransitionPlan

    spec, old, new = SPECS["tiny-moe"], P("tp=1,pp=2,dp=4,ep=2,dist_opt"), P("tp=2,pp=1,dp=3,ep=2,etp=1")
    devices = DeviceMap(8, 4, parse_devices("6,7"), 1)
    whole = plan_transition(spec, old, new, devices)
    mine = plan_device(spec, old, new, devices, whole.rank_to_device, 2)
    assert isinstance(whole, TransitionPlanView) and isinstance(mine, TransitionPlanView)
    assert not isinstance(mine, TransitionPlan) and not issubclass(DevicePlan, TransitionPlan)
    members = [m for m in dir(TransitionPlanView) if not m.startswith("_")]
    members += list(TransitionPlanView.__annotations__)
    for m in members:
        assert hasattr(whole, m) and hasattr(mine, m), m
    # each name means one thing: the digest is the inputs digest on both, the checksum the whole plan's own
    assert mine.digest == whole.digest == inputs_digest(spec, old, new, devices, whole.rank_to_device)
    assert whole.checksum != whole.digest and not hasattr(mine, "checksum")
    assert whole.device is None and mine.device == 2
    assert all(mine.device_bound(d) == whole.device_bound(d) for d in range(devices.num_devices))
    assert mine.device_to_rank == whole.device_to_rank and mine.standbys == whole.standbys
