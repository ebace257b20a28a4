"""The training spec and datasets the benchmark loops train with: megatron's mock data, the short
schedule of the tests (the liveshard runs they are compared with use the same, ``RunSpec.mock``)."""

from __future__ import annotations

from typing import Any


def mock_training(spec: Any, *, steps: int, global_batch: int, seq_length: int) -> tuple[Any, Any]:
    """``(TrainingSpec, JobData)`` for ``steps`` steps of ``global_batch`` mock sequences."""
    from liveshard.runtime.contract.training import read_training
    from liveshard.runtime.data.datasets import MockTokenizer, build_datasets

    lr = 1e-3
    training = read_training({
        "data": {"mock": True}, "trainIters": steps, "globalBatch": global_batch, "seqLength": seq_length,
        "precision": spec.params_dtype, "optimizer": {"lr": lr, "minLr": lr / 10, "weightDecay": 0.0},
        "schedule": {"warmupIters": 2, "decayIters": 1000}})
    return training, build_datasets(training, MockTokenizer(spec.vocab_size), None)
