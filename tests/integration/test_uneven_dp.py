"""Uneven data parallelism trains like the even plan: the runtime's ``Trainer`` with
``dp_split`` against even runs of the same model, data and seed.

Each config runs a few optimizer steps of the real trainer (megatron's schedule, DDP, Adam) on
megatron's mock data in a pool of gloo ranks, then one validation pass. A replica with more
micro-batches weights each of them less, so every sample counts alike: the losses, the
validation loss and the final parameters equal the even run's up to float summation order.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from liveshard.runtime.parallel import ParallelConfig

if importlib.util.find_spec("megatron.core") is None:  # checked without importing it here
    pytest.skip("needs megatron-core (the runtime extra)", allow_module_level=True)
from liveshard.dev.procpool import GlooPool

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
STEPS = 3
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(4, preload=("liveshard.runtime.megatron.build", "liveshard.runtime.agent.trainer", __name__),
                 timeout_s=180)
    yield p
    p.close()


def _training_dict() -> dict:
    return {"data": {"mock": True}, "trainIters": STEPS, "globalBatch": GLOBAL_BATCH, "microBatch": 1,
            "seqLength": 32, "precision": "fp32", "optimizer": {"lr": 1e-3, "minLr": 1e-4, "weightDecay": 0.0},
            "schedule": {"warmupIters": 1, "decayIters": 100}, "eval": {"interval": 1, "iters": 2}}


def train_job(rank: int, world: int, cfg_text: str) -> dict[str, Any]:
    """The worker's build and trainer: ``STEPS`` steps, then one evaluation. Rank 0 also
    returns its parameters (every rank holds all of them without TP and PP)."""
    from liveshard.runtime.agent.trainer import Trainer, optimizer_options
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.data.datasets import build_datasets, load_job_tokenizer
    from liveshard.runtime.megatron.build import build_model, destroy
    from liveshard.runtime.presets import PRESETS

    spec, cfg = PRESETS[MODEL], ParallelConfig.parse(cfg_text)
    training = read_training(_training_dict())
    data = build_datasets(training, load_job_tokenizer(training, spec.vocab_size, spec.padded_vocab_size), None)
    built = build_model(spec, cfg, seed=training.seed, optimizer_options=optimizer_options(training),
                        hidden_dropout=0.0, attention_dropout=0.0)
    try:
        trainer = Trainer(built, training, data)
        losses, samples = [], []
        for _ in range(STEPS):
            losses.append(trainer.step())
            samples.append(list(trainer.batches.rank_samples(trainer.consumed_samples - GLOBAL_BATCH,
                                                             trainer.dp_rank)))
        valid = trainer.evaluate()
        params = None
        if rank == 0 and cfg.tp == cfg.pp == 1:
            params = {n: p.detach().clone() for n, p in built.model.named_parameters()}
        return {"losses": losses, "valid": valid, "params": params, "samples": samples,
                "consumed": trainer.consumed_samples, "last_stage": trainer.is_last_stage}
    finally:
        del built
        destroy()


def _run(pool: GlooPool, text: str) -> list[dict]:
    return pool.run(train_job, text, world=ParallelConfig.parse(text).world_size)


@pytest.fixture(scope="module")
def runs(pool: GlooPool) -> dict[str, list[dict]]:
    configs = ["dp=2", "dp=2,dp_split=3+1", "dp=3,dp_split=2+1+1", "pp=2,dp=2,dist_opt",
               "pp=2,dp=2,dp_split=1+3,dist_opt"]
    return {text: _run(pool, text) for text in configs}


def _reported(per_rank: list[dict]) -> dict:
    """What the last pipeline stage reports (every DP rank of it agrees)."""
    last = [r for r in per_rank if r["last_stage"]]
    assert all(r["losses"] == last[0]["losses"] and r["valid"] == last[0]["valid"] for r in last)
    return last[0]


def test_every_split_reads_the_global_batch_once_in_order(runs):
    for text, per_rank in runs.items():
        cfg = ParallelConfig.parse(text)
        stage0 = [r for rank, r in enumerate(per_rank) if cfg.coord(rank).pp == 0]
        for step in range(STEPS):
            seen = [i for r in stage0 for i in r["samples"][step]]  # stage 0 ranks in DP order
            assert seen == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)), text
        assert all(r["consumed"] == STEPS * GLOBAL_BATCH for r in per_rank)
    split = runs["dp=2,dp_split=3+1"]
    assert [len(s) for s in split[0]["samples"]] == [3] * STEPS
    assert [len(s) for s in split[1]["samples"]] == [1] * STEPS


# (uneven, its even reference): the same model initialisation (megatron's depends on the stages)
PAIRS = [("dp=2,dp_split=3+1", "dp=2"), ("dp=3,dp_split=2+1+1", "dp=2"),
         ("pp=2,dp=2,dp_split=1+3,dist_opt", "pp=2,dp=2,dist_opt")]


@pytest.mark.parametrize(("text", "reference"), PAIRS)
def test_an_uneven_split_trains_like_the_even_plan(runs, text, reference):
    even, uneven = _reported(runs[reference]), _reported(runs[text])
    assert all(isinstance(x, float) for x in uneven["losses"])
    assert uneven["losses"][0] > uneven["losses"][-1]  # it trains
    assert uneven["losses"] == pytest.approx(even["losses"], rel=1e-5, abs=0)
    assert uneven["valid"] == pytest.approx(even["valid"], rel=1e-5)
    if uneven["params"] is not None:
        assert uneven["params"].keys() == even["params"].keys()
        for name, p in even["params"].items():
            diff = float((uneven["params"][name] - p).abs().max())
            assert diff <= 1e-5, f"{text}: {name} differs from the even run's by {diff}"


def test_without_the_weight_an_uneven_split_trains_differently(pool: GlooPool, runs):
    """What the comparison above would catch: without the per-replica weight the short replica's
    sample counts three times as much as each of the long one's, and training parts ways."""
    even, unweighted = _reported(runs["dp=2"]), _reported(pool.run(unweighted_job, "dp=2,dp_split=3+1", world=2))
    assert unweighted["losses"][0] == pytest.approx(even["losses"][0], rel=1e-5)  # before any update
    assert unweighted["losses"][-1] != pytest.approx(even["losses"][-1], rel=1e-5)


def unweighted_job(rank: int, world: int, cfg_text: str) -> dict[str, Any]:
    """``train_job`` with the trainer's uneven-split weight switched off."""
    from liveshard.runtime.agent import trainer as trainer_module

    original = trainer_module.Trainer.__init__

    def unweighted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._loss_weight = None

    trainer_module.Trainer.__init__ = unweighted
    try:
        return train_job(rank, world, cfg_text)
    finally:
        trainer_module.Trainer.__init__ = original


@pytest.mark.long
def test_run_local_switches_to_an_uneven_split_and_back_live(tmp_path):
    """The split flows through the whole runtime: a plan that changes only ``dp_split`` is a live
    reconfiguration that moves no tensor, and the data cursor stays exact across it."""
    from liveshard.dev.localrun.driver import RunSpec, run_local
    from liveshard.dev.localrun.events import parse_events

    events = "2:parallel=tp=1,pp=1,dp=2,dp_split=3+1 4:parallel=tp=1,pp=1,dp=2"
    report = run_local(RunSpec.mock(MODEL, workers=2, parallel="tp=1,pp=1,dp=2", steps=5, global_batch=GLOBAL_BATCH,
                                    events=parse_events(events), workdir=str(tmp_path / "run")))
    assert [e["outcome"] for e in report["events"]] == ["committed", "committed"]
    assert report["events"][0]["config"] == "tp=1,pp=1,dp=2,ep=1,dp_split=3+1"
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["config"] for s in steps] == ["tp=1,pp=1,dp=2,ep=1"] * 2 + ["tp=1,pp=1,dp=2,ep=1,dp_split=3+1"] * 2 + [
        "tp=1,pp=1,dp=2,ep=1"]
    assert [s["consumed_samples"] for s in steps] == [GLOBAL_BATCH * k for k in range(1, 6)]
    assert [list(s["samples"]) for s in steps] == [list(range(GLOBAL_BATCH * k, GLOBAL_BATCH * (k + 1)))
                                                  for k in range(5)]
    losses = [s["loss"] for s in steps]
    assert all(isinstance(x, float) for x in losses) and losses[-1] < losses[0], losses
