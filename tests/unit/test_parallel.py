"""Parallel configs: string form, megatron's rank order, validation messages."""

from __future__ import annotations

import pytest

from liveshard.runtime.errors import ConfigError
from liveshard.runtime.parallel import ParallelConfig
from liveshard.runtime.presets import COUNTED_ONLY, PRESETS


def test_round_trip_string_form():
    text = "tp=8,pp=4,dp=8,ep=1,layers=20+20+21+19,dist_opt"
    cfg = ParallelConfig.parse(text)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.layers, cfg.dist_opt) == (8, 4, 8, (20, 20, 21, 19), True)
    assert str(cfg) == text
    assert ParallelConfig.parse(str(cfg)) == cfg
    assert ParallelConfig.parse("tp=2,pp=2", world_size=16).dp == 4


def test_rank_order_matches_megatron_rank_generator():
    # FINDINGS.md: 4 ranks, TP=2 PP=2 -> TP groups [0,1],[2,3]; PP groups [0,2],[1,3].
    cfg = ParallelConfig(tp=2, pp=2)
    assert [(c.tp, c.pp) for c in map(cfg.coord, range(4))] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    cfg = ParallelConfig(tp=2, cp=2, dp=2, pp=2)
    # order tp-cp-ep-dp-pp: tp fastest, then cp, then dp, then pp
    assert cfg.coord(5) == cfg.coord(cfg.rank_of(tp=1, cp=0, dp=1, pp=0))
    assert all(cfg.rank_of(c.tp, c.cp, c.dp, c.pp) == r for r, c in enumerate(map(cfg.coord, range(16))))


def test_expert_grid():
    cfg = ParallelConfig(tp=2, dp=4, ep=4, etp=1)  # 8 ranks per stage: etp*ep=4 -> edp=2
    assert cfg.expert_dp == 2
    coords = [cfg.coord(r) for r in range(8)]
    assert [c.ep for c in coords] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [c.edp for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(("model", "text", "field", "words"), [
    ("llama3-8b", "tp=3", "tp", "attention heads"),
    ("llama3-70b", "tp=16", "tp", "query groups"),
    ("llama3-8b", "pp=3", "pp", "layers=10+11+11"),
    ("llama3-8b", "pp=2,layers=10+20", "layers", "add up to 30"),
    ("qwen3-30b-a3b", "ep=3,dp=3", "ep", "128 experts"),
    ("llama3-8b", "ep=2,dp=2", "ep", "dense model"),
    ("deepseek-v2-lite", "tp=1", "multi_latent_attention", "multi-latent"),
])
def test_validation_names_rule_and_fix(model, text, field, words):
    cfg = ParallelConfig.parse(text)
    with pytest.raises(ConfigError) as e:
        cfg.validate({**PRESETS, **COUNTED_ONLY}[model])
    assert e.value.field == field
    assert e.value.fix
    if words:
        assert words in str(e.value)


def test_vocab_padding_rule():
    spec = PRESETS["tiny-gpt"]  # vocab 250, padded to a multiple of 128 -> 256
    ParallelConfig(tp=4).validate(spec)
    odd = spec.__class__(**{**spec.to_dict(), "make_vocab_size_divisible_by": 2})  # padded: 250
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by") as e:
        ParallelConfig(tp=4).validate(odd)
    assert e.value.field == "tp"


@pytest.mark.parametrize(("text", "field"), [
    ("tp=two", "parallel.tp"), ("foo=1", "parallel.foo"), ("layers=1+x", "parallel.layers"),
    ("tp=0", "tp"), ("pp=2,layers=4", "layers"), ("order=pp-dp-tp", "parallel.order"), ("", "parallel"),
])
def test_parse_errors(text, field):
    with pytest.raises(ConfigError) as e:
        ParallelConfig.parse(text)
    assert e.value.field == field


def test_world_size_mismatch():
    with pytest.raises(ConfigError, match="world has 6"):
        ParallelConfig.parse("tp=2,dp=2", world_size=6)
