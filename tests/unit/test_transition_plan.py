"""The pure transition planner: every needed element arrives exactly once, from a device that
really holds it; plans are deterministic, cacheable and checksummed; device mapping, bounds and
schedules behave as documented. (Real transfers: tests/test_reshard_exec.py.)"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from liveshard.dev.cli import run_cli
from liveshard.dev.reshard.cases import CASES, transition_case
from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps import transition as transition_mod
from liveshard.runtime.vps.bound import modeled_seconds
from liveshard.runtime.vps.devices import DeviceMap, parse_devices
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import volume
from liveshard.runtime.vps.schedule import schedule, staging_bytes
from liveshard.runtime.vps.shards import is_flat, local_tensor_shapes
from liveshard.runtime.vps.transition import NoSurvivingCopy, plan_transition

P = ParallelConfig.parse


def np_view(arr: np.ndarray, view) -> np.ndarray:
    _, loff, lshape = view
    if not is_flat(loff, lshape) and len(lshape) == arr.ndim:
        return arr[tuple(slice(o, o + s) for o, s in zip(loff, lshape))]
    return arr.reshape(-1)[loff[0]:loff[0] + volume(lshape)].reshape(lshape)


def np_piece(arr, view, rel, shape):
    return np_view(arr, view)[tuple(slice(o, o + s) for o, s in zip(rel, shape))]


def check_plan(plan) -> None:
    """Coverage exactly once, sources hold the data, views match both layouts."""
    old, new = plan.old_layout, plan.new_layout
    devices = plan.devices
    # every new local tensor element is written exactly once
    counts = {}
    for r, d in enumerate(plan.rank_to_device):
        for state, per in local_tensor_shapes(new, r).items():
            for name, shape in per.items():
                counts[d, state, name] = np.zeros(shape, dtype=np.int32)
    old_regions = {}
    for d in range(devices.old_world):
        for reg in old.regions(d):
            old_regions.setdefault((d, reg.state, reg.local_name, reg.local_offset, reg.local_shape), reg)
    new_regions = {}
    for r, d in enumerate(plan.rank_to_device):
        for reg in new.regions(r):
            new_regions[(d, reg.state, reg.local_name, reg.local_offset, reg.local_shape)] = reg
    for c in plan.copies:
        g = plan.groups[c.group]
        assert devices.holds_old_state(c.src), c
        assert c.dst in plan.device_to_rank, c
        assert c.nbytes == volume(c.shape) * g.itemsum
        for state in g.states:
            np_piece(counts[c.dst, state, c.dst_view[0]], c.dst_view, c.dst_rel, c.shape)[...] += 1
            # the source region really holds this box of this key
            sreg = old_regions[(c.src, state, *c.src_view)]
            npre = len(sreg.global_shape) - len(sreg.local_shape)
            assert sreg.key == c.key
            assert sreg.global_offset[:npre] == c.offset[:npre]
            assert tuple(o + r for o, r in zip(sreg.global_offset[npre:], c.src_rel)) == c.offset[npre:]
            assert all(r + s <= e for r, s, e in zip(c.src_rel, c.shape, sreg.local_shape))
            dreg = new_regions[(c.dst, state, *c.dst_view)]
            assert dreg.key == c.key
            assert tuple(o + r for o, r in zip(dreg.global_offset[npre:], c.dst_rel)) == c.offset[npre:]
    for k, cnt in counts.items():
        assert cnt.min() == 1 and cnt.max() == 1, (k, int(cnt.min()), int(cnt.max()))
    # a device copies locally exactly what it already holds; it never receives what it holds
    for c in plan.copies:
        if c.src != c.dst and devices.holds_old_state(c.dst):
            for state in plan.groups[c.group].states:
                assert not _holds_box(old, c.dst, state, c.key, c.offset, c.shape), c


def _holds_box(layout: Layout, rank: int, state: str, key: str, offset, shape) -> bool:
    for reg in layout.regions(rank, (state,)):
        if reg.key != key:
            continue
        npre = len(reg.global_shape) - len(reg.local_shape)
        if reg.global_offset[:npre] != offset[:npre]:
            continue
        if all(ro <= o and o + s <= ro + rs for ro, rs, o, s in
               zip(reg.global_offset[npre:], reg.local_shape, offset[npre:], shape)):
            return True
    return False


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_named_cases_cover_every_element_once_from_real_holders(case):
    check_plan(case.plan())


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_transitions_cover_every_element_once(data):
    case = transition_case(data.draw, max_procs=12)
    note(repr(case))
    check_plan(case.plan())


def test_the_checker_catches_a_wrong_plan():
    plan = next(c for c in CASES if c.name == "tp-change").plan()
    check_plan(plan)
    i = next(i for i, c in enumerate(plan.copies) if c.src != c.dst)
    bad = copy.copy(plan)
    bad.copies = list(plan.copies)
    c = bad.copies[i]
    bad.copies[i] = c._replace(src_rel=(c.src_rel[0] + 1, *c.src_rel[1:]))
    with pytest.raises(AssertionError):
        check_plan(bad)
    bad.copies[i] = c._replace(dst=c.src)  # delivered to the wrong device: a hole and a double
    with pytest.raises((AssertionError, KeyError)):
        check_plan(bad)


def test_no_op_transition_keeps_everything_in_place():
    spec = PRESETS["tiny-moe"]
    cfg = P("tp=1,pp=2,dp=4,ep=2,dist_opt")
    plan = plan_transition(spec, cfg, cfg)
    assert plan.rank_to_device == tuple(range(8))
    assert plan.bytes_moved == 0 and plan.network_copies == []


def test_dp_shrink_without_distributed_optimizer_moves_nothing():
    spec = PRESETS["tiny-gpt"]
    plan = plan_transition(spec, P("tp=2,pp=2,dp=3"), P("tp=2,pp=2,dp=2"),
                           DeviceMap(12, 4, parse_devices("4-7")))
    assert plan.bytes_moved == 0
    assert not set(plan.rank_to_device) & set(range(4, 8))
    # TP groups stay together on one node
    for r in range(0, plan.new_cfg.world_size, 2):
        a, b = plan.rank_to_device[r], plan.rank_to_device[r + 1]
        assert plan.devices.node(a) == plan.devices.node(b)


def test_leaving_devices_serve_but_dead_ones_do_not():
    spec = PRESETS["tiny-gpt"]
    old, new = P("tp=1,pp=1,dp=4,dist_opt"), P("tp=1,pp=1,dp=3,dist_opt")
    leave = plan_transition(spec, old, new, DeviceMap(4, 1, frozenset({3})))
    assert 3 not in leave.rank_to_device
    assert any(c.src == 3 for c in leave.copies)  # its optimizer shard exists nowhere else
    check_plan(leave)
    with pytest.raises(NoSurvivingCopy, match="dead"):
        plan_transition(spec, old, new, DeviceMap(4, 1, dead=frozenset({3})))
    # without the distributed optimizer a DP replica survives the loss
    dead = plan_transition(spec, P("tp=1,pp=1,dp=4"), P("tp=2,pp=1,dp=1"), DeviceMap(4, 1, dead=frozenset({0, 3})))
    assert all(c.src in (1, 2) for c in dead.copies)
    check_plan(dead)


def test_joiners_serve_only_when_needed_and_get_everything_over_the_network():
    spec = PRESETS["tiny-llama"]
    plan = plan_transition(spec, P("tp=2,pp=1,dp=1"), P("tp=2,pp=1,dp=2"), DeviceMap(2, 2, joining=4))
    assert plan.rank_to_device[:2] == (0, 1)
    assert set(plan.rank_to_device[2:]) == {2, 3}  # the first joiners, on one new node
    assert plan.standbys == (4, 5)
    for d in (2, 3):
        need = sum(c.nbytes for c in plan.copies if c.dst == d)
        assert need == plan.lower_bound["must_receive"][d] > 0
    assert plan.devices.node(2) == plan.devices.node(3) == 1


def test_plan_is_cached_and_checksum_is_stable_across_processes():
    spec, a, b = PRESETS["tiny-qwen-moe"], P("tp=2,pp=2,dp=2,ep=2,dist_opt"), P("tp=1,pp=4,dp=2,ep=2")
    dm = DeviceMap(8, 4, parse_devices("6,7"), 2)
    p1 = plan_transition(spec, a, b, dm)
    assert plan_transition(spec, a, b, dm) is p1  # cache hit
    transition_mod.cached_plan.cache_clear()
    p2 = plan_transition(spec, a, b, dm)
    assert p2 is not p1 and p2.checksum == p1.checksum and p2.copies == p1.copies
    code = ("from liveshard.runtime.vps.transition import plan_transition;"
            "from liveshard.runtime.vps.devices import DeviceMap;"
            "from liveshard.runtime.presets import PRESETS;"
            "from liveshard.runtime.parallel import ParallelConfig; P = ParallelConfig.parse;"
            "print(plan_transition(PRESETS['tiny-qwen-moe'], P('tp=2,pp=2,dp=2,ep=2,dist_opt'), P('tp=1,pp=4,dp=2,ep=2'),"
            " DeviceMap(8, 4, frozenset({6, 7}), 2)).checksum)")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == p1.checksum
    # a different device map is a different plan
    other = plan_transition(spec, a, b, DeviceMap(8, 4, parse_devices("4,5"), 2))
    assert other.checksum != p1.checksum


@pytest.mark.parametrize(("old", "new", "leave", "join"), [
    ("tp=8,pp=2,dp=4", "tp=4,pp=4,dp=4", "", 0),
    ("tp=8,pp=2,dp=4,dist_opt", "tp=8,pp=2,dp=3,dist_opt", "24-31", 0),
    ("tp=8,pp=2,dp=3,dist_opt", "tp=8,pp=2,dp=4,dist_opt", "", 16),
    ("tp=8,pp=2,dp=4,dist_opt", "tp=8,pp=4,dp=2,dist_opt", "", 0),
    ("tp=4,pp=4,dp=4,dist_opt", "tp=8,pp=2,dp=4,dist_opt", "", 0),
    ("tp=8,pp=2,dp=4,dist_opt", "tp=4,pp=3,dp=5,layers=11+11+10,dist_opt", "4-7", 0),
])
def test_balance_reaches_the_lower_bound_on_llama3_8b(old, new, leave, join):
    spec = PRESETS["llama3-8b"]
    plan = plan_transition(spec, P(old), P(new), DeviceMap(P(old).world_size, 8, parse_devices(leave), join))
    lb = plan.lower_bound["lower_bound_bytes"]
    assert plan.bottleneck_bytes >= lb
    assert plan.bottleneck_bytes <= 1.05 * lb
    # the lower bound on receiving is exactly what each device needs and does not hold
    recv = [0] * plan.devices.num_devices
    for c in plan.network_copies:
        recv[c.dst] += c.nbytes
    assert recv == plan.lower_bound["must_receive"]


@pytest.mark.parametrize("budget", [96, 1000, 4096, 1 << 20])
def test_schedule_respects_the_budget_and_covers_every_copy(budget):
    spec = PRESETS["tiny-qwen-moe"]
    spec = spec.__class__(**{**spec.to_dict(), "params_dtype": "bf16"})
    plan = plan_transition(spec, P("tp=2,pp=2,dp=2,ep=2,dist_opt"), P("tp=1,pp=3,dp=2,ep=2,layers=1+2+1"),
                           DeviceMap(8, 4, parse_devices("5"), 0))
    sched = schedule(plan, budget)
    per = {}
    covered = {}
    for ch in sched.chunks:
        c = plan.copies[ch.copy]
        g = plan.groups[c.group]
        assert ch.staging == staging_bytes(volume(ch.shape), g.itemsizes)
        for dev in (c.src, c.dst):
            per[dev, ch.round] = per.get((dev, ch.round), 0) + ch.staging
        covered[ch.copy] = covered.get(ch.copy, 0) + volume(ch.shape)
        assert all(o + s <= e for o, s, e in zip(ch.offset, ch.shape, c.shape))
    assert max(per.values()) <= budget
    assert max(per.values()) == sched.peak_staging_bytes
    assert covered == {i: volume(c.shape) for i, c in enumerate(plan.copies) if c.src != c.dst}
    for ch in sched.chunks:  # a source tensor is not freed before its last read
        c = plan.copies[ch.copy]
        assert sched.last_read[c.src, c.group, c.src_view[0]] >= ch.round
    model = modeled_seconds(plan, sched)
    assert model["modeled_seconds"] >= model["modeled_unrounded_seconds"] > 0


def test_budget_too_small_is_a_clear_error():
    plan = plan_transition(PRESETS["tiny-gpt"], P("tp=2,pp=1,dp=1"), P("tp=1,pp=1,dp=2"))
    with pytest.raises(ConfigError, match=r"^budget: "):
        schedule(plan, 8)


def test_parse_devices():
    assert parse_devices("1,3,5,7") == {1, 3, 5, 7}
    assert parse_devices("248-255") == set(range(248, 256))
    assert parse_devices("0, 8-10") == {0, 8, 9, 10}
    assert parse_devices("") == frozenset()
    for bad in ("a", "5-3", "-1"):
        with pytest.raises(ConfigError, match=r"^devices: "):
            parse_devices(bad)


def test_device_map_checks():
    with pytest.raises(ConfigError, match=r"^leaving: "):
        DeviceMap(8, 8, frozenset({8}))
    dm = DeviceMap(12, 8, frozenset({0}), joining=3)
    assert [dm.node(d) for d in (0, 7, 8, 11, 12, 14)] == [0, 0, 1, 1, 2, 2]  # joiners on a new node
    with pytest.raises(ConfigError, match=r"^new config: "):
        dm.check_fits(15)


def test_cli_names_the_flag_behind_a_planner_error():
    out = run_cli("plan-transition", "--model", "tiny-gpt", "--from-parallel", "tp=1,pp=1,dp=2", "--to-parallel", "tp=1,pp=1,dp=2",
               "--leave", "5")
    assert out.returncode == 2 and "--leave: device 5 is not an old device" in out.stderr, out.stderr
    out = run_cli("plan-transition", "--model", "tiny-gpt", "--from-parallel", "tp=2,pp=1,dp=1", "--to-parallel", "tp=1,pp=1,dp=1",
               "--dead", "1")
    assert out.returncode == 2 and "--dead: " in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_cli_plan_transition_json_fields():
    out = run_cli("plan-transition", "--model", "tiny-moe", "--from-parallel", "tp=1,pp=2,dp=4,ep=2,dist_opt",
               "--to-parallel", "tp=2,pp=1,dp=3,ep=2,etp=1", "--leave", "6,7", "--join", "1", "--gpus-per-node", "4",
               "--budget", "64KiB", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    for field in ("plan_seconds", "transfers", "bytes_moved", "bottleneck_bytes", "lower_bound_bytes", "rounds",
                  "peak_staging_bytes", "modeled_seconds", "rank_to_device", "checksum"):
        assert field in r
    assert r["peak_staging_bytes"] <= 64 * 1024
    assert len(r["rank_to_device"]) == 6 and not {6, 7} & set(r["rank_to_device"])
    assert r["bottleneck_bytes"] >= r["lower_bound_bytes"] > 0
    text = run_cli("plan-transition", "--model", "tiny-moe", "--from-parallel", "tp=1,pp=2,dp=4,ep=2,dist_opt",
                "--to-parallel", "tp=2,pp=1,dp=3,ep=2,etp=1", "--leave", "6,7", "--join", "1", "--gpus-per-node", "4")
    assert text.returncode == 0 and "lower bound" in text.stdout and r["checksum"][:16] in text.stdout


@pytest.mark.parametrize(("args", "field"), [
    (("--leave", "3-1"), "--leave"),
    (("--leave", "99"), "--leave"),
    (("--join", "-1"), "--join"),
    (("--budget", "lots"), "--budget"),
    (("--budget", "4"), "--budget"),
])
def test_cli_plan_transition_bad_input_is_one_line(args, field):
    out = run_cli("plan-transition", "--model", "tiny-gpt", "--from-parallel", "tp=2,pp=1,dp=2", "--to-parallel", "tp=1,pp=1,dp=4", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], out.stderr


def test_cli_new_world_too_big():
    out = run_cli("plan-transition", "--model", "tiny-gpt", "--from-parallel", "tp=2,pp=1,dp=2", "--to-parallel", "tp=2,pp=1,dp=2",
               "--leave", "0")
    assert out.returncode == 2 and "--to" in out.stderr and "--join" in out.stderr


def test_plans_at_scale_stay_exact_in_bytes():
    """llama3-70b on 1024 GPUs: totals add up (speed is measured in bench/, not here)."""
    spec = PRESETS["llama3-70b"]
    old, new = P("tp=8,pp=8,dp=16,dist_opt"), P("tp=8,pp=8,dp=15,dist_opt")
    plan = plan_transition(spec, old, new, DeviceMap(1024, 8, parse_devices("512-519")))
    new_layout = Layout(spec, new)
    held = sum(new_layout.rank_bytes(r) for r in range(0, new.world_size, 97))
    got = sum(c.nbytes for c in plan.copies if plan.device_to_rank[c.dst] % 97 == 0)
    assert got == held
    assert not set(plan.rank_to_device) & set(range(512, 520))
    assert plan.bottleneck_bytes <= 1.05 * plan.lower_bound["lower_bound_bytes"]


def test_planning_imports_neither_torch_nor_kopf():
    code = ("import sys; import liveshard.runtime.vps.transition, liveshard.runtime.vps.schedule, "
            "liveshard.runtime.vps.bound, liveshard.runtime.commands.plan_transition; "
            "print(sorted(m for m in ('torch', 'kopf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
