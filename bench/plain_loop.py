"""The steady-state baseline: a plain megatron training loop with no liveshard agent around it.

Spawns ``--procs`` gloo processes that build the same model and run ``--steps`` steps of the same
``Trainer``; rank 0 prints one JSON line per step with its wall-clock end time.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # As the liveshard worker does after its imports: keep the long-lived import-time objects out
    # of the garbage collector's full passes (what Megatron-LM's --manual-gc is for).
    import gc

    import megatron.core.distributed
    import megatron.core.models.gpt  # noqa: F401

    gc.collect()
    gc.freeze()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from mock_training import mock_training

    from liveshard.runtime.agent.trainer import Trainer, optimizer_options
    from liveshard.runtime.megatron.build import build_model
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import load_model

    spec = load_model(args.model)
    training, data = mock_training(spec, steps=args.steps, global_batch=args.global_batch, seq_length=args.seq_length)
    built = build_model(spec, ParallelConfig.parse(args.parallel), seed=training.seed,
                        optimizer_options=optimizer_options(training), hidden_dropout=0.0, attention_dropout=0.0)
    trainer = Trainer(built, training, data)
    for _ in range(args.steps):
        trainer.step()
        if rank == 0:
            print(json.dumps({"step": trainer.step_count, "time": time.time()}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--parallel", default="tp=1,pp=1,dp=2")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from liveshard.dev.ports import free_port

    mp.spawn(_worker, args=(args.procs, free_port(), args), nprocs=args.procs)


if __name__ == "__main__":
    main()
