"""The demo's sample job: tiny GPT on CPU workers, pure data parallelism, quick elasticity."""

from __future__ import annotations

from typing import Any

from liveshard.runtime.contract.crd import API_VERSION, KIND


def sample_job(name: str = "tiny-gpt", namespace: str = "default", replicas: int = 3, min_workers: int = 1,
               global_batch: int = 240, micro_batch: int = 4, model: str = "tiny-gpt", cooldown_seconds: int = 5,
               extra_args: tuple[str, ...] = (), gpus_per_worker: int = 1) -> dict[str, Any]:
    """CPU processes for GPUs: a worker pod runs one training process per "GPU" it requests
    (``gpusPerWorker``; the node agent's fake nodes advertise ``nvidia.com/gpu``).

    ``tp``/``pp`` are pinned to 1 (CPU processes share two cores; the story is the world changing
    size). The planner's cost model is for GPUs: with a small global batch it gives a tiny model
    one GPU however many are offered. ``globalBatch`` 240 is large enough that it uses every
    worker, and with ``microBatch`` 4 it divides by every DP degree from 1 to 4, so every plan
    keeps it fixed. The worker's flags repeat the batch settings (the runtime takes them from
    its command line).
    """
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"preset": model},
            "image": "liveshard/worker:local",  # not pulled: the node agent runs the command locally
            "command": ["liveshard", "worker"],
            "args": ["--global-batch", str(global_batch), "--micro-batch", str(micro_batch), "--seq-length", "32",
                     "--collective-timeout", "10", *extra_args],
            "workers": {"min": min_workers, "max": replicas, "replicas": replicas, "gpusPerWorker": gpus_per_worker,
                        "gpuMemory": "80Gi"},
            "parallelism": {"tp": [1], "pp": [1], "globalBatch": global_batch, "microBatch": micro_batch,
                            "seqLength": 32,
                            "distributedOptimizer": False},
            "elasticity": {"scaleUpCooldownSeconds": cooldown_seconds, "reconfigurationTimeoutSeconds": 120},
        },
    }
