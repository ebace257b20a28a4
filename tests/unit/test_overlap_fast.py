"""The operator's overlap figures from stage templates (``vps.overlap``) equal, figure for figure,
the figures from intersecting every box of the two layouts (``transition.box_overlap_figures``):
the overlap by holder class, the classes and the rank order they give."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from liveshard.dev.reshard.cases import CASES, SPECS, transition_case
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps import overlap as overlap_mod
from liveshard.runtime.vps.devices import DeviceMap
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.transition import box_overlap_figures, overlap_figures, state_groups

P = ParallelConfig.parse
UNTIED = {name: replace(spec, share_embeddings_and_output_weights=False, name=f"{name}-untied")
          for name, spec in SPECS.items()}


def assert_same_figures(spec, old, new, devices) -> str:
    fast = overlap_figures(spec, old, new, devices)
    oracle = box_overlap_figures(spec, old, new, devices)
    assert fast.overlap == oracle.overlap
    assert fast.new_classes == oracle.new_classes and fast.old_classes == oracle.old_classes
    assert fast.best_order == oracle.best_order
    assert fast.kept_bytes(fast.best_order) == oracle.kept_bytes(oracle.best_order)
    o, n = Layout(spec, old), Layout(spec, new)
    groups = state_groups(o, n)
    if overlap_mod.class_overlap(o, n, groups) is None:
        return "boxes of the whole layouts"
    return {overlap_mod.ALL: "flat ranges", frozenset(): "template boxes"}.get(overlap_mod.alike(o, n), "both")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_named_cases(case, tied):
    spec = case.spec if tied else UNTIED[case.model]
    assert_same_figures(spec, P(case.old), P(case.new), case.devices())


def test_every_path_is_taken():
    paths = set()
    for old, new in [("tp=2,pp=2,dp=2,dist_opt", "tp=2,pp=1,dp=3,dist_opt"),  # same split: flat ranges
                     ("tp=2,pp=2,dp=2,dist_opt", "tp=1,pp=4,dp=1,dist_opt"),  # TP changes: template boxes
                     ("tp=2,pp=2,dp=2,dist_opt", "tp=2,pp=2,dp=1")]:  # the optimizer geometry changes
        paths.add(assert_same_figures(UNTIED["tiny-llama"], P(old), P(new), DeviceMap(8, 4, frozenset({7}), 0)))
    for old, new in [("tp=1,pp=2,dp=4,ep=2,dist_opt", "tp=1,pp=1,dp=6,ep=2,dist_opt"),
                     ("tp=1,pp=2,dp=4,ep=2,dist_opt", "tp=1,pp=1,dp=4,ep=4,etp=1,dist_opt"),
                     # TP changes, the experts' split does not: flat ranges for experts, boxes for the rest
                     ("tp=1,pp=2,dp=4,ep=2,etp=1,dist_opt", "tp=2,pp=1,dp=3,ep=2,etp=1,dist_opt")]:
        paths.add(assert_same_figures(UNTIED["tiny-moe"], P(old), P(new), DeviceMap(8, 4, frozenset({6, 7}), 0)))
    assert paths == {"flat ranges", "template boxes", "both", "boxes of the whole layouts"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans())
def test_random_transitions(data, tied):
    case = transition_case(data.draw)
    note(repr(case))
    spec = case.spec if tied else UNTIED[case.model]
    assert_same_figures(spec, P(case.old), P(case.new), case.devices())


@pytest.mark.parametrize(("model", "old", "new"), [
    ("llama3-70b", "tp=8,pp=2,dp=4,dist_opt", "tp=4,pp=2,dp=7,dist_opt"),
    ("qwen3-235b-a22b", "tp=4,pp=2,dp=8,ep=8,etp=1,dist_opt", "tp=2,pp=3,dp=8,ep=8,etp=1,layers=31+31+32,dist_opt"),
])
def test_real_models_at_a_small_scale(model, old, new):
    o, n = P(old), P(new)
    leaving = frozenset(range(o.world_size - (o.world_size - n.world_size), o.world_size))
    assert_same_figures(PRESETS[model], o, n, DeviceMap(o.world_size, 8, leaving, 0))
