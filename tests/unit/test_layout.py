"""The pure layout: every element of every logical tensor has exactly one primary holder, replicas
agree with their primaries, distributed-optimizer shards partition each bucket, and the CLI
prints it. (Equality with live megatron models is tests/test_live_layout.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import PRESETS
from liveshard.runtime.vps.layout import Layout
from liveshard.runtime.vps.region import PARAM, flat_range_to_boxes, intersect, volume

CONFIGS = [
    ("tiny-gpt", "tp=1,pp=1,dp=1"),
    ("tiny-gpt", "tp=2,pp=2,dp=2"),
    ("tiny-gpt", "tp=2,pp=2,dp=2,dist_opt"),
    ("tiny-gpt", "tp=4,pp=1,dp=3,dist_opt,bucket=3000"),
    ("tiny-llama", "tp=2,pp=2,dp=1,layers=1+3"),
    ("tiny-llama", "tp=1,pp=4,dp=2,dist_opt"),
    ("tiny-llama", "tp=2,pp=1,dp=3,cp=2,dist_opt"),
    ("tiny-moe", "tp=1,pp=2,dp=4,ep=2,dist_opt"),
    ("tiny-moe", "tp=2,pp=1,dp=4,ep=4,etp=1,dist_opt"),
    ("tiny-qwen-moe", "tp=2,pp=2,dp=2,ep=2,dist_opt,bucket=5000"),
]


def _counts(layout: Layout, primary_only: bool):
    counts: dict[tuple[str, str], np.ndarray] = {}
    shapes = layout.logical_tensors()
    for (key, state), shape in shapes.items():
        counts[key, state] = np.zeros(shape, dtype=np.int32)
    for reg in layout.all_regions():
        if primary_only and not reg.primary:
            continue
        sl = tuple(slice(o, o + s) for o, s in zip(reg.global_offset, reg.box_shape))
        counts[reg.key, reg.state][sl] += 1
    return counts


@pytest.mark.parametrize(("model", "text"), CONFIGS)
def test_primaries_tile_every_tensor_exactly_once(model, text):
    layout = Layout(PRESETS[model], ParallelConfig.parse(text))
    for (key, state), c in _counts(layout, primary_only=True).items():
        assert c.min() == 1 and c.max() == 1, (key, state)


@pytest.mark.parametrize(("model", "text"), CONFIGS)
def test_replica_counts(model, text):
    """Without the distributed optimizer every DP rank holds its stage's state in full."""
    spec, cfg = PRESETS[model], ParallelConfig.parse(text)
    layout = Layout(spec, cfg)
    counts = _counts(layout, primary_only=False)
    for (key, state), c in counts.items():
        assert c.min() >= 1, (key, state)
        if state == PARAM or not cfg.dist_opt:
            expert = ".experts.experts." in key
            dp = cfg.expert_dp if expert else cfg.dp * cfg.cp
            # each element held by a multiple of the DP degree (TP-replicated tensors: x tp)
            assert np.all(c % dp == 0), (key, state)


@pytest.mark.parametrize(("model", "text"), [c for c in CONFIGS if "dist_opt" in c[1]])
def test_dist_opt_shards_are_contiguous_slices_of_each_param(model, text):
    layout = Layout(PRESETS[model], ParallelConfig.parse(text))
    for rank in range(layout.world_size):
        by_param: dict[str, list] = defaultdict(list)
        for reg in layout.regions(rank, ("exp_avg",)):
            by_param[reg.local_name].append(reg)
        for regs in by_param.values():
            # flat local offsets run 0, n1, n1+n2, ... with no gaps
            expect = 0
            for reg in sorted(regs, key=lambda r: r.local_offset):
                assert reg.local_offset == (expect,)
                expect += reg.numel
        for buf in layout.buffers(rank):
            for start, end in buf.buckets:
                assert (end - start) % buf.dp_size == 0
                assert start % 128 == 0
            for bp in buf.params:
                assert bp.start % 64 == 0


def test_swiglu_fc1_is_two_boxes_per_tp_rank():
    layout = Layout(PRESETS["tiny-llama"], ParallelConfig(tp=2))
    fc1 = [r for r in layout.regions(1, (PARAM,)) if r.local_name == "decoder.layers.0.mlp.linear_fc1.weight"]
    # ffn 128, tp 2: gate rows 64..127 of [0,128), up rows 128+64.. of [128, 256)
    assert [(r.global_offset, r.local_shape, r.local_offset) for r in fc1] == [
        ((0, 64, 0), (64, 64), (0, 0)), ((0, 192, 0), (64, 64), (64, 0))]


def test_tied_embedding_copy_on_last_stage_is_a_replica():
    layout = Layout(PRESETS["tiny-gpt"], ParallelConfig(pp=2))
    last = [r for r in layout.regions(1, (PARAM,)) if r.key == "embedding.word_embeddings.weight"]
    assert len(last) == 1 and last[0].local_name == "output_layer.weight" and not last[0].primary


def test_flat_range_to_boxes_covers_range_in_order():
    shape = (3, 4, 5)
    for start in range(0, 60, 7):
        for stop in range(start, 61, 11):
            flat = np.zeros(60, dtype=int)
            boxes = flat_range_to_boxes(shape, start, stop)
            pos = start
            for off, shp in boxes:
                idx = np.zeros(shape, dtype=int)
                idx[tuple(slice(o, o + s) for o, s in zip(off, shp))] = 1
                cells = np.flatnonzero(idx.ravel())
                assert list(cells) == list(range(pos, pos + volume(shp)))  # contiguous, in order
                pos += volume(shp)
                flat[cells] += 1
            assert pos == stop and flat.sum() == stop - start


def test_intersect():
    assert intersect((0, 0), (4, 4), (2, 3), (4, 4)) == ((2, 3), (2, 1))
    assert intersect((0, 0), (2, 2), (2, 0), (2, 2)) is None


def test_bytes_at_scale_add_up():
    """llama3-70b on 1024 ranks: per-rank bytes sum to the state, counting replicas once."""
    layout = Layout(PRESETS["llama3-70b"], ParallelConfig.parse("tp=8,pp=8,dp=16,dist_opt"))
    primary = 0
    for reg in layout.all_regions():
        if reg.primary:
            primary += reg.numel * layout.itemsize(reg.state)
    assert primary == layout.state_bytes()
    # 70.55B params: bf16 weights + fp32 main + two fp32 moments = 14 bytes/param (vocab padded)
    assert layout.state_bytes() == 14 * PRESETS["llama3-70b"].num_parameters(padded_vocab=True)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "liveshard.runtime.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_rows():
    out = _cli("layout", "--model", "tiny-moe", "--parallel", "tp=1,pp=2,dp=2,ep=2,dist_opt",
               "--state", "all", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    layout = Layout(PRESETS["tiny-moe"], ParallelConfig.parse("tp=1,pp=2,dp=2,ep=2,dist_opt"))
    assert rows == [r.as_row() for r in layout.all_regions()]
    assert set(rows[0]) == {"rank", "key", "state", "global_shape", "global_offset", "local_shape", "primary"}


@pytest.mark.parametrize("args", [
    ["--model", "tiny-llama", "--parallel", "tp=3"],
    ["--model", "tiny-llama", "--parallel", "tp=x"],
    ["--model", "nope", "--parallel", "tp=1"],
    ["--model", "deepseek-v2-lite", "--parallel", "tp=1"],
])
def test_cli_bad_input_is_one_line_exit_2(args, tmp_path):
    out = _cli("layout", *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("liveshard layout: error: ")


def test_cli_bad_model_file(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("num_layers: 2\nhidden_size: 30\nnum_attention_heads: 4\nvocab_size: 64\n"
                 "max_sequence_length: 16\nnum_query_groups: 3\n")
    out = _cli("layout", "--model", str(f), "--parallel", "tp=1")
    assert out.returncode == 2 and "num_query_groups" in out.stderr and "Traceback" not in out.stderr
