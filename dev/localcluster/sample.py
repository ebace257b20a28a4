"""The demo's sample job: tiny GPT on CPU workers, pure data parallelism, quick elasticity."""

from __future__ import annotations

from typing import Any

from liveshard.runtime.contract.crd import API_VERSION, KIND


def sample_job(name: str = "tiny-gpt", namespace: str = "default", replicas: int = 3, min_workers: int = 1,
               global_batch: int = 240, micro_batch: int = 4, model: str = "tiny-gpt", cooldown_seconds: int = 5,
               extra_args: tuple[str, ...] = (), gpus_per_worker: int = 1, train_iters: int = 100_000,
               corpus: Any = None, checkpoint_dir: str | None = None) -> dict[str, Any]:
    """CPU processes for GPUs: a worker pod runs one training process per "GPU" it requests
    (``gpusPerWorker``; the node agent's fake nodes advertise ``nvidia.com/gpu``).

    ``tp``/``pp`` are pinned to 1 (CPU processes share two cores; the story is the world changing
    size). The planner's cost model is for GPUs: with a small global batch it gives a tiny model
    one GPU however many are offered. ``globalBatch`` 240 is large enough that it uses every
    worker, and with ``microBatch`` 4 it divides by every DP degree from 1 to 4, so every plan
    keeps it fixed.

    ``corpus``: a ``liveshard.runtime.data.corpus.CorpusPaths`` to train on (real text and its
    BPE tokenizer; the model's vocabulary is the tokenizer's); None: megatron's mock data.
    """
    if corpus is not None:
        data: dict[str, Any] = {"blend": [{"prefix": corpus.data_prefix}], "split": "949,50,1"}
        tokenizer: dict[str, Any] | None = {"type": "huggingface", "path": corpus.tokenizer_dir}
        model_spec: dict[str, Any] = {"preset": model, "vocab_size": corpus.vocab_size}
    else:
        data, tokenizer, model_spec = {"mock": True}, None, {"preset": model}
    training: dict[str, Any] = {
        "data": data, "trainIters": train_iters, "globalBatch": global_batch, "microBatch": micro_batch,
        "seqLength": 32, "precision": "fp32",
        "optimizer": {"lr": 3e-3, "minLr": 3e-4, "weightDecay": 0.0},
        "schedule": {"warmupIters": 3, "decayStyle": "cosine", "decayIters": max(train_iters, 10)},
        "logging": {"interval": 5},
    }
    if tokenizer:
        training["tokenizer"] = tokenizer
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": model_spec,
            "image": "liveshard/worker:local",  # not pulled: the node agent runs the command locally
            "command": ["liveshard", "worker"],
            "args": ["--collective-timeout", "10", *extra_args],
            "workers": {"min": min_workers, "max": replicas, "replicas": replicas, "gpusPerWorker": gpus_per_worker,
                        "gpuMemory": "80Gi"},
            "parallelism": {"tp": [1], "pp": [1], "distributedOptimizer": False},
            "training": training,
            # the node agent runs pods as local processes: each job gets a directory of its own
            **({"checkpoint": {"path": checkpoint_dir}} if checkpoint_dir else {}),
            "elasticity": {"scaleUpCooldownSeconds": cooldown_seconds, "reconfigurationTimeoutSeconds": 120},
        },
    }
