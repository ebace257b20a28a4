"""The restart-based peer: the same megatron training under torchrun's elastic agent.

Run by ``bench_elastic_runtime.py`` and ``bench_goodput.py`` as ``torchrun --nnodes=MIN:MAX ...
torchrun_peer.py``: every (re)start builds the model for the world it gets (DP over all ranks),
loads the newest megatron ``dist_checkpointing`` checkpoint, trains, and saves a checkpoint every
``--save-every`` steps (default 1: the best case for a restart-based system, no step is lost) and
at each step of ``--save-at`` (a spot notice's planned save). Rank 0 appends one JSON line per
completed step to ``--step-log`` (its end time and the step's own duration), and one per finished
save to ``--save-log``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--step-log", required=True)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--save-at", default="", help="comma-separated steps to save at as well")
    p.add_argument("--save-log", default=None)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from mock_training import mock_training

    from liveshard.runtime.agent import checkpoint
    from liveshard.runtime.agent.trainer import Trainer, optimizer_options
    from liveshard.runtime.megatron.build import build_model
    from liveshard.runtime.parallel import ParallelConfig
    from liveshard.runtime.spec import load_model

    spec = load_model(args.model)
    cfg = ParallelConfig(dp=dist.get_world_size())
    training, data = mock_training(spec, steps=args.steps, global_batch=args.global_batch,
                                   seq_length=args.seq_length)
    ckpts = sorted(p for p in Path(args.ckpt).glob("step*") if (p / "liveshard.json").exists())
    built = build_model(spec, cfg, seed=training.seed, optimizer_options=optimizer_options(training),
                        hidden_dropout=0.0, attention_dropout=0.0, perform_initialization=not ckpts)
    trainer = Trainer(built, training, data)
    if ckpts:
        checkpoint.load(built, trainer, ckpts[-1])
    rank = dist.get_rank()
    save_at = {int(x) for x in args.save_at.split(",") if x}
    while trainer.step_count < args.steps:
        loss = trainer.step()
        if rank == 0:
            with open(args.step_log, "a") as f:
                f.write(json.dumps({"step": trainer.step_count, "time": time.time(), "loss": loss,
                                    "seconds": trainer.last_step_seconds, "world": dist.get_world_size(),
                                    "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}) + "\n")
        if trainer.step_count % args.save_every == 0 or trainer.step_count in save_at:
            t0 = time.time()
            checkpoint.save(built, trainer, Path(args.ckpt) / f"step{trainer.step_count:06d}")
            if rank == 0 and args.save_log:
                with open(args.save_log, "a") as f:
                    f.write(json.dumps({"step": trainer.step_count, "start": t0, "time": time.time()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
